"""Decode-step weight products at Llama-3.1-8B shapes: XLA's GEMM against the
Pallas GEMV (`bench/gemv_kernel.py`) over a config sweep, and XLA under
``XLA_FLAGS`` variants (each in its own process).

Each product is timed by `jaxkv.timing.kernel_time` (profiler kernel time)
over weight copies larger than L2 together. Prints a table; ``--out DIR``
writes the rows as JSON. Usage (GPU machine)::

  python bench/gemv_probe.py --out $OUT            # XLA + Pallas sweep
  python bench/gemv_probe.py --flag-variants --out $OUT
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxkv import timing  # noqa: E402
from models import llama  # noqa: E402
import gemv_kernel as G  # noqa: E402

SHAPES = [(4096, 6144), (4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096),
          (4096, 28672)]
FLAG_VARIANTS = ["", "--xla_gpu_exhaustive_tiling_search=true",
                 "--xla_gpu_enable_triton_gemm=false", "--xla_gpu_autotune_level=0",
                 "--xla_gpu_enable_split_k_autotuning=false"]
L2_BYTES = 60 << 20


def _copies(n_in, n_out, seed=0):
  count = max(3, -(-3 * L2_BYTES // (2 * n_in * n_out)))
  keys = jax.random.split(jax.random.PRNGKey(seed), count)
  return [jax.random.normal(k, (n_in, n_out), jnp.bfloat16) for k in keys]


def _time(fn, x, ws, calls):
  r = timing.kernel_time(fn, [(x, w) for w in ws], calls=calls)
  main = max(r["by_name"].values()) if r["by_name"] else r["kernel"]
  return dict(kernel_us=r["kernel"] * 1e6, span_us=r["span"] * 1e6, main_us=main * 1e6,
              kernels=r["kernels"])


def _configs(n_in, n_out, num_sms):
  base = G.GemvConfig.default(n_in=n_in, n_out=n_out, num_sms=num_sms)
  seen = set()
  for bn, bk, sf, (warps, stages) in itertools.product(
      (64, 128, 256), (128, 256), (0.5, 1, 2), ((4, 4), (4, 3), (8, 4), (4, 6))):
    if (warps, stages) != (4, 4) and (bn, bk, sf) != (128, 128, 1):
      continue
    if n_out % bn or n_in % bk:
      continue
    steps = n_in // bk
    want = max(1, int(round(base.num_splits * sf * 128 / bn)))
    splits = max(d for d in range(1, steps + 1) if steps % d == 0 and d <= want)
    cfg = G.GemvConfig(block_n=bn, block_k=bk, num_splits=splits, num_warps=warps,
                       num_stages=stages)
    if cfg not in seen:
      seen.add(cfg)
      yield cfg


def run(args):
  gpu = jax.devices()[0].device_kind
  num_sms = getattr(jax.devices()[0], "core_count", None) or 132
  flags = os.environ.get("XLA_FLAGS", "")
  rows_out = []
  for (n_in, n_out), rows in itertools.product(SHAPES, [int(r) for r in args.rows.split(",")]):
    ws = _copies(n_in, n_out)
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, n_in), jnp.bfloat16)
    floor_us = 2 * n_in * n_out / args.bandwidth * 1e6
    ref = np.asarray(jax.jit(llama.linear)(x, ws[0]), np.float32)
    base = dict(gpu=gpu, jax_version=jax.__version__, xla_flags=flags, n_in=n_in, n_out=n_out,
                rows=rows, floor_us=floor_us)
    rows_out.append(dict(base, impl="xla", **_time(llama.linear, x, ws, args.calls)))
    print(json.dumps(rows_out[-1]), flush=True)
    if args.xla_only:
      continue
    for cfg in _configs(n_in, n_out, num_sms):
      fn = lambda x, w, cfg=cfg: G.gemv(x, w, config=cfg)  # noqa: E731
      try:
        got = np.asarray(jax.jit(fn)(x, ws[0]), np.float32)
        err = float(np.abs(got - ref).max() / (np.abs(ref).max() + 1e-9))
        t = _time(fn, x, ws, args.calls)
      except Exception as e:  # pylint: disable=broad-except
        print(f"# {n_in}x{n_out} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        continue
      rows_out.append(dict(base, impl="pallas", config=str(cfg), rel_err=err, **t))
      print(json.dumps(rows_out[-1]), flush=True)
    del ws
  return rows_out


def table(rows):
  lines = ["| in x out | rows | floor | XLA kernel (main) | best Pallas kernel (main) | config |",
           "|---|---|---|---|---|---|"]
  keys = sorted({(r["n_in"], r["n_out"], r["rows"]) for r in rows})
  for k in keys:
    xs = [r for r in rows if (r["n_in"], r["n_out"], r["rows"]) == k]
    xla = next((r for r in xs if r["impl"] == "xla"), None)
    pal = min((r for r in xs if r["impl"] == "pallas"), key=lambda r: r["kernel_us"], default=None)
    lines.append(f"| {k[0]}x{k[1]} | {k[2]} | {xs[0]['floor_us']:.1f} | "
                 + (f"{xla['kernel_us']:.1f} ({xla['main_us']:.1f})" if xla else "-") + " | "
                 + (f"{pal['kernel_us']:.1f} ({pal['main_us']:.1f}) err {pal['rel_err']:.1e}"
                    if pal else "-") + " | " + (pal["config"] if pal else "") + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default="1")
  p.add_argument("--calls", type=int, default=30)
  p.add_argument("--bandwidth", type=float, default=0.0,
                 help="bytes/s for the floor (default: timing.hbm_read_probe)")
  p.add_argument("--xla-only", action="store_true")
  p.add_argument("--flag-variants", action="store_true",
                 help="run XLA only under each of FLAG_VARIANTS, one process each")
  p.add_argument("--out", default="")
  a = p.parse_args(argv)
  if not a.bandwidth:
    a.bandwidth = timing.hbm_read_probe(1 << 30)["best"]
    print(f"# HBM read probe {a.bandwidth / 1e9:.0f} GB/s", flush=True)
  if a.flag_variants:
    rows = []
    for flags in FLAG_VARIANTS:
      env = dict(os.environ, XLA_FLAGS=flags)
      cmd = [sys.executable, os.path.abspath(__file__), "--xla-only", "--rows", a.rows,
             "--calls", str(a.calls), "--bandwidth", str(a.bandwidth)]
      res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
      got = [json.loads(l) for l in res.stdout.splitlines() if l.startswith("{")]
      if res.returncode:
        print(f"# {flags!r}: rc {res.returncode} {res.stderr[-400:]}")
      rows += got
      for r in got:
        print(f"{flags or 'default':45s} {r['n_in']}x{r['n_out']} rows {r['rows']}: "
              f"{r['kernel_us']:.1f} us (main {r['main_us']:.1f}, floor {r['floor_us']:.1f})",
              flush=True)
  else:
    rows = run(a)
    print(table(rows))
  if a.out:
    os.makedirs(a.out, exist_ok=True)
    name = "gemv-flags" if a.flag_variants else "gemv-probe"
    with open(os.path.join(a.out, f"{name}.json"), "w", encoding="utf-8") as f:
      json.dump(dict(bandwidth=a.bandwidth, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
