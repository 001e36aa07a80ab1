"""How the latent reader's cost grows with the number of inputs M, against a self-attention encoder.

Both read the same images of side s (M = s * s pixels, s = 8 .. 128, so M = 64 .. 16,384), batch 1:
- reader: the Perceiver (N latents cross-attend once to the M pixels, then latent self-attention blocks):
  O(M N) for the cross-attention, the rest independent of M, so time and memory should grow ~ M;
- encoder: the ViT with the same width, heads and number of self-attention blocks over the M pixels:
  O(M^2) attention, so time should grow ~ M^2 (memory too, when the attention materialises its scores).

Each (model, M) runs in a fresh subprocess: build, compile, then the peak growth of the resident set
during the first forward (sampled every millisecond by a thread), then the median of several timed
forwards after warm-up, each with `block_until_ready`. The slopes of log(time) and log(memory)
against log(M) are fitted over the largest sizes. Results: experiments/results/latent_reader_benchmark.md,
.json and a log-log plot .png.

    python experiments/bench_latent_reader.py            # M = 64 .. 16384 (a few minutes)
    python experiments/bench_latent_reader.py --quick    # M = 64 .. 1024, a smoke test into a temporary directory
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))
from bench_common import add_output_flags, output_dir, parse_output_args, provenance, provenance_line  # noqa: E402

WIDTH, HEADS, BLOCKS, LATENTS, BATCH = 64, 4, 2, 32, 1
FULL_SIDES = (8, 16, 32, 64, 90, 128)
QUICK_SIDES = (8, 16, 32)


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakSampler(threading.Thread):
  """Samples the resident set every millisecond until stopped; `peak` is the largest value seen."""

  def __init__(self):
    super().__init__(daemon=True)
    self.peak, self._done = _rss_bytes(), threading.Event()

  def run(self):
    while not self._done.is_set():
      self.peak = max(self.peak, _rss_bytes())
      time.sleep(0.001)

  def stop(self) -> int:
    self._done.set()
    self.join()
    return max(self.peak, _rss_bytes())


def measure_one(model_name: str, side: int, repeats: int) -> dict:
  """Builds one model, and measures its forward on a [BATCH, side, side, 1] image (run in a subprocess)."""
  import gc

  import jax
  import jax.numpy as jnp
  from flax import nnx

  from xattn_jax.models import latent_reader, vit

  rngs = nnx.Rngs(0)
  if model_name == "reader":
    model = latent_reader.Perceiver(num_classes=10, grid=(8, 8), width=WIDTH, num_latents=LATENTS,
                                    num_heads=HEADS, num_blocks=BLOCKS, position_encoding="fourier", rngs=rngs)
  else:
    model = vit.ViT(num_classes=10, grid=(8, 8), width=WIDTH, num_heads=HEADS, num_blocks=BLOCKS, rngs=rngs)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, images: nnx.merge(graphdef, state)(images))
  images = jax.random.normal(jax.random.key(1), (BATCH, side, side, 1))
  compiled = forward.lower(state, images).compile()
  analysis = compiled.memory_analysis()
  gc.collect()
  rss_before = _rss_bytes()
  sampler = _PeakSampler()
  sampler.start()
  compiled(state, images).block_until_ready()
  peak_growth = sampler.stop() - rss_before
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    compiled(state, images).block_until_ready()
    times.append(time.perf_counter() - start)
  return {"model": model_name, "side": side, "M": side * side, "N": LATENTS if model_name == "reader" else None,
          "forward_ms": 1e3 * float(np.median(times)), "runs": repeats,
          "peak_rss_growth_mb": peak_growth / 2 ** 20,
          "xla_temp_mb": (analysis.temp_size_in_bytes / 2 ** 20) if analysis is not None else None}


def _run_subprocess(model_name: str, side: int, repeats: int) -> dict:
  command = [sys.executable, __file__, "--one", f"{model_name}:{side}", "--repeats", str(repeats)]
  done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
  if done.returncode:
    return {"model": model_name, "side": side, "M": side * side, "error": done.stderr.strip().splitlines()[-1:]}
  return json.loads(done.stdout.strip().splitlines()[-1])


def fit_slope(rows: list[dict], key: str, min_m: int) -> float | None:
  """Slope of log(key) against log(M) over rows with M >= min_m (None with fewer than two points)."""
  points = [(r["M"], r[key]) for r in rows if "error" not in r and r["M"] >= min_m and r[key] and r[key] > 0]
  if len(points) < 2:
    return None
  m, y = np.log(np.array(points, dtype=np.float64)).T
  return float(np.polyfit(m, y, 1)[0])


def _table(rows: list[dict]) -> str:
  lines = ["| M | reader ms | encoder ms | encoder / reader | reader peak MB | encoder peak MB | "
           "reader XLA temp MB | encoder XLA temp MB |",
           "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
  by_m = {}
  for r in rows:
    by_m.setdefault(r["M"], {})[r["model"]] = r
  for m in sorted(by_m):
    reader, encoder = by_m[m].get("reader", {}), by_m[m].get("encoder", {})

    def cell(row, key, fmt):
      return "failed" if "error" in row else (fmt.format(row[key]) if key in row else "-")

    ratio = (f"{encoder['forward_ms'] / reader['forward_ms']:.1f}x"
             if "forward_ms" in reader and "forward_ms" in encoder else "-")
    lines.append(f"| {m} | {cell(reader, 'forward_ms', '{:.2f}')} | {cell(encoder, 'forward_ms', '{:.2f}')} | "
                 f"{ratio} | {cell(reader, 'peak_rss_growth_mb', '{:.1f}')} | "
                 f"{cell(encoder, 'peak_rss_growth_mb', '{:.1f}')} | {cell(reader, 'xla_temp_mb', '{:.1f}')} | "
                 f"{cell(encoder, 'xla_temp_mb', '{:.1f}')} |")
  return "\n".join(lines)


def _plot(rows: list[dict], path: str):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure, axes = plt.subplots(1, 2, figsize=(10, 4))
  for axis, key, label in ((axes[0], "forward_ms", "forward time (ms)"),
                           (axes[1], "peak_rss_growth_mb", "peak RSS growth (MB)")):
    for model, marker in (("reader", "o"), ("encoder", "s")):
      points = [(r["M"], r[key]) for r in rows if r["model"] == model and "error" not in r and r[key] > 0]
      if points:
        axis.loglog(*zip(*points), marker=marker, label=model)
    ms = np.array(sorted({r["M"] for r in rows}), dtype=np.float64)
    values = [r[key] for r in rows if "error" not in r and r[key] > 0]
    for power, style in ((1, ":"), (2, "--")):  # reference slopes through the smallest value
      if values:
        axis.loglog(ms, (ms / ms[0]) ** power * min(values), "k" + style, linewidth=0.8, label=f"~ M^{power}")
    axis.set_xlabel("M (inputs)")
    axis.set_ylabel(label)
    axis.legend(fontsize=8)
  figure.suptitle(f"Perceiver reader (N={LATENTS}) vs self-attention encoder, width {WIDTH}, {BLOCKS} blocks")
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_output_flags(parser)
  parser.add_argument("--one", help="internal: MODEL:SIDE, measured in this process")
  parser.add_argument("--repeats", type=int, default=3, help="timed runs per size (--quick: 2)")
  parser.add_argument("--render", help="rewrite the .md / .png of a results .json without measuring")
  args = parser.parse_args()
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  if args.one:
    model_name, _, side = args.one.partition(":")
    if model_name not in ("reader", "encoder") or not side.isdigit():
      parser.error(f"--one must be reader:SIDE or encoder:SIDE, got {args.one!r}")
    print(json.dumps(measure_one(model_name, int(side), args.repeats)))
    return

  if args.render:
    if not os.path.isfile(args.render):
      parser.error(f"--render {args.render}: no such results file")
    with open(args.render) as f:
      record = json.load(f)
    write_results(record["rows"], os.path.splitext(args.render)[0], record.get("runs", args.repeats),
                  record["machine"])
    return
  args = parse_output_args(parser, "bench_latent_reader")  # the output directory made before measuring
  run = provenance()  # before measuring: its load average
  sides = QUICK_SIDES if args.quick else FULL_SIDES
  repeats = 2 if args.quick else args.repeats
  rows = []
  for side in sides:
    for model_name in ("reader", "encoder"):
      rows.append(_run_subprocess(model_name, side, repeats))
      print(json.dumps(rows[-1]), flush=True)
  stem = os.path.join(output_dir(args, "bench_latent_reader"), "latent_reader_benchmark")
  write_results(rows, stem, repeats, {"cpu_cores": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
                                      "provenance": run})
  print(f"wrote {stem}.md")


def _memory_reading(encoder_memory_slope, largest_m: int) -> str:
  """What the measured slope of the encoder's planned memory says (not a conclusion fixed in advance)."""
  if largest_m <= 1024:
    return (f"Sizes up to M = {largest_m} only (a smoke run): the slopes are not a measurement of growth; "
            "run without --quick for that.")
  if encoder_memory_slope is None:
    return "Too few sizes to fit the encoder's memory slope."
  if encoder_memory_slope < 1.5:
    return (f"The encoder's planned memory grows about linearly too (slope {encoder_memory_slope:.2f}): "
            "`xattn_jax.ops.attention` computes long attention in query / key blocks and never holds the "
            "[M, M] score matrix, so only its time is quadratic.")
  return (f"The encoder's planned memory grows faster than linearly (slope {encoder_memory_slope:.2f}): at "
          "these sizes its attention holds [M, M] scores.")


def write_results(rows: list[dict], stem: str, repeats: int, machine: dict):
  """stem.json (everything), stem.png (log-log plot) and stem.md (table and fitted slopes)."""
  min_m = 1024 if max(r["M"] for r in rows) > 1024 else 64
  slopes = {f"{model}_{key}": fit_slope([r for r in rows if r["model"] == model], key, min_m)
            for model in ("reader", "encoder") for key in ("forward_ms", "peak_rss_growth_mb", "xla_temp_mb")}
  cores, load, run = machine["cpu_cores"], machine["load_average_1min"], machine.get("provenance")
  # a results file written before the run was recorded renders without it
  ran = provenance_line(run) + " " if run else ""
  with open(stem + ".json", "w") as f:
    json.dump({"machine": machine, "runs": repeats,
               "setup": {"width": WIDTH, "heads": HEADS, "blocks": BLOCKS, "latents": LATENTS, "batch": BATCH},
               "slopes_over_M_at_least": min_m, "slopes": slopes, "rows": rows}, f, indent=1)
  _plot(rows, stem + ".png")

  def slope(name):
    return "n/a" if slopes[name] is None else f"{slopes[name]:.2f}"

  text = [f"# Latent reader vs self-attention encoder: cost against the number of inputs M", "",
          ran + f"Machine: {cores} CPU cores (1-minute load average {load:.1f} at the end: shared with other jobs). "
          f"Batch {BATCH}, width {WIDTH}, {HEADS} heads, {BLOCKS} blocks; reader: Perceiver with N = {LATENTS} "
          f"latents (1 cross-attention + {BLOCKS} latent blocks, Fourier positions); encoder: ViT with "
          f"{BLOCKS} self-attention blocks over all M pixels. Forward only, float32, median of {repeats} runs "
          f"after warm-up; peak memory = growth of the resident set during the first forward, each case in "
          f"a fresh process.", "", _table(rows), "",
          f"Log-log slopes over M >= {min_m} (1 = linear, 2 = quadratic):", "",
          f"- time: reader {slope('reader_forward_ms')}, encoder {slope('encoder_forward_ms')}",
          f"- peak memory (RSS growth): reader {slope('reader_peak_rss_growth_mb')}, encoder "
          f"{slope('encoder_peak_rss_growth_mb')}",
          f"- XLA's planned temporary buffers: reader {slope('reader_xla_temp_mb')}, encoder "
          f"{slope('encoder_xla_temp_mb')}", "",
          _memory_reading(slopes["encoder_xla_temp_mb"], max(r["M"] for r in rows)), "",
          f"Plot: `{os.path.basename(stem)}.png`."]
  with open(stem + ".md", "w") as f:
    f.write("\n".join(text) + "\n")
  print("\n".join(text))


if __name__ == "__main__":
  main()
