"""Which buffers does a compiled decode program copy, and how much scratch does it need?

Compiles, from abstract shapes only (no weights or cache allocated), the two programs a decode runs through:
the jitted multi-step loop (`jaxkv.decode_steps`, how `generate` decodes) and
one cache-donating step (`jaxkv.decode_step`), and lists every ``copy``
(and async ``copy-start``) in the optimized HLO above ``--min-bytes``, with
its shape, bytes, the computation it sits in and the op that caused it, and
XLA's memory analysis of each program (temporaries, arguments, outputs,
aliased bytes) beside the cache size. A copy of a weight or cache-sized
buffer inside the loop body is what the profiler shows as ``MemcpyD2D`` per
step; temporaries much larger than the cache limit the batch that fits.

Example (GPU machine)::

  python bench/hlo_copies.py --config llama-3.1-8b --layers 4 --format kivi4 \\
      --context 131072 --out /tmp/copies.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import decoding  # noqa: E402
from models import llama  # noqa: E402

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
# ``%name = dtype[dims]{layout} copy(`` or, async, ``%name = (dtype[dims]{..}, ..) copy-start(``.
_COPY = re.compile(r"%(\S+) = \(?(\w+)\[([0-9,]*)\][^=]*?\s(copy|copy-start)\(")


def lines_by_computation(hlo: str):
  """``(computation, line)`` for every line of ``hlo`` (optimized HLO text), the
  computation being the one whose body holds the line (None before the first)."""
  computation = None
  for line in hlo.splitlines():
    if line[:1] not in (" ", "") and line.rstrip().endswith("{"):  # a computation's header
      computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
    yield computation, line


def fusion_calls(hlo: str) -> list[str]:
  """The computation each ``fusion`` instruction of ``hlo`` calls, one entry per
  instruction."""
  return re.findall(r" fusion\(.*?calls=%?([\w.\-]+)", hlo)


def fusion_computations(hlo: str) -> set[str]:
  """Names of the computations ``fusion`` instructions of ``hlo`` call."""
  return set(fusion_calls(hlo))


def shape_lines(hlo: str, shape: str) -> list[tuple[str, bool]]:
  """``(computation, in_gemm)`` of every line of ``hlo`` that names ``shape``;
  ``in_gemm``: the computation is a fusion's and holds a ``dot`` (a GEMM fusion
  reading its operands in place), not a loop fusion that would materialise
  the array for a separate product."""
  fused = fusion_computations(hlo)
  lines = list(lines_by_computation(hlo))
  with_dot = {c for c, line in lines if " dot(" in line}
  return [(c, c in fused and c in with_dot) for c, line in lines if shape in line]


def copies(hlo: str, min_bytes: int) -> list[dict]:
  """Unfused copies in ``hlo`` (optimized HLO text) of at least ``min_bytes``."""
  out = []
  for computation, line in lines_by_computation(hlo):
    m = _COPY.search(line)
    if not m:
      continue
    dtype, dims = m.group(2), [int(d) for d in m.group(3).split(",") if d]
    nbytes = int(np.prod(dims or [1])) * _BYTES.get(dtype, 4)
    # A copy inside a fusion is a layout change the fused kernel does, not a memcpy.
    if nbytes < min_bytes or (computation or "").startswith(("fused", "wrapped")):
      continue
    op = re.search(r'op_name="([^"]+)"', line)
    out.append(dict(name=m.group(1), kind=m.group(4), dtype=dtype, shape=dims, bytes=nbytes,
                    computation=computation, op_name=op.group(1) if op else None))
  return out


def loop_program_args(model, kv_format, batch: int, context: int, steps: int):
  """``(args, settings)`` of `jaxkv.decode_steps`' loop program
  (``decoding._decode_steps_program``) for an abstract ``model`` (`nnx.eval_shape`):
  ``decoding._decode_steps_program.at(batch).lower(*args, settings=settings)``
  compiles it from shapes alone."""
  graphdef, state = nnx.split(model)
  cache = jax.eval_shape(lambda: model.init_cache(kv_format, batch, context))
  settings = decoding._settings(model, steps, "greedy", 1.0, None, None, None, None)  # pylint: disable=protected-access
  args = (graphdef, state, jax.ShapeDtypeStruct((batch,), jnp.int32), cache,
          jax.eval_shape(lambda: jax.random.key(0)), jax.ShapeDtypeStruct((batch, 0), jnp.int32),
          jnp.float32(1), jnp.float32(1), jnp.int32(0))
  return args, settings


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="llama-3.1-8b")
  p.add_argument("--layers", type=int, default=4, help="decoder layers (compile time)")
  p.add_argument("--format", default="kivi4")
  p.add_argument("--context", type=int, default=131072, help="cache capacity")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--steps", type=int, default=8, help="steps of the loop program")
  p.add_argument("--min-bytes", type=int, default=1 << 20)
  p.add_argument("--out", default=None, help="JSON path")
  p.add_argument("--hlo-dir", default=None, help="also write each program's optimized HLO text here")
  args = p.parse_args(argv)

  config = dataclasses.replace(llama.LlamaConfig.named(args.config), num_layers=args.layers)
  model = nnx.eval_shape(lambda: llama.random_model(config, dtype=jnp.bfloat16))
  loop_args, settings = loop_program_args(model, args.format, args.batch, args.context,
                                          args.steps)
  graphdef, state, tokens, cache = loop_args[:4]
  programs = {
      "loop": decoding._decode_steps_program.at(args.batch).lower(*loop_args, settings=settings),  # pylint: disable=protected-access
      "step": jax.jit(lambda s, t, c: jaxkv.decode_step(nnx.merge(graphdef, s), t, c),
                      donate_argnums=2,
                      compiler_options=jaxkv.decode_compiler_options(args.batch)).lower(
                          state, tokens, cache),
  }
  result = dict(config=args.config, layers=args.layers, format=args.format,
                context=args.context, batch=args.batch, device=jax.devices()[0].device_kind,
                jax_version=jax.__version__, programs={})
  cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
  result["cache_bytes"] = cache_bytes
  for name, lowered in programs.items():
    compiled = lowered.compile()
    text = compiled.as_text()
    if args.hlo_dir:
      os.makedirs(args.hlo_dir, exist_ok=True)
      with open(os.path.join(args.hlo_dir, f"{name}-{args.format}-{args.layers}l.hlo.txt"), "w") as fh:
        fh.write(text)
    found = copies(text, args.min_bytes)
    mem = compiled.memory_analysis()
    sizes = {k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0) if mem is not None else None
             for k in ("temp", "argument", "output", "alias")}
    result["programs"][name] = dict(copies=found, memory=sizes)
    total = sum(c["bytes"] for c in found)
    print(f"== {name}: {len(found)} copies >= {args.min_bytes} B, {total / 2**20:.1f} MiB; "
          + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sizes.items() if v is not None)
          + f" (cache {cache_bytes / 2**30:.2f} GiB)")
    for c in sorted(found, key=lambda c: -c["bytes"])[:25]:
      print(f"  {c['bytes'] / 2**20:9.1f} MiB {c['dtype']}{c['shape']} in {c['computation']}"
            f"  <- {c['op_name']}")
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
