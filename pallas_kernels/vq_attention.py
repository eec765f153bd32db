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
are the M rows of the dots. The splits are merged in jnp (log-sum-exp).

Lane planes. The interleaved ``[block_k, D]`` tile is never built: a side
with vector ``v`` is computed as ``v`` planes of ``[block_k, n]``, plane
``l`` holding channels ``j*v + l`` (j < n). Per block and stage, the codes
are one contiguous ``[block_k, n]`` load (one byte per code) and each plane
is one ``[block_k, n]`` gather from the head's flattened codebook; 16-bit
codebooks are bitcast in the wrapper to uint32 words of two coordinates, so
a code costs ``v/2`` gathers (lane ``2w`` in the low half of word ``w``,
``2w + 1`` in the high half). Then ``q @ K^T = sum_l q_l @ K_l^T`` and
``o_l = p @ V_l``. The wrapper permutes q's channels into K's plane order
(``q_l`` is the contiguous column slice ``[l*n, (l+1)*n)``) and the merged
output back from V's plane order; the residual rows are read plane by plane
with strided loads. A side whose planes would be narrower than a Triton dot
(``n < 16``: ``v = 8`` at ``D = 64``) is one plane in channel order instead,
its tile built per element (`_gather_tile`). A lookup-table K path and a
codebook-centric V accumulation are the alternatives to measure on a GPU
(``bench/results/vq-NOTES.md``).

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

_MIN_DOT = 16  # smallest M, N or K of a Triton dot


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
    _triton.check_launch(self)

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
             capacity: int | None = None, sink_tokens: int = 0, skip_tokens: int = 0,
             block_k: int | None = None) -> tuple[bool, str]:
  """Whether the kernel handles this shape; ``(False, reason)`` if not (a format
  with ``sink_tokens`` needs ``skip_tokens`` >= them, a multiple of ``block_k``:
  `_triton.skip_refusal`)."""
  why = _triton.skip_refusal(sink_tokens, skip_tokens, block_k)
  if why:
    return False, why
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


@dataclasses.dataclass(frozen=True)
class _SideLayout:
  """How the kernel reads one side (module docstring, "Lane planes").

  Attributes:
    spec: the side's VQ parameters.
    planes: lane planes the side is computed in: ``spec.vector``, or 1 (one
      tile in channel order) when ``D / v`` is narrower than a Triton dot.
    pair_dtype: the 16-bit codebook dtype when centroids are gathered as
      uint32 words of two coordinates; None when gathered per coordinate.
  """

  spec: VQSideSpec
  planes: int
  pair_dtype: jnp.dtype | None

  @classmethod
  def of(cls, spec: VQSideSpec, head_dim: int, codebook_dtype) -> "_SideLayout":
    if spec.sub_spaces(head_dim) < _MIN_DOT:
      return cls(spec, 1, None)
    codebook_dtype = jnp.dtype(codebook_dtype)  # v is even (2, 4 or 8): words hold whole pairs
    return cls(spec, spec.vector, codebook_dtype if codebook_dtype.itemsize == 2 else None)

  def flat_codebook(self, codebook: jax.Array) -> jax.Array:
    """``[H, S, n, E, v]`` -> per kv head ``[H, S*n*E*v]``, or ``[H, S*n*E*v/2]``
    uint32 words (coordinate 2w in the low half of word w) for `pair_dtype`."""
    if self.pair_dtype is None:
      return codebook.reshape(codebook.shape[0], -1)
    pairs = codebook.reshape(*codebook.shape[:-1], -1, 2)  # [H, S, n, E, v/2, 2]
    return lax.bitcast_convert_type(pairs, jnp.uint32).reshape(codebook.shape[0], -1)


def _to_planes(x: jax.Array, planes: int) -> jax.Array:
  """Channel order -> plane order: ``out[..., l*n + j] = x[..., j*planes + l]``."""
  *lead, d = x.shape
  return x.reshape(*lead, d // planes, planes).swapaxes(-1, -2).reshape(*lead, d)


def _from_planes(x: jax.Array, planes: int) -> jax.Array:
  """Inverse of `_to_planes`."""
  *lead, d = x.shape
  return x.reshape(*lead, planes, d // planes).swapaxes(-1, -2).reshape(*lead, d)


def _gather_tile(codes_ref, codebook_ref, spec: VQSideSpec, t0, kb, head_dim):
  """Dequantized tokens ``[t0, t0 + kb)`` of one head as float32 ``[kb, D]``.

  The one-plane fallback. ``codes_ref [C, S*n]`` uint8, ``codebook_ref
  [S*n*E*v]`` (flattened ``[S, n, E, v]``). Both loads are gathers: the
  codes expanded to one per channel, then one centroid coordinate per channel.
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


def _gather_planes(codes_ref, codebook_ref, layout: _SideLayout, t0, kb, head_dim):
  """Dequantized tokens ``[t0, t0 + kb)`` as ``layout.planes`` float32 tiles.

  Returns a list whose entry ``l`` is ``[kb, D / planes]``: channels
  ``j * planes + l``. ``codes_ref [C, S*n]`` uint8; ``codebook_ref`` one kv
  head's `_SideLayout.flat_codebook`.
  """
  spec = layout.spec
  if layout.planes == 1:
    return [_gather_tile(codes_ref, codebook_ref, spec, t0, kb, head_dim)]
  n, vec = spec.sub_spaces(head_dim), spec.vector
  sub = lax.broadcasted_iota(jnp.int32, (1, n), 1)
  planes = [None] * vec
  for s in range(spec.stages):
    code = codes_ref[pl.ds(t0, kb), pl.ds(s * n, n)].astype(jnp.int32)  # [kb, n]
    entry = (s * n + sub) * spec.entries + code    # [kb, n] centroid of sub-vector j
    if layout.pair_dtype is None:
      parts = [codebook_ref[entry * vec + lane] for lane in range(vec)]
    else:
      parts = []
      for w in range(vec // 2):
        word = codebook_ref[entry * (vec // 2) + w]  # [kb, n] uint32: lanes 2w (low), 2w+1
        for half in (word & 0xFFFF, word >> 16):
          parts.append(lax.bitcast_convert_type(half.astype(jnp.uint16), layout.pair_dtype))
    planes = [p.astype(jnp.float32) if x is None else x + p.astype(jnp.float32)
              for x, p in zip(planes, parts)]
  return planes


def _vq_split_kernel(
    # inputs
    lengths_ref,     # [] int32: L_b
    scale_ref,       # [] float32: softmax scale
    q_ref,           # [M, D] (rows padded to M), channels in K's plane order
    k_codes_ref,     # [C, Sk*nk] uint8
    k_codebook_ref,  # [Sk*nk*Ek*vk] (or uint32 [Sk*nk*Ek*vk/2]) codebooks of this kv head
    v_codes_ref,     # [C, Sv*nv] uint8
    v_codebook_ref,  # [Sv*nv*Ev*vv] (or uint32 [Sv*nv*Ev*vv/2])
    k_res_ref,       # [R, D] channel order
    v_res_ref,       # [R, D] channel order
    # outputs
    o_ref,           # [M, D] float32, unnormalized, channels in V's plane order
    l_ref,           # [M] float32, softmax denominators
    m_ref,           # [M] float32, running maxima (-inf: no valid key)
    *,
    k_layout: _SideLayout,
    v_layout: _SideLayout,
    token_group: int,
    residual: int,
    num_queries: int,
    num_splits: int,
    block_k: int,
    res_block: int,
    skip_tokens: int = 0,
):
  rows, head_dim = o_ref.shape
  dtype = k_res_ref.dtype
  k_width, v_width = head_dim // k_layout.planes, head_dim // v_layout.planes
  split = pl.program_id(2)
  length = lengths_ref[()]
  sm_scale = scale_ref[()]
  packed = token_group * jnp.maximum(0, (length - residual + token_group) // token_group)
  # Row r is (query head h, new token s), r = h * S + s; it sees keys [0, L - S + s].
  row_limit = length - num_queries + lax.broadcasted_iota(jnp.int32, (rows,), 0) % num_queries
  q_planes = [q_ref[:, pl.ds(plane * k_width, k_width)].astype(dtype)
              for plane in range(k_layout.planes)]

  def scores(k_planes):  # q @ K^T, summed over K's planes
    s = None
    for q_l, k_l in zip(q_planes, k_planes):
      part = _dot_t(q_l, k_l.astype(dtype))
      s = part if s is None else s + part
    return s

  def online_softmax(s, valid, m, l):
    s = jnp.where(valid, s * sm_scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    return p, alpha, m_new, alpha * l + jnp.sum(p, axis=1)

  def accumulate(acc, alpha, p, v_planes):  # o_l = alpha * o_l + p @ V_l per plane
    p = p.astype(dtype)
    return tuple(alpha[:, None] * a + _dot(p, v.astype(dtype)) for a, v in zip(acc, v_planes))

  def packed_step(i, carry):
    m, l, acc = carry
    t0 = start + i * block_k
    t = t0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    in_packed = t < packed
    valid = in_packed[None, :] & (t[None, :] <= row_limit[:, None])
    k = _gather_planes(k_codes_ref, k_codebook_ref, k_layout, t0, block_k, head_dim)
    p, alpha, m, l = online_softmax(scores(k), valid, m, l)
    v = _gather_planes(v_codes_ref, v_codebook_ref, v_layout, t0, block_k, head_dim)
    v = [jnp.where(in_packed[:, None], v_l, 0.0) for v_l in v]
    return m, l, accumulate(acc, alpha, p, v)

  # This split's slice of the packed region (a multiple of block_k tokens);
  # with ``skip_tokens`` the caller attends [0, min(skip, packed)) itself.
  start, stop = _triton.split_range(packed, split, num_splits, block_k, skip_tokens)
  num_blocks = jnp.maximum(0, pl.cdiv(stop - start, block_k))
  carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
           tuple(jnp.zeros((rows, v_width), jnp.float32) for _ in range(v_layout.planes)))
  carry = lax.fori_loop(0, num_blocks, packed_step, carry)

  # The last split continues the same online softmax over the residual rows,
  # read plane by plane (plane l: every planes-th channel from l).
  num_res = length - packed

  def res_step(i, carry):
    m, l, acc = carry
    r0 = i * res_block
    idx = r0 + lax.broadcasted_iota(jnp.int32, (res_block,), 0)
    in_res = idx < num_res
    valid = in_res[None, :] & ((packed + idx)[None, :] <= row_limit[:, None])
    tok = pl.ds(r0, res_block)
    k = [k_res_ref[tok, pl.ds(plane, k_width, stride=k_layout.planes)]
         for plane in range(k_layout.planes)]
    p, alpha, m, l = online_softmax(scores(k), valid, m, l)
    v = [v_res_ref[tok, pl.ds(plane, v_width, stride=v_layout.planes)]
         for plane in range(v_layout.planes)]
    v = [jnp.where(in_res[:, None], v_l, 0) for v_l in v]
    return m, l, accumulate(acc, alpha, p, v)

  num_res_blocks = jnp.where(split == num_splits - 1, pl.cdiv(num_res, res_block), 0)
  m, l, acc = lax.fori_loop(0, num_res_blocks, res_step, carry)
  for plane, acc_l in enumerate(acc):
    o_ref[:, pl.ds(plane * v_width, v_width)] = acc_l
  l_ref[...] = l
  m_ref[...] = m


def combine_splits(o, l, m, return_lse: bool = False):
  """Log-sum-exp merge of the J split partials into ``[..., M, D]``.

  ``o [..., J, M, D]`` unnormalized outputs, ``l, m [..., J, M]`` sums and
  maxima. A row with no visible key (every ``l == 0``) gives zeros; a NaN
  stays NaN. ``return_lse``: also each row's log-sum-exp ``[..., M]`` (-inf
  where no key is visible).
  """
  m_all = jnp.max(m, axis=-2, keepdims=True)
  m_all = jnp.where(m_all == -jnp.inf, 0.0, m_all)
  w = jnp.exp(m - m_all)                                   # [..., J, M]
  num = jnp.sum(w[..., None] * o, axis=-3)
  den = jnp.sum(w * l, axis=-2)
  out = jnp.where((den == 0)[..., None], 0.0, num / jnp.where(den == 0, 1.0, den)[..., None])
  if not return_lse:
    return out
  lse = m_all[..., 0, :] + jnp.log(jnp.where(den == 0, 1.0, den))
  return out, jnp.where(den == 0, -jnp.inf, lse)


@functools.partial(
    jax.jit, static_argnames=("k_spec", "v_spec", "token_group", "config", "interpret",
                              "return_lse", "skip_tokens"))
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
    return_lse: bool = False,
    skip_tokens: int = 0,
) -> jax.Array | tuple[jax.Array, jax.Array]:
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
    return_lse: also return each query's log-sum-exp of its scaled scores
      (``[B, S, Hq]`` float32, -inf where no key is visible), as
      `dequant_attention.dequant_decode_attention`'s.
    skip_tokens: static; attend only the packed tokens ``[skip_tokens,
      packed_len)`` (and the residual): the caller attends the prefix itself
      (sink formats, `jaxkv.sink_attention`). A multiple of ``config.block_k``;
      0 traces the kernel unchanged.

  Returns:
    ``[B, S, Hq, D]`` in q's dtype (and the log-sum-exp with ``return_lse``).
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
  why = _triton.skip_refusal(0, skip_tokens, block_k)
  if why:
    raise ValueError(why)
  res_block = min(residual & -residual, 64)
  group_q = q_heads // kv_heads
  q_rows = group_q * num_queries
  rows = max(_MIN_DOT, _triton.next_pow2(q_rows))
  sm_scale = jnp.asarray(head_dim ** -0.5 if scale is None else scale, jnp.float32)
  if sm_scale.shape != ():
    raise ValueError(f"scale must be a scalar, got shape {sm_scale.shape}")

  k_layout = _SideLayout.of(k_spec, head_dim, k_codebook.dtype)
  v_layout = _SideLayout.of(v_spec, head_dim, v_codebook.dtype)
  # Rows r = h * S + s of kv head k's query block, zero-padded to the dot's M,
  # channels in K's plane order.
  qh = q.reshape(batch, num_queries, kv_heads, group_q, head_dim)
  qh = qh.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, q_rows, head_dim)
  qh = jnp.pad(_to_planes(qh, k_layout.planes), ((0, 0), (0, 0), (0, rows - q_rows), (0, 0)))
  k_flat = k_layout.flat_codebook(k_codebook)
  v_flat = v_layout.flat_codebook(v_codebook)
  num_parts = config.num_splits

  def per_head(x):  # one (b, h) slice of a [B, H, ...] array per program
    return pl.BlockSpec((None, None, *x.shape[2:]),
                        lambda b, h, j, _n=x.ndim - 2: (b, h) + (0,) * _n)

  def codebook_spec(x):  # one kv head's flattened codebooks
    return pl.BlockSpec((None, x.shape[1]), lambda b, h, j: (h, 0))

  per_seq = pl.BlockSpec((None,), lambda b, h, j: (b,))
  kernel = functools.partial(
      _vq_split_kernel, k_layout=k_layout, v_layout=v_layout, token_group=token_group,
      residual=residual, num_queries=num_queries, num_splits=num_parts, block_k=block_k,
      res_block=res_block, skip_tokens=skip_tokens)
  o_part, l_part, m_part = _triton.pallas_call(
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

  combined = combine_splits(o_part, l_part, m_part, return_lse=return_lse)
  out, lse = combined if return_lse else (combined, None)
  out = _from_planes(out[:, :, :q_rows], v_layout.planes)          # [B, H, q_rows, D]
  out = out.reshape(batch, kv_heads, group_q, num_queries, head_dim)
  out = out.transpose(0, 3, 1, 2, 4).reshape(batch, num_queries, q_heads, head_dim).astype(q.dtype)
  if not return_lse:
    return out
  lse = lse[:, :, :q_rows].reshape(batch, kv_heads, group_q, num_queries)
  return out, lse.transpose(0, 3, 1, 2).reshape(batch, num_queries, q_heads)


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
