"""The metrics of dispatched calls: read in step order, checked, written at the logged steps."""
import math
import types

import numpy as np
import pytest
from ml_collections import ConfigDict

from xattn_jax.training import guards, progress


class _Rows:
  def __init__(self):
    self.rows = []

  def write(self, step, row):
    self.rows.append((step, row))


def _log(total=6, log_every=2, saved=()):
  writer = _Rows()
  config = ConfigDict({"total_steps": total, "log_every_steps": log_every})
  return progress.StepLog(config, writer, lambda: list(saved)), writer


def _call(losses):
  """A call's stacked metrics ([K] arrays), as a train step returns them."""
  losses = np.asarray(losses, np.float32)
  return {"train/loss": losses, "train/grad_norm": np.ones_like(losses)}


def test_rows_are_written_for_the_logged_steps_and_the_last_in_order():
  step_log, writer = _log(total=5, log_every=2)
  step_log.add(1, 3, _call([1.0, 2.0, 3.0]))
  step_log.add(4, 2, _call([4.0, 5.0]))
  assert step_log.flush() == {}
  assert [(step, row["train/loss"]) for step, row in writer.rows] == [(2, 2.0), (4, 4.0), (5, 5.0)]


def test_the_held_steps_row_is_returned_not_written():
  step_log, writer = _log(total=6, log_every=2)
  step_log.add(1, 4, _call([1.0, 2.0, 3.0, 4.0]))
  held = step_log.flush(hold_step=4)
  assert held["train/loss"] == 4.0
  assert [step for step, _ in writer.rows] == [2]


def test_entries_past_a_calls_count_are_not_steps():
  step_log, writer = _log(total=6, log_every=1)
  step_log.add(1, 2, _call([1.0, 2.0, 0.0, 0.0]))  # a stack of 4, two steps run
  step_log.flush()
  assert [step for step, _ in writer.rows] == [1, 2]


def test_the_first_calls_rows_have_no_rate_and_later_rows_do():
  step_log, writer = _log(total=6, log_every=1)
  step_log.add(1, 2, _call([1.0, 2.0]))  # the compiling call: the rate is timed from its end
  step_log.flush()
  step_log.add(3, 2, _call([3.0, 4.0]))
  step_log.flush()
  assert ["train/steps_per_second" in row for _, row in writer.rows] == [False, False, True, True]


def test_every_run_that_trains_has_a_rate_timed_from_its_first_dispatch_less_evals(monkeypatch):
  """A run of one call logs no steps/s in its rows (that call compiles); trained() times it, compile
  included, and leaves out what restart_timer leaves out (evals, checkpoints)."""
  now = [0.0]
  monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
  step_log, writer = _log(total=4, log_every=1)  # created at 0 s, just before the first dispatch
  now[0] = 5.0  # compiled and ran
  step_log.add(1, 2, _call([1.0, 2.0]))
  now[0] = 6.0
  step_log.flush()
  assert not any("train/steps_per_second" in row for _, row in writer.rows)
  assert step_log.trained() == (2, 6.0)
  now[0] = 10.0  # after an eval
  step_log.restart_timer(2)
  step_log.add(3, 2, _call([3.0, 4.0]))
  now[0] = 11.0
  step_log.flush()
  assert step_log.trained() == (4, 7.0)


def test_the_first_non_finite_step_stops_the_run_and_nothing_after_it_is_written():
  step_log, writer = _log(total=6, log_every=1, saved=[2])
  step_log.add(1, 2, _call([1.0, 2.0]))
  step_log.add(3, 3, _call([3.0, math.nan, math.inf]))
  with pytest.raises(guards.TrainingDiverged, match=r"train/loss = nan at step 4; .*Last checkpoint: step 2"):
    step_log.flush()
  assert [step for step, _ in writer.rows] == [1, 2, 3]
