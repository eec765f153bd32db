"""Fused quantize + pack (Pallas Triton): full-precision tokens -> codes, scale, zero.

`quantize_pack` packs one side; `quantize_pack_kv` packs K and V in one
launch (what a cache flush runs).

Bitwise equal to `pallas_kernels.layout.quantize` (the spec, `quantize_pack_reference`
below): the same float32 operations in the same order, including the
reciprocal-multiply XLA uses for ``/ levels``, and the same non-finite rule
(`pallas_kernels.layout.group_is_bad`: a group with a NaN/inf, or whose stored scale or
zero overflows, stores NaN scale and zero and codes 0).

The planar bit layout (see `pallas_kernels.layout`) makes packing elementwise: byte
``j`` of a row is ``OR_i code[j + i*W] << i*bits``, so a kernel loads ``p``
column planes of width ``W`` and ORs them, never interleaving values. When a
per-token channel group is narrower than a plane, each plane is handled in
chunks of ``chunk = min(W, channel_group)`` columns that lie in one group.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import layout as quant
from pallas_kernels import _triton


@dataclasses.dataclass(frozen=True)
class PackConfig:
  """Launch parameters of the pack kernel.

  Attributes:
    block_t: tokens per program for per-token quantization (power of two;
      per-channel quantization always uses one token group per program).
    block_w: packed byte columns per program for per-channel quantization
      (power of two >= 2, capped at ``D * bits / 8``); each program reads
      the ``8 / bits`` channel slices that pack into those bytes. Narrow
      blocks give a flush (one group per sequence) enough programs.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining depth.
  """

  block_t: int = 64
  block_w: int = 16
  num_warps: int = 4
  num_stages: int = 1

  def __post_init__(self):
    if not _triton.is_pow2(self.block_t):
      raise ValueError(f"block_t={self.block_t} must be a power of two")
    if not _triton.is_pow2(self.block_w) or self.block_w < 2:
      raise ValueError(f"block_w={self.block_w} must be a power of two >= 2")

  @classmethod
  def default(cls, *, tokens: int, head_dim: int, axis: str) -> "PackConfig":
    """Heuristic: 64-token tiles (16 when there are few); 16-byte column blocks."""
    block_t = min(64, _triton.next_pow2(tokens))
    if tokens <= 256:
      block_t = min(block_t, 16)
    return cls(block_t=block_t, block_w=16, num_warps=4)



def _codes(x, zero, scale, levels):
  """Exact round-to-nearest codes, the reference's own `pallas_kernels.layout.round_codes`."""
  return quant.round_codes(x, zero, scale, levels)


def _when_active(kernel, *, column_blocks: bool):
  """``kernel(x_ref, *outs)`` -> ``(x_ref, active_ref, *outs)``: runs only where
  ``active[program_id(0)] > 0`` (its outputs are left unwritten elsewhere).

  Program ids are read outside the `pl.when` (interpret mode cannot evaluate
  them inside it) and passed in as ``col_block`` where the kernel needs one.
  """

  def gated(x_ref, active_ref, *outs, **kw):
    if column_blocks:
      kw = dict(kw, col_block=pl.program_id(2))

    @pl.when(active_ref[pl.program_id(0)] > 0)
    def _():
      kernel(x_ref, *outs, **kw)

  return gated


def _pack_per_token_kernel(
    # inputs
    x_ref,      # [block_t, D]
    # outputs
    codes_ref,  # [block_t, D * bits // 8] uint8 (words: [block_t, D * bits // 16] uint16)
    scale_ref,  # [block_t, D // channel_group]
    zero_ref,   # [block_t, D // channel_group]
    *,
    bits: int,
    channel_group: int,
    words: bool = False,
):
  """``words``: ``codes_ref`` is the code bytes viewed as little-endian uint16
  words (`word_view`): word ``k`` holds bytes ``2k`` and ``2k + 1``, built
  from the even and odd channels of each plane (strided loads)."""
  head_dim = x_ref.shape[-1]
  levels = (1 << bits) - 1
  inv_levels = np.float32(1.0 / levels)  # XLA rewrites `/ levels` into this.
  per_byte = 8 // bits
  width = head_dim // per_byte
  chunk = min(width, channel_group)
  scale_dtype = scale_ref.dtype

  scales, zeros = [], []
  for g in range(head_dim // channel_group):
    xg = x_ref[:, pl.ds(g * channel_group, channel_group)].astype(jnp.float32)
    lo = jnp.min(xg, axis=1)
    hi = jnp.max(xg, axis=1)
    scale_s = ((hi - lo) * inv_levels).astype(scale_dtype)
    zero_s = lo.astype(scale_dtype)
    bad = quant.group_is_bad(_triton.any_nonfinite(xg, axis=1), scale_s, zero_s)
    scales.append(jnp.where(bad, jnp.nan, scale_s).astype(scale_dtype))
    zeros.append(jnp.where(bad, jnp.nan, zero_s).astype(scale_dtype))
  scale_ref[...] = _triton.stack_last(scales)
  zero_ref[...] = _triton.stack_last(zeros)

  n = 2 if words else 1  # bytes per stored element; byte 2k + parity of word k
  for c in range(width // chunk):
    word = None
    for parity in range(n):
      packed = None
      for i in range(per_byte):
        col = i * width + c * chunk
        g = col // channel_group
        x = x_ref[:, pl.ds(col + parity, chunk // n, stride=n)].astype(jnp.float32)
        scale = scales[g].astype(jnp.float32)[:, None]
        zero = zeros[g].astype(jnp.float32)[:, None]
        code = _codes(x, zero, scale, levels)
        if i:
          code = code << np.uint8(i * bits)
        packed = code if packed is None else packed | code
      word = _word(word, packed, parity) if words else packed
    codes_ref[:, pl.ds(c * chunk // n, chunk // n)] = word


def _pack_per_channel_kernel(
    # inputs
    x_ref,      # [G, D]
    # outputs
    codes_ref,  # [G, bw] uint8: byte columns [j*bw, (j+1)*bw) of this program
    scale_ref,  # [D]
    zero_ref,   # [D]
    *,
    bits: int,
    block_w: int,
    col_block=None,  # program_id(2), when the caller read it already
    words: bool = False,
):
  """``words``: ``codes_ref`` is ``[G, bw]`` uint16 words ``[j bw, (j+1) bw)``
  of the code bytes (`word_view`; bytes ``2k``, ``2k + 1`` in word ``k``): the
  even and odd channels of each plane are packed apart (strided loads)."""
  head_dim = x_ref.shape[-1]
  levels = (1 << bits) - 1
  inv_levels = np.float32(1.0 / levels)
  per_byte = 8 // bits
  width = head_dim // per_byte
  j0 = (pl.program_id(2) if col_block is None else col_block) * block_w
  n = 2 if words else 1  # bytes per stored element; byte 2k + parity of word k
  word = None
  for parity in range(n):
    packed = _pack_channel_bytes(x_ref, scale_ref, zero_ref, bits=bits, levels=levels,
                                 inv_levels=inv_levels, width=width, block_w=block_w,
                                 first=n * j0 + parity, stride=n)
    word = _word(word, packed, parity) if words else packed
  codes_ref[...] = word


def _word(word, packed, parity: int):
  """``word | packed << 8 parity`` as uint16 (bytes ``2k + parity`` of words ``k``)."""
  part = packed.astype(jnp.uint16)
  if parity:
    part = part << np.uint16(8)
  return part if word is None else word | part


def _pack_channel_bytes(x_ref, scale_ref, zero_ref, *, bits: int, levels: int, inv_levels,
                        width: int, block_w: int, first, stride: int):
  """The ``[G, block_w]`` code bytes of channels ``i width + first + stride [0,
  block_w)`` of every plane ``i`` (their scale and zero rows stored)."""
  packed = None
  for i in range(8 // bits):
    cols = pl.ds(i * width + first, block_w, stride=stride)
    x = x_ref[:, cols].astype(jnp.float32)
    lo = jnp.min(x, axis=0)
    hi = jnp.max(x, axis=0)
    scale_s = ((hi - lo) * inv_levels).astype(scale_ref.dtype)
    zero_s = lo.astype(zero_ref.dtype)
    bad = quant.group_is_bad(_triton.any_nonfinite(x, axis=0), scale_s, zero_s)
    scale_s = jnp.where(bad, jnp.nan, scale_s).astype(scale_ref.dtype)
    zero_s = jnp.where(bad, jnp.nan, zero_s).astype(zero_ref.dtype)
    scale_ref[cols] = scale_s
    zero_ref[cols] = zero_s
    code = _codes(x, zero_s.astype(jnp.float32)[None, :],
                  scale_s.astype(jnp.float32)[None, :], levels)
    if i:
      code = code << np.uint8(i * bits)
    packed = code if packed is None else packed | code
  return packed


def _active_flags(active, lead, name):
  """``active`` (shape ``lead``) as one power-of-two int32 block of flags: the
  extra kernel input and its BlockSpec (none when ``active`` is None)."""
  if active is None:
    return (), []
  if tuple(active.shape) != tuple(lead):
    raise ValueError(f"active.shape={active.shape} must be {name}.shape[:-2]={tuple(lead)}")
  flags, spec = _triton.flags_block(active.reshape(-1))
  return (flags,), [spec]


def _check(x_shape, bits, axis, group, scale_dtype="float16"):
  if not _triton.is_int(bits) or bits not in (8, 4, 2):
    raise ValueError(f"bits={bits!r} must be 8, 4 or 2")
  if axis not in ("token", "channel"):
    raise ValueError(f"axis={axis!r} must be 'token' or 'channel'")
  quant.check_scale_dtype(scale_dtype)
  if len(x_shape) < 2:
    raise ValueError(f"x.shape={x_shape} must be [..., T, D]")
  tokens, head_dim = x_shape[-2:]
  if not _triton.is_pow2(head_dim) or head_dim * bits // 8 < 2:
    raise ValueError(f"head_dim={head_dim} must be a power of two >= {16 // bits}")
  if not _triton.is_int(group) or not _triton.is_pow2(group):
    raise ValueError(f"group={group!r} must be a power of two")
  if axis == "token" and head_dim % group:
    raise ValueError(f"head_dim={head_dim} must be divisible by channel group={group}")
  if axis == "channel" and tokens % group:
    raise ValueError(f"num tokens {tokens} must be a multiple of token group={group}")


@functools.partial(
    jax.jit,
    static_argnames=("bits", "axis", "group", "scale_dtype", "config", "interpret"))
def quantize_pack(
    x: jax.Array,  # [..., T, D]
    bits: int,
    *,
    axis: str,
    group: int,
    scale_dtype="float16",
    config: PackConfig | None = None,
    interpret: bool = False,
    active: jax.Array | None = None,
):
  """Quantizes and packs ``x`` with one Pallas kernel; drop-in for `pallas_kernels.layout.quantize`.

  Args:
    x: ``[..., T, D]`` floats; ``D`` a power of two.
    bits: 8, 4 or 2.
    axis: ``"token"`` (one scale per token per ``group`` channels) or
      ``"channel"`` (one scale per channel per ``group`` tokens; ``T % group == 0``).
    group: group size along the reduced axis (power of two).
    scale_dtype: dtype of the stored scale and zero.
    config: launch parameters; `PackConfig.default` when None.
    interpret: run the kernel in Pallas interpret mode (CPU).
    active: optional ``x.shape[:-2]`` bool/int mask: rows ``[..., :, :]`` whose
      mask is False are skipped (their outputs are undefined). A decode step
      quantizes its staged residual every step but keeps it only where a
      sequence flushes; the mask lets the other programs return at once.

  Returns:
    ``(packed [..., T, D*bits//8] uint8, scale, zero)`` bitwise equal to
    `pallas_kernels.layout.quantize` (where ``active``).
  """
  _check(x.shape, bits, axis, group, scale_dtype)
  *lead, tokens, head_dim = x.shape
  scale_dtype = jnp.dtype(scale_dtype)
  n = int(np.prod(lead, dtype=np.int64))
  x3 = x.reshape(n, tokens, head_dim)
  extra_in, extra_specs = _active_flags(active, lead, "x")

  def gate(kernel, column_blocks=False):
    return kernel if active is None else _when_active(kernel, column_blocks=column_blocks)
  packed_dim = head_dim * bits // 8
  if config is None:
    config = PackConfig.default(tokens=tokens, head_dim=head_dim, axis=axis)
  params = _triton.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages)

  if axis == "channel":
    ngroups = tokens // group
    block_w = min(config.block_w, packed_dim)
    kernel = functools.partial(gate(_pack_per_channel_kernel, column_blocks=True), bits=bits,
                               block_w=block_w)
    # Each program writes only its byte columns of the codes and the channels
    # that pack into them of scale/zero; whole rows are in its blocks, and
    # writes outside its columns do not happen, so programs never overlap.
    codes, scale, zero = _triton.pallas_call(
        kernel,
        grid=(n, ngroups, packed_dim // block_w),
        in_specs=[pl.BlockSpec((None, group, head_dim), lambda i, t, j: (i, t, 0)),
                  *extra_specs],
        out_specs=[
            pl.BlockSpec((None, group, block_w), lambda i, t, j: (i, t, j)),
            pl.BlockSpec((None, None, head_dim), lambda i, t, j: (i, t, 0)),
            pl.BlockSpec((None, None, head_dim), lambda i, t, j: (i, t, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n, tokens, packed_dim), jnp.uint8),
            jax.ShapeDtypeStruct((n, ngroups, head_dim), scale_dtype),
            jax.ShapeDtypeStruct((n, ngroups, head_dim), scale_dtype),
        ],
        compiler_params=params,
        interpret=interpret,
        name=f"jaxkv_pack_channel_int{bits}",
    )(x3, *extra_in)
    return (codes.reshape(*lead, tokens, packed_dim),
            scale.reshape(*lead, ngroups, head_dim), zero.reshape(*lead, ngroups, head_dim))

  ngroups = head_dim // group
  block_t = min(config.block_t, _triton.next_pow2(tokens))
  padded = pl.cdiv(tokens, block_t) * block_t
  if padded != tokens:
    x3 = jnp.pad(x3, ((0, 0), (0, padded - tokens), (0, 0)))
  kernel = functools.partial(
      gate(_pack_per_token_kernel), bits=bits, channel_group=group)
  codes, scale, zero = _triton.pallas_call(
      kernel,
      grid=(n, padded // block_t),
      in_specs=[pl.BlockSpec((None, block_t, head_dim), lambda i, t: (i, t, 0)),
                *extra_specs],
      out_specs=[
          pl.BlockSpec((None, block_t, packed_dim), lambda i, t: (i, t, 0)),
          pl.BlockSpec((None, block_t, ngroups), lambda i, t: (i, t, 0)),
          pl.BlockSpec((None, block_t, ngroups), lambda i, t: (i, t, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((n, padded, packed_dim), jnp.uint8),
          jax.ShapeDtypeStruct((n, padded, ngroups), scale_dtype),
          jax.ShapeDtypeStruct((n, padded, ngroups), scale_dtype),
      ],
      compiler_params=params,
      interpret=interpret,
      name=f"jaxkv_pack_token_int{bits}",
  )(x3, *extra_in)
  if padded != tokens:
    codes, scale, zero = codes[:, :tokens], scale[:, :tokens], zero[:, :tokens]
  return (codes.reshape(*lead, tokens, packed_dim),
          scale.reshape(*lead, tokens, ngroups), zero.reshape(*lead, tokens, ngroups))


def _pack_kv_kernel(
    # inputs
    xk_ref,     # [G, D] (per-channel K) | [block_t, D] (per-token K)
    xv_ref,     # [block_t, D]
    *refs,      # (active_ref [n_pad] int32,)? then the outputs:
    # outputs: k_codes, k_scale, k_zero, v_codes, v_scale, v_zero (blocks as in
    # the single-side kernels)
    k_programs: int,
    k_columns: int | None,  # byte-column blocks of per-channel K; None: per-token K
    k_kernel,
    v_kernel,
    gated: bool,
):
  """Program ``j < k_programs`` packs K unit ``j``, the others V token block ``j - k_programs``.

  Program ids are read outside the `pl.when`s (interpret mode cannot evaluate
  them inside one).
  """
  active_ref, outs = (refs[0], refs[1:]) if gated else (None, refs)
  row, j = pl.program_id(0), pl.program_id(1)
  is_k, is_v = j < k_programs, j >= k_programs
  if gated:
    live = active_ref[row] > 0
    is_k, is_v = is_k & live, is_v & live
  # Per-channel K programs tile byte columns; per-token ones take no column.
  k_kw = {} if k_columns is None else {"col_block": jnp.minimum(j, k_programs - 1) % k_columns}

  @pl.when(is_k)
  def _():
    k_kernel(xk_ref, *outs[:3], **k_kw)

  @pl.when(is_v)
  def _():
    v_kernel(xv_ref, *outs[3:])


@functools.partial(
    jax.jit, static_argnames=("k_bits", "k_axis", "k_group", "v_bits", "v_group", "scale_dtype",
                              "config", "interpret"))
def quantize_pack_kv(
    k: jax.Array,  # [..., T, D]
    v: jax.Array,  # [..., T, D]
    *,
    k_bits: int,
    k_axis: str,
    k_group: int,
    v_bits: int,
    v_group: int,
    scale_dtype="float16",
    config: PackConfig | None = None,
    interpret: bool = False,
    active: jax.Array | None = None,
):
  """Quantizes and packs K and V in one launch (a cache flush).

  The same bits as ``quantize_pack(k, k_bits, axis=k_axis, group=k_group)``
  and ``quantize_pack(v, v_bits, axis="token", group=v_group)``: one grid
  whose first programs run the K kernel (per channel: one per token group
  and byte-column block; per token: one per token block) and whose others
  run the per-token V kernel. A flush packs a few small tiles per head, so
  launches, not bytes, set its time; one launch instead of two.

  Args:
    k, v: ``[..., T, D]`` floats of one shape, ``D`` a power of two.
    k_bits, v_bits: 8, 4 or 2.
    k_axis: K's axis, ``"token"`` or ``"channel"`` (V is always per token).
    k_group, v_group: group sizes (``G`` tokens for per-channel K, channels
      for the per-token sides).
    scale_dtype, config, interpret, active: as in `quantize_pack`.

  Returns:
    ``((k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero))`` bitwise
    equal to `pallas_kernels.layout.quantize` of each side (where ``active``).
  """
  if k.shape != v.shape:
    raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must match")
  _check(k.shape, k_bits, k_axis, k_group, scale_dtype)
  _check(v.shape, v_bits, "token", v_group, scale_dtype)
  *lead, tokens, head_dim = k.shape
  scale_dtype = jnp.dtype(scale_dtype)
  n = int(np.prod(lead, dtype=np.int64))
  if config is None:
    # 4-byte K column blocks: four times the per-channel K programs of the
    # single-side default's 16 bytes, so the column min/max work of a
    # one-group flush spreads over more SMs (H100, jax 0.11.2, one flush at
    # (1, 131072, 32, 8), 16 -> 8 -> 4 bytes: kivi4 6.3 -> 3.9 -> 3.1 us,
    # kivi2 11.6 -> 7.1 -> 4.4 us; per-token K unchanged;
    # `bench/results/flush-fused-*.log`). 2-bit K takes 2-byte blocks and 8
    # warps (kivi2 on an H100: 4.45 -> 3.94 -> 3.42 us; 4-bit K: 3.03 us
    # with 4-byte blocks and 4 warps, 2.95-3.08 with the others;
    # `flush-w2-20261126-*.log`, `flush-bt-20261126-*.log`).
    channel_2bit = k_axis == "channel" and k_bits == 2
    config = dataclasses.replace(
        PackConfig.default(tokens=tokens, head_dim=head_dim, axis="token"),
        block_w=2 if channel_2bit else 4, num_warps=8 if channel_2bit else 4)
  params = _triton.compiler_params(num_warps=config.num_warps, num_stages=config.num_stages)
  block_t = min(config.block_t, _triton.next_pow2(tokens))
  padded = pl.cdiv(tokens, block_t) * block_t
  xk = k.reshape(n, tokens, head_dim)
  xv = v.reshape(n, tokens, head_dim)
  if padded != tokens:
    xv = jnp.pad(xv, ((0, 0), (0, padded - tokens), (0, 0)))
  v_blocks = padded // block_t
  v_packed = head_dim * v_bits // 8
  v_groups = head_dim // v_group
  k_packed = head_dim * k_bits // 8

  def v_block(_, j):
    return jnp.maximum(j - k_programs, 0)

  if k_axis == "channel":
    k_groups = tokens // k_group
    block_w = min(config.block_w, k_packed)
    k_columns = k_packed // block_w
    k_programs = k_groups * k_columns
    k_kernel = functools.partial(_pack_per_channel_kernel, bits=k_bits, block_w=block_w)

    def k_unit(j):
      jk = jnp.minimum(j, k_programs - 1)
      return jk // k_columns, jk % k_columns
    k_in = pl.BlockSpec((None, k_group, head_dim), lambda i, j: (i, k_unit(j)[0], 0))
    k_outs = [pl.BlockSpec((None, k_group, block_w), lambda i, j: (i, *k_unit(j))),
              pl.BlockSpec((None, None, head_dim), lambda i, j: (i, k_unit(j)[0], 0)),
              pl.BlockSpec((None, None, head_dim), lambda i, j: (i, k_unit(j)[0], 0))]
    k_shapes = [jax.ShapeDtypeStruct((n, tokens, k_packed), jnp.uint8),
                jax.ShapeDtypeStruct((n, k_groups, head_dim), scale_dtype),
                jax.ShapeDtypeStruct((n, k_groups, head_dim), scale_dtype)]
  else:
    if padded != tokens:
      xk = jnp.pad(xk, ((0, 0), (0, padded - tokens), (0, 0)))
    k_columns, k_programs = None, v_blocks
    k_groups = head_dim // k_group
    k_kernel = functools.partial(_pack_per_token_kernel, bits=k_bits, channel_group=k_group)

    def k_block(_, j):
      return jnp.minimum(j, k_programs - 1)
    k_in = pl.BlockSpec((None, block_t, head_dim), lambda i, j: (i, k_block(i, j), 0))
    k_outs = [pl.BlockSpec((None, block_t, k_packed), lambda i, j: (i, k_block(i, j), 0)),
              pl.BlockSpec((None, block_t, k_groups), lambda i, j: (i, k_block(i, j), 0)),
              pl.BlockSpec((None, block_t, k_groups), lambda i, j: (i, k_block(i, j), 0))]
    k_shapes = [jax.ShapeDtypeStruct((n, padded, k_packed), jnp.uint8),
                jax.ShapeDtypeStruct((n, padded, k_groups), scale_dtype),
                jax.ShapeDtypeStruct((n, padded, k_groups), scale_dtype)]
  v_in = pl.BlockSpec((None, block_t, head_dim), lambda i, j: (i, v_block(i, j), 0))
  v_outs = [pl.BlockSpec((None, block_t, v_packed), lambda i, j: (i, v_block(i, j), 0)),
            pl.BlockSpec((None, block_t, v_groups), lambda i, j: (i, v_block(i, j), 0)),
            pl.BlockSpec((None, block_t, v_groups), lambda i, j: (i, v_block(i, j), 0))]
  v_shapes = [jax.ShapeDtypeStruct((n, padded, v_packed), jnp.uint8),
              jax.ShapeDtypeStruct((n, padded, v_groups), scale_dtype),
              jax.ShapeDtypeStruct((n, padded, v_groups), scale_dtype)]
  extra_in, extra_specs = _active_flags(active, lead, "k")
  kernel = functools.partial(
      _pack_kv_kernel, k_programs=k_programs, k_columns=k_columns, k_kernel=k_kernel,
      v_kernel=functools.partial(_pack_per_token_kernel, bits=v_bits, channel_group=v_group),
      gated=active is not None)
  outs = _triton.pallas_call(
      kernel,
      grid=(n, k_programs + v_blocks),
      in_specs=[k_in, v_in, *extra_specs],
      out_specs=[*k_outs, *v_outs],
      out_shape=[*k_shapes, *v_shapes],
      compiler_params=params,
      interpret=interpret,
      name=f"jaxkv_pack_kv_k{k_axis}{k_bits}_v{v_bits}",
  )(xk, xv, *extra_in)
  k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = outs
  if k_axis == "token":
    k_codes, k_scale, k_zero = (a[:, :tokens] for a in (k_codes, k_scale, k_zero))
  v_codes, v_scale, v_zero = (a[:, :tokens] for a in (v_codes, v_scale, v_zero))
  k_out = (k_codes.reshape(*lead, tokens, k_packed),
           k_scale.reshape(*lead, *k_scale.shape[1:]), k_zero.reshape(*lead, *k_zero.shape[1:]))
  v_out = (v_codes.reshape(*lead, tokens, v_packed),
           v_scale.reshape(*lead, tokens, v_groups), v_zero.reshape(*lead, tokens, v_groups))
  return k_out, v_out


def quantize_pack_reference(x, bits, *, axis, group, scale_dtype="float16"):
  """The spec: `pallas_kernels.layout.quantize` (plain jnp)."""
  return quant.quantize(x, bits, axis=axis, group=group, scale_dtype=scale_dtype)
