"""Instruction mix of an Nsight Compute SASS page (``--page source --csv --print-source sass``).

Groups executed warp instructions and warp-stall samples by opcode (the first
word of the SASS line, predicates and modifiers stripped) and prints the top
rows; used to say where a kernel's instructions go
(`bench/results/attention-NOTES.md`). Usage::

  python3 bench/sass_mix.py kivi4-sass.csv.gz [--top 30] [--tokens N]

``--tokens``: token-heads the profiled call covered, to print instructions per
token-head. ``--loop``: also the main loop body (the most executed block) by
category: dequant, float, register moves, V byte gathers, smem, HMMA.
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


def _category(src: str) -> str:
  if "LDS.U8" in src:
    return "byte gathers (LDS.U8)"
  if src.startswith("PRMT") and ("0x5140" in src or "0x5342" in src):
    return "dequant"
  if src.startswith("PRMT"):
    return "other prmt (gather assembly)"
  if src.startswith(("LOP3", "HADD2.BF16", "HFMA2", "SHF", "HADD2 ")):
    return "dequant"
  if "MOV" in src:
    return "register moves"
  if src.startswith(("FMUL", "FADD", "FFMA", "FMNMX", "MUFU", "FSEL", "F2FP", "SHFL",
                     "FSETP", "HADD2.F32")):
    return "float"
  if src.startswith("HMMA"):
    return "HMMA"
  if src.startswith(("LDS", "LDSM", "STS", "STSM", "BAR")):
    return "smem / barriers"
  return "other"


def loop_mix(rows) -> None:
  """Category shares of the most executed block (the kernel's inner loop)."""
  counts = collections.Counter(int(r["Instructions Executed"] or 0) for r in rows)
  hot = max(n for n, c in counts.items() if c > 100)
  inst, stall = collections.Counter(), collections.Counter()
  for r in rows:
    if int(r["Instructions Executed"] or 0) == hot:
      src = r["Source"].strip()
      if src.startswith("@"):  # a predicate guard, e.g. "@!PT LDS ..."
        src = src.split(None, 1)[1] if " " in src else src
      cat = _category(src)
      inst[cat] += 1
      stall[cat] += int(r["Warp Stall Sampling (All Samples)"] or 0)
  n, ns = sum(inst.values()), max(1, sum(stall.values()))
  print(f"loop body: {n} instructions per warp per iteration")
  for cat, c in inst.most_common():
    print(f"  {cat:30s} {100 * c / n:5.1f} % inst  {100 * stall[cat] / ns:5.1f} % stall")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("path")
  ap.add_argument("--top", type=int, default=30)
  ap.add_argument("--tokens", type=float, default=0.0)
  ap.add_argument("--loop", action="store_true")
  args = ap.parse_args()
  inst, stall = collections.Counter(), collections.Counter()
  rows = _rows(args.path)
  for row in rows:
    op = _opcode(row["Source"])
    inst[op] += int(row["Instructions Executed"] or 0)
    stall[op] += int(row["Warp Stall Sampling (All Samples)"] or 0)
  total, total_stall = sum(inst.values()), max(1, sum(stall.values()))
  print(f"{total / 1e6:.2f} M warp instructions"
        + (f", {total / args.tokens:.1f} per token-head" if args.tokens else ""))
  print(f"{'opcode':10s} {'inst %':>7s} {'stall %':>8s}")
  for op, n in inst.most_common(args.top):
    print(f"{op:10s} {100 * n / total:7.1f} {100 * stall[op] / total_stall:8.1f}")
  if args.loop:
    loop_mix(rows)


if __name__ == "__main__":
  main()
