"""The vision-language models' frozen image encoder: a ViT that names the digit at each position of a strip
(`configs/vlm_encoder.py`, task "vlm_encoder").

Images are the strips of `data.vlm_digits` (1 to data.max_digits digits, upscaled by data.scale), pixels in
[0, 1] as composed (not standardised), top-left on the zero canvas `vlm_digits.canvas_for(max_digits,
scale)` (default 8x32). The model is a plain `models.vit.ViT` with NUM_POSITION_CLASSES outputs (the ten
digits and EMPTY): `position_logits` runs its features and applies its head to the mean of the patch tokens
over each digit position's columns, so training makes each position's patch features name its digit, or
EMPTY on the canvas past the strip. The ViT reads the whole canvas, padding included (it has no patch mask):
a model that freezes it reads images collated on the same canvas.

Training strips are drawn per row from (seed, step, row) out of the "train" digits and digit sequences;
the eval set is data.num_eval_strips fixed strips of data.eval_split (`eval_split`: "validation" while
developing, "test" for a final score; digit images and sequences never seen in training, see
data.vlm_digits). Metrics, logged as eval/<name>:
  loss                 cross-entropy per position (every position of the canvas, EMPTY ones included)
  position_accuracy    share of the positions that hold a digit whose digit is named right
  empty_accuracy       share of the positions past a strip's end named EMPTY
  strip_accuracy       share of strips with every position right
Inference (`--mode=infer`): each line names an image file (PNG / JPEG, fitted to the canvas as
data.image_text reads it) or `validation:K` / `test:K` (fixed eval strip K of that split, as eval draws it); the
output is the name, a tab and the digits read.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xattn_jax.data import files, image_text, vlm_digits
from xattn_jax.models import vit
from xattn_jax.training import optim, task as task_lib, validation

EVAL_METRICS = ("eval/loss", "eval/position_accuracy", "eval/empty_accuracy", "eval/strip_accuracy")
_EVAL_STREAM = 1  # the eval strips' seed stream never meets a training row's


def eval_split(config) -> str:
  """The bundled split a digits run evaluates on: data.eval_split (one of vlm_digits.EVAL_SPLITS), or "test"
  in a config written before the field, which is what such a run evaluated on."""
  return config.data.get("eval_split", "test")


def check_eval_split(config) -> None:
  if "eval_split" in config.data:
    validation.require_choice(config, "data.eval_split", vlm_digits.EVAL_SPLITS)


def canvas(config) -> tuple[int, int]:
  """The (height, width) canvas of the run's images: data.canvas ("HxW") where a config sets it (a user's
  pairs), else the digit strips' canvas of data.max_digits and data.scale. Raises ConfigError naming
  data.canvas when it is not two positive integers."""
  if "canvas" not in config.data:  # an empty data.canvas is malformed, not the strips' (a pairs config has no max_digits)
    return vlm_digits.canvas_for(config.data.max_digits, config.data.scale)
  spec = config.data.canvas
  parts = str(spec).lower().split("x")
  if len(parts) != 2 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
    raise validation.ConfigError("data.canvas", spec, "must be 'HxW', two positive integers (e.g. '32x32')")
  return int(parts[0]), int(parts[1])


def make_encoder(model_config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs) -> vit.ViT:
  """The ViT of a vlm_encoder `model` config section (this task's, or the frozen encoder's)."""
  height, width = (int(part) for part in model_config.grid.split("x"))
  rngs = nnx.Rngs(params=rngs.params(), dropout=rngs.params())  # the blocks' Dropout wants a stream
  num_classes = model_config.get("num_classes", vlm_digits.NUM_POSITION_CLASSES)  # the head's outputs
  return vit.ViT(num_classes=num_classes, channels=model_config.get("channels", 1), patch_size=model_config.patch_size,
                 grid=(height, width), width=model_config.d_model, num_heads=model_config.num_heads,
                 num_blocks=model_config.num_blocks, mlp_ratio=model_config.mlp_ratio, pool="gap",
                 scan_layers=model_config.scan_layers, remat=model_config.remat, dtype=dtype,
                 param_dtype=param_dtype, rngs=rngs)


def grey(config) -> bool:
  """Whether the run reads its images grey (1 channel), else RGB (data.color, a user's pairs only)."""
  return not config.data.get("color", False)


def read_pairs_field(config, field: str):
  """The pairs of the file that config `field` names (data.image_text, at the run's canvas and colour, read once
  per file version); a missing file or any bad line raises a ConfigError naming the field, file and lines.
  Without a data.eval_file, the two sides of data.train_file's held-out split (image_text.held_out_pairs), each
  opening only its own images."""
  eval_side = None
  if not config.data.eval_file and field in ("data.train_file", "data.eval_file"):
    field, eval_side = "data.train_file", field == "data.eval_file"
  path = validation.get_field(config, field)
  validation.require_file(field, path)
  try:
    pairs = image_text.read_image_text_pairs_cached(path, canvas=canvas(config), grey=grey(config),
                                                    eval_side=eval_side)
  except files.LineFileError as error:
    raise validation.ConfigError(field, path, " ".join(str(error).split())) from None
  if eval_side and not pairs:
    raise validation.ConfigError("data.eval_file", "", f"no eval pairs: {path} shows one image, which training "
                                 "needs; name an eval file, or give pairs of two images at least (one is held out)")
  return pairs


def check_grid(config) -> None:
  """model.grid must be the run's canvas in patches of model.patch_size (which divides it)."""
  (height, width), patch = canvas(config), config.model.patch_size
  expected = f"{height // patch}x{width // patch}"
  if config.model.grid != expected:
    raise validation.ConfigError("model.grid", config.model.grid, f"must be the canvas {height}x{width} in "
                                 f"patches of {patch}: {expected!r}")


def padded_eval_batches(images, targets: dict, size: int, process_index: int, process_count: int):
  """This process's rows of each eval batch of `size` images [n, H, W, 1] and their `targets` ({name: [n, ...]}):
  the last batch padded with blank images of weight 0 ("weights" [rows], 1 for a real image)."""
  count, local = len(images), size // process_count
  for start in range(0, count, size):
    rows = start + process_index * local + np.arange(local)
    valid = rows < count
    safe = np.where(valid, rows, 0)
    yield {"images": np.where(valid[:, None, None, None], images[safe], 0.0).astype(np.float32),
           **{name: values[safe] for name, values in targets.items()}, "weights": valid.astype(np.float32)}


def position_logits(encoder: vit.ViT, images, *, position_width: int):
  """images [b, H, W, 1] -> logits [b, W / position_width, NUM_POSITION_CLASSES] (float32): the ViT's head on
  the mean patch token of each position's columns (position_width pixels, a multiple of the patch)."""
  patch = encoder.patch_size
  grid_height, grid_width = images.shape[1] // patch, images.shape[2] // patch
  tokens = encoder.features(images)[:, 1:]  # [b, M, width]: the patches, row-major
  per_position = position_width // patch
  tokens = tokens.reshape(tokens.shape[0], grid_height, grid_width // per_position, per_position, -1)
  pooled = tokens.mean(axis=(1, 3))  # [b, positions, width]
  return encoder.head(pooled).astype(jnp.float32)


@task_lib.register("vlm_encoder")
class StripEncoderTask(task_lib.Task):
  """Name the digit (or EMPTY) at every position of a digit strip (see the module docstring)."""
  eval_metric_names = EVAL_METRICS

  @classmethod
  def validate(cls, config, mode="train"):
    validation.require_choice(config, "model.name", ("vit",))
    validation.require_positive(config, "model.d_model", "model.num_heads", "model.num_blocks", "model.mlp_ratio",
                                "model.patch_size", "data.scale", "data.num_eval_strips")
    validation.require_positive(config, "data.max_shift", allow_zero=True)
    validation.require_positive(config, "data.max_digits")
    if config.data.max_digits > vlm_digits.MAX_DIGITS:
      raise validation.ConfigError("data.max_digits", config.data.max_digits,
                                   f"must be in [1, {vlm_digits.MAX_DIGITS}]")
    position_width = vlm_digits.DIGIT_SIZE * config.data.scale
    patch = config.model.patch_size
    if position_width % patch:
      raise validation.ConfigError("model.patch_size", patch, f"must divide a digit's side {position_width} "
                                   f"(8 x data.scale={config.data.scale})")
    if config.data.max_shift >= position_width:
      raise validation.ConfigError("data.max_shift", config.data.max_shift,
                                   f"must be below a digit's side {position_width}")
    check_grid(config)
    check_eval_split(config)
    validation.require_non_negative_number(config, "task.label_smoothing", "must be a number in [0, 1)", below=1.0)

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    self.canvas = canvas(config)
    self.max_digits, self.scale = config.data.max_digits, config.data.scale
    self.position_width = vlm_digits.DIGIT_SIZE * self.scale
    self._eval = {}  # split -> its fixed eval strips

  # --- data -------------------------------------------------------------------------------------

  def _strips(self, split, rngs, max_shift=0):
    """Images [n, H, W, 1] on the canvas and position labels [n, max_digits] of one strip per rng."""
    strips, sequences = zip(*(vlm_digits.draw_strip(split, rng, max_digits=self.max_digits, scale=self.scale)
                              for rng in rngs))
    if max_shift:  # augmentation: each strip moves up or down by up to max_shift pixels, over zeros
      shifted = []
      for strip, rng in zip(strips, rngs):
        rows = int(rng.integers(-max_shift, max_shift + 1))
        padded = np.pad(strip, ((max_shift, max_shift), (0, 0)))
        shifted.append(padded[max_shift - rows: max_shift - rows + strip.shape[0]])
      strips = shifted
    images = vlm_digits.collate_images([(s,) for s in strips], canvas=self.canvas, max_images=1)["images"][:, 0]
    return images, vlm_digits.position_labels(sequences, self.max_digits)

  def train_batch(self, step, *, process_index, process_count):
    local = self.config.batch_size // process_count
    rows = process_index * local + np.arange(local)  # global rows of batch `step`
    rngs = [np.random.default_rng([self.config.seed, step, int(row)]) for row in rows]
    images, labels = self._strips("train", rngs, self.config.data.max_shift)
    return {"images": images, "labels": labels}

  def eval_set(self, split: str | None = None):
    """(images [n, H, W, 1], labels [n, max_digits]): the fixed eval strips of split (default eval_split)."""
    split = split or eval_split(self.config)
    if split not in self._eval:
      rngs = [np.random.default_rng([self.config.data.eval_seed, _EVAL_STREAM, row])
              for row in range(self.config.data.num_eval_strips)]
      self._eval[split] = self._strips(split, rngs)
    return self._eval[split]

  def eval_batches(self, *, process_index, process_count):
    images, labels = self.eval_set()
    return padded_eval_batches(images, {"labels": labels}, self.config.eval_batch_size, process_index,
                               process_count)

  # --- model, loss, metrics ---------------------------------------------------------------------

  def make_model(self, rngs, *, dtype, param_dtype):
    return make_encoder(self.config.model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def _logits(self, model, images):
    return position_logits(model, images, position_width=self.position_width)  # [b, max_digits, 11]

  def loss_terms(self, model, batch, *, rngs):
    del rngs  # no dropout; the strips are drawn fresh every step
    logits = self._logits(model, batch["images"])
    loss_sum, count = optim.cross_entropy(logits, batch["labels"], label_smoothing=self.config.task.label_smoothing)
    digit = batch["labels"] != vlm_digits.EMPTY
    correct = jnp.argmax(logits, axis=-1) == batch["labels"]
    return loss_sum, count, {"position_accuracy": (jnp.sum(correct * digit), jnp.sum(digit))}

  def eval_metrics(self, model, batch):
    """Sums over the eval strips (see the module docstring)."""
    logits = self._logits(model, batch["images"])
    labels, weights = batch["labels"], batch["weights"]
    position_weights = jnp.broadcast_to(weights[:, None], labels.shape)
    loss_sum, weight_sum = optim.cross_entropy(logits, labels, position_weights)
    correct = jnp.argmax(logits, axis=-1) == labels
    digit = (labels != vlm_digits.EMPTY) * position_weights
    empty = (labels == vlm_digits.EMPTY) * position_weights
    return {"loss": (loss_sum, weight_sum),
            "position_accuracy": (jnp.sum(correct * digit), jnp.sum(digit)),
            "empty_accuracy": (jnp.sum(correct * empty), jnp.sum(empty)),
            "strip_accuracy": (jnp.sum(jnp.all(correct, axis=-1) * weights), jnp.sum(weights))}

  # --- inference --------------------------------------------------------------------------------

  @functools.cached_property
  def _predict(self):
    return nnx.jit(lambda model, images: jnp.argmax(self._logits(model, images), axis=-1))

  def read(self, model, images: list[np.ndarray]) -> list[tuple[int, ...]]:
    """The digits the encoder reads on each image [h, w] (fitted to the canvas), up to its first EMPTY."""
    batch = vlm_digits.collate_images([(image,) for image in images], canvas=self.canvas, max_images=1)
    predictions = np.asarray(self._predict(model, batch["images"][:, 0]))
    read = []
    for row in predictions:
      stop = np.flatnonzero(row == vlm_digits.EMPTY)
      read.append(tuple(int(d) for d in row[:stop[0] if len(stop) else len(row)]))
    return read

  def infer_lines(self, model, lines):
    def read(index, line):
      name = line.strip()
      split, _, number = name.partition(":")
      if split in vlm_digits.EVAL_SPLITS and number.isdigit():
        k = int(number)
        strips = self.eval_set(split)[0]
        if not 0 <= k < len(strips):
          raise ValueError(f"{name!r}: the eval strips are 0..{len(strips) - 1}")
        return strips[k, ..., 0]
      return image_text.load_image(self.input_path(name), self.canvas)
    images = task_lib.read_each(lines, read)
    return [f"{line.strip()}\t{' '.join(map(str, digits)) or '(none)'}"
            for line, digits in zip(lines, self.read(model, images))]
