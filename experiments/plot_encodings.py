"""Pictures of the sequence position encodings themselves (used by ablate_positions.py, runnable alone).

    python experiments/plot_encodings.py --out /tmp/encodings   # the two PNGs, no training

  dot_products(table, anchor)  -> [positions]: table[anchor] . table[p] for every row p
  rope_scores(...)             -> [offsets]: <RoPE(q, m), RoPE(k, n)> as a function of n - m
  plot_dot_products(...), plot_rope_scores(...): the PNGs (ablate_positions.py adds a trained learned table).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys

import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # run as a script: the repository's package
from experiments import sweep  # noqa: E402
from xattn_jax.ops import positions as positions_ops  # noqa: E402


def dot_products(table, anchor: int) -> np.ndarray:
  """table [positions, features] -> [positions]: each row's dot product with row `anchor`."""
  table = np.asarray(table, np.float64)
  if table.ndim != 2 or not 0 <= anchor < table.shape[0]:
    raise ValueError(f"dot_products: needs table [positions, features] with a row {anchor}, got {list(table.shape)}")
  return table @ table[anchor]


def rope_scores(offsets, *, head_dim: int = 64, query_position: int = 64, scaling: str | None = None,
                scaling_factor: float = 1.0, seed: int = 0) -> np.ndarray:
  """Score of one fixed random (q, k) pair, q at query_position and k at query_position + offset.

  offsets [n] ints -> [n] float. With q = k the score peaks at offset 0 and decays (with ripples)
  as the offset grows, the long-term decay of Su et al.; scaling stretches it over longer offsets.
  """
  rng = np.random.default_rng(seed)
  vector = rng.standard_normal(head_dim).astype(np.float32)
  offsets = np.asarray(offsets)
  rope = dict(scaling=scaling, scaling_factor=scaling_factor)
  query = positions_ops.apply_rope(jnp.asarray(vector)[None, None, None, :], jnp.array([[query_position]]), **rope)
  keys = jnp.broadcast_to(jnp.asarray(vector), (1, len(offsets), 1, head_dim))
  keys = positions_ops.apply_rope(keys, jnp.asarray(query_position + offsets)[None], **rope)
  return np.asarray(jnp.einsum("b q n h, b k n h -> k", query, keys))


def plot_dot_products(path: str, *, anchor: int = 64, length: int = 129, features: int = 64, learned=None,
                      learned_note: str = ""):
  """Sinusoidal (and, if given, a trained learned table [>= length, features]) dot products with `anchor`."""
  panels = [("sinusoidal", np.asarray(positions_ops.sinusoidal(jnp.arange(length), features)))]
  if learned is not None:
    panels.append((f"learned (trained) {learned_note}".strip(), np.asarray(learned)[:length]))
  figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.6), squeeze=False)
  for axis, (title, table) in zip(axes[0], panels):
    axis.plot(np.arange(len(table)), dot_products(table, anchor))
    axis.axvline(anchor, color="gray", linestyle=":")
    axis.set(title=title, xlabel="position p", ylabel=f"enc[{anchor}] . enc[p]")
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)


def plot_rope_scores(path: str, *, max_offset: int = 128, scaling_factor: float = 4.0):
  """RoPE score of a fixed q/k pair against the offset, plain and with linear / NTK length scaling."""
  offsets = np.arange(-max_offset, max_offset + 1)
  figure, axis = plt.subplots(figsize=(7, 3.6))
  for label, scaling in (("rope", None), (f"linear x{scaling_factor:g}", "linear"), (f"ntk x{scaling_factor:g}", "ntk")):
    factor = 1.0 if scaling is None else scaling_factor
    axis.plot(offsets, rope_scores(offsets, scaling=scaling, scaling_factor=factor), label=label, linewidth=1)
  axis.set(xlabel="key position - query position", ylabel="q . k after RoPE", title="RoPE score of a fixed q = k")
  axis.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=110)
  plt.close(figure)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True,
                      help="folder for encoding_dot_products.png and encoding_rope_scores.png (made if missing)")
  parser.add_argument("--anchor", type=int, default=64, help="the position every sinusoidal row is dotted with")
  parser.add_argument("--max_offset", type=int, default=128, help="RoPE offsets from -max_offset to max_offset")
  parser.add_argument("--scaling_factor", type=float, default=4.0, help="the linear / NTK RoPE scaling curves' factor")
  args = parser.parse_args(argv)
  if args.max_offset < 1 or not 0 < args.scaling_factor < math.inf:  # nan and inf drew empty curves or a traceback
    parser.error(f"--max_offset must be >= 1 and --scaling_factor a finite number > 0, got "
                 f"--max_offset={args.max_offset} --scaling_factor={args.scaling_factor}")
  sweep.check_folders(args, parser, flags=("out",))  # `~` expanded; a file, or a folder under one, refused
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  try:
    plot_dot_products(str(out / "encoding_dot_products.png"), anchor=args.anchor)
  except ValueError as error:  # an anchor outside the table's rows
    parser.error(f"--anchor={args.anchor}: {error}")
  plot_rope_scores(str(out / "encoding_rope_scores.png"), max_offset=args.max_offset,
                   scaling_factor=args.scaling_factor)
  print(f"wrote {out}/encoding_dot_products.png, {out}/encoding_rope_scores.png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
