"""Checkpoint retention (last K plus the best) and the resume order, in process."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import template
from xattn_jax.training import checkpoints as checkpoints_lib
from xattn_jax.training import loop


def _tiny(step):
  return {"w": jnp.full((3,), float(step))}, {"count": jnp.asarray(step)}


def test_keeps_the_last_k_plus_the_best_by_the_eval_metric(tmp_path):
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=2, best_metric="eval/loss", best_mode="min")
  losses = {1: 3.0, 2: 0.5, 3: 2.0, 4: 1.0, 5: 1.5}
  for step, loss in losses.items():
    model, optimizer = _tiny(step)
    checkpoints.save(step, model, optimizer, {"step": step}, {"eval/loss": loss})
  assert checkpoints.steps() == [2, 4, 5]
  checkpoints.close()


def test_best_mode_max_keeps_the_highest_metric(tmp_path):
  checkpoints = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/accuracy", best_mode="max")
  for step, accuracy in {1: 0.2, 2: 0.9, 3: 0.4}.items():
    model, optimizer = _tiny(step)
    checkpoints.save(step, model, optimizer, {"step": step}, {"eval/accuracy": accuracy})
  assert checkpoints.steps() == [2, 3]
  checkpoints.close()


def test_the_best_checkpoint_survives_a_resume(tmp_path):
  """A resumed run (a new manager on the same directory) still knows the earlier steps' metrics:
  they were kept only in memory, and the first save after a resume deleted the best step."""
  first = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/exact_match", best_mode="max")
  for step, metrics in ((200, {"eval/exact_match": 0.9}), (232, None)):  # 232: saved on Ctrl-C, no eval
    first.save(step, *_tiny(step), {"step": step}, metrics)
  first.close()
  resumed = checkpoints_lib.Checkpoints(str(tmp_path), keep=1, best_metric="eval/exact_match", best_mode="max")
  for step in (300, 350, 400):
    resumed.save(step, *_tiny(step), {"step": step}, {"eval/exact_match": 0.5} if step % 100 == 0 else None)
  assert resumed.steps() == [200, 400]
  resumed.close()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
  """A toy run's state saved at step 3 with recognisable parameters (all ones)."""
  workdir = str(tmp_path_factory.mktemp("saved"))
  config = template.get_config("size=tiny")
  run = loop._Run(config, workdir)
  state = run.init_state()
  model_dict, optimizer_dict = run.split_pure(state)
  model_dict = jax.tree.map(jnp.ones_like, model_dict)
  checkpoints = checkpoints_lib.Checkpoints(workdir, keep=2)
  checkpoints.save(3, model_dict, optimizer_dict, {"step": 3, "rng": [0, 7]})
  checkpoints.close()
  return config, run, workdir


def _restore(config, workdir):
  checkpoints = checkpoints_lib.Checkpoints(workdir, keep=2)
  try:
    return loop._restore(loop._Run(config, workdir), checkpoints)
  finally:
    checkpoints.close()


def _all_ones(state):
  """All model leaves are ones, except PRNG keys (the dropout streams), which have no numeric value."""
  leaves = [x for x in jax.tree.leaves(state[0]) if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
  return bool(leaves) and all(np.all(np.asarray(x) == 1) for x in leaves)


def test_init_from_loads_parameters_at_step_zero(saved_run, tmp_path):
  config, _, saved_workdir = saved_run
  config = config.copy_and_resolve_references()
  config.init_from = f"{saved_workdir}/checkpoints"
  state, step, _ = _restore(config, str(tmp_path))
  assert step == 0 and _all_ones(state)


def test_checkpoint_in_the_workdir_wins_over_init_from(saved_run, tmp_path):
  config, _, saved_workdir = saved_run
  config = config.copy_and_resolve_references()
  config.init_from = str(tmp_path / "elsewhere")  # never read: the workdir has a checkpoint
  state, step, key = _restore(config, saved_workdir)
  assert step == 3 and _all_ones(state)
  assert list(np.asarray(jax.random.key_data(key))) == [0, 7]  # the run's RNG comes back too


def test_without_checkpoints_training_starts_from_the_seed(saved_run, tmp_path):
  config, _, _ = saved_run
  state, step, _ = _restore(config, str(tmp_path))
  assert step == 0 and not _all_ones(state)


def test_a_mismatch_names_a_parameter_before_an_rng_counter(tmp_path):
  """A deeper stack differs in its per-layer RNG counts too; 'blocks.dropout.rngs.count is [2]' was
  reported instead of the parameter whose shape tells why."""
  import orbax.checkpoint as ocp
  stored = {"blocks": {"dropout": {"rngs": {"count": jnp.zeros((2,), jnp.uint32)}}, "kernel": jnp.zeros((2, 8))}}
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "model", stored)
  wanted = jax.eval_shape(lambda: {"blocks": {"dropout": {"rngs": {"count": jnp.zeros((1,), jnp.uint32)}},
                                              "kernel": jnp.zeros((1, 8))}})
  assert checkpoints_lib.model_mismatch(str(tmp_path / "model"), wanted) == \
      "parameter blocks.kernel is [2, 8] in the checkpoint, [1, 8] in this config"
