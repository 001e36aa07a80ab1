"""Pure jax.numpy attention ops: no parameters, no Flax."""
