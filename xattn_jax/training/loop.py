"""`run(config, workdir, mode)`: train, evaluate or run inference for any registered task.

The engine's pieces, each in its module: `trainer` (the task, mesh, state layout and jitted steps
of a config; the resume order), `schedule` (which steps each jitted call runs), `progress` (the
metrics of dispatched calls), `guards` (divergence, SIGTERM / Ctrl-C), `rng` (per-step keys),
`workdir` (the config record), `inference` (input lines in, answers out; `load_model`), `profiling`
(a trace of a few steps: config.profile). This module keeps the entry point and the training loop
that strings them together; it also re-exports the names scripts use (`loop.load_model`,
`loop.multi_step`, `loop.TrainingDiverged` ...).

Steps count completed updates: update number s (1-based) reads the task's train batch s - 1, and
checkpoint s holds the state after it. Metrics of step s are `metrics.jsonl` rows with "step": s.
"""
from __future__ import annotations

import contextlib
import logging as py_logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
from absl import logging
from jax.experimental import multihost_utils

from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import guards, inference, metrics as metrics_lib, profiling, progress, schedule, validation
from xattn_jax.training import task as task_lib, workdir as workdir_lib
from xattn_jax.training.errors import DataError, RunError  # noqa: F401 - re-exported
from xattn_jax.training.guards import TrainingDiverged  # noqa: F401 - re-exported
from xattn_jax.training.inference import load_model  # noqa: F401 - re-exported
from xattn_jax.training.rng import model_rngs  # noqa: F401 - re-exported
from xattn_jax.training.schedule import steps_per_call  # noqa: F401 - re-exported
from xattn_jax.training.trainer import Trainer, multi_step  # noqa: F401 - re-exported
from xattn_jax.training.workdir import check_same_model  # noqa: F401 - re-exported


def train(trainer: Trainer, checkpoints, make_writer, after_restore=None) -> dict[str, float]:
  """Trains from where `trainer.restore` starts to config.total_steps, or to the eval where
  config.early_stopping ends it (`guards.EarlyStopping`, recorded in early_stop.json once its checkpoint is
  saved); returns the last eval metrics.

  `make_writer(start_step)` returns the MetricsWriter (which drops rows past start_step);
  `after_restore(step)` runs once the checkpoint (if any) has been restored into this config's model, where
  training goes on from it.
  Each call runs a few steps (`schedule`); after it come the log rows, an eval and a checkpoint
  where due, and the stop checks: a non-finite loss raises TrainingDiverged, SIGTERM or a first
  Ctrl-C saves a checkpoint and returns (on every process at the same step).
  """
  config = trainer.config
  # read first: a damaged log stops the run before it changes anything in the workdir
  logged = metrics_lib.read_metrics(os.path.join(trainer.workdir, "metrics.jsonl"))
  state, step, rng_key = trainer.restore(checkpoints)
  stopped_early = task_lib.read_early_stop(config, trainer.workdir)
  ended = stopped_early is not None and step >= stopped_early[0]  # where early stopping ended it before
  if not ended:
    _check_start_step(step, config, trainer.workdir, ended_by_epochs=trainer.ended_by_epochs)
  if after_restore is not None and not ended and step < config.total_steps:
    after_restore(step)
  if ended:
    logging.info("The run stopped early at step %d (%s): nothing to train.", *stopped_early)
    return {}
  if trainer.process_index == 0:  # training on: an earlier stop's record (other settings) no longer holds
    task_lib.clear_early_stop(trainer.workdir)
  logging.info(trainer.summary())
  if step == 0 and any(row.get("step", 0) > 0 for row in logged) and trainer.process_index == 0:
    logging.warning("%s logs an earlier run but holds no checkpoint to resume from: training starts again at "
                    "step 0 (the earlier log is kept in metrics.jsonl.before_step_0)", trainer.workdir)
  early_stopping = guards.EarlyStopping(config, logged, up_to_step=step)
  writer = make_writer(step)
  train_step = trainer.make_train_step()
  feed = schedule.CallFeed(trainer.read_train_batch, config)
  step_log = progress.StepLog(config, writer, checkpoints.steps)
  vote = guards.stop_vote(trainer.mesh) if trainer.process_count > 1 else None
  profiler = profiling.StepProfiler(config, trainer.workdir, process_index=trainer.process_index,
                                    process_count=trainer.process_count)
  last_eval, stopped, previous_metrics = {}, False, None
  with guards.stop_flag() as flag, contextlib.closing(writer), contextlib.ExitStack() as cleanup:
    cleanup.callback(lambda: profiler.close(step, state))  # a run that ends inside the window
    stop_requests = guards.StopRequests(flag, vote)
    while step < config.total_steps and not stopped:
      profiler.before_call(step, state)
      local_batches, count = feed.next_call(step)
      batches = trainer.batch(local_batches, config.batch_size, stacked=True)
      state, call_metrics = train_step(state, batches, jnp.asarray(step, jnp.int32), jnp.asarray(count, jnp.int32),
                                       rng_key)
      # The host runs one call ahead, no more: a stop below then waits for the call in flight only, not for
      # every call dispatched up to the next log row (a whole logging window, too long for a preemption notice).
      jax.block_until_ready(previous_metrics)
      previous_metrics = call_metrics
      step_log.add(step + 1, count, call_metrics)
      step += count
      if config.debug.step_delay_s:
        time.sleep(config.debug.step_delay_s)
      stopped = stop_requests.after_call(step)
      end = schedule.call_end(step, count, config)
      save = end.checkpoint or stopped
      if profiler.after_call(step, state, window_ends=end.evaluate or save):  # traces training calls only
        step_log.restart_timer(step)  # steps/s leaves out the traced calls and the summary
      if end.log or end.evaluate or save:
        train_row = step_log.flush(hold_step=step if end.evaluate else None)  # raises if diverged
      stops_early = False
      if end.evaluate:
        last_eval = _evaluate(trainer, checkpoints, state, step, rng_key)
        writer.write(step, {**train_row, **last_eval})
        stops_early = early_stopping.after_eval(step, last_eval)
      if save or stops_early or (end.evaluate and checkpoints.improves_on_best(last_eval)):
        trainer.save(checkpoints, step, state, rng_key, last_eval if end.evaluate else None)
      if stops_early:  # recorded once its checkpoint is saved
        logging.info("Early stopping at step %d: %s.", step, early_stopping.reason())
        if trainer.process_index == 0:
          task_lib.write_early_stop(config, trainer.workdir, step, early_stopping.reason(), early_stopping.best_step)
        stopped = True
      if end.evaluate or save or stops_early:  # steps/s measures training only
        step_log.restart_timer(step)
    step_log.flush()
  trained, seconds = step_log.trained()
  if trained:  # every run that trains says how fast, a run of one call included (its rows have no steps/s)
    logging.info("Trained %d steps at %.1f steps/s (%.1f s from the first call's dispatch, its compile included; "
                 "evals and checkpoints left out)", trained, trained / seconds, seconds)
  if flag.requested and step < config.total_steps:  # where it stopped, and how to pick it up
    logging.warning("Stopped at step %d of %d (SIGTERM or Ctrl-C), its checkpoint saved in %s: run the same "
                    "command again to resume.", step, config.total_steps, trainer.workdir)
  return last_eval


def _record_resumed_config(config, workdir: str, step: int) -> None:
  """The record of a run that trains on from `step`: this config, the settings it started with kept aside."""
  changed = workdir_lib.record_resumed_config(config, workdir, step)
  if changed:
    logging.warning("Training on from step %d with settings the run did not start with (%s); the record of those "
                    "it started with is kept as %s.before_step_%d", step,
                    ", ".join(f"{field}: {old!r} -> {new!r}" for field, (old, new) in changed.items()),
                    "/".join(workdir_lib.RECORD_FILES), step)


def _check_start_step(step: int, config, workdir: str, ended_by_epochs: bool = False) -> None:
  if step > config.total_steps:
    if ended_by_epochs:  # config.total_steps is the end that max_epochs set
      raise validation.ConfigError("max_epochs", config.max_epochs, f"its passes end at step {config.total_steps}, "
                                   f"but the run in {workdir} is already at step {step}; give more passes to train "
                                   "on, or use --mode=eval")
    raise validation.ConfigError("total_steps", config.total_steps, f"the run in {workdir} is already at step "
                                 f"{step}; give more steps to train on, or use --mode=eval")
  if step == config.total_steps:
    logging.info("The run is already at step %d%s: nothing to train.", step,
                 f", where its max_epochs={config.max_epochs:g} passes end" if ended_by_epochs else " = total_steps")


def _evaluate(trainer: Trainer, checkpoints, state, step: int, rng_key) -> dict[str, float]:
  """trainer.evaluate(state), logged; if it fails (a bug or a bad setting in eval), the trained state
  is saved as checkpoint `step` first, so the training done so far is not lost."""
  try:
    values = trainer.evaluate(state)
  except Exception:
    if step not in checkpoints.steps():
      logging.error("eval at step %d failed; saving the trained state as checkpoint %d first", step, step)
      trainer.save(checkpoints, step, state, rng_key)
    raise
  logging.info("step %d eval: %s", step, ", ".join(f"{k} {v:.4f}" for k, v in values.items()))
  return values


def _barrier(name: str):
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def keep_library_record(record) -> bool:
  """The run's log filter: orbax's and jax's INFO chatter (several lines per checkpoint) is left out,
  and orbax's warning at every checkpoint saved without an eval (by design: no candidate for "best")."""
  if "/orbax/" in record.pathname and "did not provide metrics" in record.getMessage():
    return False
  return record.levelno >= py_logging.WARNING or not any(
      part in record.pathname for part in ("/orbax/", "/jax/", "/jaxlib/"))


def _quiet_library_logs():
  # Library records reach the absl handler both through the absl logger and by propagation from
  # their own Python loggers; the handler that finally writes them is the python_handler (one filter,
  # however many runs a process makes).
  logging.get_absl_handler().python_handler.addFilter(keep_library_record)


def run(config, workdir: str, mode: str = "train", *, output=None):
  """Validates `config`, then trains (`train`), evaluates the newest checkpoint (`eval`) or runs the
  task's inference on the newest checkpoint (`infer`, lines from config.infer.input_file, "-" = stdin,
  outputs to `output` or stdout). Returns the final eval metrics (train, eval) or the outputs (infer).
  """
  _quiet_library_logs()
  workdir_lib.expand_home(config)
  validation.validate_config(config, mode=mode, device_count=jax.device_count(),
                             process_count=jax.process_count(), workdir=workdir)
  workdir_lib.absolute_paths(config, workdir)  # the record's config.py then works from any directory
  workdir_lib.check_same_model(config, workdir, mode)
  has_checkpoints = bool(checkpoints_lib.step_numbers(workdir))
  if mode != "train" and not has_checkpoints:  # before anything is built or written: eval / infer only
    # read a finished run
    raise RunError(f"no checkpoint in {os.path.join(os.path.abspath(workdir), 'checkpoints')} to {mode} with")
  is_writer = jax.process_index() == 0
  if mode == "train" and not has_checkpoints and (foreign := workdir_lib.foreign_record_files(workdir)):
    raise RunError(f"{workdir} holds {', '.join(foreign)} that no run wrote, which training would overwrite: "
                   "name an empty or new folder as the workdir")
  new_workdir = is_writer and mode == "train" and not os.path.exists(workdir)
  # With checkpoints, the config is rewritten only once they have been restored into its model:
  # a config they do not fit must not replace the one they were made with.
  resumed = mode == "train" and has_checkpoints
  _barrier("config checked")  # every process reads the old config.json before process 0 rewrites it
  with contextlib.ExitStack() as held:
    if is_writer:
      try:
        os.makedirs(workdir, exist_ok=True)
      except OSError as error:  # launch.py checks what it can first; a file system may still refuse
        raise RunError(f"cannot create the workdir {workdir}: {error.strerror or error}") from None
      if mode == "train":  # one training process a workdir, from before its config is written to the end
        held.enter_context(workdir_lib.training_lock(workdir))
      if mode == "train" and not resumed:
        workdir_lib.write_config(config, workdir)
        workdir_lib.record_data_files(config, workdir)
      elif mode == "train" and (moved := workdir_lib.record_moved_data_files(config, workdir)):
        logging.info("Data files read at a new path, with the contents the run started on: %s",
                     "; ".join(f"{field} {path}" for field, path in moved.items()))
      if mode == "train" and resumed and (changed := workdir_lib.changed_data_files(config, workdir)):
        # the record keeps the contents the run started on; a run that depends on this one refuses it
        logging.warning("Training on over data files edited since the run started: %s. The steps from here read "
                        "the new contents; a run that depends on this one will refuse it (train into a new "
                        "workdir to start over on them)", "; ".join(changed))
    return _run_in(config, workdir, mode, output, is_writer=is_writer, new_workdir=new_workdir, resumed=resumed)


def _run_in(config, workdir: str, mode: str, output, *, is_writer: bool, new_workdir: bool, resumed: bool):
  """`run` once the workdir is ready (and, to train, locked)."""
  _barrier("workdir ready")
  try:
    trainer = Trainer(config, workdir, mode)
  except (validation.ConfigError, DataError):
    if new_workdir:  # it holds only this run's config so far: leave nothing half-made behind
      shutil.rmtree(workdir, ignore_errors=True)
    raise
  if is_writer and mode == "train" and config.get("max_epochs", 0.0):  # where the data-sized budget ends
    task_lib.write_end_step(config, workdir, trainer.config.total_steps)
  checkpoints = checkpoints_lib.Checkpoints(
      workdir, keep=config.checkpoint.keep, best_metric=config.checkpoint.best_metric,
      best_mode=config.checkpoint.best_mode, read_only=mode != "train")
  try:
    if mode == "train":
      result = train(trainer, checkpoints, lambda start_step: metrics_lib.MetricsWriter(
          workdir, active=is_writer, tensorboard=config.logging.tensorboard, resume_step=start_step),
          after_restore=(lambda step: _record_resumed_config(config, workdir, step)) if resumed and is_writer else None)
      if is_writer and config.logging.plot:
        metrics_lib.plot_losses(workdir)
      return result
    state, step = trainer.latest_state(checkpoints, mode)
    if mode == "eval":
      trainer.task.figure_directory = workdir_lib.eval_figure_directory(workdir, step)  # training's figures stay
      values = trainer.evaluate(state)
      logging.info("eval at step %d: %s", step, values)
      if is_writer:
        workdir_lib.append_eval_result(config, workdir, step, values)
      return values
    return inference.infer(trainer, state, config.infer.input_file, output)
  finally:
    checkpoints.close()
