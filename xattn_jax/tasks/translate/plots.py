"""Cross-attention maps of the translator as PNG files (matplotlib, no display needed)."""
from __future__ import annotations

import os

import numpy as np

from xattn_jax.tasks.figure_text import drawable, installed_fonts

_LABEL_POINTS = 7  # tick and axis labels
_TITLE_POINTS = 8
_CELL_INCHES = 0.28  # one source or target piece
_MIN_HEATMAP_INCHES = 1.6  # a heatmap of few pieces stays readable however long its labels
_MAX_LABEL_CHARACTERS = 40  # longer tick labels (escaped ones grow 6x) end in an ellipsis
_PAD_INCHES = 0.12  # around each panel's labels and title


def _label(piece: str, fonts, limit: int = _MAX_LABEL_CHARACTERS) -> str:
  """The tick label of piece: drawable, and when longer than limit characters cut after a whole
  character (never inside an escape) and ended with an ellipsis."""
  characters = [drawable(c, fonts) for c in piece]
  if sum(map(len, characters)) <= limit:
    return "".join(characters)
  ellipsis = "…" if drawable("…", fonts) == "…" else "..."
  label = ""
  for drawn in characters:
    if len(label) + len(drawn) + len(ellipsis) > limit:
      break
    label += drawn
  return label + ellipsis


def _place_panels(figure, axes, width: float, height: float) -> None:
  """Sizes figure and places the panels of axes [rows, columns] so that every heatmap is
  width x height inches and its tick labels, axis labels and title fit around it."""
  rows, columns = axes.shape

  def place(left, bottom, right, top):
    panel_width, panel_height = left + width + right, bottom + height + top
    figure.set_size_inches(columns * panel_width, rows * panel_height)
    for (row, column), ax in np.ndenumerate(axes):
      x0, y0 = column * panel_width + left, (rows - 1 - row) * panel_height + bottom
      ax.set_position([x0 / (columns * panel_width), y0 / (rows * panel_height),
                       width / (columns * panel_width), height / (rows * panel_height)])

  place(0.0, 0.0, 0.0, 0.0)  # heatmaps at their final size: a title's overhang depends on it
  renderer = figure.canvas.get_renderer()
  margins = np.zeros(4)  # -> [left, bottom, right, top] in pixels, largest over the panels
  for ax in axes.flat:
    heatmap, whole = ax.get_window_extent(renderer), ax.get_tightbbox(renderer)
    margins = np.maximum(margins, [heatmap.x0 - whole.x0, heatmap.y0 - whole.y0,
                                   whole.x1 - heatmap.x1, whole.y1 - heatmap.y1])
  place(*(margins / figure.dpi + _PAD_INCHES))


def plot_cross_attention(weights, source_pieces, target_pieces, path, *, per_head: bool = False):
  """Writes target-by-source cross-attention maps of one sentence to path (a PNG).

  weights [layers, heads, t, s] (rows: target tokens, columns: source tokens); one panel per layer
  with the heads averaged, or with per_head a grid of layers x heads. The figure grows with the
  labels so that heatmaps keep at least _MIN_HEATMAP_INCHES a side; labels longer than
  _MAX_LABEL_CHARACTERS end in an ellipsis. Returns the figure (the caller closes it with close).
  """
  weights = np.asarray(weights, np.float32)
  if weights.ndim != 4 or weights.shape[2:] != (len(target_pieces), len(source_pieces)):
    raise ValueError(f"plot_cross_attention: weights must be [layers, heads, {len(target_pieces)}, "
                     f"{len(source_pieces)}] (target by source pieces), got weights{list(weights.shape)}")
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  font_names, fonts = installed_fonts()
  source_labels = [_label(piece, fonts) for piece in source_pieces]
  target_labels = [_label(piece, fonts) for piece in target_pieces]
  layers, heads = weights.shape[:2]
  panels = weights if per_head else weights.mean(axis=1, keepdims=True)  # -> [layers, columns, t, s]
  rows, columns = panels.shape[:2]
  figure, axes = plt.subplots(rows, columns, squeeze=False)
  for layer in range(rows):
    for column in range(columns):
      ax = axes[layer, column]
      ax.imshow(panels[layer, column], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
      # parse_math=False: a piece is text, never mathtext ('$x$' drawn as math, '$^$' raising at savefig)
      ax.set_xticks(range(len(source_labels)), source_labels, rotation=90, fontsize=_LABEL_POINTS,
                    fontfamily=font_names, parse_math=False)
      ax.set_yticks(range(len(target_labels)), target_labels, fontsize=_LABEL_POINTS, fontfamily=font_names,
                    parse_math=False)
      ax.set_title(f"layer {layer}" + (f", head {column}" if per_head else f" ({heads} heads averaged)"),
                   fontsize=_TITLE_POINTS)
      ax.set_xlabel("source", fontsize=_LABEL_POINTS)
      ax.set_ylabel("target", fontsize=_LABEL_POINTS)
  _place_panels(figure, axes, max(_MIN_HEATMAP_INCHES, _CELL_INCHES * len(source_labels)),
                max(_MIN_HEATMAP_INCHES, _CELL_INCHES * len(target_labels)))
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  figure.savefig(path, dpi=110)
  return figure


def close(figure) -> None:
  """Frees a figure returned by plot_cross_attention."""
  from matplotlib import pyplot as plt
  plt.close(figure)
