"""The loop's pieces: per-step RNG, multi-step calls, call boundaries."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common, toy_reverse
from xattn_jax.training import loop
from xattn_jax.tasks.toy_reverse import ToyReverseTask


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
