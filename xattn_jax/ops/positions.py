"""Position encodings as pure functions of explicit positions.

Positions are always passed in, never implied by an array index: `[batch, length]` (or any leading
shape) for sequences, `[batch, length, 2]` (row, column) for images and `[3, batch, length]`
(time, height, width) for multimodal RoPE in the Qwen2-VL layout. Angles and tables are computed
in float32; `apply_*` functions return the dtype they were given.

Relative position biases (ALiBi, T5 buckets) live in `xattn_jax.ops.relative_bias`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import chex
import einops
import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.ops.concrete import concrete

ROPE_LAYOUTS = ("split", "interleaved")
ROPE_SCALINGS = (None, "linear", "ntk")
RESIZE_METHODS = {"bilinear": "linear", "bicubic": "cubic"}


# ---------------------------------------------------------------------------------------------
# Validation shared by every encoding: each raises ValueError naming the function and argument.

def _as_positions(positions, function: str, name: str = "positions") -> jax.Array:
  """positions as an int or float array; bool, complex and strings are rejected."""
  positions = jnp.asarray(positions)
  if not (jnp.issubdtype(positions.dtype, jnp.integer) or jnp.issubdtype(positions.dtype, jnp.floating)):
    raise ValueError(f"{function}: {name} must hold integer or float positions, got dtype {positions.dtype}")
  return positions


def _check_positive_int(value, function: str, name: str, *, even: bool = False, multiple_of: int = 1) -> int:
  multiple_of = 2 if even else multiple_of
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0 or value % multiple_of:
    need = f"a positive multiple of {multiple_of}" if multiple_of > 1 else "a positive int"
    raise ValueError(f"{function}: {name} must be {need}, got {value!r}")
  return int(value)


def _check_base(base, function: str) -> None:
  """A wavelength base must be a finite number > 0: base ** (-2i/dim) of 0 or a negative base is inf or NaN."""
  if isinstance(base, (bool, np.bool_)) or not isinstance(base, (int, float, np.integer, np.floating)) or not (
      math.isfinite(base) and base > 0):
    raise ValueError(f"{function}: base must be a finite number > 0, got base={base!r}")


def _check_broadcasts(shape, target, function: str, name: str, need: str) -> None:
  """shape must broadcast to target without enlarging it (e.g. [length] or [batch, length])."""
  try:
    ok = len(shape) <= len(target) and np.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
  except ValueError:
    ok = False
  if not ok:
    raise ValueError(f"{function}: {name} must have shape {need} broadcastable to {list(target)}, "
                     f"got {list(shape)}")


def _check_choice(value, choices, function: str, name: str) -> None:
  if value not in choices:
    raise ValueError(f"{function}: {name} must be one of {list(choices)}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Which positions a sequence gets.

def randomized_positions(rng, batch: int, length: int, max_position: int) -> jax.Array:
  """Randomized positions (Ruoss et al. 2023): for every row, `length` distinct positions drawn
  uniformly from [0, max_position), sorted ascending: int32 [batch, length].

  Training a sequence of length n on such a subset instead of 0..n-1 shows the encoding every
  position below max_position, so a longer sequence at test time sees no position it never trained
  on. Every row is an independent draw; the result is a pure function of rng.
  """
  batch = _check_positive_int(batch, "randomized_positions", "batch")
  length = _check_positive_int(length, "randomized_positions", "length")
  max_position = _check_positive_int(max_position, "randomized_positions", "max_position")
  if length > max_position:
    raise ValueError(f"randomized_positions: length must be <= max_position={max_position} (positions are "
                     f"distinct), got length={length}")
  rng = rng if isinstance(rng, jax.Array) else jnp.asarray(rng)
  if not (jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) or (rng.dtype == jnp.uint32 and rng.shape == (2,))):
    raise ValueError(f"randomized_positions: rng must be a jax.random key, got {rng.dtype}{list(rng.shape)}")
  scores = jax.random.uniform(rng, (batch, max_position))
  _, chosen = jax.lax.top_k(scores, length)  # [batch, length]: distinct indices of the largest scores
  return jnp.sort(chosen, axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Absolute encodings added to the embeddings.

def sinusoidal(positions, dim: int, base: float = 10000.0) -> jax.Array:
  """Vaswani et al. table: p[t, 2i] = sin(t / base^(2i/dim)), p[t, 2i+1] = cos(t / base^(2i/dim)).

  positions: [...] int or float -> [..., dim] float32. dim must be even. Pair i of the output is a
  point on a circle turning at frequency base^(-2i/dim), so p[t + k] is p[t] rotated pair by pair
  by an angle that depends on k only.
  """
  positions = _as_positions(positions, "sinusoidal")
  dim = _check_positive_int(dim, "sinusoidal", "dim", even=True)
  _check_base(base, "sinusoidal")
  frequencies = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # [dim/2]
  angles = positions.astype(jnp.float32)[..., None] * frequencies  # [..., dim/2]
  table = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)  # [..., dim/2, (sin, cos)]
  return einops.rearrange(table, "... pair two -> ... (pair two)")


def check_positions_fit(max_position: int, table_size: int, function: str = "learned_lookup") -> None:
  """Static check for layers: raises unless positions 0..max_position all index a table row.

  Call it with Python ints known at trace time (e.g. `offset + length - 1`), where
  `learned_lookup` alone cannot check traced positions.
  """
  if max_position >= table_size:
    raise ValueError(f"{function}: position {max_position} does not fit a learned table of {table_size} rows "
                     f"(positions must lie in 0..{table_size - 1}); build a larger table (a model's max_length)")


def learned_lookup(table, positions) -> jax.Array:
  """Absolute learned encoding: table [max_len, dim], int positions [...] -> [..., dim].

  Concrete positions outside 0..max_len-1 raise ValueError. Traced positions (under jit) cannot be
  checked: there an out-of-range position, negative ones included, yields a row of NaN instead of
  silently reading a clamped or wrapped row; layers should also call `check_positions_fit` with
  their static length.
  """
  table = jnp.asarray(table)
  if table.ndim != 2 or not jnp.issubdtype(table.dtype, jnp.floating):
    raise ValueError(f"learned_lookup: table must be a float [max_len, dim], got {table.dtype}{list(table.shape)}")
  positions = jnp.asarray(positions)
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    raise ValueError(f"learned_lookup: positions must be integers, got dtype {positions.dtype}")
  table_size = table.shape[0]
  values = concrete(positions)
  if values is not None and values.size:
    low, high = int(values.min()), int(values.max())
    if low < 0:
      raise ValueError(f"learned_lookup: positions must be >= 0, got minimum {low}")
    check_positions_fit(high, table_size)
  # jnp.take wraps negative indices; send them past the end so that they fill with NaN too.
  positions = jnp.where(positions < 0, table_size, positions)
  return jnp.take(table, positions, axis=0, mode="fill", fill_value=jnp.nan)


# ---------------------------------------------------------------------------------------------
# Rotary encodings (RoPE): rotate query and key pairs so that scores see only offsets.

def rope_angles(positions, dim: int, base: float = 10000.0, *, scaling: str | None = None,
                scaling_factor: float = 1.0) -> jax.Array:
  """Rotation angles positions * theta_i with theta_i = base^(-2i/dim), i < dim/2.

  positions: [...] -> [..., dim/2] float32. `dim` is the number of rotated channels.
  scaling="linear" (position interpolation, Chen et al. 2023) divides positions by
  scaling_factor; scaling="ntk" (NTK-aware) raises the base to base * factor^(dim / (dim - 2)),
  which leaves the fastest pair unchanged and stretches the slowest by ~factor.
  """
  positions = _as_positions(positions, "rope_angles")
  dim = _check_positive_int(dim, "rope_angles", "dim", even=True)
  _check_base(base, "rope_angles")
  _check_choice(scaling, ROPE_SCALINGS, "rope_angles", "scaling")
  if not scaling_factor > 0:
    raise ValueError(f"rope_angles: scaling_factor must be > 0, got {scaling_factor!r}")
  positions = positions.astype(jnp.float32)
  if scaling == "linear":
    positions = positions / scaling_factor
  elif scaling == "ntk":
    if dim == 2:
      raise ValueError("rope_angles: scaling='ntk' needs dim > 2 (base * factor^(dim/(dim-2))), got dim=2")
    base = base * scaling_factor ** (dim / (dim - 2))
  inverse_frequencies = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # [dim/2]
  return positions[..., None] * inverse_frequencies


def _rotate_pair(first, second, angle):
  """Rotate the 2D vector (first, second) by angle.

  Written for one pair at one position; broadcasting lifts it over pairs, heads and positions.
  """
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  return first * cos - second * sin, first * sin + second * cos


def _rotate(x, angles, layout: str):
  """Rotate the first 2 * angles.shape[-1] channels of x [..., head_dim] pair by pair.

  angles broadcasts to [..., rotary_dim/2]. "split" pairs channel i with i + rotary_dim/2
  (Llama / Qwen / GPT-NeoX checkpoints); "interleaved" pairs 2i with 2i+1 (RoFormer, GPT-J).
  Channels past rotary_dim pass through untouched. Computed in float32, returned in x.dtype.
  """
  rotary_dim = 2 * angles.shape[-1]
  x32 = x.astype(jnp.float32)
  rotated, passthrough = x32[..., :rotary_dim], x32[..., rotary_dim:]
  pattern = "... (two pair) -> two ... pair" if layout == "split" else "... (pair two) -> two ... pair"
  first, second = einops.rearrange(rotated, pattern, two=2)  # each [..., rotary_dim/2]
  turned = jnp.stack(_rotate_pair(first, second, angles))  # [2, ..., rotary_dim/2]
  inverse = "two ... pair -> ... (two pair)" if layout == "split" else "two ... pair -> ... (pair two)"
  out = jnp.concatenate([einops.rearrange(turned, inverse), passthrough], axis=-1)
  chex.assert_shape(out, x.shape)
  return out.astype(x.dtype)


def _check_rope_input(x, rotary_dim, layout, function: str, multiple_of: int = 2):
  """Validates x [..., length, heads, head_dim] and returns the number of rotated channels."""
  x = jnp.asarray(x)
  if x.ndim < 3 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{function}: x must be a float array [batch, length, heads, head_dim], "
                     f"got {x.dtype}{list(x.shape)}")
  _check_choice(layout, ROPE_LAYOUTS, function, "layout")
  head_dim = x.shape[-1]
  if rotary_dim is None:  # all of head_dim rotates: then it is x's last axis that must divide
    if head_dim % multiple_of:
      raise ValueError(f"{function}: x's last axis (head_dim) must be a multiple of {multiple_of} to rotate "
                       f"all of it, got x{list(x.shape)}; or pass a rotary_dim <= {head_dim} that is")
    rotary_dim = head_dim
  _check_positive_int(rotary_dim, function, "rotary_dim", multiple_of=multiple_of)
  if rotary_dim > head_dim:
    raise ValueError(f"{function}: rotary_dim must be <= head_dim={head_dim}, got {rotary_dim}")
  return x, rotary_dim


def apply_rope(x, positions, *, base: float = 10000.0, rotary_dim: int | None = None, layout: str = "split",
               scaling: str | None = None, scaling_factor: float = 1.0) -> jax.Array:
  """1D RoPE (Su et al.): rotate x [batch, length, heads, head_dim] by positions [batch, length].

  positions may be any shape broadcastable to x.shape[:-2], e.g. [length]. Pair i turns by
  positions * base^(-2i/rotary_dim), so <apply_rope(q, m), apply_rope(k, n)> depends on m - n only.
  rotary_dim (default head_dim) < head_dim rotates only the leading channels (partial rotary,
  as GPT-NeoX). See `rope_angles` for scaling and `_rotate` for the two pair layouts.
  """
  x, rotary_dim = _check_rope_input(x, rotary_dim, layout, "apply_rope")
  positions = _as_positions(positions, "apply_rope")
  _check_broadcasts(positions.shape, x.shape[:-2], "apply_rope", "positions", "[batch, length]")
  angles = rope_angles(positions, rotary_dim, base, scaling=scaling, scaling_factor=scaling_factor)
  return _rotate(x, angles[..., None, :], layout)  # angles [..., length, 1 (heads), rotary_dim/2]


def apply_rope_2d(x, positions, *, base: float = 10000.0, rotary_dim: int | None = None,
                  layout: str = "split", scaling: str | None = None, scaling_factor: float = 1.0) -> jax.Array:
  """Axial 2D RoPE: x [batch, length, heads, head_dim], positions [batch, length, 2] (row, column).

  positions may be [batch | 1, length | 1, 2] or [2] (one cell for every token); never [n, 2], which would
  read as [length, 2] even where it was meant as one cell per row [batch, 2] (the same shape when n = batch
  = length), so either shape is spelt out as [1, length, 2] or [batch, 1, 2].

  The first half of the rotary pairs turns with the row, the second half with the column, each
  half with the 1D frequencies of a rotary_dim/2 rope (Heo et al. 2024, "RoPE-Axial"). Scores
  then depend only on (row offset, column offset). rotary_dim must be a multiple of 4.
  """
  x, rotary_dim = _check_rope_input(x, rotary_dim, layout, "apply_rope_2d", multiple_of=4)
  positions = _as_positions(positions, "apply_rope_2d")
  if positions.ndim < 1 or positions.shape[-1] != 2:
    raise ValueError(f"apply_rope_2d: positions must be [batch, length, 2] (row, column), got {list(positions.shape)}")
  if positions.ndim == 2:
    raise ValueError(f"apply_rope_2d: positions{list(positions.shape)} could be one cell per token [length, 2] or "
                     f"per row [batch, 2]: pass [1, length, 2] or [batch, 1, 2] (x is [batch, length] = "
                     f"{list(x.shape[:2])})")
  _check_broadcasts(positions.shape[:-1], x.shape[:-2], "apply_rope_2d", "positions[..., 0]", "[batch, length]")
  per_axis = [rope_angles(positions[..., axis], rotary_dim // 2, base, scaling=scaling,
                          scaling_factor=scaling_factor) for axis in range(2)]  # 2 x [..., rotary_dim/4]
  angles = jnp.concatenate(per_axis, axis=-1)  # [batch, length, rotary_dim/2]
  return _rotate(x, angles[..., None, :], layout)


def apply_mrope(x, positions, sections: Sequence[int], *, base: float = 10000.0, rotary_dim: int | None = None,
                layout: str = "split", scaling: str | None = None, scaling_factor: float = 1.0) -> jax.Array:
  """Multimodal RoPE (Qwen2-VL): x [batch, length, heads, head_dim], positions [3, batch, length].

  Every frequency pair i gets the usual 1D frequency base^(-2i/rotary_dim), but takes its
  position from one axis: the first sections[0] pairs from positions[0] (time), the next
  sections[1] from positions[1] (height), the rest from positions[2] (width). As in Qwen2-VL's
  `mrope_section` (e.g. [16, 24, 24] for head_dim 128), sections count frequency pairs and must sum
  to rotary_dim / 2; Qwen2-VL doubles the list internally to index its duplicated cos/sin
  halves, which is the "split" layout here. With all axes equal this is exactly 1D RoPE.
  """
  x, rotary_dim = _check_rope_input(x, rotary_dim, layout, "apply_mrope")
  positions = _as_positions(positions, "apply_mrope")
  try:
    sections = list(sections)
  except TypeError:  # a single int: iterating it failed with a TypeError naming no argument
    raise ValueError(f"apply_mrope: sections must be a list of positive ints, got {sections!r}") from None
  if not sections or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s <= 0 for s in sections):
    raise ValueError(f"apply_mrope: sections must be positive ints, got {sections}")
  if sum(sections) != rotary_dim // 2:
    raise ValueError(f"apply_mrope: sections must count frequency pairs summing to rotary_dim/2={rotary_dim // 2}, "
                     f"got {sections} (sum {sum(sections)})")
  if positions.ndim < 1 or positions.shape[0] != len(sections):
    raise ValueError(f"apply_mrope: positions must be [{len(sections)}, batch, length] (one row per section), "
                     f"got {list(positions.shape)}")
  _check_broadcasts(positions.shape[1:], x.shape[:-2], "apply_mrope", "positions[axis]", "[batch, length]")
  angles = rope_angles(positions, rotary_dim, base, scaling=scaling, scaling_factor=scaling_factor)
  bounds = np.cumsum([0] + sections)  # pair ranges [bounds[a], bounds[a+1]) read axis a
  angles = jnp.concatenate([angles[axis, ..., start:stop] for axis, (start, stop)
                            in enumerate(zip(bounds[:-1], bounds[1:]))], axis=-1)  # [batch, length, rotary_dim/2]
  return _rotate(x, angles[..., None, :], layout)


def mrope_position_ids(batch_segments, *, spatial_merge_size: int = 1, pad_to: int | None = None,
                       pad_position: int = 0) -> np.ndarray:
  """Host-side [3, batch, length] int32 ids for apply_mrope, following Qwen2-VL's get_rope_index.

  batch_segments: one list per example of segments ("text", n) or ("image", (t, h, w)), with
  (t, h, w) the patch grid of the image (or video). An image block yields t * (h/m) * (w/m)
  tokens, m = spatial_merge_size (2 in Qwen2-VL, whose LLM sees 2x2-merged patches), whose ids are
  their (time, row, column) grid coordinates plus `start`, the next text index. Text tokens get
  the same index on all three axes; text after a block resumes at the block's maximum id + 1.
  Examples shorter than the longest (or than pad_to) are padded with pad_position; mask them.
  Built with numpy because segment lengths decide the output shape.
  """
  merge = _check_positive_int(spatial_merge_size, "mrope_position_ids", "spatial_merge_size")
  # ints only: a float pad_to failed in np.full, a float pad_position was truncated into the int32 ids
  is_int = lambda value: isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
  if pad_to is not None and not (is_int(pad_to) and pad_to >= 0):
    raise ValueError(f"mrope_position_ids: pad_to must be None or an int >= 0, got pad_to={pad_to!r}")
  if not is_int(pad_position):
    raise ValueError(f"mrope_position_ids: pad_position must be an int, got pad_position={pad_position!r}")
  if isinstance(batch_segments, (str, bytes)) or not isinstance(batch_segments, Sequence):
    raise ValueError(f"mrope_position_ids: batch_segments must be a list (one per example) of segment lists, "
                     f"got {type(batch_segments).__name__}")
  examples = []
  for segments in batch_segments:
    ids, start = [], 0
    for segment in segments:
      kind, size = segment if isinstance(segment, tuple) and len(segment) == 2 else (None, None)
      if kind == "text":
        n = _check_positive_int(size, "mrope_position_ids", "text segment length")
        ids.append(np.broadcast_to(np.arange(start, start + n), (3, n)))
      elif kind == "image" and isinstance(size, (tuple, list)) and len(size) == 3:
        t, h, w = (_check_positive_int(s, "mrope_position_ids", "image grid (t, h, w)") for s in size)
        if h % merge or w % merge:
          raise ValueError(f"mrope_position_ids: image grid {size} must have h and w divisible by "
                           f"spatial_merge_size={merge}")
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h // merge), np.arange(w // merge), indexing="ij"))
        ids.append(grid.reshape(3, -1) + start)  # [3, t*h*w/merge^2] in (time, row, column) order
      else:
        raise ValueError(f"mrope_position_ids: segments must be ('text', n) or ('image', (t, h, w)), got {segment!r}")
      start = int(ids[-1].max()) + 1
    examples.append(np.concatenate(ids, axis=1) if ids else np.zeros((3, 0), np.int64))
  length = max((e.shape[1] for e in examples), default=0) if pad_to is None else pad_to
  if any(e.shape[1] > length for e in examples):
    raise ValueError(f"mrope_position_ids: pad_to={pad_to} is shorter than the longest example "
                     f"({max(e.shape[1] for e in examples)} tokens)")
  out = np.full((3, len(examples), length), pad_position, np.int32)
  for b, e in enumerate(examples):
    out[:, b, :e.shape[1]] = e
  return out


# ---------------------------------------------------------------------------------------------
# 2D encodings for image patches.

def grid_positions(height: int, width: int) -> jax.Array:
  """Integer (row, column) of every cell of a height x width grid, row-major: [height*width, 2]."""
  height = _check_positive_int(height, "grid_positions", "height")
  width = _check_positive_int(width, "grid_positions", "width")
  rows, columns = jnp.meshgrid(jnp.arange(height), jnp.arange(width), indexing="ij")
  return jnp.stack([rows.ravel(), columns.ravel()], axis=-1)


def normalized_grid(height: int, width: int) -> jax.Array:
  """Perceiver-style (row, column) coordinates in [-1, 1], row-major: [height*width, 2] float32.

  The first and last cell of each axis sit at -1 and 1 exactly (an axis of size 1 sits at -1).
  """
  height = _check_positive_int(height, "normalized_grid", "height")
  width = _check_positive_int(width, "normalized_grid", "width")
  rows, columns = jnp.meshgrid(jnp.linspace(-1.0, 1.0, height), jnp.linspace(-1.0, 1.0, width), indexing="ij")
  return jnp.stack([rows.ravel(), columns.ravel()], axis=-1).astype(jnp.float32)


def sincos_2d(positions, dim: int, base: float = 10000.0) -> jax.Array:
  """Fixed 2D sine-cosine table (MAE, big_vision "sincos2d"): [..., dim] float32.

  positions: an array (or list) [..., 2] of (row, column) pairs, or a TUPLE (height, width) of two
  integers meaning the row-major grid (-> [height*width, dim]); so `(3, 4)` is a 12-row table and
  `[3, 4]` or `np.array([3, 4])` is the single position (3, 4). Channels [0, dim/2) are
  `sinusoidal(row, dim/2)`, channels [dim/2, dim) are `sinusoidal(column, dim/2)`: the frequencies
  of MAE, with sin and cos interleaved per pair rather than in blocks (a fixed channel permutation).
  dim must be a multiple of 4.
  """
  if isinstance(positions, tuple) and len(positions) == 2 and all(
      isinstance(p, (int, np.integer)) and not isinstance(p, bool) for p in positions):
    positions = grid_positions(*positions)
  positions = _as_positions(positions, "sincos_2d")
  dim = _check_positive_int(dim, "sincos_2d", "dim", multiple_of=4)
  _check_base(base, "sincos_2d")
  if positions.ndim < 1 or positions.shape[-1] != 2:
    raise ValueError(f"sincos_2d: positions must be [..., 2] (row, column) or (height, width), "
                     f"got shape {list(positions.shape)}")
  return jnp.concatenate([sinusoidal(positions[..., 0], dim // 2, base),
                          sinusoidal(positions[..., 1], dim // 2, base)], axis=-1)


def fourier_features(coords, num_bands: int, max_resolution, concat_pos: bool = True) -> jax.Array:
  """Perceiver Fourier features of coords [..., d] in [-1, 1].

  For every axis a, num_bands frequencies f linearly spaced from 1 to max_resolution[a] / 2
  (the Nyquist frequency of a grid of that many cells); features sin(pi f x) for every (axis,
  band), then cos(pi f x), then (if concat_pos) the raw coords first:
  [..., d * (2 * num_bands + concat_pos)]. max_resolution: an int for every axis or d ints.
  """
  coords = _as_positions(coords, "fourier_features", "coords")
  if coords.ndim < 1:
    raise ValueError(f"fourier_features: coords must be [..., d], got shape {list(coords.shape)}")
  num_axes = coords.shape[-1]
  num_bands = _check_positive_int(num_bands, "fourier_features", "num_bands")
  resolution = (max_resolution,) * num_axes if np.ndim(max_resolution) == 0 else tuple(max_resolution)
  if len(resolution) != num_axes or not all(r > 0 for r in resolution):
    raise ValueError(f"fourier_features: max_resolution must be a positive number or {num_axes} of them "
                     f"(coords [..., {num_axes}]), got {max_resolution!r}")
  bands = jnp.stack([jnp.linspace(1.0, r / 2, num_bands) for r in resolution])  # [d, num_bands]
  phases = jnp.pi * coords.astype(jnp.float32)[..., :, None] * bands  # [..., d, num_bands]
  phases = einops.rearrange(phases, "... d bands -> ... (d bands)")
  features = [jnp.sin(phases), jnp.cos(phases)]
  if concat_pos:
    features.insert(0, coords.astype(jnp.float32))
  return jnp.concatenate(features, axis=-1)


def resize_2d_table(table, old_grid: tuple[int, int], new_grid: tuple[int, int], method: str = "bilinear",
                    num_extra_tokens: int = 0, *, align_corners: bool = True) -> jax.Array:
  """Resize a learned 2D table [num_extra + h*w, dim] (row-major grid) to [num_extra + h2*w2, dim].

  The first num_extra_tokens rows (class / register tokens) are kept as they are. An unchanged
  grid returns the table itself. align_corners=True (default) maps corner cells onto corner cells
  and interpolates without antialiasing, like scipy.ndimage.zoom in big_vision's resample_posemb,
  so a table linear in (row, column) stays linear under bilinear resizing; align_corners=False
  uses half-pixel centers with antialiased downsampling (jax.image.resize, as timm).
  """
  table = jnp.asarray(table)
  _check_choice(method, RESIZE_METHODS, "resize_2d_table", "method")
  grids = {}
  for name, grid in (("old_grid", old_grid), ("new_grid", new_grid)):
    if not isinstance(grid, (tuple, list)) or len(grid) != 2:
      raise ValueError(f"resize_2d_table: {name} must be (height, width), got {grid!r}")
    grids[name] = tuple(_check_positive_int(g, "resize_2d_table", name) for g in grid)
  (height, width), (new_height, new_width) = grids["old_grid"], grids["new_grid"]
  if num_extra_tokens < 0 or table.ndim != 2 or table.shape[0] != num_extra_tokens + height * width:
    raise ValueError(f"resize_2d_table: table must be [num_extra_tokens + h*w = {num_extra_tokens + height * width}, "
                     f"dim] for old_grid={old_grid}, num_extra_tokens={num_extra_tokens}, got {list(table.shape)}")
  if (height, width) == (new_height, new_width):
    return table
  extra, cells = table[:num_extra_tokens], table[num_extra_tokens:]
  image = einops.rearrange(cells, "(h w) dim -> h w dim", h=height).astype(jnp.float32)
  new_shape = (new_height, new_width, table.shape[1])
  if align_corners:
    # Output cell k samples input coordinate k * (n - 1) / (n2 - 1). scale_and_translate samples
    # (k + 0.5 - translation) / scale - 0.5, so scale = (n2 - 1) / (n - 1), translation = (1 - scale) / 2.
    # A size-1 axis on either side has no such map: sample cell 0 (output) or repeat it (input).
    scale = [(n2 - 1) / (n - 1) if n > 1 and n2 > 1 else (n2 if n == 1 else 1.0)
             for n, n2 in ((height, new_height), (width, new_width))]
    translation = [(1 - s) / 2 if n > 1 and n2 > 1 else 0.0
                   for s, n, n2 in zip(scale, (height, width), (new_height, new_width))]
    resized = jax.image.scale_and_translate(image, new_shape, (0, 1), jnp.array(scale, jnp.float32),
                                            jnp.array(translation, jnp.float32), RESIZE_METHODS[method],
                                            antialias=False)
  else:
    resized = jax.image.resize(image, new_shape, RESIZE_METHODS[method])
  cells = einops.rearrange(resized, "h w dim -> (h w) dim").astype(table.dtype)
  return jnp.concatenate([extra, cells], axis=0)
