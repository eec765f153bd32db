"""How fast can the Mosaic kernel's TMA pipeline alone read the kivi4 cache? (a probe)

The tokens-on-M attention kernel (`pallas_kernels.mosaic_attention`) streams
one kv head's code tiles and scale rows through `plgpu.emit_pipeline`. This
probe runs the *same* grid, BlockSpecs and pipeline with an empty step body
(copies only), beside the real kernel in the same process, so a kernel's time
can be split into "what its memory pipeline costs" and "what its compute adds":

* ``kernel_*``: the real kernel (default config, 48 splits, 3 stages);
* ``xla sums``: XLA reductions over the same arrays (a plain-read reference);
* ``copy bkB sS stT [codes] [wW]``: the copy-only pipeline in ``B``-token blocks,
  ``S`` splits per kv head, ``T`` stages; ``codes``: the two code arrays only
  (no scale/zero rows); ``wW``: the code arrays viewed as ``W``-byte rows
  (``W / 64`` tokens per row, the same bytes: `mosaic_attention.wide_view`;
  both code tiles unswizzled there, where the kernel swizzles V's by 128 bytes).

Each row: main-kernel us (profiler) and the fraction of the HBM read probe's
bandwidth it reaches on the cache's bytes. Findings: `bench/results/mosaic-NOTES.md`
(2026-11-28, fifteenth session: 64-byte TMA rows stream at ~75 % of HBM,
128/256-byte rows at ~93 %). Not part of the library.

Usage (GPU machine)::

  python bench/stream_probe.py --out $OUT/stream.json \\
      --variants '128,32,2;128,32,2,1;128,32,2,1,128;128,32,2,0,256'

(variant: ``block_k,splits,stages[,codes_only[,row_bytes]]``). ``--lower-only``
lowers the first variants for CUDA on a CPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

import attention as A  # noqa: E402
from jaxkv import timing  # noqa: E402
from jaxkv.formats import PRESETS  # noqa: E402
from pallas_kernels import mosaic_attention as ma  # noqa: E402
from pallas_kernels.side_spec import SideSpec  # noqa: E402

HEAD_DIM = 128


def copy_only(arrays, *, bk: int, splits: int, stages: int, codes_only: bool = False,
              row_bytes: int = 0):
  """The kivi4 kernel's packed-program pipeline with an empty step: ``[H * S, 128]``
  float32 (each program's block count, so nothing is dead code)."""
  k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = arrays[:6]
  batch, heads, capacity, width = k_codes.shape
  fmt = PRESETS["kivi4"]
  k_side, v_side = SideSpec.of(fmt, "k", HEAD_DIM), SideSpec.of(fmt, "v", HEAD_DIM)
  k_specs = ma._side_specs(k_side, width, HEAD_DIM, bk, None, plain_codes=True)
  v_specs = ma._side_specs(v_side, width, HEAD_DIM, bk, ma._tiled(16, 16))
  v_scale = v_scale.reshape(batch, heads, capacity)
  v_zero = v_zero.reshape(batch, heads, capacity)
  ins = ma.head_rows([k_codes, k_scale, k_zero, v_codes, v_scale, v_zero])
  specs = k_specs + v_specs
  if row_bytes:
    ins = [x.reshape(x.shape[0], -1, row_bytes) if i in (0, 3) else x
           for i, x in enumerate(ins)]
    wide = plgpu.BlockSpec((bk * width // row_bytes, row_bytes), lambda i: (i, 0))
    specs = [wide, *specs[1:3], wide, *specs[4:]]
  if codes_only:
    ins, specs = [ins[0], ins[3]], [specs[0], specs[3]]

  def kernel(*refs):
    gmem, (o_gmem, o_smem) = refs[:len(ins)], refs[len(ins):]
    h, j = lax.axis_index("h"), lax.axis_index("j")
    n = ma._run_split(lambda tiles, carry, token0: carry + 1, specs, [r.at[h] for r in gmem],
                      packed=capacity, j=j, num_splits=splits, bk=bk,
                      max_concurrent_steps=stages, init_carry=jnp.int32(0))
    o_smem[...] = jnp.full((128,), 1.0, jnp.float32) * n.astype(jnp.float32)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[h * splits + j])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((heads * splits, 128), jnp.float32),
                      grid=(1, heads, splits), grid_names=("b", "h", "j"),
                      scratch_types=[plgpu.SMEM((128,), jnp.float32)],
                      compiler_params=plgpu.CompilerParams(lowering_semantics=ma._SEMANTICS),
                      kernel_name=f"stream_probe_bk{bk}_s{splits}_st{stages}")(*ins)


def _variant(text: str) -> dict:
  bk, splits, stages, *rest = (int(x) for x in text.split(","))
  return dict(bk=bk, splits=splits, stages=stages, codes_only=bool(rest and rest[0]),
              row_bytes=rest[1] if len(rest) > 1 else 0)


def _name(v: dict) -> str:
  return (f"copy bk{v['bk']} s{v['splits']} st{v['stages']}"
          + (" codes" if v["codes_only"] else "") + (f" w{v['row_bytes']}" if v["row_bytes"]
                                                     else ""))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", type=int, default=131072)
  p.add_argument("--variants", default="128,32,2;128,32,2,1;128,32,2,1,128;128,32,2,0,256")
  p.add_argument("--lower-only", action="store_true")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  variants = [_variant(v) for v in filter(None, args.variants.split(";"))]
  tokens = 8192 if args.lower_only else args.tokens
  fmt = PRESETS["kivi4"]
  data = A.random_packed(jax.random.PRNGKey(3), fmt, 1, tokens, 8, HEAD_DIM)
  arrays = tuple(data.arrays)
  if args.lower_only:
    for v in variants[:3]:
      jax.jit(functools.partial(copy_only, **v)).trace(arrays).lower(lowering_platforms=("cuda",))
      print("lowered", _name(v))
    return 0
  nbytes = A.nbytes(*arrays[:6])
  copies = A.rotating_copies((arrays,), nbytes)
  hbm = timing.hbm_read_probe(1 << 30)["best"]
  q = jax.random.normal(jax.random.PRNGKey(0), (1, 1, 32, HEAD_DIM), jnp.bfloat16)
  config = A.mosaic_default(fmt, 1, tokens, 8)
  rows = []

  def add(name, fn, read):
    kt = timing.kernel_time(fn, copies, calls=16)
    main_s = max(kt["by_name"].values(), default=kt["kernel"])
    rows.append(dict(variant=name, us=kt["kernel"] * 1e6, main_us=main_s * 1e6, bytes=read,
                     frac_hbm=read / main_s / hbm))

  for name, cfg in (("kernel_default", config),
                    ("kernel_s48", dataclasses.replace(config, num_splits=48)),
                    ("kernel_st3", dataclasses.replace(config, max_concurrent_steps=3))):
    add(name, lambda arrs, c=cfg: A.mosaic_call(q, arrs, data.lengths, fmt=fmt, config=c),
        nbytes)
  add("xla sums", lambda arrs: sum(jnp.sum(x.astype(jnp.float32)) for x in arrs[:6]), nbytes)
  for v in variants:
    add(_name(v), functools.partial(copy_only, **v),
        A.nbytes(arrays[0], arrays[3]) if v["codes_only"] else nbytes)
  for r in rows:
    print(f"{r['variant']:26s} {r['main_us']:7.1f} us  {r['frac_hbm']:.2f} of HBM")
  print(f"bytes {nbytes / 1e6:.1f} MB, HBM {hbm / 1e12:.2f} TB/s, floor {nbytes / hbm * 1e6:.1f} us")
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                     tokens=tokens, nbytes=nbytes, hbm=hbm, rows=rows), fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
