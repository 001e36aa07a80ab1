"""Pictures of promptable segmentation: the image with its prompt, each predicted mask, the target."""
from __future__ import annotations

import numpy as np

from xattn_jax.data import segment_digits
from xattn_jax.tasks.figure_text import drawable_text


def plot_prediction(image: np.ndarray, points: np.ndarray, point_labels: np.ndarray, masks: np.ndarray,
                    predicted_iou: np.ndarray, path: str, *, target: np.ndarray | None = None,
                    title: str = "") -> None:
  """Writes a PNG: image [H, W] with the prompt (points [P, 2] in [0, 1] (row, col), point_labels [P]:
  green + positive, red x negative, a yellow rectangle for a box), then each mask [K, H, W] (bool) with
  its predicted IoU (the chosen one, the highest, starred), then the target [H, W] when given."""
  import matplotlib
  matplotlib.use("Agg")  # files only; never open a window
  import matplotlib.pyplot as plt
  height, width = image.shape
  panels = 1 + len(masks) + (target is not None)
  figure, axes = plt.subplots(1, panels, figsize=(1.9 * panels, 2.2), dpi=100)
  axes[0].imshow(image, cmap="gray", vmin=0.0, vmax=1.0)
  pixels = points * np.array([height, width]) - 0.5  # (row, col) of each point in pixel-centre units
  for (row, col), label in zip(pixels, point_labels):
    if label == segment_digits.POSITIVE:
      axes[0].plot(col, row, "+", color="lime", markersize=10, markeredgewidth=2)
    elif label == segment_digits.NEGATIVE:
      axes[0].plot(col, row, "x", color="red", markersize=8, markeredgewidth=2)
  corners = {label: pixels[k] for k, label in enumerate(point_labels)
             if label in (segment_digits.BOX_TOP_LEFT, segment_digits.BOX_BOTTOM_RIGHT)}
  if len(corners) == 2:
    (top, left), (bottom, right) = corners[segment_digits.BOX_TOP_LEFT], corners[segment_digits.BOX_BOTTOM_RIGHT]
    axes[0].add_patch(plt.Rectangle((left, top), right - left, bottom - top, fill=False, color="yellow"))
  # infer's title is the input line's image path: one in a script no installed font draws (a Chinese file name
  # without a CJK font) reads as \uXXXX, not as empty boxes with a matplotlib warning per character.
  text, fonts = drawable_text(title or "prompt")
  axes[0].set_title(text, fontsize=8, fontfamily=fonts, parse_math=False)  # a '$' in a file name is text
  best = int(np.argmax(predicted_iou))
  for k, mask in enumerate(masks):
    axes[1 + k].imshow(image, cmap="gray", vmin=0.0, vmax=1.0)
    axes[1 + k].imshow(np.ma.masked_where(~mask, mask), cmap="autumn", alpha=0.6, vmin=0, vmax=1)
    axes[1 + k].set_title(f"mask {k}{' *' if k == best else ''}: IoU~{predicted_iou[k]:.2f}", fontsize=8)
  if target is not None:
    axes[-1].imshow(target, cmap="gray", vmin=0, vmax=1)
    axes[-1].set_title("target", fontsize=8)
  for axis in axes:
    axis.set_xticks([])
    axis.set_yticks([])
  figure.tight_layout()
  figure.savefig(path)
  plt.close(figure)
