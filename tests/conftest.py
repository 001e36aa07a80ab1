"""Shared pytest setup: cached bytecode, one persistent XLA compilation cache for the session, float32 on GPU."""
import os
import shutil
import sys
import tempfile

# README's test command installs with `pip install --no-compile`: byte-compiling every installed file is half the
# install's time, and most of those files no test imports. The modules a test imports are compiled by the first
# process that imports them and cached beside them for every later one (the workers and launch.py subprocesses
# inherit the environment), also where the environment asks Python not to write bytecode.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# One compilation cache for this test session, shared by every launch.py subprocess a test spawns (they
# inherit the environment): the same small programs are compiled by many launches, and a cache hit skips
# XLA's compile. Set before JAX is imported; a cache the caller chose is kept.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE_DIR = tempfile.mkdtemp(prefix="xattn_jax_test_xla_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
else:
  _CACHE_DIR = None
# XLA's backend optimization level 0 halves its CPU compile time, and compiling is most of what these small
# tests do; XLA:CPU's older (non-MLIR) fusion emitters halve what is left, and each program's LLVM module is
# compiled in one piece rather than split across a thread pool the busy cores cannot serve. Numerics are the
# same programs' up to float rounding; the launch tests that must see XLA's default level or emitters ask for
# them (helpers.subprocess_env(optimize=True) or fusion_emitters=True). Set here before JAX starts.
from tests.xla_flags import COMPILE_FAST_XLA_FLAGS  # noqa: E402  (imports no JAX)

for _flag in COMPILE_FAST_XLA_FLAGS:
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# Trained artefacts that many tests read (tests/helpers.py build_once), built once per session.
if "XATTN_JAX_TEST_ARTIFACTS" not in os.environ:
  _ARTIFACTS_DIR = tempfile.mkdtemp(prefix="xattn_jax_test_artifacts_")
  os.environ["XATTN_JAX_TEST_ARTIFACTS"] = _ARTIFACTS_DIR
else:
  _ARTIFACTS_DIR = None

import jax  # noqa: E402
import pytest  # noqa: E402

from tests import helpers  # noqa: E402

# Tests that spawn launch.py subprocesses must not inherit a device count set for this process.
os.environ.setdefault("PYTHONHASHSEED", "0")

# The tests compare float32 results with references to ~1e-5. On GPU, XLA's default float32 matmul
# runs in TF32 (~1e-3); the tests check the mathematics, so they ask for full float32 there. CPU
# matmuls are float32 either way.
if jax.default_backend() == "gpu":
  jax.config.update("jax_default_matmul_precision", "highest")

# The persistent cache is for the launch.py subprocesses, which compile the same programs again and again;
# this process's tests compile programs no other process compiles, so writing them out only costs time (a module
# whose tests compile the same programs run after run opts in: compilation_cache_in_process below).
jax.config.update("jax_enable_compilation_cache", False)


def pytest_unconfigure(config):
  # Only the process that made a directory removes it (xdist workers inherit the paths).
  if not hasattr(config, "workerinput"):
    for directory in (_CACHE_DIR, _ARTIFACTS_DIR):
      if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def trained_translator():
  """The workdir of a tiny translator trained on two years of dates (helpers.TINY_DATES): checkpoint,
  tokenizer, metrics and plots. Shared by the whole session: copy it before writing into it."""
  def build(workdir):
    result = helpers.launch("configs/translate_dates.py", workdir, overrides=helpers.TINY_DATES)
    assert result.returncode == 0, result.stderr[-3000:]
  return helpers.build_once("trained_translator", build)


@pytest.fixture(scope="module")
def compilation_cache_in_process():
  """The persistent compilation cache for this process too, while a module runs: for the modules whose tests run
  the same programs run after run (loop.run of one small config, again and again), each a cache hit after its first
  compile. JAX decides once whether a process uses the cache: reset, it decides again."""
  from jax.experimental.compilation_cache import compilation_cache
  jax.config.update("jax_enable_compilation_cache", True)
  compilation_cache.reset_cache()
  yield
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()


def pytest_configure(config):
  # pytest-xdist would hand out the files with the most tests first, undoing the order below.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  # The costliest files run first: pytest-xdist (--dist loadfile) hands whole files to its workers in this
  # order, and a long file that starts last runs alone at the end. A file's cost is estimated as its test
  # count plus ten per slow (launching, training) test. Within a file the order is kept; every worker
  # sorts the same collection the same way.
  cost_per_file: dict[str, int] = {}
  for item in items:
    cost = 1 + 10 * (item.get_closest_marker("slow") is not None)
    cost_per_file[item.path] = cost_per_file.get(item.path, 0) + cost
  items.sort(key=lambda item: -cost_per_file[item.path])
