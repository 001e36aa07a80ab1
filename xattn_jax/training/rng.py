"""The run's random streams: every key is a pure function of (config.seed, step), so a resumed run
draws what the run it continues would have drawn.

The run key (`jax.random.key(config.seed)`, stored in every checkpoint) is folded with a stream id,
so the model's dropout masks and a task's own randomness never share keys.
"""
from __future__ import annotations

import jax
from flax import nnx

DROPOUT_STREAM, TASK_STREAM = 0, 1


def model_rngs(seed: int) -> nnx.Rngs:
  """The Rngs a task's make_model receives: `params` from the seed, and a `dropout` stream that
  nnx.Dropout layers fork at construction (its key is replaced every step, see reseed_for_step)."""
  return nnx.Rngs(params=seed, dropout=jax.random.fold_in(jax.random.key(seed), DROPOUT_STREAM))


def reseed_for_step(model, rng_key, step) -> None:
  """Sets every `dropout` stream of `model` to a key that is a pure function of (run key, step).

  Resuming from checkpoint s therefore draws the same dropout masks at step s + 1 as the run it
  continues, whatever RNG state the checkpoint holds. Stacked layers hold one key per layer
  ([layers] shaped): `match_shape` splits this step's key into one per layer.
  """
  step_key = jax.random.fold_in(jax.random.fold_in(rng_key, DROPOUT_STREAM), step)
  nnx.reseed(model, dropout=step_key, policy="match_shape")


def task_rngs(rng_key, step, microbatch=None) -> nnx.Rngs:
  """The `rngs` handed to Task.loss: any randomness a task draws itself (not the model's dropout); with
  config.num_microbatches > 1, one stream per microbatch of the step."""
  key = jax.random.fold_in(jax.random.fold_in(rng_key, TASK_STREAM), step)
  return nnx.Rngs(key if microbatch is None else jax.random.fold_in(key, microbatch))
