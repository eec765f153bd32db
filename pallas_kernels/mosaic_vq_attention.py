"""Split-K decode attention over a VQ cache for Hopper (Pallas Mosaic GPU).

The Triton VQ kernel (`pallas_kernels.vq_attention`) gathers every centroid
coordinate from L1/L2 and is bound by those gathers (0.2x of BF16 attention).
These kernels keep the codebooks in shared memory, VQ-LLM's point, on the
tokens-on-M dataflow of `pallas_kernels.mosaic_attention` (``S^T = K q^T``,
``O^T += V^T P^T``, split-K, the residual block as one more program, the
`combine_t` merge):

- each packed program copies its kv head's K and V codebooks (``[n, E, v]``
  each, in the cache dtype, in the entry-major image of
  `mosaic_dequant.vq_book_rows`: 64 KiB per side at D = 128, E = 256) into
  shared memory once, before its pipeline;
- code tiles (``D / v`` bytes per token and side) arrive by TMA and
  `mosaic_dequant.gather_codebook` turns them into the ``[64, D]`` wgmma
  operand with one ``ld.shared`` of ``2 v`` bytes per code, free of bank
  conflicts (each thread holds a contiguous quarter of the channels,
  `mosaic_dequant.vq_permutation`, and walks its sub-spaces in a lane-rotated
  order); K stays in registers, V is stored for the value MMA;
- q's channels are permuted once in the wrapper, and the combine reads the
  packed programs' outputs in that order.

Two kernels. ``block_k=128`` (the default where it fits): two compute
warpgroups and a memory warpgroup per CTA (`_two_wg_call`), since the
codebooks leave room for one CTA per SM; each compute warpgroup takes 64 rows
of every 128-token tile with its own softmax state and partial, its column
reductions through its own scratch. ``block_k=64``: the one-warpgroup kernel
of `mosaic_attention._tokens_m_call` with the codebooks in its scope. Both
use the lazy running max (`mosaic_attention.new_max`). H200, (1, 131072, 32,
8, 128): cq2 190 us with one warpgroup and sub-space-major gathers (5.8-way
bank conflicts), 138 with two warpgroups, 113 conflict-free, 104 with the
lazy max; the Triton VQ kernel 718 (`bench/results/vq-NOTES.md`).

Scope (`supports`): one VQ stage per side, ``D / v >= 16`` codes per token,
head_dim 64/128, bfloat16/float16 caches, (Hq/Hkv) x S <= 64 (<= 16 for two
warpgroups), token group, residual and capacity multiples of ``block_k``. The
centroids enter the MMA in the cache dtype (float16 codebooks are rounded to a
bfloat16 cache's dtype per call, as in the Triton VQ kernel).
`vq_attention.vq_decode_attention_reference` is the spec.
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
from pallas_kernels import combine_t
from pallas_kernels import mosaic_attention as ma
from pallas_kernels import mosaic_dequant
from pallas_kernels.side_spec import SideSpec
from pallas_kernels.vq_attention import VQSideSpec

# Shared memory an H100/H200 CTA may use (227 KiB), less room for q, the V
# tile, P^T and the pipeline's code tiles.
_SMEM_FOR_BOOKS = 160 * 1024


def supports(*, head_dim: int, k_spec: VQSideSpec, v_spec: VQSideSpec, q_rows: int, dtype,
             token_group: int, residual: int, capacity: int | None = None,
             block_k: int = 64, sink_tokens: int = 0,
             skip_tokens: int = 0) -> tuple[bool, str]:
  """Whether the Mosaic VQ kernel serves this case; ``(False, reason)`` if not (a
  format with ``sink_tokens`` needs ``skip_tokens`` >= them, a multiple of
  ``block_k``: `_triton.skip_refusal`)."""
  why = _triton.skip_refusal(sink_tokens, skip_tokens, block_k)
  if why:
    return False, why
  if ma.plgpu is None:
    return False, "jax.experimental.pallas.mosaic_gpu is not importable"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return False, f"cache dtype {jnp.dtype(dtype)} (Mosaic VQ kernel: bfloat16/float16 only)"
  if head_dim not in (64, 128):
    return False, f"head_dim={head_dim} (Mosaic VQ kernel: 64 or 128)"
  if q_rows > ma._M:  # pylint: disable=protected-access
    return False, f"(Hq/Hkv)*S={q_rows} query rows per kv head > {ma._M}"  # pylint: disable=protected-access
  book_bytes = 0
  for name, spec in (("K", k_spec), ("V", v_spec)):
    if spec.stages != 1:
      return False, f"{name}: {spec.stages} residual VQ stages (Mosaic VQ kernel: 1)"
    if head_dim // spec.vector < 16:
      return False, (f"{name}: {head_dim // spec.vector} codes per token (vector={spec.vector}) "
                     "< 16: rows under TMA's 16 bytes")
    book_bytes += head_dim * spec.entries * jnp.dtype(dtype).itemsize
  if book_bytes > _SMEM_FOR_BOOKS:
    return False, f"codebooks of {book_bytes} bytes per kv head exceed shared memory"
  for name, value in (("token_group", token_group), ("residual", residual),
                      ("capacity", capacity)):
    if value is not None and value % block_k:
      return False, f"{name}={value} not a multiple of block_k={block_k}"
  return True, ""


def default_config(*, batch: int, tokens: int, kv_heads: int, num_sms: int = 132,
                   two_warpgroups: bool = False, stages: int = 4,
                   residual: int = 128) -> ma.MosaicAttentionConfig:
  """One CTA per SM (the two codebooks take most of its shared memory): one
  wave of ``num_sms`` programs, less the residual programs of each (b, h)
  when that is many (the two-warpgroup kernel's one, the one-warpgroup
  kernel's one per 64 rows, `mosaic_attention.residual_parts`), at least 4
  blocks per split. ``two_warpgroups``: 128-token blocks (the two-warpgroup
  kernel), else 64; ``stages`` pipeline stages."""
  block_k = 128 if two_warpgroups else 64
  # one wave as measured for VQ (the two-wave rule of the dequant kernel was not)
  splits = ma.one_wave_splits(
      num_sms, batch * kv_heads, max(1, tokens // block_k), fill_waves=False,
      residual_programs=1 if two_warpgroups else ma.residual_parts(residual, block_k))
  return ma.MosaicAttentionConfig(block_k=block_k, num_splits=splits,
                                  max_concurrent_steps=stages)


# ----------------------------------------------------------------------------
# Two compute warpgroups per CTA. With 128 KiB of codebooks a CTA fills an SM
# alone, so one warpgroup left each scheduler one warp and the kernel waited on
# latency (ncu, H200: 6 % occupancy, stalls barrier 31 %, short scoreboard
# 27 %). Here a memory warpgroup streams 128-token code tiles
# (`plgpu.emit_pipeline_warp_specialized`) and each of two compute warpgroups
# takes 64 rows of every tile with its own softmax state and writes its own
# partial (index ``2 j + wg``), so nothing is reduced across warpgroups; the
# column reductions of a warpgroup go through its own shared scratch
# (`_wg_reduce`), since Pallas' own cross-warp reduction scratch is one buffer
# per CTA.
# ----------------------------------------------------------------------------
_WGS = 2          # compute warpgroups
_HALF = 64        # rows of a 128-token tile per compute warpgroup
_RED = 512        # float32 reduction scratch per warpgroup (>= 4 warps x 32 lanes x 2)
_SMEM_LIMIT = 220 * 1024


def _wg_reduce(x, scratch, op: str):
  """Column (axis-0) ``op`` ("max" or "add") of a ``[rows, N]`` WGMMA float32
  array over this warpgroup's warps, through ``scratch`` (its own 1-D smem)."""
  n = x.shape[1]

  @ma.plgpu.inline_mgpu(
      arg_types=(ma.plgpu.Layout.WGMMA, ma.plgpu.RefType()),
      return_type=ma.plgpu.ShapeDtypeStruct((n,), jnp.float32,
                                            layout=ma.plgpu.Layout.WGMMA.reduce(0)))
  def body(_, arr, ref):
    return arr.reduce(op, 0, scratch=ref)

  return body(x, scratch)


def _two_wg_smem(head_dim: int, n_pv: int, n_rows: int, book_elems: int, stages: int,
                 code_bytes: int, itemsize: int) -> int:
  """Shared-memory bytes of the two-warpgroup kernel (`_two_wg_call`)."""
  fixed = (book_elems * itemsize                                         # codebooks
           + n_rows * head_dim * itemsize                                # q
           + _WGS * _HALF * (head_dim + n_pv) * itemsize                 # V tiles, P^T
           + _WGS * (_RED + 1 + head_dim * n_pv + 2 * n_rows) * 4)       # scratch, flag, o, l, m
  pipeline = stages * 2 * _HALF * code_bytes
  residual_k = _WGS * _HALF * head_dim * itemsize
  return fixed + max(pipeline, residual_k)


def _two_wg_call(q_perm, q_res, k_codes, v_codes, k_residual, v_residual, lengths, books, *,
                 token_group, residual, num_queries, q_rows, num_splits, stages, dtype,
                 row0, early_v=True, lazy_max=True, edge_masks=True, unmasked_guards=False,
                 skip_tokens: int = 0):
  """Partials ``o [B,H,2(J+1),D,N_pv], l, m [B,H,2(J+1),N]`` (``J = num_splits``).
  ``skip_tokens``: packed tokens left to the caller (`mosaic_attention._split_blocks`).
  ``edge_masks``: `MosaicAttentionConfig.edge_masks` (whole 128-token groups
  are a condition of this kernel, `supports`); ``unmasked_guards``:
  `MosaicAttentionConfig.unmasked_guards`.

  ``row0``: ``[1]`` int32, the cache arrays' row of sequence 0
  (`mosaic_attention.stacked_rows`)."""
  plgpu = ma.plgpu
  batch, kv_heads, n_rows, head_dim = q_perm.shape
  n_pv = max(n_rows, 16)
  bk = _WGS * _HALF
  grid_j = num_splits + 1
  unmasked = edge_masks and ma.unmasked_packed_steps(num_queries, token_group, residual, bk)
  f32 = jnp.float32
  (k_vec, k_entries, k_book), (v_vec, v_entries, v_book) = books
  q_tf = ma._tiled(64, 16)  # pylint: disable=protected-access
  v_tf = ma._tiled(n_pv, 16)  # pylint: disable=protected-access
  t = ma._t  # pylint: disable=protected-access
  specs = [plgpu.BlockSpec((bk, x.shape[-1]), lambda i: (i, 0)) for x in (k_codes, v_codes)]
  widen = mosaic_dequant.widen_columns

  def attend(q_smem, k_tile, v_tile, pt_smem, vdq_smem, red, flag, book_smems, carry, *,
             token0, valid_below, row_limit, masked=True):
    """One online-softmax step of a warpgroup over its 64 tokens."""
    acc, m_i, l_i = carry

    def scores(acc_ref):
      if book_smems is None:  # residual rows in smem
        plgpu.wgmma(acc_ref, k_tile, t(q_smem))
      else:
        plgpu.wgmma(acc_ref, mosaic_dequant.gather_codebook(
            k_tile, book_smems[0], head_dim, k_vec, k_entries), t(q_smem))
        if early_v:  # the V tile while the score MMA runs
          vdq_smem[...] = mosaic_dequant.gather_codebook(v_tile, book_smems[1], head_dim, v_vec,
                                                         v_entries)
      return acc_ref[...]

    s = pl.run_scoped(scores, plgpu.ACC((_HALF, n_rows), f32))        # [64, N]
    p, m_new, alpha = ma.masked_softmax(
        s, m_i, token0=token0, valid_below=valid_below, row_limit=row_limit,
        colmax=lambda x: _wg_reduce(x, red, "max"), flag_smem=flag if lazy_max else None,
        masked=masked, guards=unmasked_guards)
    l_i = l_i * lax.broadcast_in_dim(alpha, l_i.shape, [1]) + p      # row sums deferred
    acc = acc * widen(lax.broadcast_in_dim(alpha, (head_dim, n_rows), [1]), n_pv, 1.0)
    pt_smem[...] = widen(p.astype(dtype), n_pv)
    if book_smems is not None:
      if not early_v:
        vdq_smem[...] = mosaic_dequant.gather_codebook(v_tile, book_smems[1], head_dim, v_vec,
                                                       v_entries)
      v_tile = vdq_smem
    plgpu.commit_smem()

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, t(v_tile), pt_smem)

    return pl.run_state(pv)(plgpu.ACC.init(acc)), m_new, l_i

  def kernel(lengths_gmem, row0_gmem, q_gmem, qres_gmem, kc_gmem, vc_gmem, kres_gmem, vres_gmem,
             kb_gmem, vb_gmem, o_gmem, l_gmem, m_gmem,
             q_smem, kb_smem, vb_smem, vdq2, pt2, red2, flag2, o2, lm2, bars):
    wg = lax.axis_index("wg")
    b = lax.axis_index("b")
    h = lax.axis_index("h")
    j = lax.axis_index("j")
    bh = b * kv_heads + h  # this (sequence, kv head)'s row of q, q_res and the partials
    cb = (row0_gmem[0] + b) * kv_heads + h  # ... and of the cache arrays (`head_rows`)
    length = lengths_gmem[b]
    packed = token_group * jnp.maximum(0, (length - residual + token_group) // token_group)
    row = plgpu.broadcasted_iota(jnp.int32, (n_rows,), 0,
                                 layout=plgpu.Layout.WGMMA.reduce(0))
    row_limit = length - num_queries + (row % q_rows) % num_queries

    def shared_load(src, dst, i):
      """One TMA copy issued by compute warpgroup 0; both wait for it."""
      @pl.when(wg == 0)
      def _():
        plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
      plgpu.barrier_wait(bars.at[i])

    def init():
      return (plgpu.layout_cast(jnp.zeros((head_dim, n_pv), f32), plgpu.Layout.WGMMA),
              plgpu.layout_cast(jnp.full((n_rows,), -jnp.inf, f32),
                                plgpu.Layout.WGMMA.reduce(0)),
              plgpu.layout_cast(jnp.zeros((_HALF, n_rows), f32), plgpu.Layout.WGMMA))

    def finish(carry):
      acc, m_i, l_i = carry
      l_sum = _wg_reduce(l_i, red2.at[wg], "add")
      ma._write_partials(acc, l_sum, m_i, o2.at[wg], lm2.at[wg],  # pylint: disable=protected-access
                         o_gmem, l_gmem, m_gmem, bh * parts + _WGS * j + wg)

    @pl.when(j < num_splits)
    def _packed():
      first, num_blocks = ma._split_blocks(  # pylint: disable=protected-access
          packed, j, num_splits, bk, skip_tokens)

      def compute_context(pipeline_callback):
        shared_load(q_gmem.at[bh], q_smem, 0)
        shared_load(kb_gmem.at[h], kb_smem, 1)
        shared_load(vb_gmem.at[h], vb_smem, 2)
        finish(pipeline_callback(init()))

      def body(idx, k_tile, v_tile, carry):
        (i,) = idx
        rows = pl.ds(wg * _HALF, _HALF)
        return attend(q_smem, k_tile.at[rows], v_tile.at[rows], pt2.at[wg], vdq2.at[wg],
                      red2.at[wg], flag2.at[wg], (kb_smem, vb_smem), carry,
                      token0=(first + i) * bk + wg * _HALF, valid_below=packed,
                      row_limit=row_limit, masked=not unmasked)

      pipeline = plgpu.emit_pipeline_warp_specialized(
          body, grid=(num_blocks,), memory_registers=40,
          in_specs=[ma._shifted(spec, first) for spec in specs],  # pylint: disable=protected-access
          max_concurrent_steps=stages, wg_axis="wg", num_compute_wgs=_WGS,
          compute_context=compute_context)
      pipeline(kc_gmem.at[cb], vc_gmem.at[cb])

    @pl.when(j == num_splits)
    def _residual():
      def scope(kres2):
        @pl.when(wg < _WGS)
        def _():
          shared_load(qres_gmem.at[bh], q_smem, 0)
          carry = init()
          for r0 in range(0, residual, bk):
            # Residual row r holds token packed + r; warpgroup wg takes 64 of every 128.
            rows = pl.ds(r0 + wg * _HALF, _HALF)
            plgpu.copy_gmem_to_smem(kres_gmem.at[cb, rows], kres2.at[wg], bars.at[3 + wg])
            plgpu.barrier_wait(bars.at[3 + wg])
            plgpu.copy_gmem_to_smem(vres_gmem.at[cb, rows], vdq2.at[wg], bars.at[3 + wg])
            plgpu.barrier_wait(bars.at[3 + wg])
            carry = attend(q_smem, kres2.at[wg], vdq2.at[wg], pt2.at[wg], vdq2.at[wg],
                           red2.at[wg], flag2.at[wg], None, carry,
                           token0=packed + r0 + wg * _HALF,
                           valid_below=length, row_limit=row_limit)
          finish(carry)

      pl.run_scoped(scope, plgpu.SMEM((_WGS, _HALF, head_dim), dtype, transforms=q_tf),
                    collective_axes="wg")

  k_flat, v_flat = k_book, v_book
  scratch = [
      plgpu.SMEM((n_rows, head_dim), dtype, transforms=q_tf),            # q
      plgpu.SMEM(k_flat.shape[1:], dtype),                              # K codebook
      plgpu.SMEM(v_flat.shape[1:], dtype),                              # V codebook
      plgpu.SMEM((_WGS, _HALF, head_dim), dtype, transforms=v_tf),      # V tiles
      plgpu.SMEM((_WGS, _HALF, n_pv), dtype, transforms=v_tf),          # P^T
      plgpu.SMEM((_WGS, _RED), f32),                                    # reductions
      plgpu.SMEM((_WGS, 1), jnp.int32),                                 # lazy-max flags
      plgpu.SMEM((_WGS, head_dim, n_pv), f32),                          # o^T
      plgpu.SMEM((_WGS, 2, n_rows), f32),                               # l, m
      plgpu.Barrier(num_barriers=3 + _WGS),
  ]
  parts = _WGS * grid_j
  return ma.unflatten_partials(plgpu.kernel(
      kernel,
      out_type=ma.partials_type(batch, kv_heads, parts, head_dim, n_pv, n_rows),
      grid=(batch, kv_heads, grid_j),
      grid_names=("b", "h", "j"),
      num_threads=_WGS + 1,
      thread_name="wg",
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True,
                                           lowering_semantics=ma._SEMANTICS),  # pylint: disable=protected-access
      kernel_name=f"jaxkv_mosaic_vq2_attention_k{k_vec}v{v_vec}",
  )(lengths, row0, *ma.head_rows([q_perm, q_res, k_codes, v_codes, k_residual, v_residual]),
    k_flat, v_flat), batch, kv_heads)


def _case_smem(q_rows, head_dim, k_spec, v_spec, dtype, stages):
  """`_two_wg_smem` of one case."""
  n_pad = ma._rows_n(q_rows, smallest=8)  # pylint: disable=protected-access
  return _two_wg_smem(head_dim, max(n_pad, 16), n_pad,
                      head_dim * (k_spec.entries + v_spec.entries), stages,
                      k_spec.code_width(head_dim) + v_spec.code_width(head_dim),
                      jnp.dtype(dtype).itemsize)


def auto_config(*, q_rows: int, head_dim: int, k_spec: VQSideSpec, v_spec: VQSideSpec, dtype,
                batch: int, capacity: int, kv_heads: int, token_group: int, residual: int,
                num_sms: int = 132) -> ma.MosaicAttentionConfig:
  """The config `mosaic_vq_decode_attention` uses when given none: the
  two-warpgroup kernel where it fits (<= 16 query rows per kv head, 128-token
  multiples, shared memory) with the deepest pipeline (2-4 stages) that fits,
  else the one-warpgroup kernel (64-token blocks, 4 stages)."""
  smem = functools.partial(_case_smem, q_rows, head_dim, k_spec, v_spec, dtype)
  two = (ma._rows_n(q_rows, smallest=8) <= 16  # pylint: disable=protected-access
         and capacity % 128 == 0 and token_group % 128 == 0 and residual % 128 == 0
         and smem(2) <= _SMEM_LIMIT)
  stages = max(st for st in (2, 3, 4) if smem(st) <= _SMEM_LIMIT) if two else 4
  config = default_config(batch=batch, tokens=capacity, kv_heads=kv_heads, num_sms=num_sms,
                          two_warpgroups=two, stages=stages, residual=residual)
  # Unmasked packed steps (`MosaicAttentionConfig.edge_masks`) for vectors of
  # >= 4 channels: H200, main kernel us, cq2 90.6 vs 92.6 at (1, 131072, 32,
  # 8), 178.6 vs 181.9 at (8, 32768); cq4 (2-channel vectors) lost with them,
  # 111.8 vs 107.4 and 221.9 vs 212.1 (`attention-ab-vq-edge-masks-20261129-*`).
  # The -inf guards stay on those steps (`unmasked_guards`): cq2 was 2-3 % slower
  # without them (93.8 vs 91.3 us at (1, 131072), 183.6 vs 179.6 at (8, 32768)),
  # cq4 the same (`attention-ab-vq-finite-guards-20261129-*`); unexplained.
  return dataclasses.replace(config, edge_masks=min(k_spec.vector, v_spec.vector) >= 4,
                             unmasked_guards=True)


@functools.partial(jax.jit, static_argnames=("k_spec", "v_spec", "token_group", "config",
                                             "return_lse", "skip_tokens"))
def mosaic_vq_decode_attention(
    q: jax.Array,           # [B, S, Hq, D]
    k_codes: jax.Array,     # [B, H, C, nk] uint8 ([L, B, ...] with ``layer``)
    k_codebook: jax.Array,  # [H, 1, nk, Ek, vk]
    v_codes: jax.Array,     # [B, H, C, nv] uint8
    v_codebook: jax.Array,  # [H, 1, nv, Ev, vv]
    k_residual: jax.Array,  # [B, H, R, D]
    v_residual: jax.Array,  # [B, H, R, D]
    lengths: jax.Array,     # [B] int32
    *,
    k_spec: VQSideSpec,
    v_spec: VQSideSpec,
    token_group: int,
    scale: float | jax.Array | None = None,
    config: ma.MosaicAttentionConfig | None = None,
    layer: jax.Array | int | None = None,
    return_lse: bool = False,
    skip_tokens: int = 0,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Decode attention of S new queries over a VQ cache (Hopper kernel).

  Same arguments and result as `vq_attention.vq_decode_attention` (raw VQ
  cache arrays, ``scale`` a float or a traced scalar, default ``D ** -0.5``);
  ``config`` a `MosaicAttentionConfig` (its register/fold flags do not apply):
  ``block_k=128`` runs the two-warpgroup kernel (64 rows of each tile per
  compute warpgroup; (Hq/Hkv) x S <= 16 and its shared memory must fit),
  ``block_k=64`` the one-warpgroup kernel; by default the first where it fits.
  ``layer``: with the codes and residuals stacked on a leading layer axis
  (``[L, B, H, ...]``, a `jaxkv.VQModelCache`; the codebooks are the layer's
  own ``[H, ...]``), the (possibly traced) layer to read in place
  (`mosaic_attention.stacked_rows`).
  ``return_lse`` / ``skip_tokens`` as `mosaic_attention.mosaic_decode_attention`'s
  (the merged log-sum-exp; packed tokens left to the caller, sink formats).
  Returns ``[B, S, Hq, D]`` in q's dtype (and the ``[B, S, Hq]`` log-sum-exp).
  ValueError when `supports` refuses.
  """
  batch, num_queries, q_heads, head_dim = q.shape
  (k_codes, v_codes, k_residual, v_residual), row0 = ma.stacked_rows(
      (k_codes, v_codes, k_residual, v_residual), layer, batch)
  kv_heads, capacity = k_codes.shape[1], k_codes.shape[2]
  residual = k_residual.shape[2]
  dtype = k_residual.dtype
  if q_heads % kv_heads:
    raise ValueError(f"num query heads Hq={q_heads} must be a multiple of {kv_heads=}")
  group_q = q_heads // kv_heads
  q_rows = group_q * num_queries
  n_pad = ma._rows_n(q_rows, smallest=8)  # pylint: disable=protected-access
  two_wg_smem = functools.partial(_case_smem, q_rows, head_dim, k_spec, v_spec, dtype)

  if config is None:
    config = auto_config(q_rows=q_rows, head_dim=head_dim, k_spec=k_spec, v_spec=v_spec,
                         dtype=dtype, batch=batch, capacity=capacity, kv_heads=kv_heads,
                         token_group=token_group, residual=residual)
  if config.block_k == 128:
    if n_pad > 16:
      raise ValueError(f"Mosaic VQ kernel: block_k=128 (two warpgroups) serves <= 16 query "
                       f"rows per kv head, got {q_rows}")
    need = two_wg_smem(config.max_concurrent_steps)
    if need > _SMEM_LIMIT:
      raise ValueError(f"Mosaic VQ kernel: block_k=128 with max_concurrent_steps="
                       f"{config.max_concurrent_steps} needs {need} bytes of shared memory "
                       f"(> {_SMEM_LIMIT})")
  ok, why = supports(head_dim=head_dim, k_spec=k_spec, v_spec=v_spec, q_rows=q_rows,
                     dtype=dtype, token_group=token_group, residual=residual,
                     capacity=capacity, block_k=config.block_k)
  why = why or _triton.skip_refusal(0, skip_tokens, config.block_k)
  if why:
    raise ValueError(f"Mosaic VQ kernel: {why}")
  books = []
  for name, cb, codes, spec in (("k", k_codebook, k_codes, k_spec),
                                ("v", v_codebook, v_codes, v_spec)):
    if cb.shape != spec.codebook_shape(kv_heads, head_dim):
      raise ValueError(f"{name}_codebook.shape={cb.shape} must be "
                       f"{spec.codebook_shape(kv_heads, head_dim)} for {spec}")
    if codes.shape[-1] != spec.code_width(head_dim) or codes.dtype != jnp.uint8:
      raise ValueError(f"{name}_codes must be uint8 [..., {spec.code_width(head_dim)}], got "
                       f"{codes.dtype} {codes.shape}")
    # Each kv head's [n, E, v] codebook in the MMA's dtype, entry-major rows.
    books.append((spec.vector, spec.entries, mosaic_dequant.vq_book_rows(cb[:, 0].astype(dtype))))
  sm_scale = jnp.asarray(head_dim ** -0.5 if scale is None else scale, jnp.float32)
  if sm_scale.shape != ():
    raise ValueError(f"scale must be a scalar, got shape {sm_scale.shape}")

  # Query rows r = h * S + s of each kv head, scaled, padded to the score MMA's N.
  qh = ma.query_rows(q, kv_heads, sm_scale, dtype, n_pad)
  perm = mosaic_dequant.vq_permutation(head_dim)
  if config.block_k == 128:
    o_part, l_part, m_part = _two_wg_call(
        qh[..., perm], qh, k_codes, v_codes, k_residual, v_residual, lengths.astype(jnp.int32),
        tuple(books), token_group=token_group, residual=residual, num_queries=num_queries,
        q_rows=q_rows, num_splits=config.num_splits, stages=config.max_concurrent_steps,
        dtype=dtype, early_v=config.early_v, lazy_max=config.lazy_max,
        edge_masks=config.edge_masks, unmasked_guards=config.unmasked_guards, row0=row0,
        skip_tokens=skip_tokens)
    tail = _WGS  # the residual program's partials, one per compute warpgroup
  else:
    placeholder = SideSpec(16)  # the side specs of the quantized formats do not apply
    o_part, l_part, m_part = ma._tokens_m_call(  # pylint: disable=protected-access
        qh[..., perm], qh, [k_codes], [v_codes], k_residual, v_residual,
        lengths.astype(jnp.int32), k_side=placeholder, v_side=placeholder,
        token_group=token_group, residual=residual, num_queries=num_queries, q_rows=q_rows,
        config=config, dtype=dtype, vq=tuple(books), row0=row0, skip_tokens=skip_tokens)
    tail = ma.residual_parts(residual, config.block_k)  # the residual programs' partials
  out = combine_t.combine_t(o_part, l_part, m_part, rows=_triton.next_pow2(q_rows),
                            packed_rows=np.argsort(perm), out_dtype=q.dtype, plain_tail=tail)
  out = ma.unpack_rows(out, num_queries, q_heads)
  if not return_lse:
    return out
  lse = ma.partials_lse(l_part[..., :q_rows], m_part[..., :q_rows])   # [B, H, q_rows]
  lse = lse.reshape(batch, kv_heads, group_q, num_queries).transpose(0, 3, 1, 2)
  return out, lse.reshape(batch, num_queries, q_heads)


__all__ = ["auto_config", "default_config", "mosaic_vq_decode_attention", "supports"]
