"""A vision-language model: a frozen decoder-only language model reads images through a connector.

Three connectors (`connectors.CONNECTORS`, the one list of them), all reading the same frozen image encoder (a
`vit.ViT`: `features(images, valid=) -> [B, 1 + P, width]`, the class token then P patches) and feeding
the same frozen `lm.LanguageModel`:

- "flamingo" (Alayrac et al. 2022): a `GatedCrossAttentionBlock` (cross-attention + MLP, tanh gates
  starting at 0) before every `cross_attention_every`-th LM layer (layers 0, k, 2k, ...), through the
  LM's `insert` hook. The text's tokens read the image features, or with `num_latents` > 0 the N
  latents of a Perceiver resampler (latents cross-attend to the features and themselves). Each text
  token reads only the LATEST image whose marker is at or before it (Flamingo's image-causal masking);
  a token before any image reads none, so its cross-attention output is zero. At initialisation the
  logits are the frozen LM's, bit for bit. An image sits in the text as its marker alone.
- "qformer" (BLIP-2, Li et al. 2023): `num_queries` learned queries (32 by default) self-attend and
  cross-attend (every `qformer_cross_attention_every`-th block) to the image's features, a linear
  maps them to the LM width, and they stand in the text as N soft tokens whatever the image's M.
- "llava" (LLaVA-1.5, Liu et al. 2023): Linear-GELU-Linear maps each of the image's patch features (the
  class token is left out, as LLaVA reads patches only) to one LM token: gh * gw soft tokens, one per
  real patch, row-major. With `spatial_merge` m > 1 (Qwen2-VL's patch merger) each m x m block of
  neighbouring patches is concatenated into one feature first (m * m * width wide), so an image hands
  the LM ceil(gh / m) * ceil(gw / m) tokens on its merged grid; an image side that is not a multiple
  of m ends in blocks that also hold canvas padding (Qwen2-VL resizes images to avoid them). Their
  positions follow `image_positions` (`IMAGE_POSITIONS`): "sequence" (1D, one position per token) or
  "mrope" (Qwen2-VL: image token (row, col) of an image starting at s sits at (s, s + row, s + col);
  text after it resumes at the image's maximum position + 1, as
  `ops.positions.mrope_position_ids`). "mrope" needs an LM built with a multimodal encoding ("mrope"); an LM
  pretrained with 1D RoPE runs with it unchanged (text-only M-RoPE positions are 1D RoPE exactly).

Inputs (the task turns a VLMExample's segments into them):
  images       float [b, n, H, W, C]: up to n images per row, each top-left on a zero canvas H x W
  pixel_valid  bool [b, n, H, W]: the pixels of the image (a patch is real when all its pixels are)
  image_valid  bool [b, n]: which of the n slots hold an image
  tokens       int [b, T]: the text's ids; where image j sits, `slots_per_image(h_j, w_j)` SOFT_TOKEN slots
               (flamingo: none; qformer: N; llava: one per real patch, row-major) and then the image's
               marker `image_token_id` (the LM's id of IMAGE_TOKEN, an ordinary token it was pretrained
               with). The soft tokens replace the slots in order (the k-th slot of the j-th image in the
               row takes that image's k-th soft token); the j-th image in the text is slot j of `images`.
  valid        bool [b, T]: real tokens (False on padding, left or right); None = tokens != 0.
Positions are computed here from tokens, valid and the images' patch grids: 1D positions count the
real tokens (the first at 0); "mrope" as above.

Training: `__call__(...) -> logits [b, T, vocab]` (predicting token t + 1 at t). Generation: the image
context (soft tokens, or flamingo's projected memory per gated layer) is computed ONCE, the LM's KV cache
is pre-filled with the prompt (soft tokens included), then the shared `decoding.search` (greedy, beam,
sampling) runs over `loop_step`. A prompt ends with a text token (it is fed first): an image's marker
comes after its soft tokens, so a prompt may end with an image.

Feature positions: before any connector reads them, the features get the connector's own position
encoding of the encoder's patch grid (`feature_positions`, one of feature_position_encodings():
"learned_2d" by default, a trained table of 1 + P rows, class token included, as Flamingo's and BLIP-2's
encoders hand on features that carry their positions). An encoder trained with a position-blind objective
(one head shared by every place, as the digits' encoder) keeps little of where a feature sits, and a
connector that reads features by content alone then confuses the order of the digits
(experiments/results/compare_connectors.md).

Canvas padding: with `hide_padding` the padded patches are hidden from the encoder's attention and from
the connector; without it (an encoder trained on padded canvases, which reads padding as "empty") every
canvas patch is a feature, and only llava's soft tokens stay one per REAL patch.

Freezing: the encoder and the LM are `latent_reader.freeze`d (their parameters are `FrozenParam`s, so
`nnx.Param`-selecting gradients and optimizers never see them) and run deterministically; the encoder's
features also stop gradients. Only the connector's parameters train.
"""
from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xattn_jax import decoding
from xattn_jax.layers.attention import MemoryCache
from xattn_jax.models import latent_reader
from xattn_jax.models import lm as lm_lib
from xattn_jax.models import vit as vit_lib
from xattn_jax.models.connectors import CONNECTORS, feature_position_encodings
from xattn_jax.ops.concrete import concrete

IMAGE_POSITIONS = ("sequence", "mrope")
SOFT_TOKEN = -1  # the id of a soft-token slot in `tokens` (never embedded: the connector's token replaces it)


@flax.struct.dataclass
class ImageContext:
  """What the connector made of a batch's images, computed once per image.

  counts        int32 [b, n]: soft tokens (or flamingo markers) each image takes in the text; 0 = no image
  grid_height   int32 [b, n], grid_width int32 [b, n]: each image's real patch grid (gh, gw); llava with
                spatial_merge m: the grid of its soft tokens, (ceil(gh / m), ceil(gw / m))
  tokens        [b, n, K, d_lm] soft tokens (qformer, llava) or None
  memory        [b, n * S, memory_features] what flamingo's gated layers read, or None
  memory_valid  bool [b, n * S]; memory_image int32 [n * S]: the image each memory row belongs to
  canvas_width  the canvas's patch-grid width (static; llava: of its soft-token grid)
  """
  counts: jax.Array
  grid_height: jax.Array
  grid_width: jax.Array
  tokens: jax.Array | None = None
  memory: jax.Array | None = None
  memory_valid: jax.Array | None = None
  memory_image: jax.Array | None = None
  canvas_width: int = flax.struct.field(pytree_node=False, default=0)


@flax.struct.dataclass
class VLMCache:
  """Decode state: the LM's cache, and for flamingo each gated layer's projected memory, which memory rows
  are real (memory_valid bool [b, n * S]) and of which image (memory_image int32 [b, n * S]), and the latest
  image before the next fed token (latest int32 [b]; a fed marker opens the next one, as in the full pass)."""
  lm: lm_lib.LMCache
  memory: tuple[MemoryCache, ...] | None = None
  memory_valid: jax.Array | None = None
  memory_image: jax.Array | None = None
  latest: jax.Array | None = None

  def decode_room(self) -> int:
    return self.lm.decode_room()

  @property
  def capacity(self) -> int:
    return self.lm.capacity

  @property
  def filled(self) -> jax.Array:
    return self.lm.filled

  def head(self, n: int) -> VLMCache:
    """The cache of the LM's first n slots (`LMCache.head`); the images' memory stays whole."""
    return self.replace(lm=self.lm.head(n))

  def with_head(self, head: VLMCache) -> VLMCache:
    return head.replace(lm=self.lm.with_head(head.lm))


def _recording(insert: dict, hidden: list | None, num_layers: int) -> dict | None:
  """LM insert hooks that also append the residual stream after each block (hook keys 1..num_layers) to
  `hidden`, before the hook's own function at that layer runs; `hidden` None: `insert` as it is."""
  if hidden is None:
    return insert or None

  def at(layer):
    inner = insert.get(layer)

    def apply(x):
      hidden.append(x)
      return x if inner is None else inner(x)
    return apply
  return {**insert, **{layer: at(layer) for layer in range(1, num_layers + 1)}}


def lm_hidden_states(lm: lm_lib.LanguageModel, tokens) -> list[jax.Array]:
  """A language model on a text, tokens int [b, t] (right-padded, positions 0..) -> its residual stream after
  each of its L blocks, [b, t, d_model] each. No gradient flows through them."""
  lm_lib._check_tokens("lm_hidden_states", tokens)
  hidden = []
  lm(tokens, insert=_recording({}, hidden, lm.num_layers))
  return [jax.lax.stop_gradient(h) for h in hidden]


class VisionLanguageModel(nnx.Module):
  """A frozen image encoder and a frozen LM joined by a trainable connector; see the module docstring.

  Args:
    encoder: a `vit.ViT` (or any module with `features(images, valid=) -> [B, 1 + P, width]`, `width`,
      `patch_size`); frozen here.
    lm: a `lm.LanguageModel`; frozen here. image_positions="mrope" needs its position_encoding "mrope".
    connector: a name in CONNECTORS. image_token_id: the LM's id of the image marker (IMAGE_TOKEN).
    num_heads, mlp_ratio: sizes of the connector's attention / MLP layers. Each connector takes the fields of its
      `config_fields` (these keywords, the model config's field names); the others are not read.
    cross_attention_every, num_latents, resampler_blocks: flamingo (k; resampler latents, 0 = none).
    hide_padding: hide padded canvas patches from the encoder and the connector (module docstring).
    num_queries, qformer_width, qformer_blocks, qformer_cross_attention_every: qformer.
    image_positions: a name in IMAGE_POSITIONS (llava only; the others hand the LM no spatial tokens).
    spatial_merge: llava: m x m blocks of patches make one soft token (Qwen2-VL: 2); 1 = one per patch.
    feature_positions: a name in feature_position_encodings(), the connector's encoding of the features' patch
      grid (module docstring); feature_grid: the grid it is built for (default: the encoder's `positions.grid`).
    dropout_rate: the connector's dropout. dtype: compute dtype; param_dtype: the connector's storage dtype.
    connector_options: the fields of a registered connector's config_fields not named above.
  """

  def __init__(self, encoder: nnx.Module, lm: lm_lib.LanguageModel, *, connector: str, image_token_id: int,
               num_heads: int = 4, mlp_ratio: int = 4, cross_attention_every: int = 1, num_latents: int = 0,
               resampler_blocks: int = 1, num_queries: int = 32, qformer_width: int = 64, qformer_blocks: int = 2,
               qformer_cross_attention_every: int = 2, image_positions: str = "sequence", spatial_merge: int = 1,
               feature_positions: str = "learned_2d", feature_grid=None, hide_padding: bool = True,
               dropout_rate: float = 0.0, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs,
               **connector_options):
    if connector not in CONNECTORS:
      raise ValueError(f"VisionLanguageModel: connector must be one of {tuple(CONNECTORS)}, got "
                       f"connector={connector!r}")
    if image_positions not in IMAGE_POSITIONS:
      raise ValueError(f"VisionLanguageModel: image_positions must be one of {IMAGE_POSITIONS}, got "
                       f"image_positions={image_positions!r}")
    kind = CONNECTORS[connector]
    if image_positions == "mrope" and not kind.spatial:
      raise ValueError(f"VisionLanguageModel: image_positions='mrope' places soft tokens on their patch grid, "
                       f"which connector={connector!r} does not hand the LM (only "
                       f"{tuple(n for n, k in CONNECTORS.items() if k.spatial)})")
    if image_positions == "mrope" and not lm.multimodal_positions:
      raise ValueError(f"VisionLanguageModel: image_positions='mrope' needs an LM built with a multimodal position "
                       f"encoding such as 'mrope' (the 1D-RoPE weights load unchanged), got "
                       f"position_encoding={lm.position_encoding!r}")
    if feature_positions not in feature_position_encodings():
      raise ValueError(f"VisionLanguageModel: feature_positions must be one of {feature_position_encodings()}, got "
                       f"feature_positions={feature_positions!r}")
    if isinstance(spatial_merge, bool) or not isinstance(spatial_merge, int) or spatial_merge < 1:
      raise ValueError(f"VisionLanguageModel: spatial_merge must be a positive int, got "
                       f"spatial_merge={spatial_merge!r}")
    if spatial_merge > 1 and not kind.spatial:
      raise ValueError(f"VisionLanguageModel: spatial_merge merges the patches that become soft tokens, which "
                       f"connector={connector!r} does not hand the LM (only "
                       f"{tuple(n for n, k in CONNECTORS.items() if k.spatial)}), got spatial_merge={spatial_merge}")
    if feature_grid is None:
      feature_grid = getattr(getattr(encoder, "positions", None), "grid", None)
    if feature_positions != "none" and feature_grid is None:
      raise ValueError("VisionLanguageModel: feature_positions needs feature_grid (the encoder has no "
                       "positions.grid to take it from)")
    if (isinstance(image_token_id, bool) or not isinstance(image_token_id, int)
        or not 0 < image_token_id < lm.vocab_size):
      raise ValueError(f"VisionLanguageModel: image_token_id must be an id in [1, {lm.vocab_size}), got "
                       f"image_token_id={image_token_id!r}")
    known = {field for k in CONNECTORS.values() for field in k.config_fields}
    if unknown := sorted(set(connector_options) - known):
      raise ValueError(f"VisionLanguageModel: {unknown} are no registered connector's config_fields (known: "
                       f"{sorted(known)})")
    fields = dict(num_heads=num_heads, mlp_ratio=mlp_ratio, cross_attention_every=cross_attention_every,
                  num_latents=num_latents, resampler_blocks=resampler_blocks, num_queries=num_queries,
                  qformer_width=qformer_width, qformer_blocks=qformer_blocks,
                  qformer_cross_attention_every=qformer_cross_attention_every, spatial_merge=spatial_merge,
                  **connector_options)
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.connector_name, self.image_token_id, self.image_positions = connector, image_token_id, image_positions
    self.patch_size, self.dtype, self.hide_padding = encoder.patch_size, dtype, hide_padding
    self.spatial_merge = spatial_merge
    # the fields this connector reads (what `slots` reads too), and its constructor's keyword for each
    self.connector_fields = {field: fields[field] for field in kind.config_fields if field in fields}
    options = {kind.config_fields[field]: value for field, value in self.connector_fields.items()}
    self.encoder = latent_reader.freeze(encoder)
    self.lm = latent_reader.freeze(lm)
    self.connector = kind(encoder.width, lm, feature_positions=feature_positions, feature_grid=feature_grid,
                          dropout_rate=dropout_rate, **options, **common)

  # --- host side ----------------------------------------------------------------------------------

  def slots_per_image(self, height: int, width: int) -> int:
    """How many SOFT_TOKEN slots an image of height x width pixels takes in `tokens` (before its marker)."""
    if height % self.patch_size or width % self.patch_size or height < 1 or width < 1:
      raise ValueError(f"VisionLanguageModel.slots_per_image: an image must be a positive multiple of the "
                       f"encoder's patch size {self.patch_size} on each side, got {height}x{width}")
    return self.connector.slots((height // self.patch_size, width // self.patch_size), self.connector_fields)

  # --- images -------------------------------------------------------------------------------------

  def encode_images(self, images, pixel_valid, image_valid, *, features=None,
                    deterministic: bool = True) -> ImageContext:
    """The connector's reading of images [b, n, H, W, C] (pixel_valid [b, n, H, W], image_valid [b, n]).

    features: the frozen encoder's features of these images, [b, n, 1 + P, width] as `frozen_features`
    gives them (computed once for a fixed training set, so a step skips the encoder), or None to compute
    them here; with features, images may be None.
    """
    self._check_images(images, pixel_valid, image_valid, features)
    b, n, height, width = pixel_valid.shape
    grid = (height // self.patch_size, width // self.patch_size)
    features, feature_valid, patch_valid = self._features(images, pixel_valid, image_valid, features)
    on_grid = patch_valid.reshape(b, n, *grid)
    grid_height = jnp.sum(on_grid[..., 0], axis=-1, dtype=jnp.int32)  # [b, n]
    grid_width = jnp.sum(on_grid[:, :, 0, :], axis=-1, dtype=jnp.int32)
    canvas_width = grid[1]
    if self.connector.spatial:  # its soft tokens' grid: the patches', or merged blocks'
      grid_height, grid_width = self.connector.token_grid((grid_height, grid_width), self.spatial_merge)
      canvas_width = self.connector.token_grid(grid, self.spatial_merge)[1]
      counts = grid_height * grid_width
    else:
      counts = jnp.where(image_valid, self.connector.slots(grid, self.connector_fields), 0).astype(jnp.int32)
    context = ImageContext(counts=counts, grid_height=grid_height, grid_width=grid_width, canvas_width=canvas_width)
    if self.connector.prefix_tokens:
      tokens = self.connector.tokens(features, feature_valid, grid=grid, deterministic=deterministic)  # [B, K, d]
      return context.replace(tokens=tokens.reshape(b, n, *tokens.shape[1:]))
    memory, memory_valid = self.connector.memory(features, feature_valid, deterministic=deterministic)
    size = memory.shape[1]
    return context.replace(memory=memory.reshape(b, n * size, memory.shape[-1]),
                           memory_valid=memory_valid.reshape(b, n * size),
                           memory_image=jnp.repeat(jnp.arange(n, dtype=jnp.int32), size))

  def _check_images(self, images, pixel_valid, image_valid, features=None) -> None:
    if features is None and getattr(images, "ndim", None) != 5:
      raise ValueError(f"VisionLanguageModel: images must be [batch, n, H, W, C], got images"
                       f"{list(getattr(images, 'shape', ()))}")
    if getattr(pixel_valid, "ndim", None) != 4:
      raise ValueError(f"VisionLanguageModel: pixel_valid must be bool [batch, n, H, W], got "
                       f"{list(getattr(pixel_valid, 'shape', ()))}")
    b, n, height, width = pixel_valid.shape if images is None else images.shape[:4]
    for name, array, shape in (("pixel_valid", pixel_valid, (b, n, height, width)), ("image_valid", image_valid, (b, n))):
      if getattr(array, "shape", None) != shape or array.dtype != jnp.bool_:
        raise ValueError(f"VisionLanguageModel: {name} must be bool {list(shape)}, got "
                         f"{getattr(array, 'dtype', type(array))}{list(getattr(array, 'shape', ()))}")
    if features is not None:
      patches = (height // self.patch_size) * (width // self.patch_size)
      shape = (b, n, 1 + patches, self.encoder.width)
      if getattr(features, "shape", None) != shape:
        raise ValueError(f"VisionLanguageModel: features must be [batch, n, 1 + patches, encoder width] = "
                         f"{list(shape)}, got features{list(getattr(features, 'shape', ()))}")

  def _features(self, images, pixel_valid, image_valid, features=None):
    """The frozen encoder's features of every image slot (or the given `features` [b, n, 1 + P, w], see
    `frozen_features`) with the connector's positions -> (features [B, 1 + P, w], feature_valid [B, 1 + P]:
    what the connector reads, patch_valid [B, P]: the real patches), B = b * n."""
    b, n, height, width = pixel_valid.shape
    p = self.patch_size
    if features is None:
      features, patch_valid = frozen_features(self.encoder, images, pixel_valid, image_valid,
                                              hide_padding=self.hide_padding, dtype=self.dtype)
    else:
      patch_valid = _patch_valid(pixel_valid, image_valid, p)
    patch_valid = patch_valid.reshape(b * n, -1)
    features = features.reshape(b * n, *features.shape[2:]).astype(self.dtype)
    features = self.connector.positioned(features, (height // p, width // p))
    present = image_valid.reshape(b * n, 1)
    read = patch_valid if self.hide_padding else jnp.broadcast_to(present, patch_valid.shape)
    return features, jnp.concatenate([present, read], axis=1), patch_valid

  # --- text layout --------------------------------------------------------------------------------

  def _check_text(self, tokens, valid):
    if getattr(tokens, "ndim", None) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"VisionLanguageModel: tokens must be int [batch, length], got "
                       f"{getattr(tokens, 'dtype', type(tokens))}{list(getattr(tokens, 'shape', ()))}")
    valid = tokens != lm_lib.PAD_ID if valid is None else jnp.asarray(valid)
    if valid.shape != tokens.shape or valid.dtype != jnp.bool_:
      raise ValueError(f"VisionLanguageModel: valid must be bool {list(tokens.shape)}, got "
                       f"{valid.dtype}{list(valid.shape)}")
    return valid

  def _slots(self, tokens, valid, context: ImageContext):
    """Per token: (is an image slot, its image j, its index k within the image), each [b, T]."""
    is_slot = (tokens == SOFT_TOKEN) & valid
    slot = jnp.cumsum(is_slot, axis=1, dtype=jnp.int32) - 1  # the row's slot count so far
    ends = jnp.cumsum(context.counts, axis=1)  # [b, n]: one past each image's last slot
    image = jnp.sum(slot[:, :, None] >= ends[:, None, :], axis=-1, dtype=jnp.int32)  # -> [b, T]
    image = jnp.minimum(image, context.counts.shape[1] - 1)
    starts = jnp.take_along_axis(ends - context.counts, image, axis=1)
    return is_slot, image, slot - starts

  def positions(self, tokens, valid, context: ImageContext):
    """Position ids of tokens [b, T]: int32 [b, T] (1D: the real tokens counted from 0) or, for
    image_positions="mrope", [3, b, T] (see the module docstring). Concrete tokens whose SOFT_TOKEN slots cut an
    image short (or outrun the images) raise ValueError."""
    valid = self._check_text(tokens, valid)
    # A context of one row would broadcast its images to every text row without a word.
    if context.counts.shape[0] != tokens.shape[0]:
      raise ValueError(f"VisionLanguageModel: tokens{list(tokens.shape)} need an image context of their batch "
                       f"{tokens.shape[0]}, got images of batch {context.counts.shape[0]}")
    _check_slots(tokens, valid, context)
    if self.image_positions == "sequence":
      return jnp.maximum(jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)
    is_slot, image, k = self._slots(tokens, valid, context)
    height = jnp.take_along_axis(context.grid_height, image, axis=1)
    width = jnp.maximum(jnp.take_along_axis(context.grid_width, image, axis=1), 1)
    count = jnp.take_along_axis(context.counts, image, axis=1)
    # A text token advances the next position by 1, an image by max(gh, gw) at its last slot: an image's
    # slots then share their start s, and the text after it resumes at s + max(gh, gw) = max id + 1.
    advance = jnp.where(is_slot, jnp.where(k == count - 1, jnp.maximum(height, width), 0), valid.astype(jnp.int32))
    start = jnp.cumsum(advance, axis=1, dtype=jnp.int32) - advance  # exclusive -> [b, T]
    row = jnp.where(is_slot, k // width, 0)
    column = jnp.where(is_slot, k % width, 0)
    return jnp.stack([start, start + row, start + column])  # -> [3, b, T]

  def _embed(self, tokens, valid, context: ImageContext):
    """The LM's input embeddings [b, T, d_lm]: text ids embedded as the LM embeds them, image slots
    replaced by the images' soft tokens in order."""
    is_slot, image, k = self._slots(tokens, valid, context)
    x = self.lm.embed(jnp.where(tokens == SOFT_TOKEN, lm_lib.PAD_ID, tokens))
    x = x * jnp.sqrt(float(self.lm.d_model)).astype(self.lm.dtype)
    b, n, size, features = context.tokens.shape
    width = jnp.maximum(jnp.take_along_axis(context.grid_width, image, axis=1), 1)
    index = image * size + jnp.clip(self.connector.slot_token(k, width, context.canvas_width), 0, size - 1)
    soft = jnp.take_along_axis(context.tokens.reshape(b, n * size, features), index[..., None], axis=1)
    return jnp.where(is_slot[..., None], soft.astype(x.dtype), x)

  # --- flamingo's masks and inserted layers -----------------------------------------------------

  def _media(self, tokens, valid):
    """The latest image whose marker is at or before each token [b, T] (-1: none yet), Flamingo's
    image-causal index."""
    return jnp.cumsum((tokens == self.image_token_id) & valid, axis=1, dtype=jnp.int32) - 1

  @staticmethod
  def _memory_mask(media, memory_image, memory_valid):
    """media [b, T], memory_image [n * S] or [b, n * S], memory_valid [b, n * S] -> bool [b, 1, T, n * S]:
    a token reads the real memory rows of its latest image."""
    memory_image = jnp.broadcast_to(memory_image, memory_valid.shape)
    mask = (media[:, :, None] == memory_image[:, None, :]) & memory_valid[:, None, :]
    return mask[:, None]

  def _insert(self, memory_caches, mask, deterministic, record=None):
    """{LM layer: x -> gated block(x)} reading the projected memories under mask; with a list `record`, each
    gated layer also appends its attention probabilities [b, heads, T, n * S] to it."""
    def gated(block, memory_cache):
      def attend(h):
        if record is not None:
          record.append(block.attention.memory_attention_weights(h, memory_cache, mask=mask))
        return block.attention.attend(h, memory_cache, mask=mask, deterministic=deterministic), None
      def apply(x):
        x, _ = block.attention_residual(x, attend, deterministic)
        x, _ = block.mlp_residual(x, lambda h: (block.mlp(h, deterministic=deterministic), None), deterministic)
        return x
      return apply
    return {layer: gated(block, cache)
            for layer, block, cache in zip(self.connector.layers, self.connector.blocks, memory_caches)}

  def _project_memories(self, context: ImageContext):
    return tuple(block.attention.project_memory(context.memory) for block in self.connector.blocks)

  # --- training pass ------------------------------------------------------------------------------

  def __call__(self, images, pixel_valid, image_valid, tokens, valid=None, *, features=None,
               deterministic: bool = True, hidden: list | None = None):
    """-> logits [b, T, vocab] (float32); arrays as in the module docstring, features as in `encode_images`,
    hidden as in `forward`."""
    valid = self._check_text(tokens, valid)
    context = self.encode_images(images, pixel_valid, image_valid, features=features, deterministic=deterministic)
    return self.forward(context, tokens, valid, deterministic=deterministic, hidden=hidden)

  def forward(self, context: ImageContext, tokens, valid=None, *, deterministic: bool = True,
              hidden: list | None = None):
    """The LM pass over tokens [b, T] given an image context -> logits [b, T, vocab]. A list `hidden` receives
    the LM's residual stream after each of its L blocks ([b, T, d_lm] each, before any gated block that
    follows), as `lm_hidden_states(self.lm, ...)` gives a text's."""
    valid = self._check_text(tokens, valid)
    positions = self.positions(tokens, valid, context)
    segment_ids = valid.astype(jnp.int32)  # padding (0) is hidden from every real token
    if self.connector.prefix_tokens:
      return self.lm(tokens[:, :0], prefix=self._embed(tokens, valid, context), positions=positions,
                     segment_ids=segment_ids, insert=_recording({}, hidden, self.lm.num_layers))
    mask = self._memory_mask(self._media(tokens, valid), context.memory_image, context.memory_valid)
    insert = self._insert(self._project_memories(context), mask, deterministic)
    return self.lm(tokens, positions=positions, segment_ids=segment_ids,
                   insert=_recording(insert, hidden, self.lm.num_layers))

  def attention_maps(self, images, pixel_valid, image_valid, tokens, valid=None) -> jax.Array:
    """Where the connector looks in the images (float32 probabilities, deterministic; arrays as in __call__).

    What they are is the connector's `attention_maps`:
    "queries" (qformer): [b, n, C, heads, N, 1 + P], each of the N queries' attention over image j's features (the
      class token first, then the canvas patches row-major) in each of the C Q-Former blocks that cross-attend.
    "text" (flamingo): [b, L, heads, T, n * (1 + P)], each text token's attention in each of the L gated layers over
      image j's features at j * (1 + P) .. (j + 1) * (1 + P) - 1 (as for qformer); with a resampler, its
      attention over the latents composed with the latents' over the features (`feature_weights`), so a row
      sums to the share that reached the image. A token reads only its latest image, so its weights over every
      other image are 0 (all 0 before the first image's marker).
    None (llava) has no cross-attention (the LM's self-attention reads its soft tokens): a ValueError.
    """
    if self.connector.attention_maps is None:
      raise ValueError(f"VisionLanguageModel.attention_maps: connector={self.connector_name!r} has no "
                       "cross-attention; its soft tokens are read by the LM's own self-attention")
    valid = self._check_text(tokens, valid)
    if self.connector.attention_maps == "queries":
      self._check_images(images, pixel_valid, image_valid)
      features, feature_valid, _ = self._features(images, pixel_valid, image_valid)
      weights = self.connector.cross_attention_weights(features, feature_valid)
      return weights.reshape(*images.shape[:2], *weights.shape[1:])
    context = self.encode_images(images, pixel_valid, image_valid)
    mask = self._memory_mask(self._media(tokens, valid), context.memory_image, context.memory_valid)
    record = []
    self.lm(tokens, positions=self.positions(tokens, valid, context), segment_ids=valid.astype(jnp.int32),
            insert=self._insert(self._project_memories(context), mask, True, record=record))
    weights = jnp.stack(record, axis=1)  # [b, L, heads, T, n * S] over the memory rows
    if self.connector.latents is None:
      return weights
    features, feature_valid, _ = self._features(images, pixel_valid, image_valid)
    reach = self.connector.feature_weights(features, feature_valid)  # [b * n, S, 1 + P]
    b, n = image_valid.shape
    reach = reach.reshape(b, n, *reach.shape[1:])
    weights = weights.reshape(*weights.shape[:-1], n, reach.shape[2])
    return jnp.einsum("blhtjs,bjsm->blhtjm", weights, reach).reshape(*weights.shape[:-2], n * reach.shape[-1])

  # --- generation ---------------------------------------------------------------------------------

  def prefill(self, context: ImageContext, tokens, valid, capacity: int):
    """Pre-fills a fresh cache of `capacity` with a left-padded prompt tokens [b, t] but its last token
    -> (VLMCache, the last tokens [b] to feed first). The prompt's last token must be text (or a marker)."""
    valid = self._check_text(tokens, valid)
    batch = tokens.shape[0]
    cache = self.lm.init_cache(batch, capacity)
    positions = self.positions(tokens, valid, context)[..., :-1]
    head, head_valid = tokens[:, :-1], valid[:, :-1]
    if self.connector.prefix_tokens:
      _, lm_cache = self.lm.prefill(head[:, :0], cache, valid=head_valid[:, :0], positions=positions,
                                    prefix=self._embed(head, head_valid, context), prefix_valid=head_valid)
      return VLMCache(lm=lm_cache), tokens[:, -1]
    media = self._media(head, head_valid)
    memories = self._project_memories(context)
    mask = self._memory_mask(media, context.memory_image, context.memory_valid)
    _, lm_cache = self.lm.prefill(head, cache, valid=head_valid, positions=positions,
                                  insert=self._insert(memories, mask, True))
    latest = jnp.max(jnp.where(head_valid, media, -1), axis=1)  # -> [b], before the last prompt token
    memory_image = jnp.broadcast_to(context.memory_image, context.memory_valid.shape)
    return VLMCache(lm=lm_cache, memory=memories, memory_valid=context.memory_valid, memory_image=memory_image,
                    latest=latest), tokens[:, -1]

  def loop_step(self) -> decoding.DecodeStep:
    """(tokens [b, 1], VLMCache) -> (logits [b, 1, vocab], VLMCache), the LM's layers sliced once."""
    step = self.lm.loop_step()
    if self.connector.prefix_tokens:
      def prefix_step(tokens, cache):
        logits, lm_cache = step(tokens, cache.lm)
        return logits, cache.replace(lm=lm_cache)
      return prefix_step

    def flamingo_step(tokens, cache):
      latest = cache.latest + (tokens[:, 0] == self.image_token_id)  # the fed token's latest image
      mask = self._memory_mask(latest[:, None], cache.memory_image, cache.memory_valid)  # [b, 1, 1, n * S]
      logits, lm_cache = step(tokens, cache.lm, insert=self._insert(cache.memory, mask, True))
      return logits, cache.replace(lm=lm_cache, latest=latest)
    return flamingo_step

  def generate(self, images, pixel_valid, image_valid, prompt, prompt_valid, *, max_length: int, eos_id: int,
               options: decoding.DecodingOptions | None = None, pad_id: int = lm_lib.PAD_ID, rng=None,
               suppress_ids: tuple[int, ...] = (), logits_sharding=None):
    """Continues each left-padded prompt [b, t] -> tokens [b, max_length] (EOS then padding) and scores [b].

    The images are read once; the search is `options` (default greedy) and never emits suppress_ids
    (logits_sharding: `decoding.search`'s). Wrap in nnx.jit with max_length, eos_id, options, suppress_ids and
    logits_sharding static.
    """
    options = decoding.DecodingOptions() if options is None else options
    context = self.encode_images(images, pixel_valid, image_valid)
    cache, first = self.prefill(context, prompt, prompt_valid, prompt.shape[1] + max_length)
    out = decoding.search(self.loop_step(), cache, options, batch_size=prompt.shape[0], max_length=max_length,
                          bos_id=0, eos_id=eos_id, pad_id=pad_id, rng=rng, first_tokens=first,
                          suppress_ids=suppress_ids, logits_sharding=logits_sharding)
    return out.tokens, out.scores


def _check_slots(tokens, valid, context: ImageContext) -> None:
  """Concrete tokens (outside jit) must hold in each row the SOFT_TOKEN slots of its first k images, whole (a
  prompt may stop before its later images): with an image's slots cut short its soft tokens spill into the next
  image's slots or are dropped, past the last image's the last soft token repeats, and the model runs on.
  Traced tokens cannot be checked."""
  tokens, valid, counts = concrete(tokens), concrete(valid), concrete(context.counts)
  if tokens is None or valid is None or counts is None:
    return
  have = np.sum((tokens == SOFT_TOKEN) & valid, axis=1)  # [b]
  ends = np.cumsum(counts, axis=1)  # [b, n]: the slots of the first 1, 2, .. n images
  for row in range(tokens.shape[0]):
    if have[row] and not np.any(ends[row] == have[row]):
      raise ValueError(f"VisionLanguageModel: tokens row {row} holds {int(have[row])} SOFT_TOKEN slots, which end "
                       f"no image: its images take {[int(c) for c in counts[row]]} slots in turn "
                       f"(slots_per_image of each, before its marker), and the text holds its first images whole")


def _patch_valid(pixel_valid, image_valid, patch_size: int):
  """[b, n, P]: the real patches of the images present."""
  b, n, height, width = pixel_valid.shape
  patch_valid = vit_lib.patch_valid(pixel_valid.reshape(b * n, height, width), patch_size)
  return (patch_valid & image_valid.reshape(b * n, 1)).reshape(b, n, -1)


def frozen_features(encoder: nnx.Module, images, pixel_valid, image_valid, *, hide_padding: bool, dtype=None):
  """The frozen encoder's reading of every image slot, as the VLM computes it -> (features [b, n, 1 + P,
  width], patch_valid [b, n, P]). An empty slot is read too (the connectors mask it); with hide_padding,
  the padded patches are hidden from the encoder's attention. No gradient flows into the features."""
  b, n, height, width, channels = images.shape
  patch_valid = _patch_valid(pixel_valid, image_valid, encoder.patch_size)
  features = encoder.features(images.reshape(b * n, height, width, channels).astype(dtype or images.dtype),
                              valid=patch_valid.reshape(b * n, -1) if hide_padding else None, deterministic=True)
  return jax.lax.stop_gradient(features).reshape(b, n, *features.shape[1:]), patch_valid


def trainable_parameters(model: nnx.Module) -> int:
  """How many parameters training updates (the `nnx.Param`s; frozen ones are `FrozenParam`s)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
