"""A decoder-only language model (GPT / Llama / Qwen family), composed from the shared layers.

  __call__(tokens [b, t], positions=, segment_ids=)     -> logits [b, t, vocab]   (training, packed rows)
  init_cache(batch, capacity)                           -> LMCache
  prefill(tokens [b, t], cache, valid=)                 -> (logits [b, t, vocab], cache)   any length t
  decode_step(tokens [b, t], cache)                     -> (logits [b, t, vocab], cache)   a decoding.DecodeStep
  loop_step()                                           -> decode_step with the layers sliced once

Each block is pre-norm: x + attention(norm(x)) with causal self-attention, then x + mlp(norm(x)),
and a final norm before the output. The norm type (`layernorm` | `rmsnorm`) and the MLP
(`mlp` with an activation, or `swiglu`) are config choices; grouped-query attention by
num_kv_heads; the output layer is the transposed embedding (tied) or its own.

Positions, one option (`POSITION_ENCODINGS`, from layers.positions): `none`, `learned`,
`sinusoidal` (added to the embeddings), `rope` (optionally scaled) and `mrope` (rotating q and k;
text-only M-RoPE positions are the 1D positions on all three axes, which is 1D RoPE exactly),
`alibi` and `t5_bias` (causal-form biases on the scores).

Packed rows: `segment_ids` (1.. per document, 0 = padding) keep attention inside a document and
`positions` restart at every document, as data.text.pack_documents lays them out.

Ragged prompts are LEFT-padded: every row ends at the same column, so one scalar cache index serves
the batch and the last column holds each row's last prompt token. `prefill` takes `valid` [b, t]
(default tokens != PAD_ID); padded slots are hidden from every query and each row's positions count
its real tokens only (the first real token is at position 0), so a row decodes exactly as it would
alone. The cache keeps, per row, which slots are real, the position of every slot (for the relative
biases) and the next position.

Hooks for a host model (a vision-language model reading images through this one):
  prefix     [b, p, d_model] embeddings put before the token embeddings (image tokens); they take
             positions 0..p-1 and the logits cover all p + t positions.
  insert     {layer index: callable x -> x} run on the stream before that block (index num_layers:
             after the last one), e.g. a GatedCrossAttentionBlock with its memory bound.
With neither given the code path is the one without hooks; an inserted layer that is the identity
(a gated block at initialisation) leaves the logits bit for bit unchanged. With insert given the
layers run unrolled (a Python loop over the same stacked parameters).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xattn_jax.layers import blocks
from xattn_jax.layers import dense
from xattn_jax.layers import layer_stack
from xattn_jax.layers import positions as position_layers
from xattn_jax.layers.attention import KVCache, MultiHeadAttention
from xattn_jax.layers.rotary import RotarySpec
from xattn_jax.ops import masks as masks_lib

PAD_ID = 0
# The registry's text encodings: sequence positions, and M-RoPE with text positions on all three axes.
POSITION_ENCODINGS = position_layers.names(layout="sequence") + position_layers.names(layout="multimodal")
NORM_TYPES = ("layernorm", "rmsnorm")
MLP_TYPES = ("mlp", "swiglu")

Insert = Mapping[int, Callable[[jax.Array], jax.Array]]


def _partitioned(init, axes):
  return nnx.with_partitioning(init, axes, eager_sharding=False)


def make_norm(norm_type: str, features: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
  """LayerNorm (scale and bias) or RMSNorm (scale only, Llama) over the last axis of [..., features]."""
  if norm_type == "layernorm":
    return nnx.LayerNorm(features, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                         scale_init=_partitioned(nnx.initializers.ones_init(), ("embed",)),
                         bias_init=_partitioned(nnx.initializers.zeros_init(), ("embed",)))
  if norm_type == "rmsnorm":
    return nnx.RMSNorm(features, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                       scale_init=_partitioned(nnx.initializers.ones_init(), ("embed",)))
  raise ValueError(f"norm_type must be one of {NORM_TYPES}, got norm_type={norm_type!r}")


class SwiGLU(nnx.Module):
  """Gated feed-forward of Llama / Qwen: W_out (silu(x W_gate) * x W_up), no biases. [b, t, f] -> [b, t, f]."""

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
    hidden = jax.nn.silu(self.gate(x)) * self.up(x)
    return self.down(self.dropout(hidden, deterministic=deterministic))


class LMBlock(nnx.Module):
  """x + attention(norm(x)) (causal), then x + mlp(norm(x)). [b, t, features] -> [b, t, features]."""

  def __init__(self, features: int, num_heads: int, mlp_features: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, norm_type: str = "layernorm", mlp_type: str = "mlp",
               activation: str = "gelu", use_bias: bool = True, dropout_rate: float = 0.0,
               attention_dropout_rate: float = 0.0, rotary: RotarySpec | None = None,
               implementation: str | None = None, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attention = MultiHeadAttention(
        num_heads, features, num_kv_heads=num_kv_heads, head_dim=head_dim, use_bias=use_bias,
        dropout_rate=attention_dropout_rate, rotary=rotary, implementation=implementation, **common)
    if mlp_type == "swiglu":
      self.mlp = SwiGLU(features, mlp_features, dropout_rate=dropout_rate, **common)
    elif mlp_type == "mlp":
      self.mlp = blocks.MLP(features, mlp_features, activation=activation, dropout_rate=dropout_rate, **common)
    else:
      raise ValueError(f"mlp_type must be one of {MLP_TYPES}, got mlp_type={mlp_type!r}")
    self.attention_norm = make_norm(norm_type, features, **common)
    self.mlp_norm = make_norm(norm_type, features, **common)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  def _mlp_residual(self, x, deterministic):
    y = self.mlp(self.mlp_norm(x), deterministic=deterministic)
    return x + self.dropout(y, deterministic=deterministic)

  def __call__(self, x, *, mask=None, positions=None, bias=None, deterministic: bool = True):
    """mask (e.g. same-document [b, 1, t, t]) is ANDed with the causal mask; positions feed a rotary
    attention; bias [b, heads, t, t] is a relative position bias on the scores."""
    y = self.attention(self.attention_norm(x), mask=mask, bias=bias, query_positions=positions, is_causal=True,
                       deterministic=deterministic)
    x = x + self.dropout(y, deterministic=deterministic)
    return self._mlp_residual(x, deterministic)

  def decode(self, x, cache: KVCache, *, positions=None, mask=None, bias=None):
    """Appends x [b, t, features] to the layer's cache -> (out [b, t, features], advanced cache).

    mask and bias broadcast to [b, heads, t, capacity] (prompt padding, a bias to every cache row).
    """
    y, cache = self.attention.extend(self.attention_norm(x), cache, positions=positions, mask=mask, bias=bias)
    return self._mlp_residual(x + y, deterministic=True), cache


@flax.struct.dataclass
class LMCache:
  """Decode state: a KVCache per layer (one shared fill index), and per row

  key_valid      bool [b, capacity]: the slot holds a real token (not left padding, not yet unfilled)
  key_positions  int32 [b, capacity]: the position of the token in each slot (relative biases)
  next_position  int32 [b]: the position the row's next token takes
  """
  layers: tuple[KVCache, ...]
  key_valid: jax.Array
  key_positions: jax.Array
  next_position: jax.Array

  @property
  def capacity(self) -> int:
    return self.key_valid.shape[1]

  def decode_room(self) -> int:
    """How many more tokens the cache holds (its capacity while traced), for decoding's check."""
    index = self.layers[0].index
    if isinstance(index, jax.core.Tracer):
      return self.capacity
    return self.capacity - int(index)


def _check_tokens(where: str, tokens) -> None:
  if getattr(tokens, "ndim", None) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"LanguageModel.{where}: tokens must be int [batch, length], got "
                     f"{getattr(tokens, 'dtype', type(tokens))}{list(getattr(tokens, 'shape', ()))}")


class LanguageModel(nnx.Module):
  """Decoder-only transformer over token ids (id 0 = padding); see the module docstring.

  Args:
    vocab_size: number of token ids.
    d_model, num_heads, num_layers, mlp_dim: width, query heads, depth, MLP hidden width.
    num_kv_heads: key / value heads (GQA; 1 = MQA); None = num_heads. head_dim: None = d_model // num_heads.
    position_encoding: one of POSITION_ENCODINGS.
    max_length: rows of the learned position table (the longest position it covers).
    rope_scaling, rope_scaling_factor: RoPE length scaling, None | "linear" | "ntk".
    mrope_sections: frequency pairs per (time, height, width) axis for mrope; None = Qwen2-VL's split.
    norm_type: "layernorm" | "rmsnorm"; mlp_type: "mlp" (with activation) | "swiglu".
    tie_output: the output projection is the transposed embedding.
    use_bias: biases on the attention projections.
    scan_layers, remat: how the training pass runs the stack (layer_stack; remat by policy name).
    dtype: compute dtype; param_dtype: storage dtype. Logits are float32.
  """

  def __init__(self, vocab_size: int, *, d_model: int, num_heads: int, num_layers: int, mlp_dim: int,
               num_kv_heads: int | None = None, head_dim: int | None = None, position_encoding: str = "rope",
               max_length: int = 512, rope_scaling: str | None = None, rope_scaling_factor: float = 1.0,
               mrope_sections: tuple[int, ...] | None = None, norm_type: str = "layernorm", mlp_type: str = "mlp", activation: str = "gelu",
               tie_output: bool = True, use_bias: bool = True, dropout_rate: float = 0.0,
               attention_dropout_rate: float = 0.0, scan_layers: bool = False, remat: str = "none",
               implementation: str | None = None, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
      raise ValueError(f"LanguageModel: vocab_size must be an int >= 2, got vocab_size={vocab_size!r}")
    for name, value in (("d_model", d_model), ("num_heads", num_heads), ("num_layers", num_layers),
                        ("mlp_dim", mlp_dim), ("max_length", max_length)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LanguageModel: {name} must be a positive int, got {name}={value!r}")
    for name, value, allowed in (("position_encoding", position_encoding, POSITION_ENCODINGS),
                                 ("norm_type", norm_type, NORM_TYPES), ("mlp_type", mlp_type, MLP_TYPES)):
      if value not in allowed:
        raise ValueError(f"LanguageModel: {name} must be one of {allowed}, got {name}={value!r}")
    layer_stack.remat_policy(remat)  # raises for an unknown policy name
    head_dim = d_model // num_heads if head_dim is None else head_dim
    self.vocab_size, self.d_model, self.num_layers, self.max_length = vocab_size, d_model, num_layers, max_length
    self.position_encoding, self.scan_layers, self.remat, self.dtype = position_encoding, scan_layers, remat, dtype
    common = dict(dtype=dtype, param_dtype=param_dtype)

    self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs, **common,
                           embedding_init=_partitioned(nnx.initializers.normal(d_model ** -0.5), ("vocab", "embed")))
    self.positions = position_layers.make_position_encoding(
        position_encoding, features=d_model, max_length=max_length, num_heads=num_heads, head_dim=head_dim,
        causal=True, rope_scaling=rope_scaling, rope_scaling_factor=rope_scaling_factor,
        mrope_sections=mrope_sections, rngs=rngs, **common)
    self.blocks = layer_stack.create_stack(
        lambda r: LMBlock(d_model, num_heads, mlp_dim, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          norm_type=norm_type, mlp_type=mlp_type, activation=activation, use_bias=use_bias,
                          dropout_rate=dropout_rate, attention_dropout_rate=attention_dropout_rate,
                          rotary=self.positions.rotary, implementation=implementation, rngs=r, **common),
        num_layers, rngs)
    self.final_norm = make_norm(norm_type, d_model, rngs=rngs, **common)
    self.output = None if tie_output else dense.Dense(
        d_model, vocab_size, rngs=rngs, kernel_init=_partitioned(nnx.initializers.lecun_normal(), ("embed", "vocab")),
        **common)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  # --- pieces -----------------------------------------------------------------------------------

  def _embed(self, tokens, prefix, positions, deterministic):
    """tokens [b, t] (after prefix [b, p, d_model]) -> [b, p + t, d_model]: scaled embeddings plus additive
    positions (None = 0.. for every row)."""
    x = self.embed(tokens) * jnp.sqrt(float(self.d_model)).astype(self.dtype)
    if prefix is not None:
      if prefix.ndim != 3 or prefix.shape[0] != tokens.shape[0] or prefix.shape[2] != self.d_model:
        raise ValueError(f"LanguageModel: prefix must be [batch={tokens.shape[0]}, p, d_model={self.d_model}], "
                         f"got prefix{list(prefix.shape)}")
      x = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)
    x = self.positions.add_to_inputs(x, None if positions is None else self._sequence_positions(positions))
    return self.dropout(x, deterministic=deterministic)

  def _sequence_positions(self, positions):
    """The 1D positions [b, t] (for M-RoPE positions [3, b, t]: the temporal axis)."""
    return positions[0] if positions.ndim == 3 else positions

  def _rotary_positions(self, positions):
    """What the rotary layers take: [b, t] for rope, [3, b, t] for mrope (text: the same on every axis)."""
    if self.position_encoding == "mrope" and positions.ndim == 2:
      return jnp.broadcast_to(positions[None], (3, *positions.shape))
    return positions if self.positions.rotary is not None else None

  def _check_positions(self, where, positions, shape):
    positions = jnp.asarray(positions)
    ok = positions.shape == shape or (self.position_encoding == "mrope" and positions.shape == (3, *shape))
    if not ok or not jnp.issubdtype(positions.dtype, jnp.integer):
      also = f" (or [3, {shape[0]}, {shape[1]}] for mrope)" if self.position_encoding == "mrope" else ""
      raise ValueError(f"LanguageModel.{where}: positions must be int {list(shape)}{also}, got "
                       f"{positions.dtype}{list(positions.shape)}")
    return positions.astype(jnp.int32)

  def _logits(self, x):
    x = self.final_norm(x)
    logits = dense.flat_matmul(x, self.embed.attend) if self.output is None else self.output(x)
    return logits.astype(jnp.float32)

  def layers(self):
    """The stacked blocks, one module per layer (slices of the same parameters)."""
    graphdef, state = nnx.split(self.blocks)
    return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state)) for i in range(self.num_layers)]

  def _check_insert(self, insert):
    if insert is None:
      return {}
    bad = [k for k in insert if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.num_layers]
    if bad:
      raise ValueError(f"LanguageModel: insert keys must be layer indices in [0, {self.num_layers}], got {bad}")
    return dict(insert)

  # --- training pass ----------------------------------------------------------------------------

  def __call__(self, tokens, *, positions=None, segment_ids=None, prefix=None, insert: Insert | None = None,
               deterministic: bool = True):
    """tokens [b, t] -> logits [b, p + t, vocab] (float32; p = 0 without prefix).

    positions: int [b, p + t] (mrope: or [3, b, p + t]); None = 0.. for every row. segment_ids: int
    [b, p + t], 1.. per packed document, 0 = padding; attention stays within a document.
    """
    _check_tokens("__call__", tokens)
    batch = tokens.shape[0]
    length = tokens.shape[1] + (0 if prefix is None else prefix.shape[1])
    if positions is not None:
      positions = self._check_positions("__call__", positions, (batch, length))
    x = self._embed(tokens, prefix, positions, deterministic)
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    mask = None
    if segment_ids is not None:
      segment_ids = jnp.asarray(segment_ids)
      if segment_ids.shape != (batch, length):
        raise ValueError(f"LanguageModel.__call__: segment_ids must be [{batch}, {length}], got "
                         f"segment_ids{list(segment_ids.shape)}")
      mask = masks_lib.segment_mask(segment_ids, segment_ids)  # [b, 1, t, t]; the blocks add causality
    flat = self._sequence_positions(positions)
    bias = self.positions.attention_bias(flat, flat)  # [b, heads, t, t] or None
    options = dict(mask=mask, positions=self._rotary_positions(positions), bias=bias, deterministic=deterministic)
    insert = self._check_insert(insert)
    if not insert:
      x = layer_stack.apply_stack(self.blocks, x, scan=self.scan_layers, remat=self.remat, **options)
    else:
      for i, block in enumerate(self.layers()):
        x = insert[i](x) if i in insert else x
        x = block(x, **options)
      x = insert[self.num_layers](x) if self.num_layers in insert else x
    return self._logits(x)

  # --- incremental decoding ---------------------------------------------------------------------

  def init_cache(self, batch_size: int, capacity: int) -> LMCache:
    """An empty cache for up to capacity tokens per row (prompt and generated, prefix included)."""
    for name, value in (("batch_size", batch_size), ("capacity", capacity)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LanguageModel.init_cache: {name} must be a positive int, got {name}={value!r}")
    if self.position_encoding == "learned" and capacity > self.max_length:
      raise ValueError(f"LanguageModel.init_cache: capacity={capacity} positions do not fit the learned position "
                       f"table of {self.max_length} rows (max_length)")
    layers = tuple(block.attention.init_cache(batch_size, capacity) for block in self.layers())
    return LMCache(layers=layers, key_valid=jnp.zeros((batch_size, capacity), bool),
                   key_positions=jnp.zeros((batch_size, capacity), jnp.int32),
                   next_position=jnp.zeros((batch_size,), jnp.int32))

  def prefill(self, tokens, cache: LMCache, *, valid=None, positions=None, prefix=None,
              insert: Insert | None = None):
    """Feeds a (left-padded) prompt tokens [b, t] -> (logits [b, p + t, vocab], advanced cache).

    valid: bool [b, t], False on left padding (default tokens != PAD_ID); a prefix [b, p, d_model] is
    always valid. positions (default: each row's next position onward, counting its real tokens only)
    as in __call__; the row's next position is then one past its largest.
    """
    return self._extend(self.layers(), tokens, cache, valid=valid, positions=positions, prefix=prefix,
                        insert=insert)

  def decode_step(self, tokens, cache: LMCache, *, insert: Insert | None = None):
    """tokens [b, t] (t = 1 per step) continue every row -> (logits [b, t, vocab], cache)."""
    return self._extend(self.layers(), tokens, cache, valid=jnp.ones(tokens.shape, bool), insert=insert)

  def loop_step(self, *, insert: Insert | None = None):
    """`decode_step` with the per-layer parameters sliced out of the stack once, now (for search loops:
    inside `lax.while_loop` XLA would otherwise copy every stacked weight at every step)."""
    layers = self.layers()
    def step(tokens, cache):
      return self._extend(layers, tokens, cache, valid=jnp.ones(tokens.shape, bool), insert=insert)
    return step

  def _extend(self, layers, tokens, cache: LMCache, *, valid=None, positions=None, prefix=None, insert=None):
    _check_tokens("prefill", tokens)
    batch = tokens.shape[0]
    if cache.key_valid.shape[0] != batch:
      raise ValueError(f"LanguageModel.prefill: tokens batch {batch} differs from the cache's {cache.key_valid.shape[0]}")
    valid = (tokens != PAD_ID) if valid is None else jnp.asarray(valid)
    if valid.shape != tokens.shape or valid.dtype != jnp.bool_:
      raise ValueError(f"LanguageModel.prefill: valid must be bool {list(tokens.shape)}, got "
                       f"{valid.dtype}{list(valid.shape)}")
    if prefix is not None:
      valid = jnp.concatenate([jnp.ones(prefix.shape[:2], bool), valid], axis=1)
    length = valid.shape[1]
    if positions is None:
      # Real tokens count up from the row's next position; a padded slot repeats it (it is never seen).
      counted = cache.next_position[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
      positions = jnp.maximum(counted, cache.next_position[:, None])
    else:
      positions = self._check_positions("prefill", positions, (batch, length))
    flat = self._sequence_positions(positions)
    index = cache.layers[0].index
    key_valid = jax.lax.dynamic_update_slice(cache.key_valid, valid, (0, index))
    key_positions = jax.lax.dynamic_update_slice(cache.key_positions, flat, (0, index))
    x = self._embed(tokens, prefix, positions, deterministic=True)
    mask = masks_lib.padding_mask(key_valid)  # [b, 1, 1, capacity]; extend adds causality and the fill
    bias = self.positions.attention_bias(flat, key_positions)  # [b, heads, t, capacity] or None
    rotary = self._rotary_positions(positions)
    insert = self._check_insert(insert)
    new_layers = []
    for i, (block, layer_cache) in enumerate(zip(layers, cache.layers)):
      x = insert[i](x) if i in insert else x
      x, layer_cache = block.decode(x, layer_cache, positions=rotary, mask=mask, bias=bias)
      new_layers.append(layer_cache)
    x = insert[self.num_layers](x) if self.num_layers in insert else x
    all_positions = positions if positions.ndim == 2 else jnp.max(positions, axis=0)
    last = jnp.max(jnp.where(valid, all_positions, -1), axis=1)  # -> [b]; -1 for a row of padding only
    next_position = jnp.maximum(cache.next_position, last + 1)
    cache = LMCache(layers=tuple(new_layers), key_valid=key_valid, key_positions=key_positions,
                    next_position=next_position)
    return self._logits(x), cache


def left_pad(sequences, length: int | None = None, pad_id: int = PAD_ID):
  """Token-id sequences -> (tokens int32 [n, length], valid bool [n, length]), each row right-aligned.

  length: None = the longest sequence. Raises ValueError for an empty sequence or one too long.
  """
  sequences = [list(s) for s in sequences]
  if not sequences or any(not s for s in sequences):
    raise ValueError("left_pad: sequences must be a non-empty list of non-empty id sequences")
  longest = max(map(len, sequences))
  length = longest if length is None else length
  if longest > length:
    raise ValueError(f"left_pad: a sequence of {longest} ids does not fit length={length}")
  tokens = np.full((len(sequences), length), pad_id, np.int32)
  valid = np.zeros((len(sequences), length), bool)
  for row, ids in enumerate(sequences):
    tokens[row, length - len(ids):] = ids
    valid[row, length - len(ids):] = True
  return tokens, valid
