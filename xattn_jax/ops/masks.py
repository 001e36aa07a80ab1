"""Boolean attention masks, True = may attend, broadcastable to [batch, heads, q_len, kv_len].

Positions convention: key j sits at absolute position j; query i sits at absolute position
`offset + i`. With the default `offset = kv_len - q_len` the queries are the LAST q_len positions
of the key sequence, which is what a decoder with a KV cache needs (one new query attends to the
whole cache) and what `dot_product_attention(..., is_causal=True)` uses.

Segment ids: 0 means padding. A padded query attends to nothing (zero output in
`dot_product_attention`) and a padded key is seen by no query; real segments use ids >= 1.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _shape(x) -> list[int]:
  return list(jnp.shape(x))


def _static_length(n) -> bool:
  """A length known while tracing: a Python or numpy int (not a bool) above 0."""
  return isinstance(n, (int, np.integer)) and not isinstance(n, (bool, np.bool_)) and n > 0


def causal_mask(q_len: int, kv_len: int | None = None, offset=None) -> jnp.ndarray:
  """Mask where query i may attend to keys 0 .. offset + i.

  Args:
    q_len: number of queries (static int > 0).
    kv_len: number of keys (static int > 0); defaults to q_len.
    offset: absolute position of query 0. None means `kv_len - q_len` (queries are the last
      q_len positions). A Python int or a traced scalar gives a `[1, 1, q_len, kv_len]` mask; a
      `[batch]` integer array (one cache position per sequence) gives `[batch, 1, q_len, kv_len]`.
  """
  kv_len = q_len if kv_len is None else kv_len
  if not (_static_length(q_len) and _static_length(kv_len)):
    raise ValueError(
        f"causal_mask: q_len and kv_len must be positive static ints, got q_len={q_len!r}, kv_len={kv_len!r}")
  q_len, kv_len = int(q_len), int(kv_len)
  if offset is None:
    offset = kv_len - q_len
  offset = jnp.asarray(offset)
  if offset.ndim > 1 or not jnp.issubdtype(offset.dtype, jnp.integer):
    raise ValueError(
        "causal_mask: offset must be an int scalar or an int [batch] array, "
        f"got {offset.dtype}{_shape(offset)}")
  query_positions = offset.reshape(-1, 1, 1, 1) + jnp.arange(q_len)[:, None]  # [batch|1, 1, q_len, 1]
  key_positions = jnp.arange(kv_len)  # [kv_len]
  return key_positions <= query_positions  # [batch|1, 1, q_len, kv_len]


def lengths_to_valid(lengths, length: int) -> jnp.ndarray:
  """Boolean [batch, length] array, True at positions < lengths[b]. lengths: int [batch]."""
  lengths = jnp.asarray(lengths)
  if lengths.ndim != 1 or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths_to_valid: lengths must be int [batch], got {lengths.dtype}{_shape(lengths)}")
  if not _static_length(length):  # numpy ints too, as causal_mask; a bool failed in iota
    raise ValueError(f"lengths_to_valid: length must be a positive static int, got {length!r}")
  return jnp.arange(int(length)) < lengths[:, None]


def padding_mask(valid, kv_len: int | None = None) -> jnp.ndarray:
  """Key padding mask [batch, 1, 1, kv_len].

  `valid` is either a boolean [batch, kv_len] array (True = real key), or int lengths [batch]
  together with `kv_len` (keys at positions >= lengths[b] are padding).
  """
  valid = jnp.asarray(valid)
  if kv_len is not None and not _static_length(kv_len):  # named here: lengths_to_valid calls it length
    raise ValueError(f"padding_mask: kv_len must be None or a positive static int, got kv_len={kv_len!r}")
  if valid.ndim == 1 and jnp.issubdtype(valid.dtype, jnp.integer):
    if kv_len is None:
      raise ValueError(
          f"padding_mask: got lengths int{_shape(valid)}, which needs kv_len (the padded key length); got None")
    valid = lengths_to_valid(valid, kv_len)
  if valid.ndim != 2 or valid.dtype != jnp.bool_:
    raise ValueError(
        "padding_mask: valid must be bool [batch, kv_len] or int lengths [batch] with kv_len, "
        f"got {valid.dtype}{_shape(valid)}")
  if kv_len is not None and valid.shape[1] != kv_len:
    raise ValueError(f"padding_mask: valid must be [batch, {kv_len}] for kv_len={kv_len}, got {_shape(valid)}")
  return valid[:, None, None, :]


def segment_mask(query_segment_ids, key_segment_ids) -> jnp.ndarray:
  """Mask [batch, 1, q_len, kv_len]: a query attends to keys of its own segment.

  For packed sequences: ids are int [batch, q_len] and [batch, kv_len]; pass the same array twice
  for self-attention, or the decoder's and encoder's ids for cross-attention (segment k of the
  targets attends to segment k of the sources). Id 0 marks padding and matches nothing.
  """
  query_segment_ids = jnp.asarray(query_segment_ids)
  key_segment_ids = jnp.asarray(key_segment_ids)
  for name, ids in (("query_segment_ids", query_segment_ids), ("key_segment_ids", key_segment_ids)):
    if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise ValueError(f"segment_mask: {name} must be int [batch, length], got {ids.dtype}{_shape(ids)}")
  if query_segment_ids.shape[0] != key_segment_ids.shape[0]:
    raise ValueError(
        "segment_mask: query_segment_ids and key_segment_ids need the same batch, got "
        f"{_shape(query_segment_ids)} and {_shape(key_segment_ids)}")
  same = query_segment_ids[:, :, None] == key_segment_ids[:, None, :]  # [batch, q_len, kv_len]
  real = (query_segment_ids != 0)[:, :, None]
  return (same & real)[:, None]


def combine_masks(*masks):
  """Logical AND of the masks that are not None (broadcasting); None if all are None."""
  present = [jnp.asarray(m) for m in masks if m is not None]
  for i, m in enumerate(present):
    if m.dtype != jnp.bool_:
      raise ValueError(f"combine_masks: every mask must be bool, got mask {i} as {m.dtype}{_shape(m)}")
  if not present:
    return None
  try:
    shape = jnp.broadcast_shapes(*(m.shape for m in present))
  except ValueError:
    raise ValueError(
        f"combine_masks: masks must broadcast together, got shapes {[_shape(m) for m in present]}") from None
  out = present[0]
  for m in present[1:]:
    out = jnp.logical_and(out, m)
  return jnp.broadcast_to(out, shape)


def may_hide_rows(mask, bias, is_causal: bool, q_len: int, kv_len: int) -> bool:
  """Whether some query row may see no key at all (a mask, a bias that may hold -inf, or causal with
  q_len > kv_len): attention kernels then guard such rows to give zeros, not NaN, and skip the
  guards otherwise."""
  return mask is not None or bias is not None or (is_causal and q_len > kv_len)
