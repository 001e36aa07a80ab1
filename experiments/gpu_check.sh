#!/usr/bin/env bash
# The checks that need a GPU, as one script: the attention, layer and model tests on the GPU (cuDNN
# included; they skip it elsewhere) and the attention benchmark's GPU tables. Run from the repo root:
#   bash experiments/gpu_check.sh [out_dir]      # default out_dir: /tmp/gpu_check
# Logs and the benchmark's tables land in out_dir (copy them to experiments/results/ to record them); the
# benchmark writes its tables after every row, so a run its time limit stops keeps what it measured.
# On an H200 the tests take over 150 s on 12 workers and the benchmark about 35 s a shape (nearly all
# compiling), so its full run (float32 and bfloat16, long keys, memory) needs about 20 minutes: within a
# shorter lease, set BENCH_TIMEOUT and run the remaining shapes with bench_attention.py --case.
# Python: $PYTHON, else the README's .venv, else python3. Tests run in parallel when pytest-xdist is
# installed (pip install pytest-xdist), one after another otherwise.
set -uo pipefail
out=${1:-/tmp/gpu_check}
mkdir -p "$out"
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test workers share the GPU
nvidia-smi -L 2>&1 | tee "$out/versions.txt"
"$python" -c "import jax, flax, chex, torch; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__,
  'chex', chex.__version__, 'torch', torch.__version__)" 2>&1 | tee -a "$out/versions.txt"
parallel=()
if "$python" -c "import xdist" 2>/dev/null; then
  parallel=(-n "$(( $(nproc) < 12 ? $(nproc) : 12 ))")
fi
timeout "${TEST_TIMEOUT:-240}" "$python" -m pytest -v -p no:cacheprovider "${parallel[@]}" -rs \
  tests/ops/test_attention.py tests/ops/test_torch_oracle.py tests/ops/test_masks.py tests/layers/test_attention.py \
  tests/layers/test_blocks.py tests/test_decoding.py tests/models/test_translator.py tests/models/test_latent_reader.py \
  2>&1 | tee "$out/tests.log" | grep -v " PASSED " | tail -60
tests_status=$?
echo "tests exit: $tests_status"
timeout "${BENCH_TIMEOUT:-300}" "$python" experiments/bench_attention.py --out="$out" 2>&1 | tee "$out/bench.log" | tail -60
bench_status=$?
echo "benchmark exit: $bench_status"
exit $(( tests_status || bench_status ))
