"""A/B of split-kernel config variants: profiler kernel time, one process, one GPU.

For each shape (indices into `bench/attention.py` SHAPES) and format, times
jaxkv's Triton kernel under the default config and under named variants
(``dataclasses.replace`` of it), beside cuDNN BF16 on the same shape, and
prints a table of microseconds and ratios to cuDNN. Every variant's output is
checked against the default's (relative error), so a faster wrong variant
cannot pass unnoticed. ``default`` is the config a call without ``config=``
gets (`pallas_kernels.default_config`: the shipped table, else the heuristic). A quick probe for kernel experiments; the full
benchmark with loop timing and all baselines is `bench/attention.py`.

Example (GPU machine)::

  python bench/ab_attention.py --shapes 2,4,5 --formats kivi4,int8 \\
      --variants 'noprefetch:prefetch=False;w8:num_warps=8' --out $OUT/ab.json

``--baseline FILE``: an older copy of ``pallas_kernels/dequant_attention.py``
(e.g. ``git show HEAD~1:pallas_kernels/dequant_attention.py > /tmp/old.py``)
timed as variant ``baseline`` beside the working tree's kernel, for changes
that are not config fields.

Hierarchical views go by ``quantspec:draft`` / ``quantspec:target`` in
``--formats`` (a filled `jaxkv.KVCache`, `pallas_decode_attention(view=...)`).
VQ presets (``cq4``, ``cq2``) time the Mosaic VQ kernel with its automatic
config (``default``), the ``--mosaic`` variants on that config, and the
Triton VQ kernel (``triton``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attention as A  # noqa: E402
import pallas_kernels as pk  # noqa: E402
from jaxkv import timing  # noqa: E402
from jaxkv.formats import PRESETS  # noqa: E402


def parse_variants(text: str) -> dict[str, dict]:
  """``'name:field=value,field=value;name2:...'`` -> {name: {field: value}}."""
  out = {}
  for item in filter(None, (t.strip() for t in text.split(";"))):
    name, _, fields = item.partition(":")
    kv = {}
    for f in filter(None, fields.split(",")):
      key, _, val = f.partition("=")
      kv[key] = {"True": True, "False": False}.get(val, None)
      if kv[key] is None:
        kv[key] = int(val)
    out[name] = kv
  return out


def replace_config(default, fields: dict):
  """``dataclasses.replace(default, **fields)``; ``num_splits`` -2 / -3 / -4 / -5
  mean half / double / a quarter / four times the default's splits."""
  fields = dict(fields)
  factor = {-2: 0.5, -3: 2, -4: 0.25, -5: 4}.get(fields.get("num_splits"))
  if factor is not None:
    fields["num_splits"] = max(1, int(default.num_splits * factor))
  return dataclasses.replace(default, **fields)


@contextlib.contextmanager
def captured_output():
  """Everything written to file descriptors 1 and 2 inside the block (the
  compilers' C++ logs too) goes to a temporary file; yields a function that
  returns it as text (call it after the block)."""
  sys.stdout.flush()
  sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  captured = []
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 1)
    os.dup2(tmp.fileno(), 2)
    try:
      yield lambda: "".join(captured)
    finally:
      sys.stdout.flush()
      sys.stderr.flush()
      os.dup2(saved[0], 1)
      os.dup2(saved[1], 2)
      for fd in saved:
        os.close(fd)
      tmp.seek(0)
      captured.append(tmp.read().decode(errors="replace"))


def ptxas_registers(log: str) -> dict[str, int]:
  """``{kernel: registers per thread}`` from a ptxas info log
  (``MOSAIC_GPU_DUMP_PTXAS=1``): the occupancy a kernel can reach is
  ``65536 // (registers * threads)`` programs per SM, shared memory allowing."""
  out, current = {}, None
  for line in log.splitlines():
    m = re.search(r"Compiling entry function '([^']+)'", line)
    if m:
      current = m.group(1)
    m = re.search(r"Used (\d+) registers", line)
    if m and current:
      out[current] = int(m.group(1))
  return out


def _time_variants(name, shape, configs, call, args_, copies, cudnn, calls, ptxas=False):
  """Times ``call(*args_, config=c)`` per named config; rows with errors vs the first.
  ``ptxas``: also the register count of each Mosaic GPU kernel compiled for it."""
  rows, ref = [], None
  for vname, config in configs.items():
    fn = functools.partial(call, config=config)
    regs = {}
    try:
      if ptxas:
        with captured_output() as text:
          out = jax.block_until_ready(jax.jit(fn)(*args_))
        regs = ptxas_registers(text())
      else:
        out = jax.jit(fn)(*args_)
      ref = out if ref is None else ref
      err = A.rel_err(out, ref)
      kt = timing.kernel_time(fn, copies, calls=calls)
      us = kt["kernel"] * 1e6
      top = max(kt.get("by_name", {}).items(), key=lambda x: x[1], default=("", 0.0))
    except Exception as e:  # pylint: disable=broad-except
      print(f"  {name:16s} {vname:12s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
      continue
    rows.append(dict(shape=A.shape_id(shape), format=name, variant=vname,
                     config=(dataclasses.asdict(getattr(config, "config", config))
                             if dataclasses.is_dataclass(getattr(config, "config", config))
                             else str(config)), us=us, cudnn_us=cudnn,
                     x_cudnn=cudnn / us, rel_err_vs_default=err, main_kernel=top[0][:80],
                     main_kernel_us=top[1] * 1e6, registers=regs))
    reg_text = ("  regs " + "/".join(str(r) for r in regs.values())) if regs else ""
    print(f"  {name:16s} {vname:12s} {us:8.1f} us  {cudnn / us:5.2f}x cuDNN  err {err:.1e}"
          f"  (largest kernel {top[1] * 1e6:.1f} us of {kt['kernels']:.0f}){reg_text}",
          flush=True)
    if os.environ.get("AB_KERNELS"):
      for kname, sec in sorted(kt.get("by_name", {}).items(), key=lambda x: -x[1]):
        print(f"      {sec * 1e6:7.1f} us  {kname[:90]}", flush=True)
  return rows


class Baseline:
  """A config tag: run it through the ``--baseline`` copy of the kernel module."""

  def __init__(self, module, config):
    self.module, self.config = module, config


def load_baseline(path: str):
  """Imports a copy of ``dequant_attention.py`` as a sibling module of the package."""
  spec = importlib.util.spec_from_file_location("pallas_kernels._ab_baseline", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def vq_rows(name, q, shape, mosaic_variants, cudnn, calls, ptxas=False):
  """The Mosaic VQ kernel (automatic config and variants) and the Triton one."""
  import jaxkv  # pylint: disable=import-outside-toplevel
  from pallas_kernels import mosaic_vq_attention as mv  # pylint: disable=import-outside-toplevel
  b, t, hq, hkv, d, s = shape
  cache = A.filled_cache(name, jax.random.PRNGKey(4), b, t, hkv, d)
  fmt = cache.fmt
  auto = mv.auto_config(q_rows=hq // hkv * s, head_dim=d, k_spec=fmt.spec("k"),
                        v_spec=fmt.spec("v"), dtype=cache.k_residual.dtype, batch=b,
                        capacity=cache.storage_len, kv_heads=hkv,
                        token_group=fmt.token_group, residual=fmt.residual)
  configs = {"default": auto, "triton": "triton"}
  configs.update({f"mosaic_{k_}": replace_config(auto, kv) for k_, kv in mosaic_variants.items()})

  def call(q, cache, *, config):
    if config == "triton":
      return jaxkv.decode_attention(q, cache, implementation="triton")
    return jaxkv.decode_attention(q, cache, implementation="mosaic", config=config)

  copies = A.rotating_copies((q, cache), A.nbytes(*jax.tree.leaves(cache)))
  return _time_variants(name, shape, configs, call, (q, cache), copies, cudnn, calls, ptxas)


def view_rows(name, q, shape, variants, cudnn, calls, ptxas=False, mosaic_variants=None):
  """Triton variants of one hierarchical view on a cache filled with random K/V, and
  the Mosaic kernel: its default config (``mosaic``) and ``mosaic_variants``."""
  b, t, hq, hkv, d, _ = shape
  view = name.split(":")[1]
  cache = A.filled_cache(name, jax.random.PRNGKey(4), b, t, hkv, d)
  default, _ = pk.default_config(cache.fmt, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d,
                                 num_queries=q.shape[1], capacity=cache.storage_len, view=view)
  configs = {"default": default}
  configs.update({k_: replace_config(default, kv) for k_, kv in variants.items()})
  from jaxkv import attention  # pylint: disable=import-outside-toplevel
  mosaic = attention._mosaic_default(cache, view)  # pylint: disable=protected-access
  configs["mosaic"] = mosaic
  configs.update({f"mosaic_{k_}": replace_config(mosaic, kv)
                  for k_, kv in (mosaic_variants or {}).items()})

  def call(q, cache, *, config):
    if isinstance(config, A.ma.MosaicAttentionConfig):
      return A.jaxkv.decode_attention(q, cache, implementation="mosaic", view=view,
                                      config=config)
    return pk.pallas_decode_attention(q, cache, config=config, view=view)

  copies = A.rotating_copies((q, cache), A.nbytes(*jax.tree.leaves(cache)))
  return _time_variants(name, shape, configs, call, (q, cache), copies, cudnn, calls, ptxas)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--shapes", default="2,4,5")
  p.add_argument("--custom", default="",
                 help="extra shapes 'B,T,Hq,Hkv,D,q_len;...' timed after --shapes")
  p.add_argument("--formats", default="kivi4,kivi2,int8,k8v4")
  p.add_argument("--variants", default="noprefetch:prefetch=False")
  p.add_argument("--mosaic", default="",
                 help="Mosaic GPU variants (same syntax, fields of MosaicAttentionConfig "
                      "replaced on its default; num_splits -2 / -3 / -4 / -5: x1/2, x2, x1/4, x4)")
  p.add_argument("--baseline", default=None,
                 help="older copy of pallas_kernels/dequant_attention.py, timed as 'baseline'")
  p.add_argument("--calls", type=int, default=16)
  p.add_argument("--ptxas", action="store_true",
                 help="record each Mosaic GPU kernel's registers per thread (ptxas info, "
                      "MOSAIC_GPU_DUMP_PTXAS=1) in the rows: 65536 // (registers * 128) "
                      "one-warpgroup programs fit an SM, shared memory allowing")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  if args.ptxas:
    os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"  # read by Mosaic GPU at each compile
  variants = parse_variants(args.variants)
  baseline = load_baseline(args.baseline) if args.baseline else None
  rows = []
  shapes = [A.SHAPES[int(i)] for i in filter(None, args.shapes.split(","))]
  shapes += [tuple(int(x) for x in c.split(",")) for c in filter(None, args.custom.split(";"))]
  for shape in shapes:
    b, t, hq, hkv, d, s = shape
    q = jax.random.normal(jax.random.PRNGKey(0), (b, s, hq, d), jnp.bfloat16)
    lengths = jnp.full((b,), t, jnp.int32)
    k = jax.random.normal(jax.random.PRNGKey(1), (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(jax.random.PRNGKey(2), (b, t, hkv, d), jnp.bfloat16)
    base_args = (q, k, v, lengths)
    copies = A.rotating_copies(base_args, A.nbytes(k, v))
    cudnn = timing.kernel_time(A.cudnn_bf16, copies, calls=args.calls)["kernel"] * 1e6
    del copies, k, v
    print(f"== {A.shape_id(shape)}: cuDNN bf16 {cudnn:.1f} us", flush=True)
    for name in args.formats.split(","):
      if ":" in name:  # a hierarchical view ("quantspec:draft" / "quantspec:target")
        rows += view_rows(name, q, shape, variants, cudnn, args.calls, args.ptxas,
                          parse_variants(args.mosaic))
        continue
      if name in A.jaxkv.VQ_PRESETS:
        rows += vq_rows(name, q, shape, parse_variants(args.mosaic), cudnn, args.calls,
                        args.ptxas)
        continue
      base, _, fields = name.partition("@")  # "kivi4@scale_dtype=bfloat16": a preset, modified
      fmt = dataclasses.replace(PRESETS[base], **dict(f.split("=") for f in fields.split("+")
                                                      if f))
      data = A.random_packed(jax.random.PRNGKey(3), fmt, b, t, hkv, d)
      default, _ = pk.default_config(fmt, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d,
                                     num_queries=s, capacity=t)
      configs = {"default": default}
      if baseline is not None:
        known = {f.name for f in dataclasses.fields(baseline.DecodeAttentionConfig)}
        configs["baseline"] = Baseline(baseline, baseline.DecodeAttentionConfig(
            **{k_: v_ for k_, v_ in dataclasses.asdict(default).items() if k_ in known}))
      configs.update({k_: replace_config(default, kv) for k_, kv in variants.items()})
      mdefault = A.mosaic_default(fmt, b, t, hkv)
      for k_, kv in parse_variants(args.mosaic).items():
        kv = dict(kv)
        ok, why = A.mosaic_supported(fmt, hq, hkv, d, s)
        if ok:
          configs[f"mosaic_{k_}"] = replace_config(mdefault, kv)
        else:
          print(f"  {name:14s} mosaic_{k_}: unsupported ({why})", flush=True)
      arrays = (q, data.arrays, data.lengths)
      copies = A.rotating_copies(arrays, A.nbytes(*jax.tree.leaves(data.arrays)))

      def call(q, arrays, lengths, *, config, _fmt=fmt):
        if isinstance(config, Baseline):
          return config.module.dequant_decode_attention(q, *arrays, lengths, fmt=_fmt,
                                                        config=config.config)
        fn = A.mosaic_call if isinstance(config, A.ma.MosaicAttentionConfig) else A.jaxkv_call
        return fn(q, arrays, lengths, fmt=_fmt, config=config)

      rows += _time_variants(name, shape, configs, call, arrays, copies, cudnn, args.calls,
                             args.ptxas)
      del copies, data
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                     rows=rows), fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
