"""The VLM's frozen parts: the image encoder and the language model, each a finished run of its own.

They are declared as dependencies that launch.py trains first when their workdirs hold no finished run: the
image encoder (`model.encoder_config`, e.g. configs/vlm_encoder.py, in `model.encoder_workdir`) and the language
model pretrained on the task's text alone (`model.lm_config`, e.g. configs/vlm_lm.py, in `model.lm_workdir`;
SentencePiece with IMAGE_TOKEN one piece), each read at the checkpoint its run names as its result
(`checkpoints.result_step`: its newest, or its best where its checkpoint.eval_from is "best"). Training records
in the VLM's workdir where they are, the steps read, their model configs and their weights' digests
(FROZEN_RECORD), and copies the LM's tokenizer there: eval and infer read only that workdir (its checkpoints hold
the frozen weights too).

A user's pairs (data.source="tsv") come with their own LM and image encoder: configs/vlm_tsv.py's
model.lm_config (configs/vlm_lm.py:text=pairs) pretrains the LM on the text of data.train_file, so it can write
the captions' words (`lm_config`; the digits' LM knows only the digits' 39 words), and its
model.encoder_config (configs/vlm_encoder.py:data=pairs, task vlm_pairs_encoder) trains the encoder on its
images (`encoder_config`), at the canvas data.canvas, grey or RGB (data.color).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from ml_collections import ConfigDict

from xattn_jax.data import tokenizers, vlm_digits
from xattn_jax.models import connectors
from xattn_jax.tasks.lm import text as lm_task
from xattn_jax.tasks.vlm import encoder as encoder_task
from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import dependencies as dependencies_lib
from xattn_jax.training import records, task as task_lib, validation
from xattn_jax.training import workdir as workdir_lib

# The tasks whose runs can be the frozen image encoder: the digit strips' reader, or one trained on a user's pairs.
ENCODER_TASKS = ("vlm_encoder", "vlm_pairs_encoder")
FROZEN_RECORD = "frozen.json"  # {"encoder_workdir", "encoder_step", "encoder_model", "encoder_digest", "lm_workdir",
#                                  "lm_step", "lm_model", "lm_digest", "vocab_size"}
TOKENIZER_FILE = lm_task.SPM_FILE


def _read_record(workdir: str | None) -> dict | None:
  return records.read_record(os.path.join(workdir, FROZEN_RECORD), (
      "restore it from a backup: it names the encoder and LM runs this VLM froze and their steps, which eval, "
      "infer and training on read")) if workdir else None


def _weights_digest(weights: dict) -> str:
  """SHA-256 of nested dict `weights` (as `checkpoints.restore_params` returns them): each array's path, dtype,
  shape and bytes."""
  digest = hashlib.sha256()
  leaves = {jax.tree_util.keystr(path): value for path, value in jax.tree_util.tree_leaves_with_path(weights)}
  for name in sorted(leaves):
    value = np.ascontiguousarray(leaves[name])
    digest.update(f"{name} {value.dtype} {value.shape}".encode())
    digest.update(value.tobytes())
  return digest.hexdigest()


def _set_params(module: nnx.Module, weights: dict) -> None:
  """Loads nested dict `weights` (as `checkpoints.restore_params` returns them) into the module's `nnx.Param`s."""
  state = nnx.state(module, nnx.Param)
  nnx.replace_by_pure_dict(state, weights)
  nnx.update(module, state)


def lm_model_config(lm_model: ConfigDict, image_positions: str) -> ConfigDict:
  """The frozen LM's model config as the VLM builds it: M-RoPE (same weights) when the images take it."""
  lm_model = ConfigDict(lm_model.to_dict())
  if image_positions == "mrope":
    lm_model.position_encoding = "mrope"
  return lm_model


# --- config -------------------------------------------------------------------------------------


def check_configs(config) -> None:
  """The declared frozen runs' configs must fit the VLM's: an encoder task of ENCODER_TASKS reading its images
  (canvas, colour, scale), and a SentencePiece LM with IMAGE_TOKEN one piece (rope or mrope for mrope images)."""
  encoder = dependencies_lib.load_config(config.model.encoder_config, "model.encoder_config")
  lm = dependencies_lib.load_config(config.model.lm_config, "model.lm_config")
  if encoder.task.name not in ENCODER_TASKS:
    raise validation.ConfigError("model.encoder_config", config.model.encoder_config,
                                 f"must train a run of task {' or '.join(ENCODER_TASKS)}, got "
                                 f"task.name={encoder.task.name!r}")
  if encoder.task.name == "vlm_pairs_encoder" and config.data.source != "tsv":
    raise validation.ConfigError("model.encoder_config", config.model.encoder_config,
                                 "an encoder trained on a user's pairs reads a user's pairs: data.source='tsv' "
                                 f"only, got data.source={config.data.source!r}")
  encoder_canvas = encoder_task.canvas(encoder)
  if encoder_task.grey(encoder) != encoder_task.grey(config):
    raise validation.ConfigError("data.color", config.data.get("color", False),
                                 f"must be the frozen encoder's data.color, {not encoder_task.grey(encoder)} "
                                 f"({config.model.encoder_config})")
  if encoder.data.get("canvas"):  # a user's pairs: the VLM's canvas is the encoder's
    if encoder_canvas != encoder_task.canvas(config):
      raise validation.ConfigError("data.canvas", config.data.get("canvas", ""),
                                   f"must be the frozen encoder's canvas, {encoder.data.canvas!r} "
                                   f"({config.model.encoder_config})")
  elif config.data.get("canvas"):
    raise validation.ConfigError("data.canvas", config.data.canvas,
                                 f"the digits' encoder reads its strips' canvas {encoder_canvas}: must be empty "
                                 f"with {config.model.encoder_config} (configs/vlm_tsv.py:image_encoder=digits)")
  elif encoder.data.scale != config.data.scale:
    raise validation.ConfigError("data.scale", config.data.scale,
                                 f"must be the frozen encoder's, {encoder.data.scale} "
                                 f"({config.model.encoder_config}; configs/vlm_digits.py:scale=S names the encoder "
                                 f"trained at S)")
  elif encoder_canvas != encoder_task.canvas(config):
    raise validation.ConfigError("data.max_digits", config.data.max_digits,
                                 f"the canvas {encoder_task.canvas(config)} (data.max_digits, data.scale) must be "
                                 f"the frozen encoder's {encoder_canvas} ({config.model.encoder_config})")
  if lm.task.name != "lm" or lm.data.tokenizer != "sentencepiece" or \
      vlm_digits.IMAGE_TOKEN not in tuple(lm.data.get("single_piece_words", ())):
    raise validation.ConfigError("model.lm_config", config.model.lm_config,
                                 f"must train an lm run with data.tokenizer='sentencepiece' and "
                                 f"{vlm_digits.IMAGE_TOKEN!r} in data.single_piece_words (one marker id)")
  if config.model.image_positions == "mrope" and lm.model.position_encoding not in ("rope", "mrope"):
    raise validation.ConfigError("model.image_positions", "mrope", f"needs a rope or mrope LM, got "
                                 f"position_encoding={lm.model.position_encoding!r} ({config.model.lm_config})")
  # The connector's attention splits these widths into model.num_heads heads (connectors.py): a width they do not
  # divide failed in MultiHeadAttention's ValueError when the model was built, after the frozen runs had trained.
  parts = {"lm": ("the frozen LM's model.d_model", lm.model.d_model, config.model.lm_config),
           "encoder": ("the frozen encoder's model.d_model", encoder.model.d_model, config.model.encoder_config)}
  kind = connectors.CONNECTORS[config.model.connector]
  for what, width, spec in (parts[part] for part in kind.frozen_widths(config.model)):
    if width % config.model.num_heads:
      raise validation.ConfigError("model.num_heads", config.model.num_heads,
                                   f"must divide {what}, {width} ({spec}): the {config.model.connector} connector's "
                                   "attention splits it into these heads")


def _on_the_pairs(config, field: str, reads_pairs):
  """The frozen part's declared config `field` (a file spec), or, for a user's pairs and a config that
  trains on pairs (`reads_pairs(loaded)`) but names no files, that config loaded with this run's
  data.train_file / data.eval_file (absolute)."""
  spec = validation.get_field(config, field)
  if config.data.source != "tsv":
    return spec
  loaded = dependencies_lib.load_config(spec, field)
  if not reads_pairs(loaded) or loaded.data.train_file or loaded.data.eval_file:
    return spec
  loaded.data.train_file = os.path.abspath(config.data.train_file)
  # none: each holds out the same pairs of the training file (image_text.held_out_pairs)
  loaded.data.eval_file = os.path.abspath(config.data.eval_file) if config.data.eval_file else ""
  return loaded


def lm_config(config):
  """The frozen LM's declared config (`_on_the_pairs`): configs/vlm_lm.py:text=pairs learns the words of the
  user's captions."""
  return _on_the_pairs(config, "model.lm_config", lambda lm: lm.data.get("file_format") == "image_text")


def encoder_config(config):
  """The frozen encoder's declared config (`_on_the_pairs`): configs/vlm_encoder.py:data=pairs learns the
  user's images."""
  return _on_the_pairs(config, "model.encoder_config", lambda encoder: encoder.task.name == "vlm_pairs_encoder")


def dependencies(config, workdir) -> list[task_lib.Dependency]:
  """The frozen encoder and LM runs: those recorded in this run's workdir, else the configured ones."""
  record = _read_record(workdir)
  lm, encoder = lm_config(config), encoder_config(config)
  return [
      task_lib.Dependency(workdir=record["encoder_workdir"] if record else config.model.encoder_workdir,
                          config=encoder, workdir_field="model.encoder_workdir", record=FROZEN_RECORD,
                          config_field="model.encoder_config" if isinstance(encoder, str) else "",
                          # the pairs encoder only evaluates on the VLM's eval file: another one is the same
                          unchecked_fields=() if isinstance(encoder, str) else ("data.eval_file",)),
      task_lib.Dependency(workdir=record["lm_workdir"] if record else config.model.lm_workdir,
                          config=lm, workdir_field="model.lm_workdir", record=FROZEN_RECORD,
                          config_field="model.lm_config" if isinstance(lm, str) else "",
                          # the pairs LM only evaluates on the VLM's eval file: another one is the same LM
                          unchecked_fields=() if isinstance(lm, str) else ("data.eval_file",)),
  ]


# --- reading the runs ---------------------------------------------------------------------------


def load(config, workdir, mode: str):
  """(record, tokenizer path, {"encoder": params, "lm": params} or None) of the frozen parts: in training those
  of the finished dependency runs (recorded in workdir), in eval and infer those workdir's FROZEN_RECORD names
  (no weights: the checkpoint restore sets them)."""
  if mode == "train":
    return _load_runs(config, workdir)
  record = _read_record(workdir)
  if record is None:
    raise validation.ConfigError("workdir", workdir, f"holds no {FROZEN_RECORD}: train the VLM there first")
  return record, os.path.join(workdir, TOKENIZER_FILE), None


def _load_runs(config, workdir):
  """(record, tokenizer path, {"encoder": params, "lm": params}) of the finished dependency runs."""
  encoder_dep, lm_dep = dependencies(config, workdir)
  for dependency in (encoder_dep, lm_dep):
    if not dependencies_lib.is_finished(dependency):
      raise validation.ConfigError(
          dependency.workdir_field, dependency.workdir, "holds no finished run; launch.py trains it first (from "
          "Python, call xattn_jax.training.dependencies.resolve(config, workdir) before loop.run)")
  encoder_model = workdir_lib.stored_config(encoder_dep.workdir).model
  lm_run = workdir_lib.stored_config(lm_dep.workdir)
  tokenizer_path = os.path.join(lm_dep.workdir, TOKENIZER_FILE)
  vocab_size = tokenizers.SentencePieceTokenizer(tokenizer_path).vocab_size
  # Each frozen part is read at the step its run names as its result (checkpoint.eval_from), as its
  # --mode=eval reads it: an early-stopped LM with eval_from='best' hands on its best weights.
  encoder_step, lm_step = (checkpoints_lib.result_step(d.workdir) for d in (encoder_dep, lm_dep))
  weights = {
      "encoder": checkpoints_lib.restore_params(encoder_dep.workdir, encoder_step, lambda: encoder_task.make_encoder(
          encoder_model, rngs=nnx.Rngs(params=0, dropout=0))),
      "lm": checkpoints_lib.restore_params(lm_dep.workdir, lm_step, lambda: lm_task.make_language_model(
          lm_run.model, vocab_size, max_length=lm_run.model.max_length, dtype=jnp.float32,
          param_dtype=jnp.float32, rngs=nnx.Rngs(params=0, dropout=0))),
  }
  record = {"encoder_workdir": encoder_dep.workdir, "encoder_step": encoder_step,
            "encoder_model": encoder_model.to_dict(), "encoder_digest": _weights_digest(weights["encoder"]),
            "lm_workdir": lm_dep.workdir, "lm_step": lm_step, "lm_model": lm_run.model.to_dict(),
            "lm_digest": _weights_digest(weights["lm"]), "vocab_size": vocab_size}
  _check_same_frozen_parts(workdir, record, {"encoder": encoder_dep, "lm": lm_dep})
  if workdir and jax.process_index() == 0:
    os.makedirs(os.path.join(workdir, os.path.dirname(TOKENIZER_FILE)), exist_ok=True)
    shutil.copyfile(tokenizer_path, os.path.join(workdir, TOKENIZER_FILE))
    if _read_record(workdir) != record:
      records.write_atomically(os.path.join(workdir, FROZEN_RECORD), json.dumps(record, indent=2, sort_keys=True))
  return record, tokenizer_path, weights


def _check_same_frozen_parts(workdir: str | None, record: dict, dependencies: dict) -> None:
  """A run trained on from its checkpoints must read the frozen weights it froze: the training features it
  caches (and distills from) come from the runs it loads, its checkpoints hold the weights it froze. Another run
  at a recorded path (trained there again after the run was copied or moved, or trained on since) is refused in
  one line. A record from before the digests were kept cannot say, and is not checked."""
  if not workdir or not checkpoints_lib.step_numbers(workdir):
    return  # nothing trained yet: this run freezes what it loads now
  previous = _read_record(workdir) or {}
  for part, dependency in dependencies.items():
    was = previous.get(f"{part}_digest")
    if was is not None and was != record[f"{part}_digest"]:
      raise validation.ConfigError(
          dependency.workdir_field, dependency.workdir,
          f"holds other weights (step {record[f'{part}_step']}) than the run in {workdir} froze (step "
          f"{previous.get(f'{part}_step')}, {FROZEN_RECORD}): another run was trained there since; put back the "
          f"run it froze, or write its path as {part}_workdir in {os.path.join(workdir, FROZEN_RECORD)}; "
          "eval and infer read only this run's checkpoints")



# --- building the parts -------------------------------------------------------------------------


def make_lm(lm_model, vocab_size: int, weights: dict | None, *, dtype=jnp.float32, param_dtype=jnp.float32,
            rngs=None):
  """The frozen language model of model config `lm_model`, with `weights` (its pure dict of params) when given."""
  lm = lm_task.make_language_model(lm_model, vocab_size, max_length=lm_model.max_length, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs or nnx.Rngs(params=0, dropout=0))
  if weights is not None:
    _set_params(lm, weights)
  return lm


def make_encoder(encoder_model, weights: dict | None, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs=None):
  """The frozen image encoder of model config `encoder_model`, with `weights` (its pure dict of params) when
  given."""
  encoder = encoder_task.make_encoder(encoder_model, dtype=dtype, param_dtype=param_dtype,
                                      rngs=rngs or nnx.Rngs(params=0, dropout=0))
  if weights is not None:
    _set_params(encoder, weights)
  return encoder
