"""Does ``defer_sums`` pay at many query rows? Triton kernel time with it on and off.

The tuned table's first entries for QuantSpec's verify pass (20 query rows per
kv head: gamma 4 + 1 tokens x GQA 4) found ``defer_sums=False`` alone 1.28-1.31x
faster than the heuristic on an H200 (`bench/results/tune-quantspec-target-20261128l-*`):
its ``[rows, block_k]`` float32 accumulators grow with the rows. This probe
times both settings (profiler kernel time, rotating copies over L2, outputs
compared) for a few formats and row counts. Its H200 run
(`bench/results/defer-sums-20261128{,b}-nvidia-h200.json`) led to the
heuristic's rule (`DecodeAttentionConfig.default`): off above 16 rows.

Usage (GPU machine): ``python3 bench/defer_sums_probe.py ['fmt:B,T,Hq,Hkv,D,S;...']`` (writes
``$OUT/defer.json``; without the argument, the cells in ``CELLS``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import attention as A  # noqa: E402
from jaxkv import timing  # noqa: E402
from jaxkv.formats import PRESETS  # noqa: E402
from pallas_kernels import dequant_attention as da  # noqa: E402
CELLS = [("quantspec", (1, 131072, 32, 8, 128, 5)), ("kivi4", (1, 131072, 32, 8, 128, 5)),
         ("kivi2", (1, 131072, 32, 8, 128, 5)), ("int8", (1, 131072, 32, 8, 128, 5)),
         ("kivi4", (1, 32768, 64, 8, 128, 4)), ("kivi4", (8, 32768, 32, 8, 128, 5)),
         ("kivi4", (1, 131072, 32, 8, 128, 2))]


def measure(name, shape) -> dict:
  """Kernel us of the heuristic config with ``defer_sums`` on and off at one shape."""
  b, t, hq, hkv, d, s = shape
  fmt = PRESETS[name]
  q = jax.random.normal(jax.random.PRNGKey(0), (b, s, hq, d), jnp.bfloat16)
  data = A.random_packed(jax.random.PRNGKey(3), fmt, b, t, hkv, d)
  arrays = (q, data.arrays, data.lengths)
  copies = A.rotating_copies(arrays, A.nbytes(*jax.tree.leaves(data.arrays)))
  h, _ = da.default_config(fmt, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, num_queries=s,
                           capacity=t, itemsize=2, use_table=False)
  row = dict(fmt=name, shape=list(shape), heuristic=dataclasses.asdict(h))
  ref = None
  for tag, cfg in (("defer", dataclasses.replace(h, defer_sums=True)),
                   ("nodefer", dataclasses.replace(h, defer_sums=False))):
    fn = functools.partial(A.jaxkv_call, fmt=fmt, config=cfg)
    o = jax.jit(fn)(*arrays)
    ref = o if ref is None else ref
    row[tag + "_us"] = timing.kernel_time(fn, copies, calls=8)["kernel"] * 1e6
    row[tag + "_err"] = float(A.rel_err(o, ref))
  return row


def parse_cells(text: str) -> list:
  """``"kivi4:1,131072,32,8,128,3;int8:..."`` -> ``[(fmt, (B, T, Hq, Hkv, D, S)), ...]``."""
  cells = []
  for item in filter(None, text.split(";")):
    name, _, dims = item.partition(":")
    parts = dims.split(",")
    if name not in PRESETS or len(parts) != 6 or not all(p.strip().isdigit() for p in parts):
      raise ValueError(f"bad cell {item!r}: want 'fmt:B,T,Hq,Hkv,D,S' (six ints) with fmt in "
                       f"{sorted(PRESETS)}")
    cells.append((name, tuple(int(x) for x in dims.split(","))))
  return cells


def main() -> int:
  out, t0 = [], time.time()
  cells = parse_cells(sys.argv[1]) if len(sys.argv) > 1 else CELLS
  for name, shape in cells:
    if time.time() - t0 > 110:
      break
    row = measure(name, shape)
    out.append(row)
    print(f"{name:10s} {str(tuple(shape)):32s} defer {row['defer_us']:7.1f} nodefer "
          f"{row['nodefer_us']:7.1f} err {row['nodefer_err']:.1e}", flush=True)
  with open(os.path.join(os.environ.get("OUT", "/tmp"), "defer.json"), "w") as f:
    json.dump(dict(gpu=jax.devices()[0].device_kind, jax=jax.__version__, rows=out), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
