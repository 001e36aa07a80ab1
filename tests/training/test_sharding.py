"""Logical-axis sharding rules."""
import jax
import pytest
from flax import nnx

from configs import common
from xattn_jax.training import sharding


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


def test_logits_sharding_splits_rows_by_the_batch_rule_and_the_vocabulary_by_the_vocab_rule():
  rules = common.DEFAULT_SHARDING_RULES
  spec = lambda shape: getattr(sharding.logits_sharding(
      jax.sharding.AbstractMesh(shape, ("data", "fsdp", "tensor")), rules), "spec", None)
  assert spec((2, 2, 2)) == jax.sharding.PartitionSpec(("data", "fsdp"), ("tensor",))
  assert spec((1, 1, 4)) == jax.sharding.PartitionSpec(None, ("tensor",))
  assert spec((4, 2, 1)) is None  # the vocabulary is whole: decoding ranks it as one


def test_rows_decode_in_the_eval_batch_or_the_next_power_of_two_split_over_the_devices_the_rows_take():
  batches = lambda shape: sharding.batch_sharding(
      jax.sharding.AbstractMesh(shape, ("data", "fsdp", "tensor")), common.DEFAULT_SHARDING_RULES)
  assert [sharding.rows_batch_size(n, 256, None) for n in (1, 2, 3, 5, 200, 256, 1000)] == [1, 2, 4, 8, 256, 256, 256]
  assert [sharding.rows_batch_size(n, 256, batches((4, 2, 1))) for n in (1, 3, 9, 1000)] == [8, 8, 16, 256]
  assert sharding.rows_batch_size(3, 256, batches((1, 1, 4))) == 4  # rows whole on every device (tensor-parallel)


def test_optimizer_moments_are_not_counted_again_in_the_replicated_parameters_warning(caplog):
  """The trainer places (model, optimizer) together: Adam's mu and nu of each replicated parameter tripled the
  count and filled the five names shown with copies of the same parameter."""
  import optax
  mesh = jax.sharding.AbstractMesh((1, 1, 8), ("data", "fsdp", "tensor"))
  init = lambda: (lambda model: (model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)))(  # noqa: E731
      nnx.Linear(16, 20, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
          nnx.initializers.lecun_normal(), ("embed", "mlp"), eager_sharding=False)))
  abstract = nnx.state(nnx.eval_shape(init))
  with caplog.at_level("WARNING"):
    shardings = sharding.state_shardings(abstract, mesh, common.DEFAULT_SHARDING_RULES)
  (record,) = [r for r in caplog.records if "replicated, not sharded" in r.getMessage()]
  assert record.getMessage() == ("sharding: 1 parameter dimensions are replicated, not sharded, because their mesh "
                                 "axes do not divide them: 0.kernel [16, 20] (mlp=20 not divisible by {'tensor': 8})")
  assert shardings[1]["opt_state"][0]["mu"]["kernel"].get_value().spec == jax.sharding.PartitionSpec(None, None)


def test_rules_that_name_no_mesh_axis_are_refused_in_one_line_naming_the_function_and_the_rule():
  """A notebook's rules (place_model, logits_sharding) are not validated with a config: a misspelt axis raised
  KeyError 'model', a list raised AttributeError, and 'tensor,tensor' left the dimension replicated, warned as
  'not divisible by {tensor: 4}'."""
  mesh = jax.sharding.AbstractMesh((1, 1, 4), ("data", "fsdp", "tensor"))
  model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"^place_model: rules\['mlp'\]='model': comma-separated mesh axes from "):
    sharding.place_model(model, mesh, {"mlp": "model"})
  with pytest.raises(ValueError, match=r"^place_model: rules\['mlp'\]='tensor,tensor': names mesh axis 'tensor' twice"):
    sharding.place_model(model, mesh, {"mlp": "tensor,tensor"})
  with pytest.raises(ValueError, match=r"^logits_sharding: rules\['vocab'\]=\['tensor'\]: must be a string"):
    sharding.logits_sharding(mesh, {"vocab": ["tensor"]})
  with pytest.raises(ValueError, match=r"^logits_sharding: rules must map logical axis names to mesh axes"):
    sharding.logits_sharding(mesh, None)
  tensor_only = jax.sharding.AbstractMesh((4,), ("tensor",))
  with pytest.raises(ValueError, match=r"^batch_sharding: rules\['batch'\]='data,fsdp' names mesh axis 'data', "
                                       r"which the mesh \(axes \('tensor',\)\) lacks"):
    sharding.batch_sharding(tensor_only, common.DEFAULT_SHARDING_RULES)
