"""Log-sum-exp merge of transposed split partials in one kernel (Pallas Triton).

The Mosaic family (`mosaic_attention.py`) computes ``O^T`` per split: its
partials are ``o_t [B, H, J, D, N]`` (channels on rows, query rows on
columns; the value MMA's N may be wider than the query rows), ``l, m
[B, H, J, N]``. Merging them with jnp costs four small XLA kernels and a
transpose; this kernel reads ``o_t`` as it is and writes the normalized
``[B, H, M, D]`` output in one launch, like the Triton family's
``jaxkv_decode_combine``.

With ``qh`` (the split kernel's own query rows) and ``seq_bad`` the kernel
also applies the input policy's poison (README "Input policy"): a query row
holding a NaN/inf, or every row of a flagged sequence, comes out NaN
(`_triton.query_row_flags`). The flags cost no XLA kernel of their own (two
per call and layer when computed apart, `_triton.nonfinite_query_rows`: ~2.8
us per layer of a B = 1 decode step on an H200), and reading the kernel's
input rather than q leaves q one consumer, the query preparation, which its
producer (RoPE in the model) can fuse into; reading q itself, as this kernel
did before, q had to be written out by a kernel of its own (1.2-1.4 us per
layer in the H100 step anatomy of 2026-11-28). (``stage`` reads q again: the
staged scores are float32 sums over the unrounded queries.)

``packed_rows`` (optional, ``[D]`` ints) says where channel ``c`` sits in the
rows of every partial but the last ``plain_tail`` (default 1): the register V
path of the Mosaic kernel leaves the packed splits' rows in the MMA's column
order, while the residual program's partials are in channel order (one
partial, or one per compute warpgroup). The kernel gathers the
rows per partial, so neither a permuted copy of the partials nor of the
output is made.

With ``stage`` (speculative decoding's staged tokens, `jaxkv.staged_cache`)
the kernel also attends a few full-precision rows exactly and merges them as
one more softmax block: query row ``r = s G + g`` (the folded queries of
`jaxkv.staged_cache`: ``S`` queries of ``G`` heads per kv head) sees staged
row ``p`` iff ``p <= staged - S + s``. The scores are float32 sums of
products over the head dim (no tensor-core rounding); each program computes
them for its (batch, kv head) whole and applies them to its channel block.
In XLA the staged rows and their log-sum-exp merge cost ~8 small kernels per
layer and call (`bench/results/speculative-NOTES.md`).

Semantics match the jnp reference `combine_t_reference`: a query row with no
visible key (``l == 0``) gives zeros; a NaN ``l`` stays NaN.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _triton

_BUDGET = 8192  # float32 elements of one [J', dblk, M] tile per program
_MIN_PROGRAMS = 64  # channel blocks split further until this many programs run
_STAGE_BUDGET = 4096  # float32 products per step of the staged scores' sum


def _stage_partials(stage, rows: int):
  """jnp: the staged rows' scaled scores ``[B, H, P, rows]`` (``-inf`` where not
  visible), their V ``[B, H, P, D]`` (float32) and ``[B]`` whether a row ``p <
  staged`` holds a NaN/inf (`combine_t`'s ``stage``)."""
  q, k, v, staged, scale, num_queries = stage
  batch, heads, q_rows, _ = q.shape
  group = q_rows // num_queries
  r = jnp.arange(rows)
  p = jnp.arange(k.shape[1])
  qf = jnp.zeros((batch, heads, rows, q.shape[-1]), jnp.float32).at[:, :, :q_rows].set(
      q.astype(jnp.float32))
  sc = jnp.einsum("bhrd,bphd->bhpr", qf, k.astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST) * jnp.asarray(scale, jnp.float32)
  limit = staged[:, None] - num_queries + r[None, :] // group                 # [B, rows]
  vis = (p[None, :, None] <= limit[:, None, :]) & (r < q_rows)[None, None, :]  # [B, P, rows]
  sc = jnp.where(vis[:, None], sc, -jnp.inf)
  here = (p[None, :] < staged[:, None])[:, :, None, None]                       # [B, P, 1, 1]
  bad = jnp.any(here & ~(jnp.isfinite(k) & jnp.isfinite(v)), axis=(1, 2, 3))    # [B]
  v = jnp.where(here, v.astype(jnp.float32), 0.0)  # rows past the staged count: never read
  return sc, jnp.swapaxes(v, 1, 2), bad


def combine_t_reference(o_t, l, m, *, rows: int, packed_rows=None, out_dtype=jnp.float32,
                        plain_tail: int = 1, stage=None):
  """jnp oracle: ``o_t [B,H,J,D,N], l/m [B,H,J,N]`` (and ``stage``, as `combine_t`'s)
  -> ``[B, H, rows, D]``."""
  o_t = o_t[..., :rows].astype(jnp.float32)
  l, m = l[..., :rows], m[..., :rows]
  if packed_rows is not None:
    idx = np.asarray(packed_rows)
    o_t = jnp.concatenate([o_t[:, :, :-plain_tail][:, :, :, idx], o_t[:, :, -plain_tail:]],
                          axis=2)
  stage_bad = None
  if stage is not None:  # each staged row: one more partial (l = 1, m = its score, o = v)
    sc, vs, stage_bad = _stage_partials(stage, rows)           # [B, H, P, M], [B, H, P, D]
    o_t = jnp.concatenate([o_t, jnp.broadcast_to(vs[..., None], (*vs.shape, rows))], axis=2)
    l = jnp.concatenate([l, jnp.where(sc == -jnp.inf, 0.0, 1.0)], axis=2)
    m = jnp.concatenate([m, sc], axis=2)
  m_max = jnp.max(m, axis=2, keepdims=True)
  m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
  w = jnp.exp(m - m_max)                                       # [B, H, J, M]
  num = jnp.einsum("bhjm,bhjdm->bhmd", w, o_t)
  den = jnp.sum(w * l, axis=2)                                 # [B, H, M]
  safe = jnp.where(den == 0, 1.0, den)
  out = jnp.where((den == 0)[..., None], 0.0, num / safe[..., None])
  if stage_bad is not None:
    out = jnp.where(stage_bad[:, None, None, None], jnp.nan, out)
  return out.astype(out_dtype)


def _stage_chunk(stage_pad: int, rows: int, head_dim: int) -> int:
  """Head-dim channels per step of the staged scores' sum (a power of two)."""
  chunk = head_dim
  while chunk > 1 and stage_pad * rows * chunk > _STAGE_BUDGET:
    chunk //= 2
  return chunk


def _staged_scores(qs_ref, ks_ref, vs_ref, scale_ref, staged_ref, *, rows, stage_pad,
                   head_dim, stage):
  """``[P', M]`` float32 scaled scores of the staged rows (``-inf`` where not
  visible), ``[P', 1]`` which rows are staged (``p < staged``; no other row is
  read), and whether one of them (any kv head) holds a NaN/inf; ``qs_ref [R *
  D]`` holds this kv head's folded queries, ``ks_ref, vs_ref [P * H * D]`` the
  sequence's staged K and V."""
  num_queries, q_rows, n_stage, heads = stage
  h, staged = pl.program_id(1), staged_ref[()]
  chunk = _stage_chunk(stage_pad, rows, head_dim)
  p = jax.lax.broadcasted_iota(jnp.int32, (stage_pad, 1, 1), 0)         # [P', 1, 1]
  r = jax.lax.broadcasted_iota(jnp.int32, (1, rows, 1), 1)              # [1, M, 1]
  c = jax.lax.broadcasted_iota(jnp.int32, (1, 1, chunk), 2)             # [1, 1, C]
  have_p, live_r = (p < n_stage) & (p < staged), r < q_rows
  sc = jnp.zeros((stage_pad, rows), jnp.float32)
  for c0 in range(0, head_dim, chunk):  # float32 products, summed per chunk
    k = plt.load(ks_ref.at[(p * heads + h) * head_dim + c0 + c],
                 mask=jnp.broadcast_to(have_p, (stage_pad, 1, chunk)), other=0.0)
    q = plt.load(qs_ref.at[r * head_dim + c0 + c],
                 mask=jnp.broadcast_to(live_r, (1, rows, chunk)), other=0.0)
    sc = sc + jnp.sum(k.astype(jnp.float32) * q.astype(jnp.float32), axis=2)
  limit = staged - num_queries + r[:, :, 0] // (q_rows // num_queries)  # [1, M]
  vis = have_p[:, :, 0] & (p[:, :, 0] <= limit) & live_r[:, :, 0]       # [P', M]
  # the staged rows' input policy: a NaN/inf in any kv head's K or V row poisons
  # the sequence (|x| <= max is False exactly for NaN and +-inf)
  pp = jax.lax.broadcasted_iota(jnp.int32, (stage_pad, 1), 0)           # [P', 1]
  cc = jax.lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)            # [1, D]
  rows_here = jnp.broadcast_to(have_p[:, :, 0], (stage_pad, head_dim))
  finite = jnp.ones((stage_pad, head_dim), jnp.bool_)
  for hh in range(heads):  # unrolled: the loads issue together (a loop ran them serially)
    for ref in (ks_ref, vs_ref):
      x = plt.load(ref.at[(pp * heads + hh) * head_dim + cc], mask=rows_here, other=0.0)
      finite = finite & (jnp.abs(x.astype(jnp.float32)) <= jnp.finfo(jnp.float32).max)
  bad = jnp.min(finite.astype(jnp.int32)) == 0
  return jnp.where(vis, sc * scale_ref[()], -jnp.inf), have_p[:, :, 0], bad


def _kernel(o_ref, l_ref, m_ref, rows_ref, *refs, num_parts, parts_pad, dblk, rows, width,
            permuted, plain_tail, query, stage, stage_pad, head_dim):
  """One (batch, kv head, channel block): all partials at once, gathered rows;
  with ``query`` (the real query rows; refs: ``qh_ref, seq_bad_ref``) the rows
  `_triton.query_row_flags` finds are NaN; with ``stage`` (``(S, R, P, H)``;
  refs ``qs_ref, ks_ref, vs_ref, scale_ref, staged_ref``) the staged rows are
  merged too. The last ref is the output."""
  refs = list(refs)
  out_ref = refs.pop()
  if query is not None:
    qh_ref, seq_bad_ref = refs[:2]
    flags = _triton.query_row_flags(qh_ref, seq_bad_ref, rows=rows, q_rows=query)
  d0 = pl.program_id(2) * dblk
  part = jax.lax.broadcasted_iota(jnp.int32, (parts_pad, 1), 0)           # [J', 1]
  live = part < num_parts
  col = jax.lax.broadcasted_iota(jnp.int32, (1, rows), 1)                 # [1, M]
  live_m = jnp.broadcast_to(live, (parts_pad, rows))
  m = plt.load(m_ref.at[part, col], mask=live_m, other=-jnp.inf)         # [J', M]
  l = plt.load(l_ref.at[part, col], mask=live_m, other=0.0)
  m_max = jnp.max(m, axis=0)                                             # [M]
  if stage is not None:
    qs_ref, ks_ref, vs_ref, scale_ref, staged_ref = refs[-5:]
    sc, have_p, stage_bad = _staged_scores(qs_ref, ks_ref, vs_ref, scale_ref, staged_ref,
                                           rows=rows, stage_pad=stage_pad, head_dim=head_dim,
                                           stage=stage)                             # [P', M]
    m_max = jnp.maximum(m_max, jnp.max(sc, axis=0))
  m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
  w = jnp.exp(m - m_max[None, :])                                        # [J', M]
  den = jnp.sum(w * l, axis=0)                                           # [M]

  chan = d0 + jax.lax.broadcasted_iota(jnp.int32, (1, dblk), 1)          # [1, dblk]
  if permuted:  # packed partials: channel c at row packed_rows[c]; the tail in order
    packed = rows_ref[pl.ds(d0, dblk)][None, :]                          # [1, dblk]
    row = jnp.where(part >= num_parts - plain_tail, chan, packed)        # [J', dblk]
  else:
    row = jnp.broadcast_to(chan, (parts_pad, dblk))
  flat = (row[:, :, None] * width
          + jax.lax.broadcasted_iota(jnp.int32, (1, 1, rows), 2))        # [J', dblk, M]
  flat = flat.reshape(parts_pad, dblk * rows)
  o = plt.load(o_ref.at[part, flat], mask=jnp.broadcast_to(live, flat.shape),
               other=0.0)                                                # [J', dblk*M]
  o = o.reshape(parts_pad, dblk, rows)
  num = jnp.sum(w[:, None, :] * o, axis=0)                               # [dblk, M]
  if stage is not None:  # each staged row: weight exp(score - max), value its V row
    w_s = jnp.exp(sc - m_max[None, :])                                   # [P', M], 0 if hidden
    den = den + jnp.sum(w_s, axis=0)
    p = jax.lax.broadcasted_iota(jnp.int32, (stage_pad, 1), 0)
    heads = stage[-1]
    # rows past the staged count are not read (a stale inf there times 0 is NaN)
    v = plt.load(vs_ref.at[(p * heads + pl.program_id(1)) * head_dim + chan],
                 mask=jnp.broadcast_to(have_p, (stage_pad, dblk)), other=0.0)  # [P', dblk]
    num = num + jnp.sum(v.astype(jnp.float32)[:, :, None] * w_s[:, None, :], axis=0)
  safe = jnp.where(den == 0, 1.0, den)
  out = jnp.where((den == 0)[None, :], 0.0, num / safe[None, :])
  if query is not None:
    out = jnp.where(flags[None, :], jnp.nan, out)
  if stage is not None:
    out = jnp.where(stage_bad, jnp.nan, out)
  out_ref[...] = out.T.astype(out_ref.dtype)                             # [M, dblk]


def combine_t(o_t: jax.Array, l: jax.Array, m: jax.Array, *, rows: int, packed_rows=None,
              out_dtype=jnp.float32, interpret: bool = False, plain_tail: int = 1,
              qh=None, q_rows: int | None = None, seq_bad=None, stage=None) -> jax.Array:
  """Merge ``o_t [B,H,J,D,N], l/m [B,H,J,N']`` over J into ``[B, H, rows, D]``.

  ``rows`` (a power of two <= N) query rows are merged; ``packed_rows`` see the
  module docstring. The last ``plain_tail`` partials are always read in
  channel order. ``qh [B, H, N', D]`` with ``q_rows`` (and ``seq_bad [B]``
  bool, optional): the split kernel's own query rows (``r < q_rows`` real,
  ``N' >= rows``, scaled by any scale > 0); rows holding a NaN/inf and every
  row of a flagged sequence come out NaN, computed in the kernel.
  ``stage``: ``(q, k, v, staged, scale, S)``: staged rows attended exactly and
  merged (module docstring): ``q [B, H, R, D]`` the folded queries in channel
  order, unscaled (``R = S G <= rows``), ``k, v [B, P, H, D]`` the staged K/V,
  ``staged [B]`` ints (row ``r`` sees staged rows ``p <= staged - S + r // G``),
  ``scale`` the softmax scale (a real or a scalar array), ``S`` an int. A
  NaN/inf in a staged K or V row ``p < staged`` of any kv head makes the
  whole sequence NaN (the input policy, as ``seq_bad``).
  """
  batch, heads, num_parts, head_dim, width = o_t.shape
  if not 1 <= plain_tail <= num_parts:
    raise ValueError(f"plain_tail={plain_tail} must be in [1, {num_parts}] partials")
  if rows & (rows - 1) or rows > width or rows > l.shape[-1]:
    raise ValueError(f"rows={rows} must be a power of two <= N={width} and <= l's "
                     f"{l.shape[-1]} columns")
  if l.shape[:3] != (batch, heads, num_parts) or m.shape != l.shape:
    raise ValueError(f"l {l.shape} and m {m.shape} must be {(batch, heads, num_parts)} + (N',)")
  permuted = packed_rows is not None
  if permuted:
    packed_rows = np.asarray(packed_rows)
    if sorted(packed_rows.tolist()) != list(range(head_dim)):
      raise ValueError(f"packed_rows must be a permutation of range({head_dim})")
    rows_arr = jnp.asarray(packed_rows, jnp.int32)
  else:
    rows_arr = jnp.arange(head_dim, dtype=jnp.int32)
  parts_pad = _triton.next_pow2(num_parts)
  stage_args, stage_key, stage_pad = _stage_inputs(stage, batch, heads, head_dim, rows)
  dblk = head_dim
  while dblk > 1 and max(parts_pad, stage_pad) * dblk * rows > _BUDGET:
    dblk //= 2
  # a single sequence: more, smaller channel blocks (each program's loads are
  # latency, not bandwidth)
  while dblk > 16 and batch * heads * (head_dim // dblk) < _MIN_PROGRAMS:
    dblk //= 2
  query, extra = None, ([], [])
  if qh is not None:
    if (qh.ndim != 4 or qh.shape[:2] != (batch, heads) or not isinstance(q_rows, int)
        or not 1 <= q_rows <= rows or qh.shape[2] < rows):
      raise ValueError(f"qh.shape={qh.shape} must be [B={batch}, H={heads}, N' >= rows={rows}, "
                       f"D] with 1 <= q_rows={q_rows!r} <= rows")
    if seq_bad is None:
      seq_bad = jnp.zeros((batch,), bool)
    if seq_bad.shape != (batch,):
      raise ValueError(f"seq_bad.shape={seq_bad.shape} must be ({batch},)")
    query = q_rows
    extra = ([pl.BlockSpec((None, None, *qh.shape[2:]), lambda b, h, d: (b, h, 0, 0)),
              pl.BlockSpec((1,), lambda b, h, d: (b,))],
             [qh, seq_bad.astype(jnp.int32)])
  elif seq_bad is not None:
    raise ValueError("seq_bad needs qh")
  kernel = functools.partial(_kernel, num_parts=num_parts, parts_pad=parts_pad, dblk=dblk,
                             rows=rows, width=width, permuted=permuted, plain_tail=plain_tail,
                             query=query, stage=stage_key, stage_pad=stage_pad,
                             head_dim=head_dim)
  o_flat = o_t.reshape(batch, heads, num_parts, head_dim * width)  # free
  return _triton.pallas_call(
      kernel,
      grid=(batch, heads, head_dim // dblk),
      in_specs=[
          pl.BlockSpec((None, None, num_parts, head_dim * width), lambda b, h, d: (b, h, 0, 0)),
          pl.BlockSpec((None, None, num_parts, l.shape[-1]), lambda b, h, d: (b, h, 0, 0)),
          pl.BlockSpec((None, None, num_parts, l.shape[-1]), lambda b, h, d: (b, h, 0, 0)),
          pl.BlockSpec((head_dim,), lambda b, h, d: (0,)),
          *extra[0],
          *stage_args[0],
      ],
      out_specs=pl.BlockSpec((None, None, rows, dblk), lambda b, h, d: (b, h, 0, d)),
      out_shape=jax.ShapeDtypeStruct((batch, heads, rows, head_dim), out_dtype),
      compiler_params=_triton.compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name="jaxkv_mosaic_combine",
  )(o_flat, l, m, rows_arr, *extra[1], *stage_args[1])


def _stage_inputs(stage, batch: int, heads: int, head_dim: int, rows: int):
  """``((specs, arrays), (S, R, P, H), P')`` of `combine_t`'s ``stage`` (checked), or
  empty ones without it."""
  if stage is None:
    return ([], []), None, 0
  q, k, v, staged, scale, num_queries = stage
  if q.ndim != 4 or q.shape[:2] != (batch, heads) or q.shape[3] != head_dim:
    raise ValueError(f"stage q.shape={q.shape} must be [B={batch}, H={heads}, R, "
                     f"D={head_dim}]")
  if not _triton.is_pow2(head_dim):
    raise ValueError(f"head_dim={head_dim} must be a power of two with stage")
  q_rows = q.shape[2]
  if q_rows > rows:
    raise ValueError(f"stage q has R={q_rows} rows, more than rows={rows}")
  try:
    num_queries = operator.index(num_queries)
  except TypeError:
    raise TypeError(f"stage S={num_queries!r} must be an int") from None
  if isinstance(num_queries, bool) or num_queries < 1 or q_rows % num_queries:
    raise ValueError(f"stage S={num_queries!r} must be an int >= 1 dividing R={q_rows}")
  if k.ndim != 4 or k.shape[0] != batch or k.shape[2:] != (heads, head_dim) or v.shape != k.shape:
    raise ValueError(f"stage k {k.shape} / v {v.shape} must be [B={batch}, P, H={heads}, "
                     f"D={head_dim}]")
  if staged.shape != (batch,) or not jnp.issubdtype(staged.dtype, jnp.integer):
    raise ValueError(f"stage staged ({staged.dtype} {staged.shape}) must be ({batch},) "
                     f"integers")
  n_stage = k.shape[1]
  per_b = lambda size: pl.BlockSpec((None, size), lambda b, h, d: (b, 0))  # noqa: E731
  specs = [pl.BlockSpec((None, None, q_rows * head_dim), lambda b, h, d: (b, h, 0)),
           per_b(n_stage * heads * head_dim), per_b(n_stage * heads * head_dim),
           pl.BlockSpec((None,), lambda b, h, d: (b,)),
           pl.BlockSpec((None,), lambda b, h, d: (b,))]
  arrays = [q.reshape(batch, heads, -1), k.reshape(batch, -1), v.reshape(batch, -1),
            jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (batch,)),
            staged.astype(jnp.int32)]
  return (specs, arrays), (num_queries, q_rows, n_stage, heads), _triton.next_pow2(n_stage)


__all__ = ["combine_t", "combine_t_reference"]
