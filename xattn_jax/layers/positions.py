"""Position-encoding modules, chosen by name from config.

Every module has the same interface:
  sequence_positions(batch, length, *, rng=None) -> (positions [b, t] int32, highest)
      the positions a sequence of `length` tokens gets when none are passed: 0..t-1, or randomized
      ones (see RandomizedPositions); `highest` is the largest they can hold.
  add_to_inputs(x, positions=None, *, grid=None) -> x   additive encodings add themselves to the
      embeddings x [b, t, features]; rotary ones and "none" return x unchanged.
  rotary                                                 a RotarySpec for MultiHeadAttention to rotate
      q and k with, or None for additive encodings.
  attention_bias(query_positions, key_positions)         an additive score bias [b, heads, q, kv] for
      the SELF-attention of the stack the module belongs to ("alibi", "t5_bias"), or None. Positions
      are [b, q] and [b, kv] ints. Cross-attention gets no position bias: its keys are another
      sequence, whose positions are not comparable with the queries'.

Positions are explicit: [b, t] ints for sequences (None = 0..t-1), [b, M, 2] (row, column) for
images (None = the row-major grid). Image encodings take the input's grid (height, width) as `grid`
(default: the grid they were built for) and may carry `num_extra_tokens` leading non-grid tokens
(a class token): x is then [b, num_extra + M, features], positions cover the M grid tokens only,
and the extra tokens get their own learned rows (learned_2d) or nothing (fixed encodings).

POSITION_ENCODINGS is the one list of encodings: each entry builds its module and declares the
rules configs are checked against (which positions it takes, whether it is additive, rotary or a
score bias, which rotary op, whether randomized positions apply, whether it is a table of max_length
rows). Models, tasks and config checks read names and rules from it when they run, so an encoding
registered from outside the package (register_position_encoding) counts as a built-in one. Adding an
encoding means one op, one entry and one test.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xattn_jax import registry
from xattn_jax.layers import dense
from xattn_jax.layers.rotary import ROTARY_KINDS, RotaryKind, RotarySpec
from xattn_jax.ops import positions as positions_ops
from xattn_jax.ops import relative_bias
from xattn_jax.ops.concrete import concrete


def _check_width(where: str, x, features: int) -> None:
  """x must be [batch, length, features] with the encoding's own width: a narrower or wider x failed to broadcast
  in the addition, naming neither."""
  if jnp.ndim(x) != 3 or jnp.shape(x)[-1] != features:
    raise ValueError(f"{where}: x must be [batch, length, {features}] (the encoding's features), "
                     f"got x{list(jnp.shape(x))}")


def _sequence_positions(x, positions):
  """positions [b, t], or 0..t-1 as one [1, t] row shared by the batch of x [b, t, features] (so a
  table is computed once per length, not once per sequence)."""
  if positions is None:
    return jnp.arange(x.shape[1], dtype=jnp.int32)[None]
  positions = jnp.asarray(positions)
  if positions.shape != x.shape[:2]:
    raise ValueError(f"add_to_inputs: positions must be [batch, length] = {list(x.shape[:2])}, "
                     f"got positions{list(positions.shape)}")
  return positions


@dataclasses.dataclass(frozen=True)
class RandomizedPositions:
  """Randomized positions (Ruoss et al. 2023), declared once for every sequence encoding.

  max_position: 0 = off (positions 0..t-1); else a sequence of t tokens gets t sorted distinct
    positions from [0, max_position) (`ops.positions.randomized_positions`), drawn from the `rng`
    the training pass hands in, so the draw is a pure function of (seed, step).
  at_eval: what passes without an rng (evaluation, cached decoding) get. False (the default):
    0..t-1, deterministic, the same positions for a teacher-forced pass and for cached decoding,
    and in distribution: training has reached every position below max_position. True: a draw
    as in training from the fixed key `eval_seed`, the training distribution of position gaps;
    decoding draws one sorted set for the cache's whole capacity (its prefix is what a step sees).
  """
  max_position: int = 0
  at_eval: bool = False
  eval_seed: int = 0

  def __post_init__(self):
    for field in ("max_position", "eval_seed"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"RandomizedPositions: {field} must be an int >= 0, got {field}={value!r}")

  def positions(self, batch: int, length: int, *, rng=None):
    """(positions [batch, length] int32, the largest they can hold): drawn when on and an rng is given
    (or at_eval), else 0..length-1."""
    if self.max_position and (rng is not None or self.at_eval):
      key = jax.random.key(self.eval_seed) if rng is None else rng
      return positions_ops.randomized_positions(key, batch, length, self.max_position), self.max_position - 1
    return jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length)), length - 1


class NoPositions(nnx.Module):
  """"none": no position information at all (attention is then permutation equivariant)."""
  rotary = None
  randomized = RandomizedPositions()  # set per module by make_position_encoding

  def sequence_positions(self, batch: int, length: int, *, rng=None):
    """(positions [batch, length] int32, the highest they can hold): what a sequence of `length` tokens
    gets without explicit positions; ValueError if a table has no row for the highest."""
    positions, highest = self.randomized.positions(batch, length, rng=rng)
    self.check_fits(highest)
    return positions, highest

  def check_fits(self, highest: int) -> None:
    """Raises ValueError if position `highest` has no row (tables only; other encodings take any)."""
    del highest

  def add_to_inputs(self, x, positions=None, *, grid=None):
    del positions, grid
    return x

  def attention_bias(self, query_positions, key_positions):
    del query_positions, key_positions
    return None


class RotaryPositions(NoPositions):
  """"rope", "rope_2d", "mrope": nothing added to the inputs; the attention layers rotate q and k."""

  def __init__(self, spec: RotarySpec):
    self.rotary = spec


class LearnedPositions(NoPositions):
  """"learned": a trained table [max_length, features] (std 0.02), row p added at position p."""

  def __init__(self, max_length: int, features: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("length", "embed"), eager_sharding=False)
    self.table = nnx.Param(init(rngs.params(), (max_length, features), param_dtype))

  def check_fits(self, highest: int) -> None:
    positions_ops.check_positions_fit(highest, self.table.shape[0], "LearnedPositions")

  def add_to_inputs(self, x, positions=None, *, grid=None):
    _check_width("LearnedPositions.add_to_inputs", x, self.table.shape[1])
    if positions is None:
      # Positions 0..t-1 are static, so a too-short table is caught at trace time.
      positions_ops.check_positions_fit(x.shape[1] - 1, self.table.shape[0], "LearnedPositions.add_to_inputs")
    table = self.table[...]
    return x + positions_ops.learned_lookup(table, _sequence_positions(x, positions)).astype(x.dtype)


class SinusoidalPositions(NoPositions):
  """"sinusoidal": the fixed table of Vaswani et al., sin / cos of position / base^(2i/features)."""

  def __init__(self, features: int, *, base: float = 10000.0):
    self.features, self.base = features, base

  def add_to_inputs(self, x, positions=None, *, grid=None):
    _check_width("SinusoidalPositions.add_to_inputs", x, self.features)
    encoding = positions_ops.sinusoidal(_sequence_positions(x, positions), self.features, self.base)
    return x + encoding.astype(x.dtype)


class _GridPositions(NoPositions):
  """Shared handling of image positions: grid defaults, extra leading tokens, shape checks.

  Subclasses set `features` and define `encode(positions [b, M, 2], grid) -> [b, M, features]` on the input grid.
  """

  def __init__(self, grid, num_extra_tokens: int):
    # ints only: int() truncated a grid of (2.5, 3) to (2, 3)
    if not (isinstance(grid, (tuple, list)) and len(grid) == 2 and all(
        isinstance(g, (int, np.integer)) and not isinstance(g, (bool, np.bool_)) and g > 0 for g in grid)):
      raise ValueError(f"{type(self).__name__}: grid must be (height, width) of positive ints, got grid={grid!r}")
    if num_extra_tokens < 0:
      raise ValueError(f"{type(self).__name__}: num_extra_tokens must be >= 0, got {num_extra_tokens}")
    self.grid, self.num_extra_tokens = tuple(int(g) for g in grid), num_extra_tokens

  def extra_rows(self, features: int):
    """[num_extra_tokens, features] added to the leading non-grid tokens."""
    return jnp.zeros((self.num_extra_tokens, features))

  def add_to_inputs(self, x, positions=None, *, grid=None):
    _check_width(f"{type(self).__name__}.add_to_inputs", x, self.features)
    grid = self.grid if grid is None else tuple(grid)
    batch, length = x.shape[:2]
    if positions is None:
      positions = jnp.broadcast_to(positions_ops.grid_positions(*grid), (batch, grid[0] * grid[1], 2))
    positions = jnp.asarray(positions)
    if positions.ndim != 3 or positions.shape[0] != batch or positions.shape[-1] != 2 \
        or length != self.num_extra_tokens + positions.shape[1]:
      raise ValueError(
          f"{type(self).__name__}.add_to_inputs: positions must be [batch, M, 2] with x [batch, "
          f"{self.num_extra_tokens} + M, features], got positions{list(positions.shape)}, x{list(x.shape)}")
    encoding = self.encode(positions, grid)  # [b, M, features]
    extra = jnp.broadcast_to(self.extra_rows(x.shape[-1]), (batch, self.num_extra_tokens, x.shape[-1]))
    return x + jnp.concatenate([extra, encoding], axis=1).astype(x.dtype)


class Learned2DPositions(_GridPositions):
  """"learned_2d": a trained table [num_extra + h*w, features] (ViT), resized when the input grid differs."""

  def __init__(self, grid, features: int, *, num_extra_tokens: int = 0, resize_method: str = "bilinear",
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    super().__init__(grid, num_extra_tokens)
    self.features, self.resize_method = features, resize_method
    rows = num_extra_tokens + self.grid[0] * self.grid[1]
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("length", "embed"), eager_sharding=False)
    self.table = nnx.Param(init(rngs.params(), (rows, features), param_dtype))

  def extra_rows(self, features: int):
    return self.table[...][:self.num_extra_tokens]

  def encode(self, positions, grid):
    table = positions_ops.resize_2d_table(self.table[...], self.grid, grid, self.resize_method,
                                          self.num_extra_tokens)[self.num_extra_tokens:]  # [h2 * w2, features]
    outside = lambda cells: ((cells[..., 0] < 0) | (cells[..., 0] >= grid[0]) | (cells[..., 1] < 0)
                             | (cells[..., 1] >= grid[1]))
    values = concrete(positions)
    if values is not None and values.size:
      if (cells := outside(values)).any():
        row, column = values[tuple(np.argwhere(cells)[0])]
        raise ValueError(f"Learned2DPositions: positions must be (row, column) cells of the {grid[0]}x{grid[1]} "
                         f"grid, got ({row}, {column})")
    # A flattened index would read a neighbour's row for a column off the grid; off-grid cells (under jit,
    # where they cannot be checked) read learned_lookup's NaN row instead.
    rows, columns = positions[..., 0], positions[..., 1]
    return positions_ops.learned_lookup(table, jnp.where(outside(positions), -1, rows * grid[1] + columns))


class SinCos2DPositions(_GridPositions):
  """"sincos_2d": the fixed 2D sine-cosine table (MAE / big_vision), half the channels per axis."""

  def __init__(self, grid, features: int, *, num_extra_tokens: int = 0, base: float = 10000.0):
    super().__init__(grid, num_extra_tokens)
    self.features, self.base = features, base

  def encode(self, positions, grid):
    return positions_ops.sincos_2d(positions, self.features, self.base)


class FourierPositions(_GridPositions):
  """"fourier": Perceiver Fourier features of the cell's coordinates in [-1, 1], PROJECTED to features.

  The Perceiver concatenates the features to the input channels; here a linear map brings them to
  the embedding width and they are added, so every encoding keeps the same interface and width.
  Coordinates are normalized per input grid (a corner cell sits at +-1 on any grid); the band
  frequencies run up to max_resolution / 2 (default: the configured grid).
  """

  def __init__(self, grid, features: int, *, num_bands: int = 16, max_resolution=None, num_extra_tokens: int = 0,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    super().__init__(grid, num_extra_tokens)
    self.features, self.num_bands = features, num_bands
    self.max_resolution = self.grid if max_resolution is None else max_resolution
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "embed"), eager_sharding=False)
    self.projection = dense.Dense(2 * (2 * num_bands + 1), features, kernel_init=init, dtype=dtype,
                                  param_dtype=param_dtype, rngs=rngs)

  def encode(self, positions, grid):
    # Cell k of n sits at -1 + 2k / (n - 1), as in normalized_grid; a one-cell axis sits at -1.
    spans = jnp.maximum(jnp.array(grid, jnp.float32) - 1.0, 1.0)
    coords = 2.0 * positions.astype(jnp.float32) / spans - 1.0  # [b, M, 2]
    return self.projection(positions_ops.fourier_features(coords, self.num_bands, self.max_resolution))


class AlibiPositions(NoPositions):
  """"alibi": nothing added to the inputs; scores get -slope_h * |i - j| (Press et al. 2022).

  causal=True (a decoder's self-attention) uses the paper's causal form -slope_h * (i - j), which
  equals the symmetric one on every key a causal mask leaves visible.
  """

  def __init__(self, num_heads: int, *, causal: bool = False):
    self.num_heads, self.causal = num_heads, causal

  def attention_bias(self, query_positions, key_positions):
    slopes = relative_bias.alibi_slopes(self.num_heads)  # [heads], a constant
    return relative_bias.alibi_bias(query_positions, key_positions, slopes, causal=self.causal)


class T5BiasPositions(NoPositions):
  """"t5_bias": a learned table [num_buckets, heads] read at the T5 bucket of key - query position.

  One table per stack, shared by its layers (as in T5). Bidirectional buckets (separate ones for
  keys before and after the query) for an encoder; unidirectional ones for a causal decoder, whose
  queries never see later keys. Starts at zero, so the untrained model has no position bias.
  """

  def __init__(self, num_heads: int, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    del rngs  # zero init needs no randomness; kept for the registry's uniform signature
    multiple = 4 if bidirectional else 2  # bidirectional: two halves, each split into exact and log buckets
    if not isinstance(num_buckets, int) or num_buckets <= 0 or num_buckets % multiple:
      raise ValueError(f"T5BiasPositions: num_buckets must be a positive multiple of {multiple} "
                       f"(bidirectional={bidirectional}), got num_buckets={num_buckets!r}")
    exact = num_buckets // (2 if bidirectional else 1) // 2
    if max_distance <= exact:
      raise ValueError(f"T5BiasPositions: max_distance must exceed the {exact} exactly bucketed offsets, "
                       f"got max_distance={max_distance}")
    # Replicated: the table is tiny, and num_heads need not divide over the tensor axis.
    init = nnx.with_partitioning(nnx.initializers.zeros_init(), (None, None), eager_sharding=False)
    self.table = nnx.Param(init(None, (num_buckets, num_heads), param_dtype))
    self.bidirectional, self.max_distance = bidirectional, max_distance

  def attention_bias(self, query_positions, key_positions):
    return relative_bias.t5_relative_bias(query_positions, key_positions, self.table[...],
                                          bidirectional=self.bidirectional, max_distance=self.max_distance)


@dataclasses.dataclass(frozen=True)
class PositionOptions:
  """Everything a registry entry may need; each entry takes what it uses and checks it is set."""
  name: str
  features: int
  max_length: int | None = None
  grid: tuple[int, int] | None = None
  num_heads: int | None = None
  head_dim: int | None = None
  base: float = 10000.0
  rope_layout: str = "split"
  rotary_dim: int | None = None
  mrope_sections: tuple[int, ...] | None = None
  rope_scaling: str | None = None
  rope_scaling_factor: float = 1.0
  num_extra_tokens: int = 0
  num_fourier_bands: int = 16
  causal: bool = False  # the stack's self-attention is causal: T5 buckets unidirectional, ALiBi causal form
  num_buckets: int = 32
  max_distance: int = 128
  randomized: RandomizedPositions = RandomizedPositions()
  dtype: object = jnp.float32
  param_dtype: object = jnp.float32

  def require(self, field: str):
    value = getattr(self, field)
    if value is None:
      raise ValueError(f"make_position_encoding: {self.name!r} needs {field}, got {field}=None")
    return value

  def rotary(self, kind: str) -> RotarySpec:
    sections = self.mrope_sections
    if ROTARY_KINDS[kind].num_sections and sections is None:
      sections = _default_mrope_sections(self.rotary_dim or self.require("head_dim"))
    spec = RotarySpec(kind=kind, base=self.base, layout=self.rope_layout, rotary_dim=self.rotary_dim,
                      sections=sections, scaling=self.rope_scaling, scaling_factor=self.rope_scaling_factor)
    if self.head_dim is not None:
      spec.check_head_dim(self.head_dim)
    return spec


def _default_mrope_sections(rotary_dim: int) -> tuple[int, int, int]:
  """Qwen2-VL's split scaled to any width: 3/8 of the frequency pairs each to height and width,
  the rest to time ((16, 24, 24) for head_dim 128)."""
  pairs = rotary_dim // 2
  spatial = 3 * pairs // 8
  if spatial < 1:  # each of the three axes needs at least one frequency pair
    raise ValueError(f"mrope: the default sections split rotary_dim / 2 = {pairs} frequency pairs 2:3:3 between "
                     f"(time, height, width) and need rotary_dim >= 6 (head_dim >= 6); got rotary_dim={rotary_dim}. "
                     "Pass mrope_sections explicitly or use wider heads")
  return (pairs - 2 * spatial, spatial, spatial)


POSITION_LAYOUTS = ("sequence", "grid", "multimodal")  # [b, t], [b, M, 2] (row, column), [3, b, t]
ROLES = ("none", "additive", "rotary", "bias")  # nothing, added to the inputs, rotating q / k, on the scores


@dataclasses.dataclass(frozen=True)
class PositionEncoding:
  """One registered encoding: how to build it and what a config using it must meet.

  build: (PositionOptions, rngs) -> the module.
  layouts: the positions it takes (POSITION_LAYOUTS); a model lists the encodings of its layout.
  role: how it acts (ROLES).
  rotary: for role "rotary", its ROTARY_KINDS name (which carries the rotary width rules).
  randomizable: computed from integer position indices, so randomized positions apply (a no-op
    for "none").
  max_length_table: a trained table of max_length rows (or max_position's, randomized): a position
    past them has no row, and eval must build the rows training did, so max_length is fixed by the run.
  """
  build: Callable[[PositionOptions, nnx.Rngs], nnx.Module]
  layouts: tuple[str, ...]
  role: str
  rotary: str | None = None
  randomizable: bool = False
  max_length_table: bool = False

  def __post_init__(self):
    if not set(self.layouts) <= set(POSITION_LAYOUTS) or self.role not in ROLES:
      raise ValueError(f"PositionEncoding: layouts must be from {POSITION_LAYOUTS} and role from {ROLES}, "
                       f"got layouts={self.layouts}, role={self.role!r}")
    if (self.role == "rotary") != (self.rotary in ROTARY_KINDS):
      raise ValueError(f"PositionEncoding: role 'rotary' needs rotary from {list(ROTARY_KINDS)} and only it does, "
                       f"got role={self.role!r}, rotary={self.rotary!r}")

  @property
  def rotary_kind(self) -> RotaryKind | None:
    """The rotary op entry (its width multiple, sections) or None if not rotary."""
    return None if self.rotary is None else ROTARY_KINDS[self.rotary]


def _rotary(kind: str) -> PositionEncoding:
  return PositionEncoding(lambda o, rngs: RotaryPositions(o.rotary(kind)), (ROTARY_KINDS[kind].positions,),
                          "rotary", rotary=kind, randomizable=ROTARY_KINDS[kind].positions == "sequence")


def _table_rows(o: PositionOptions) -> int:
  """A learned table covers the model's longest sequence and every randomized position."""
  # max_length 0 or less built a table of no rows: only a later add_to_inputs said that no position fit it
  max_length = positions_ops._check_positive_int(o.require("max_length"), "make_position_encoding", "max_length")
  return max(max_length, o.randomized.max_position)


POSITION_ENCODINGS: dict[str, PositionEncoding] = {
    "none": PositionEncoding(lambda o, rngs: NoPositions(), ("sequence", "grid"), "none", randomizable=True),
    "learned": PositionEncoding(
        lambda o, rngs: LearnedPositions(_table_rows(o), o.features, param_dtype=o.param_dtype, rngs=rngs),
        ("sequence",), "additive", randomizable=True, max_length_table=True),
    "sinusoidal": PositionEncoding(lambda o, rngs: SinusoidalPositions(o.features, base=o.base),
                                   ("sequence",), "additive", randomizable=True),
    "rope": _rotary("rope"),
    "alibi": PositionEncoding(lambda o, rngs: AlibiPositions(o.require("num_heads"), causal=o.causal),
                              ("sequence",), "bias", randomizable=True),
    "t5_bias": PositionEncoding(
        lambda o, rngs: T5BiasPositions(o.require("num_heads"), bidirectional=not o.causal,
                                        num_buckets=o.num_buckets, max_distance=o.max_distance,
                                        param_dtype=o.param_dtype, rngs=rngs),
        ("sequence",), "bias", randomizable=True),
    "learned_2d": PositionEncoding(
        lambda o, rngs: Learned2DPositions(o.require("grid"), o.features, num_extra_tokens=o.num_extra_tokens,
                                           param_dtype=o.param_dtype, rngs=rngs),
        ("grid",), "additive"),
    "sincos_2d": PositionEncoding(
        lambda o, rngs: SinCos2DPositions(o.require("grid"), o.features, num_extra_tokens=o.num_extra_tokens,
                                          base=o.base),
        ("grid",), "additive"),
    "fourier": PositionEncoding(
        lambda o, rngs: FourierPositions(o.require("grid"), o.features, num_bands=o.num_fourier_bands,
                                         num_extra_tokens=o.num_extra_tokens, dtype=o.dtype,
                                         param_dtype=o.param_dtype, rngs=rngs),
        ("grid",), "additive"),
    "rope_2d": _rotary("rope_2d"),
    "mrope": _rotary("mrope"),
}


def register_position_encoding(name: str, entry: PositionEncoding, *, replace: bool = False) -> None:
  """Adds `entry` to POSITION_ENCODINGS as `name`: models, tasks and config validation accept it from then on.

  The entry provides `build(options, rngs)`, returning a module with NoPositions' interface (subclass it:
  sequence_positions, check_fits, add_to_inputs, rotary, attention_bias; see the module docstring), and
  declares the rules configs are checked by: `layouts` (a model takes the encodings of its layout), `role`,
  `rotary` (its ROTARY_KINDS name, if rotary), `randomizable`, `max_length_table`. Register it before the
  config is validated: a run of launch.py registers it from a module its config file imports.
  ValueError for a name that is not a non-empty str, or is registered already (unless replace), or an entry
  that is not a PositionEncoding.
  """
  registry.check_new_name("register_position_encoding", POSITION_ENCODINGS, name, replace=replace)
  if not isinstance(entry, PositionEncoding):
    raise ValueError(f"register_position_encoding: entry must be a PositionEncoding, got {type(entry).__name__}")
  registry.add("register_position_encoding", POSITION_ENCODINGS, name, entry)


def names(*, layout: str | tuple[str, ...] | None = None, role: str | None = None,
          randomizable: bool | None = None) -> tuple[str, ...]:
  """The registered encodings (registry order) that take `layout` (or any of several), act as `role`, are
  randomizable. Read when called: encodings registered since count."""
  layouts = (layout,) if isinstance(layout, str) else layout
  return tuple(name for name, entry in POSITION_ENCODINGS.items()
               if (layouts is None or set(layouts) & set(entry.layouts)) and (role is None or entry.role == role)
               and (randomizable is None or entry.randomizable == randomizable))


def get(name: str) -> PositionEncoding:
  """The registry entry of name; ValueError listing the registered names if there is none."""
  if name not in POSITION_ENCODINGS:
    raise ValueError(f"make_position_encoding: unknown name {name!r}; allowed: {', '.join(POSITION_ENCODINGS)}")
  return POSITION_ENCODINGS[name]


def make_position_encoding(name: str, *, features: int, rngs: nnx.Rngs, **options) -> nnx.Module:
  """The position-encoding module registered under name (see POSITION_ENCODINGS and PositionOptions).

  E.g. make_position_encoding("learned", features=512, max_length=256, rngs=rngs), or
  make_position_encoding("rope", features=512, head_dim=64, rngs=rngs), or with
  randomized=RandomizedPositions(max_position=1024) for randomized sequence positions.
  """
  entry = get(name)
  unknown = set(options) - {f.name for f in dataclasses.fields(PositionOptions)}
  if unknown:
    raise ValueError(f"make_position_encoding: unknown options {sorted(unknown)}")
  options = PositionOptions(name=name, features=features, **options)
  if options.randomized.max_position and not entry.randomizable:
    raise ValueError(f"make_position_encoding: randomized positions apply to the encodings computed from "
                     f"sequence indices {list(names(randomizable=True))}, got {name!r}")
  module = entry.build(options, rngs)
  module.randomized = options.randomized
  return module
