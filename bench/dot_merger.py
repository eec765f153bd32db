"""Gate and up projections as two GEMMs or one merged GEMM, by token rows.

XLA's dot merger (threshold ``xla_gpu_dot_merger_threshold_mb``) joins
``x @ w_gate`` and ``x @ w_up`` into one GEMM over the concatenated weight when
both weights are under the threshold. The decode programs raise it up to
`jaxkv.decoding.DOT_MERGER_MAX_ROWS` token rows per step
(`jaxkv.decode_compiler_options`); this is the benchmark behind that limit,
and the one to run at prefill sizes (thousands of rows), which the programs
that prefill inside them (`generate`) also compile with the merger. It times
the Llama MLP's first half, ``silu(x @ w_gate) * (x @ w_up)``, at
Llama-3.1-8B widths for several row counts ``M`` (batch x query tokens) with
the decode programs' two option sets, in one process. Each of the
``--calls`` back-to-back calls per timed program has its own weights, so XLA
cannot merge dots across calls; the compiled program is checked to hold one
GEMM fusion over the merged ``[D, 2F]`` weight per call with the merger and
none without. Usage
(GPU)::

  python bench/dot_merger.py --rows 1,16,32,64,128,192,256 --out $OUT
  python bench/dot_merger.py --rows 512,2048,4096,8192 --calls 2 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import hlo_copies  # noqa: E402

from jaxkv import decoding, timing  # noqa: E402
from jaxkv.cache import check_int  # noqa: E402

OPTIONS = {"two": decoding._options(False), "merged": decoding._options(True)}  # pylint: disable=protected-access


def gate_up(x, w_gate, w_up):
  """``silu(x @ w_gate) * (x @ w_up)``: x [M, D], w [D, F] -> [M, F]."""
  return jax.nn.silu(x @ w_gate) * (x @ w_up)


def _call(args):
  return gate_up(*args)


def merged_dots(options: dict, calls: list) -> int:
  """Fusion instructions of the compiled ``calls`` program (the timed one's
  body) whose computation holds a dot and names the merged ``[D, 2F]`` weight
  (split-K may reshape it before the dot itself)."""
  d, f = calls[0][1].shape
  program = jax.jit(lambda cs: [_call(c) for c in cs], compiler_options=options)
  text = program.lower(calls).compile().as_text()
  gemms = {c for c, in_gemm in hlo_copies.shape_lines(text, f"[{d},{2 * f}]") if in_gemm}
  return sum(1 for c in hlo_copies.fusion_calls(text) if c in gemms)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default="1,8,16,32,48,64,96,128,160,192,256")
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--intermediate", type=int, default=14336)
  p.add_argument("--calls", type=int, default=8, help="back-to-back calls per timed program")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--out", default="")
  a = p.parse_args(argv)
  rows = [int(r) for r in a.rows.split(",")]
  for m in rows:
    check_int("rows", m)
  scale = a.hidden ** -0.5

  def weight(i):  # [D, F]; every call has its own (no dots share an operand across calls)
    key = jax.random.fold_in(jax.random.PRNGKey(1), i)
    return (jax.random.normal(key, (a.hidden, a.intermediate)) * scale).astype(jnp.bfloat16)

  weights = [(weight(2 * i), weight(2 * i + 1)) for i in range(a.calls)]
  weight_bytes = 2 * a.hidden * a.intermediate * 2
  results = []
  for m in rows:
    xs = [jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(2), i),
                            (m, a.hidden)).astype(jnp.bfloat16) for i in range(a.calls)]
    calls = [(x, wg, wu) for x, (wg, wu) in zip(xs, weights)]
    row = dict(rows=m)
    for name, opts in OPTIONS.items():
      t = timing.device_time(_call, calls, reps=a.reps, compiler_options=opts)
      row[f"{name}_us"] = round(t["median"] * 1e6, 2)
      row[f"{name}_gbps"] = round(weight_bytes / t["median"] / 1e9, 1)
      row[f"{name}_compile_s"] = round(t["compile"], 2)
      row[f"{name}_merged_dots"] = merged_dots(opts, calls)
    row["merged_over_two"] = round(row["merged_us"] / row["two_us"], 4)
    results.append(row)
    print(json.dumps(row), flush=True)
  meta = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
              hidden=a.hidden, intermediate=a.intermediate, options=OPTIONS,
              calls=a.calls, reps=a.reps)
  print(f"{'rows':>5} {'two us':>9} {'merged us':>9} {'ratio':>7} merged dots (two / merged)")
  for r in results:
    print(f"{r['rows']:>5} {r['two_us']:>9.1f} {r['merged_us']:>9.1f} "
          f"{r['merged_over_two']:>7.3f} {r['two_merged_dots']} / {r['merged_merged_dots']}")
  if a.out:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "dot_merger.json"), "w") as f:
      json.dump(dict(meta=meta, results=results), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
