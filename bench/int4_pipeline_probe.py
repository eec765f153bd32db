"""Where the Mosaic 4-bit product's time goes at B = 1: its pipeline with parts removed.

`pallas_kernels.mosaic_int4_matmul`'s folded, ``x_direct`` kernel rebuilt with
a ``mode``: ``full`` (dequant + MMA, as the kernel), ``mma_const`` (the MMA on constant
registers: no code tile read into registers, no dequant), ``copy`` (the four
TMA copies per step, no work), ``copy_h`` (the same with bf16 scale / zero),
``codes`` (the code tiles alone); ``full_joint`` / ``copy_joint`` (``full`` /
``copy`` with each tile's scale and zero rows in one 1 KB box: three copies
per step instead of four); ``k`` groups per copy (a 3-D box);
``stream_codes`` / ``stream_copy`` (`stream`: a fixed number of persistent
programs with equal runs of steps; ``PROBE_STREAM_ONLY=1`` times only these
beside the default). Times
are profiler kernel us over 4 weight copies cycled (the 4096 x 6144 copies, ~14
MB each, may still partly hit the ~50 MB L2), beside the code bytes' floor at
the measured HBM bandwidth; ``err``: the kernel's and ``full``'s largest
difference from the dequantize + dot spec, relative to its largest output.
Hopper GPUs only (Mosaic GPU). Usage: ``python bench/int4_pipeline_probe.py
OUTDIR`` (writes ``OUTDIR/int4-probe.json``; the 2026-11-29 runs are
``bench/results/draft-int4-{pipeline,stream}-probe-*``).
"""
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxkv import timing  # noqa: E402
from pallas_kernels import int4_matmul as i4  # noqa: E402
from models import draft_weights as dw  # noqa: E402
from pallas_kernels import mosaic_attention as ma  # noqa: E402
from pallas_kernels import mosaic_dequant  # noqa: E402
from pallas_kernels import mosaic_int4_matmul as m4  # noqa: E402

plgpu = ma.plgpu
STREAM_ONLY = os.environ.get("PROBE_STREAM_ONLY") == "1"  # only the default + stream variants
GROUP, BO = 128, 128


def probe(x, codes, scale, zero, *, mode, splits, stages, k=1):
  """The kernel's pipeline with ``mode``'s parts (module doc); float32 [rows, out]."""
  rows, n_in = x.shape
  groups, n_out, _ = codes.shape
  per_split = groups // splits
  n = ma._rows_n(rows)
  codes2 = ma.wide_view(codes.reshape(groups * n_out, 64))  # [groups*n_out/2, 128]
  code_rows = BO * 64 // codes2.shape[-1]
  codes3 = codes2.reshape(groups, n_out * 64 // 128, 128)
  xs = x.astype(jnp.bfloat16)
  sdt = jnp.bfloat16 if mode.endswith("_h") else jnp.float32
  scale = scale.astype(sdt); zero = zero.astype(sdt)
  joint = mode.endswith("_joint")
  if joint:  # row (group, tile): the tile's 128 scales, then its 128 zeros
    tiles = n_out // BO
    scale = jnp.stack([scale.reshape(groups, tiles, BO), zero.reshape(groups, tiles, BO)],
                      axis=2).reshape(groups * tiles, 2 * BO)
  x_tf = ma._tiled(64, 16)
  steps = per_split // k

  def kernel(*refs):
    codes_gmem, scale_gmem, *zero_gmem, x_gmem, out_gmem = refs  # no zero array: joint
    zero_gmem = zero_gmem[0] if zero_gmem else None
    o = lax.axis_index("o")
    first = lax.axis_index("s") * per_split
    cspec = (plgpu.BlockSpec((code_rows, 128), lambda i: ((first + i) * (n_out // BO) + o, 0))
             if k == 1 else
             plgpu.BlockSpec((k, code_rows, 128), lambda i: (first // k + i, o, 0)))
    specs = [cspec,
             plgpu.BlockSpec((k, BO), lambda i: (first // k + i, o)),
             plgpu.BlockSpec((k, BO), lambda i: (first // k + i, o)),
             plgpu.BlockSpec((n, k * GROUP), lambda i: (0, first // k + i), transforms=x_tf)]
    ins = [codes_gmem, scale_gmem, zero_gmem, x_gmem]
    if mode.startswith("codes"):
      specs, ins = specs[:1], ins[:1]
    if joint:  # one (1, 256) box of the joint rows in place of the scale and zero boxes
      specs[1:3] = [plgpu.BlockSpec((1, 2 * BO), lambda i: ((first + i) * (n_out // BO) + o, 0))]
      ins[1:3] = [scale_gmem]

    def body(acc_ref, *refs):
      if joint:  # the (1, 256) row's halves as the kernel's scale / zero rows
        _, c, sz, xr = refs
        refs = (None, c, sz.at[:, pl.ds(0, BO)], sz.at[:, pl.ds(BO, BO)], xr)
      if mode in ("full", "full_joint"):
        _, c, s, z, xr = refs
        a = mosaic_dequant.dequant_codes_rows(c, s, z)
        plgpu.wgmma(acc_ref, a, ma._t(xr))
        plgpu.wgmma_wait(0)
      elif mode == "mma_const":
        _, c, s, z, xr = refs
        a = plgpu.layout_cast(jnp.full((BO, GROUP), 1.0, jnp.bfloat16), plgpu.Layout.WGMMA)
        plgpu.wgmma(acc_ref, a, ma._t(xr))
        plgpu.wgmma_wait(0)
      # copy / codes: nothing

    def run(acc_ref):
      plgpu.emit_pipeline(mosaic_dequant.release_stages(functools.partial(body, acc_ref), True),
                          grid=(steps,), in_specs=specs, max_concurrent_steps=stages)(*ins)
      return acc_ref[...]

    acc = pl.run_scoped(run, plgpu.ACC((BO, n), jnp.float32))

    def write(o_smem):
      o_smem[...] = acc * (2.0 ** mosaic_dequant.K_SHIFT) if mode.startswith("full") else acc
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[lax.axis_index("s"), pl.ds(o * BO, BO)])
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(write, plgpu.SMEM((BO, n), jnp.float32))

  part = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((splits, n_out, n), jnp.float32),
                      grid=(n_out // BO, splits), grid_names=("o", "s"),
                      compiler_params=plgpu.CompilerParams(approx_math=True,
                          lowering_semantics=ma._SEMANTICS, unsafe_no_auto_barriers=True),
                      kernel_name=f"probe_{mode}")(
                          codes3 if k > 1 else codes2, scale, *(() if joint else (zero,)), xs)
  return part.sum(axis=0).T[:rows]


def stream(x, codes, scale, zero, *, mode, programs, stages):
  """``stream_codes`` / ``stream_copy``: ``programs`` persistent programs, each
  copying an equal run of the product's (output tile, group) steps (tile-major;
  the last run clamped to the last step, so a few steps repeat), with no work
  and no output but a token row: is the TMA stream itself able to reach the
  bandwidth when no SM has more steps than another?"""
  rows, _ = x.shape
  groups, n_out, _ = codes.shape
  n = ma._rows_n(rows)  # pylint: disable=protected-access
  codes2 = ma.wide_view(codes.reshape(groups * n_out, 64))
  code_rows = BO * 64 // codes2.shape[-1]
  tiles = n_out // BO
  total = tiles * groups
  per = -(-total // programs)
  xs = x.astype(jnp.bfloat16)
  scale = scale.astype(jnp.float32)
  zero = zero.astype(jnp.float32)
  x_tf = ma._tiled(64, 16)  # pylint: disable=protected-access

  def at(i):  # -> (tile, group) of this program's step i
    q = jnp.minimum(lax.axis_index("p") * per + i, total - 1)
    return q // groups, q % groups

  def kernel(codes_gmem, scale_gmem, zero_gmem, x_gmem, out_gmem):
    specs = [plgpu.BlockSpec((code_rows, 128), lambda i: (at(i)[1] * tiles + at(i)[0], 0)),
             plgpu.BlockSpec((1, BO), lambda i: (at(i)[1], at(i)[0])),
             plgpu.BlockSpec((1, BO), lambda i: (at(i)[1], at(i)[0])),
             plgpu.BlockSpec((n, GROUP), lambda i: (0, at(i)[1]), transforms=x_tf)]
    ins = [codes_gmem, scale_gmem, zero_gmem, x_gmem]
    if mode == "stream_codes":
      specs, ins = specs[:1], ins[:1]
    plgpu.emit_pipeline(mosaic_dequant.release_stages(lambda *_: None, True), grid=(per,),
                        in_specs=specs, max_concurrent_steps=stages)(*ins)

    def write(o_smem):
      o_smem[...] = jnp.zeros((1, 128), jnp.float32)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(lax.axis_index("p"), 1)])
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(write, plgpu.SMEM((1, 128), jnp.float32))

  return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((programs, 128), jnp.float32),
                      grid=(programs,), grid_names=("p",),
                      compiler_params=plgpu.CompilerParams(
                          approx_math=True, lowering_semantics=ma._SEMANTICS,  # pylint: disable=protected-access
                          unsafe_no_auto_barriers=True),
                      kernel_name=f"probe_{mode}")(codes2, scale, zero, xs)


def main():
  """Times every variant at the draft's three largest shapes; writes int4-probe.json."""
  out = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
  bw = timing.hbm_read_probe(1 << 32)["best"]
  print("hbm GB/s", bw / 1e9)
  res = []
  for n_in, n_out in ((4096, 28672), (4096, 6144), (14336, 4096)):
    key = jax.random.PRNGKey(n_in + n_out)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (n_in, n_out), jnp.bfloat16) * 0.02 for i in range(4)]
    qs = [dw.quantize_kernel(w, bits=4, group_size=128, layout="in_major") for w in ws]
    mqs = [(m4.transpose_packed(q.codes), q.scale, q.zero) for q in qs]
    x = jax.random.normal(key, (1, n_in), jnp.bfloat16)
    # the spec (dequantize + float32 dot): `default` and `full` must match it
    ref = i4.int4_matmul_reference(x, qs[0].codes, qs[0].scale, qs[0].zero, group=128)
    del ws, qs
    floor = n_in * n_out / 2 / bw * 1e6
    base = m4.default_splits(n_in, n_out)
    variants = [("default", None, dict())]
    variants += [(f"full_s{base}_st{st}", "full", dict(splits=base, stages=st)) for st in (3, 6)]
    variants += [(f"full_joint_s{base}_st3", "full_joint", dict(splits=base, stages=3)),
                 (f"copy_joint_s{base}_st3", "copy_joint", dict(splits=base, stages=3))]
    variants += [(f"mma_const_s{base}_st3", "mma_const", dict(splits=base, stages=3))]
    variants += [(f"copy_s{base}_st{st}", "copy", dict(splits=base, stages=st)) for st in (3, 6)]
    if (n_in // 128) % (2 * base) == 0:
      variants += [(f"copy_s{2 * base}_st3", "copy", dict(splits=2 * base, stages=3))]
    variants += [(f"codes_s{base}_st3", "codes", dict(splits=base, stages=3)),
                 (f"copy_h_s{base}_st3", "copy_h", dict(splits=base, stages=3))]
    for mode in ("copy", "codes"):
      for kk in (2, 4):
        if (n_in // 128) % (base * kk) == 0:
          variants.append((f"{mode}_s{base}_st3_k{kk}", mode, dict(splits=base, stages=3, k=kk)))
    if STREAM_ONLY:
      variants = [("default", None, dict())]
    for mode in ("stream_codes", "stream_copy"):
      for programs in (132, 264, 396):
        for st in (3, 6):
          variants.append((f"{mode}_p{programs}_st{st}", mode, dict(programs=programs, stages=st)))
    for name, mode, kw in variants:
      fn = (lambda x, w: m4.mosaic_int4_matmul(x, *w)) if mode is None else (
          lambda x, w, _m=mode, _kw=kw: (stream if _m.startswith("stream") else probe)(
              x, *w, mode=_m, **_kw))
      try:
        y = jax.jit(fn)(x, mqs[0])
        err = (float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
               if mode in (None, "full", "full_joint") else None)
        us = timing.kernel_time(fn, [(x, w) for w in mqs], calls=16)["kernel"] * 1e6
      except Exception as e:
        print(f"  [{n_in}x{n_out}] {name:22s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        continue
      res.append(dict(n_in=n_in, n_out=n_out, variant=name, us=us, floor_us=floor, err=err))
      print(f"  [{n_in}x{n_out}] {name:22s} {us:6.1f} us  floor {floor:5.1f}  "
            f"{floor / us * 100:4.0f}%  err {err}", flush=True)
  with open(os.path.join(out, "int4-probe.json"), "w") as f:
    json.dump(dict(gpu=jax.devices()[0].device_kind, jax=jax.__version__, hbm_bps=bw, rows=res),
              f, indent=1)

if __name__ == "__main__":
  main()
