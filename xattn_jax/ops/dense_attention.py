"""Attention as one fused XLA program over the whole [q_len, kv_len] score matrix, with its own VJP.

Without gradients the CPU forward normalizes the OUTPUT: exp against the row maximum, P V, then one
divide of the [..., head_dim] rows by the row sums, which is cheaper than dividing the [q, kv]
probabilities there. On GPU the other order is faster (XLA fuses the divide into the exp), so every
other backend runs the differentiable forward's order. Under differentiation the forward keeps the
normalized float32 probabilities as the residual and the backward is the textbook softmax backward
without recomputation. On CPU this is the fastest path up to 256 x 256 scores per head; beyond,
the score tensor leaves the cache and the blocked kernel wins (experiments/results/attention_benchmark.md).

Inputs are validated by `attention.dot_product_attention`; queries arrive already scaled, or (half-precision
queries, whose scaled copy would round every score once more) `scale` multiplies the float32 scores.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from xattn_jax.ops import masks as masks_lib


def _query_head_major(x, kv_heads: int):
  """[b, t, k*g, h] -> [b, k, g*t, h]: each kv head's query rows, group by group."""
  b, t, n, h = x.shape
  return x.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, h)


def _kv_head_major(x, kv_heads_major: bool):
  """key / value [b, s, k, h] -> [b, k, s, h] (as they are if already kv_heads_major).

  Every matmul below then has its batch axes leading and writes its natural output layout; the
  one transpose of the output at the end is far cheaper than asking the matmuls for [b, t, n, h].
  """
  return x if kv_heads_major else x.transpose(0, 2, 1, 3)


def _from_head_major(x, query_shape):
  """[b, k, g*t, h] -> [b, t, k*g, h]."""
  b, t, n, h = query_shape
  k = x.shape[1]
  return x.reshape(b, k, n // k, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _grouped(x, kv_heads: int):
  """[B', N', T', S'] (N' = 1 or heads) -> [B', K', G', T', S'] matching scores [b, k, g, t, s]."""
  if x is None:
    return None
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def _scores(query, key, mask, bias, is_causal: bool, q_len: int, scale: float = 1.0):
  """Masked float32 scores [b, k, g*t, s] (-inf where masked) from head-major query [b, k, g*t, h], times
  scale (1.0: the query came scaled)."""
  b, k, gt, _ = query.shape
  s = key.shape[2]
  logits = jnp.einsum("bkqh,bksh->bkqs", query, key, preferred_element_type=jnp.float32)
  if scale != 1.0:
    logits = logits * scale
  if bias is None and mask is None and not is_causal:
    return logits
  logits = logits.reshape(b, k, gt // q_len, q_len, s)  # free: splits the (g t) axis
  if bias is not None:
    logits = logits + _grouped(bias, k).astype(jnp.float32)
  valid = _grouped(mask, k)
  if is_causal:
    valid = masks_lib.combine_masks(valid, masks_lib.causal_mask(q_len, s))
  if valid is not None:
    logits = jnp.where(valid, logits, -jnp.inf)
  return logits.reshape(b, k, gt, s)


def _exp_and_sums(logits, hide: bool):
  """exp(logits - row max) and the row sums [..., 1].

  With `hide` (`masks.may_hide_rows`) a row that sees no key gives zeros and sum 0 instead of NaN;
  without, the guard is skipped (a measurable cost at short lengths).
  """
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  if hide:
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.exp(logits - row_max)
  return p, jnp.sum(p, axis=-1, keepdims=True)


def _safe_divide(x, row_sum, hide: bool):
  """x / row_sum, 0 for a row that sees no key (sum exactly 0); a NaN sum (NaN scores) stays NaN, as without
  `hide`: NaN inputs are never turned into zeros."""
  if not hide:
    return x / row_sum
  seen = row_sum != 0
  return jnp.where(seen, x / jnp.where(seen, row_sum, 1.0), 0.0)


def _unnormalized(query, key, mask, bias, is_causal: bool, kv_heads_major: bool, scale: float = 1.0):
  """(head-major q [b, k, g*t, h], k [b, k, s, h], exp'd scores [b, k, g*t, s], row sums, hide)."""
  q, k = _query_head_major(query, key.shape[1 if kv_heads_major else 2]), _kv_head_major(key, kv_heads_major)
  t, s = query.shape[1], k.shape[2]
  hide = masks_lib.may_hide_rows(mask, bias, is_causal, t, s)
  p, row_sum = _exp_and_sums(_scores(q, k, mask, bias, is_causal, t, scale), hide)
  return q, k, p, row_sum, hide


def probabilities(query, key, mask, bias, is_causal: bool, scale: float = 1.0):
  """Normalized float32 probabilities [b, heads, t, s]; query pre-scaled or scores times `scale` (for
  `attention_weights`)."""
  _, _, p, row_sum, hide = _unnormalized(query, key, mask, bias, is_causal, False, scale)
  b, t, n, _ = query.shape
  return _safe_divide(p, row_sum, hide).reshape(b, n, t, key.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def dense_attention(query, key, value, mask, bias, is_causal: bool, kv_heads_major: bool, scale: float = 1.0):
  """softmax(scale * query key^T + bias, masked) value; query pre-scaled where scale is 1.0. Shapes as
  `dot_product_attention`; key / value [b, kv_heads, s, h] if kv_heads_major, else [b, s, kv_heads, h]."""
  if jax.default_backend() != "cpu":
    return _dense_fwd(query, key, value, mask, bias, is_causal, kv_heads_major, scale)[0]
  _, _, p, row_sum, hide = _unnormalized(query, key, mask, bias, is_causal, kv_heads_major, scale)
  v = _kv_head_major(value, kv_heads_major)
  out = jnp.einsum("bkqs,bksh->bkqh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  out = _safe_divide(out, row_sum, hide)
  return _from_head_major(out, query.shape).astype(query.dtype)


def _dense_fwd(query, key, value, mask, bias, is_causal, kv_heads_major, scale=1.0):
  q, k, p, row_sum, hide = _unnormalized(query, key, mask, bias, is_causal, kv_heads_major, scale)
  v = _kv_head_major(value, kv_heads_major)
  p = _safe_divide(p, row_sum, hide)
  out = jnp.einsum("bkqs,bksh->bkqh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return _from_head_major(out, query.shape).astype(query.dtype), (q, k, v, bias, p)


def _dense_bwd(is_causal, kv_heads_major, scale, residuals, out_grad):
  del is_causal  # already applied: masked probabilities are exactly zero
  q, k, v, bias, p = residuals
  b, t, n, h = out_grad.shape
  do = _query_head_major(out_grad, k.shape[1])
  dv = jnp.einsum("bkqs,bkqh->bksh", p.astype(do.dtype), do, preferred_element_type=jnp.float32)
  dp = jnp.einsum("bkqh,bksh->bkqs", do, v, preferred_element_type=jnp.float32)
  ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True))  # d loss / d scores
  dscaled = ds if scale == 1.0 else ds * scale  # d loss / d (query key^T)
  dq = jnp.einsum("bkqs,bksh->bkqh", dscaled.astype(k.dtype), k, preferred_element_type=jnp.float32)
  dk = jnp.einsum("bkqs,bkqh->bksh", dscaled.astype(q.dtype), q, preferred_element_type=jnp.float32)
  dbias = None
  if bias is not None:
    ds = ds.reshape(b, n, t, -1)  # [b, k, (g t), s] -> [b, (k g), t, s]
    dbias = ds.sum(axis=tuple(a for a in range(4) if bias.shape[a] == 1), keepdims=True).astype(bias.dtype)
  to_seq = lambda x: _kv_head_major(x, kv_heads_major)  # back to key's layout (the swap is its own inverse)
  return (_from_head_major(dq, out_grad.shape).astype(q.dtype), to_seq(dk).astype(k.dtype),
          to_seq(dv).astype(v.dtype), None, dbias)


dense_attention.defvjp(_dense_fwd, _dense_bwd)
