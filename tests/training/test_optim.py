"""Optimizer, schedules and the shared losses."""
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from tests.helpers import abstract_model
from xattn_jax.tasks.template import TemplateTask
from configs import template
from xattn_jax.training import optim


def test_schedule_warms_up_linearly_to_the_peak():
  config = template.get_config("size=tiny").optimizer
  config.learning_rate, config.warmup_steps = 1e-2, 10
  schedule = optim.make_schedule(config, total_steps=100)
  np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)], [0.0, 5e-3, 1e-2], rtol=1e-6)


@pytest.mark.parametrize("name,expected_at_40", [("cosine", 0.5e-2), ("rsqrt", 1e-2 * (10 / 40) ** 0.5),
                                                 ("constant", 1e-2)])
def test_schedule_decays_as_named_after_warmup(name, expected_at_40):
  config = template.get_config("size=tiny").optimizer
  config.learning_rate, config.warmup_steps, config.schedule = 1e-2, 10, name
  schedule = optim.make_schedule(config, total_steps=70)  # cosine: halfway through 60 decay steps
  np.testing.assert_allclose(schedule(40), expected_at_40, rtol=1e-5)


def test_weight_decay_spares_biases_norms_and_embeddings():
  model = abstract_model(TemplateTask(template.get_config("size=tiny")))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  mask = optim.weight_decay_mask(params, "bias,scale,embedding")
  assert mask["blocks"]["attention"]["query"]["kernel"] and mask["logits"]["kernel"]
  assert not mask["blocks"]["attention"]["query"]["bias"] and not mask["final_norm"]["scale"]
  assert not mask["embed"]["embedding"]


def test_exclusions_match_the_parameters_names_not_the_variables_value_attribute():
  """optax reads an nnx.Optimizer's parameters as Variables, whose paths end in their `.value` attribute:
  excluding "value" (the attention's value projection) excluded every parameter."""
  model = abstract_model(TemplateTask(template.get_config("size=tiny")))
  mask = nnx.to_pure_dict(optim.weight_decay_mask(nnx.state(model, nnx.Param), "value"))
  assert mask["blocks"]["attention"]["query"]["kernel"] and mask["logits"]["kernel"]
  assert not mask["blocks"]["attention"]["value"]["kernel"]
  assert "value" not in optim.parameter_names(nnx.state(model.logits, nnx.Param))[0]


def test_exclusions_naming_no_parameter_are_found_but_the_defaults_names_are_kept():
  params = {"patch": {"kernel": np.ones((2, 2))}, "norm": {"scale": np.ones(2)}}  # no bias, no embedding
  assert optim.unmatched_exclude_patterns(params, optim.DEFAULT_WEIGHT_DECAY_EXCLUDE) == []
  assert optim.unmatched_exclude_patterns(params, " bias, scale,,patc , kernal,norm/scale") == ["kernal"]


def test_cross_entropy_with_smoothing_matches_torch():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 5, 11)).astype(np.float32)
  targets = rng.integers(1, 11, size=(3, 5))
  targets[0, 3:] = 0  # padding, masked out below
  weights = (targets != 0).astype(np.float32)
  loss_sum, weight_sum = optim.cross_entropy(jnp.asarray(logits), jnp.asarray(targets),
                                             jnp.asarray(weights), label_smoothing=0.1)
  expected = torch.nn.functional.cross_entropy(torch.tensor(logits[weights > 0]),
                                               torch.tensor(targets[weights > 0]), label_smoothing=0.1)
  np.testing.assert_allclose(loss_sum / weight_sum, expected.item(), rtol=1e-5)


def test_cross_entropy_of_bfloat16_logits_is_the_float32_one_of_the_same_values():
  """"in float32": bfloat16 logits are upcast before the log-softmax (in bfloat16 the smoothed loss of logits
  ~30 is off by ~0.1); padding weighs exactly nothing."""
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(2, 4, 50)) * 10 + 20, jnp.bfloat16)
  targets = jnp.asarray(rng.integers(1, 50, size=(2, 4))).at[1, 2:].set(0)
  weights = targets != 0
  loss, weight = optim.cross_entropy(logits, targets, weights, label_smoothing=0.1)
  real = lambda rows: optim.cross_entropy(logits[rows].astype(jnp.float32), targets[rows], label_smoothing=0.1)[0]
  assert loss.dtype == jnp.float32 and float(weight) == 6
  np.testing.assert_allclose(loss, real((0, slice(None))) + real((1, slice(0, 2))), rtol=1e-6)


def test_bfloat16_parameters_have_no_master_copy_so_an_update_under_half_their_step_rounds_away():
  """README's limit of precision.param_dtype=bfloat16: the optimizer updates the bfloat16 values themselves."""
  config = template.get_config("size=tiny").optimizer
  config.learning_rate, config.warmup_steps, config.schedule, config.weight_decay = 1e-3, 0, "constant", 0.0
  tx = optim.make_optimizer(config, total_steps=100)
  for dtype, moved in ((jnp.bfloat16, False), (jnp.float32, True)):
    params = {"w": jnp.ones((4,), dtype)}
    state = tx.init(params)
    for _ in range(10):  # each Adam step moves w by about the learning rate, under half of bfloat16's 2 ** -7 at 1.0
      updates, state = tx.update({"w": jnp.ones((4,), dtype)}, state, params)
      params = optax.apply_updates(params, updates)
    assert params["w"].dtype == dtype and bool((params["w"] != 1.0).all()) == moved, (dtype, params["w"])


def test_cross_entropy_rejects_mismatched_targets():
  with pytest.raises(ValueError, match=r"targets must be logits.shape\[:-1\]=\[2, 3\]"):
    optim.cross_entropy(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4), jnp.int32))


def test_gradient_clipping_bounds_the_update_norm():
  config = template.get_config("size=tiny").optimizer
  config.name, config.grad_clip_norm, config.warmup_steps, config.schedule = "sgd", 0.5, 0, "constant"
  config.learning_rate, config.momentum = 1.0, 0.0
  tx = optim.make_optimizer(config, total_steps=10)
  grads = {"w": jnp.full((4,), 10.0)}
  updates, _ = tx.update(grads, tx.init(grads), grads)
  np.testing.assert_allclose(optax.tree.norm(updates), 0.5, rtol=1e-6)


# --- dropout keys -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(optim.OPTIMIZERS))
def test_every_registered_optimizer_lowers_a_quadratic(name):
  config = template.get_config("size=tiny").optimizer
  config.name, config.learning_rate, config.warmup_steps, config.schedule = name, 0.1, 0, "constant"
  tx = optim.make_optimizer(config, total_steps=10)
  params = {"w": jnp.ones((2, 2))}
  state = tx.init(params)
  for _ in range(5):
    updates, state = tx.update({"w": 2 * params["w"]}, state, params)  # gradient of sum(w^2)
    params = optax.apply_updates(params, updates)
  assert float(jnp.sum(params["w"] ** 2)) < 4.0


@pytest.mark.parametrize("field, key, registry", [("optimizer.name", "name", optim.OPTIMIZERS),
                                                  ("optimizer.schedule", "schedule", optim.SCHEDULES)])
def test_an_unregistered_name_raises_listing_the_registry(field, key, registry):
  config = template.get_config("size=tiny").optimizer
  config[key] = "nope"
  with pytest.raises(ValueError, match=re.escape(f"{field}='nope': allowed are {sorted(registry)}")):
    optim.make_optimizer(config, total_steps=10)


@pytest.mark.parametrize("name, schedule, unread", [
    ("adamw", "cosine", ["momentum"]),
    ("adam", "rsqrt", ["final_learning_rate_fraction", "momentum", "weight_decay", "weight_decay_exclude"]),
    ("sgd", "constant", ["b1", "b2", "eps", "final_learning_rate_fraction", "weight_decay", "weight_decay_exclude"]),
])
def test_the_fields_a_choice_does_not_read_are_named_from_the_registries(name, schedule, unread):
  """adam took optimizer.weight_decay silently; weight_decay_exclude was checked only for the name "adamw". A field
  left at its default is not named (every adamw run was told that it reads no optimizer.momentum)."""
  config = template.get_config("size=tiny").optimizer
  config.name, config.schedule = name, schedule
  assert optim.unread_fields(config) == []
  for field, value in optim.CHOICE_FIELD_DEFAULTS.items():  # each set otherwise, as a user would
    config[field] = value + ",head" if isinstance(value, str) else value + 0.05
  assert optim.unread_fields(config) == unread
  assert optim.reads(config, "weight_decay_exclude") == (name == "adamw")



def test_a_registered_schedule_is_the_decay_after_warmup():
  optim.register_schedule("halved", lambda c, total_steps: lambda count: c.learning_rate / 2)
  try:
    config = template.get_config("size=tiny").optimizer
    config.schedule, config.warmup_steps = "halved", 2
    assert float(optim.make_schedule(config, 10)(5)) == pytest.approx(config.learning_rate / 2)
  finally:
    optim.SCHEDULES.pop("halved")


@pytest.mark.parametrize("name, build, reads, message", [
    ("", optax.sgd, (), r"name must be a non-empty str, got name=''"),
    ("adamw", optax.sgd, (), r"'adamw' is registered already"),
    ("mine", "sgd", (), r"build must be callable, got str"),
    ("mine", optax.sgd, "momentum", r"reads must be a tuple of optimizer.\* field names, got reads='momentum'"),
])
def test_register_optimizer_refuses_what_the_registry_could_not_hold(name, build, reads, message):
  with pytest.raises(ValueError, match=rf"^register_optimizer: {message}"):
    optim.register_optimizer(name, build, reads=reads)
  assert "mine" not in optim.OPTIMIZERS
