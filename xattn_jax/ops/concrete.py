"""Values known while tracing: the checks that read an array's values (ids in range, slots that end an image)."""
import jax
import numpy as np


def concrete(array) -> np.ndarray | None:
  """array's values as NumPy where they are known (a NumPy or Python value, or a jax.Array, also one a jitted
  function closed over), None for a tracer. Checks compute on the NumPy copy: jnp ops on a closed-over array
  inside a jit return tracers, whose values cannot be read."""
  return None if isinstance(array, jax.core.Tracer) else np.asarray(array)
