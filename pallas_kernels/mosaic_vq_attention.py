"""Split-K decode attention over a VQ cache for Hopper (Pallas Mosaic GPU).

The Triton VQ kernel (`pallas_kernels.vq_attention`) gathers every centroid
coordinate from L1/L2 and is bound by those gathers (about 0.2x of BF16
attention, `bench/results/vq-NOTES.md`). This one is the tokens-on-M Mosaic
kernel of `pallas_kernels.mosaic_attention` (``S^T = K q^T``, ``O^T += V^T
P^T``, split-K, the residual as one more program, the `combine_t` merge)
with the codebooks in shared memory, VQ-LLM's point:

- each packed program copies its kv head's K and V codebooks (``[n, E, v]``
  each, converted to the cache dtype in the wrapper: 64 KiB per side at
  D = 128, E = 256) into shared memory once, before its pipeline;
- per 64-token block the code tiles arrive by TMA (``D / v`` bytes per
  token and side), and `mosaic_dequant.gather_codebook` turns them into the
  ``[bk, D]`` wgmma operand with one ``ld.shared`` of ``2 v`` bytes per code
  (each thread holds a contiguous quarter of the channels,
  `mosaic_dequant.vq_permutation`): the K operand stays in registers, the V
  tile is stored to shared memory for the value MMA;
- q's channels are permuted once in the wrapper, and the packed programs'
  outputs are read back in that order by the combine.

Scope (`supports`): one VQ stage per side, ``D / v >= 16`` codes per token,
head_dim 64/128, bfloat16/float16 caches, (Hq/Hkv) x S <= 64, token group,
residual and capacity multiples of ``block_k``. The centroids enter the MMA
in the cache dtype, as in the Triton VQ kernel. `vq_attention
.vq_decode_attention_reference` is the spec.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

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
             block_k: int = 64) -> tuple[bool, str]:
  """Whether the Mosaic VQ kernel serves this case; ``(False, reason)`` if not."""
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


def default_config(*, batch: int, tokens: int, kv_heads: int,
                   num_sms: int = 132) -> ma.MosaicAttentionConfig:
  """One CTA per SM (the two codebooks take most of its shared memory): one
  wave of ``num_sms`` programs, less one per (b, h) for the residual program
  when that is many, at least 4 blocks per split; 64-token blocks, 4 stages.
  Not yet tuned on a GPU."""
  block_k = 64
  blocks = max(1, tokens // block_k)
  programs = max(1, num_sms // max(1, batch * kv_heads))
  want = programs - 1 if programs > 16 else programs
  splits = max(1, min(want, blocks // 4, 64))
  return ma.MosaicAttentionConfig(block_k=block_k, num_splits=splits, max_concurrent_steps=4)


@functools.partial(jax.jit, static_argnames=("k_spec", "v_spec", "token_group", "config"))
def mosaic_vq_decode_attention(
    q: jax.Array,           # [B, S, Hq, D]
    k_codes: jax.Array,     # [B, H, C, nk] uint8
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
) -> jax.Array:
  """Decode attention of S new queries over a VQ cache (Hopper kernel).

  Same arguments and result as `vq_attention.vq_decode_attention` (raw VQ
  cache arrays, ``scale`` a float or a traced scalar, default ``D ** -0.5``);
  ``config`` a `MosaicAttentionConfig` (its register/fold flags do not apply).
  Returns ``[B, S, Hq, D]`` in q's dtype. ValueError when `supports` refuses.
  """
  batch, num_queries, q_heads, head_dim = q.shape
  kv_heads, capacity = k_codes.shape[1], k_codes.shape[2]
  residual = k_residual.shape[2]
  dtype = k_residual.dtype
  if q_heads % kv_heads:
    raise ValueError(f"num query heads Hq={q_heads} must be a multiple of {kv_heads=}")
  group_q = q_heads // kv_heads
  q_rows = group_q * num_queries
  if config is None:
    config = default_config(batch=batch, tokens=capacity, kv_heads=kv_heads)
  ok, why = supports(head_dim=head_dim, k_spec=k_spec, v_spec=v_spec, q_rows=q_rows,
                     dtype=dtype, token_group=token_group, residual=residual,
                     capacity=capacity, block_k=config.block_k)
  if not ok:
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
    # One kv head's [n, E, v] codebook in the MMA's dtype, as 128-element rows.
    books.append((spec.vector, spec.entries,
                  cb[:, 0].astype(dtype).reshape(kv_heads, head_dim * spec.entries // 128, 128)))
  sm_scale = jnp.asarray(head_dim ** -0.5 if scale is None else scale, jnp.float32)
  if sm_scale.shape != ():
    raise ValueError(f"scale must be a scalar, got shape {sm_scale.shape}")

  # Query rows r = h * S + s of each kv head, scaled, padded to the score MMA's N.
  n_pad = ma._rows_n(q_rows, smallest=8)  # pylint: disable=protected-access
  qh = q.reshape(batch, num_queries, kv_heads, group_q, head_dim)
  qh = qh.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, q_rows, head_dim)
  qh = (qh.astype(jnp.float32) * sm_scale).astype(dtype)
  qh = jnp.pad(qh, ((0, 0), (0, 0), (0, n_pad - q_rows), (0, 0)))
  perm = mosaic_dequant.vq_permutation(head_dim)
  placeholder = SideSpec(16)  # the side specs of the quantized formats do not apply
  o_part, l_part, m_part = ma._tokens_m_call(  # pylint: disable=protected-access
      qh[..., perm], qh, [k_codes], [v_codes], k_residual, v_residual,
      lengths.astype(jnp.int32), k_side=placeholder, v_side=placeholder,
      token_group=token_group, residual=residual, num_queries=num_queries, q_rows=q_rows,
      config=config, dtype=dtype, vq=tuple(books))
  out = combine_t.combine_t(o_part, l_part, m_part, rows=_triton.next_pow2(q_rows),
                            packed_rows=np.argsort(perm), out_dtype=q.dtype)
  out = out[:, :, :q_rows].reshape(batch, kv_heads, group_q, num_queries, head_dim)
  return out.transpose(0, 3, 1, 2, 4).reshape(batch, num_queries, q_heads, head_dim)


__all__ = ["default_config", "mosaic_vq_decode_attention", "supports"]
