"""Decode attention over caches with exact sink tokens (`KVFormat.sink_tokens` S > 0).

The packed storage of a sink format still holds the first S tokens quantized;
their exact values sit beside it (``k_sink, v_sink``). The split-K kernels
(Triton and Mosaic, KV and VQ) do not read those rows. Instead ("option 1" of
bench/results/vq-NOTES.md, sink tokens):

* the kernel attends the packed tokens ``[skip, packed_len)`` and the
  residual, ``skip`` the smallest multiple of its token block >= S
  (`pallas_kernels._triton.sink_skip`: block starts stay aligned), and
  returns its log-sum-exp;
* this module attends the prefix ``[0, min(skip, packed_len))`` exactly
  (float32): rows ``[0, S)`` from the sink rows, rows ``[S, skip)``
  dequantized from the packed storage (`prefix_rows`);
* the two softmax blocks are merged by their log-sum-exps (`merge_lse`, as
  `jaxkv.staged_cache` merges the staged rows).

On a GPU the prefix attention, the merge and the input policy's NaN rows run
in one Pallas Triton launch (`pallas_kernels.sink_prefix`) after one XLA
fusion that builds the prefix rows; elsewhere (and as its reference) in jnp.

The result is attention over ``cache.dequantize()`` (DESIGN.md, "Attention").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.cache import QuantizedKV
from pallas_kernels import sink_prefix
from pallas_kernels._triton import sink_skip

_HI = jax.lax.Precision.HIGHEST


def lse_attention(q, k, v, visible, scale):
  """Softmax attention of ``q [B, S, Hq, D]`` over the rows of ``k, v [B, Hkv, n, D]``
  (float32, GQA: ``Hq / Hkv`` query heads per kv head) where ``visible [B, S, n]``.

  Returns ``(out [B, S, Hq, D], lse [B, S, Hq])`` float32: the normalized output
  and the log-sum-exp of the scaled scores; a query that sees no row gives
  zeros and ``lse = -inf``. ``v`` must be finite wherever no query sees it.
  """
  b, s, hq, d = q.shape
  hkv = k.shape[1]
  qf = q.astype(jnp.float32).reshape(b, s, hkv, hq // hkv, d)
  logits = jnp.einsum("bshgd,bhnd->bshgn", qf, k.astype(jnp.float32), precision=_HI) * scale
  vis = visible[:, :, None, None, :]                                     # [B, S, 1, 1, n]
  logits = jnp.where(vis, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(vis, jnp.exp(logits - m[..., None]), 0.0)
  l = jnp.sum(p, axis=-1)                                                # [B, S, Hkv, G]
  o = jnp.einsum("bshgn,bhnd->bshgd", p, v.astype(jnp.float32), precision=_HI)
  safe = jnp.where(l > 0, l, 1.0)
  lse = jnp.where(l > 0, m + jnp.log(safe), -jnp.inf)
  return (o / safe[..., None]).reshape(b, s, hq, d), lse.reshape(b, s, hq)


def merge_lse(o_a, lse_a, o_b, lse_b):
  """Merges two normalized softmax blocks ``(o [..., D], lse [...])`` over disjoint
  keys into one ``(o, lse)`` (float32); a row empty in both stays zeros / -inf."""
  m = jnp.maximum(lse_a, lse_b)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w_a, w_b = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
  den = w_a + w_b
  safe = jnp.where(den > 0, den, 1.0)
  out = (o_a.astype(jnp.float32) * w_a[..., None] + o_b.astype(jnp.float32) * w_b[..., None])
  out = jnp.where((den > 0)[..., None], out / safe[..., None], 0.0)
  return out, jnp.where(den > 0, m + jnp.log(safe), -jnp.inf)


def _leading_rows(x, n: int, layer):
  """Rows ``[0, n)`` (axis -2) of ``x [B, H, C, X]``, or of layer ``layer`` of
  ``x [L, B, H, C, X]`` (one dynamic slice: only those rows are read)."""
  if layer is None:
    return x[:, :, :n]
  return jax.lax.dynamic_slice(x, (layer, 0, 0, 0, 0), (1, *x.shape[1:3], n, x.shape[-1]))[0]


def _side_rows(side: QuantizedKV, n: int, layer) -> jax.Array:
  """Packed rows ``[0, n)`` of a `QuantizedKV` as float32 ``[B, H, n, D]`` (whole
  token groups read for per-channel scales)."""
  per_channel = side.bits < 16 and side.axis == "channel"
  n_read = -(-n // side.group) * side.group if per_channel else n
  n_affine = n_read // side.group if per_channel else n_read
  take = lambda x, rows: None if x is None else _leading_rows(x, rows, layer)  # noqa: E731
  part = dataclasses.replace(side, codes=take(side.codes, n_read),
                             scale=take(side.scale, n_affine), zero=take(side.zero, n_affine))
  return part.dequantize()[:, :, :n]


def _overlay_sinks(rows: jax.Array, sink: jax.Array, lengths: jax.Array) -> jax.Array:
  """``rows [B, H, n, D]`` (float32) with rows ``[0, min(S, L_b))`` taken from ``sink
  [B, S, H, D]``: a static slice and pad, no gather (`jaxkv.cache.sink_rows` at
  start 0), so it fuses with the dequantization."""
  n, s = rows.shape[2], sink.shape[1]
  exact = jnp.swapaxes(sink[:, :min(s, n)], 1, 2).astype(jnp.float32)  # [B, H, min(S, n), D]
  exact = jnp.pad(exact, ((0, 0), (0, 0), (0, n - exact.shape[2]), (0, 0)))
  pos = jnp.arange(n)[None, :]
  use = (pos < s) & (pos < lengths[:, None])                            # [B, n]
  return jnp.where(use[:, None, :, None], exact, rows)


def prefix_rows(cache, n: int, layer=None) -> jax.Array:
  """K and V of tokens ``[0, n)`` as one float32 ``[B, Hkv, 2, n, D]`` (K at index 0):
  the exact sink rows ``[0, min(S, L_b))``, the packed storage dequantized after
  them (garbage past ``packed_len``); elementwise ops, a slice and a pad per side
  and a stack, which XLA fuses into one kernel. ``cache``: a `KVCache` or
  `jaxkv.VQCache`, or (with ``layer``) a `ModelCache`'s stacked arrays read at
  that layer."""
  from jaxkv.vq_cache import VQCache  # pylint: disable=import-outside-toplevel
  if isinstance(cache, VQCache):
    if layer is not None:  # VQ layer views reach here materialized (`vq_decode_attention`)
      raise TypeError("prefix_rows reads a VQ cache's own layer only: pass a VQCache "
                      f"with layer=None, got layer={layer!r}")
    from pallas_kernels.vq_attention import vq_dequantize  # pylint: disable=import-outside-toplevel
    k = vq_dequantize(cache.k_codes[:, :, :n], cache.k_codebook)
    v = vq_dequantize(cache.v_codes[:, :, :n], cache.v_codebook)
  else:
    k, v = _side_rows(cache.k, n, layer), _side_rows(cache.v, n, layer)
  k_sink, v_sink = (x if layer is None else x[layer] for x in (cache.k_sink, cache.v_sink))
  return jnp.stack([_overlay_sinks(k.astype(jnp.float32), k_sink, cache.lengths),
                    _overlay_sinks(v.astype(jnp.float32), v_sink, cache.lengths)], axis=2)


def _prefix_len(cache, skip: int) -> int:
  """Static rows of the prefix: ``min(skip, storage)``."""
  storage = (cache.k_codes if hasattr(cache, "k_codes") else cache.k.codes).shape[-2]
  return min(skip, storage)


def prefix_attention(q, cache, skip: int, *, scale, layer=None):
  """Exact attention of ``q [B, S, Hq, D]`` over the tokens ``[0, min(skip,
  packed_len))`` of ``cache`` (`prefix_rows`), with the kernels' causal rule
  (query ``s`` sees tokens ``<= L - S + s``). Returns ``(out, lse)`` as
  `lse_attention`; a sequence whose prefix is empty gives zeros / -inf."""
  n = _prefix_len(cache, skip)
  kv = prefix_rows(cache, n, layer)                                     # [B, Hkv, 2, n, D]
  k, v = kv[:, :, 0], kv[:, :, 1]
  s = q.shape[1]
  rows = jnp.arange(n)
  in_packed = rows[None, :] < cache.fmt.packed_len(cache.lengths)[:, None]           # [B, n]
  limit = cache.lengths[:, None] - s + jnp.arange(s)[None, :]                       # [B, S]
  visible = in_packed[:, None, :] & (rows[None, None, :] <= limit[:, :, None])       # [B, S, n]
  v = jnp.where(in_packed[:, None, :, None], v, 0.0)  # stale rows past packed_len never reach o
  return lse_attention(q, k, v, visible, scale)


def _on_gpu() -> bool:  # the default of ``use_kernel`` (tests patch it)
  return jax.default_backend() == "gpu"


# Prefix rows up to which the fused kernel is the default on a GPU. Measured on
# an H200 (2026-11-27, bench/results/vq-NOTES.md): 64 rows (kivi2-g32-s4, Triton
# block 64) 7.9 us, faster than the ~10 us of the jnp path's XLA kernels; 128
# rows (cq2-s4, Mosaic VQ block 128) 19.4 us, slower than their ~16 us.
PREFIX_KERNEL_MAX_ROWS = 64


def _interpret() -> bool:  # Pallas interpret mode off a GPU (tests lowering for CUDA patch it)
  return jax.default_backend() != "gpu"


def sink_decode_attention(q, cache, kernel, *, block: int, scale, seq_bad, layer=None,
                          return_lse: bool = False, use_kernel: bool | None = None):
  """Decode attention over a sink-format cache: ``kernel(return_lse=True,
  skip_tokens=skip)`` -> ``(out, lse)`` (a split-K kernel of ``block``-token
  steps over ``[skip, packed_len)`` and the residual, ``skip =
  sink_skip(S, block)``) merged with
  `prefix_attention`; NaN rows as `jaxkv.decode_attention` (README "Input
  policy": NaN/inf query rows and sequences flagged ``seq_bad [B]``).

  ``use_kernel`` (default: on a GPU for prefixes of at most
  `PREFIX_KERNEL_MAX_ROWS` rows): the prefix, merge and NaN rows in one
  Pallas launch (`pallas_kernels.sink_prefix`; interpret mode off a GPU)
  after one XLA fusion building the rows; else the jnp path here (its
  reference: `prefix_attention`, `merge_lse`, `_poison`).

  Returns ``[B, S, Hq, D]`` in q's dtype (and the merged ``[B, S, Hq]``
  float32 log-sum-exp with ``return_lse``).
  """
  from jaxkv.attention import _poison  # pylint: disable=import-outside-toplevel
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  skip = sink_skip(cache.fmt.sink_tokens, block)
  o_kernel, lse_kernel = kernel(return_lse=True, skip_tokens=skip)
  n = _prefix_len(cache, skip)
  if use_kernel is None:
    use_kernel = _on_gpu() and n <= PREFIX_KERNEL_MAX_ROWS
  if use_kernel and n > 0 and sink_prefix.supported(q.shape[-1]):
    # one XLA fusion builds the rows, one launch attends them, merges and poisons
    out, lse = sink_prefix.sink_prefix_attention(
        q, prefix_rows(cache, n, layer), cache.lengths, cache.fmt.packed_len(cache.lengths),
        o_kernel, lse_kernel, scale=scale, seq_bad=seq_bad,
        interpret=_interpret())
    return (out, lse) if return_lse else out
  o_prefix, lse_prefix = prefix_attention(q, cache, skip, scale=scale, layer=layer)
  out, lse = merge_lse(o_kernel, lse_kernel, o_prefix, lse_prefix)
  out = _poison(out, q, seq_bad).astype(q.dtype)
  return (out, lse) if return_lse else out
