"""Shared pytest setup: one persistent XLA compilation cache for the session, float32 on GPU."""
import os
import shutil
import tempfile

# One compilation cache for this test session, shared by pytest-xdist workers and by every launch.py
# subprocess a test spawns (they inherit the environment): the same small programs are compiled by many
# tests, and a cache hit skips XLA's compile. Set before JAX is imported; a cache the caller chose is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = tempfile.mkdtemp(prefix="xattn_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
else:
  _CACHE_DIR = None

import jax  # noqa: E402

# Tests that spawn launch.py subprocesses must not inherit a device count set for this process.
os.environ.setdefault("PYTHONHASHSEED", "0")

# The tests compare float32 results with references to ~1e-5. On GPU, XLA's default float32 matmul
# runs in TF32 (~1e-3); the tests check the mathematics, so they ask for full float32 there. CPU
# matmuls are float32 either way.
if jax.default_backend() == "gpu":
  jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
  # Only the process that made the cache removes it (xdist workers inherit its path).
  if _CACHE_DIR is not None and not hasattr(config, "workerinput"):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)
