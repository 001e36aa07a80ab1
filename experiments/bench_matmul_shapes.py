"""Where the translator's training step meets torch: its matmuls, shape by shape, in XLA:CPU and torch.

`bench_translator.py` times the whole training step. This script times each matmul that step runs
(forward, and the two backward products of every weight), in the operand layout autodiff gives it:

  NN  a @ b        forward projections; dX of the tied output (dlogits @ table)
  NT  a @ b.T      dX = dY @ W.T; the tied output logits = x @ table.T; scores = q @ k.T
  TN  a.T @ b      dW = X.T @ dY (contracts the token axis of two row-major activations)

JAX and torch run each shape in one process, in alternating blocks of back-to-back calls (medians
after warm-up; JAX calls end in block_until_ready; see bench_common.blocked_median_seconds for why
not call by call). Counts per step are for the benchmark translator (d_model 512, 8 heads, 3 + 3
layers, MLP 2048, vocab 8000, batch 32 x length 64 per side, tied embeddings): 36 attention
projections, 12 MLP matmuls, one tied output layer, 9 attention calls of six batched
[32 x 8] x 64 x 64 x 64 products each. The weighted sum is the step's matmul time if each ran alone
on an idle machine, so the two columns say how much of the gap between the steps the kernels
explain. Results: experiments/results/matmul_shapes.{md,json}.

    python experiments/bench_matmul_shapes.py           # full sizes (about a minute)
    python experiments/bench_matmul_shapes.py --quick   # a smoke run into a temporary directory
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_common import (blocked_median_seconds, output_dir, parse_jax_vs_torch_args, provenance,  # noqa: E402
                          provenance_line)

FULL = dict(tokens=2048, d_model=512, mlp=2048, vocab=8000, batch=32, heads=8, length=64, head_dim=64,
            layers=3, repeats=15)
QUICK = dict(tokens=64, d_model=32, mlp=64, vocab=100, batch=2, heads=2, length=8, head_dim=16,
             layers=1, repeats=2)


def cases(s):
  """(name, form, lhs shape, rhs shape, count per step); shapes are the stored operands."""
  t, d, m, v = s["tokens"], s["d_model"], s["mlp"], s["vocab"]
  n, b, h = s["layers"], s["batch"], s["heads"]
  qkv, scores = (b, h, s["length"], s["head_dim"]), (b, h, s["length"], s["length"])
  projections = 4 * n + 4 * n + 4 * n  # encoder self, decoder self, decoder cross
  attention_calls = 3 * n
  return [
      ("projection forward", "NN", (t, d), (d, d), projections),
      ("projection dX", "NT", (t, d), (d, d), projections),
      ("projection dW", "TN", (t, d), (t, d), projections),
      ("MLP in forward", "NN", (t, d), (d, m), 2 * n),
      ("MLP in dX", "NT", (t, m), (d, m), 2 * n),
      ("MLP in dW", "TN", (t, d), (t, m), 2 * n),
      ("MLP out forward", "NN", (t, m), (m, d), 2 * n),
      ("MLP out dX", "NT", (t, d), (m, d), 2 * n),
      ("MLP out dW", "TN", (t, m), (t, d), 2 * n),
      ("tied output logits", "NT", (t, d), (v, d), 1),
      ("tied output dX", "NN", (t, v), (v, d), 1),
      ("tied output dTable", "TN", (t, v), (t, d), 1),
      ("attention, batched q k^T / dP", "NT", qkv, qkv, 2 * attention_calls),
      ("attention, batched P v / dQ", "NN", scores, qkv, 2 * attention_calls),
      ("attention, batched dV / dK", "TN", scores, qkv, 2 * attention_calls),
  ]


def flops(form, lhs, rhs):
  rows = lhs[-1] if form == "TN" else lhs[-2]
  inner = lhs[-2] if form == "TN" else lhs[-1]
  cols = rhs[-2] if form == "NT" else rhs[-1]
  return 2.0 * np.prod(lhs[:-2], dtype=np.float64) * rows * inner * cols


def jax_product(form):
  swap = lambda x: jnp.swapaxes(x, -1, -2)  # noqa: E731
  return jax.jit({"NN": lambda a, b: a @ b, "NT": lambda a, b: a @ swap(b),
                  "TN": lambda a, b: swap(a) @ b}[form])


def torch_product(form):
  return {"NN": lambda a, b: torch.matmul(a, b), "NT": lambda a, b: torch.matmul(a, b.transpose(-1, -2)),
          "TN": lambda a, b: torch.matmul(a.transpose(-1, -2), b)}[form]


def main():
  args, s, cores = parse_jax_vs_torch_args(__doc__, FULL, QUICK)
  run = provenance()  # before measuring: its load average is the one before the start
  rng = np.random.default_rng(0)
  rows = []
  for name, form, lhs_shape, rhs_shape, count in cases(s):
    lhs = rng.standard_normal(lhs_shape, dtype=np.float32)
    rhs = rng.standard_normal(rhs_shape, dtype=np.float32)
    jf, tf = jax_product(form), torch_product(form)
    ja, jb = jnp.asarray(lhs), jnp.asarray(rhs)
    ta, tb = torch.from_numpy(lhs), torch.from_numpy(rhs)
    np.testing.assert_allclose(np.asarray(jf(ja, jb)), tf(ta, tb).numpy(), rtol=2e-3, atol=2e-2 * np.sqrt(
        lhs_shape[-1] if form != "TN" else lhs_shape[-2]))
    with torch.no_grad():
      times = blocked_median_seconds({"jax": lambda: jf(ja, jb).block_until_ready(),
                                      "torch": lambda: tf(ta, tb)}, blocks=3, per_block=s["repeats"])
    fl = flops(form, lhs_shape, rhs_shape)
    rows.append(dict(name=name, form=form, lhs=list(lhs_shape), rhs=list(rhs_shape), count=count,
                     jax_ms=times["jax"] * 1e3, torch_ms=times["torch"] * 1e3,
                     jax_gflops=fl / times["jax"] / 1e9, torch_gflops=fl / times["torch"] / 1e9))
    print(rows[-1], flush=True)

  total_jax = sum(r["count"] * r["jax_ms"] for r in rows)
  total_torch = sum(r["count"] * r["torch_ms"] for r in rows)

  def row(*cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"

  lines = ["# Matmuls of the translator's training step: XLA:CPU vs torch", "",
           f"{provenance_line(run)} 1-minute load average {os.getloadavg()[0]:.1f} when writing.", "",
           f"{cores} CPU cores ({run['cpu']}, {platform.machine()}), jax {jax.__version__}, torch {torch.__version__} "
           f"({torch.get_num_threads()} threads), float32. Each shape timed alone, JAX and torch in one process in "
           f"3 alternating blocks of {s['repeats']} back-to-back calls, medians after warm-up.", "",
           row("product", "form", "operands", "per step", "jax ms", "torch ms", "jax GFLOP/s",
               "torch GFLOP/s", "jax / torch time"),
           row(*["---"] * 9)]
  for r in rows:
    lines.append(row(r["name"], r["form"], f"{r['lhs']} x {r['rhs']}", r["count"], f"{r['jax_ms']:.2f}",
                     f"{r['torch_ms']:.2f}", f"{r['jax_gflops']:.0f}", f"{r['torch_gflops']:.0f}",
                     f"{r['jax_ms'] / r['torch_ms']:.2f}"))
  lines += ["", f"Weighted by count per step: JAX {total_jax:.0f} ms, torch {total_torch:.0f} ms "
            f"(JAX - torch = {total_jax - total_torch:+.0f} ms per step).", ""]
  markdown = "\n".join(lines)
  print(markdown)
  out = output_dir(args, "bench_matmul_shapes")
  (out / "matmul_shapes.md").write_text(markdown)
  (out / "matmul_shapes.json").write_text(json.dumps(
      {"provenance": run, "cores": cores, "jax": jax.__version__, "torch": torch.__version__, "sizes": s, "rows": rows,
       "weighted_ms": {"jax": total_jax, "torch": total_torch}}, indent=2) + "\n")
  print(f"wrote {out}/matmul_shapes.md")


if __name__ == "__main__":
  main()
