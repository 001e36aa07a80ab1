"""Orbax checkpoints of a run: the last K steps plus the best by an eval metric.

Each step directory holds three items: `model` (the nnx.State of the model), `optimizer` (its
nnx.State) and `meta` (JSON: step, the run's RNG key data, the metrics at that step). `init_from`
reads only `model`, so a different optimizer does not stop it.

A checkpoint that cannot be read (truncated files) is reported and the next older one is tried; training
moves it to `<workdir>/corrupt_checkpoints/` (so that saving that step again does not collide), eval and
infer only read and leave it where it is. A readable checkpoint whose
parameters have other names or shapes than the config builds (another vocabulary, another size) is
not damaged: restoring stops with a `CheckpointMismatch` naming the first differing parameter, and
the checkpoints stay where they are.
"""
from __future__ import annotations

import os
import shutil
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from absl import logging
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from xattn_jax.training import records
from xattn_jax.training.errors import RunError

ITEMS = ("model", "optimizer", "meta")


def abstract_with_shardings(abstract_state, shardings):
  """ShapeDtypeStructs carrying the target shardings, for orbax to restore straight into place."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract_state, shardings)


def step_numbers(workdir: str) -> list[int]:
  """The steps saved under `<workdir>/checkpoints`, read from the directory names alone (no orbax
  manager, which would create the directory)."""
  directory = os.path.join(workdir, "checkpoints")
  return sorted(int(name) for name in os.listdir(directory) if name.isdigit()) if os.path.isdir(directory) else []


class CheckpointMismatch(ValueError):
  """The checkpoint is readable but holds another model than the config builds."""


def _path_name(path) -> str:
  return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _shapes(tree) -> dict[str, tuple]:
  """{parameter name: shape}; a typed PRNG key counts as its key data (stored as [..., 2] uint32)."""
  shapes = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shape = tuple(leaf.shape)
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      shape = tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, leaf.dtype)).shape)
    shapes[_path_name(path)] = shape
  return shapes


def model_mismatch(item_directory: str, abstract_model) -> str | None:
  """How the stored `model` item differs from abstract_model (names, shapes), or None when it does
  not, or when its metadata cannot be read (then it is damaged, not different)."""
  try:
    stored = _shapes(ocp.StandardCheckpointHandler().metadata(epath.Path(item_directory)))
  except Exception:  # noqa: BLE001 - unreadable metadata: a damaged checkpoint
    return None
  wanted = _shapes(abstract_model)
  # Parameters first: a differing RNG counter (e.g. one per layer of a deeper stack) would name the
  # symptom, not the cause.
  for name in sorted(set(stored) | set(wanted), key=lambda name: (".rngs." in f".{name}.", name)):
    if name not in stored:
      return f"parameter {name} {list(wanted[name])} is not in the checkpoint"
    if name not in wanted:
      return f"the checkpoint has parameter {name} {list(stored[name])} that this config does not build"
    if stored[name] != wanted[name]:
      return f"parameter {name} is {list(stored[name])} in the checkpoint, {list(wanted[name])} in this config"
  return None


# The step a checkpoint's eval metrics belong to, stored beside them: equal values rank by it.
STEP_METRIC = "checkpoint/step"


def _ranking(best_metric: str, best_mode: str):
  """The sort key orbax ranks checkpoints by (the best sorts last): best_metric, and of equal values the
  earliest step, as early stopping counts a tie as no gain (`guards.EarlyStopping`). Orbax alone keeps the
  latest of a tie. Metrics saved before the step was stored rank as step 0 (orbax's order among them)."""
  sign = 1 if best_mode == "min" else -1  # min sorts descending, max ascending
  return lambda metrics: (metrics[best_metric], sign * metrics.get(STEP_METRIC, 0))


class Checkpoints:
  """The checkpoint directory of one run (`<workdir>/checkpoints`)."""

  def __init__(self, workdir: str, *, keep: int, best_metric: str = "", best_mode: str = "min",
               read_only: bool = False):
    self.workdir = workdir
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.best_metric, self.best_mode = best_metric, best_mode
    preserve = [policies.LatestN(n=keep)]
    rank = _ranking(best_metric, best_mode)
    if best_metric:
      preserve.append(policies.BestN(get_metric_fn=rank, reverse=best_mode == "min", n=1,
                                     keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policies.AnyPreservationPolicy(preserve),
        # The policy alone keeps the best step only within one process: orbax writes a step's
        # metrics to disk (its `metrics` item) only when best_fn is set, and a resumed run's policy
        # read none back, so it deleted the best checkpoint. best_fn makes orbax store and reload them.
        best_fn=rank if best_metric else None, best_mode=best_mode,
        # Synchronous saves: when save() returns the step is on disk, so SIGTERM / SIGKILL right
        # after can never leave a half-written "latest" behind.
        enable_async_checkpointing=False,
        # Eval and infer (`read_only`) leave the temporary folders alone: one may be the save in progress of a
        # run training in the workdir, which failed when they removed it.
        cleanup_tmp_directories=not read_only, create=not read_only)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, model_state, optimizer_state, meta: dict, metrics: dict | None = None):
    if step in self.manager.all_steps():
      return
    if metrics is not None and self.best_metric not in metrics:
      metrics = None
    if metrics is not None:
      metrics = {**metrics, STEP_METRIC: step}
    self.manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(model_state), optimizer=ocp.args.StandardSave(optimizer_state),
        meta=ocp.args.JsonSave(meta)), metrics=metrics, force=True)

  def best_step(self) -> int | None:
    """The step whose eval metrics rank best by best_metric (among those kept; of equal values the earliest);
    None without any."""
    if not self.best_metric or not self.manager.all_steps():
      return None
    return self.manager.best_step()

  def improves_on_best(self, metrics: dict | None) -> bool:
    """Whether eval `metrics` rank better by best_metric than every kept step's (a tie does not: the earliest
    keeps it, as early stopping counts a tie as no gain); False without a best_metric or that metric. The loop
    saves a checkpoint at such an eval between its checkpoint steps, so that the best eval is the best
    checkpoint (`eval_from=best`, early_stop.json's step)."""
    if not self.best_metric or not metrics or self.best_metric not in metrics:
      return False
    best = self.best_step()
    stored = self.manager.metrics(best) if best is not None else None
    if not stored or self.best_metric not in stored:
      return True
    value, kept = float(metrics[self.best_metric]), float(stored[self.best_metric])
    return value < kept if self.best_mode == "min" else value > kept

  def restore_latest(self, abstract_model, abstract_optimizer, *, steps=None, quarantine: bool = True):
    """(model_state, optimizer_state, meta) of the newest readable step (of `steps`, else of all), or None if
    there is none; RunError when there are steps and none can be read. An unreadable step is moved to
    corrupt_checkpoints/ when `quarantine` (training), else left where it is (eval and infer only read).

    A step that disappears while it is read was deleted by the retention (checkpoint.keep) of a run training in
    the workdir, not damaged: without `steps` the newest step kept then is read instead; a step of `steps` (one the
    caller chose) raises RunError naming it and the steps kept."""
    failures, tried = [], set()
    while candidates := [step for step in (self.steps() if steps is None else sorted(steps)) if step not in tried]:
      step = candidates[-1]
      tried.add(step)
      # Checked before restoring: orbax fails on another model's shapes only after starting its
      # reads, and leaves their threads printing tracebacks.
      mismatch = model_mismatch(os.path.join(self.directory, str(step), "model"), abstract_model)
      if mismatch is not None:
        raise CheckpointMismatch(
            f"checkpoint step {step} in {self.directory} holds another model than this config builds: "
            f"{mismatch}. Run with the config it was made with (--config=WORKDIR/config.py) or use a "
            f"new --workdir; the checkpoints are left as they are")
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(abstract_model),
            optimizer=ocp.args.StandardRestore(abstract_optimizer),
            meta=ocp.args.JsonRestore()))
      except Exception as e:  # orbax / tensorstore raise many kinds for a damaged checkpoint
        if not os.path.isdir(os.path.join(self.directory, str(step))):
          self._deleted_while_read(step, chosen=steps is not None)
          continue
        message = short_error(e)
        logging.error("Checkpoint step %d in %s cannot be read (%s); trying an older one.",
                      step, self.directory, message)
        failures.append(f"step {step}: {message}")
        if quarantine:
          self._quarantine(step)
        continue
      if failures:
        logging.warning("Reading step %d; %s", step, self._unreadable_note(quarantine))
      return restored.model, restored.optimizer, restored.meta
    if failures:
      raise RunError(f"no checkpoint in {self.directory} could be read ({'; '.join(failures)}); "
                     + self._unreadable_note(quarantine)
                     + ("; run again to train from step 0" if quarantine else ""))
    return None

  def _deleted_while_read(self, step: int, *, chosen: bool):
    """After `step` vanished during its read: RunError naming it where the caller `chosen` it, else a warning, the
    steps listed again (the newest kept is read next)."""
    kept = step_numbers(self.workdir)
    why = (f"checkpoint step {step} in {self.directory} was deleted while it was being read, by the retention "
           f"(checkpoint.keep) of a run training in the workdir")
    if chosen:
      raise RunError(f"{why}; it keeps steps {kept} now: read one of them, or wait for training to end")
    logging.warning("%s; reading the newest step it keeps instead (of %s)", why, kept)
    self.manager.reload()

  def _unreadable_note(self, quarantined: bool) -> str:
    corrupt = os.path.join(self.workdir, "corrupt_checkpoints")
    return f"the unreadable steps were moved to {corrupt}" if quarantined else "the unreadable steps were left as they are"

  def _quarantine(self, step: int):
    """Moves an unreadable step aside so that saving that step again later does not collide."""
    if jax.process_index() == 0:
      target = os.path.join(self.workdir, "corrupt_checkpoints", f"{step}-{int(time.time())}")
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"quarantine checkpoint {step}")
    self.manager.reload()

  def close(self):
    self.manager.close()


def steps_to_read(checkpoints: Checkpoints, eval_from: str) -> list[int] | None:
  """The steps checkpoint.eval_from names: None for the newest readable, [best by best_metric] for 'best', [N]
  for a step number; RunError naming the field when that checkpoint is not there."""
  if eval_from == "latest":
    return None
  if eval_from == "best":
    best = checkpoints.best_step()
    if best is None:
      raise RunError(f"checkpoint.eval_from='best': no checkpoint in {checkpoints.directory} was saved with eval "
                     f"metrics ({checkpoints.best_metric}) to rank; read the 'latest'")
    return [best]
  if int(eval_from) not in checkpoints.steps():
    raise RunError(f"checkpoint.eval_from={eval_from!r}: no checkpoint at step {eval_from} in "
                   f"{checkpoints.directory}; it keeps steps {checkpoints.steps()}")
  return [int(eval_from)]


def result_step(workdir: str) -> int:
  """The step a finished run names as its result, the one its `--mode=eval` reads (`steps_to_read` of the
  checkpoint.eval_from in its config.json): its newest, its best by checkpoint.best_metric, or the step named.
  A run that froze into another (a VLM's encoder and LM, the Q-Former's ViT) hands on this step."""
  steps = step_numbers(workdir)
  if not steps:
    raise FileNotFoundError(f"{os.path.join(workdir, 'checkpoints')} holds no checkpoint step")
  checkpoint = (records.read_config(workdir) or {}).get("checkpoint", {})
  eval_from = checkpoint.get("eval_from", "latest")
  if eval_from == "latest":  # the step directories say it: no orbax manager to build
    return steps[-1]
  checkpoints = Checkpoints(workdir, keep=len(steps), best_metric=checkpoint.get("best_metric", ""),
                            best_mode=checkpoint.get("best_mode", "min"))
  try:
    return steps_to_read(checkpoints, eval_from)[0]
  except RunError as error:
    raise RunError(f"the run in {workdir}: {error}") from None
  finally:
    checkpoints.close()


def _select(tree: dict, template: dict) -> dict:
  """The entries of nested dict `tree` at the paths of `template`, as numpy arrays."""
  return {key: _select(tree[key], sub) if isinstance(sub, dict) else np.asarray(tree[key])
          for key, sub in template.items()}


def short_error(error: Exception) -> str:
  """`Type: message` of a failed read, its first line without the TensorStore spec that tensorstore's errors
  append (a JSON dump of the whole store, thousands of characters, and a bound method's repr)."""
  text = str(error).splitlines()[0] if str(error) else ""
  for tail in (" [tensorstore_spec", " [source locations", " See full TensorStore details"):
    text = text.split(tail, 1)[0]
  return f"{type(error).__name__}: {text}"


def restore_params(workdir: str, step: int, build) -> dict:
  """The parameters (`nnx.Param` leaves) of the model `build()` makes, as a pure dict of numpy arrays, from the
  checkpoint of `step` in run `workdir`: what a model that freezes that run reads (its RNG state, dropout keys,
  plays no part in a frozen model)."""
  abstract = nnx.eval_shape(build)
  restored = restore_model_from(os.path.join(workdir, "checkpoints", str(step)),
                                nnx.to_pure_dict(nnx.state(abstract)))
  return _select(restored, nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))


def holds_checkpoint(path: str) -> bool:
  """Whether `path` is what restore_model_from reads: a step directory, or a directory of numbered steps."""
  return os.path.isdir(os.path.join(path, "model")) or any(name.isdigit() for name in os.listdir(path))


def restore_model_from(path: str, abstract_model):
  """The `model` item of a checkpoint: `path` is a step directory or a checkpoints directory (latest)."""
  path = os.path.abspath(path)
  if not os.path.isdir(os.path.join(path, "model")):
    steps = [int(name) for name in os.listdir(path) if name.isdigit()]
    if not steps:
      raise FileNotFoundError(f"init_from={path!r}: no checkpoint step directories in it")
    path = os.path.join(path, str(max(steps)))
  logging.info("init_from: reading the parameters of checkpoint step %s (%s)", os.path.basename(path), path)
  mismatch = model_mismatch(os.path.join(path, "model"), abstract_model)
  if mismatch is not None:  # checked first: orbax would fail only after starting its reads
    raise CheckpointMismatch(f"init_from checkpoint {path} holds another model than this config builds: "
                             f"{mismatch}; initialise from a run of the same model")
  # A leaf without a sharding is read onto this process's first device: orbax would otherwise restore the
  # checkpoint's own layout and refuse one saved over other devices (a frozen LM trained over 2 CPU devices,
  # read by a process with 1).
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  abstract_model = jax.tree.map(lambda leaf: leaf if getattr(leaf, "sharding", None) is not None else
                                jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=device), abstract_model)
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(os.path.join(path, "model"), abstract_model)
