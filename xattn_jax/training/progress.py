"""The train metrics of dispatched calls: checked for divergence, written, and logged with a rate.

A call's metrics come back as device arrays. They are held here unread, so that JAX can dispatch
the next call while this one runs, and read (`flush`) only where the loop needs them: at a logged
step, before an eval or a checkpoint.

Two rates: `train/steps_per_second` of the logged rows times the calls after the first (which compiles),
so a run of one call has none; `trained()` counts every step from the first call's dispatch, its compile
included, so every run that trains has one (the loop logs it at the end).
"""
from __future__ import annotations

import datetime
import time
from typing import Callable, Sequence

import jax
from absl import logging

from xattn_jax.training import guards, schedule


def format_duration(seconds: float) -> str:
  return str(datetime.timedelta(seconds=int(seconds)))


class StepLog:
  """Pending per-step train metrics of one training session, in step order.

  `writer` has `write(step, row)` (a metrics.MetricsWriter); `saved_steps()` lists the checkpoints
  on disk, for the message of a diverged run.
  """

  def __init__(self, config, writer, saved_steps: Callable[[], Sequence[int]]):
    self.config, self.writer, self.saved_steps = config, writer, saved_steps
    self.pending: list[tuple[int, int, dict]] = []  # (first step, count, {name: [K] array})
    self.timer_step: int | None = None  # steps/s counts from here, at timer_start
    self.timer_start = 0.0
    # trained(): the steps and seconds of the windows of training read so far, and the open window's start
    # (from here, the first call's dispatch, its compile included; then each restart_timer).
    self.trained_steps, self.trained_seconds = 0, 0.0
    self.window_step: int | None = None
    self.window_start = time.perf_counter()

  def add(self, first_step: int, count: int, stacked_metrics: dict) -> None:
    """Holds the metrics of a call that ran steps first_step ... first_step + count - 1. The first
    call's (which compiles) is waited for, and the rate is timed from its end on."""
    self.pending.append((first_step, count, stacked_metrics))
    if self.window_step is None:
      self.window_step = first_step - 1
    if self.timer_step is None:
      jax.block_until_ready(stacked_metrics)
      self.timer_step, self.timer_start = first_step + count - 1, time.perf_counter()

  def restart_timer(self, step: int) -> None:
    """Times the rate from now, at `step` (after an eval or a checkpoint: steps/s measures training)."""
    self.timer_step, self.timer_start = step, time.perf_counter()
    self.window_step, self.window_start = step, self.timer_start

  def trained(self) -> tuple[int, float]:
    """(steps, seconds) trained in the windows read so far: from the first call's dispatch (its compile
    included) to the last flush, less the evals, checkpoints and traced calls (restart_timer) between."""
    return self.trained_steps, self.trained_seconds

  def _rate(self, newest: int) -> float:
    """Steps per second since the timer started, up to `newest` (a call's steps finish together)."""
    if self.timer_step is None or newest <= self.timer_step:
      return float("nan")
    return (newest - self.timer_step) / (time.perf_counter() - self.timer_start)

  def flush(self, hold_step: int | None = None) -> dict[str, float]:
    """Reads every pending step in step order, raises TrainingDiverged at the first whose loss or
    gradient norm is not finite, and writes the row of each logged step; the row of `hold_step` is
    returned instead of written (so its eval metrics can join it), {} when there is none."""
    per_step = [(first + i, {k: v[i] for k, v in stacked.items()})
                for first, count, stacked in jax.device_get(self.pending) for i in range(count)]
    self.pending.clear()
    if not per_step:
      return {}
    rate = self._rate(per_step[-1][0])
    now = time.perf_counter()
    self.trained_steps += per_step[-1][0] - self.window_step
    self.trained_seconds += now - self.window_start
    self.window_step, self.window_start = per_step[-1][0], now
    held = {}
    for step, values in per_step:
      guards.check_finite(step, values, self.saved_steps)
      if not schedule.logged(step, self.config):
        continue
      row = {k: float(v) for k, v in values.items()}
      if rate == rate:  # no rate yet for the first (compiling) call's steps: left out, not NaN
        row["train/steps_per_second"] = rate
      if step == hold_step:
        held = row
      else:
        self.writer.write(step, row)
      if rate == rate and rate > 0:
        speed = f"{rate:.1f} steps/s, {format_duration((self.config.total_steps - step) / rate)} left"
      else:
        speed = "steps/s not measured yet (the first call compiles)"
      logging.info("step %d/%d: loss %.4f, grad norm %.3g, %s", step, self.config.total_steps, row["train/loss"],
                   row["train/grad_norm"], speed)
    return held
