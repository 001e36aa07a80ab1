"""A small Vision Transformer: the image encoder whose patch features the Q-Former reads.

images [b, H, W, C] -> patches [b, M, p*p*C] (M = (H/p) * (W/p), row-major) -> linear embedding
-> + learned 2D position table (resized to the input's patch grid when it differs from the grid
it was trained on) -> a class token in front -> encoder blocks -> LayerNorm.
`features(images)` returns every output token [b, 1 + M, width] (the class token first): BLIP-2's
Q-Former likewise reads all of its ViT's outputs (257 = 1 + 16 x 16). `__call__(images)` classifies
from the class token, which is how the encoder is pre-trained
(`configs/vit_digits.py`) before the Q-Former freezes it.
"""
from __future__ import annotations

import chex
import einops
import jax.numpy as jnp
from flax import nnx

from xattn_jax.layers import EncoderBlock, make_position_encoding
from xattn_jax.layers import dense
from xattn_jax.layers import layer_stack
from xattn_jax.ops import masks as masks_lib
from xattn_jax.ops.positions import _check_positive_int


POOLS = ("token", "gap")


def patchify(images, patch_size: int, channels: int | None = None):
  """images [b, H, W, C] -> (patches [b, M, p*p*C], positions [b, M, 2] int32 (row, col), grid (H/p, W/p)).

  Patches are taken row-major; a patch's position is its (row, column) on the patch grid. channels: the C
  a model's patch embedding reads (None = any).
  """
  if images.ndim != 4 or channels not in (None, images.shape[-1]):
    raise ValueError(f"patchify: images must be [batch, height, width, channels={channels or 'C'}], got "
                     f"images{list(images.shape)}")
  batch, height, width, _ = images.shape
  if patch_size < 1 or height % patch_size or width % patch_size:
    raise ValueError(f"patchify: height and width must be multiples of patch_size={patch_size}, got "
                     f"images{list(images.shape)}")
  grid = (height // patch_size, width // patch_size)
  patches = einops.rearrange(images, "b (gh p) (gw q) c -> b (gh gw) (p q c)", p=patch_size, q=patch_size)
  rows, cols = jnp.meshgrid(jnp.arange(grid[0]), jnp.arange(grid[1]), indexing="ij")
  positions = jnp.stack([rows.ravel(), cols.ravel()], axis=-1).astype(jnp.int32)  # [M, 2]
  return patches, jnp.broadcast_to(positions, (batch, *positions.shape)), grid


def patch_valid(pixel_valid, patch_size: int):
  """pixel_valid bool [b, H, W] -> bool [b, M] (row-major, as `patchify`): a patch is real when all its
  pixels are (an image placed top-left on a padded canvas covers whole patches)."""
  if (pixel_valid.ndim != 3 or pixel_valid.shape[1] % patch_size or pixel_valid.shape[2] % patch_size
      or pixel_valid.dtype != jnp.bool_):  # a 0.5 or 2 would count as real: masks are bool, True = real
    raise ValueError(f"patch_valid: pixel_valid must be bool [batch, H, W] with H, W multiples of "
                     f"patch_size={patch_size}, got pixel_valid {pixel_valid.dtype}{list(pixel_valid.shape)}")
  grid = einops.rearrange(pixel_valid, "b (gh p) (gw q) -> b (gh gw) (p q)", p=patch_size, q=patch_size)
  return jnp.all(grid, axis=-1)


class ViT(nnx.Module):
  """Vision Transformer classifier with a class token and a learned 2D position table.

  Args:
    num_classes: outputs of the head (read from the class token).
    channels: image channels; patch_size: side of a square patch (1 = every pixel is a token).
    grid: the (height, width) patch grid of training images: the shape of the learned table, which is
      resized (bilinear) to any other grid, the class token's row untouched.
    width, num_heads, num_blocks, mlp_ratio: transformer sizes.
    pool: what the head reads: "token" (the class token) or "gap" (the mean of the patch tokens, which
      generalises better on small data sets, Beyer et al. 2022).
    scan_layers / remat: run the blocks with nnx.scan, under a remat policy by name.
  """

  def __init__(self, *, num_classes: int, channels: int = 1, patch_size: int = 1, grid: tuple[int, int] = (8, 8),
               width: int = 64, num_heads: int = 4, num_blocks: int = 4, mlp_ratio: int = 4,
               dropout_rate: float = 0.0, pool: str = "token", scan_layers: bool = False, remat: str = "none",
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if pool not in POOLS:
      raise ValueError(f"ViT: pool must be one of {POOLS}, got pool={pool!r}")
    for name, value in (("num_classes", num_classes), ("channels", channels), ("patch_size", patch_size),
                        ("width", width), ("num_heads", num_heads), ("num_blocks", num_blocks),
                        ("mlp_ratio", mlp_ratio)):
      _check_positive_int(value, "ViT", name)
    layer_stack.remat_policy(remat)  # raises for an unknown policy name
    self.width, self.patch_size, self.scan_layers, self.remat, self.dtype = width, patch_size, scan_layers, remat, dtype
    self.pool, self.channels = pool, channels
    self.embed = dense.Dense(
        channels * patch_size ** 2, width, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "embed"), eager_sharding=False),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("embed",), eager_sharding=False))
    self.class_token = nnx.Param(nnx.with_partitioning(
        nnx.initializers.normal(0.02), (None, "embed"), eager_sharding=False)(rngs.params(), (1, width), param_dtype))
    self.positions = make_position_encoding("learned_2d", features=width, grid=tuple(grid), num_extra_tokens=1,
                                            param_dtype=param_dtype, rngs=rngs)
    self.blocks = layer_stack.create_stack(
        lambda r: EncoderBlock(width, num_heads, mlp_ratio * width, dropout_rate=dropout_rate, dtype=dtype,
                               param_dtype=param_dtype, rngs=r), num_blocks, rngs)
    self.norm = nnx.LayerNorm(width, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.head = dense.Dense(width, num_classes, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def features(self, images, *, valid=None, deterministic: bool = True):
    """images [b, H, W, C] -> tokens [b, 1 + M, width]: the class token, then the M patches row-major.

    valid: bool [b, M] (True = a real patch, e.g. `patch_valid` of an image on a padded canvas) or None;
    padded patches are hidden from every attention, so the real tokens do not depend on the padding.
    """
    patches, positions, grid = patchify(images, self.patch_size, self.channels)
    mask = None
    if valid is not None:
      valid = jnp.asarray(valid)
      if valid.shape != patches.shape[:2] or valid.dtype != jnp.bool_:
        raise ValueError(f"ViT.features: valid must be bool {list(patches.shape[:2])} (batch, patches), got "
                         f"valid {valid.dtype}{list(valid.shape)}")
      with_class = jnp.concatenate([jnp.ones((valid.shape[0], 1), bool), valid], axis=1)
      mask = masks_lib.padding_mask(with_class)  # [b, 1, 1, 1 + M]
    x = self.embed(patches.astype(self.dtype))  # [b, M, width]
    class_token = jnp.broadcast_to(self.class_token[...].astype(x.dtype), (x.shape[0], 1, x.shape[-1]))
    x = self.positions.add_to_inputs(jnp.concatenate([class_token, x], axis=1), positions, grid=grid)
    x = layer_stack.apply_stack(self.blocks, x, scan=self.scan_layers, remat=self.remat, mask=mask,
                                deterministic=deterministic)
    x = self.norm(x)
    chex.assert_shape(x, (images.shape[0], 1 + patches.shape[1], self.width))
    return x

  def __call__(self, images, *, deterministic: bool = True):
    """images [b, H, W, C] -> logits [b, num_classes] (float32), from the class token or the patches' mean."""
    tokens = self.features(images, deterministic=deterministic)
    pooled = tokens[:, 0] if self.pool == "token" else tokens[:, 1:].mean(axis=1)
    return self.head(pooled).astype(jnp.float32)
