#!/usr/bin/env bash
# One device call: the Pallas kernel tests compiled on the GPU, then the
# attention benchmark on a subset of shapes.
# Usage (GPU machine, repo root): bash bench/gpu_attention.sh OUTDIR [SHAPES] [TUNE] [TEST_TIMEOUT]
set -uo pipefail
out=${1:-/tmp/jaxkv-gpu}; shapes=${2:-4,5,0}; tune=${3:-4}; ttest=${4:-200}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
if [ "$ttest" -gt 0 ]; then
  JAXKV_TEST_GPU=1 timeout "$ttest" python3 -m pytest -q -p no:cacheprovider \
    tests/test_pallas_kernels.py 2>&1 | tee "$out/gpu_tests.log" | tail -15
fi
python3 bench/attention.py --shapes "$shapes" --tune "$tune" --out "$out" 2>&1 | tee "$out/attention.log" | tail -30
