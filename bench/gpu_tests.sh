#!/usr/bin/env bash
# The kernel test suite compiled for the GPU (not interpreted), one device call.
# Usage (GPU machine, repo root): bash bench/gpu_tests.sh OUTDIR [TIMEOUT_S] [WORKERS]
# Uses pytest-xdist when importable (e.g. wheels unpacked into .whl/site) to
# compile test cases in parallel; each worker allocates GPU memory on demand.
set -uo pipefail
out=${1:-/tmp/jaxkv-gpu}; ttest=${2:-540}; workers=${3:-8}
mkdir -p "$out"
export PYTHONPATH=".:.whl/site" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
par=()
if python3 -c "import xdist" 2>/dev/null; then par=(-n "$workers"); fi
JAXKV_TEST_GPU=1 timeout "$ttest" python3 -m pytest -q -p no:cacheprovider "${par[@]}" \
  --durations=10 tests/test_pallas_kernels.py tests/test_quant.py tests/test_unpack_asm.py \
  tests/test_autotune.py tests/test_cache.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$out/gpu_tests.log"
