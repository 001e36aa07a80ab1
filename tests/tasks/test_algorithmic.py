"""The length-generalization task: its data, its determinism, its bands, and its config hooks."""
import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import algorithmic as algorithmic_config
from xattn_jax.data import algorithmic
from xattn_jax.tasks import algorithmic as algorithmic_task
from xattn_jax.training import loop, validation


def _examples(operation, seed=0, count=16, min_length=1, max_length=9, width=None):
  return algorithmic.make_examples(np.random.default_rng(seed), count, operation=operation, min_length=min_length,
                                   max_length=max_length, num_symbols=5, width=width)


def _config(**task):
  config = algorithmic_config.get_config("size=micro")
  config.task.update(task)
  return config


@pytest.mark.parametrize("operation, transform", [("copy", lambda s: s), ("reverse", lambda s: s[::-1])])
def test_targets_are_the_transformed_string_then_eos_then_padding(operation, transform):
  batch = _examples(operation)
  for inputs, targets, n in zip(batch["inputs"], batch["targets"], batch["lengths"]):
    np.testing.assert_array_equal(targets[:n], transform(inputs[:n]))
    assert targets[n] == algorithmic.EOS_ID and not targets[n + 1:].any() and not inputs[n:].any()


def test_decoder_inputs_are_bos_then_targets_shifted_right_without_the_eos():
  batch = _examples("reverse")
  for decoder_inputs, targets, n in zip(batch["decoder_inputs"], batch["targets"], batch["lengths"]):
    assert decoder_inputs[0] == algorithmic.BOS_ID
    np.testing.assert_array_equal(decoder_inputs[1:n + 1], targets[:n])
    assert not decoder_inputs[n + 1:].any()


@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(min_length=st.integers(1, 20), extra=st.integers(0, 20), pad=st.integers(0, 5),
                  seed=st.integers(0, 1000))
def test_lengths_stay_in_the_band_and_symbols_avoid_special_ids(min_length, extra, pad, seed):
  max_length = min_length + extra
  batch = _examples("copy", seed, 8, min_length, max_length, max_length + pad)
  assert np.all((batch["lengths"] >= min_length) & (batch["lengths"] <= max_length))
  assert batch["inputs"].shape == (8, max_length + pad) and batch["targets"].shape == (8, max_length + pad + 1)
  real = batch["inputs"][batch["inputs"] != algorithmic.PAD_ID]
  assert np.all(real >= algorithmic.FIRST_SYMBOL) and len(real) == batch["lengths"].sum()


def test_make_examples_rejects_a_width_below_max_length():
  with pytest.raises(ValueError, match="width=4"):
    _examples("copy", max_length=9, width=4)


def test_train_batches_are_a_pure_function_of_seed_step_and_process():
  task = algorithmic_task.AlgorithmicTask(_config())
  whole = task.train_batch(7, process_index=0, process_count=1)
  halves = [task.train_batch(7, process_index=p, process_count=2) for p in range(2)]
  for key, array in whole.items():
    np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), array)
    np.testing.assert_array_equal(task.train_batch(7, process_index=0, process_count=1)[key], array)
  assert not np.array_equal(task.train_batch(8, process_index=0, process_count=1)["inputs"], whole["inputs"])


def test_training_never_sees_a_string_longer_than_train_max_length():
  task = algorithmic_task.AlgorithmicTask(_config(train_max_length=12))
  inputs = np.concatenate([task.train_batch(s, process_index=0, process_count=1)["inputs"] for s in range(5)])
  assert inputs.shape[1] == 12 and (inputs != 0).sum(axis=1).max() == 12


def test_eval_batches_hold_each_band_once_with_lengths_inside_it():
  config = _config(eval_bands="1-4,5-9,20-30", num_eval_examples=10)
  config.eval_batch_size = 4
  task = algorithmic_task.AlgorithmicTask(config)
  seen = {0: 0, 1: 0, 2: 0}
  for batch in task.eval_batches(process_index=0, process_count=1):
    real = batch["weights"] > 0
    lengths = (batch["inputs"][real] != 0).sum(axis=1)
    (band,) = set(batch["band"][real])
    lo, hi = task.bands[band]
    assert np.all((lengths >= lo) & (lengths <= hi)) and batch["inputs"].shape[1] == hi
    seen[band] += real.sum()
  assert seen == {0: 10, 1: 10, 2: 10}


def test_every_band_gets_its_own_exact_match_and_token_accuracy():
  config = _config(eval_bands="1-3,4-6", num_eval_examples=2)
  config.eval_batch_size = 2
  task = algorithmic_task.AlgorithmicTask(config)
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  batch = next(iter(task.eval_batches(process_index=0, process_count=1)))
  metrics = nnx.jit(task.eval_metrics)(model, batch)
  assert {"exact_match_1_3", "exact_match_4_6", "token_accuracy_1_3", "token_accuracy_4_6", "loss",
          "token_accuracy"} == set(metrics)
  assert float(metrics["exact_match_4_6"][1]) == 0.0 and float(metrics["exact_match_1_3"][1]) == 2.0
  # Band 1-3 holds every real token of this batch, EOS included.
  assert float(metrics["token_accuracy_1_3"][1]) == float(metrics["token_accuracy"][1]) == (batch["targets"] > 0).sum()


def test_learned_table_has_a_row_for_every_eval_position_eos_included():
  task = algorithmic_task.AlgorithmicTask(_config(eval_bands="1-32,33-64,65-128"))
  assert task.max_length == 129


@pytest.mark.parametrize("field, value, message", [
    ("eval_bands", "1-32,40", "eval_bands"), ("eval_bands", "9-3", "eval_bands"),
    ("operation", "sort", "operation"), ("num_symbols", 40, "num_symbols"), ("min_length", 40, "min_length")])
def test_invalid_task_fields_are_rejected_naming_the_field(field, value, message):
  with pytest.raises(validation.ConfigError, match=f"config.task.{message}"):
    validation.validate_config(_config(**{field: value}))


def test_unknown_rope_scaling_is_rejected():
  config = algorithmic_config.get_config("size=micro,posenc=rope")
  config.model.rope_scaling = "yarn"
  with pytest.raises(validation.ConfigError, match="config.model.rope_scaling='yarn'"):
    validation.validate_config(config)


def test_rope_scaling_override_reaches_the_models_rotary_layers():
  config = algorithmic_config.get_config("size=micro,posenc=rope")
  config.model.rope_scaling, config.model.rope_scaling_factor = "ntk", 4.0
  validation.validate_config(config)
  task = algorithmic_task.AlgorithmicTask(config)
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  for rotary in (model.source_positions.rotary, model.target_positions.rotary):
    assert (rotary.scaling, rotary.scaling_factor) == ("ntk", 4.0)


@pytest.mark.parametrize("posenc", ["alibi", "t5_bias"])
def test_relative_encodings_give_the_decoder_causal_and_the_encoder_symmetric_variants(posenc):
  task = algorithmic_task.AlgorithmicTask(algorithmic_config.get_config(f"size=micro,posenc={posenc}"))
  model = task.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  if posenc == "alibi":
    assert (model.source_positions.causal, model.target_positions.causal) == (False, True)
  else:
    assert (model.source_positions.bidirectional, model.target_positions.bidirectional) == (True, False)


def test_dates_config_rope_scaling_override_reaches_the_translator(tmp_path):
  from configs import translate_dates
  from xattn_jax.tasks.translate import task as translate_task
  config = translate_dates.get_config("posenc=rope,tokenizer=bytes")
  config.data.first_year, config.data.last_year = 2000, 2000
  config.model.rope_scaling, config.model.rope_scaling_factor = "linear", 2.0
  validation.validate_config(config)
  model = translate_task.TranslateTask(config, str(tmp_path)).make_model(loop.model_rngs(0), dtype=jnp.float32,
                                                                         param_dtype=jnp.float32)
  assert (model.target_positions.rotary.scaling, model.target_positions.rotary.scaling_factor) == ("linear", 2.0)


def test_remat_and_the_attention_implementation_reach_the_model():
  """configs/algorithmic.py had neither field, and the task built its Translator without them: a length sweep
  that needed remat or the chunked kernel at long eval bands had no way to ask for it."""
  config = _config()
  config.model.remat, config.model.implementation = "full", "chunked"
  model = algorithmic_task.AlgorithmicTask(config).make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  assert model.remat == "full"
  implementations = {module.implementation for _, module in nnx.iter_graph(model) if hasattr(module, "implementation")}
  assert implementations == {"chunked"}, implementations
