"""Warp stall reasons and launch limits from an Nsight Compute raw CSV.

Reads the ``*-raw.csv.gz`` that `bench/ncu_attention.sh` writes (one kernel)
and prints the sampled warp stall reasons as shares of all samples, then the
launch figures that decide occupancy (registers per thread, shared memory
per block, the per-resource block limits, achieved active warps).

Usage: python bench/ncu_stalls.py OUT/kivi4-raw.csv.gz [--top 12]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import sys

_LAUNCH = ("launch__registers_per_thread", "launch__shared_mem_per_block",
           "launch__occupancy_limit", "sm__warps_active.avg.pct")


def read(path: str) -> dict[str, str]:
  """``{metric: value}`` of the first kernel row of an ncu raw CSV (plain or gzip)."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    rows = list(csv.reader(f))
  if len(rows) < 3:
    raise ValueError(f"{path}: expected a header, a units row and a kernel row")
  return dict(zip(rows[0], rows[2]))


def stalls(metrics: dict[str, str]) -> dict[str, float]:
  """Sampled stall reasons -> share of all samples (``pcsamp_warps_issue_stalled_*``)."""
  out = {}
  for name, value in metrics.items():
    if "pcsamp_warps_issue_stalled_" in name and not name.endswith("not_issued"):
      try:
        out[name.split("stalled_")[-1]] = float(value.replace(",", ""))
      except ValueError:
        continue
  total = sum(out.values()) or 1.0
  return {k: v / total for k, v in out.items()}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("raw_csv")
  ap.add_argument("--top", type=int, default=12)
  a = ap.parse_args(argv)
  metrics = read(a.raw_csv)
  for reason, share in sorted(stalls(metrics).items(), key=lambda x: -x[1])[:a.top]:
    print(f"{reason:36s} {100 * share:5.1f} %")
  for name, value in metrics.items():
    if name.startswith(_LAUNCH):
      print(f"{name:52s} {value}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
