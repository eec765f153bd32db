"""GPU probe: per-call launch overhead of Pallas Triton calls, and the tiny-group
pack mismatch data (saved for offline analysis).

Usage: python bench/probe_overhead.py OUTDIR
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attention as A  # noqa: E402
from jaxkv import quant  # noqa: E402
from jaxkv.autotune import device_time  # noqa: E402
from jaxkv.formats import PRESETS  # noqa: E402
import pallas_kernels as pk  # noqa: E402


def wall(fn, *args, reps=20):
  c = jax.jit(fn).lower(*args).compile()
  for _ in range(3):
    jax.block_until_ready(c(*args))
  t = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(c(*args))
    t.append(time.perf_counter() - t0)
  return float(np.median(t))


def hidden(op, n, x, big):
  """GPU time of n back-to-back op(x) calls, with host launch cost hidden behind a long matmul."""
  def lead(big):
    return jnp.tanh(big @ big @ big @ big)

  def with_ops(x, big):
    y = lead(big)
    outs = []
    for i in range(n):
      outs.append(op(x + i))
    return y, outs
  t_lead = wall(lead, big)
  t_all = wall(with_ops, x, big)
  return (t_all - t_lead) / n, t_lead


def main():
  out = sys.argv[1]
  os.makedirs(out, exist_ok=True)
  print("nsys:", shutil.which("nsys"), "ncu:", shutil.which("ncu"), flush=True)

  def tiny_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2.0

  def tiny_pallas(x):
    return pl.pallas_call(tiny_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=pk._triton.compiler_params(num_warps=1, num_stages=1))(x)

  def tiny_xla(x):
    return jnp.sin(x) * 2.0

  x = jnp.ones((16,), jnp.float32)
  big = jax.random.normal(jax.random.PRNGKey(0), (4096, 4096), jnp.bfloat16)
  for name, op in (("tiny pallas", tiny_pallas), ("tiny xla", tiny_xla)):
    per = device_time(op, [x + i for i in range(8)], reps=20)["median"]
    gpu, lead = hidden(op, 32, x, big)
    print(f"{name:14s} device_time/call {per*1e6:7.2f} us   hidden-launch GPU/call {gpu*1e6:7.2f} us"
          f"  (lead matmuls {lead*1e6:.0f} us)", flush=True)

  # Flush and a small attention call, both ways.
  fmt = PRESETS["kivi4"]
  xs = jax.random.normal(jax.random.PRNGKey(3), (8, 128, 128), jnp.bfloat16)

  def flush(x):
    k = pk.quantize_pack(x, 4, axis="channel", group=128)
    v = pk.quantize_pack(x, 4, axis="token", group=128)
    return k, v
  per = device_time(flush, [xs + i for i in range(8)], reps=20)["median"]
  gpu, _ = hidden(flush, 16, xs, big)
  print(f"flush kivi4    device_time/call {per*1e6:7.2f} us   hidden-launch GPU/call {gpu*1e6:7.2f} us", flush=True)

  for shape in (A.SHAPES[0], A.SHAPES[4]):
    b, t, hq, hkv, d, s = shape
    for name in ("kivi4", "int8"):
      fmt = PRESETS[name]
      data = A.random_packed(jax.random.PRNGKey(1), fmt, b, t, hkv, d)
      q = jax.random.normal(jax.random.PRNGKey(2), (b, s, hq, d), jnp.bfloat16)
      fn = lambda q_, fmt=fmt, data=data: pk.dequant_decode_attention(q_, *data.arrays, data.lengths, fmt=fmt)
      per = device_time(fn, [q + i for i in range(8)], reps=10)["median"]
      gpu, _ = hidden(fn, 8, q, big)
      print(f"{A.shape_id(shape)} {name:6s} device_time/call {per*1e6:7.2f} us   hidden-launch GPU/call {gpu*1e6:7.2f} us", flush=True)

  # Tiny-range group of test_pack_bitwise (bits=8, per token): save the data.
  import zlib
  key = jax.random.PRNGKey(zlib.crc32(repr(("pack", 8, "token", 128, 40, 128)).encode()))
  xx = jax.random.normal(key, (2, 3, 40, 128))
  xx = (xx * 2.0 + 0.3).astype(jnp.bfloat16)
  xx = xx.at[0, 0, :, :].set(1.5).at[1, 2, :, :].multiply(1e-6)
  got = pk.quantize_pack(xx, 8, axis="token", group=128)
  ref = jax.jit(functools.partial(quant.quantize, bits=8, axis="token", group=128))(xx)
  ref_cpu = jax.jit(functools.partial(quant.quantize, bits=8, axis="token", group=128))(
      jax.device_put(np.asarray(xx), jax.devices("cpu")[0]))
  np.savez(os.path.join(out, "pack_tiny.npz"), x=np.asarray(xx.astype(jnp.float32)),
           got_codes=np.asarray(got[0]), got_scale=np.asarray(got[1]), got_zero=np.asarray(got[2]),
           ref_codes=np.asarray(ref[0]), ref_scale=np.asarray(ref[1]), ref_zero=np.asarray(ref[2]),
           cpu_codes=np.asarray(ref_cpu[0]) if ref_cpu else np.zeros(1))
  for n_, g, r in zip(("codes", "scale", "zero"), got, ref):
    print(f"pack tiny {n_}: mismatches {int(np.sum(np.asarray(g) != np.asarray(r)))}", flush=True)
  if ref_cpu:
    print(f"pack tiny codes GPU-XLA vs CPU-XLA mismatches {int(np.sum(np.asarray(ref[0]) != np.asarray(ref_cpu[0])))};"
          f" kernel vs CPU-XLA {int(np.sum(np.asarray(got[0]) != np.asarray(ref_cpu[0])))}", flush=True)


if __name__ == "__main__":
  main()
