"""Instruction mix of an Nsight Compute SASS page (``--page source --csv --print-source sass``).

Groups executed warp instructions and warp-stall samples by opcode (the first
word of the SASS line, predicates and modifiers stripped) and prints the top
rows; used to say where a kernel's instructions go
(`bench/results/attention-NOTES.md`). Usage::

  python3 bench/sass_mix.py kivi4-sass.csv.gz [--top 30] [--tokens N]

``--tokens``: token-heads the profiled call covered, to print instructions per
token-head.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip


def _rows(path):
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as f:
    lines = f.read().splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
  return list(csv.DictReader(lines[start:]))


def _opcode(source: str) -> str:
  words = source.strip().split()
  if words and words[0].startswith("@"):
    words = words[1:]
  return words[0].split(".")[0] if words else "?"


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("path")
  ap.add_argument("--top", type=int, default=30)
  ap.add_argument("--tokens", type=float, default=0.0)
  args = ap.parse_args()
  inst, stall = collections.Counter(), collections.Counter()
  for row in _rows(args.path):
    op = _opcode(row["Source"])
    inst[op] += int(row["Instructions Executed"] or 0)
    stall[op] += int(row["Warp Stall Sampling (All Samples)"] or 0)
  total, total_stall = sum(inst.values()), max(1, sum(stall.values()))
  print(f"{total / 1e6:.2f} M warp instructions"
        + (f", {total / args.tokens:.1f} per token-head" if args.tokens else ""))
  print(f"{'opcode':10s} {'inst %':>7s} {'stall %':>8s}")
  for op, n in inst.most_common(args.top):
    print(f"{op:10s} {100 * n / total:7.1f} {100 * stall[op] / total_stall:8.1f}")


if __name__ == "__main__":
  main()
