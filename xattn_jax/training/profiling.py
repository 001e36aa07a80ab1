"""A trace of a few training steps (`config.profile`) and a table of where their time went.

    python launch.py --config=... --workdir=RUN --config.profile.first_step=100 --config.profile.num_steps=8

traces the jitted calls that run steps 101 ... 108 with `jax.profiler` into RUN/profile/ (open it with
TensorBoard's profile plugin or xprof, or load the `*.trace.json.gz` in ui.perfetto.dev) and writes
RUN/profile/summary.md: the traced calls' wall time per step, and the time per step of each kind of XLA
op (HLO instruction names without their numbers: `ynn_fusion`, `dot`, `copy_bitcast_fusion` ...) and of
the costliest single ops. Whole calls are traced (a call runs `steps_per_call` steps), so the window
grows to call boundaries; the table divides by the steps the traced calls ran. Pending calls are waited
for before the trace starts, and the traced ones before it stops, so no other step's work is in it. An
eval or a checkpoint ends the window early (the summary names the steps it holds).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

import jax
from absl import logging

SUMMARY_FILE = "summary.md"


def trace_dir(workdir: str) -> str:
  return os.path.join(workdir, "profile")


def window(config) -> tuple[int, int]:
  """(first_step, num_steps) of config.profile; (0, 0) (off) in a config written before the field existed."""
  profile = config.get("profile", None)
  if profile is None:
    return 0, 0
  return profile.first_step, profile.num_steps


class StepProfiler:
  """Starts the trace before the first call that begins at or after `first_step` (completed steps)
  and stops it after the call that completes `num_steps` more; then writes the summary.

  The loop calls `before_call(step, state)` before each train call, `after_call(step, outputs, ...)`
  after it (step: completed steps at that moment) and `close()` at the end (a run that stops inside
  the window, by a signal or an error, still gets its trace and summary). Every process traces its
  own ops (into profile/process_<i> when there are several); process 0 writes the summary of its trace.
  """

  def __init__(self, config, workdir: str, *, process_index: int = 0, process_count: int = 1):
    self.first_step, self.num_steps = window(config)
    self.directory = trace_dir(workdir)  # the summary's
    # jax.profiler names a trace by host and second: processes of one host would write the same files
    self.traces = self.directory if process_count == 1 else os.path.join(self.directory, f"process_{process_index}")
    self.is_writer = process_index == 0
    self.started_at: int | None = None
    self.done = self.num_steps == 0
    self.calls = 0  # train calls this process has run (its first compiles)

  def before_call(self, step: int, state) -> None:
    if self.done or self.started_at is not None or step < self.first_step:
      return
    jax.block_until_ready(state)  # calls dispatched earlier must not run inside the trace
    os.makedirs(self.traces, exist_ok=True)
    jax.profiler.start_trace(self.traces, create_perfetto_trace=True)
    self.started_at = step
    logging.info("Profiling from step %d (%s)", step + 1, self.traces)
    if step > self.first_step:  # whole calls are traced: the one holding first_step + 1 had begun already
      logging.warning("profile.first_step=%d falls inside a call of several steps (steps_per_call): the trace starts "
                      "with the next call, at step %d", self.first_step, step + 1)
    if self.calls == 0:
      logging.warning("The profile starts with this process's first training call, which compiles: the trace holds "
                      "the compilation and its op times read near 0; start it at or past the first call "
                      "(profile.first_step >= steps_per_call, counted from where a resumed run starts)")

  def after_call(self, step: int, outputs, *, window_ends: bool = False) -> bool:
    """Stops the trace once the window's steps have run, or where the loop evaluates or saves next
    (`window_ends`: the trace holds training calls only); True if it stopped (the summary is written)."""
    self.calls += 1
    if self.started_at is not None and (window_ends or step - self.started_at >= self.num_steps):
      self._stop(step, outputs)
      return True
    return False

  def close(self, step: int, outputs=None) -> None:
    """Stops a trace still running (the run ended or failed inside the window) and summarises it."""
    if self.started_at is None:
      return
    try:
      self._stop(step, outputs)
    except Exception as error:  # noqa: BLE001 - never hide what ended the run
      logging.warning("profile of the steps from %d not summarised: %s", self.started_at + 1, error)

  def _stop(self, step: int, outputs) -> None:
    try:
      jax.block_until_ready(outputs)
    finally:
      jax.profiler.stop_trace()
    first, self.started_at, self.done = self.started_at, None, True
    if not self.is_writer:
      return
    text = summarize(self.traces, steps=step - first, first_step=first + 1, relative_to=self.directory)
    with open(os.path.join(self.directory, SUMMARY_FILE), "w") as f:
      f.write(text)
    logging.info("Profile of steps %d-%d written to %s:\n%s", first + 1, step, self.directory,
                 "\n".join(text.splitlines()[:16]))


def newest_trace(directory: str) -> str:
  """The newest perfetto trace (`*.trace.json.gz`) jax.profiler wrote under `directory`."""
  traces = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)
  if not traces:
    raise FileNotFoundError(f"no *.trace.json.gz under {directory}")
  return max(traces, key=os.path.getmtime)


def op_times(trace_path: str) -> tuple[dict[str, float], dict[str, int], float]:
  """({HLO op name: total microseconds}, {name: count}, microseconds from the first event to the last
  op's end) of the XLA ops in one perfetto trace. Ops are the events that carry an `hlo_op`
  argument; host-side events (Python, dispatch, waits) are not. Where the trace holds programs of
  several names, an op is `program/op` (each program numbers its ops from 1). The programs of one
  jitted function at several shapes (length bucketing) share its name: their like-named ops add up."""
  with gzip.open(trace_path, "rt") as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  totals, counts = collections.Counter(), collections.Counter()
  start, end = float("inf"), 0.0
  for event in events:
    if event.get("ph") != "X" or "dur" not in event:
      continue
    start = min(start, event["ts"])
    if "hlo_op" in event.get("args", {}):
      key = (event["args"].get("hlo_module", ""), event["name"])
      totals[key] += event["dur"]
      counts[key] += 1
      end = max(end, event["ts"] + event["dur"])
  several = len({module for module, _ in totals}) > 1
  name = lambda key: f"{key[0]}/{key[1]}" if several else key[1]  # noqa: E731
  return ({name(k): v for k, v in totals.items()}, {name(k): v for k, v in counts.items()},
          max(end - start, 0.0))


def op_kind(name: str) -> str:
  """An HLO instruction's kind: its name without its program and the number XLA appends
  (`jit_steps/ynn_fusion.116` -> `ynn_fusion`)."""
  return re.sub(r"\.\d+$", "", name.rsplit("/", 1)[-1])


def summarize(directory: str, *, steps: int, first_step: int, top: int = 15, relative_to: str | None = None) -> str:
  """The markdown table of the newest trace under `directory`, per training step (`steps` traced); the
  trace is named relative to `relative_to` (default `directory`: where the table is written)."""
  if steps < 1:
    raise ValueError(f"steps={steps}: the traced calls ran no step")
  trace = newest_trace(directory)
  totals, counts, span = op_times(trace)
  kinds, kind_counts = collections.Counter(), collections.Counter()
  for name, micros in totals.items():
    kinds[op_kind(name)] += micros
    kind_counts[op_kind(name)] += counts[name]
  op_total = sum(totals.values())
  per_step = lambda micros: micros / 1000 / steps  # noqa: E731 - ms a step
  lines = [
      f"# Profile of steps {first_step}-{first_step + steps - 1} ({steps} steps)",
      "",
      f"Traced wall time {per_step(span):.2f} ms a step; XLA ops {per_step(op_total):.2f} ms a step summed over "
      "threads (more than the wall time where ops ran side by side). Trace: "
      f"`{os.path.relpath(trace, relative_to or directory)}`.",
      "",
      "| op kind | ms a step | ops a step | share of op time |",
      "| --- | --- | --- | --- |",
  ]
  for kind, micros in kinds.most_common(top):
    lines.append(f"| `{kind}` | {per_step(micros):.2f} | {kind_counts[kind] / steps:.1f} | "
                 f"{micros / max(op_total, 1e-9):.1%} |")
  lines += ["", "| costliest ops | ms a step | runs a step |", "| --- | --- | --- |"]
  for name, micros in sorted(totals.items(), key=lambda item: -item[1])[:top]:
    lines.append(f"| `{name}` | {per_step(micros):.2f} | {counts[name] / steps:.1f} |")
  return "\n".join(lines) + "\n"
