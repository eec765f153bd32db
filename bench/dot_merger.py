"""Gate and up projections as two GEMMs or one merged GEMM, by token rows.

XLA's dot merger (threshold ``xla_gpu_dot_merger_threshold_mb``) joins
``x @ w_gate`` and ``x @ w_up`` into one GEMM over the concatenated weight when
both weights are under the threshold. The decode programs raise it
(`jaxkv.decode_compiler_options`, up to a row limit); this times the Llama MLP's first half,
``silu(x @ w_gate) * (x @ w_up)``, at Llama-3.1-8B widths for several row
counts ``M`` (batch x query tokens) both ways, in one process, and reports
whether the compiled program really holds the merged dot. Each of the
``--calls`` back-to-back calls per timed program has its own weights, so XLA
cannot merge dots across calls. Usage (GPU)::

  python bench/dot_merger.py --rows 1,16,32,64,128,192,256 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxkv import timing  # noqa: E402
from jaxkv.cache import check_int  # noqa: E402

_BASE = {"xla_disable_hlo_passes": "rematerialization"}


def gate_up(x, w_gate, w_up):
  """``silu(x @ w_gate) * (x @ w_up)``: x [M, D], w [D, F] -> [M, F]."""
  return jax.nn.silu(x @ w_gate) * (x @ w_up)


def _call(args):
  return gate_up(*args)


def merged_in_hlo(options: dict, x, w_gate, w_up) -> bool:
  """Whether the compiled program holds a dot over ``[D, 2F]`` (the merged weight)."""
  d, f = w_gate.shape
  text = jax.jit(gate_up, compiler_options=options).lower(x, w_gate, w_up).compile().as_text()
  return f"[{d},{2 * f}]" in text


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default="1,8,16,32,48,64,96,128,160,192,256")
  p.add_argument("--hidden", type=int, default=4096)
  p.add_argument("--intermediate", type=int, default=14336)
  p.add_argument("--threshold-mb", type=int, default=1024)
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
  merged_opts = {**_BASE, "xla_gpu_dot_merger_threshold_mb": a.threshold_mb}
  weight_bytes = 2 * a.hidden * a.intermediate * 2
  results = []
  for m in rows:
    xs = [jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(2), i),
                            (m, a.hidden)).astype(jnp.bfloat16) for i in range(a.calls)]
    calls = [(x, wg, wu) for x, (wg, wu) in zip(xs, weights)]
    row = dict(rows=m)
    for name, opts in (("two", _BASE), ("merged", merged_opts)):
      t = timing.device_time(_call, calls, reps=a.reps, compiler_options=opts)
      row[f"{name}_us"] = round(t["median"] * 1e6, 2)
      row[f"{name}_gbps"] = round(weight_bytes / t["median"] / 1e9, 1)
    row["merged_in_hlo"] = merged_in_hlo(merged_opts, *calls[0])
    row["merged_over_two"] = round(row["merged_us"] / row["two_us"], 4)
    results.append(row)
    print(json.dumps(row), flush=True)
  meta = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
              hidden=a.hidden, intermediate=a.intermediate, threshold_mb=a.threshold_mb,
              calls=a.calls, reps=a.reps)
  print(f"{'rows':>5} {'two us':>9} {'merged us':>9} {'ratio':>7} merged-in-hlo")
  for r in results:
    print(f"{r['rows']:>5} {r['two_us']:>9.1f} {r['merged_us']:>9.1f} "
          f"{r['merged_over_two']:>7.3f} {r['merged_in_hlo']}")
  if a.out:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "dot_merger.json"), "w") as f:
      json.dump(dict(meta=meta, results=results), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
