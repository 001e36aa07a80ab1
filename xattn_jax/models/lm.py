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

Positions, one option (`position_encodings()`, from layers.positions): `none`, `learned`,
`sinusoidal` (added to the embeddings), `rope` (optionally scaled) and `mrope` (rotating q and k;
text-only M-RoPE positions are the 1D positions on all three axes, which is 1D RoPE exactly),
`alibi` and `t5_bias` (causal-form biases on the scores). The norm type and MLP kind are the
registries of layers.blocks (`NORM_TYPES`, `MLP_TYPES`).

Randomized positions (`randomized_positions`, a layers.positions.RandomizedPositions; not for mrope):
a training pass given `position_rng` replaces each document's positions 0..n-1 by n sorted distinct
positions drawn from [0, max_position) (`randomized_document_positions`; a row without explicit
positions is one document). Passes without an rng (evaluation) use 0..n-1, or with `at_eval` the same
kind of draw from the fixed key `eval_seed`; a cache then draws one sorted set of positions for its
whole capacity at `init_cache`, and the row's k-th real token takes the k-th of them.

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
from xattn_jax.layers.attention import KVCache, MultiHeadAttention, decode_room, write_head
from xattn_jax.layers.rotary import RotarySpec
from xattn_jax.ops import masks as masks_lib

PAD_ID = 0
RandomizedPositions = position_layers.RandomizedPositions

Insert = Mapping[int, Callable[[jax.Array], jax.Array]]


def position_encodings() -> tuple[str, ...]:
  """The registry's text encodings, read when called: sequence positions, and M-RoPE with text positions on all
  three axes."""
  return position_layers.names(layout=("sequence", "multimodal"))


def _partitioned(init, axes):
  return nnx.with_partitioning(init, axes, eager_sharding=False)


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
    self.mlp = blocks.make_mlp(mlp_type, features, mlp_features, activation=activation, dropout_rate=dropout_rate,
                               **common)
    self.attention_norm = blocks.make_norm(norm_type, features, **common)
    self.mlp_norm = blocks.make_norm(norm_type, features, **common)
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

  key_valid       bool [b, capacity]: the slot holds a real token (False on left padding and unfilled slots)
  key_positions   int32 [b, capacity]: the position of the token in each slot (relative biases)
  next_position   int32 [b]: the index (real tokens so far) of the row's next token; its position
                  unless position_table is set
  position_table  int32 [b, capacity] or None: the position of the row's k-th real token (randomized
                  positions at eval: one sorted draw per row); None = index k is position k
  """
  layers: tuple[KVCache, ...]
  key_valid: jax.Array
  key_positions: jax.Array
  next_position: jax.Array
  position_table: jax.Array | None = None

  @property
  def capacity(self) -> int:
    return self.key_valid.shape[1]

  @property
  def filled(self) -> jax.Array:
    """How many slots are in use (the next slot to fill; left padding included)."""
    return self.layers[0].index

  def head(self, n: int) -> LMCache:
    """The cache of its first n slots (`KVCache.head`), for a decode that fills no more."""
    table = None if self.position_table is None else self.position_table[:, :n]
    return self.replace(layers=tuple(layer.head(n) for layer in self.layers), key_valid=self.key_valid[:, :n],
                        key_positions=self.key_positions[:, :n], position_table=table)

  def with_head(self, head: LMCache) -> LMCache:
    """This cache continued from `head` (a `head(n)` of it, decoded further). Slots past the head are not
    written yet and their drawn positions are the same for every beam of an example, so the head's beam
    reorderings leave them as they are."""
    table = None if self.position_table is None else write_head(self.position_table, head.position_table, 1)
    return head.replace(layers=tuple(full.with_head(part) for full, part in zip(self.layers, head.layers)),
                        key_valid=write_head(self.key_valid, head.key_valid, 1),
                        key_positions=write_head(self.key_positions, head.key_positions, 1), position_table=table)

  def decode_room(self) -> int:
    """How many more tokens the cache holds (its capacity while traced), for decoding's check."""
    return decode_room(self.capacity, self.filled)


def _check_tokens(where: str, tokens) -> None:
  if getattr(tokens, "ndim", None) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"LanguageModel.{where}: tokens must be int [batch, length], got "
                     f"{getattr(tokens, 'dtype', type(tokens))}{list(getattr(tokens, 'shape', ()))}")


def randomized_document_positions(rng, positions, max_position: int) -> jax.Array:
  """Randomized positions for packed rows (Ruoss et al. 2023, per document): positions int [b, t], 0..n-1
  restarting at every document (data.text.pack_documents) -> int32 [b, t] where each document's n tokens
  take n distinct positions from [0, max_position), sorted ascending, a uniform draw for each document.

  A document starts at slot 0 and wherever a position does not exceed the one before it. One random
  ordering of t distinct positions is drawn per row; each document takes the chunk at its own slots,
  sorted (a chunk of a uniformly random ordering is a uniformly random subset). Needs t <= max_position.
  """
  batch, length = positions.shape
  if length > max_position:
    raise ValueError(f"randomized_document_positions: a row of {length} tokens needs max_position >= {length}, "
                     f"got max_position={max_position}")
  _, draw = jax.lax.top_k(jax.random.uniform(rng, (batch, max_position)), length)  # -> [b, t], random order
  slots = jnp.arange(length, dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones((batch, 1), bool), positions[:, 1:] <= positions[:, :-1]], axis=1)
  document = jax.lax.cummax(jnp.where(starts, slots, 0), axis=1)  # -> [b, t]: the slot its document starts at
  # Documents are contiguous, so sorting by (document start, drawn position) sorts within each in place.
  _, ordered = jax.lax.sort((document, draw.astype(jnp.int32)), dimension=1, num_keys=2)
  return ordered


class LanguageModel(nnx.Module):
  """Decoder-only transformer over token ids (id 0 = padding); see the module docstring.

  Ids outside [0, vocab_size) are not checked (a jitted pass cannot read them): they embed as NaN
  (`dense.embed_ids`), and NaN reaches the logits (a search marks such a row INVALID_TOKEN).

  Args:
    vocab_size: number of token ids.
    d_model, num_heads, num_layers, mlp_dim: width, query heads, depth, MLP hidden width.
    num_kv_heads: key / value heads (GQA; 1 = MQA); None = num_heads. head_dim: None = d_model // num_heads.
    position_encoding: one of position_encodings().
    max_length: rows of the learned position table (the longest position it covers).
    randomized_positions: a RandomizedPositions (default off; see the module docstring): max_position
      must cover max_length.
    rope_scaling, rope_scaling_factor: RoPE length scaling, None | "linear" | "ntk".
    mrope_sections: frequency pairs per (time, height, width) axis for mrope; None = Qwen2-VL's split.
    norm_type: "layernorm" | "rmsnorm"; mlp_type: "mlp" (with activation) | "swiglu".
    activation: the "mlp" MLP's activation (layers.blocks).
    tie_output: the output projection is the transposed embedding.
    use_bias: biases on the attention projections.
    dropout_rate: dropout on the embeddings, the residual branches and inside the MLP; attention_dropout_rate:
      on the attention probabilities.
    scan_layers, remat: how the training pass runs the stack (layer_stack; remat by policy name).
    implementation: the attention kernel (`ops.attention.dot_product_attention`'s; None = its default).
    dtype: compute dtype; param_dtype: storage dtype. Logits are float32.
  """

  def __init__(self, vocab_size: int, *, d_model: int, num_heads: int, num_layers: int, mlp_dim: int,
               num_kv_heads: int | None = None, head_dim: int | None = None, position_encoding: str = "rope",
               max_length: int = 512, randomized_positions: RandomizedPositions = RandomizedPositions(),
               rope_scaling: str | None = None, rope_scaling_factor: float = 1.0,
               mrope_sections: tuple[int, ...] | None = None, norm_type: str = "layernorm", mlp_type: str = "mlp",
               activation: str = "gelu",
               tie_output: bool = True, use_bias: bool = True, dropout_rate: float = 0.0,
               attention_dropout_rate: float = 0.0, scan_layers: bool = False, remat: str = "none",
               implementation: str | None = None, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
      raise ValueError(f"LanguageModel: vocab_size must be an int >= 2, got vocab_size={vocab_size!r}")
    for name, value in (("d_model", d_model), ("num_heads", num_heads), ("num_layers", num_layers),
                        ("mlp_dim", mlp_dim), ("max_length", max_length)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LanguageModel: {name} must be a positive int, got {name}={value!r}")
    for name, value, allowed in (("position_encoding", position_encoding, position_encodings()),
                                 ("norm_type", norm_type, blocks.NORM_TYPES),
                                 ("mlp_type", mlp_type, blocks.MLP_TYPES)):
      if value not in allowed:
        raise ValueError(f"LanguageModel: {name} must be one of {tuple(allowed)}, got {name}={value!r}")
    if not isinstance(randomized_positions, RandomizedPositions):
      raise ValueError(f"LanguageModel: randomized_positions must be a RandomizedPositions, got "
                       f"{type(randomized_positions).__name__}")
    if randomized_positions.max_position and randomized_positions.max_position < max_length:
      raise ValueError(f"LanguageModel: randomized_positions.max_position must be >= max_length={max_length} (every "
                       f"position a row can hold must be drawable), got {randomized_positions.max_position}")
    for name, rate in (("dropout_rate", dropout_rate), ("attention_dropout_rate", attention_dropout_rate)):
      blocks.check_dropout_rate(rate, name, "LanguageModel")
    layer_stack.remat_policy(remat)  # raises for an unknown policy name
    if head_dim is None and d_model % num_heads:  # as MultiHeadAttention: no silently floored head width
      raise ValueError(f"LanguageModel: d_model must be divisible by num_heads when head_dim is None, got "
                       f"d_model={d_model}, num_heads={num_heads}")
    head_dim = d_model // num_heads if head_dim is None else head_dim
    self.vocab_size, self.d_model, self.num_layers, self.max_length = vocab_size, d_model, num_layers, max_length
    self.position_encoding, self.scan_layers, self.remat, self.dtype = position_encoding, scan_layers, remat, dtype
    entry = position_layers.get(position_encoding)
    # Multimodal positions [3, b, t] (M-RoPE); a table of max_length rows bounds the cache.
    self.multimodal_positions, self.max_length_table = "multimodal" in entry.layouts, entry.max_length_table
    common = dict(dtype=dtype, param_dtype=param_dtype)

    self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs, **common,
                           embedding_init=_partitioned(nnx.initializers.normal(d_model ** -0.5), ("vocab", "embed")))
    self.positions = position_layers.make_position_encoding(
        position_encoding, features=d_model, max_length=max_length, num_heads=num_heads, head_dim=head_dim,
        causal=True, rope_scaling=rope_scaling, rope_scaling_factor=rope_scaling_factor,
        mrope_sections=mrope_sections, randomized=randomized_positions, rngs=rngs, **common)
    self.blocks = layer_stack.create_stack(
        lambda r: LMBlock(d_model, num_heads, mlp_dim, num_kv_heads=num_kv_heads, head_dim=head_dim,
                          norm_type=norm_type, mlp_type=mlp_type, activation=activation, use_bias=use_bias,
                          dropout_rate=dropout_rate, attention_dropout_rate=attention_dropout_rate,
                          rotary=self.positions.rotary, implementation=implementation, rngs=r, **common),
        num_layers, rngs)
    self.final_norm = blocks.make_norm(norm_type, d_model, rngs=rngs, **common)
    self.output = None if tie_output else dense.Dense(
        d_model, vocab_size, rngs=rngs, kernel_init=_partitioned(nnx.initializers.lecun_normal(), ("embed", "vocab")),
        **common)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

  # --- pieces -----------------------------------------------------------------------------------

  def _embed(self, tokens, prefix, positions, deterministic):
    """tokens [b, t] (after prefix [b, p, d_model]) -> [b, p + t, d_model]: scaled embeddings plus additive
    positions (None = 0.. for every row)."""
    x = dense.embed_ids(self.embed, tokens) * jnp.sqrt(float(self.d_model)).astype(self.dtype)
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
    if self.multimodal_positions and positions.ndim == 2:
      return jnp.broadcast_to(positions[None], (3, *positions.shape))
    return positions if self.positions.rotary is not None else None

  def _check_positions(self, where, positions, shape):
    positions = jnp.asarray(positions)
    ok = positions.shape == shape or (self.multimodal_positions and positions.shape == (3, *shape))
    if not ok or not jnp.issubdtype(positions.dtype, jnp.integer):
      also = f" (or [3, {shape[0]}, {shape[1]}] for {self.position_encoding})" if self.multimodal_positions else ""
      raise ValueError(f"LanguageModel.{where}: positions must be int {list(shape)}{also}, got "
                       f"{positions.dtype}{list(positions.shape)}")
    return positions.astype(jnp.int32)

  def _randomized(self, positions, rng):
    """positions [b, t] (0.. per document) as the pass uses them: drawn per document when randomized
    positions are on and an rng is given (or at_eval, from the fixed key), else as given."""
    randomized = self.positions.randomized
    if not randomized.max_position or (rng is None and not randomized.at_eval) or positions.ndim != 2:
      return positions
    key = jax.random.key(randomized.eval_seed) if rng is None else rng
    return randomized_document_positions(key, positions, randomized.max_position)

  def _logits(self, x, output_table=None):
    """x [b, t, d_model] -> float32 logits [b, t, vocab]. output_table: the tied embedding transposed,
    [d_model, vocab], made once by `loop_step` (a step then streams it in the matmul's own layout)."""
    x = self.final_norm(x)
    if self.output is not None:
      logits = self.output(x)
    elif output_table is not None:
      logits = dense.flat_matmul(x.astype(self.dtype), lambda rows: rows @ output_table)
    else:
      logits = dense.flat_matmul(x, self.embed.attend)
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
               position_rng=None, deterministic: bool = True):
    """tokens [b, t] -> logits [b, p + t, vocab] (float32; p = 0 without prefix).

    positions: int [b, p + t] (mrope: or [3, b, p + t]); None = 0.. for every row. segment_ids: int
    [b, p + t], 1.. per packed document, 0 = padding; attention stays within a document.
    position_rng: a training pass's key for randomized positions (per document); None = the
    evaluation positions.
    """
    _check_tokens("__call__", tokens)
    batch = tokens.shape[0]
    length = tokens.shape[1] + (0 if prefix is None else prefix.shape[1])
    if positions is not None:
      positions = self._randomized(self._check_positions("__call__", positions, (batch, length)), position_rng)
    else:
      positions, _ = self.positions.sequence_positions(batch, length, rng=position_rng)  # -> [b, p + t]
    x = self._embed(tokens, prefix, positions, deterministic)
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
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"LanguageModel.init_cache: {name} must be a positive int, got {name}={value!r}")
    batch_size, capacity = int(batch_size), int(capacity)  # NumPy ints (a shape read from an array) as Python's
    randomized = self.positions.randomized
    drawn = bool(randomized.max_position and randomized.at_eval)
    if drawn and capacity > randomized.max_position:
      raise ValueError(f"LanguageModel.init_cache: capacity={capacity} tokens need as many distinct randomized "
                       f"positions, more than max_position={randomized.max_position}")
    if not drawn and self.max_length_table and capacity > self.max_length:
      raise ValueError(f"LanguageModel.init_cache: capacity={capacity} positions do not fit the learned position "
                       f"table of {self.max_length} rows (max_length)")
    # At eval with randomized positions: one sorted draw for the whole capacity (a step reads its prefix).
    table = self.positions.sequence_positions(batch_size, capacity)[0] if drawn else None  # [b, capacity]
    layers = tuple(block.attention.init_cache(batch_size, capacity) for block in self.layers())
    return LMCache(layers=layers, key_valid=jnp.zeros((batch_size, capacity), bool),
                   key_positions=jnp.zeros((batch_size, capacity), jnp.int32),
                   next_position=jnp.zeros((batch_size,), jnp.int32), position_table=table)

  def prefill(self, tokens, cache: LMCache, *, valid=None, positions=None, prefix=None, prefix_valid=None,
              insert: Insert | None = None):
    """Feeds a (left-padded) prompt tokens [b, t] -> (logits [b, p + t, vocab], advanced cache).

    valid: bool [b, t], False on left padding (default tokens != PAD_ID); a prefix [b, p, d_model] is
    valid where prefix_valid bool [b, p] is (default: everywhere; left padding of a prompt given
    whole as embeddings, tokens [b, 0]). positions (default: each row's next position onward, counting its real tokens only)
    as in __call__; the row's next position is then one past its largest. With a cache's
    position_table (randomized positions at eval) positions are indices into it.
    """
    return self._extend(self.layers(), tokens, cache, valid=valid, positions=positions, prefix=prefix,
                        prefix_valid=prefix_valid, insert=insert)

  def decode_step(self, tokens, cache: LMCache, *, insert: Insert | None = None):
    """tokens [b, t] (t = 1 per step) continue every row -> (logits [b, t, vocab], cache)."""
    return self._extend(self.layers(), tokens, cache, valid=jnp.ones(tokens.shape, bool), insert=insert,
                        where="decode_step")

  def loop_step(self, *, transpose_kernels: bool = True):
    """`decode_step` with the per-layer parameters sliced out of the stack once, now (for search loops:
    inside `lax.while_loop` XLA would otherwise copy every stacked weight at every step), their kernels
    stored [out, in] (`dense.loop_kernels`; `transpose_kernels=False` keeps them [in, out]). The step
    takes `insert=` per call (a host model whose inserted layers read state carried in its cache)."""
    layers_at = dense.loop_kernels(self.layers(), transpose=transpose_kernels)
    table = None if self.output is not None else self.embed.embedding[...].T.astype(self.dtype)
    def step(tokens, cache, *, insert=None):
      return self._extend(layers_at(tokens), tokens, cache, valid=jnp.ones(tokens.shape, bool), insert=insert,
                          output_table=table, where="loop_step")
    return step

  def _extend(self, layers, tokens, cache: LMCache, *, valid=None, positions=None, prefix=None, prefix_valid=None,
              insert=None, output_table=None, where="prefill"):
    _check_tokens(where, tokens)
    batch = tokens.shape[0]
    if cache.key_valid.shape[0] != batch:
      raise ValueError(f"LanguageModel.{where}: tokens batch {batch} differs from the cache's {cache.key_valid.shape[0]}")
    # zip would run only as many layers as the shorter of the two, without a word.
    if len(cache.layers) != self.num_layers:
      raise ValueError(f"LanguageModel.{where}: cache has {len(cache.layers)} layers, the model "
                       f"num_layers={self.num_layers} (a cache of another model)")
    valid = (tokens != PAD_ID) if valid is None else jnp.asarray(valid)
    if valid.shape != tokens.shape or valid.dtype != jnp.bool_:
      raise ValueError(f"LanguageModel.{where}: valid must be bool {list(tokens.shape)}, got "
                       f"{valid.dtype}{list(valid.shape)}")
    if prefix is not None:
      prefix_valid = jnp.ones(prefix.shape[:2], bool) if prefix_valid is None else jnp.asarray(prefix_valid)
      if prefix_valid.shape != prefix.shape[:2] or prefix_valid.dtype != jnp.bool_:
        raise ValueError(f"LanguageModel.prefill: prefix_valid must be bool {list(prefix.shape[:2])}, got "
                         f"{prefix_valid.dtype}{list(prefix_valid.shape)}")
      valid = jnp.concatenate([prefix_valid, valid], axis=1)
    length = valid.shape[1]
    if length > cache.capacity:  # the slot updates below would fail in XLA with a shape error
      raise ValueError(f"LanguageModel.{where}: {length} tokens (prefix included) do not fit the cache's "
                       f"capacity={cache.capacity}")
    if positions is None:
      # Real tokens count up from the row's next index; a padded slot repeats it (it is never seen).
      counted = cache.next_position[:, None] + jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1
      indices = jnp.maximum(counted, cache.next_position[:, None])
    else:
      indices = self._check_positions("prefill", positions, (batch, length))
    positions = indices
    if cache.position_table is not None:  # the k-th real token takes the cache's k-th drawn position
      positions = jnp.take_along_axis(cache.position_table, jnp.minimum(indices, cache.capacity - 1), axis=1)
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
    all_indices = indices if indices.ndim == 2 else jnp.max(indices, axis=0)
    last = jnp.max(jnp.where(valid, all_indices, -1), axis=1)  # -> [b]; -1 for a row of padding only
    next_position = jnp.maximum(cache.next_position, last + 1)
    cache = LMCache(layers=tuple(new_layers), key_valid=key_valid, key_positions=key_positions,
                    next_position=next_position, position_table=cache.position_table)
    return self._logits(x, output_table), cache


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
