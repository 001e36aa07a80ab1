"""Test helpers for attention: a plain reference written without the library, inputs and mask cases."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax.ops import attention, blocked_attention, masks

Blocking = blocked_attention.Blocking


def reference_attention(query, key, value, bias=None, mask=None, is_causal=False, scale=None, xp=jnp):
  """softmax(query key^T * scale + bias, masked) value, written out with einsum and exp.

  xp=np computes in float64 (the forward oracle); xp=jnp in float32, differentiable to any order
  (the gradient oracle). Causal masking is built here from positions, not by `masks`: query i
  sits at key position kv_len - q_len + i. A query that may attend to no key gives zeros.
  """
  dtype = np.float64 if xp is np else jnp.float32
  query, key, value = (xp.asarray(x).astype(dtype) for x in (query, key, value))
  b, t, n, h = query.shape
  s, kv_heads = key.shape[1], key.shape[2]
  key = xp.repeat(key, n // kv_heads, axis=2)  # [b, s, n, h]
  value = xp.repeat(value, n // kv_heads, axis=2)
  scale = h ** -0.5 if scale is None else scale
  scores = xp.einsum("btnh,bsnh->bnts", query, key) * scale
  if bias is not None:
    scores = scores + xp.asarray(bias).astype(dtype)
  visible = xp.ones((b, n, t, s), bool)
  if mask is not None:
    visible = visible & xp.asarray(mask)
  if is_causal:
    visible = visible & (xp.arange(s)[None, :] <= s - t + xp.arange(t)[:, None])
  scores = xp.where(visible, scores, -np.inf)
  row_max = scores.max(axis=-1, keepdims=True)
  row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
  if xp is jnp:  # the softmax does not depend on the shift, so no derivative flows through it (a fully
    row_max = jax.lax.stop_gradient(row_max)  # masked row's -inf max would make 0 * inf = NaN there)
  weights = xp.exp(scores - row_max)
  row_sum = weights.sum(axis=-1, keepdims=True)
  weights = xp.where(row_sum > 0, weights / xp.where(row_sum > 0, row_sum, 1.0), 0.0)
  return xp.einsum("bnts,bsnh->btnh", weights, value)


# How each variant of attention runs the small test shapes (`attend_as`). "xla" and "chunked" would
# run them fused ("dense") or in one block; these blockings send them through the blocked kernel
# with several query blocks of 4 rows (the last one padded) and, for "chunked", several key blocks
# of 8 (the last one padded, causal blocks above the diagonal skipped). The rest are the kernel's
# other schedules: all units vmapped (GPU / TPU), two vmapped units per loop step (CPU, units with
# block loops), four single-block units per step, and the one-pass kernel without block loops.
BLOCKINGS = {
    "dense": None,
    "xla": lambda s, units: Blocking(block_q=4, block_k=s),
    "chunked": lambda s, units: Blocking(block_q=4, block_k=8),
    "cudnn": None,
    "chunked_parallel_units": lambda s, units: Blocking(block_q=4, block_k=8, parallel_units=True),
    "chunked_2_units_per_step": lambda s, units: Blocking(block_q=4, block_k=8, units_per_step=math.gcd(2, units)),
    "xla_4_units_per_step": lambda s, units: Blocking(block_q=1024, block_k=s, units_per_step=math.gcd(4, units)),
    "xla_one_block": lambda s, units: Blocking(block_q=1024, block_k=s),
    # CPU "xla" past 256 x 256 scores: query blocks over all keys, the backward in blocks of its own
    "xla_backward_blocks": lambda s, units: Blocking(block_q=4, block_k=s, backward_block_q=2),
}


def attend_as(variant, monkeypatch):
  """dot_product_attention(q, k, v, **kwargs) as `variant` (a key of BLOCKINGS) runs it."""
  implementation = variant.split("_")[0]
  blocking = BLOCKINGS[variant]
  if blocking is not None:
    monkeypatch.setattr(attention, "_runs_fused", lambda implementation, *_: implementation == "dense")
    monkeypatch.setattr(attention, "choose_blocking",
                        lambda impl, t, s, backend="cpu", units=1, **_: blocking(s, units))
  return functools.partial(attention.dot_product_attention, implementation=implementation)


def random_inputs(seed, b=2, t=6, s=11, heads=4, kv_heads=2, h=8, dtype=jnp.float32):
  """query [b, t, heads, h], key and value [b, s, kv_heads, h] (grouped queries by default), and the rng."""
  rng = np.random.default_rng(seed)
  query = jnp.asarray(rng.normal(size=(b, t, heads, h)), dtype)
  key = jnp.asarray(rng.normal(size=(b, s, kv_heads, h)), dtype)
  value = jnp.asarray(rng.normal(size=(b, s, kv_heads, h)), dtype)
  return query, key, value, rng


# Masking kinds of `make_case`. Every shape is small: 2 batch, 4 query heads over 2 kv heads, 6
# queries, 11 keys unless the kind says otherwise.
KINDS = ["none", "bool_mask", "key_padding", "segments", "causal", "bias", "bias_mask_causal"]
MORE_KINDS = ["causal_decode", "causal_more_queries_than_keys", "causal_cache_offsets", "multi_query",
              "multi_head"]


def make_case(kind, seed, **shape):
  """(query, key, value, kwargs) for one masking kind (KINDS or MORE_KINDS)."""
  if kind == "causal_decode":  # one decode step: a query after 10 cached keys
    shape = {"t": 1, "s": 11, **shape}
  elif kind == "causal_more_queries_than_keys":  # the first 3 queries precede every key: zeros
    shape = {"t": 9, "s": 6, **shape}
  elif kind == "multi_query":  # all 4 heads share one kv head
    shape = {"kv_heads": 1, **shape}
  elif kind == "multi_head":  # one kv head per head
    shape = {"kv_heads": 4, **shape}
  query, key, value, rng = random_inputs(seed, **shape)
  b, t, n, _ = query.shape
  s = key.shape[1]
  kwargs = {}
  if kind == "bool_mask":
    mask = rng.random((b, n, t, s)) > 0.4
    mask[0, 0, 0] = False  # one query that sees nothing
    kwargs["mask"] = jnp.asarray(mask)
  elif kind == "key_padding":
    kwargs["mask"] = masks.padding_mask(jnp.asarray([s - 3, 0][:b]), kv_len=s)  # second batch: all padding
  elif kind == "segments":
    q_ids = jnp.asarray(np.sort(rng.integers(0, 3, size=(b, t)), axis=1))
    k_ids = jnp.asarray(np.sort(rng.integers(0, 3, size=(b, s)), axis=1))
    kwargs["mask"] = masks.segment_mask(q_ids, k_ids)
  elif kind == "causal":  # q_len == kv_len
    key, value = key[:, :t], value[:, :t]
    kwargs["is_causal"] = True
  elif kind in ("causal_decode", "causal_more_queries_than_keys", "multi_query"):
    kwargs["is_causal"] = True
  elif kind == "causal_cache_offsets":  # per-sequence cache fill: query i of item b sees keys <= offsets[b] + i
    kwargs["mask"] = masks.causal_mask(t, s, offset=jnp.asarray([0, s - t][:b]))
  elif kind == "bias":
    kwargs["bias"] = jnp.asarray(rng.normal(size=(1, n, t, s)), jnp.float32)
  elif kind == "bias_mask_causal":
    kwargs["bias"] = jnp.asarray(rng.normal(size=(b, 1, 1, s)), jnp.float32)
    kwargs["mask"] = jnp.asarray(rng.random((b, 1, t, s)) > 0.3)
    kwargs["is_causal"] = True
  elif kind == "multi_head":
    kwargs["bias"] = jnp.asarray(rng.normal(size=(b, n, 1, s)), jnp.float32)
  elif kind != "none":
    raise ValueError(f"make_case: unknown kind {kind!r}")
  return query, key, value, kwargs


def output_and_grads(fn, query, key, value, kwargs, cotangent):
  """fn's output and the gradients of <output, cotangent> w.r.t. query, key, value and bias (or None).

  One jitted function per call, so forward and backward compile together (test speed). A new one
  each time: fn's behaviour may depend on monkeypatched dispatch, which a jit cache would not see.
  """
  bias = kwargs.get("bias")
  rest = {k: v for k, v in kwargs.items() if k != "bias"}

  @jax.jit
  def run(q, k, v, bias, cotangent):
    def loss(q, k, v, bias):
      out = fn(q, k, v, bias=bias, **rest)
      return jnp.sum(out.astype(jnp.float32) * cotangent), out
    grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
    return out, grads

  return run(query, key, value, bias, cotangent)


@functools.partial(jax.jit, static_argnames=("is_causal",))
def _reference_output_and_grads(query, key, value, bias, mask, cotangent, is_causal):
  def loss(q, k, v, bias):
    out = reference_attention(q, k, v, bias=bias, mask=mask, is_causal=is_causal)
    return jnp.sum(out * cotangent), out
  grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(query, key, value, bias)
  return out, grads


def reference_output_and_grads(query, key, value, kwargs, cotangent):
  """output_and_grads(reference_attention, ...), compiled once per shape for the whole session."""
  return _reference_output_and_grads(query, key, value, kwargs.get("bias"), kwargs.get("mask"), cotangent,
                                     is_causal=kwargs.get("is_causal", False))
