"""Register builders of the Mosaic GPU kernels: codes -> ``wgmma`` operands (inline PTX).

- `dequant_codes`: 4/2-bit codes -> bfloat16 registers, one shared load per row
  (below);
- `dequant_codes_rows`: 4-bit weight tiles with one scale and zero per row
  folded in (`pallas_kernels.mosaic_int4_matmul`; oracle
  `registers_rows_reference`; compiled only through that kernel's tests);
- `dequant_codes_t`: the transposed tile (``[D, tokens]``, the value MMA's A
  operand) through ``ldmatrix.trans`` of swizzled code tiles
  (`vt_permutation`, oracle `registers_t_reference`);
- `gather_codebook`: VQ codes -> their centroids from a shared-memory codebook,
  one conflict-free ``ld.shared`` per code (`vq_book_rows`, `vq_permutation`,
  oracle `gather_reference`);
- `widen_columns`, `warpgroup_any` (an OR over a warpgroup in one
  ``bar.red``).

`dequant_codes` (`bench/results/mosaic-NOTES.md`, "v3"): the packed K tile of the cache, ``[64, D/2]`` bytes in shared memory
(planar nibbles: byte ``b`` of a row holds channel ``b`` in its low nibble
and channel ``D/2 + b`` in its high nibble, as everywhere in jaxkv), becomes
the ``[64, D]`` bfloat16 A operand of ``wgmma`` in ``WGMMA_LAYOUT`` without
any shuffle or shared-memory round trip:

- thread ``(warp, lane)`` of the warpgroup owns rows ``16 warp + lane // 4``
  and ``+ 8`` and, for ``c = lane % 4``, the bytes ``[c D/8, (c + 1) D/8)`` of
  each: one 16-byte (D = 128) or 8-byte (D = 64) shared load per row;
- each 32-bit word gives four bf16 pairs, ``(w >> s) & 0x000F000F | 0x43004300``
  (``128 + code`` in each half) minus ``128``: two instructions per pair;
- register ``j`` (columns ``8 j + 2 c + {0, 1}`` of the MMA) takes pair
  ``j % 4`` of word ``j // 4``, so the MMA's column order is a fixed
  permutation of the channels (`code_permutation`): the kernel permutes q's
  channels (the B operand) once instead of moving any code.

2-bit codes (``bits=2``: four planes of ``D/4`` channels per byte) work the
same way with the mask ``0x00030003`` and eight pairs per word. The numpy
oracle of the register contents is `registers_reference`. Everything here is
compiled and tested on an H100 and an H200 (jax 0.11.2).
Hardware facts this rests on (sm_90): ``lop3.b32`` with LUT ``0xEA`` is
``(a & b) | c``; ``sub.rn.bf16x2`` is exact here (both operands are
bfloat16 integers below 256).
"""

from __future__ import annotations

import functools
import itertools

import jax
import numpy as np

try:
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
except ImportError:  # pragma: no cover
  plgpu = None

import jax.numpy as jnp
from jax.experimental import pallas as pl

_ROWS = 64  # rows of one warpgroup's A operand
# (w & 0x000F000F) | 0x43004300, then minus 0x43004300 (128.0 in each bf16 half).
_ASM = ("{{\n.reg .b32 t, m;\nmov.b32 m, 0x43004300;\n"
        "lop3.b32 t, $1, {mask}, m, 0xEA;\nsub.rn.bf16x2 $0, t, m;\n}}")
_MASK = {4: "0x000F000F", 2: "0x00030003"}
# Pairs (lo.0, hi.0) and (lo.1, hi.1) of two 32-bit words of 16-bit values, as
# bfloat16 pairs: a byte permute, or for float16 rows a widening and one
# rounding to bfloat16 (cvt.rn.bf16x2.f32 d, a, b puts b in the low half).
_PAIR_BF16 = ("prmt.b32 $0, $1, $2, 0x5410;", "prmt.b32 $0, $1, $2, 0x7632;")
_PAIR_F16 = tuple(
    "{\n.reg .b16 a, b, c, d;\n.reg .f32 x, y;\nmov.b32 {a, b}, $1;\nmov.b32 {c, d}, $2;\n"
    f"cvt.f32.f16 x, {u};\ncvt.f32.f16 y, {v};\ncvt.rn.bf16x2.f32 $0, y, x;\n}}"
    for u, v in (("a", "c"), ("b", "d")))
# The same, then code * scale + zero ($2, $3: bf16 pairs) with one rounding.
_ASM_AFFINE = ("{{\n.reg .b32 t, m;\nmov.b32 m, 0x43004300;\n"
               "lop3.b32 t, $1, {mask}, m, 0xEA;\nsub.rn.bf16x2 t, t, m;\n"
               "fma.rn.bf16x2 $0, t, $2, $3;\n}}")

# Subnormal codes (``subnormal=True``): a code ``c`` in the mantissa of a
# bfloat16 whose exponent field is zero *is* the subnormal ``c * 2**-133``, so
# one ``and`` makes the value (no magic number to subtract, no ``sub`` per
# pair). The MMAs are linear: the other operand carries the power of two
# back. Hopper's ``fma.rn.bf16x2`` and bf16 ``wgmma`` take subnormal inputs
# exactly (checked by the compiled probes in `tests/test_mosaic_dequant.py`).
SUBNORMAL_EXP = 133
# With an affine (K): registers = (code * scale + zero) * 2**-K_SHIFT, one
# rounding, from scale * 2**(133 - K_SHIFT) and zero * 2**-K_SHIFT (exact
# power-of-two products, once per group); the caller multiplies q by
# 2**K_SHIFT. Exact while scale < 2**59, |q| < 2**64 and |code * scale + zero|
# >= 2**-62 (below that the result is a bfloat16 subnormal: absolute error
# <= 2**-70).
K_SHIFT = 64
# Without an affine (V, scales folded into P): the value MMA takes P times
# 2**P_SHIFT and its product comes out times 2**(P_SHIFT - SUBNORMAL_EXP)
# (= 2**-53: f32 products of |O| >= 2**-73 stay normal); exact while
# ``p * scale < 2**47`` (``p <= e**8`` with the lazy max: V scales < 2**35).
P_SHIFT = 80
_ASM_SUB = "and.b32 $0, $1, {mask};"
_ASM_SUB_AFFINE = ("{{\n.reg .b32 t;\nand.b32 t, $1, {mask};\n"
                   "fma.rn.bf16x2 $0, t, $2, $3;\n}}")
# x * factor ($2: a bf16 power of two in both halves) + (-0.0): exact.
_ASM_POW2 = "{\n.reg .b32 z;\nmov.b32 z, 0x80008000;\nfma.rn.bf16x2 $0, $1, $2, z;\n}"
# Lane $2's value of $1 (the whole warp takes part).
_ASM_SHFL = "shfl.sync.idx.b32 $0, $1, $2, 31, -1;"

# Two 4-bit planes of a hierarchical code (``lower``: QuantSpec's target view,
# `pallas_kernels.hierarchical`): the upper and lower codes of a pair masked
# alike ($1, $2), joined to the 8-bit code ``16 C_U + C_L'`` by one exact fma
# (each half ``c * 2**(e - 133)`` with ``c < 256``: a bf16 subnormal or in the
# first normal binade, whose spacing is the same 2**(e - 133)).
_JOIN = "mov.b32 h, 0x41804180;\nand.b32 t, $1, {mask};\nand.b32 u, $2, {mask};\n" \
        "fma.rn.bf16x2 t, t, h, u;\n"
_ASM_JOIN = "{{\n.reg .b32 t, u, h;\n" + _JOIN + "mov.b32 $0, t;\n}}"
_ASM_JOIN_AFFINE = "{{\n.reg .b32 t, u, h;\n" + _JOIN + "fma.rn.bf16x2 $0, t, $3, $4;\n}}"


def _zero_pair_asm(rows_f16: bool, off: int) -> str:
  """PTX of the target view's zero pair ``zero - scale / 2`` (float32, then one
  rounding to bfloat16) of elements ``off`` and ``off + 2`` of a quad: ``$1, $2``
  the scale quad's words, ``$3, $4`` the zero quad's (`_quad_pairs`' order)."""
  a, c, e, g = ("a", "c", "e", "g") if off == 0 else ("b", "d", "f", "h")
  if rows_f16:
    cvt = "".join(f"cvt.f32.f16 {x}, {y};\n" for x, y in
                  (("sx", a), ("sy", c), ("zx", e), ("zy", g)))
  else:  # bfloat16 bits are the upper half of the float32's
    cvt = "".join(f"mov.b32 w, {{n, {y}}};\nmov.b32 {x}, w;\n" for x, y in
                  (("sx", a), ("sy", c), ("zx", e), ("zy", g)))
  return ("{\n.reg .b16 a, b, c, d, e, f, g, h, n;\n.reg .f32 sx, sy, zx, zy;\n.reg .b32 w;\n"
          "mov.b16 n, 0;\nmov.b32 {a, b}, $1;\nmov.b32 {c, d}, $2;\n"
          "mov.b32 {e, f}, $3;\nmov.b32 {g, h}, $4;\n" + cvt
          + "fma.rn.f32 zx, sx, 0fBF000000, zx;\nfma.rn.f32 zy, sy, 0fBF000000, zy;\n"
          "cvt.rn.bf16x2.f32 $0, zy, zx;\n}")


def _bf16_pow2_pair(exp: int):
  """``2**exp`` in both halves of a bf16x2 register, as an i32 constant."""
  if not -126 <= exp <= 127:
    raise ValueError(f"2**{exp} is not a normal bfloat16")
  half = (exp + 127) << 7
  return mgpu_utils.c(half << 16 | half, ir.IntegerType.get_signless(32))


def _byte_mask(offset: int, bits: int, byte_masks: bool) -> tuple[int, str, int]:
  """``(shift, mask, exponent)`` of the pair at bit ``offset`` of each 16-bit half.

  Plain: shift by ``offset``, mask the low ``bits``: the value is ``code``.
  ``byte_masks``: shift by whole bytes only and mask the code where it sits in
  its byte: ``code * 2**(offset % 8)`` (as a bf16 subnormal, or the first
  normal binade for bit 7: both are spaced 2**-133, so the value is exact).
  """
  base = _MASK[bits]
  if not byte_masks:
    return offset, base, 0
  inner = offset % 8
  lo = int(base[2:6], 16) << inner
  return offset - inner, f"0x{lo:04X}{lo:04X}", inner


def code_permutation(head_dim: int, bits: int = 4) -> np.ndarray:
  """``perm[col]``: the channel that MMA column ``col`` holds after `dequant_codes`."""
  if head_dim not in (64, 128):
    raise ValueError(f"head_dim={head_dim} must be 64 or 128")
  if bits not in _MASK:
    raise ValueError(f"bits={bits} must be 4 or 2")
  width = head_dim * bits // 8                # code bytes per row (channels per plane)
  span = width // 4                           # bytes per thread per row
  pairs = 16 // bits                          # bf16 pairs per 32-bit word
  perm = np.empty(head_dim, np.int64)
  for c in range(4):
    for j in range(head_dim // 8):
      w, k = divmod(j, pairs)
      shift = bits * k                        # pair k: bits [shift, shift + bits) of each half
      for e in range(2):
        byte = c * span + 4 * w + shift // 8 + 2 * e
        perm[8 * j + 2 * c + e] = (shift % 8) // bits * width + byte
  return perm


def _planar_channels(codes: np.ndarray, bits: int) -> np.ndarray:
  """``[rows, D]`` float64 codes of planar ``[rows, D bits/8]`` uint8 rows."""
  codes = np.asarray(codes)
  mask = (1 << bits) - 1
  return np.concatenate([(codes >> (bits * p)) & mask for p in range(8 // bits)],
                        axis=-1).astype(np.float64)


def registers_reference(codes: np.ndarray, bits: int = 4, scale=None, zero=None,
                        lower=None) -> np.ndarray:
  """``[rows, D]`` float values `dequant_codes` holds: code of channel ``perm[col]``
  (times its scale plus its zero, rounded once to bfloat16, when given).
  ``lower``: the lower-plane tile of hierarchical codes (`dequant_codes`'
  ``lower_smem``): ``(16 C_U + C_L') * scale / 16 + (zero - scale / 2)``, the
  zero term rounded to bfloat16 from float32 first, as the kernel does."""
  codes = np.asarray(codes)
  width = codes.shape[-1]
  channels = _planar_channels(codes, bits)                              # [rows, D] planar
  if lower is not None:
    channels = 16.0 * channels + _planar_channels(lower, bits)
  if scale is not None:  # float16 rows are rounded to bfloat16 first, as the kernel does
    def bf16(x):
      return np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float64).reshape(-1)
    if lower is None:
      channels = channels * bf16(scale) + bf16(zero)
    else:
      s32, z32 = np.asarray(scale, np.float32), np.asarray(zero, np.float32)
      channels = channels * (bf16(scale) / 16.0) + bf16(z32 - s32 * np.float32(0.5))
    channels = channels.astype(jnp.bfloat16).astype(np.float64)  # ml_dtypes: round to nearest
  return channels[..., code_permutation(width * 8 // bits, bits)].astype(np.float32)


WIDE_ROW = 128  # bytes per row of a wide code tile (`wide_rows`)


def fits_wide_row(width: int) -> bool:
  """Whether code rows of ``width`` bytes can be read as `WIDE_ROW`-byte rows
  (several tokens per row; the same bytes in the same order)."""
  return width < WIDE_ROW and WIDE_ROW % width == 0


def _code_tile(codes_smem, head_dim: int, bits: int, head_dims) -> tuple[int, int, bool]:
  """``(width, rows, wide)`` of a ``[64 | 128, D*bits/8]`` uint8 code tile, or of
  the same bytes as a *wide* tile ``[rows * width / 128, 128]`` (`WIDE_ROW`:
  ``128 / width`` tokens per row, what TMA copies at full bandwidth);
  ValueError naming what does not fit (``head_dims``: the head sizes the
  caller serves)."""
  if head_dim not in head_dims:
    raise ValueError(f"head_dim={head_dim} must be one of {head_dims}")
  if bits not in _MASK:
    raise ValueError(f"bits={bits} must be 4 or 2")
  width = head_dim * bits // 8
  shape = tuple(codes_smem.shape)
  if len(shape) != 2:
    raise ValueError(f"codes_smem must be a 2-D uint8 tile, got {codes_smem.dtype} {shape}")
  # A wide tile carries no width of its own: it is read as head_dim * bits / 8
  # bytes per token, which the caller states.
  wide = fits_wide_row(width) and shape[1] == WIDE_ROW
  rows = shape[0] * WIDE_ROW // width if wide else shape[0]
  if (rows not in (_ROWS, 2 * _ROWS)
      or shape[1] != (WIDE_ROW if wide else width) or codes_smem.dtype != jnp.uint8):
    raise ValueError(f"codes_smem must be uint8 [64 | 128, {width}] (or those bytes as "
                     f"rows of {WIDE_ROW}), got {codes_smem.dtype} {shape}")
  return width, rows, wide


def dequant_codes(codes_smem, head_dim: int, bits: int = 4, scale_smem=None, zero_smem=None,
                  *, subnormal: bool = False, byte_masks: bool = False,
                  shuffle_scales: bool = False, lower_smem=None):
  """``[rows, D]`` bfloat16 codes (WGMMA layout) of a ``[rows, D*bits/8]`` uint8 smem tile.

  ``rows`` is 64 or 128 (two warpgroup row tiles).

  ``codes_smem`` must be untiled and unswizzled (row stride ``D*bits/8``
  bytes, or the same bytes as a wide tile of `WIDE_ROW`-byte rows); a warp's
  8 rows x 4 threads then read contiguous bytes, so the loads are free of
  bank conflicts. Columns follow `code_permutation`.

  With ``scale_smem`` and ``zero_smem`` (``[1, D]`` rows in *channel*
  order, untiled, bfloat16 or float16 (rounded to bfloat16 once): a
  per-channel side's group), the values are ``code * scale + zero`` of each
  column's channel, one ``fma.rn.bf16x2`` per pair (a single rounding); each
  thread reads the scale/zero of its own columns with one 8-byte load per
  four channels, so no permuted copy of the rows is needed.

  ``subnormal``: one ``and`` per pair instead of ``lop3`` + ``sub``; the
  registers hold ``code * 2**-SUBNORMAL_EXP`` (no affine) or ``(code * scale
  + zero) * 2**-K_SHIFT`` (with one: each thread scales its scale/zero pairs by
  exact powers of two once per tile); see `K_SHIFT` for the range.

  ``byte_masks`` (with ``subnormal`` and an affine): each word is shifted by
  whole bytes only (one shift per two 4-bit or four 2-bit pairs) and a code
  masked where it sits in its byte is ``code * 2**(b - 133)`` for its bit
  offset ``b``; with an affine the pair's scale is prescaled by ``2**-b`` more,
  so the registers are the same values as without (`_byte_mask`); without
  one they hold ``code * 2**(b - 133)`` (`code_column_exponents`).

  ``shuffle_scales`` (with an affine): the 8 lanes of a warp that hold the
  same columns (``lane % 4`` alike) need the same scale/zero pairs, so each
  converts (float16 -> bfloat16, prescale) only its share, one quad of four
  channels per row instead of all of them, and gets the others with one
  ``shfl.sync`` per pair: per thread and tile 2 loads, 4 conversions and 32
  shuffles instead of 16 loads and 32 conversions. Same registers, bit for
  bit.

  ``lower_smem`` (4-bit, with ``subnormal`` and an affine): a second code tile
  of the same shape, the lower plane of a hierarchical code
  (`pallas_kernels.hierarchical`, QuantSpec's target view): the values are
  ``(16 C_U + C_L') * scale / 16 + zero - scale / 2`` with ``C_U`` from
  ``codes_smem`` and ``C_L'`` from ``lower_smem`` (both ``[0, 15]``), one
  rounding; the 8-bit code is joined exactly in registers (`_ASM_JOIN_AFFINE`:
  two ``and`` and two ``fma`` per pair) and ``zero - scale / 2`` computed in
  float32 from the stored rows and rounded once. Oracle: `registers_reference`
  with ``lower``.
  """
  width, rows, wide = _code_tile(codes_smem, head_dim, bits, (64, 128))
  affine = scale_smem is not None
  if affine != (zero_smem is not None):
    raise ValueError("pass both scale_smem and zero_smem, or neither")
  if byte_masks and not subnormal:
    raise ValueError("byte_masks needs subnormal=True")
  hier = _check_lower(lower_smem, codes_smem, bits, affine and subnormal,
                      "subnormal=True and scale_smem/zero_smem")
  rows_f16 = False
  if affine:
    for name, ref in (("scale_smem", scale_smem), ("zero_smem", zero_smem)):
      if (tuple(ref.shape) != (1, head_dim)
          or ref.dtype not in (jnp.bfloat16, jnp.float16) or ref.dtype != scale_smem.dtype):
        raise ValueError(f"{name} must be bfloat16 or float16 [1, {head_dim}] (both alike), "
                         f"got {ref.dtype} {tuple(ref.shape)}")
    rows_f16 = scale_smem.dtype == jnp.float16
  elif shuffle_scales:
    raise ValueError("shuffle_scales needs scale_smem and zero_smem")
  span = width // 4
  words = span // 4
  pairs = 16 // bits
  # Pair k of a word: (shift, mask, exponent of the power of two it carries).
  pair_src = [_byte_mask(bits * k, bits, byte_masks) for k in range(pairs)]
  if subnormal:
    asm = [(_ASM_JOIN_AFFINE if hier else _ASM_SUB_AFFINE if affine else _ASM_SUB).format(
        mask=mask) for _, mask, _ in pair_src]
    # hierarchical: the joined code carries scale / 16
    prescale = {("s", k): SUBNORMAL_EXP - K_SHIFT - e - 4 * hier
                for k, (_, _, e) in enumerate(pair_src)}
    prescale.update({("z", k): -K_SHIFT for k in range(pairs)})   # exponents of the factors
  else:
    asm = [(_ASM_AFFINE if affine else _ASM).format(mask=mask) for _, mask, _ in pair_src]
  # Register (m, j, 0, 0, half, 0...) = columns 8 j + 2 (lane % 4) + {0, 1} of
  # row 64 m + 16 warp + lane // 4 + 8 half: WGMMA_LAYOUT's tiling as of jax
  # 0.10-0.11.
  want_regs = (rows // _ROWS, head_dim // 8, 1, 1, 2) + (1,) * 4
  if fa.WGMMA_LAYOUT.registers_shape((rows, head_dim)) != want_regs:
    raise NotImplementedError("WGMMA_LAYOUT's register tiling changed; dequant_codes assumes "
                              f"{want_regs}")

  body_type = plgpu.ShapeDtypeStruct((rows, head_dim), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

  def body_fn(_, ref, *rows_refs):
    i32 = ir.IntegerType.get_signless(32)
    code_refs = [ref] + ([rows_refs[0]] if hier else [])
    rows_refs = rows_refs[1:] if hier else rows_refs
    if wide:  # the same bytes, one token per row
      code_refs = [mgpu_utils.memref_reshape(r, (rows, width)) for r in code_refs]
    lane, row0, col = _thread_place(span)
    regs = np.empty(want_regs, dtype=object)
    affine_pairs = {}
    if rows_refs and shuffle_scales:
      affine_pairs = _shuffled_affine_pairs(rows_refs, lane, bits=bits, width=width, span=span,
                                            words=words, rows_f16=rows_f16,
                                            subnormal=subnormal, byte_masks=byte_masks,
                                            hier=hier)
    elif rows_refs:
      # Pair (w, k) of a thread holds channels base + k // (8 / bits) + {0, 2},
      # base = plane * width + c * span + 4 w with plane = k % (8 / bits): one
      # 8-byte load of channels [base, base + 4) serves four pairs.
      planes = 8 // bits
      cc = arith.andi(lane, mgpu_utils.c(3, i32))
      for name in ("s", "z"):
        for w, plane in itertools.product(range(words), range(planes)):
          base = arith.addi(arith.muli(cc, mgpu_utils.c(span, i32)),
                            mgpu_utils.c(plane * width + 4 * w, i32))
          for off, pair in enumerate(_affine_quad(rows_refs, name, base, rows_f16, hier)):
            k = plane + planes * off
            if subnormal:
              pair = llvm.inline_asm(i32, [pair, _bf16_pow2_pair(prescale[name, k])],
                                     _ASM_POW2, "=r,r,r")
            affine_pairs[name, w, k] = pair
    def emit(m, half, w, k, shifted):
      del m, half
      if rows_refs:
        ops = [*shifted, affine_pairs["s", w, k], affine_pairs["z", w, k]]
        return llvm.inline_asm(i32, ops, asm[k], "=r" + ",r" * len(ops))
      return llvm.inline_asm(i32, list(shifted), asm[k], "=r,r")

    _unpack_words(regs, code_refs, row0, col, span=span, pair_src=pair_src, emit=emit)
    return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  refs = (codes_smem, *([lower_smem] if hier else []), scale_smem, zero_smem) if affine else (
      codes_smem,)
  return plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(refs),
                           return_type=body_type)(body_fn)(*refs)


def dequant_codes_rows(codes_smem, scale_smem, zero_smem, bits: int = 4):
  """``[rows, 128]`` bf16 registers ``(code * scale[row] + zero[row]) * 2**-K_SHIFT``.

  The affine of a weight tile (`pallas_kernels.mosaic_int4_matmul`): one
  scale and zero per *row* (``scale_smem`` / ``zero_smem``: float32 ``[1, rows]``
  in shared memory), where `dequant_codes` takes one per column. Codes are
  byte-masked subnormals (``code * 2**(b - 133)``, one ``and`` per pair) and
  one ``fma.rn.bf16x2`` per pair makes the value with a single rounding; each
  thread builds its four rows' pairs once per tile (per row: the scale times
  ``2**(133 - K_SHIFT - b)`` for each bit offset ``b`` and the zero times
  ``2**-K_SHIFT``, exact power-of-two products in float32, each rounded once
  to bfloat16). Columns follow `code_permutation`; numpy oracle
  `registers_rows_reference`. The MMA's other operand carries ``2**K_SHIFT``.
  """
  width, rows, wide = _code_tile(codes_smem, 128, bits, (128,))
  for name, ref in (("scale_smem", scale_smem), ("zero_smem", zero_smem)):
    if tuple(ref.shape) != (1, rows) or ref.dtype != jnp.float32:
      raise ValueError(f"{name} must be float32 [1, {rows}], got {ref.dtype} {tuple(ref.shape)}")
  span = width // 4
  pair_src = [_byte_mask(bits * k, bits, True) for k in range(16 // bits)]
  asm = [_ASM_SUB_AFFINE.format(mask=mask) for _, mask, _ in pair_src]
  want_regs = (rows // _ROWS, 128 // 8, 1, 1, 2) + (1,) * 4
  if fa.WGMMA_LAYOUT.registers_shape((rows, 128)) != want_regs:
    raise NotImplementedError("WGMMA_LAYOUT's register tiling changed; dequant_codes_rows "
                              f"assumes {want_regs}")
  body_type = plgpu.ShapeDtypeStruct((rows, 128), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

  def body_fn(_, ref, sref, zref):
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    index = ir.IndexType.get()
    if wide:  # the same bytes, one weight output row per row
      ref = mgpu_utils.memref_reshape(ref, (rows, width))
    _, row0, col = _thread_place(span)
    zero_i = arith.index_cast(index, mgpu_utils.c(0, i32))

    def pair(x):  # f32 -> (x, x) as a bf16x2 i32, one rounding
      return llvm.inline_asm(i32, [x], "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f")

    def times(x, exp: int):
      return arith.mulf(x, arith.constant(f32, ir.FloatAttr.get(f32, 2.0 ** exp)))

    row_pairs = {}
    for m, half in itertools.product(range(rows // _ROWS), range(2)):
      r = arith.index_cast(index, arith.addi(row0, mgpu_utils.c(_ROWS * m + 8 * half, i32)))
      sc, zr = memref.load(sref, [zero_i, r]), memref.load(zref, [zero_i, r])
      scaled = {e: pair(times(sc, SUBNORMAL_EXP - K_SHIFT - e)) for e in {e for *_, e in pair_src}}
      row_pairs[m, half] = ([scaled[e] for *_, e in pair_src], pair(times(zr, -K_SHIFT)))

    def emit(m, half, w, k, shifted):
      del w
      s_pairs, z_pair = row_pairs[m, half]
      return llvm.inline_asm(i32, [*shifted, s_pairs[k], z_pair], asm[k], "=r,r,r,r")

    regs = np.empty(want_regs, dtype=object)
    _unpack_words(regs, [ref], row0, col, span=span, pair_src=pair_src, emit=emit)
    return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3, return_type=body_type)(body_fn)(
      codes_smem, scale_smem, zero_smem)


def registers_rows_reference(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray,
                             bits: int = 4) -> np.ndarray:
  """``[rows, 128]`` float values `dequant_codes_rows` holds, times ``2**K_SHIFT``:
  ``bf16(code * bf16(scale[row]) + bf16(zero[row]))`` of channel ``perm[col]``."""
  def bf16(x):
    return np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float64)
  codes = np.asarray(codes)
  mask = (1 << bits) - 1
  channels = np.concatenate([(codes >> (bits * p)) & mask for p in range(8 // bits)],
                            axis=-1).astype(np.float64)                 # [rows, 128] planar
  s = bf16(np.reshape(scale, (-1, 1)))
  z = bf16(np.reshape(zero, (-1, 1)))
  vals = bf16(channels * s + z)
  return vals[..., code_permutation(128, bits)].astype(np.float32)


def _thread_place(span: int):
  """``(lane, row0, col)`` of this thread in a warpgroup's WGMMA A tile: its rows are
  ``row0 + 64 m + 8 half`` (i32) and its code bytes start at ``col`` (index)."""
  i32 = ir.IntegerType.get_signless(32)
  tid = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(128, i32))
  warp = arith.shrui(tid, mgpu_utils.c(5, i32))
  lane = arith.andi(tid, mgpu_utils.c(31, i32))
  row0 = arith.addi(arith.muli(warp, mgpu_utils.c(16, i32)),
                    arith.shrui(lane, mgpu_utils.c(2, i32)))
  col = arith.muli(arith.andi(lane, mgpu_utils.c(3, i32)), mgpu_utils.c(span, i32))
  return lane, row0, arith.index_cast(ir.IndexType.get(), col)


def _unpack_words(regs, refs, row0, col, *, span: int, pair_src, emit) -> None:
  """Fills a thread's WGMMA registers ``regs`` from its ``span`` code bytes per row
  of each tile of ``refs`` (tiles of one shape: a hierarchical code's planes).

  Register ``(m, j, 0, 0, half)`` (columns ``8 j + 2 (lane % 4) + {0, 1}`` of
  row ``row0 + 64 m + 8 half``) is ``emit(m, half, w, k, shifted)`` for pair
  ``k`` of word ``w`` (``j = pairs * w + k``), ``shifted`` the tiles' words
  (one per ref) moved right by ``pair_src[k]``'s shift (each shift computed
  once per word).
  """
  i32 = ir.IntegerType.get_signless(32)
  index = ir.IndexType.get()
  bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
  words, pairs = span // 4, len(pair_src)
  for m, half in itertools.product(range(regs.shape[0]), range(2)):
    row = arith.index_cast(index, arith.addi(row0, mgpu_utils.c(_ROWS * m + 8 * half, i32)))
    packed = [vector.bitcast(ir.VectorType.get((words,), i32), vector.load(
        ir.VectorType.get((span,), ir.IntegerType.get_signless(8)), ref, [row, col]))
              for ref in refs]
    for w in range(words):
      word = tuple(vector.extract(p, [], [w]) for p in packed)
      shifted_by = {0: word}
      for k in range(pairs):
        shift = pair_src[k][0]
        if shift not in shifted_by:
          shifted_by[shift] = tuple(arith.shrui(x, mgpu_utils.c(shift, i32)) for x in word)
        pair = emit(m, half, w, k, shifted_by[shift])
        regs[(m, pairs * w + k, 0, 0, half) + (0,) * (regs.ndim - 5)] = (
            mgpu_utils.bitcast(pair, bf16x2))


def _quad_words(rref, base, rows_f16: bool) -> list:
  """Channels ``[base, base + 4)`` of a ``[1, D]`` smem row (one 8-byte load) as two
  i32 words (channels ``base, base + 1`` and ``base + 2, base + 3``)."""
  i32 = ir.IntegerType.get_signless(32)
  index = ir.IndexType.get()
  elem = ir.F16Type.get() if rows_f16 else ir.BF16Type.get()
  quad = vector.load(ir.VectorType.get((4,), elem), rref,
                     [arith.index_cast(index, mgpu_utils.c(0, i32)),
                      arith.index_cast(index, base)])
  quad = vector.bitcast(ir.VectorType.get((2,), i32), quad)
  return [vector.extract(quad, [], [e]) for e in range(2)]


def _quad_pairs(rref, base, rows_f16: bool) -> tuple:
  """Channels ``[base, base + 4)`` of a ``[1, D]`` smem row (`_quad_words`) as the
  bf16x2 pairs ``(base, base + 2)`` and ``(base + 1, base + 3)`` (i32 values)."""
  i32 = ir.IntegerType.get_signless(32)
  words = _quad_words(rref, base, rows_f16)
  return tuple(llvm.inline_asm(i32, words, (_PAIR_F16 if rows_f16 else _PAIR_BF16)[off],
                               "=r,r,r") for off in (0, 1))


def _zero_pairs(sref, zref, base, rows_f16: bool) -> tuple:
  """The hierarchical target view's zero ``zero - scale / 2`` of channels ``[base,
  base + 4)`` as `_quad_pairs` gives pairs (float32 from the stored rows, one
  rounding to bfloat16)."""
  i32 = ir.IntegerType.get_signless(32)
  words = _quad_words(sref, base, rows_f16) + _quad_words(zref, base, rows_f16)
  return tuple(llvm.inline_asm(i32, words, _zero_pair_asm(rows_f16, off), "=r,r,r,r,r")
               for off in (0, 1))


def _affine_quad(rows_refs, name: str, base, rows_f16: bool, hier: bool) -> tuple:
  """Row ``name``'s (``"s"`` or ``"z"``) pairs of channels ``[base, base + 4)``
  (`_quad_pairs`); with ``hier`` the zero row's are the target view's
  ``zero - scale / 2`` (`_zero_pairs`)."""
  if hier and name == "z":
    return _zero_pairs(*rows_refs, base, rows_f16)
  return _quad_pairs(rows_refs[0 if name == "s" else 1], base, rows_f16)


def _check_lower(lower_smem, codes_smem, bits: int, ok: bool, needs: str) -> bool:
  """Whether ``lower_smem`` (a hierarchical code's lower-plane tile) is given;
  ValueError unless it is 4-bit, ``ok`` (what the caller ``needs`` besides) and
  of ``codes_smem``'s shape and dtype."""
  if lower_smem is None:
    return False
  if bits != 4 or not ok:
    raise ValueError(f"lower_smem (hierarchical codes) needs bits=4, {needs}")
  if (tuple(lower_smem.shape) != tuple(codes_smem.shape)
      or lower_smem.dtype != codes_smem.dtype):
    raise ValueError(f"lower_smem {lower_smem.dtype} {tuple(lower_smem.shape)} must match "
                     f"codes_smem {codes_smem.dtype} {tuple(codes_smem.shape)}")
  return True


def _shuffled_affine_pairs(rows_refs, lane, *, bits: int, width: int, span: int, words: int,
                           rows_f16: bool, subnormal: bool, byte_masks: bool,
                           hier: bool = False) -> dict:
  """`dequant_codes`' ``{(name, w, k): bf16x2 pair}`` of a thread, through warp shuffles.

  A thread with ``c = lane % 4`` needs, per row (``s``, ``z``), the pairs of
  the ``words * planes`` quads ``(w, plane)`` of channels ``c span + plane
  width + 4 w + [0, 4)`` (pair ``k = plane + planes off`` of word ``w`` takes
  channels ``+off`` and ``+off + 2``). The 8 lanes ``c + 4 r`` alike split the
  quads: lane ``r`` converts quad ``r % quads`` of each row (two pairs), and
  pair ``(w, k)`` comes from lane ``c + 4 (w planes + plane)``.
  ``hier``: a hierarchical target view's pairs (`dequant_codes`' ``lower_smem``):
  scale / 16 and zero - scale / 2.
  """
  i32 = ir.IntegerType.get_signless(32)
  planes = 8 // bits
  quads = words * planes                                     # per row: 4 or 8
  if quads not in (4, 8):
    raise ValueError(f"shuffle_scales: {quads} quads of channels per thread (need 4 or 8)")
  cc = arith.andi(lane, mgpu_utils.c(3, i32))
  mine = arith.andi(arith.shrui(lane, mgpu_utils.c(2, i32)), mgpu_utils.c(quads - 1, i32))
  plane = arith.andi(mine, mgpu_utils.c(planes - 1, i32))    # planes is a power of two
  w = arith.shrui(mine, mgpu_utils.c(planes.bit_length() - 1, i32))
  base = arith.addi(arith.addi(arith.muli(cc, mgpu_utils.c(span, i32)),
                               arith.muli(plane, mgpu_utils.c(width, i32))),
                    arith.muli(w, mgpu_utils.c(4, i32)))
  factors = {}
  if subnormal:
    # scale pairs: 2**(SUBNORMAL_EXP - K_SHIFT - e), e = bits * plane with byte
    # masks (`_byte_mask`: the pair's bit offset inside its byte), else 0.
    expo = mgpu_utils.c(SUBNORMAL_EXP - K_SHIFT - 4 * hier + 127, i32)
    if byte_masks:
      expo = arith.subi(expo, arith.muli(plane, mgpu_utils.c(bits, i32)))
    half = arith.shli(expo, mgpu_utils.c(7, i32))
    factors["s"] = arith.ori(half, arith.shli(half, mgpu_utils.c(16, i32)))
    factors["z"] = _bf16_pow2_pair(-K_SHIFT)
  local = {}
  for name in ("s", "z"):
    for off, pair in enumerate(_affine_quad(rows_refs, name, base, rows_f16, hier)):
      if subnormal:
        pair = llvm.inline_asm(i32, [pair, factors[name]], _ASM_POW2, "=r,r,r")
      local[name, off] = pair
  out = {}
  for name, w_, k in itertools.product(("s", "z"), range(words), range(2 * planes)):
    owner = w_ * planes + k % planes
    src = arith.addi(cc, mgpu_utils.c(4 * owner, i32))
    out[name, w_, k] = llvm.inline_asm(i32, [local[name, k // planes], src], _ASM_SHFL,
                                       "=r,r,r")
  return out


# ldmatrix .trans of four 8x8 b16 matrices: thread i gets, per matrix, b16
# elements (row 2 (i % 4), col i / 4) and (row 2 (i % 4) + 1, col i / 4).
_LDMATRIX_T = "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];"


def vt_permutation(head_dim: int = 128, bits: int = 4) -> np.ndarray:
  """``perm[row]``: the channel that row ``row`` of `dequant_codes_t`'s ``[D, rows]``
  operand holds (D = 128; planar codes: bits ``[b p, b (p + 1))`` of byte ``j``
  of a token row are channel ``p W + j``, ``W = D b / 8``).

  Row ``64 m + 16 warp + l + 8 half`` (``l = lane // 4``) holds pair ``k = 2 m +
  half`` of the thread's 16-bit unit (bytes ``B``, ``B + 1`` of each token row):
  4-bit: ``B = 16 warp + 2 l``, channels ``B``, ``W + B``, ``B + 1``, ``W + B + 1``;
  2-bit: ``B = 16 (warp % 2) + 2 l``, planes ``2 (warp // 2) + {0, 1}``, pair
  ``k`` = byte ``B + k // 2``, plane ``2 (warp // 2) + k % 2``.
  """
  if head_dim != 128:
    raise ValueError(f"head_dim={head_dim} must be 128 (four warps x 16 code bytes)")
  if bits not in (4, 2):
    raise ValueError(f"bits={bits} must be 4 or 2")
  width = head_dim * bits // 8
  perm = np.empty(head_dim, np.int64)
  for warp, l, m, half in itertools.product(range(4), range(8), range(2), range(2)):
    k = 2 * m + half
    if bits == 4:
      byte = 16 * warp + 2 * l
      ch = (byte, width + byte, byte + 1, width + byte + 1)[k]
    else:
      byte = 16 * (warp % 2) + 2 * l + k // 2
      ch = (2 * (warp // 2) + k % 2) * width + byte
    perm[64 * m + 16 * warp + l + 8 * half] = ch
  return perm


def registers_t_reference(codes: np.ndarray, bits: int = 4, lower=None) -> np.ndarray:
  """``[D, rows]`` float values `dequant_codes_t` holds for ``codes [rows, D bits/8]``:
  the code of channel ``vt_permutation()[row]`` at each token (column);
  ``lower``: the hierarchical code ``16 C_U + C_L'`` with the lower-plane tile."""
  codes = np.asarray(codes)
  channels = _planar_channels(codes, bits)                               # [rows, D] planar
  if lower is not None:
    channels = 16.0 * channels + _planar_channels(lower, bits)
  return channels[:, vt_permutation(codes.shape[-1] * 8 // bits, bits)].T.astype(np.float32)


def _vt_shifts(bits: int) -> list[int]:
  """Bit offset of pair ``k`` (row group ``(m, half) = divmod(k, 2)``) in the
  16-bit units `dequant_codes_t` reads (after the 2-bit plane shift)."""
  return [4 * k for k in range(4)] if bits == 4 else [8 * (k // 2) + 2 * (k % 2)
                                                      for k in range(4)]


def vt_row_factors(head_dim: int = 128, bits: int = 4) -> np.ndarray:
  """``[D]`` powers of two `dequant_codes_t(byte_masks=True)` leaves on its rows:
  ``2**bits`` on the rows with ``half = 1`` (``row % 16 >= 8``), 1 elsewhere;
  `scale_halves` takes them back off the value MMA's accumulator."""
  exps = [_byte_mask(s, bits, True)[2] for s in _vt_shifts(bits)]
  if exps != [0, bits, 0, bits]:
    raise AssertionError(f"unexpected byte-mask exponents {exps}")
  row = np.arange(head_dim)
  return np.where(row % 16 >= 8, 2.0 ** bits, 1.0)


def dequant_codes_t(codes_smem, head_dim: int = 128, bits: int = 4, *, swizzle: int = 0,
                    subnormal: bool = False, byte_masks: bool = False, lower_smem=None):
  """``[D, rows]`` bfloat16 codes (WGMMA layout) of a ``[rows, D bits/8]`` uint8 smem
  tile of 4/2-bit codes: the *transposed* tile, as the register A operand of
  ``O^T += V^T P^T`` (tokens on the MMA's K axis), with no shared-memory store.

  One ``ldmatrix.x4.trans`` per 32 tokens: a warp reads 16 code bytes of each
  token row as eight 16-bit units (4-bit: warp ``w`` bytes ``[16 w, 16 w + 16)``;
  2-bit: bytes ``[16 (w % 2), ...)``, warps 2-3 taking the upper two planes),
  and thread ``lane`` receives unit ``lane // 4`` of tokens ``8 j + 2 (lane % 4)
  + {0, 1}`` in one register: exactly the ``(row, column pair)`` of
  WGMMA_LAYOUT's register ``j``, four of the unit's channels being the
  thread's four rows (`vt_permutation`). Each pair is then ``lop3`` + ``sub``
  as in `dequant_codes`. Codes only (no affine): the per-token V scale and
  zero are folded into P.

  ``swizzle``: 0 for an untiled, unswizzled tile; else the tile TMA writes with
  ``TilingTransform((8, W)), SwizzleTransform(W)`` for its row width ``W`` (64
  or 32 bytes; 16-byte chunk ``c`` of row ``r`` stored at chunk ``c ^ ((r >> 1)
  & 3)``, resp. ``c ^ ((r >> 2) & 1)``; a wide tile (`WIDE_ROW`-byte rows of
  ``128 / W`` tokens, `_code_tile`): ``c ^ (r & 7)``): the ``ldmatrix`` rows
  then hit distinct banks.

  ``subnormal``: registers hold ``code * 2**-SUBNORMAL_EXP`` (one ``and`` per
  pair); the caller scales ``P`` up and the product back down.

  ``byte_masks`` (with ``subnormal``): one shift by a whole byte per word, each
  code masked where it sits in its byte; rows with ``half = 1`` then hold
  ``2**bits`` times their codes (`vt_row_factors`), which the caller takes
  off the product (`scale_halves`).

  ``lower_smem`` (4-bit, with ``subnormal``): a second tile of the same shape
  and transforms, the lower plane of a hierarchical code (QuantSpec's target
  view): the registers hold the 8-bit codes ``16 C_U + C_L'`` (times the same
  powers of two), joined exactly by one ``fma`` per pair (`_ASM_JOIN`); the
  caller folds ``scale / 16`` and ``zero - scale / 2`` into P.
  """
  width, rows, wide = _code_tile(codes_smem, head_dim, bits, (128,))
  if byte_masks and not subnormal:
    raise ValueError("byte_masks needs subnormal=True")
  hier = _check_lower(lower_smem, codes_smem, bits, subnormal, "subnormal=True")
  row_bytes = WIDE_ROW if wide else width
  if swizzle not in (0, row_bytes):
    raise ValueError(f"swizzle={swizzle} must be 0 or {row_bytes} (the tile's row width)")
  want_regs = (head_dim // _ROWS, rows // 8, 1, 1, 2) + (1,) * 4
  if fa.WGMMA_LAYOUT.registers_shape((head_dim, rows)) != want_regs:
    raise NotImplementedError("WGMMA_LAYOUT's register tiling changed; dequant_codes_t assumes "
                              f"{want_regs}")
  # Pair k of a (pre-shifted) word: (shift, mask, exponent).
  pair_src = [_byte_mask(s, bits, byte_masks) for s in _vt_shifts(bits)]
  asm = [(_ASM_JOIN if hier else _ASM_SUB if subnormal else _ASM).format(mask=mask)
         for _, mask, _ in pair_src]
  body_type = plgpu.ShapeDtypeStruct((head_dim, rows), jnp.bfloat16, layout=plgpu.Layout.WGMMA)
  transforms = ((plgpu.TilingTransform((8, row_bytes)), plgpu.SwizzleTransform(row_bytes))
                if swizzle else ())
  per_row = row_bytes // width  # tokens per tile row

  def body_fn(_, ref, *lower):
    i32 = ir.IntegerType.get_signless(32)
    c = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
    tid = arith.remui(mgpu_utils.thread_idx(), c(128))
    warp = arith.shrui(tid, c(5))
    lane = arith.andi(tid, c(31))
    bases = [llvm.ptrtoint(i32, mgpu_utils.memref_ptr(r)) for r in (ref, *lower)]
    chunk = warp if bits == 4 else arith.andi(warp, c(1))
    # 2-bit: warps 2-3 move planes 2-3 of each byte down to planes 0-1 first
    plane_shift = None if bits == 4 else arith.muli(arith.shrui(warp, c(1)), c(4))
    regs = np.empty(want_regs, dtype=object)
    quad_ty = llvm.StructType.get_literal([i32] * 4)
    for t0 in range(0, rows, 32):
      tok = arith.addi(lane, c(t0))          # the token this thread addresses
      # its 16-byte chunk: chunk `phys` of tile row `row` (per_row tokens a row)
      row = arith.shrui(tok, c(per_row.bit_length() - 1)) if per_row > 1 else tok
      phys = chunk
      if per_row > 1:
        phys = arith.addi(chunk, arith.muli(arith.andi(tok, c(per_row - 1)), c(width // 16)))
      if swizzle:  # chunk c of row r sits at c ^ ((r * swizzle >> 7) & (swizzle / 16 - 1))
        rbits = arith.andi(arith.shrui(arith.muli(row, c(swizzle)), c(7)), c(swizzle // 16 - 1))
        phys = arith.xori(phys, rbits)
      offset = arith.addi(arith.muli(row, c(row_bytes)), arith.muli(phys, c(16)))
      got = [llvm.inline_asm(quad_ty, [arith.addi(base, offset)], _LDMATRIX_T,
                             "=r,=r,=r,=r,r", has_side_effects=True) for base in bases]
      for mat in range(4):
        words = [llvm.extractvalue(i32, g, [mat]) for g in got]   # upper (and lower) plane
        if plane_shift is not None:
          words = [arith.shrui(word, plane_shift) for word in words]
        j = t0 // 8 + mat
        shifted_by = {0: words}
        for k in range(4):
          m, half = divmod(k, 2)
          shift = pair_src[k][0]
          if shift not in shifted_by:
            shifted_by[shift] = [arith.shrui(word, c(shift)) for word in words]
          ops = shifted_by[shift]
          pair = llvm.inline_asm(i32, ops, asm[k], "=r" + ",r" * len(ops))
          regs[(m, j, 0, 0, half) + (0,) * (regs.ndim - 5)] = mgpu_utils.bitcast(pair, bf16x2)
    return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  refs = (codes_smem, *([lower_smem] if hier else []))
  return plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms),) * len(refs),
                           return_type=body_type)(body_fn)(*refs)


def vq_permutation(head_dim: int) -> np.ndarray:
  """``perm[col]``: the channel MMA column ``col`` holds after `gather_codebook`.

  Thread ``c = lane % 4`` owns the channel quarter ``[c D/4, (c + 1) D/4)``:
  register ``j`` (columns ``8 j + 2 c + {0, 1}``) holds channels
  ``c D/4 + 2 j + {0, 1}``, whatever the sub-vector size.
  """
  if head_dim not in (64, 128):
    raise ValueError(f"head_dim={head_dim} must be 64 or 128")
  perm = np.empty(head_dim, np.int64)
  for c, j, e in itertools.product(range(4), range(head_dim // 8), range(2)):
    perm[8 * j + 2 * c + e] = c * (head_dim // 4) + 2 * j + e
  return perm


def gather_reference(codes: np.ndarray, codebook: np.ndarray) -> np.ndarray:
  """``[rows, D]`` values `gather_codebook` holds: ``codebook [n, E, v]`` at each
  sub-vector's code (``codes [rows, n]``), columns in `vq_permutation` order."""
  codes = np.asarray(codes).astype(np.int64)
  codebook = np.asarray(codebook)
  n, _, vec = codebook.shape
  x = codebook[np.arange(n)[None, :], codes]               # [rows, n, v]
  x = x.reshape(codes.shape[0], n * vec)
  return x[:, vq_permutation(n * vec)]


def vq_book_rows(codebook):
  """A kv head's codebook(s) ``[..., n, E, v]`` -> the entry-major shared-memory
  image `gather_codebook` reads, ``[..., n E v / 128, 128]``: entry ``e`` of
  sub-space ``s`` at element ``(e n + s) v``, so a centroid's bank depends on
  its sub-space only."""
  *lead, n, entries, vec = codebook.shape
  x = codebook.swapaxes(-3, -2)                                   # [..., E, n, v]
  return x.reshape(*lead, n * entries * vec // 128, 128)


def _barrel(items, amount, bits: int, step_of):
  """``out[k] = items[step_of(k, amount)]`` for a lane-dependent ``amount`` <
  2^bits (a rotation: ``step_of(k, d)`` is ``k`` moved by ``d`` places, so
  moves compose), as one select per item and bit of ``amount``."""
  i1 = ir.IntegerType.get_signless(1)
  i32 = ir.IntegerType.get_signless(32)
  for b in range(bits):
    bit = arith.trunci(i1, arith.shrui(amount, mgpu_utils.c(b, i32))) if b else (
        arith.trunci(i1, amount))
    items = [[arith.select(bit, a, o) for a, o in zip(items[step_of(k, 1 << b)], items[k])]
             for k in range(len(items))]
  return items


def gather_codebook(codes_smem, codebook_smem, head_dim: int, vector_size: int, entries: int):
  """``[rows, D]`` centroids (WGMMA layout) of a ``[rows, n]`` uint8 code tile.

  ``codebook_smem`` is one kv head's codebook ``[n, E, v]`` in the layout of
  `vq_book_rows` (``[n E v / 128, 128]``, bfloat16 or float16, untiled and
  unswizzled); the result has its dtype. ``codes_smem`` (``n = D / v`` codes
  per token, untiled and unswizzled) must have ``n >= 16`` (TMA's 16-byte
  rows).

  Thread ``c = lane % 4`` holds the channel quarter ``[c D/4, (c+1) D/4)``
  (`vq_permutation`): sub-spaces ``c n/4 + k``. It reads its ``n/4`` codes of a
  row with one shared load, then one ``ld.shared`` of ``2 v`` bytes per code.
  Bank conflicts: in the entry-major image a centroid's bank is set by its
  sub-space, so at load ``t`` thread ``(r = lane / 4, c)`` takes sub-space
  ``k = (t + rho) % (n/4)`` with ``rho = r + (c / 2)(n/8)``: the lanes of one
  shared-memory wavefront read distinct banks whatever the codes (a random
  gather in sub-space-major order cost 5.8-way conflicts, ncu on an H200).
  The thread's code bytes are rotated by ``rho`` once per row (funnel shifts)
  and the loaded centroids rotated back into register order by ``log2(n/4)``
  selects each. The numpy oracle is `gather_reference`.
  """
  if head_dim not in (64, 128):
    raise ValueError(f"head_dim={head_dim} must be 64 or 128")
  if vector_size not in (2, 4, 8):
    raise ValueError(f"vector_size={vector_size} must be 2, 4 or 8")
  n = head_dim // vector_size
  if n < 16:
    raise ValueError(f"head_dim / vector_size = {n} codes per token < 16 (TMA rows of 16 "
                     "bytes)")
  rows = codes_smem.shape[0]
  if (rows not in (_ROWS, 2 * _ROWS) or tuple(codes_smem.shape[1:]) != (n,)
      or codes_smem.dtype != jnp.uint8):
    raise ValueError(f"codes_smem must be uint8 [64 | 128, {n}], got "
                     f"{codes_smem.dtype} {tuple(codes_smem.shape)}")
  flat = head_dim * entries
  if (codebook_smem.dtype not in (jnp.bfloat16, jnp.float16)
      or tuple(codebook_smem.shape) != (flat // 128, 128)):
    raise ValueError(f"codebook_smem must be bfloat16 or float16 [{flat // 128}, 128], got "
                     f"{codebook_smem.dtype} {tuple(codebook_smem.shape)}")
  span = n // 4                    # codes (sub-spaces) per thread per row: 4, 8 or 16
  words = span // 4
  pairs = vector_size // 2         # 32-bit registers per code
  code_bytes = 2 * vector_size     # bytes of one centroid
  row_bytes = n * code_bytes       # bytes of one entry over all sub-spaces
  want_regs = (rows // _ROWS, head_dim // 8, 1, 1, 2) + (1,) * 4
  if fa.WGMMA_LAYOUT.registers_shape((rows, head_dim)) != want_regs:
    raise NotImplementedError("WGMMA_LAYOUT's register tiling changed; gather_codebook assumes "
                              f"{want_regs}")
  dtype = codebook_smem.dtype
  outs = ",".join(f"${i}" for i in range(pairs))
  vec = {1: "", 2: ".v2", 4: ".v4"}[pairs]
  dst = f"{{{outs}}}" if pairs > 1 else "$0"
  # $pairs: the rotated code word, $pairs+1: this load's sub-space address.
  def asm(k):
    return ("{\n.reg .b32 t, a;\n"
            f"bfe.u32 t, ${pairs}, {8 * k}, 8;\n"
            f"mad.lo.u32 a, t, {row_bytes}, ${pairs + 1};\n"
            f"ld.shared{vec}.b32 {dst}, [a];\n}}")
  constraints = ",".join(["=r"] * pairs + ["r", "r"])
  body_type = plgpu.ShapeDtypeStruct((rows, head_dim), dtype, layout=plgpu.Layout.WGMMA)

  def body_fn(_, codes_ref, book_ref):
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    c = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
    pair_ty = ir.VectorType.get((2,), ir.BF16Type.get() if dtype == jnp.bfloat16
                                else ir.F16Type.get())
    result_ty = llvm.StructType.get_literal([i32] * pairs) if pairs > 1 else i32
    tid = arith.remui(mgpu_utils.thread_idx(), c(128))
    warp = arith.shrui(tid, c(5))
    lane = arith.andi(tid, c(31))
    cc = arith.andi(lane, c(3))
    r = arith.shrui(lane, c(2))
    row0 = arith.addi(arith.muli(warp, c(16)), r)
    col = arith.index_cast(index, arith.muli(cc, c(span)))
    rho = arith.andi(arith.addi(r, arith.muli(arith.shrui(cc, c(1)), c(span // 2))),
                     c(span - 1))
    book = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(book_ref))
    base = arith.addi(book, arith.muli(cc, c(span * code_bytes)))
    # Load t reads sub-space k = (t + rho) % span of this thread.
    addr = [arith.addi(base, arith.muli(arith.andi(arith.addi(rho, c(t)), c(span - 1)),
                                        c(code_bytes))) for t in range(span)]
    shift = arith.muli(arith.andi(rho, c(3)), c(8))
    regs = np.empty(want_regs, dtype=object)
    for m, half in itertools.product(range(rows // _ROWS), range(2)):
      row = arith.index_cast(index, arith.addi(row0, c(_ROWS * m + 8 * half)))
      raw = vector.load(ir.VectorType.get((span,), ir.IntegerType.get_signless(8)), codes_ref,
                        [row, col])
      packed = vector.bitcast(ir.VectorType.get((words,), i32), raw)
      w_in = [vector.extract(packed, [], [w]) for w in range(words)]
      # Code bytes rotated by rho: whole words by rho / 4, then a funnel shift.
      w_in = [x[0] for x in _barrel([[x] for x in w_in], arith.shrui(rho, c(2)),
                                    max(0, words.bit_length() - 1),
                                    lambda k, d: (k + d) % words)]
      rot = [llvm.inline_asm(i32, [w_in[w], w_in[(w + 1) % words], shift],
                             "shf.r.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r")
             for w in range(words)]
      loaded = []
      for t in range(span):
        got = llvm.inline_asm(result_ty, [rot[t // 4], addr[t]], asm(t % 4), constraints)
        loaded.append([llvm.extractvalue(i32, got, [p]) if pairs > 1 else got
                       for p in range(pairs)])
      # loaded[t] is sub-space (t + rho) % span: back to sub-space order.
      ordered = _barrel(loaded, rho, span.bit_length() - 1, lambda k, d: (k - d) % span)
      for k, p in itertools.product(range(span), range(pairs)):
        regs[(m, pairs * k + p, 0, 0, half) + (0,) * (regs.ndim - 5)] = (
            mgpu_utils.bitcast(ordered[k][p], pair_ty))
    return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                           return_type=body_type)(body_fn)(codes_smem, codebook_smem)


def widen_columns(x, columns: int, fill: float = 0.0):
  """``[R, n]`` WGMMA-layout array -> ``[R, columns]`` (``columns`` a multiple of n):
  the same registers for columns ``< n``, ``fill`` for the rest; no instruction
  but the constant. Lets the softmax of a ``[bk, 8]`` score tile feed a
  ``[bk, 16]`` MMA operand (Pallas swizzles need rows of >= 32 bytes)."""
  rows, n = x.shape
  if columns % 8 or columns < n or n % 8:
    raise ValueError(f"widen_columns: {n} -> {columns} columns must be multiples of 8, "
                     "not narrower")
  if columns == n:
    return x
  out_regs = fa.WGMMA_LAYOUT.registers_shape((rows, columns))
  in_regs = fa.WGMMA_LAYOUT.registers_shape((rows, n))
  if out_regs[2:] != in_regs[2:] or out_regs[0] != in_regs[0]:
    raise NotImplementedError(f"WGMMA_LAYOUT's register tiling changed: {in_regs} -> {out_regs}")

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct((rows, columns), x.dtype, layout=plgpu.Layout.WGMMA))
  def body(_, arr):
    regs = np.empty(out_regs, dtype=object)
    vec_ty = arr.registers.flat[0].type
    pad = arith.constant(vec_ty, ir.DenseElementsAttr.get_splat(
        vec_ty, ir.FloatAttr.get(ir.VectorType(vec_ty).element_type, fill)))
    for idx in np.ndindex(out_regs):
      regs[idx] = arr.registers[idx] if idx[1] < in_regs[1] else pad
    return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return body(x)


def _tile_addr(base, row, col0, *, cols: int, tile_cols: int, swizzle: int):
  """Shared address (i32) of elements ``[row, col0, col0 + 8)`` (one 16-byte chunk,
  ``col0 % 8 == 0``) of a 16-bit ``[rows, cols]`` smem tile stored with
  ``TilingTransform((8, tile_cols))`` and ``SwizzleTransform(swizzle)``
  (``swizzle = 2 tile_cols`` bytes: 16-byte chunk ``c`` of tile row ``r`` at
  chunk ``c ^ ((r swizzle >> 7) & (swizzle / 16 - 1))``: the address bits 4-6
  XORed with bits 7-9, as TMA and ``wgmma`` swizzle)."""
  i32 = ir.IntegerType.get_signless(32)
  c = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
  if swizzle != 2 * tile_cols or swizzle not in (32, 64, 128) or cols % tile_cols:
    raise ValueError(f"tile ({tile_cols} columns, swizzle {swizzle}) does not fit {cols}")
  tiles_per_row = cols // tile_cols
  r = arith.andi(row, c(7))
  tile = arith.addi(arith.muli(arith.shrui(row, c(3)), c(tiles_per_row)),
                    arith.divui(col0, c(tile_cols)))
  chunk = arith.shrui(arith.remui(col0, c(tile_cols)), c(3))
  rbits = arith.andi(arith.shrui(arith.muli(r, c(swizzle)), c(7)), c(swizzle // 16 - 1))
  phys = arith.xori(chunk, rbits)
  off = arith.addi(arith.muli(tile, c(8 * swizzle)),
                   arith.addi(arith.muli(r, c(swizzle)), arith.muli(phys, c(16))))
  return arith.addi(base, off)


_LD_V4 = "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];"
_LD_V2 = "ld.shared.v2.b32 {$0, $1}, [$2];"
_ST_V4 = "st.shared.v4.b32 [$0], {$1, $2, $3, $4};"
# One 16-bit half (bit offset $2: 0 or 16) of $1 as float32: float16 / bfloat16.
_HALF_F32 = {
    "float16": "{\n.reg .b32 t;\n.reg .b16 h;\nshr.b32 t, $1, $2;\ncvt.u16.u32 h, t;\n"
               "cvt.f32.f16 $0, h;\n}",
    "bfloat16": "{\n.reg .b32 t;\nshr.b32 t, $1, $2;\nshl.b32 $0, t, 16;\n}",
}
FOLD_BIAS_COLUMNS = 32   # the zero term's MMA: K = 32 (hi and lo bf16 parts of 16 partials)
FOLD_SHIFT = 64          # the folded scores come out times 2**-FOLD_SHIFT


def fold_k_operands(q_smem, scale_smem, zero_smem, qs_smem, bias_smem, *, bits: int,
                    q_tiling: tuple[int, int]) -> None:
  """Per-channel K scale and zero folded into the score MMA's B operands (one tile).

  With `dequant_codes(..., subnormal=True, byte_masks=True)` and no affine, K's
  registers hold ``code * 2**(b - 133)`` (``b``: the column's bit offset in its
  byte, `code_column_exponents`). Then ``S^T = (C s + z) q^T`` is
  ``C (q s)^T + (q . z)`` per query row, and this writes both B operands:

  - ``qs_smem [N, 128]`` (the layout of ``q_smem``, ``q_tiling = (tile columns,
    swizzle)``): ``bf16(q * s * 2**(69 - b))`` per MMA column, so the code MMA
    gives ``sum (q s c) * 2**-FOLD_SHIFT``;
  - ``bias_smem [N, 32]`` (tiled ``(8, 32)``, swizzle 64): per query row ``n``
    and 8-column chunk ``j``, ``p = 2**-FOLD_SHIFT sum_chunk q z`` as bfloat16
    ``hi`` (column ``j``) and ``lo = bf16(p - hi)`` (column ``16 + j``), so an MMA
    of ones ``[rows, 32]`` against it adds ``2**-FOLD_SHIFT q . z`` to every
    token's score (the tensor core does the cross-thread sum).

  ``q_smem`` holds q in the MMA's column order (`code_permutation`), unscaled;
  ``scale_smem``/``zero_smem`` the group's ``[1, 128]`` rows in channel order
  (float16 or bfloat16). Thread ``t`` takes (row, chunk) tasks ``t, t + 128,
  ...`` of the ``N x 16`` (row ``id % N``, chunk ``id // N``): one 16-byte load of
  q, four 8-byte loads of each row (the chunk's channels are four pairs
  ``(x, x + 2)``), float32 products, one 16-byte store. The caller makes the
  stores visible (``commit_smem``) before the MMAs.
  """
  n_rows, head_dim = q_smem.shape
  if head_dim != 128 or n_rows % 8 or (n_rows * 16) % 128:
    raise ValueError(f"fold_k_operands needs head_dim 128 and N * 16 a multiple of 128 "
                     f"(q_smem {tuple(q_smem.shape)})")
  if bits not in _MASK:
    raise ValueError(f"bits={bits} must be 4 or 2")
  if tuple(bias_smem.shape) != (n_rows, FOLD_BIAS_COLUMNS) or bias_smem.dtype != jnp.bfloat16:
    raise ValueError(f"bias_smem must be bfloat16 [{n_rows}, {FOLD_BIAS_COLUMNS}], got "
                     f"{bias_smem.dtype} {tuple(bias_smem.shape)}")
  rows_dtype = jnp.dtype(scale_smem.dtype).name
  if rows_dtype not in _HALF_F32 or zero_smem.dtype != scale_smem.dtype:
    raise ValueError(f"scale/zero rows must be float16 or bfloat16 alike, got "
                     f"{scale_smem.dtype}, {zero_smem.dtype}")
  tile_cols, swizzle = q_tiling
  width = head_dim * bits // 8
  span = width // 4
  pairs = 16 // bits
  planes = 8 // bits
  log_n = int(np.log2(n_rows))
  if 1 << log_n != n_rows:
    raise ValueError(f"N={n_rows} must be a power of two")

  def body_fn(_, qref, sref, zref, qsref, bref):
    i32 = ir.IntegerType.get_signless(32)
    f32 = ir.F32Type.get()
    c = lambda v: mgpu_utils.c(v, i32)  # noqa: E731
    fc = lambda v: arith.constant(f32, ir.FloatAttr.get(f32, v))  # noqa: E731
    ptr = lambda ref: llvm.ptrtoint(i32, mgpu_utils.memref_ptr(ref))  # noqa: E731
    q_base, s_base, z_base, qs_base, b_base = map(ptr, (qref, sref, zref, qsref, bref))
    tid = arith.remui(mgpu_utils.thread_idx(), c(128))
    quad = llvm.StructType.get_literal([i32] * 4)
    pair_ty = llvm.StructType.get_literal([i32] * 2)

    def half_f32(word, shift, dtype):
      return llvm.inline_asm(f32, [word, shift], _HALF_F32[dtype], "=f,r,r")

    for it in range(n_rows * 16 // 128):
      task = arith.addi(tid, c(128 * it))
      n = arith.andi(task, c(n_rows - 1))
      j = arith.shrui(task, c(log_n))                  # MMA columns [8 j, 8 j + 8)
      w = arith.divui(j, c(pairs))
      k = arith.remui(j, c(pairs))
      plane = arith.remui(k, c(planes))
      off16 = arith.muli(arith.divui(k, c(planes)), c(16))   # channel x + off: bit 16 off
      # 2**(69 - b) with b = bits * plane (the code's bit offset in its byte)
      factor = arith.bitcast(f32, arith.shli(
          arith.subi(c(127 + SUBNORMAL_EXP - FOLD_SHIFT), arith.muli(plane, c(bits))), c(23)))
      col0 = arith.muli(j, c(8))
      q_addr = _tile_addr(q_base, n, col0, cols=head_dim, tile_cols=tile_cols, swizzle=swizzle)
      qs_addr = _tile_addr(qs_base, n, col0, cols=head_dim, tile_cols=tile_cols,
                           swizzle=swizzle)
      qw = llvm.inline_asm(quad, [q_addr], _LD_V4, "=r,=r,=r,=r,r")
      partial = fc(0.0)
      out = []
      for cc in range(4):
        # channels base + off and base + off + 2 are columns 8 j + 2 cc + {0, 1}
        base = arith.addi(arith.muli(plane, c(width)),
                          arith.addi(c(cc * span), arith.muli(w, c(4))))
        word_q = llvm.extractvalue(i32, qw, [cc])
        qv = [half_f32(word_q, c(16 * e), "bfloat16") for e in (0, 1)]
        rows = []
        for rbase in (s_base, z_base):
          got = llvm.inline_asm(pair_ty, [arith.addi(rbase, arith.muli(base, c(2)))], _LD_V2,
                                "=r,=r,r")
          rows.append([half_f32(llvm.extractvalue(i32, got, [e]), off16, rows_dtype)
                       for e in (0, 1)])
        sv, zv = rows
        prod = [arith.mulf(arith.mulf(qv[e], sv[e]), factor) for e in (0, 1)]
        out.append(llvm.inline_asm(i32, [prod[1], prod[0]], "cvt.rn.bf16x2.f32 $0, $1, $2;",
                                   "=r,f,f"))
        for e in (0, 1):
          partial = arith.addf(partial, arith.mulf(qv[e], zv[e]))
      llvm.inline_asm(ir.Type.parse("!llvm.void"), [qs_addr, *out], _ST_V4, "r,r,r,r,r",
                      has_side_effects=True)
      partial = arith.mulf(partial, fc(2.0 ** -FOLD_SHIFT))
      hi = llvm.inline_asm(i32, [partial], "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f")
      hi_f = llvm.inline_asm(f32, [hi], "shl.b32 $0, $1, 16;", "=f,r")
      lo = llvm.inline_asm(i32, [arith.subf(partial, hi_f)],
                           "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f")
      for col, val in ((j, hi), (arith.addi(j, c(16)), lo)):
        chunk0 = arith.muli(arith.shrui(col, c(3)), c(8))
        addr = _tile_addr(b_base, n, chunk0, cols=FOLD_BIAS_COLUMNS, tile_cols=32, swizzle=64)
        addr = arith.addi(addr, arith.muli(arith.andi(col, c(7)), c(2)))
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [addr, val],
                        "{\n.reg .b16 h;\ncvt.u16.u32 h, $1;\nst.shared.b16 [$0], h;\n}",
                        "r,r", has_side_effects=True)

  tf = lambda tc, sw: (plgpu.TilingTransform((8, tc)), plgpu.SwizzleTransform(sw))  # noqa: E731
  plgpu.inline_mgpu(arg_types=(plgpu.RefType(tf(tile_cols, swizzle)), plgpu.RefType(),
                               plgpu.RefType(), plgpu.RefType(tf(tile_cols, swizzle)),
                               plgpu.RefType(tf(32, 64))))(body_fn)(
                                   q_smem, scale_smem, zero_smem, qs_smem, bias_smem)


def code_column_exponents(head_dim: int, bits: int = 4) -> np.ndarray:
  """``[D]``: the power of two ``b`` `dequant_codes(byte_masks=True)` leaves on each
  MMA column (the code's bit offset in its byte; 0 without byte masks)."""
  pairs = 16 // bits
  cols = np.arange(head_dim)
  k = (cols // 8) % pairs
  return (bits * k) % 8


def scale_halves(x, lo: float, hi: float):
  """``x`` (a float32 WGMMA-layout array) times ``lo`` on rows with ``row % 16 < 8``
  and ``hi`` on the others: one multiply per register, the factor picked by the
  register's row half at trace time (`dequant_codes_t`'s ``byte_masks``)."""
  rows, cols = x.shape
  regs_shape = fa.WGMMA_LAYOUT.registers_shape((rows, cols))
  if regs_shape[2:5] != (1, 1, 2) or any(d != 1 for d in regs_shape[5:]):
    raise NotImplementedError(f"WGMMA_LAYOUT's register tiling changed: {regs_shape}")

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct((rows, cols), x.dtype, layout=plgpu.Layout.WGMMA))
  def body(_, arr):
    vec_ty = arr.registers.flat[0].type
    elem = ir.VectorType(vec_ty).element_type
    factors = [arith.constant(vec_ty, ir.DenseElementsAttr.get_splat(
        vec_ty, ir.FloatAttr.get(elem, f))) for f in (lo, hi)]
    regs = np.empty(regs_shape, dtype=object)
    for idx in np.ndindex(regs_shape):
      regs[idx] = arith.mulf(arr.registers[idx], factors[idx[4]])
    return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return body(x)


def warpgroup_barrier() -> None:
  """A barrier over this warpgroup's 128 threads (Mosaic's named barrier ``1 +
  warpgroup``), for kernels compiled without Pallas's automatic barriers
  (``CompilerParams(unsafe_no_auto_barriers=True)``) that place their own."""
  @plgpu.inline_mgpu()
  def body(_):
    mgpu_utils.warpgroup_barrier()

  body()


def release_stages(body, lean_barriers: bool = True):
  """``body`` of an `plgpu.emit_pipeline` with a `warpgroup_barrier` after it when
  ``lean_barriers`` (the kernel compiled with ``unsafe_no_auto_barriers``): every
  warp has waited for the step's MMAs and read its stage before the pipeline
  refills it. ``body`` itself otherwise."""
  if not lean_barriers:
    return body

  def released(*args):
    out = body(*args)
    warpgroup_barrier()
    return out

  return released


def warpgroup_any(flags, flag_smem) -> None:
  """OR of a WGMMA-layout int32 array over this warpgroup, into ``flag_smem[0]``.

  Each thread ORs its registers, then one ``bar.red.or.pred`` over the
  warpgroup's 128 threads (its named barrier, as Mosaic's warpgroup barrier)
  both synchronizes and reduces: one barrier instead of a shared-memory
  exchange between two barriers. Every thread stores the same value, so
  ``flag_smem[0]`` read right after is the warpgroup-uniform answer
  (``flag_smem``: a ``[1]`` int32 smem ref of this warpgroup's own).
  """
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def body(_, arr, ref):
    i32 = ir.IntegerType.get_signless(32)
    acc = mgpu_utils.c(0, i32)
    for reg in arr.registers.flat:
      for k in range(ir.VectorType(reg.type).shape[0]):
        acc = arith.ori(acc, vector.extract(reg, [], [k]))
    bar = arith.addi(mgpu_utils.warpgroup_idx(sync=False), mgpu_utils.c(1, i32))
    flag = llvm.inline_asm(
        i32, [acc, bar],
        "{\n.reg .pred p, q;\nsetp.ne.u32 p, $1, 0;\nbar.red.or.pred q, $2, 128, p;\n"
        "selp.u32 $0, 1, 0, q;\n}", "=r,r,r", has_side_effects=True)
    memref.store(flag, ref, [arith.constant(ir.IndexType.get(), 0)])

  body(flags, flag_smem)


def _copy_in(pairs, barrier) -> None:
  """TMA-copies each ``(gmem, smem)`` pair and waits for it (the probes' start)."""
  for g, sm in pairs:
    plgpu.copy_gmem_to_smem(g, sm, barrier)
    plgpu.barrier_wait(barrier)


def _write_out(value, out_smem, out_gmem):
  """Stores a register array through shared memory to its HBM output (the probes' end)."""
  out_smem[...] = value
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_gmem)
  plgpu.wait_smem_to_gmem(0)


def _params():
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def _wide_tile(codes: jax.Array, wide: bool) -> jax.Array:
  """The probes' code input, as `WIDE_ROW`-byte rows with ``wide`` (same bytes)."""
  rows, width = codes.shape
  if not wide:
    return codes
  if not fits_wide_row(width):
    raise ValueError(f"wide=True needs code rows narrower than {WIDE_ROW} bytes, got {width}")
  return codes.reshape(rows * width // WIDE_ROW, WIDE_ROW)


@functools.partial(jax.jit, static_argnames=("bits", "subnormal", "byte_masks", "shuffle_scales",
                                             "wide"))
def probe_dequant(codes: jax.Array, scale: jax.Array | None = None, zero: jax.Array | None = None,
                  *, bits: int = 4, subnormal: bool = False,
                  byte_masks: bool = False, shuffle_scales: bool = False,
                  wide: bool = False, lower: jax.Array | None = None) -> jax.Array:
  """``[64, D*bits/8]`` uint8 -> the ``[64, D]`` bf16 registers of `dequant_codes` (a probe).

  With ``scale`` and ``zero`` (bf16 ``[1, D]``, channel order) the registers
  hold ``code * scale + zero``. ``wide``: the tile is copied as `WIDE_ROW`-byte rows.
  ``lower``: a lower-plane tile like ``codes`` (`dequant_codes`' ``lower_smem``).
  """
  rows, width = codes.shape
  head_dim = width * 8 // bits
  if (scale is None) != (zero is None):
    raise ValueError("pass both scale_smem and zero_smem rows (scale, zero), or neither")
  rows_in = () if scale is None else (scale, zero)
  for name, x in zip(("scale", "zero"), rows_in):
    if tuple(x.shape) != (1, head_dim) or x.dtype not in (jnp.bfloat16, jnp.float16):
      raise ValueError(f"{name} must be bfloat16 or float16 [1, {head_dim}], got {x.dtype} "
                       f"{tuple(x.shape)}")

  tiles_in = [codes] + ([] if lower is None else [lower])
  nt = len(tiles_in)

  def kernel(*refs):
    gm, refs = refs[:nt + len(rows_in)], refs[nt + len(rows_in):]
    out_gmem, sm, (out_smem, barrier) = refs[0], refs[1:-2], refs[-2:]
    _copy_in(tuple(zip(gm, sm)), barrier)
    tiles, extra = sm[:nt], sm[nt:]
    _write_out(dequant_codes(tiles[0], head_dim, bits, *extra, subnormal=subnormal,
                             byte_masks=byte_masks, shuffle_scales=shuffle_scales,
                             lower_smem=tiles[1] if nt > 1 else None),
               out_smem, out_gmem)

  rows_smem = [plgpu.SMEM((1, head_dim), x.dtype) for x in rows_in]
  tiles_in = [_wide_tile(t, wide) for t in tiles_in]
  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((rows, head_dim), jnp.bfloat16),
      scratch_types=[*(plgpu.SMEM(t.shape, jnp.uint8) for t in tiles_in), *rows_smem,
                     plgpu.SMEM((rows, head_dim), jnp.bfloat16), plgpu.Barrier()],
      compiler_params=_params(),
      kernel_name=f"jaxkv_probe_dequant_{bits}{'_affine' if rows_in else ''}"
                  f"{'_sub' if subnormal else ''}{'_bytes' if byte_masks else ''}"
                  f"{'_shfl' if shuffle_scales else ''}{'_wide' if wide else ''}"
                  f"{'_hier' if nt > 1 else ''}")(*tiles_in, *rows_in)


@jax.jit
def probe_gather(codes: jax.Array, codebook: jax.Array) -> jax.Array:
  """``codes [64 | 128, n]`` uint8, ``codebook [n, E, v]`` (bf16/f16) -> the
  ``[rows, n v]`` registers of `gather_codebook` (a probe)."""
  rows, n = codes.shape
  n_cb, entries, vec = codebook.shape
  if n_cb != n:
    raise ValueError(f"codes {codes.shape} and codebook {codebook.shape} disagree on n")
  head_dim = n * vec
  flat = vq_book_rows(codebook)

  def kernel(codes_gmem, book_gmem, out_gmem, codes_smem, book_smem, out_smem, barrier):
    _copy_in(((codes_gmem, codes_smem), (book_gmem, book_smem)), barrier)
    _write_out(gather_codebook(codes_smem, book_smem, head_dim, vec, entries), out_smem,
               out_gmem)

  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((rows, head_dim), codebook.dtype),
      scratch_types=[plgpu.SMEM((rows, n), jnp.uint8), plgpu.SMEM(flat.shape, flat.dtype),
                     plgpu.SMEM((rows, head_dim), codebook.dtype), plgpu.Barrier()],
      compiler_params=_params(), kernel_name=f"jaxkv_probe_gather_v{vec}")(codes, flat)


@functools.partial(jax.jit, static_argnames=("bits", "subnormal"))
def probe_scores(codes: jax.Array, q: jax.Array, scale: jax.Array | None = None,
                 zero: jax.Array | None = None, *, bits: int = 4,
                 subnormal: bool = False) -> jax.Array:
  """``S^T [64, N] = codes @ q^T`` through `dequant_codes` as the wgmma A operand (a probe).

  ``q [N, D]`` bf16 in channel order, N a multiple of 8; its columns are
  permuted by `code_permutation` here, so the result is in channel terms.
  With ``scale``/``zero`` (``[1, D]`` bf16 rows) the A operand is ``code *
  scale + zero``; with ``subnormal`` (affine only) q is multiplied by
  ``2**K_SHIFT`` as the attention kernel does.
  """
  rows, width = codes.shape
  head_dim = width * 8 // bits
  n = q.shape[0]
  if rows not in (_ROWS, 2 * _ROWS) or n % 8 or q.shape[1] != head_dim:
    raise ValueError(f"codes {codes.shape} must be [64, D*bits/8] and q {q.shape} "
                     "[N % 8 == 0, D]")
  rows_in = () if scale is None else (scale, zero)
  if subnormal and not rows_in:
    raise ValueError("probe_scores(subnormal=True) needs scale and zero rows")
  q_perm = q[:, code_permutation(head_dim, bits)]             # [N, D] in MMA column order
  if subnormal:
    q_perm = q_perm * jnp.asarray(2.0 ** K_SHIFT, q.dtype)
  swizzle = 128 if head_dim * 2 % 128 == 0 else 64
  q_transforms = (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))

  def kernel(codes_gmem, q_gmem, *refs):
    if rows_in:
      s_gmem, z_gmem, out_gmem, codes_smem, q_smem, s_smem, z_smem, out_smem, barrier = refs
      _copy_in(((s_gmem, s_smem), (z_gmem, z_smem)), barrier)
      extra = (s_smem, z_smem)
    else:
      out_gmem, codes_smem, q_smem, out_smem, barrier = refs
      extra = ()
    _copy_in(((codes_gmem, codes_smem), (q_gmem, q_smem)), barrier)
    a = dequant_codes(codes_smem, head_dim, bits, *extra, subnormal=subnormal)

    def mma(acc_ref):
      plgpu.wgmma(acc_ref, a, q_smem.transpose((1, 0)))
      return acc_ref[...]

    _write_out(pl.run_scoped(mma, plgpu.ACC((rows, n), jnp.float32)), out_smem, out_gmem)

  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((rows, n), jnp.float32),
      scratch_types=[plgpu.SMEM((rows, width), jnp.uint8),
                     plgpu.SMEM((n, head_dim), jnp.bfloat16, transforms=q_transforms),
                     *[plgpu.SMEM((1, head_dim), x.dtype) for x in rows_in],
                     plgpu.SMEM((rows, n), jnp.float32), plgpu.Barrier()],
      compiler_params=_params(),
      kernel_name=f"jaxkv_probe_scores_{bits}{'_affine' if rows_in else ''}"
                  f"{'_sub' if subnormal else ''}")(codes, q_perm, *rows_in)


@functools.partial(jax.jit, static_argnames=("bits",))
def probe_fold_scores(codes: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array, *,
                      bits: int = 4) -> jax.Array:
  """``S^T [rows, N]`` of ``(codes * scale + zero) @ q^T`` through the folded path (a
  probe): `dequant_codes` (subnormal, byte masks, no affine) against the B
  operands `fold_k_operands` writes, then ones against the zero term; times
  ``2**FOLD_SHIFT``. ``q [N, 128]`` bf16 in channel order, N 8 or 16."""
  rows, width = codes.shape
  head_dim = width * 8 // bits
  n = q.shape[0]
  if rows not in (_ROWS, 2 * _ROWS) or n not in (8, 16) or q.shape[1] != head_dim:
    raise ValueError(f"codes {codes.shape} must be [64 | 128, D*bits/8] and q {q.shape} "
                     "[8 | 16, D]")
  q_perm = q[:, code_permutation(head_dim, bits)]
  q_tf = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  b_tf = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64))

  def kernel(codes_gmem, q_gmem, s_gmem, z_gmem, out_gmem, codes_smem, q_smem, qs_smem, s_smem,
             z_smem, b_smem, out_smem, barrier):
    _copy_in(((codes_gmem, codes_smem), (q_gmem, q_smem), (s_gmem, s_smem), (z_gmem, z_smem)),
             barrier)
    a = dequant_codes(codes_smem, head_dim, bits, subnormal=True, byte_masks=True)
    fold_k_operands(q_smem, s_smem, z_smem, qs_smem, b_smem, bits=bits, q_tiling=(64, 128))
    plgpu.commit_smem()
    ones = plgpu.layout_cast(jnp.full((rows, FOLD_BIAS_COLUMNS), 1.0, jnp.bfloat16),
                             plgpu.Layout.WGMMA)

    def mma(acc_ref):
      plgpu.wgmma(acc_ref, a, qs_smem.transpose((1, 0)))
      plgpu.wgmma(acc_ref, ones, b_smem.transpose((1, 0)))
      return acc_ref[...]

    out = pl.run_scoped(mma, plgpu.ACC((rows, n), jnp.float32)) * (2.0 ** FOLD_SHIFT)
    _write_out(out, out_smem, out_gmem)

  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((rows, n), jnp.float32),
      scratch_types=[plgpu.SMEM((rows, width), jnp.uint8),
                     plgpu.SMEM((n, head_dim), jnp.bfloat16, transforms=q_tf),
                     plgpu.SMEM((n, head_dim), jnp.bfloat16, transforms=q_tf),
                     plgpu.SMEM((1, head_dim), scale.dtype), plgpu.SMEM((1, head_dim), zero.dtype),
                     plgpu.SMEM((n, FOLD_BIAS_COLUMNS), jnp.bfloat16, transforms=b_tf),
                     plgpu.SMEM((rows, n), jnp.float32), plgpu.Barrier()],
      compiler_params=_params(), kernel_name=f"jaxkv_probe_fold_scores_{bits}")(
          codes, q_perm, scale, zero)


@functools.partial(jax.jit, static_argnames=("bits", "swizzle", "subnormal", "byte_masks", "wide"))
def probe_pv(codes: jax.Array, p_t: jax.Array, *, bits: int = 4, swizzle: int = 0,
             subnormal: bool = False, byte_masks: bool = False, wide: bool = False,
             lower: jax.Array | None = None) -> jax.Array:
  """``O^T [D, N] = codes^T @ p_t`` through `dequant_codes_t` as the wgmma A operand
  (a probe); ``codes [64 | 128, D bits/8]`` uint8, ``p_t [rows, N]`` bf16, N a
  multiple of 16; ``swizzle`` 0 or the row width. Rows come out in
  `vt_permutation` order. ``subnormal``: subnormal codes, ``p_t`` times
  ``2**P_SHIFT`` and the product times ``2**(SUBNORMAL_EXP - P_SHIFT)``, as
  the attention kernel does; ``byte_masks`` (with ``subnormal``) takes
  `vt_row_factors` off the product with `scale_halves`, as the kernel does.
  ``wide``: the tile is copied as `WIDE_ROW`-byte rows (``swizzle`` 0 or 128).
  ``lower``: a lower-plane tile like ``codes`` (`dequant_codes_t`' ``lower_smem``)."""
  rows, width = codes.shape
  head_dim = width * 8 // bits
  n = p_t.shape[1]
  if rows not in (_ROWS, 2 * _ROWS) or n % 16 or p_t.shape[0] != rows:
    raise ValueError(f"codes {codes.shape} must be [64 | 128, D bits/8] and p_t {p_t.shape} "
                     "[rows, N % 16 == 0]")
  p_transforms = (plgpu.TilingTransform((8, n)), plgpu.SwizzleTransform(2 * n))
  tiles_in = [_wide_tile(t, wide) for t in [codes] + ([] if lower is None else [lower])]
  nt = len(tiles_in)
  c_transforms = ((plgpu.TilingTransform((8, tiles_in[0].shape[1])),
                   plgpu.SwizzleTransform(swizzle)) if swizzle else ())

  def kernel(*refs):
    gm, (p_gmem, out_gmem), refs = refs[:nt], refs[nt:nt + 2], refs[nt + 2:]
    sm, (p_smem, out_smem, barrier) = refs[:nt], refs[nt:]
    _copy_in((*zip(gm, sm), (p_gmem, p_smem)), barrier)
    a = dequant_codes_t(sm[0], head_dim, bits, swizzle=swizzle, subnormal=subnormal,
                        byte_masks=byte_masks, lower_smem=sm[1] if nt > 1 else None)

    def mma(acc_ref):
      plgpu.wgmma(acc_ref, a, p_smem)
      return acc_ref[...]

    out = pl.run_scoped(mma, plgpu.ACC((head_dim, n), jnp.float32))
    if byte_masks:
      shift = SUBNORMAL_EXP - P_SHIFT
      out = scale_halves(out, 2.0 ** shift, 2.0 ** (shift - bits))
    elif subnormal:
      out = out * (2.0 ** (SUBNORMAL_EXP - P_SHIFT))
    _write_out(out, out_smem, out_gmem)

  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((head_dim, n), jnp.float32),
      scratch_types=[*(plgpu.SMEM(t.shape, jnp.uint8, transforms=c_transforms)
                       for t in tiles_in),
                     plgpu.SMEM((rows, n), jnp.bfloat16, transforms=p_transforms),
                     plgpu.SMEM((head_dim, n), jnp.float32), plgpu.Barrier()],
      compiler_params=_params(),
      kernel_name=f"jaxkv_probe_pv_{bits}_sw{swizzle}{'_sub' if subnormal else ''}"
                  f"{'_bytes' if byte_masks else ''}{'_wide' if wide else ''}"
                  f"{'_hier' if nt > 1 else ''}")(
          *tiles_in, p_t * jnp.asarray(2.0 ** P_SHIFT, p_t.dtype) if subnormal else p_t)


__all__ = ["K_SHIFT", "P_SHIFT", "SUBNORMAL_EXP", "code_permutation", "dequant_codes",
           "dequant_codes_rows", "dequant_codes_t", "gather_codebook", "registers_rows_reference",
           "gather_reference", "probe_dequant", "probe_gather", "probe_pv", "probe_scores",
           "registers_reference", "registers_t_reference", "scale_halves", "fold_k_operands",
           "code_column_exponents", "probe_fold_scores", "FOLD_SHIFT", "FOLD_BIAS_COLUMNS", "vq_book_rows",
           "vq_permutation", "vt_permutation", "vt_row_factors", "warpgroup_any", "widen_columns",
           "WIDE_ROW", "fits_wide_row", "release_stages", "warpgroup_barrier"]
