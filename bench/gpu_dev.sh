#!/usr/bin/env bash
# One device call for kernel development: the kernel/quant tests compiled on
# the GPU, a config sweep of the split kernel, and the flush timings.
# Usage (GPU machine, repo root): bash bench/gpu_dev.sh OUTDIR [SHAPES] [FORMATS] [TEST_TIMEOUT]
set -uo pipefail
out=${1:-/tmp/jaxkv-gpu}; shapes=${2:-4,0}; formats=${3:-kivi4,int8}; ttest=${4:-240}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
if [ "$ttest" -gt 0 ]; then
  JAXKV_TEST_GPU=1 timeout "$ttest" python3 -m pytest -q -p no:cacheprovider -x \
    tests/test_pallas_kernels.py tests/test_quant.py tests/test_unpack_asm.py 2>&1 \
    | tee "$out/gpu_tests.log" | tail -8
fi
timeout 120 python3 bench/attention.py --flush-only --out "$out" 2>&1 | tail -8
python3 bench/sweep_configs.py --shapes "$shapes" --formats "$formats" \
  --block_k 64,128 --warps 2,4,8 --stages 2,3 --defer 1 --split_mult 1 --out "$out" 2>&1 \
  | tee "$out/sweep.log" | grep -v "^ " | tail -3
grep -A4 "default" "$out/sweep.log" | tail -60
