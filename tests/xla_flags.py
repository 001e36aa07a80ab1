"""XLA flags that compile the tests' small programs ~3x faster, numerics the same up to float rounding: XLA's
backend optimization level 0, and XLA:CPU's older (non-MLIR) fusion emitters. No imports: conftest.py sets
them before JAX starts, and helpers.subprocess_env passes them to launch.py subprocesses."""
COMPILE_FAST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
