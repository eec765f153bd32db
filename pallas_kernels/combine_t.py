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
layer in the H100 step anatomy of 2026-11-28).

``packed_rows`` (optional, ``[D]`` ints) says where channel ``c`` sits in the
rows of every partial but the last ``plain_tail`` (default 1): the register V
path of the Mosaic kernel leaves the packed splits' rows in the MMA's column
order, while the residual program's partials are in channel order (one
partial, or one per compute warpgroup). The kernel gathers the
rows per partial, so neither a permuted copy of the partials nor of the
output is made.

Semantics match the jnp reference `combine_t_reference`: a query row with no
visible key (``l == 0``) gives zeros; a NaN ``l`` stays NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _triton

_BUDGET = 8192  # float32 elements of one [J', dblk, M] tile per program
_MIN_PROGRAMS = 64  # channel blocks split further until this many programs run


def combine_t_reference(o_t, l, m, *, rows: int, packed_rows=None, out_dtype=jnp.float32,
                        plain_tail: int = 1):
  """jnp oracle: ``o_t [B,H,J,D,N], l/m [B,H,J,N]`` -> ``[B, H, rows, D]``."""
  o_t = o_t[..., :rows].astype(jnp.float32)
  l, m = l[..., :rows], m[..., :rows]
  if packed_rows is not None:
    idx = np.asarray(packed_rows)
    o_t = jnp.concatenate([o_t[:, :, :-plain_tail][:, :, :, idx], o_t[:, :, -plain_tail:]],
                          axis=2)
  m_max = jnp.max(m, axis=2, keepdims=True)
  m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
  w = jnp.exp(m - m_max)                                       # [B, H, J, M]
  num = jnp.einsum("bhjm,bhjdm->bhmd", w, o_t)
  den = jnp.sum(w * l, axis=2)                                 # [B, H, M]
  safe = jnp.where(den == 0, 1.0, den)
  out = jnp.where((den == 0)[..., None], 0.0, num / safe[..., None])
  return out.astype(out_dtype)


def _kernel(o_ref, l_ref, m_ref, rows_ref, *refs, num_parts, parts_pad, dblk, rows, width,
            permuted, plain_tail, query):
  """One (batch, kv head, channel block): all partials at once, gathered rows;
  with ``query`` (the real query rows; refs: ``qh_ref, seq_bad_ref, out_ref``)
  the rows `_triton.query_row_flags` finds are NaN."""
  if query is not None:
    qh_ref, seq_bad_ref, out_ref = refs
    flags = _triton.query_row_flags(qh_ref, seq_bad_ref, rows=rows, q_rows=query)
  else:
    (out_ref,) = refs
  d0 = pl.program_id(2) * dblk
  part = jax.lax.broadcasted_iota(jnp.int32, (parts_pad, 1), 0)           # [J', 1]
  live = part < num_parts
  col = jax.lax.broadcasted_iota(jnp.int32, (1, rows), 1)                 # [1, M]
  live_m = jnp.broadcast_to(live, (parts_pad, rows))
  m = plt.load(m_ref.at[part, col], mask=live_m, other=-jnp.inf)         # [J', M]
  l = plt.load(l_ref.at[part, col], mask=live_m, other=0.0)
  m_max = jnp.max(m, axis=0)                                             # [M]
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
  safe = jnp.where(den == 0, 1.0, den)
  out = jnp.where((den == 0)[None, :], 0.0, num / safe[None, :])
  if query is not None:
    out = jnp.where(flags[None, :], jnp.nan, out)
  out_ref[...] = out.T.astype(out_ref.dtype)                             # [M, dblk]


def combine_t(o_t: jax.Array, l: jax.Array, m: jax.Array, *, rows: int, packed_rows=None,
              out_dtype=jnp.float32, interpret: bool = False, plain_tail: int = 1,
              qh=None, q_rows: int | None = None, seq_bad=None) -> jax.Array:
  """Merge ``o_t [B,H,J,D,N], l/m [B,H,J,N']`` over J into ``[B, H, rows, D]``.

  ``rows`` (a power of two <= N) query rows are merged; ``packed_rows`` see the
  module docstring. The last ``plain_tail`` partials are always read in
  channel order. ``qh [B, H, N', D]`` with ``q_rows`` (and ``seq_bad [B]``
  bool, optional): the split kernel's own query rows (``r < q_rows`` real,
  ``N' >= rows``, scaled by any scale > 0); rows holding a NaN/inf and every
  row of a flagged sequence come out NaN, computed in the kernel.
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
  dblk = head_dim
  while dblk > 1 and parts_pad * dblk * rows > _BUDGET:
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
                             query=query)
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
      ],
      out_specs=pl.BlockSpec((None, None, rows, dblk), lambda b, h, d: (b, h, 0, d)),
      out_shape=jax.ShapeDtypeStruct((batch, heads, rows, head_dim), out_dtype),
      compiler_params=_triton.compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name="jaxkv_mosaic_combine",
  )(o_flat, l, m, rows_arr, *extra[1])


__all__ = ["combine_t", "combine_t_reference"]
