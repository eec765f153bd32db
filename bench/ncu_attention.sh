#!/usr/bin/env bash
# Nsight Compute report of the split kernel per format at shape 4 (1, 131072, 32, 8, 128): details, raw metrics and SASS with per-instruction counters, as CSV under $1 (default $OUT).
# KERNEL=jaxkv_mosaic EXTRA=--mosaic profiles the Mosaic GPU kernel instead.
OUT=${1:-$OUT}; FORMATS=${FORMATS:-kivi4 int8}; KERNEL=${KERNEL:-jaxkv_dequant_attention}
set -x
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
echo NCU=$NCU
for f in $FORMATS; do
  $NCU --clock-control none --kernel-name regex:$KERNEL --launch-skip 3 --launch-count 1 --set full --import-source no -o $OUT/$f python3 bench/ncu_attention.py --format $f --shape 4 ${EXTRA:-} > $OUT/$f-ncu.log 2>&1; tail -3 $OUT/$f-ncu.log
  $NCU -i $OUT/$f.ncu-rep --page source --csv --print-source sass > $OUT/$f-sass.csv 2>&1
  $NCU -i $OUT/$f.ncu-rep --page details --csv > $OUT/$f-details.csv 2>&1
  $NCU -i $OUT/$f.ncu-rep --page raw --csv > $OUT/$f-raw.csv 2>&1
  wc -l $OUT/$f-*.csv; gzip $OUT/$f-sass.csv $OUT/$f-raw.csv; rm -f $OUT/$f.ncu-rep
done
grep -i "duration\|DRAM Throughput\|Registers Per\|Achieved Occupancy\|Executed Ipc A\|Issue Slots Busy\|Theoretical Occ\|Block Limit Reg\|Shared Memory Config\|Dynamic Shared" $OUT/kivi4-details.csv | head -30
