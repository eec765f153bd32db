"""Exact prefix attention of a sink format merged with the split-K kernel's
result, in one launch (Pallas Triton).

`jaxkv.sink_attention` runs a sink format's decode attention as a split-K
kernel over the packed tokens ``[skip, packed_len)`` and the residual, which
returns ``(o, lse)``, plus exact attention over the prefix ``[0, min(skip,
packed_len))``. In XLA the prefix and the log-sum-exp merge cost ~10 small
kernels (two dots, selects, reductions, a concatenate). This kernel reads the
prefix K/V rows (built by one XLA fusion, `jaxkv.sink_attention.prefix_rows`),
attends them with each query's causal cut, merges the result with the
kernel's ``(o, lse)``, applies the input policy's NaN rows (README "Input
policy") and writes the final output and the merged log-sum-exp.

One program per (batch, kv head): its ``M`` rows are the ``S`` queries times
the ``G = Hq / Hkv`` query heads, row ``r = s G + g`` (query ``s``, q head
``h G + g``), gathered from and scattered to the ``[B, S, Hq, D]`` layout
itself (no transposes). The padding rows ``r >= S G`` (M is a power of two
>= 16, the dots' minimum) index past the sequence's block: masked, and no
alias of a real row (interpret mode's masked scatter writes every index). The prefix is walked in blocks of ``block_n`` rows
with an online softmax.

Semantics match the jnp reference `sink_prefix_reference` (the XLA path of
`jaxkv.sink_attention`): row ``t`` is visible to query ``s`` iff ``t <
packed_len`` and ``t <= L - S + s``; a query that sees nothing in either part
gives zeros and lse ``-inf``; a query row holding a NaN/inf, and every row of
a sequence flagged ``seq_bad``, is NaN in the output (its lse is whatever the
arithmetic gives).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _triton

_BLOCK_N = 64  # prefix rows per step of the online softmax
_HI = lax.Precision.HIGHEST


# ---------------------------------------------------------------- reference
def sink_prefix_reference(q, kv, lengths, packed_len, o, lse, *, scale, seq_bad=None,
                          out_dtype=None):
  """jnp oracle of `sink_prefix_attention` (the same arguments): exact attention
  of ``q [B, S, Hq, D]`` over the rows of ``kv [B, Hkv, 2, n, D]`` merged with
  ``(o, lse)``. Returns ``(out [B, S, Hq, D] in out_dtype (q's), lse [B, S, Hq]
  float32)``."""
  b, s, hq, d = q.shape
  hkv, n = kv.shape[1], kv.shape[3]
  rows = jnp.arange(n)
  in_packed = rows[None, :] < packed_len[:, None]                                   # [B, n]
  limit = lengths[:, None] - s + jnp.arange(s)[None, :]                             # [B, S]
  vis = (in_packed[:, None, :] & (rows[None, None, :] <= limit[:, :, None]))       # [B, S, n]
  vis = vis[:, :, None, None, :]                                                    # [B,S,1,1,n]
  k = kv[:, :, 0].astype(jnp.float32)
  v = jnp.where(in_packed[:, None, :, None], kv[:, :, 1].astype(jnp.float32), 0.0)
  qf = q.astype(jnp.float32).reshape(b, s, hkv, hq // hkv, d)
  logits = jnp.einsum("bshgd,bhnd->bshgn", qf, k, precision=_HI) * scale
  logits = jnp.where(vis, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(vis, jnp.exp(logits - m[..., None]), 0.0)
  l = jnp.sum(p, axis=-1)                                                           # [B,S,H,G]
  o_p = jnp.einsum("bshgn,bhnd->bshgd", p, v, precision=_HI)
  safe = jnp.where(l > 0, l, 1.0)
  lse_p = jnp.where(l > 0, m + jnp.log(safe), -jnp.inf).reshape(b, s, hq)
  o_p = (o_p / safe[..., None]).reshape(b, s, hq, d)
  # the log-sum-exp merge
  mm = jnp.maximum(lse, lse_p)
  mm = jnp.where(jnp.isfinite(mm), mm, 0.0)
  w_a, w_b = jnp.exp(lse - mm), jnp.exp(lse_p - mm)
  den = w_a + w_b
  safe = jnp.where(den > 0, den, 1.0)
  out = o.astype(jnp.float32) * w_a[..., None] + o_p * w_b[..., None]
  out = jnp.where((den > 0)[..., None], out / safe[..., None], 0.0)
  lse_out = jnp.where(den > 0, mm + jnp.log(safe), -jnp.inf)
  bad = ~jnp.all(jnp.isfinite(q), axis=-1, keepdims=True)                         # [B,S,Hq,1]
  if seq_bad is not None:
    bad = bad | seq_bad[:, None, None, None]
  out = jnp.where(bad, jnp.nan, out)
  return out.astype(q.dtype if out_dtype is None else out_dtype), lse_out


# ------------------------------------------------------------------- kernel
def _dot(a, b):  # HIGHEST: IEEE fp32 dots (Triton's default for f32 is TF32)
  return jnp.dot(a, b, precision=_HI, preferred_element_type=jnp.float32)


def _dot_t(a, b):
  """``a @ b.T``."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_HI,
                         preferred_element_type=jnp.float32)


def _kernel(len_ref, packed_ref, scale_ref, bad_ref, q_ref, kv_ref, o_ref, lse_ref,
            out_ref, out_lse_ref, *, n, block_n, rows, num_queries, group, q_heads, head_dim):
  """One (batch, kv head). ``q_ref, o_ref``: the sequence's ``[S * Hq * D]``;
  ``lse_ref``: its ``[S * Hq]``; ``kv_ref``: the kv head's ``[2 * n * D]`` (K rows
  then V rows); the outputs as ``q_ref`` and ``lse_ref``."""
  length, packed, scale = len_ref[()], packed_ref[()], scale_ref[()]
  r = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)                      # [M, 1]
  live = r < group * num_queries
  query = r // group  # >= S on the padding rows: their indices lie past the block
  head = pl.program_id(1) * group + r % group
  col = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)                # [1, D]
  q_flat = (query * q_heads + head) * head_dim + col                     # [M, D]
  live_md = jnp.broadcast_to(live, q_flat.shape)
  qv = plt.load(q_ref.at[q_flat], mask=live_md, other=0.0).astype(jnp.float32)
  limit = length - num_queries + query                                   # [M, 1]
  seen = jnp.clip(jnp.minimum(packed, n), 0, n)  # rows [0, seen) hold data

  def body(j, carry):
    acc, l, m = carry
    t = j * block_n + lax.broadcasted_iota(jnp.int32, (block_n, 1), 0)   # [BN, 1]
    here = jnp.broadcast_to(t < seen, (block_n, head_dim))
    kv_flat = t * head_dim + col                                         # [BN, D]
    k = plt.load(kv_ref.at[kv_flat], mask=here, other=0.0).astype(jnp.float32)
    v = plt.load(kv_ref.at[kv_flat + n * head_dim], mask=here, other=0.0).astype(jnp.float32)
    vis = (t.T < seen) & (t.T <= limit)                                  # [M, BN]
    sc = jnp.where(vis, _dot_t(qv, k) * scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))                          # [M]
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.where(vis, jnp.exp(sc - m_safe[:, None]), 0.0)
    return acc * alpha[:, None] + _dot(p, v), l * alpha + jnp.sum(p, axis=1), m_new

  carry = (jnp.zeros((rows, head_dim), jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.full((rows,), -jnp.inf, jnp.float32))
  acc, l, m = lax.fori_loop(0, (seen + block_n - 1) // block_n, body, carry)
  safe = jnp.where(l > 0, l, 1.0)
  lse_p = jnp.where(l > 0, m + jnp.log(safe), -jnp.inf)                  # [M]
  o_p = acc / safe[:, None]                                              # [M, D]
  # merge with the split-K kernel's rows
  lse_flat = (query * q_heads + head)[:, 0]                              # [M]
  o_k = plt.load(o_ref.at[q_flat], mask=live_md, other=0.0).astype(jnp.float32)
  lse_k = plt.load(lse_ref.at[lse_flat], mask=live[:, 0], other=-jnp.inf)
  mm = jnp.maximum(lse_k, lse_p)
  # NaN fails every comparison: |x| <= max is False exactly for NaN and +-inf
  mm = jnp.where(jnp.abs(mm) <= jnp.finfo(jnp.float32).max, mm, 0.0)
  w_a, w_b = jnp.exp(lse_k - mm), jnp.exp(lse_p - mm)
  den = w_a + w_b
  safe = jnp.where(den > 0, den, 1.0)
  out = o_k * w_a[:, None] + o_p * w_b[:, None]
  out = jnp.where((den > 0)[:, None], out / safe[:, None], 0.0)
  lse_out = jnp.where(den > 0, mm + jnp.log(safe), -jnp.inf)
  # the input policy: a row with a NaN/inf query, every row of a flagged sequence
  finite = jnp.abs(plt.load(q_ref.at[q_flat], mask=live_md, other=0.0).astype(jnp.float32)) \
      <= jnp.finfo(jnp.float32).max
  bad = (jnp.min(finite.astype(jnp.int32), axis=1) == 0) | (bad_ref[()] != 0)     # [M]
  out = jnp.where(bad[:, None], jnp.nan, out)
  plt.store(out_ref.at[q_flat], out.astype(out_ref.dtype), mask=live_md)
  plt.store(out_lse_ref.at[lse_flat], lse_out, mask=live[:, 0])


def supported(head_dim: int) -> bool:
  """Whether the kernel serves this head dim (a power of two >= 16: its dots)."""
  return head_dim >= 16 and _triton.is_pow2(head_dim)


def sink_prefix_attention(q, kv, lengths, packed_len, o, lse, *, scale, seq_bad=None,
                          out_dtype=None, interpret: bool = False):
  """Prefix attention merged with the split-K kernel's result, in one launch.

  Args:
    q: ``[B, S, Hq, D]`` queries.
    kv: ``[B, Hkv, 2, n, D]``: K (index 0) and V (index 1) of prefix tokens
      ``[0, n)`` (float32 or the cache dtype; rows ``>= packed_len`` are never read).
    lengths, packed_len: ``[B]`` ints: ``L_b`` and the packed tokens of each
      sequence; row ``t`` is visible to query ``s`` iff ``t < packed_len`` and
      ``t <= L - S + s``.
    o, lse: the split-K kernel's ``[B, S, Hq, D]`` (any float dtype) and
      ``[B, S, Hq]`` float32 over the other tokens (``lse = -inf``: none).
    scale: softmax scale (a real or a scalar array, traced ones included).
    seq_bad: optional ``[B]`` bool, flagged sequences come out NaN.
    out_dtype: the output's dtype, default q's.
    interpret: Pallas interpret mode (off a GPU).
  Returns:
    ``(out [B, S, Hq, D], lse [B, S, Hq] float32)`` as `sink_prefix_reference`.
  """
  batch, num_queries, q_heads, head_dim = q.shape
  if kv.ndim != 5 or kv.shape[0] != batch or kv.shape[2] != 2 or kv.shape[4] != head_dim:
    raise ValueError(f"kv.shape={kv.shape} must be [B={batch}, Hkv, 2, n, D={head_dim}]")
  kv_heads, n = kv.shape[1], kv.shape[3]
  if q_heads % kv_heads:
    raise ValueError(f"Hq={q_heads} must be a multiple of Hkv={kv_heads}")
  if not supported(head_dim):
    raise ValueError(f"head_dim={head_dim} must be a power of two >= 16")
  if o.shape != q.shape or lse.shape != q.shape[:3]:
    raise ValueError(f"o {o.shape} / lse {lse.shape} must be {q.shape} / {q.shape[:3]}")
  group = q_heads // kv_heads
  rows = max(16, _triton.next_pow2(group * num_queries))
  block_n = min(_BLOCK_N, max(16, _triton.next_pow2(n)))
  if seq_bad is None:
    seq_bad = jnp.zeros((batch,), bool)
  out_dtype = q.dtype if out_dtype is None else out_dtype
  scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (batch,))
  per_seq = pl.BlockSpec((None,), lambda b, h: (b,))
  flat = lambda x: pl.BlockSpec((None, x), lambda b, h: (b, 0))  # noqa: E731
  q_size, lse_size = num_queries * q_heads * head_dim, num_queries * q_heads
  kernel = functools.partial(_kernel, n=n, block_n=block_n, rows=rows,
                             num_queries=num_queries, group=group, q_heads=q_heads,
                             head_dim=head_dim)
  out, lse_out = _triton.pallas_call(
      kernel,
      grid=(batch, kv_heads),
      in_specs=[per_seq, per_seq, per_seq, per_seq, flat(q_size),
                pl.BlockSpec((None, None, 2 * n * head_dim), lambda b, h: (b, h, 0)),
                flat(q_size), flat(lse_size)],
      out_specs=[flat(q_size), flat(lse_size)],
      out_shape=[jax.ShapeDtypeStruct((batch, q_size), out_dtype),
                 jax.ShapeDtypeStruct((batch, lse_size), jnp.float32)],
      compiler_params=_triton.compiler_params(num_warps=4 if rows * block_n <= 2048 else 8,
                                              num_stages=1),
      interpret=interpret,
      name="jaxkv_sink_prefix",
  )(lengths.astype(jnp.int32), packed_len.astype(jnp.int32), scale,
    seq_bad.astype(jnp.int32), q.reshape(batch, -1), kv.reshape(batch, kv_heads, -1),
    o.reshape(batch, -1), lse.astype(jnp.float32).reshape(batch, -1))
  return out.reshape(q.shape), lse_out.reshape(q.shape[:3])


__all__ = ["sink_prefix_attention", "sink_prefix_reference", "supported"]
