#!/usr/bin/env bash
# One device call: the GPU test suite (kernels compiled, not interpreted),
# then the attention benchmark on a subset of shapes.
# Usage (GPU machine, repo root):
#   bash bench/gpu_attention.sh OUTDIR [SHAPES] [TUNE] [TEST_TIMEOUT] [EXTRA_BENCH_ARGS...]
# Several runs (e.g. shapes 0,1 / 2,3,4 / 5,6) are merged with
#   python bench/attention.py --merge run*/attention-*.json --out bench/results
set -uo pipefail
out=${1:-/tmp/jaxkv-gpu}; shapes=${2:-4,5,0}; tune=${3:-4}; ttest=${4:-200}
shift $(( $# < 4 ? $# : 4 ))
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
if [ "$ttest" -gt 0 ]; then
  JAXKV_TEST_GPU=1 timeout "$ttest" python3 -m pytest -q -p no:cacheprovider \
    tests/test_pallas_kernels.py tests/test_quant.py tests/test_unpack_asm.py \
    tests/test_autotune.py tests/test_cache.py 2>&1 | tee "$out/gpu_tests.log" | tail -15
fi
python3 bench/attention.py --shapes "$shapes" --tune "$tune" --out "$out" "$@" 2>&1 \
  | tee "$out/attention.log" | tail -40
