"""Scaled dot-product attention (reference dense path; H1 extends with chunked / cuDNN)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xattn_jax.ops import masks as masks_lib


def _validate(query, key, value):
  if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
    raise ValueError(
        "dot_product_attention: query, key and value must be [batch, length, heads, head_dim], got "
        f"query{list(query.shape)}, key{list(key.shape)}, value{list(value.shape)}")
  b, _, n, h = query.shape
  if key.shape[0] != b or key.shape[3] != h:
    raise ValueError(f"dot_product_attention: key must be [{b}, kv_len, kv_heads, {h}], got key{list(key.shape)}")
  if value.shape[:3] != key.shape[:3]:
    raise ValueError(
        f"dot_product_attention: value must be [{key.shape[0]}, {key.shape[1]}, {key.shape[2]}, head_dim], "
        f"got value{list(value.shape)}")
  if n % key.shape[2]:
    raise ValueError(f"dot_product_attention: heads={n} must be divisible by kv_heads={key.shape[2]}")


def attention_weights(query, key, *, bias=None, mask=None, is_causal=False, scale=None):
  """Softmax probabilities [batch, heads, q_len, kv_len] in float32; fully masked rows are zero."""
  b, t, n, h = query.shape
  s, k = key.shape[1], key.shape[2]
  scale = h ** -0.5 if scale is None else scale
  q = query.reshape(b, t, k, n // k, h)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, key, preferred_element_type=jnp.float32) * scale
  scores = scores.reshape(b, n, t, s)
  if bias is not None:
    scores = scores + bias.astype(jnp.float32)
  if is_causal:
    mask = masks_lib.combine_masks(mask, masks_lib.causal_mask(t, s))
  if mask is not None:
    mask = jnp.broadcast_to(mask, scores.shape)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(scores, axis=-1)
  if mask is not None:
    # A query that may see no key gets zero weight everywhere (zero output, finite gradient).
    weights = jnp.where(jnp.any(mask, axis=-1, keepdims=True), weights, 0.0)
  return weights


def dot_product_attention(query, key, value, *, bias=None, mask=None, is_causal=False, scale=None,
                          implementation=None):
  """softmax(q k^T * scale + bias, masked) v. Shapes as jax.nn.dot_product_attention."""
  _validate(query, key, value)
  b, t, n, h = query.shape
  k = key.shape[2]
  weights = attention_weights(query, key, bias=bias, mask=mask, is_causal=is_causal, scale=scale)
  weights = weights.reshape(b, k, n // k, t, -1).astype(value.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", weights, value)
  return out.reshape(b, t, n, h)
