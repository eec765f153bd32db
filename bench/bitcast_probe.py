"""Does XLA reinterpret packed uint8 codes as wider or sub-byte words for free?

The Mosaic kernel could read the cache's uint8 code rows as uint16/uint32
words (fewer, wider shared-memory loads and no per-byte widening) or as int4
(Mosaic's fast signed-int4 -> bf16 upcast) if ``lax.bitcast_convert_type``
costs nothing on the GPU. This times each reinterpretation of a 1 GiB code
array inside one jitted call and prints the compiled HLO's fusions, so a
copy (a kernel reading and writing the whole array) shows up as time.

Usage (GPU machine): ``python3 bench/bitcast_probe.py``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax import lax


def _views(codes):
  b, h, c, w = codes.shape
  return {
      "u16": lambda x: lax.bitcast_convert_type(x.reshape(b, h, c, w // 2, 2), jnp.uint16),
      "u32": lambda x: lax.bitcast_convert_type(x.reshape(b, h, c, w // 4, 4), jnp.uint32),
      "int4": lambda x: lax.bitcast_convert_type(x, jnp.int4).reshape(b, h, c, 2 * w),
  }


def main() -> None:
  tokens = 262144 if jax.devices()[0].platform == "gpu" else 8192
  codes = jax.random.randint(jax.random.PRNGKey(0), (8, 8, tokens, 64), 0, 255).astype(jnp.uint8)
  print(jax.devices()[0].device_kind, jax.__version__, f"codes {codes.nbytes / 2**30:.2f} GiB")
  for name, view in _views(codes).items():
    # The whole view is materialized (an optimization barrier, as a kernel's
    # operand would be) and then only one row is read, so any time beyond a
    # few microseconds is a copy made by the reinterpretation.
    fn = jax.jit(lambda x, _v=view: jnp.sum(
        lax.optimization_barrier(_v(x))[0, 0, 0].astype(jnp.float32)))
    try:
      hlo = fn.lower(codes).compile().as_text()
      fn(codes).block_until_ready()
      t0 = time.perf_counter()
      for _ in range(10):
        out = fn(codes)
      out.block_until_ready()
      us = (time.perf_counter() - t0) / 10 * 1e6
    except Exception as e:  # pylint: disable=broad-except
      print(f"{name:5s} FAILED {type(e).__name__}: {str(e)[:300]}")
      continue
    fusions = sum(1 for line in hlo.splitlines() if "fusion(" in line or " copy(" in line)
    print(f"{name:5s} {us:9.1f} us per call, {fusions} fusion/copy ops in the compiled HLO")


if __name__ == "__main__":
  main()
