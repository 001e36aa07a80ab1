"""The rotary position spec that MultiHeadAttention applies to its queries and keys.

A `RotarySpec` is a frozen, hashable value: it is configuration, not state, so it can sit on a
module that is scanned or jitted. It names one of the rotary ops in `xattn_jax.ops.positions` and
the keyword arguments to call it with; the positions themselves are always passed explicitly.
`ROTARY_KINDS` is the one list of rotary kinds: each entry names its op, the positions it takes and
the rule its rotated width must meet; config checks and the position registry read it from here.
Layouts and scalings are the op's own (`ops.positions.ROPE_LAYOUTS`, `ROPE_SCALINGS`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from xattn_jax.ops import positions as positions_ops


@dataclasses.dataclass(frozen=True)
class RotaryKind:
  """One rotary op and what it needs.

  op: the `ops.positions` function, op(x, positions, **options) (mrope takes sections too).
  positions: the layout of its positions: "sequence" [batch, length], "grid" [batch, length, 2]
    (row, column) or "multimodal" [3, batch, length] (time, height, width).
  multiple_of: the rotated width (rotary_dim) must be a multiple of this.
  num_sections: frequency-pair sections it needs, one per position axis (0 = none).
  """
  op: Callable
  positions: str
  multiple_of: int = 2
  num_sections: int = 0


ROTARY_KINDS: dict[str, RotaryKind] = {
    "rope": RotaryKind(positions_ops.apply_rope, "sequence"),  # 1D, RoFormer / Llama
    # Half the pairs turn with the row, half with the column: pairs split in two, so 4 channels.
    "rope_2d": RotaryKind(positions_ops.apply_rope_2d, "grid", multiple_of=4),
    "mrope": RotaryKind(positions_ops.apply_mrope, "multimodal", num_sections=3),  # Qwen2-VL sections
}


@dataclasses.dataclass(frozen=True)
class RotarySpec:
  """Which rotary encoding to apply to q and k, and with what constants.

  Attributes:
    kind: a name in ROTARY_KINDS.
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
      raise ValueError(f"RotarySpec: kind must be one of {list(ROTARY_KINDS)}, got kind={self.kind!r}")
    if self.layout not in positions_ops.ROPE_LAYOUTS:
      raise ValueError(f"RotarySpec: layout must be one of {positions_ops.ROPE_LAYOUTS}, got layout={self.layout!r}")
    if self.scaling not in positions_ops.ROPE_SCALINGS:
      raise ValueError(f"RotarySpec: scaling must be one of {positions_ops.ROPE_SCALINGS}, "
                       f"got scaling={self.scaling!r}")
    positions_ops._check_base(self.base, "RotarySpec")
    if not self.scaling_factor > 0:
      raise ValueError(f"RotarySpec: scaling_factor must be > 0, got scaling_factor={self.scaling_factor!r}")
    sections_needed = self.rotary_kind.num_sections
    if sections_needed and (not self.sections or len(self.sections) != sections_needed):
      raise ValueError(f"RotarySpec: kind={self.kind!r} needs {sections_needed} sections (frequency pairs per "
                       f"position axis), e.g. sections=(16, 24, 24), got sections={self.sections}")
    if self.sections is not None and not sections_needed:  # apply would rotate without them, silently
      takers = [name for name, kind in ROTARY_KINDS.items() if kind.num_sections]
      raise ValueError(f"RotarySpec: kind={self.kind!r} takes no sections (only {takers} rotate each position "
                       f"axis by its own frequency pairs), got sections={self.sections}")
    if self.sections is not None:
      if any(int(s) != s or s < 1 for s in self.sections):
        raise ValueError(f"RotarySpec: sections must be positive ints (frequency pairs per axis), "
                         f"got sections={tuple(self.sections)}")
      # A list would make the spec unhashable, and jit needs hashable static configuration.
      object.__setattr__(self, "sections", tuple(int(s) for s in self.sections))

  @property
  def rotary_kind(self) -> RotaryKind:
    return ROTARY_KINDS[self.kind]

  def check_head_dim(self, head_dim: int) -> None:
    """Raises ValueError if this spec cannot rotate heads of width head_dim."""
    rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
    if rotary_dim > head_dim or rotary_dim <= 0:
      raise ValueError(f"RotarySpec: rotary_dim must be in [1, head_dim={head_dim}], got rotary_dim={rotary_dim}")
    multiple = self.rotary_kind.multiple_of
    if rotary_dim % multiple:
      raise ValueError(
          f"RotarySpec: kind={self.kind!r} needs rotary_dim divisible by {multiple}, got rotary_dim={rotary_dim} "
          f"(head_dim={head_dim})")
    if self.rotary_kind.num_sections and sum(self.sections) != rotary_dim // 2:
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
    if self.rotary_kind.num_sections:
      return self.rotary_kind.op(x, positions, self.sections, **options)
    return self.rotary_kind.op(x, positions, **options)
