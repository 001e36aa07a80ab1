"""Attention speed and memory on this machine: our implementations vs jax.nn and torch SDPA.

Speed: forward and forward+backward (gradients w.r.t. query, key and value of the output's sum),
float32, medians of several rounds after a warm-up (every row of a case interleaved round by round),
`block_until_ready` on every result; torch runs with as many threads as JAX has cores. The cases
(`CASES`) are the shapes the models use, each at a base length L of 512 and 2048 (the plain case
also at 128): plain self-attention (batch 8, 8 heads, head_dim 64), causal with key padding,
cross-attention over a padded memory, GQA, head_dim 128, batch 1 with a short query over a long
memory, and a shape the blocking constants were not tuned on (odd lengths, 6 heads of 80). The
default path's row names the implementation `implementation=None` picks; it runs that program.
Long keys: "xla" against "chunked" at kv_len 4096 / 8192 / 16384 (self-attention, and a short query up to 32768),
time and XLA's temp-buffer bytes: the numbers behind the default's choice between them.
Memory: peak resident set of dense (`jax.nn.dot_product_attention`, which materializes the
[batch, heads, q, kv] scores) versus our paths at length 16384 (batch 1, 8 heads), each in its own
fresh process, with its time. Writes experiments/results/attention_benchmark.{md,json}.

On a GPU backend the same tables are made on the GPU (torch on CUDA, synchronized), in float32 (full
float32 matmuls on both sides: PRECISION_NOTE) and in bfloat16 with cuDNN rows (ours and jax.nn's), memory
as the device's peak bytes in use; they go to attention_benchmark_gpu.{md,json}.

  python experiments/bench_attention.py           # full run, several minutes
  python experiments/bench_attention.py --quick   # seconds: tiny sizes, into a new temporary directory
  python experiments/bench_attention.py --long_keys_only   # the long-key rows alone: attention_long_keys.{md,json}
  python experiments/bench_attention.py --case plain --case "GQA 8/2" --no_long_keys --no_memory   # those rows only
Results are written after every row: a run stopped partway keeps what it measured (marked incomplete).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# On GPU, take device memory as needed (not 75% up front), so the memory workers' fresh processes
# find the device free and their peak bytes are their own.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_common import (HostContention, add_output_flags, blocked_median_seconds, parse_output_args,  # noqa: E402
                          run_record)
from xattn_jax.ops import attention  # noqa: E402


def ours() -> dict[str, str | None]:
  """Our rows' names and the implementation each runs: the default path, then every name in the registry
  (`attention.IMPLEMENTATIONS`, read when called, so one registered before the run gets its rows)."""
  return {"ours (default)": None, **{f"ours {name}": name for name in attention.IMPLEMENTATIONS}}


ON_GPU = jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention shape: query [batch, q_len, heads, head_dim], keys [batch, kv_len, kv_heads, head_dim].

  key_padding: the last keys of some rows are hidden by a [batch, 1, 1, kv_len] mask (row b keeps
  kv_len - (b % 4) * kv_len // 8 keys, so no query row is left without keys).
  """
  name: str
  batch: int
  q_len: int
  kv_len: int
  heads: int = 8
  kv_heads: int = 8
  head_dim: int = 64
  is_causal: bool = False
  key_padding: bool = False

  def label(self) -> str:
    shape = f"b{self.batch} q{self.q_len} kv{self.kv_len} h{self.heads}"
    shape += f"/{self.kv_heads}kv" if self.kv_heads != self.heads else ""
    return shape + f" d{self.head_dim}" + (" causal" if self.is_causal else "") + (" pad" if self.key_padding else "")


# The shapes the models use, at base length L and batch B (`CASES[name](L, B)`): the one owner of the list.
CASES = {
    "plain": lambda L, B: Case("plain", B, L, L),
    "causal + key padding": lambda L, B: Case("causal + key padding", B, L, L, is_causal=True, key_padding=True),
    "cross, padded memory": lambda L, B: Case("cross, padded memory", B, L // 2, L, key_padding=True),
    "GQA 8/2": lambda L, B: Case("GQA 8/2", B, L, L, kv_heads=2),
    "head_dim 128": lambda L, B: Case("head_dim 128", B, L, L, heads=4, kv_heads=4, head_dim=128),
    "batch 1, long kv": lambda L, B: Case("batch 1, long kv", 1, L // 4, 8 * L),
    "untuned shape": lambda L, B: Case("untuned shape", max(1, B * 3 // 8), L - L // 8 + 5, L - L // 8 + 5, heads=6,
                                       kv_heads=6, head_dim=80),
}
LONG_CASES = (  # xla against chunked: the default's rule between them
    *(Case("self", 1, n, n) for n in (4096, 8192, 16384)),
    *(Case("short query", 1, 256, n) for n in (4096, 8192, 16384, 32768)),
)


def case_arrays(case: Case, dtype, rng):
  """(query, key, value, mask or None) for a case, as JAX arrays."""
  q = jnp.asarray(rng.normal(size=(case.batch, case.q_len, case.heads, case.head_dim)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(case.batch, case.kv_len, case.kv_heads, case.head_dim)), dtype)
          for _ in range(2))
  mask = None
  if case.key_padding:
    valid = case.kv_len - (np.arange(case.batch) % 4) * (case.kv_len // 8)  # -> [batch]
    mask = jnp.asarray(np.arange(case.kv_len)[None, :] < valid[:, None])[:, None, None, :]
  return q, k, v, mask


def default_implementation(case: Case, dtype) -> str:
  return attention.select_implementation(
      backend=jax.default_backend(), dtype=dtype, head_dim=case.head_dim, q_len=case.q_len, kv_len=case.kv_len,
      has_mask=case.key_padding, has_bias=False, is_causal=case.is_causal, groups=case.heads // case.kv_heads)


# Float32 on both sides means full float32 matmuls: XLA's GPU default for float32 is TF32, torch's is not
# (torch_runners turns TF32 off explicitly). CPU matmuls are float32 either way.
FLOAT32_MATMUL_PRECISION = "highest"
PRECISION_NOTE = ("float32 rows at full float32 on both sides: JAX traced under "
                  f"jax.default_matmul_precision({FLOAT32_MATMUL_PRECISION!r}), torch with "
                  "torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32 False")


def at_equal_precision(fn, enabled: bool):
  """fn(q, k, v) traced with full-float32 matmuls when its inputs are float32 (and `enabled`)."""
  def wrapped(q, k, v):
    if not enabled or q.dtype != jnp.float32:
      return fn(q, k, v)
    with jax.default_matmul_precision(FLOAT32_MATMUL_PRECISION):
      return fn(q, k, v)
  return wrapped


def jax_attention_fn(name, case: Case, mask):
  kwargs = dict(mask=mask, is_causal=case.is_causal)
  if name in ("jax.nn", "jax.nn cudnn"):
    implementation = "cudnn" if name == "jax.nn cudnn" else "xla"
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=implementation, **kwargs)
  return lambda q, k, v: attention.dot_product_attention(q, k, v, implementation=ours()[name], **kwargs)


def names_for(dtype: str, case: Case) -> tuple[str, ...]:
  """The rows measured besides torch: the paths the default can take ("xla", "chunked"), cuDNN rows only
  where cuDNN can run (GPU, half precision), and registered implementations. "dense" is what "xla" runs up to
  256 x 256 scores."""
  cudnn = ON_GPU and dtype != "float32"
  rows = [n for n in ours() if n not in ("ours (default)", "ours dense") and (cudnn or n != "ours cudnn")]
  return ("jax.nn", *(("jax.nn cudnn",) if cudnn else ()), *rows)


def forward_and_backward(fn, equal_precision: bool = ON_GPU):
  """(jitted forward, jitted gradients of sum(output) w.r.t. q, k, v), each traced whole (the backward's
  custom VJP rules included) at full float32 for float32 inputs when `equal_precision`."""
  grad = jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))
  return (jax.jit(at_equal_precision(fn, equal_precision)), jax.jit(at_equal_precision(grad, equal_precision)))


def median_ms(run, repeats):
  run()  # warm-up (and compile)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def torch_runners(arrays, mask, case: Case, threads):
  import torch
  torch.set_num_threads(threads)
  torch.backends.cuda.matmul.allow_tf32 = False  # PRECISION_NOTE: full float32, as the JAX rows
  torch.backends.cudnn.allow_tf32 = False
  device = "cuda" if ON_GPU else "cpu"
  sync = torch.cuda.synchronize if ON_GPU else (lambda: None)
  dtype = getattr(torch, str(arrays[0].dtype))
  # torch SDPA takes [batch, heads, length, head_dim]
  q, k, v = (torch.from_numpy(np.array(x, np.float32)).to(device, dtype).transpose(1, 2).contiguous()
             for x in arrays)
  qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
  attn_mask, is_causal = None, case.is_causal
  if mask is not None:  # torch takes a causal flag or a mask, not both: a causal case's mask holds both
    attn_mask = torch.from_numpy(np.array(mask)).to(device)
    if case.is_causal:
      attn_mask = attn_mask & torch.ones(case.q_len, case.kv_len, dtype=torch.bool, device=device).tril(
          case.kv_len - case.q_len)
      is_causal = False
  kwargs = dict(attn_mask=attn_mask, is_causal=is_causal, enable_gqa=case.kv_heads != case.heads)

  def forward():
    with torch.no_grad():
      torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    sync()

  def backward():  # fresh gradients, as jax.grad returns: .backward() would also add them into .grad each call
    torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, **kwargs).sum(), (qg, kg, vg))
    sync()

  return forward, backward


def small(case: Case) -> bool:
  """Whether a case's calls are short (up to 8 x 8 x 512 x 512 scores): more runs a round."""
  return case.batch * case.heads * case.q_len * case.kv_len <= 8 * 8 * 512 * 512


def speed_rows(cases, threads, repeats_at, dtype="float32", rows=None, on_row=lambda: None):
  """Appends a row per case to `rows` (returned), calling `on_row()` after each."""
  rows = [] if rows is None else rows
  rng = np.random.default_rng(0)
  for case in cases:
    *arrays, mask = case_arrays(case, dtype, rng)
    repeats = repeats_at(case)
    runners = dict(zip((("torch SDPA", 0), ("torch SDPA", 1)), torch_runners(arrays, mask, case, threads)))
    failed = {}
    for name in names_for(dtype, case):
      try:  # an implementation this backend or library version cannot run is a row that says so, not a lost run
        fwd, bwd = (fn.lower(*arrays).compile() for fn in forward_and_backward(jax_attention_fn(name, case, mask)))
      except Exception as error:  # noqa: BLE001  (any compile or lowering error is reported the same way)
        failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        continue
      runners[name, 0] = lambda fwd=fwd: jax.block_until_ready(fwd(*arrays))
      runners[name, 1] = lambda bwd=bwd: jax.block_until_ready(bwd(*arrays))
    # Every row interleaved in rounds, so load changes hit them alike. In a round each row first runs
    # once untimed, so the timed runs follow a run of the same program, as in a training loop: right
    # after another library's call its threads still spin, and right after a call that freed
    # gigabytes (jax.nn's backward) the allocator faults its pages back in. Short calls run 2 a round;
    # long ones (a second or more) once, without the untimed run.
    few = small(case) or ON_GPU
    seconds = blocked_median_seconds(runners, blocks=repeats, per_block=2 if few else 1, warmup=1, drop_first=few)
    row = {"case": case.name, "shape": dataclasses.asdict(case), "dtype": dtype,
           "default": default_implementation(case, dtype),
           "ms": {name: [seconds[name, 0] * 1e3, seconds[name, 1] * 1e3] for name, mode in runners if mode == 0},
           **({"failed": failed} if failed else {})}
    print(json.dumps(row), flush=True)
    rows.append(row)
    on_row()
  return rows


def long_rows(cases, threads, repeats, rows=None, on_row=lambda: None):
  """xla and chunked (and torch SDPA) at long key lengths: ms forward / forward+backward and XLA's
  temp bytes for each program, interleaved round by round."""
  rows = [] if rows is None else rows
  rng = np.random.default_rng(0)
  for case in cases:
    *arrays, mask = case_arrays(case, "float32", rng)
    runners, temp_mb = dict(zip((("torch SDPA", 0), ("torch SDPA", 1)), torch_runners(arrays, mask, case, threads))), {}
    for name in ("ours xla", "ours chunked"):
      for mode, fn in enumerate(forward_and_backward(jax_attention_fn(name, case, mask))):
        compiled = fn.lower(*arrays).compile()
        temp_mb[name, mode] = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
        runners[name, mode] = lambda compiled=compiled: jax.block_until_ready(compiled(*arrays))
    seconds = blocked_median_seconds(runners, blocks=repeats, per_block=1, warmup=1, drop_first=False)
    row = {"case": case.name, "shape": dataclasses.asdict(case), "default": default_implementation(case, "float32"),
           "ms": {name: [seconds[name, 0] * 1e3, seconds[name, 1] * 1e3] for name, mode in runners if mode == 0},
           "xla_temp_mb": {name: [temp_mb[name, 0], temp_mb[name, 1]] for name, mode in temp_mb if mode == 0}}
    print(json.dumps(row), flush=True)
    rows.append(row)
    on_row()
  return rows


def memory_worker(name, mode, length, heads, head_dim, repeats):
  """Runs in a fresh process: prints peak RSS growth (MB), time (ms) and XLA's temp buffer size."""
  rng = np.random.default_rng(0)
  case = Case("memory", 1, length, length, heads=heads, kv_heads=heads, head_dim=head_dim)
  *arrays, mask = case_arrays(case, jnp.float32, rng)
  fwd, bwd = forward_and_backward(jax_attention_fn(name, case, mask))
  fn = fwd if mode == "forward" else bwd
  compiled = fn.lower(*arrays).compile()
  temp_mb = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
  if ON_GPU:  # the device's peak bytes in use, over what the inputs already hold
    stats = lambda: jax.devices()[0].memory_stats()
    jax.block_until_ready(compiled(*arrays))  # a first run (autotuning allocations) before the baseline
    baseline = stats()["bytes_in_use"]
    ms = median_ms(lambda: jax.block_until_ready(compiled(*arrays)), repeats)
    peak_mb = (stats()["peak_bytes_in_use"] - baseline) / 2 ** 20
    print(json.dumps({"peak_rss_growth_mb": peak_mb, "ms": ms, "xla_temp_mb": temp_mb}))
    return
  rss = lambda field: int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(field))) / 1024
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak resident set (VmHWM) so compile time does not count
  baseline = rss("VmRSS:")
  ms = median_ms(lambda: jax.block_until_ready(compiled(*arrays)), repeats)
  print(json.dumps({"peak_rss_growth_mb": rss("VmHWM:") - baseline, "ms": ms, "xla_temp_mb": temp_mb}))


def memory_rows(names, length, heads, head_dim, repeats, rows=None, on_row=lambda: None):
  rows = [] if rows is None else rows
  for mode in ("forward", "forward+backward"):
    for name in names:
      # The dense forward+backward keeps several [heads, q, kv] float32 arrays: skip it when the
      # machine cannot hold them instead of pushing every other process into swap or the OOM killer.
      needed_gb = heads * length * length * 4 * (2 if mode == "forward" else 4) / 2 ** 30
      if ON_GPU:
        available_gb = jax.devices()[0].memory_stats()["bytes_limit"] / 2 ** 30
      else:
        available_gb = int(next(l.split()[1] for l in open("/proc/meminfo") if l.startswith("MemAvailable"))) / 2 ** 20
      row = {"implementation": name, "mode": mode, "length": length}
      if name == "jax.nn" and needed_gb > 0.8 * available_gb:
        row["skipped"] = f"needs ~{needed_gb:.0f} GB, {available_gb:.0f} GB available"
      else:
        cmd = [sys.executable, __file__, "--memory_worker", f"{name}|{mode}|{length}|{heads}|{head_dim}|{repeats}"]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode:
          row["skipped"] = f"worker failed: {result.stderr.strip().splitlines()[-1:]}"
        else:
          row.update(json.loads(result.stdout.strip().splitlines()[-1]))
      print(json.dumps(row), flush=True)
      rows.append(row)
      on_row()
  return rows


def to_markdown(meta, speed, long, memory):
  where = (f"JAX {meta['jax']} on {meta['jax_device_kind']}; torch {meta['torch']} on CUDA" if ON_GPU else
           f"JAX {meta['jax']} on {meta['jax_devices']} CPU device(s) using {meta['cores']} cores; "
           f"torch {meta['torch']} with {meta['torch_threads']} threads")
  lines = [f"# Attention benchmark ({meta['date']})", "",
           f"Machine: {meta['machine']}" + (f" ({meta['cpu']})" if meta.get("cpu") else "")
           + f"; {where}. Load average before the start: {meta['load_average']}"
           + (f"; {HostContention.describe(meta['contention'])}. " if "contention" in meta else ". ") +
           f"Commit {meta['commit']}. Command: `{meta['command']}`. "
           f"Medians over {meta['repeats']} after a warm-up; within a case every row is timed round by "
           "round, interleaved with the others. "
           "`ours (default)` is the implementation `implementation=None` picks for the case (the same program "
           "as that row, so its numbers are that row's)."
           + (f" Precision: {meta['float32_precision']}." if "float32_precision" in meta else ""), ""]
  digits = 3 if ON_GPU else 1
  for dtype in dict.fromkeys(row["dtype"] for row in speed):
    rows = [r for r in speed if r["dtype"] == dtype]
    lines += [f"## Default path against torch SDPA and jax.nn, {dtype} (forward+backward unless said)", "",
              "| case | shape | default | fwd / torch | fwd+bwd / torch | fwd / jax.nn | fwd+bwd / jax.nn |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
      if f"ours {row['default']}" not in row["ms"] or "jax.nn" not in row["ms"]:
        lines.append(f"| {row['case']} | {Case(**row['shape']).label()} | {row['default']} | failed: see below | | | |")
        continue
      ours, torch_ms, jax_ms = row["ms"][f"ours {row['default']}"], row["ms"]["torch SDPA"], row["ms"]["jax.nn"]
      lines.append(f"| {row['case']} | {Case(**row['shape']).label()} | {row['default']} | "
                   f"{ours[0] / torch_ms[0]:.2f} | **{ours[1] / torch_ms[1]:.2f}** | {ours[0] / jax_ms[0]:.2f} | "
                   f"{ours[1] / jax_ms[1]:.2f} |")
    lines += ["", f"## Speed, every implementation, {dtype} (ms)", "",
              "| case | shape | implementation | forward | fwd+bwd | fwd / torch | fwd+bwd / torch | fwd / jax.nn | "
              "fwd+bwd / jax.nn |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
      torch_ms, jax_ms = row["ms"]["torch SDPA"], row["ms"].get("jax.nn", (float("nan"),) * 2)
      for name, error in row.get("failed", {}).items():
        lines.append(f"| {row['case']} | {Case(**row['shape']).label()} | {name} | failed: {error} | | | | | |")
      for name, (fwd, bwd) in row["ms"].items():
        shown = name + (" = default" if name == f"ours {row['default']}" else "")
        lines.append(f"| {row['case']} | {Case(**row['shape']).label()} | {shown} | {fwd:.{digits}f} | "
                     f"{bwd:.{digits}f} | {fwd / torch_ms[0]:.2f} | {bwd / torch_ms[1]:.2f} | {fwd / jax_ms[0]:.2f} | "
                     f"{bwd / jax_ms[1]:.2f} |")
    lines.append("")
  if long:
    lines += ["## Long keys: xla against chunked, float32 (ms; XLA temp buffers in MB)", "",
              "| case | shape | default | xla fwd | chunked fwd | xla fwd+bwd | chunked fwd+bwd | chunked / xla "
              "(fwd, fwd+bwd) | temp MB xla / chunked (fwd+bwd) | torch SDPA fwd / fwd+bwd |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in long:
      x, c, t = row["ms"]["ours xla"], row["ms"]["ours chunked"], row["ms"]["torch SDPA"]
      mx, mc = row["xla_temp_mb"]["ours xla"], row["xla_temp_mb"]["ours chunked"]
      lines.append(f"| {row['case']} | {Case(**row['shape']).label()} | {row['default']} | {x[0]:.0f} | {c[0]:.0f} | "
                   f"{x[1]:.0f} | {c[1]:.0f} | {c[0] / x[0]:.2f}, {c[1] / x[1]:.2f} | {mx[1]:.0f} / {mc[1]:.0f} | "
                   f"{t[0]:.0f} / {t[1]:.0f} |")
    lines.append("")
  if not memory:
    return "\n".join(lines) + "\n"
  peak = ("Peak device bytes in use while running the compiled function (after a first run), over what its "
          "inputs hold" if ON_GPU else "Peak resident-set growth while running the compiled function (after compiling)")
  lines += [f"## Memory: batch 1, {meta['heads']} heads, head_dim {meta['head_dim']}, float32, each in a "
            "fresh process", "",
            f"{peak}, its median time, and XLA's own temp-buffer size for that program.", "",
            f"| length | implementation | mode | peak {'device' if ON_GPU else 'RSS growth'} (MB) | XLA temp (MB) | ms |",
            "| --- | --- | --- | --- | --- | --- |"]
  for row in memory:
    if "skipped" in row:
      lines.append(f"| {row['length']} | {row['implementation']} | {row['mode']} | skipped: {row['skipped']} | | |")
    else:
      lines.append(f"| {row['length']} | {row['implementation']} | {row['mode']} | {row['peak_rss_growth_mb']:.0f} | "
                   f"{row['xla_temp_mb']:.0f} | {row['ms']:.0f} |")
  return "\n".join(lines) + "\n"


def planned_cases(args) -> tuple[list[Case], tuple[Case, ...]]:
  """(speed cases, long-key cases) that the flags ask for: --case picks speed cases, --long_keys_only drops them,
  --no_long_keys drops the long-key rows, --quick shrinks both."""
  # Base lengths and batches: batch 8 up to length 512, 2 at 2048 (a round of every case there takes
  # minutes on this shared 2-core machine at batch 8).
  bases = {"plain": ((32, 8), (64, 8))} if args.quick else {"plain": ((128, 8), (512, 8), (2048, 2))}
  default_bases = ((32, 8), (64, 8)) if args.quick else ((512, 8), (2048, 2))
  cases = [CASES[name](*base) for name in args.case or CASES for base in bases.get(name, default_bases)]
  long = ((Case("self", 1, 256, 256), Case("short query", 1, 16, 512)) if args.quick else LONG_CASES)
  return ([] if args.long_keys_only else cases), (() if args.no_long_keys else long)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_output_flags(parser)
  parser.add_argument("--memory_worker", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--no_memory", action="store_true",
                      help="skip the fresh-process memory rows at length 16384 (minutes on a loaded machine)")
  parser.add_argument("--long_keys_only", action="store_true",
                      help="only the long-key rows (xla against chunked), into attention_long_keys.{md,json}")
  parser.add_argument("--case", action="append", choices=list(CASES), default=None,
                      help="a speed case to run (repeat the flag for several); default: every case")
  parser.add_argument("--no_long_keys", action="store_true",
                      help="skip the long-key rows (xla against chunked up to 32768 keys: minutes on a CPU)")
  args = parser.parse_args()
  if args.long_keys_only and args.no_long_keys:
    parser.error("--long_keys_only and --no_long_keys together leave nothing to measure")
  if args.memory_worker:
    name, mode, length, heads, head_dim, repeats = args.memory_worker.split("|")
    memory_worker(name, mode, int(length), int(heads), int(head_dim), int(repeats))
    return
  load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
  contention = HostContention()
  args = parse_output_args(parser, "bench_attention")  # the output directory made before measuring

  import torch
  cores = len(os.sched_getaffinity(0))
  heads, head_dim = (2, 16) if args.quick else (8, 64)
  cases, long = planned_cases(args)
  memory_length = 256 if args.quick else 16384
  # Short calls get more rounds: at 512 one round of every row takes ~6 s, and on a shared machine
  # 5 rounds left the same program 10% apart in two rows of one run.
  repeats_at = (lambda case: 2) if args.quick else (lambda case: 3 if small(case) else 2)
  if ON_GPU and not args.quick:  # milliseconds a call: many more runs for the same wall time
    repeats_at = lambda case: 10
  meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": cores,
          "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
          "jax": jax.__version__, "jax_devices": jax.local_device_count(),
          "jax_device_kind": jax.devices()[0].device_kind, "torch": torch.__version__,
          "torch_threads": cores, "load_average": load_before, **run_record(),
          "float32_precision": PRECISION_NOTE if ON_GPU else "float32 matmuls at full float32 on both sides (CPU)",
          "heads": heads, "head_dim": head_dim,
          "repeats": ("10 rounds of 2 timed runs (after one untimed); long keys 2 rounds of 1; 3 for memory"
                      if ON_GPU else
                      "3 rounds of 2 timed runs (after one untimed) up to 8 x 8 x 512 x 512 scores, 2 rounds of 1 "
                      "beyond; long keys 2 rounds of 1; 1 for memory")
                     if not args.quick else 2}
  speed, long_measured, memory = [], [], []
  if args.long_keys_only:
    meta["repeats"] = "2 rounds of 1 (after a warm-up)" if not args.quick else 2
  stem = "attention_benchmark_gpu" if ON_GPU else "attention_benchmark"
  if args.long_keys_only:
    stem = stem.replace("benchmark", "long_keys")
  path = os.path.join(args.out, stem)

  def write(complete: bool):
    """Writes what is measured so far, after every row: a run stopped partway keeps its rows."""
    meta["complete"] = complete
    meta["contention"] = contention.summary()
    markdown = to_markdown(meta, speed, long_measured, memory)
    if not complete:
      markdown += "\nIncomplete: the run stopped before its last row.\n"
    with open(f"{path}.md", "w") as f:
      f.write(markdown)
    with open(f"{path}.json", "w") as f:
      json.dump({"meta": meta, "speed": speed, "long": long_measured, "memory": memory}, f, indent=1)
    return markdown

  for dtype in ("float32", "bfloat16") if ON_GPU else ("float32",):
    speed_rows(cases, cores, repeats_at, dtype, rows=speed, on_row=lambda: write(False))
  long_rows(long, cores, 2, rows=long_measured, on_row=lambda: write(False))
  if not (args.no_memory or args.long_keys_only):
    memory_rows(("jax.nn", "ours xla", "ours chunked"), memory_length, heads, head_dim,
                repeats=(3 if ON_GPU else 1) if not args.quick else 2, rows=memory, on_row=lambda: write(False))
  print(write(True))
  print(f"wrote {path}.md")


if __name__ == "__main__":
  main()
