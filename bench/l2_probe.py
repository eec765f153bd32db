"""Would the decode step gain from the o-projection's weights in L2? (a probe)

At one sequence the quantized attention kernel is latency-bound: on an H200
at (1, 131072, 32, 8, 128) kivi4 reads ~140 MB in ~47 us at ~61 % of the HBM
bandwidth (`bench/results/mosaic-NOTES.md`), and the next weight read is the
o-projection, a 4096 x 4096 bf16 GEMV (32 MB, ~10 us at 71 %). If the spare
bandwidth during attention could leave those weights in L2 (50 MB), the
GEMV would read L2 instead of HBM. This probe measures the upper bound and
whether L2 keeps the weights through an attention-sized stream:

* ``cold``: the GEMV after a 256 MB stream (weights not in L2);
* ``warm``: right after a reduction that read the weights (all in L2);
* ``warm_stream``: the weights read, then ``--stream-mb`` of other data, then
  the GEMV (what a prefetch before attention would leave);
* ``evict_last`` / ``evict_last_stream``: the same with the weights read by a
  Pallas Triton kernel whose loads carry ``eviction_policy="evict_last"``
  (does that priority outlive the stream?).

Each row: the GEMV kernel's profiler time (us), the whole call's, and the
GEMV's bandwidth against the HBM read probe. One JSON with the GPU name and
JAX version. Not part of the library; its findings go to
`bench/results/e2e-NOTES.md`.

Usage (GPU machine)::

  python bench/l2_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plt  # noqa: E402

from jaxkv import timing  # noqa: E402
from pallas_kernels import _triton  # noqa: E402


def evict_last_sum(w: jax.Array, *, block=(32, 512), interpret: bool = False) -> jax.Array:
  """``sum(w)`` (float32) by a Pallas Triton kernel whose loads of ``w`` carry
  ``eviction_policy="evict_last"``: the read leaves ``w`` in L2 at that priority."""
  rows, cols = w.shape
  br, bc = block

  def kernel(w_ref, o_ref):
    x = plt.load(w_ref, eviction_policy="evict_last")
    o_ref[...] = jnp.full((1, 1), jnp.sum(x.astype(jnp.float32)), jnp.float32)

  parts = pl.pallas_call(
      kernel, grid=(rows // br, cols // bc),
      in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((1, 1), lambda i, j: (i, j)),
      out_shape=jax.ShapeDtypeStruct((rows // br, cols // bc), jnp.float32),
      compiler_params=_triton.compiler_params(num_warps=4, num_stages=1),
      interpret=interpret, name="l2_probe_evict_last_read")(w)
  return jnp.sum(parts)


def _after(x, *deps):
  """``x`` made to depend on ``deps`` (scalars), so XLA runs them first."""
  for d in deps:
    x = x + (d * 0).astype(x.dtype)
  return x


def variants(interpret: bool = False):
  """``{name: fn(w, x, stream, flush) -> y}``; ``flush`` is read first in every
  variant so each call starts with the weights out of L2."""
  def gemv(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

  def flushed(flush):
    return jnp.sum(flush, dtype=jnp.float32)

  def cold(w, x, stream, flush):
    return gemv(_after(x, flushed(flush)), w)

  def warm(w, x, stream, flush):
    s = jnp.sum(_after(w, flushed(flush)), dtype=jnp.float32)
    return gemv(_after(x, s), w)

  def warm_stream(w, x, stream, flush):
    s = jnp.sum(_after(w, flushed(flush)), dtype=jnp.float32)
    t = jnp.sum(_after(stream, s), dtype=jnp.float32)
    return gemv(_after(x, t), w)

  def evict_last(w, x, stream, flush):
    s = evict_last_sum(_after(w, flushed(flush)), interpret=interpret)
    return gemv(_after(x, s), w)

  def evict_last_stream(w, x, stream, flush):
    s = evict_last_sum(_after(w, flushed(flush)), interpret=interpret)
    t = jnp.sum(_after(stream, s), dtype=jnp.float32)
    return gemv(_after(x, t), w)

  return dict(cold=cold, warm=warm, warm_stream=warm_stream, evict_last=evict_last,
              evict_last_stream=evict_last_stream)


def gemv_kernel_us(by_name: dict) -> float:
  """Seconds -> us of the GEMV: the kernels whose name says dot/gemm."""
  return 1e6 * sum(t for n, t in by_name.items() if "dot" in n.lower() or "gemm" in n.lower())


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--din", type=int, default=4096)
  p.add_argument("--dout", type=int, default=4096)
  p.add_argument("--stream-mb", type=int, default=140)
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--out", default="/tmp")
  args = p.parse_args()
  dev = jax.devices()[0]
  hbm = timing.hbm_read_probe()["best"]
  key = jax.random.PRNGKey(0)
  w = jax.random.normal(key, (args.din, args.dout), jnp.bfloat16)
  x = jax.random.normal(key, (2, args.din), jnp.bfloat16)  # two rows, as the model's twin
  stream = jnp.ones((args.stream_mb << 20) // 2, jnp.bfloat16)
  flush = jnp.ones((256 << 20) // 2, jnp.bfloat16)
  rows = {}
  print(f"{dev.device_kind}, jax {jax.__version__}, HBM read {hbm / 1e9:.0f} GB/s; "
        f"W [{args.din}, {args.dout}] bf16 = {w.nbytes / 2 ** 20:.0f} MiB, stream "
        f"{args.stream_mb} MiB", flush=True)
  for name, fn in variants().items():
    try:
      tm = timing.kernel_time(fn, [(w, x, stream, flush)], calls=args.calls)
    except Exception as e:  # noqa: BLE001  (a variant that fails to lower is reported)
      rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      print(f"  {name:18s} FAILED {rows[name]['error'][:150]}", flush=True)
      continue
    g = gemv_kernel_us(tm["by_name"])
    rows[name] = {"gemv_us": g, "call_us": tm["kernel"] * 1e6,
                  "gemv_fraction_of_hbm": w.nbytes / (g * 1e-6) / hbm if g else None,
                  "by_name_us": {n: t * 1e6 for n, t in tm["by_name"].items()}}
    print(f"  {name:18s} GEMV {g:7.2f} us ({rows[name]['gemv_fraction_of_hbm'] or 0:.2f} "
          f"of HBM)  call {tm['kernel'] * 1e6:8.1f} us", flush=True)
  out = {"gpu": dev.device_kind, "jax_version": jax.__version__, "hbm_read_gbps": hbm / 1e9,
         "args": vars(args), "rows": rows}
  path = os.path.join(args.out, f"l2-probe-{dev.device_kind.replace(' ', '-').lower()}.json")
  os.makedirs(args.out, exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
