#!/usr/bin/env bash
# One GPU call for Mosaic kernel work (bench/results/mosaic-NOTES.md): the
# Mosaic tests compiled, an A/B of Mosaic variants against the Triton default
# and cuDNN (bench/ab_attention.py), then Nsight Compute details of the
# default Mosaic kernel (registers, occupancy, issue slots, stalls).
# Usage (GPU machine, repo root): bash bench/mosaic_probe.sh OUTDIR SHAPES FORMATS 'VARIANTS'
set -uo pipefail
out=$1; shapes=${2:-2,4}; formats=${3:-kivi4,kivi2,int8,k8v4}; variants=${4:-v2:tokens_m=True}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L
timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_mosaic_attention.py 2>&1 \
  | tee "$out/tests.log" | grep -v Warning | tail -8
timeout 330 python3 bench/ab_attention.py --shapes "$shapes" --formats "$formats" --variants '' \
  --mosaic "$variants" --out "$out/ab.json" 2>&1 | tee "$out/ab.log"
if [ -n "${NCU_FORMATS:-}" ]; then
  FORMATS=$NCU_FORMATS KERNEL=jaxkv_mosaic EXTRA=--mosaic timeout 240 bash bench/ncu_attention.sh "$out" \
    > "$out/ncu.log" 2>&1
  for f in $NCU_FORMATS; do
    grep -i "duration\|DRAM Throughput\|Registers Per\|Achieved Occupancy\|Executed Ipc A\|Issue Slots Busy\|Theoretical Occ\|Block Limit\|Dynamic Shared\|Warp Cycles Per Issued" \
      "$out/$f-details.csv" | cut -c1-200 | head -24
  done
fi
