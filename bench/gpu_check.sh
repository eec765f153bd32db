#!/usr/bin/env bash
# One device call: the kernel/cache/model tests compiled on the GPU, then the
# end-to-end benchmark. Usage (on the GPU machine, repo root): bash bench/gpu_check.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/jaxkv-gpu}; mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAXKV_TEST_GPU=1
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_pallas_kernels.py \
  tests/test_attention_reference.py tests/test_generate.py 2>&1 | tee "$out/gpu_tests.log" | tail -25
timeout 300 python3 bench/e2e.py --quick --time-budget 260 2>&1 | tee "$out/e2e.log" | tail -40
cp bench/results/e2e-* "$out/" 2>/dev/null; ls "$out"
