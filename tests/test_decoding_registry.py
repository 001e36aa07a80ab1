"""A decoding method registered from outside the package, after every import, counts as a built-in one:
DecodingOptions, search and the tasks' task.decoding.method read the registry when they check."""
import re

import jax.numpy as jnp
import numpy as np
import pytest

from configs import translate_dates
from xattn_jax import decoding
from xattn_jax.decoding import register_decoding_method
from xattn_jax.tasks import decoding_config
from xattn_jax.training import validation

BOS, EOS = 1, 2
CALLS = []


def recorded_greedy(decode_step, cache, options, rng, *, cache_batch_axis, logits_sharding, **common):
  """A researcher's own method: greedy search, noting the option it declares it reads."""
  del rng, cache_batch_axis, logits_sharding
  CALLS.append(options.temperature)
  return decoding.greedy_search(decode_step, cache, cache_halves=options.cache_halves, **common)


@pytest.fixture
def registered():
  """Registers recorded_greedy as a user's code would, and removes it afterwards."""
  CALLS.clear()
  register_decoding_method("recorded_greedy", recorded_greedy, reads=("temperature",))
  yield
  decoding.DECODING_METHODS.pop("recorded_greedy")


def _step(tokens, cache):
  """Every row's next-token logits favour token 3, then EOS."""
  logits = jnp.asarray([0.0, 0.0, 1.0, 2.0, 0.5])
  return jnp.broadcast_to(logits, (tokens.shape[0], 1, 5)), cache


def _search(options):
  return decoding.search(_step, jnp.zeros(()), options, batch_size=2, max_length=3, bos_id=BOS, eos_id=EOS)


def test_search_runs_a_registered_method_with_its_options(registered):
  options = decoding.DecodingOptions(method="recorded_greedy", temperature=0.5)
  np.testing.assert_array_equal(_search(options).tokens, _search(decoding.DecodingOptions()).tokens)
  assert CALLS == [0.5]
  assert decoding.DECODING_METHODS["recorded_greedy"].reads == ("temperature",)


def test_a_registered_method_must_return_tokens_and_scores_of_the_batch(registered):
  wrong = lambda decode_step, cache, options, rng, **common: decoding.GreedyOutput(jnp.zeros((2, 1)), jnp.zeros(2))  # noqa: E731
  register_decoding_method("truncated", wrong)
  try:
    with pytest.raises(ValueError, match=re.escape("method 'truncated' must return GreedyOutput(tokens [batch_size, "
                                                   "max_length]=[2, 3], scores [2]), got GreedyOutput with shapes "
                                                   "[[2, 1], [2]]")):
      _search(decoding.DecodingOptions(method="truncated"))
  finally:
    decoding.DECODING_METHODS.pop("truncated")


def test_a_config_naming_a_registered_method_validates(registered):
  config = translate_dates.get_config()
  config.task.decoding.method = "recorded_greedy"
  validation.validate_config(config)
  assert decoding_config.decoding_options(config).method == "recorded_greedy"
  config.task.decoding.method = "nucleus"
  with pytest.raises(validation.ConfigError, match=re.escape(
      "config.task.decoding.method='nucleus': method must be one of ['greedy', 'beam', 'sample', "
      "'recorded_greedy'], got 'nucleus'")):
    validation.validate_config(config)


def test_a_registered_name_is_not_registered_again(registered):
  for name in ("recorded_greedy", "beam"):
    with pytest.raises(ValueError, match=rf"^register_decoding_method: '{name}' is registered already"):
      register_decoding_method(name, recorded_greedy)
  register_decoding_method("recorded_greedy", decoding.DECODING_METHODS["greedy"].run, replace=True)
  assert decoding.DECODING_METHODS["recorded_greedy"].reads == ()
  with pytest.raises(ValueError, match="name must be a non-empty str, got name=''"):
    register_decoding_method("", recorded_greedy)
  with pytest.raises(ValueError, match="run must be callable, got str"):
    register_decoding_method("nucleus", "nucleus")
  with pytest.raises(ValueError, match=re.escape("reads must be a tuple of DecodingOptions fields from ['beam_size', "
                                                 "'alpha', 'temperature', 'top_k', 'top_p'], got reads=('seed',)")):
    register_decoding_method("nucleus", recorded_greedy, reads=("seed",))
  with pytest.raises(ValueError, match=re.escape("draws must be a bool (True: run draws from rng), got draws='yes'")):
    register_decoding_method("nucleus", recorded_greedy, draws="yes")
  assert "nucleus" not in decoding.DECODING_METHODS
  register_decoding_method("recorded_greedy", recorded_greedy, draws=True, replace=True)
  assert decoding.DECODING_METHODS["recorded_greedy"].draws
