"""Learned queries (BLIP-2 Q-Former) over a frozen ViT's patch features, or the LLaVA-style MLP connector
(`configs/qformer_digits.py`; `model.connector`, see CONNECTORS).

The frozen encoder is the ViT run in `model.encoder_workdir`, trained with the config file
`model.encoder_config` ("path.py[:arg]"): the task declares it as its dependency, so launch.py trains
(or resumes) it there first when that workdir holds no finished run (`xattn_jax.training.dependencies`).
This task only loads it: the run's resolved config gives the architecture, and the checkpoint that run names
as its result the weights (its newest; its best by checkpoint.best_metric where its checkpoint.eval_from is
"best", as its --mode=eval reads it). Training records in the Q-Former's workdir (`encoder.json`) where that
run is (an absolute path), the step read and the encoder's model config; a resumed training reads the encoder
from there, and eval and infer read only this record, since the Q-Former's checkpoints hold the frozen
weights, so they never train, nor read the encoder run, whatever the current directory.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import jax
from flax import nnx
from ml_collections import ConfigDict

from xattn_jax.data import digits
from xattn_jax.models import latent_reader
from xattn_jax.tasks.digits import common, vit as vit_task
from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import dependencies as dependencies_lib
from xattn_jax.training import records, task as task_lib, validation
from xattn_jax.training import workdir as workdir_lib

ENCODER_RECORD = "encoder.json"  # in a Q-Former workdir: {"encoder_workdir": absolute path, "encoder_step", "model"}


@dataclasses.dataclass(frozen=True)
class Connector:
  """What the task reads of one `latent_reader.QFormer` connector."""
  tokens_handed_on: Callable  # (model, images [b, H, W, 1]) -> how many tokens it hands on (an int)
  has_queries: bool  # whether it has queries whose attention over the patches can be drawn


# What the task reads of each connector the model offers (`latent_reader.CONNECTORS` owns the names, which
# config checks and errors read).
CONNECTORS = {
    "qformer": Connector(lambda model, images: model.queries.queries.shape[0], has_queries=True),  # N
    # LLaVA-style: one token per encoder output, the class token and every patch (1 + M).
    "llava": Connector(lambda model, images: 1 + common.patch_tokens(images, model.encoder.patch_size),
                     has_queries=False),
}
if set(CONNECTORS) != set(latent_reader.CONNECTORS):
  raise ImportError(f"tasks.digits.qformer: CONNECTORS {sorted(CONNECTORS)} must cover the model's "
                    f"latent_reader.CONNECTORS {sorted(latent_reader.CONNECTORS)}")


def _read_record(workdir: str | None) -> dict | None:
  return records.read_record(os.path.join(workdir, ENCODER_RECORD), (
      "restore it from a backup, or move it aside: training on then freezes the run in model.encoder_workdir, "
      "eval and infer read the encoder's model from that run's config.json")) if workdir else None


def _check_encoder_patch(config, encoder_model, source: str):
  """Every image grid (data.grid, data.extra_eval_grids) must split into the frozen encoder's patches."""
  patch = encoder_model.get("patch_size")
  if isinstance(patch, bool) or not isinstance(patch, int) or patch < 1:
    raise validation.ConfigError("model.encoder_config", config.model.encoder_config,
                                 f"the encoder's model.patch_size={patch!r} ({source}) must be a positive integer")
  for field, text in (("data.grid", config.data.grid), ("data.extra_eval_grids", config.data.extra_eval_grids)):
    for height, width in common.parse_grids(text, field):
      if height % patch or width % patch:
        raise validation.ConfigError(
            field, text, f"every grid must be divisible by the frozen encoder's patch size {patch} "
            f"(model.patch_size of {source}), got {height}x{width}")


class QFormerTask(common.DigitsBase):
  """Classify the digits from a frozen ViT's features, read by learned queries or an MLP connector."""

  @classmethod
  def validate(cls, config, mode="train"):
    super().validate(config, mode)
    validation.require_choice(config, "model.connector", latent_reader.CONNECTORS)
    validation.require_positive(config, "model.num_queries", "model.cross_attention_every",
                                "model.num_consumer_blocks")
    if mode == "train":  # eval and infer take the encoder from the run's record (see __init__)
      encoder = dependencies_lib.load_config(config.model.encoder_config, "model.encoder_config")
      _check_encoder_patch(config, encoder.model, config.model.encoder_config)

  @classmethod
  def dependencies(cls, config, workdir):
    """The ViT run to freeze: the one recorded in this run's workdir, else model.encoder_workdir (from the
    current directory), trained with model.encoder_config."""
    record = _read_record(workdir)
    return [task_lib.Dependency(
        workdir=record["encoder_workdir"] if record else config.model.encoder_workdir,
        config=config.model.encoder_config, workdir_field="model.encoder_workdir", record=ENCODER_RECORD,
        config_field="model.encoder_config")]

  def __init__(self, config, workdir=None, mode="train"):
    super().__init__(config, workdir, mode)
    # The frozen encoder: its model config, and in training its parameters (a pure dict). Eval and infer
    # restore them with the rest of the Q-Former's checkpoint, so they need only its structure.
    self.connector = CONNECTORS[config.model.connector]
    self.encoder_weights = None
    if mode == "train":
      self.encoder_config, self.encoder_weights = self._load_encoder()
    else:
      self.encoder_config = self._recorded_encoder_config()

  # --- the frozen encoder -----------------------------------------------------------------------

  def _write_record(self, encoder_workdir: str, encoder_config: ConfigDict, step: int):
    """Records in this run's workdir where its encoder run is, the step read and the encoder's model config."""
    record = {"encoder_workdir": encoder_workdir, "encoder_step": step, "model": encoder_config.to_dict()}
    if not self.workdir or jax.process_index() != 0 or _read_record(self.workdir) == record:
      return
    # never half-written for a process that reads it
    records.write_atomically(os.path.join(self.workdir, ENCODER_RECORD),
                                 json.dumps(record, indent=2, sort_keys=True))

  def _recorded_encoder_config(self) -> ConfigDict:
    """The encoder's model config for eval and infer, without training or reading the encoder run: from
    this run's record, or for a run older than the record, the encoder run's resolved config or else
    model.encoder_config (a wrong guess stops the restore with a CheckpointMismatch)."""
    record = _read_record(self.workdir)
    if record is not None:
      encoder_config, source = ConfigDict(record["model"]), os.path.join(self.workdir, ENCODER_RECORD)
    elif os.path.isfile(os.path.join(self.config.model.encoder_workdir, "config.json")):
      encoder_config = workdir_lib.stored_config(self.config.model.encoder_workdir).model
      source = f"the run in {self.config.model.encoder_workdir}"
    else:
      source = self.config.model.encoder_config
      encoder_config = dependencies_lib.load_config(source, "model.encoder_config").model
    _check_encoder_patch(self.config, encoder_config, source)
    return encoder_config

  def _load_encoder(self):
    """(ViT model config, its trained parameters as a pure dict) of the finished dependency run."""
    dependency, = self.dependencies(self.config, self.workdir)
    if not dependencies_lib.is_finished(dependency):
      raise validation.ConfigError(
          "model.encoder_workdir", self.config.model.encoder_workdir,
          f"{dependency.workdir} holds no finished encoder run; launch.py trains it first (from Python, call "
          "xattn_jax.training.dependencies.resolve(config, workdir) before loop.run)")
    encoder_config = workdir_lib.stored_config(dependency.workdir).model
    _check_encoder_patch(self.config, encoder_config, f"the run in {dependency.workdir}")
    step = checkpoints_lib.result_step(dependency.workdir)  # what its --mode=eval reads (checkpoint.eval_from)
    self._write_record(dependency.workdir, encoder_config, step)
    return encoder_config, checkpoints_lib.restore_params(
        dependency.workdir, step, lambda: vit_task.make_vit(encoder_config, rngs=nnx.Rngs(params=0, dropout=0)))

  # --- the model --------------------------------------------------------------------------------

  def make_model(self, rngs, *, dtype, param_dtype):
    model = self.config.model
    # The layers' Dropout modules want a "dropout" stream at construction even when they never drop.
    rngs = nnx.Rngs(params=rngs.params(), dropout=rngs.params())
    encoder = vit_task.make_vit(self.encoder_config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if self.encoder_weights is not None:  # None in eval / infer: the checkpoint restore sets them
      state = nnx.state(encoder, nnx.Param)
      nnx.replace_by_pure_dict(state, self.encoder_weights)
      nnx.update(encoder, state)
    return latent_reader.QFormer(
        encoder, num_classes=digits.NUM_CLASSES, connector=model.connector, num_queries=model.num_queries,
        width=model.d_model, num_heads=model.num_heads, num_blocks=model.num_blocks,
        cross_attention_every=model.cross_attention_every, num_consumer_blocks=model.num_consumer_blocks,
        mlp_ratio=model.mlp_ratio, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def loaded_params(self):
    return None if self.encoder_weights is None else {"encoder": self.encoder_weights}

  def tokens_handed_on(self, model, images):
    return self.connector.tokens_handed_on(model, images)

  def query_attention(self, model, images):
    """The queries' attention over the patches; the class token's share is left out of the maps (it has
    no place on the image), so a query's map sums to one minus what it gives the class token."""
    if not self.connector.has_queries:
      return None
    weights = nnx.jit(lambda m, x: m.cross_attention_weights(x))(model, images)  # [n, heads, N, 1 + M]
    return weights[..., 1:], model.encoder.patch_size
