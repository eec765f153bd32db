"""Split-K dequant decode attention for Hopper (Pallas Mosaic GPU).

The second kernel family beside the Triton one (`dequant_attention.py`): the
same cache layout, the same partial results ``(o, l, m)`` per split, but built
from Hopper's own pieces:

- TMA bulk copies of packed code tiles (and their scale/zero rows) into shared
  memory, ``max_concurrent_steps`` stages deep (`plgpu.emit_pipeline`);
- one warpgroup per program dequantizes a ``[block_k, D]`` tile of K and of V
  into swizzled shared memory (planar layout: plane ``i`` of byte column ``j``
  is channel ``i * W + j``, so each plane is a contiguous column block);
- ``wgmma``: ``S = Q @ K^T`` with the query rows of one kv head (Hq/Hkv x S,
  padded to the warpgroup's M = 64) and ``O += P @ V`` with ``P`` from
  registers, as JAX's own ``attention_mgpu.py`` does;
- the residual block takes one more program per (batch, kv head) and
  ``block_k``-row tile of it (`residual_parts`): its bf16/f16 rows are copied
  straight into the same shared-memory tiles, no dequant.

Partials of all programs are merged by a log-sum-exp combine: the v2 kernel's
``O^T`` partials by one Pallas Triton kernel (`combine_t`), v1's in jnp
(``J + R / block_k`` partials of ``rows x D`` floats per (batch, kv head)).

Scope (``supports``): bf16/f16 caches, head_dim 64 or 128, per-channel K with
token groups that are multiples of ``block_k``, per-token sides with one
scale group per head (``Gd = D``), 16-bit sides, (Hq/Hkv) x S <= 64 rows.
Everything else falls back to the Triton family.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

try:  # Mosaic GPU ships with every jax >= 0.6, but keep the import soft.
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

from pallas_kernels import _triton
from pallas_kernels import combine_t
from pallas_kernels import hierarchical
from pallas_kernels import mosaic_dequant
from pallas_kernels.side_spec import SideSpec


def _takes_index() -> bool:
  """Whether `plgpu.load` still requires its index argument (jax 0.10; 0.11 deprecates it)."""
  import inspect  # pylint: disable=import-outside-toplevel
  if plgpu is None:
    return True
  idx = inspect.signature(plgpu.load).parameters.get("idx")
  return idx is not None and idx.default is inspect.Parameter.empty


_LOAD_INDEX = _takes_index()


def _load(ref, *, layout, **kw):
  """``plgpu.load`` of a whole (already indexed) ref, on jax 0.10 and >= 0.11."""
  if _LOAD_INDEX:
    return plgpu.load(ref, (), layout=layout, **kw)
  return plgpu.load(ref, layout=layout, **kw)


def _t(ref):
  """The transposed view of a 2-D smem ref (`plgpu.transpose_ref` is this on jax 0.10
  and deprecated on 0.11)."""
  return ref.transpose((1, 0))


_M = 64  # rows of one warpgroup MMA
# Lane semantics (explicit layouts, as `attention_mgpu.py`): jax 0.11 defaults
# to Warpgroup semantics, whose layout-inference search did not finish on
# this kernel within minutes (H100, jax 0.11.2).
_SEMANTICS = plgpu.LoweringSemantics.Lane if plgpu is not None else None


@dataclasses.dataclass(frozen=True)
class MosaicAttentionConfig:
  """Launch parameters of the Mosaic GPU dequant-attention kernel.

  Attributes:
    block_k: packed tokens per pipeline step (64 or 128).
    num_splits: programs per (batch, kv head) over the packed region; one
      more program per (batch, kv head) and ``block_k`` rows of the residual
      block attends over them (`residual_parts`).
    max_concurrent_steps: TMA pipeline depth (shared-memory stages).
    tokens_m: the token block as the M dimension of both MMAs (``S^T = K q^T``,
      ``O^T += V^T P^T``, query rows as N = 16/32/64) with K dequantized in
      registers (v2); False runs v1 (query rows padded to M = 64, K and V
      dequantized through shared memory).
    fold_scales: (tokens_m only) apply per-token scales and zeros to the scores
      (K) and to ``P`` (V) instead of to every code; per-channel K is always
      dequantized per element.
    register_k: (tokens_m only; per-channel 4/2-bit K in a bfloat16 cache, else
      ignored) K codes become the wgmma A operand through `mosaic_dequant.dequant_codes` (one
      shared load per row, a shift, ``lop3``, ``sub`` and ``fma`` per value
      pair with each column's scale/zero read from the channel-order rows,
      unswizzled code tiles), q's channels permuted to the MMA's column order
      in the wrapper; the residual program reads the unpermuted q. On by
      default: 1.17-1.25x faster than without at (1, 131072, 32, 8, 128) on an
      H200 (`bench/results/mosaic-NOTES.md`, 2026-11-26).
    register_v: (tokens_m only; 4/2-bit V with one scale group per head, folded
      scales, a bfloat16 cache; else ignored) V codes become exact values in
      registers the same way and are stored to the value tile in one piece;
      the packed programs' outputs come out in the permuted channel order and
      the combine kernel (`combine_t`) reads their rows in that order. On by
      default (measured with ``register_k``).
    register_vt: (with ``register_v``; 4/2-bit V, D = 128) V codes become the
      *register* A operand of the value MMA (``O^T += V^T P^T``) through
      ``ldmatrix.trans`` (`mosaic_dequant.dequant_codes_t`): no V tile is stored
      to shared memory, and the packed programs need no V value buffer; their
      outputs come out in `mosaic_dequant.vt_permutation` order.
    vt_swizzle: (with ``register_vt``) the V code tiles are TMA-swizzled by
      their row width, so the ``ldmatrix`` rows are free of bank conflicts
      (unswizzled: 6-21 % slower, H100).
    early_v: (with ``register_v`` or a VQ cache) build the step's V tile while
      the score MMA runs (between its issue and its wait) instead of after the
      softmax, off the step's serial chain.
    lazy_max: (tokens_m only) the running max is a reference that moves only
      when a score exceeds it by more than ``LAZY_MARGIN`` (so ``p <= e^8``):
      one ``bar.red.or`` per step decides, and the exact cross-warp column max
      and the rescale run only then (`new_max`).
    subnormal_k, subnormal_v: (with ``register_k`` / ``register_vt``) codes
      become bf16 subnormals ``c * 2**-133`` with one ``and`` per pair (no
      ``sub``); K's scale/zero rows and q, and V's ``P`` and the value
      product, carry the powers of two back (`mosaic_dequant.K_SHIFT`,
      ``P_SHIFT``).
    byte_masks: (with subnormal codes) shift each code word by whole bytes only
      and mask every code where it sits in its byte (one shift per two 4-bit
      or four 2-bit pairs instead of one per pair): a code at bit ``b`` of its
      byte is ``code * 2**(b - 133)``. K's scales carry ``2**-b`` (same
      registers as without); V's rows with ``2**bits`` are divided back on the
      value product in ``finish`` (`mosaic_dequant.scale_halves`).
    k_scale_in_q: (with byte-masked subnormal K registers, head_dim 128, N = 8
      or 16 query rows) per-channel K scale and zero folded into the score
      MMA's B operands each step (`mosaic_dequant.fold_k_operands`: ``q * s``
      per column, ``q . z`` as an MMA of ones against per-thread partial sums),
      so K's codes need no per-value ``fma`` and no scale-pair work; one more
      fence + warpgroup barrier per step. Off: correct on an H100 but 2-10 %
      slower there (`attention-ab-k-scale-in-q-20261126-*`, mosaic-NOTES).
    wide_rows: (with ``register_k`` / ``register_v``) the code tiles those paths
      read are copied as `mosaic_dequant.WIDE_ROW`-byte rows (``128 / W``
      tokens per row: a free view of the same bytes) instead of one ``W``-byte
      token row each (4-bit D = 128: 64 bytes). TMA streams 64-byte rows at
      ~75 % of the HBM bandwidth and 128-byte rows at ~93 % (H200, a copy-only
      pipeline of the kivi4 tiles at (1, 131072, 32, 8): 41.9 vs 33.7 us;
      `bench/results/mosaic-NOTES.md`, 2026-11-28).
    lean_barriers: (tokens_m only) the kernel is compiled without Pallas's
      automatic warpgroup barriers (``unsafe_no_auto_barriers``: one before
      every TMA copy, six per refilled pipeline stage, and two around every
      shared-memory store) and places its own: one per pipeline step, after
      every warp has waited for the step's MMAs and made its last read of the
      stage, before the stage is refilled, and one before the partials are
      written over the shared memory the last MMAs read (a warp's wgmma wait
      covers only its own part of an MMA). Every other store comes after such
      a barrier and is followed by `plgpu.commit_smem` (a fence and a
      barrier) before a TMA or MMA reads it. (Off, i.e. Pallas's automatic
      barriers: compiled bit-equal to on in `tests/test_mosaic_attention.py`;
      the int4 product's automatic-barrier path, with x read through an
      out-of-bounds box, returned wrong products on an H200 and was removed,
      cause not traced: `bench/results/speculative-NOTES.md`, 2026-11-29.)
    edge_masks: (tokens_m and both VQ kernels) with one query per row
      (``q_len`` 1), blocks that tile the token group and ``residual >=
      token_group``, the packed steps skip the length and causal masks: the
      packed region ends on a block boundary and every row sees all of it
      (`unmasked_packed_steps`; a compare and select per score less; the
      residual program keeps them). A branch on whether a block needs them instead cost
      5-13 registers (H200, 2026-11-29: kivi4 164 -> 169, a program per SM).
    lazy_rescale: (tokens_m only) o, l and the folded zero sums are rescaled
      inside the exact branch of the running max (`new_max`) only, so the
      lazy steps that keep the reference skip multiplying them by one.
    unmasked_guards: (tokens_m and the VQ kernels) keep the online softmax's
      guards against a running max of ``-inf`` (no visible key yet) on the
      unmasked packed steps (``edge_masks``) too. Off by default: they matter
      only while every score a row has seen is ``-inf``, which there needs a
      non-finite query row (the input policy's NaN anyway) or a product that
      overflows (q is scaled by 2**64 in bfloat16 with ``subnormal_k``, so
      ``|q| > ~1.8e19``, ``~1.3e19`` with ``log2_scores``, is already
      ``inf``): then NaN instead of a zero weight.
      The guards are dead otherwise (0.5-1.6 % of the kivi4 / kivi2 main
      kernel, H200, 2026-11-29; the same output bit for bit). VQ's
      `mosaic_vq_attention.auto_config` keeps them (cq2 was 2-3 % slower
      without); an explicit VQ config takes this field as given.
    shuffle_scales: (with register K and its affine) each K scale/zero pair is
      converted by one of the 8 lanes of a warp that share its columns and
      handed to the others by ``shfl.sync`` (`mosaic_dequant.dequant_codes`):
      per thread and tile 4 pair conversions and 32 shuffles instead of 32
      conversions. Same registers.
    log2_scores: (tokens_m, a bfloat16 cache; VQ keeps natural units) q carries
      ``log2(e)`` beside the softmax scale, so the scores, the running max and
      `LAZY_MARGIN` are in base-2 units and each weight is one ``ex2`` of
      ``s - m`` (natural units: ``(s - m) * log2(e)`` first, a multiply per
      score); the partials' max is written back in natural units (times
      ``ln 2``), so the combine kernels and ``return_lse`` see the same
      statistics. Not with float16 caches, whose q could overflow. H200,
      main kernel: 1.1-1.2 % faster at (188, 32768) for kivi2 / kivi4 and
      1-2 % at (8, 32768) and the 5-query target view, within noise at one
      sequence (`bench/results/mosaic-NOTES.md`, 2026-11-29).

    narrow_partials: (tokens_m) each program writes only the ``N`` columns of
      its ``O^T`` partial that hold query rows (``[D, N]`` float32) instead of
      the value MMA's ``N_pv = max(N, 16)`` (the extra columns are zero): at
      ``N = 8`` (GQA 4 or 8 at q_len 1) half the partial bytes written and read
      by the combine. Off by default until timed on a GPU. (The VQ kernel's
      two-warpgroup path writes its own partials and ignores it.)

  Searched around the heuristic by `bench/attention.py` (``mosaic_configs``:
  num_splits x1/2, x1, x2, max_concurrent_steps 2 or 4, block_k 128); the
  library's tuned table (`pallas_kernels.tuned`) holds Triton configs only.
  """

  block_k: int = 64
  num_splits: int = 8
  max_concurrent_steps: int = 3
  tokens_m: bool = True
  fold_scales: bool = True
  register_k: bool = True
  register_v: bool = True
  register_vt: bool = True
  vt_swizzle: bool = True
  early_v: bool = True
  lazy_max: bool = True
  subnormal_k: bool = True
  subnormal_v: bool = True
  byte_masks: bool = True
  k_scale_in_q: bool = False
  shuffle_scales: bool = False
  wide_rows: bool = True
  lean_barriers: bool = True
  edge_masks: bool = True
  lazy_rescale: bool = True
  unmasked_guards: bool = False
  log2_scores: bool = True
  narrow_partials: bool = False

  def __post_init__(self):
    if self.block_k not in (64, 128):
      raise ValueError(f"block_k={self.block_k} must be 64 or 128")
    if self.num_splits < 1:
      raise ValueError(f"num_splits={self.num_splits} must be >= 1")
    if not 1 <= self.max_concurrent_steps <= 8:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be in [1, 8]")

  @classmethod
  def default(cls, *, batch: int, tokens: int, kv_heads: int, num_sms: int = 132,
              k_bits: int = 4, v_bits: int = 4, token_group: int = 128, residual: int = 128,
              target_view: bool = False, **unused) -> "MosaicAttentionConfig":
    """Heuristic: one wave of programs at the occupancy the kernel reaches, at
    least 4 blocks per split.

    From the A/Bs on H100 and H200 (`bench/results/mosaic-NOTES.md`): sides
    of 2 bits take 128-token blocks (kivi2 52 -> 36 us at (1, 32768, 32, 8)),
    where fixed per-step costs dominate, and 2 pipeline stages (H100: 61.0
    vs 65.8 us with 3 at (1, 131072), equal at (8, 32768)); 4-bit K and V
    take 128-token blocks where each split still gets >= 8 of them (H100,
    register V operand: 69.5 vs 73.5 us at (1, 131072), 133.9 vs 148.7 at
    (8, 32768); 29.1 vs 26.7 at (1, 32768), 4 blocks per split, so 64
    there); 4 stages unless both sides are 8-bit (int8 lost 10-25 % with 4,
    k8v4 gained 2-5 %), but 2 for kivi4; the lazy rescale (``lazy_rescale``)
    except for kivi4 in 128-token blocks over <= 8 pairs at 2 per SM (a long
    sequence runs 3 per SM, below, and takes it); K scale pairs shared
    by warp shuffles (``shuffle_scales``) for 2-bit and 4-bit K (in 128-token
    blocks only over at most 64 (sequence, kv head) pairs). Over more than 64
    pairs, kivi4 whose 4-per-SM split count would fill its last wave at the 2
    per SM it runs at (171-172 registers) under 90 % takes shuffled scales
    instead (162-170 registers: 3 per SM) with at least 2 splits (the packed
    programs are counted; the short residual program of each pair is not).
    Over many pairs (``33 B Hkv >= 64 num_sms``: 256+ pairs on 132 SMs, 32+
    sequences at 8 kv heads), kivi4 in 128-token blocks and kivi2 take at
    least 4 splits where each keeps >= 4 blocks, kivi4 with shuffled scales.
    ``target_view`` (a hierarchical cache's two 4-bit planes, ``k_bits`` and
    ``v_bits`` 4): kivi4's rule, except that its 198-200 registers run 2
    programs per SM, not 3: over <= 8 pairs it keeps the 2-per-SM count and
    the plain rescale where kivi4 goes to 3 per SM; over 9-64 pairs in
    128-token blocks (64-token blocks not measured) one wave at 2 per SM, at least 8 splits (at most
    ``blocks // 4``). H200, whole call us, splits 8 / 12 / 16 / 24 / 33:
    (2, 32768) 66.9 / 50.5 / **47.3** / 53.3 / 50.8, (4, 32768) **81.7** /
    93.2 / 83.8 / 85.0 / 86.6, (8, 32768) **148.7** / 151.8 / 150.7 / 153.3 /
    157.1; in a second run, splits 4 / 6 / 8: (8, 32768) 151.1 / 172.9 /
    **148.8**, (16, 32768) 280.9 / 282.8 / 281.8 (kivi4's count kept); at
    one sequence kivi4's count (31) was best: (1, 32768) 27.9 / (1, 131072)
    74.8 us vs 32.2 / 79.6 with 62
    (`ab-quantspec-target-mosaic-*-nvidia-h200-20261129s.json`).

    Programs: the split counts assume 4 per SM for 4-bit K and V (3 in
    128-token blocks over 9-64 (sequence, kv head) pairs and in the
    shuffled-scales case above, 2 over <= 8 except where each split keeps
    >= 8 blocks at 3 and the count exceeds the 2-per-SM one, not the target
    view), 3 for
    8-bit K with 4-bit V and for 2-bit K and V (over at most 8 pairs only
    where every split keeps >= 8 blocks), 2 otherwise. Nsight Compute (H100, (1, 131072),
    2026-11-26) finds kivi4 at 4 per SM in 64-token blocks (120 registers,
    44 KB) but 2 in 128-token blocks (229 registers, 79 KB: the residual
    program's two [128, D] tiles), kivi2 at 3 (168 registers, 75 KB); the
    counts stay because they were measured best (attending a 128-token tile
    as two 64-token halves took 144 registers and ran 20-50 % slower). The
    packed programs per (batch, kv head) are ``per_sm * num_sms // (batch *
    kv_heads)``, less the residual programs (`residual_parts`: one per
    ``block_k`` rows of the residual) when that count is large (a single
    sequence), at most 64 and at least 4 blocks each, and at least
    two waves where one would leave slots idle (`one_wave_splits`). Measured
    (kernel us, the rule's pick in brackets): H100 2026-11-26, kivi4 at (1, 131072,
    32, 8) [64] 73.7 vs 78.0 (48), 91.4 (32); at (8, 32768, 32, 8) [8] 149.4
    vs 178.0 (6), 210.8 (4); H200 2026-11-26 (before the register V operand):
    kivi2 [32] 74.9 vs 76.4 (33), 98.7 (48); [4] 152 vs 202 (3); k8v4 [32]
    106 vs 131 (48); k8v4 on the H100 with the register V operand [48] 90.2
    vs 89.5 (32), [6] 177.6 vs 232.4 (4) at (8, 32768). The placement of
    programs on SMs makes these counts jumpy; `bench/attention.py` searches
    around them.
    """
    del unused
    fits_128 = token_group % 128 == 0 and residual % 128 == 0
    # the residual block's programs (`residual_parts`) share the wave: a
    # QuantSpec R = 256 in 128-token blocks counted as one put 8 of 272
    # programs in a second wave at (1, 131072, 32, 8) (H200, 70.7 us vs 47.3)
    one_wave = lambda slots, heads, blocks, bk=128: one_wave_splits(  # noqa: E731
        slots, heads, blocks, residual_programs=residual_parts(residual, bk))
    per_sm = {(4, 4): 4, (8, 4): 3}.get((k_bits, v_bits), 2)
    slots, heads = per_sm * num_sms, batch * kv_heads
    block_k = 128 if min(k_bits, v_bits) <= 2 and fits_128 else 64
    if (k_bits, v_bits) == (4, 4) and fits_128:
      # 128-token blocks where every split still gets >= 8 of them
      # (counted at the 2 programs per SM they run at up to 64 (sequence, kv
      # head) pairs: H100 (1, 32768) 22.1 us in 32 splits of 8 blocks vs 23.6
      # in 64-token blocks; `attention-ab-splits-shuffle-20261127b-*`)
      wide = one_wave(2 * num_sms if heads <= 64 else slots, heads, max(1, tokens // 128))
      block_k = 128 if tokens // 128 >= 8 * wide else 64
    blocks = max(1, tokens // block_k)
    # 256+ (sequence, kv head) pairs on 132 SMs: 32+ sequences at 8 kv heads
    # (H200, main kernel us, the former pick vs 4 shuffled splits: kivi4 (32,
    # 32768) 344.1 (2 splits, unshuffled) vs 299.7, (40, 32768) 389.3 vs 373.6;
    # kivi2 (40, 32768) 385.2 (3) vs 363.8 (at 32 it had 4 already); but at 25
    # sequences (200 pairs) kivi4 260.6 (6 splits) vs 266.5;
    # `ab-kivi4-kivi2-25-40-seqs-splits-nvidia-h200-20261129s.json`)
    many = 33 * heads >= 64 * num_sms
    # one wave at 3 per SM, at least 2 splits (4 over many pairs) of >= 4 blocks
    three_per_sm = lambda: max(one_wave(3 * num_sms, heads, blocks, block_k),  # noqa: E731
                               min(4 if many else 2, blocks // 4))
    # 4-bit K and V in 128-token blocks over <= 64 (sequence, kv head) pairs
    kivi4_wide = (k_bits, v_bits) == (4, 4) and block_k == 128 and heads <= 64
    splits = one_wave(slots, heads, blocks, block_k)
    if kivi4_wide:
      # They run 3 programs per SM (163 registers since q and the partials are
      # flat rows too, `head_rows`; 2 before, at 171-175), not the 4 counted
      # above: one wave of 3 per SM over several sequences, with shuffles
      # (below) (H200, whole call us: (8, 32768) 98.0 (6 splits) vs 132.5 (4,
      # the former 2-per-SM count), 103.5 (8)); but a single sequence kept the
      # 2-per-SM count ((1, 32768) 19.9 (32) vs 21.6 (48), (1, 131072) 52.0 vs
      # 53.2; `attention-ab-flat-splits-20261127e-*`; superseded at long
      # contexts below)
      splits = one_wave((3 if heads > 8 else 2) * num_sms, heads, blocks, block_k)
    elif (k_bits, v_bits) == (2, 2) and heads > 8:
      # Several sequences: 3 per SM too since the flat rows (162-166 registers,
      # 173-185 before), and at least 2 splits (H200, whole call us: (8,
      # 32768) 95.9 (6) vs 131.1 (4), 99.6 (8); (48, 32768) 497 (2), 490 (3),
      # 522 (1); (186, 32768) 1798 (2) vs 1916 (1);
      # `attention-ab-flat-splits-20261127e-*`); over many sequences at least 4
      # (H200, main kernel us, 2 vs 4 splits: (48, 32768) 438.0 vs 429.3, (64,
      # 32768) 576.8 vs 565.6, (100, 32768) 911.1 vs 869.8, (160, 32768) 1384.7
      # vs 1355.0, (188, 32768) 1595.3 vs 1592.7; `ab-kivi2-*-splits-nvidia-h200-20261129r.json`,
      # `ab-kivi4-large-batch-splits-nvidia-h200-20261129r.json` (64, 160))
      splits = three_per_sm()
    # A single long sequence (<= 8 pairs), 2-bit K and V (162-168 registers)
    # and kivi4 in 128-token blocks (166): one wave at 3 programs per SM where
    # each split still gets >= 8 blocks, and only where that is more programs
    # than the count above (few kv heads hit the 64 cap in both). 2-bit: H100,
    # whole call us, (1, 131072) 51.5 (48 splits) vs 54.1 (32); H200 50.9 vs
    # 53.7; (1, 32768) 20.4 vs 19.7, so not there (`attention-ab-kivi2-splits-
    # 20261127b-*`). kivi4: H200, main kernel us, 48 / 47 vs 32 / 31 splits:
    # (1, 131072) 42.6 vs 43.7, the QuantSpec draft view (R = 256) 42.5 vs
    # 44.2; (1, 32768) 15.4 vs 14.6 (`ab-b1-splits-20261129x-*`,
    # `ab-b1-3per-sm-20261129x-*`). Not the target view (198-200 registers: 2
    # per SM).
    # (kivi4 keeps a count above that went to two waves at 2 per SM, e.g. R =
    # 512: neither measured there; 2-bit K and V take the 3-per-SM wave.)
    two_bit = (k_bits, v_bits) == (2, 2)
    wide3 = one_wave(3 * num_sms, heads, blocks, block_k)
    long_3_per_sm = ((two_bit or (kivi4_wide and not target_view)) and heads <= 8
                     and blocks >= 8 * wide3 and (wide3 > splits or two_bit))
    if long_3_per_sm:
      splits = wide3
    stages = 3 if k_bits >= 8 and v_bits >= 8 else 4
    if min(k_bits, v_bits) <= 2 and block_k == 128:
      stages = 2
    # V is built while the score MMA runs. 2-bit V over >= 64 (sequence, kv
    # head) pairs (H100, kernel us: (8, 32768) 114.4 vs 123.9, (96, 32768) 1208
    # vs 1295) and 4-bit K and V in 128-token blocks (H100: (1, 131072) 61.6 vs
    # 63.0) were built after the softmax until the unmasked packed steps
    # (`edge_masks`) freed their registers; since, early wins (H200, main
    # kernel us, early vs late: kivi2 (8, 32768) 81.2 vs 83.9, (48, 32768) 444.7
    # vs 455.5, (160, 32768) 1405.7 vs 1443.5; kivi4 (1, 131072) 44.6 vs 45.2,
    # (1, 32768) 14.7 vs 15.1, (8, 32768) 84.4 vs 87.4, (48, 32768) 452.0 vs
    # 464.0; `attention-ab-kivi4-wide-early-v-20261129-*`,
    # `attention-ab-k-scale-in-q-early-v-large-batch-20261129-*`; the field's
    # default). Measured at q_len 1 only: with q_len > 1 (speculative verify)
    # the packed steps keep their masks, and late V may win there again.
    if (k_bits, v_bits) == (4, 4):
      # 2 stages at any batch and block size since the byte-mask codes (H100,
      # whole call us, 4 vs 2 stages: (1, 32768) 25.9 vs 24.6, (48, 32768)
      # 669.7 vs 651.3, (96, 32768) 1261.6 vs 1247.9; `attention-ab-stages-
      # shuffle-20261127-*`)
      stages = 2
    # K scale/zero pairs shared by warp shuffles: 2-bit K everywhere (H100, whole
    # call us: (1, 32768) 20.2 -> 19.9, (1, 131072) 55.3 -> 54.6, (8, 32768)
    # 106.2 -> 102.2, (48, 32768) 558.5 -> 538.1); 4-bit K in 64-token blocks
    # ((1, 32768): 24.6 -> 23.7 with 2 stages) and in 128-token blocks with the
    # 2-per-SM split count above (and the 3-per-SM one of a long sequence).
    shuffle = k_bits == 2 or (k_bits == 4 and block_k == 64) or kivi4_wide
    if (k_bits, v_bits) == (4, 4) and block_k == 128 and heads > 64:
      # Over more than 64 pairs, unshuffled scales kept them at 171-172 registers
      # (2 per SM, with V early); where those split counts fill their last wave
      # at 2 per SM poorly (< 90 %), shuffled scales (and, before the unmasked
      # packed steps, V after the softmax) run 3 per SM (162-170 registers; 166
      # with V early since), at least 2 splits (H100, whole call us: (48,
      # 32768) 624.9 (2 splits) vs 659.8 (3, the 2-per-SM count; 1.87 waves of
      # its 4.36 used), (100, 32768) 1274.0 vs 1324.4; where the count fills
      # its waves, it stays: (16 / 32 / 64, 32768) 216.0 / 416.0 / 822.9 vs
      # 219.9 / 424.4 / 833.2 at the best 3-per-SM count;
      # `attention-ab-kivi4-wide-20261127f-*`). Over about one program per slot
      # at 3 per SM and one split each (many sequences), shuffled scales and at
      # least 4 splits everywhere: shorter programs, a shorter tail (H200, main
      # kernel us, the former pick vs 4 shuffled splits: (48, 32768) 447.7 (2)
      # vs 439.9, (64, 32768) 672.0 (1, unshuffled) vs 579.7, (100, 32768) 926.3
      # (2) vs 888.2, (160, 32768) 1647.4 (1, unshuffled) vs 1390.1; 6 splits
      # within 1 % of 4; `ab-kivi4-large-batch-splits-nvidia-h200-20261129r.json`)
      programs, two_per_sm = heads * splits, 2 * num_sms
      if many or programs * 10 < -(-programs // two_per_sm) * two_per_sm * 9:
        splits = three_per_sm()
        shuffle = True
    # Subnormal codes for 4-bit K and V (H100, kernel us, kivi4: 68.4 vs 70.4 at
    # (1, 131072), 132.3 vs 134.8 at (8, 32768), 1291 vs 1342 at (96, 32768)),
    # and with byte masks (one shift per word) for 2-bit too: whole call, H100,
    # kivi2 55.0 vs 61.8 us at (1, 131072), 106.8 vs 121.1 at (8, 32768), 558.6
    # vs 643.5 at (48, 32768); kivi4 64.5 vs 67.5, 120.4 vs 126.8, 670.8 vs 674.0
    # (`attention-ab-byte-masks-20261126-*`); k8v4's 4-bit V 1-2 % faster
    # (`attention-ab-k8v4-byte-masks-20261126-*`). Without byte masks kivi2
    # lost with subnormal codes on either side (1304 vs 1226 at (96, 32768)).
    # So the fields' defaults (on) stand for every format.
    # 4-bit K and V in 128-token blocks over <= 8 (sequence, kv head) pairs keep
    # the plain rescale: the lazy one gave (1, 131072) 45.8 vs 45.2 us, 15.2 vs
    # 15.1 at (1, 32768), but 85.7 vs 87.4 at (8, 32768) (H200, main kernel;
    # 0.2-1 % faster for kivi2 and at large batch;
    # `attention-ab-edge-masks-lazy-rescale-20261129-*`, `-kivi4-wide-early-v-`)
    # At 3 per SM (above) the lazy one wins again (H200, main kernel us, lazy vs
    # plain: (1, 131072) 42.2 vs 42.6, (1, 65536) 23.8 vs 24.0, the draft view
    # 42.3 vs 42.5 and 23.7 vs 24.3; at (1, 49152), 8 blocks per split, 19.1
    # vs 19.0; `ab-b1-3per-sm-20261129x-*`).
    lazy_rescale = not (kivi4_wide and heads <= 8) or long_3_per_sm
    if target_view and 8 < heads <= 64 and block_k == 128:
      splits = max(1, min(max(one_wave(2 * num_sms, heads, blocks, block_k), 8), blocks // 4))
    return cls(block_k=block_k, num_splits=splits, max_concurrent_steps=stages,
               shuffle_scales=shuffle, lazy_rescale=lazy_rescale)


def one_wave_splits(slots: int, heads: int, blocks: int, fill_waves: bool = True,
                    residual_programs: int = 1) -> int:
  """Packed programs per (batch, kv head) for ``slots`` resident programs over
  ``heads = B * Hkv``: one wave, ``slots // heads`` (less the
  ``residual_programs`` of each (batch, kv head), `residual_parts`, when that
  is more than 16). With ``fill_waves``, when those
  programs number fewer than two waves and fill under 90 % of the slots of
  the waves they take (e.g. 392 programs in one wave of 528, or 640 in two),
  at least two waves instead: the smallest count with ``heads * splits >= 2
  * slots``. At most ``blocks // 4`` (>= 4 blocks per split) and 64.

  H100, kivi4 (128-token blocks), kernel us: at (48, 32768, 32, 8) 1 split
  (0.73 waves) 744.7, 2 676.6, 3 670.7, 4 669.2, 8 669.4; at (16, 32768) 1
  432.7, 2 245.4, 3 (0.73 waves) 263.8, 4 (one wave) 236.5, 8 236.0
  (`attention-ab-large-batch*-20261126-*`)."""
  heads = max(1, heads)
  programs = max(1, slots // heads)
  want = programs - residual_programs if programs > 16 else programs
  total = heads * want
  waves = -(-total // slots)
  if fill_waves and total < 2 * slots and total * 10 < waves * slots * 9:
    want = -(-2 * slots // heads)
  return max(1, min(want, blocks // 4, 64))


def _code_width(side: SideSpec, head_dim: int, codes) -> int:
  """Bytes of a token row a side's code tiles read: ``D bits / 8`` (a 16-bit
  side: D values); ``codes [..., C, W]`` must have rows of exactly that width
  (a hierarchical cache's plane-blocked codes come as ``[..., 2C, D/2]``
  rows, `mosaic_decode_attention`'s ``plane_block``)."""
  width = head_dim if side.bits == 16 else head_dim * side.bits // 8
  if codes.shape[-1] != width:
    raise ValueError(f"{side.bits}-bit codes of head_dim {head_dim} need rows of {width} "
                     f"bytes, got {codes.shape}")
  return width


def _swizzle(width_bytes: int) -> int:
  for s in (128, 64, 32):
    if width_bytes % s == 0:
      return s
  return 16


def _tiled(width_elems: int, itemsize_bits: int):
  """Transforms of a ``[rows, width]`` smem tile (tiling + swizzle)."""
  sw = _swizzle(width_elems * itemsize_bits // 8)
  return (plgpu.TilingTransform((8, sw * 8 // itemsize_bits)), plgpu.SwizzleTransform(sw))


def _plane_blocks(i, plane_block: int, bk: int):
  """Block ``i`` (``bk`` tokens) of the upper-plane rows of plane-blocked codes
  seen as ``[2C, D/2]`` rows (`hierarchical.plane_row`; ``bk`` divides
  ``plane_block``): every plane block's lower half is skipped."""
  per = plane_block // bk
  return i + per * (i // per)


def _side_specs(side: SideSpec, width: int, head_dim: int, bk: int, values_transforms,
                plain_codes: bool = False, plane_block: int = 0, wide: bool = False,
                lower: bool = False):
  """Pipeline BlockSpecs of one side: code tile ``[bk, width]`` (+ scale, zero),
  or a ``[bk, D]`` value tile (``values_transforms``) for a 16-bit side.
  ``plain_codes``: the code tile untiled and unswizzled (`mosaic_dequant` reads rows).
  ``plane_block``: the codes are a hierarchical cache's plane-blocked rows
  ``[2C, D/2]`` and the tiles read its upper planes (the draft view);
  ``lower`` (with it): a second code tile of the same tokens' lower planes,
  ``plane_block`` rows further (the target view).
  ``wide``: the codes come as `wide_view` rows and the code tile is
  ``[bk * width / WIDE_ROW, WIDE_ROW]`` (the same bytes)."""
  if side.bits == 16:
    return [plgpu.BlockSpec((bk, head_dim), lambda i: (i, 0), transforms=values_transforms)]
  if plane_block:
    code_map = lambda i: (_plane_blocks(i, plane_block, bk), 0)  # noqa: E731
  else:
    code_map = lambda i: (i, 0)  # noqa: E731
  rows, cols = (bk * width // mosaic_dequant.WIDE_ROW, mosaic_dequant.WIDE_ROW) if wide else (
      bk, width)
  code_tf = () if plain_codes else _tiled(cols, 8)
  specs = [plgpu.BlockSpec((rows, cols), code_map, transforms=code_tf)]
  if lower:
    if not plane_block:
      raise ValueError("lower planes need plane-blocked codes (plane_block)")
    per = plane_block // bk  # tiles per plane block: the lower planes follow the upper
    specs.append(plgpu.BlockSpec(
        (rows, cols), lambda i: (_plane_blocks(i, plane_block, bk) + per, 0),
        transforms=code_tf))
  if side.axis == "token":
    specs += [plgpu.BlockSpec((bk,), lambda i: (i,))] * 2
  else:
    g = side.group // bk
    specs += [plgpu.BlockSpec((1, head_dim), lambda i, _g=g: (i // _g, 0))] * 2
  return specs


def wide_view(codes):
  """``[..., C, W]`` code rows as ``[..., C W / WIDE_ROW, WIDE_ROW]`` (free: the
  same contiguous bytes), the rows `_side_specs(wide=True)` tiles read."""
  return codes.reshape(*codes.shape[:-2], codes.shape[-2] * codes.shape[-1]
                       // mosaic_dequant.WIDE_ROW, mosaic_dequant.WIDE_ROW)


def _split_blocks(packed, j, num_splits: int, bk: int, skip: int = 0):
  """``(first, num_blocks)``: the ``bk``-token blocks of split ``j`` of the packed
  region ``[min(skip, packed), packed)`` (``skip``: a multiple of ``bk`` the
  caller attends itself, sink formats; `_triton.split_range`)."""
  start, stop = _triton.split_range(packed, j, num_splits, bk, skip)
  return start // bk, jnp.maximum(0, pl.cdiv(stop - start, bk))


def _shifted(spec, first):
  """``spec`` with its block index offset by ``first`` (a split's first block)."""
  im = spec.index_map
  return dataclasses.replace(spec, index_map=lambda i, _im=im: _im(i + first))


def _run_split(step, specs, gmem_refs, *, packed, j, num_splits: int, bk: int,
               max_concurrent_steps: int, init_carry, skip: int = 0):
  """Pipelines split ``j``'s packed blocks through ``step(tiles, carry, token0)``
  (`plgpu.emit_pipeline` over TMA tiles of ``specs`` from ``gmem_refs``); returns
  the final carry. ``skip``: packed tokens left to the caller (`_split_blocks`)."""
  first, num_blocks = _split_blocks(packed, j, num_splits, bk, skip)

  def body(idx, *tiles_and_carry):
    *tiles, carry = tiles_and_carry
    (i,) = idx
    return step(tiles, carry, (first + i) * bk)

  pipeline = plgpu.emit_pipeline(
      body, grid=(num_blocks,), in_specs=[_shifted(spec, first) for spec in specs],
      max_concurrent_steps=max_concurrent_steps, init_carry=init_carry)
  return pipeline(*gmem_refs)


def unmasked_packed_steps(num_queries: int, token_group: int, residual: int,
                          block_k: int) -> bool:
  """Whether every query row sees every token of every packed block
  (`MosaicAttentionConfig.edge_masks`): one query per row (its causal limit
  is ``length - 1``), blocks that tile the token group (the packed region, a
  whole number of groups, ends on a block boundary) and ``residual >=
  token_group`` (so ``packed <= length - residual + token_group <= length``;
  `KVFormat` requires it, the raw kernel entries do not)."""
  return num_queries == 1 and token_group % block_k == 0 and residual >= token_group


def residual_parts(residual: int, block_k: int) -> int:
  """Programs per (sequence, kv head) over the residual block: one per
  ``block_k``-row tile, each writing its own partial after the packed splits'.

  One program per tile rather than one program looping (or unrolled) over
  them: a second tile in the residual program, as a Python loop, made ptxas
  schedule the whole kernel worse (QuantSpec's R = 2G in 128-token blocks,
  H200, (1, 131072, 32, 8): 65.0 us against 47.3 with R = 128), and as a
  `fori_loop` it raised the kernel's registers 163 -> 176, which costs the
  third program per SM at large batch (`mosaic-NOTES.md`, 2026-11-28)."""
  return residual // block_k


def _program_start(lengths_gmem, row0_gmem, q_gmem, q_smem, barrier, *, kv_heads: int,
                   token_group: int, residual: int, num_queries: int, q_rows: int, rows: int,
                   row_layout):
  """What every program reads first: its ``(b, h, j)``, its row ``cb`` of the
  `head_rows` cache arrays ``[R * H, ...]`` (``(row0 + b) * H + h``, ``row0_gmem
  [1]`` from `stacked_rows`), the
  sequence length, the packed length (the residual rule) and each query row's
  causal limit (row ``r = head * S + s`` sees tokens ``<= length - S + s``); q
  is copied to smem from its row ``bh = b * H + h`` of ``q_gmem [B * H, ...]``
  (also the program's row of the other per-query inputs and, times ``J + R / block_k``,
  of the partial outputs). Returns ``(bh, cb, h, j, length, packed, row_limit)``."""
  b = lax.axis_index("b")
  h = lax.axis_index("h")
  j = lax.axis_index("j")
  cb = (row0_gmem[0] + b) * kv_heads + h
  length = lengths_gmem[b]
  packed = token_group * jnp.maximum(0, (length - residual + token_group) // token_group)
  row = plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=row_layout)
  row_limit = length - num_queries + (row % q_rows) % num_queries
  bh = b * kv_heads + h
  plgpu.copy_gmem_to_smem(q_gmem.at[bh], q_smem, barrier)
  plgpu.barrier_wait(barrier)
  return bh, cb, h, j, length, packed, row_limit


def _write_partials(acc, l_i, m_i, o_smem, lm_smem, o_gmem, l_gmem, m_gmem, idx, rows=None,
                    log2: bool = False):
  """Stores one program's unnormalized output and softmax statistics (first
  ``rows`` rows of the smem tiles when given) to its slot ``idx`` in HBM; a
  base-2 max (``log2``) is written in natural-log units."""
  o_smem[...] = acc
  lm_smem[0] = l_i
  lm_smem[1] = m_i * LN2 if log2 else m_i
  plgpu.commit_smem()
  part = slice(None) if rows is None else pl.ds(0, rows)
  plgpu.copy_smem_to_gmem(o_smem.at[part], o_gmem.at[idx])
  plgpu.copy_smem_to_gmem(lm_smem.at[0, part], l_gmem.at[idx])
  plgpu.copy_smem_to_gmem(lm_smem.at[1, part], m_gmem.at[idx])
  plgpu.wait_smem_to_gmem(0)


def stacked_rows(arrays, layer, batch: int):
  """Layer ``layer`` of layer-stacked cache arrays, read in place.

  ``arrays``: ``[L, B, H, ...]`` (None entries pass through). Returns them as
  ``[L * B, H, ...]`` (merging the two leading axes is free: no copy) and
  ``row0 [1]`` int32, the row of sequence 0 of that layer; the kernels read
  sequence ``b`` at row ``row0 + b``. ``layer`` (int or traced) is clamped
  to ``[0, L)`` like `lax.dynamic_index_in_dim`. ``layer=None``: one layer's
  ``[B, H, ...]`` arrays, returned as they are with ``row0 = 0``.
  """
  if layer is None:
    return list(arrays), jnp.zeros((1,), jnp.int32)
  num_layers = next(x for x in arrays if x is not None).shape[0]
  flat = [None if x is None else x.reshape(num_layers * batch, *x.shape[2:]) for x in arrays]
  row0 = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1) * batch
  return flat, row0.reshape(1)


def head_rows(arrays):
  """Arrays ``[R, H, ...]`` as ``[R * H, ...]`` (free: a reshape of contiguous
  axes), which the kernels index by one row: the cache arrays at ``cb * H + h``,
  q, its residual-program copy and ``sum(q)`` (``R = B``) at ``b * H + h``.

  One dynamic TMA coordinate instead of two: with the layer-stacked arrays of
  a `jaxkv.ModelCache` (``R = L * B``) the two-index form took the 2-bit kernel
  from 168 to 185 registers, a program fewer per SM (H200, 2026-11-27,
  mosaic-NOTES), while a single ``B = 1`` cache's size-1 axis was dropped.
  """
  return [None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
          for x in arrays]


def query_rows(q, kv_heads: int, sm_scale, dtype, n_pad: int):
  """``q [B, S, Hq, D]`` -> ``[B, Hkv, n_pad, D]``: the query rows ``r = h S + s``
  of each kv head, times ``sm_scale`` (in float32), in ``dtype``, zero-padded."""
  batch, num_queries, q_heads, head_dim = q.shape
  group_q = q_heads // kv_heads
  q_rows = group_q * num_queries
  qh = q.reshape(batch, num_queries, kv_heads, group_q, head_dim)
  qh = qh.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, q_rows, head_dim)
  qh = (qh.astype(jnp.float32) * sm_scale).astype(dtype)
  return jnp.pad(qh, ((0, 0), (0, 0), (0, n_pad - q_rows), (0, 0)))


def log2_scale(sm_scale) -> jax.Array:
  """``sm_scale * log2(e)`` in float32 (`MosaicAttentionConfig.log2_scores`),
  whatever the dtype of a traced ``sm_scale``: a bfloat16 product would be off
  by up to a bf16 rounding (0.33 % at ``128**-0.5``), a different softmax
  temperature from the staged rows', which take ``sm_scale`` as it is."""
  return jnp.asarray(sm_scale, jnp.float32) * np.float32(LOG2E)


def unpack_rows(out, num_queries: int, q_heads: int):
  """Inverse of `query_rows`' layout: ``[B, Hkv, rows, D]`` (rows >= Hq/Hkv * S)
  -> ``[B, S, Hq, D]``; the padding rows are dropped."""
  batch, kv_heads, _, head_dim = out.shape
  group_q = q_heads // kv_heads
  out = out[:, :, :group_q * num_queries].reshape(batch, kv_heads, group_q, num_queries,
                                                  head_dim)
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, num_queries, q_heads, head_dim)


def target_view_refusal(config: MosaicAttentionConfig, head_dim: int, dtype,
                        k_side: SideSpec | None = None, v_side: SideSpec | None = None) -> str:
  """Why the Mosaic kernel cannot read a hierarchical cache's target view with
  ``config`` ("" if it can): the two planes are joined only on the register
  paths (K codes as the score MMA's operand, V's as the value MMA's) with
  subnormal codes, so bfloat16 caches with head_dim 128, K per channel and V
  per token with one group per head (the planes' 4-bit ``k_side`` /
  ``v_side``, when given), and a config keeping ``tokens_m``, ``register_k``,
  ``register_v``, ``register_vt``, ``fold_scales``, ``subnormal_k`` and
  ``subnormal_v`` on."""
  if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16) or head_dim != 128:
    return (f"the Mosaic target view needs a bfloat16 cache with head_dim 128, got "
            f"{jnp.dtype(dtype)} and {head_dim}")
  if k_side is not None and k_side.axis != "channel":
    return f"the Mosaic target view needs K quantized per channel, got k_axis={k_side.axis!r}"
  if v_side is not None and (v_side.axis != "token" or v_side.group != head_dim):
    return (f"the Mosaic target view needs V quantized per token with one group per head, "
            f"got axis={v_side.axis!r}, group={v_side.group}")
  off = [f for f in ("tokens_m", "register_k", "register_v", "register_vt", "fold_scales",
                     "subnormal_k", "subnormal_v") if not getattr(config, f)]
  if off:
    return f"the Mosaic target view needs {', '.join(off)}=True in the config"
  return ""


def supports(k_side: SideSpec, v_side: SideSpec, *, head_dim: int, q_rows: int,
             dtype, token_group: int, residual: int, block_k: int = 64,
             sink_tokens: int = 0, skip_tokens: int = 0) -> tuple[bool, str]:
  """Whether the Mosaic kernel serves this case; ``(False, reason)`` if not (a
  format with ``sink_tokens`` needs ``skip_tokens`` >= them, a multiple of
  ``block_k``: `_triton.skip_refusal`)."""
  why = _triton.skip_refusal(sink_tokens, skip_tokens, block_k)
  if why:
    return False, why
  if plgpu is None:
    return False, "jax.experimental.pallas.mosaic_gpu is not importable"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return False, f"cache dtype {jnp.dtype(dtype)} (Mosaic kernel: bfloat16/float16 only)"
  if head_dim not in (64, 128):
    return False, f"head_dim={head_dim} (Mosaic kernel: 64 or 128)"
  if q_rows > _M:
    return False, f"(Hq/Hkv)*S={q_rows} query rows per kv head > {_M}"
  for name, side in (("K", k_side), ("V", v_side)):
    if side.bits == 16:
      continue
    if side.axis == "token" and side.group != head_dim:
      return False, (f"{name}: per-token groups of {side.group} channels "
                     f"(Mosaic kernel: one group per head)")
    if side.axis == "channel" and side.group % block_k:
      return False, f"{name}: token_group={side.group} not a multiple of block_k={block_k}"
    if head_dim * side.bits // 8 < 32:
      return False, (f"{name}: {side.bits}-bit rows of {head_dim} channels are under 32 bytes "
                     "(no TMA swizzle for them)")
  if residual % block_k:
    return False, f"residual={residual} not a multiple of block_k={block_k}"
  return True, ""


def _dequant_into(codes_smem, scale_smem, zero_smem, dq_smem, side: SideSpec, dtype):
  """Unpacks one ``[bk, D*bits/8]`` code tile into ``dq_smem [bk, D]`` (``dtype``)."""
  per_byte = 8 // side.bits
  width = codes_smem.shape[-1]            # bytes per token row = channels per plane
  raw = _load(codes_smem, layout=plgpu.Layout.WGMMA)  # [bk, W] uint8
  raw = raw.astype(jnp.uint32)  # Mosaic does no 8-bit arithmetic but bitwise ops
  bk = raw.shape[0]
  if side.axis == "token":  # one (scale, zero) per token: column vectors
    sc = _load(scale_smem, layout=plgpu.Layout.WGMMA.reduce(1)).astype(jnp.float32)
    zr = _load(zero_smem, layout=plgpu.Layout.WGMMA.reduce(1)).astype(jnp.float32)
    sc = lax.broadcast_in_dim(sc, (bk, width), [0])
    zr = lax.broadcast_in_dim(zr, (bk, width), [0])
  mask = np.uint32((1 << side.bits) - 1)
  for plane in range(per_byte):
    codes = raw
    if plane:
      codes = codes >> np.uint32(plane * side.bits)
    if side.bits < 8:
      codes = codes & mask
    x = codes.astype(jnp.float32)
    cols = pl.ds(plane * width, width)
    if side.axis == "channel":  # one (scale, zero) per channel of this token group
      sc_p = _load(scale_smem.at[0, cols], layout=plgpu.Layout.WGMMA.reduce(0))
      zr_p = _load(zero_smem.at[0, cols], layout=plgpu.Layout.WGMMA.reduce(0))
      x = (x * lax.broadcast_in_dim(sc_p.astype(jnp.float32), (bk, width), [1])
           + lax.broadcast_in_dim(zr_p.astype(jnp.float32), (bk, width), [1]))
    else:
      x = x * sc + zr
    dq_smem[:, cols] = x.astype(dtype)


def _attend_block(q_smem, kdq_smem, vdq_smem, carry, *, token0, valid_below, row_limit,
                  dtype):
  """One online-softmax step over a ``[bk, D]`` K/V tile already in smem."""
  acc, m_i, l_i = carry
  bk = kdq_smem.shape[0]

  def scores(acc_ref):
    plgpu.wgmma(acc_ref, q_smem, _t(kdq_smem))
    return acc_ref[...]

  s = pl.run_scoped(scores, plgpu.ACC((_M, bk), jnp.float32))  # [M, bk]
  tok = token0 + plgpu.broadcasted_iota(jnp.int32, (_M, bk), 1, layout=plgpu.Layout.WGMMA)
  lim = lax.broadcast_in_dim(row_limit, (_M, bk), [0])
  s = jnp.where((tok < valid_below) & (tok <= lim), s, -jnp.inf)
  m_new = jnp.maximum(m_i, s.max(axis=1))
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp(m_i - m_safe)
  p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
  l_i = l_i * alpha + p.sum(axis=1)
  acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

  def pv(acc_ref):
    plgpu.wgmma(acc_ref, p.astype(dtype), vdq_smem)

  acc = pl.run_state(pv)(plgpu.ACC.init(acc))
  return acc, m_new, l_i


@functools.partial(
    jax.jit, static_argnames=("k_side", "v_side", "token_group", "residual", "config",
                              "return_lse", "skip_tokens", "plane_block", "target_view",
                              "stage_queries"))
def mosaic_decode_attention(
    q: jax.Array,           # [B, S, Hq, D]
    k_codes: jax.Array,     # [B, H, C, D*kb/8] uint8 | [B, H, C, D] (16-bit; plane_block)
    k_scale: jax.Array | None,  # [B, H, C//G, D] | [B, H, C, 1] | None
    k_zero: jax.Array | None,
    v_codes: jax.Array,     # [B, H, C, D*vb/8] uint8 | [B, H, C, D] (16-bit; plane_block)
    v_scale: jax.Array | None,  # [B, H, C, 1] | None
    v_zero: jax.Array | None,
    k_residual: jax.Array,  # [B, H, R, D]
    v_residual: jax.Array,  # [B, H, R, D]
    lengths: jax.Array,     # [B] int32
    *,
    k_side: SideSpec,
    v_side: SideSpec,
    token_group: int,
    residual: int,
    sm_scale: float | jax.Array,
    config: MosaicAttentionConfig,
    layer: jax.Array | int | None = None,
    return_lse: bool = False,
    seq_bad: jax.Array | None = None,
    skip_tokens: int = 0,
    plane_block: int = 0,
    target_view: bool = False,
    stage: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    stage_queries: int = 0,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Decode attention of S new queries over a packed cache (Hopper kernel).

  Same arguments and result as `dequant_attention.dequant_decode_attention`
  (raw cache arrays); ``k_side``/``v_side`` describe the storage.
  ``plane_block``: the codes are a hierarchical cache's plane-blocked
  ``[..., C, D]`` (`jaxkv.hierarchical`, blocks of ``plane_block`` tokens,
  a multiple of ``config.block_k``) and 4-bit ``k_side``/``v_side`` read
  their upper planes in place (the draft view): whole contiguous runs of
  upper-plane rows, never the lower plane; ``target_view``: both planes
  (QuantSpec's target view, the 8-bit codes joined in registers,
  `target_view_refusal` for what it needs);
  ``sm_scale`` may be a traced scalar (it scales q before the kernel).
  ``layer``: with every cache array stacked on a leading layer axis
  (``[L, B, H, ...]``, a `jaxkv.ModelCache`), the (possibly traced) layer to
  attend over, read in place (`stacked_rows`): slicing it out first would
  copy the layer's whole storage on every call.
  ``return_lse``: also return each query's log-sum-exp of its scaled scores
  (``[B, S, Hq]`` float32, ``-inf`` where no key is visible), merged from the
  programs' partial statistics, as the Triton family's ``return_lse``.
  ``seq_bad``: optional ``[B]`` flags: NaN for every query of a flagged
  sequence and for NaN/inf query rows, written by the combine kernel
  (`dequant_attention.dequant_decode_attention`'s ``seq_bad``).
  ``skip_tokens``: attend only the packed tokens ``[skip_tokens, packed_len)``
  (and the residual); the caller attends the prefix (sink formats,
  `jaxkv.sink_attention`). A multiple of ``config.block_k``; 0 traces the
  kernel unchanged.
  ``stage``: ``(k_stage, v_stage, staged)`` (``[B, P, H, D]``, ``[B]``):
  speculative decoding's staged rows, attended exactly and merged by the
  combine kernel (`combine_t.combine_t`'s ``stage``); q must then be the
  folded queries of `jaxkv.staged_cache` (``S = 1``, ``Hq = H *
  stage_queries * G``: row ``s G + g`` of each kv head is query ``s``), and
  ``return_lse`` False.
  Returns ``[B, S, Hq, D]`` in q's dtype (and the log-sum-exp).
  """
  batch, num_queries, q_heads, head_dim = q.shape
  (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual, v_residual), row0 = \
      stacked_rows((k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_residual,
                    v_residual), layer, batch)
  kv_heads, capacity = k_codes.shape[1], k_codes.shape[2]
  dtype = k_residual.dtype
  group_q = q_heads // kv_heads
  q_rows = group_q * num_queries
  out_rows = max(8, -(-q_rows // 8) * 8)
  bk = config.block_k
  if capacity % bk:
    raise ValueError(f"cache capacity {capacity} must be a multiple of block_k={bk}")
  if residual % bk or {k_residual.shape[-2], v_residual.shape[-2]} != {residual}:
    # one program per block_k rows (`residual_parts`): a partial tile would be dropped
    raise ValueError(f"residual={residual} must be a multiple of block_k={bk} and the "
                     f"residual arrays' rows (K {k_residual.shape[-2]}, V "
                     f"{v_residual.shape[-2]})")
  if plane_block:
    if plane_block % bk or capacity % plane_block or not config.tokens_m or any(
        s.bits != 4 for s in (k_side, v_side)):
      raise ValueError(f"plane_block={plane_block}: the views of plane-blocked codes "
                       f"need 4-bit sides, tokens_m=True and a block of a multiple of "
                       f"block_k={bk} dividing the capacity {capacity}")
    # [B, H, C, D] -> the rows of one plane, [B, H, 2C, D/2] (free)
    k_codes, v_codes = hierarchical.plane_view(k_codes), hierarchical.plane_view(v_codes)
  if target_view:
    why = target_view_refusal(config, head_dim, dtype, k_side, v_side) or (
        "" if plane_block else "target_view needs plane-blocked codes (plane_block)")
    if why:
      raise ValueError(why)
  why = _triton.skip_refusal(0, skip_tokens, bk)
  if why:
    raise ValueError(why)
  num_splits = config.num_splits
  # the last programs of each (b, h) take the residual, one tile each
  grid_j = num_splits + residual_parts(residual, bk)

  # Query rows r = h * S + s, scaled by the softmax scale, zero-padded to M
  # (v1) or to the N of the tokens-on-M MMAs (v2).
  # N = 8 only with the register K path: the 8-bit sides' float path lost
  # ~20 % at (8, 32768, 32, 8) with it on an H200 (kivi2 gained 5-7 %).
  n_pad = (_rows_n(q_rows, smallest=8 if _register_k(config, k_side, head_dim, dtype) else 16)
           if config.tokens_m else _M)
  # base-2 scores (`MosaicAttentionConfig.log2_scores`): log2(e) rides on q
  log2 = config.tokens_m and config.log2_scores and dtype == jnp.bfloat16
  qh = query_rows(q, kv_heads, log2_scale(sm_scale) if log2 else sm_scale, dtype, n_pad)
  # Per-token scale/zero with one group per head: [B, H, C] so TMA boxes are rows.
  def squeeze_token(x, side):
    if x is None or side.axis != "token":
      return x
    return x.reshape(x.shape[:3])
  k_scale, k_zero = squeeze_token(k_scale, k_side), squeeze_token(k_zero, k_side)
  v_scale, v_zero = squeeze_token(v_scale, v_side), squeeze_token(v_zero, v_side)
  lengths = lengths.astype(jnp.int32)

  def unpack_out(out, l_part, m_part):  # [B, H, rows, D] -> [B, S, Hq, D]
    out = unpack_rows(out, num_queries, q_heads).astype(q.dtype)
    if not return_lse:
      return out
    lse = partials_lse(l_part[..., :q_rows], m_part[..., :q_rows])   # [B, H, rows]
    lse = lse.reshape(batch, kv_heads, group_q, num_queries).transpose(0, 3, 1, 2)
    return out, lse.reshape(batch, num_queries, q_heads)

  if config.tokens_m:
    def arrays_of(codes, scale, zero, side):
      return [codes] if side.bits == 16 else [codes, scale, zero]
    q_res = qh
    if _register_k(config, k_side, head_dim, dtype):
      # The MMA's K columns are a fixed permutation of the channels: permute
      # q once instead of any code (the kernel reads each column's scale/zero).
      qh = qh[..., mosaic_dequant.code_permutation(head_dim, k_side.bits)]
    o_part, l_part, m_part = _tokens_m_call(
        qh, q_res, arrays_of(k_codes, k_scale, k_zero, k_side),
        arrays_of(v_codes, v_scale, v_zero, v_side), k_residual, v_residual, lengths,
        k_side=k_side, v_side=v_side, token_group=token_group, residual=residual,
        num_queries=num_queries, q_rows=q_rows, config=config, dtype=dtype, row0=row0,
        skip_tokens=skip_tokens, plane_block=plane_block, target_view=target_view, log2=log2)
    # One combine kernel reads the O^T partials as they are: with register_v
    # the packed programs' rows are in the MMA's V column order (channel c at
    # row argsort(perm)[c]), the residual programs' in channel order.
    packed_rows = None
    if _register_vt(config, v_side, head_dim, dtype):
      packed_rows = np.argsort(mosaic_dequant.vt_permutation(head_dim, v_side.bits))
    elif _register_v(config, v_side, head_dim, dtype):
      packed_rows = np.argsort(mosaic_dequant.code_permutation(head_dim, v_side.bits))
    rows = _triton.next_pow2(q_rows)
    # The input policy's flags: computed in the combine kernel from the query
    # rows this kernel read (q_res: scaled, channel order), so q has one
    # consumer and its producer (RoPE in a model) can fuse into their preparation
    # (with staged rows the combine kernel reads q itself too: their scores in
    # float32 from the unrounded q).
    poison = {} if seq_bad is None else dict(qh=q_res, q_rows=q_rows, seq_bad=seq_bad)
    if stage is not None:
      if num_queries != 1 or return_lse:  # (combine_t checks stage_queries)
        raise ValueError(f"stage needs the folded queries (q_len 1, got {num_queries}) "
                         f"and return_lse=False")
      poison["stage"] = (q.reshape(batch, kv_heads, q_rows, head_dim), *stage, sm_scale,
                         stage_queries)
    return unpack_out(combine_t.combine_t(o_part, l_part, m_part, rows=rows,
                                          packed_rows=packed_rows, out_dtype=q.dtype,
                                          plain_tail=residual_parts(residual, bk), **poison),
                      l_part, m_part)

  if stage is not None:
    raise ValueError("stage needs config.tokens_m")
  k_w = k_codes.shape[-1]
  v_w = v_codes.shape[-1]
  for side, codes in ((k_side, k_codes), (v_side, v_codes)):
    w = codes.shape[-1]
    if w != _code_width(side, head_dim, codes):
      raise ValueError(f"tokens_m=False reads whole code rows: rows of {w} bytes for "
                       f"{side.bits}-bit codes of head_dim {head_dim} need tokens_m=True")
  # The dequantized tiles are written one plane (a block of D*bits/8 channels)
  # at a time, so their swizzle tile must not be wider than the narrowest plane.
  plane_width = min([head_dim] + [head_dim * s.bits // 8 for s in (k_side, v_side)
                                  if s.bits < 16])
  dq_transforms = _tiled(plane_width, 16)

  k_specs = _side_specs(k_side, k_w, head_dim, bk, dq_transforms)
  v_specs = _side_specs(v_side, v_w, head_dim, bk, dq_transforms)
  nk, nv = len(k_specs), len(v_specs)

  def kernel(lengths_gmem, row0_gmem, q_gmem, *refs):
    k_refs = refs[:3]
    v_refs = refs[3:6]
    kres_gmem, vres_gmem, o_gmem, l_gmem, m_gmem = refs[6:11]
    q_smem, kdq_smem, vdq_smem, o_smem, lm_smem, barrier = refs[11:]
    bh, cb, h, j, length, packed, row_limit = _program_start(
        lengths_gmem, row0_gmem, q_gmem, q_smem, barrier, kv_heads=kv_heads,
        token_group=token_group,
        residual=residual, num_queries=num_queries, q_rows=q_rows, rows=_M,
        row_layout=plgpu.Layout.WGMMA.reduce(1))

    acc0 = plgpu.layout_cast(jnp.zeros((_M, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m0 = plgpu.layout_cast(jnp.full((_M,), -jnp.inf, jnp.float32),
                           plgpu.Layout.WGMMA.reduce(1))
    l0 = plgpu.layout_cast(jnp.zeros((_M,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))

    def finish(carry):
      acc, m_i, l_i = carry
      _write_partials(acc, l_i, m_i, o_smem, lm_smem, o_gmem, l_gmem, m_gmem,
                      bh * grid_j + j,
                      rows=out_rows)

    @pl.when(j < num_splits)
    def _packed():
      def step(tiles, carry, token0):
        kt, vt = tiles[:nk], tiles[nk:]
        if k_side.bits == 16:
          k_tile = kt[0]
        else:
          _dequant_into(kt[0], kt[1], kt[2], kdq_smem, k_side, dtype)
          k_tile = kdq_smem
        if v_side.bits == 16:
          v_tile = vt[0]
        else:
          _dequant_into(vt[0], vt[1], vt[2], vdq_smem, v_side, dtype)
          v_tile = vdq_smem
        plgpu.commit_smem()
        return _attend_block(q_smem, k_tile, v_tile, carry, token0=token0,
                             valid_below=packed, row_limit=row_limit, dtype=dtype)

      gm = [r.at[cb] for r in k_refs[:nk]] + [r.at[cb] for r in v_refs[:nv]]
      finish(_run_split(step, k_specs + v_specs, gm, packed=packed, j=j,
                        num_splits=num_splits, bk=bk,
                        max_concurrent_steps=config.max_concurrent_steps,
                        init_carry=(acc0, m0, l0), skip=skip_tokens))

    @pl.when(j >= num_splits)
    def _residual():  # tile j - num_splits of the residual block
      num_res = length - packed
      r0 = pl.multiple_of((j - num_splits) * bk, bk)
      plgpu.copy_gmem_to_smem(kres_gmem.at[cb, pl.ds(r0, bk)], kdq_smem, barrier)
      plgpu.barrier_wait(barrier)
      plgpu.copy_gmem_to_smem(vres_gmem.at[cb, pl.ds(r0, bk)], vdq_smem, barrier)
      plgpu.barrier_wait(barrier)
      # Residual row r holds token packed + r.
      finish(_attend_block(q_smem, kdq_smem, vdq_smem, (acc0, m0, l0), token0=packed + r0,
                           valid_below=packed + num_res, row_limit=row_limit, dtype=dtype))

  def arrays(codes, scale, zero, side):
    return [codes] if side.bits == 16 else [codes, scale, zero]

  k_in = arrays(k_codes, k_scale, k_zero, k_side)
  v_in = arrays(v_codes, v_scale, v_zero, v_side)
  k_in += [k_in[0]] * (3 - len(k_in))  # unused slots (16-bit sides) repeat the codes
  v_in += [v_in[0]] * (3 - len(v_in))
  scratch = [
      plgpu.SMEM((_M, head_dim), dtype, transforms=dq_transforms),          # q
      plgpu.SMEM((bk, head_dim), dtype, transforms=dq_transforms),          # K tile
      plgpu.SMEM((bk, head_dim), dtype, transforms=dq_transforms),          # V tile
      plgpu.SMEM((_M, head_dim), jnp.float32),                              # o
      plgpu.SMEM((2, _M), jnp.float32),                                     # l, m
      plgpu.Barrier(),
  ]
  o_part, l_part, m_part = plgpu.kernel(
      kernel,
      out_type=[  # flat over (sequence, kv head, part), as the inputs (`head_rows`)
          jax.ShapeDtypeStruct((batch * kv_heads * grid_j, out_rows, head_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch * kv_heads * grid_j, out_rows), jnp.float32),
          jax.ShapeDtypeStruct((batch * kv_heads * grid_j, out_rows), jnp.float32),
      ],
      grid=(batch, kv_heads, grid_j),
      grid_names=("b", "h", "j"),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=_SEMANTICS),
      kernel_name=f"jaxkv_mosaic_dequant_attention_k{k_side.bits}v{v_side.bits}",
  )(lengths, row0, *head_rows([qh, *k_in, *v_in, k_residual, v_residual]))
  o_part, l_part, m_part = unflatten_partials((o_part, l_part, m_part), batch, kv_heads)
  out = _combine(o_part, l_part, m_part)                                 # [B, H, M, D]
  if seq_bad is not None:
    bad = _triton.nonfinite_query_rows(q, seq_bad, kv_heads, out.shape[2])
    out = jnp.where(bad[..., None] != 0, jnp.nan, out)
  return unpack_out(out, l_part, m_part)


def _split_weights(m):
  """``(m_max [B, H, 1, M], exp(m - m_max) [B, H, J, M])`` over the split axis of
  ``m [B, H, J, M]``; an all ``-inf`` column (no visible key) takes ``m_max = 0``."""
  m_max = jnp.max(m, axis=2, keepdims=True)
  m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
  return m_max, jnp.exp(m - m_max)


def partials_lse(l, m):
  """Log-sum-exp over the split axis of partial statistics ``l, m [B, H, J, M]``
  (``sum_j l_j exp(m_j)`` in log space): ``[B, H, M]`` float32, ``-inf`` where
  every ``l`` is zero, NaN where one is NaN."""
  m_max, w = _split_weights(m)
  den = jnp.sum(l * w, axis=2)
  return jnp.where(den == 0, -jnp.inf, m_max[:, :, 0] + jnp.log(den))


def _combine(o, l, m):
  """Log-sum-exp merge over the split axis: ``o [B,H,J,M,D], l/m [B,H,J,M]``."""
  _, w = _split_weights(m)                               # [B, H, J, M]
  num = jnp.sum(w[..., None] * o, axis=2)
  den = jnp.sum(w * l, axis=2)
  return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


# ----------------------------------------------------------------------------
# Tokens on M ("v2"): S^T = K_tile @ q^T and O^T += V_tile^T @ P^T.
#
# The packed token block is the M dimension of both MMAs, so the query rows of
# one kv head (Hq/Hkv x S, padded to N = 16, 32 or 64) are the N dimension and
# nothing is padded to the warpgroup's 64 rows. K is dequantized in registers
# and is the register A operand of the score MMA (no shared-memory round trip);
# V is dequantized into shared memory and read as the transposed A operand of
# ``O^T += V^T @ P^T`` with ``P^T`` (``[bk, N]``) stored beside it. Codes become
# exact 16-bit floats with one or / bitcast / subtract per element (the
# exponent trick: ``bits(0x4300 | c)`` is ``128 + c`` in bfloat16, ``0x6400 | c``
# is ``1024 + c`` in float16), then ``c * scale + zero`` in the cache dtype.
# Softmax statistics of a ``[bk, N]`` score tile are column (axis 0)
# reductions; the row sums are deferred (summed over tokens once at the end).
# ----------------------------------------------------------------------------

LAZY_MARGIN = 8.0  # natural-log units: p = exp(s - m) <= e^8 ~ 2981 between rescales
LOG2E = 1.4426950408889634  # log2(e): natural-log scores times this are base-2 scores
LN2 = 0.6931471805599453    # ln(2): a base-2 max times this is the natural-log one


def new_max(s, m_i, colmax, flag_smem=None, state=None, rescale=None, guard: bool = True,
            log2: bool = False):
  """``(m_new, alpha)`` of an online-softmax step over scores ``s [bk, N]``
  (tokens on rows, masked to -inf) with running reference ``m_i [N]``.

  Exact (``flag_smem`` None): ``m_new = max(m_i, colmax(s))``, ``alpha =
  exp(m_i - m_new)``. Lazy: the reference stays (``alpha = 1``) unless some
  score of the warpgroup exceeds it by more than `LAZY_MARGIN`
  (`mosaic_dequant.warpgroup_any` into ``flag_smem``); then the exact update
  runs. Either way o, l and m stay consistent with the reference, so the
  result is the same up to float rounding (p <= e^8 between rescales).

  With ``rescale`` (``rescale(state, alpha) -> state``) the running ``state``
  is rescaled in the exact update only and ``(m_new, state)`` is returned:
  the lazy steps that keep the reference skip the multiplies by one.
  ``guard=False``: the scores are finite (no ``-inf`` new max to guard).
  ``log2``: scores and max in base-2 units (``alpha = 2**(m_i - m_new)``, the
  margin `LAZY_MARGIN` ``* log2(e)``: the same bound on ``p``).
  """
  exp = jnp.exp2 if log2 else jnp.exp

  def exact(s, m_i, state):
    m_new = jnp.maximum(m_i, colmax(s))
    alpha = exp(m_i - (jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard else m_new))
    return (m_new, alpha) if rescale is None else (m_new, rescale(state, alpha))

  if flag_smem is None:
    return exact(s, m_i, state)
  bound = lax.broadcast_in_dim(m_i + LAZY_MARGIN * (LOG2E if log2 else 1.0), s.shape, [1])
  mosaic_dequant.warpgroup_any((s > bound).astype(jnp.int32), flag_smem)
  if rescale is None:
    one = plgpu.layout_cast(jnp.ones(m_i.shape, jnp.float32), plgpu.Layout.WGMMA.reduce(0))
    keep = lambda s, m, st: (m, one)  # noqa: E731
  else:
    keep = lambda s, m, st: (m, st)  # noqa: E731
  return lax.cond(flag_smem[0] != 0, exact, keep, s, m_i, state)


def masked_softmax(s, m_i, *, token0, valid_below, row_limit, colmax, flag_smem=None,
                   masked: bool = True, state=None, rescale=None, guards: bool = True,
                   log2: bool = False):
  """``(p, m_new, alpha)`` of one online-softmax step over scores ``s [bk, N]``
  of tokens ``token0 + [0, bk)``: tokens ``>= valid_below`` or past a query
  row's causal limit (``row_limit [N]``) are masked, then `new_max` (``colmax``
  the column max; lazy with ``flag_smem``), then ``p = exp(s - m_new)``.

  ``masked=False``: the caller knows every query row sees every token of the
  block (no masks). ``state`` / ``rescale``: `new_max`'s (then ``(p, m_new,
  state)`` is returned). ``guards=False`` (with ``masked=False`` only): the
  scores are finite, so no ``-inf`` running max needs guarding. ``log2``:
  `new_max`'s (``p = 2**(s - m_new)``).
  """
  bk, n_rows = s.shape
  if masked:
    tok = token0 + plgpu.broadcasted_iota(jnp.int32, (bk, n_rows), 0, layout=plgpu.Layout.WGMMA)
    lim = lax.broadcast_in_dim(row_limit, (bk, n_rows), [1])
    s = jnp.where((tok < valid_below) & (tok <= lim), s, -jnp.inf)
  guard = guards or masked
  m_new, alpha = new_max(s, m_i, colmax, flag_smem, state, rescale, guard,
                         log2)                                   # [N] (or the state)
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if guard else m_new
  exp = jnp.exp2 if log2 else jnp.exp
  return exp(s - lax.broadcast_in_dim(m_safe, s.shape, [1])), m_new, alpha


_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0), jnp.dtype(jnp.float16): (0x6400, 1024.0)}


def _rows_n(q_rows: int, smallest: int = 8) -> int:
  """N of the tokens-on-M score MMA (and the softmax's width) for ``q_rows``
  query rows: 8 (``smallest``), 16, 32 or 64."""
  for n in (8, 16, 32, 64):
    if smallest <= n and q_rows <= n:
      return n
  raise ValueError(f"{q_rows=} query rows per kv head > 64")


def _plane_width(side: SideSpec, head_dim: int) -> int:
  """Channels per plane (one plane for 8/16-bit sides)."""
  return head_dim if side.bits >= 8 else head_dim * side.bits // 8


def _affine_regs(scale_smem, zero_smem, side: SideSpec, c0: int, width: int, bk: int, dt):
  """Scale/zero of a ``[bk, width]`` plane, broadcast to it (dtype ``dt``)."""
  def to_dt(x):  # float16 scales -> bfloat16 through float32; no-op when they match
    return x if x.dtype == jnp.dtype(dt) else x.astype(jnp.float32).astype(dt)

  if side.axis == "token":
    lay = plgpu.Layout.WGMMA.reduce(1)
    sc = to_dt(_load(scale_smem, layout=lay))
    zr = to_dt(_load(zero_smem, layout=lay))
    dims = [0]
  else:
    lay = plgpu.Layout.WGMMA.reduce(0)
    cols = pl.ds(c0, width)
    sc = to_dt(_load(scale_smem.at[0, cols], layout=lay))
    zr = to_dt(_load(zero_smem.at[0, cols], layout=lay))
    dims = [1]
  return (lax.broadcast_in_dim(sc, (bk, width), dims),
          lax.broadcast_in_dim(zr, (bk, width), dims))


def _dequant_planes(codes_smem, scale_smem, zero_smem, side: SideSpec, head_dim: int, dtype, *,
                    affine: bool = True):
  """Yields ``(c0, x)``: plane ``x`` = channels ``[c0, c0 + W)`` of the tile, ``[bk, W]``
  values in ``dtype`` (WGMMA register layout): ``c * scale + zero``, or the exact
  codes ``c`` when ``affine`` is False (the caller folds scale and zero)."""
  raw = _load(codes_smem, layout=plgpu.Layout.WGMMA)  # [bk, W] uint8
  bk = raw.shape[0]
  width = _plane_width(side, head_dim)
  if side.bits == 8:
    # 8-bit codes exceed a 16-bit float's exponent trick: go through float32
    # (exact: every code < 256 is a bfloat16/float16 integer).
    x = lax.bitcast_convert_type(raw.astype(jnp.uint32) | np.uint32(0x4B000000), jnp.float32)
    x = x - np.float32(8388608.0)                        # 2^23 + c - 2^23 = c
    if not affine:
      yield 0, x.astype(dtype)
      return
    sc, zr = _affine_regs(scale_smem, zero_smem, side, 0, width, bk, jnp.float32)
    yield 0, (x * sc + zr).astype(dtype)
    return
  magic, base = _MAGIC[jnp.dtype(dtype)]
  mask = np.uint16((1 << side.bits) - 1)
  wide = raw.astype(jnp.uint16)
  for plane in range(8 // side.bits):
    c = wide >> np.uint16(plane * side.bits) if plane else wide
    c = (c & mask) | np.uint16(magic)
    x = lax.bitcast_convert_type(c, dtype) - jnp.asarray(base, dtype)  # exact code
    if affine:
      sc, zr = _affine_regs(scale_smem, zero_smem, side, plane * width, width, bk, dtype)
      x = x * sc + zr
    yield plane * width, x


def _token_affine(scale_smem, zero_smem):
  """Per-token scale and zero of a block as float32 ``[bk]`` (WGMMA row vectors)."""
  lay = plgpu.Layout.WGMMA.reduce(1)
  return (_load(scale_smem, layout=lay).astype(jnp.float32),
          _load(zero_smem, layout=lay).astype(jnp.float32))


def _dequant_codes_fit(config: MosaicAttentionConfig, side: SideSpec, head_dim: int,
                       dtype) -> bool:
  """Whether `mosaic_dequant.dequant_codes` makes this side's values (v2 layout, 4/2-bit
  codes, D 64/128; its PTX builds bfloat16 values, so bfloat16 caches only)."""
  return (config.tokens_m and side.bits in (2, 4) and head_dim in (64, 128)
          and jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16))


def _register_k(config: MosaicAttentionConfig, k_side: SideSpec, head_dim: int, dtype) -> bool:
  """Whether K takes the register-dequant path (`MosaicAttentionConfig.register_k`)."""
  return (config.register_k and k_side.axis == "channel"
          and _dequant_codes_fit(config, k_side, head_dim, dtype))


def _register_v(config: MosaicAttentionConfig, v_side: SideSpec, head_dim: int, dtype) -> bool:
  """Whether V takes the register-dequant path (`MosaicAttentionConfig.register_v`)."""
  return (config.register_v and config.fold_scales and v_side.group == head_dim
          and _dequant_codes_fit(config, v_side, head_dim, dtype))


def _register_vt(config: MosaicAttentionConfig, v_side: SideSpec, head_dim: int, dtype) -> bool:
  """Whether V is the value MMA's register operand (`MosaicAttentionConfig.register_vt`)."""
  return (config.register_vt and v_side.bits in (4, 2) and head_dim == 128
          and _register_v(config, v_side, head_dim, dtype))


def partials_type(batch: int, kv_heads: int, parts: int, head_dim: int, n_pv: int,
                  n_rows: int) -> list:
  """Output types of the tokens-on-M kernels, flat over (sequence, kv head,
  part) like their inputs (`head_rows`): ``o^T [B * H * parts, D, N_pv]``
  (``n_pv``: the value MMA's columns, or ``N`` for narrow partials),
  ``l, m [B * H * parts, N]`` (float32); `unflatten_partials` gives them
  their ``[B, H, parts, ...]`` shape."""
  f32 = jnp.float32
  rows = batch * kv_heads * parts
  return [jax.ShapeDtypeStruct((rows, head_dim, n_pv), f32),
          jax.ShapeDtypeStruct((rows, n_rows), f32),
          jax.ShapeDtypeStruct((rows, n_rows), f32)]


def unflatten_partials(parts, batch: int, kv_heads: int) -> list:
  """The kernels' flat partials (`partials_type`) as ``[B, H, parts, ...]`` (free)."""
  return [x.reshape(batch, kv_heads, -1, *x.shape[1:]) for x in parts]


def _tokens_m_call(qh, q_res, k_in, v_in, k_residual, v_residual, lengths, *, k_side, v_side,
                   token_group, residual, num_queries, q_rows, config, dtype, row0, vq=None,
                   skip_tokens: int = 0, plane_block: int = 0, target_view: bool = False,
                   log2: bool = False):
  """The v2 kernel; returns partials ``o [B,H,P,D,N_pv]`` (``[..., N]`` with
  ``config.narrow_partials``), ``l, m [B,H,P,N]``
  (``P = J + R / block_k``: the splits', then the residual tiles', `residual_parts`).

  ``skip_tokens``: packed tokens left to the caller (`_split_blocks`).
  ``plane_block``: the code inputs are plane-blocked rows ``[., 2C, D/2]``
  (`mosaic_decode_attention`); the tiles read the upper planes, and with
  ``target_view`` the lower planes too (each side's inputs ``[codes, codes,
  scale, zero]``, the tiles ``(upper, lower, scale, zero)``): K's 8-bit codes
  joined in registers with ``scale / 16`` and ``zero - scale / 2``
  (`mosaic_dequant.dequant_codes`' ``lower_smem``), V's joined codes as the
  value MMA's operand with the same affine folded into P.

  ``row0``: ``[1]`` int32, the cache arrays' row of sequence 0 (`stacked_rows`).

  ``log2``: ``qh`` and ``q_res`` carry ``log2(e)`` (`MosaicAttentionConfig.log2_scores`).

  ``qh`` is what the packed programs multiply K by (channels permuted with
  `register_k` or ``vq``), ``q_res`` what the residual program does (channel
  order).

  ``vq``: ``((k_vector, k_entries, k_book), (v_vector, v_entries, v_book))``
  for a one-stage VQ cache (``k_in = [codes]``, ``v_in = [codes]``, each book
  the `mosaic_dequant.vq_book_rows` image ``[H, D E / 128, 128]`` in ``dtype``;
  ``k_side``/``v_side`` are then ignored): each packed program copies its kv head's two codebooks into
  shared memory once and `mosaic_dequant.gather_codebook` builds the K operand
  and the V tile from them; the packed outputs come out in
  `mosaic_dequant.vq_permutation` order.
  N (q's padded rows) is the score MMA's N and the softmax's width; the value
  MMA takes ``N_pv = max(N, 16)`` columns (its smem operands need rows of >=
  32 bytes), the extra columns of ``P^T`` zero, so ``o``'s extra columns are
  zero too.
  """
  batch, kv_heads, n_rows, head_dim = qh.shape
  n_pv = max(n_rows, 16)
  n_out = n_rows if config.narrow_partials else n_pv   # o^T partial's columns
  bk = config.block_k
  num_splits = config.num_splits
  grid_j = num_splits + residual_parts(residual, bk)
  f32 = jnp.float32
  # Shared-memory tiles. q (the B operand of the score MMA, read K-major) is
  # tiled by K's plane width; V tiles and P^T (A and B of the value MMA, one
  # swizzle for both) are tiled by N.
  kw = _plane_width(k_side, head_dim)
  q_tf = _tiled(min(kw, 64), 16)
  v_tf = _tiled(n_pv, 16)

  if vq is not None:
    register_k = register_v = register_vt = fold_k = fold_v = False
    k_specs = [plgpu.BlockSpec((bk, k_in[0].shape[-1]), lambda i: (i, 0))]
    v_specs = [plgpu.BlockSpec((bk, v_in[0].shape[-1]), lambda i: (i, 0))]
    (k_vec, k_entries, k_book), (v_vec, v_entries, v_book) = vq
    books = [k_book, v_book]
  else:
    register_k = _register_k(config, k_side, head_dim, dtype)
    register_v = _register_v(config, v_side, head_dim, dtype)
    register_vt = _register_vt(config, v_side, head_dim, dtype)
    # Code tiles are D bits/8 bytes of each row (a hierarchical cache's draft
    # view: its upper-plane rows, `plane_block`).
    k_width = _code_width(k_side, head_dim, k_in[0])
    v_width = _code_width(v_side, head_dim, v_in[0])
    # the register paths read wide rows (`MosaicAttentionConfig.wide_rows`)
    wide_k = config.wide_rows and register_k and mosaic_dequant.fits_wide_row(k_width)
    wide_v = config.wide_rows and register_v and mosaic_dequant.fits_wide_row(v_width)
    k_specs = _side_specs(k_side, k_width, head_dim, bk, q_tf, plain_codes=register_k,
                          plane_block=plane_block, wide=wide_k, lower=target_view)
    # register_vt reads rows with ldmatrix: TMA-swizzled (by row width) or plain tiles
    v_specs = _side_specs(v_side, v_width, head_dim, bk, v_tf,
                          plain_codes=register_v and not (register_vt and config.vt_swizzle),
                          plane_block=plane_block, wide=wide_v, lower=target_view)
    k_in = [wide_view(k_in[0]) if wide_k else k_in[0], *k_in[1:]]
    v_in = [wide_view(v_in[0]) if wide_v else v_in[0], *v_in[1:]]
    if target_view:  # the same codes twice: upper- and lower-plane tiles
      k_in, v_in = [k_in[0], *k_in], [v_in[0], *v_in]
    fold_k = config.fold_scales and k_side.bits < 16 and k_side.axis == "token"
    fold_v = config.fold_scales and v_side.bits < 16
    books = []
  sub_k = register_k and config.subnormal_k    # q times 2**K_SHIFT (exact in bf16)
  sub_v = register_vt and config.subnormal_v   # P times 2**P_SHIFT, O^T times 2**-53
  bytes_k = sub_k and config.byte_masks        # codes masked in place in their bytes
  bytes_v = sub_v and config.byte_masks        # (V rows with half = 1: times 2**bits)
  # K's scale and zero in the score MMA's B operands (q stays unscaled)
  fold_kq = (bytes_k and config.k_scale_in_q and head_dim == 128 and n_rows in (8, 16)
             and not target_view)
  slots = 4 if target_view else 3  # inputs per side: codes (, lower planes), scale, zero
  if sub_k and not fold_kq:  # the K registers are (c s + z) 2**-K_SHIFT
    qh = qh * jnp.asarray(2.0 ** mosaic_dequant.K_SHIFT, qh.dtype)
  q_tiling = (q_tf[0].tiling[1], q_tf[1].swizzle)
  nk, nv = len(k_specs), len(v_specs)
  packed_unmasked = config.edge_masks and unmasked_packed_steps(num_queries, token_group,
                                                                residual, bk)

  def attend(q_smem, k_tiles, v_tiles, pt_smem, vdq_smem, carry, *, token0, valid_below,
             row_limit, q_sum, masked=True, book_smems=None, flag_smem=None,
             fold_smems=None):
    """One online-softmax step over ``bk`` tokens (tokens on M).

    Folded scales (``config.fold_scales``): a per-token K side is applied to the
    scores (``S^T = (C q^T) * s_t + z_t * sum(q)``), the V side to ``P`` (``O^T +=
    C^T (P * s_t)^T``, and ``sum_t p * z_t`` kept per column), so those codes
    need no per-element affine.
    """
    acc, m_i, l_i, z_i = carry
    packed_k = isinstance(k_tiles, tuple)
    packed_v = isinstance(v_tiles, tuple)
    early_v = config.early_v and packed_v and (vq is not None or register_v)

    def v_values():  # the step's V tile in registers (register_v / VQ paths)
      if register_vt:  # [D, bk]: the value MMA's A operand itself
        return mosaic_dequant.dequant_codes_t(v_tiles[0], head_dim, v_side.bits,
                                              swizzle=v_tiles[0].shape[-1] if config.vt_swizzle
                                              else 0,
                                              subnormal=sub_v, byte_masks=bytes_v,
                                              lower_smem=v_tiles[1] if target_view else None)
      if vq is not None:
        return mosaic_dequant.gather_codebook(v_tiles[0], book_smems[1], head_dim, v_vec,
                                              v_entries)
      return mosaic_dequant.dequant_codes(v_tiles[0], head_dim, v_side.bits)

    def scores(acc_ref):
      if not packed_k:  # full-precision K tile in smem
        plgpu.wgmma(acc_ref, k_tiles, _t(q_smem))
      elif vq is not None:  # centroids of the codes, channels in vq_permutation order
        x = mosaic_dequant.gather_codebook(k_tiles[0], book_smems[0], head_dim, k_vec,
                                           k_entries)
        plgpu.wgmma(acc_ref, x, _t(q_smem))
      elif register_k and fold_smems is not None:
        # codes only; q * scale and the zero term are the B operands (written here)
        qsrc_smem, bias_smem = fold_smems
        mosaic_dequant.fold_k_operands(qsrc_smem, k_tiles[1], k_tiles[2], q_smem, bias_smem,
                                       bits=k_side.bits, q_tiling=q_tiling)
        x = mosaic_dequant.dequant_codes(k_tiles[0], head_dim, k_side.bits, subnormal=True,
                                         byte_masks=True)
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, x, _t(q_smem))
        ones = plgpu.layout_cast(
            jnp.full((bk, mosaic_dequant.FOLD_BIAS_COLUMNS), 1.0, jnp.bfloat16),
            plgpu.Layout.WGMMA)
        plgpu.wgmma(acc_ref, ones, _t(bias_smem))
      elif register_k:
        # code * scale + zero in registers; the scale/zero rows stay in channel order
        x = mosaic_dequant.dequant_codes(k_tiles[0], head_dim, k_side.bits, k_tiles[-2],
                                         k_tiles[-1], subnormal=sub_k, byte_masks=bytes_k,
                                         shuffle_scales=config.shuffle_scales,
                                         lower_smem=k_tiles[1] if target_view else None)
        plgpu.wgmma(acc_ref, x, _t(q_smem))
      else:
        for c0, x in _dequant_planes(*k_tiles, k_side, head_dim, dtype, affine=not fold_k):
          q_plane = q_smem.at[:, pl.ds(c0, kw)]
          plgpu.wgmma(acc_ref, x, _t(q_plane))
      vt = None
      if early_v and register_vt:  # while the MMA runs: the value MMA's registers
        vt = v_values()
      elif early_v:  # while the MMA runs (the last step's value MMA has finished)
        vdq_smem[...] = v_values()
      return acc_ref[...], vt

    s, vt = pl.run_scoped(scores, plgpu.ACC((bk, n_rows), f32))   # [bk, N]
    if packed_k and fold_smems is not None:  # the folded MMAs' 2**-FOLD_SHIFT
      s = s * (2.0 ** mosaic_dequant.FOLD_SHIFT)
    if packed_k and fold_k:
      ksc, kzr = _token_affine(k_tiles[1], k_tiles[2])
      s = (s * lax.broadcast_in_dim(ksc, s.shape, [0])
           + lax.broadcast_in_dim(kzr, s.shape, [0]) * lax.broadcast_in_dim(q_sum, s.shape, [1]))
    def rescale(state, alpha):  # o, l and the zero sums to a new reference
      acc, l_i, z_i = state
      alpha_b = lax.broadcast_in_dim(alpha, l_i.shape, [1])
      return (acc * mosaic_dequant.widen_columns(
          lax.broadcast_in_dim(alpha, (head_dim, n_rows), [1]), n_pv, 1.0),
              l_i * alpha_b, z_i * alpha_b)

    lazy = config.lazy_rescale  # rescaled in the exact branch only
    p, m_new, out = masked_softmax(
        s, m_i, token0=token0, valid_below=valid_below, row_limit=row_limit,
        colmax=lambda x: x.max(axis=0), flag_smem=flag_smem if config.lazy_max else None,
        masked=masked, state=(acc, l_i, z_i) if lazy else None,
        rescale=rescale if lazy else None, guards=config.unmasked_guards, log2=log2)
    acc, l_i, z_i = out if lazy else rescale((acc, l_i, z_i), out)     # out: alpha if not lazy
    l_i = l_i + p                                              # row sums deferred
    if packed_v and fold_v:
      vsc, vzr = _token_affine(v_tiles[-2], v_tiles[-1])
      if target_view:  # the joined codes' affine: scale / 16, zero - scale / 2
        vzr, vsc = vzr - 0.5 * vsc, vsc * (1.0 / 16.0)
      z_i = z_i + p * lax.broadcast_in_dim(vzr, p.shape, [0])
      if sub_v:  # subnormal V codes: P carries 2**P_SHIFT
        vsc = vsc * (2.0 ** mosaic_dequant.P_SHIFT)
      p = p * lax.broadcast_in_dim(vsc, p.shape, [0])
    pt_smem[...] = mosaic_dequant.widen_columns(p.astype(dtype), n_pv)
    if packed_v and register_vt:  # exact codes, [D, bk] in registers, `vt_permutation` rows
      v_op = vt if early_v else v_values()
    elif packed_v:
      if vq is not None or register_v:  # register_v: exact codes, `code_permutation` order
        if not early_v:
          vdq_smem[...] = v_values()
      else:
        for c0, x in _dequant_planes(*v_tiles, v_side, head_dim, dtype, affine=not fold_v):
          vdq_smem[:, pl.ds(c0, x.shape[1])] = x
      v_op = _t(vdq_smem)
    else:
      v_op = _t(v_tiles)
    plgpu.commit_smem()

    def pv(acc_ref):
      plgpu.wgmma(acc_ref, v_op, pt_smem)

    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    return acc, m_new, l_i, z_i

  def kernel(lengths_gmem, row0_gmem, q_gmem, *refs):
    # sum(q) per query row only when a per-token K side folds its zero point
    if fold_k:
      qsum_gmem, qres_gmem, *refs = refs
    else:
      qsum_gmem, (qres_gmem, *refs) = None, refs
    k_refs, v_refs = refs[:slots], refs[slots:2 * slots]
    kres_gmem, vres_gmem = refs[2 * slots:2 * slots + 2]
    book_gmems, refs = refs[2 * slots + 2:2 * slots + 2 + len(books)], refs[
        2 * slots + 2 + len(books):]
    o_gmem, l_gmem, m_gmem = refs[:3]
    q_smem, pt_smem, flag_smem, barrier, *fold_smems = refs[3:]
    fold_smems = tuple(fold_smems) if fold_kq else None
    # Query rows are the columns of the [bk, N] score tiles here.
    bh, cb, h, j, length, packed, row_limit = _program_start(
        lengths_gmem, row0_gmem, q_gmem, q_smem, barrier, kv_heads=kv_heads,
        token_group=token_group,
        residual=residual, num_queries=num_queries, q_rows=q_rows, rows=n_rows,
        row_layout=plgpu.Layout.WGMMA.reduce(0))

    acc0 = plgpu.layout_cast(jnp.zeros((head_dim, n_pv), f32), plgpu.Layout.WGMMA)
    m0 = plgpu.layout_cast(jnp.full((n_rows,), -jnp.inf, f32), plgpu.Layout.WGMMA.reduce(0))
    l0 = plgpu.layout_cast(jnp.zeros((bk, n_rows), f32), plgpu.Layout.WGMMA)
    q_sum = (_load(qsum_gmem.at[bh], layout=plgpu.Layout.WGMMA.reduce(0),
                   optimized=False)
             if fold_k else None)

    def finish(carry, acc_shift=0):
      acc, m_i, l_i, z_i = carry
      if acc_shift and bytes_v:  # ... and the byte-masked rows' 2**bits
        acc = mosaic_dequant.scale_halves(acc, 2.0 ** acc_shift,
                                          2.0 ** (acc_shift - v_side.bits))
      elif acc_shift:  # the subnormal V path's product, back to scale
        acc = acc * (2.0 ** acc_shift)
      if fold_v:  # + sum_t p_t * zero_t on every channel
        acc = acc + mosaic_dequant.widen_columns(
            lax.broadcast_in_dim(z_i.sum(axis=0), (head_dim, n_rows), [1]), n_pv)
      l_sum = l_i.sum(axis=0)

      # Scoped after the pipeline's (or the residual tile's) scope has closed,
      # so the output tiles reuse that shared memory: with lean barriers every
      # warp must be past its MMAs on it first (a warp's wgmma wait covers its
      # own part of an MMA only; the packed steps end on a barrier, the
      # residual tile does not).
      if config.lean_barriers:
        mosaic_dequant.warpgroup_barrier()

      out = acc[:, :n_out] if n_out < n_pv else acc   # whole 8-column register tiles

      def write(o_smem, lm_smem):
        _write_partials(out, l_sum, m_i, o_smem, lm_smem, o_gmem, l_gmem, m_gmem,
                        bh * grid_j + j, log2=log2)

      pl.run_scoped(write, plgpu.SMEM((head_dim, n_out), f32), plgpu.SMEM((2, n_rows), f32))

    # The V value tile ([bk, D], dtype) is scoped per branch: the packed
    # programs need none with register_vt or a 16-bit V side.
    vdq_type = plgpu.SMEM((bk, head_dim), dtype, transforms=v_tf)
    packed_vdq = vq is not None or (v_side.bits < 16 and not register_vt)

    @pl.when(j < num_splits)
    def _packed():
      def run(*scoped):
        book_smems = scoped[:len(books)]
        vdq_smem = scoped[len(books)] if packed_vdq else None
        if fold_kq:  # q (column order) kept apart: q_smem takes q * scale each step
          plgpu.copy_gmem_to_smem(q_gmem.at[bh], fold_smems[0], barrier)
          plgpu.barrier_wait(barrier)
        for g, sm in zip(book_gmems, book_smems):  # a VQ head's codebooks, once
          plgpu.copy_gmem_to_smem(g.at[h], sm, barrier)
          plgpu.barrier_wait(barrier)

        def step(tiles, carry, token0):
          kt, vt = tiles[:nk], tiles[nk:]
          k_tiles = kt[0] if vq is None and k_side.bits == 16 else tuple(kt)
          v_tiles = vt[0] if vq is None and v_side.bits == 16 else tuple(vt)
          return attend(q_smem, k_tiles, v_tiles, pt_smem, vdq_smem, carry, token0=token0,
                        fold_smems=fold_smems,
                        valid_below=packed, row_limit=row_limit, q_sum=q_sum,
                        masked=not packed_unmasked,
                        book_smems=book_smems, flag_smem=flag_smem)

        gm = [r.at[cb] for r in k_refs[:nk]] + [r.at[cb] for r in v_refs[:nv]]
        return _run_split(mosaic_dequant.release_stages(step, config.lean_barriers),
                          k_specs + v_specs, gm, packed=packed, j=j,
                          num_splits=num_splits, bk=bk,
                          max_concurrent_steps=config.max_concurrent_steps,
                          init_carry=(acc0, m0, l0, l0), skip=skip_tokens)

      scoped = [plgpu.SMEM(book.shape[1:], dtype) for book in books]
      scoped += [vdq_type] if packed_vdq else []
      finish(pl.run_scoped(run, *scoped) if scoped else run(),
             acc_shift=mosaic_dequant.SUBNORMAL_EXP - mosaic_dequant.P_SHIFT if sub_v else 0)

    @pl.when(j >= num_splits)
    def _residual():  # tile j - num_splits of the residual block (`residual_parts`)
      num_res = length - packed
      r0 = pl.multiple_of((j - num_splits) * bk, bk)
      if register_k or vq is not None:  # the residual's K rows are in channel order
        plgpu.copy_gmem_to_smem(qres_gmem.at[bh], q_smem, barrier)
        plgpu.barrier_wait(barrier)

      # The residual K and V tiles live in this branch's scope only (the packed
      # programs' pipeline buffers take the same shared memory).
      def attend_residual(kres_smem, vdq_smem):
        plgpu.copy_gmem_to_smem(kres_gmem.at[cb, pl.ds(r0, bk)], kres_smem, barrier)
        plgpu.barrier_wait(barrier)
        plgpu.copy_gmem_to_smem(vres_gmem.at[cb, pl.ds(r0, bk)], vdq_smem, barrier)
        plgpu.barrier_wait(barrier)
        # Residual row r holds token packed + r.
        return attend(q_smem, kres_smem, vdq_smem, pt_smem, vdq_smem, (acc0, m0, l0, l0),
                      token0=packed + r0, valid_below=packed + num_res,
                      row_limit=row_limit, q_sum=q_sum, flag_smem=flag_smem)

      finish(pl.run_scoped(attend_residual, plgpu.SMEM((bk, head_dim), dtype, transforms=q_tf),
                           vdq_type))

  k_in = list(k_in) + [k_in[0]] * (slots - len(k_in))  # unused slots repeat the codes
  v_in = list(v_in) + [v_in[0]] * (slots - len(v_in))
  scratch = [
      plgpu.SMEM((n_rows, head_dim), dtype, transforms=q_tf),     # q
      plgpu.SMEM((bk, n_pv), dtype, transforms=v_tf),             # P^T
      plgpu.SMEM((1,), jnp.int32),                                # lazy-max flag
      plgpu.Barrier(),
      *([plgpu.SMEM((n_rows, head_dim), dtype, transforms=q_tf),  # q kept apart (fold)
         plgpu.SMEM((n_rows, mosaic_dequant.FOLD_BIAS_COLUMNS), jnp.bfloat16,
                    transforms=_tiled(mosaic_dequant.FOLD_BIAS_COLUMNS, 16))]
        if fold_kq else []),
      # the V value tile, the residual K tile and o^T, l, m are scoped (see the kernel)
  ]
  return unflatten_partials(plgpu.kernel(
      kernel,
      out_type=partials_type(batch, kv_heads, grid_j, head_dim, n_out, n_rows),
      grid=(batch, kv_heads, grid_j),
      grid_names=("b", "h", "j"),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=_SEMANTICS,
                                           unsafe_no_auto_barriers=config.lean_barriers),
      kernel_name=(f"jaxkv_mosaic_tokens_m_attention_k{k_side.bits}v{v_side.bits}"
                   f"{'_target' if target_view else ''}" if vq is None
                   else f"jaxkv_mosaic_vq_attention_k{k_vec}v{v_vec}"),
  )(lengths, row0, *head_rows([qh, *([jnp.sum(qh.astype(f32), axis=-1)] if fold_k else []),
                               q_res, *k_in, *v_in, k_residual, v_residual]), *books),
      batch, kv_heads)
