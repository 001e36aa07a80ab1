"""The Perceiver latent reader on the digits' pixels or patches (`configs/perceiver_digits.py`)."""
from __future__ import annotations

from flax import nnx

from xattn_jax.data import digits
from xattn_jax.models import latent_reader
from xattn_jax.tasks.digits import common
from xattn_jax.training import validation


class PerceiverTask(common.DigitsBase):
  """Classify the digits with N latents that cross-attend to the image's M elements once."""
  # The grid's encodings alone: validation names these for any other value, unknown or 1D (rope, sinusoidal, ...)
  position_encodings = staticmethod(latent_reader.grid_encodings)

  @classmethod
  def validate(cls, config, mode="train"):
    super().validate(config, mode)
    common.check_patch_size(config)
    validation.require_positive(config, "model.num_latents", "model.num_repeats")

  def make_model(self, rngs, *, dtype, param_dtype):
    model = self.config.model
    # The layers' Dropout modules want a "dropout" stream at construction even when they never drop.
    rngs = nnx.Rngs(params=rngs.params(), dropout=rngs.params())
    return latent_reader.Perceiver(
        num_classes=digits.NUM_CLASSES, patch_size=model.patch_size, grid=common.parse_grid(model.grid),
        width=model.d_model, num_latents=model.num_latents, num_heads=model.num_heads,
        num_blocks=model.num_blocks, num_repeats=model.num_repeats, mlp_ratio=model.mlp_ratio,
        position_encoding=model.position_encoding, scan_layers=model.scan_layers,
        remat=model.remat, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def tokens_handed_on(self, model, images):
    return model.latents.queries.shape[0]  # N, whatever M is

  def query_attention(self, model, images):
    weights = nnx.jit(lambda m, x: m.cross_attention_weights(x))(model, images)  # [n, heads, N, M]
    return weights, model.patch_size
