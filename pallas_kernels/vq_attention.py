"""Split-K decode attention over a vector-quantized KV cache (Pallas Triton).

VQ layout (VQ-LLM; `jaxkv.vq` learns the codebooks). A head of ``D``
channels is cut into ``n = D / v`` sub-vectors of ``v`` consecutive channels
(``v`` in 2, 4, 8). Each side (K or V) has, per kv head, ``S`` stages (1, or
2 for residual VQ) of one codebook of ``E = 2^b`` entries per sub-space:

    codebook  [H, S, n, E, v]          float (the format's codebook dtype)
    codes     [B, H, C, S * n] uint8   column ``s * n + j``: stage s, sub-vector j
    x_hat[b, h, t, j*v + i] = sum_s codebook[h, s, j, codes[b, h, t, s*n + j], i]

the stages summed in order, in float32 (`vq_dequantize`).

Kernel design (one of the two the issue allows: centroids gathered into the
dot operands). Grid ``(batch, kv_head, split)`` as in
`pallas_kernels.dequant_attention`: each split walks a contiguous slice of
the packed region, the last one continues over the full-precision residual
block; all ``Hq/Hkv`` query heads times ``S`` new queries of one kv head
are the M rows of the dots. Per block of ``block_k`` tokens, each stage's
codes are loaded expanded to ``[block_k, D]`` (one gather load that reads
every code byte ``v`` times, from L1) and turned into centroid values by a
second gather load from the head's flattened codebook; the summed tile is a
plain dot operand (``q @ K^T``, ``p @ V``). The splits are merged in jnp
(log-sum-exp). A lookup-table K path and a codebook-centric V accumulation
are the alternatives to measure on a GPU (``bench/results/vq-NOTES.md``).

Dot operands are in the cache dtype (float32 caches: IEEE float32 dots at
HIGHEST precision). Unlike `dequant_attention`, nothing is rescaled for a
float16 cache: q and the centroid sums must fit float16's range there.

This module imports nothing from `jaxkv`; `vq_decode_attention_reference`
beside the kernel is its spec.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _triton

_MIN_ROWS = 16  # smallest M of a Triton dot


@dataclasses.dataclass(frozen=True)
class VQSideSpec:
  """Static description of one VQ side (K or V).

  Attributes:
    vector: channels per sub-vector (2, 4 or 8).
    entries: codebook entries ``2^b`` (at most 256: uint8 codes).
    stages: residual VQ stages (1 or 2).
  """

  vector: int
  entries: int
  stages: int

  def __post_init__(self):
    if self.vector not in (2, 4, 8):
      raise ValueError(f"vector={self.vector!r} must be 2, 4 or 8 channels")
    if not _triton.is_pow2(self.entries) or not 2 <= self.entries <= 256:
      raise ValueError(f"entries={self.entries!r} must be a power of two in [2, 256]")
    if self.stages not in (1, 2):
      raise ValueError(f"stages={self.stages!r} must be 1 or 2")

  def sub_spaces(self, head_dim: int) -> int:
    """Sub-vectors per head, ``n = D / v``."""
    if head_dim % self.vector:
      raise ValueError(f"head_dim={head_dim} must be a multiple of vector={self.vector}")
    return head_dim // self.vector

  def code_width(self, head_dim: int) -> int:
    """uint8 codes per token per head, ``S * D / v``."""
    return self.stages * self.sub_spaces(head_dim)

  def codebook_shape(self, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (kv_heads, self.stages, self.sub_spaces(head_dim), self.entries, self.vector)


def vq_dequantize(codes: jax.Array, codebook: jax.Array) -> jax.Array:
  """Centroid sums: float32 ``[B, H, T, n*v]``.

  Args:
    codes: ``[B, H, T, S*n]`` uint8.
    codebook: ``[H, S, n, E, v]``.
  """
  h, stages, n, _, vec = codebook.shape
  b, _, t, _ = codes.shape
  idx = codes.astype(jnp.int32).reshape(b, h, t, stages, n)
  heads = jnp.arange(h)[None, :, None, None]
  subs = jnp.arange(n)[None, None, None, :]
  x = None
  for s in range(stages):
    part = codebook[:, s].astype(jnp.float32)[heads, subs, idx[:, :, :, s]]  # [B, H, T, n, v]
    x = part if x is None else x + part
  return x.reshape(b, h, t, n * vec)


@dataclasses.dataclass(frozen=True)
class VQAttentionConfig:
  """Launch parameters of the VQ split-K attention kernel.

  Attributes:
    block_k: packed tokens per inner-loop step (power of two in [16, 256]).
    num_splits: programs per (batch, kv head) over the packed region (the
      last also takes the residual block).
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining depth of the inner loop.

  Search space (to measure on a GPU): block_k in {32, 64, 128}, num_splits
  around the heuristic (x1/2, x1, x2), num_warps in {2, 4, 8}, num_stages in
  {1, 2, 3}.
  """

  block_k: int = 64
  num_splits: int = 8
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if not _triton.is_pow2(self.block_k) or not 16 <= self.block_k <= 256:
      raise ValueError(f"block_k={self.block_k} must be a power of two in [16, 256]")
    if self.num_splits < 1:
      raise ValueError(f"num_splits={self.num_splits} must be >= 1")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps={self.num_warps} must be a power of two <= 16")
    if self.num_stages < 1:
      raise ValueError(f"num_stages={self.num_stages} must be >= 1")

  @classmethod
  def default(cls, *, batch: int, tokens: int, kv_heads: int,
              num_sms: int | None = None) -> "VQAttentionConfig":
    """Heuristic (unmeasured): ~2 programs per SM, >= 2 blocks per split."""
    num_sms = num_sms or _triton.num_sms()
    block_k = 64
    blocks = max(1, pl.cdiv(tokens, block_k))
    want = pl.cdiv(2 * num_sms, batch * kv_heads)
    splits = min(_triton.prev_pow2(want), max(1, blocks // 2), 256)
    return cls(block_k=block_k, num_splits=max(1, splits))


def supports(*, head_dim: int, k_spec: VQSideSpec, v_spec: VQSideSpec,
             num_q_heads: int | None = None, kv_heads: int | None = None,
             num_queries: int | None = None, residual: int | None = None,
             capacity: int | None = None) -> tuple[bool, str]:
  """Whether the kernel handles this shape; ``(False, reason)`` if not."""
  if not _triton.is_pow2(head_dim) or not 32 <= head_dim <= 256:
    return False, f"head_dim={head_dim} must be a power of two in [32, 256]"
  for name, spec in (("K", k_spec), ("V", v_spec)):
    if head_dim % spec.vector:
      return False, f"{name}: head_dim={head_dim} must be a multiple of vector={spec.vector}"
  if residual is not None and (residual & -residual) < 16:
    return False, f"residual={residual} must be a multiple of 16"
  if num_q_heads is not None and kv_heads is not None:
    if num_q_heads % kv_heads:
      return False, f"num_q_heads={num_q_heads} must be a multiple of {kv_heads=}"
    rows = num_q_heads // kv_heads * (num_queries or 1)
    if rows > 128:
      return False, f"(Hq/Hkv)*S={rows} query rows per kv head must be <= 128"
  if capacity is not None and capacity % 16:
    return False, f"capacity={capacity} must be a multiple of 16"
  return True, ""


def _dot(a, b):
  return jnp.dot(a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _dot_t(a, b):
  """``a @ b.T``."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def _gather_tile(codes_ref, codebook_ref, spec: VQSideSpec, t0, kb, head_dim):
  """Dequantized tokens ``[t0, t0 + kb)`` of one head as float32 ``[kb, D]``.

  ``codes_ref [C, S*n]`` uint8, ``codebook_ref [S*n*E*v]`` (flattened
  ``[S, n, E, v]``). Both loads are gathers: the codes expanded to one per
  channel, then one centroid coordinate per channel.
  """
  n = head_dim // spec.vector
  tok = t0 + lax.broadcasted_iota(jnp.int32, (kb, 1), 0)
  col = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
  sub, lane = col // spec.vector, col % spec.vector
  x = None
  for s in range(spec.stages):
    code = codes_ref[tok, s * n + sub].astype(jnp.int32)             # [kb, D]
    flat = ((s * n + sub) * spec.entries + code) * spec.vector + lane  # [kb, D]
    part = codebook_ref[flat].astype(jnp.float32)
    x = part if x is None else x + part
  return x


def _vq_split_kernel(
    # inputs
    lengths_ref,     # [] int32: L_b
    scale_ref,       # [] float32: softmax scale
    q_ref,           # [M, D] (rows padded to M)
    k_codes_ref,     # [C, Sk*nk] uint8
    k_codebook_ref,  # [Sk*nk*Ek*vk] flattened codebooks of this kv head
    v_codes_ref,     # [C, Sv*nv] uint8
    v_codebook_ref,  # [Sv*nv*Ev*vv]
    k_res_ref,       # [R, D]
    v_res_ref,       # [R, D]
    # outputs
    o_ref,           # [M, D] float32, unnormalized
    l_ref,           # [M] float32, softmax denominators
    m_ref,           # [M] float32, running maxima (-inf: no valid key)
    *,
    k_spec: VQSideSpec,
    v_spec: VQSideSpec,
    token_group: int,
    residual: int,
    num_queries: int,
    num_splits: int,
    block_k: int,
    res_block: int,
):
  rows, head_dim = o_ref.shape
  dtype = k_res_ref.dtype
  split = pl.program_id(2)
  length = lengths_ref[()]
  sm_scale = scale_ref[()]
  packed = token_group * jnp.maximum(0, (length - residual + token_group) // token_group)
  # Row r is (query head h, new token s), r = h * S + s; it sees keys [0, L - S + s].
  row_limit = length - num_queries + lax.broadcasted_iota(jnp.int32, (rows,), 0) % num_queries
  q = q_ref[...].astype(dtype)

  def online_softmax(s, valid, m, l):
    s = jnp.where(valid, s * sm_scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    return p, alpha, m_new, alpha * l + jnp.sum(p, axis=1)

  def packed_step(i, carry):
    m, l, acc = carry
    t0 = start + i * block_k
    t = t0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    in_packed = t < packed
    valid = in_packed[None, :] & (t[None, :] <= row_limit[:, None])
    k = _gather_tile(k_codes_ref, k_codebook_ref, k_spec, t0, block_k, head_dim)
    p, alpha, m, l = online_softmax(_dot_t(q, k.astype(dtype)), valid, m, l)
    v = _gather_tile(v_codes_ref, v_codebook_ref, v_spec, t0, block_k, head_dim)
    v = jnp.where(in_packed[:, None], v, 0.0)
    return m, l, alpha[:, None] * acc + _dot(p.astype(dtype), v.astype(dtype))

  # This split's slice of the packed region (a multiple of block_k tokens).
  per_split = pl.cdiv(pl.cdiv(packed, num_splits), block_k) * block_k
  start = split * per_split
  stop = jnp.minimum(start + per_split, packed)
  num_blocks = jnp.maximum(0, pl.cdiv(stop - start, block_k))
  carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, head_dim), jnp.float32))
  carry = lax.fori_loop(0, num_blocks, packed_step, carry)

  # The last split continues the same online softmax over the residual rows.
  num_res = length - packed

  def res_step(i, carry):
    m, l, acc = carry
    r0 = i * res_block
    idx = r0 + lax.broadcasted_iota(jnp.int32, (res_block,), 0)
    in_res = idx < num_res
    valid = in_res[None, :] & ((packed + idx)[None, :] <= row_limit[:, None])
    tok = pl.ds(r0, res_block)
    p, alpha, m, l = online_softmax(_dot_t(q, k_res_ref[tok, :]), valid, m, l)
    v = jnp.where(in_res[:, None], v_res_ref[tok, :], 0)
    return m, l, alpha[:, None] * acc + _dot(p.astype(dtype), v)

  num_res_blocks = jnp.where(split == num_splits - 1, pl.cdiv(num_res, res_block), 0)
  m, l, acc = lax.fori_loop(0, num_res_blocks, res_step, carry)
  o_ref[...] = acc
  l_ref[...] = l
  m_ref[...] = m


def combine_splits(o, l, m):
  """Log-sum-exp merge of the J split partials into ``[..., M, D]``.

  ``o [..., J, M, D]`` unnormalized outputs, ``l, m [..., J, M]`` sums and
  maxima. A row with no visible key (every ``l == 0``) gives zeros; a NaN
  stays NaN.
  """
  m_all = jnp.max(m, axis=-2, keepdims=True)
  m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
  w = jnp.exp(m - m_all)                                   # [..., J, M]
  num = jnp.sum(w[..., None] * o, axis=-3)
  den = jnp.sum(w * l, axis=-2)
  return jnp.where((den == 0)[..., None], 0.0, num / jnp.where(den == 0, 1.0, den)[..., None])


@functools.partial(
    jax.jit, static_argnames=("k_spec", "v_spec", "token_group", "config", "interpret"))
def vq_decode_attention(
    q: jax.Array,           # [B, S, Hq, D]
    k_codes: jax.Array,     # [B, H, C, Sk*nk] uint8
    k_codebook: jax.Array,  # [H, Sk, nk, Ek, vk]
    v_codes: jax.Array,     # [B, H, C, Sv*nv] uint8
    v_codebook: jax.Array,  # [H, Sv, nv, Ev, vv]
    k_residual: jax.Array,  # [B, H, R, D]
    v_residual: jax.Array,  # [B, H, R, D]
    lengths: jax.Array,     # [B] int32, total tokens per sequence
    *,
    k_spec: VQSideSpec,
    v_spec: VQSideSpec,
    token_group: int,
    scale: float | jax.Array | None = None,
    config: VQAttentionConfig | None = None,
    interpret: bool = False,
) -> jax.Array:
  """Decode attention of S new queries over a VQ cache (raw arrays).

  Args:
    q: ``[B, S, Hq, D]`` queries of the S newest tokens (already in the cache).
    k_codes, k_codebook, v_codes, v_codebook: the VQ storage (module docstring).
    k_residual, v_residual: ``[B, H, R, D]`` full-precision newest tokens.
    lengths: ``[B]`` total tokens ``L_b`` per sequence; the first
      ``G * max(0, (L - R + G) // G)`` are quantized.
    k_spec, v_spec: the sides' VQ parameters.
    token_group: G, the flush granularity of the cache.
    scale: softmax scale, default ``D ** -0.5`` (a float or a scalar array).
    config: launch parameters; `VQAttentionConfig.default` when None.
    interpret: run in Pallas interpret mode (CPU).

  Returns:
    ``[B, S, Hq, D]`` in q's dtype.
  """
  batch, num_queries, q_heads, head_dim = q.shape
  kv_heads, capacity = k_codes.shape[1], k_codes.shape[2]
  residual = k_residual.shape[2]
  ok, why = supports(head_dim=head_dim, k_spec=k_spec, v_spec=v_spec, num_q_heads=q_heads,
                     kv_heads=kv_heads, num_queries=num_queries, residual=residual,
                     capacity=capacity)
  if not ok:
    raise ValueError(why)
  for name, cb, spec in (("k_codebook", k_codebook, k_spec), ("v_codebook", v_codebook, v_spec)):
    if cb.shape != spec.codebook_shape(kv_heads, head_dim):
      raise ValueError(f"{name}.shape={cb.shape} must be "
                       f"{spec.codebook_shape(kv_heads, head_dim)} for {spec}")
  if config is None:
    config = VQAttentionConfig.default(batch=batch, tokens=capacity, kv_heads=kv_heads)
  block_k = config.block_k
  if capacity % block_k:
    raise ValueError(f"cache capacity {capacity} must be a multiple of block_k={block_k}")
  res_block = min(residual & -residual, 64)
  group_q = q_heads // kv_heads
  q_rows = group_q * num_queries
  rows = max(_MIN_ROWS, _triton.next_pow2(q_rows))
  sm_scale = jnp.asarray(head_dim ** -0.5 if scale is None else scale, jnp.float32)
  if sm_scale.shape != ():
    raise ValueError(f"scale must be a scalar, got shape {sm_scale.shape}")

  # Rows r = h * S + s of kv head k's query block, zero-padded to the dot's M.
  qh = q.reshape(batch, num_queries, kv_heads, group_q, head_dim)
  qh = qh.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, q_rows, head_dim)
  qh = jnp.pad(qh, ((0, 0), (0, 0), (0, rows - q_rows), (0, 0)))
  k_flat = k_codebook.reshape(kv_heads, -1)
  v_flat = v_codebook.reshape(kv_heads, -1)
  num_parts = config.num_splits

  def per_head(x):  # one (b, h) slice of a [B, H, ...] array per program
    return pl.BlockSpec((None, None, *x.shape[2:]),
                        lambda b, h, j, _n=x.ndim - 2: (b, h) + (0,) * _n)

  def codebook_spec(x):  # one kv head's flattened codebooks
    return pl.BlockSpec((None, x.shape[1]), lambda b, h, j: (h, 0))

  per_seq = pl.BlockSpec((None,), lambda b, h, j: (b,))
  kernel = functools.partial(
      _vq_split_kernel, k_spec=k_spec, v_spec=v_spec, token_group=token_group,
      residual=residual, num_queries=num_queries, num_splits=num_parts, block_k=block_k,
      res_block=res_block)
  o_part, l_part, m_part = pl.pallas_call(
      kernel,
      grid=(batch, kv_heads, num_parts),
      in_specs=[per_seq, per_seq, per_head(qh), per_head(k_codes), codebook_spec(k_flat),
                per_head(v_codes), codebook_spec(v_flat), per_head(k_residual),
                per_head(v_residual)],
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
      name=f"jaxkv_vq_attention_k{k_spec.vector}x{k_spec.stages}v{v_spec.vector}x{v_spec.stages}",
  )(lengths.astype(jnp.int32), jnp.broadcast_to(sm_scale, (batch,)), qh, k_codes, k_flat,
    v_codes, v_flat, k_residual, v_residual)

  out = combine_splits(o_part, l_part, m_part)[:, :, :q_rows]  # [B, H, q_rows, D]
  out = out.reshape(batch, kv_heads, group_q, num_queries, head_dim)
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, num_queries, q_heads, head_dim).astype(q.dtype)


def vq_decode_attention_reference(
    q, k_codes, k_codebook, v_codes, v_codebook, k_residual, v_residual, lengths, *,
    token_group: int, scale: float | None = None) -> jax.Array:
  """The spec (plain jnp, float32): exact attention over the dequantized VQ cache."""
  batch, num_queries, q_heads, head_dim = q.shape
  kv_heads, capacity = k_codes.shape[1], k_codes.shape[2]
  residual = k_residual.shape[2]
  g = token_group
  packed = g * jnp.maximum(0, (lengths - residual + g) // g)
  # Token t of sequence b lives at packed row t (t < P) or residual row t - P.
  t = jnp.arange(capacity + residual)
  in_packed = t[None, :] < packed[:, None]
  res_idx = jnp.clip(t[None, :] - packed[:, None], 0, residual - 1)

  def assemble(codes, codebook, res_x):
    x = jnp.pad(vq_dequantize(codes, codebook), ((0, 0), (0, 0), (0, residual), (0, 0)))
    res = jnp.take_along_axis(res_x.astype(jnp.float32), res_idx[:, None, :, None], axis=2)
    return jnp.where(in_packed[:, None, :, None], x, res)   # [B, H, C + R, D]

  k = assemble(k_codes, k_codebook, k_residual)
  v = assemble(v_codes, v_codebook, v_residual)
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
