"""Cross-attention maps of the translator as PNG files (matplotlib, no display needed)."""
from __future__ import annotations

import functools
import os

import numpy as np

# Tried in order for each character (matplotlib font fallback); the CJK ones only where installed.
_FONTS = ("DejaVu Sans", "Noto Sans CJK JP", "Noto Sans CJK SC", "Noto Sans", "IPAexGothic", "IPAGothic",
          "Source Han Sans", "WenQuanYi Zen Hei", "Arial Unicode MS")


@functools.cache
def _installed_fonts():
  """(names, FT2Font objects) of the _FONTS matplotlib can find on this machine."""
  from matplotlib import font_manager, ft2font
  installed = {font.name: font.fname for font in font_manager.fontManager.ttflist}
  names = [name for name in _FONTS if name in installed]
  return names, [ft2font.FT2Font(installed[name]) for name in names]


def _drawable(piece: str, fonts) -> str:
  """piece with every character no installed font can draw written as \\uXXXX (e.g. Japanese
  without a CJK font): a readable label instead of empty boxes and a warning per glyph."""
  return "".join(c if c.isspace() or any(font.get_char_index(ord(c)) for font in fonts) else f"\\u{ord(c):04x}"
                 for c in piece)


def plot_cross_attention(weights, source_pieces, target_pieces, path, *, per_head: bool = False):
  """Writes target-by-source cross-attention maps of one sentence to path (a PNG).

  weights [layers, heads, t, s] (rows: target tokens, columns: source tokens); one panel per layer
  with the heads averaged, or with per_head a grid of layers x heads. Returns the figure (the
  caller closes it with matplotlib.pyplot.close).
  """
  weights = np.asarray(weights, np.float32)
  if weights.ndim != 4 or weights.shape[2:] != (len(target_pieces), len(source_pieces)):
    raise ValueError(f"plot_cross_attention: weights must be [layers, heads, {len(target_pieces)}, "
                     f"{len(source_pieces)}] (target by source pieces), got weights{list(weights.shape)}")
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  font_names, fonts = _installed_fonts()
  source_pieces = [_drawable(piece, fonts) for piece in source_pieces]
  target_pieces = [_drawable(piece, fonts) for piece in target_pieces]
  layers, heads = weights.shape[:2]
  panels = weights if per_head else weights.mean(axis=1, keepdims=True)  # -> [layers, columns, t, s]
  rows, columns = panels.shape[:2]
  cell = 0.28
  size = (max(3.0, cell * len(source_pieces) + 1.5) * columns, max(2.5, cell * len(target_pieces) + 1.5) * rows)
  figure, axes = plt.subplots(rows, columns, figsize=size, squeeze=False)
  for layer in range(rows):
    for column in range(columns):
      ax = axes[layer, column]
      ax.imshow(panels[layer, column], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
      ax.set_xticks(range(len(source_pieces)), source_pieces, rotation=90, fontsize=7, fontfamily=font_names)
      ax.set_yticks(range(len(target_pieces)), target_pieces, fontsize=7, fontfamily=font_names)
      ax.set_title(f"layer {layer}" + (f", head {column}" if per_head else f" ({heads} heads averaged)"),
                   fontsize=8)
      ax.set_xlabel("source", fontsize=7)
      ax.set_ylabel("target", fontsize=7)
  figure.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  figure.savefig(path, dpi=110)
  return figure


def close(figure) -> None:
  """Frees a figure returned by plot_cross_attention."""
  from matplotlib import pyplot as plt
  plt.close(figure)
