"""Latent readers: N learned queries read M input features, so the cost after reading depends on N, not M.

- `LearnedQueries`: N vectors (std 0.02), the same for every input, broadcast over the batch.
- `ReaderBlock`: the queries' layer: optional self-attention among the queries, optional
  cross-attention from the queries to the inputs (with a key padding mask and, for `rope_2d`, the keys
  rotated by their 2D positions), then an MLP; pre-LayerNorm residuals.
- `Perceiver` (Jaegle et al. 2021): image elements (pixels or patches) embedded, plus a 2D position
  encoding chosen by name; ONE cross-attention from the latents to the elements, then a stack of latent
  self-attention blocks, applied `num_repeats` times with the same weights (Perceiver IO style);
  classification from the mean of the latents.
- `QFormer` (BLIP-2, Li et al. 2023): a frozen image encoder's patch features are read by learned queries
  whose blocks self-attend and cross-attend to the features every other block; or, as the LLaVA-style
  baseline (`connector="llava"`), an MLP maps each feature to one token. The tokens handed on (N queries or M
  features) go through a small self-attention "consumer" (a stand-in for the language model) and a head.
  `read(features, valid=...)` takes any encoder's features directly, padded to a common M with a
  `valid` mask, and `classify` pools only the real tokens: padding changes no output.

Freezing: `freeze(module)` turns a module's `nnx.Param`s into `FrozenParam`s. Gradients and optimizers
that select `nnx.Param` (`nnx.Optimizer(model, tx, wrt=nnx.Param)`, `nnx.grad` over `nnx.Param`) then never
see them, and the reader also stops gradients at the features. So the frozen encoder cannot change, not even
through weight decay.

Shapes: images [b, H, W, C]; elements [b, M, element_features]; positions [b, M, 2] (row, column);
valid [b, M] bool (True = a real element); queries / latents [b, N, width].
"""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from xattn_jax.layers import MLP, EncoderBlock, MultiHeadAttention, make_position_encoding
from xattn_jax.layers import dense
from xattn_jax.layers.blocks import rotary_positions
from xattn_jax.layers import positions as position_layers
from xattn_jax.models import vit as vit_lib
from xattn_jax.ops.positions import _check_positive_int
from xattn_jax.ops import masks as masks_lib
from xattn_jax.layers import layer_stack

CONNECTORS = ("qformer", "llava")


def grid_encodings() -> tuple[str, ...]:
  """The registry's encodings of a 2D grid of elements (the Perceiver's), read when called; 1D ones (rope,
  sinusoidal, ...) do not apply."""
  return position_layers.names(layout="grid")


class FrozenParam(nnx.Variable):
  """A parameter that training does not update: not an `nnx.Param`, so `wrt=nnx.Param` skips it."""


def freeze(module: nnx.Module) -> nnx.Module:
  """A copy of `module` whose `nnx.Param`s are `FrozenParam`s (same values and sharding names)."""
  graphdef, state = nnx.split(module)
  state = jax.tree.map(lambda v: FrozenParam(v[...], **v.get_metadata()) if isinstance(v, nnx.Param) else v,
                       state, is_leaf=lambda v: isinstance(v, nnx.Variable))
  return nnx.merge(graphdef, state)


def _layer_norm(features, dtype, param_dtype, rngs):
  return nnx.LayerNorm(
      features, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
      scale_init=nnx.with_partitioning(nnx.initializers.ones_init(), ("embed",), eager_sharding=False),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",), eager_sharding=False))


def _linear(in_features, out_features, axes, dtype, param_dtype, rngs):
  return dense.Dense(
      in_features, out_features, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
      kernel_init=nnx.with_partitioning(nnx.initializers.xavier_uniform(), axes, eager_sharding=False),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axes[1:], eager_sharding=False))


class LearnedQueries(nnx.Module):
  """N learned vectors (normal, std 0.02), the same for every input: `(batch_size) -> [b, N, features]`."""

  def __init__(self, num_queries: int, features: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
    num_queries = _check_positive_int(num_queries, "LearnedQueries", "num_queries")
    features = _check_positive_int(features, "LearnedQueries", "features")
    init = nnx.with_partitioning(nnx.initializers.normal(0.02), ("length", "embed"), eager_sharding=False)
    self.queries = nnx.Param(init(rngs.params(), (num_queries, features), param_dtype))

  def __call__(self, batch_size: int, dtype=jnp.float32):
    return jnp.broadcast_to(self.queries[...].astype(dtype), (batch_size, *self.queries.shape))


class ReaderBlock(nnx.Module):
  """One layer of the queries: [self-attention] -> [cross-attention to the inputs] -> MLP, pre-norm.

  x [b, N, features], inputs [b, M, input_features] -> [b, N, features]. The inputs get their own
  LayerNorm before the cross-attention (as in the Perceiver). `rotary` (a `RotarySpec`, e.g. rope_2d)
  rotates the cross-attention keys by their positions; the queries sit at the origin (they have no
  place on the image), so a score is q . R(p_key) k, an absolute encoding of where the key is.
  """

  def __init__(self, features: int, input_features: int, num_heads: int, mlp_features: int, *,
               self_attention: bool = False, cross_attention: bool = True, rotary=None,
               dropout_rate: float = 0.0, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.self_norm = _layer_norm(features, **common) if self_attention else None
    self.self_attention = MultiHeadAttention(num_heads, features, **common) if self_attention else None
    self.cross_norm = _layer_norm(features, **common) if cross_attention else None
    self.input_norm = _layer_norm(input_features, **common) if cross_attention else None
    self.cross_attention = (MultiHeadAttention(num_heads, features, input_features, rotary=rotary, **common)
                            if cross_attention else None)
    self.mlp_norm = _layer_norm(features, **common)
    self.mlp = MLP(features, mlp_features, dropout_rate=dropout_rate, **common)
    self.rotary = rotary

  def _query_positions(self, x):
    return None if self.rotary is None else jnp.zeros((*x.shape[:2], 2), jnp.int32)

  def __call__(self, x, inputs=None, *, input_mask=None, input_positions=None, deterministic: bool = True):
    """input_mask: bool broadcastable to [b, heads, N, M] (e.g. padding [b, 1, 1, M])."""
    if self.self_attention is not None:
      x = x + self.self_attention(self.self_norm(x), deterministic=deterministic)
    if self.cross_attention is not None:
      x = x + self.cross_attention(
          self.cross_norm(x), self.input_norm(inputs), mask=input_mask, query_positions=self._query_positions(x),
          key_positions=rotary_positions(self.cross_attention, input_positions), deterministic=deterministic)
    return x + self.mlp(self.mlp_norm(x), deterministic=deterministic)

  def cross_attention_weights(self, x, inputs, *, input_mask=None, input_positions=None):
    """The queries' attention over the inputs [b, heads, N, M] (float32), as in `__call__`."""
    if self.self_attention is not None:
      x = x + self.self_attention(self.self_norm(x))
    return self.cross_attention.attention_weights(
        self.cross_norm(x), self.input_norm(inputs), mask=input_mask, query_positions=self._query_positions(x),
        key_positions=rotary_positions(self.cross_attention, input_positions))


def _padding_mask(valid, elements):
  if valid is None:
    return None
  if valid.shape != elements.shape[:2] or valid.dtype != jnp.bool_:
    raise ValueError(f"latent reader: valid must be bool {list(elements.shape[:2])} (batch, M), got "
                     f"valid {valid.dtype}{list(valid.shape)}")
  return masks_lib.padding_mask(valid)  # [b, 1, 1, M]


class Perceiver(nnx.Module):
  """Perceiver classifier over image elements: latents cross-attend once, then self-attend, then a head.

  Args:
    num_classes: outputs of the head.
    channels: image channels C; an element is a patch of patch_size x patch_size pixels (1 = pixels).
    grid: the (height, width) of the element grid seen in training (sizes a learned_2d table, which
      is resized to any other grid the model is given).
    width: latent and element width; num_latents: N; num_heads: heads of every attention.
    num_blocks: latent self-attention blocks per repeat; num_repeats: how many times the latent stack
      runs with the SAME weights (Perceiver IO style weight sharing).
    position_encoding: a name in grid_encodings() (the registry's encodings of grid positions).
    scan_layers / remat: run the latent stack with nnx.scan, under a remat policy by name.
  """

  def __init__(self, *, num_classes: int, channels: int = 1, patch_size: int = 1, grid: tuple[int, int] = (8, 8),
               width: int = 64, num_latents: int = 32, num_heads: int = 4, num_blocks: int = 2,
               num_repeats: int = 1, mlp_ratio: int = 4, position_encoding: str = "fourier",
               dropout_rate: float = 0.0, scan_layers: bool = False, remat: str = "none", dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    for name, value in (("num_classes", num_classes), ("channels", channels), ("patch_size", patch_size),
                        ("width", width), ("num_latents", num_latents), ("num_heads", num_heads),
                        ("num_blocks", num_blocks), ("num_repeats", num_repeats), ("mlp_ratio", mlp_ratio)):
      _check_positive_int(value, "Perceiver", name)
    layer_stack.remat_policy(remat)  # raises for an unknown policy name
    if position_encoding not in grid_encodings():
      raise ValueError(f"Perceiver: position_encoding must be one of {grid_encodings()} (2D grid encodings), "
                       f"got position_encoding={position_encoding!r}")
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.patch_size, self.num_repeats, self.scan_layers, self.remat = patch_size, num_repeats, scan_layers, remat
    self.dtype, self.channels = dtype, channels
    self.embed = _linear(channels * patch_size ** 2, width, (None, "embed"), **common)
    self.positions = make_position_encoding(
        position_encoding, features=width, grid=tuple(grid), num_heads=num_heads, head_dim=width // num_heads,
        param_dtype=param_dtype, rngs=rngs)
    self.latents = LearnedQueries(num_latents, width, param_dtype=param_dtype, rngs=rngs)
    self.cross = ReaderBlock(width, width, num_heads, mlp_ratio * width, rotary=self.positions.rotary,
                             dropout_rate=dropout_rate, **common)
    self.blocks = layer_stack.create_stack(
        lambda r: EncoderBlock(width, num_heads, mlp_ratio * width, dropout_rate=dropout_rate, dtype=dtype,
                               param_dtype=param_dtype, rngs=r), num_blocks, rngs)
    self.norm = _layer_norm(width, **common)
    self.head = _linear(width, num_classes, ("embed", None), **common)

  def embed_elements(self, patches, positions, grid):
    """patches [b, M, p*p*C] at positions [b, M, 2] on a grid -> elements [b, M, width] (additive positions in).

    An element's embedding depends only on its own (patch, position) pair, in whatever order they come.
    """
    return self.positions.add_to_inputs(self.embed(patches.astype(self.dtype)), positions, grid=grid)

  def elements(self, images):
    """images [b, H, W, C] -> (elements [b, M, width], positions [b, M, 2]), patches row-major."""
    patches, positions, grid = vit_lib.patchify(images, self.patch_size, self.channels)
    return self.embed_elements(patches, positions, grid), positions

  def read(self, elements, positions, *, valid=None, deterministic: bool = True):
    """elements [b, M, width], positions [b, M, 2], valid [b, M] -> latents [b, N, width], for any M."""
    width = self.latents.queries.shape[1]
    if elements.ndim != 3 or elements.shape[-1] != width:
      raise ValueError(f"Perceiver.read: elements must be [batch, M, {width}], got elements{list(elements.shape)}")
    if positions.shape != (*elements.shape[:2], 2) or not jnp.issubdtype(positions.dtype, jnp.integer):
      raise ValueError(f"Perceiver.read: positions must be int [batch, M, 2] = {[*elements.shape[:2], 2]}, got "
                       f"positions {positions.dtype}{list(positions.shape)}")
    latents = self.latents(elements.shape[0], elements.dtype)
    latents = self.cross(latents, elements, input_mask=_padding_mask(valid, elements), input_positions=positions,
                         deterministic=deterministic)
    for _ in range(self.num_repeats):  # the same weights every repeat
      latents = layer_stack.apply_stack(self.blocks, latents, scan=self.scan_layers, remat=self.remat,
                                        deterministic=deterministic)
    chex.assert_shape(latents, (elements.shape[0], self.latents.queries.shape[0], elements.shape[-1]))
    return latents

  def __call__(self, images, *, deterministic: bool = True):
    """images [b, H, W, C] -> logits [b, num_classes] (float32)."""
    elements, positions = self.elements(images)
    latents = self.read(elements, positions, deterministic=deterministic)
    return self.head(self.norm(latents.mean(axis=1))).astype(jnp.float32)

  def cross_attention_weights(self, images):
    """Each latent's attention over the image elements [b, heads, N, M] (float32)."""
    elements, positions = self.elements(images)
    latents = self.latents(elements.shape[0], elements.dtype)
    return self.cross.cross_attention_weights(latents, elements, input_positions=positions)


class QFormer(nnx.Module):
  """Learned queries read a frozen image encoder's patch features (BLIP-2), or an MLP connector does (LLaVA).

  Args:
    encoder: the image encoder (e.g. a trained `vit.ViT`), with `features(images) -> [b, M, encoder.width]`
      (for the ViT, M = 1 + patches: the class token and every patch, as BLIP-2 reads its ViT);
      it is frozen here (see `freeze`) and run deterministically, gradients stopped at its features.
    connector: "qformer": `num_queries` learned queries pass through `num_blocks` ReaderBlocks that all
      self-attend and cross-attend to the features in every `cross_attention_every`-th block (blocks 0, 2,
      ... by default, as BLIP-2), handing on N = num_queries tokens whatever M is. "llava": each feature is
      mapped by Linear-GELU-Linear to one token (LLaVA-1.5), handing on M tokens.
    num_consumer_blocks: self-attention blocks over the handed-on tokens before the mean-pooled head
      (a stand-in for the language model that would read them).
  """

  def __init__(self, encoder: nnx.Module, *, num_classes: int, connector: str = "qformer", num_queries: int = 32,
               width: int = 64, num_heads: int = 4, num_blocks: int = 4, cross_attention_every: int = 2,
               num_consumer_blocks: int = 1, mlp_ratio: int = 4, dropout_rate: float = 0.0, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if connector not in CONNECTORS:
      raise ValueError(f"QFormer: connector must be one of {CONNECTORS}, got connector={connector!r}")
    for name, value in (("num_classes", num_classes), ("num_queries", num_queries), ("width", width),
                        ("num_heads", num_heads), ("num_blocks", num_blocks),
                        ("cross_attention_every", cross_attention_every), ("mlp_ratio", mlp_ratio)):
      _check_positive_int(value, "QFormer", name)
    if isinstance(num_consumer_blocks, bool) or not isinstance(num_consumer_blocks, int) or num_consumer_blocks < 0:
      raise ValueError(f"QFormer: num_consumer_blocks must be an int >= 0, got {num_consumer_blocks!r}")
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.encoder = freeze(encoder)
    self.connector, self.dtype = connector, dtype
    self.feature_width = feature_width = encoder.width
    use_queries = connector == "qformer"
    self.queries = LearnedQueries(num_queries, width, param_dtype=param_dtype, rngs=rngs) if use_queries else None
    self.blocks = nnx.List([
        ReaderBlock(width, feature_width, num_heads, mlp_ratio * width, self_attention=True,
                    cross_attention=i % cross_attention_every == 0, dropout_rate=dropout_rate, **common)
        for i in range(num_blocks if use_queries else 0)])
    # LLaVA-1.5's projector: Linear-GELU-Linear applied to every feature.
    self.projector = None if use_queries else MLP(feature_width, mlp_ratio * width, width, **common)
    self.consumer = nnx.List([
        EncoderBlock(width, num_heads, mlp_ratio * width, dropout_rate=dropout_rate, **common)
        for _ in range(num_consumer_blocks)])
    self.norm = _layer_norm(width, **common)
    self.head = _linear(width, num_classes, ("embed", None), **common)

  def features(self, images):
    """The frozen encoder's output tokens [b, M, encoder.width]; no gradient flows into the encoder."""
    return jax.lax.stop_gradient(self.encoder.features(images, deterministic=True)).astype(self.dtype)

  def read(self, features, *, valid=None, deterministic: bool = True):
    """features [b, M, encoder.width] (any M), valid [b, M] bool (True = a real feature) or None
    -> (tokens, token_valid): the tokens handed on and which of them are real.

    "qformer": tokens [b, N, width], token_valid None (every query is real; padded features are
    hidden from the cross-attention). "llava": tokens [b, M, width], token_valid = valid.
    """
    if features.ndim != 3 or features.shape[-1] != self.feature_width:
      raise ValueError(f"QFormer.read: features must be [batch, M, {self.feature_width}], got "
                       f"features{list(features.shape)}")
    features = features.astype(self.dtype)
    mask = _padding_mask(valid, features)
    if self.connector == "llava":
      return self.projector(features, deterministic=deterministic), valid
    x = self.queries(features.shape[0], features.dtype)
    for block in self.blocks:
      x = block(x, features if block.cross_attention is not None else None, input_mask=mask,
                deterministic=deterministic)
    return x, None

  def classify(self, tokens, token_valid=None, *, deterministic: bool = True):
    """tokens [b, T, width] (from `read`), token_valid [b, T] or None -> logits [b, num_classes] (float32):
    the consumer blocks (padded tokens hidden from them) and the head on the mean of the real tokens."""
    mask = _padding_mask(token_valid, tokens)
    x = tokens
    for block in self.consumer:
      x = block(x, mask=mask, deterministic=deterministic)
    if token_valid is None:
      pooled = x.mean(axis=1)
    else:
      weights = token_valid.astype(x.dtype)[..., None]
      pooled = (x * weights).sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1)
    return self.head(self.norm(pooled)).astype(jnp.float32)

  def tokens(self, images, *, deterministic: bool = True):
    """The tokens handed on: [b, N, width] (qformer) or [b, M, width] (llava), M = the encoder's outputs."""
    return self.read(self.features(images), deterministic=deterministic)[0]

  def __call__(self, images, *, deterministic: bool = True):
    """images [b, H, W, C] -> logits [b, num_classes] (float32)."""
    return self.classify(self.tokens(images, deterministic=deterministic), deterministic=deterministic)

  def cross_attention_weights(self, images):
    """The queries' attention over the encoder's M outputs in the first block [b, heads, N, M] (qformer only)."""
    if self.connector != "qformer":
      raise ValueError("QFormer.cross_attention_weights: connector='llava' has no queries to look at")
    features = self.features(images)
    return self.blocks[0].cross_attention_weights(self.queries(features.shape[0], features.dtype), features)
