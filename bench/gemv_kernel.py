"""bf16 weight x a few activation rows (decode's linear layers), Pallas Triton:
an experiment of `bench/gemv_probe.py`, not used by the library (XLA's own
split-K GEMM was faster at every Llama-3.1-8B shape on an H200,
`bench/results/e2e-NOTES.md`, 2026-11-28).

A decode step at a small batch reads every weight once; the product is a
matrix-vector product bound by the weight bytes. This kernel streams the
``[in, out]`` kernel in ``[block_k, block_n]`` tiles, ``num_stages`` deep,
and accumulates in float32.

Grid: ``(out / block_n, num_splits)``; split ``s`` takes a contiguous run of
input rows and writes a float32 partial ``[rows, block_n]``; the caller sums
the partials (XLA fuses the sum into what consumes the product). Rows
(``B * T``) are zero-padded to 16 (the smallest dot M); a single row is read
once and broadcast in registers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton

MAX_ROWS = 16  # rows (B * T) the kernel serves; more take XLA's GEMM


@dataclasses.dataclass(frozen=True)
class GemvConfig:
  """Launch parameters of the bf16 GEMV kernel.

  Attributes:
    block_n: output columns per program (a power of two dividing ``out``).
    block_k: input rows per loop step (a power of two).
    num_splits: programs along the input dimension (``in`` divisible by
      ``num_splits * block_k``).
    num_warps, num_stages: Triton launch parameters.
  """

  block_n: int = 128
  block_k: int = 128
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 4

  def __post_init__(self):
    for name in ("block_n", "block_k"):
      v = getattr(self, name)
      if not _triton.is_pow2(v) or not 16 <= v <= 1024:
        raise ValueError(f"{name}={v} must be a power of two in [16, 1024]")
    _triton.check_launch(self)

  @classmethod
  def default(cls, *, n_in: int, n_out: int, num_sms: int | None = None) -> "GemvConfig":
    """About 4 programs per SM: 128 columns each, the input split to fill the GPU."""
    num_sms = num_sms or _triton.num_sms()
    block_n = next((b for b in (128, 64, 32, 16) if n_out % b == 0), 16)
    block_k = next((b for b in (128, 64, 32, 16) if n_in % b == 0), 16)
    steps = n_in // block_k
    want = max(1, -(-4 * num_sms // (n_out // block_n)))
    splits = max(d for d in range(1, steps + 1) if steps % d == 0 and d <= want)
    return cls(block_n=block_n, block_k=block_k, num_splits=splits)


def supports(n_in: int, n_out: int, rows: int) -> tuple[bool, str]:
  """Whether the kernel serves this shape; ``(False, reason)`` if not."""
  if n_in % 16 or n_out % 16:
    return False, f"in={n_in} and out={n_out} must be multiples of 16"
  if rows > MAX_ROWS:
    return False, f"{rows} rows > {MAX_ROWS} (the kernel is for decode)"
  return True, ""


def gemv_reference(x: jax.Array, w: jax.Array) -> jax.Array:
  """The spec (jnp, float32): ``x [..., in] @ w [in, out]``."""
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST)


def _kernel(x_ref, w_ref, o_ref, *, block_k, steps):
  split = pl.program_id(1)
  rows, block_n = o_ref.shape[-2], o_ref.shape[-1]

  def body(i, acc):
    k0 = (split * steps + i) * block_k
    w = w_ref[pl.ds(i * block_k, block_k), :]                 # [bk, bn]
    x = x_ref[:, pl.ds(k0, block_k)]                          # [xr, bk]
    if x_ref.shape[0] == 1:
      x = jnp.broadcast_to(x, (rows, block_k))
    return acc + jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)

  o_ref[...] = lax.fori_loop(0, steps, body, jnp.zeros((rows, block_n), jnp.float32))


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def gemv_partials(x: jax.Array, w: jax.Array, *, config: GemvConfig | None = None,
                  interpret: bool = False) -> jax.Array:
  """float32 partials ``[num_splits, rows, out]`` of ``x [..., in] @ w [in, out]``
  (their sum over the first axis is the product)."""
  *lead, n_in = x.shape
  n_out = w.shape[-1]
  rows = int(np.prod(lead, dtype=np.int64))
  ok, why = supports(n_in, n_out, rows)
  if not ok:
    raise ValueError(f"gemv: {why}")
  if w.shape != (n_in, n_out):
    raise ValueError(f"w {w.shape} must be [{n_in}, {n_out}]")
  if config is None:
    config = GemvConfig.default(n_in=n_in, n_out=n_out)
  bn, bk, splits = config.block_n, config.block_k, config.num_splits
  if n_out % bn or n_in % (bk * splits):
    raise ValueError(f"{config} does not tile in={n_in}, out={n_out}")
  m = 16
  x_rows = 1 if rows == 1 else m
  x2 = jnp.pad(x.reshape(rows, n_in), ((0, x_rows - rows), (0, 0)))
  per = n_in // splits
  part = pl.pallas_call(
      functools.partial(_kernel, block_k=bk, steps=per // bk),
      grid=(n_out // bn, splits),
      in_specs=[
          pl.BlockSpec((x_rows, n_in), lambda n, s: (0, 0)),
          pl.BlockSpec((per, bn), lambda n, s: (s, n)),
      ],
      out_specs=pl.BlockSpec((None, m, bn), lambda n, s: (s, 0, n)),
      out_shape=jax.ShapeDtypeStruct((splits, m, n_out), jnp.float32),
      compiler_params=_triton.compiler_params(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="jaxkv_gemv",
  )(x2, w)
  return part[:, :rows]


def gemv(x: jax.Array, w: jax.Array, *, config: GemvConfig | None = None,
         out_dtype=None, interpret: bool = False) -> jax.Array:
  """``x [..., in] @ w [in, out]`` accumulated in float32, cast to ``out_dtype``
  (default ``x.dtype``)."""
  part = gemv_partials(x, w, config=config, interpret=interpret)
  y = part.sum(axis=0).reshape(*x.shape[:-1], w.shape[-1])
  return y.astype(out_dtype or x.dtype)


__all__ = ["GemvConfig", "MAX_ROWS", "gemv", "gemv_partials", "gemv_reference", "supports"]
