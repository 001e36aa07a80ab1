"""Flax NNX layers that wrap the ops: attention with explicit caches, position encodings, blocks."""
from xattn_jax.layers.attention import KVCache, MemoryCache, MultiHeadAttention
from xattn_jax.layers.blocks import (MLP, CrossAttentionBlock, DecoderBlock, DecoderCache, EncoderBlock,
                                     GatedCrossAttentionBlock, LearnedQueryPooling)
from xattn_jax.layers.positions import (POSITION_ENCODINGS, PositionEncoding, make_position_encoding,
                                        register_position_encoding)
from xattn_jax.layers.rotary import RotarySpec
