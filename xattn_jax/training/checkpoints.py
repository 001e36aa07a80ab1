"""Orbax checkpoints of a run: the last K steps plus the best by an eval metric.

Each step directory holds three items: `model` (the nnx.State of the model), `optimizer` (its
nnx.State) and `meta` (JSON: step, the run's RNG key data, the metrics at that step). `init_from`
reads only `model`, so a different optimizer does not stop it.

A checkpoint that cannot be read (truncated files, shapes of another config) is reported, moved to
`<workdir>/corrupt_checkpoints/`, and the next older one is tried.
"""
from __future__ import annotations

import os
import shutil
import time

import jax
import orbax.checkpoint as ocp
from absl import logging
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

ITEMS = ("model", "optimizer", "meta")


def abstract_with_shardings(abstract_state, shardings):
  """ShapeDtypeStructs carrying the target shardings, for orbax to restore straight into place."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract_state, shardings)


class Checkpoints:
  """The checkpoint directory of one run (`<workdir>/checkpoints`)."""

  def __init__(self, workdir: str, *, keep: int, best_metric: str = "", best_mode: str = "min"):
    self.workdir = workdir
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.best_metric = best_metric
    preserve = [policies.LatestN(n=keep)]
    if best_metric:
      preserve.append(policies.BestN(get_metric_fn=lambda metrics: metrics[best_metric],
                                     reverse=best_mode == "min", n=1,
                                     keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policies.AnyPreservationPolicy(preserve),
        # Synchronous saves: when save() returns the step is on disk, so SIGTERM / SIGKILL right
        # after can never leave a half-written "latest" behind.
        enable_async_checkpointing=False, cleanup_tmp_directories=True, create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, model_state, optimizer_state, meta: dict, metrics: dict | None = None):
    if step in self.manager.all_steps():
      return
    if metrics is not None and self.best_metric not in metrics:
      metrics = None
    self.manager.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(model_state), optimizer=ocp.args.StandardSave(optimizer_state),
        meta=ocp.args.JsonSave(meta)), metrics=metrics, force=True)

  def restore_latest(self, abstract_model, abstract_optimizer):
    """(model_state, optimizer_state, meta) of the newest readable step, or None if there is none."""
    failures = []
    for step in reversed(self.steps()):
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(abstract_model),
            optimizer=ocp.args.StandardRestore(abstract_optimizer),
            meta=ocp.args.JsonRestore()))
      except Exception as e:  # orbax / tensorstore raise many kinds for a damaged checkpoint
        message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        logging.error("Checkpoint step %d in %s cannot be read (%s); trying an older one.",
                      step, self.directory, message)
        failures.append(f"step {step}: {message}")
        self._quarantine(step)
        continue
      if failures:
        logging.warning("Resuming from step %d; unreadable steps were moved to %s", step,
                        os.path.join(self.workdir, "corrupt_checkpoints"))
      return restored.model, restored.optimizer, restored.meta
    if failures:
      raise RuntimeError(f"no checkpoint in {self.directory} could be read: " + "; ".join(failures))
    return None

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


def restore_model_from(path: str, abstract_model):
  """The `model` item of a checkpoint: `path` is a step directory or a checkpoints directory (latest)."""
  path = os.path.abspath(path)
  if not os.path.isdir(os.path.join(path, "model")):
    steps = [int(name) for name in os.listdir(path) if name.isdigit()]
    if not steps:
      raise FileNotFoundError(f"init_from={path!r}: no checkpoint step directories in it")
    path = os.path.join(path, str(max(steps)))
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(os.path.join(path, "model"), abstract_model)
