"""GPU probe: per-kernel device time from the profiler (CUPTI), no host in the figure.

For a few benchmark shapes it traces jaxkv's attention (default config, each
format), the BF16 baselines and the residual flush, then reads the trace with
`jax.profiler.ProfileData` and prints, per call, every GPU kernel's mean
duration and the sum. This is the per-kernel view of `kernel_time` and the
breakdown the note uses (split kernel vs combine vs XLA glue).

Usage: python bench/profile_kernels.py OUTDIR [SHAPE_INDICES] [FORMATS]
"""

from __future__ import annotations

import collections
import functools
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attention as A  # noqa: E402
from jaxkv.formats import PRESETS  # noqa: E402
import pallas_kernels as pk  # noqa: E402

from jaxkv import timing  # noqa: E402

CALLS = 20


def kernel_times(fn, args, tmp, calls=CALLS):
  """{kernel name: (mean us per call, kernels per call)} from a profiler trace.

  The calls rotate over enough copies of ``args`` (as the benchmark does)
  that none is served from L2.
  """
  f = jax.jit(fn)
  copies = A.rotating_copies(args, A.nbytes(*jax.tree.leaves(args)))
  for c in copies:
    jax.block_until_ready(f(*c))
  shutil.rmtree(tmp, ignore_errors=True)
  jax.profiler.start_trace(tmp)
  for i in range(calls):
    out = f(*copies[i % len(copies)])
  jax.block_until_ready(out)
  jax.profiler.stop_trace()
  per = collections.defaultdict(float)
  counts = collections.Counter()
  for name, _, duration_ns in timing.gpu_kernel_events(tmp):
    per[name] += duration_ns / 1e3 / calls
    counts[name] += 1
  return {k: (v, counts[k] / calls) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def show(label, times, log):
  total = sum(v for v, _ in times.values())
  log(f"{label:40s} total {total:8.2f} us/call  ({sum(c for _, c in times.values()):.0f} kernels)")
  for name, (us, cnt) in list(times.items())[:6]:
    log(f"    {us:8.2f} us  x{cnt:.0f}  {name[:90]}")
  return {"total_us": total, "kernels": {k: {"us": v, "per_call": c} for k, (v, c) in times.items()}}


def run(label, fn, args, tmp, log):
  try:
    return show(label, kernel_times(fn, args, tmp), log)
  except Exception as e:  # noqa: BLE001 - a baseline that does not run here is logged
    log(f"{label:40s} FAILED {type(e).__name__}: {str(e)[:200]}")
    return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def main():
  out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/jaxkv-prof"
  shapes = [A.SHAPES[int(i)] for i in (sys.argv[2] if len(sys.argv) > 2 else "4,2,5").split(",")]
  formats = (sys.argv[3] if len(sys.argv) > 3 else "kivi4,int8,kivi2").split(",")
  os.makedirs(out, exist_ok=True)
  tmp = os.path.join(out, "trace")
  lines = []

  def log(s):
    print(s, flush=True)
    lines.append(s)

  res = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "shapes": {}, "flush": {}}
  for shape in shapes:
    b, t, hq, hkv, d, s = shape
    sid = A.shape_id(shape)
    log(f"== {sid}")
    q = jax.random.normal(jax.random.PRNGKey(0), (b, s, hq, d), jnp.bfloat16)
    lengths = jnp.full((b,), t, jnp.int32)
    k = jax.random.normal(jax.random.PRNGKey(1), (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(2), (b, t, hkv, d), jnp.bfloat16)
    r = res["shapes"][sid] = {}
    r["bf16_cudnn"] = run("bf16_cudnn", A.cudnn_bf16, (q, k, v, lengths), tmp, log)
    khm, vhm = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    del k, v
    fn = functools.partial(A.pallas_gqa_head_major, k_splits=32)
    r["bf16_pallas_gqa_hm_s32"] = run("bf16_pallas_gqa_hm_s32", fn, (q, khm, vhm, lengths), tmp, log)
    del khm, vhm
    for name in formats:
      fmt = PRESETS[name]
      data = A.random_packed(jax.random.PRNGKey(3), fmt, b, t, hkv, d)
      fn = functools.partial(A.jaxkv_call, fmt=fmt, config=None)
      r[name] = run(f"jaxkv_{name}", fn, (q, data.arrays, lengths), tmp, log)
      del data
  log("== flush (1,131072,32,8,128): one token group of 8 heads, K and V")
  for name in ("kivi4", "int4-token-g4", "int8"):
    fmt = PRESETS[name]
    # Distinct K and V: equal inputs would let XLA merge two identical packs.
    xk, xv = (jax.random.normal(jax.random.PRNGKey(4 + j), (8, fmt.token_group, 128),
                                jnp.bfloat16) for j in range(2))
    gd = fmt.channel_group_for(128)

    def flush(xk, xv, fmt=fmt, gd=gd):
      kk = pk.quantize_pack(xk, fmt.k_bits, axis=fmt.k_axis,
                            group=fmt.token_group if fmt.k_axis == "channel" else gd)
      vv = pk.quantize_pack(xv, fmt.v_bits, axis="token", group=gd)
      return kk, vv
    res["flush"][name] = run(f"flush_{name}", flush, (xk, xv), tmp, log)
  shutil.rmtree(tmp, ignore_errors=True)
  with open(os.path.join(out, "profile.json"), "w") as f:
    json.dump(res, f, indent=1)
  with open(os.path.join(out, "profile.log"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
