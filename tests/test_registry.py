"""A fork's registry entries reach a run's record: the recorded config.py imports the modules that registered the
entries its config names, so resume, eval, infer and load_model from it find them in a fresh process."""
import importlib
import json
import sys

import pytest

from configs import lm_algorithmic
from tests import helpers
from xattn_jax import decoding, registry
from xattn_jax.layers import positions
from xattn_jax.ops import attention
from xattn_jax.training import optim, validation, workdir

MODULE = "my_fork_entries"
# A researcher's module: the dense op, greedy search, SGD and sinusoidal positions, each under a name of its own.
FORK = """
from xattn_jax import decoding
from xattn_jax.layers import positions
from xattn_jax.ops import attention
from xattn_jax.training import optim


def my_dense(query, key, value, *, mask, bias, is_causal, scale):
  return attention.dot_product_attention(query, key, value, mask=mask, bias=bias, is_causal=is_causal, scale=scale,
                                         implementation="dense")


attention.register_attention_implementation("my_dense", my_dense)
decoding.register_decoding_method("my_greedy", decoding.DECODING_METHODS["greedy"].run)
optim.register_optimizer("my_sgd", optim.OPTIMIZERS["sgd"].build, reads=("momentum",))
positions.register_position_encoding("my_sinusoidal", positions.POSITION_ENCODINGS["sinusoidal"])
"""
ENTRIES = ((attention.IMPLEMENTATIONS, "my_dense"), (decoding.DECODING_METHODS, "my_greedy"),
           (optim.OPTIMIZERS, "my_sgd"), (positions.POSITION_ENCODINGS, "my_sinusoidal"))


def _unregister():
  """The process as a fresh one finds it: no fork entry, no fork module imported."""
  for entries, name in ENTRIES:
    entries.pop(name, None)
  sys.modules.pop(MODULE, None)


@pytest.fixture
def fork(tmp_path):
  """The module, in a folder of its own, imported as a config file beside it imports it (the folder on sys.path
  only while it does); the registries, sys.modules and sys.path as they were afterwards."""
  folder = tmp_path / "fork"
  folder.mkdir()
  (folder / f"{MODULE}.py").write_text(FORK)
  sys.path.insert(0, str(folder))
  importlib.import_module(MODULE)
  sys.path.remove(str(folder))
  yield folder
  _unregister()
  while str(folder) in sys.path:
    sys.path.remove(str(folder))


def _forked_config():
  config = lm_algorithmic.get_config("size=micro")
  config.model.implementation = "my_dense"
  config.task.decoding.method = "my_greedy"
  config.optimizer.name = "my_sgd"
  config.model.position_encoding = "my_sinusoidal"
  return config


def test_the_recorded_config_registers_the_fork_entries_it_names_again(fork, tmp_path):
  config = _forked_config()
  workdir.write_config(config, str(tmp_path))
  _unregister()
  loaded = helpers.load_config(f"--config={tmp_path / 'config.py'}")  # as launch.py loads it
  assert json.loads(loaded.to_json()) == json.loads(config.to_json_best_effort())
  assert all(name in entries for entries, name in ENTRIES)
  validation.validate_config(loaded, mode="train")  # refused before: "allowed are ... dense, xla, chunked, cudnn"


def test_a_config_naming_only_the_packages_own_entries_records_no_import(fork, tmp_path):
  workdir.write_config(lm_algorithmic.get_config("size=micro"), str(tmp_path))
  text = (tmp_path / "config.py").read_text()
  assert "registry" not in text and MODULE not in text


def test_a_record_whose_module_is_gone_names_the_entry_and_where_the_module_was(fork, tmp_path):
  workdir.write_config(_forked_config(), str(tmp_path))
  _unregister()
  (fork / f"{MODULE}.py").unlink()
  importlib.invalidate_caches()
  with pytest.raises(ValueError, match=rf"^model.implementation='my_dense' names an entry that "
                                       rf"register_attention_implementation added in {MODULE}; importing it failed "
                                       rf".*: restore the module in {fork}"):
    validation.load_config_file(str(tmp_path / "config.py"))


def test_an_entry_registered_outside_an_import_loads_where_registered_and_is_named_where_not(tmp_path):
  attention.register_attention_implementation(  # from a test function: no import registers it
      "inline_dense", lambda q, k, v, **options: attention.dot_product_attention(q, k, v, implementation="dense",
                                                                                 **options))
  try:
    config = lm_algorithmic.get_config("size=micro")
    config.model.implementation = "inline_dense"
    workdir.write_config(config, str(tmp_path))
    assert validation.load_config_file(str(tmp_path / "config.py")).model.implementation == "inline_dense"
  finally:
    attention.IMPLEMENTATIONS.pop("inline_dense")
  with pytest.raises(ValueError, match=r"^model.implementation='inline_dense' names an entry that "
                                       r"register_attention_implementation added in .*, where no import by name runs "
                                       r"it .*: register it at the top level of a module the config file imports"):
    validation.load_config_file(str(tmp_path / "config.py"))


@pytest.mark.parametrize("entries", [None, [("model.implementation", "register_attention_implementation", "x")]])
def test_restore_refuses_what_named_by_does_not_return(entries):
  with pytest.raises(ValueError, match=r"^restore: entries must be a list of \(field, register function"):
    registry.restore(entries)
