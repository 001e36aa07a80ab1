"""XLA flags that compile the tests' small programs ~3x faster, numerics the same up to float rounding. No
JAX import: conftest.py sets them before JAX starts, and helpers.subprocess_env passes them to launch.py
subprocesses. XLA aborts at start on a flag it does not know, so each flag is kept only for the jaxlib
versions that have it."""
from importlib import metadata


def _jaxlib_version() -> tuple[int, int]:
  try:
    major, minor = metadata.version("jaxlib").split(".")[:2]
    return int(major), int(minor)
  except (metadata.PackageNotFoundError, ValueError):
    return 0, 0

# XLA's backend optimization level 0.
OPTIMIZATION_LEVEL_0 = "--xla_backend_optimization_level=0"
# XLA:CPU's older (non-MLIR) fusion emitters; jaxlib 0.11 removed them and the flag with them (None there).
OLDER_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false" if _jaxlib_version() < (0, 11) else None
# Each program's LLVM module is compiled in one piece instead of split across a thread pool: the same kernels,
# with less work when two test processes already keep both cores busy. Kept at every optimization level.
ONE_CODEGEN_PIECE = "--xla_cpu_parallel_codegen_split_count=1"
COMPILE_FAST_XLA_FLAGS = tuple(flag for flag in (OPTIMIZATION_LEVEL_0, OLDER_FUSION_EMITTERS, ONE_CODEGEN_PIECE) if flag)
