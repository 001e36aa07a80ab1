"""Boolean attention masks, True = may attend, broadcastable to [batch, heads, q_len, kv_len]."""
from __future__ import annotations

import jax.numpy as jnp


def causal_mask(q_len: int, kv_len: int | None = None, offset=None) -> jnp.ndarray:
  """Causal mask of shape [1, 1, q_len, kv_len].

  Query i sits at absolute position ``offset + i`` and may attend to keys 0..offset + i.
  By default ``offset = kv_len - q_len``: the queries are the last q_len positions of the
  key sequence, as when decoding with a KV cache.
  """
  kv_len = q_len if kv_len is None else kv_len
  if q_len <= 0 or kv_len <= 0:
    raise ValueError(f"causal_mask: q_len and kv_len must be positive, got q_len={q_len}, kv_len={kv_len}")
  offset = kv_len - q_len if offset is None else offset
  query_positions = jnp.arange(q_len)[:, None] + offset
  key_positions = jnp.arange(kv_len)[None, :]
  return (key_positions <= query_positions)[None, None]


def padding_mask(valid) -> jnp.ndarray:
  """Key padding mask [batch, 1, 1, kv_len] from a boolean valid array [batch, kv_len]."""
  valid = jnp.asarray(valid)
  if valid.ndim != 2 or valid.dtype != jnp.bool_:
    raise ValueError(f"padding_mask: valid must be bool [batch, kv_len], got {valid.dtype}{list(valid.shape)}")
  return valid[:, None, None, :]


def combine_masks(*masks):
  """Logical AND of the masks that are not None; None if all are None."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return None
  out = masks[0]
  for m in masks[1:]:
    out = jnp.logical_and(out, m)
  return out
