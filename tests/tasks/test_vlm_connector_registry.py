"""A connector is one class and one registry entry: a tiny one registered here runs through the model and the
VLM task's config validation, which name no connector."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests import helpers
from tests.models.test_vlm import batch_of, interleaved, logits_of, make_images, make_vlm
from xattn_jax.models import connectors
from xattn_jax.training import validation


class MeanConnector(connectors._Connector):
  """model.mean_tokens soft tokens per image, read off the mean of the image's real features by one linear."""
  prefix_tokens = True
  config_fields = {"mean_tokens": "num_tokens"}
  own_fields = {"mean_tokens": 1}

  def __init__(self, feature_width, lm, *, num_tokens: int = 1, feature_positions="none", feature_grid=None,
               dropout_rate=0.0, dtype, param_dtype, rngs):
    self._init_feature_positions(feature_positions, feature_width, feature_grid, param_dtype=param_dtype, rngs=rngs)
    self.num_tokens, self.d_model = num_tokens, lm.d_model
    self.projection = nnx.Linear(feature_width, num_tokens * lm.d_model, dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs)

  @staticmethod
  def slots(grid, fields) -> int:
    return fields["mean_tokens"]

  @classmethod
  def check_config(cls, model):
    if model.mean_tokens < 1:
      return "model.mean_tokens", model.mean_tokens, "must be >= 1"
    return None

  def tokens(self, features, valid, *, grid, deterministic):
    """features [B, 1 + P, w], valid [B, 1 + P] -> soft tokens [B, K, d_lm]."""
    weights = valid[..., None].astype(features.dtype)
    mean = jnp.sum(features * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)  # -> [B, w]
    return self.projection(mean).reshape(features.shape[0], self.num_tokens, self.d_model)

  def slot_token(self, k, grid_width, canvas_width):
    return k


@pytest.fixture
def mean_connector():
  connectors.register_connector("mean", MeanConnector)
  yield "mean"
  del connectors.CONNECTORS["mean"]  # the other tests see the bundled three


def test_a_registered_connector_hands_the_lm_its_soft_tokens(mean_connector):
  model = make_vlm(mean_connector, mean_tokens=2)
  assert model.slots_per_image(8, 8) == 2
  tokens, valid = batch_of([interleaved(model)] * 2)
  images, pixel_valid, image_valid = make_images()
  both = jnp.concatenate([images, images + 1.0])  # the same text on other pixels: one compiled pass
  logits = np.asarray(logits_of(model, both, *(jnp.concatenate([x, x]) for x in (pixel_valid, image_valid, tokens,
                                                                                 valid))))
  assert logits.shape == (4, *tokens.shape[1:], model.lm.vocab_size) and np.all(np.isfinite(logits))
  logits, other = logits[:2], logits[2:]
  assert not np.allclose(logits, other)  # the images reach the text


def test_the_task_validates_a_registered_connector_and_its_own_field(mean_connector):
  def error(*argv):
    try:
      validation.validate_config(helpers.load_config("--config=configs/vlm_digits.py", *argv), mode="train")
    except validation.ConfigError as caught:
      return str(caught)
    return None

  assert error("--config.model.connector=mean", "--config.model.mean_tokens=3") is None
  assert error("--config.model.connector=mean", "--config.model.mean_tokens=0").startswith(
      "config.model.mean_tokens=0: must be >= 1")  # its check_config
  assert error("--config.model.connector=llava", "--config.model.mean_tokens=3") == (
      "config.model.mean_tokens=3: is read by connector=mean only (or 1), got model.connector='llava'")
  assert error("--config.model.connector=mean", "--config.model.cross_attention_every=2").startswith(
      "config.model.cross_attention_every=2: is read by connector=flamingo only")


@pytest.mark.parametrize("name, connector, message", [
    ("", MeanConnector, "name must be a non-empty str"),
    ("llava", MeanConnector, "'llava' is registered already"),
    ("plain", nnx.Module, "must be a subclass of connectors._Connector"),
    ("unread", type("Unread", (MeanConnector,), {"own_fields": {"other": 1}}), "must be among its config_fields"),
    ("maps", type("Maps", (MeanConnector,), {"attention_maps": "patches"}), "attention_maps must be one of"),
])
def test_register_connector_refuses_what_the_model_could_not_read(name, connector, message):
  with pytest.raises(ValueError, match=message):
    connectors.register_connector(name, connector)
  assert name not in connectors.CONNECTORS or name == "llava"
