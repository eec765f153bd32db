export PYTHONPATH=".:$PWD/.whl/site" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
JAXKV_GPU_TESTS="tests/test_model_cache.py::test_decode_program_merges_gate_and_up_in_place" timeout 150 bash bench/gpu_tests.sh $OUT/t 140 2>&1 | grep -E "passed|failed|PASS|FAIL" | tail -5
timeout 150 python3 bench/dot_merger.py --rows 1,8,16,27,32,48,64,80,100,128,160,188 --out $OUT 2>&1 | tail -13
timeout 330 python3 bench/e2e.py --formats bf16,kivi2 --contexts '' --batch-context 32768 --prefill-lens '' --steps 8 --reps 3 --bandwidth-gib 2 --time-budget 320 --out $OUT 2>&1 | tail -8
