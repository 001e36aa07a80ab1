"""Config parsing and validation: every bad field fails before compiling, in one line naming it."""
import dataclasses
import importlib
import os
import pathlib
import re

import jax.numpy as jnp
import pytest
from flax import nnx

from tests.helpers import load_config, abstract_model
from configs import algorithmic, common, perceiver_digits, template, translate_dates
from xattn_jax.layers import blocks, layer_stack
from xattn_jax.layers import positions as position_layers
from xattn_jax.layers.rotary import ROTARY_KINDS
from xattn_jax.training import loop, optim, task as task_lib, validation
from xattn_jax.training import workdir as workdir_lib
from xattn_jax.tasks.template import TemplateTask


# --- config -------------------------------------------------------------------------------------

def test_parse_arg_converts_values_to_the_default_types():
  args = common.parse_arg("size=tiny,layers=3,rate=0.5,scan", size="small", layers=1, rate=0.1, scan=False)
  assert (args.size, args.layers, args.rate, args.scan) == ("tiny", 3, 0.5, True)


def test_parse_arg_rejects_a_key_given_twice():
  """'size=tiny,size=base' built the base model (the last won) without a word."""
  with pytest.raises(ValueError, match=r"^config argument 'size' in 'size=tiny,scan,size=base' is given twice$"):
    common.parse_arg("size=tiny,scan,size=base", size="small", scan=False)


def test_parse_arg_rejects_an_unknown_key_listing_the_allowed_ones():
  with pytest.raises(ValueError, match=r"'sise'.*\['scan', 'size'\]"):
    common.parse_arg("sise=tiny", size="small", scan=False)


def test_variant_argument_and_override_reach_the_model():
  config = load_config("--config=configs/template.py:size=tiny,posenc=rope,scan",
                        "--config.model.d_model=48", "--config.model.num_layers=3")
  model = abstract_model(TemplateTask(config))
  assert model.embed.embedding.shape == (27, 48)  # 26 letters + padding
  assert model.blocks.attention.query.kernel.shape == (3, 48, 48)  # 3 stacked layers
  assert model.scan_layers and model.positions.rotary.kind == "rope" and not hasattr(model.positions, "table")


def test_misspelt_override_is_rejected_by_the_locked_config():
  with pytest.raises(Exception, match="d_modle"):
    load_config("--config=configs/template.py:size=tiny", "--config.model.d_modle=48")


# --- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("task.name", "nope"), ("optimizer.name", "lamb"), ("optimizer.schedule", "step"),
    ("model.position_encoding", "fourier"), ("model.remat", "some"), ("model.name", "other"),
])
def test_unknown_name_is_a_config_error_naming_the_field(field, value):
  _assert_refused(template.get_config("size=tiny"), field, value, rf"^config\.{field}='{value}': allowed")


def _assert_refused(config, field: str, value, message: str):
  """Sets the dotted `field` to `value` and checks validation refuses it with `message` (a regex)."""
  *sections, key = field.split(".")
  parent = config
  for section in sections:
    parent = parent[section]
  parent[key] = value
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(config)


def test_d_model_not_divisible_by_heads_is_a_config_error():
  config = template.get_config("size=tiny")
  config.model.d_model, config.model.num_heads = 30, 4
  with pytest.raises(validation.ConfigError, match=r"config\.model\.d_model=30: must be divisible"):
    validation.validate_config(config)


def test_odd_rotary_dimension_is_a_config_error():
  config = template.get_config("size=tiny,posenc=rope")
  config.model.rotary_dim = 7
  with pytest.raises(validation.ConfigError, match=r"config\.model\.rotary_dim=7"):
    validation.validate_config(config)


@pytest.mark.parametrize("config_arg, field, value, rule", [
    ("size=tiny", "model.d_model", 0, "must be a positive integer"),  # was ZeroDivisionError
    ("size=tiny,posenc=rope", "model.rotary_dim", -2, "must be a positive integer, or 0"),
    ("algorithmic:posenc=rope", "model.rope_scaling_factor", -4.0, "must be > 0"),
    ("algorithmic:posenc=sinusoidal", "model.rope_scaling_factor", 0.0, "must be > 0"),  # was ignored
    ("algorithmic:posenc=rope", "model.rope_scaling_factor", 0.5, "scales nothing without model.rope_scaling"),
    ("size=tiny", "optimizer.grad_clip_norm", -1.0, "must be >= 0"),
    ("size=tiny", "optimizer.weight_decay", -1.0, "must be >= 0"),
    ("size=tiny", "optimizer.b1", 1.5, "must be in [0, 1)"),
    ("size=tiny", "optimizer.final_learning_rate_fraction", -2.0, "must be in [0, 1]"),
    ("size=tiny", "steps_per_call", 0, "must be a positive integer"),
    ("size=tiny", "steps_per_call", True, "must be a positive integer"),  # a bool passed as 1
    ("size=tiny", "total_steps", True, "must be a positive integer"),
    ("size=tiny", "optimizer.learning_rate", float("inf"), "must be > 0 and finite"),  # was NaN at step 2
    ("size=tiny", "optimizer.weight_decay", float("inf"), "must be >= 0 and finite"),
    ("size=tiny", "profile.num_steps", -1, "must be a non-negative integer"),
    ("size=tiny", "profile.first_step", True, "must be a non-negative integer"),
    ("size=tiny", "max_epochs", -1.0, "must be a non-negative number (0: total_steps alone)"),
    ("size=tiny", "max_epochs", float("inf"), "must be a non-negative number (0: total_steps alone)"),
    ("size=tiny", "min_steps", -3, "must be a non-negative integer"),
    ("size=tiny", "cpu_devices", -1, "must be a non-negative integer"),
    ("size=tiny", "early_stopping.patience", -1, "must be a non-negative integer"),
    ("size=tiny", "early_stopping.min_delta", -0.5, "must be a non-negative number"),
    ("size=tiny", "debug.step_delay_s", -1.0, "must be a non-negative number of seconds"),  # time.sleep's traceback
    # no step matched: the run trained on without the NaN it was asked for
    ("size=tiny", "debug.nan_at_step", 0, "-1 (off) or the step whose loss to make NaN, in [1, total_steps=2000]"),
    ("size=tiny", "debug.nan_at_step", -5, "-1 (off) or the step whose loss to make NaN, in [1, total_steps=2000]"),
    ("size=tiny", "debug.nan_at_step", 2001, "-1 (off) or the step whose loss to make NaN, in [1, total_steps=2000]"),
])
def test_out_of_range_numbers_are_config_errors_naming_the_field(config_arg, field, value, rule):
  """Each of these trained silently (optimizer numbers) or ended in a traceback from inside the model."""
  module, _, arg = config_arg.rpartition(":") if config_arg.startswith("algorithmic") else ("", "", config_arg)
  config = (algorithmic if module else template).get_config(arg)
  _assert_refused(config, field, value, rf"^config\.{field}={value}: {re.escape(rule)}")


@pytest.mark.parametrize("config_file, field", [
    ("vit_digits.py", "data.split_seed"),      # was sklearn's InvalidParameterError, raised inside validation
    ("vlm_encoder.py", "data.eval_seed"),      # was numpy's ValueError after compiling
    ("vlm_digits.py", "data.seed"),
    ("lm_text.py", "data.corpus_seed"),
    ("lm_text.py", "task.decoding.seed"),
    ("translate_dates.py", "seed"),
])
def test_a_negative_seed_anywhere_is_a_config_error_naming_the_field(config_file, field):
  config = validation.load_config_file(f"configs/{config_file}")
  _assert_refused(config, field, -1, rf"^config\.{re.escape(field)}=-1: must be a non-negative integer")


@pytest.mark.parametrize("config_file, field", [
    ("vit_digits.py", "data.split_seed"),      # was sklearn's InvalidParameterError, raised inside validation
    ("segment_digits.py", "data.split_seed"),
    ("translate_dates.py", "seed"),
])
def test_a_seed_past_2_to_the_32_is_a_config_error_naming_the_field(config_file, field):
  config = validation.load_config_file(f"configs/{config_file}")
  _assert_refused(config, field, 2**32, rf"^config\.{re.escape(field)}={2**32}: must be a non-negative integer below "
                  r"2\*\*32")


def test_eval_from_is_latest_best_or_a_step_number():
  for good in ("latest", "best", "4000"):
    config = template.get_config("size=tiny")
    config.checkpoint.eval_from = good
    validation.validate_config(config)
  _assert_refused(template.get_config("size=tiny"), "checkpoint.eval_from", "newest",
                  r"^config\.checkpoint\.eval_from='newest': allowed are \['latest', 'best'\] or a kept checkpoint's "
                  r"step number")


def test_eval_from_a_step_the_run_does_not_keep_is_a_config_error_naming_the_kept_steps(tmp_path):
  """eval / infer of a step no longer kept ended in a RunError (status 1) after building the model."""
  for step in (4, 12):
    (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
  config = template.get_config("size=tiny")
  config.checkpoint.eval_from = "8"
  for mode in ("eval", "infer"):
    with pytest.raises(validation.ConfigError, match=r"^config\.checkpoint\.eval_from='8': no checkpoint at step 8 "
                       r"in .*checkpoints; it keeps steps \[4, 12\]"):
      validation.validate_config(config, mode=mode, workdir=str(tmp_path))
  config.checkpoint.eval_from = "12"
  validation.validate_config(config, mode="eval", workdir=str(tmp_path))
  validation.validate_config(config, mode="train", workdir=str(tmp_path))  # training does not read eval_from


def test_early_stopping_without_a_metric_to_watch_is_a_config_error():
  config = template.get_config("size=tiny")
  config.checkpoint.best_metric = ""
  _assert_refused(config, "early_stopping.patience", 3, r"^config\.early_stopping\.patience=3: compares "
                  r"checkpoint\.best_metric, which is ''")


def test_mrope_sections_not_adding_up_is_a_config_error():
  config = template.get_config("size=tiny,posenc=mrope")
  config.model.mrope_sections = (1, 2, 2)
  with pytest.raises(validation.ConfigError, match=r"config\.model\.mrope_sections"):
    validation.validate_config(config)


def test_mrope_sections_with_an_empty_axis_are_a_config_error():
  config = template.get_config("size=tiny,posenc=mrope")
  pairs = config.model.d_model // config.model.num_heads // 2
  _assert_refused(config, "model.mrope_sections", (pairs, 0, 0), r"config\.model\.mrope_sections=.*3 positive sections")


@pytest.mark.parametrize("config_arg, field, value, message", [
    ("template.py:posenc=learned", "model.rotary_dim", 8,
     r"^config\.model\.rotary_dim=8: rotates part of each head: needs position_encoding in \['rope', 'mrope'\], "
     r"this model has 'learned'; leave it 0 otherwise$"),
    ("template.py:posenc=rope", "model.mrope_sections", (2, 3, 3),
     r"^config\.model\.mrope_sections=\(2, 3, 3\): splits M-RoPE's frequency pairs: needs position_encoding in "
     r"\['mrope'\], this model has 'rope'; leave it \(\) otherwise$"),
    ("lm_text.py:posenc=alibi", "model.mrope_sections", (4, 6, 6), r"^config\.model\.mrope_sections=\(4, 6, 6\): "),
    ("lm_algorithmic.py", "model.randomized_positions_at_eval", True,
     r"^config\.model\.randomized_positions_at_eval=True: draws eval positions from \[0, "
     r"model\.randomized_positions_max\), which is 0 \(off\)"),
    ("translate_dates.py", "model.randomized_positions_at_eval", True, r"^config\.model\.randomized_positions_at_eval"),
])
def test_a_position_field_the_encoding_does_not_read_is_a_config_error(config_arg, field, value, message):
  """rotary_dim with a learned table, M-RoPE sections with 1D RoPE or ALiBi, randomized eval positions with
  randomization off: each trained the same model as without the field, without a word (rope_scaling was refused
  that way already)."""
  _assert_refused(load_config(f"--config=configs/{config_arg}"), field, value, message)


@pytest.mark.parametrize("config_arg, fields", [
    ("template.py:posenc=rope", {"model.rotary_dim": 8}),
    ("template.py:posenc=mrope", {"model.mrope_sections": (4, 6, 6), "model.d_model": 64, "model.num_heads": 2}),
    ("lm_text.py:posenc=rope", {"model.randomized_positions_at_eval": True, "model.randomized_positions_max": 1024}),
])
def test_a_position_field_its_encoding_reads_passes(config_arg, fields):
  config = load_config(f"--config=configs/{config_arg}", *(f"--config.{k}={v}" for k, v in fields.items()))
  validation.validate_config(config)


@pytest.mark.parametrize("config_arg", ["lm_text.py:posenc=mrope", "lm_algorithmic.py:posenc=mrope",
                                        "template.py:posenc=mrope"])
def test_default_mrope_sections_follow_a_head_size_override(config_arg):
  """The configs wrote the split for their own head size: --config.model.num_heads=8 on the LM (head 16, 8 pairs)
  was refused naming model.mrope_sections, whose sum the user had to work out. () is the 2:3:3 split of any head
  of 6 or more dimensions; narrower heads are refused naming the field."""
  config = load_config(f"--config=configs/{config_arg}", "--config.model.num_heads=8", "--config.model.d_model=128")
  assert tuple(config.model.mrope_sections) == ()
  validation.validate_config(config)
  _assert_refused(load_config(f"--config=configs/{config_arg}", "--config.model.num_heads=2",
                              "--config.model.d_model=8"), "model.num_heads", 2,
                  r"^config\.model\.mrope_sections=\(\): \(\) splits rotary_dim / 2 = 2 frequency pairs .* needs "
                  r"rotary_dim >= 6")


@pytest.mark.parametrize("config_arg", ["algorithmic:posenc=sinusoidal", "algorithmic:posenc=alibi", "dates"])
def test_rope_scaling_without_a_rotary_encoding_is_a_config_error(config_arg):
  """It was ignored: a length-scaling ablation on sinusoidal positions measured nothing."""
  config = translate_dates.get_config() if config_arg == "dates" else algorithmic.get_config(config_arg.split(":")[1])
  _assert_refused(config, "model.rope_scaling", "ntk", r"^config\.model\.rope_scaling='ntk': scales rotary positions")
  config = algorithmic.get_config("posenc=rope")
  config.model.rope_scaling = "ntk"
  validation.validate_config(config)


@pytest.mark.parametrize("config_file, field, value, missing", [
    ("configs/template.py", "task.name", "lm", "'lm': with model.name='reverser' reads a config field 'data'"),
    ("configs/lm_text.py", "task.name", "lm_algorithmic", "'lm_algorithmic': with model.name='lm' reads a config "
                                                          "field 'operation'"),
    ("configs/vit_digits.py", "model.name", "perceiver", "'digits': with model.name='perceiver' reads a config "
                                                         "field 'num_latents'"),
])
def test_a_config_written_for_another_task_or_model_is_a_config_error_naming_the_field_it_lacks(
    config_file, field, value, missing):
  """A config whose task.name or model.name is changed to one whose fields it lacks ended in ml_collections'
  KeyError / AttributeError traceback."""
  _assert_refused(load_config(f"--config={config_file}"), field, value,
                  rf"^config\.task\.name={re.escape(missing)} that this config lacks: it was written for another")


def _leaves(config, prefix=""):
  for key, value in config.items():
    if hasattr(value, "items"):
      yield from _leaves(value, f"{prefix}{key}.")
    else:
      yield f"{prefix}{key}", value


# The configs whose defaults validate (the TSV ones need a user's file first).
_SELF_CONTAINED_CONFIGS = sorted(
    path.stem for path in pathlib.Path("configs").glob("*.py")
    if path.stem not in ("__init__", "common", "digits_common", "translate_tsv", "vlm_tsv"))


@pytest.mark.parametrize("config_name", _SELF_CONTAINED_CONFIGS)
def test_a_field_of_the_wrong_type_is_a_config_error_never_another_exception(config_name):
  """A config file of yours may hold None or a string where a number goes, or a number where a name or spec goes
  (a command-line override cannot: its type is checked on parsing): validation raised TypeError ('<' not
  supported ...) from the range checks of ten fields, AttributeError ('int' object has no attribute 'split') from
  the parsers of grids, bands, formats, sharding rules and config specs."""
  module = importlib.import_module(f"configs.{config_name}")
  checked = 0
  for field, default in _leaves(module.get_config()):
    numeric = not isinstance(default, bool) and isinstance(default, (int, float))
    for value in ((None, "ten") if numeric else (3,) if isinstance(default, str) else ()):
      config = module.get_config()
      *sections, key = field.split(".")
      parent = config
      for section in sections:
        parent = parent[section]
      with parent.unlocked():  # as written in a file of yours: not an override of the field's type
        del parent[key]
        parent[key] = value
      checked += 1
      try:
        validation.validate_config(config)
      except validation.ConfigError:
        pass
  assert checked > 20


def test_a_key_error_of_a_tasks_own_code_is_not_taken_for_a_missing_field(monkeypatch):
  """Only a ConfigDict lookup's error means a field the config lacks; a task's own KeyError is its bug, raised."""
  def validate(config, mode="train"):
    return {}["x"]

  monkeypatch.setattr(TemplateTask, "validate", staticmethod(validate))
  with pytest.raises(KeyError, match="x"):
    validation.validate_config(load_config("--config=configs/template.py"))


def test_float16_parameters_are_a_config_error_that_names_the_alternatives():
  """They trained to NaN at step 2 (Adam's second moment underflows in float16)."""
  _assert_refused(template.get_config("size=tiny"), "precision.param_dtype", "float16",
                  r"^config\.precision\.param_dtype='float16': allowed are \['bfloat16', 'float32'\]")
  # an unknown name is answered with the same two (float16 was listed, then refused)
  _assert_refused(template.get_config("size=tiny"), "precision.param_dtype", "half",
                  r"^config\.precision\.param_dtype='half': allowed are \['bfloat16', 'float32'\]$")
  config = template.get_config("size=tiny")
  config.precision.compute_dtype = "float16"
  validation.validate_config(config)


def test_a_workdir_of_another_kind_of_run_is_refused_naming_the_task(tmp_path):
  """Every field of another task's config differs; the first in alphabetical order
  (model.activation) hid the reason."""
  workdir_lib.write_config(translate_dates.get_config(), str(tmp_path))
  (tmp_path / "checkpoints" / "100").mkdir(parents=True)
  with pytest.raises(validation.ConfigError,
                     match=r"^config\.task\.name='digits': the run in .* was made with 'translate'"):
    loop.check_same_model(perceiver_digits.get_config(), str(tmp_path))
  with pytest.raises(validation.ConfigError, match=r"^config\.task\.name='digits'"):
    loop.check_same_model(perceiver_digits.get_config(), str(tmp_path), mode="eval")


def test_rotary_head_dim_check_reaches_the_translators_encoder_and_decoder():
  config = translate_dates.get_config("posenc=rope")
  config.model.decoder.d_model, config.model.decoder.num_heads = 36, 4  # head_dim 9
  with pytest.raises(validation.ConfigError, match=r"model\.decoder\.d_model=36: rotary dimension 9"):
    validation.check_attention_dims(config.model)


def test_rotary_head_dim_check_covers_the_perceivers_rope_2d():
  config = perceiver_digits.get_config("posenc=rope_2d,width=24")  # 4 heads: head_dim 6
  with pytest.raises(validation.ConfigError, match=r"model\.d_model=24: rotary dimension 6 must be a multiple of 4"):
    validation.check_attention_dims(config.model)


@pytest.mark.parametrize("mesh,devices", [({"data": 3}, 8), ({"data": -1, "fsdp": 3}, 8),
                                          ({"data": -1, "fsdp": -1}, 8), ({"data": 2, "tensor": 2}, 8)])
def test_mesh_that_does_not_match_the_device_count_is_a_config_error(mesh, devices):
  config = template.get_config("size=tiny")
  config.mesh.update(mesh)
  with pytest.raises(validation.ConfigError, match=r"config\.mesh"):
    validation.validate_config(config, device_count=devices)


@pytest.mark.parametrize("field", ["batch_size", "eval_batch_size"])
def test_batch_not_divisible_by_the_data_shards_is_a_config_error(field):
  config = template.get_config("size=tiny")
  config.mesh.update({"data": 2, "fsdp": 2})
  config[field] = 6  # 4 data x fsdp shards on 4 devices
  with pytest.raises(validation.ConfigError, match=rf"config\.{field}=6: must be divisible by mesh data x fsdp = 4"):
    validation.validate_config(config, device_count=4)


@pytest.mark.parametrize("overrides, devices, processes", [
    ({"batch_size": 8}, 3, 1),                           # trained on 8 devices, read on 3
    ({"batch_size": 6}, 4, 1),                           # trained on 1 device, read on 4
    ({"batch_size": 6}, 4, 4),                           # ... by 4 processes
    ({"batch_size": 12, "num_microbatches": 2}, 4, 1),   # microbatches of 6 rows
])
def test_eval_and_infer_need_no_training_batch_their_mesh_divides(overrides, devices, processes):
  """`--mode=eval` / `infer` of a run on another device count was refused for the training batch_size, which they
  never read; training on those devices still is."""
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"eval_batch_size": 8, **overrides})
  with pytest.raises(validation.ConfigError, match=r"^config\.(batch_size|num_microbatches)="):
    validation.validate_config(config, mode="train", device_count=devices, process_count=processes)
  for mode in ("eval", "infer"):
    validation.validate_config(config, mode=mode, device_count=devices, process_count=processes)


@pytest.mark.parametrize("overrides, devices, size", [
    ({}, 3, 9), ({}, 4, 8), ({}, 1, 8), ({"mesh.data": 2, "mesh.fsdp": -1}, 6, 12),
    ({"mesh.data": 1, "mesh.tensor": -1}, 3, 8),  # the rows are not split: any size
    ({"sharding_rules.batch": ""}, 3, 8),
])
def test_an_eval_batch_is_rounded_up_to_a_multiple_of_its_batch_shards(overrides, devices, size):
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"eval_batch_size": 8, **overrides})
  assert validation.eval_batch_size_on_mesh(config, devices) == size
  with pytest.raises(ValueError, match=r"device_count must be a positive integer, got 0"):
    validation.eval_batch_size_on_mesh(config, 0)


def test_a_mesh_whose_set_axes_do_not_divide_the_devices_names_them():
  """--config.mesh.tensor=3 on one device read 'config.mesh.data=-1: the other axes (3 devices) do not divide the 1
  devices': the default axis was named, not the one to change."""
  with pytest.raises(validation.ConfigError, match=r"^config\.mesh\.data=-1: the other axes \(mesh\.fsdp=1 x "
                                                   r"mesh\.tensor=3 = 3 devices\) do not divide the 1 devices$"):
    validation.mesh_shape({"data": -1, "fsdp": 1, "tensor": 3}, 1)


def test_a_sharding_rule_naming_a_mesh_axis_twice_is_a_config_error():
  """--config.sharding_rules.heads=tensor,tensor passed validation and ended in JAX's DuplicateSpecError traceback."""
  config = template.get_config("size=tiny")
  config.sharding_rules.heads = "tensor, tensor"
  with pytest.raises(validation.ConfigError, match=r"^config\.sharding_rules\.heads='tensor, tensor': names mesh axis "
                                                   r"'tensor' twice; each at most once$"):
    validation.validate_config(config)


@pytest.mark.parametrize("overrides, message", [
    ({"sharding_rules.batch": "tensor", "batch_size": 8, "eval_batch_size": 9},
     r"^config\.batch_size=8: must be divisible by mesh tensor = 3 \(sharding_rules\.batch='tensor'\)$"),
    ({"sharding_rules.batch": "tensor", "batch_size": 9, "eval_batch_size": 8},
     r"^config\.eval_batch_size=8: must be divisible by mesh tensor = 3"),
    ({"sharding_rules.batch": "data,tensor", "mesh.data": 2, "mesh.tensor": -1, "batch_size": 12, "eval_batch_size": 8,
      "num_microbatches": 2},
     r"^config\.num_microbatches=2: leaves microbatches of 6 rows, not divisible by mesh data x tensor = 4 "
     r"\(sharding_rules\.batch='data,tensor'\)$"),
])
def test_a_batch_the_batch_rules_mesh_axes_do_not_divide_is_a_config_error(overrides, message):
  """The batch's rows lie over the axes sharding_rules.batch names, not always data x fsdp: batch_size=8 with the
  rows over tensor=3 passed validation and ended in JAX's IndivisibleError traceback at the first batch."""
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict({"mesh.data": 1, "mesh.tensor": 3, "eval_batch_size": 9, **overrides})
  devices = 4 if "mesh.data" in overrides else 3
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(config, device_count=devices)
  config.update_from_flattened_dict({"batch_size": 24, "eval_batch_size": 24})
  validation.validate_config(config, device_count=devices)  # divisible: passes
  config.sharding_rules.batch = ""  # replicated rows: any batch
  config.update_from_flattened_dict({"batch_size": 7, "eval_batch_size": 7, "num_microbatches": 1})
  validation.validate_config(config, device_count=devices)


def test_mesh_minus_one_takes_the_remaining_devices():
  assert validation.mesh_shape({"data": -1, "fsdp": 2, "tensor": 2}, 8) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_unknown_task_name_lists_the_registered_tasks():
  with pytest.raises(KeyError, match="template"):
    task_lib.get_task_class("no_such_task")


def test_every_task_module_registers_the_name_it_is_listed_under():
  for name in task_lib.TASK_MODULES:
    assert task_lib.get_task_class(name).name == name


def test_a_task_module_registering_another_name_is_said_so(monkeypatch):
  """TASK_MODULES 'sort_letters' with @register("sort_leters") was refused while 'sort_letters' was listed as allowed."""
  monkeypatch.setitem(task_lib.TASK_MODULES, "templat", "xattn_jax.tasks.template")
  with pytest.raises(KeyError, match=r"xattn_jax.tasks.template registers no task 'templat' \(TASK_MODULES names it "
                                     r"so\): its @register\(...\) name must be the same"):
    task_lib.get_task_class("templat")


def test_task_can_be_named_by_module_path():
  assert task_lib.get_task_class("xattn_jax.tasks.template:TemplateTask") is TemplateTask


def test_a_task_path_that_does_not_resolve_says_why(tmp_path, monkeypatch):
  """A user's "mytasks.sorter:SortTask" whose folder was not on PYTHONPATH, or whose class name was misspelt, was
  answered "allowed are [...] or 'package.module:TaskClass'", the form they had written."""
  with pytest.raises(KeyError, match=r"module 'mytasks.sorter' cannot be imported \(No module named 'mytasks'\): "
                                     r"put the folder that holds it on PYTHONPATH"):
    task_lib.get_task_class("mytasks.sorter:SortTask")
  with pytest.raises(KeyError, match=r"module 'xattn_jax.tasks.template' has no Task subclass 'Template'; its Task "
                                     r"subclasses: \['TemplateTask'\]"):
    task_lib.get_task_class("xattn_jax.tasks.template:Template")
  # a module that imports something missing itself: its own error, not "cannot be imported"
  (tmp_path / "broken_task.py").write_text("import no_such_dependency\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(ModuleNotFoundError, match="no_such_dependency"):
    task_lib.get_task_class("broken_task:Task")


# --- one owner per list of choices ---------------------------------------------------------------

@pytest.mark.parametrize("field, registry", [
    ("optimizer.name", lambda: optim.OPTIMIZERS), ("optimizer.schedule", lambda: optim.SCHEDULES),
    ("model.remat", lambda: layer_stack.REMAT_POLICIES),
])
def test_an_unknown_choice_lists_exactly_its_registrys_names(field, registry):
  names = sorted(registry()) if field.startswith("optimizer") else list(registry())
  _assert_refused(template.get_config("size=tiny"), field, "nope",
                  rf"^config\.{re.escape(field)}='nope': allowed are {re.escape(str(names))}$")


def test_an_optimizer_added_as_readme_shows_is_accepted_and_listed():
  import optax
  readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
  snippet = re.search(r"```python\n(optim\.register_optimizer\(.*?)```", readme, re.S).group(1)
  before = dict(optim.OPTIMIZERS)
  exec(snippet, {"optim": optim, "optax": optax})  # noqa: S102 - README's own example
  try:
    (added,) = set(optim.OPTIMIZERS) - set(before)
    config = template.get_config("size=tiny")
    config.optimizer.name = added
    validation.validate_config(config)
    _assert_refused(template.get_config("size=tiny"), "optimizer.name", "nope", rf"allowed are .*'{added}'")
  finally:
    optim.OPTIMIZERS.clear()
    optim.OPTIMIZERS.update(before)


@pytest.mark.parametrize("field, registry", [("model.norm", blocks.NORM_PLACEMENTS),
                                             ("model.activation", blocks.ACTIVATIONS)])
def test_the_translators_norm_and_activation_choices_are_the_blocks(field, registry):
  _assert_refused(translate_dates.get_config(), field, "nope",
                  rf"^config\.{re.escape(field)}='nope': allowed are {re.escape(str(sorted(registry)))}$")


@pytest.mark.parametrize("config_file, task_name", [
    ("configs/algorithmic.py", "algorithmic"), ("configs/translate_dates.py", "translate"),
    ("configs/lm_text.py", "lm"), ("configs/lm_algorithmic.py", "lm_algorithmic"),
    ("configs/template.py", "template"), ("configs/perceiver_digits.py", "digits")])
def test_an_unknown_position_encoding_lists_exactly_the_encodings_the_tasks_model_builds(config_file, task_name):
  """Every registered encoding was listed (the grid ones to a sequence model, the 1D ones to the Perceiver) before
  the task's own check ran."""
  allowed = task_lib.get_task_class(task_name).position_encodings()
  assert allowed and set(allowed) < set(position_layers.POSITION_ENCODINGS)
  _assert_refused(load_config(f"--config={config_file}"), "model.position_encoding", "nope",
                  rf"^config\.model\.position_encoding='nope': allowed are {re.escape(str(sorted(allowed)))}$")


# `config.<field> = ...  # a | b | c`: a config's comment listing a field's choices (a name, optionally followed by
# "(...)" or ": what it does").
_CHOICES_COMMENT = re.compile(r"^\s*config\.([a-z_.]+) = .*?#\s*(\S+(?:(?: \(.*?\))?|: [^|]*?)(?: \| .*)+)$")


def _commented_choices():
  for path in sorted(pathlib.Path("configs").glob("*.py")):
    for number, line in enumerate(path.read_text().splitlines(), 1):
      match = _CHOICES_COMMENT.match(line)
      if match:
        names = [re.sub(r" \(.*|:.*", "", part).strip() for part in match.group(2).split(" | ")]
        yield pytest.param(path.stem, match.group(1), ["" if name == '""' else name for name in names],
                           id=f"{path.name}:{number}")


@pytest.mark.parametrize("config_name, field, listed", list(_commented_choices()))
def test_a_configs_comment_lists_exactly_the_choices_validation_names(config_name, field, listed):
  """The registries own the lists; a config's comment beside a field copies one for its reader, so it is held
  to the names validation gives for an unknown value (a comment that drifted from its registry fails here)."""
  config = importlib.import_module(f"configs.{config_name}").get_config()
  *sections, key = field.split(".")
  parent = config
  for section in sections:
    parent = parent[section]
  parent[key] = "not_a_choice"
  with pytest.raises(validation.ConfigError) as refused:
    validation.validate_config(config)
  assert refused.value.field == field, refused.value
  assert sorted(listed) == sorted(re.findall(r"'([^']*)'", refused.value.allowed)), refused.value


def test_the_config_comments_that_list_choices_are_found():
  """The pattern above still reads the configs' comments (a test over none of them would pass vacuously)."""
  found = {(values[0], values[1]) for values in (param.values for param in _commented_choices())}
  assert {("lm_text", "model.norm_type"), ("vlm_digits", "model.connector"),
          ("template", "model.remat")} <= found and len(found) >= 12, found


def test_a_task_of_yours_may_list_its_encodings_as_a_tuple(monkeypatch):
  """Task.position_encodings became a method (read when validating); a tuple, as a task may have set it, works."""
  from xattn_jax.tasks.template import TemplateTask

  class RopeOnly(TemplateTask):
    position_encodings = ("rope",)

  monkeypatch.setattr(task_lib, "get_task_class", lambda name: RopeOnly)
  config = load_config("--config=configs/template.py")
  _assert_refused(config, "model.position_encoding", "learned",
                  r"^config\.model\.position_encoding='learned': allowed are \['rope'\]$")


def test_a_task_without_its_own_encodings_is_offered_every_registered_one():
  config = algorithmic.get_config()
  config.model.position_encoding = "nope"
  with pytest.raises(validation.ConfigError, match=re.escape(str(sorted(position_layers.POSITION_ENCODINGS)))):
    validation.check_attention_dims(config.model)


def test_a_new_registry_entry_is_checked_by_the_rules_it_declares(monkeypatch):
  """Registering an encoding is all validation needs: its rotary rule comes with the entry."""
  monkeypatch.setitem(position_layers.POSITION_ENCODINGS, "my_rope", position_layers.get("rope"))
  config = translate_dates.get_config()
  config.model.position_encoding = "my_rope"
  validation.check_attention_dims(config.model)
  config.model.decoder.d_model, config.model.decoder.num_heads = 36, 4  # head_dim 9
  with pytest.raises(validation.ConfigError, match=r"model\.decoder\.d_model=36: rotary dimension 9"):
    validation.check_attention_dims(config.model)


def test_the_rotary_width_rule_is_read_from_the_rotary_registry(monkeypatch):
  monkeypatch.setitem(ROTARY_KINDS, "rope", dataclasses.replace(ROTARY_KINDS["rope"], multiple_of=32))
  config = algorithmic.get_config("posenc=rope")  # d_model 64, 4 heads: head_dim 16
  with pytest.raises(validation.ConfigError, match=r"rotary dimension 16 must be a multiple of 32"):
    validation.check_attention_dims(config.model)


# --- randomized positions ---------------------------------------------------------------------------

def test_randomized_positions_config_validates():
  validation.validate_config(algorithmic.get_config("posenc=rope,randomized=256"))


@pytest.mark.parametrize("value, rule", [(-1, "must be an integer >= 0"), (True, "must be an integer >= 0"),
                                         (100, "must be >= 129, the longest sequence the model sees")])
def test_a_bad_randomized_positions_max_is_a_config_error_naming_it(value, rule):
  _assert_refused(algorithmic.get_config("posenc=learned"), "model.randomized_positions_max", value,
                  rf"^config\.model\.randomized_positions_max={value}: {re.escape(rule)}")


def test_randomized_positions_below_the_translators_max_length_are_a_config_error():
  config = translate_dates.get_config()  # max_length 64
  config.model.randomized_positions_max = 32
  with pytest.raises(validation.ConfigError, match=r"randomized_positions_max=32: must be >= model\.max_length=64"):
    validation.check_attention_dims(config.model)


def test_randomized_positions_with_a_2d_encoding_are_a_config_error():
  config = perceiver_digits.get_config("posenc=learned_2d")
  config.model.randomized_positions_max = 256
  with pytest.raises(validation.ConfigError, match=r"randomized_positions_max=256: randomizes sequence positions: "
                                                   r"needs position_encoding in \[.*'rope'.*\], this model has "
                                                   r"'learned_2d'"):
    validation.check_attention_dims(config.model)


# --- optimizer and loss -------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"cpu_devices": 4, "mesh.data": 2}, r"^config\.mesh=.*needs 2 devices, but 4 are available .*; these 4 devices "
                                         r"are the ones config\.cpu_devices=4 asks for$"),
    ({"cpu_devices": 3, "batch_size": 64}, r"^config\.batch_size=64: must be divisible by mesh data x fsdp = 3; "
                                           r"these 3 devices are the ones config\.cpu_devices=3 asks for$")])
def test_a_mesh_that_does_not_fit_the_devices_cpu_devices_asked_for_names_that_field_too(overrides, message):
  """The mesh or the batch alone was named, though the devices were the config's own cpu_devices."""
  config = template.get_config("size=tiny")
  config.update_from_flattened_dict(overrides)
  with pytest.raises(validation.ConfigError, match=message):
    validation.validate_config(config, device_count=overrides["cpu_devices"])
  config.cpu_devices = 1  # the same devices from the environment: the mesh alone is named
  with pytest.raises(validation.ConfigError) as error:
    validation.validate_config(config, device_count=overrides["cpu_devices"])
  assert "cpu_devices" not in str(error.value)


def test_cudnn_on_a_cpu_run_names_the_backend_before_the_dtype_it_would_need():
  """A float32 CPU run was told to switch to bfloat16, then, once it had, that cuDNN needs a GPU."""
  config = template.get_config("size=tiny")
  config.model.implementation = "cudnn"
  with pytest.raises(validation.ConfigError, match=r"needs a GPU backend, this run has 'cpu'"):
    validation.validate_config(config, device_count=1)


@pytest.mark.parametrize("mode", ["eval", "infer"])
def test_eval_and_infer_of_a_fine_tuned_run_do_not_need_the_run_it_started_from(tmp_path, mode):
  """A run trained from init_from, moved elsewhere or kept after the run it started from was deleted, could not be
  evaluated or run with its own config.py: init_from's folder was required, though only a fresh training reads it."""
  config = template.get_config("size=tiny")
  config.init_from = str(tmp_path / "deleted" / "checkpoints")
  validation.validate_config(config, mode=mode)
  for workdir in (None, str(tmp_path / "fresh")):  # a fresh training reads it
    with pytest.raises(validation.ConfigError, match=r"^config\.init_from=.*no such checkpoint directory"):
      validation.validate_config(config, mode="train", workdir=workdir)
  (tmp_path / "run" / "checkpoints" / "4").mkdir(parents=True)
  validation.validate_config(config, mode="train", workdir=str(tmp_path / "run"))  # one that resumes does not


def test_init_from_a_runs_workdir_is_refused_naming_its_checkpoints_directory(tmp_path):
  """--config.init_from=RUN (not RUN/checkpoints) compiled the model, then ended in a FileNotFoundError traceback."""
  (tmp_path / "run" / "checkpoints" / "4" / "model").mkdir(parents=True)
  config = template.get_config("size=tiny")
  config.init_from = str(tmp_path / "run")
  with pytest.raises(validation.ConfigError, match=rf"^config\.init_from='{tmp_path / 'run'}': holds no checkpoint: "
                                                   rf"name a run's checkpoints directory or one step in it, here "
                                                   rf"{tmp_path / 'run' / 'checkpoints'}$"):
    validation.validate_config(config, workdir=str(tmp_path / "fresh"))
  for path in ("run/checkpoints", "run/checkpoints/4"):
    config.init_from = str(tmp_path / path)
    validation.validate_config(config, workdir=str(tmp_path / "fresh"))


def test_a_data_file_that_is_a_pipe_is_refused_as_one_not_as_missing(tmp_path):
  """--config.data.train_file=<(zcat corpus.gz) names /dev/fd/63, a pipe, which was refused as "no such file"."""
  os.mkfifo(tmp_path / "pipe")
  with pytest.raises(validation.ConfigError, match="is not a regular file \\(a pipe or a device\\)"):
    validation.require_file("data.train_file", str(tmp_path / "pipe"))


def test_an_infer_input_that_is_a_pipe_is_read(tmp_path):
  """--config.infer.input_file=<(zcat prompts.gz) was refused as a data file is, though infer reads it once."""
  import threading

  from xattn_jax.training import inference
  pipe = tmp_path / "pipe"
  os.mkfifo(pipe)
  config = template.get_config("size=tiny")
  config.infer.input_file = str(pipe)
  validation.validate_config(config, mode="infer")
  writer = threading.Thread(target=lambda: pipe.write_text("abc\nxyz\n"), daemon=True)  # blocks until read
  writer.start()
  assert inference.read_input_lines(str(pipe)) == (str(pipe), ["abc", "xyz"])
  writer.join(timeout=10)
