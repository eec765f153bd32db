"""GPU: time the split-K kernel over a grid of configs (no baselines).

A development tool for choosing `DecodeAttentionConfig.default`: for each
(shape, format) it prints the fastest configs and their error against the jnp
reference. The benchmark that reports speedups is bench/attention.py.

Usage: python bench/sweep_configs.py --shapes 4,5 --formats kivi4,int8 [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attention as A  # noqa: E402  (bench/attention.py)
from jaxkv.autotune import device_time  # noqa: E402
from jaxkv.formats import PRESETS  # noqa: E402
import pallas_kernels as pk  # noqa: E402


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="4,5")
  ap.add_argument("--formats", default="kivi4,int8")
  ap.add_argument("--block_k", default="32,64,128")
  ap.add_argument("--warps", default="4,8")
  ap.add_argument("--stages", default="2,3")
  ap.add_argument("--defer", default="0,1")
  ap.add_argument("--split_mult", default="0.5,1,2")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  results = []
  for si in args.shapes.split(","):
    b, t, hq, hkv, d, s = A.SHAPES[int(si)]
    q = [jax.random.normal(jax.random.PRNGKey(i), (b, s, hq, d), jnp.bfloat16) for i in range(A.UNROLL)]
    for name in args.formats.split(","):
      fmt = PRESETS[name]
      data = A.random_packed(jax.random.PRNGKey(1), fmt, b, t, hkv, d)
      ref = jax.jit(functools.partial(pk.dequant_decode_attention_reference, fmt=fmt))(
          q[0], *data.arrays, data.lengths)
      base = pk.DecodeAttentionConfig.default(
          batch=b, tokens=t, q_heads=hq, kv_heads=hkv, head_dim=d, k_bits=fmt.k_bits,
          v_bits=fmt.v_bits, token_group=fmt.token_group, k_axis=fmt.k_axis)
      rows = []
      for bk, nw, ns, df, sm in itertools.product(
          *[[int(x) for x in getattr(args, k).split(",")] for k in ("block_k", "warps", "stages", "defer")],
          [float(x) for x in args.split_mult.split(",")]):
        cfg = pk.DecodeAttentionConfig(block_k=bk, num_splits=max(1, int(base.num_splits * sm)),
                                       num_warps=nw, num_stages=ns, defer_sums=bool(df))
        fn = functools.partial(A.jaxkv_call, fmt=fmt, config=cfg)
        try:
          out = jax.jit(fn)(q[0], data.arrays, data.lengths)
          tm = device_time(fn, q, data.arrays, data.lengths, reps=A.REPS)
        except Exception as e:  # noqa: BLE001
          print(f"  {name} {cfg} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
          continue
        rows.append({"config": dataclasses.asdict(cfg), "time_us": tm["median"] * 1e6,
                     "rel_err": A.rel_err(out, ref)})
      rows.sort(key=lambda r: r["time_us"])
      results.append({"shape": A.SHAPES[int(si)], "format": name, "rows": rows})
      print(f"{A.shape_id(A.SHAPES[int(si)])} {name}: default {base}", flush=True)
      for r in rows[:6]:
        c = r["config"]
        print(f"   {r['time_us']:8.1f} us  bk={c['block_k']:3d} sp={c['num_splits']:3d} "
              f"nw={c['num_warps']} ns={c['num_stages']} defer={int(c['defer_sums'])} "
              f"err={r['rel_err']:.1e}", flush=True)
  if args.out:
    with open(os.path.join(args.out, "sweep_configs.json"), "w") as f:
      json.dump({"gpu": jax.devices()[0].device_kind, "jax_version": jax.__version__,
                 "results": results}, f, indent=1)


if __name__ == "__main__":
  main()
