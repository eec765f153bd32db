#!/usr/bin/env bash
# The one GPU runner: the kernel tests compiled on the GPU (Triton family with
# JAXKV_TEST_GPU=1, the Mosaic family on a Hopper GPU), the sharded checks when
# there are several GPUs (NVLink multicast kept off), then optionally a
# benchmark. Usage (GPU machine, repo root):
#   bash bench/gpu_tests.sh OUTDIR [TEST_TIMEOUT_S] [-- BENCH COMMAND...]
# e.g. bash bench/gpu_tests.sh $OUT 300 -- python3 bench/attention.py --shapes 2 --out $OUT
# Uses pytest-xdist when importable to compile cases in parallel (the GPU image
# lacks it: build .whl/site with bench/fetch_wheels.sh and carry .whl). The log
# names every test's outcome (-v), so a run cut by its timeout shows what ran.
# JAXKV_GPU_WORKERS sets the xdist worker count (default 8).
set -uo pipefail
out=${1:-/tmp/jaxkv-gpu}; ttest=${2:-540}
shift $(( $# < 2 ? $# : 2 ))
[ "${1:-}" = "--" ] && shift
mkdir -p "$out"
export PYTHONPATH=".:.whl/site" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L | tee "$out/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
par=()
if python3 -c "import xdist" 2>/dev/null; then par=(-n "${JAXKV_GPU_WORKERS:-8}" --dist worksteal); fi
# JAXKV_GPU_TESTS (space-separated files or node ids) runs a part of the list,
# e.g. to spread the whole list over two calls of a 600 s device limit.
all_tests="tests/test_pallas_kernels.py tests/test_mosaic_attention.py
  tests/test_layer_view.py tests/test_quant.py tests/test_unpack_asm.py
  tests/test_autotune.py tests/test_cache.py tests/test_model_cache.py tests/test_vq_attention.py
  tests/test_quantspec.py tests/test_chunked_prefill.py tests/test_mosaic_dequant.py tests/test_combine_t.py
  tests/test_mosaic_vq_attention.py tests/test_vq_model.py tests/test_sink_kernels.py tests/test_sink_tokens.py
  tests/test_triton_offsets.py tests/test_int4_matmul.py tests/test_mosaic_int4_matmul.py
  tests/test_speculative.py tests/test_range.py tests/test_sink_prefix.py tests/test_hlo_copies.py"
# shellcheck disable=SC2086  # the list is split on whitespace on purpose
JAXKV_TEST_GPU=1 timeout "$ttest" python3 -m pytest -v -p no:cacheprovider "${par[@]}" \
  --durations=10 ${JAXKV_GPU_TESTS:-$all_tests} 2>&1 \
  | tee "$out/gpu_tests.log" | grep -v "PASSED\|SKIPPED\|Warning\|warner" | tail -25
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$out/gpu_tests.log"
# Several GPUs: the sharded checks (tests/sharding_checks.py) on all of them.
ngpu=$(nvidia-smi -L | grep -c "^GPU")
if [ "$ngpu" -ge 2 ]; then
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  timeout 300 python3 tests/sharding_checks.py --devices $(( ngpu / 2 * 2 )) 2>&1 \
    | tee "$out/sharding_checks.log" | tail -12
fi
if [ $# -gt 0 ]; then "$@" 2>&1 | tee "$out/bench.log" | tail -40; fi
