"""Shared pytest setup."""
import os

import jax

# Tests that spawn launch.py subprocesses must not inherit a device count set for this process.
os.environ.setdefault("PYTHONHASHSEED", "0")

# The tests compare float32 results with references to ~1e-5. On GPU, XLA's default float32 matmul
# runs in TF32 (~1e-3); the tests check the mathematics, so they ask for full float32 there. CPU
# matmuls are float32 either way.
if jax.default_backend() == "gpu":
  jax.config.update("jax_default_matmul_precision", "highest")
