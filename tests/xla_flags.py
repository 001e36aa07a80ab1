"""XLA flags that compile the tests' small programs ~3x faster, numerics the same up to float rounding. No
imports: conftest.py sets them before JAX starts, and helpers.subprocess_env passes them to launch.py
subprocesses."""
# XLA's backend optimization level 0.
OPTIMIZATION_LEVEL_0 = "--xla_backend_optimization_level=0"
# XLA:CPU's older (non-MLIR) fusion emitters.
OLDER_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# Each program's LLVM module is compiled in one piece instead of split across a thread pool: the same kernels,
# with less work when two test processes already keep both cores busy. Kept at every optimization level.
ONE_CODEGEN_PIECE = "--xla_cpu_parallel_codegen_split_count=1"
COMPILE_FAST_XLA_FLAGS = (OPTIMIZATION_LEVEL_0, OLDER_FUSION_EMITTERS, ONE_CODEGEN_PIECE)
