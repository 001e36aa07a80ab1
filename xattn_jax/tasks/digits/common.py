"""What the three digits tasks share: the data, the loss and metrics, the attention pictures, inference.

Each model family's task (`vit.py`, `perceiver.py`, `qformer.py`) subclasses `DigitsBase` and supplies
`make_model`, `tokens_handed_on` and, when its model has queries to draw, `query_attention`;
`task.py` registers "digits", which picks one of them by `config.model.name`.

Batches are `images` [b, H, W, 1] (standardised pixels) and `labels` [b]; see `xattn_jax.data.digits`.
Logged besides the loss: `accuracy`, and `tokens_handed_on` (how many rows the model passes to what
follows it). Eval reads `data.eval_split` of `digits.load_digits_split` (validation while training: what a best
checkpoint or early stopping reads; `--mode=eval --config.data.eval_split=test` for the final score), reports
`eval/accuracy_HxW` on its images resized to each grid in `data.extra_eval_grids` and writes the queries'
attention maps of its first `task.num_attention_images` images as `attention_maps/<split>_K.png` under
`Task.figure_directory` (the workdir while training, `eval_results/step_N/` in it for --mode=eval), removing those of
the split an earlier eval drew beyond that count.

Inference (`launch.py --mode=infer`): each input line names a `.npy` file ([H, W] or a stack [n, H, W])
or an image file (PNG, JPEG, ...: data.image_files); the output line is the file name and the predicted digit(s).
`test:K` classifies test image K.
"""
from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xattn_jax.data import digits
from xattn_jax.training import optim, task as task_lib, validation

# What the eval of every digits run logs; it adds eval/accuracy_HxW for each grid in data.extra_eval_grids.
EVAL_METRICS = ("eval/loss", "eval/accuracy", "eval/tokens_handed_on")


def parse_grid(text: str, field: str = "grid") -> tuple[int, int]:
  """"12x16" -> (12, 16)."""
  try:
    height, width = (int(part) for part in validation.require_string(field, text, "16x16").lower().split("x"))
  except ValueError:
    raise validation.ConfigError(field, text, "must look like HEIGHTxWIDTH, e.g. 16x16") from None
  if height < 1 or width < 1:
    raise validation.ConfigError(field, text, "needs a positive height and width")
  return height, width


def parse_grids(text: str, field: str) -> list[tuple[int, int]]:
  """"12x12,16x16" -> [(12, 12), (16, 16)]; "" -> []."""
  return [parse_grid(part.strip(), field) for part in validation.require_string(field, text, "12x12,16x16").split(",")
          if part.strip()]


def check_split_fields(config) -> tuple[float, str, dict[str, np.ndarray]]:
  """(data.validation_fraction, data.eval_split, the split's images of each class by side) of a digits-based
  run (the readers here, the segmenter), checking the two fields: a config written before them has neither
  (digits.split_settings)."""
  data = config.data
  if "eval_split" in data:
    validation.require_choice(config, "data.eval_split", digits.EVAL_SPLITS)
  if "validation_fraction" in data:
    validation.require_non_negative_number(config, "data.validation_fraction", "must be a number in [0, 1)", below=1.0)
  fraction, eval_split = digits.split_settings(data)
  counts = digits.class_counts(test_fraction=data.test_fraction, split_seed=data.split_seed,
                               validation_fraction=fraction)
  return fraction, eval_split, counts


def image_grids(config) -> list[tuple[int, int]]:
  """Every grid the run reads images on: data.grid, then data.extra_eval_grids."""
  return [parse_grid(config.data.grid, "data.grid")] + parse_grids(config.data.extra_eval_grids,
                                                                    "data.extra_eval_grids")


def check_patch_size(config):
  """model.patch_size (of a model that cuts the images itself) must divide every image grid."""
  validation.require_positive(config, "model.patch_size")
  patch = config.model.patch_size
  for grid in image_grids(config):
    if grid[0] % patch or grid[1] % patch:
      raise validation.ConfigError("model.patch_size", patch, f"must divide every image grid, got {grid}")
  parse_grid(config.model.grid, "model.grid")


def patch_tokens(images, patch_size: int) -> int:
  """M: how many patches of patch_size cut images [b, H, W, C]."""
  return (images.shape[1] // patch_size) * (images.shape[2] // patch_size)


class _EvalMetricNames(tuple):
  """The eval/<name> metrics of a digits run, for checkpoint.best_metric. `in` also takes
  eval/accuracy_HxW for any grid: which of those a run logs depends on data.extra_eval_grids, which
  DigitsBase.validate checks."""

  def __contains__(self, name):
    return super().__contains__(name) or re.fullmatch(r"eval/accuracy_\d+x\d+", str(name)) is not None


class DigitsBase(task_lib.Task):
  """Classify the bundled digits with the model of a subclass (see the module docstring)."""

  eval_metric_names = _EvalMetricNames(EVAL_METRICS + ("eval/accuracy_<HxW in data.extra_eval_grids>",))

  @classmethod
  def validate(cls, config, mode="train"):
    """The data, task and checkpoint fields every digits run has; subclasses add their model's."""
    validation.require_positive(config, "model.d_model", "model.num_heads", "model.num_blocks", "model.mlp_ratio")
    validation.require_positive(config, "data.max_shift", allow_zero=True)
    if config.data.max_shift > digits.MAX_SHIFT:
      raise validation.ConfigError(
          "data.max_shift", config.data.max_shift,
          f"must be at most {digits.MAX_SHIFT}: a larger shift of the native 8x8 images (before any resize to "
          "data.grid) moves some digits entirely off the canvas")
    test_fraction = config.data.test_fraction
    if not validation.is_number(test_fraction) or not 0.0 < test_fraction < 1.0:
      raise validation.ConfigError("data.test_fraction", test_fraction, "must be in (0, 1)")
    classes, images, num_test = digits.NUM_CLASSES, digits.NUM_IMAGES, digits.num_test_images(test_fraction)
    if not classes <= num_test <= images - classes:
      # The split is stratified: each class needs an image on both sides.
      raise validation.ConfigError("data.test_fraction", test_fraction,
                                   f"must leave at least {classes} of the {images} images (one per class) on "
                                   f"each side: in [{classes / images:.4f}, {(images - classes) / images:.4f}]")
    fraction, eval_split, counts = check_split_fields(config)
    if counts["train"].min() == 0:
      raise validation.ConfigError("data.validation_fraction", fraction,
                                   "leaves a class with no training image: lower it (or data.test_fraction)")
    num_eval = int(counts[eval_split].sum())
    if num_eval == 0:
      raise validation.ConfigError("data.validation_fraction", fraction,
                                   "holds out no image, and data.eval_split is 'validation': raise it above 0, "
                                   "or evaluate on data.eval_split='test'")
    count = config.task.num_attention_images
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= num_eval:
      raise validation.ConfigError("task.num_attention_images", count,
                                   f"must be an integer in [0, {num_eval}], the images of "
                                   f"data.eval_split={eval_split!r}")
    extra_grids = image_grids(config)[1:]
    best, logged = config.checkpoint.best_metric, [f"eval/accuracy_{h}x{w}" for h, w in extra_grids]
    if best.startswith("eval/accuracy_") and best not in logged:
      raise validation.ConfigError("checkpoint.best_metric", best, "allowed are '' (no best checkpoint) or "
                                   f"{list(EVAL_METRICS) + logged}")

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    fraction, self.eval_split = digits.split_settings(config.data)
    self.split = digits.load_digits_split(test_fraction=config.data.test_fraction,
                                          split_seed=config.data.split_seed, validation_fraction=fraction)
    self.eval_images, self.eval_labels = self.split.side(self.eval_split)
    self.grid, *self.extra_grids = image_grids(config)

  # --- what each model family supplies ----------------------------------------------------------

  def tokens_handed_on(self, model, images) -> int:
    """How many rows the model passes on for images [b, H, W, 1] (a Python int: static shapes)."""
    raise NotImplementedError

  def query_attention(self, model, images):
    """(weights [n, heads, N, M], patch size): each of the N queries' attention over the M patches of
    images [n, H, W, 1] (row-major), or None when the model has no queries to draw."""
    return None

  # --- the contract -----------------------------------------------------------------------------

  def train_batch(self, step, *, process_index, process_count):
    return digits.train_batch(self.split, step, seed=self.config.seed, batch_size=self.config.batch_size,
                              process_index=process_index, process_count=process_count, grid=self.grid,
                              max_shift=self.config.data.max_shift)

  def loss_terms(self, model, batch, *, rngs):
    del rngs  # no dropout: the digits models regularise through data.max_shift augmentation
    logits = model(batch["images"], deterministic=True)
    loss_sum, count = optim.cross_entropy(logits, batch["labels"], label_smoothing=self.config.task.label_smoothing)
    correct = jnp.sum(jnp.argmax(logits, axis=-1) == batch["labels"])
    return loss_sum, count, {"accuracy": (correct, count),
                             "tokens_handed_on": (jnp.float32(self.tokens_handed_on(model, batch["images"])), 1.0)}

  def eval_batches(self, *, process_index, process_count):
    return digits.eval_batches(self.split, self.config.eval_batch_size, process_index=process_index,
                               process_count=process_count, grid=self.grid, eval_split=self.eval_split)

  def eval_metrics(self, model, batch):
    """Over every image of data.eval_split once: eval/loss (cross-entropy of the class), eval/accuracy (share of images
    classified right) and eval/tokens_handed_on (how many tokens the reader passes on per image)."""
    logits = model(batch["images"])
    weights = batch["weights"]
    loss_sum, weight_sum = optim.cross_entropy(logits, batch["labels"], weights)
    correct = (jnp.argmax(logits, axis=-1) == batch["labels"]) * weights
    tokens = self.tokens_handed_on(model, batch["images"])
    return {"loss": (loss_sum, weight_sum), "accuracy": (jnp.sum(correct), jnp.sum(weights)),
            "tokens_handed_on": (jnp.float32(tokens), jnp.float32(1.0))}

  # --- host-side evaluation, pictures and inference ---------------------------------------------

  @functools.cached_property
  def _predict(self):
    return nnx.jit(lambda model, images: jnp.argmax(model(images), axis=-1))

  def _classify(self, model, images: np.ndarray) -> np.ndarray:
    """Predicted digits [n] for images [n, H, W] in [0, 1] units (standardised here), in eval batches."""
    images = self.split.standardize(images)[..., None]
    size = self.config.eval_batch_size
    return np.concatenate([np.asarray(self._predict(model, images[start:start + size]))
                           for start in range(0, len(images), size)])

  def extra_eval(self, model):
    """eval/accuracy_HxW: accuracy on every image of data.eval_split resized to each extra grid; attention maps
    into the workdir."""
    results = {}
    for grid in self.extra_grids:
      predictions = self._classify(model, digits.resize_images(self.eval_images, grid))
      results[f"accuracy_{grid[0]}x{grid[1]}"] = float(np.mean(predictions == self.eval_labels))
    if self.figure_directory and jax.process_index() == 0:
      self.write_attention_maps(model, os.path.join(self.figure_directory, "attention_maps"))
    return results

  def write_attention_maps(self, model, directory: str) -> list[str]:
    """One PNG per image of data.eval_split (`<split>_K.png`, K < task.num_attention_images): the image next to
    each query's attention over it (heads averaged); none for a model without queries. The split's maps numbered
    from the count on, an earlier eval's, are removed (`task.figure_family`)."""
    count, split = self.config.task.num_attention_images, self.eval_split
    images = digits.resize_images(self.eval_images[:count], self.grid)
    attention = self.query_attention(model, self.split.standardize(images)[..., None]) if count else None
    paths = task_lib.figure_family(directory, f"{split}_", count if attention is not None else 0)
    if not paths:
      return []
    from xattn_jax.tasks.digits import plots as digits_plots  # matplotlib only when pictures are asked for
    weights, patch = np.asarray(attention[0]), attention[1]  # [count, heads, N, M]
    grid = (self.grid[0] // patch, self.grid[1] // patch)
    for k, path in enumerate(paths):
      digits_plots.plot_query_attention(images[k], weights[k].mean(axis=0).reshape(-1, *grid), path,
                                        title=f"{split} image {k} (label {self.eval_labels[k]})")
    return paths

  def _read_input(self, line: str) -> np.ndarray:
    """Images [n, H, W] in [0, 1] named by one input line."""
    if line.startswith("test:"):
      index = int(line[len("test:"):]) if line[len("test:"):].isdigit() else -1
      if not 0 <= index < len(self.split.test_labels):
        raise ValueError(f"{line!r}: the test set has images 0..{len(self.split.test_labels) - 1}")
      return self.split.test_images[index][None]
    if line.endswith(".npy"):
      array = digits.read_npy(self.input_path(line))
      return array if array.ndim == 3 else array[None]  # a stack of images, or one
    return digits.read_image_file(self.input_path(line))[None]

  def infer_lines(self, model, lines):
    """One line per input: the input name, a tab, the predicted digit (several for a stack)."""
    def read(index, line):
      images = self._read_input(line.strip())
      if not np.isfinite(images).all():
        raise ValueError(f"{line.strip()!r} holds NaN or infinite pixel values")
      return images
    outputs = []
    for line, images in zip(lines, task_lib.read_each(lines, read)):
      predictions = self._classify(model, digits.resize_images(images, self.grid, antialias=True))
      outputs.append(f"{line.strip()}\t{' '.join(str(p) for p in predictions)}")
    return outputs
