"""Transformer blocks built on MultiHeadAttention: encoder, decoder, gated and plain cross-attention.

Shapes: token streams x [batch, length, features], memories [batch, memory_length, memory_features],
masks boolean (True = may attend) broadcastable to [batch, heads, q_len, kv_len].

Blocks hold only parameters (and dropout rngs): `__call__` and `decode` change no Python-side
state, so stacks of blocks can be built with `nnx.vmap` and run with `nnx.scan`, and a decode
step is a pure function of (x, cache) -> (out, cache).
"""
from __future__ import annotations

import numbers
from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from xattn_jax.layers import dense
from xattn_jax.layers.attention import KVCache, MaskBiasError, MemoryCache, MultiHeadAttention, _check_positive_int
from xattn_jax.layers.rotary import RotarySpec
from xattn_jax.ops import masks as masks_lib

# The one list of each choice (tasks validate config against them): residual norm placements, MLP
# activations by name; the norm types and MLP kinds (NORM_TYPES, MLP_TYPES) are registered below.
NORM_PLACEMENTS = ("pre", "post")
ACTIVATIONS: dict[str, Callable] = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu}


def _check_choice(name: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {tuple(allowed)}, got {name}={value!r}")


def check_dropout_rate(rate, name: str = "dropout_rate", where: str = "") -> None:
  """A dropout rate in [0, 1): nnx.Dropout takes any, and at 1.5 zeroed (and rescaled) every activation without a
  word. ValueError naming `name` (and `where`, the model or layer) otherwise."""
  if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not 0 <= rate < 1:
    raise ValueError(f"{where + ': ' if where else ''}{name} must be in [0, 1), got {name}={rate!r}")


def _check_stream(where: str, name: str, x, features: int) -> None:
  if x.ndim != 3 or x.shape[-1] != features:
    raise ValueError(f"{where}: {name} must be [batch, length, {features}], got {name}{list(x.shape)}")


def _check_same_batch(where: str, x, memory) -> None:
  # attend would read a memory of fewer rows as one row per group of queries (the beams of one source)
  if memory.shape[0] != x.shape[0]:
    raise ValueError(f"{where}: memory must have x's batch {x.shape[0]}, got memory{list(memory.shape)}")


def _naming(where: str, names: dict[str, str], call: Callable):
  """call(), a complaint of the attention inside about its mask / bias re-raised from `where`, naming the
  argument the caller passed (names: the attention's name -> the block's, e.g. {"mask": "self_mask"})."""
  try:
    return call()
  except MaskBiasError as error:
    if error.argument not in names:
      raise
    raise error.renamed(where, names[error.argument]) from None


def rotary_positions(attention: MultiHeadAttention, positions):
  """positions where the attention rotates q and k by them, else None: a block takes its model's positions
  whatever the model's encoding (the Translator's, for an additive or relative one), which a MultiHeadAttention
  without a rotary encoding refuses."""
  return positions if attention.rotary is not None else None


# The attention's mask / bias as DecoderBlock's arguments call them
_SELF_NAMES = {"mask": "self_mask", "bias": "self_bias"}
_MEMORY_NAMES = {"mask": "memory_mask"}


def _partitioned(init, axes):
  return nnx.with_partitioning(init, axes, eager_sharding=False)


def layer_norm(features: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs) -> nnx.LayerNorm:
  """LayerNorm over the last axis of [..., features]: (x - mean) / sqrt(var + eps) * scale + bias."""
  return nnx.LayerNorm(features, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                       scale_init=_partitioned(nnx.initializers.ones_init(), ("embed",)),
                       bias_init=_partitioned(nnx.initializers.zeros_init(), ("embed",)))


def rms_norm(features: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs) -> nnx.RMSNorm:
  """RMSNorm (Zhang & Sennrich 2019; Llama) over the last axis: x / sqrt(mean(x^2) + eps) * scale, no bias."""
  return nnx.RMSNorm(features, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                     scale_init=_partitioned(nnx.initializers.ones_init(), ("embed",)))


# Norm types by name: (features, *, dtype, param_dtype, rngs) -> a module over [..., features].
NORM_TYPES: dict[str, Callable[..., nnx.Module]] = {"layernorm": layer_norm, "rmsnorm": rms_norm}


def make_norm(norm_type: str, features: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
  """The NORM_TYPES entry norm_type over [..., features]; ValueError naming norm_type if there is none."""
  _check_choice("norm_type", norm_type, NORM_TYPES)
  return NORM_TYPES[norm_type](features, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class MLP(nnx.Module):
  """Position-wise feed-forward: out(dropout(activation(x W_in + b_in))). [b, t, features] -> [b, t, out]."""
  takes_activation = True

  def __init__(self, features: int, hidden_features: int, out_features: int | None = None, *,
               activation: str = "gelu", dropout_rate: float = 0.0, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    _check_choice("activation", activation, ACTIVATIONS)
    out_features = features if out_features is None else out_features
    self.features, self.activation = features, activation

    def linear(fan_in, fan_out, axes):
      return dense.Dense(
          fan_in, fan_out, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
          kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), axes, eager_sharding=False),
          bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axes[1:], eager_sharding=False))

    self.wi = linear(features, hidden_features, ("embed", "mlp"))
    self.wo = linear(hidden_features, out_features, ("mlp", "embed"))
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def __call__(self, x, *, deterministic: bool = True):
    if x.shape[-1] != self.features:
      raise ValueError(f"MLP: x must be [..., {self.features}], got x{list(x.shape)}")
    hidden = ACTIVATIONS[self.activation](self.wi(x))
    return self.wo(self.dropout(hidden, deterministic=deterministic))


class SwiGLU(nnx.Module):
  """Gated feed-forward of Llama / Qwen (Shazeer 2020): W_down (silu(x W_gate) * x W_up), no biases.

  [..., features] -> [..., features]. The gate's activation is silu by definition (no activation option).
  """
  takes_activation = False

  def __init__(self, features: int, hidden_features: int, *, dropout_rate: float = 0.0, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    def linear(fan_in, fan_out, axes):
      return dense.Dense(fan_in, fan_out, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                         kernel_init=_partitioned(nnx.initializers.xavier_uniform(), axes))

    self.features = features
    self.gate = linear(features, hidden_features, ("embed", "mlp"))
    self.up = linear(features, hidden_features, ("embed", "mlp"))
    self.down = linear(hidden_features, features, ("mlp", "embed"))
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def __call__(self, x, *, deterministic: bool = True):
    if x.shape[-1] != self.features:
      raise ValueError(f"SwiGLU: x must be [..., {self.features}], got x{list(x.shape)}")
    hidden = jax.nn.silu(self.gate(x)) * self.up(x)  # -> [..., hidden_features]
    return self.down(self.dropout(hidden, deterministic=deterministic))


# MLP kinds by name: (features, hidden_features, *, [activation,] dropout_rate, dtype, param_dtype, rngs);
# `takes_activation` says whether the kind reads an ACTIVATIONS name.
MLP_TYPES: dict[str, type[nnx.Module]] = {"mlp": MLP, "swiglu": SwiGLU}


def make_mlp(mlp_type: str, features: int, hidden_features: int, *, activation: str = "gelu",
             dropout_rate: float = 0.0, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
  """The MLP_TYPES entry mlp_type, [..., features] -> [..., features]; activation is read by "mlp" only."""
  _check_choice("mlp_type", mlp_type, MLP_TYPES)
  check_dropout_rate(dropout_rate)
  kind = MLP_TYPES[mlp_type]
  options = dict(activation=activation) if kind.takes_activation else {}
  return kind(features, hidden_features, dropout_rate=dropout_rate, dtype=dtype, param_dtype=param_dtype,
              rngs=rngs, **options)


class _Residual(nnx.Module):
  """x + dropout(f(norm(x))) (pre-norm) or norm(x + dropout(f(x))) (post-norm, Vaswani et al.).

  gated: the branch is scaled by tanh(gate), gate a scalar parameter starting at zero (Flamingo).
  """

  def __init__(self, features, norm, dropout_rate, dtype, param_dtype, rngs, gated=False):
    _check_choice("norm", norm, NORM_PLACEMENTS)
    check_dropout_rate(dropout_rate)
    self.norm_placement = norm
    self.norm = layer_norm(features, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
    self.gate = nnx.Param(jnp.zeros((), param_dtype)) if gated else None

  def branch_inputs(self, x):
    """What the sublayer sees: norm(x) when pre-norm, x itself when post-norm."""
    return self.norm(x) if self.norm_placement == "pre" else x

  def __call__(self, x, sublayer, deterministic):
    """sublayer maps the (normalized) stream to (y, extra); returns (new stream, extra)."""
    y, extra = sublayer(self.branch_inputs(x))
    y = self.dropout(y, deterministic=deterministic)
    if self.gate is not None:
      y = jnp.tanh(self.gate[...]).astype(y.dtype) * y
    x = x + y
    return (x if self.norm_placement == "pre" else self.norm(x)), extra


class EncoderBlock(nnx.Module):
  """Bidirectional self-attention then MLP, each in a residual with LayerNorm. [b, t, f] -> [b, t, f]."""

  def __init__(self, features: int, num_heads: int, mlp_features: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, norm: str = "pre", dropout_rate: float = 0.0,
               attention_dropout_rate: float = 0.0, activation: str = "gelu", rotary: RotarySpec | None = None,
               implementation: str | None = None, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attention = MultiHeadAttention(
        num_heads, features, num_kv_heads=num_kv_heads, head_dim=head_dim, dropout_rate=attention_dropout_rate,
        rotary=rotary, implementation=implementation, **common)
    self.mlp = MLP(features, mlp_features, activation=activation, dropout_rate=dropout_rate, **common)
    self.attention_residual = _Residual(features, norm, dropout_rate, **common)
    self.mlp_residual = _Residual(features, norm, dropout_rate, **common)

  def __call__(self, x, *, mask=None, positions=None, bias=None, deterministic: bool = True):
    """mask: e.g. key padding [b, 1, 1, t]; positions: for a rotary attention layer; bias: a relative
    position bias [b, heads, t, t] added to the self-attention scores (ALiBi, T5)."""
    _check_stream("EncoderBlock", "x", x, self.attention.in_features)
    x, _ = self.attention_residual(x, lambda h: (self.attention(
        h, mask=mask, bias=bias, query_positions=rotary_positions(self.attention, positions),
        deterministic=deterministic), None), deterministic)
    x, _ = self.mlp_residual(x, lambda h: (self.mlp(h, deterministic=deterministic), None), deterministic)
    return x

  def attention_weights(self, x, *, mask=None, positions=None, bias=None):
    """Self-attention probabilities [b, heads, t, t] (float32) of this block on x [b, t, features]."""
    _check_stream("EncoderBlock.attention_weights", "x", x, self.attention.in_features)
    return self.attention.attention_weights(self.attention_residual.branch_inputs(x), mask=mask, bias=bias,
                                            query_positions=rotary_positions(self.attention, positions))


@flax.struct.dataclass
class DecoderCache:
  """One decoder layer's cache: the growing self-attention KVCache and the memory's projection."""
  self_attention: KVCache
  cross_attention: MemoryCache

  def head(self, n: int) -> DecoderCache:
    """The cache of the first n target positions (`KVCache.head`); the memory's stays whole."""
    return self.replace(self_attention=self.self_attention.head(n))

  def with_head(self, head: DecoderCache) -> DecoderCache:
    return head.replace(self_attention=self.self_attention.with_head(head.self_attention))


class DecoderBlock(nnx.Module):
  """Causal self-attention, cross-attention to a memory, then MLP; residuals with pre / post LayerNorm."""

  def __init__(self, features: int, num_heads: int, mlp_features: int, *, memory_features: int | None = None,
               num_kv_heads: int | None = None, head_dim: int | None = None, norm: str = "pre",
               dropout_rate: float = 0.0, attention_dropout_rate: float = 0.0, activation: str = "gelu",
               rotary: RotarySpec | None = None, implementation: str | None = None, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    attention = dict(num_kv_heads=num_kv_heads, head_dim=head_dim, dropout_rate=attention_dropout_rate,
                     implementation=implementation, **common)
    self.self_attention = MultiHeadAttention(num_heads, features, rotary=rotary, **attention)
    # The memory carries its own positions (encoded by the encoder), so no rotary here.
    self.cross_attention = MultiHeadAttention(num_heads, features, memory_features, **attention)
    self.mlp = MLP(features, mlp_features, activation=activation, dropout_rate=dropout_rate, **common)
    self.self_residual = _Residual(features, norm, dropout_rate, **common)
    self.cross_residual = _Residual(features, norm, dropout_rate, **common)
    self.mlp_residual = _Residual(features, norm, dropout_rate, **common)

  def _cross_and_mlp(self, x, memory_cache, memory_mask, deterministic, where):
    x, _ = self.cross_residual(x, lambda h: (_naming(where, _MEMORY_NAMES, lambda: self.cross_attention.attend(
        h, memory_cache, mask=memory_mask, deterministic=deterministic)), None), deterministic)
    x, _ = self.mlp_residual(x, lambda h: (self.mlp(h, deterministic=deterministic), None), deterministic)
    return x

  def __call__(self, x, memory, *, self_mask=None, positions=None, memory_mask=None, self_bias=None,
               deterministic: bool = True):
    """Full pass: x [b, t, features], memory [b, s, memory_features] -> [b, t, features].

    self_mask is ANDed with the causal mask (e.g. target padding); memory_mask hides padded
    memory rows ([b, 1, 1, s]); positions feed a rotary self-attention; self_bias [b, heads, t, t]
    is a relative position bias on the self-attention scores only.
    """
    _check_stream("DecoderBlock", "x", x, self.self_attention.in_features)
    _check_stream("DecoderBlock", "memory", memory, self.cross_attention.kv_features)
    _check_same_batch("DecoderBlock", x, memory)
    x = self._self_attend(x, self_mask, positions, self_bias, deterministic, "DecoderBlock")
    memory_cache = self.cross_attention.project_memory(memory)
    return self._cross_and_mlp(x, memory_cache, memory_mask, deterministic, "DecoderBlock")

  def _self_attend(self, x, self_mask, positions, self_bias, deterministic, where):
    x, _ = self.self_residual(x, lambda h: (_naming(where, _SELF_NAMES, lambda: self.self_attention(
        h, mask=self_mask, bias=self_bias, query_positions=rotary_positions(self.self_attention, positions),
        is_causal=True,
        deterministic=deterministic)), None), deterministic)
    return x

  def cross_attention_weights(self, x, memory, *, positions=None, self_mask=None, memory_mask=None,
                              self_bias=None):
    """Cross-attention probabilities [b, heads, t, s] (float32) of the full pass (arguments as __call__).

    The queries are what the cross-attention sees inside __call__: the stream after the causal
    self-attention residual, normalised first when pre-norm.
    """
    _check_stream("DecoderBlock.cross_attention_weights", "x", x, self.self_attention.in_features)
    _check_stream("DecoderBlock.cross_attention_weights", "memory", memory, self.cross_attention.kv_features)
    _check_same_batch("DecoderBlock.cross_attention_weights", x, memory)
    where = "DecoderBlock.cross_attention_weights"
    x = self._self_attend(x, self_mask, positions, self_bias, True, where)
    return _naming(where, _MEMORY_NAMES, lambda: self.cross_attention.attention_weights(
        self.cross_residual.branch_inputs(x), memory, mask=memory_mask))

  def init_cache(self, memory, max_length: int) -> DecoderCache:
    """An empty self-attention cache of capacity max_length and the memory's keys / values, projected once."""
    _check_stream("DecoderBlock.init_cache", "memory", memory, self.cross_attention.kv_features)
    return DecoderCache(
        self_attention=self.self_attention.init_cache(memory.shape[0], max_length),
        cross_attention=self.cross_attention.project_memory(memory))

  def decode(self, x, cache: DecoderCache, *, positions=None, self_mask=None, memory_mask=None,
             self_bias=None, deterministic: bool = True):
    """Pre-fill (t > 1) or one step (t = 1): x [b, t, features] -> (out [b, t, features], cache).

    self_mask and self_bias broadcast to [b, heads, t, max_length] (e.g. prompt padding, a relative
    position bias between these queries and every cache row); memory_mask as in __call__.
    """
    _check_stream("DecoderBlock.decode", "x", x, self.self_attention.in_features)
    def self_attend(h):
      return _naming("DecoderBlock.decode", _SELF_NAMES, lambda: self.self_attention.extend(
          h, cache.self_attention, positions=rotary_positions(self.self_attention, positions), mask=self_mask,
          bias=self_bias, deterministic=deterministic))

    x, self_cache = self.self_residual(x, self_attend, deterministic)
    x = self._cross_and_mlp(x, cache.cross_attention, memory_mask, deterministic, "DecoderBlock.decode")
    return x, cache.replace(self_attention=self_cache)


class CrossAttentionBlock(nnx.Module):
  """Queries attend to inputs, then an MLP (the Perceiver's / Q-Former's cross block), pre-norm.

  x [b, n, features], inputs [b, m, input_features] -> [b, n, features]. With normalize_inputs the
  inputs get their own LayerNorm before the attention, as in the Perceiver. With gated, each
  residual branch is scaled by tanh(alpha), alpha starting at zero (see GatedCrossAttentionBlock).
  """
  _inputs_name = "inputs"  # what errors call the attended-to stream

  def __init__(self, features: int, input_features: int, num_heads: int, mlp_features: int, *,
               num_kv_heads: int | None = None, head_dim: int | None = None, dropout_rate: float = 0.0,
               attention_dropout_rate: float = 0.0, activation: str = "gelu", implementation: str | None = None,
               normalize_inputs: bool = True, gated: bool = False, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.input_norm = layer_norm(input_features, **common) if normalize_inputs else None
    self.attention = MultiHeadAttention(
        num_heads, features, input_features, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dropout_rate=attention_dropout_rate, implementation=implementation, **common)
    self.mlp = MLP(features, mlp_features, activation=activation, dropout_rate=dropout_rate, **common)
    self.attention_residual = _Residual(features, "pre", dropout_rate, gated=gated, **common)
    self.mlp_residual = _Residual(features, "pre", dropout_rate, gated=gated, **common)

  def __call__(self, x, inputs, *, mask=None, deterministic: bool = True):
    """mask: e.g. input padding [b, 1, 1, m]."""
    _check_stream(type(self).__name__, "x", x, self.attention.in_features)
    _check_stream(type(self).__name__, self._inputs_name, inputs, self.attention.kv_features)
    if self.input_norm is not None:
      inputs = self.input_norm(inputs)
    x, _ = self.attention_residual(x, lambda h: (self.attention(
        h, inputs, mask=mask, deterministic=deterministic), None), deterministic)
    x, _ = self.mlp_residual(x, lambda h: (self.mlp(h, deterministic=deterministic), None), deterministic)
    return x


class GatedCrossAttentionBlock(CrossAttentionBlock):
  """Flamingo's gated cross-attention (GATED XATTN-DENSE), inserted before a frozen block of a host model.

  x <- x + tanh(alpha_attention) * cross_attention(norm(x), memory)
  x <- x + tanh(alpha_mlp) * mlp(norm(x))
  Both alphas start at zero, so an inserted block is exactly the identity at initialisation. The
  memory is not normalized here (Flamingo's resampler output already is).
  x [b, t, features], memory [b, m, memory_features] -> [b, t, features].
  """
  _inputs_name = "memory"

  def __init__(self, features: int, memory_features: int, num_heads: int, mlp_features: int, **options):
    super().__init__(features, memory_features, num_heads, mlp_features, normalize_inputs=False, gated=True,
                     **options)

  def __call__(self, x, memory, *, memory_mask=None, deterministic: bool = True):
    return super().__call__(x, memory, mask=memory_mask, deterministic=deterministic)


class LearnedQueryPooling(nnx.Module):
  """N learned queries read any number M of inputs through a CrossAttentionBlock.

  inputs [b, M, input_features] (+ optional valid [b, M] bool) -> [b, num_queries, features].
  The inputs carry no positions here, so the result is invariant to permuting them.
  """

  def __init__(self, num_queries: int, features: int, input_features: int, num_heads: int, *,
               mlp_features: int | None = None, dropout_rate: float = 0.0, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    _check_positive_int("num_queries", num_queries, "LearnedQueryPooling")
    self.input_features = input_features
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("length", "embed"), eager_sharding=False)
    self.queries = nnx.Param(init(rngs.params(), (num_queries, features), param_dtype))
    self.block = CrossAttentionBlock(
        features, input_features, num_heads, 4 * features if mlp_features is None else mlp_features,
        dropout_rate=dropout_rate, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def __call__(self, inputs, *, valid=None, deterministic: bool = True):
    if inputs.ndim != 3 or inputs.shape[-1] != self.input_features:
      raise ValueError(
          f"LearnedQueryPooling: inputs must be [batch, M, {self.input_features}], got inputs{list(inputs.shape)}")
    valid = None if valid is None else jnp.asarray(valid)
    if valid is not None and (valid.shape != inputs.shape[:2] or valid.dtype != jnp.bool_):
      raise ValueError(
          f"LearnedQueryPooling: valid must be bool {list(inputs.shape[:2])}, got {valid.dtype}{list(valid.shape)}")
    queries = jnp.broadcast_to(self.queries[...], (inputs.shape[0], *self.queries.shape))  # [b, N, features]
    mask = None if valid is None else masks_lib.padding_mask(valid)
    return self.block(queries.astype(inputs.dtype), inputs, mask=mask, deterministic=deterministic)
