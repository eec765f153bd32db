"""The Mosaic GPU kernel inside a lowered JAX call, read on any machine (no GPU).

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the Pallas
Mosaic GPU lowering on the CPU too; the kernel travels in the custom call's
``module`` attribute as MLIR bytecode. `module_text` parses it back (jax's MLIR
context plus the Mosaic GPU dialect: jax internals, present in jax 0.10.2) and
`launch_smem` reads the dynamic shared memory its launch asks for, which with
the register count (`bench/ab_attention.py --ptxas`, on the GPU) decides how
many programs share an SM. Usage (CPU)::

  python bench/mosaic_module.py --formats kivi4,kivi2 --shapes '1,131072;8,32768;48,32768'

prints, per format and (B, T) at Hq 32 / Hkv 8 / D 128, the default config's
dynamic shared memory and the programs per SM it allows (228 KB per SM, 1 KB
reserved per program; Hopper).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

SMEM_PER_SM = 228 * 1024   # Hopper (H100, H200): shared memory per SM
SMEM_RESERVED = 1024       # reserved by the system per resident program


def module_text(lowered_text: str, *, masked: bool = False) -> str:
  """The Mosaic GPU kernel module of a lowered call's text (one kernel) as MLIR
  text; ``masked``: SSA names, locations and every integer literal replaced,
  so two kernels that differ only in sizes and constants compare equal.
  ImportError where this jax lacks the internals used to parse it."""
  from jax._src.interpreters import mlir as jax_mlir  # pylint: disable=import-outside-toplevel
  from jax._src.lib import mosaic_gpu_dialect  # pylint: disable=import-outside-toplevel
  from jax._src.lib.mlir import ir  # pylint: disable=import-outside-toplevel
  (escaped,) = re.findall(r'module = "((?:[^"\\]|\\.)*)"', lowered_text)
  raw = bytearray()
  i = 0
  while i < len(escaped):  # MLIR text escapes: \XX hex bytes, \c quoted chars
    if escaped[i] == "\\" and re.fullmatch(r"[0-9A-Fa-f]{2}", escaped[i + 1:i + 3]):
      raw.append(int(escaped[i + 1:i + 3], 16))
      i += 3
    elif escaped[i] == "\\":
      raw.append(ord(escaped[i + 1]))
      i += 2
    else:
      raw.append(ord(escaped[i]))
      i += 1
  ctx = jax_mlir.make_ir_context()
  with ctx, ir.Location.unknown():
    ctx.allow_unregistered_dialects = True
    mosaic_gpu_dialect.register_dialect(ctx)
    text = str(ir.Module.parse(bytes(raw)))
  if masked:
    text = re.sub(r"loc\([^)]*\)", "", text)
    text = re.sub(r"%[\w#]+", "%v", text)
    text = re.sub(r"\d+", "N", text)
  return text


def launch_smem(text: str) -> int:
  """Dynamic shared memory bytes of the kernel launch in `module_text`'s output
  (the ``gpu.launch`` op's last operand, a constant)."""
  (operands,) = re.findall(r'gpu\.launch"\(([^)]*)\)', text)
  name = operands.split(", ")[-1]
  (value,) = re.findall(re.escape(name) + r' = "[\w.]*arith\.constant"\(\) \{value = (\d+)', text)
  return int(value)


def programs_per_sm(smem: int) -> int:
  """Programs of ``smem`` dynamic shared memory bytes that fit one Hopper SM."""
  return SMEM_PER_SM // (smem + SMEM_RESERVED)


def _lower_default(fmt_name: str, batch: int, tokens: int):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import jaxkv  # pylint: disable=import-outside-toplevel
  from jaxkv import attention as jattn  # pylint: disable=import-outside-toplevel
  cache = jaxkv.KVCache.init(fmt_name, batch, 8, 128, 1024, jnp.bfloat16, use_kernel=False)
  k_side, v_side = jattn._mosaic_specs(cache)  # pylint: disable=protected-access
  from pallas_kernels.mosaic_attention import MosaicAttentionConfig  # pylint: disable=import-outside-toplevel
  config = MosaicAttentionConfig.default(batch=batch, tokens=tokens, kv_heads=8,
                                         k_bits=k_side.bits, v_bits=v_side.bits,
                                         token_group=cache.fmt.token_group,
                                         residual=cache.fmt.residual)
  q = jnp.zeros((batch, 1, 32, 128), jnp.bfloat16)

  def f(q, c):
    return jattn._mosaic_attention(q, c, scale=None, config=config,  # pylint: disable=protected-access
                                   seq_bad=c.nonfinite)

  lowered = jax.jit(f).trace(q, cache).lower(lowering_platforms=("cuda",)).as_text()
  return config, module_text(lowered)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--formats", default="kivi4,kivi2")
  p.add_argument("--shapes", default="1,131072;8,32768;48,32768", help="'B,T;B,T;...'")
  args = p.parse_args(argv)
  for fmt_name in args.formats.split(","):
    for item in filter(None, args.shapes.split(";")):
      batch, tokens = (int(x) for x in item.split(","))
      config, text = _lower_default(fmt_name, batch, tokens)
      smem = launch_smem(text)
      print(f"{fmt_name:8s} B={batch:<4d} T={tokens:<7d} block_k={config.block_k} "
            f"splits={config.num_splits} stages={config.max_concurrent_steps}: "
            f"{smem} B dynamic shared memory, {programs_per_sm(smem)} programs per SM by "
            "shared memory", flush=True)
  return 0


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  sys.exit(main())
