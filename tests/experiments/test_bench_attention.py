"""The attention benchmark's GPU float32 rows run at full float32 on both sides (experiments/bench_attention.py),
and experiments/gpu_check.sh names test files and flags that exist."""
import argparse
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY / "experiments"))

import bench_attention  # noqa: E402


def _dot_precisions(jaxpr) -> list:
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      found.append(eqn.params["precision"])
    for value in eqn.params.values():
      for inner in (value if isinstance(value, (tuple, list)) else (value,)):
        inner = getattr(inner, "jaxpr", inner)  # ClosedJaxpr -> Jaxpr
        if hasattr(inner, "eqns"):
          found += _dot_precisions(inner)
  return found


@pytest.mark.parametrize("implementation", ["ours xla", "ours chunked", "jax.nn"])
def test_float32_rows_trace_every_matmul_of_forward_and_backward_at_highest_precision(implementation):
  case = bench_attention.Case("plain", 2, 8, 8, heads=2, kv_heads=2, head_dim=4)
  q = jax.random.normal(jax.random.key(0), (2, 8, 2, 4))
  fwd, bwd = bench_attention.forward_and_backward(bench_attention.jax_attention_fn(implementation, case, None),
                                                  equal_precision=True)
  highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
  for fn in (fwd, bwd):
    precisions = _dot_precisions(jax.make_jaxpr(fn)(q, q, q).jaxpr)
    assert precisions and all(p == highest for p in precisions), precisions
  # Half-precision rows, and every row where equal precision is off (CPU), trace as the function itself does.
  plain_fwd, _ = bench_attention.forward_and_backward(bench_attention.jax_attention_fn(implementation, case, None),
                                                      equal_precision=False)
  assert highest not in _dot_precisions(jax.make_jaxpr(plain_fwd)(q, q, q).jaxpr)
  half = q.astype(jnp.bfloat16)
  assert (_dot_precisions(jax.make_jaxpr(fwd)(half, half, half).jaxpr)
          == _dot_precisions(jax.make_jaxpr(plain_fwd)(half, half, half).jaxpr))


def test_gpu_check_runs_test_files_and_benchmark_flags_that_exist():
  script = (REPOSITORY / "experiments" / "gpu_check.sh").read_text()
  test_files = re.findall(r"\btests/[\w/]+\.py\b", script)
  assert test_files and all((REPOSITORY / f).is_file() for f in test_files), test_files
  flags = re.findall(r"bench_attention\.py (--\w+)", script)
  benchmark = (REPOSITORY / "experiments" / "bench_attention.py").read_text()
  common = (REPOSITORY / "experiments" / "bench_common.py").read_text()  # --out, --quick
  assert "--out" in flags and all(f'"{flag}"' in benchmark + common for flag in flags), flags


def test_an_implementation_that_cannot_compile_is_a_failed_row_and_every_row_is_written_as_it_lands(monkeypatch):
  """One implementation a backend cannot run (cuDNN on a shape it refuses, say) stopped the whole run and lost
  every measured row; and rows were written only at the end, so a run stopped by a time limit left nothing."""
  cases = [bench_attention.Case("plain", 1, 8, 8, heads=2, kv_heads=2, head_dim=4),
           bench_attention.Case("GQA 8/2", 1, 8, 8, heads=2, kv_heads=1, head_dim=4)]
  real = bench_attention.jax_attention_fn

  def chunked_refuses(name, case, mask):
    if name == "ours chunked":
      def refuse(q, k, v):
        raise NotImplementedError("no chunked path here\nsecond line")
      return refuse
    return real(name, case, mask)

  monkeypatch.setattr(bench_attention, "jax_attention_fn", chunked_refuses)
  rows, written = [], []
  bench_attention.speed_rows(cases, 1, lambda case: 1, rows=rows, on_row=lambda: written.append(len(rows)))
  assert written == [1, 2]
  for row in rows:
    assert row["failed"] == {"ours chunked": "NotImplementedError: no chunked path here"}
    assert set(row["ms"]) == {"torch SDPA", "jax.nn", "ours xla"}
  meta = {"date": "d", "machine": "m", "jax": "j", "jax_devices": 1, "cores": 1, "torch": "t", "torch_threads": 1,
          "load_average": "0", "commit": "c", "command": "x", "repeats": 1}
  markdown = bench_attention.to_markdown(meta, rows, [], [])
  assert markdown.count("| ours chunked | failed: NotImplementedError: no chunked path here |") == 2
  # the processor, not only "x86_64": two EPYC generations differ 2.4x at a matmul
  named = bench_attention.to_markdown({**meta, "cpu": "AMD EPYC (AVX2; family 23 model 1)"}, rows, [], [])
  assert "Machine: m (AMD EPYC (AVX2; family 23 model 1));" in named


@pytest.mark.parametrize("flags, speed, long", [
    (dict(), 15, 7),                                       # every speed case at its lengths, every long-key row
    (dict(case=["GQA 8/2", "head_dim 128"], no_long_keys=True), 4, 0),
    (dict(case=["plain"]), 3, 7),
    (dict(long_keys_only=True), 0, 7),
])
def test_the_flags_pick_the_rows_to_measure(flags, speed, long):
  """--case picks speed cases; the long-key rows (minutes on a CPU) ran after every --case run until
  --no_long_keys could leave them out."""
  args = argparse.Namespace(**{"quick": False, "case": None, "long_keys_only": False, "no_long_keys": False, **flags})
  cases, long_cases = bench_attention.planned_cases(args)
  assert (len(cases), len(long_cases)) == (speed, long)
  assert {case.name for case in cases} <= set(flags.get("case") or bench_attention.CASES)
