"""Split-K flash decoding over a packed low-bit KV cache (Pallas Triton).

Two kernels (BitDecoding's dequant-attention and combine):

1. ``jaxkv_dequant_attention``: grid ``(batch, kv_head, split)``. Each split
   walks one contiguous slice of the packed region ``[0, packed_len)``; the
   last one then continues over the full-precision residual block. All ``Hq/Hkv`` query heads times the ``S`` new queries of
   one kv head are the M rows of every dot (padded to >= 16). Each program
   returns an unnormalized partial output with its running max and sum.
2. ``jaxkv_decode_combine``: grid ``(batch, kv_head)``; log-sum-exp merge of
   the partials, normalization, cast to q's dtype.

Scale and zero are folded out of the inner loop (DESIGN.md, "Kernels"), so
each code only needs an int -> float conversion before the dot:

- K per channel (one scale/zero per channel per G tokens):
  ``s = (q * scale_g) @ codes^T + q @ zero_g``.
- K per token (one scale/zero per token per Gd channels):
  ``s = sum_groups scale_t * (q_grp @ codes_grp^T) + zero_t * sum(q_grp)``.
- V per token: ``o_grp += (p * scale_t) @ codes_grp`` and a rank-1 term
  ``(p @ zero_t)`` added once at the end.

Range (README "Input policy"): the softmax scale is a runtime operand applied
to the float32 scores, never folded into a low-precision operand. A float16
dot operand holds only ``|x| <= 65504`` and loses precision below ``6e-5``,
so wherever one is built from other values (q of another dtype, ``q * scale_g``,
``p * scale_t``) its factors are first divided by their largest magnitude
(q per row, scales per step) and the float32 dot result is multiplied back.
A NaN partial denominator makes the combined output NaN, never zero.

The planar layout of `pallas_kernels.layout` unpacks a byte column block into ``8/bits``
contiguous channel blocks of width ``W = D*bits/8``; the kernel multiplies
block ``i`` with ``q_ref[:, i*W : (i+1)*W]`` and keeps one output
accumulator per block, never slicing or concatenating loaded values.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import hierarchical
from pallas_kernels import layout as quant
from pallas_kernels import _triton
from pallas_kernels import tuned
from pallas_kernels.side_spec import CacheFormat

_MIN_ROWS = 16  # smallest M of a Triton dot


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
  """Launch parameters of the split-K dequant-attention kernel family.

  Attributes:
    block_k: packed tokens per inner-loop step (power of two, at most 256;
      with per-channel K it divides the token group G or is a multiple of it).
    num_splits: programs per (batch, kv head) over the packed region.
    residual_program: one more program per (batch, kv head) attends over the
      residual block alone (the partials padded to a multiple of 8 with
      empty programs, so the combine loads them in power-of-two blocks);
      False: the last packed split also takes the residual block, and is the
      slowest program of the grid by that block. Measured (H100, jax 0.11.2,
      `bench/results/attention-residual-program-*.json`): a win for a
      residual of 256 rows (quantspec draft view 37.2 vs 42.6 us at (1, 32K,
      32, 8)), a loss for 128 (int8 46.1 vs 40.2, k8v4 42.0 vs 36.0: more
      programs); `default` turns it on for residuals of >= 256 rows.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining depth of the inner loop.
    prefetch: load each step's scales and zero points one step ahead (carried
      in the loop), so their global-memory latency hides behind the previous
      step's work. Triton's software pipeliner stages only the code tiles;
      without this, Nsight Compute on an H200 showed the first use of a scale
      load as the kernel's hottest stall (long scoreboard, 1/3 of samples).
    defer_sums: accumulate the softmax denominators (and the V zero-point
      terms) elementwise over ``[rows, block_k]`` and reduce them once after
      the loop, instead of a cross-warp row reduction per step: fewer
      instructions and barriers, more registers (so fewer resident programs).
    fast_exp: softmax exponentials as one ``ex2.approx.ftz.f32`` each, with
      log2(e) folded into the score scale (the running maxima kept in base-2
      units inside the kernel, written out in natural units); False:
      ``jnp.exp``, which lowers to libdevice's accurate ``expf`` (six
      instructions per element).
    unpack_sub: on sm_90+, bfloat16 codes leave their magic base by one
      ``sub.bf16x2`` with no multiplier register (see `_unpack_asm`).
    lazy_rescale: a packed step rescales the accumulators (output, deferred
      sums) by ``exp(m_old - m_new)`` only when some row's running max grew,
      under a branch uniform over the program; otherwise that factor is
      ``exp(0) = 1`` and the multiplies are skipped. After a split's first
      few blocks the max rarely grows. Measured (H100, jax 0.11.2,
      `bench/results/attention-ab-lazy-rescale-*.json`): kivi4 -6 to -7 %,
      kivi2 -2 to -5 %, int8 -1 to -2 %, k8v4 -14 to -16 % (the same
      outputs).

  Search space (`jaxkv.autotune`): block_k in {32, 64, 128, 256}, num_splits
  around the heuristic (x1/2, x1, x2), num_warps in {1, 2, 4}, num_stages in
  {2, 3, 4}, defer_sums in {True, False} (prefetch stays on).
  """

  block_k: int = 128
  num_splits: int = 16
  num_warps: int = 4
  num_stages: int = 2
  defer_sums: bool = True
  prefetch: bool = True
  residual_program: bool = False
  fast_exp: bool = True
  unpack_sub: bool = True
  lazy_rescale: bool = True

  @property
  def num_parts(self) -> int:
    """Partials per (batch, kv head): the splits, the residual program, padding."""
    if not self.residual_program:
      return self.num_splits
    parts = self.num_splits + 1
    return parts if parts <= 8 else -(-parts // 8) * 8

  @property
  def residual_split(self) -> int:
    """The program that attends over the residual block."""
    return self.num_splits if self.residual_program else self.num_splits - 1

  def __post_init__(self):
    if not _triton.is_int(self.block_k):
      raise ValueError(f"block_k={self.block_k!r} must be an int, got "
                       f"{type(self.block_k).__name__}")
    if not _triton.is_pow2(self.block_k) or not 16 <= self.block_k <= 256:
      raise ValueError(f"block_k={self.block_k} must be a power of two in [16, 256]")
    _triton.check_launch(self)
    for name in ("block_k", "num_splits", "num_warps", "num_stages"):  # numpy ints -> int
      object.__setattr__(self, name, int(getattr(self, name)))
    for f in dataclasses.fields(self):  # "no" is truthy: flags must be real bools
      value = getattr(self, f.name)
      if f.type in ("bool", bool) and not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{f.name}={value!r} must be a bool")
      if f.type in ("bool", bool):
        object.__setattr__(self, f.name, bool(value))

  @classmethod
  def default(cls, *, batch: int, tokens: int, q_heads: int, kv_heads: int,
              head_dim: int, k_bits: int, v_bits: int, token_group: int = 128,
              k_axis: str = "channel", num_sms: int | None = None,
              itemsize: int = 2, residual: int = 128,
              channel_groups: int = 1, num_queries: int = 1) -> "DecodeAttentionConfig":
    """Heuristic: ~2 programs per SM (4 with an 8-bit side), >= 2 steps and >= 2 splits.

    Measured on an H100 (the benchmark's config
    search, jax 0.11.2): splits rounded down to a power of two so that
    about two programs (four for 8-bit sides, whose programs are lighter)
    share an SM were fastest; 128-token steps with 3 stages for 4/2-bit
    sides, 64-token steps for 8-bit ones;
    2 warps when K is per-token (its unpacked tile is half the registers of
    a per-channel one at the same speed); ``itemsize`` is the bytes of the cache dtype: float32 caches double every
    unpacked tile in shared memory, so they get no software pipelining.
    ``channel_groups``: per-token channel groups (``D // Gd``) of the low-bit
    sides. With more than two (int4-token-g4: four groups of 32), each group
    is its own dot, scale and zero-point row sum, so one-warp programs (no
    cross-warp row reductions), about eight per SM, with 32-token steps:
    35.7 / 104.1 / 194.5 us instead of 56.2 / 194.9 / 380.7 at (1, 32K) /
    (1, 128K) / (8, 32K) with 32 query and 8 kv heads (H100, jax 0.11.2,
    `bench/results/attention-ab-{w1,token-g4}-nvidia-h100-80gb-hbm3-20261125.*`).
    ``num_queries``: query tokens per sequence; with the GQA ratio they make
    the rows one program holds (``num_queries * q_heads // kv_heads``).
    """
    del head_dim, token_group
    rows = num_queries * max(1, q_heads // max(kv_heads, 1))
    num_sms = num_sms or _triton.num_sms()
    bits = max(k_bits, v_bits)
    one_warp = channel_groups > 2 and bits < 8
    block_k = 32 if one_warp else {16: 64, 8: 64}.get(bits, 128)
    blocks = max(1, pl.cdiv(tokens, block_k))
    per_sm = 8 if one_warp else 4 if bits >= 8 else 2
    want = pl.cdiv(per_sm * num_sms, batch * kv_heads)
    splits = min(_triton.prev_pow2(want), max(1, blocks // 2), 256)
    # At least two splits: the last split also reads the residual block, so
    # an unsplit (b, h) program is the longest of the grid (kivi4 at (48, 32K,
    # 32, 8): 1156 us with one split, 887 with two).
    splits = max(splits, min(2, max(1, blocks // 2)))
    # When one program per (b, h) already fills the GPU, occupancy matters
    # more than the per-step row sums: defer_sums' [rows, block_k]
    # accumulators cost registers (kivi4 at (48, 32K): 849 vs 887 us; at
    # (16, 32K), below the fill, 323 vs 304 the other way). Measured for
    # 4/2-bit sides only; at up to 16 rows 8-bit and 16-bit sides keep the
    # deferred sums.
    grid_full = bits < 8 and batch * kv_heads >= per_sm * num_sms
    # Above 16 rows per program the [rows, block_k] accumulators cost more
    # than the row sums they save, at every low-bit width measured (H200, jax
    # 0.11.2, 128K, 20 rows: quantspec 207 -> 159 us, kivi4 153 -> 134, kivi2
    # 696 -> 300, int8 200 -> 141; kivi4 at 32 rows 47.0 -> 40.7; at 8-16
    # rows within 1-10 % the other way: `bench/results/defer-sums-20261128*`).
    # Extrapolated, not measured: 16-bit sides and the H100.
    many_rows = rows > 16
    stages = 3
    if itemsize > 2:
      stages = 1
    warps = 1 if one_warp else 2 if k_axis == "token" else 4
    return cls(block_k=block_k, num_splits=max(1, splits), num_warps=warps, num_stages=stages,
               defer_sums=not (grid_full or many_rows), residual_program=residual >= 256)


def _code_dtype(bits, cache_dtype):
  """Float dtype the unpacked codes of a ``bits``-bit side are fed to the dots in.

  bf16 holds integers exactly only up to 256, so 8-bit codes (and every side
  of a float16 cache) use float16; float32 caches keep float32 dots.
  """
  if cache_dtype == jnp.float32:
    return jnp.float32
  if bits <= 4 and cache_dtype == jnp.bfloat16:
    return jnp.bfloat16
  return jnp.float16


# Codes become floats by bit tricks, not int->float conversions: OR-ing a code
# c, shifted left by s bits, into the low mantissa bits of ``magic`` gives the
# float ``base + c * 2**s`` exactly (bf16 0x4300 = 128 with 7 mantissa bits,
# f16 0x6400 = 1024 with 10), and one fused multiply-add
# ``x * 2**-s - base * 2**-s`` leaves exactly ``c``.
_MAGIC = {  # dtype -> (magic bits, base value, code bits that fit the low byte)
    jnp.dtype(jnp.bfloat16): (0x4300, 128.0, 7),
    jnp.dtype(jnp.float16): (0x6400, 1024.0, 8),
}


def _pair_bits(value: float, dtype) -> int:
  """32-bit pattern of ``value`` in both halves (a bf16x2 / f16x2 constant)."""
  half = int(np.array(value, dtype).view(np.uint16))
  return (half << 16) | half


def _unpack_asm(bits: int, dtype, plane: int, hier_plane: int | None = None,
                sub: bool = False) -> str:
  """PTX turning 4 packed bytes into the 4 exact codes of one plane.

  Operands: outputs ``$0`` (elements 0-1) and ``$1`` (elements 2-3) as
  bf16x2/f16x2; the input ``$2`` holds 4 bytes, element 0 lowest.
  An optional ``shr`` of the word (when the plane's bits would reach past
  the low mantissa byte), then per output register one ``prmt`` that puts
  two bytes into the low halves of the 16-bit lanes and the magic exponent
  byte into the high halves, one ``and`` with a single immediate that keeps
  the plane's bits and the exponent, and one ``fma`` that removes the base.
  Every constant but one (the exponent filler) is an immediate, so ptxas
  does not rematerialize masks inside the loop.

  ``sub`` (bfloat16 on sm_90+, where ``sub.bf16x2`` exists): the word is
  shifted so the plane's bits sit at bit 0 of each byte and the base leaves
  by one ``sub`` with no multiplier. The multiplier of the ``fma`` form is a
  register constant, and Nsight Compute showed ptxas packing it into the
  upper half of a register that receives a (prefetched) scale load, so the
  dequantization waited on that load: the kernel's hottest stall.

  ``hier_plane`` (QuantSpec target view, ``bits == 8``): the inputs are two
  words, ``$2`` the upper-plane bytes and ``$3`` the lower-plane bytes of 4
  byte columns; plane ``p``'s 8-bit codes ``16 C_U + (C_L + 8)`` are composed
  for all 4 bytes at once (a shift and one ``lop3`` per word) before the
  8-bit unpack.
  """
  magic, base, low_bits = _MAGIC[jnp.dtype(dtype)]
  suffix = "bf16x2" if jnp.dtype(dtype) == jnp.bfloat16 else "f16x2"
  shift = plane * bits
  pre = max(0, shift + bits - low_bits)  # right shift so the code fits
  if sub:
    pre = shift
  at = shift - pre
  keep = magic | (((1 << bits) - 1) << at)  # exponent byte + the code's bits
  lines = ["{", ".reg .b32 w, t, lo, hi, fill, sc, bs;",
           f"mov.b32 fill, {(magic >> 8) * 0x01010101:#010x};"]
  if sub:  # at == 0: subtract the base
    lines.append(f"mov.b32 bs, {_pair_bits(base, dtype):#010x};")
  else:    # x * 2**-at - base * 2**-at
    lines += [f"mov.b32 sc, {_pair_bits(2.0 ** -at, dtype):#010x};",
              f"mov.b32 bs, {_pair_bits(-base * 2.0 ** -at, dtype):#010x};"]
  src = "$2"
  if hier_plane is not None:
    if bits != 8 or pre:
      raise ValueError(f"hierarchical codes need 8-bit float16 unpacking, got {bits=} {dtype}")
    # lop3 0xE4 = (a & c) | (b & ~c): high nibbles from a, low from b.
    if hier_plane == 0:   # element j: upper low nibble -> high, lower low nibble -> low
      lines += ["shl.b32 t, $2, 4;", "lop3.b32 w, t, $3, 0xF0F0F0F0, 0xE4;"]
    else:                 # element j + D/2: the high nibbles
      lines += ["shr.u32 t, $3, 4;", "lop3.b32 w, $2, t, 0xF0F0F0F0, 0xE4;"]
    src = "w"
  elif pre:
    lines.append(f"shr.u32 w, $2, {pre};")
    src = "w"
  lines += [f"prmt.b32 lo, {src}, fill, 0x5140;",   # [b0, m, b1, m]
            f"prmt.b32 hi, {src}, fill, 0x5342;"]   # [b2, m, b3, m]
  for out, reg in (("$0", "lo"), ("$1", "hi")):
    if bits < 8:
      lines.append(f"and.b32 {reg}, {reg}, {keep | (keep << 16):#010x};")
    if sub:
      lines.append(f"sub.rn.{suffix} {out}, {reg}, bs;")
    else:
      lines.append(f"fma.rn.{suffix} {out}, {reg}, sc, bs;")
  lines.append("}")
  return "\n".join(lines)


def _unpack_planes(byte_block, bits, dtype, use_asm, sub=False):
  """All ``8/bits`` planes of a ``[t, w]`` uint8 block as exact codes in ``dtype``.

  ``use_asm`` (compiled GPU kernels) runs `_unpack_asm`, one call per plane
  (the Triton lowering takes single-result inline assembly; ptxas merges the
  repeated ``prmt``); otherwise the same bit trick in jnp (interpret mode).
  """
  planes = 8 // bits
  out = []
  for plane in range(planes):
    if use_asm and dtype != jnp.float32:
      [codes] = plgpu.elementwise_inline_asm(
          _unpack_asm(bits, dtype, plane, sub=sub and dtype == jnp.bfloat16),
          args=[byte_block], constraints="=r,=r,r", pack=4,
          result_shape_dtypes=[jax.ShapeDtypeStruct(byte_block.shape, dtype)])
      out.append(codes)
      continue
    codes = byte_block
    if plane:
      codes = codes >> np.uint8(plane * bits)
    if bits < 8:
      codes = codes & np.uint8((1 << bits) - 1)
    if dtype == jnp.float32:
      out.append(codes.astype(jnp.float32))
      continue
    magic, base, _ = _MAGIC[jnp.dtype(dtype)]
    as_float = lax.bitcast_convert_type(codes.astype(jnp.uint16) | np.uint16(magic), dtype)
    out.append(as_float - jnp.asarray(base, dtype))
  return out


# HIGHEST makes float32 operands use IEEE fp32 dots (Triton's default for f32
# is TF32, ~1e-3 relative); bf16/f16 operands are unaffected.
def _dot(a, b):
  return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _dot_t(a, b):
  """``a @ b.T``."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _exp2(x, use_asm):
  """``2 ** x`` (float32): one ``ex2.approx.ftz.f32`` per element when compiled.

  Its relative error (~2e-7) is below float32 softmax rounding; -inf gives 0.
  """
  if not use_asm:
    return jnp.exp2(x)
  [y] = plgpu.elementwise_inline_asm(
      "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
  return y


@dataclasses.dataclass(frozen=True)
class _Side:
  """Static description of one cache side (K or V) inside the kernel."""

  bits: int
  axis: str      # "token" or "channel"
  group: int     # Gd for "token", G for "channel"; 1 when bits == 16
  # QuantSpec target view (`jaxkv.hierarchical`): ``bits == 4`` plane geometry;
  # each element becomes the 8-bit code c8 = 16 C_U + C_L + 8 with scale
  # S_U / 16 and zero min - S_U / 2. A draft view is a plain 4-bit side.
  hier: bool = False
  # Either view of a hierarchical cache: its codes are plane-blocked by this
  # many tokens and the kernel gets them as [2C, D/2] rows: token t's upper
  # plane at row `hierarchical.plane_row(t, plane_block)`, its lower plane
  # plane_block rows further (a step never crosses a plane block).
  plane_block: int = 0

  @property
  def code_bits(self) -> int:
    """Bits of the codes the dots consume (8 for the hierarchical target view)."""
    return 8 if self.hier else self.bits

  def affine(self, scale, zero):
    """Stored (scale, zero) as float32 -> the (scale, zero) of this side's codes."""
    if not self.hier:
      return scale, zero
    return scale * np.float32(1.0 / 16.0), zero - np.float32(0.5) * scale

  def chunks(self, head_dim):
    """Byte column blocks ``(byte_col, width, [(plane, out_col, group), ...])``.

    Each block is loaded once and unpacked into its planes; every plane lies
    inside one channel group.
    """
    if self.bits == 16:
      return [(0, head_dim, [(0, 0, 0)])]
    per_byte = 8 // self.bits
    width = head_dim // per_byte
    chunk = width if self.axis == "channel" else min(width, self.group)
    out = []
    for c in range(width // chunk):
      planes = []
      for i in range(per_byte):
        col = i * width + c * chunk
        planes.append((i, col, 0 if self.axis == "channel" else col // self.group))
      out.append((c * chunk, chunk, planes))
    return out

  def flat(self, head_dim):
    """``(byte_col, width, plane, out_col, group)`` for every plane of every block."""
    return [(bcol, w, i, col, g) for bcol, w, planes in self.chunks(head_dim)
            for i, col, g in planes]


def _split_kernel(
    # inputs
    lengths_ref,   # [] int32: L_b
    scale_ref,     # [] float32: softmax scale
    q_ref,         # [Mq, D]
    k_codes_ref,   # [C, D*kb/8] uint8 | [C, D] when 16-bit | [2C, D/2] (hierarchical)
    k_scale_ref,   # [C//G, D] (channel) | [C, D//Gd] (token) | None
    k_zero_ref,    # like k_scale_ref
    v_codes_ref,   # [C, D*vb/8] uint8 | [C, D] when 16-bit | [2C, D/2] (hierarchical)
    v_scale_ref,   # [C, D//Gd] | None
    v_zero_ref,    # like v_scale_ref
    k_res_ref,     # [R, D]
    v_res_ref,     # [R, D]
    # outputs
    o_ref,         # [M, D] float32, unnormalized
    l_ref,         # [M] float32, softmax denominators
    m_ref,         # [M] float32, running maxima (-inf: no valid key)
    *,
    k_side: _Side,
    v_side: _Side,
    token_group: int,
    residual: int,
    num_queries: int,
    num_splits: int,
    residual_split: int,
    block_k: int,
    res_block: int,
    use_asm: bool,
    defer_sums: bool,
    prefetch: bool = False,
    fast_exp: bool = False,
    unpack_sub: bool = False,
    lazy_rescale: bool = False,
    skip_tokens: int = 0,
):
  rows, head_dim = o_ref.shape
  q_rows = q_ref.shape[0]
  dtype = k_res_ref.dtype
  split = pl.program_id(2)
  length = lengths_ref[()]
  sm_scale = scale_ref[()]
  packed = token_group * jnp.maximum(0, (length - residual + token_group) // token_group)
  # Query row r is (query head h, new token s) with r = h * S + s; it sees keys
  # [0, L - S + s] (causal among the S new tokens).
  row_s = (lax.broadcasted_iota(jnp.int32, (rows,), 0) % q_rows) % num_queries
  row_limit = length - num_queries + row_s
  # fast_exp: scores (and the running maxima) in base-2 units, exponentials
  # by ex2; the maxima are written out in natural units.
  if fast_exp:
    exp = functools.partial(_exp2, use_asm=use_asm)
    sm_scale = sm_scale * _LOG2E
  else:
    exp = jnp.exp

  def online_softmax(s, valid, m, l):
    s = jnp.where(valid, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = exp(m - m_safe)
    p = exp(s - m_safe[:, None])
    return p, alpha, m_new, alpha * l + jnp.sum(p, axis=1)

  k_flat = k_side.flat(head_dim)
  v_flat = v_side.flat(head_dim)
  k_dt = dtype if k_side.bits == 16 else _code_dtype(k_side.code_bits, dtype)
  v_dt = dtype if v_side.bits == 16 else _code_dtype(v_side.code_bits, dtype)
  # q per K plane, [rows, w] in q's dtype (kept in registers across the loop).
  q_vals = [q_ref[:, pl.ds(col, w)] for _, w, _, col, _ in k_flat]
  q_abs = None
  for qv in q_vals:
    part = jnp.max(jnp.abs(qv.astype(jnp.float32)), axis=1)
    q_abs = part if q_abs is None else jnp.maximum(q_abs, part)
  q_norm = jnp.where(q_abs > 0, q_abs, 1.0)  # [rows] largest |q| of each row
  ones = jnp.ones((rows,), jnp.float32)

  def q_operands(dt, normalize):
    """q per plane as dot operands in ``dt``, and the [rows] factor of their scores.

    ``normalize``: q / (its row's largest |q|), so a float16 operand neither
    overflows nor goes subnormal; the scores are multiplied back in float32.
    """
    if not normalize:
      return [qv.astype(dt) for qv in q_vals], sm_scale * ones
    return ([(qv.astype(jnp.float32) / q_norm[:, None]).astype(dt) for qv in q_vals],
            sm_scale * q_norm)

  q_dtype = q_ref.dtype
  k_token = k_side.bits < 16 and k_side.axis == "token"
  # Per-channel K folds its scale into a float16 operand: both factors normalized.
  k_channel_norm = k_side.bits < 16 and k_side.axis == "channel" and k_dt == jnp.float16
  if k_token or k_side.bits == 16:
    q_dots, k_mult = q_operands(k_dt, k_dt == jnp.float16 and q_dtype != jnp.float16)
  elif k_channel_norm:
    q_f32 = [qv.astype(jnp.float32) / q_norm[:, None] for qv in q_vals]
    k_mult = sm_scale * q_norm
  else:
    # The softmax scale rides in the bfloat16 operand (q s) and the bias: the
    # scores leave the MMA chain scaled (no multiply per score).
    q_f32 = [qv.astype(jnp.float32) * sm_scale for qv in q_vals]
    k_mult = None
  v_norm = v_side.bits < 16 and v_dt == jnp.float16
  if k_token:
    num_k_groups = head_dim // k_side.group
    q_sums = [None] * num_k_groups  # sums of the rounded q the dots consume
    for (_, _, _, _, g), qd in zip(k_flat, q_dots):
      part = jnp.sum(qd.astype(jnp.float32), axis=1)
      q_sums[g] = part if q_sums[g] is None else q_sums[g] + part
  v_groups = 1 if v_side.bits == 16 else head_dim // v_side.group
  # Row sums (softmax denominator, V zero-point term) are accumulated
  # elementwise over [rows, kb] and reduced once after the loop: a row sum of
  # an mma tile crosses warps (shared memory and a barrier) on every step.
  defer_sums = defer_sums and v_groups <= 2

  def unpack(ref, tok, bcol, w, side, dt):
    if side.plane_block:  # the upper-plane rows of the step's tokens (one plane block)
      tok = pl.ds(hierarchical.plane_row(tok.start, side.plane_block), tok.size)
    if not side.hier:
      return _unpack_planes(ref[tok, pl.ds(bcol, w)], side.bits, dt, use_asm, unpack_sub)
    # Target view: byte j of a plane holds elements j (low nibble) and j + D/2
    # (high nibble); an element's upper and lower nibbles form its 8-bit code
    # c8 = 16 C_U + (C_L + 8), exact in ``dt`` (float16). Compiled: one PTX
    # block per 4 byte columns composes the codes in 32-bit words and unpacks
    # them (`_unpack_asm` with ``hier_plane``). Composing with uint8 tensor
    # ops instead made the target view 1.7x slower than int8.
    upper = ref[tok, pl.ds(bcol, w)]
    lower = ref[pl.ds(tok.start + side.plane_block, tok.size), pl.ds(bcol, w)]
    if use_asm and dt == jnp.float16:
      out = []
      for plane in range(2):
        [codes] = plgpu.elementwise_inline_asm(
            _unpack_asm(8, dt, 0, hier_plane=plane), args=[upper, lower],
            constraints="=r,=r,r,r", pack=4,
            result_shape_dtypes=[jax.ShapeDtypeStruct(upper.shape, dt)])
        out.append(codes)
      return out
    low_nib = np.uint8(15)
    c8 = [((upper & low_nib) << np.uint8(4)) | (lower & low_nib),
          (upper & np.uint8(0xF0)) | (lower >> np.uint8(4))]
    return [_unpack_planes(c, 8, dt, False)[0] for c in c8]

  def load_affine(t0, kb):
    """Raw (stored dtype) scales and zeros a step over tokens [t0, t0 + kb) reads.

    ``(k_aff, v_aff)``: per-channel K one ``([1, w] scale, [1, w] zero)`` per
    plane (in `k_flat` order); per-token K and V one ``([kb] scale, [kb]
    zero)`` per channel group. Indices are clamped into the arrays, so a
    look-ahead past the last step reads valid (unused) rows.
    """
    k_aff, v_aff = [], []
    if k_side.bits < 16 and k_side.axis == "channel":
      grp = jnp.minimum(t0 // token_group, k_scale_ref.shape[0] - 1)
      for _, w, _, col, _ in k_flat:
        k_aff.append((k_scale_ref[pl.ds(grp, 1), pl.ds(col, w)],
                      k_zero_ref[pl.ds(grp, 1), pl.ds(col, w)]))
    elif k_side.bits < 16:
      tok = pl.ds(jnp.minimum(t0, k_scale_ref.shape[0] - kb), kb)
      for g in range(head_dim // k_side.group):
        k_aff.append((k_scale_ref[tok, g], k_zero_ref[tok, g]))
    if v_side.bits < 16:
      tok = pl.ds(jnp.minimum(t0, v_scale_ref.shape[0] - kb), kb)
      for g in range(v_groups):
        v_aff.append((v_scale_ref[tok, g], v_zero_ref[tok, g]))
    return k_aff, v_aff

  def k_scores_channel(tok, k_aff):
    """Per-channel K scores (times ``k_mult``) as one accumulator chain over the planes.

    ``sum_c q_c (s_c code_c + z_c) = (q s) . code + q . z``: the zero-point
    term of every plane starts the chain, each plane's ``(q s) . code``
    is added by its MMA. A float16 operand is normalized by the step's
    largest scale (over all planes, so one factor serves the chain).
    Triton folds each ``dot + acc`` into the MMA's accumulator; measured 3-5 %
    faster than summing separate products (H100, kivi4/kivi2).
    """
    scales, bias = [], None
    for idx in range(len(k_flat)):
      scale, zero = k_side.affine(k_aff[idx][0].astype(jnp.float32),
                                  k_aff[idx][1].astype(jnp.float32))
      scales.append(scale)
      part = jnp.sum(q_f32[idx] * zero, axis=1)
      bias = part if bias is None else bias + part
    s_max = None
    if k_channel_norm:
      for scale in scales:
        part = jnp.max(jnp.abs(scale))
        s_max = part if s_max is None else jnp.maximum(s_max, part)
      s_max = jnp.where(s_max > 0, s_max, 1.0)
      bias = bias / s_max
    s = jnp.broadcast_to(bias[:, None], (rows, tok.size))
    for bcol, w, planes in k_side.chunks(head_dim):
      codes = unpack(k_codes_ref, tok, bcol, w, k_side, k_dt)
      for plane, col, _ in planes:
        idx = k_flat.index((bcol, w, plane, col, 0))
        scale = scales[idx] if s_max is None else scales[idx] / s_max
        s = _dot_t((q_f32[idx] * scale).astype(k_dt), codes[plane]) + s
    if s_max is None:
      return s if k_mult is None else s * k_mult[:, None]
    return s * (s_max * k_mult)[:, None]  # one multiply per score

  def k_scores(t0, kb, k_aff):
    """Scaled scores [rows, kb] of packed tokens [t0, t0 + kb)."""
    tok = pl.ds(t0, kb)
    if k_side.bits == 16:
      return _dot_t(q_dots[0], k_codes_ref[tok, :].astype(dtype)) * k_mult[:, None]
    if k_side.axis == "channel":
      return k_scores_channel(tok, k_aff)
    per_group = [None] * num_k_groups
    for bcol, w, planes in k_side.chunks(head_dim):
      codes = unpack(k_codes_ref, tok, bcol, w, k_side, k_dt)
      for plane, col, g in planes:
        qd = q_dots[k_flat.index((bcol, w, plane, col, g))]
        per_group[g] = (_dot_t(qd, codes[plane]) if per_group[g] is None
                        else _dot_t(qd, codes[plane]) + per_group[g])
    s = None
    for g in range(num_k_groups):
      scale, zero = k_side.affine(k_aff[g][0].astype(jnp.float32),
                                  k_aff[g][1].astype(jnp.float32))
      term = per_group[g] * scale[None, :] + q_sums[g][:, None] * zero[None, :]
      s = term if s is None else s + term
    return s * k_mult[:, None]

  def step(t0, kb, carry, aff):
    m, l, accs, zaccs = carry
    k_aff, v_aff = aff
    s = k_scores(t0, kb, k_aff)
    in_packed = None
    if mask_packed:
      t = t0 + lax.broadcasted_iota(jnp.int32, (kb,), 0)
      in_packed = t < packed
      valid = in_packed[None, :] & (t[None, :] <= row_limit[:, None])
      s = jnp.where(valid, s, -jnp.inf)
    def packed_only(x, fill):  # [kb, ...] values of tokens past the packed region -> fill
      if in_packed is None:
        return x
      return jnp.where(in_packed.reshape(in_packed.shape + (1,) * (x.ndim - 1)), x, fill)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = exp(s - m_safe[:, None])

    def rescale(c):  # every accumulator times exp(m_old - m_new)
      l_, accs_, zaccs_ = c
      a = exp(m - m_safe)
      a2 = a[:, None]
      return (a2 * l_ if defer_sums else a * l_, [a2 * x for x in accs_],
              [a2 * z if defer_sums else a * z for z in zaccs_])

    if lazy_rescale:  # the factor is exp(0) = 1 unless some row's max grew
      grew = jnp.max(jnp.where(m_new > m, 1, 0)) > 0
      l, accs, zaccs = lax.cond(grew, rescale, lambda c: c, (l, list(accs), list(zaccs)))
    else:
      l, accs, zaccs = rescale((l, list(accs), list(zaccs)))
    l = l + p if defer_sums else l + jnp.sum(p, axis=1)
    tok = pl.ds(t0, kb)
    if v_side.bits == 16:
      v = packed_only(v_codes_ref[tok, :].astype(dtype), 0)
      return m_new, l, [accs[0] + _dot(p.astype(dtype), v)], zaccs
    p_scaled, v_mult, new_zaccs = [], [], []
    for g in range(v_groups):
      scale = packed_only(v_aff[g][0].astype(jnp.float32), 0.0)
      zero = packed_only(v_aff[g][1].astype(jnp.float32), 0.0)
      scale, zero = v_side.affine(scale, zero)
      if v_norm:  # p * scale in float16: divide by the step's largest scale
        s_max = jnp.max(jnp.abs(scale))
        s_max = jnp.where(s_max > 0, s_max, 1.0)
        p_scaled.append((p * (scale / s_max)[None, :]).astype(v_dt))
        v_mult.append(s_max)
      else:
        p_scaled.append((p * scale[None, :]).astype(v_dt))
        v_mult.append(None)
      if defer_sums:
        new_zaccs.append(zaccs[g] + p * zero[None, :])
      else:
        new_zaccs.append(zaccs[g] + jnp.sum(p * zero[None, :], axis=1))
    new_accs = list(accs)
    for bcol, w, planes in v_side.chunks(head_dim):
      codes = unpack(v_codes_ref, tok, bcol, w, v_side, v_dt)
      for plane, col, g in planes:
        idx = v_flat.index((bcol, w, plane, col, g))
        part = _dot(p_scaled[g], codes[plane])
        if v_mult[g] is not None:
          part = part * v_mult[g]
        new_accs[idx] = accs[idx] + part
    return m_new, l, new_accs, new_zaccs

  # Per-channel K: a step never crosses a token group (one scale row per step);
  # plane-blocked codes: nor a plane block (contiguous rows per plane).
  blocked = max(k_side.plane_block, v_side.plane_block)
  sub_k = (min(token_group, block_k) if k_side.axis == "channel" and k_side.bits < 16
           else block_k)
  if blocked:
    sub_k = min(sub_k, blocked)

  # Every packed step is whole and precedes every query row's causal limit
  # when the splits' blocks tile the packed region (a multiple of G) and the
  # residual keeps >= S - 1 rows (packed <= L - (R - G)): then the steps skip
  # the token mask (its compares and selects on every score).
  mask_packed = not (token_group % block_k == 0 and residual - token_group >= num_queries - 1)

  # The look-ahead needs a whole step of rows in the per-token arrays (the
  # code rows: C, or 2C plane rows for hierarchical codes, both >= G >= sub_k).
  prefetch = prefetch and k_codes_ref.shape[0] >= sub_k

  def body(i, carry):
    t0 = start + i * block_k
    if not prefetch:
      for sub in range(block_k // sub_k):
        carry = step(t0 + sub * sub_k, sub_k, carry, load_affine(t0 + sub * sub_k, sub_k))
      return carry
    state, aff = carry
    for sub in range(block_k // sub_k):
      ts = t0 + sub * sub_k
      nxt = load_affine(ts + sub_k, sub_k)  # issued before this step's work
      state = step(ts, sub_k, state, aff)
      aff = nxt
    return state, aff

  # This split's slice of the packed region (a multiple of block_k tokens);
  # with ``skip_tokens`` the caller attends [0, min(skip, packed)) itself.
  start, stop = _triton.split_range(packed, split, num_splits, block_k, skip_tokens)
  num_blocks = jnp.maximum(0, pl.cdiv(stop - start, block_k))
  sums_shape = (rows, sub_k) if defer_sums else (rows,)
  carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros(sums_shape, jnp.float32),
           [jnp.zeros((rows, w), jnp.float32) for (_, w, _, _, _) in v_flat],
           [jnp.zeros(sums_shape, jnp.float32) for _ in range(v_groups)])
  if prefetch:
    carry = (carry, load_affine(start, sub_k))
  carry = lax.fori_loop(0, num_blocks, body, carry)
  m, l, accs, zaccs = carry[0] if prefetch else carry
  if defer_sums:
    l = jnp.sum(l, axis=1)
    zaccs = [jnp.sum(z, axis=1) for z in zaccs]

  # Program ``residual_split`` attends over the residual (full precision)
  # rows: its own program after the packed splits (``residual_program``; it
  # has no packed blocks), or the last packed split continuing the same
  # online softmax with the same per-plane accumulators. Either way it is
  # straight-line code under a branch, not a loop: a loop would be
  # software-pipelined, and its staging buffers (several [res_block, D] tiles
  # per stage) would take shared memory from every program for a block that
  # one program reads once. Programs past it (padding) write empty partials.
  num_res = length - packed
  q_res, res_mult = q_operands(dtype, dtype == jnp.float16 and q_dtype != jnp.float16)

  def res_block_step(r0, carry):
    m, l, accs = carry
    idx = r0 + lax.broadcasted_iota(jnp.int32, (res_block,), 0)
    in_res = idx < num_res
    valid = in_res[None, :] & ((packed + idx)[None, :] <= row_limit[:, None])
    tok = pl.ds(r0, res_block)
    s = None
    for (_, w, _, col, _), qr in zip(k_flat, q_res):
      part = _dot_t(qr, k_res_ref[tok, pl.ds(col, w)])
      s = part if s is None else s + part
    p, alpha, m, l = online_softmax(s * res_mult[:, None], valid, m, l)
    p = p.astype(dtype)
    new_accs = []
    for (_, w, _, col, _), acc in zip(v_flat, accs):
      v = jnp.where(in_res[:, None], v_res_ref[tok, pl.ds(col, w)], 0)
      new_accs.append(alpha[:, None] * acc + _dot(p, v))
    return m, l, new_accs

  def residual_part(carry):
    for r0 in range(0, residual, res_block):
      carry = lax.cond(r0 < num_res, functools.partial(res_block_step, r0),
                       lambda c: c, carry)
    return carry

  m_packed = m
  m, l, accs = lax.cond(split == residual_split, residual_part, lambda c: c, (m, l, accs))
  # Rescale the zero accumulators by how far the residual moved the max.
  alpha_z = exp(m_packed - jnp.where(m == -jnp.inf, 0.0, m))
  for (_, w, _, col, g), acc in zip(v_flat, accs):
    if v_side.bits < 16:
      acc = acc + (alpha_z * zaccs[g])[:, None]
    o_ref[:, pl.ds(col, w)] = acc
  l_ref[...] = l
  m_ref[...] = m * _LN2 if fast_exp else m


def _combine_kernel(
    # inputs
    o_ref,    # [J, M, dblk] float32 partial outputs
    l_ref,    # [J, M]
    m_ref,    # [J, M]
    *refs,    # [qh_ref [M', D], seq_bad_ref [1] int32 (with ``poison``)], out_ref
              # [Mo, dblk] in q's dtype, [lse_ref [Mo] float32 log-sum-exp of the
              # scaled scores]
    parts_block: int,
    poison: int = 0,
):
  """Log-sum-exp merge of the J partials of one (batch, kv head, column block);
  with ``poison`` (the number of real query rows), the rows
  `_triton.query_row_flags` finds in the split kernel's query rows ``qh_ref``
  are NaN."""
  if poison:
    qh_ref, seq_bad_ref, refs = refs[0], refs[1], refs[2:]
  out_ref, lse_ref = refs[0], (refs[1] if len(refs) > 1 else None)
  num_parts = o_ref.shape[0]
  out_rows = out_ref.shape[0]
  rows = pl.ds(0, out_rows)

  def max_body(j, m):
    part = pl.ds(j * parts_block, parts_block)
    return jnp.maximum(m, jnp.max(m_ref[part, rows], axis=0))

  num_blocks = num_parts // parts_block
  m = lax.fori_loop(0, num_blocks, max_body, jnp.full((out_rows,), -jnp.inf, jnp.float32))
  m = jnp.where(m == -jnp.inf, 0.0, m)

  def sum_body(j, carry):
    acc, l = carry
    part = pl.ds(j * parts_block, parts_block)
    w = jnp.exp(m_ref[part, rows] - m[None, :])          # [jb, Mo]
    acc = acc + jnp.sum(w[:, :, None] * o_ref[part, rows, :], axis=0)
    return acc, l + jnp.sum(w * l_ref[part, rows], axis=0)

  acc, l = lax.fori_loop(
      0, num_blocks, sum_body,
      (jnp.zeros(out_ref.shape, jnp.float32), jnp.zeros((out_rows,), jnp.float32)))
  # l == 0: no visible key (zeros); a NaN l (NaN scores) stays NaN, never 0.
  safe = jnp.where(l == 0, 1.0, l)
  out = jnp.where((l == 0)[:, None], 0.0, acc / safe[:, None])
  if poison:
    bad = _triton.query_row_flags(qh_ref, seq_bad_ref, rows=out_rows, q_rows=poison)
    out = jnp.where(bad[:, None], jnp.nan, out)
  out_ref[...] = out.astype(out_ref.dtype)
  if lse_ref is not None:  # -inf where no key is visible
    lse_ref[...] = jnp.where(l == 0, -jnp.inf, m + jnp.log(safe))


class _LayerRef:
  """A ``[L, ...]`` ref read as its layer ``layer``: every load gets the layer
  index prepended (one indexer per load: Pallas Triton does not lower a load
  through a ``ref.at[...]`` view plus an index, "multiple indexers")."""

  def __init__(self, ref, layer):
    self._ref, self._layer = ref, layer
    self.shape, self.dtype = tuple(ref.shape[1:]), ref.dtype

  def __getitem__(self, idx):
    if not isinstance(idx, tuple):
      idx = (idx,)
    if idx == (Ellipsis,):
      idx = (slice(None),) * len(self.shape)
    return self._ref[(self._layer, *idx)]


def _side_arrays(codes, scale, zero, bits):
  return [codes] if bits == 16 else [codes, scale, zero]


def _sides(fmt: CacheFormat, head_dim: int, draft: bool) -> tuple[_Side, _Side]:
  """The kernel's (K, V) sides for a format and view."""
  gd = fmt.channel_group_for(head_dim)
  k_side = (_Side(16, "token", 1) if fmt.k_bits == 16 else
            _Side(fmt.k_bits, fmt.k_axis, fmt.token_group if fmt.k_axis == "channel" else gd))
  v_side = _Side(16, "token", 1) if fmt.v_bits == 16 else _Side(fmt.v_bits, "token", gd)
  if fmt.hierarchical:  # 4-bit plane geometry; the target view combines both planes
    k_side = _Side(4, k_side.axis, k_side.group, hier=not draft, plane_block=fmt.plane_block)
    v_side = _Side(4, "token", gd, hier=not draft, plane_block=fmt.plane_block)
  return k_side, v_side


def tuned_key(fmt: CacheFormat, *, batch: int, q_heads: int, kv_heads: int, head_dim: int,
              num_queries: int, capacity: int, itemsize: int, view: str = "target") -> str:
  """This launch's shape class in the shipped table (`pallas_kernels.tuned`)."""
  k_side, v_side = _sides(fmt, head_dim, view == "draft")
  return tuned.shape_class(
      k_bits=k_side.bits, k_axis=k_side.axis, k_group=k_side.group, v_bits=v_side.bits,
      v_group=v_side.group, hier=k_side.hier, token_group=fmt.token_group,
      residual=fmt.residual, q_rows=q_heads // kv_heads * num_queries, batch=batch,
      kv_heads=kv_heads, capacity=capacity, head_dim=head_dim, itemsize=itemsize)


def _channel_groups(fmt: CacheFormat, head_dim: int) -> int:
  """Per-token channel groups (``D // Gd``) of the low-bit sides of ``fmt`` (1: none)."""
  token_side = fmt.v_bits < 16 or (fmt.k_bits < 16 and fmt.k_axis == "token")
  return head_dim // fmt.channel_group_for(head_dim) if token_side else 1


def default_config(fmt: CacheFormat, *, batch: int, q_heads: int, kv_heads: int, head_dim: int,
                   num_queries: int, capacity: int, itemsize: int = 2, view: str = "target",
                   device_kind: str | None = None,
                   use_table: bool = True) -> tuple[DecodeAttentionConfig, str]:
  """The config a call without ``config=`` uses, and where it came from.

  The shipped tuned table's entry for this GPU and shape class
  (`pallas_kernels.tuned`) when there is one, ``"tuned"``; otherwise
  `DecodeAttentionConfig.default`, ``"heuristic"``. ``device_kind``: the GPU
  name to look up (default: the first device's, when the backend is a GPU);
  ``use_table=False``: the heuristic.
  """
  if device_kind is None and jax.default_backend() == "gpu":
    device_kind = jax.devices()[0].device_kind
  if use_table and device_kind is not None:
    key = tuned_key(fmt, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                    num_queries=num_queries, capacity=capacity, itemsize=itemsize, view=view)
    config = tuned.lookup(device_kind, key, DecodeAttentionConfig, capacity=capacity)
    if config is not None:
      return config, "tuned"
  # Hierarchical caches take the 4-bit defaults in both views: the target
  # view's two-plane read ran 58.3 / 163.7 us at (1, 32K / 128K, 32, 8) with
  # them against 63.0 / 181.8 with the 8-bit ones (H100, jax 0.11.2).
  sub4 = fmt.hierarchical
  return DecodeAttentionConfig.default(
      batch=batch, tokens=capacity, q_heads=q_heads, kv_heads=kv_heads,
      head_dim=head_dim, k_bits=4 if sub4 else fmt.k_bits, v_bits=4 if sub4 else fmt.v_bits,
      token_group=fmt.token_group, k_axis=fmt.k_axis, itemsize=itemsize,
      residual=fmt.residual, channel_groups=_channel_groups(fmt, head_dim),
      num_queries=num_queries), "heuristic"


def _check_operands(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual,
                    v_residual, lengths, *, fmt, scale, config, layer, view, seq_bad,
                    skip_tokens=0) -> None:
  """`dequant_decode_attention`'s argument checks, in Python before any tracing:
  every operand's shape and dtype against q's ``[B, ., ., D]``, K's ``[B, H, C]``
  and the format, and concrete ``lengths`` / ``scale`` / ``layer`` values
  (traced ones are not read: no op is added to the kernel's path)."""
  stacked = layer is not None
  lead = 1 if stacked else 0
  if getattr(q, "ndim", None) != 4 or not jnp.issubdtype(q.dtype, jnp.floating):
    raise ValueError(f"q must be a floating [B, S, Hq, D] array, got {getattr(q, 'shape', q)} "
                     f"{getattr(q, 'dtype', '')}")
  if config is not None and not isinstance(config, DecodeAttentionConfig):
    raise TypeError(f"config={config!r} must be a DecodeAttentionConfig or None, got "
                    f"{type(config).__name__}")
  if view not in ("target", "draft") or (view == "draft" and not fmt.hierarchical):
    raise ValueError(f"view={view!r} must be 'target', or 'draft' for a hierarchical format")
  dims = "[L, B, H, T, .]" if stacked else "[B, H, T, .]"
  for name, x in (("k_codes", k_codes), ("v_codes", v_codes), ("k_residual", k_residual),
                  ("v_residual", v_residual)):
    if getattr(x, "ndim", None) != lead + 4:
      raise ValueError(f"{name} must be a {dims} array, got shape "
                       f"{getattr(x, 'shape', type(x).__name__)}")
  batch, num_queries, q_heads, head_dim = q.shape
  kv_heads, capacity = k_codes.shape[lead + 1], k_codes.shape[lead + 2]
  if (k_codes.shape[lead], k_residual.shape[lead], k_residual.shape[-1]) != (
      batch, batch, head_dim):
    raise ValueError(f"q.shape={q.shape} does not match the cache (batch "
                     f"{k_codes.shape[lead]}, head_dim {k_residual.shape[-1]})")
  if getattr(lengths, "shape", None) != (batch,) or not jnp.issubdtype(lengths.dtype,
                                                                        jnp.integer):
    raise ValueError(f"lengths must be an integer [{batch}] array, got "
                     f"{getattr(lengths, 'shape', None)} {getattr(lengths, 'dtype', '')}")
  ok, why = supports(fmt, head_dim=head_dim, num_q_heads=q_heads, kv_heads=kv_heads,
                     num_queries=num_queries, capacity=capacity, skip_tokens=skip_tokens,
                     block_k=None if config is None else config.block_k)
  if not ok:
    raise ValueError(why)
  # Every operand against K's [(L,) B, H, C] and the format.
  layers = tuple(k_codes.shape[:lead])
  bhc = (*layers, batch, kv_heads, capacity)
  for side, bits, axis, codes, sc, zr in (
      ("k", fmt.k_bits, fmt.k_axis, k_codes, k_scale, k_zero),
      ("v", fmt.v_bits, "token", v_codes, v_scale, v_zero)):
    want = (*bhc, head_dim if bits == 16 else head_dim * bits // 8)
    if codes.shape != want:
      raise ValueError(f"{side}_codes.shape={codes.shape} must be {want} (K's batch, kv "
                       f"heads and capacity; {side}_bits={bits}, head_dim={head_dim})")
    if bits == 16:
      if not jnp.issubdtype(codes.dtype, jnp.floating):
        raise TypeError(f"{side}_codes.dtype={codes.dtype} must be floating for a 16-bit side")
      if sc is not None or zr is not None:
        raise ValueError(f"{side}_scale and {side}_zero must be None for a 16-bit side "
                         f"({side}_bits=16)")
    else:
      if codes.dtype != jnp.uint8:
        raise TypeError(f"{side}_codes.dtype={codes.dtype} must be uint8 ({side}_bits={bits})")
      if axis == "channel":
        side_shape = (*bhc[:-1], capacity // fmt.token_group, head_dim)
      else:
        side_shape = (*bhc, head_dim // fmt.channel_group_for(head_dim))
      for name, x in ((f"{side}_scale", sc), (f"{side}_zero", zr)):
        if getattr(x, "shape", None) != side_shape:
          raise ValueError(f"{name}.shape={getattr(x, 'shape', None)} must be {side_shape} "
                           f"({side}_bits={bits}, per-{axis})")
        if not jnp.issubdtype(x.dtype, jnp.floating):
          raise TypeError(f"{name}.dtype={x.dtype} must be floating")
  res_shape = (*layers, batch, kv_heads, fmt.residual, head_dim)
  for name, x in (("k_residual", k_residual), ("v_residual", v_residual)):
    if x.shape != res_shape:
      raise ValueError(f"{name}.shape={x.shape} must be {res_shape} (residual={fmt.residual})")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name}.dtype={x.dtype} must be floating")
  if v_residual.dtype != k_residual.dtype:
    raise TypeError(f"v_residual.dtype={v_residual.dtype} must equal "
                    f"k_residual.dtype={k_residual.dtype}")
  if not isinstance(lengths, jax.core.Tracer):
    ln = np.asarray(lengths)
    if ln.min(initial=0) < 0 or ln.max(initial=0) > capacity + fmt.residual:
      raise ValueError(f"lengths={ln.tolist()} must lie in [0, C + R = "
                       f"{capacity + fmt.residual}]")
  _triton.check_scale(scale)
  if seq_bad is not None and (getattr(seq_bad, "shape", None) != (batch,) or not (
      seq_bad.dtype == jnp.bool_ or jnp.issubdtype(seq_bad.dtype, jnp.integer))):
    raise ValueError(f"seq_bad must be a bool [{batch}] array, got "
                     f"{getattr(seq_bad, 'shape', None)} {getattr(seq_bad, 'dtype', '')}")
  if stacked:
    if tuple(getattr(layer, "shape", ())) != () or not (
        _triton.is_int(layer) or jnp.issubdtype(getattr(layer, "dtype", float), jnp.integer)):
      raise ValueError(f"layer={layer!r} must be an integer scalar")
    if not isinstance(layer, jax.core.Tracer) and not 0 <= int(layer) < layers[0]:
      raise ValueError(f"layer={int(layer)} must lie in [0, {layers[0]})")


def dequant_decode_attention(
    q: jax.Array,           # [B, S, Hq, D]
    k_codes: jax.Array,     # [B, H, C, D*kb/8] uint8 | [B, H, C, D]
    k_scale: jax.Array | None,  # [B, H, C//G, D] | [B, H, C, D//Gd] | None
    k_zero: jax.Array | None,   # like k_scale
    v_codes: jax.Array,     # [B, H, C, D*vb/8] uint8 | [B, H, C, D]
    v_scale: jax.Array | None,  # [B, H, C, D//Gd] | None
    v_zero: jax.Array | None,   # like v_scale
    k_residual: jax.Array,  # [B, H, R, D]
    v_residual: jax.Array,  # [B, H, R, D]
    lengths: jax.Array,     # [B] int32, total tokens per sequence
    *,
    fmt: CacheFormat,
    scale: float | jax.Array | None = None,
    config: DecodeAttentionConfig | None = None,
    interpret: bool = False,
    layer: jax.Array | None = None,
    view: str = "target",
    return_lse: bool = False,
    seq_bad: jax.Array | None = None,
    skip_tokens: int = 0,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Decode attention of S new queries over a packed cache (raw arrays).

  Args:
    q: ``[B, S, Hq, D]`` queries of the S newest tokens (already in the cache).
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero: the packed storage
      (see `jaxkv.cache.KVCache`); scales None for 16-bit sides.
    k_residual, v_residual: ``[B, H, R, D]`` full-precision newest tokens.
    lengths: ``[B]`` total tokens ``L_b`` per sequence.
    fmt: the cache format.
    scale: softmax scale, default ``D ** -0.5``: a float or a (possibly
      traced) scalar array; a runtime operand, so new values do not recompile.
    config: launch parameters; when None, `default_config`: the shipped tuned
      config of this GPU and shape class, else `DecodeAttentionConfig.default`.
    interpret: run in Pallas interpret mode (CPU).
    layer: with every cache array stacked on a leading layer axis
      (``[L, B, H, ...]``, a model-level cache), the (possibly traced) layer
      to attend over. The kernel reads that layer in place: slicing it out
      first would make XLA copy the layer's whole storage into a fresh
      buffer for the custom call on every step.
    view: hierarchical (``fmt.hierarchical``) caches: ``"target"`` combines
      both 4-bit planes into 8-bit codes in the kernel, ``"draft"`` reads
      the upper plane only (a 4-bit read; `jaxkv.hierarchical`).
    return_lse: also return the log-sum-exp of each query's scaled scores
      (natural log; -inf where no key is visible), so a caller can merge this
      attention with attention over keys outside the cache.
    seq_bad: optional ``[B]`` bool: the combine kernel writes NaN for every
      query of a flagged sequence and for query rows holding a NaN/inf (the
      README's input policy, without a select kernel after the call).
    skip_tokens: static; attend only the packed tokens ``[skip_tokens,
      packed_len)`` (and the residual): the caller attends the prefix
      ``[0, min(skip_tokens, packed_len))`` itself and merges by ``return_lse``
      (`jaxkv.sink_attention`). A multiple of ``config.block_k``, at least the
      format's ``sink_tokens``. 0 (the default) traces the kernel unchanged.

  Returns:
    ``[B, S, Hq, D]`` in q's dtype; with ``return_lse`` also ``[B, S, Hq]``
    float32.
  """
  _check_operands(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual,
                  v_residual, lengths, fmt=fmt, scale=scale, config=config, layer=layer,
                  view=view, seq_bad=seq_bad, skip_tokens=skip_tokens)
  return _dequant_decode_attention(
      q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual, lengths,
      fmt=fmt, scale=scale, config=config, interpret=interpret, layer=layer, view=view,
      return_lse=return_lse, seq_bad=seq_bad, skip_tokens=int(skip_tokens))


@functools.partial(
    jax.jit, static_argnames=("fmt", "config", "interpret", "view", "return_lse", "skip_tokens"))
def _dequant_decode_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual,
                              v_residual, lengths, *, fmt: CacheFormat, scale=None,
                              config: DecodeAttentionConfig | None = None,
                              interpret: bool = False, layer=None, view: str = "target",
                              return_lse: bool = False, seq_bad=None, skip_tokens: int = 0):
  """`dequant_decode_attention` after its checks (`_check_operands`)."""
  stacked = layer is not None
  lead = 1 if stacked else 0
  batch, num_queries, q_heads, head_dim = q.shape
  kv_heads, capacity = k_codes.shape[lead + 1], k_codes.shape[lead + 2]
  group_q = q_heads // kv_heads
  q_rows = group_q * num_queries
  rows = max(_MIN_ROWS, _triton.next_pow2(q_rows))
  residual = k_residual.shape[lead + 2]
  sm_scale = jnp.asarray(head_dim ** -0.5 if scale is None else scale, jnp.float32)
  draft = view == "draft"
  k_side, v_side = _sides(fmt, head_dim, draft)
  if config is None:
    config, _ = default_config(
        fmt, batch=batch, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
        num_queries=num_queries, capacity=capacity, itemsize=k_residual.dtype.itemsize,
        view=view)
  block_k = config.block_k
  if capacity % block_k:
    raise ValueError(f"cache capacity {capacity} must be a multiple of block_k={block_k}")
  why = _triton.skip_refusal(getattr(fmt, "sink_tokens", 0), skip_tokens, block_k)
  if why:
    raise ValueError(why)
  # Residual rows per unrolled step: at most 8 steps, tiles of >= 32 rows.
  res_block = min(residual & -residual, max(32, residual // 8))

  # Rows r = h * S + s of kv head k's query block; a free reshape when S == 1.
  qh = q.reshape(batch, num_queries, kv_heads, group_q, head_dim)
  qh = qh.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, q_rows, head_dim)
  # Rows the combine writes (a power of two); the split kernel gets q zero-padded
  # to the full M of its dots, so every row of a dot operand is its own register.
  q_block = _triton.next_pow2(q_rows)
  qh = jnp.pad(qh, ((0, 0), (0, 0), (0, rows - q_rows), (0, 0)))
  num_parts = config.num_parts

  def full(x):  # one (b, h) slice of a [B, H, ...] array per program
    return pl.BlockSpec((None, None, *x.shape[2:]),
                        lambda b, h, j, _n=x.ndim - 2: (b, h) + (0,) * _n)

  def full_stacked(x):  # every layer of one (b, h) of a [L, B, H, ...] array
    return pl.BlockSpec((x.shape[0], None, None, *x.shape[3:]),
                        lambda b, h, j, _n=x.ndim - 3: (0, b, h) + (0,) * _n)

  if fmt.hierarchical:  # plane-blocked codes as rows of one plane: [.., 2C, D/2] (free)
    k_codes, v_codes = hierarchical.plane_view(k_codes), hierarchical.plane_view(v_codes)
  k_arrays = _side_arrays(k_codes, k_scale, k_zero, fmt.k_bits)
  v_arrays = _side_arrays(v_codes, v_scale, v_zero, fmt.v_bits)
  cache_arrays = [*k_arrays, *v_arrays, k_residual, v_residual]
  layer_arr = jnp.broadcast_to(jnp.asarray(0 if layer is None else layer, jnp.int32), (batch,))
  inputs = [lengths.astype(jnp.int32), jnp.broadcast_to(sm_scale, (batch,)), layer_arr, qh,
            *cache_arrays]
  per_seq = pl.BlockSpec((None,), lambda b, h, j: (b,))
  in_specs = [per_seq, per_seq, per_seq, full(qh)] + [
      (full_stacked if stacked else full)(x) for x in cache_arrays]

  kernel = functools.partial(
      _split_kernel, k_side=k_side, v_side=v_side, token_group=fmt.token_group,
      residual=fmt.residual, num_queries=num_queries, num_splits=config.num_splits,
      residual_split=config.residual_split,
      block_k=block_k, res_block=res_block, use_asm=not interpret,
      defer_sums=config.defer_sums, prefetch=config.prefetch, fast_exp=config.fast_exp,
      unpack_sub=config.unpack_sub and _triton.compute_capability() >= (9, 0),
      lazy_rescale=config.lazy_rescale, skip_tokens=skip_tokens)
  num_k, num_v = len(k_arrays), len(v_arrays)

  def kernel_with_nones(lengths_ref, scale_ref, layer_ref, q_ref, *refs):
    if stacked:  # this program's layer, read in place
      layer_idx = layer_ref[()]
      refs = ([_LayerRef(r, layer_idx) for r in refs[:num_k + num_v + 2]]
              + list(refs[num_k + num_v + 2:]))
    k_refs = list(refs[:num_k]) + [None] * (3 - num_k)
    v_refs = list(refs[num_k:num_k + num_v]) + [None] * (3 - num_v)
    rest = refs[num_k + num_v:]
    kernel(lengths_ref, scale_ref, q_ref, *k_refs, *v_refs, *rest)

  o_part, l_part, m_part = _triton.pallas_call(
      kernel_with_nones,
      grid=(batch, kv_heads, num_parts),
      in_specs=in_specs,
      out_specs=[
          pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, j: (b, h, j, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda b, h, j: (b, h, j, 0)),
          pl.BlockSpec((None, None, None, rows), lambda b, h, j: (b, h, j, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, kv_heads, num_parts, rows, head_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch, kv_heads, num_parts, rows), jnp.float32),
          jax.ShapeDtypeStruct((batch, kv_heads, num_parts, rows), jnp.float32),
      ],
      compiler_params=_triton.compiler_params(
          num_warps=config.num_warps, num_stages=config.num_stages),
      interpret=interpret,
      name=(f"jaxkv_dequant_attention_quantspec_{view}" if fmt.hierarchical
            else f"jaxkv_dequant_attention_k{fmt.k_bits}v{fmt.v_bits}"),
  )(*inputs)

  # Combine: one program per (b, h, column block), every partial loaded at once
  # (a few loads in flight instead of a J-long dependent chain).
  budget = 8192  # float32 elements of one [parts_block, Mo, dblk] tile
  dblk = head_dim
  while dblk > 1 and num_parts * q_block * dblk > budget:
    dblk //= 2
  parts_block = 1
  while (parts_block * 2 <= num_parts and num_parts % (parts_block * 2) == 0
         and parts_block * 2 * q_block * dblk <= budget):
    parts_block *= 2
  out_specs = [pl.BlockSpec((None, None, q_block, dblk), lambda b, h, d: (b, h, 0, d))]
  out_shape = [jax.ShapeDtypeStruct((batch, kv_heads, q_block, head_dim), q.dtype)]
  if return_lse:  # every column block writes the same lse rows
    out_specs.append(pl.BlockSpec((None, None, q_block), lambda b, h, d: (b, h, 0)))
    out_shape.append(jax.ShapeDtypeStruct((batch, kv_heads, q_block), jnp.float32))
  # the input policy's flags: from the split kernel's own query rows qh in the
  # combine (one consumer of q, so a producer such as RoPE fuses into qh's prep)
  poison = q_rows if seq_bad is not None else 0
  in_specs = [
      pl.BlockSpec((None, None, num_parts, rows, dblk), lambda b, h, d: (b, h, 0, 0, d)),
      pl.BlockSpec((None, None, num_parts, rows), lambda b, h, d: (b, h, 0, 0)),
      pl.BlockSpec((None, None, num_parts, rows), lambda b, h, d: (b, h, 0, 0)),
  ]
  combine_in = [o_part, l_part, m_part]
  if poison:
    in_specs += [pl.BlockSpec((None, None, rows, head_dim), lambda b, h, d: (b, h, 0, 0)),
                 pl.BlockSpec((1,), lambda b, h, d: (b,))]
    combine_in += [qh, seq_bad.astype(jnp.int32)]
  outs = _triton.pallas_call(
      functools.partial(_combine_kernel, parts_block=parts_block, poison=poison),
      grid=(batch, kv_heads, head_dim // dblk),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_triton.compiler_params(num_warps=4, num_stages=2),
      interpret=interpret,
      name="jaxkv_decode_combine",
  )(*combine_in)
  out = outs[0][:, :, :q_rows].reshape(batch, kv_heads, group_q, num_queries, head_dim)
  out = out.transpose(0, 3, 1, 2, 4).reshape(batch, num_queries, q_heads, head_dim)
  if not return_lse:
    return out
  lse = outs[1][:, :, :q_rows].reshape(batch, kv_heads, group_q, num_queries)
  return out, lse.transpose(0, 3, 1, 2).reshape(batch, num_queries, q_heads)


def supports(fmt: CacheFormat, *, head_dim: int, num_q_heads: int | None = None,
             kv_heads: int | None = None, num_queries: int | None = None,
             capacity: int | None = None, skip_tokens: int = 0,
             block_k: int | None = None) -> tuple[bool, str]:
  """Whether the kernels handle this format and shape; ``(False, reason)`` if not.

  A format with ``sink_tokens`` S needs ``skip_tokens >= S`` (a multiple of
  ``block_k`` when given): the kernels would read the sinks' quantized rows,
  so the caller attends the prefix exactly (`_triton.skip_refusal`).
  """
  why = _triton.skip_refusal(getattr(fmt, "sink_tokens", 0), skip_tokens, block_k)
  if why:
    return False, why
  if not _triton.is_pow2(head_dim) or not 32 <= head_dim <= 256:
    return False, f"head_dim={head_dim} must be a power of two in [32, 256]"
  try:
    fmt.validate_head_dim(head_dim)
  except ValueError as e:
    return False, str(e)
  gd = fmt.channel_group_for(head_dim)
  for name, bits, axis in (("K", fmt.k_bits, fmt.k_axis), ("V", fmt.v_bits, "token")):
    if bits == 16:
      continue
    if getattr(fmt, "hierarchical", False):
      bits = 4  # two 4-bit planes, each read as a 4-bit side
    width = head_dim * bits // 8
    chunk = width if axis == "channel" else min(width, gd)
    if not _triton.is_pow2(gd) or chunk < 16:
      return False, (f"{name}: {bits}-bit channel blocks of width {chunk} "
                     f"(head_dim={head_dim}, channel_group={gd}) must be powers of two >= 16")
  if fmt.k_bits < 16 and fmt.k_axis == "channel" and not 16 <= fmt.token_group <= 256:
    return False, f"token_group={fmt.token_group} must be in [16, 256] for per-channel K"
  if getattr(fmt, "hierarchical", False) and fmt.token_group < 16:
    # a step never crosses a plane block of G tokens: dots of >= 16 tokens
    return False, (f"token_group={fmt.token_group} must be >= 16 for a hierarchical "
                   "format (the kernel's steps stay inside a plane block of G tokens)")
  if (getattr(fmt, "hierarchical", False) and capacity is not None
      and capacity % fmt.token_group):
    return False, (f"capacity={capacity} must be a multiple of token_group="
                   f"{fmt.token_group} (plane-blocked hierarchical codes)")
  res_block = fmt.residual & -fmt.residual
  if res_block < 16:
    return False, f"residual={fmt.residual} must be a multiple of 16"
  if num_q_heads is not None and kv_heads is not None:
    if num_q_heads % kv_heads:
      return False, f"num_q_heads={num_q_heads} must be a multiple of {kv_heads=}"
    rows = num_q_heads // kv_heads * (num_queries or 1)
    if rows > 128:
      return False, f"(Hq/Hkv)*S={rows} query rows per kv head must be <= 128"
  if capacity is not None and capacity % 256 and capacity % max(16, fmt.token_group):
    return False, (f"capacity={capacity} must be a multiple of 256 or of "
                   f"max(16, token_group={fmt.token_group})")
  return True, ""


def dequant_decode_attention_reference(
    q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual,
    lengths, *, fmt: CacheFormat, scale: float | None = None, view: str = "target") -> jax.Array:
  """The spec (plain jnp, float32): exact attention over the dequantized cache (``view``)."""
  if view not in ("target", "draft") or (view == "draft" and not fmt.hierarchical):
    raise ValueError(f"view={view!r} must be 'target', or 'draft' for a hierarchical format")
  batch, num_queries, q_heads, head_dim = q.shape
  kv_heads, capacity = k_codes.shape[1], k_codes.shape[2]
  residual = k_residual.shape[2]

  def side(codes, sc, zr, bits, axis):
    if bits == 16:
      return codes.astype(jnp.float32)
    if fmt.hierarchical:
      return hierarchical.dequantize(codes, sc, zr, axis=axis, block=fmt.plane_block, view=view)
    return quant.dequantize(codes, sc, zr, bits, axis=axis)

  k = side(k_codes, k_scale, k_zero, fmt.k_bits, fmt.k_axis)
  v = side(v_codes, v_scale, v_zero, fmt.v_bits, "token")
  packed = fmt.packed_len(lengths)
  # Token t of sequence b lives at packed row t (t < P) or residual row t - P.
  t = jnp.arange(capacity + residual)
  in_packed = t[None, :] < packed[:, None]
  res_idx = jnp.clip(t[None, :] - packed[:, None], 0, residual - 1)

  def assemble(packed_x, res_x):
    pad = jnp.pad(packed_x, ((0, 0), (0, 0), (0, residual), (0, 0)))
    res = jnp.take_along_axis(res_x.astype(jnp.float32), res_idx[:, None, :, None], axis=2)
    return jnp.where(in_packed[:, None, :, None], pad, res)

  k = assemble(k, k_residual)
  v = assemble(v, v_residual)
  sm_scale = head_dim ** -0.5 if scale is None else scale
  qf = q.astype(jnp.float32).reshape(batch, num_queries, kv_heads, q_heads // kv_heads, head_dim)
  s = jnp.einsum("bskgd,bktd->bskgt", qf, k, precision=lax.Precision.HIGHEST) * sm_scale
  limit = lengths[:, None] - num_queries + jnp.arange(num_queries)[None, :]
  valid = t[None, None, :] <= limit[:, :, None]
  s = jnp.where(valid[:, :, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bskgt,bktd->bskgd", p / jnp.where(l > 0, l, 1.0), v,
                 precision=lax.Precision.HIGHEST)
  return o.reshape(batch, num_queries, q_heads, head_dim).astype(q.dtype)



def pallas_decode_attention(q: jax.Array, cache, *, scale: float | jax.Array | None = None,
                            config: DecodeAttentionConfig | None = None,
                            interpret: bool = False, layer=None,
                            view: str = "target", return_lse: bool = False,
                            seq_bad: jax.Array | None = None, skip_tokens: int = 0):
  """`dequant_decode_attention` over a `jaxkv.cache.KVCache`.

  Args:
    q: ``[B, S, Hq, D]``; the K/V of the S query tokens are already appended.
    cache: the `KVCache`.
    scale: softmax scale, default ``D ** -0.5`` (a float or a scalar array).
    config: launch parameters; `default_config` when None (tuned, else heuristic).
    interpret: run in Pallas interpret mode (CPU).
    layer: with a layer-stacked cache (`jaxkv.ModelCache`), the layer to read
      in place.
    view: ``"target"`` or (hierarchical caches) ``"draft"``.
    return_lse: also return each query's log-sum-exp (`dequant_decode_attention`).
    seq_bad: ``[B]`` flags whose sequences come out NaN, as NaN/inf query rows
      (`dequant_decode_attention`).
    skip_tokens: packed tokens left to the caller (`dequant_decode_attention`).

  Returns:
    ``[B, S, Hq, D]`` in q's dtype (and ``[B, S, Hq]`` float32 with ``return_lse``).
  """
  _triton.check_scale(scale)  # a concrete one finite in float32 (the kernels' operand)
  return dequant_decode_attention(
      q, cache.k.codes, cache.k.scale, cache.k.zero, cache.v.codes, cache.v.scale,
      cache.v.zero, cache.k_residual, cache.v_residual, cache.lengths,
      fmt=cache.fmt, scale=scale, config=config, interpret=interpret, layer=layer, view=view,
      return_lse=return_lse, seq_bad=seq_bad, skip_tokens=skip_tokens)
