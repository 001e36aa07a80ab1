"""Cross-attention PNGs: which characters are drawn or escaped, and a layout that fits long labels."""
import warnings

import numpy as np
import pytest
from matplotlib import font_manager

from xattn_jax.tasks import figure_text
from xattn_jax.tasks.translate import plots as translate_plots

ARABIC = "▁الاثنين"  # a SentencePiece piece of "Monday"
SOURCE = ["▁Monday", ",", "▁January", "▁15,", "▁1900"]
TARGET = [ARABIC, "،", "▁15", "▁يناير", "▁1900", "</s>"]


def _fonts():
  return figure_text.installed_fonts()[1]


def _covered(character, fonts) -> bool:
  return any(font.get_char_index(ord(character)) for font in fonts)


def _plot_without_warnings(source, target, path, *, per_head=False):
  """plot_cross_attention of random weights; any warning (e.g. matplotlib's "Glyph ... missing
  from font") fails the test."""
  weights = np.random.default_rng(0).dirichlet(np.ones(len(source)), size=(2, 4, len(target)))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    return translate_plots.plot_cross_attention(weights, source, target, path, per_head=per_head)


def _labels(ax):
  return [label.get_text() for label in ax.get_xticklabels() + ax.get_yticklabels()]


def test_glyph_check_reads_the_font_files_matplotlib_draws_labels_with(tmp_path):
  figure = _plot_without_warnings(SOURCE, TARGET, tmp_path / "map.png")
  checked = {font.fname for font in _fonts()}
  for label in figure.axes[0].get_yticklabels():
    for family in label.get_fontproperties().get_family():
      drawn_from = font_manager.findfont(font_manager.FontProperties(family=family), fallback_to_default=False)
      assert drawn_from in checked
  translate_plots.close(figure)


def test_arabic_pieces_are_drawn_unescaped_when_a_font_matplotlib_uses_has_their_glyphs(tmp_path):
  # matplotlib's bundled DejaVuSans.ttf has Arabic (a system DejaVuSansCondensed-Oblique.ttf does not).
  default = font_manager.get_font(font_manager.findfont("DejaVu Sans"))
  if not all(_covered(c, [default]) for c in ARABIC):
    pytest.skip("matplotlib's DejaVu Sans has no Arabic here")
  assert figure_text.drawable(ARABIC, _fonts()) == ARABIC
  figure = _plot_without_warnings(SOURCE, TARGET, tmp_path / "map.png")
  labels = _labels(figure.axes[0])
  translate_plots.close(figure)
  assert ARABIC in labels and "▁يناير" in labels
  assert not any("\\u" in label for label in labels)


def test_characters_no_font_has_are_still_escaped_without_warnings(tmp_path):
  fonts = _fonts()
  missing = [c for c in "กขคनमस日本🙂" if not _covered(c, fonts)]
  if not missing:
    pytest.skip("every candidate character has a font here")
  figure = _plot_without_warnings(["a", *missing], ["b", "c"], tmp_path / "map.png")
  labels = _labels(figure.axes[0])
  translate_plots.close(figure)
  assert labels[1:len(missing) + 1] == [f"\\u{ord(c):04x}" for c in missing]


def test_long_labels_end_in_an_ellipsis_after_whole_characters():
  fonts = _fonts()
  limit = translate_plots._MAX_LABEL_CHARACTERS
  for piece in ["▁" + "x" * 100, "▁" + "ก" * 30, "ก" * 30 + "x" * 100]:
    label = translate_plots._label(piece, fonts)
    kept = label.rstrip(".…")
    assert len(label) <= limit and label != kept
    assert any(figure_text.drawable(piece[:k], fonts) == kept for k in range(len(piece)))
  assert translate_plots._label("▁January", fonts) == "▁January"


@pytest.mark.parametrize("per_head", [False, True])
def test_heatmaps_keep_a_minimum_size_and_fit_in_the_figure_with_their_long_labels(tmp_path, per_head):
  long_labels = ["▁" + "x" * 60, "▁ภาษาไทยยาวมาก", "▁" + "न" * 12, "▁الاثنين" * 3, "▁1900"]
  path = tmp_path / "map.png"
  figure = _plot_without_warnings(long_labels, list(reversed(long_labels)) + ["</s>"], path, per_head=per_head)
  figure.canvas.draw()
  renderer, whole = figure.canvas.get_renderer(), figure.bbox
  minimum = translate_plots._MIN_HEATMAP_INCHES * figure.dpi - 1  # pixels
  assert len(figure.axes) == (8 if per_head else 2)
  for ax in figure.axes:
    heatmap = ax.get_window_extent(renderer)
    assert heatmap.width >= minimum and heatmap.height >= minimum
    title = ax.title.get_window_extent(renderer)
    assert whole.x0 <= title.x0 and title.x1 <= whole.x1 and whole.y0 <= title.y0 and title.y1 <= whole.y1
    labels = ax.get_tightbbox(renderer)  # heatmap, tick labels, axis labels and title
    assert whole.x0 <= labels.x0 and labels.x1 <= whole.x1 and whole.y0 <= labels.y0 and labels.y1 <= whole.y1
  assert path.stat().st_size > 0
  translate_plots.close(figure)


def test_panels_do_not_overlap(tmp_path):
  figure = _plot_without_warnings(SOURCE, TARGET, tmp_path / "map.png", per_head=True)
  figure.canvas.draw()
  renderer = figure.canvas.get_renderer()
  boxes = [ax.get_tightbbox(renderer) for ax in figure.axes]
  translate_plots.close(figure)
  for i, a in enumerate(boxes):
    for b in boxes[i + 1:]:
      assert a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0


def test_pieces_holding_dollar_signs_are_drawn_as_text_not_mathtext(tmp_path):
  """A corpus with LaTeX or prices: a piece '$^$' raised matplotlib's mathtext ParseSyntaxException at savefig
  (ending the training run at its eval), and '$x$' was drawn as math."""
  figure = _plot_without_warnings(["▁$^$", "▁$x$"], ["▁$5", "</s>"], tmp_path / "map.png")
  labels = [label for label in figure.axes[0].get_xticklabels() + figure.axes[0].get_yticklabels()]
  translate_plots.close(figure)
  assert (tmp_path / "map.png").exists()
  assert [label.get_text() for label in labels] == ["▁$^$", "▁$x$", "▁$5", "</s>"]
  assert not any(label.get_parse_math() for label in labels)
