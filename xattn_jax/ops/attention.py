"""Scaled dot-product attention: validation, dispatch to dense / chunked / cuDNN, attention weights.

Shapes follow `jax.nn.dot_product_attention`: query [batch, q_len, heads, head_dim], key and value
[batch, kv_len, kv_heads, head_dim] with kv_heads dividing heads (MQA / GQA). Boolean masks
(True = may attend) and biases broadcast to [batch, heads, q_len, kv_len]. `is_causal` aligns the
queries to the LAST q_len keys (see `masks.causal_mask`): with q_len < kv_len these are a decode
step's queries after a cache; `jax.nn.dot_product_attention` aligns them to the first keys instead.
Differentiation is reverse mode: grad and vjp everywhere, grad of grad in "dense", "xla" and
"chunked" (cuDNN's backward has no derivative of its own). The dense and blocked kernels are
`jax.custom_vjp` functions, so forward mode of the forward pass (jvp, jacfwd) raises; use `jax.jacrev`
or `jax.nn.dot_product_attention` for those; `jax.hessian` (forward mode over the hand-written backward)
works where grad of grad does. Scores and softmax run in float32 (a half-precision query is not scaled in its
own dtype where the scale is not exact in it: `scale_on_scores`); a query that may attend to no key returns
zeros with finite gradients, in every implementation; a NaN score (a NaN query or key) makes its query's output
NaN with or without a mask, never zeros.

Implementations:
  "dense":   the whole [q, kv] score matrix as one fused XLA program with a hand-written VJP
             (`dense_attention`): the fastest CPU path for short sequences (training at length 64,
             a decode step's single query), memory quadratic in length.
  "xla":     the one-pass softmax over all keys, sized to the problem. On CPU: "dense" up to
             256 x 256 scores per head; beyond that a loop over (batch, kv head) units and query
             blocks, so the score blocks stay in cache, with a custom VJP that recomputes them
             (`blocked_attention`). On GPU / TPU: "dense" (one fused program, as `jax.nn`'s "xla").
  "chunked": online softmax over key blocks: forward and backward memory linear in length. On CPU
             the units run in a loop (one per thread in each step); on GPU / TPU side by side
             (`Blocking.parallel_units`).
  "cudnn":   `jax.nn.dot_product_attention(implementation="cudnn")` on GPU for bfloat16 / float16
             (`cudnn_unsupported_reason` says when it cannot run). Boolean masks become an additive
             bias there, and causal masks with q_len != kv_len become such masks (cuDNN aligns them
             top-left); rows that see no key are set to zero afterwards, as everywhere. A bias is
             clipped at a quarter of the dtype's range (half precision would overflow to -inf and
             NaN), so a row hidden by a -inf bias alone is not hidden there: it attends to the keys
             its mask leaves it (evenly only where the clipped bias swamps the scores, as bfloat16's
             does): hide keys with `mask`.
  None:      cuDNN when allowed, otherwise "xla", or "chunked" from 4096 x 4096 scores per (batch,
             head) (on CPU from 32768 keys, and causal or GQA attention from 2048 queries and keys)
             (`select_implementation`, `takes_chunked`).

IMPLEMENTATIONS is the one list of names: layers, config validation and messages read it when they check, so
an implementation registered from outside the package (`register_attention_implementation`) counts as a
built-in one (the default choice, None, takes only the built-ins).
"""
from __future__ import annotations

import functools
import math
import os
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from xattn_jax import registry
from xattn_jax.ops import blocked_attention
from xattn_jax.ops import dense_attention
from xattn_jax.ops import masks as masks_lib

# The implementations by name: None for this module's own kernels (dot_product_attention runs them itself), the
# function of one registered with register_attention_implementation.
IMPLEMENTATIONS: dict[str, Callable | None] = {"dense": None, "xla": None, "chunked": None, "cudnn": None}
# Up to this many scores per (batch, head) "xla" runs as one fused program ("dense"): below it the
# blocked kernel's loop costs more than the cache locality it buys (CPU), and cuDNN's fixed costs
# more than its fusion saves (GPU): experiments/results/attention_benchmark.md and _gpu.md.
_FUSED_UP_TO_SCORES = 256 * 256
# Where the default path beyond the fused size takes online softmax ("chunked") instead of one pass
# ("xla"). Off CPU "xla" is one fused program holding every score of a (batch, head), so "chunked" comes
# once those scores reach 4096 x 4096 (64 MiB a head in float32): self-attention from 4096 keys keeps
# bounded memory, while a short query over long keys stays in the faster fused program
# (experiments/results/nvidia_h200/). On CPU both are blocked with bounded temporaries; chunked's
# 256 x 512 score blocks stay in a core's L2 cache at any key count, while xla's query blocks span all
# keys and lean on the shared L3, which costs only from about 32768 keys (the "Long keys" tables of
# experiments/results/*attention_benchmark*.md).
_CHUNKED_FROM_SCORES = 4096 * 4096
_CHUNKED_FROM_KV_LEN_CPU = 32768
# On CPU causal and grouped-query (GQA) self-attention take "chunked" from 2048 queries and keys: its blocks
# skip the key blocks above the diagonal, which xla's query blocks over every key cannot, and its GQA rows ran
# faster too. On the five CPUs measured, chunked ran the 2048 causal + padding rows at 0.52-0.98x torch SDPA's
# forward+backward time against 0.85-1.71x for "xla", the GQA rows at 0.75-1.24x against 0.95-1.65x; at 512
# "xla" led or tied (experiments/results/*/attention_benchmark.md).
_CHUNKED_CAUSAL_OR_GROUPED_FROM_CPU = 2048


def _shape(x) -> list[int]:
  return list(jnp.shape(x))


KV_LAYOUTS = ("bskh", "bksh")
_KV_AXES = {"bskh": "[batch, kv_len, kv_heads, head_dim]", "bksh": "[batch, kv_heads, kv_len, head_dim]"}


def _validate_qkv(query, key, value, kv_layout: str = "bskh", function: str = "dot_product_attention"):
  """Checks ranks, dtypes and shapes (arrays, not lists); returns (kv_len, kv_heads)."""
  if kv_layout not in KV_LAYOUTS:
    raise ValueError(f"{function}: kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
  for name, x in (("query", query), ("key", key), ("value", value)):
    axes = "[batch, length, heads, head_dim]" if name == "query" else _KV_AXES[kv_layout]
    if jnp.ndim(x) != 4:
      raise ValueError(f"{function}: {name} must be rank 4 {axes}, got {name}{_shape(x)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):  # an int query would turn the scale into 0
      raise ValueError(f"{function}: {name} must be floating point, got {x.dtype}{_shape(x)}")
    if 0 in x.shape:
      raise ValueError(f"{function}: {name} {axes} must have no empty dimension, got {name}{_shape(x)}")
  b, _, n, h = query.shape
  s, k = (key.shape[1], key.shape[2]) if kv_layout == "bskh" else (key.shape[2], key.shape[1])
  if key.shape[0] != b or key.shape[3] != h:
    needed = f"[{b}, kv_len, kv_heads, {h}]" if kv_layout == "bskh" else f"[{b}, kv_heads, kv_len, {h}]"
    raise ValueError(f"{function}: key must be {needed} (query's batch and head_dim), got "
                     f"key{_shape(key)} with query{_shape(query)}")
  if n % k:
    raise ValueError(f"{function}: heads={n} of query{_shape(query)} must be divisible by "
                     f"kv_heads={k} of key{_shape(key)}")
  if value.shape != key.shape:
    raise ValueError(f"{function}: value must have key's shape {_shape(key)}, got value{_shape(value)}")
  return s, k


def _validate_scale(scale, head_dim: int, function: str = "dot_product_attention"):
  """head_dim ** -0.5 by default; else a scalar (a float or a 0-d array, traced or not)."""
  if scale is None:
    return head_dim ** -0.5
  # a str failed deep in the kernel ("could not convert string to float") and a bool scaled by 1 or 0
  dtype = getattr(scale, "dtype", None) if not isinstance(scale, (int, float)) else type(scale)
  if isinstance(scale, bool) or dtype is None or not jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(
      dtype, jnp.complexfloating):
    raise ValueError(f"{function}: scale must be a real number, got {scale!r}"[:300])
  if jnp.ndim(scale) != 0:
    raise ValueError(f"{function}: scale must be a scalar, got shape {list(jnp.shape(scale))}")
  return scale


def _validate_is_causal(is_causal, function: str = "dot_product_attention") -> bool:
  """is_causal as a Python bool: it picks the masking at trace time, so a traced value cannot choose it."""
  if isinstance(is_causal, jax.core.Tracer):
    raise ValueError(f"{function}: is_causal must be a Python bool (static under jit), got a traced "
                     f"{is_causal.dtype}{_shape(is_causal)}; mark it static or pass a mask")
  # bool() of anything else guessed: is_causal="no" or a mask given here ran causal attention without a word
  if not isinstance(is_causal, bool) and not (getattr(is_causal, "dtype", None) == np.bool_
                                              and jnp.ndim(is_causal) == 0):
    raise ValueError(f"{function}: is_causal must be True or False, got {is_causal!r}"[:300])
  return bool(is_causal)


def _validate_broadcast(name, x, target, function: str = "dot_product_attention"):
  """x must broadcast to target = [batch, heads, q_len, kv_len]; returns x as rank 4."""
  if x is None:
    return None
  x = jnp.asarray(x)
  if x.ndim > 4 or any(d not in (1, t) for d, t in zip(x.shape[::-1], target[::-1])):
    raise ValueError(f"{function}: {name} must broadcast to [batch, heads, q_len, kv_len]="
                     f"{list(target)}, got {name}{_shape(x)}")
  if name == "mask" and x.dtype != jnp.bool_:
    raise ValueError(f"{function}: mask must be bool (True = may attend), got {x.dtype}{_shape(x)}")
  if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{function}: bias must be floating point, got {x.dtype}{_shape(x)}")
  return x.reshape((1,) * (4 - x.ndim) + x.shape)


def cudnn_unsupported_reason(*, backend: str, dtype, head_dim: int, q_len: int, kv_len: int,
                             has_mask: bool, has_bias: bool, is_causal: bool) -> str | None:
  """Why cuDNN flash attention cannot take this case, or None if it can. Pure: testable on CPU."""
  if backend != "gpu":
    return f"needs a GPU backend, got {backend!r}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"needs bfloat16 or float16 inputs, got {jnp.dtype(dtype)}"
  if head_dim > 128 or head_dim % 8:
    return f"needs head_dim <= 128 and a multiple of 8, got {head_dim}"
  # Masks reach cuDNN as an additive bias (so does a causal mask with q_len != kv_len), and its
  # backward with a bias needs even lengths.
  if (has_mask or has_bias or (is_causal and q_len != kv_len)) and (q_len % 2 or kv_len % 2):
    return f"needs even lengths with a mask or bias, got q_len={q_len}, kv_len={kv_len}"
  return None


def select_implementation(*, backend: str, dtype, head_dim: int, q_len: int, kv_len: int,
                          has_mask: bool = False, has_bias: bool = False, is_causal: bool = False,
                          groups: int = 1) -> str:
  """The implementation `implementation=None` takes for this case (pure function of static facts; groups:
  query heads per kv head).

  cuDNN only above 256 x 256 scores per head: below that the fused XLA program trains faster on an
  H200 (experiments/results/attention_benchmark_gpu.md).
  """
  if q_len * kv_len > _FUSED_UP_TO_SCORES and cudnn_unsupported_reason(
      backend=backend, dtype=dtype, head_dim=head_dim, q_len=q_len, kv_len=kv_len, has_mask=has_mask,
      has_bias=has_bias, is_causal=is_causal) is None:
    return "cudnn"
  if q_len * kv_len > _FUSED_UP_TO_SCORES and takes_chunked(backend, q_len, kv_len, is_causal=is_causal,
                                                              groups=groups):
    return "chunked"
  return "xla"


def takes_chunked(backend: str, q_len: int, kv_len: int, *, is_causal: bool = False, groups: int = 1) -> bool:
  """Whether the default path takes "chunked" over "xla" on this backend (above the fused size): on CPU
  from 32768 keys, and for causal or grouped-query attention (groups > 1 query heads per kv head) from
  2048 queries and keys; elsewhere from 4096 x 4096 scores per (batch, head)."""
  if backend == "cpu":
    return kv_len >= _CHUNKED_FROM_KV_LEN_CPU or (
        (is_causal or groups > 1) and min(q_len, kv_len) >= _CHUNKED_CAUSAL_OR_GROUPED_FROM_CPU)
  return q_len * kv_len >= _CHUNKED_FROM_SCORES


def _runs_fused(implementation: str, backend: str, q_len: int, kv_len: int) -> bool:
  """Whether the case runs as one fused dense program (`dense_attention`)."""
  if implementation == "dense":
    return True
  return implementation == "xla" and (backend != "cpu" or q_len * kv_len <= _FUSED_UP_TO_SCORES)


def usable_cores() -> int:
  """The cores this process may run on (XLA:CPU sizes its thread pool to them)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Scores one CPU loop step holds at most (8 MiB in float32, about what stays in cache): sets the
# query block for "xla" and how many units share a step.
_STEP_SCORES = 2 ** 21
# A CPU backward block of "xla" over a unit's forward block of this many scores or more takes this many query
# rows, all of the unit's query heads counted (see _backward_block_q), on a core with _TUNED_L2_BYTES of L2 cache
# (the Zen 2 EPYC's, where they were measured); both grow with a larger L2, where larger backward blocks run
# faster (experiments/results/intel_xeon_amx/attention_backward_blocks.md).
_BACKWARD_SPLIT_SCORES = 2 ** 20
_BACKWARD_ROWS = 256
_TUNED_L2_BYTES = 512 * 1024
# Units of one block per CPU loop step, at most (see choose_blocking).
_MAX_CHAINS = 8


@functools.cache
def l2_cache_bytes(base: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
  """This CPU's per-core L2 cache in bytes, as Linux's sysfs gives it (`base`: its first core's cache folder);
  _TUNED_L2_BYTES where it cannot be read."""
  units = {"K": 1 << 10, "M": 1 << 20}
  try:
    for index in sorted(os.listdir(base)):
      read = lambda name: open(os.path.join(base, index, name)).read().strip()  # noqa: B023 - read at once
      if index.startswith("index") and read("level") == "2" and read("type") in ("Unified", "Data"):
        size = read("size")  # e.g. "2048K"
        return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
  except (OSError, ValueError):
    pass
  return _TUNED_L2_BYTES


def choose_blocking(implementation: str, q_len: int, kv_len: int, backend: str = "cpu", units: int = 1,
                    threads: int | None = None, groups: int = 1,
                    l2_bytes: int | None = None) -> blocked_attention.Blocking:
  """Block sizes and schedule by length, tuned by measurement on a 2-core CPU (the resulting speeds:
  experiments/results/attention_benchmark.md).

  CPU: "xla" takes query blocks of about _STEP_SCORES scores over all keys, "chunked" 256 x 512
  blocks, and a loop step takes several units while their score blocks stay within _STEP_SCORES.
  GPU / TPU: all units side by side, 512 keys per step. units: batch * kv_heads; threads: CPU
  cores (default: this process's); groups: query heads per kv head (a unit's score block holds
  groups * block_q rows, so GQA takes proportionally fewer query rows per block and units per step);
  l2_bytes: a core's L2 cache (default: this CPU's, `l2_cache_bytes`), which sizes the backward's blocks.
  """
  if backend != "cpu":
    return blocked_attention.Blocking(block_q=q_len, block_k=512, parallel_units=True)
  if implementation == "xla":  # (only beyond _FUSED_UP_TO_SCORES: below, "xla" runs fused)
    # 64 to 1024 rows: fewer rows lose more to per-iteration overhead than they gain in cache. The
    # queries are then split evenly into as many blocks as that size needs (rows rounded up to a
    # multiple of 8), so padding stays small: 1030 queries run as 2 x 520, not 2 x 1024.
    target = 1 << max(6, min(10, max(1, _STEP_SCORES // (kv_len * groups)).bit_length() - 1))
    blocks = math.ceil(q_len / target)
    block_q = q_len if blocks == 1 else math.ceil(math.ceil(q_len / blocks) / 8) * 8
    block_k = kv_len
  else:
    block_q, block_k = 256, 512
  # Units of one block are separate computations that XLA:CPU runs concurrently, so more of them
  # than threads keep the threads busy (at most _MAX_CHAINS: compile time grows with each). Units
  # with block loops are vmapped, one per thread, so that each thread runs whole matmuls instead of
  # a share of each.
  block_q, block_k = min(block_q, q_len), min(block_k, kv_len)
  one_block = block_q == q_len and block_k == kv_len
  limit = min(_MAX_CHAINS if one_block else threads or usable_cores(),
              max(1, _STEP_SCORES // (groups * block_q * block_k)))
  per_step = max(d for d in range(1, limit + 1) if units % d == 0)
  backward_block_q = (_backward_block_q(block_q, block_k, groups, l2_bytes or l2_cache_bytes())
                      if implementation == "xla" else None)
  return blocked_attention.Blocking(block_q=block_q, block_k=block_k, units_per_step=per_step,
                                    backward_block_q=backward_block_q)


def _backward_block_q(block_q: int, block_k: int, groups: int, l2_bytes: int = _TUNED_L2_BYTES) -> int | None:
  """The query rows of a CPU backward block of "xla", or None for the forward's block_q.

  A backward block holds about twice the forward's score-sized temporaries (the scores, the probabilities and
  both their gradients) and runs more matmuls over them. Where one unit's forward block holds
  _BACKWARD_SPLIT_SCORES scores or more, the backward takes blocks of _BACKWARD_ROWS query rows, every query
  head of the unit's group counted: the largest divisor of block_q that is a multiple of 8 and at least half
  that many rows (a block_q with none keeps its own). Smaller units keep their blocks, which run side by side.
  Both sizes are for a core of _TUNED_L2_BYTES of L2 and grow in proportion to a larger one (`l2_bytes`).
  """
  scale = max(1, l2_bytes // _TUNED_L2_BYTES)
  if groups * block_q * block_k < _BACKWARD_SPLIT_SCORES * scale:
    return None
  target = _BACKWARD_ROWS * scale // groups
  rows = [d for d in range(8, target + 1, 8) if block_q % d == 0 and 2 * d >= target]
  return max(rows) if rows and max(rows) < block_q else None


def register_attention_implementation(name: str, fn: Callable, *, replace: bool = False) -> None:
  """Adds `fn` to IMPLEMENTATIONS as `name`: dot_product_attention, the layers and config validation
  (`model.implementation`) take it from then on.

  dot_product_attention validates the arguments, then calls
      fn(query, key, value, *, mask, bias, is_causal, scale) -> [batch, q_len, heads, head_dim] in query's dtype
  with query [batch, q_len, heads, head_dim], key and value [batch, kv_len, kv_heads, head_dim] (heads % kv_heads
  == 0; a kv_layout="bksh" caller's are transposed to this layout first), mask bool (True = may attend) and bias
  float, each None or rank 4 broadcastable to [batch, heads, q_len, kv_len], is_causal a Python bool (query i
  sees keys 0 .. kv_len - q_len + i: the queries are the last keys) and scale a scalar (head_dim ** -0.5 unless
  given). A query that may attend to no key should get zeros, as in the built-ins. Register it before the config
  is validated: a run of launch.py registers it from a module its config file imports.
  ValueError for a name that is not a non-empty str, or is registered already (unless replace; a built-in
  kernel's name even then), or an fn that is not callable.
  """
  registry.check_new_name("register_attention_implementation", IMPLEMENTATIONS, name, replace=replace)
  if name in IMPLEMENTATIONS and IMPLEMENTATIONS[name] is None:  # the default choice would still run the kernel
    raise ValueError(f"register_attention_implementation: {name!r} is a built-in kernel, which replace=True does "
                     "not override; register the function under a name of its own")
  if not callable(fn):
    raise ValueError(f"register_attention_implementation: fn must be callable, got {type(fn).__name__}")
  registry.add("register_attention_implementation", IMPLEMENTATIONS, name, fn)


def check_implementation(implementation, function: str = "dot_product_attention") -> None:
  """ValueError (from `function`) unless implementation is None or a name in IMPLEMENTATIONS (read when called)."""
  if implementation not in (None, *IMPLEMENTATIONS):
    raise ValueError(f"{function}: implementation must be None or one of {list(IMPLEMENTATIONS)}, "
                     f"got implementation={implementation!r}")


def _run_registered(implementation: str, fn: Callable, query, key, value, mask, bias, is_causal: bool, scale,
                    kv_layout: str):
  """A registered implementation's output for validated arguments; ValueError unless it is query's shape and dtype."""
  if kv_layout == "bksh":  # registered functions take the jax.nn layout
    key, value = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
  out = fn(query, key, value, mask=mask, bias=bias, is_causal=is_causal, scale=scale)
  if jnp.shape(out) != query.shape or getattr(out, "dtype", None) != query.dtype:
    raise ValueError(f"dot_product_attention: implementation {implementation!r} must return query's "
                     f"{query.dtype}{_shape(query)} [batch, q_len, heads, head_dim], got "
                     f"{getattr(out, 'dtype', type(out).__name__)}{_shape(out)}")
  return out


def dot_product_attention(query, key, value, *, bias=None, mask=None, is_causal=False, scale=None,
                          implementation=None, kv_layout: str = "bskh"):
  """softmax(query key^T * scale + bias, masked) value.

  Args:
    query: [batch, q_len, heads, head_dim].
    key, value: [batch, kv_len, kv_heads, head_dim]; heads % kv_heads == 0.
    bias: float, broadcastable to [batch, heads, q_len, kv_len], added to the scaled scores.
    mask: bool, broadcastable to [batch, heads, q_len, kv_len]; True = may attend.
    is_causal: a bool (static under jit); True: query i may attend to keys 0 .. kv_len - q_len + i (queries
      are the last keys).
    scale: score scale, a real number or a 0-d array (traced or not); default head_dim ** -0.5.
    implementation: None, "dense", "xla", "chunked", "cudnn" (see the module docstring) or a name registered
      with register_attention_implementation.
    kv_layout: "bskh" (key / value [batch, kv_len, kv_heads, head_dim], as jax.nn) or "bksh"
      ([batch, kv_heads, kv_len, head_dim]: the layout a decode cache should keep, so that a step
      never transposes the whole cache).
  Returns:
    [batch, q_len, heads, head_dim] in query's dtype.
  """
  query, key, value = (jnp.asarray(x) for x in (query, key, value))
  s, kv_heads = _validate_qkv(query, key, value, kv_layout)
  b, t, n, h = query.shape
  target = (b, n, t, s)
  mask = _validate_broadcast("mask", mask, target)
  bias = _validate_broadcast("bias", bias, target)
  check_implementation(implementation)
  scale = _validate_scale(scale, h)
  is_causal = _validate_is_causal(is_causal)
  if implementation is not None and IMPLEMENTATIONS[implementation] is not None:
    return _run_registered(implementation, IMPLEMENTATIONS[implementation], query, key, value, mask, bias,
                           is_causal, scale, kv_layout)
  facts = dict(dtype=query.dtype, head_dim=h, q_len=t, kv_len=s, has_mask=mask is not None,
               has_bias=bias is not None, is_causal=is_causal)
  backend = jax.default_backend()
  if implementation is None:
    implementation = select_implementation(backend=backend, groups=n // kv_heads, **facts)
  if _runs_fused(implementation, backend, t, s):
    if scale_on_scores(query.dtype, scale):
      return dense_attention.dense_attention(query, key, value, mask, bias, is_causal, kv_layout == "bksh",
                                             float(scale))
    # Scaling the queries once is cheaper than scaling every score (autodiff applies it to dq).
    query = query * jnp.asarray(scale, query.dtype)
    return dense_attention.dense_attention(query, key, value, mask, bias, is_causal, kv_layout == "bksh")
  if implementation == "cudnn":
    reason = cudnn_unsupported_reason(backend=backend, **facts)
    if reason is not None:
      raise ValueError(f"dot_product_attention: implementation='cudnn' {reason}")
    if kv_layout == "bksh":  # cuDNN takes the jax.nn layout
      key, value = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
    return _cudnn_attention(query, key, value, mask, bias, scale, is_causal)
  if isinstance(scale, (int, float, np.floating)):  # a number: each block's rows are scaled in the kernel
    scale = float(scale)
  else:  # a traced (or array) scale keeps its gradient: scale the queries first
    query, scale = query * jnp.asarray(scale, query.dtype), 1.0
  return blocked_attention.blocked_attention(
      query, key, value, mask=mask, bias=bias, is_causal=is_causal,
      blocking=choose_blocking(implementation, t, s, backend, units=b * kv_heads, groups=n // kv_heads),
      kv_heads_major=kv_layout == "bksh",
      scale=scale, scale_scores=scale_on_scores(query.dtype, scale))


def scale_on_scores(dtype, scale) -> bool:
  """Whether the scale multiplies the float32 scores rather than the queries (of `dtype`): for half-precision queries and
  a number that their dtype cannot hold exactly (head_dim not a power of 4), whose scaled copy would round
  every score once more (at scores ~60, bfloat16 outputs ten times their own rounding off). float32 queries
  are scaled as they are; a traced scale scales them in any dtype."""
  return (jnp.dtype(dtype).itemsize < 4 and isinstance(scale, (int, float, np.floating))
          and float(np.asarray(scale, jnp.dtype(dtype))) != float(scale))


def _cudnn_attention(query, key, value, mask, bias, scale, is_causal: bool):
  """cuDNN flash attention with this module's mask semantics (inputs validated, mask / bias rank 4)."""
  b, t, n, _ = query.shape
  s = key.shape[1]
  if is_causal and t != s:  # cuDNN aligns causal masks top-left; ours put the queries last
    mask, is_causal = masks_lib.combine_masks(mask, masks_lib.causal_mask(t, s)), False
  # cuDNN takes a bias (a mask becomes one) only at the full [q_len, kv_len].
  full = lambda x: None if x is None else jnp.broadcast_to(x, (*x.shape[:2], t, s))
  if bias is not None:
    # In half precision a large negative bias plus cuDNN's mask value (-0.7 x the dtype's max)
    # would overflow to -inf, and a row of -inf gives NaN there; a quarter of the range is already
    # "never" for the softmax.
    bias = jnp.maximum(bias, jnp.finfo(query.dtype).min / 4).astype(query.dtype)
  mask, bias = full(mask), full(bias)
  out = jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask, scale=scale,
                                     is_causal=is_causal, implementation="cudnn")
  if mask is None:
    return out
  # A row whose keys are all masked (causal included) gets a uniform softmax there; here it
  # returns zeros.
  visible = masks_lib.combine_masks(mask, masks_lib.causal_mask(t, s)) if is_causal else mask
  seen = jnp.broadcast_to(jnp.any(visible, axis=-1), (b, n, t)).transpose(0, 2, 1)[..., None]
  return jnp.where(seen, out, jnp.zeros((), out.dtype))


def attention_weights(query, key, *, bias=None, mask=None, is_causal=False, scale=None):
  """Softmax probabilities [batch, heads, q_len, kv_len] in float32 (dense; for plots and probes).

  Rows whose keys are all masked are zero. Arguments as in `dot_product_attention`.
  """
  query, key = jnp.asarray(query), jnp.asarray(key)
  where = dict(function="attention_weights")  # the errors name the function the caller called
  _validate_qkv(query, key, key, **where)
  b, t, n, h = query.shape
  s = key.shape[1]
  mask = _validate_broadcast("mask", mask, (b, n, t, s), **where)
  bias = _validate_broadcast("bias", bias, (b, n, t, s), **where)
  scale = _validate_scale(scale, h, **where)
  is_causal = _validate_is_causal(is_causal, **where)
  if scale_on_scores(query.dtype, scale):
    return dense_attention.probabilities(query, key, mask, bias, is_causal, float(scale))
  query = query * jnp.asarray(scale, query.dtype)
  return dense_attention.probabilities(query, key, mask, bias, is_causal)
