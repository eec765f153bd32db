"""Group-wise 4-bit weight x activation matmul for decode (a few rows), Pallas Triton.

The draft model of QuantSpec reads every linear kernel in 4 bits. Left to
XLA, ``x @ dequantize(W4)`` on an H100 (jax 0.11.2) took 99-133 us for a
``[4096, 14336]`` kernel where the bf16 dot takes 39 us and the 4-bit bytes
allow 13 us (`bench/results/speculative-NOTES.md`). This kernel reads the
codes once and never writes a dequantized copy.

Measured (H100, jax 0.11.2, B = 1, default config before the 2-warp change):
``[4096, 14336]`` 30.4 us vs bf16 39.2 us, XLA's int4 98.9 us, floor 13.1 us;
``[4096, 4096]`` 11.8 vs 14.5; ``[4096, 1024]`` 7.2 vs 17.0.

Storage (`pack_weight`): a ``[in, out]`` kernel in groups of ``G`` input rows
(one float32 ``(scale, zero)`` per group and output column, the cache's
asymmetric rule) keeps its codes as uint8 ``[in / 2, out]``, two codes per
byte, planar inside each group: byte row ``g * G/2 + j`` holds input rows
``g * G + j`` (low nibble) and ``g * G + G/2 + j`` (high nibble). A group's
two nibble planes are then two contiguous ``[G/2, out]`` operands, each
multiplied by a contiguous half of the group's ``x`` columns:

    y[:, n] = sum_g  s[g, n] * (x_lo_g @ C_lo_g + x_hi_g @ C_hi_g)[:, n]
                   + z[g, n] * sum(x_g)

Codes become exact floats with the attention kernel's bit trick
(`dequant_attention._unpack_planes`), the dots accumulate in float32, scale
and zero apply once per group in float32.

Grid: ``(out / block_n, num_splits)``; split ``s`` takes a contiguous run of
groups and writes a float32 partial ``[rows, block_n]``; XLA sums the
``num_splits`` partials. Rows (``B * T``) are zero-padded to 16 (the smallest
dot M) up to `MAX_ROWS`; larger inputs take the reference path.
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
from pallas_kernels import layout
from pallas_kernels.dequant_attention import _unpack_planes

MAX_ROWS = 64  # rows (B * T) the kernel serves; more take the reference path


@dataclasses.dataclass(frozen=True)
class Int4MatmulConfig:
  """Launch parameters of the 4-bit matmul kernel.

  Attributes:
    block_n: output columns per program (a power of two dividing ``out``).
    num_splits: programs along the input dimension (divides the group count).
    num_warps, num_stages: Triton launch parameters.
  """

  block_n: int = 128
  num_splits: int = 1
  num_warps: int = 2
  num_stages: int = 3

  def __post_init__(self):
    if not _triton.is_pow2(self.block_n) or not 16 <= self.block_n <= 512:
      raise ValueError(f"block_n={self.block_n} must be a power of two in [16, 512]")
    _triton.check_launch(self)

  @classmethod
  def default(cls, *, n_in: int, n_out: int, group: int,
              num_sms: int | None = None) -> "Int4MatmulConfig":
    """About 4 programs per SM: 128 columns each, the groups split to fill the GPU.

    From the sweep of `bench/draft_matmul_probe.py --sweep` (H100, jax 0.11.2,
    Llama-3.1-8B shapes, B = 1): 2 warps beat 4 by 5-10 % on the
    ``[4096, 14336]`` / ``[14336, 4096]`` kernels (27.7 / 25.7 us vs 30.6 /
    28.1) and lost 5 % on ``[4096, 1024]``; 64- and 256-column blocks were
    slower, and so was unrolling 2-4 groups per loop step (tried, removed).
    """
    num_sms = num_sms or _triton.num_sms()
    block_n = next((b for b in (128, 64, 32, 16) if n_out % b == 0), 16)
    groups = n_in // group
    want = max(1, -(-4 * num_sms // (n_out // block_n)))
    splits = max(d for d in range(1, groups + 1) if groups % d == 0 and d <= want)
    return cls(block_n=block_n, num_splits=splits)


def supports(n_in: int, n_out: int, group: int, rows: int) -> tuple[bool, str]:
  """Whether the kernel serves this shape; ``(False, reason)`` if not."""
  if group % 2 or not _triton.is_pow2(group // 2) or not 16 <= group // 2 <= 256:
    return False, f"group={group}: half a group must be a power of two in [16, 256]"
  if n_in % group:
    return False, f"in={n_in} is not a multiple of group={group}"
  if n_out % 16:
    return False, f"out={n_out} is not a multiple of 16"
  if rows > MAX_ROWS:
    return False, f"{rows} rows > {MAX_ROWS} (the kernel is for decode)"
  return True, ""


# ------------------------------------------------------------------ storage
def pack_weight(codes: jax.Array, group: int) -> jax.Array:
  """``codes [in, out]`` in ``[0, 15]`` -> uint8 ``[in / 2, out]`` (group-planar nibbles)."""
  n_in, n_out = codes.shape
  if n_in % group or group % 2:
    raise ValueError(f"in={n_in} must be a multiple of an even group={group}")
  g = codes.astype(jnp.uint8).reshape(n_in // group, group, n_out)
  packed = layout.pack(jnp.swapaxes(g, 1, 2), 4, check=False)  # [ng, out, G/2]
  return jnp.swapaxes(packed, 1, 2).reshape(n_in // 2, n_out)


def unpack_weight(packed: jax.Array, group: int) -> jax.Array:
  """Inverse of `pack_weight`: uint8 ``[in, out]`` codes in ``[0, 15]``."""
  half, n_out = packed.shape
  g = packed.reshape(2 * half // group, group // 2, n_out)
  codes = layout.unpack(jnp.swapaxes(g, 1, 2), 4)         # [ng, out, G]
  return jnp.swapaxes(codes, 1, 2).reshape(2 * half, n_out)


def dequantize_groups(codes: jax.Array, scale: jax.Array, zero: jax.Array,
                      group: int) -> jax.Array:
  """``codes [in, out]`` (unpacked) -> float32 ``codes * scale + zero`` per group of rows."""
  n_in, n_out = codes.shape
  c = codes.astype(jnp.float32).reshape(n_in // group, group, n_out)
  return (c * scale[:, None, :] + zero[:, None, :]).reshape(n_in, n_out)


def int4_matmul_reference(x: jax.Array, packed: jax.Array, scale: jax.Array,
                          zero: jax.Array, *, group: int) -> jax.Array:
  """The spec (jnp, float32): ``x @ (codes * scale + zero)``, ``[..., in] -> [..., out]``."""
  w = dequantize_groups(unpack_weight(packed, group), scale, zero, group)
  return jnp.dot(x.astype(jnp.float32), w, precision=lax.Precision.HIGHEST)


# ------------------------------------------------------------------- kernel
def _kernel(x_ref, codes_ref, scale_ref, zero_ref, o_ref, *, group, groups_per_split,
            code_dtype, use_asm):
  half = group // 2
  split = pl.program_id(1)
  rows = o_ref.shape[-2]          # the dots' M (>= 16)
  block_n = o_ref.shape[-1]

  def x_cols(start):              # [rows, G/2]; a single x row is broadcast, not padded
    x = x_ref[:, pl.ds(start, half)]
    return jnp.broadcast_to(x, (rows, half)) if x_ref.shape[0] == 1 else x

  def dot(a, b):
    return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

  def body(i, acc):
    g = split * groups_per_split + i
    c = codes_ref[pl.ds(g * half, half), :]                       # [G/2, bn] uint8
    lo, hi = _unpack_planes(c, 4, code_dtype, use_asm)            # exact codes
    x_lo, x_hi = x_cols(g * group), x_cols(g * group + half)     # [rows, G/2]
    d = dot(x_lo.astype(code_dtype), lo) + dot(x_hi.astype(code_dtype), hi)
    x_sum = (jnp.sum(x_lo.astype(jnp.float32), axis=1)
             + jnp.sum(x_hi.astype(jnp.float32), axis=1))       # [rows]
    sc = scale_ref[pl.ds(g, 1), :]                                # [1, bn] float32
    zr = zero_ref[pl.ds(g, 1), :]
    return acc + d * sc + x_sum[:, None] * zr

  acc = lax.fori_loop(0, groups_per_split, body, jnp.zeros((rows, block_n), jnp.float32))
  o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("group", "config", "interpret"))
def int4_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array, zero: jax.Array, *,
                group: int, config: Int4MatmulConfig | None = None,
                interpret: bool = False) -> jax.Array:
  """``x @ W`` for a 4-bit group-wise ``W`` stored by `pack_weight`.

  Args:
    x: ``[..., in]`` (bfloat16, float16 or float32), at most `MAX_ROWS` rows.
    packed: uint8 ``[in / 2, out]``; scale, zero: float32 ``[in / group, out]``.
    group: input rows per (scale, zero).
    config: launch parameters (default: `Int4MatmulConfig.default`).
    interpret: Pallas interpret mode (CPU).
  Returns:
    ``[..., out]`` float32 (accumulated in float32; the caller casts).
  """
  *lead, n_in = x.shape
  n_out = packed.shape[1]
  rows = int(np.prod(lead, dtype=np.int64))
  ok, why = supports(n_in, n_out, group, rows)
  if not ok:
    raise ValueError(f"int4_matmul: {why}")
  if packed.shape != (n_in // 2, n_out) or packed.dtype != jnp.uint8:
    raise ValueError(f"packed {packed.shape} {packed.dtype} must be uint8 [{n_in // 2}, {n_out}]")
  groups = n_in // group
  if scale.shape != (groups, n_out) or zero.shape != (groups, n_out):
    raise ValueError(f"scale {scale.shape} / zero {zero.shape} must be [{groups}, {n_out}]")
  if config is None:
    config = Int4MatmulConfig.default(n_in=n_in, n_out=n_out, group=group)
  if n_out % config.block_n or groups % config.num_splits:
    raise ValueError(f"{config} does not tile out={n_out} / {groups} groups")
  code_dtype = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
  m = max(16, _triton.next_pow2(rows))
  # One row (a decode step at B = 1) is read once per step and broadcast to
  # the dot's 16 rows in registers; more rows are zero-padded in HBM.
  x_rows = 1 if rows == 1 else m
  x2 = jnp.pad(x.reshape(rows, n_in), ((0, x_rows - rows), (0, 0)))
  bn, splits = config.block_n, config.num_splits
  part = _triton.pallas_call(
      functools.partial(_kernel, group=group, groups_per_split=groups // splits,
                        code_dtype=code_dtype, use_asm=not interpret),
      grid=(n_out // bn, splits),
      in_specs=[
          pl.BlockSpec((x_rows, n_in), lambda n, s: (0, 0)),
          pl.BlockSpec((n_in // 2, bn), lambda n, s: (0, n)),
          pl.BlockSpec((groups, bn), lambda n, s: (0, n)),
          pl.BlockSpec((groups, bn), lambda n, s: (0, n)),
      ],
      out_specs=pl.BlockSpec((None, m, bn), lambda n, s: (s, 0, n)),
      out_shape=jax.ShapeDtypeStruct((splits, m, n_out), jnp.float32),
      compiler_params=_triton.compiler_params(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="jaxkv_int4_matmul",
  )(x2, packed, scale.astype(jnp.float32), zero.astype(jnp.float32))
  return part.sum(axis=0)[:rows].reshape(*lead, n_out)


__all__ = ["Int4MatmulConfig", "MAX_ROWS", "dequantize_groups", "int4_matmul", "int4_matmul_reference",
           "pack_weight", "supports", "unpack_weight"]
