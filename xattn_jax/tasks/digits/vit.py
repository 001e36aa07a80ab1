"""The small ViT classifier on the digits (`configs/vit_digits.py`), later frozen as the Q-Former's encoder."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from xattn_jax.data import digits
from xattn_jax.models import vit
from xattn_jax.tasks.digits import common
from xattn_jax.training import validation


def make_vit(model_config, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs):
  """The ViT of a `model` config section (this task's, or the frozen encoder's)."""
  return vit.ViT(num_classes=digits.NUM_CLASSES, patch_size=model_config.patch_size,
                 grid=common.parse_grid(model_config.grid), width=model_config.d_model,
                 num_heads=model_config.num_heads, num_blocks=model_config.num_blocks,
                 mlp_ratio=model_config.mlp_ratio, pool=model_config.get("pool", "token"),
                 scan_layers=model_config.scan_layers, remat=model_config.remat, dtype=dtype,
                 param_dtype=param_dtype, rngs=rngs)


class ViTTask(common.DigitsBase):
  """Classify the digits with a ViT (class token or mean-pooled head, `model.pool`)."""

  @classmethod
  def validate(cls, config, mode="train"):
    super().validate(config, mode)
    common.check_patch_size(config)
    validation.require_choice(config, "model.pool", vit.POOLS)

  def make_model(self, rngs, *, dtype, param_dtype):
    # The layers' Dropout modules want a "dropout" stream at construction even when they never drop.
    rngs = nnx.Rngs(params=rngs.params(), dropout=rngs.params())
    return make_vit(self.config.model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def tokens_handed_on(self, model, images):
    return 1 + common.patch_tokens(images, model.patch_size)  # the class token and every patch
