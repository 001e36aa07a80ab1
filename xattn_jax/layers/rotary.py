"""The rotary position spec that MultiHeadAttention applies to its queries and keys.

A `RotarySpec` is a frozen, hashable value: it is configuration, not state, so it can sit on a
module that is scanned or jitted. It names one of the rotary ops in `xattn_jax.ops.positions` and
the keyword arguments to call it with; the positions themselves are always passed explicitly:

  kind        positions          op
  "rope"      [batch, length]    apply_rope (1D, RoFormer / Llama)
  "rope_2d"   [batch, length, 2] apply_rope_2d (row, column)
  "mrope"     [3, batch, length] apply_mrope (Qwen2-VL time / height / width sections)
"""
from __future__ import annotations

import dataclasses

from xattn_jax.ops import positions as positions_ops

ROTARY_KINDS = ("rope", "rope_2d", "mrope")
ROPE_LAYOUTS = ("split", "interleaved")
ROPE_SCALINGS = (None, "linear", "ntk")


@dataclasses.dataclass(frozen=True)
class RotarySpec:
  """Which rotary encoding to apply to q and k, and with what constants.

  Attributes:
    kind: "rope", "rope_2d" or "mrope".
    base: the wavelength base of theta_i = base^(-2i/d).
    layout: "split" (rotate halves, Llama / Qwen checkpoints) or "interleaved" (pairs (2i, 2i+1)).
    rotary_dim: rotate only the first rotary_dim dims of each head (partial rotary); None = all.
    sections: for "mrope", frequency pairs per (time, height, width) axis; they sum to rotary_dim / 2.
    scaling: None, "linear" (position interpolation) or "ntk" (base scaling), by `scaling_factor`.
  """
  kind: str = "rope"
  base: float = 10000.0
  layout: str = "split"
  rotary_dim: int | None = None
  sections: tuple[int, ...] | None = None
  scaling: str | None = None
  scaling_factor: float = 1.0

  def __post_init__(self):
    if self.kind not in ROTARY_KINDS:
      raise ValueError(f"RotarySpec: kind must be one of {ROTARY_KINDS}, got kind={self.kind!r}")
    if self.layout not in ROPE_LAYOUTS:
      raise ValueError(f"RotarySpec: layout must be one of {ROPE_LAYOUTS}, got layout={self.layout!r}")
    if self.scaling not in ROPE_SCALINGS:
      raise ValueError(f"RotarySpec: scaling must be one of {ROPE_SCALINGS}, got scaling={self.scaling!r}")
    if not self.scaling_factor > 0:
      raise ValueError(f"RotarySpec: scaling_factor must be > 0, got scaling_factor={self.scaling_factor!r}")
    if self.kind == "mrope" and not self.sections:
      raise ValueError("RotarySpec: kind='mrope' needs sections, e.g. sections=(16, 24, 24), got None")
    if self.sections is not None:
      if any(int(s) != s or s < 1 for s in self.sections):
        raise ValueError(f"RotarySpec: sections must be positive ints (frequency pairs per axis), "
                         f"got sections={tuple(self.sections)}")
      # A list would make the spec unhashable, and jit needs hashable static configuration.
      object.__setattr__(self, "sections", tuple(int(s) for s in self.sections))

  def check_head_dim(self, head_dim: int) -> None:
    """Raises ValueError if this spec cannot rotate heads of width head_dim."""
    rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
    if rotary_dim > head_dim or rotary_dim <= 0:
      raise ValueError(f"RotarySpec: rotary_dim must be in [1, head_dim={head_dim}], got rotary_dim={rotary_dim}")
    # Rotations act on pairs of dims; 2D RoPE further splits the pairs between rows and columns.
    multiple = 4 if self.kind == "rope_2d" else 2
    if rotary_dim % multiple:
      raise ValueError(
          f"RotarySpec: kind={self.kind!r} needs rotary_dim divisible by {multiple}, got rotary_dim={rotary_dim} "
          f"(head_dim={head_dim})")
    if self.kind == "mrope" and sum(self.sections) != rotary_dim // 2:
      raise ValueError(
          f"RotarySpec: sections must sum to rotary_dim / 2 = {rotary_dim // 2} frequency pairs, got "
          f"sections={self.sections} (sum {sum(self.sections)})")

  def apply(self, x, positions):
    """Rotates x [batch, length, heads, head_dim] by positions (shape by kind, see module doc)."""
    options = {"base": self.base, "layout": self.layout}
    # Only pass options that differ from the op's defaults, so the spec works with any op version
    # that supports what it asks for.
    if self.rotary_dim is not None:
      options["rotary_dim"] = self.rotary_dim
    if self.scaling is not None:
      options["scaling"] = self.scaling
      options["scaling_factor"] = self.scaling_factor
    if self.kind == "rope":
      return positions_ops.apply_rope(x, positions, **options)
    if self.kind == "rope_2d":
      return positions_ops.apply_rope_2d(x, positions, **options)
    return positions_ops.apply_mrope(x, positions, self.sections, **options)
