"""What stops training early: a non-finite loss (an error), SIGTERM / Ctrl-C (a clean stop), and an eval
metric that stopped improving (config.early_stopping, a clean stop).

A non-finite loss or gradient norm raises `TrainingDiverged` naming the step, before anything of
that step is saved. SIGTERM (or a first Ctrl-C) sets a flag; the loop lets the calls already
dispatched finish (the call in flight and at most one queued: the host runs one call ahead), saves a
checkpoint and returns normally.
With several processes every call also dispatches a vote (the OR of each process's flag, one boolean
per device), read after the next call has been dispatched: a signal that reaches one host stops
every host at the same step, one call later, where they save the checkpoint together, and the vote
never makes a host wait for the call it has just dispatched.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from xattn_jax.training import task as task_lib

GUARDED_METRICS = ("train/loss", "train/grad_norm")


class TrainingDiverged(RuntimeError):
  """The loss or the gradient norm became NaN or infinite."""


def check_finite(step: int, values: dict, saved_steps: Callable[[], Sequence[int]]) -> None:
  """Raises TrainingDiverged when train/loss or train/grad_norm of `step` is NaN or infinite; the
  message names the metric, the step and the newest checkpoint (`saved_steps()`, asked only then),
  which is left untouched."""
  for name in GUARDED_METRICS:
    if not np.isfinite(values[name]):
      saved = saved_steps()
      last = f"step {max(saved)}" if saved else "none"
      raise TrainingDiverged(f"{name} = {float(values[name])} at step {step}; stopping. "
                             f"Last checkpoint: {last} (left untouched)")


# Whether SIGTERM or Ctrl-C reached this process since `clear_stop_request`, whichever handler took it: a stop
# asked during a run's last call ends that run normally, and the runs queued after it (dependencies, then the
# run that needs them) must not start.
_STOP_ASKED = [False]


def note_stop_request() -> None:
  _STOP_ASKED[0] = True


def stop_requested() -> bool:
  return _STOP_ASKED[0]


def clear_stop_request() -> None:
  _STOP_ASKED[0] = False


class StopFlag:
  """`requested` turns True on SIGTERM or a first Ctrl-C (while `stop_flag()` is active)."""

  def __init__(self):
    self.requested = False

  def handle(self, signum, frame) -> None:
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
      if self.requested:  # a second Ctrl-C interrupts at once, as usual
        raise KeyboardInterrupt
      name = "Ctrl-C (press it again to stop without saving)"
    logging.warning("%s received: saving a checkpoint at the end of the current call (or of the next one, "
                    "already queued).", name)
    self.requested = True
    note_stop_request()


@contextlib.contextmanager
def stop_flag() -> Iterator[StopFlag]:
  """Yields a StopFlag handling SIGTERM and SIGINT; the old handlers are restored afterwards. Off the
  main thread (where Python allows no signal handlers) the flag never turns True."""
  flag = StopFlag()
  previous = {}
  try:
    for signum in (signal.SIGTERM, signal.SIGINT):
      previous[signum] = signal.signal(signum, flag.handle)
  except ValueError:  # not the main thread: no signal handling
    previous.clear()
  try:
    yield flag
  finally:
    for signum, old in previous.items():
      signal.signal(signum, old)


def stop_vote(mesh) -> Callable[[bool], jax.Array]:
  """flag -> a replicated bool jax.Array, True if `flag` is True on any process (a collective: every
  process calls it at the same step). Dispatched like a train step; reading it waits for it."""
  devices = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
  any_true = jax.jit(jnp.any, out_shardings=NamedSharding(mesh, PartitionSpec()))

  def vote(flag: bool) -> jax.Array:
    local = np.full(len(mesh.local_devices), flag, np.bool_)
    return any_true(jax.make_array_from_process_local_data(devices, local, (mesh.devices.size,)))

  return vote


class StopRequests:
  """Whether to stop after the call just dispatched, the same answer on every process.

  Without a vote (one process) that is the flag itself. With `vote` (`stop_vote(mesh)`), it is the
  vote dispatched after the previous call (so every process stops after the same call, one call
  after the signal), and this call's vote is dispatched for the next answer.
  """

  def __init__(self, flag: StopFlag, vote: Callable[[bool], jax.Array] | None = None):
    self.flag, self.vote = flag, vote
    self._last_vote = None

  def after_call(self, step: int) -> bool:
    """True when every process stops after the call that ends at `step`."""
    if self.vote is None:
      return self.flag.requested
    stop = self._last_vote is not None and bool(self._last_vote)
    self._last_vote = self.vote(self.flag.requested)
    if stop and not self.flag.requested:
      logging.warning("Another process received SIGTERM: saving a checkpoint after step %d.", step)
    return stop


class EarlyStopping:
  """Watches config.checkpoint.best_metric at each eval; `after_eval` says when it has not beaten its reference
  (the value of its last gain) by more than early_stopping.min_delta for early_stopping.patience evals in a row.
  `best_step` is the best checkpoint's step by the checkpoints' own rule (the best value, of equal values the
  earliest), so the record and `checkpoint.eval_from=best` name one step.

  A resumed run first replays the evals it logged up to its checkpoint (`rows`, metrics.jsonl's), so it
  stops where the uninterrupted run stops.
  """

  def __init__(self, config, rows: Sequence[dict] = (), *, up_to_step: int = 0):
    settings = task_lib.early_stopping_settings(config) or {"patience": 0, "min_delta": 0.0, "metric": "", "mode": ""}
    self.patience, self.min_delta = settings["patience"], settings["min_delta"]
    self.metric, self.mode = settings["metric"], settings["mode"]
    self.reference, self.reference_step, self.evals_since_best = None, None, 0
    self.best, self.best_step = None, None
    if self.patience:
      logged = {row["step"]: row for row in rows if row.get("step", 0) <= up_to_step and self.metric in row}
      for step in sorted(logged):
        self.after_eval(step, logged[step])

  def _beats(self, value: float, other: float | None, margin: float) -> bool:
    return other is None or (value < other - margin if self.mode == "min" else value > other + margin)

  def after_eval(self, step: int, values: dict) -> bool:
    """Counts the eval of `step`; True when training should end here. An eval without the metric counts as
    no gain (a BLEU the corpus cannot define, say)."""
    if not self.patience:
      return False
    value = values.get(self.metric)
    if value is not None and self._beats(value, self.best, 0.0):
      self.best, self.best_step = float(value), step
    if value is not None and self._beats(value, self.reference, self.min_delta):
      self.reference, self.reference_step, self.evals_since_best = float(value), step, 0
    else:
      self.evals_since_best += 1
    return self.evals_since_best >= self.patience

  def reason(self) -> str:
    if self.reference is None:
      return f"{self.metric} has no value after early_stopping.patience={self.patience} evals"
    settings = (f"by more than early_stopping.min_delta={self.min_delta:g} for "
                f"early_stopping.patience={self.patience} evals")
    if self.best_step == self.reference_step:
      return f"{self.metric} has not beaten its best {self.reference:.6g} at step {self.reference_step} {settings}"
    return (f"{self.metric} has not beaten step {self.reference_step}'s {self.reference:.6g} {settings} (its best, "
            f"step {self.best_step}'s {self.best:.6g}, gained less)")
