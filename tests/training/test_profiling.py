"""config.profile: a trace of the steps asked for, and a table of where their time went."""
import gzip
import json
import re

import jax
import pytest

from configs import template, translate_dates
from xattn_jax.training import loop, profiling, validation

# Their runs compile the same programs again and again: each a cache hit after the first (conftest.py).
pytestmark = pytest.mark.usefixtures("compilation_cache_in_process")

# A 2-step call at a time; no checkpoint or eval inside the runs below but the last step's.
OVERRIDES = {"batch_size": 8, "eval_batch_size": 8, "task.num_eval_examples": 8, "log_every_steps": 2,
             "steps_per_call": 2, "logging.tensorboard": False, "logging.plot": False}


def _run(tmp_path, total_steps, first_step, num_steps):
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({**OVERRIDES, "total_steps": total_steps, "eval_every_steps": total_steps,
                                     "checkpoint.every_steps": total_steps, "profile.first_step": first_step,
                                     "profile.num_steps": num_steps})
  workdir = tmp_path / "run"
  loop.run(config, str(workdir))
  return workdir / "profile"


def _op_rows(summary: str) -> dict[str, float]:
  return {m[1]: float(m[2]) for m in re.finditer(r"^\| `(\w+)` \| ([\d.]+) \| [\d.]+ \| [\d.]+%", summary, re.M)}


def test_the_steps_asked_for_are_traced_and_their_ops_tabled(tmp_path):
  directory = _run(tmp_path, total_steps=8, first_step=2, num_steps=4)
  summary = (directory / profiling.SUMMARY_FILE).read_text()
  assert summary.startswith("# Profile of steps 3-6 (4 steps)")  # calls of 2 steps: 3-4, 5-6
  assert profiling.newest_trace(str(directory)).endswith(".trace.json.gz")
  rows = _op_rows(summary)
  assert rows and all(ms >= 0 for ms in rows.values())
  assert any("dot" in kind or "fusion" in kind for kind in rows)  # the step's matmuls are XLA ops


def test_the_window_ends_where_the_run_evaluates(tmp_path):
  directory = _run(tmp_path, total_steps=4, first_step=2, num_steps=100)
  assert (directory / profiling.SUMMARY_FILE).read_text().startswith("# Profile of steps 3-4 (2 steps)")


@pytest.mark.parametrize("first_step, warned", [
    (0, "starts with this process's first training call, which compiles"),  # its op times read near 0
    (3, "profile.first_step=3 falls inside a call of several steps (steps_per_call): the trace starts with the next "
        "call, at step 5"),
    (2, None)])
def test_a_window_that_starts_at_the_compiling_call_or_inside_a_call_says_so(tmp_path, caplog, monkeypatch, first_step,
                                                                           warned):
  """Both ran without a word: a trial read the near-zero op times of the compiling call as a profile."""
  # The trace is still taken and summarised, of XLA's ops without the Python function calls: tracing those of
  # JAX's compile (first_step=0) and writing them out took ~10 s, and the words logged are what is checked here.
  start_trace = jax.profiler.start_trace
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  monkeypatch.setattr(jax.profiler, "start_trace",
                      lambda *args, **kwargs: start_trace(*args, **kwargs, profiler_options=options))
  _run(tmp_path, total_steps=8, first_step=first_step, num_steps=2)
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "profile" in r.getMessage()]
  assert [m for m in warnings if warned and warned in m] if warned else not warnings, warnings


def test_no_profile_is_written_by_default(tmp_path):
  assert not _run(tmp_path, total_steps=2, first_step=0, num_steps=0).exists()


def test_summary_adds_up_the_xla_ops_per_step_and_leaves_host_events_out(tmp_path):
  events = [
      {"ph": "X", "ts": 0.0, "dur": 5.0, "name": "$api.py:1 block_until_ready"},  # host: not an op
      {"ph": "X", "ts": 10.0, "dur": 3000.0, "name": "ynn_fusion.1", "args": {"hlo_op": "ynn_fusion.1"}},
      {"ph": "X", "ts": 20.0, "dur": 1000.0, "name": "ynn_fusion.2", "args": {"hlo_op": "ynn_fusion.2"}},
      {"ph": "X", "ts": 3000.0, "dur": 1000.0, "name": "copy.7", "args": {"hlo_op": "copy.7"}},
      {"ph": "M", "name": "thread_name", "args": {"name": "main"}},
  ]
  run = tmp_path / "plugins" / "profile" / "run1"
  run.mkdir(parents=True)
  with gzip.open(run / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  summary = profiling.summarize(str(tmp_path), steps=2, first_step=5)
  assert summary.startswith("# Profile of steps 5-6 (2 steps)")
  assert "Traced wall time 2.00 ms a step; XLA ops 2.50 ms a step" in summary  # 0 .. 4000 us; 5000 us of ops
  assert _op_rows(summary) == {"ynn_fusion": 2.0, "copy": 0.5}
  assert "| `ynn_fusion.1` | 1.50 | 0.5 |" in summary


def test_ops_of_several_programs_are_named_by_program_and_kinds_add_up_over_them(tmp_path):
  """Each program numbers its ops from 1: ynn_fusion.1 of two programs was one row."""
  events = [{"ph": "X", "ts": 0.0, "dur": 1000.0, "name": "ynn_fusion.1",
             "args": {"hlo_op": "ynn_fusion.1", "hlo_module": module}} for module in ("jit_a", "jit_b")]
  run = tmp_path / "plugins" / "profile" / "run1"
  run.mkdir(parents=True)
  with gzip.open(run / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  summary = profiling.summarize(str(tmp_path), steps=1, first_step=1)
  assert "| `jit_a/ynn_fusion.1` | 1.00 | 1.0 |" in summary and "| `jit_b/ynn_fusion.1` | 1.00 | 1.0 |" in summary
  assert "| `ynn_fusion` | 2.00 | 2.0 | 100.0% |" in summary


def test_a_window_past_the_last_step_is_a_config_error():
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"total_steps": 10, "profile.first_step": 10, "profile.num_steps": 5})
  with pytest.raises(validation.ConfigError, match=r"^config\.profile\.first_step=10: must be below total_steps"):
    validation.validate_config(config)


def test_a_window_inside_the_last_call_is_a_config_error():
  """steps_per_call=16 over 8 steps is one call, from step 0: a trace from step 4 began with no call, and the run
  ended without a word and without a profile."""
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"total_steps": 8, "steps_per_call": 16, "profile.first_step": 4,
                                     "profile.num_steps": 2})
  with pytest.raises(validation.ConfigError, match=r"^config\.profile\.first_step=4: no training call starts at or "
                                                   r"after it: the last one runs steps 1-8 \(steps_per_call=16\)"):
    validation.validate_config(config)
  config.steps_per_call = 4  # calls 1-4 and 5-8
  validation.validate_config(config)
  bucketed = translate_dates.get_config("tokenizer=bytes")
  bucketed.update_from_flattened_dict({"total_steps": 8, "steps_per_call": 16, "profile.first_step": 4,
                                       "profile.num_steps": 2, "data.length_bucketing": True})
  validation.validate_config(bucketed)  # a batch of another length may end the first call before step 4


def test_each_process_of_a_multi_process_run_traces_into_its_own_folder(tmp_path):
  """jax.profiler names trace files by host and second: two processes of one host wrote the same files."""
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"profile.first_step": 8, "profile.num_steps": 8})
  alone = profiling.StepProfiler(config, str(tmp_path))
  assert (alone.traces, alone.is_writer) == (str(tmp_path / "profile"), True)
  second = profiling.StepProfiler(config, str(tmp_path), process_index=1, process_count=2)
  assert (second.traces, second.directory, second.is_writer) == (
      str(tmp_path / "profile" / "process_1"), str(tmp_path / "profile"), False)
