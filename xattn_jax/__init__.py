"""xattn_jax: attention research in JAX and Flax NNX."""
