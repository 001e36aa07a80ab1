"""Attention speed and memory on this machine: our implementations vs jax.nn and torch SDPA.

Speed: batch 8, 8 heads, head_dim 64, float32, lengths 128 / 512 / 2048; forward and
forward+backward (gradients w.r.t. query, key and value of the output's sum), medians of several
rounds after a warm-up (every row of a length interleaved round by round), `block_until_ready` on
every result; torch runs with as many threads as JAX has cores. Memory: peak resident set of dense
(`jax.nn.dot_product_attention`, which materializes the [batch, heads, q, kv] scores) versus our
paths at length 16384 (batch 1, 8 heads), each in its own fresh process, with its time. Writes experiments/results/attention_benchmark.{md,json}.

On a GPU backend the same tables are made on the GPU (torch on CUDA, synchronized), in float32
and in bfloat16 with cuDNN rows (ours and jax.nn's), memory as the device's peak bytes in use;
they go to attention_benchmark_gpu.{md,json}.

  python experiments/bench_attention.py           # full run, several minutes
  python experiments/bench_attention.py --quick   # seconds: tiny sizes, into a new temporary directory
"""
from __future__ import annotations

import argparse
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
from bench_common import add_output_flags, blocked_median_seconds, parse_output_args  # noqa: E402
from xattn_jax.ops import attention  # noqa: E402

OURS = {"ours (default)": None, "ours dense": "dense", "ours xla": "xla", "ours chunked": "chunked",
        "ours cudnn": "cudnn"}
ON_GPU = jax.default_backend() == "gpu"


def jax_attention_fn(name):
  if name in ("jax.nn", "jax.nn cudnn"):
    implementation = "cudnn" if name == "jax.nn cudnn" else "xla"
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=implementation)
  return lambda q, k, v: attention.dot_product_attention(q, k, v, implementation=OURS[name])


def names_for(dtype: str) -> tuple[str, ...]:
  """The rows measured besides torch: cuDNN rows only where cuDNN can run (GPU, half precision)."""
  cudnn = ON_GPU and dtype != "float32"
  return ("jax.nn", *(("jax.nn cudnn",) if cudnn else ()), *(n for n in OURS if cudnn or n != "ours cudnn"))


def forward_and_backward(fn):
  """(jitted forward, jitted gradients of sum(output) w.r.t. q, k, v)."""
  return jax.jit(fn), jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2)))


def median_ms(run, repeats):
  run()  # warm-up (and compile)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def torch_runners(arrays, threads):
  import torch
  torch.set_num_threads(threads)
  device = "cuda" if ON_GPU else "cpu"
  sync = torch.cuda.synchronize if ON_GPU else (lambda: None)
  dtype = getattr(torch, str(arrays[0].dtype))
  # torch SDPA takes [batch, heads, length, head_dim]
  q, k, v = (torch.from_numpy(np.array(x, np.float32)).to(device, dtype).transpose(1, 2).contiguous()
             for x in arrays)
  qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

  def forward():
    with torch.no_grad():
      torch.nn.functional.scaled_dot_product_attention(q, k, v)
    sync()

  def backward():
    torch.nn.functional.scaled_dot_product_attention(qg, kg, vg).sum().backward()
    sync()

  return forward, backward


def speed_rows(lengths, batch, heads, head_dim, threads, repeats_at, dtype="float32"):
  rows = []
  rng = np.random.default_rng(0)
  for length in lengths:
    arrays = [jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), dtype) for _ in range(3)]
    repeats = repeats_at(length)
    runners = dict(zip((("torch SDPA", 0), ("torch SDPA", 1)), torch_runners(arrays, threads)))
    for name in names_for(dtype):
      fwd, bwd = forward_and_backward(jax_attention_fn(name))
      runners[name, 0] = lambda fwd=fwd: jax.block_until_ready(fwd(*arrays))
      runners[name, 1] = lambda bwd=bwd: jax.block_until_ready(bwd(*arrays))
    # Every row interleaved in rounds, so load changes hit them alike. In a round each row first runs
    # once untimed, so the timed runs follow a run of the same program, as in a training loop: right
    # after another library's call its threads still spin, and right after a call that freed
    # gigabytes (jax.nn's backward) the allocator faults its pages back in. Short calls run 3 a round.
    seconds = blocked_median_seconds(runners, blocks=repeats, per_block=3 if length <= 512 or ON_GPU else 1,
                                     warmup=1, drop_first=True)
    row = {"length": length, "dtype": dtype,
           "ms": {name: [seconds[name, 0] * 1e3, seconds[name, 1] * 1e3] for name, mode in runners if mode == 0}}
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


def memory_worker(name, mode, length, heads, head_dim, repeats):
  """Runs in a fresh process: prints peak RSS growth (MB), time (ms) and XLA's temp buffer size."""
  rng = np.random.default_rng(0)
  arrays = [jnp.asarray(rng.normal(size=(1, length, heads, head_dim)), jnp.float32) for _ in range(3)]
  fwd, bwd = forward_and_backward(jax_attention_fn(name))
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


def memory_rows(names, length, heads, head_dim, repeats):
  rows = []
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
  return rows


def to_markdown(meta, speed, memory):
  where = (f"JAX {meta['jax']} on {meta['jax_device_kind']}; torch {meta['torch']} on CUDA" if ON_GPU else
           f"JAX {meta['jax']} on {meta['jax_devices']} CPU device(s) using {meta['cores']} cores; "
           f"torch {meta['torch']} with {meta['torch_threads']} threads")
  lines = [f"# Attention benchmark ({meta['date']})", "",
           f"Machine: {meta['machine']}; {where}. Load average at start: {meta['load_average']}. "
           f"Medians over {meta['repeats']} after a warm-up; within a length every row is timed round by "
           "round, interleaved with the others, each round's timed runs after one untimed run.", ""]
  digits = 3 if ON_GPU else 1
  for dtype in dict.fromkeys(row["dtype"] for row in speed):
    lines += [f"## Speed: batch {meta['batch']}, {meta['heads']} heads, head_dim {meta['head_dim']}, {dtype} (ms)", "",
              "| length | implementation | forward | fwd+bwd | fwd / torch | fwd+bwd / torch | fwd / jax.nn | "
              "fwd+bwd / jax.nn |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in (r for r in speed if r["dtype"] == dtype):
      torch_ms, jax_ms = row["ms"]["torch SDPA"], row["ms"]["jax.nn"]
      for name, (fwd, bwd) in row["ms"].items():
        lines.append(f"| {row['length']} | {name} | {fwd:.{digits}f} | {bwd:.{digits}f} | {fwd / torch_ms[0]:.2f} | "
                     f"{bwd / torch_ms[1]:.2f} | {fwd / jax_ms[0]:.2f} | {bwd / jax_ms[1]:.2f} |")
    lines.append("")
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_output_flags(parser)
  parser.add_argument("--memory_worker", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.memory_worker:
    name, mode, length, heads, head_dim, repeats = args.memory_worker.split("|")
    memory_worker(name, mode, int(length), int(heads), int(head_dim), int(repeats))
    return
  args = parse_output_args(parser, "bench_attention")  # the output directory made before measuring

  import torch
  cores = os.cpu_count()
  batch, heads, head_dim = (2, 2, 16) if args.quick else (8, 8, 64)
  lengths = (32, 64) if args.quick else (128, 512, 2048)
  memory_length = 256 if args.quick else 16384
  # Short calls get more rounds: at 512 one round of every row takes ~6 s, and on a shared machine
  # 5 rounds left the same program 10% apart in two rows of one run.
  repeats_at = (lambda length: 2) if args.quick else (lambda length: 15 if length <= 512 else 5)
  if ON_GPU and not args.quick:  # milliseconds a call: many more runs for the same wall time
    repeats_at = lambda length: 10
  meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": cores,
          "machine": f"{platform.processor() or platform.machine()}, {cores} cores",
          "jax": jax.__version__, "jax_devices": jax.local_device_count(),
          "jax_device_kind": jax.devices()[0].device_kind, "torch": torch.__version__,
          "torch_threads": cores, "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()),
          "batch": batch, "heads": heads, "head_dim": head_dim,
          "repeats": ("10 rounds of 3; 3 for memory" if ON_GPU else
                      "15 rounds of 3 timed runs up to length 512, 5 rounds of 1 beyond; 1 for memory")
                     if not args.quick else 2}
  speed = []
  for dtype in ("float32", "bfloat16") if ON_GPU else ("float32",):
    speed += speed_rows(lengths, batch, heads, head_dim, cores, repeats_at, dtype)
  memory = memory_rows(("jax.nn", "ours xla", "ours chunked"), memory_length, heads, head_dim,
                       repeats=(3 if ON_GPU else 1) if not args.quick else 2)
  out_dir = args.out
  markdown = to_markdown(meta, speed, memory)
  stem = "attention_benchmark_gpu" if ON_GPU else "attention_benchmark"
  with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
    f.write(markdown)
  with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
    json.dump({"meta": meta, "speed": speed, "memory": memory}, f, indent=1)
  print(markdown)
  print(f"wrote {os.path.join(out_dir, stem)}.md")


if __name__ == "__main__":
  main()
