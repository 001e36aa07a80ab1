"""task.decoding read into DecodingOptions (xattn_jax/tasks/decoding_config.py)."""
import importlib
import logging

import ml_collections
import pytest

from xattn_jax import decoding
from xattn_jax.tasks import decoding_config
from xattn_jax.training import validation


def test_a_missing_section_lists_the_decoding_methods_and_options_of_their_owner(monkeypatch):
  monkeypatch.setitem(decoding.DECODING_METHODS, "my_search", decoding.DECODING_METHODS["greedy"])
  config = ml_collections.ConfigDict({"task": {}})
  with pytest.raises(validation.ConfigError) as error:
    decoding_config.decoding_options(config)
  assert " | ".join(decoding.DECODING_METHODS) in str(error.value) and "my_search" in str(error.value)
  assert all(field in str(error.value) for field in decoding.OPTION_FIELDS)


def test_an_option_the_method_does_not_read_is_named_once_in_a_warning_with_its_reader(caplog):
  config = ml_collections.ConfigDict({"task": {"decoding": {"method": "greedy", "temperature": 0.731}}})
  with caplog.at_level(logging.WARNING):
    for _ in range(2):  # validate and the task's setup both read the section
      assert decoding_config.decoding_options(config).method == "greedy"
  said = [r.getMessage() for r in caplog.records if "temperature" in r.getMessage()]
  assert len(said) == 1 and "task.decoding.temperature=0.731 is read by method=sample only" in said[0], said


def test_a_seed_beside_a_method_that_draws_nothing_is_named_once_in_a_warning_with_the_methods_that_draw(
    caplog, monkeypatch):
  sample = decoding.DECODING_METHODS["sample"]
  monkeypatch.setitem(decoding.DECODING_METHODS, "my_sampler", decoding.DecodingMethod(sample.run, draws=True))
  with caplog.at_level(logging.WARNING):
    for method, seed in [(m, s) for m in ("greedy", "beam", "sample", "my_sampler") for s in (4321, 0)] * 2:
      config = ml_collections.ConfigDict({"task": {"decoding": {"method": method, "seed": seed}}})
      assert decoding_config.decoding_options(config).method == method
  said = [r.getMessage() for r in caplog.records if "seed" in r.getMessage()]
  assert said == [f"task.decoding.seed=4321 is read by method=sample | my_sampler only: method={method} decodes "
                  "without it" for method in ("greedy", "beam")], said


# configs/vlm_lm.py decodes greedily on lm_text's sampling section: finished LM runs recorded it, and a VLM
# refuses a declared LM config that differs from its run's, so it stays (one warning)
@pytest.mark.parametrize("spec", ["lm_algorithmic", "lm_text", "translate_dates", "translate_tsv", "vlm_digits",
                                  "vlm_tsv"])
def test_every_bundled_decoding_section_sets_only_what_its_method_reads(spec):
  name, _, arg = spec.partition(":")
  config = importlib.import_module(f"configs.{name}").get_config(arg or None)
  options = decoding_config.decoding_options(config)
  assert options.method == config.task.decoding.method and decoding.unread_options(options) == ()
