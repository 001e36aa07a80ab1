"""Helpers shared by test modules (fixtures live in conftest.py)."""
import jax.numpy as jnp
from absl import flags
from flax import nnx
from ml_collections import config_flags


def load_config(*argv):
  """The config exactly as launch.py resolves it from command-line arguments."""
  flag_values = flags.FlagValues()
  argv = ["prog", *argv]
  config_flags.DEFINE_config_file("config", None, flag_values=flag_values, lock_config=True, sys_argv=argv)
  flag_values(argv)
  return flag_values.config


def abstract_model(task):
  """The task's model as shapes only (no parameters allocated)."""
  with nnx.use_eager_sharding(False):
    return nnx.eval_shape(lambda: task.make_model(nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32))
