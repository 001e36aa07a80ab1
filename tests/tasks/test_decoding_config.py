"""task.decoding read into DecodingOptions (xattn_jax/tasks/decoding_config.py)."""
import ml_collections
import pytest

from xattn_jax import decoding
from xattn_jax.tasks import decoding_config
from xattn_jax.training import validation


def test_a_missing_section_lists_the_decoding_methods_and_options_of_their_owner(monkeypatch):
  monkeypatch.setattr(decoding, "DECODING_METHODS", (*decoding.DECODING_METHODS, "my_search"))
  config = ml_collections.ConfigDict({"task": {}})
  with pytest.raises(validation.ConfigError) as error:
    decoding_config.decoding_options(config)
  assert " | ".join(decoding.DECODING_METHODS) in str(error.value) and "my_search" in str(error.value)
  assert all(field in str(error.value) for field in decoding.OPTION_FIELDS)
