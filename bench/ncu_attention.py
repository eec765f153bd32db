"""A minimal driver for Nsight Compute: one jaxkv attention call repeated.

``ncu`` profiles the split kernel of one call (``--launch-skip`` past the
warm-up) and its SASS page gives executed instructions and warp-stall samples
per instruction: the instruction mix behind `attention-NOTES.md`'s
"instruction bound" finding. Run on the GPU machine, e.g.::

  ncu --clock-control none --kernel-name regex:jaxkv_dequant_attention \\
      --launch-skip 3 --launch-count 1 --set full --import-source no \\
      -o /tmp/kivi4 python3 bench/ncu_attention.py --format kivi4 --shape 4
  ncu -i /tmp/kivi4.ncu-rep --page source --csv --print-source sass > kivi4-sass.csv

Options: ``--shape`` indexes `bench/attention.py`'s SHAPES; ``--config``
``block_k,num_splits,num_warps,num_stages`` overrides the default config;
``--vq`` runs a filled VQ cache (``--format cq2``/``cq4``) through the Mosaic
VQ kernel (kernel regex ``jaxkv_mosaic_vq``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attention as A  # noqa: E402
import jaxkv  # noqa: E402
import pallas_kernels as pk  # noqa: E402
from jaxkv.formats import PRESETS  # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--format", default="kivi4")
  p.add_argument("--shape", type=int, default=4)
  p.add_argument("--config", default=None, help="block_k,num_splits,num_warps,num_stages")
  p.add_argument("--calls", type=int, default=6)
  p.add_argument("--mosaic", action="store_true",
                 help="the Mosaic GPU kernel (default config; kernel regex jaxkv_mosaic)")
  p.add_argument("--mosaic-set", default="",
                 help="Mosaic config fields over the default, e.g. register_k=True,block_k=128")
  p.add_argument("--vq", action="store_true",
                 help="a VQ cache (--format cq2/cq4) through the Mosaic VQ kernel")
  args = p.parse_args(argv)
  b, t, hq, hkv, d, s = A.SHAPES[args.shape]
  if args.vq:
    q = jax.random.normal(jax.random.PRNGKey(0), (b, s, hq, d), jnp.bfloat16)
    cache = A.filled_cache(args.format, jax.random.PRNGKey(3), b, t, hkv, d)
    f = jax.jit(functools.partial(jaxkv.decode_attention, implementation="mosaic"))
    for _ in range(args.calls):
      out = f(q, cache)
    jax.block_until_ready(out)
    print(f"{args.format} {A.SHAPES[args.shape]} mosaic VQ: ok")
    return 0
  fmt = PRESETS[args.format]
  config = None
  if args.config:
    bk, ns, nw, st = (int(x) for x in args.config.split(","))
    config = pk.DecodeAttentionConfig(block_k=bk, num_splits=ns, num_warps=nw, num_stages=st)
  q = jax.random.normal(jax.random.PRNGKey(0), (b, s, hq, d), jnp.bfloat16)
  data = A.random_packed(jax.random.PRNGKey(3), fmt, b, t, hkv, d)
  if args.mosaic:
    config = A.mosaic_default(fmt, b, t, hkv)
    if args.mosaic_set:
      from ab_attention import parse_variants  # pylint: disable=import-outside-toplevel
      config = dataclasses.replace(config, **parse_variants("set:" + args.mosaic_set)["set"])
  call = A.mosaic_call if args.mosaic else A.jaxkv_call
  f = jax.jit(functools.partial(call, fmt=fmt, config=config))
  for _ in range(args.calls):
    out = f(q, data.arrays, data.lengths)
  jax.block_until_ready(out)
  print(f"{args.format} {A.SHAPES[args.shape]} config={config}: ok")
  return 0


if __name__ == "__main__":
  sys.exit(main())
