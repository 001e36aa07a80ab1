"""An encoding registered from outside the package, after every import, counts as a built-in one: the models,
the tasks and config validation read the registry when they check."""
import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import algorithmic, lm_text, perceiver_digits, translate_dates
from xattn_jax.layers import PositionEncoding, register_position_encoding
from xattn_jax.layers import positions as position_layers
from xattn_jax.models import lm, translator
from xattn_jax.ops import positions as positions_ops
from xattn_jax.tasks import algorithmic as algorithmic_task
from xattn_jax.tasks import reading_fields
from xattn_jax.training import validation
from xattn_jax.training import workdir as workdir_lib

VOCAB, D_MODEL = 16, 8


class HalfSinusoidalPositions(position_layers.NoPositions):
  """A researcher's own encoding: the sinusoidal table at half amplitude."""

  def __init__(self, features: int):
    self.features = features

  def add_to_inputs(self, x, positions=None, *, grid=None):
    positions = jnp.arange(x.shape[1])[None] if positions is None else positions  # [b or 1, t]
    return x + 0.5 * positions_ops.sinusoidal(positions, self.features).astype(x.dtype)


HALF_SINUSOIDAL = PositionEncoding(lambda o, rngs: HalfSinusoidalPositions(o.features), ("sequence",), "additive",
                                   randomizable=True)
# A second learned table: all it shares with "learned" is its entry's rules.
MY_TABLE = dataclasses.replace(position_layers.get("learned"))


@pytest.fixture
def registered():
  """Registers the test's encodings as a user's code would, and removes them afterwards."""
  encodings = {"half_sinusoidal": HALF_SINUSOIDAL, "my_table": MY_TABLE}
  for name, entry in encodings.items():
    register_position_encoding(name, entry)
  yield
  for name in encodings:
    position_layers.POSITION_ENCODINGS.pop(name)


def _lm(encoding: str) -> lm.LanguageModel:
  return lm.LanguageModel(VOCAB, d_model=D_MODEL, num_heads=2, num_layers=1, mlp_dim=16, position_encoding=encoding,
                          max_length=8, rngs=nnx.Rngs(0))


def test_make_position_encoding_builds_a_registered_encoding(registered):
  module = position_layers.make_position_encoding("half_sinusoidal", features=D_MODEL, rngs=nnx.Rngs(0))
  x = jnp.zeros((1, 5, D_MODEL))
  full = position_layers.make_position_encoding("sinusoidal", features=D_MODEL, rngs=nnx.Rngs(0)).add_to_inputs(x)
  np.testing.assert_allclose(module.add_to_inputs(x), 0.5 * full, atol=1e-6)


def test_the_language_model_runs_a_registered_encoding(registered):
  assert _lm("half_sinusoidal")(jnp.ones((2, 5), jnp.int32)).shape == (2, 5, VOCAB)


def test_the_translator_runs_a_registered_encoding(registered):
  side = translator.StackSize(d_model=D_MODEL, num_heads=2, num_layers=1, mlp_dim=16)
  model = translator.Translator(VOCAB, encoder=side, decoder=side, position_encoding="half_sinusoidal",
                                max_length=8, rngs=nnx.Rngs(0))
  tokens = jnp.ones((2, 5), jnp.int32)
  assert model(tokens, tokens).shape == (2, 5, VOCAB)


def test_validation_takes_a_registered_encoding_for_its_layout_only(registered):
  for config in (translate_dates.get_config(), lm_text.get_config()):
    config.model.position_encoding = "half_sinusoidal"
    validation.validate_config(config)
  config = translate_dates.get_config()
  config.model.position_encoding = "nope"
  allowed = sorted(translator.position_encodings())
  assert "half_sinusoidal" in allowed
  with pytest.raises(validation.ConfigError, match=rf"^config\.model\.position_encoding='nope': allowed are "
                                                   rf"{re.escape(str(allowed))}$"):
    validation.validate_config(config)
  config = perceiver_digits.get_config()  # a grid model
  config.model.position_encoding = "half_sinusoidal"
  with pytest.raises(validation.ConfigError, match=rf"^config\.model\.position_encoding='half_sinusoidal': allowed "
                                                   rf"are {re.escape(str(sorted(position_layers.names(layout='grid'))))}$"):
    validation.validate_config(config)


def test_a_registered_name_is_not_registered_again(registered):
  for name in ("half_sinusoidal", "rope"):
    with pytest.raises(ValueError, match=rf"^register_position_encoding: '{name}' is registered already"):
      register_position_encoding(name, HALF_SINUSOIDAL)
  register_position_encoding("half_sinusoidal", MY_TABLE, replace=True)
  assert position_layers.get("half_sinusoidal") is MY_TABLE
  with pytest.raises(ValueError, match="name must be a non-empty str"):
    register_position_encoding("", HALF_SINUSOIDAL)
  with pytest.raises(ValueError, match="entry must be a PositionEncoding"):
    register_position_encoding("half_cosine", HalfSinusoidalPositions)


@pytest.mark.parametrize("encoding", ["learned", "my_table"])
def test_a_second_table_encoding_is_bounded_by_max_length_as_learned_is(registered, encoding, tmp_path):
  """The LM's cache, the model fields eval may change and an algorithmic eval's bands read the entry's
  max_length_table, not the name "learned"."""
  with pytest.raises(ValueError, match=r"capacity=9 positions do not fit the learned position table of 8 rows"):
    _lm(encoding).init_cache(1, 9)
  trained = algorithmic.get_config(f"size=tiny,posenc={encoding}")
  assert "model.max_length" not in reading_fields.position_reading_fields(trained)
  workdir_lib.write_config(trained, str(tmp_path))
  config = algorithmic.get_config(f"size=tiny,posenc={encoding}")
  config.task.eval_bands = "1-20,81-160"
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.eval_bands='1-20,81-160': need 161 positions; "
                                                   r"the run's learned position table has"):
    algorithmic_task.positions_for(config, str(tmp_path), "eval", algorithmic_task.AlgorithmicTask.positions_needed)
