"""Relative position biases added to attention scores: ALiBi and T5 buckets.

Both take explicit query and key positions, [batch, q_len] and [batch, kv_len] (or [q_len] and
[kv_len]), and return an additive bias [batch, heads, q_len, kv_len] in float32, the shape
`jax.nn.dot_product_attention` takes as `bias`.
"""
from __future__ import annotations

import math

import einops
import jax
import jax.numpy as jnp

from xattn_jax.ops.positions import _as_positions, _check_positive_int


def alibi_slopes(num_heads: int) -> jax.Array:
  """ALiBi head slopes (Press et al. 2022): [num_heads] float32.

  For a power of two n the slopes are the geometric sequence 2^(-8/n), 2^(-16/n), ..., 2^(-8).
  Otherwise, with p the largest power of two below n, the p slopes of p heads are followed by
  every other slope of 2p heads (the odd-numbered ones), n - p of them, as in the paper's code.
  """
  num_heads = _check_positive_int(num_heads, "alibi_slopes", "num_heads")

  def power_of_two_slopes(n: int) -> list[float]:
    return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

  p = 2 ** math.floor(math.log2(num_heads))
  slopes = power_of_two_slopes(p) + power_of_two_slopes(2 * p)[0::2][:num_heads - p]
  return jnp.asarray(slopes, jnp.float32)


def _pair_positions(query_positions, key_positions, function: str):
  """Validates [batch, q] / [batch, kv] (or 1D) positions; returns both as [batch, len]."""
  query_positions = _as_positions(query_positions, function, "query_positions")
  key_positions = _as_positions(key_positions, function, "key_positions")
  for name, positions in (("query_positions", query_positions), ("key_positions", key_positions)):
    if positions.ndim not in (1, 2):
      raise ValueError(f"{function}: {name} must be [batch, length] or [length], got shape {list(positions.shape)}")
  query_positions, key_positions = jnp.atleast_2d(query_positions), jnp.atleast_2d(key_positions)
  batch = {query_positions.shape[0], key_positions.shape[0]} - {1}
  if len(batch) > 1:
    raise ValueError(f"{function}: query_positions {list(query_positions.shape)} and key_positions "
                     f"{list(key_positions.shape)} must share the batch size (or have batch 1)")
  return query_positions, key_positions


def alibi_bias(query_positions, key_positions, slopes, *, causal: bool = False) -> jax.Array:
  """ALiBi bias -slope_h * |i - j| for query position i and key position j: [batch, heads, q, kv].

  causal=True gives -slope_h * (i - j) instead, the form of the paper's causal language model:
  equal for keys at or before the query, and meant to be combined with a causal mask.
  slopes: [heads], e.g. `alibi_slopes(heads)`.
  """
  query_positions, key_positions = _pair_positions(query_positions, key_positions, "alibi_bias")
  slopes = jnp.asarray(slopes, jnp.float32)
  if slopes.ndim != 1:
    raise ValueError(f"alibi_bias: slopes must be [heads], got shape {list(slopes.shape)}")
  offsets = (query_positions[:, :, None] - key_positions[:, None, :]).astype(jnp.float32)  # [batch, q, kv]
  distances = offsets if causal else jnp.abs(offsets)
  return -jnp.einsum("h, b q k -> b h q k", slopes, distances)


def t5_relative_position_bucket(relative_position, *, bidirectional: bool, num_buckets: int = 32,
                                max_distance: int = 128) -> jax.Array:
  """T5's bucket of relative_position = key_position - query_position (int array -> int32 array).

  Bidirectional: half of the buckets for keys after the query, half for keys at or before it.
  Unidirectional: keys after the query share bucket 0. Within a half of n buckets, distances
  below n/2 have a bucket each; larger ones share n/2 buckets spaced logarithmically up to
  max_distance, beyond which everything falls in the last bucket. Same as the Mesh TensorFlow
  and Hugging Face implementations.
  """
  function = "t5_relative_position_bucket"
  relative_position = _as_positions(relative_position, function, "relative_position")
  if not jnp.issubdtype(relative_position.dtype, jnp.integer):
    raise ValueError(f"{function}: relative_position must be integers, got dtype {relative_position.dtype}")
  num_buckets = _check_positive_int(num_buckets, function, "num_buckets", multiple_of=4 if bidirectional else 2)
  buckets_per_side = num_buckets // 2 if bidirectional else num_buckets
  max_exact = buckets_per_side // 2
  if not max_distance > max_exact:
    raise ValueError(f"{function}: max_distance must exceed the exact range {max_exact}, got {max_distance}")
  relative_position = relative_position.astype(jnp.int32)
  if bidirectional:
    side_offset = jnp.where(relative_position > 0, buckets_per_side, 0)
    distance = jnp.abs(relative_position)
  else:
    side_offset = 0
    distance = jnp.maximum(-relative_position, 0)
  # log of max(distance, 1): the small-distance branch is chosen there anyway, but log(0) = -inf
  # would turn into an undefined integer.
  log_ratio = jnp.log(jnp.maximum(distance, 1).astype(jnp.float32) / max_exact) / math.log(max_distance / max_exact)
  large = max_exact + (log_ratio * (buckets_per_side - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, buckets_per_side - 1)
  return side_offset + jnp.where(distance < max_exact, distance, large)


def t5_relative_bias(query_positions, key_positions, table, *, bidirectional: bool,
                     max_distance: int = 128) -> jax.Array:
  """T5 relative bias: table [num_buckets, heads] read at the bucket of key - query: [batch, heads, q, kv]."""
  for name, positions in (("query_positions", query_positions), ("key_positions", key_positions)):
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):  # buckets are of integer distances
      raise ValueError(
          f"t5_relative_bias: {name} must be integer positions, got {positions.dtype}{list(positions.shape)}")
  query_positions, key_positions = _pair_positions(query_positions, key_positions, "t5_relative_bias")
  table = jnp.asarray(table)
  if table.ndim != 2:
    raise ValueError(f"t5_relative_bias: table must be [num_buckets, heads], got shape {list(table.shape)}")
  relative = (key_positions[:, None, :] - query_positions[:, :, None]).astype(jnp.int32)  # [batch, q, kv]
  buckets = t5_relative_position_bucket(relative, bidirectional=bidirectional, num_buckets=table.shape[0],
                                        max_distance=max_distance)
  return einops.rearrange(jnp.take(table, buckets, axis=0), "b q k h -> b h q k").astype(jnp.float32)
