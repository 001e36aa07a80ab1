"""The run's random streams: dropout masks and task keys as pure functions of (seed, step)."""
import jax
import jax.numpy as jnp
from flax import nnx

from configs import template
from xattn_jax.tasks.template import TemplateTask
from xattn_jax.training import rng


def _toy_loss_after_reseed(dropout_rate, step, seed=0):
  config = template.get_config("size=tiny")
  config.model.dropout_rate = dropout_rate
  task = TemplateTask(config)
  with nnx.use_eager_sharding(False):
    model = task.make_model(rng.model_rngs(seed), dtype=jnp.float32, param_dtype=jnp.float32)
  batch = task.train_batch(0, process_index=0, process_count=1)
  rng.reseed_for_step(model, jax.random.key(seed), step)
  return float(_toy_loss(model, batch, task))


@nnx.jit(static_argnums=2)
def _toy_loss(model, batch, task):
  return task.loss(model, batch, rngs=None)[0]


def test_dropout_masks_are_a_pure_function_of_seed_and_step():
  assert _toy_loss_after_reseed(0.3, step=5) == _toy_loss_after_reseed(0.3, step=5)
  assert _toy_loss_after_reseed(0.3, step=5) != _toy_loss_after_reseed(0.3, step=6)
  assert _toy_loss_after_reseed(0.0, step=5) == _toy_loss_after_reseed(0.0, step=6)


def _draw(rngs):
  return jax.random.key_data(rngs.noise()).tolist()


def test_task_keys_are_a_pure_function_of_run_key_and_step():
  key = jax.random.key(3)
  assert _draw(rng.task_rngs(key, 4)) == _draw(rng.task_rngs(key, 4))
  assert _draw(rng.task_rngs(key, 4)) != _draw(rng.task_rngs(key, 5))
  assert _draw(rng.task_rngs(key, 4)) != _draw(rng.task_rngs(jax.random.key(4), 4))


def test_task_keys_are_not_the_dropout_keys_of_the_same_step():
  key, step = jax.random.key(0), 2
  dropout_key = jax.random.fold_in(jax.random.fold_in(key, rng.DROPOUT_STREAM), step)
  task_key = jax.random.fold_in(jax.random.fold_in(key, rng.TASK_STREAM), step)
  assert jax.random.key_data(dropout_key).tolist() != jax.random.key_data(task_key).tolist()
  assert _draw(rng.task_rngs(key, step)) == _draw(nnx.Rngs(task_key))
