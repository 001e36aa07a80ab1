"""The template task learns its problem (reversing letter strings) in a short run, and answers inference
lines with the reversal's length."""
import jax.numpy as jnp
import pytest

from configs import template
from xattn_jax.tasks import template as template_task
from xattn_jax.tasks.template import TemplateTask
from xattn_jax.training import loop, validation

CHANCE = 1 / 26  # a letter guessed uniformly


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(final eval metrics, workdir) of 300 steps on strings of up to 6 letters."""
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({
      "total_steps": 300, "log_every_steps": 100, "eval_every_steps": 300, "checkpoint.every_steps": 300,
      "logging.tensorboard": False, "logging.plot": False, "task.max_length": 6,
      "task.num_eval_examples": 128, "optimizer.warmup_steps": 20})
  workdir = str(tmp_path_factory.mktemp("template"))
  return loop.run(config, workdir), workdir


@pytest.mark.slow
def test_template_learns_to_reverse_well_above_chance(trained):
  metrics, _ = trained
  assert metrics["eval/token_accuracy"] > 6 * CHANCE


@pytest.mark.slow
def test_template_infers_one_string_of_the_input_length_per_line(trained):
  model, task = loop.load_model(trained[1])
  answers = task.infer(model, ["abc", "hello"])
  assert [len(answer) for answer in answers] == [3, 5]
  assert all(set(answer) <= set("abcdefghijklmnopqrstuvwxyz") for answer in answers)


@pytest.mark.parametrize("name", sorted(TemplateTask.position_encodings()))
def test_every_position_encoding_the_template_accepts_builds_a_model_that_tags_each_position(name):
  config = template.get_config(f"size=tiny,posenc={name}")
  validation.validate_config(config)
  task = TemplateTask(config)
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  inputs = task.train_batch(0, process_index=0, process_count=1)["inputs"][:2]
  assert model(inputs).shape == (2, config.task.max_length, template_task.VOCAB_SIZE)


@pytest.mark.slow
def test_launch_trains_an_encoding_that_a_module_imported_by_the_config_file_registers(tmp_path):
  """README: a researcher's own encoding joins the registry from a module their config file imports."""
  import json
  from tests import helpers
  (tmp_path / "my_encoding.py").write_text(
      "from xattn_jax.layers import positions\n"
      "positions.register_position_encoding('my_sinusoidal', positions.PositionEncoding(\n"
      "    lambda o, rngs: positions.SinusoidalPositions(o.features, base=o.base), ('sequence',), 'additive'))\n")
  (tmp_path / "my_config.py").write_text(
      "import os, sys\n"
      "sys.path.insert(0, os.path.dirname(__file__))\n"
      "import my_encoding  # noqa: F401 - registers my_sinusoidal\n"
      "from configs import template\n\n\n"
      "def get_config(arg=None):\n"
      "  config = template.get_config('size=tiny')\n"
      "  config.model.position_encoding = 'my_sinusoidal'\n"
      "  return config\n")
  overrides = {"total_steps": 2, "eval_every_steps": 2, "checkpoint.every_steps": 2, "logging.plot": False,
               "logging.tensorboard": False, "task.num_eval_examples": 8}
  result = helpers.launch(str(tmp_path / "my_config.py"), tmp_path / "run", overrides=overrides)
  assert result.returncode == 0, result.stderr[-2000:]
  assert json.loads((tmp_path / "run" / "config.json").read_text())["model"]["position_encoding"] == "my_sinusoidal"
