"""Decode attention of sink formats (`sink_tokens`) against the same format without
sinks, kivi2 and cuDNN bf16, one process: what the exact prefix costs.

Each format's cache is filled with random K/V (VQ: random codebooks) and timed
through `jaxkv.decode_attention` (default dispatch: the Mosaic / Triton kernel
from the skip plus the XLA prefix, merged) on copies rotated past L2. Prints
one row per (shape, format) and writes a JSON with the GPU name and JAX
version. Usage (GPU machine)::

  python bench/sink_timing.py --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import attention as A  # noqa: E402
import jaxkv  # noqa: E402
from jaxkv import timing  # noqa: E402
from jaxkv.formats import PRESETS  # noqa: E402

SHAPES = ((1, 32768, 32, 8, 128, 1), (1, 131072, 32, 8, 128, 1), (8, 32768, 32, 8, 128, 1))


def format_of(name: str):
  """A preset name, or ``<KV preset>-s<N>`` for that preset with ``sink_tokens=N``."""
  if name in jaxkv.VQ_PRESETS:
    return jaxkv.VQ_PRESETS[name]
  base, _, sinks = name.rpartition("-s")
  if base in PRESETS and sinks.isdigit():
    return dataclasses.replace(PRESETS[base], sink_tokens=int(sinks))
  return PRESETS[name]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--formats", default="kivi2,kivi2-g32,kivi2-g32-s4,cq2,cq2-s4")
  p.add_argument("--shapes", default="0,1,2", help="indices into SHAPES")
  p.add_argument("--calls", type=int, default=16)
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  rows = []
  for i in a.shapes.split(","):
    b, t, hq, hkv, d, s = SHAPES[int(i)]
    q = jax.random.normal(jax.random.PRNGKey(0), (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(jax.random.PRNGKey(1), (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(2), (b, t, hkv, d), jnp.bfloat16)
    lengths = jnp.full((b,), t, jnp.int32)
    copies = A.rotating_copies((q, k, v, lengths), A.nbytes(k, v))
    cudnn = timing.kernel_time(A.cudnn_bf16, copies, calls=a.calls)["kernel"] * 1e6
    del copies, k, v
    print(f"== B={b} T={t}: cuDNN bf16 {cudnn:.1f} us", flush=True)
    for name in a.formats.split(","):
      fmt = format_of(name)
      cache = A.filled_cache(fmt, jax.random.PRNGKey(4), b, t, hkv, d)
      try:
        impl = jaxkv.attention.resolve_implementation(q, cache, None)
      except Exception:  # pylint: disable=broad-except  (VQ caches dispatch on their own)
        impl = "default"
      copies = A.rotating_copies((q, cache), A.nbytes(*jax.tree.leaves(cache)))
      r = timing.kernel_time(lambda q, c: jaxkv.decode_attention(q, c), copies, calls=a.calls)
      us = r["kernel"] * 1e6
      rows.append(dict(shape=[b, t, hq, hkv, d, s], format=name, implementation=impl,
                       kernel_us=us, span_us=r["span"] * 1e6, kernels=r["kernels"],
                       cudnn_us=cudnn, vs_cudnn=cudnn / us,
                       by_name_us={k_: v_ * 1e6 for k_, v_ in r.get("by_name", {}).items()}))
      print(f"  {name:14s} {impl:9s} {us:8.1f} us ({r['kernels']:.0f} kernels, span "
            f"{r['span'] * 1e6:.1f})  {cudnn / us:5.2f}x cuDNN", flush=True)
      del copies, cache
  if a.out:
    os.makedirs(a.out, exist_ok=True)
    gpu = jax.devices()[0].device_kind
    with open(os.path.join(a.out, f"sink-timing-{gpu.replace(' ', '-').lower()}.json"), "w") as f:
      json.dump(dict(gpu=gpu, jax_version=jax.__version__, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
