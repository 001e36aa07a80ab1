"""Two-way cross-attention: prompt tokens and image features read each other (SAM's mask decoder).

Segment Anything's decoder (Kirillov et al. 2023, `TwoWayTransformer`) runs a few blocks of

  tokens <- LayerNorm(tokens + SelfAttention(tokens + token_pe, tokens + token_pe, tokens))
  tokens <- LayerNorm(tokens + CrossAttention(tokens + token_pe, image + image_pe, image))   # token -> image
  tokens <- LayerNorm(tokens + MLP(tokens))
  image  <- LayerNorm(image + CrossAttention(image + image_pe, tokens + token_pe, tokens))  # image -> token

then one last token -> image attention. The first block's self-attention adds no token_pe and no residual,
`tokens <- LayerNorm(SelfAttention(tokens, tokens, tokens))`, as SAM's (`skip_first_layer_pe`): the tokens
are their own encoding there. Positional encodings are added to queries and keys only, never
to values, and re-added at every layer (the streams themselves carry no position): `token_pe` is the
tokens' own initial embedding (the prompt encoding), `image_pe` the dense encoding of the image grid.
Every attention is a `layers.attention.MultiHeadAttention`; its keys and values are projected from
different inputs (keys with the encoding, values without) into a `MemoryCache` and read with `attend`.

Padding: a batch of prompts of different lengths is padded to one length with `token_valid` False.
Padded tokens are hidden as KEYS of the token self-attention and of the image -> token attention, so
they change no valid token and no image feature; their own rows are computed and meaningless. (SAM
instead pads point prompts with a learned "not a point" embedding that every token attends to; masking
makes a prompt's result independent of how far it was padded.)

Shapes: tokens [b, T, d]; token_pe [b, T, d]; token_valid [b, T] bool (True = a real token);
image [b, M, d] (M features, any order); image_pe [b, M, d].
"""
from __future__ import annotations

import einops
import jax.numpy as jnp
from flax import nnx

from xattn_jax.layers import blocks
from xattn_jax.layers.attention import MemoryCache, MultiHeadAttention, _check_positive_int
from xattn_jax.ops import masks as masks_lib


def _memory(attention: MultiHeadAttention, key_inputs, value_inputs) -> MemoryCache:
  """Keys projected from key_inputs, values from value_inputs ([b, s, kv_features] each), heads-major
  [b, kv_heads, s, head_dim] as `MultiHeadAttention.attend` reads them."""
  split = lambda x: einops.rearrange(x, "b s (k h) -> b k s h", k=attention.num_kv_heads)
  return MemoryCache(keys=split(attention.key(key_inputs)), values=split(attention.value(value_inputs)))


def _attend(attention: MultiHeadAttention, queries, keys, values, mask=None):
  """softmax(q(queries) k(keys)^T) v(values) -> [b, t, out_features]; mask [b, 1, 1, s] hides keys."""
  return attention.attend(queries, _memory(attention, keys, values), mask=mask)


def _check(where: str, name: str, x, shape: tuple[int, ...]):
  if tuple(x.shape) != tuple(shape):
    raise ValueError(f"{where}: {name} must be {list(shape)}, got {name}{list(x.shape)}")


def _check_inputs(where: str, tokens, token_pe, token_valid, image, image_pe, width: int):
  if tokens.ndim != 3 or tokens.shape[-1] != width:
    raise ValueError(f"{where}: tokens must be [batch, T, {width}], got tokens{list(tokens.shape)}")
  if image.ndim != 3 or image.shape[-1] != width or image.shape[0] != tokens.shape[0]:
    raise ValueError(f"{where}: image must be [{tokens.shape[0]}, M, {width}], got image{list(image.shape)}")
  _check(where, "token_pe", token_pe, tokens.shape)
  _check(where, "image_pe", image_pe, image.shape)
  if token_valid is not None:
    _check(where, "token_valid", token_valid, tokens.shape[:2])
    if token_valid.dtype != jnp.bool_:
      raise ValueError(f"{where}: token_valid must be boolean (True = a real token), got {token_valid.dtype}")


class TwoWayAttentionBlock(nnx.Module):
  """One block of SAM's two-way transformer: tokens and image features both come out updated.

  Args:
    width: d of both streams.
    num_heads: heads of every attention.
    mlp_features: hidden width of the tokens' MLP.
    cross_attention_downsample: the cross-attentions work at width / this (SAM: 2), the self-attention
      at the full width.
    skip_first_layer_pe: the first block of a stack: its self-attention adds no token_pe (the tokens ARE
      their encoding there) and replaces the tokens by its output, no residual, as SAM's.
  """

  def __init__(self, width: int, num_heads: int, mlp_features: int, *, cross_attention_downsample: int = 2,
               skip_first_layer_pe: bool = False, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    for name, value in (("width", width), ("num_heads", num_heads),
                        ("cross_attention_downsample", cross_attention_downsample)):
      _check_positive_int(name, value, "TwoWayAttentionBlock")  # 0 divided the widths by zero below
    if width % cross_attention_downsample or (width // cross_attention_downsample) % num_heads:
      raise ValueError(f"TwoWayAttentionBlock: width / cross_attention_downsample must be a multiple of "
                       f"num_heads, got width={width}, cross_attention_downsample={cross_attention_downsample}, "
                       f"num_heads={num_heads}")
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    cross_head_dim = width // cross_attention_downsample // num_heads
    self.width, self.skip_first_layer_pe = width, skip_first_layer_pe
    self.self_attention = MultiHeadAttention(num_heads, width, **common)
    self.token_to_image = MultiHeadAttention(num_heads, width, head_dim=cross_head_dim, **common)
    self.image_to_token = MultiHeadAttention(num_heads, width, head_dim=cross_head_dim, **common)
    self.mlp = blocks.MLP(width, mlp_features, activation="relu", **common)
    self.norms = nnx.List([blocks.layer_norm(width, **common) for _ in range(4)])

  def __call__(self, tokens, image, *, token_pe, image_pe, token_valid=None):
    """(tokens [b, T, d], image [b, M, d]) -> both updated, same shapes; see the module docstring."""
    _check_inputs("TwoWayAttentionBlock", tokens, token_pe, token_valid, image, image_pe, self.width)
    token_keys = None if token_valid is None else masks_lib.padding_mask(token_valid)  # [b, 1, 1, T]
    if self.skip_first_layer_pe:
      tokens = self.norms[0](_attend(self.self_attention, tokens, tokens, tokens, token_keys))
    else:
      queries = tokens + token_pe
      tokens = self.norms[0](tokens + _attend(self.self_attention, queries, queries, tokens, token_keys))
    tokens = self.norms[1](tokens + _attend(self.token_to_image, tokens + token_pe, image + image_pe, image))
    tokens = self.norms[2](tokens + self.mlp(tokens))
    image = self.norms[3](image + _attend(self.image_to_token, image + image_pe, tokens + token_pe, tokens,
                                          token_keys))
    return tokens, image


class TwoWayTransformer(nnx.Module):
  """num_blocks TwoWayAttentionBlocks, then a final token -> image attention (residual + LayerNorm).

  `__call__(tokens, image, token_pe=..., image_pe=..., token_valid=...)` -> (tokens [b, T, d],
  image [b, M, d]). The number of output tokens is T whatever M is; permuting the M image features
  together with their encodings leaves the tokens unchanged and permutes the image outputs alike.
  """

  def __init__(self, width: int, num_heads: int, mlp_features: int, num_blocks: int, *,
               cross_attention_downsample: int = 2, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    if num_blocks < 1:
      raise ValueError(f"TwoWayTransformer: num_blocks must be positive, got num_blocks={num_blocks}")
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.width = width
    self.blocks = nnx.List([
        TwoWayAttentionBlock(width, num_heads, mlp_features, cross_attention_downsample=cross_attention_downsample,
                             skip_first_layer_pe=index == 0, **common) for index in range(num_blocks)])
    self.final_attention = MultiHeadAttention(
        num_heads, width, head_dim=width // cross_attention_downsample // num_heads, **common)
    self.final_norm = blocks.layer_norm(width, **common)

  def __call__(self, tokens, image, *, token_pe, image_pe, token_valid=None):
    _check_inputs("TwoWayTransformer", tokens, token_pe, token_valid, image, image_pe, self.width)
    for block in self.blocks:
      tokens, image = block(tokens, image, token_pe=token_pe, image_pe=image_pe, token_valid=token_valid)
    tokens = self.final_norm(tokens + _attend(self.final_attention, tokens + token_pe, image + image_pe, image))
    return tokens, image
