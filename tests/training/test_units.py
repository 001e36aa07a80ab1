"""In-process properties of the training pieces: config parsing, validation, optimizer, loss,
layer stacking, sharding rules. Fast; the launcher's end-to-end behaviour is in test_launch.py."""
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from absl import flags
from flax import nnx
from ml_collections import config_flags

from configs import algorithmic, common, perceiver_digits, toy_reverse, translate_dates
from xattn_jax.layers import layer_stack
from xattn_jax.training import loop, optim, sharding, task as task_lib, validation
from xattn_jax.tasks.toy_reverse import ToyReverseTask


def _load_config(*argv):
  """The config exactly as launch.py resolves it from command-line arguments."""
  flag_values = flags.FlagValues()
  argv = ["prog", *argv]
  config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True, sys_argv=argv)
  flag_values(argv)
  return flag_values.config


def _abstract_model(config):
  task = ToyReverseTask(config)
  with nnx.use_eager_sharding(False):
    return nnx.eval_shape(lambda: task.make_model(nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32))


# --- config -------------------------------------------------------------------------------------

def test_parse_arg_converts_values_to_the_default_types():
  args = common.parse_arg("size=tiny,layers=3,rate=0.5,scan", size="small", layers=1, rate=0.1, scan=False)
  assert (args.size, args.layers, args.rate, args.scan) == ("tiny", 3, 0.5, True)


def test_parse_arg_rejects_an_unknown_key_listing_the_allowed_ones():
  with pytest.raises(ValueError, match=r"'sise'.*\['scan', 'size'\]"):
    common.parse_arg("sise=tiny", size="small", scan=False)


def test_variant_argument_and_override_reach_the_model():
  config = _load_config("--config=configs/toy_reverse.py:size=tiny,posenc=rope,scan",
                        "--config.model.d_model=48", "--config.model.num_layers=3")
  model = _abstract_model(config)
  assert model.embed.embedding.shape == (27, 48)  # 26 letters + padding
  assert model.blocks.query.kernel.shape == (3, 48, 48)  # 3 stacked layers
  assert model.scan_layers and model.position_encoding == "rope" and not hasattr(model, "position_table")


def test_misspelt_override_is_rejected_by_the_locked_config():
  with pytest.raises(Exception, match="d_modle"):
    _load_config("--config=configs/toy_reverse.py:size=tiny", "--config.model.d_modle=48")


# --- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("task.name", "nope"), ("optimizer.name", "lamb"), ("optimizer.schedule", "step"),
    ("model.position_encoding", "alibi"), ("model.remat", "some"), ("model.name", "other"),
])
def test_unknown_name_is_a_config_error_naming_the_field(field, value):
  _assert_refused(toy_reverse.get_config("size=tiny"), field, value, rf"^config\.{field}='{value}': allowed")


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
  config = toy_reverse.get_config("size=tiny")
  config.model.d_model, config.model.num_heads = 30, 4
  with pytest.raises(validation.ConfigError, match=r"config\.model\.d_model=30: must be divisible"):
    validation.validate_config(config)


def test_odd_rotary_dimension_is_a_config_error():
  config = toy_reverse.get_config("size=tiny,posenc=rope")
  config.model.rotary_dim = 7
  with pytest.raises(validation.ConfigError, match=r"config\.model\.rotary_dim=7"):
    validation.validate_config(config)


@pytest.mark.parametrize("config_arg, field, value, rule", [
    ("size=tiny", "model.d_model", 0, "must be a positive integer"),  # was ZeroDivisionError
    ("size=tiny,posenc=rope", "model.rotary_dim", -2, "must be a positive integer, or 0"),
    ("algorithmic:posenc=rope", "model.rope_scaling_factor", -4.0, "must be > 0"),
    ("algorithmic:posenc=sinusoidal", "model.rope_scaling_factor", 0.0, "must be > 0"),  # was ignored
    ("size=tiny", "optimizer.grad_clip_norm", -1.0, "must be >= 0"),
    ("size=tiny", "optimizer.weight_decay", -1.0, "must be >= 0"),
    ("size=tiny", "optimizer.b1", 1.5, "must be in [0, 1)"),
    ("size=tiny", "optimizer.final_learning_rate_fraction", -2.0, "must be in [0, 1]"),
    ("size=tiny", "steps_per_call", 0, "must be a positive integer"),
    ("size=tiny", "steps_per_call", True, "must be a positive integer"),  # a bool passed as 1
    ("size=tiny", "total_steps", True, "must be a positive integer"),
    ("size=tiny", "optimizer.learning_rate", float("inf"), "must be > 0 and finite"),  # was NaN at step 2
    ("size=tiny", "optimizer.weight_decay", float("inf"), "must be >= 0 and finite"),
])
def test_out_of_range_numbers_are_config_errors_naming_the_field(config_arg, field, value, rule):
  """Each of these trained silently (optimizer numbers) or ended in a traceback from inside the model."""
  module, _, arg = config_arg.rpartition(":") if config_arg.startswith("algorithmic") else ("", "", config_arg)
  config = (algorithmic if module else toy_reverse).get_config(arg)
  _assert_refused(config, field, value, rf"^config\.{field}={value}: {re.escape(rule)}")


def test_mrope_sections_not_adding_up_is_a_config_error():
  config = toy_reverse.get_config("size=tiny,posenc=mrope")
  config.model.mrope_sections = (1, 2, 2)
  with pytest.raises(validation.ConfigError, match=r"config\.model\.mrope_sections"):
    validation.validate_config(config)


def test_mrope_sections_with_an_empty_axis_are_a_config_error():
  config = toy_reverse.get_config("size=tiny,posenc=mrope")
  pairs = sum(config.model.mrope_sections)
  _assert_refused(config, "model.mrope_sections", (pairs, 0, 0), r"config\.model\.mrope_sections=.*3 positive sections")


@pytest.mark.parametrize("config_arg", ["algorithmic:posenc=sinusoidal", "algorithmic:posenc=alibi", "dates"])
def test_rope_scaling_without_a_rotary_encoding_is_a_config_error(config_arg):
  """It was ignored: a length-scaling ablation on sinusoidal positions measured nothing."""
  config = translate_dates.get_config() if config_arg == "dates" else algorithmic.get_config(config_arg.split(":")[1])
  _assert_refused(config, "model.rope_scaling", "ntk", r"^config\.model\.rope_scaling='ntk': scales rotary positions")
  config = algorithmic.get_config("posenc=rope")
  config.model.rope_scaling = "ntk"
  validation.validate_config(config)


def test_float16_parameters_are_a_config_error_that_names_the_alternatives():
  """They trained to NaN at step 2 (Adam's second moment underflows in float16)."""
  _assert_refused(toy_reverse.get_config("size=tiny"), "precision.param_dtype", "float16",
                  r"^config\.precision\.param_dtype='float16': allowed are \['bfloat16', 'float32'\]")
  config = toy_reverse.get_config("size=tiny")
  config.precision.compute_dtype = "float16"
  validation.validate_config(config)


def test_a_workdir_of_another_kind_of_run_is_refused_naming_the_task(tmp_path):
  """Every field of another task's config differs; the first in alphabetical order
  (model.activation) hid the reason."""
  loop._write_config(translate_dates.get_config(), str(tmp_path))
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
  config = toy_reverse.get_config("size=tiny")
  config.mesh.update(mesh)
  with pytest.raises(validation.ConfigError, match=r"config\.mesh"):
    validation.validate_config(config, device_count=devices)


@pytest.mark.parametrize("field", ["batch_size", "eval_batch_size"])
def test_batch_not_divisible_by_the_data_shards_is_a_config_error(field):
  config = toy_reverse.get_config("size=tiny")
  config.mesh.update({"data": 2, "fsdp": 2})
  config[field] = 6  # 4 data x fsdp shards on 4 devices
  with pytest.raises(validation.ConfigError, match=rf"config\.{field}=6: must be divisible by mesh data x fsdp = 4"):
    validation.validate_config(config, device_count=4)


def test_mesh_minus_one_takes_the_remaining_devices():
  assert validation.mesh_shape({"data": -1, "fsdp": 2, "tensor": 2}, 8) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_unknown_task_name_lists_the_registered_tasks():
  with pytest.raises(KeyError, match="toy_reverse"):
    task_lib.get_task_class("no_such_task")


def test_task_can_be_named_by_module_path():
  assert task_lib.get_task_class("xattn_jax.tasks.toy_reverse:ToyReverseTask") is ToyReverseTask


# --- optimizer and loss -------------------------------------------------------------------------

def test_schedule_warms_up_linearly_to_the_peak():
  config = toy_reverse.get_config("size=tiny").optimizer
  config.learning_rate, config.warmup_steps = 1e-2, 10
  schedule = optim.make_schedule(config, total_steps=100)
  np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)], [0.0, 5e-3, 1e-2], rtol=1e-6)


@pytest.mark.parametrize("name,expected_at_40", [("cosine", 0.5e-2), ("rsqrt", 1e-2 * (10 / 40) ** 0.5),
                                                 ("constant", 1e-2)])
def test_schedule_decays_as_named_after_warmup(name, expected_at_40):
  config = toy_reverse.get_config("size=tiny").optimizer
  config.learning_rate, config.warmup_steps, config.schedule = 1e-2, 10, name
  schedule = optim.make_schedule(config, total_steps=70)  # cosine: halfway through 60 decay steps
  np.testing.assert_allclose(schedule(40), expected_at_40, rtol=1e-5)


def test_weight_decay_spares_biases_norms_and_embeddings():
  model = _abstract_model(toy_reverse.get_config("size=tiny"))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  mask = optim.weight_decay_mask(params, "bias,scale,embedding")
  assert mask["blocks"]["query"]["kernel"] and mask["logits"]["kernel"]
  assert not mask["blocks"]["query"]["bias"] and not mask["final_norm"]["scale"]
  assert not mask["embed"]["embedding"]


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


def test_cross_entropy_rejects_mismatched_targets():
  with pytest.raises(ValueError, match=r"targets must be logits.shape\[:-1\]=\[2, 3\]"):
    optim.cross_entropy(jnp.zeros((2, 3, 4)), jnp.zeros((2, 4), jnp.int32))


def test_gradient_clipping_bounds_the_update_norm():
  config = toy_reverse.get_config("size=tiny").optimizer
  config.name, config.grad_clip_norm, config.warmup_steps, config.schedule = "sgd", 0.5, 0, "constant"
  config.learning_rate, config.momentum = 1.0, 0.0
  tx = optim.make_optimizer(config, total_steps=10)
  grads = {"w": jnp.full((4,), 10.0)}
  updates, _ = tx.update(grads, tx.init(grads), grads)
  np.testing.assert_allclose(optax.tree.norm(updates), 0.5, rtol=1e-6)


# --- dropout keys -------------------------------------------------------------------------------

def _toy_loss_after_reseed(dropout_rate, step, seed=0):
  config = toy_reverse.get_config("size=tiny")
  config.model.dropout_rate = dropout_rate
  task = ToyReverseTask(config)
  with nnx.use_eager_sharding(False):
    model = task.make_model(loop.model_rngs(seed), dtype=jnp.float32, param_dtype=jnp.float32)
  batch = task.train_batch(0, process_index=0, process_count=1)
  loop.reseed_for_step(model, jax.random.key(seed), step)
  return float(_toy_loss(model, batch, task))


@nnx.jit(static_argnums=2)
def _toy_loss(model, batch, task):
  return task.loss(model, batch, rngs=None)[0]


def test_dropout_masks_are_a_pure_function_of_seed_and_step():
  assert _toy_loss_after_reseed(0.3, step=5) == _toy_loss_after_reseed(0.3, step=5)
  assert _toy_loss_after_reseed(0.3, step=5) != _toy_loss_after_reseed(0.3, step=6)
  assert _toy_loss_after_reseed(0.0, step=5) == _toy_loss_after_reseed(0.0, step=6)


# --- layer stacking -----------------------------------------------------------------------------

class _Block(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 8, kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(),
                                                                     ("embed", "mlp")), rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)

  def __call__(self, x, scale):
    return x + scale * jnp.tanh(self.linear(self.norm(x)))


@pytest.fixture(scope="module")
def stack():
  with nnx.use_eager_sharding(False):
    return layer_stack.create_stack(_Block, 4, nnx.Rngs(0))


def test_stacked_blocks_are_initialised_independently(stack):
  kernels = stack.linear.kernel[...]
  assert kernels.shape == (4, 8, 8) and not np.allclose(kernels[0], kernels[1])


def test_stacked_params_get_the_layers_logical_axis(stack):
  assert stack.linear.kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_scanned_and_unrolled_layers_give_the_same_outputs_and_gradients(stack, remat):
  x = jax.random.normal(jax.random.key(1), (2, 5, 8))

  def loss(model, scan):
    return jnp.sum(layer_stack.apply_stack(model, x, 0.5, scan=scan, remat=remat) ** 2)

  scanned, scanned_grads = nnx.value_and_grad(loss)(stack, True)
  unrolled, unrolled_grads = nnx.value_and_grad(loss)(stack, False)
  np.testing.assert_allclose(scanned, unrolled, rtol=1e-5)
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(scanned_grads)),
                              nnx.to_pure_dict(nnx.state(unrolled_grads)), rtol=1e-4, atol=1e-6)


class _DropoutBlock(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 8, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x, scale, *, deterministic=True):
    return x + scale * self.dropout(jnp.tanh(self.linear(x)), deterministic=deterministic)


def _dropout_stack():
  return layer_stack.create_stack(_DropoutBlock, 3, nnx.Rngs(params=0, dropout=1))


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_and_unrolled_layers_draw_the_same_dropout_masks(remat):
  x = jnp.ones((2, 5, 8))

  @nnx.jit(static_argnums=1)
  def loss(model, scan):
    return jnp.sum(layer_stack.apply_stack(model, x, 0.5, scan=scan, remat=remat, deterministic=False) ** 2)

  stacks = {scan: _dropout_stack() for scan in (True, False)}
  for _ in range(2):  # a second call draws new masks either way: the unrolled loop wrote back no RNG counts
    scanned, scanned_grads = nnx.value_and_grad(loss)(stacks[True], True)
    unrolled, unrolled_grads = nnx.value_and_grad(loss)(stacks[False], False)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-6)
    chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(scanned_grads, nnx.Param)),
                                nnx.to_pure_dict(nnx.state(unrolled_grads, nnx.Param)), rtol=1e-5, atol=1e-7)
  assert not np.allclose(loss(stacks[False], False), unrolled)  # a third call: other masks again


def test_dropout_in_scanned_layers_is_active_only_when_not_deterministic():
  x = jnp.ones((2, 5, 8))
  run = nnx.jit(lambda model, deterministic: layer_stack.apply_stack(
      model, x, 0.5, scan=True, deterministic=deterministic), static_argnums=1)
  stack = _dropout_stack()
  deterministic = run(stack, True)
  np.testing.assert_array_equal(deterministic, run(stack, True))
  assert not np.allclose(run(stack, False), deterministic)


def test_unknown_remat_policy_is_rejected():
  with pytest.raises(ValueError, match="allowed are"):
    layer_stack.remat_policy("everything")


# --- sharding rules -----------------------------------------------------------------------------

class _FakeMesh:
  shape = {"data": 2, "fsdp": 2, "tensor": 2}


def test_logical_names_map_to_mesh_axes_by_rules():
  spec = sharding.logical_to_spec(("embed", "mlp"), (8, 16), common.DEFAULT_SHARDING_RULES, _FakeMesh)
  assert tuple(spec) == ("fsdp", "tensor")


def test_dimension_not_divisible_by_its_mesh_axes_is_replicated():
  spec = sharding.logical_to_spec(("vocab", "embed"), (27, 8), common.DEFAULT_SHARDING_RULES, _FakeMesh)
  assert tuple(spec) == (None, "fsdp")


def test_mesh_axis_is_used_once_per_array():
  spec = sharding.logical_to_spec(("heads", "mlp"), (8, 8), common.DEFAULT_SHARDING_RULES, _FakeMesh)
  assert tuple(spec) == ("tensor", None)


def test_parameters_left_replicated_by_an_indivisible_mesh_axis_are_named_in_a_warning(caplog):
  """A model sized against the mesh (vocab 13, mlp 20 on tensor=8) trained fully replicated without a word."""
  from xattn_jax.models.translator import StackSize, Translator
  mesh = jax.sharding.AbstractMesh((1, 1, 8), ("data", "fsdp", "tensor"))
  abstract = nnx.state(nnx.eval_shape(lambda: Translator(
      13, encoder=StackSize(16, 2, 1, 20), decoder=StackSize(16, 2, 1, 20), rngs=nnx.Rngs(0))))
  with caplog.at_level("WARNING"):
    shardings = sharding.state_shardings(abstract, mesh, common.DEFAULT_SHARDING_RULES)
  (record,) = [r for r in caplog.records if "replicated, not sharded" in r.getMessage()]
  message = record.getMessage()  # 6 MLP arrays (mlp=20) and the source embedding (vocab=13), first 5 shown
  assert message.startswith("sharding: 7 parameter dimensions are replicated") and message.endswith(" ...")
  assert "encoder_blocks.mlp.wi.kernel [1, 16, 20] (mlp=20 not divisible by {'tensor': 8})" in message
  assert shardings["source_embed"]["embedding"].get_value().spec == jax.sharding.PartitionSpec(None, None)


def test_batch_rule_shards_over_data_and_fsdp():
  spec = sharding.logical_to_spec(("batch", None), (8, 5), common.DEFAULT_SHARDING_RULES, _FakeMesh)
  assert tuple(spec) == (("data", "fsdp"), None)


def test_resuming_drops_later_metric_rows_but_keeps_a_copy_of_them(tmp_path):
  from xattn_jax.training import metrics
  writer = metrics.MetricsWriter(str(tmp_path), active=True, tensorboard=False)
  for step in (1, 2, 3):
    writer.write(step, {"train/loss": float(step)})
  writer.close()
  metrics.MetricsWriter(str(tmp_path), active=True, tensorboard=False, resume_step=1).close()
  assert [row["step"] for row in metrics.read_metrics(str(tmp_path / "metrics.jsonl"))] == [1]
  copy = metrics.read_metrics(str(tmp_path / "metrics.jsonl.before_step_1"))
  assert [row["step"] for row in copy] == [1, 2, 3]


# --- several steps per call ---------------------------------------------------------------------

def _sgd_step(state, batch, step, rng_key):
  """A stand-in train step: one SGD update of a linear least-squares model, key and step mixed in."""
  def loss_fn(w):
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2)

  loss, grad = jax.value_and_grad(loss_fn)(state["w"])
  noise = jax.random.normal(jax.random.fold_in(rng_key, step), state["w"].shape)
  new = {"w": state["w"] - 0.1 * grad + 1e-3 * noise, "count": state["count"] + 1}
  return new, {"loss": loss, "step": step}


@pytest.mark.parametrize("size,count", [(4, 4), (4, 3), (4, 1), (1, 1)])
def test_multi_step_equals_that_many_single_steps(size, count):
  rng = np.random.default_rng(0)
  batches = {"x": jnp.asarray(rng.standard_normal((size, 8, 5)), jnp.float32),
             "y": jnp.asarray(rng.standard_normal((size, 8, 3)), jnp.float32)}
  state = {"w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32), "count": jnp.int32(0)}
  key, first = jax.random.key(7), jnp.int32(10)
  multi_state, metrics = jax.jit(loop.multi_step(_sgd_step))(state, batches, first, jnp.int32(count), key)

  single = jax.jit(_sgd_step)
  expected, losses = state, []
  for i in range(count):
    expected, values = single(expected, jax.tree.map(lambda x: x[i], batches), first + i, key)
    losses.append(values["loss"])
  assert int(multi_state["count"]) == count
  np.testing.assert_allclose(multi_state["w"], expected["w"], rtol=1e-6, atol=1e-6)
  assert metrics["loss"].shape == metrics["step"].shape == (size,)
  np.testing.assert_allclose(metrics["loss"][:count], losses, rtol=1e-6)
  np.testing.assert_array_equal(metrics["step"][:count], 10 + np.arange(count))
  assert not np.any(metrics["loss"][count:])  # entries past count are zeros


def test_multi_step_takes_a_different_count_without_retracing():
  traced = []

  def step(state, batch, step, rng_key):
    traced.append(1)
    return _sgd_step(state, batch, step, rng_key)

  run = jax.jit(loop.multi_step(step))
  batches = {"x": jnp.ones((3, 2, 5)), "y": jnp.ones((3, 2, 3))}
  state = {"w": jnp.zeros((5, 3)), "count": jnp.int32(0)}
  for count in (3, 1, 2):
    state, _ = run(state, batches, jnp.int32(0), jnp.int32(count), jax.random.key(0))
  assert int(state["count"]) == 6
  traces = len(traced)
  run(state, batches, jnp.int32(0), jnp.int32(3), jax.random.key(0))
  assert len(traced) == traces


@pytest.mark.parametrize("steps_per_call,total,eval_every,checkpoint_every", [
    (4, 20, 5, 7), (8, 8, 4, 4), (1, 6, 2, 3), (16, 50, 10, 25), (3, 7, 100, 100)])
def test_calls_end_at_every_eval_checkpoint_and_the_last_step(steps_per_call, total, eval_every, checkpoint_every):
  config = common.base_config(total_steps=total, eval_every_steps=eval_every,
                              checkpoint_every_steps=checkpoint_every)
  config.steps_per_call = steps_per_call
  step, ends = 0, []
  while step < total:
    count = loop._steps_in_call(step, config)
    assert 1 <= count <= loop._stack_depth(config) <= steps_per_call
    step += count
    ends.append(step)
  must_end = {s for s in range(1, total + 1) if s % eval_every == 0 or s % checkpoint_every == 0} | {total}
  assert must_end <= set(ends)
  # Calls are cut only there: every call that does not end at one of those steps is full length.
  starts = [0] + ends[:-1]
  assert all(b - a == steps_per_call for a, b in zip(starts, ends) if b not in must_end)
