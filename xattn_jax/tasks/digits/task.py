"""Digit classification on scikit-learn's bundled 8x8 digits, for any of three models (`config.model.name`):

- "vit": the small ViT that is later frozen as the Q-Former's encoder (`configs/vit_digits.py`);
- "perceiver": the Perceiver latent reader over pixels or patches (`configs/perceiver_digits.py`);
- "qformer": learned queries (or, with `model.connector="mlp"`, an MLP connector) over the frozen ViT's
  patch features (`configs/qformer_digits.py`). The encoder comes from the ViT run in
  `model.encoder_workdir`: its resolved config gives the architecture and its newest checkpoint the
  weights. When that workdir holds no finished run, the ViT is trained (or resumed) there first, with the
  config file `model.encoder_config` ("path.py[:arg]"). Training records in the Q-Former's workdir
  (`encoder.json`) where that run is (an absolute path) and the encoder's model config; eval and infer read
  only this record, since the Q-Former's checkpoints hold the frozen weights, so they never train, nor read
  the encoder run, whatever the current directory.

Batches are `images` [b, H, W, 1] (standardised pixels) and `labels` [b]; see `xattn_jax.data.digits`.
Logged besides the loss: `accuracy`, and `tokens_handed_on` (how many rows the reader passes to what
follows it: N latents / queries, or M features for the MLP connector and the ViT). Eval also reports
`eval/accuracy_HxW` on the test images resized to each grid in `data.extra_eval_grids` (reading more
features than in training) and writes the readers' attention maps as `attention_maps/test_K.png` in the workdir.

Inference (`launch.py --mode=infer`): each input line names a `.npy` file ([H, W] or a stack [n, H, W])
or a PNG file; the output line is the file name and the predicted digit(s). `test:K` classifies test image K.
"""
from __future__ import annotations

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from ml_collections import ConfigDict

from xattn_jax.data import digits
from xattn_jax.models import latent_reader, vit
from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import optim, task as task_lib, validation

MODELS = ("vit", "perceiver", "qformer")
# What the eval of every digits run logs; it adds eval/accuracy_HxW for each grid in data.extra_eval_grids.
EVAL_METRICS = ("eval/loss", "eval/accuracy", "eval/tokens_handed_on")
ENCODER_RECORD = "encoder.json"  # in a Q-Former workdir: {"encoder_workdir": absolute path, "model": {...}}
_REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_grid(text: str, field: str = "grid") -> tuple[int, int]:
  """"12x16" -> (12, 16)."""
  try:
    height, width = (int(part) for part in text.lower().split("x"))
  except ValueError:
    raise validation.ConfigError(field, text, "must look like HEIGHTxWIDTH, e.g. 16x16") from None
  if height < 1 or width < 1:
    raise validation.ConfigError(field, text, "needs a positive height and width")
  return height, width


def _grids(text: str, field: str) -> list[tuple[int, int]]:
  return [parse_grid(part.strip(), field) for part in text.split(",") if part.strip()]


def _config_path(spec: str) -> str:
  """The file of "path/to/config.py[:arg]", relative to the working directory or else to the repository."""
  path = spec.partition(":")[0]
  return path if os.path.isfile(path) else os.path.join(_REPOSITORY, path)


def _load_config_file(spec: str) -> ConfigDict:
  """get_config(arg) of "path/to/config.py[:arg]", as launch.py's --config would load it."""
  return validation.load_config_file(_config_path(spec), spec.partition(":")[2] or None)


def _encoder_finished(workdir: str) -> bool:
  """Whether the run in workdir saved a checkpoint at its config's total_steps."""
  stored = os.path.join(workdir, "config.json")
  if not os.path.isfile(stored):
    return False
  with open(stored) as f:
    total_steps = json.load(f)["total_steps"]
  return max(checkpoints_lib.step_numbers(workdir), default=-1) >= total_steps


def _encoder_run_config(encoder_workdir: str, spec: str) -> tuple[ConfigDict, str]:
  """(config, where it comes from) of the frozen encoder's run: the resolved config of the run in
  encoder_workdir, else get_config of the config file `spec` (which trains the encoder there)."""
  stored = os.path.join(encoder_workdir, "config.json")
  if os.path.isfile(stored):
    with open(stored) as f:
      return ConfigDict(json.load(f)), f"the run in {encoder_workdir}"
  if not os.path.isfile(_config_path(spec)):
    raise validation.ConfigError(
        "model.encoder_config", spec, f"no such config file, and model.encoder_workdir={encoder_workdir!r} "
        "holds no encoder run to load the frozen encoder from")
  try:
    return _load_config_file(spec), spec
  except Exception as error:  # noqa: BLE001 - whatever the user's get_config raises, in one line
    raise validation.ConfigError("model.encoder_config", spec,
                                 f"cannot be loaded: {type(error).__name__}: {' '.join(str(error).split())}") from None


def _check_encoder_patch(config, encoder_model, source: str):
  """Every image grid (data.grid, data.extra_eval_grids) must split into the frozen encoder's patches."""
  patch = encoder_model.get("patch_size")
  if isinstance(patch, bool) or not isinstance(patch, int) or patch < 1:
    raise validation.ConfigError("model.encoder_config", config.model.encoder_config,
                                 f"the encoder's model.patch_size={patch!r} ({source}) must be a positive integer")
  for field, text in (("data.grid", config.data.grid), ("data.extra_eval_grids", config.data.extra_eval_grids)):
    for height, width in _grids(text, field):
      if height % patch or width % patch:
        raise validation.ConfigError(
            field, text, f"every grid must be divisible by the frozen encoder's patch size {patch} "
            f"(model.patch_size of {source}), got {height}x{width}")


class EncoderRunStopped(SystemExit):
  """SIGTERM or Ctrl-C stopped the frozen encoder's training, which saved a checkpoint: the Q-Former run
  ends there with exit status 0, as any stopped run does, and resumes the encoder when started again."""

  def __init__(self, message: str):
    super().__init__(0)
    self.message = message

  def __str__(self):
    return self.message


class _EvalMetricNames(tuple):
  """The eval/<name> metrics of a digits run, for checkpoint.best_metric. `in` also takes
  eval/accuracy_HxW for any grid: which of those a run logs depends on data.extra_eval_grids, which
  DigitsTask.validate checks."""

  def __contains__(self, name):
    return super().__contains__(name) or re.fullmatch(r"eval/accuracy_\d+x\d+", str(name)) is not None


def _select(tree: dict, template: dict) -> dict:
  """The entries of nested dict `tree` at the paths of `template`, as numpy arrays."""
  return {key: _select(tree[key], sub) if isinstance(sub, dict) else np.asarray(tree[key])
          for key, sub in template.items()}


def make_vit(model_config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs):
  return vit.ViT(num_classes=digits.NUM_CLASSES, patch_size=model_config.patch_size,
                 grid=parse_grid(model_config.grid), width=model_config.d_model, num_heads=model_config.num_heads,
                 num_blocks=model_config.num_blocks, mlp_ratio=model_config.mlp_ratio,
                 pool=model_config.get("pool", "token"),
                 scan_layers=model_config.scan_layers,
                 remat=model_config.remat, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


@task_lib.register("digits")
class DigitsTask(task_lib.Task):
  """Classify the bundled digits with a ViT, a Perceiver or a Q-Former (see the module docstring)."""

  eval_metric_names = _EvalMetricNames(EVAL_METRICS + ("eval/accuracy_<HxW in data.extra_eval_grids>",))

  @classmethod
  def validate(cls, config, mode="train"):
    validation.require_choice(config, "model.name", MODELS)
    validation.require_positive(config, "model.d_model", "model.num_heads", "model.num_blocks", "model.mlp_ratio")
    validation.require_positive(config, "data.max_shift", allow_zero=True)
    if config.data.max_shift > digits.MAX_SHIFT:
      raise validation.ConfigError(
          "data.max_shift", config.data.max_shift,
          f"must be at most {digits.MAX_SHIFT}: a larger shift of the native 8x8 images (before any resize to "
          "data.grid) moves some digits entirely off the canvas")
    test_fraction = config.data.test_fraction
    if not 0.0 < test_fraction < 1.0:
      raise validation.ConfigError("data.test_fraction", test_fraction, "must be in (0, 1)")
    classes, images, num_test = digits.NUM_CLASSES, digits.NUM_IMAGES, digits.num_test_images(test_fraction)
    if not classes <= num_test <= images - classes:
      # The split is stratified: each class needs an image on both sides.
      raise validation.ConfigError("data.test_fraction", test_fraction,
                                   f"must leave at least {classes} of the {images} images (one per class) on "
                                   f"each side: in [{classes / images:.4f}, {(images - classes) / images:.4f}]")
    count = config.task.num_attention_images
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= num_test:
      raise validation.ConfigError("task.num_attention_images", count,
                                   f"must be an integer in [0, {num_test}], the test images at "
                                   f"data.test_fraction={test_fraction}")
    train_grid = parse_grid(config.data.grid, "data.grid")
    extra_grids = _grids(config.data.extra_eval_grids, "data.extra_eval_grids")
    best, logged = config.checkpoint.best_metric, [f"eval/accuracy_{h}x{w}" for h, w in extra_grids]
    if best.startswith("eval/accuracy_") and best not in logged:
      raise validation.ConfigError("checkpoint.best_metric", best, "allowed are '' (no best checkpoint) or "
                                   f"{list(EVAL_METRICS) + logged}")
    name = config.model.name
    if name in ("perceiver", "vit"):
      validation.require_positive(config, "model.patch_size")
      patch = config.model.patch_size
      for grid in [train_grid] + extra_grids:
        if grid[0] % patch or grid[1] % patch:
          raise validation.ConfigError("model.patch_size", patch, f"must divide every image grid, got {grid}")
      parse_grid(config.model.grid, "model.grid")
    if name == "perceiver":
      validation.require_choice(config, "model.position_encoding", latent_reader.GRID_ENCODINGS)
      validation.require_positive(config, "model.num_latents", "model.num_repeats")
    if name == "vit":
      validation.require_choice(config, "model.pool", vit.POOLS)
    if name == "qformer":
      validation.require_choice(config, "model.connector", latent_reader.CONNECTORS)
      validation.require_positive(config, "model.num_queries", "model.cross_attention_every",
                                  "model.num_consumer_blocks")
      if mode == "train":  # eval and infer take the encoder from the run's record (see __init__)
        encoder_run, source = _encoder_run_config(config.model.encoder_workdir, config.model.encoder_config)
        _check_encoder_patch(config, encoder_run.model, source)

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    self.split = digits.load_digits_split(test_fraction=config.data.test_fraction,
                                          split_seed=config.data.split_seed)
    self.grid = parse_grid(config.data.grid, "data.grid")
    self.extra_grids = _grids(config.data.extra_eval_grids, "data.extra_eval_grids")
    # The frozen encoder: its model config, and in training its parameters (a pure dict). Eval and infer
    # restore them with the rest of the Q-Former's checkpoint, so they need only its structure.
    self.encoder_config = self.encoder_weights = None
    if config.model.name == "qformer":
      if mode == "train":
        self.encoder_config, self.encoder_weights = self._load_encoder()
      else:
        self.encoder_config = self._recorded_encoder_config()

  # --- the frozen encoder -----------------------------------------------------------------------

  def _read_record(self) -> dict | None:
    path = os.path.join(self.workdir, ENCODER_RECORD) if self.workdir else ""
    if not os.path.isfile(path):
      return None
    with open(path) as f:
      return json.load(f)

  def _write_record(self, encoder_workdir: str, encoder_config: ConfigDict):
    """Records in this run's workdir where its encoder run is and the encoder's model config."""
    record = {"encoder_workdir": encoder_workdir, "model": encoder_config.to_dict()}
    if not self.workdir or jax.process_index() != 0 or self._read_record() == record:
      return
    path = os.path.join(self.workdir, ENCODER_RECORD)
    with open(path + ".tmp", "w") as f:
      json.dump(record, f, indent=2, sort_keys=True)
    os.replace(path + ".tmp", path)  # never half-written for a process that reads it

  def _recorded_encoder_config(self) -> ConfigDict:
    """The encoder's model config for eval and infer, without training or reading the encoder run: from
    this run's record, or for a run older than the record, the encoder run's resolved config or else
    model.encoder_config (a wrong guess stops the restore with a CheckpointMismatch)."""
    record = self._read_record()
    if record is not None:
      encoder_config, source = ConfigDict(record["model"]), os.path.join(self.workdir, ENCODER_RECORD)
    else:
      encoder_run, source = _encoder_run_config(self.config.model.encoder_workdir, self.config.model.encoder_config)
      encoder_config = encoder_run.model
    _check_encoder_patch(self.config, encoder_config, source)
    return encoder_config

  def _load_encoder(self):
    """(ViT model config, its trained parameters as a pure dict), training the ViT first if needed.

    The encoder run is the one recorded in this run's workdir, else model.encoder_workdir from the current
    directory. One that did not reach its total_steps is resumed to the end first; when SIGTERM or Ctrl-C
    stops it, the whole run stops (EncoderRunStopped, status 0) rather than freeze a half-trained encoder.
    """
    from xattn_jax.training import loop  # the loop imports tasks; import it only when needed
    record = self._read_record()
    workdir = record["encoder_workdir"] if record else os.path.abspath(self.config.model.encoder_workdir)
    encoder_run, source = _encoder_run_config(workdir, self.config.model.encoder_config)
    _check_encoder_patch(self.config, encoder_run.model, source)  # before any training
    if not _encoder_finished(workdir):
      logging.info("Training the frozen encoder first in %s", workdir)
      loop.run(encoder_run, workdir, "train")
      if not _encoder_finished(workdir):  # the loop returns early only when stopped by a signal
        message = (f"The encoder run in {workdir} was stopped (SIGTERM or Ctrl-C) at step "
                   f"{max(checkpoints_lib.step_numbers(workdir), default=0)} of {encoder_run.total_steps} "
                   "and saved; run the same command again to resume it, then train the Q-Former")
        logging.warning("%s", message)
        raise EncoderRunStopped(message)
    with open(os.path.join(workdir, "config.json")) as f:
      encoder_config = ConfigDict(json.load(f)).model
    self._write_record(workdir, encoder_config)
    abstract = nnx.eval_shape(lambda: make_vit(encoder_config, rngs=nnx.Rngs(params=0, dropout=0)))
    restored = checkpoints_lib.restore_model_from(os.path.join(workdir, "checkpoints"),
                                                  nnx.to_pure_dict(nnx.state(abstract)))
    # Only the parameters: the encoder's RNG state (dropout keys) plays no part in a frozen encoder.
    return encoder_config, _select(restored, nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))

  # --- the contract -----------------------------------------------------------------------------

  def make_model(self, rngs, *, dtype, param_dtype):
    model = self.config.model
    # The layers' Dropout modules want a "dropout" stream at construction even when they never drop.
    rngs = nnx.Rngs(params=rngs.params(), dropout=rngs.params())
    if model.name == "vit":
      return make_vit(model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if model.name == "perceiver":
      return latent_reader.Perceiver(
          num_classes=digits.NUM_CLASSES, patch_size=model.patch_size, grid=parse_grid(model.grid),
          width=model.d_model, num_latents=model.num_latents, num_heads=model.num_heads,
          num_blocks=model.num_blocks, num_repeats=model.num_repeats, mlp_ratio=model.mlp_ratio,
          position_encoding=model.position_encoding, scan_layers=model.scan_layers,
          remat=model.remat, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    encoder = make_vit(self.encoder_config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if self.encoder_weights is not None:  # None in eval / infer: the checkpoint restore sets them
      state = nnx.state(encoder, nnx.Param)
      nnx.replace_by_pure_dict(state, self.encoder_weights)
      nnx.update(encoder, state)
    return latent_reader.QFormer(
        encoder, num_classes=digits.NUM_CLASSES, connector=model.connector, num_queries=model.num_queries,
        width=model.d_model, num_heads=model.num_heads, num_blocks=model.num_blocks,
        cross_attention_every=model.cross_attention_every, num_consumer_blocks=model.num_consumer_blocks,
        mlp_ratio=model.mlp_ratio, dtype=dtype, param_dtype=param_dtype,
        rngs=rngs)

  def train_batch(self, step, *, process_index, process_count):
    return digits.train_batch(self.split, step, seed=self.config.seed, batch_size=self.config.batch_size,
                              process_index=process_index, process_count=process_count, grid=self.grid,
                              max_shift=self.config.data.max_shift)

  def _tokens_handed_on(self, model, images) -> int:
    """N for the readers; the ViT's whole sequence, 1 + M patches, for the MLP connector and the ViT."""
    if isinstance(model, latent_reader.Perceiver):
      return model.latents.queries.shape[0]
    if isinstance(model, latent_reader.QFormer) and model.connector == "qformer":
      return model.queries.queries.shape[0]
    patch = model.encoder.patch_size if isinstance(model, latent_reader.QFormer) else model.patch_size
    return 1 + (images.shape[1] // patch) * (images.shape[2] // patch)

  def loss(self, model, batch, *, rngs):
    del rngs  # no dropout: the digits models regularise through data.max_shift augmentation
    logits = model(batch["images"], deterministic=True)
    loss_sum, count = optim.cross_entropy(logits, batch["labels"], label_smoothing=self.config.task.label_smoothing)
    accuracy = jnp.mean(jnp.argmax(logits, axis=-1) == batch["labels"])
    return loss_sum / count, {"accuracy": accuracy,
                              "tokens_handed_on": jnp.float32(self._tokens_handed_on(model, batch["images"]))}

  def eval_batches(self, *, process_index, process_count):
    return digits.eval_batches(self.split, self.config.eval_batch_size, process_index=process_index,
                               process_count=process_count, grid=self.grid)

  def eval_metrics(self, model, batch):
    logits = model(batch["images"])
    weights = batch["weights"]
    loss_sum, weight_sum = optim.cross_entropy(logits, batch["labels"], weights)
    correct = (jnp.argmax(logits, axis=-1) == batch["labels"]) * weights
    tokens = self._tokens_handed_on(model, batch["images"])
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
    """Accuracy on the test images resized to each extra grid; attention maps into the workdir."""
    results = {}
    for grid in self.extra_grids:
      predictions = self._classify(model, digits.resize_images(self.split.test_images, grid))
      results[f"accuracy_{grid[0]}x{grid[1]}"] = float(np.mean(predictions == self.split.test_labels))
    if self.workdir and jax.process_index() == 0 and self.config.task.num_attention_images:
      self.write_attention_maps(model, os.path.join(self.workdir, "attention_maps"))
    return results

  def write_attention_maps(self, model, directory: str) -> list[str]:
    """One PNG per test image: the image next to each query's attention over it (heads averaged).

    For the Q-Former the class token's share of the attention is left out of the maps (it has no place
    on the image), so a query's map sums to one minus what it gives the class token.
    """
    if not hasattr(model, "cross_attention_weights") or getattr(model, "connector", "qformer") != "qformer":
      return []
    from xattn_jax.tasks.digits import plots as digits_plots  # matplotlib only when pictures are asked for
    count = self.config.task.num_attention_images
    images = digits.resize_images(self.split.test_images[:count], self.grid)
    weights = np.asarray(nnx.jit(lambda m, x: m.cross_attention_weights(x))(
        model, self.split.standardize(images)[..., None]))  # [count, heads, N, M]
    if isinstance(model, latent_reader.QFormer):
      patch, weights = model.encoder.patch_size, weights[..., 1:]  # drop the class token's column
    else:
      patch = model.patch_size
    grid = (self.grid[0] // patch, self.grid[1] // patch)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for k in range(count):
      path = os.path.join(directory, f"test_{k}.png")
      digits_plots.plot_query_attention(images[k], weights[k].mean(axis=0).reshape(-1, *grid), path,
                                        title=f"test image {k} (label {self.split.test_labels[k]})")
      paths.append(path)
    return paths

  def _read_input(self, line: str) -> np.ndarray:
    """Images [n, H, W] in [0, 1] named by one input line."""
    if line.startswith("test:"):
      index = int(line[len("test:"):])
      if not 0 <= index < len(self.split.test_labels):
        raise ValueError(f"{line!r}: the test set has images 0..{len(self.split.test_labels) - 1}")
      return self.split.test_images[index][None]
    if line.endswith(".npy"):
      array = np.load(line).astype(np.float32)
      if array.ndim == 3:  # a stack of images, each read like a single one
        return digits.to_unit_range(array)
    return digits.read_image_file(line)[None]

  def infer(self, model, lines):
    """One line per input: the input name, a tab, the predicted digit (several for a stack)."""
    outputs = []
    for index, line in enumerate(lines):
      try:
        images = self._read_input(line.strip())
        if not np.isfinite(images).all():
          raise ValueError(f"{line.strip()!r} holds NaN or infinite pixel values")
      except (ValueError, OSError) as e:
        raise task_lib.InputLineError(index, str(e)) from None
      predictions = self._classify(model, digits.resize_images(images, self.grid))
      outputs.append(f"{line.strip()}\t{' '.join(str(p) for p in predictions)}")
    return outputs
