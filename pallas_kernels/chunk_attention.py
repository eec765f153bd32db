"""Pallas-Triton flash attention of a prefill chunk over a history plus itself.

`jaxkv.chunk_attention(..., implementation="pallas")` lands here. Query ``i``
of sequence ``b`` (position ``L_b + i``) attends to the history keys
``[0, L_b)`` and to the chunk's own keys ``j <= i``, with one online softmax
over both (float32 statistics and accumulator, operand-dtype MMAs):

* history: ``k_hist``/``v_hist`` ``[B, C, Hkv, D]`` (what `KVCache.dequantize`
  returns, cast to the operand dtype by the caller); a dynamic number of
  ``block_k`` blocks per sequence, ``ceil(L_b / block_k)``, so an empty or
  short history costs nothing past its length;
* the chunk: blocks strictly below the diagonal unmasked, the diagonal masked.

One program per ``(b, q head, query block)``; GQA heads of a KV head read the
same K/V (from L2). Inputs stay token-major (no transposes): block specs pick
one head's ``[rows, D]`` slab. `chunk_attention_reference` is the jnp spec.
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

_LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class ChunkAttentionConfig:
  """Launch config of the chunk-attention kernel.

  block_q: queries per program (power of two >= 16; shrunk to the chunk).
  block_k: keys per inner step (power of two >= 16, <= block_q).
  num_warps, num_stages: Triton launch parameters.
  """
  # Defaults from an H100 sweep (bench/results/e2e-NOTES.md, 2026-11-25):
  # 128x128, 8 warps, 3 stages ran a 4K chunk over 28K of history at 470
  # TFLOP/s (128x64x8x2: 327; cuDNN's dense BF16 attention: 628).
  block_q: int = 128
  block_k: int = 128
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      v = getattr(self, name)
      if not _triton.is_int(v) or v < 16 or not _triton.is_pow2(v):
        raise ValueError(f"{name}={v!r} must be a power of two >= 16")
    if self.block_k > self.block_q:
      raise ValueError(f"block_k={self.block_k} must be <= block_q={self.block_q}")
    _triton.check_launch(self)
    for name in ("block_q", "block_k", "num_warps", "num_stages"):  # numpy ints -> int
      object.__setattr__(self, name, int(getattr(self, name)))


def chunk_attention_reference(q, k_hist, v_hist, hist_len, k_chunk, v_chunk, *, scale):
  """Dense jnp spec (float32): the same arguments as `pallas_chunk_attention`.

  q: ``[B, c, Hq, D]``; k_hist, v_hist: ``[B, C, Hkv, D]``; hist_len: ``[B]``;
  k_chunk, v_chunk: ``[B, c, Hkv, D]``. Returns ``[B, c, Hq, D]`` in q's dtype.
  """
  b, c, hq, d = q.shape
  cap, hkv = k_hist.shape[1], k_hist.shape[2]
  f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
  k = jnp.concatenate([f32(k_hist), f32(k_chunk)], axis=1)              # [B, C + c, Hkv, D]
  v = jnp.concatenate([f32(v_hist), f32(v_chunk)], axis=1)
  qf = f32(q).reshape(b, c, hkv, hq // hkv, d)
  s = jnp.einsum("bihgd,bthd->bhgit", qf, k, precision=lax.Precision.HIGHEST) * scale
  pos = jnp.arange(cap + c)[None, None, :]
  i = jnp.arange(c)[None, :, None]
  mask = jnp.where(pos < cap, pos < hist_len[:, None, None], pos - cap <= i)   # [B, c, C + c]
  p = jax.nn.softmax(jnp.where(mask[:, None, None], s, -jnp.inf), axis=-1)
  out = jnp.einsum("bhgit,bthd->bihgd", p, v, precision=lax.Precision.HIGHEST)
  return out.reshape(b, c, hq, d).astype(q.dtype)


def _dot_t(a, b):
  """``a @ b.T`` with float32 accumulation (IEEE fp32 for float32 operands)."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def _dot(a, b):
  return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _kernel(len_ref, q_ref, kh_ref, vh_ref, kc_ref, vc_ref, o_ref, *, scale, block_q,
            block_k):
  # q_ref/o_ref [bq, D]; kh/vh [C, D]; kc/vc [c, D]; len_ref [] int32 (L_b).
  i = pl.program_id(2)
  hist_len = len_ref[()]
  q = q_ref[...]
  qk_scale = scale * _LOG2E                    # scores in log2 units: exp2 below
  rows = block_q

  def step(carry, k, v, mask):
    acc, l, m = carry
    s = _dot_t(q, k) * qk_scale                                        # [bq, bk] f32
    if mask is not None:
      s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))                         # finite: m starts finite
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return acc, l * alpha + jnp.sum(p, axis=1), m_new

  d = q.shape[-1]
  carry = (jnp.zeros((rows, d), jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.full((rows,), -1e30, jnp.float32))

  def hist_body(j, carry, masked=False):
    start = j * block_k
    k = kh_ref[pl.ds(start, block_k), :]
    v = vh_ref[pl.ds(start, block_k), :]
    mask = None
    if masked:
      mask = (start + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)) < hist_len
    return step(carry, k, v, mask)

  # Whole history blocks unmasked, then the partial last one (if any) masked.
  full_blocks = hist_len // block_k
  carry = lax.fori_loop(0, full_blocks, hist_body, carry)
  carry = lax.fori_loop(full_blocks, (hist_len + block_k - 1) // block_k,
                        functools.partial(hist_body, masked=True), carry)

  def own_body(j, carry):  # chunk blocks wholly below this query block's diagonal
    k = kc_ref[pl.ds(j * block_k, block_k), :]
    v = vc_ref[pl.ds(j * block_k, block_k), :]
    return step(carry, k, v, None)

  per_q = block_q // block_k
  carry = lax.fori_loop(0, i * per_q, own_body, carry)

  def diag_body(j, carry):
    start = i * block_q + j * block_k
    k = kc_ref[pl.ds(start, block_k), :]
    v = vc_ref[pl.ds(start, block_k), :]
    qpos = i * block_q + lax.broadcasted_iota(jnp.int32, (rows, block_k), 0)
    kpos = start + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
    return step(carry, k, v, kpos <= qpos)

  acc, l, _ = lax.fori_loop(0, per_q, diag_body, carry)
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)   # l >= 1: the diagonal key


def pallas_chunk_attention(q: jax.Array, k_hist: jax.Array, v_hist: jax.Array,
                           hist_len: jax.Array, k_chunk: jax.Array, v_chunk: jax.Array, *,
                           scale: float, config: ChunkAttentionConfig | None = None,
                           interpret: bool = False) -> jax.Array:
  """Flash attention of ``c`` new queries over ``L_b`` history keys plus the chunk.

  Args:
    q: ``[B, c, Hq, D]`` (query ``i`` at position ``hist_len[b] + i``).
    k_hist, v_hist: ``[B, C, Hkv, D]`` history keys/values; rows past
      ``hist_len[b]`` are ignored. Same dtype as ``q`` (the MMA operands).
    hist_len: ``[B]`` int, ``0 <= hist_len <= C``.
    k_chunk, v_chunk: ``[B, c, Hkv, D]`` the chunk's own keys/values (causal).
    scale: softmax scale.
    config: `ChunkAttentionConfig` (default: block_q 128, block_k 128).
    interpret: Pallas interpret mode (CPU tests).
  Returns:
    ``[B, c, Hq, D]`` in q's dtype.
  """
  config = ChunkAttentionConfig() if config is None else config
  if not isinstance(config, ChunkAttentionConfig):
    raise TypeError(f"config must be a ChunkAttentionConfig, got {type(config).__name__}")
  for name, x in (("q", q), ("k_hist", k_hist), ("v_hist", v_hist), ("k_chunk", k_chunk),
                  ("v_chunk", v_chunk)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be rank 4, got shape {getattr(x, 'shape', type(x).__name__)}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"q.dtype={q.dtype} must be floating")
  b, c, hq, d = q.shape
  cap, hkv = k_hist.shape[1], k_hist.shape[2]
  if hkv < 1:
    raise ValueError(f"k_hist.shape={k_hist.shape} has no kv heads")
  for name, x in (("k_hist", k_hist), ("v_hist", v_hist), ("k_chunk", k_chunk),
                  ("v_chunk", v_chunk)):
    if x.dtype != q.dtype:  # the MMA operands: a silent cast rounded float32 history
      raise TypeError(f"{name}.dtype={x.dtype} must equal q.dtype={q.dtype} (cast first)")
  _triton.check_counts("hist_len", hist_len, b, cap, "C")
  if scale is None or isinstance(scale, jax.core.Tracer):  # float(scale) below needs a value
    raise TypeError(f"scale={scale!r} must be a concrete real number")
  _triton.check_scale(scale)
  if hq % hkv:
    raise ValueError(f"q heads {hq} must be a multiple of kv heads {hkv}")
  if k_chunk.shape != (b, c, hkv, d) or v_chunk.shape != k_chunk.shape:
    raise ValueError(f"k_chunk {k_chunk.shape} / v_chunk {v_chunk.shape} must be "
                     f"{(b, c, hkv, d)}")
  if v_hist.shape != k_hist.shape or k_hist.shape[0] != b or k_hist.shape[3] != d:
    raise ValueError(f"k_hist {k_hist.shape} / v_hist {v_hist.shape} must be "
                     f"[{b}, C, {hkv}, {d}]")
  if not _triton.is_pow2(d) or d < 16:
    raise ValueError(f"head_dim={d} must be a power of two >= 16")
  g = hq // hkv
  block_q = max(16, min(config.block_q, _triton.next_pow2(c)))
  block_k = min(config.block_k, block_q)
  dtype = q.dtype
  k_hist, v_hist, k_chunk, v_chunk = (x.astype(dtype) for x in (k_hist, v_hist, k_chunk,
                                                                 v_chunk))
  cp = -(-c // block_q) * block_q
  if cp != c:  # padded keys sit past every real query's diagonal: never attended
    widen = lambda x: jnp.pad(x, ((0, 0), (0, cp - c), (0, 0), (0, 0)))  # noqa: E731
    q, k_chunk, v_chunk = widen(q), widen(k_chunk), widen(v_chunk)
  capp = -(-cap // block_k) * block_k
  if capp != cap:  # rows past hist_len are masked
    widen = lambda x: jnp.pad(x, ((0, 0), (0, capp - cap), (0, 0), (0, 0)))  # noqa: E731
    k_hist, v_hist = widen(k_hist), widen(v_hist)
  hist_len = jnp.clip(jnp.asarray(hist_len, jnp.int32), 0, cap)

  kernel = functools.partial(_kernel, scale=float(scale), block_q=block_q, block_k=block_k)
  kv_spec = lambda n: pl.BlockSpec((None, n, None, d), lambda bb, h, i: (bb, 0, h // g, 0))  # noqa: E731
  q_spec = pl.BlockSpec((None, block_q, None, d), lambda bb, h, i: (bb, i, h, 0))
  out = _triton.pallas_call(
      kernel,
      grid=(b, hq, cp // block_q),
      in_specs=[pl.BlockSpec((None,), lambda bb, h, i: (bb,)), q_spec,
                kv_spec(capp), kv_spec(capp), kv_spec(cp), kv_spec(cp)],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct((b, cp, hq, d), dtype),
      compiler_params=_triton.compiler_params(num_warps=config.num_warps,
                                              num_stages=config.num_stages),
      interpret=interpret,
      name="jaxkv_chunk_attention",
  )(hist_len, q, k_hist, v_hist, k_chunk, v_chunk)
  return out[:, :c]


__all__ = ["ChunkAttentionConfig", "chunk_attention_reference", "pallas_chunk_attention"]
