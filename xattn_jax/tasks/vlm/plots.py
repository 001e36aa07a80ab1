"""Where a trained VLM's connector looks: attention maps over the image, next to the generated text (PNG).

What is drawn follows the connector's `attention_maps` (models/connectors.py):
  "queries" (qformer): each learned query's cross-attention over the image's patches (the last Q-Former block
    that cross-attends, mean over heads): what each of the N soft tokens summarises.
  "text" (flamingo): each generated token's gated cross-attention over the image it reads (mean over the gated
    layers and heads), at the position whose output produced the token: what the LM looked at to write it.

`attention_figure(task, model, examples, path)` draws one row group per example: the image with its prompt
and the generated answer, then the maps on the image's patch grid (the class token's share in each
title; one colour scale per example, so a diffuse map looks faint). The maps are of the text the model generated itself (decoded as configured, tokenized again), fed back whole.
"""
from __future__ import annotations

import numpy as np
from flax import nnx

from xattn_jax.data import vlm_digits
from xattn_jax.models import connectors, lm as lm_lib
from xattn_jax.tasks.figure_text import drawable_text
from xattn_jax.tasks.vlm.task import MAX_IMAGES

MAX_COLUMNS = 8  # maps per row of panels
MAX_TOKENS = 16  # flamingo: maps of at most this many generated tokens per example


def _request(task, example):
  """(images, prompt ids, end id) of the example's first target, as the task's evaluation asks it."""
  layout = task.layout(example)
  prefix, stop, _ = layout.targets[0]
  return example.images, layout.ids[:prefix].tolist(), stop


def _prompt_text(task, ids) -> str:
  return task.tokenizer.decode([t for t in ids if t >= 0 and t != task.marker and t != task.tokenizer.bos_id])


@nnx.jit
def _maps(model, images, pixel_valid, image_valid, tokens, valid):
  return model.attention_maps(images, pixel_valid, image_valid, tokens, valid)


def example_maps(task, model, example):
  """The maps of one example -> (image [h, w], prompt text, generated text, [(title, map [gh, gw])]).

  The maps are on the first image's real patch grid (gh, gw) = its size / the encoder's patch size.
  """
  images, prompt, stop = _request(task, example)
  answer = task.generate(model, [(images, prompt, stop)])[0]
  answer_ids = task.tokenizer.encode(answer) if answer else []
  ids = prompt + answer_ids
  tokens, valid = lm_lib.left_pad([ids], len(ids))
  batch = vlm_digits.collate_images([images], canvas=task.canvas, max_images=MAX_IMAGES)
  maps = np.asarray(_maps(model, batch["images"], batch["pixel_valid"], batch["image_valid"], np.asarray(tokens),
                          np.asarray(valid)))
  patch = task.patch_size
  canvas_grid = (task.canvas[0] // patch, task.canvas[1] // patch)
  image = images[0]
  grid = (-(-image.shape[0] // patch), -(-image.shape[1] // patch))

  def on_grid(weights):  # [1 + canvas patches] -> (class token share, [gh, gw] of the image's patches)
    return float(weights[0]), weights[1:].reshape(canvas_grid)[:grid[0], :grid[1]]

  panels = []
  if connectors.CONNECTORS[task.config.model.connector].attention_maps == "queries":
    weights = maps[0, 0, -1].mean(axis=0)  # [N, 1 + P]: image 0, the last cross-attending block, mean over heads
    for query, row in enumerate(weights):
      share, grid_map = on_grid(row)
      panels.append((f"query {query} (cls {share:.0%})", grid_map))
  else:
    rows = maps.shape[-1] // MAX_IMAGES
    media = np.cumsum(np.asarray(tokens[0]) == task.marker) - 1  # the latest image of each position
    pieces = [task.tokenizer.decode([t]) for t in answer_ids] + ["<end>"]
    for k, piece in enumerate(pieces[:MAX_TOKENS]):
      position = len(prompt) - 1 + k  # its output is the k-th generated token
      if media[position] != 0:
        continue  # this position reads another image (or none): not a map of this one
      weights = maps[0, :, :, position, :rows].mean(axis=(0, 1))  # -> [1 + P] of image 0
      share, grid_map = on_grid(weights)
      panels.append((f"{piece!r} (cls {share:.0%})", grid_map))
  return image, _prompt_text(task, prompt), answer, panels


def attention_figure(task, model, examples, path: str) -> list:
  """Writes the maps of `examples` (VLMExamples with at least one image) to the PNG `path`; returns what it
  drew, `example_maps` of each."""
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  drawn = [example_maps(task, model, example) for example in examples]
  columns = max(2, min(MAX_COLUMNS, max((len(panels) for *_, panels in drawn), default=1)))
  map_rows = [max(1, -(-len(panels) // columns)) for *_, panels in drawn]
  rows = sum(1 + n for n in map_rows)
  figure, axes = plt.subplots(rows, columns, figsize=(2.0 * columns, 1.3 * rows), squeeze=False)
  for ax in axes.flat:
    ax.axis("off")
  row = 0
  patch = task.patch_size
  for (image, prompt, answer, panels), n_rows in zip(drawn, map_rows):
    head = axes[row, 0]
    head.imshow(image, cmap="gray_r", vmin=0.0, vmax=1.0)
    # A user's captions in a script no installed font draws (Chinese without a CJK font) read as \uXXXX, not as
    # empty boxes with one matplotlib warning per character.
    text, fonts = drawable_text(f"{prompt.strip() or '(caption)'} -> {answer or '(nothing)'}")
    head.set_title(text, fontsize=8, loc="left", fontfamily=fonts, parse_math=False)
    top = max([float(grid_map.max()) for _, grid_map in panels] + [1e-6])  # one colour scale per example
    for k, (title, grid_map) in enumerate(panels):
      ax = axes[row + 1 + k // columns, k % columns]
      ax.imshow(image, cmap="gray_r", vmin=0.0, vmax=1.0)
      upsampled = np.kron(grid_map, np.ones((patch, patch)))[:image.shape[0], :image.shape[1]]
      ax.imshow(upsampled, cmap="magma", alpha=0.6, vmin=0.0, vmax=top)
      text, fonts = drawable_text(title)
      ax.set_title(text, fontsize=7, fontfamily=fonts, parse_math=False)
    row += 1 + n_rows
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)
  return drawn
