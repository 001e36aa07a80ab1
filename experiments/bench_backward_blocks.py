"""The CPU backward's query blocks of the "xla" attention path, sized for one L2 cache against another.

`ops.attention.choose_blocking` splits a unit's large forward block into smaller backward blocks, by a rule
measured on a core of 512 KiB of L2 and grown in proportion to a larger L2 (`l2_cache_bytes`). This script
times forward+backward (gradients of sum(output) w.r.t. q, k and v, jitted) of the default path on the shapes
where the two rules differ, compiled once with the 512 KiB rule and once with this CPU's L2, interleaved in one
process with torch SDPA's forward+backward (float32 on both sides, medians after warm-up). Results:
experiments/results/attention_backward_blocks.{md,json} (or --out).

    python experiments/bench_backward_blocks.py           # the shapes of bench_attention's rows (about a minute)
    python experiments/bench_backward_blocks.py --quick   # a smoke run into a temporary directory
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from experiments import bench_common  # noqa: E402

# (name, batch, q_len, kv_len, heads, kv_heads, head_dim, padded keys)
CASES = (("GQA 8/2", 8, 512, 512, 8, 2, 64, False), ("MQA 8/1", 8, 512, 512, 8, 1, 64, False),
         ("GQA 8/2", 4, 1024, 1024, 8, 2, 64, False), ("plain", 2, 2048, 2048, 8, 8, 64, False),
         ("cross, padded memory", 2, 1024, 2048, 8, 8, 64, True), ("head_dim 128", 2, 2048, 2048, 4, 4, 128, False))
QUICK_CASES = (("GQA 8/2", 1, 64, 64, 4, 2, 16, False),)
TUNED = "512 KiB rule"


def timings(case, repeats: int, l2_bytes: int) -> dict:
  """{row: median seconds} of one case: the default path compiled under each rule, and torch SDPA."""
  import jax
  import torch
  from xattn_jax.ops import attention
  _, b, t, s, n, kv_heads, d, padded = case
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal(shape, np.float32) for shape in ((b, t, n, d), (b, s, kv_heads, d),
                                                                     (b, s, kv_heads, d)))
  mask = None
  if padded:
    mask = (np.arange(s)[None, :] < rng.integers(s // 2, s + 1, size=b)[:, None])[:, None, None, :]
  compiled = {}
  for row, l2 in ((TUNED, attention._TUNED_L2_BYTES), (f"this CPU's L2 ({l2_bytes // 1024} KiB)", l2_bytes)):
    # a function of its own per rule: jit caches traces by function, and the rule is read when one is traced
    grad = jax.grad(lambda q, k, v: attention.dot_product_attention(q, k, v, mask=mask).sum(), argnums=(0, 1, 2))
    rule = attention.l2_cache_bytes
    attention.l2_cache_bytes = lambda l2=l2: l2
    try:
      compiled[row] = jax.jit(grad).lower(q, k, v).compile()
    finally:
      attention.l2_cache_bytes = rule
  tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
  tmask = None if mask is None else torch.from_numpy(mask)
  def torch_step():  # fresh gradients, as jax.grad returns: .backward() would also add them into .grad each call
    torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=tmask, enable_gqa=n != kv_heads).sum(), (tq, tk, tv))
  fns = {row: (lambda f=f: jax.block_until_ready(f(q, k, v))) for row, f in compiled.items()}
  return bench_common.interleaved_median_seconds({**fns, "torch SDPA": torch_step}, repeats)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--repeats", type=int, default=7, help="timed runs of each row, interleaved")
  bench_common.add_output_flags(parser)
  args = bench_common.parse_output_args(parser, "attention_backward_blocks", argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  record = {"provenance": bench_common.provenance(argv), "rows": []}  # before measuring: its load
  import torch
  from xattn_jax.ops import attention
  torch.set_num_threads(attention.usable_cores())
  l2 = attention.l2_cache_bytes()
  run = record["provenance"]
  lines = ["# The CPU backward's blocks: the 512 KiB L2 rule against this CPU's L2", "",
           f"{bench_common.provenance_line(run)} {run['cpu_cores']} CPU cores ({run['cpu']}).", "",
           f"Forward+backward of the default path (`dot_product_attention`, gradients w.r.t. q, k, v), float32 on "
           f"both sides, torch {torch.__version__} SDPA on {attention.usable_cores()} threads; medians of "
           f"{args.repeats} interleaved runs after warm-up. This CPU's L2 per core: {l2 // 1024} KiB.", "",
           "| case | shape | backward blocks (512 KiB rule / this L2) | 512 KiB rule ms | this L2 ms | torch ms | "
           "512 KiB rule / torch | this L2 / torch | this L2 / 512 KiB rule |", "| --- |" + " --- |" * 8]
  for case in QUICK_CASES if args.quick else CASES:
    name, b, t, s, n, kv_heads, d, padded = case
    seconds = timings(case, args.repeats, l2)
    tuned, ours, torch_s = (seconds[row] for row in (TUNED, next(r for r in seconds if r.startswith("this")),
                                                      "torch SDPA"))
    blocks = [attention.choose_blocking("xla", t, s, units=b * kv_heads, groups=n // kv_heads, l2_bytes=size)
              .backward_block_q for size in (attention._TUNED_L2_BYTES, l2)]
    shape = (f"b{b} q{t} kv{s} h{n}" + (f"/{kv_heads}kv" if kv_heads != n else "") + f" d{d}"
             + (" pad" if padded else ""))
    record["rows"].append({"case": name, "shape": shape, "backward_block_q": blocks, "seconds": seconds})
    lines.append(f"| {name} | {shape} | {' / '.join(str(x or 'forward') for x in blocks)} | {tuned * 1e3:.1f} | "
                 f"{ours * 1e3:.1f} | {torch_s * 1e3:.1f} | {tuned / torch_s:.2f} | {ours / torch_s:.2f} | "
                 f"{ours / tuned:.2f} |")
    print(lines[-1], flush=True)
  bench_common.write_results(args.out, "attention_backward_blocks", record, "\n".join(lines) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
