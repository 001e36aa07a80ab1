"""Pictures of what the latent readers look at: each query's attention over an image."""
from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files only; never open a window
import matplotlib.pyplot as plt
import numpy as np


def plot_query_attention(image: np.ndarray, attention: np.ndarray, path: str, *, title: str = "",
                         columns: int = 8) -> None:
  """Writes a PNG: the image [H, W] on the left, each query's attention map [N, h, w] as a grid on the right.

  Each map has its own colour scale (a query's weights sum to one over the h*w inputs; what matters is
  where they sit). The attention grid (h, w) is the reader's input grid, which may be coarser than the
  image when the inputs are patches.
  """
  num_queries = attention.shape[0]
  columns = min(columns, num_queries)
  rows = math.ceil(num_queries / columns)
  figure = plt.figure(figsize=(2.2 + 1.1 * columns, max(2.4, 1.1 * rows)), dpi=100)
  grid = figure.add_gridspec(rows, columns + 2, width_ratios=[2.0, 0.2] + [1.0] * columns)
  axis = figure.add_subplot(grid[:, 0])
  axis.imshow(image, cmap="gray_r")
  axis.set_title(title or "image", fontsize=8)
  axis.axis("off")
  for q in range(num_queries):
    axis = figure.add_subplot(grid[q // columns, 2 + q % columns])
    axis.imshow(attention[q], cmap="viridis")
    axis.set_title(f"q{q}", fontsize=6, pad=1)
    axis.axis("off")
  figure.savefig(path, bbox_inches="tight")
  plt.close(figure)
