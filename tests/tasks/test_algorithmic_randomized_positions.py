"""Randomized positions from the algorithmic config: `configs/algorithmic.py:randomized=N` to the model."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import algorithmic as algorithmic_config
from tests.helpers import abstract_model
from xattn_jax.tasks import algorithmic as algorithmic_task
from xattn_jax.training import loop
from xattn_jax.training import rng as rng_lib


def _task(arg):
  config = algorithmic_config.get_config("size=micro," + arg)
  config.task.update(train_max_length=6, eval_bands="1-6,7-12", num_eval_examples=4)
  config.batch_size = config.eval_batch_size = 4
  return algorithmic_task.AlgorithmicTask(config)


def test_randomized_config_argument_sizes_the_learned_table_to_max_position():
  model = abstract_model(_task("posenc=learned,randomized=64"))
  assert model.source_positions.table.shape[0] == model.target_positions.table.shape[0] == 64


def test_training_loss_draws_positions_from_the_steps_rngs_and_eval_uses_0_to_n_minus_1():
  randomized, plain = _task("posenc=sinusoidal,randomized=64"), _task("posenc=sinusoidal")
  model = randomized.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  batch = {k: jnp.asarray(v) for k, v in randomized.train_batch(0, process_index=0, process_count=1).items()}
  loss = nnx.jit(lambda m, b, step: randomized.loss(m, b, rngs=rng_lib.task_rngs(jax.random.key(0), step))[0])
  same, again, other = (float(loss(model, batch, step)) for step in (0, 0, 1))
  assert same == again and same != other  # a pure function of the step's rngs, and they matter
  first_eval_batch = next(iter(randomized.eval_batches(process_index=0, process_count=1)))
  eval_batch = {k: jnp.asarray(v) for k, v in first_eval_batch.items()}
  metrics = nnx.jit(randomized.eval_metrics)(model, eval_batch)
  # Sinusoidal positions have no parameters: the plain model has the same ones, and positions 0..n-1.
  plain_model = plain.make_model(loop.model_rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
  plain_metrics = nnx.jit(plain.eval_metrics)(plain_model, eval_batch)
  np.testing.assert_allclose(np.asarray(metrics["loss"][0]), np.asarray(plain_metrics["loss"][0]), rtol=1e-6)
