"""How fast is the QuantSpec draft model's 4-bit matmul on this GPU?

For each linear layer shape of Llama-3.1-8B (``[in, out]``), one decode
token (``x [B, in]``, B = 1 and 8): profiler kernel time of

- ``bf16``: ``x @ W`` with the full bfloat16 kernel (the target's weights);
- ``xla``: ``x @ dequantize(W4)`` inside a jitted program (packed 4-bit
  codes, float32 group scales, the dequantization left for XLA to fuse);
- ``kernel``: `QuantizedWeight.matmul` of ``layout="in_major"`` weights,
  the Triton kernel `pallas_kernels.int4_matmul` on a GPU (what the draft
  model runs off Hopper and for the 4096-wide products on it);
- ``mosaic``: `pallas_kernels.mosaic_int4_matmul` (Hopper; ``layout="out_major"``
  codes ``[in / 128, out, 64]``, what the draft runs there for the large products);
  ``--mosaic-sweep`` also times its split counts and pipeline depths at B = 1;

beside the bytes floor of each (weights read once at the measured HBM read
bandwidth). If XLA materializes the dequantized kernel, ``draft`` costs more
than ``bf16`` (it did: 3.3x at ``[4096, 14336]`` on an H100, jax 0.11.2).

Usage (GPU machine): ``python3 bench/draft_matmul_probe.py --out $OUT/draft_mm.json``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import dataclasses

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxkv import timing  # noqa: E402
from jaxkv.attention import is_hopper  # noqa: E402
from models import draft_weights as dw  # noqa: E402
from pallas_kernels import int4_matmul as i4  # noqa: E402
from pallas_kernels import mosaic_int4_matmul as m4  # noqa: E402

# Llama-3.1-8B linear layers: q, k/v, o, gate/up, down.
SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]
ROTATE = 4  # weight copies cycled so that none is read from L2


def _time_variants(fns, weights, n_in, n_out, calls, extra=None):
  """Kernel time of ``fns[name](x, w)`` at B=1 over the rotated ``weights``, each
  output checked against the first variant's; one row per variant."""
  x = jax.random.normal(jax.random.PRNGKey(5), (1, n_in), jnp.bfloat16)
  out, ref = [], None
  for name, fn in fns.items():
    try:
      y = jax.jit(fn)(x, weights[0])
      ref = y if ref is None else ref
      err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
      us = timing.kernel_time(fn, [(x, w) for w in weights], calls=calls)["kernel"] * 1e6
    except Exception as e:  # pylint: disable=broad-except
      print(f"    {name:16s} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
      continue
    out.append(dict(n_in=n_in, n_out=n_out, batch=1, variant=name, kernel_us=us,
                    rel_err_vs_default=err, **(extra or {}).get(name, {})))
    print(f"    {name:16s} {us:7.1f} us  err {err:.1e}", flush=True)
  return out


def sweep(n_in, n_out, qs, group, calls):
  """Triton kernel config variants at B=1, each checked against the default's output."""
  base = i4.Int4MatmulConfig.default(n_in=n_in, n_out=n_out, group=qs[0].group)
  groups = n_in // qs[0].group
  variants = {"default": base}
  for warps in (2, 4):
    for bn in (128, 256):
      if n_out % bn:
        continue
      cfg = dataclasses.replace(base, num_warps=warps, block_n=bn)
      if cfg != base:
        variants[f"w{warps}_bn{bn}"] = cfg
  for f in (2,):
    if groups % (base.num_splits * f) == 0:
      variants[f"splits_x{f}"] = dataclasses.replace(base, num_splits=base.num_splits * f)
  if base.num_splits % 2 == 0:
    variants["splits_half"] = dataclasses.replace(base, num_splits=base.num_splits // 2)
  variants["warps1"] = dataclasses.replace(base, num_warps=1)
  fns = {name: (lambda x, qw, _c=cfg: i4.int4_matmul(x, qw.codes, qw.scale, qw.zero,
                                                       group=qw.group, config=_c))
         for name, cfg in variants.items()}
  extra = {name: {"config": dataclasses.asdict(cfg)} for name, cfg in variants.items()}
  return _time_variants(fns, qs, n_in, n_out, calls, extra)


def mosaic_sweep(n_in, n_out, mqs, calls):
  """Mosaic kernel split counts x pipeline depths at B=1 (the default first), each
  with the affine per group (default) and folded into the registers (``fold``)."""
  groups = n_in // m4.GROUP
  base = m4.default_splits(n_in, n_out)
  splits = [base] + [s for s in (max(1, base // 2), 2 * base) if s != base and groups % s == 0]
  fns = {f"mosaic{'_fold' if f else ''}_s{s}_st{st}": (
      lambda x, w, _s=s, _st=st, _f=f: m4.mosaic_int4_matmul(x, *w, num_splits=_s, stages=_st,
                                                             fold=_f))
         for f in (False, True) for s in splits for st in (3, 2, 4)}
  return _time_variants(fns, mqs, n_in, n_out, calls)


def mosaic_ab(n_in, n_out, mqs, calls):
  """The Mosaic kernel's default (folded) config with its x operand (``x_direct``)
  and code-tile row width toggled (`mosaic_int4_matmul`'s ``x_direct``,
  ``wide_rows``)."""
  fns = {f"mosaic_{name}": (lambda x, w, _kw=kw: m4.mosaic_int4_matmul(x, *w, **_kw))
         for name, kw in (("new", {}), ("xprep", {"x_direct": False}),
                          ("narrow", {"wide_rows": False}))}
  return _time_variants(fns, mqs, n_in, n_out, calls)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batches", default="1,8")
  p.add_argument("--group", type=int, default=128)
  p.add_argument("--calls", type=int, default=16)
  p.add_argument("--sweep", action="store_true",
                 help="also time kernel config variants at B=1 (correctness checked)")
  p.add_argument("--mosaic-sweep", action="store_true",
                 help="also time the Mosaic kernel's split counts and depths at B=1")
  p.add_argument("--mosaic-ab", action="store_true",
                 help="also time the Mosaic kernel with x_direct / wide_rows toggled")
  p.add_argument("--shapes", default=None, metavar="IN:OUT,...",
                 help="only these [in, out] shapes (default: Llama-3.1-8B's four)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  shapes = SHAPES
  if args.shapes:
    items = args.shapes.split(",")
    bad = [i for i in items if len(i.split(":")) != 2 or not all(v.isdigit() for v in i.split(":"))]
    if bad:
      p.error(f"--shapes items {bad} must be IN:OUT (two ints)")
    shapes = [tuple(int(v) for v in i.split(":")) for i in items]
  from jaxkv import timing  # pylint: disable=import-outside-toplevel
  bw = timing.hbm_read_probe(1 << 32)["best"]
  rows = []
  for n_in, n_out in shapes:
    key = jax.random.PRNGKey(n_in * 7 + n_out)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (n_in, n_out), jnp.bfloat16) * 0.02
          for i in range(ROTATE)]
    # The Triton kernel's layout, whatever layout="auto" would pick on this GPU.
    qs = [dw.quantize_kernel(w, bits=4, group_size=args.group, layout="in_major") for w in ws]
    mosaic_ok = m4.supports(n_in, n_out, args.group, 1)[0] and is_hopper()
    mqs = [(m4.transpose_packed(q.codes), q.scale, q.zero) for q in qs] if mosaic_ok else []
    for b in (int(x) for x in args.batches.split(",")):
      x = jax.random.normal(jax.random.fold_in(key, 99), (b, n_in), jnp.bfloat16)

      def full(x, w):
        return x @ w

      def xla(x, qw):
        return x @ qw.dequantize(jnp.bfloat16)

      def kernel(x, qw):
        return qw.matmul(x)

      def mosaic(x, w):
        return m4.mosaic_int4_matmul(x, *w)

      full_bytes = n_in * n_out * 2
      draft_bytes = dw.nbytes({"w": qs[0]})
      row = dict(n_in=n_in, n_out=n_out, batch=b, bf16_floor_us=full_bytes / bw * 1e6,
                 draft_floor_us=draft_bytes / bw * 1e6, draft_bytes=draft_bytes,
                 mosaic_layout="group_major [in / 128, out, 64]" if mqs else None)
      want = jax.jit(full)(x, ws[0]).astype(jnp.float32)
      cases = [("bf16", full, ws), ("xla", xla, qs), ("kernel", kernel, qs)]
      cases += [("mosaic", mosaic, mqs)] if mqs else []
      for name, fn, args_ in cases:
        try:
          t = timing.kernel_time(fn, [(x, a) for a in args_], calls=args.calls)
        except Exception as e:  # pylint: disable=broad-except
          row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
          print(f"    {name} FAILED {row[f'{name}_error'][:160]}", flush=True)
          continue
        row[f"{name}_us"] = t["kernel"] * 1e6
        row[f"{name}_kernels"] = t["kernels"]
        row[f"{name}_max_abs_diff_vs_bf16"] = float(
            jnp.max(jnp.abs(jax.jit(fn)(x, args_[0]).astype(jnp.float32) - want)))
      rows.append(row)
      print(f"[{n_in:5d} x {n_out:5d}] B={b}: bf16 {row['bf16_us']:7.1f} us "
            f"(floor {row['bf16_floor_us']:6.1f})  xla int4 {row['xla_us']:7.1f}  "
            f"kernel int4 {row.get('kernel_us', float('nan')):7.1f} "
            f"mosaic int4 {row.get('mosaic_us', float('nan')):7.1f} "
            f"(floor {row['draft_floor_us']:6.1f})  "
            f"|diff| xla {row['xla_max_abs_diff_vs_bf16']:.2e} "
            f"kernel {row.get('kernel_max_abs_diff_vs_bf16', float('nan')):.2e} "
            f"mosaic {row.get('mosaic_max_abs_diff_vs_bf16', float('nan')):.2e}", flush=True)
    if args.sweep:
      rows += sweep(n_in, n_out, qs, args.group, args.calls)
    if args.mosaic_sweep and mqs:
      rows += mosaic_sweep(n_in, n_out, mqs, args.calls)
    if args.mosaic_ab and mqs:
      rows += mosaic_ab(n_in, n_out, mqs, args.calls)
    del ws, qs, mqs
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                     hbm_read_gb_s=bw / 1e9, rows=rows), fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  sys.exit(main())
