"""Multi-head attention as a Flax NNX module, with caches passed in and out as explicit values.

One module serves self-attention (`x_kv` is None) and cross-attention (a query stream of width
`in_features` reading a key/value stream of width `kv_features`, as torch's kdim / vdim). All
passes go through the same two halves:

  project_memory(x_kv)        -> MemoryCache(keys, values)     [batch, kv_heads, kv_len, head_dim]
  attend(x_q, memory_cache)   -> out                           [batch, q_len, out_features]

`__call__` is exactly `attend(x_q, project_memory(x_kv))`; a decoder projects the encoder memory
once and reuses the MemoryCache for every step. Self-attention decoding keeps a `KVCache` of
fixed capacity that `extend` fills with `lax.dynamic_update_slice` (a prompt of any length, or one
token at a time) and returns advanced, so a step is a pure function (tokens, cache) -> (out, cache).
Both caches keep keys / values heads-major, [batch, kv_heads, length, head_dim]: the attention
kernel reads them without transposing the whole cache at every step (`kv_layout="bksh"`).

Parameters carry logical axis names (`nnx.with_partitioning`, not sharded eagerly, so the module
builds anywhere); the training code maps the names to mesh axes:
  query kernel [in_features, heads * head_dim]         ("embed", "heads")
  key / value kernels [kv_features, kv_heads * head_dim] ("embed", "kv")  -- kv heads may not split
  output kernel [heads * head_dim, out_features]       ("heads", "embed")
"""
from __future__ import annotations

import re

import chex
import einops
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xattn_jax.layers import dense
from xattn_jax.layers.rotary import RotarySpec
from xattn_jax.ops import attention as attention_ops
from xattn_jax.ops import masks as masks_lib


def write_head(full: jax.Array, head: jax.Array, axis: int) -> jax.Array:
  """`full` with its first positions along `axis` (negative counts from the end) replaced by `head`'s: a cache
  leaf cut by `head(n)` and decoded further, written back (`with_head`)."""
  return jax.lax.dynamic_update_slice_in_dim(full, head.astype(full.dtype), 0, axis % full.ndim)


def decode_room(capacity: int, filled) -> int:
  """How many more positions a cache of `capacity` slots, the first `filled` in use, takes: its capacity while
  `filled` is traced (a decode's check of max_length, `decoding._check_common`)."""
  if isinstance(filled, jax.core.Tracer):
    return capacity
  return capacity - int(filled)


@flax.struct.dataclass
class KVCache:
  """Self-attention cache: the first `index` rows of keys / values are filled.

  keys, values: [batch, kv_heads, max_length, head_dim]; index: int32 scalar.
  A pytree, so caches of several layers can be stacked and carried through jit / scan.

  Beam layout (`expand_beams`): values [batch, kv_heads, max_length * beams, head_dim], row
  t * beams + i holding position t of beam slot i; keys the same rows transposed, [batch, kv_heads,
  head_dim, max_length * beams] (one example's beams are few queries against many rows: the
  score matmul runs several times faster with the rows minor); and ancestry int32 [batch, beams,
  max_length]: the slot whose row holds position t of beam j's history. A beam search then reorders
  its beams by rewriting the ancestry (`reorder_beams`) instead of copying whole caches, and `extend`
  attends each beam to its own history through a mask over its example's slots.
  """
  keys: jax.Array
  values: jax.Array
  index: jax.Array
  ancestry: jax.Array | None = None

  @property
  def max_length(self) -> int:
    """The capacity: how many rows (positions per beam, in the beam layout) the cache can hold."""
    if self.ancestry is None:
      return self.keys.shape[-2]
    return self.ancestry.shape[-1]

  def head(self, n: int) -> KVCache:
    """The cache of its first n positions (rows, or n * beams slots in the beam layout): a smaller cache
    that attention reads in less time, for as long as the fill stays below n (`decoding`'s first half)."""
    if not isinstance(n, (int, np.integer)) or not 0 < n <= self.max_length:
      raise ValueError(f"KVCache.head: n must be an int in [1, {self.max_length}] (the capacity), got n={n!r}")
    if self.ancestry is None:
      return self.replace(keys=self.keys[..., :n, :], values=self.values[..., :n, :])
    slots = n * self.ancestry.shape[-2]
    return self.replace(keys=self.keys[..., :slots], values=self.values[..., :slots, :],
                        ancestry=self.ancestry[..., :n])

  def with_head(self, head: KVCache) -> KVCache:
    """This cache with its first positions, fill index (and ancestry) those of `head`, a `head(n)` of it
    decoded further."""
    if (head.ancestry is None) != (self.ancestry is None) or head.max_length > self.max_length:
      raise ValueError(f"KVCache.with_head: head must be a head(n) of this cache (capacity {self.max_length}, "
                       f"{'beam' if self.ancestry is not None else 'plain'} layout), got capacity {head.max_length} "
                       f"in the {'beam' if head.ancestry is not None else 'plain'} layout")
    if self.ancestry is None:
      return head.replace(keys=write_head(self.keys, head.keys, -2), values=write_head(self.values, head.values, -2))
    return head.replace(keys=write_head(self.keys, head.keys, -1), values=write_head(self.values, head.values, -2),
                        ancestry=write_head(self.ancestry, head.ancestry, -1))

  def expand_beams(self, beam_size: int) -> KVCache:
    """This cache in the beam layout: every example's filled rows copied to beam_size slots."""
    if self.ancestry is not None:
      raise ValueError("KVCache.expand_beams: the cache is already in the beam layout")
    _check_positive_int("beam_size", beam_size, "KVCache.expand_beams")  # 0 beams made an empty beam cache
    batch, _, capacity, _ = self.keys.shape
    slots = lambda x: jnp.repeat(x, beam_size, axis=2)  # -> [batch, kv_heads, capacity * beams, head_dim]
    own = jnp.broadcast_to(jnp.arange(beam_size, dtype=jnp.int32)[:, None], (batch, beam_size, capacity))
    return KVCache(keys=slots(self.keys).transpose(0, 1, 3, 2), values=slots(self.values), index=self.index,
                   ancestry=own)

  def reorder_beams(self, parent) -> KVCache:
    """Beam j continues beam parent[b, j] (int [batch, beams]): it inherits that beam's history up to
    the fill index, and its own slot holds the positions still to come. Keys / values stay in place."""
    if self.ancestry is None:
      raise ValueError("KVCache.reorder_beams: the cache is not in the beam layout (expand_beams)")
    batch, beams, capacity = self.ancestry.shape
    parent = jnp.asarray(parent)
    if parent.shape != (batch, beams) or not jnp.issubdtype(parent.dtype, jnp.integer):
      raise ValueError(f"KVCache.reorder_beams: parent must be int [{batch}, {beams}], got "
                       f"{parent.dtype}{list(parent.shape)}")
    inherited = jnp.take_along_axis(self.ancestry, parent[:, :, None].astype(jnp.int32), axis=1)
    own = jnp.arange(beams, dtype=jnp.int32)[:, None]
    filled = jnp.arange(capacity) < self.index
    return self.replace(ancestry=jnp.where(filled, inherited, own))


@flax.struct.dataclass
class MemoryCache:
  """Cross-attention cache: a memory's projected keys and values, [batch, kv_heads, kv_len, head_dim].

  With keys_transposed the keys are [batch, kv_heads, head_dim, kv_len] (`transpose_keys`): the layout
  in which a few queries per memory row (a beam search's beams of one source) score several times
  faster on CPU.
  """
  keys: jax.Array
  values: jax.Array
  keys_transposed: bool = flax.struct.field(pytree_node=False, default=False)

  def transpose_keys(self) -> MemoryCache:
    """The same cache with keys [batch, kv_heads, head_dim, kv_len]."""
    if self.keys_transposed:
      return self
    return MemoryCache(keys=self.keys.transpose(0, 1, 3, 2), values=self.values, keys_transposed=True)


def _check_features(name: str, x, features: int) -> None:
  if x.ndim != 3 or x.shape[-1] != features:
    raise ValueError(f"MultiHeadAttention: {name} must be [batch, length, {features}], got {name}{list(x.shape)}")


# extend's positions argument, as its errors name it
EXTEND_NAMES = dict(name="positions", where="MultiHeadAttention.extend")


def _check_positive_int(name: str, value, where: str = "MultiHeadAttention") -> None:
  """A size argument: a Python or numpy integer (not a bool) above 0."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{where}: {name} must be a positive int, got {name}={value!r}")


class MaskBiasError(ValueError):
  """A mask or bias that does not fit the attention: `argument` ("mask" or "bias") is the layer's name for it,
  so a block that passed its own argument (a DecoderBlock's self_mask) can say so with `renamed`."""

  def __init__(self, where: str, argument: str, complaint: str):
    super().__init__(f"{where}: {complaint}")
    self.argument, self.complaint = argument, complaint

  def renamed(self, where: str, argument: str) -> MaskBiasError:
    """The same complaint from `where`, about its argument of that name."""
    return MaskBiasError(where, argument, re.sub(rf"\b{self.argument}\b", argument, self.complaint))


def _check_broadcastable(name: str, array, target: tuple[int, ...], method: str = "__call__"):
  """array (rank <= 4, numpy broadcasting from the right) as rank 4 broadcasting to target =
  (batch, heads, q_len, kv_len); raises MaskBiasError naming the method and the shapes otherwise."""
  array = jnp.asarray(array)
  where = "MultiHeadAttention" if method == "__call__" else f"MultiHeadAttention.{method}"
  kv_len = "kv_len" if method == "__call__" else "max_length"
  ok = array.ndim <= 4 and all(a in (1, t) for a, t in zip(array.shape[::-1], target[::-1]))
  if not ok:
    raise MaskBiasError(where, name, f"{name} must broadcast to [batch, heads, q_len, {kv_len}] = {list(target)}, "
                                     f"got {name}{list(array.shape)}")
  if name == "mask" and array.dtype != jnp.bool_:
    raise MaskBiasError(where, name, f"mask must be boolean (True = may attend), got dtype {array.dtype}")
  if name == "bias" and not jnp.issubdtype(array.dtype, jnp.floating):  # else the op named itself and a rank-4 copy
    raise MaskBiasError(where, name, f"bias must be floating point, got dtype {array.dtype}")
  return array.reshape((1,) * (4 - array.ndim) + array.shape)


def _swap_length_and_heads(x):
  """[b, s, k, h] <-> [b, k, s, h] (the caches' heads-major layout); its own inverse."""
  return x.transpose(0, 2, 1, 3)


def _is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


class MultiHeadAttention(nnx.Module):
  """Multi-head (and grouped-query) attention: softmax(q k^T / sqrt(head_dim) + bias, mask) v.

  Args:
    num_heads: query heads.
    in_features: width of the query input x_q.
    kv_features: width of the key/value input x_kv; None = in_features (self-attention).
    num_kv_heads: key/value heads (GQA / MQA); must divide num_heads. None = num_heads.
    head_dim: per-head width; None = in_features // num_heads.
    out_features: output width; None = in_features.
    use_bias: biases on the four projections.
    dropout_rate: dropout on the attention probabilities when not deterministic (this pass then
      materializes the [b, heads, q, kv] weights instead of calling the fused op).
    rotary: a RotarySpec applied to q and k from explicit positions, or None.
    implementation: passed to `ops.attention.dot_product_attention` (None = its default choice).
    dtype: compute dtype; param_dtype: storage dtype of the parameters.
  """

  def __init__(self, num_heads: int, in_features: int, kv_features: int | None = None, *,
               num_kv_heads: int | None = None, head_dim: int | None = None, out_features: int | None = None,
               use_bias: bool = True, dropout_rate: float = 0.0, rotary: RotarySpec | None = None,
               implementation: str | None = None, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    kv_features = in_features if kv_features is None else kv_features
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    out_features = in_features if out_features is None else out_features
    for name, value in (("num_heads", num_heads), ("in_features", in_features), ("kv_features", kv_features),
                        ("num_kv_heads", num_kv_heads), ("out_features", out_features)):
      _check_positive_int(name, value)
    if num_heads % num_kv_heads:
      raise ValueError(
          f"MultiHeadAttention: num_heads must be divisible by num_kv_heads, got num_heads={num_heads}, "
          f"num_kv_heads={num_kv_heads}")
    if head_dim is None:
      if in_features % num_heads:
        raise ValueError(
            f"MultiHeadAttention: in_features must be divisible by num_heads when head_dim is None, got "
            f"in_features={in_features}, num_heads={num_heads}")
      head_dim = in_features // num_heads
    _check_positive_int("head_dim", head_dim)
    num_heads, num_kv_heads, head_dim = int(num_heads), int(num_kv_heads), int(head_dim)
    in_features, kv_features, out_features = int(in_features), int(kv_features), int(out_features)
    if not 0.0 <= dropout_rate < 1.0:
      raise ValueError(f"MultiHeadAttention: dropout_rate must be in [0, 1), got dropout_rate={dropout_rate}")
    if rotary is not None:
      rotary.check_head_dim(head_dim)
    attention_ops.check_implementation(implementation, "MultiHeadAttention")

    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.in_features, self.kv_features, self.out_features = in_features, kv_features, out_features
    self.dropout_rate, self.rotary, self.implementation, self.dtype = dropout_rate, rotary, implementation, dtype

    def linear(fan_in, fan_out, axes):
      return dense.Dense(
          fan_in, fan_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
          kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), axes, eager_sharding=False),
          bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axes[1:], eager_sharding=False),
          rngs=rngs)

    self.query = linear(in_features, num_heads * head_dim, ("embed", "heads"))
    self.key = linear(kv_features, num_kv_heads * head_dim, ("embed", "kv"))
    self.value = linear(kv_features, num_kv_heads * head_dim, ("embed", "kv"))
    self.out = linear(num_heads * head_dim, out_features, ("heads", "embed"))
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  # --- projections ---------------------------------------------------------------------------

  def _default_positions(self, name: str, positions, batch: int, length: int, start=0, where="MultiHeadAttention"):
    """Positions for the rotary spec: given ones, or start + arange(length) for 1D RoPE."""
    if self.rotary is None and positions is not None:  # nothing would read them
      raise ValueError(f"{where}: {name} given to an attention without a rotary encoding (rotary=None), which "
                       f"cannot use them; pass {name}=None, or build the layer with a RotarySpec")
    if self.rotary is None or positions is not None:
      return positions
    if self.rotary.kind != "rope":
      raise ValueError(
          f"{where}: rotary kind {self.rotary.kind!r} needs explicit {name} "
          f"({'[batch, length, 2]' if self.rotary.kind == 'rope_2d' else '[3, batch, length]'}), got None")
    return jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32), (batch, length))

  def _split_heads(self, x, num_heads: int, positions, name: str, where: str):
    x = einops.rearrange(x, "b t (n h) -> b t n h", n=num_heads)
    if self.rotary is not None:
      try:
        x = self.rotary.apply(x, positions)
      except ValueError as error:  # the op names its own argument; say which of the layer's it was
        raise ValueError(f"{where}: {name} do not fit the [batch, length] = {list(x.shape[:2])} they rotate: "
                         f"{error}") from error
    return x

  def _project_query(self, x_q, query_positions, start=0, name="query_positions", where="MultiHeadAttention"):
    """x_q [b, t, in_features] -> q [b, t, heads, head_dim], rotated if the layer is rotary."""
    _check_features("x_q", x_q, self.in_features)
    positions = self._default_positions(name, query_positions, x_q.shape[0], x_q.shape[1], start, where)
    return self._split_heads(self.query(x_q), self.num_heads, positions, name, where)

  def _project_key_value(self, x_kv, key_positions, start=0, name="key_positions", where="MultiHeadAttention"):
    """x_kv [b, s, kv_features] -> keys, values [b, s, kv_heads, head_dim] (keys rotated if rotary)."""
    _check_features("x_kv", x_kv, self.kv_features)
    positions = self._default_positions(name, key_positions, x_kv.shape[0], x_kv.shape[1], start, where)
    keys = self._split_heads(self.key(x_kv), self.num_kv_heads, positions, name, where)
    values = einops.rearrange(self.value(x_kv), "b s (k h) -> b s k h", k=self.num_kv_heads)
    return keys, values

  # --- the attention itself -------------------------------------------------------------------

  def _check_mask_bias(self, q, keys, mask, bias):
    """keys are heads-major [b, kv_heads, s, h]; returns mask and bias as rank 4 (or None)."""
    target = (q.shape[0], self.num_heads, q.shape[1], keys.shape[2])
    if mask is not None:
      mask = _check_broadcastable("mask", mask, target)
    if bias is not None:
      bias = _check_broadcastable("bias", bias, target)
    if keys.shape[0] != q.shape[0]:
      raise ValueError(f"MultiHeadAttention: memory batch {keys.shape[0]} differs from x_q batch {q.shape[0]}")
    return mask, bias

  def _attend_heads(self, q, keys, values, *, mask, bias, is_causal, deterministic):
    """q [b, t, n, h], keys / values heads-major [b, k, s, h] -> [b, t, out_features]."""
    mask, bias = self._check_mask_bias(q, keys, mask, bias)
    if self.dropout_rate > 0.0 and not deterministic:
      # Dropout acts on the probabilities, so this pass needs them explicitly.
      weights = attention_ops.attention_weights(q, _swap_length_and_heads(keys), bias=bias, mask=mask,
                                                is_causal=is_causal)
      weights = self.dropout(weights, deterministic=False).astype(values.dtype)
      weights = einops.rearrange(weights, "b (k g) t s -> b k g t s", k=self.num_kv_heads)
      heads = jnp.einsum("bkgts,bksh->btkgh", weights, values)
      heads = einops.rearrange(heads, "b t k g h -> b t (k g) h")
    else:
      heads = attention_ops.dot_product_attention(
          q, keys, values, bias=bias, mask=mask, is_causal=is_causal, implementation=self.implementation,
          kv_layout="bksh")
    chex.assert_shape(heads, (q.shape[0], q.shape[1], self.num_heads, self.head_dim))
    return self.out(einops.rearrange(heads, "b t n h -> b t (n h)"))

  # --- public passes --------------------------------------------------------------------------

  def project_memory(self, x_kv, *, key_positions=None) -> MemoryCache:
    """Projects a memory x_kv [b, s, kv_features] once into its keys and values."""
    return self._memory(x_kv, key_positions)

  def _memory(self, x_kv, key_positions, name="key_positions") -> MemoryCache:
    keys, values = self._project_key_value(x_kv, key_positions, name=name)
    return MemoryCache(keys=_swap_length_and_heads(keys), values=_swap_length_and_heads(values))

  def _own_memory(self, x_q, x_kv, query_positions, key_positions) -> MemoryCache:
    """The memory of a full pass: x_kv's, or x_q's when x_kv is None (self-attention), whose keys then take
    query_positions unless key_positions are given (and errors name the argument the caller passed)."""
    if x_kv is not None:
      if jnp.ndim(x_kv) >= 1 and jnp.ndim(x_q) >= 1 and jnp.shape(x_kv)[0] != jnp.shape(x_q)[0]:
        # attend's grouped rows (a beam search's beams of one source) read a wrong batch without a word here
        raise ValueError(f"MultiHeadAttention: x_kv must have x_q's batch {jnp.shape(x_q)[0]}, got x_kv "
                         f"{list(jnp.shape(x_kv))}; memory rows shared by several query rows go through attend")
      return self._memory(x_kv, key_positions)
    if key_positions is None:
      return self._memory(x_q, query_positions, "query_positions")
    return self._memory(x_q, key_positions)

  def attend(self, x_q, memory_cache: MemoryCache, *, mask=None, bias=None, query_positions=None,
             is_causal: bool = False, deterministic: bool = True):
    """Queries x_q [b, t, in_features] attend to a projected memory -> [b, t, out_features].

    mask (bool, True = may attend) and bias broadcast to [b, heads, t, kv_len]; is_causal aligns
    the queries with the last t keys. A memory of batch m dividing b serves b / m consecutive query
    rows each (rows i * b / m .. read memory row i: the beams of one source), read once for all of
    them; mask and bias then broadcast to [m, heads, 1, kv_len].
    """
    q = self._project_query(x_q, query_positions)
    rows, length = q.shape[:2]
    batch = memory_cache.keys.shape[0]
    group = rows // batch if rows != batch and rows % batch == 0 else 1
    if group == 1 and not memory_cache.keys_transposed:
      return self._attend_heads(q, memory_cache.keys, memory_cache.values, mask=mask, bias=bias,
                                is_causal=is_causal, deterministic=deterministic)
    if is_causal:
      raise ValueError("MultiHeadAttention.attend: is_causal needs one memory row per query row and keys not "
                       f"transposed, got {group} query rows per memory row")
    if group > 1:
      # Query rows r * group .. (r + 1) * group - 1 share memory row r (a beam search's beams of one
      # source): they attend as more queries of that row, so its keys / values are read once, never copied.
      for name, array in (("mask", mask), ("bias", bias)):
        if array is not None and not (jnp.ndim(array) <= 4 and jnp.shape(array)[-2:-1] in ((), (1,))
                                      and (jnp.ndim(array) < 4 or jnp.shape(array)[0] in (1, batch))):
          raise MaskBiasError("MultiHeadAttention.attend", name,
                              f"x_q has {group} rows per memory row, so {name} must broadcast to [{batch}, heads, "
                              f"1, kv_len] (one per memory row), got {name}{list(jnp.shape(array))}")
      q = q.reshape(batch, group * length, *q.shape[2:])
    if not memory_cache.keys_transposed:
      out = self._attend_heads(q, memory_cache.keys, memory_cache.values, mask=mask, bias=bias, is_causal=False,
                               deterministic=deterministic)
    else:
      if self.dropout_rate > 0.0 and not deterministic:
        raise ValueError("MultiHeadAttention.attend: a memory with transposed keys is read deterministically")
      target = (batch, self.num_heads, q.shape[1], memory_cache.keys.shape[3])
      mask = None if mask is None else _check_broadcastable("mask", mask, target)
      bias = None if bias is None else _check_broadcastable("bias", bias, target)
      heads = _attention_keys_transposed(q, memory_cache.keys, memory_cache.values, mask, bias)
      out = self.out(heads.reshape(*q.shape[:2], self.num_heads * self.head_dim))
    return out.reshape(rows, length, self.out_features)

  def __call__(self, x_q, x_kv=None, *, mask=None, bias=None, query_positions=None, key_positions=None,
               is_causal: bool = False, deterministic: bool = True):
    """Full pass: self-attention over x_q when x_kv is None, else cross-attention to x_kv.

    x_q [b, t, in_features], x_kv [b, s, kv_features] (the same b; memory rows shared by several query rows go
    through `attend`) -> [b, t, out_features]. For self-attention key_positions defaults to query_positions.
    """
    _check_features("x_q", x_q, self.in_features)
    memory_cache = self._own_memory(x_q, x_kv, query_positions, key_positions)
    return self.attend(x_q, memory_cache, mask=mask, bias=bias, query_positions=query_positions,
                       is_causal=is_causal, deterministic=deterministic)

  def attention_weights(self, x_q, x_kv=None, *, mask=None, bias=None, query_positions=None,
                        key_positions=None, is_causal: bool = False):
    """Attention probabilities [b, heads, t, s] in float32 (for plots), same projections as __call__."""
    return self.memory_attention_weights(x_q, self._own_memory(x_q, x_kv, query_positions, key_positions),
                                         mask=mask, bias=bias, query_positions=query_positions, is_causal=is_causal)

  def memory_attention_weights(self, x_q, memory_cache: MemoryCache, *, mask=None, bias=None, query_positions=None,
                               is_causal: bool = False):
    """Attention probabilities [b, heads, t, kv_len] in float32 of queries x_q over a projected memory, as
    `attend` computes them (one memory row per query row, keys not transposed)."""
    if memory_cache.keys_transposed:
      raise ValueError("MultiHeadAttention.memory_attention_weights: needs a memory with keys not transposed")
    q = self._project_query(x_q, query_positions)
    mask, bias = self._check_mask_bias(q, memory_cache.keys, mask, bias)
    return attention_ops.attention_weights(q, _swap_length_and_heads(memory_cache.keys), bias=bias, mask=mask,
                                           is_causal=is_causal)

  # --- self-attention decoding ----------------------------------------------------------------

  def init_cache(self, batch_size: int, max_length: int, dtype=None) -> KVCache:
    """An empty self-attention cache of capacity max_length, in dtype (default: compute dtype)."""
    if not all(isinstance(n, (int, np.integer)) and n > 0 for n in (batch_size, max_length)):
      raise ValueError(
          f"MultiHeadAttention.init_cache: batch_size and max_length must be positive ints, got "
          f"batch_size={batch_size}, max_length={max_length}")
    shape = (batch_size, self.num_kv_heads, max_length, self.head_dim)
    dtype = self.dtype if dtype is None else dtype
    if not jnp.issubdtype(dtype, jnp.floating):  # an int cache truncated every key and value written to it
      raise ValueError(f"MultiHeadAttention.init_cache: dtype must be floating point, got dtype={jnp.dtype(dtype)}")
    return KVCache(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype), index=jnp.zeros((), jnp.int32))

  def extend(self, x, cache: KVCache, *, positions=None, mask=None, bias=None, deterministic: bool = True):
    """Appends x [b, t, in_features] to the cache and attends causally to everything filled so far.

    Works for a pre-fill prompt (t > 1) and for single steps. With 1D RoPE, positions default to
    cache.index + arange(t). mask (e.g. key padding [b, 1, 1, max_length]) is ANDed with the causal
    mask, which already hides the unfilled rows. bias (e.g. ALiBi between these queries and every
    cache row) broadcasts to [b, heads, t, max_length]. Returns (out [b, t, out_features], advanced cache).

    Overflow: if t > max_length, or cache.index is concrete and index + t > max_length, this raises.
    Under jit the index is traced and cannot be checked at trace time; dynamic_update_slice would
    then clamp the write and overwrite the newest rows, so instead the output is set to NaN, which
    makes a decode past capacity impossible to miss.

    A cache in the beam layout (`KVCache.expand_beams`, batch b and beams k) takes one token per
    beam, x [b * k, 1, in_features] (row b * k + j: beam j of example b); mask and bias then
    broadcast to [b * k, heads, 1, max_length].
    """
    if self.kv_features != self.in_features:
      raise ValueError(
          f"MultiHeadAttention.extend: self-attention needs kv_features == in_features, got "
          f"kv_features={self.kv_features}, in_features={self.in_features}")
    _check_features("x", x, self.in_features)
    if cache.ancestry is not None:
      return self._extend_beams(x, cache, positions=positions, mask=mask, bias=bias, deterministic=deterministic)
    batch, length = x.shape[:2]
    if length == 0:  # else causal_mask refused a q_len=0 the caller never passed
      raise ValueError(f"MultiHeadAttention.extend: x must hold at least one token, got x{list(x.shape)}")
    expected = (batch, self.num_kv_heads, cache.keys.shape[2], self.head_dim)
    if cache.keys.shape != expected or cache.values.shape != expected:
      raise ValueError(
          f"MultiHeadAttention.extend: cache keys / values must be [batch, kv_heads, max_length, head_dim] = "
          f"{list(expected)}, got keys{list(cache.keys.shape)}, values{list(cache.values.shape)}")
    max_length = cache.max_length
    if length > max_length or (not _is_traced(cache.index) and int(cache.index) + length > max_length):
      raise ValueError(
          f"MultiHeadAttention.extend: cache of max_length={max_length} cannot take {length} more tokens at "
          f"index={cache.index if not _is_traced(cache.index) else 'traced'}")
    # named here: once ANDed with the causal mask, a bad mask would blame combine_masks
    if mask is not None:
      mask = _check_broadcastable("mask", mask, (batch, self.num_heads, length, max_length), "extend")
    if bias is not None:
      bias = _check_broadcastable("bias", bias, (batch, self.num_heads, length, max_length), "extend")
    index = cache.index
    q = self._project_query(x, positions, start=index, **EXTEND_NAMES)
    new_keys, new_values = self._project_key_value(x, positions, start=index, **EXTEND_NAMES)
    def write(rows, new):  # new [b, t, k, h] into rows [b, k, max_length, h] at index
      return jax.lax.dynamic_update_slice(rows, _swap_length_and_heads(new).astype(rows.dtype), (0, 0, index, 0))
    keys, values = write(cache.keys, new_keys), write(cache.values, new_values)
    # Query i sits at position index + i and sees keys 0 .. index + i: filled rows only.
    causal = masks_lib.causal_mask(length, max_length, offset=index)  # [1, 1, t, max_length]
    out = self._attend_heads(q, keys, values, mask=masks_lib.combine_masks(causal, mask), bias=bias,
                             is_causal=False, deterministic=deterministic)
    out = jnp.where(index + length <= max_length, out, jnp.nan)
    return out, KVCache(keys=keys, values=values, index=index + length)

  def _extend_beams(self, x, cache: KVCache, *, positions, mask, bias, deterministic):
    """`extend` for a cache in the beam layout: one token per beam, x [batch * beams, 1, in_features].

    The beams of one example attend as `beams` queries to that example's slots, each masked to the
    rows its ancestry names: the same scores as a cache reordered per beam, with no copying.
    """
    batch, beams, max_length = cache.ancestry.shape
    rows, slots = batch * beams, max_length * beams
    kv_heads, head_dim = self.num_kv_heads, self.head_dim
    if (x.shape[:2] != (rows, 1) or cache.keys.shape != (batch, kv_heads, head_dim, slots)
        or cache.values.shape != (batch, kv_heads, slots, head_dim)):
      raise ValueError(
          f"MultiHeadAttention.extend: a beam cache of {batch} examples x {beams} beams takes x [{rows}, 1, "
          f"{self.in_features}], keys {[batch, kv_heads, head_dim, slots]} and values "
          f"{[batch, kv_heads, slots, head_dim]}, got x{list(x.shape)}, keys{list(cache.keys.shape)}, values"
          f"{list(cache.values.shape)}")
    if self.dropout_rate > 0.0 and not deterministic:
      raise ValueError("MultiHeadAttention.extend: a beam cache decodes deterministically (deterministic=True)")
    if not _is_traced(cache.index) and int(cache.index) + 1 > max_length:
      raise ValueError(f"MultiHeadAttention.extend: cache of max_length={max_length} cannot take 1 more token "
                       f"at index={int(cache.index)}")
    index = cache.index
    q = self._project_query(x, positions, start=index, **EXTEND_NAMES)  # -> [rows, 1, heads, head_dim]
    new_keys, new_values = self._project_key_value(x, positions, start=index, **EXTEND_NAMES)
    # This position of every beam: slots index * beams .. (index + 1) * beams - 1.
    new_keys = new_keys.reshape(batch, beams, kv_heads, head_dim).transpose(0, 2, 3, 1)  # -> [b, k, h, beams]
    new_values = new_values.reshape(batch, beams, kv_heads, head_dim).transpose(0, 2, 1, 3)  # -> [b, k, beams, h]
    keys = jax.lax.dynamic_update_slice(cache.keys, new_keys.astype(cache.keys.dtype), (0, 0, 0, index * beams))
    values = jax.lax.dynamic_update_slice(cache.values, new_values.astype(cache.values.dtype),
                                          (0, 0, index * beams, 0))
    # Beam j sees slot t * beams + i iff t <= index and slot i holds position t of its history.
    sees = ((cache.ancestry[..., None] == jnp.arange(beams, dtype=jnp.int32))
            & (jnp.arange(max_length) <= index)[:, None])  # -> [b, beams (j), max_length, beams (i)]
    beam_mask = sees.reshape(batch, 1, beams, slots)
    if mask is not None:
      beam_mask = beam_mask & self._to_beam_layout("mask", mask, batch, beams, max_length)
    if bias is not None:
      bias = self._to_beam_layout("bias", bias, batch, beams, max_length)
    heads = _attention_keys_transposed(q.reshape(batch, beams, self.num_heads, head_dim), keys, values, beam_mask,
                                       bias)
    out = self.out(heads.reshape(rows, 1, self.num_heads * head_dim))
    out = jnp.where(index + 1 <= max_length, out, jnp.nan)
    return out, cache.replace(keys=keys, values=values, index=index + 1)

  def _to_beam_layout(self, name, array, batch: int, beams: int, max_length: int):
    """A mask / bias over beam rows and positions, [b * beams | 1, heads | 1, 1, max_length], as one over
    the beam layout's queries and slots: [b | 1, heads | 1, beams | 1, max_length * beams]."""
    array = _check_broadcastable(name, array, (batch * beams, self.num_heads, 1, max_length), "extend")
    array = jnp.broadcast_to(array, array.shape[:3] + (max_length,))
    if array.shape[0] == batch * beams:  # -> [b, heads, beams, max_length]
      array = array.reshape(batch, beams, array.shape[1], max_length).transpose(0, 2, 1, 3)
    return jnp.repeat(array, beams, axis=-1)  # position t's value for each of its slots


def _attention_keys_transposed(q, keys, values, mask, bias):
  """softmax(q keys / sqrt(head_dim) + bias, masked) values, with the keys stored transposed.

  q [b, beams, heads, head_dim] (a few queries per row: beams, or beams x steps); keys [b, kv_heads,
  head_dim, slots]; values [b, kv_heads, slots, head_dim]; mask bool and bias (or None) broadcasting
  to [b, heads, beams, slots] -> [b, beams, heads, head_dim]. Scores and softmax in float32, and a
  query that may attend to no slot returns zeros, as in `ops.attention`.
  """
  b, beams, heads, head_dim = q.shape
  kv_heads, slots = keys.shape[1], keys.shape[3]
  groups = heads // kv_heads
  out_dtype, scale = q.dtype, head_dim ** -0.5
  on_scores = attention_ops.scale_on_scores(q.dtype, scale)  # a half-precision copy would round the scores again
  if not on_scores:
    q = q * jnp.asarray(scale, q.dtype)
  q = q.reshape(b, beams, kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4)  # -> [b, k, g, beams, h]
  logits = jnp.einsum("bkqh,bkhs->bkqs", q.reshape(b, kv_heads, groups * beams, head_dim), keys,
                      preferred_element_type=jnp.float32).reshape(b, kv_heads, groups, beams, slots)
  if on_scores:
    logits = logits * scale

  def grouped(x):  # [B, 1 | heads, beams | 1, slots] -> [B, 1 | k, 1 | g, beams | 1, slots]
    x = jnp.broadcast_to(x, x.shape[:3] + (slots,))
    return x[:, :, None] if x.shape[1] == 1 else x.reshape(x.shape[0], kv_heads, groups, *x.shape[2:])

  if bias is not None:
    logits = logits + grouped(bias).astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(grouped(mask), logits, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  weights = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  row_sum = jnp.sum(weights, axis=-1, keepdims=True)
  seen = row_sum != 0  # a NaN sum stays NaN, as in `ops.attention`
  weights = jnp.where(seen, weights / jnp.where(seen, row_sum, 1.0), 0.0)
  out = jnp.einsum("bkqs,bksh->bkqh", weights.reshape(b, kv_heads, groups * beams, slots).astype(values.dtype),
                   values, preferred_element_type=jnp.float32)  # -> [b, k, g * beams, h]
  out = out.reshape(b, kv_heads, groups, beams, head_dim).transpose(0, 3, 1, 2, 4)
  return out.reshape(b, beams, heads, head_dim).astype(out_dtype)
