"""Promptable digit segmentation (`configs/segment_digits.py`): click a digit or box it, get its mask.

Data: `xattn_jax.data.segment_digits` (scenes of 2-4 digits on a canvas, prompts of PROMPT_KINDS, split
by source image). Model: `xattn_jax.models.segmenter.Segmenter` (ViT encoder, prompt encoder, two-way
transformer, num_masks masks and their predicted IoU per prompt).

Loss (SAM's): for each prompt the smallest over the K masks of (pixel-mean binary cross-entropy + dice
loss) against the target mask, so an ambiguous click can keep several readings in different masks; plus
task.iou_loss_weight times the mean squared error of the IoU head against every mask's actual IoU
(thresholded at logit 0, no gradient into the masks). Unlike SAM's, task.all_masks_loss_weight (small)
times the mean over all K masks is added too: with the minimum alone a mask that loses every prompt early
gets no gradient and stays untrained for good (a mask of everything).

Eval (over the fixed prompts of data.eval_split, `segment_digits.eval_examples`: validation while training,
`--mode=eval --config.data.eval_split=test` for the final score): the mask the IoU head ranks highest
is the prediction. eval/click_* are single positive clicks on a digit's own strokes, eval/box_* its
bounding box: mean_iou, iou50_rate / iou75_rate (share with IoU >= 0.5 / 0.75) and oracle_iou (the best
of the K masks). eval/ambiguous_both_iou: for a click on a pixel two digits share, the mean over the two
digits of the best mask's IoU with it (do the K masks hold both readings?). eval/iou_head_pearson: the
correlation of predicted with actual IoU over every mask of every eval prompt. PNGs of the first
task.num_plot_examples eval prompts go to `segment_plots/<split>_K.png` under `Task.figure_directory` (the workdir
while training, `eval_results/step_N/` in it for --mode=eval); those of the split an earlier eval drew beyond that
count are removed.

Inference (`launch.py --mode=infer`), one line per prompt:
    IMAGE x,y[,+|-] [x,y[,+|-] ...]      clicks (x = column, y = row in IMAGE's pixels; + positive, - negative)
    IMAGE box=x0,y0,x1,y1                a box (pixel edges: the box holds columns x0..x1-1, rows y0..y1-1)
IMAGE is an image file (PNG, JPEG, ...: data.image_files) or a .npy file (resized to the canvas) or test:K
(test prompt K's image; with no prompt after it, test prompt K's own); a tab after IMAGE instead of a space
takes a path with spaces (`my scan.png<TAB>12,9`). The answer line is IMAGE, the PNG
written to `<workdir>/infer/` (image, prompt, every mask; `<name>_<line>.png`, name cut to 48 characters, the
input line's number from 1 as errors give it, blank lines counted; `-2`, `-3` ... where an earlier infer wrote
that name), the predicted IoU and pixel count of the chosen mask (pixels of the canvas the image is
resized to, data.canvas a side, not of IMAGE), tab-separated.
"""
from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from xattn_jax.data import digits, segment_digits
from xattn_jax.models import segmenter
from xattn_jax.tasks.digits import common as digits_task
from xattn_jax.training import task as task_lib, validation
from xattn_jax.training.errors import RunError

MODELS = ("sam",)
PROMPTED = ("click", "box")  # the prompt kinds with per-kind IoU metrics
_PER_KIND = ("mean_iou", "iou50_rate", "iou75_rate", "oracle_iou")
METRIC_NAMES = (("loss",) + tuple(f"{kind}_{name}" for kind in PROMPTED for name in _PER_KIND)
                + ("ambiguous_both_iou", "iou_head_pearson"))
_NUMBER = r"(-?(?:\d+(?:\.\d*)?|\.\d+))"  # 12, 12.5, .5, -3 (not 1.2.3)
_BOX = re.compile(rf"box={_NUMBER},{_NUMBER},{_NUMBER},{_NUMBER}$")
_CLICK = re.compile(rf"{_NUMBER},{_NUMBER}(?:,([+-]))?$")
_MAX_STEM = 48  # characters of an image's name kept in its PNG's: a file name holds 255 bytes, a UTF-8 letter 1-4
_FIT_SCENES = 20  # training scenes drawn to check that data.min_digits digits fit the canvas
# PNGs drawn at each eval (task.num_plot_examples) at the most: matplotlib takes a good part of a second for one,
# every eval draws them anew, and more than a page of them is no longer looked at one by one.
MAX_PLOT_EXAMPLES = 100


def scene_options(config) -> segment_digits.SceneOptions:
  data = config.data
  return segment_digits.SceneOptions(canvas=data.canvas, digit_size=data.digit_size, min_digits=data.min_digits,
                                     max_digits=data.max_digits, threshold=data.threshold,
                                     min_visible=data.min_visible, max_clicks=data.max_clicks)


def mask_losses(logits, targets):
  """Per-mask BCE (pixel mean) + dice loss: logits [b, K, H, W], targets [b, H, W] in {0, 1} -> [b, K]."""
  targets = jnp.broadcast_to(targets[:, None], logits.shape)
  bce = optax.sigmoid_binary_cross_entropy(logits, targets).mean(axis=(-2, -1))
  probabilities = jax.nn.sigmoid(logits)
  overlap = jnp.sum(probabilities * targets, axis=(-2, -1))
  dice = 1.0 - (2.0 * overlap + 1.0) / (jnp.sum(probabilities, axis=(-2, -1)) + jnp.sum(targets, axis=(-2, -1)) + 1.0)
  return bce + dice


def mask_iou(logits, targets):
  """IoU of each mask (logit > 0) with the target: logits [b, K, H, W], targets [b, H, W] -> [b, K]
  (1 when both are empty)."""
  predicted, target = logits > 0, targets[:, None] > 0.5
  intersection = jnp.sum(predicted & target, axis=(-2, -1))
  union = jnp.sum(predicted | target, axis=(-2, -1))
  return jnp.where(union > 0, intersection / jnp.maximum(union, 1), 1.0).astype(jnp.float32)


def pearson(x: np.ndarray, y: np.ndarray) -> float:
  """Pearson correlation of two equal-length vectors (0 when either is constant)."""
  x, y = np.asarray(x, np.float64) - np.mean(x), np.asarray(y, np.float64) - np.mean(y)
  denominator = np.sqrt(np.sum(x * x) * np.sum(y * y))
  return float(np.sum(x * y) / denominator) if denominator > 0 else 0.0


def _free_path(path: str) -> str:
  """`path`, or `<stem>-2<ext>`, `-3` ... where it is taken."""
  stem, ext = os.path.splitext(path)
  count = 1
  while os.path.exists(path):
    count += 1
    path = f"{stem}-{count}{ext}"
  return path


@task_lib.register("segment")
class SegmentTask(task_lib.Task):
  """Segment the digit a prompt points at (see the module docstring)."""

  eval_metric_names = tuple(f"eval/{name}" for name in METRIC_NAMES)
  model_building_fields = ("data.canvas", "task.num_masks")  # the encoder's patch grid, the mask tokens

  @classmethod
  def validate(cls, config, mode="train"):
    validation.require_choice(config, "model.name", MODELS)
    validation.require_positive(config, "data.canvas", "data.digit_size", "data.min_digits", "data.max_digits",
                                "data.max_clicks", "task.num_eval_scenes", "task.num_masks", "model.patch_size",
                                "model.num_blocks", "model.mlp_dim", "model.mask_features",
                                "model.encoder.num_blocks", "model.encoder.mlp_ratio")
    validation.require_positive(config, "task.num_plot_examples", allow_zero=True)
    data, model, task = config.data, config.model, config.task
    # every eval scene gives a click and a box prompt (an ambiguous click only where digits overlap)
    most_plots = min(MAX_PLOT_EXAMPLES, 2 * task.num_eval_scenes)
    if task.num_plot_examples > most_plots:
      raise validation.ConfigError("task.num_plot_examples", task.num_plot_examples,
                                   f"must be in [0, {most_plots}]: each eval draws them anew ({MAX_PLOT_EXAMPLES} at "
                                   f"most), from its 2 prompts per scene of task.num_eval_scenes={task.num_eval_scenes}")
    if data.digit_size > data.canvas:
      raise validation.ConfigError("data.digit_size", data.digit_size, f"must be at most data.canvas={data.canvas}")
    if data.min_digits > data.max_digits:
      raise validation.ConfigError("data.min_digits", data.min_digits,
                                   f"must be at most data.max_digits={data.max_digits}")
    validation.require_non_negative_number(config, "data.threshold", "must be in [0, 16) (the digits' 0..16 scale)",
                                           below=16.0)
    if not validation.is_number(data.min_visible) or not 0.0 <= data.min_visible <= 1.0:
      raise validation.ConfigError("data.min_visible", data.min_visible, "must be in [0, 1]")
    if not validation.is_number(data.test_fraction) or not 0.0 < data.test_fraction < 1.0:
      raise validation.ConfigError("data.test_fraction", data.test_fraction, "must be in (0, 1)")
    test_images = digits.num_test_images(data.test_fraction)
    if min(test_images, digits.NUM_IMAGES - test_images) < data.max_digits:
      raise validation.ConfigError("data.test_fraction", data.test_fraction,
                                   f"leaves fewer than data.max_digits={data.max_digits} source images on one side")
    fraction, eval_split, counts = digits_task.check_split_fields(config)
    for side in ("train", eval_split):
      if counts[side].sum() < data.max_digits:
        raise validation.ConfigError("data.validation_fraction", fraction,
                                     f"leaves {counts[side].sum()} source images for the {side} scenes, fewer "
                                     f"than data.max_digits={data.max_digits}")
    if data.canvas % model.patch_size:
      raise validation.ConfigError("model.patch_size", model.patch_size,
                                   f"must divide data.canvas={data.canvas}")
    if model.d_model % (2 * model.num_heads):
      raise validation.ConfigError("model.d_model", model.d_model,
                                   f"must be divisible by 2 * model.num_heads = {2 * model.num_heads} (the "
                                   "cross-attentions work at half the width; the Fourier features pair sin / cos)")
    if not isinstance(model.encoder.freeze, bool):
      raise validation.ConfigError("model.encoder.freeze", model.encoder.freeze, "must be True or False")
    if not validation.is_number(model.fourier_scale) or not 0 < model.fourier_scale < float("inf"):
      raise validation.ConfigError("model.fourier_scale", model.fourier_scale, "must be a finite number > 0")
    mix = task.prompt_mix
    unknown = sorted(set(mix) - set(segment_digits.PROMPT_KINDS))
    if unknown:
      raise validation.ConfigError(f"task.prompt_mix.{unknown[0]}", mix[unknown[0]],
                                   f"is no prompt kind: allowed are {list(segment_digits.PROMPT_KINDS)}")
    for kind in mix:
      validation.require_non_negative_number(config, f"task.prompt_mix.{kind}", "must be a finite non-negative number")
    if not sum(mix.values()) > 0:
      raise validation.ConfigError("task.prompt_mix", mix.to_dict(), "needs a positive weight on some prompt kind")
    for field in ("iou_loss_weight", "all_masks_loss_weight"):
      validation.require_non_negative_number(config, f"task.{field}", "must be a finite number >= 0")

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    self.options = scene_options(config)
    fraction, self.eval_split = digits.split_settings(config.data)
    self.pools = segment_digits.load_pools(self.options, test_fraction=config.data.test_fraction,
                                           split_seed=config.data.split_seed, validation_fraction=fraction)
    self._prompts = {}
    if mode == "train":
      self._check_scenes()

  def _check_scenes(self):
    """make_scene places fewer digits than data.min_digits where they do not fit, each keeping data.min_visible of
    its mask alone (a canvas of one digit's side holds one): refused where no scene of the first few fits them,
    said where some do not. Scenes without overlapping digits have no ambiguous prompt: said where none of them has
    one (data.min_visible=1, max_digits=1), as eval/ambiguous_both_iou then reads 0."""
    data = self.config.data
    scenes = [segment_digits.make_scene(self.pools["train"], np.random.default_rng([data.split_seed, 2, index]),
                                        self.options) for index in range(_FIT_SCENES)]
    short = sum(len(scene.labels) < data.min_digits for scene in scenes)
    why = (f"{data.min_digits} digits of data.digit_size={data.digit_size} on data.canvas={data.canvas}, each "
           f"keeping data.min_visible={data.min_visible:g} of its mask alone")
    remedy = "raise data.canvas, or lower data.digit_size, data.min_digits or data.min_visible"
    if short == _FIT_SCENES:
      raise validation.ConfigError("data.min_digits", data.min_digits,
                                   f"none of {_FIT_SCENES} scenes fits {why}: {remedy}")
    if short:
      logging.warning("%d of %d scenes hold fewer than data.min_digits digits: they do not fit %s (%s)", short,
                      _FIT_SCENES, why, remedy)
    if not any(segment_digits.ambiguous_pairs(scene) for scene in scenes):
      logging.warning("None of %d scenes has digits that share a pixel (data.min_visible=%g, data.max_digits=%d): "
                      "ambiguous prompts (task.prompt_mix.ambiguous) train as single clicks, and "
                      "eval/ambiguous_both_iou reads 0 where no eval prompt is ambiguous", _FIT_SCENES,
                      data.min_visible, data.max_digits)

  def prompts(self, split: str) -> dict[str, np.ndarray]:
    """The fixed eval prompts of one of digits.EVAL_SPLITS. Drawn from data.split_seed, not the run's seed:
    runs with different seeds score the same prompts."""
    if split not in self._prompts:
      self._prompts[split] = segment_digits.eval_examples(
          self.pools[split], self.options, seed=self.config.data.split_seed,
          num_scenes=self.config.task.num_eval_scenes)
    return self._prompts[split]

  @property
  def eval_set(self) -> dict[str, np.ndarray]:
    """The prompts of data.eval_split: validation while training, test for the final score."""
    return self.prompts(self.eval_split)

  def make_model(self, rngs, *, dtype, param_dtype):
    model, canvas = self.config.model, self.config.data.canvas
    # The layers' Dropout modules want a "dropout" stream at construction even when they never drop.
    rngs = nnx.Rngs(params=rngs.params(), dropout=rngs.params())
    side = canvas // model.patch_size
    return segmenter.Segmenter(
        patch_size=model.patch_size, grid=(side, side), encoder_width=model.encoder.d_model,
        encoder_heads=model.encoder.num_heads, encoder_blocks=model.encoder.num_blocks,
        encoder_mlp_ratio=model.encoder.mlp_ratio, freeze_encoder=model.encoder.freeze, width=model.d_model,
        num_heads=model.num_heads, num_blocks=model.num_blocks, mlp_features=model.mlp_dim,
        num_masks=self.config.task.num_masks, mask_features=model.mask_features,
        num_point_labels=segment_digits.NUM_POINT_LABELS, fourier_scale=model.fourier_scale, dtype=dtype,
        param_dtype=param_dtype, rngs=rngs)

  # --- training ---------------------------------------------------------------------------------

  def train_batch(self, step, *, process_index, process_count):
    return segment_digits.train_batch(self.pools["train"], self.options, seed=self.config.seed, step=step,
                                      batch_size=self.config.batch_size,
                                      kind_weights=dict(self.config.task.prompt_mix),
                                      process_index=process_index, process_count=process_count)

  def _losses(self, model, batch):
    """(per-prompt loss [b], logits [b, K, H, W], predicted IoU [b, K], actual IoU [b, K])."""
    logits, predicted = model(batch["images"], batch["points"], batch["point_labels"])
    actual = jax.lax.stop_gradient(mask_iou(logits, batch["masks"]))
    per_mask = mask_losses(logits, batch["masks"])  # [b, K]
    iou_error = jnp.mean((predicted - actual) ** 2, axis=-1)
    task = self.config.task
    losses = (jnp.min(per_mask, axis=-1) + task.all_masks_loss_weight * jnp.mean(per_mask, axis=-1)
              + task.iou_loss_weight * iou_error)
    return losses, logits, predicted, actual

  def loss_terms(self, model, batch, *, rngs):
    del rngs  # no randomness of its own: prompts and jitter come with the batch
    losses, _, predicted, actual = self._losses(model, batch)
    chosen = jnp.take_along_axis(actual, jnp.argmax(predicted, axis=-1)[:, None], axis=-1)[:, 0]
    count = jnp.float32(losses.shape[0])
    return jnp.sum(losses), count, {"iou": (jnp.sum(chosen), count),
                                    "oracle_iou": (jnp.sum(jnp.max(actual, axis=-1)), count)}

  # --- evaluation -------------------------------------------------------------------------------

  def eval_batches(self, *, process_index, process_count):
    return segment_digits.padded_batches(self.eval_set, self.config.eval_batch_size, process_index=process_index,
                                         process_count=process_count)

  def eval_metrics(self, model, batch):
    """See the module docstring: loss, per-kind IoU of the chosen mask, its rates, the oracle's, and
    ambiguous_both_iou."""
    losses, logits, predicted, actual = self._losses(model, batch)
    weights, kinds = batch["weights"], batch["kinds"]
    chosen = jnp.take_along_axis(actual, jnp.argmax(predicted, axis=-1)[:, None], axis=-1)[:, 0]  # [b]
    metrics = {"loss": (jnp.sum(losses * weights), jnp.sum(weights))}
    for kind in PROMPTED:
      selected = weights * (kinds == segment_digits.PROMPT_KINDS.index(kind))
      count = jnp.sum(selected)
      metrics[f"{kind}_mean_iou"] = (jnp.sum(chosen * selected), count)
      metrics[f"{kind}_iou50_rate"] = (jnp.sum((chosen >= 0.5) * selected), count)
      metrics[f"{kind}_iou75_rate"] = (jnp.sum((chosen >= 0.75) * selected), count)
      metrics[f"{kind}_oracle_iou"] = (jnp.sum(jnp.max(actual, axis=-1) * selected), count)
    ambiguous = weights * (kinds == segment_digits.PROMPT_KINDS.index("ambiguous"))
    both = 0.5 * (jnp.max(actual, axis=-1) + jnp.max(mask_iou(logits, batch["alt_masks"]), axis=-1))
    # the weight is this batch's count, 0 too: the loop sums weights over batches (a floor of 1 a batch made
    # the mean depend on eval_batch_size)
    metrics["ambiguous_both_iou"] = (jnp.sum(both * ambiguous), jnp.sum(ambiguous))
    return metrics

  @functools.cached_property
  def _predict(self):
    """(model, images, points, point_labels) -> (mask logits, predicted IoU), jitted."""
    return nnx.jit(lambda model, images, points, labels: model(images, points, labels))

  def _predict_rows(self, model, images, points, labels):
    """Predictions for any number of rows, in eval batches (the last one padded)."""
    size, total = self.config.eval_batch_size, len(images)
    logits, ious = [], []
    for start in range(0, total, size):
      rows = np.minimum(np.arange(start, start + size), total - 1)
      out_logits, out_iou = self._predict(model, images[rows], points[rows], labels[rows])
      count = min(size, total - start)
      logits.append(np.asarray(out_logits)[:count])
      ious.append(np.asarray(out_iou)[:count])
    return np.concatenate(logits), np.concatenate(ious)

  def extra_eval(self, model):
    """eval/iou_head_pearson over every mask of every eval prompt; PNGs of the first ones."""
    examples = self.eval_set
    logits, predicted = self._predict_rows(model, examples["images"], examples["points"], examples["point_labels"])
    actual = np.asarray(mask_iou(jnp.asarray(logits), jnp.asarray(examples["masks"])))
    if self.figure_directory and jax.process_index() == 0:  # an earlier eval's PNGs beyond its count are removed
      paths = task_lib.figure_family(os.path.join(self.figure_directory, "segment_plots"), f"{self.eval_split}_",
                                     min(self.config.task.num_plot_examples, len(logits)))
      if paths:
        from xattn_jax.tasks.segment import plots  # matplotlib only when pictures are asked for
      for k, path in enumerate(paths):
        kind = segment_digits.PROMPT_KINDS[examples["kinds"][k]]
        plots.plot_prediction(examples["images"][k, ..., 0], examples["points"][k], examples["point_labels"][k],
                              logits[k] > 0, predicted[k], path,
                              target=examples["masks"][k] > 0.5,
                              title=f"{kind}: IoU {actual[k, np.argmax(predicted[k])]:.2f}")
    return {"iou_head_pearson": pearson(predicted.ravel(), actual.ravel())}

  # --- inference --------------------------------------------------------------------------------

  def _read_line(self, line: str):
    """(name, image [H, W] on the canvas, points [P, 2], point_labels [P]) of one inference line: the image,
    then its prompt, separated by whitespace, or by a tab where the image's path holds spaces."""
    if "\t" in line:
      name, rest = line.split("\t", 1)
      name, prompt = name.strip(), rest.split()
    else:
      name, *prompt = line.split()
    canvas = self.options.canvas
    if name.startswith("test:"):
      index = int(name[len("test:"):]) if name[len("test:"):].isdigit() else -1
      test = self.prompts("test")
      count = len(test["kinds"])
      if not 0 <= index < count:
        raise ValueError(f"{name!r}: the test prompts are test:0 .. test:{count - 1}")
      image = test["images"][index, ..., 0]
      if not prompt:
        return name, image, test["points"][index], test["point_labels"][index]
    else:
      if not os.path.exists(self.input_path(name)) and "\t" not in line and prompt and not (
          _CLICK.match(prompt[0]) or _BOX.match(prompt[0])):  # `my scan.png 8,6` read the path as 'my'
        raise ValueError(f"no such file {name!r}; a path holding spaces takes a tab before its prompt")
      image = digits.read_image_file(self.input_path(name))  # refuses an image of no pixels
      if not np.isfinite(image).all():
        raise ValueError(f"{name!r} holds NaN or infinite pixel values")
    height, width = image.shape
    if not prompt:
      raise ValueError(f"{name!r}: no prompt; give clicks x,y[,+|-] or box=x0,y0,x1,y1 after the image")
    box = _BOX.match(prompt[0]) if len(prompt) == 1 else None
    if box:
      x0, y0, x1, y1 = (float(v) for v in box.groups())
      if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
        raise ValueError(f"box {prompt[0]!r} must satisfy 0 <= x0 < x1 <= {width} and 0 <= y0 < y1 <= {height}")
      points = np.zeros((self.options.num_prompt_tokens, 2), np.float32)
      labels = np.zeros(self.options.num_prompt_tokens, np.int32)
      points[:2] = [(y0 / height, x0 / width), (y1 / height, x1 / width)]
      labels[:2] = (segment_digits.BOX_TOP_LEFT, segment_digits.BOX_BOTTOM_RIGHT)
    else:
      if len(prompt) > self.options.num_prompt_tokens:  # click_points would name neither the field nor the fix
        raise ValueError(f"{len(prompt)} clicks: a prompt holds at most {self.options.num_prompt_tokens} "
                         f"(data.max_clicks={self.config.data.max_clicks}; --config.data.max_clicks={len(prompt)} "
                         "takes more, beyond what the run trained with)")
      clicks = []
      for text in prompt:
        match = _CLICK.match(text)
        if not match:
          raise ValueError(f"{text!r} is no click: write x,y or x,y,+ (positive) or x,y,- (negative)")
        label = segment_digits.NEGATIVE if match.group(3) == "-" else segment_digits.POSITIVE
        clicks.append((float(match.group(1)), float(match.group(2)), label))
      points, labels = segment_digits.click_points(clicks, self.options, height=height, width=width)
    if image.shape != (canvas, canvas):
      image = digits.resize_images(image[None], (canvas, canvas), antialias=True)[0]
    return name, np.clip(image, 0.0, 1.0), points, labels

  def infer_lines(self, model, lines):
    """One answer line per prompt line (module docstring); the PNG of each into `<workdir>/infer/`."""
    parsed = task_lib.read_each(lines, lambda index, line: self._read_line(line.strip()))
    directory = os.path.join(self.workdir or ".", "infer")
    try:  # before predicting: a workdir infer cannot write (read-only storage) failed after it, in a traceback
      os.makedirs(directory, exist_ok=True)
      problem = None if os.access(directory, os.W_OK | os.X_OK) else "is not writable"
    except OSError as error:
      problem = f"cannot be made ({error.strerror})"
    if problem:
      raise RunError(f"the segmenter's infer draws each answer into {directory}, which {problem}; copy the run to "
                     "a folder you can write")
    images = np.stack([p[1] for p in parsed])[..., None].astype(np.float32)
    points, labels = np.stack([p[2] for p in parsed]), np.stack([p[3] for p in parsed])
    logits, predicted = self._predict_rows(model, images, points, labels)
    from xattn_jax.tasks.segment import plots  # matplotlib only when pictures are asked for
    outputs = []
    for index, (name, image, point, label) in enumerate(parsed):
      best = int(np.argmax(predicted[index]))
      stem = re.sub(r"[^\w.-]", "_", os.path.splitext(os.path.basename(name))[0])[:_MAX_STEM]
      # named by the input line's number (as errors name it); an earlier infer's PNG is kept
      path = _free_path(os.path.join(directory, f"{stem}_{self.line_number(index)}.png"))
      plots.plot_prediction(image, point, label, logits[index] > 0, predicted[index], path, title=name)
      outputs.append(f"{name}\t{path}\tiou={predicted[index, best]:.3f}\tpixels={int(np.sum(logits[index, best] > 0))}")
    return outputs
