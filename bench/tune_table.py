"""Tune the split decode-attention kernel per shape class; write the shipped table.

For each format and shape, starts from the heuristic config
(`DecodeAttentionConfig.default`) and walks greedily over its neighbours
(`jaxkv.tuning.greedy_search`: splits x1/2 and x2, every other block_k,
num_stages 2/3/4, the other warp count, defer_sums and residual_program
flipped), moving to the fastest until no neighbour is faster, timing each
candidate by profiler kernel time
(split kernel + combine, `jaxkv.timing.kernel_time`, rotating cache copies
larger than L2) in one process. A candidate whose output differs from the
heuristic's by more than float32 reassociation could explain is rejected.
The winner goes into the table (`pallas_kernels/tuned_configs.json`, keyed by
GPU name and `dequant_attention.tuned_key`) only when it beats the heuristic by
``--margin``; every timing goes to ``--out``. VQ formats (``cq4``, ``cq2``:
the VQ kernel's `VQAttentionConfig`, block_k / warps / stages / splits) are
searched the same way and recorded, with no table entry.

Example (GPU machine)::

  python bench/tune_table.py --formats kivi4,kivi2,bf16 \\
      --shapes '1,32768,32,8,128,1;8,32768,32,8,128,1' --out $OUT/tune.json \\
      --table $OUT/tuned_configs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attention as A  # noqa: E402
import pallas_kernels as pk  # noqa: E402
from jaxkv import timing  # noqa: E402
from jaxkv import tuning  # noqa: E402
from jaxkv.formats import PRESETS  # noqa: E402
from pallas_kernels import dequant_attention as da  # noqa: E402
from pallas_kernels import tuned  # noqa: E402
from pallas_kernels.vq_attention import VQAttentionConfig  # noqa: E402
import jaxkv  # noqa: E402
from jaxkv import vq_attention as vqa  # noqa: E402

DEFAULT_SHAPES = ";".join([
    "1,32768,32,8,128,1", "1,131072,32,8,128,1", "8,32768,32,8,128,1",
    "16,32768,32,8,128,1", "48,32768,32,8,128,1", "80,32768,32,8,128,1"])
MAX_REL_ERR = 2e-2  # bf16 outputs of two reassociated float32 sums


def tune_cell(name, shape, calls, max_evals, log):
  """Greedy search for one format and shape; returns the cell's record."""
  b, t, hq, hkv, d, s = shape
  view = name.split(":")[1] if ":" in name else "target"
  q = jax.random.normal(jax.random.PRNGKey(0), (b, s, hq, d), jnp.bfloat16)
  vq = name in jaxkv.VQ_PRESETS
  if ":" in name or vq:
    cache = A.filled_cache(name, jax.random.PRNGKey(4), b, t, hkv, d)
    fmt, capacity = cache.fmt, cache.storage_len
    arrays = (q, cache)

    def call(q, cache, *, config):
      if vq:
        return vqa.vq_decode_attention(q, cache, implementation="triton", config=config)
      return pk.pallas_decode_attention(q, cache, config=config, view=view)
    moved = A.nbytes(*jax.tree.leaves(cache))
  else:
    fmt = PRESETS[name]
    data = A.random_packed(jax.random.PRNGKey(3), fmt, b, t, hkv, d)
    capacity = t
    arrays = (q, data.arrays, data.lengths)

    def call(q, arrays, lengths, *, config):
      return A.jaxkv_call(q, arrays, lengths, fmt=fmt, config=config)
    moved = A.nbytes(*jax.tree.leaves(data.arrays))
  copies = A.rotating_copies(arrays, moved)
  if vq:  # no shipped table for the VQ kernel: its results are recorded only
    heuristic = VQAttentionConfig.default(batch=b, tokens=capacity, kv_heads=hkv)
  else:
    heuristic, _ = da.default_config(
        fmt, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, num_queries=s, capacity=capacity,
        itemsize=2, view=view, use_table=False)
  timed, ref = {}, None

  def measure(config):
    nonlocal ref
    fn = functools.partial(call, config=config)
    try:
      out = jax.jit(fn)(*arrays)
      ref = out if ref is None else ref
      err = A.rel_err(out, ref)
      if err > MAX_REL_ERR:
        raise ValueError(f"output differs from the heuristic's: rel err {err:.2e}")
      us = timing.kernel_time(fn, copies, calls=calls)["kernel"] * 1e6
    except Exception as e:  # noqa: BLE001 - a config the compiler rejects is skipped
      timed[config] = dict(us=float("inf"), error=f"{type(e).__name__}: {str(e)[:200]}")
      log(f"    {config}: FAILED {timed[config]['error']}")
      return float("inf")
    timed[config] = dict(us=us, rel_err=err)
    return us

  best, best_us, _ = tuning.greedy_search(measure, heuristic, capacity, max_evals=max_evals)
  heuristic_us = timed[heuristic]["us"]
  key = None if vq else da.tuned_key(fmt, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d,
                                    num_queries=s, capacity=capacity, itemsize=2, view=view)
  log(f"  {name:16s} {A.shape_id(shape):28s} heuristic {heuristic_us:8.1f} us  best "
      f"{best_us:8.1f} us ({heuristic_us / best_us:5.3f}x, {len(timed)} tried)")
  return dict(format=name, shape=A.shape_id(shape), key=key, heuristic=dataclasses.asdict(heuristic),
              heuristic_us=heuristic_us, best=dataclasses.asdict(best), best_us=best_us,
              speedup=heuristic_us / best_us, best_config=best,
              tried=[dict(config=dataclasses.asdict(c), **r) for c, r in timed.items()])


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--formats", default="kivi4,kivi2,bf16")
  p.add_argument("--shapes", default=DEFAULT_SHAPES, help="'B,T,Hq,Hkv,D,S;...'")
  p.add_argument("--calls", type=int, default=8)
  p.add_argument("--max-evals", type=int, default=16, help="candidates timed per cell")
  p.add_argument("--margin", type=float, default=0.03,
                 help="table entries only for wins over the heuristic by this fraction")
  p.add_argument("--table", default=tuned.TABLE_PATH, help="table JSON to merge the winners into")
  p.add_argument("--out", default=None, help="JSON of every timing")
  p.add_argument("--time-budget", type=float, default=520.0,
                 help="seconds; no new cell starts after this")
  args = p.parse_args(argv)
  started = time.perf_counter()
  device = jax.devices()[0].device_kind

  def log(msg):
    print(msg, flush=True)

  shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";") if s]
  cells, skipped = [], []
  for shape in shapes:
    for name in args.formats.split(","):
      if time.perf_counter() - started > args.time_budget:
        skipped.append(f"{name} {A.shape_id(shape)}")
        continue
      cells.append(tune_cell(name, shape, args.calls, args.max_evals, log))
  table = json.loads(json.dumps(tuned.load_table(args.table)))  # a copy, not the cached dict
  written = 0
  for cell in cells:
    if cell["key"] is not None and cell["speedup"] >= 1 + args.margin:
      tuned.store(table, device, cell["key"], cell["best_config"], us=cell["best_us"],
                  heuristic_us=cell["heuristic_us"], shape=cell["shape"])
      written += 1
  with open(args.table, "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)
    f.write("\n")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(device=device, jax_version=jax.__version__, margin=args.margin,
                     calls=args.calls, metric="profiler kernel time per call (split + combine)",
                     cells=[{k: v for k, v in c.items() if k != "best_config"} for c in cells],
                     skipped=skipped), f, indent=1)
  log(f"\n{device}, jax {jax.__version__}: {written} of {len(cells)} cells beat the heuristic "
      f"by >= {args.margin:.0%} (table {args.table}); skipped {len(skipped)}")
  log(f"{'format':16s} {'shape':28s} {'heur us':>8s} {'best us':>8s} {'x':>6s}  best")
  for c in cells:
    b = c["best"]
    flags = (f" defer{int(b['defer_sums'])} rp{int(b['residual_program'])}"
             if "defer_sums" in b else "")
    log(f"{c['format']:16s} {c['shape']:28s} {c['heuristic_us']:8.1f} {c['best_us']:8.1f} "
        f"{c['speedup']:6.3f}  bk{b['block_k']} sp{b['num_splits']} w{b['num_warps']} "
        f"st{b['num_stages']}{flags}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
