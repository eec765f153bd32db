"""Attention of a prefill chunk over a (quantized) cached history plus itself.

Chunked and multi-turn prefill run a block of ``c`` new tokens per sequence
against a cache that already holds ``L_b`` tokens. Query ``i`` of sequence
``b`` (position ``L_b + i``) attends to

* the history ``[0, L_b)`` exactly as stored (`KVCache.dequantize()`:
  packed tokens dequantized, residual tokens exact; for a `jaxkv.VQCache`
  the packed tokens are their summed centroids), and
* the chunk's own keys ``j <= i`` in full precision (causal),

with one softmax over both. The chunk's K/V are written to the cache after
this attention (so they are never read back quantized by their own chunk).

Three implementations:

* ``"pallas"``: a Pallas-Triton flash kernel
  (`pallas_kernels.chunk_attention`) over ``cache.dequantize()`` cast to the
  query dtype (bf16 MMAs with float32 softmax and accumulation, the way flash
  attention runs); it visits only ``ceil(L_b / block_k)`` history blocks per
  sequence. The default on GPU.
* ``"xla"``: flash-style online softmax in jnp, float32, blocked
  over queries (``block_q``) and keys (``block_k``) so memory stays
  ``O(B * Hq * block_q * block_k)`` whatever the history and chunk lengths;
  history blocks past the longest packed length are skipped. Each key source
  (packed history blocks, residual block, chunk blocks) yields an
  unnormalized ``(o, (l, m))`` partial merged by log-sum-exp, the structure a
  Pallas kernel would follow.
* ``"reference"``: dense jnp over ``cache.dequantize()`` (the spec; memory
  ``O(B * Hq * c * (capacity + c))``).

``implementation=None`` picks the Pallas kernel on GPU; elsewhere the
reference while its logits take at most `DENSE_LOGITS_BYTES`, the blocked
path otherwise.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import hierarchical, quant
from jaxkv.attention import _poison, check_counts, check_scale
from jaxkv.cache import KVCache, QuantizedKV, sink_rows
from jaxkv.vq_cache import VQCache
from pallas_kernels.vq_attention import vq_dequantize

IMPLEMENTATIONS = ("pallas", "xla", "reference")
# implementation=None runs the dense reference while its float32 logits stay
# below this many bytes (small problems: less work, much faster to compile),
# the blocked "xla" path beyond.
DENSE_LOGITS_BYTES = 32 << 20
# The "pallas" path dequantizes the history (K and V, in the query dtype)
# for at most this many bytes at a time: larger batches run in slices.
PALLAS_HISTORY_BYTES = 1 << 30
_HI = jax.lax.Precision.HIGHEST


def _pallas_supports(q) -> bool:
  d = q.shape[-1]
  return d >= 16 and d & (d - 1) == 0 and jnp.issubdtype(q.dtype, jnp.floating)


def _pallas(q, cache: KVCache, k_chunk, v_chunk, scale, config, interpret: bool):
  """The Pallas kernel over the history dequantized to q's dtype.

  The dequantized history is a temporary of ``2 * C * Hkv * D`` elements per
  sequence; above `PALLAS_HISTORY_BYTES` the batch runs in slices of ``bs``
  sequences, one after the other (the last slice overlaps the one before
  rather than padding the cache), so the temporary stays bounded whatever B.
  """
  from pallas_kernels.chunk_attention import pallas_chunk_attention  # pylint: disable=import-outside-toplevel
  b = q.shape[0]
  per_seq = 2 * cache.capacity * cache.kv_heads * cache.head_dim * jnp.dtype(q.dtype).itemsize
  bs = int(max(1, min(b, PALLAS_HISTORY_BYTES // per_seq)))

  def attend(q, cache, k_chunk, v_chunk):
    k_hist, v_hist = cache.dequantize()                                 # [bs, C, Hkv, D]
    # The kernel's MMA operands share q's dtype (the cast it did itself before).
    return pallas_chunk_attention(q, k_hist.astype(q.dtype), v_hist.astype(q.dtype),
                                  cache.lengths, k_chunk.astype(q.dtype),
                                  v_chunk.astype(q.dtype), scale=scale, config=config,
                                  interpret=interpret)

  if bs >= b:
    return attend(q, cache, k_chunk, v_chunk)

  def one_slice(i, out):
    start = jnp.minimum(i * bs, b - bs)
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, bs, axis=0)  # noqa: E731
    o = attend(take(q), _take_sequences(cache, take), take(k_chunk), take(v_chunk))
    return jax.lax.dynamic_update_slice_in_dim(out, o, start, axis=0)

  return jax.lax.fori_loop(0, -(-b // bs), one_slice, jnp.zeros_like(q))


def _take_sequences(cache, take):
  """``take`` applied to every per-sequence leaf of the cache (a VQ cache's
  codebooks ``[Hkv, ...]`` are shared by all sequences and kept whole)."""
  if not isinstance(cache, VQCache):
    return jax.tree.map(take, cache)
  shared = dict(k_codebook=cache.k_codebook, v_codebook=cache.v_codebook)
  per_seq = jax.tree.map(take, dataclasses.replace(cache, k_codebook=None, v_codebook=None))
  return dataclasses.replace(per_seq, **shared)


def _check(q, cache, k_chunk, v_chunk, chunk_lengths):
  if not isinstance(cache, (KVCache, VQCache)):
    raise TypeError(f"cache must be a jaxkv.KVCache or VQCache, got {type(cache).__name__}")
  for name, x in (("q", q), ("k_chunk", k_chunk), ("v_chunk", v_chunk)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be rank 4, got shape {getattr(x, 'shape', type(x))}")
  b, c, hq, d = q.shape
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"q.dtype={q.dtype} must be floating")
  if k_chunk.shape != v_chunk.shape or k_chunk.shape != (b, c, cache.kv_heads, d):
    raise ValueError(f"k_chunk.shape={k_chunk.shape} and v_chunk.shape={v_chunk.shape} must "
                     f"be {(b, c, cache.kv_heads, d)}")
  for name, x in (("k_chunk", k_chunk), ("v_chunk", v_chunk)):
    if x.dtype != cache.dtype:  # README "Input policy": K/V in the cache dtype
      raise TypeError(f"{name}.dtype={x.dtype} must be the cache dtype {cache.dtype}")
  if (b, d) != (cache.batch, cache.head_dim) or hq % cache.kv_heads:
    raise ValueError(f"q.shape={q.shape} does not match the cache (batch={cache.batch}, "
                     f"kv_heads={cache.kv_heads}, head_dim={cache.head_dim})")
  check_counts("chunk_lengths", chunk_lengths, b, c, "c")


def _is_int(value) -> bool:
  """A Python or numpy integer, not a bool."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def chunk_attention_reference(q: jax.Array, cache: KVCache, k_chunk: jax.Array,
                              v_chunk: jax.Array, *, scale: float | None = None) -> jax.Array:
  """Dense spec of `chunk_attention`: float32 softmax over ``[history; chunk]``.

  Args:
    q: ``[B, c, Hq, D]`` queries of the chunk (positions ``L_b + i``).
    cache: the history (`KVCache` or `jaxkv.VQCache`, lengths ``L_b``); not changed.
    k_chunk, v_chunk: ``[B, c, Hkv, D]`` the chunk's own keys and values.
    scale: softmax scale, default ``D ** -0.5``.
  Returns:
    ``[B, c, Hq, D]`` in q's dtype.
  """
  from pallas_kernels.chunk_attention import chunk_attention_reference as dense  # pylint: disable=import-outside-toplevel
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  k_hist, v_hist = cache.dequantize()                                   # [B, C, Hkv, D]
  return dense(q, k_hist, v_hist, cache.lengths, k_chunk, v_chunk, scale=scale)


def _history_rows(cache, side: str, start, n: int) -> jax.Array:
  """Packed rows ``[start, start + n)`` of side ``"k"``/``"v"`` as float32 ``[B, H, n, D]``."""
  if isinstance(cache, VQCache):
    codes = jax.lax.dynamic_slice_in_dim(getattr(cache, f"{side}_codes"), start, n, axis=2)
    return vq_dequantize(codes, getattr(cache, f"{side}_codebook"))
  return _dequant_rows(getattr(cache, side), start, n)


def _dequant_rows(side: QuantizedKV, start, n: int) -> jax.Array:
  """Rows ``[start, start + n)`` of a packed side as float32 ``[B, H, n, D]``
  (``start`` and ``n`` multiples of G, so a hierarchical side's slice holds whole
  plane blocks)."""
  codes = jax.lax.dynamic_slice_in_dim(side.codes, start, n, axis=2)
  if side.bits == 16:
    return codes.astype(jnp.float32)
  if side.axis == "channel":
    s0, ns = start // side.group, n // side.group
  else:
    s0, ns = start, n
  scale = jax.lax.dynamic_slice_in_dim(side.scale, s0, ns, axis=2)
  zero = jax.lax.dynamic_slice_in_dim(side.zero, s0, ns, axis=2)
  if side.hierarchical:  # prefill attends to the target view; whole plane blocks
    return hierarchical.dequantize(codes, scale, zero, axis=side.axis, block=side.plane_block)
  return quant.dequantize(codes, scale, zero, side.bits, axis=side.axis)


def _partial(q, k, v, mask, state):
  """Online-softmax update with one key block.

  q: ``[B, Hkv, g, bq, D]`` (pre-scaled); k, v: ``[B, Hkv, bk, D]`` float32;
  mask: broadcastable to ``[B, Hkv, g, bq, bk]``; state: ``(acc, l, m)`` with
  acc ``[B, Hkv, g, bq, D]``, l/m ``[B, Hkv, g, bq]``.
  """
  acc, l, m = state
  s = jnp.einsum("bhgqd,bhkd->bhgqk", q, k, precision=_HI)
  s = jnp.where(mask, s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1))
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  p = jnp.where(mask, jnp.exp(s - m_safe[..., None]), 0.0)
  alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
  acc = acc * alpha[..., None] + jnp.einsum("bhgqk,bhkd->bhgqd", p, v, precision=_HI)
  return acc, l * alpha + jnp.sum(p, axis=-1), m_new


def _blocked(q, cache: KVCache, k_chunk, v_chunk, scale, block_q: int, block_k: int):
  b, c, hq, d = q.shape
  hkv, g = cache.kv_heads, hq // cache.kv_heads
  fmt = cache.fmt
  bq = min(block_q, c)
  pad = -c % bq
  if pad:
    widen = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))  # noqa: E731
    q, k_chunk, v_chunk = widen(q), widen(k_chunk), widen(v_chunk)
  cp = c + pad
  nq = cp // bq
  # [B, Hkv, g, c, D], pre-scaled; chunk K/V head-major [B, Hkv, c, D].
  qf = jnp.moveaxis(q.astype(jnp.float32).reshape(b, cp, hkv, g, d), 1, 3) * scale
  kc = jnp.swapaxes(k_chunk.astype(jnp.float32), 1, 2)
  vc = jnp.swapaxes(v_chunk.astype(jnp.float32), 1, 2)
  # History blocks: a multiple of G dividing the storage (power-of-two aligned).
  bk = math.gcd(cache.storage_len, max(block_k, fmt.token_group))
  packed = cache.packed_lens                                            # [B]
  n_hist = (jnp.max(packed) + bk - 1) // bk
  res_len = cache.lengths - packed
  k_res = cache.k_residual.astype(jnp.float32)                          # [B, Hkv, R, D]
  v_res = cache.v_residual.astype(jnp.float32)
  res_mask = (jnp.arange(fmt.residual)[None, :] < res_len[:, None])[:, None, None, None, :]

  def one_query_block(qi):
    qb = jax.lax.dynamic_slice_in_dim(qf, qi * bq, bq, axis=3)           # [B, Hkv, g, bq, D]
    state = (jnp.zeros(qb.shape, jnp.float32), jnp.zeros(qb.shape[:-1], jnp.float32),
             jnp.full(qb.shape[:-1], -jnp.inf, jnp.float32))

    def hist(j, state):
      kb, vb = _history_rows(cache, "k", j * bk, bk), _history_rows(cache, "v", j * bk, bk)
      if cache.k_sink is not None:  # rows [0, S) exactly (`KVCache.dequantize`)
        kb = sink_rows(kb, cache.k_sink, cache.lengths, j * bk)
        vb = sink_rows(vb, cache.v_sink, cache.lengths, j * bk)
      mask = (j * bk + jnp.arange(bk)[None, :] < packed[:, None])[:, None, None, None, :]
      return _partial(qb, kb, vb, mask, state)

    state = jax.lax.fori_loop(0, n_hist, hist, state)
    state = _partial(qb, k_res, v_res, res_mask, state)

    def own(j, state):  # chunk key block j <= qi, causal inside the diagonal block
      kb = jax.lax.dynamic_slice_in_dim(kc, j * bq, bq, axis=2)
      vb = jax.lax.dynamic_slice_in_dim(vc, j * bq, bq, axis=2)
      mask = (j * bq + jnp.arange(bq))[None, :] <= (qi * bq + jnp.arange(bq))[:, None]
      return _partial(qb, kb, vb, mask, state)

    if nq == 1:  # one block: skip the loop (smaller program, faster compile)
      acc, l, _ = own(0, state)
    else:
      acc, l, _ = jax.lax.fori_loop(0, qi + 1, own, state)
    return acc / jnp.where(l > 0, l, 1.0)[..., None]                    # [B, Hkv, g, bq, D]

  if nq == 1:
    out = one_query_block(0)[None]
  else:
    out = jax.lax.map(one_query_block, jnp.arange(nq))                  # [nq, B, Hkv, g, bq, D]
  out = jnp.moveaxis(out, 0, 3).reshape(b, hkv, g, cp, d)
  out = jnp.moveaxis(out, 3, 1).reshape(b, cp, hq, d)[:, :c]
  return out.astype(q.dtype)


def chunk_attention(q: jax.Array, cache: KVCache, k_chunk: jax.Array, v_chunk: jax.Array,
                    chunk_lengths: jax.Array | None = None, *, scale: float | None = None,
                    implementation: str | None = None, block_q: int = 256,
                    block_k: int = 256, config=None, interpret: bool | None = None) -> jax.Array:
  """Attention of a chunk of new tokens over the cached history and themselves.

  Args:
    q: ``[B, c, Hq, D]`` queries of the chunk; query ``i`` sits at position
      ``cache.lengths[b] + i``.
    cache: `KVCache` or `jaxkv.VQCache` holding the history (the chunk is
      *not* in it yet).
    k_chunk, v_chunk: ``[B, c, Hkv, D]`` the chunk's keys and values, in the
      cache dtype.
    chunk_lengths: ``[B]`` real tokens per sequence (optional; queries past it
      are padding and their rows are unspecified but finite). An integer
      array; concrete values must lie in ``[0, c]``.
    scale: softmax scale, default ``D ** -0.5``.
    implementation: ``"pallas"`` (flash kernel, operands in q's dtype),
      ``"xla"`` (blocked, bounded memory), ``"reference"`` (dense) or None
      (Pallas on GPU for head_dim <= 128; else dense when small, see
      `DENSE_LOGITS_BYTES`, blocked jnp otherwise).
    block_q, block_k: query / key block sizes of the ``"xla"`` path (the
      Pallas kernel takes ``config``).
    config: `pallas_kernels.chunk_attention.ChunkAttentionConfig` of the
      ``"pallas"`` path (None: its defaults).
    interpret: run the Pallas kernel in interpret mode; None: off a GPU.
  Returns:
    ``[B, c, Hq, D]`` in q's dtype; float32 softmax and accumulation.
  """
  if chunk_lengths is None:
    chunk_lengths = jnp.full((q.shape[0],), q.shape[1], jnp.int32)
  _check(q, cache, k_chunk, v_chunk, chunk_lengths)
  scale = check_scale(scale)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  impl = implementation
  # The default picks the kernel only at head sizes its config was measured at
  # (<= 128; larger heads need smaller tiles to fit shared memory).
  if impl is None and jax.default_backend() == "gpu" and _pallas_supports(q) \
      and q.shape[-1] <= 128:
    impl = "pallas"
  if impl is None:
    b, c, hq, _ = q.shape
    impl = "reference" if 4 * b * hq * c * (cache.capacity + c) <= DENSE_LOGITS_BYTES else "xla"
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={impl!r} must be one of {IMPLEMENTATIONS} or None")
  for name, blk in (("block_q", block_q), ("block_k", block_k)):
    if not _is_int(blk):
      raise TypeError(f"{name}={blk!r} must be an int, got {type(blk).__name__}")
    if blk < 1 or blk & (blk - 1):
      raise ValueError(f"{name}={blk!r} must be a positive power of two")
  block_q, block_k = int(block_q), int(block_k)
  from pallas_kernels.chunk_attention import ChunkAttentionConfig  # pylint: disable=import-outside-toplevel
  if config is not None and not isinstance(config, ChunkAttentionConfig):
    raise TypeError(f"config={config!r} must be a ChunkAttentionConfig or None, got "
                    f"{type(config).__name__}")
  if impl != "pallas" and (config is not None or interpret is not None):  # they would be ignored
    raise ValueError(f"config / interpret are for implementation='pallas', but chunk_attention "
                     f"runs {impl!r} here (implementation={implementation!r} on "
                     f"{jax.default_backend()})")
  if impl == "reference":
    out = chunk_attention_reference(q, cache, k_chunk, v_chunk, scale=scale)
  elif impl == "pallas":
    if not _pallas_supports(q):
      raise ValueError(f"implementation='pallas' needs a power-of-two head_dim >= 16 and a "
                       f"float q, got shape {q.shape} dtype {q.dtype}")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    out = _pallas(q, cache, k_chunk, v_chunk, scale, config, interpret)
  else:
    out = _blocked(q, cache, k_chunk, v_chunk, scale, block_q, block_k)
  # README "Input policy": every output of a sequence whose cache holds a
  # non-finite value is NaN, and so is a query row holding one (whatever the
  # implementation's softmax did with it).
  return _poison(out, q, cache.nonfinite)


__all__ = ["chunk_attention", "chunk_attention_reference"]
