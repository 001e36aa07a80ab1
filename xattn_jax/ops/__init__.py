"""Pure jax.numpy attention ops: no parameters, no Flax.

The submodules are `attention` (the dispatcher), `masks`, `positions` and `relative_bias`; the names
below are the ones most code needs.
"""
from xattn_jax.ops.attention import (IMPLEMENTATIONS, attention_weights, dot_product_attention,
                                     register_attention_implementation)
from xattn_jax.ops.masks import causal_mask, combine_masks, padding_mask, segment_mask
from xattn_jax.ops.positions import (apply_mrope, apply_rope, apply_rope_2d, fourier_features, rope_angles,
                                     sincos_2d, sinusoidal)
from xattn_jax.ops.relative_bias import alibi_bias, t5_relative_bias
