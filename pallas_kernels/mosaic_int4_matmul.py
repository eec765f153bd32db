"""Group-wise 4-bit weight x activation product for decode on Hopper (Pallas Mosaic GPU).

QuantSpec's draft step reads every linear kernel in 4 bits. The Triton
kernel (`int4_matmul`) reaches ~45 % of the HBM bandwidth on an H100 and
does not get faster on an H200 (the draft step ran 3.3x its bytes floor
there, `bench/results/speculative-NOTES.md`, 2026-11-28). This kernel is the
attention kernel's register K path turned into a product: the weight's
*output* rows are the MMA's M, so each 128-input group of 128 output rows is
one ``[128, 64]`` byte tile that `mosaic_dequant.dequant_codes_rows` turns
into the register A operand, like a kivi4 K tile with its affine per row:

    y^T[o, m] = sum_g  (bf16(C_g s[g, o] + z[g, o]) 2**-64  x_g^T 2**64)[o, m]

(``fold=False``: ``sum_g s[g, o] (C_g x_g^T)[o, m] + z[g, o] sum(x_g)[m]`` in
float32, the codes alone from `mosaic_dequant.dequant_codes`.)

- codes group-major, ``[in / 128, out, 64]`` uint8 (`transpose_packed` of
  `int4_matmul.pack_weight`'s ``[in / 2, out]``): ``codes[g, o, j]`` holds
  planar positions ``j`` (low nibble) and ``64 + j`` (high nibble) of output
  ``o``'s group ``g`` (the cache's planar layout of a 128-channel row), the
  inputs stored there permuted (`_mma_rows`) so that the registers' columns
  come out in input order and x needs no gather; each
  group's tile of 128 output rows is one contiguous 8 KB run in HBM (with
  ``[out, in / 2]`` rows, 128 runs of 64 bytes ``in / 2`` apart, a
  Llama-3.1-8B MLP product took 20.8 instead of 17.4 us in the H200 draft
  step);
- codes become bf16 subnormals ``c 2**(b - 133)`` with one ``and`` per pair
  (byte masks); the x tile (the B operand, ``[N, 128]`` per group, in input
  order) is x itself (``x_direct``, the powers of two on the accumulator) or
  an XLA-prepared tile carrying them;
- TMA pipelines the code tile, the group's scale/zero rows and x's group
  tile ``stages`` deep; by default (``fold``) the registers are the weights
  themselves, ``(code * scale + zero) * 2**-64`` rounded to bf16 (scale and
  zero rounded to bf16 per group first, then one rounding per weight)
  (`mosaic_dequant.dequant_codes_rows`: one ``and`` + one ``fma.bf16x2`` per
  pair), the ``2**64`` goes on x (an XLA-prepared tile) or, with ``x_direct``,
  on the float32 accumulator that sums every group of a split (then partial
  products below ~2**-62 in magnitude are float32 subnormals in the MMA: far
  below bf16 activations times weights); with ``fold=False`` the registers
  are the bare codes, x carries ``2**(69 - b)`` per column, and each group's
  ``[128, N]`` MMA result (times ``2**-64``) is scaled per row and its zero
  times ``sum(x_g)`` added in float32 (the spec's rounding; ~2 us slower per product on an H200);
- grid ``(out / 128, splits)``: a split takes a run of groups and writes a
  float32 partial; XLA sums the partials (and transposes) in one fusion.

`int4_matmul.int4_matmul_reference` is the spec. Rows ``B * T`` up to 64
(N = 8, 16, 32 or 64, zero-padded); group 128 only. x enters the MMA as
bf16 whatever its dtype (`models.draft_weights` sends float32 x elsewhere).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton
from pallas_kernels import int4_matmul as i4
from pallas_kernels import mosaic_attention as ma
from pallas_kernels import mosaic_dequant

plgpu = ma.plgpu
GROUP = 128      # inputs per (scale, zero); the dequant tile's channels
_BLOCK_OUT = 128  # output rows per program (two warpgroup row tiles)
_SHIFT = mosaic_dequant.FOLD_SHIFT  # products come out times 2**-64
MAX_ROWS = 64


def _mma_rows() -> np.ndarray:
  """``[128]``: the input (within its group) stored at each planar position of a
  group's codes so that `mosaic_dequant.dequant_codes_rows`' register column ``k``
  holds input ``k`` (the inverse of `mosaic_dequant.code_permutation`)."""
  return np.argsort(mosaic_dequant.code_permutation(GROUP, 4))


def transpose_packed(packed: jax.Array) -> jax.Array:
  """`int4_matmul.pack_weight`'s ``[in / 2, out]`` codes (group 128) as this
  kernel's group-major ``[in / 128, out, 64]``, each group's inputs stored in
  the order that puts them in input order in the MMA's columns (`_mma_rows`),
  so x enters the MMA as it is (a copy; done once per weight)."""
  if packed.ndim != 2 or packed.shape[0] % (GROUP // 2):
    raise ValueError(f"packed.shape={packed.shape} must be [in / 2, out] with in a multiple "
                     f"of {GROUP}")
  half, n_out = packed.shape
  codes = i4.unpack_weight(packed, GROUP).reshape(2 * half // GROUP, GROUP, n_out)
  packed = i4.pack_weight(codes[:, _mma_rows()].reshape(2 * half, n_out), GROUP)
  return packed.reshape(half // (GROUP // 2), GROUP // 2, n_out).transpose(0, 2, 1)


def untranspose_packed(codes: jax.Array) -> jax.Array:
  """Inverse of `transpose_packed`: ``[in / 128, out, 64]`` -> `int4_matmul.pack_weight`'s
  ``[in / 2, out]`` in input order."""
  groups, n_out, _ = codes.shape
  packed = jnp.swapaxes(codes, 1, 2).reshape(-1, n_out)
  unpacked = i4.unpack_weight(packed, GROUP).reshape(groups, GROUP, n_out)
  order = mosaic_dequant.code_permutation(GROUP, 4)  # stored position of each input
  return i4.pack_weight(unpacked[:, order].reshape(groups * GROUP, n_out), GROUP)


def supports(n_in: int, n_out: int, group: int, rows: int) -> tuple[bool, str]:
  """Whether the kernel serves this shape; ``(False, reason)`` if not."""
  if plgpu is None:
    return False, "jax.experimental.pallas.mosaic_gpu is not importable"
  if group != GROUP:
    return False, f"group={group} (the Mosaic kernel takes groups of {GROUP} inputs)"
  if n_in % GROUP or n_out % _BLOCK_OUT:
    return False, f"[{n_in}, {n_out}] must be multiples of [{GROUP}, {_BLOCK_OUT}]"
  if not 1 <= rows <= MAX_ROWS:
    return False, f"{rows} rows (1 to {MAX_ROWS})"
  return True, ""


def default_splits(n_in: int, n_out: int, num_sms: int = 132, per_sm: int = 3) -> int:
  """Splits of the input groups: the largest divisor of the groups that is at most
  ``ceil(per_sm * num_sms / tiles)`` (about ``per_sm`` programs per SM).

  H200, B = 1 (`bench/results/speculative-NOTES.md`, folded kernel): 8 splits for
  ``[4096, 6144]`` (8.8 us; 4 splits 9.7) and ``[4096, 4096]`` (6.6; 4: 7.5), 4 for
  ``[4096, 14336]`` (2 and 4 alike) and 2 for the fused gate/up ``[4096, 28672]``
  (21.8 us; 1 split 22.9, 2026-11-29)."""
  groups, tiles = n_in // GROUP, n_out // _BLOCK_OUT
  want = max(1, -(-per_sm * num_sms // tiles))
  return max(d for d in range(1, groups + 1) if groups % d == 0 and d <= want)


def _x_tiles(xg, rows: int, n: int, factor):
  """x ``[rows, groups, 128]`` float32 -> the B tiles ``[groups * N, 128]`` bf16 (each
  group's inputs in input order: `transpose_packed` stores the codes so), times
  ``factor`` (a scalar or one per MMA column), rows zero-padded to N."""
  groups = xg.shape[1]
  xs = (xg * factor).astype(jnp.bfloat16)
  xs = jnp.pad(xs, ((0, n - rows), (0, 0), (0, 0))).transpose(1, 0, 2)  # [groups, N, 128]
  return xs.reshape(groups * n, GROUP)


def _folded_operand(x, rows: int, n: int):
  """x ``[rows, in]`` -> the folded kernel's B tiles (`_x_tiles`, times ``2**K_SHIFT``)."""
  xg = x.reshape(rows, -1, GROUP).astype(jnp.float32)
  return _x_tiles(xg, rows, n, 2.0 ** mosaic_dequant.K_SHIFT)


def _operands(x, rows: int, n: int):
  """x ``[rows, in]`` -> the B tiles (`_x_tiles`, times ``2**(69 - b)`` per column) and
  ``sum(x_g)`` ``[groups, max(N, 32)]`` f32 (zero-padded)."""
  xg = x.reshape(rows, -1, GROUP).astype(jnp.float32)
  exps = mosaic_dequant.code_column_exponents(GROUP, 4)
  # registers hold c 2**(b - 133): x carries 2**(133 - b - 64), products c x 2**-64
  factor = jnp.asarray(2.0 ** (mosaic_dequant.SUBNORMAL_EXP - _SHIFT - exps), jnp.float32)
  # [groups, max(N, 32)]: a TMA copy moves a multiple of 128 bytes
  sums = jnp.pad(xg.sum(-1), ((0, max(n, 32) - rows), (0, 0))).T
  return _x_tiles(xg, rows, n, factor), sums


@functools.partial(jax.jit, static_argnames=("group", "num_splits", "stages", "fold",
                                             "wide_rows", "x_direct"))
def mosaic_int4_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, zero: jax.Array, *,
                       group: int = GROUP, num_splits: int | None = None,
                       stages: int = 3, fold: bool = True, wide_rows: bool = True,
                       x_direct: bool | None = None) -> jax.Array:
  """``x @ W`` for a 4-bit group-wise ``W`` (Hopper).

  Args:
    x: ``[..., in]``, at most `MAX_ROWS` rows.
    codes: uint8 ``[in / 128, out, 64]`` (`transpose_packed`); scale, zero:
      ``[in / 128, out]`` (float32 or narrower).
    group: must be 128.
    num_splits: programs along the input groups (default `default_splits`).
    stages: TMA pipeline depth.
    fold: scale and zero folded into the A registers
      (`mosaic_dequant.dequant_codes_rows`: scale and zero rounded to bfloat16
      per group, then each weight ``code * scale + zero`` once; output error
      ~4e-3 of the largest output at Llama-3.1-8B widths; finite while
      ``scale < 2**59``, and weights below ``2**-62`` in magnitude are bf16
      subnormals, absolute error <= ``2**-70``), one accumulator over all of a
      split's groups: no per-group float32 epilogue and no ``sum(x_g)``
      operand; H200, B = 1: 1.8-2.2 us faster per product at the same splits
      (14.0 vs 16.2 us at ``[4096, 14336]``). ``False``: codes times exact
      powers of two, the affine per group in float32 (the spec's rounding; two
      more XLA kernels per call, ``sum(x_g)`` and its padding).
    wide_rows: the code tiles are copied as 128-byte rows (two output rows
      each; `mosaic_attention.wide_view`), as the attention kernel's
      (`MosaicAttentionConfig.wide_rows`); for this product it made no
      measurable difference (H200, B = 1: 13.5-14.9 us either way).
    x_direct: (default: ``fold``; True needs ``fold``) the pipeline reads x
      itself (``[rows, in]`` in bf16, a ``[N, 128]`` box per group; TMA fills
      the rows past ``rows`` with zeros) and the accumulator takes the ``2**K_SHIFT`` at the end, so
      no XLA kernel prepares x (it was one per product input, 1.4-2.2 us in
      the H200 draft step; B = 1 with its preparation counted: 0.8-1.7 us less
      per product, 2026-11-29).
  Returns:
    ``[..., out]`` float32.
  """
  *lead, n_in = x.shape
  n_out = scale.shape[-1]  # not codes': a wrong layout must not size the output
  rows = int(np.prod(lead, dtype=np.int64))
  ok, why = supports(n_in, n_out, group, rows)
  if not ok:
    raise ValueError(f"mosaic_int4_matmul: {why}")
  groups = n_in // GROUP
  if codes.shape != (groups, n_out, GROUP // 2) or codes.dtype != jnp.uint8:
    raise ValueError(f"codes {codes.shape} {codes.dtype} must be uint8 [in / 128, out, 64] = "
                     f"[{groups}, {n_out}, 64] (`transpose_packed` of pack_weight's codes)")
  codes = codes.reshape(groups * n_out, GROUP // 2)  # free: row-major
  if wide_rows:  # two output rows per 128-byte row (free)
    codes = ma.wide_view(codes)
  code_rows = _BLOCK_OUT * (GROUP // 2) // codes.shape[-1]   # a tile's rows
  if scale.shape != (groups, n_out) or zero.shape != (groups, n_out):
    raise ValueError(f"scale {scale.shape} / zero {zero.shape} must be [{groups}, {n_out}]")
  splits = num_splits or default_splits(n_in, n_out, _triton.num_sms())
  if groups % splits:
    raise ValueError(f"num_splits={splits} must divide the {groups} groups")
  per_split = groups // splits
  n = ma._rows_n(rows)  # pylint: disable=protected-access
  if x_direct and not fold:
    raise ValueError("x_direct=True needs fold=True (the unfolded kernel takes x as "
                     "XLA-prepared tiles scaled per MMA column)")
  direct = fold if x_direct is None else bool(x_direct)
  if direct:  # x as it is: the box's rows past `rows` are out of bounds (zeros)
    xs, sums = x.reshape(rows, n_in).astype(jnp.bfloat16), None
  elif fold:
    xs, sums = _folded_operand(x.reshape(rows, n_in), rows, n), None
  else:
    xs, sums = _operands(x.reshape(rows, n_in), rows, n)
  # No XLA work on the weight per call: the powers of two go on each loaded scale
  # row in the kernel (a per-call multiply of the [groups, out] scales was a kernel
  # of its own, ~2 us per product on an H200).
  scale = scale.astype(jnp.float32)
  zero = zero.astype(jnp.float32)
  bo, f32 = _BLOCK_OUT, jnp.float32
  x_tf = ma._tiled(64, 16)  # pylint: disable=protected-access
  row_l, col_l = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

  def kernel(codes_gmem, scale_gmem, zero_gmem, x_gmem, *refs):
    sum_gmem, out_gmem = (None, *refs) if fold else refs
    o = lax.axis_index("o")
    first = lax.axis_index("s") * per_split
    specs = [
        plgpu.BlockSpec((code_rows, codes.shape[-1]),                         # codes, plain
                        lambda i: ((first + i) * (n_out // bo) + o, 0)),
        plgpu.BlockSpec((1, bo), lambda i: (first + i, o)),                  # scale
        plgpu.BlockSpec((1, bo), lambda i: (first + i, o)),                  # zero
        (plgpu.BlockSpec((n, GROUP), lambda i: (0, first + i), transforms=x_tf) if direct
         else plgpu.BlockSpec((n, GROUP), lambda i: (first + i, 0), transforms=x_tf)),  # x tile
    ]
    if not fold:
      specs.append(plgpu.BlockSpec((1, sums.shape[1]), lambda i: (first + i, 0)))  # sum(x_g)

    def folded_body(acc_ref, _, c_smem, s_smem, z_smem, x_smem):
      a = mosaic_dequant.dequant_codes_rows(c_smem, s_smem, z_smem)
      plgpu.wgmma(acc_ref, a, ma._t(x_smem))  # pylint: disable=protected-access
      plgpu.wgmma_wait(0)  # a's registers are reused by the next group's dequant

    def body(_, c_smem, s_smem, z_smem, x_smem, sum_smem, acc):
      a = mosaic_dequant.dequant_codes(c_smem, GROUP, 4, subnormal=True, byte_masks=True)

      def mma(acc_ref):
        plgpu.wgmma(acc_ref, a, ma._t(x_smem))  # pylint: disable=protected-access
        return acc_ref[...]

      prod = pl.run_scoped(mma, plgpu.ACC((bo, n), f32))                      # [128, N]
      sc = ma._load(s_smem.at[0], layout=row_l, optimized=False) * (2.0 ** _SHIFT)  # pylint: disable=protected-access
      zr = ma._load(z_smem.at[0], layout=row_l, optimized=False)  # pylint: disable=protected-access
      sx = ma._load(sum_smem.at[0, pl.ds(0, n)], layout=col_l,  # pylint: disable=protected-access
                    optimized=False)
      return (acc + prod * lax.broadcast_in_dim(sc, (bo, n), [0])
              + lax.broadcast_in_dim(zr, (bo, n), [0]) * lax.broadcast_in_dim(sx, (bo, n), [1]))

    if fold:
      def run(acc_ref):
        plgpu.emit_pipeline(mosaic_dequant.release_stages(functools.partial(folded_body, acc_ref)),
                            grid=(per_split,),
                            in_specs=specs, max_concurrent_steps=stages)(
                                codes_gmem, scale_gmem, zero_gmem, x_gmem)
        return acc_ref[...]

      acc = pl.run_scoped(run, plgpu.ACC((bo, n), f32))
    else:
      acc0 = plgpu.layout_cast(jnp.zeros((bo, n), f32), plgpu.Layout.WGMMA)
      acc = plgpu.emit_pipeline(mosaic_dequant.release_stages(body),
                                grid=(per_split,), in_specs=specs,
                                max_concurrent_steps=stages, init_carry=acc0)(
                                    codes_gmem, scale_gmem, zero_gmem, x_gmem, sum_gmem)

    def write(o_smem):
      o_smem[...] = acc * (2.0 ** mosaic_dequant.K_SHIFT) if direct else acc
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[lax.axis_index("s"), pl.ds(o * bo, bo)])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(write, plgpu.SMEM((bo, n), f32))

  part = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((splits, n_out, n), f32),
      grid=(n_out // bo, splits),
      grid_names=("o", "s"),
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           lowering_semantics=ma._SEMANTICS,  # pylint: disable=protected-access
                                           # one barrier per step (release_stages), none
                                           # of Pallas's: with Pallas's automatic barriers
                                           # and x read directly, the H200 returned wrong
                                           # products (2 of 4 draft shapes, 2026-11-29;
                                           # draft-matmul-int4-overlap-ab-*)
                                           unsafe_no_auto_barriers=True),
      kernel_name="jaxkv_mosaic_int4_matmul" + ("_folded" if fold else ""),
  )(codes, scale, zero, xs, *(() if fold else (sums,)))
  return part.sum(axis=0).T[:rows].reshape(*lead, n_out)


__all__ = ["GROUP", "MAX_ROWS", "default_splits", "mosaic_int4_matmul", "supports",
           "transpose_packed"]
