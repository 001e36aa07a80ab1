"""The encoder-decoder translator of Vaswani et al. (2017), composed from the shared layers.

  encode(inputs [b, s])                      -> memory [b, s, encoder.d_model]
  __call__(inputs [b, s], decoder_inputs [b, t]) -> logits [b, t, vocab]   (training, teacher forcing)
  init_cache(memory, memory_valid [b, s], max_length) -> TranslatorCache
  decode_step(tokens [b, t], cache)          -> (logits [b, t, vocab], cache)
  loop_step()                                -> decode_step with per-layer weights sliced once (for loops)

The encoder is a stack of bidirectional self-attention blocks; each decoder block runs causal
self-attention over the target so far, cross-attention from the target to the encoder output
(masked only by the source padding) and an MLP. Token id 0 is padding in both streams.

The decode cache holds, per decoder layer, the self-attention keys/values (filled as tokens arrive)
and the cross-attention keys/values projected from the memory once per source sentence, plus the
memory's padding mask, the target positions of every cache row and the next row to fill. For beam
search it expands and reorders itself (`TranslatorCache.expand_beams` / `reorder_beams`): the
memory's keys / values stay one per source sentence, shared by its beams, and the self-attention
caches are reordered by index (`KVCache` beam layout) instead of copied every step.

Positions: explicit ones (packed rows) are used as given; otherwise each side's position module
chooses them (`layers.positions.RandomizedPositions`): 0..t-1, or with randomized positions a
sorted random subset of [0, max_position) drawn from the `position_rng` a training pass passes in.

The blocks are stacked (`layers.layer_stack`): the training pass runs them with `nnx.scan` when
`scan_layers` is set, else as a Python loop over the same stacked parameters, so checkpoints do not
depend on the switch. Decoding always loops over the layers, so each layer's cache is updated in
place inside the decode loop instead of being restacked every step.
"""
from __future__ import annotations

import dataclasses
import functools

import chex
import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from xattn_jax.layers import blocks
from xattn_jax.layers import dense
from xattn_jax.layers import positions as position_layers
from xattn_jax.layers.attention import decode_room, write_head
from xattn_jax.ops import masks as masks_lib
from xattn_jax.layers import layer_stack

PAD_ID = 0
RandomizedPositions = position_layers.RandomizedPositions


def position_encodings() -> tuple[str, ...]:
  """The encodings of layers.positions that take sequence positions [b, t] (additive, rotary, or a relative bias
  on the self-attention scores), read from the registry when called."""
  return position_layers.names(layout="sequence")


@dataclasses.dataclass(frozen=True)
class StackSize:
  """Width and depth of one side (encoder or decoder)."""
  d_model: int
  num_heads: int
  num_layers: int
  mlp_dim: int

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"StackSize: {field.name} must be a positive int, got {field.name}={value!r}")


@flax.struct.dataclass
class TranslatorCache:
  """Decode state: one DecoderCache per layer, the memory's padding mask [b, 1, 1, s], the target
  position of every cache row [b, capacity] (int32) and the index of the next row to fill (int32
  scalar, the same for every row)."""
  layers: tuple[blocks.DecoderCache, ...]
  memory_mask: jax.Array
  positions: jax.Array
  position: jax.Array

  @property
  def capacity(self) -> int:
    """How many target positions the self-attention caches hold."""
    return self.layers[0].self_attention.max_length

  @property
  def filled(self) -> jax.Array:
    """How many of them are filled (the next row to fill)."""
    return self.position

  def decode_room(self) -> int:
    """How many more target tokens the self-attention caches hold (their capacity while traced)."""
    return decode_room(self.capacity, self.filled)

  def head(self, n: int) -> TranslatorCache:
    """The cache of the first n target positions (`KVCache.head`), for a decode that fills no more."""
    return self.replace(layers=tuple(layer.head(n) for layer in self.layers), positions=self.positions[:, :n])

  def with_head(self, head: TranslatorCache) -> TranslatorCache:
    """This cache continued from `head` (a `head(n)` of it, decoded further). Positions past the head are
    the same for every beam of an example, so the head's beam reorderings leave them as they are."""
    return head.replace(layers=tuple(full.with_head(part) for full, part in zip(self.layers, head.layers)),
                        positions=write_head(self.positions, head.positions, 1))

  def expand_beams(self, beam_size: int) -> TranslatorCache:
    """The cache for beam_size beams per example (rows b * beams + j): the self-attention caches in
    the beam layout (`KVCache.expand_beams`); the memory's keys / values and mask stay one per example,
    read once by all of its beams (`MultiHeadAttention.attend`), the keys transposed (`MemoryCache`)."""
    layers = tuple(layer.replace(self_attention=layer.self_attention.expand_beams(beam_size),
                                 cross_attention=layer.cross_attention.transpose_keys())
                   for layer in self.layers)
    return self.replace(layers=layers, positions=jnp.repeat(self.positions, beam_size, axis=0))

  def reorder_beams(self, parent) -> TranslatorCache:
    """Beam j of example b continues beam parent[b, j] (int [batch, beams]): the self-attention caches
    rewrite their ancestry (no keys / values move); the memory's are the same for every beam."""
    batch, beams = parent.shape
    rows = (jnp.arange(batch)[:, None] * beams + parent).reshape(-1)  # -> [batch * beams]
    layers = tuple(layer.replace(self_attention=layer.self_attention.reorder_beams(parent)) for layer in self.layers)
    return self.replace(layers=layers, positions=jnp.take(self.positions, rows, axis=0))


def _check_tokens(name: str, tokens) -> None:
  # an empty batch or length failed inside the attention op, naming its query, not this argument
  if getattr(tokens, "ndim", None) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer) or 0 in tokens.shape:
    raise ValueError(f"Translator: {name} must be int [batch, length] with batch and length >= 1, got "
                     f"{getattr(tokens, 'dtype', type(tokens))}{list(getattr(tokens, 'shape', ()))}")


def _positions(encoding, tokens, positions, rng=None, name="positions"):
  """Explicit positions [b, t] as given, else the ones the position module chooses for tokens [b, t]."""
  if positions is not None:
    positions = jnp.asarray(positions)
    if positions.shape != tokens.shape or not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"Translator: {name} must be int {list(tokens.shape)}, got "
                       f"{positions.dtype}{list(positions.shape)}")
    return positions
  return encoding.sequence_positions(*tokens.shape, rng=rng)[0]


def _split(rng):
  """(source key, target key) of a training pass's position key, or (None, None)."""
  return (None, None) if rng is None else tuple(jax.random.split(rng))


class Translator(nnx.Module):
  """Encoder-decoder transformer over one shared token id space (id 0 = padding).

  Ids outside [0, vocab_size) are not checked (a jitted pass cannot read them): they embed as NaN
  (`dense.embed_ids`), and NaN reaches the logits (a search marks such a row INVALID_TOKEN).

  Args:
    vocab_size: number of token ids (source and target share the id space).
    encoder, decoder: StackSize of each side; their widths may differ (the decoder's
      cross-attention reads encoder.d_model-wide memories).
    position_encoding: a name in position_encodings() (added to the embeddings, rotating the
      self-attention queries and keys, or biasing the self-attention scores; the decoder's relative
      biases use the causal form).
    max_length: longest sequence the learned position table covers (and the rope/sinusoidal
      positions are meant for).
    randomized_positions: a RandomizedPositions option (default off): training passes given a
      `position_rng` draw positions from [0, max_position), which must cover max_length.
    rope_scaling, rope_scaling_factor: RoPE length scaling, "linear" (position interpolation) or
      "ntk" (base scaling), or None.
    share_embeddings: one embedding table for source and target (needs equal widths).
    tie_output: the output projection is the transposed target embedding.
    norm: "pre" (LayerNorm inside each residual, plus a final LayerNorm) or "post" (Vaswani).
    scan_layers, remat: how the training pass runs the stacks (see module doc; remat by name).
    dtype: compute dtype (e.g. bfloat16 for mixed precision); param_dtype: storage dtype. Logits
      are returned in float32.
  """

  def __init__(self, vocab_size: int, *, encoder: StackSize, decoder: StackSize,
               position_encoding: str = "sinusoidal", max_length: int = 256,
               randomized_positions: RandomizedPositions = RandomizedPositions(), rope_scaling: str | None = None,
               rope_scaling_factor: float = 1.0, share_embeddings: bool = True,
               tie_output: bool = True, norm: str = "pre", dropout_rate: float = 0.0,
               attention_dropout_rate: float = 0.0, activation: str = "relu", scan_layers: bool = False,
               remat: str = "none", implementation: str | None = None, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not isinstance(vocab_size, int) or vocab_size < 2:
      raise ValueError(f"Translator: vocab_size must be an int >= 2, got vocab_size={vocab_size!r}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
      raise ValueError(f"Translator: max_length must be a positive int, got max_length={max_length!r}")
    for name, side in (("encoder", encoder), ("decoder", decoder)):
      if not isinstance(side, StackSize):
        raise ValueError(f"Translator: {name} must be a StackSize, got {name}={side!r}")
    if position_encoding not in position_encodings():
      raise ValueError(f"Translator: position_encoding must be one of {position_encodings()}, "
                       f"got position_encoding={position_encoding!r}")
    if share_embeddings and encoder.d_model != decoder.d_model:
      raise ValueError(f"Translator: share_embeddings needs encoder.d_model == decoder.d_model, got "
                       f"{encoder.d_model} and {decoder.d_model}")
    if randomized_positions.max_position and randomized_positions.max_position < max_length:
      raise ValueError(f"Translator: randomized_positions.max_position must be >= max_length={max_length} (every "
                       f"sequence position must be drawable), got {randomized_positions.max_position}")
    for name, rate in (("dropout_rate", dropout_rate), ("attention_dropout_rate", attention_dropout_rate)):
      blocks.check_dropout_rate(rate, name, "Translator")
    layer_stack.remat_policy(remat)  # raises for an unknown policy name
    self.vocab_size, self.max_length, self.norm = vocab_size, max_length, norm
    self.share_embeddings, self.tie_output = share_embeddings, tie_output
    self.scan_layers, self.remat, self.dtype = scan_layers, remat, dtype
    self.position_encoding = position_encoding
    common = dict(dtype=dtype, param_dtype=param_dtype)

    def embed(features):
      init = nnx.with_partitioning(nnx.initializers.normal(features ** -0.5), ("vocab", "embed"),
                                   eager_sharding=False)
      return nnx.Embed(vocab_size, features, embedding_init=init, rngs=rngs, **common)

    def positions(side: StackSize, causal: bool):
      return position_layers.make_position_encoding(
          position_encoding, features=side.d_model, max_length=max_length, num_heads=side.num_heads,
          head_dim=side.d_model // side.num_heads, causal=causal, rope_scaling=rope_scaling,
          rope_scaling_factor=rope_scaling_factor, randomized=randomized_positions, rngs=rngs, **common)

    self.source_embed = embed(encoder.d_model)
    self.target_embed = None if share_embeddings else embed(decoder.d_model)
    self.source_positions, self.target_positions = positions(encoder, False), positions(decoder, True)
    block_options = dict(norm=norm, dropout_rate=dropout_rate, attention_dropout_rate=attention_dropout_rate,
                         activation=activation, implementation=implementation, **common)
    self.encoder_blocks = layer_stack.create_stack(
        lambda r: blocks.EncoderBlock(encoder.d_model, encoder.num_heads, encoder.mlp_dim,
                                      rotary=self.source_positions.rotary, rngs=r, **block_options),
        encoder.num_layers, rngs)
    self.decoder_blocks = layer_stack.create_stack(
        lambda r: blocks.DecoderBlock(decoder.d_model, decoder.num_heads, decoder.mlp_dim,
                                      memory_features=encoder.d_model, rotary=self.target_positions.rotary,
                                      rngs=r, **block_options),
        decoder.num_layers, rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    def layer_norm(features):
      init = lambda base: nnx.with_partitioning(base, ("embed",), eager_sharding=False)
      return nnx.LayerNorm(features, scale_init=init(nnx.initializers.ones_init()),
                           bias_init=init(nnx.initializers.zeros_init()), rngs=rngs, **common)

    # Pre-norm residual streams are never normalised inside the stack; post-norm ones already are.
    self.encoder_norm = layer_norm(encoder.d_model) if norm == "pre" else None
    self.decoder_norm = layer_norm(decoder.d_model) if norm == "pre" else None
    self.output = None if tie_output else dense.Dense(
        decoder.d_model, vocab_size, rngs=rngs,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "vocab"),
                                          eager_sharding=False), **common)
    self.encoder_size, self.decoder_size = encoder, decoder

  # --- pieces -----------------------------------------------------------------------------------

  def _target_table(self) -> nnx.Embed:
    return self.source_embed if self.target_embed is None else self.target_embed

  def _embed(self, table: nnx.Embed, position_encoding, tokens, positions, deterministic):
    """tokens [b, t], positions [b, t] -> [b, t, d_model]: scaled embeddings (Vaswani et al.) plus
    additive positions."""
    x = dense.embed_ids(table, tokens) * jnp.sqrt(float(table.features)).astype(self.dtype)
    x = position_encoding.add_to_inputs(x, positions)
    return self.dropout(x, deterministic=deterministic)

  def _logits(self, x, output_kernel=None):
    """Decoder output [b, t, d_model] -> float32 logits [b, t, vocab].

    output_kernel: the tied output projection already transposed, [d_model, vocab] (`loop_step`
    makes it once per loop), or None.
    """
    if self.decoder_norm is not None:
      x = self.decoder_norm(x)
    if output_kernel is not None:
      logits = dense.flat_matmul(x.astype(output_kernel.dtype), lambda rows: rows @ output_kernel)
    elif self.output is None:
      logits = dense.flat_matmul(x, self._target_table().attend)
    else:
      logits = self.output(x)
    return logits.astype(jnp.float32)

  def decoder_layers(self):
    """The stacked decoder blocks, one module per layer (slices of the same parameters)."""
    graphdef, state = nnx.split(self.decoder_blocks)
    return [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            for i in range(self.decoder_size.num_layers)]

  @staticmethod
  def memory_mask(inputs, *, inputs_segmentation=None, targets_segmentation=None):
    """Cross-attention mask: source padding [b, 1, 1, s], or same-segment [b, 1, t, s] when packed."""
    if inputs_segmentation is not None and targets_segmentation is not None:
      return masks_lib.segment_mask(targets_segmentation, inputs_segmentation)
    return masks_lib.padding_mask(inputs != PAD_ID)

  # --- public passes ----------------------------------------------------------------------------

  def encode(self, inputs, *, inputs_positions=None, inputs_segmentation=None, position_rng=None,
             deterministic: bool = True):
    """inputs [b, s] -> memory [b, s, encoder.d_model]; padded rows of the memory are ignored later.

    position_rng: a key for randomized positions (training passes); None = the evaluation positions.
    """
    _check_tokens("inputs", inputs)
    positions = _positions(self.source_positions, inputs, inputs_positions, position_rng, "inputs_positions")  # [b, s]
    if inputs_segmentation is None:
      mask = masks_lib.padding_mask(inputs != PAD_ID)  # [b, 1, 1, s]
    else:
      mask = masks_lib.segment_mask(inputs_segmentation, inputs_segmentation)  # [b, 1, s, s]
    x = self._embed(self.source_embed, self.source_positions, inputs, positions, deterministic)
    bias = self.source_positions.attention_bias(positions, positions)  # [b, heads, s, s] or None
    x = layer_stack.apply_stack(self.encoder_blocks, x, scan=self.scan_layers, remat=self.remat, mask=mask,
                                positions=positions, bias=bias, deterministic=deterministic)
    memory = x if self.encoder_norm is None else self.encoder_norm(x)
    chex.assert_shape(memory, (*inputs.shape, self.encoder_size.d_model))
    return memory

  def decode(self, decoder_inputs, memory, memory_mask, *, targets_positions=None, targets_segmentation=None,
             position_rng=None, deterministic: bool = True):
    """Full teacher-forced decoder pass: decoder_inputs [b, t] -> logits [b, t, vocab] (float32)."""
    _check_tokens("decoder_inputs", decoder_inputs)
    positions = _positions(self.target_positions, decoder_inputs, targets_positions, position_rng,
                           "targets_positions")  # [b, t]
    x = self._embed(self._target_table(), self.target_positions, decoder_inputs, positions, deterministic)
    return self.decode_embeddings(x, memory, memory_mask, targets_positions=positions,
                                  targets_segmentation=targets_segmentation, deterministic=deterministic)

  def decode_embeddings(self, x, memory, memory_mask, *, targets_positions=None, targets_segmentation=None,
                        position_rng=None, deterministic: bool = True):
    """The decoder stack and output layer on embedded targets x [b, t, decoder.d_model] -> logits."""
    chex.assert_rank(x, 3)
    positions = _positions(self.target_positions, x[..., 0], targets_positions, position_rng, "targets_positions")
    self_mask = None if targets_segmentation is None else masks_lib.segment_mask(
        targets_segmentation, targets_segmentation)  # [b, 1, t, t]; the block adds the causal mask
    self_bias = self.target_positions.attention_bias(positions, positions)  # [b, heads, t, t] or None
    x = layer_stack.apply_stack(self.decoder_blocks, x, memory, scan=self.scan_layers, remat=self.remat,
                                self_mask=self_mask, positions=positions, memory_mask=memory_mask,
                                self_bias=self_bias, deterministic=deterministic)
    return self._logits(x)

  def __call__(self, inputs, decoder_inputs, *, inputs_positions=None, inputs_segmentation=None,
               targets_positions=None, targets_segmentation=None, position_rng=None, deterministic: bool = True):
    """Training pass: inputs [b, s], decoder_inputs [b, t] (BOS + target[:-1]) -> logits [b, t, vocab].

    For packed rows pass the segment ids (0 = padding) and per-segment positions of both streams.
    position_rng: the key randomized positions are drawn from (a training step's; split between the
    encoder and the decoder); None = the positions evaluation uses.
    """
    source_rng, target_rng = _split(position_rng)
    if (inputs_segmentation is None) != (targets_segmentation is None):
      raise ValueError("Translator: pass both inputs_segmentation and targets_segmentation (packed rows) or "
                       "neither")
    memory = self.encode(inputs, inputs_positions=inputs_positions, inputs_segmentation=inputs_segmentation,
                         position_rng=source_rng, deterministic=deterministic)
    memory_mask = self.memory_mask(inputs, inputs_segmentation=inputs_segmentation,
                                   targets_segmentation=targets_segmentation)
    return self.decode(decoder_inputs, memory, memory_mask, targets_positions=targets_positions,
                       targets_segmentation=targets_segmentation, position_rng=target_rng,
                       deterministic=deterministic)

  # --- incremental decoding ---------------------------------------------------------------------

  def init_cache(self, memory, memory_valid, max_length: int) -> TranslatorCache:
    """A cache for up to max_length target tokens; projects the memory's keys/values once per layer.

    memory [b, s, encoder.d_model]; memory_valid bool [b, s] (True = real source token).
    """
    if memory.ndim != 3 or memory.shape[-1] != self.encoder_size.d_model:
      raise ValueError(f"Translator.init_cache: memory must be [batch, length, {self.encoder_size.d_model}], "
                       f"got memory{list(memory.shape)}")
    if memory_valid.shape != memory.shape[:2] or memory_valid.dtype != jnp.bool_:
      raise ValueError(f"Translator.init_cache: memory_valid must be bool {list(memory.shape[:2])}, got "
                       f"{memory_valid.dtype}{list(memory_valid.shape)}")
    if not isinstance(max_length, int) or max_length < 1:
      raise ValueError(f"Translator.init_cache: max_length must be a positive int, got {max_length!r}")
    # The positions of every row the cache will hold; a learned table that cannot hold them raises
    # here (decoding would read NaN rows past the table, which a search turns into tokens).
    try:
      positions, _ = self.target_positions.sequence_positions(memory.shape[0], max_length)  # [b, capacity]
    except ValueError as error:
      raise ValueError(f"Translator.init_cache: max_length={max_length} target positions: {error}") from None
    layers = tuple(block.init_cache(memory, max_length) for block in self.decoder_layers())
    return TranslatorCache(layers=layers, memory_mask=masks_lib.padding_mask(memory_valid), positions=positions,
                           position=jnp.zeros((), jnp.int32))

  def decode_step(self, tokens, cache: TranslatorCache):
    """Feeds tokens [b, t] (t = 1 per step, or a prompt) -> (logits [b, t, vocab], advanced cache)."""
    return self._decode_step(lambda tokens: self.decoder_layers(), None, tokens, cache)

  def loop_step(self, *, transpose_kernels: bool = True):
    """`decode_step` with the decoder's per-layer parameters sliced out of the stack once, now, their
    kernels stored [out, in] (`dense.loop_kernels`; `transpose_kernels=False` keeps them [in, out]), and a
    tied output projection transposed once, to [d_model, vocab].

    Use it as the step of a decoding loop: inside `lax.while_loop` XLA does not hoist the slices of
    the loop-invariant stacked weights, so `decode_step` there would copy every decoder weight at
    every step (a fifth of a d512 greedy step on CPU); and XLA:CPU's matmul of a few rows against the
    [vocab, d_model] embedding table contracted on its minor axis is slower than against its transpose.
    """
    output_kernel = None
    if self.output is None:
      table = self._target_table()
      embedding = table.embedding[...]
      output_kernel = embedding.astype(table.dtype or embedding.dtype).T  # -> [d_model, vocab]
    return functools.partial(self._decode_step, dense.loop_kernels(self.decoder_layers(), transpose=transpose_kernels),
                             output_kernel)

  def _decode_step(self, layers_at, output_kernel, tokens, cache: TranslatorCache):
    """layers_at(tokens) -> the decoder's blocks (`dense.loop_kernels`' function in a loop)."""
    _check_tokens("tokens", tokens)
    # zip would run only as many layers as the shorter of the two; a slice past the capacity fails in XLA.
    if len(cache.layers) != self.decoder_size.num_layers:
      raise ValueError(f"Translator.decode_step: cache has {len(cache.layers)} layers, the decoder "
                       f"num_layers={self.decoder_size.num_layers} (a cache of another model)")
    if tokens.shape[0] != cache.positions.shape[0]:
      raise ValueError(f"Translator.decode_step: tokens batch {tokens.shape[0]} differs from the cache's "
                       f"{cache.positions.shape[0]} rows")
    if tokens.shape[1] > cache.capacity:
      raise ValueError(f"Translator.decode_step: {tokens.shape[1]} tokens do not fit the cache's "
                       f"capacity={cache.capacity}")
    layers = layers_at(tokens)
    positions = jax.lax.dynamic_slice_in_dim(cache.positions, cache.position, tokens.shape[1], axis=1)  # [b, t]
    x = self._embed(self._target_table(), self.target_positions, tokens, positions, deterministic=True)
    # A relative bias between these queries and every cache row (rows past the fill are masked).
    self_bias = self.target_positions.attention_bias(positions, cache.positions)  # [b, heads, t, capacity]
    new_layers = []
    for block, layer_cache in zip(layers, cache.layers):
      x, layer_cache = block.decode(x, layer_cache, positions=positions, memory_mask=cache.memory_mask,
                                    self_bias=self_bias)
      new_layers.append(layer_cache)
    cache = cache.replace(layers=tuple(new_layers), position=cache.position + tokens.shape[1])
    return self._logits(x, output_kernel), cache

  # --- inspection -------------------------------------------------------------------------------

  def cross_attention_weights(self, inputs, decoder_inputs):
    """Cross-attention probabilities [layers, b, heads, t, s] of the teacher-forced pass (for plots)."""
    _check_tokens("decoder_inputs", decoder_inputs)
    memory = self.encode(inputs)
    memory_mask = self.memory_mask(inputs)
    positions = _positions(self.target_positions, decoder_inputs, None)
    x = self._embed(self._target_table(), self.target_positions, decoder_inputs, positions, deterministic=True)
    self_bias = self.target_positions.attention_bias(positions, positions)
    weights = []
    for block in self.decoder_layers():
      weights.append(block.cross_attention_weights(x, memory, positions=positions, memory_mask=memory_mask,
                                                   self_bias=self_bias))
      x = block(x, memory, positions=positions, memory_mask=memory_mask, self_bias=self_bias)
    return jnp.stack(weights)  # -> [layers, b, heads, t, s]

