"""A promptable segmenter in the shape of Segment Anything (Kirillov et al. 2023), on small images.

  encode(images) -> ImageFeatures                       once per image (the expensive part)
  decode(features, points, point_labels) -> masks, iou  once per prompt (cheap: SAM's interactive loop)

Image encoder: the project's ViT (`models/vit.py`, its patch tokens from `.features`, the class token
dropped), a linear "neck" to the decoder width with LayerNorm, and a 3x3 convolution of the pixels
whose features the mask head adds after upsampling (the patch tokens alone are too coarse for a
pixel-exact mask of an 8x8-pixel stroke). `freeze_encoder` turns the ViT's parameters into
`latent_reader.FrozenParam`s and stops gradients at its output, as the Q-Former freezes its encoder.

Prompt encoder: a point's (row, column) in [0, 1] image units goes through SAM's
`PositionEmbeddingRandom` (random Fourier features sin / cos(2 pi (2p - 1) G), G a fixed Gaussian
[2, width / 2]), plus a learned embedding of its type (positive / negative click, a box's top-left /
bottom-right corner; `data.segment_digits` labels). The same features at every patch centre are the
image's dense positional encoding. In front of the prompt tokens sit learned output tokens: one IoU
token and `num_masks` mask tokens.

Decoder: `layers.two_way.TwoWayTransformer` over (output + prompt tokens, patch features), padded
prompt tokens masked out. Mask head: the updated patch features are upsampled to the pixel grid
(a linear map to patch * patch sub-pixel features, SAM's transposed convolution with stride = kernel),
the pixel features added; each mask token's MLP output dotted with every pixel's features gives that
mask's logits. The IoU token's MLP predicts each mask's IoU with the target (sigmoid, in [0, 1]).
Every prompt gets all `num_masks` masks (SAM also has a single-mask token for unambiguous prompts;
here the predicted IoU picks one).

Shapes: images [b, H, W, C]; points [b, P, 2]; point_labels [b, P] int (0 = padding);
masks [b, num_masks, H, W] (logits); iou [b, num_masks].
"""
from __future__ import annotations

import math

import einops
import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from xattn_jax.layers import blocks, dense
from xattn_jax.layers.two_way import TwoWayTransformer
from xattn_jax.models import latent_reader, vit as vit_lib
from xattn_jax.ops.concrete import concrete
from xattn_jax.ops.positions import _check_positive_int


class FixedRandom(nnx.Variable):
  """A value drawn at initialisation and never trained (not an `nnx.Param`): SAM's random Fourier matrix."""


@flax.struct.dataclass
class ImageFeatures:
  """What `Segmenter.encode` hands to every decode of the same images.

  embeddings [b, M, width] (patch grid row-major); pixels [b, H, W, mask_features]; grid (h, w) static.
  """
  embeddings: jax.Array
  pixels: jax.Array
  grid: tuple[int, int] = flax.struct.field(pytree_node=False)


def _linear(fan_in, fan_out, dtype, param_dtype, rngs, axes=("embed", "mlp")):
  return dense.Dense(
      fan_in, fan_out, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), axes, eager_sharding=False),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axes[1:], eager_sharding=False))


def _neighbourhoods(images):
  """images [b, H, W, C] -> [b, H, W, 9 C]: each pixel's 3x3 neighbourhood (zero outside), a 3x3
  convolution's inputs as one matmul (XLA:CPU's convolution backward is several times slower here)."""
  height, width = images.shape[1:3]
  padded = jnp.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)))
  return jnp.concatenate([padded[:, r:r + height, c:c + width] for r in range(3) for c in range(3)], axis=-1)


class HeadMLP(nnx.Module):
  """relu MLP of `depth` linear layers: [..., fan_in] -> [..., fan_out] (SAM's prediction heads)."""

  def __init__(self, fan_in: int, hidden: int, fan_out: int, depth: int = 3, *, dtype, param_dtype, rngs):
    sizes = [fan_in] + [hidden] * (depth - 1) + [fan_out]
    self.layers = nnx.List([_linear(a, b, dtype, param_dtype, rngs) for a, b in zip(sizes[:-1], sizes[1:])])

  def __call__(self, x):
    for index, layer in enumerate(self.layers):
      x = layer(x) if index == len(self.layers) - 1 else jax.nn.relu(layer(x))
    return x


class PositionEmbeddingRandom(nnx.Module):
  """Random Fourier features of coordinates in [0, 1]: [..., 2] -> [..., width] (Tancik et al. 2020; SAM)."""

  def __init__(self, width: int, *, scale: float = 1.0, rngs: nnx.Rngs):
    if width % 2:
      raise ValueError(f"PositionEmbeddingRandom: width must be even, got width={width}")
    self.gaussian = FixedRandom(scale * jax.random.normal(rngs.params(), (2, width // 2), jnp.float32))

  def __call__(self, coords):
    if coords.shape[-1] != 2:
      raise ValueError(f"PositionEmbeddingRandom: coords must be [..., 2], got coords{list(coords.shape)}")
    phases = 2.0 * math.pi * (2.0 * coords.astype(jnp.float32) - 1.0) @ self.gaussian[...]  # [..., width / 2]
    return jnp.concatenate([jnp.sin(phases), jnp.cos(phases)], axis=-1)

  def grid(self, height: int, width: int):
    """The encoding of every cell centre of a height x width grid, row-major: [height * width, width]."""
    rows, cols = jnp.meshgrid((jnp.arange(height) + 0.5) / height, (jnp.arange(width) + 0.5) / width,
                              indexing="ij")
    return self(jnp.stack([rows.ravel(), cols.ravel()], axis=-1))


class PromptEncoder(nnx.Module):
  """points [b, P, 2] in [0, 1], point_labels [b, P] -> (tokens [b, 1 + K + P, width], valid [b, 1 + K + P]).

  The first 1 + K tokens are the learned IoU and mask tokens (always valid); a prompt token is
  PositionEmbeddingRandom(point) + type_embedding[label]; label 0 is padding (invalid, its row zero).
  """

  def __init__(self, width: int, num_masks: int, num_point_labels: int, *, fourier_scale: float = 1.0,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.num_masks, self.num_point_labels = num_masks, num_point_labels
    self.positions = PositionEmbeddingRandom(width, scale=fourier_scale, rngs=rngs)
    init = nnx.with_partitioning(nnx.initializers.normal(1.0), (None, "embed"), eager_sharding=False)
    self.type_embeddings = nnx.Param(init(rngs.params(), (num_point_labels, width), param_dtype))
    self.output_tokens = nnx.Param(init(rngs.params(), (1 + num_masks, width), param_dtype))

  def __call__(self, points, point_labels):
    if points.ndim != 3 or points.shape[-1] != 2:
      raise ValueError(f"PromptEncoder: points must be [batch, P, 2], got points{list(points.shape)}")
    if point_labels.shape != points.shape[:2] or not jnp.issubdtype(point_labels.dtype, jnp.integer):
      raise ValueError(f"PromptEncoder: point_labels must be int {list(points.shape[:2])}, got "
                       f"{point_labels.dtype}{list(point_labels.shape)}")
    labels = concrete(point_labels)  # traced labels cannot be checked
    if labels is not None and labels.size:
      low, high = int(labels.min()), int(labels.max())
      if low < 0 or high >= self.num_point_labels:  # a negative one read as padding, one past the table NaN
        raise ValueError(f"PromptEncoder: point_labels must be in [0, num_point_labels={self.num_point_labels}) "
                         f"(0 = padding), got labels from {low} to {high}")
    valid = point_labels > 0  # [b, P]
    prompt = self.positions(points) + jnp.take(self.type_embeddings[...], point_labels, axis=0)
    prompt = jnp.where(valid[..., None], prompt, 0.0)
    batch = points.shape[0]
    output = jnp.broadcast_to(self.output_tokens[...], (batch, *self.output_tokens.shape))
    tokens = jnp.concatenate([output.astype(prompt.dtype), prompt], axis=1)
    return tokens, jnp.concatenate([jnp.ones((batch, 1 + self.num_masks), bool), valid], axis=1)


class Segmenter(nnx.Module):
  """ViT image encoder, prompt encoder, two-way transformer, mask and IoU heads (module docstring).

  Args:
    patch_size, grid: the ViT's patches and the patch grid of its learned position table.
    encoder_width, encoder_heads, encoder_blocks, encoder_mlp_ratio: the ViT's sizes.
    freeze_encoder: the ViT is not trained (FrozenParam, gradients stopped at its output).
    width, num_heads, num_blocks, mlp_features: the two-way transformer's sizes.
    num_masks: masks (and IoU predictions) per prompt.
    mask_features: channels of the upsampled pixel features the mask tokens are dotted with.
    num_point_labels: point types the prompt encoder embeds (label 0 = padding included).
    fourier_scale: standard deviation of the random Fourier matrix.
  """

  def __init__(self, *, patch_size: int, grid: tuple[int, int], encoder_width: int, encoder_heads: int,
               encoder_blocks: int, encoder_mlp_ratio: int, freeze_encoder: bool, width: int, num_heads: int,
               num_blocks: int, mlp_features: int, num_masks: int = 3, mask_features: int = 16,
               num_point_labels: int = 5, fourier_scale: float = 1.0, channels: int = 1, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    for name, value in (("num_masks", num_masks), ("mask_features", mask_features), ("width", width),
                        ("mlp_features", mlp_features), ("num_point_labels", num_point_labels)):
      _check_positive_int(value, "Segmenter", name)
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.patch_size, self.num_masks, self.freeze_encoder, self.dtype = patch_size, num_masks, freeze_encoder, dtype
    encoder = vit_lib.ViT(num_classes=1, channels=channels, patch_size=patch_size, grid=tuple(grid),
                          width=encoder_width, num_heads=encoder_heads, num_blocks=encoder_blocks,
                          mlp_ratio=encoder_mlp_ratio, **common)
    self.encoder = latent_reader.freeze(encoder) if freeze_encoder else encoder
    self.neck = _linear(encoder_width, width, dtype, param_dtype, rngs, axes=("mlp", "embed"))
    self.neck_norm = blocks.layer_norm(width, **common)
    self.pixel_stem = _linear(9 * channels, mask_features, dtype, param_dtype, rngs, axes=(None, "embed"))
    self.prompts = PromptEncoder(width, num_masks, num_point_labels, fourier_scale=fourier_scale,
                                 param_dtype=param_dtype, rngs=rngs)
    self.transformer = TwoWayTransformer(width, num_heads, mlp_features, num_blocks, **common)
    self.upsample = _linear(width, patch_size * patch_size * mask_features, dtype, param_dtype, rngs)
    self.upsample_norm = blocks.layer_norm(mask_features, **common)
    self.mask_mlps = nnx.List([HeadMLP(width, width, mask_features, **common) for _ in range(num_masks)])
    self.iou_head = HeadMLP(width, width, num_masks, **common)

  def encode(self, images) -> ImageFeatures:
    """images [b, H, W, C] -> ImageFeatures: patch embeddings [b, M, width], pixel features [b, H, W, c]."""
    if images.ndim != 4:
      raise ValueError(f"Segmenter.encode: images must be [batch, height, width, channels], got "
                       f"images{list(images.shape)}")
    tokens = self.encoder.features(images.astype(self.dtype))[:, 1:]  # [b, M, encoder_width], class token dropped
    if self.freeze_encoder:
      tokens = jax.lax.stop_gradient(tokens)
    grid = (images.shape[1] // self.patch_size, images.shape[2] // self.patch_size)
    return ImageFeatures(embeddings=self.neck_norm(self.neck(tokens)),
                         pixels=self.pixel_stem(_neighbourhoods(images.astype(self.dtype))), grid=grid)

  def decode(self, features: ImageFeatures, points, point_labels):
    """ImageFeatures of b images, b prompts (points [b, P, 2], point_labels [b, P]) ->
    (mask logits [b, num_masks, H, W] float32, predicted IoU [b, num_masks] float32)."""
    embeddings = features.embeddings
    if points.shape[0] != embeddings.shape[0]:
      raise ValueError(f"Segmenter.decode: points must have the features' batch {embeddings.shape[0]}, got "
                       f"points{list(points.shape)}")
    tokens, valid = self.prompts(points, point_labels)  # [b, T, width], [b, T]
    tokens = tokens.astype(embeddings.dtype)
    image_pe = jnp.broadcast_to(self.prompts.positions.grid(*features.grid).astype(embeddings.dtype),
                                embeddings.shape)
    tokens, image = self.transformer(tokens, embeddings, token_pe=tokens, image_pe=image_pe, token_valid=valid)
    iou_token, mask_tokens = tokens[:, 0], tokens[:, 1:1 + self.num_masks]
    height, width = features.grid
    upsampled = einops.rearrange(self.upsample(image), "b (h w) (p q c) -> b (h p) (w q) c", h=height, w=width,
                                 p=self.patch_size, q=self.patch_size)  # [b, H, W, c]
    pixels = jax.nn.gelu(self.upsample_norm(upsampled) + features.pixels)
    mask_vectors = jnp.stack([mlp(mask_tokens[:, k]) for k, mlp in enumerate(self.mask_mlps)], axis=1)  # [b, K, c]
    masks = jnp.einsum("bkc,bhwc->bkhw", mask_vectors, pixels)
    iou = jax.nn.sigmoid(self.iou_head(iou_token))
    return masks.astype(jnp.float32), iou.astype(jnp.float32)

  def __call__(self, images, points, point_labels):
    """decode(encode(images), points, point_labels): one prompt per image."""
    return self.decode(self.encode(images), points, point_labels)
