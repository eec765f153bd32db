"""`VQCache`: a functional, fixed-capacity, vector-quantized KV cache (one layer).

The sibling of `jaxkv.KVCache` for `jaxkv.vq.VQFormat`: the same residual
rule (DESIGN.md "The contract": tokens ``[packed_len(L), L)`` sit exactly in
a full-precision residual block of ``R`` rows and are flushed in whole groups
of ``G`` tokens), the same ragged lengths, overflow and non-finite flags, the
same staging helpers (`jaxkv.cache.stage_residual`, `shift_residual`,
`flush_groups`). What differs is the packed region: uint8 codebook indices
(`pallas_kernels.vq_attention` layout) and the layer's codebooks, both
pytree leaves, so the cache flows through `jit`, `lax.scan` and donation.

VQ quantizes each token on its own, so any sequence of `prefill`/`append`
calls gives the same cache as quantizing the whole history at once, bit for
bit. A NaN/inf cannot be stored in a code: an eager update holding one
raises `ValueError`; under `jit` the sequence's ``nonfinite`` flag is set and
`jaxkv.decode_attention` returns NaN for all of its outputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv import vq
from jaxkv.cache import (STORAGE_ALIGN, ResidualBlockCache, _static, check_dims,
                         appended_sinks, empty_sinks, nonfinite_rows, with_sinks)
from jaxkv.model_cache import check_layer_index
from pallas_kernels.vq_attention import vq_dequantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VQCache(ResidualBlockCache):
  """Vector-quantized KV cache for a batch of sequences, one attention layer.

  Attributes:
    k_codes, v_codes: ``[B, Hkv, C, S*n]`` uint8 codebook indices of the
      packed tokens (``C`` storage rows).
    k_codebook, v_codebook: ``[Hkv, S, n, 2^b, v]`` the layer's codebooks.
    k_residual, v_residual: ``[B, Hkv, R, D]`` full-precision residual rows;
      row ``i`` holds token ``packed_len(L) + i``; rows past ``L`` are zero.
    lengths: ``[B]`` int32 tokens held per sequence.
    overflow: ``[B]`` bool, set when an update under `jit` was not applied
      (it would pass ``capacity``, or a prefill length was outside ``[0, T]``).
    nonfinite: ``[B]`` bool, set when an update under `jit` held a NaN/inf.
    fmt: the `VQFormat` (static).
    capacity: tokens per sequence the cache can hold (static).
    k_sink, v_sink: ``[B, S, Hkv, D]`` exact copies of each sequence's first
      ``S = fmt.sink_tokens`` tokens (rows past ``L`` zero), or None (S = 0);
      `dequantize` reads them in place of those tokens' centroids (as
      `jaxkv.KVCache.k_sink`).
  """

  k_codes: jax.Array
  v_codes: jax.Array
  k_codebook: jax.Array
  v_codebook: jax.Array
  k_residual: jax.Array
  v_residual: jax.Array
  lengths: jax.Array
  overflow: jax.Array
  nonfinite: jax.Array
  fmt: vq.VQFormat = _static()
  capacity: int = _static()
  k_sink: jax.Array | None = None
  v_sink: jax.Array | None = None

  _NAME = "VQ cache"

  # ------------------------------------------------------------ construction
  @classmethod
  def init(cls, fmt: vq.VQFormat | str, codebooks, batch: int, kv_heads: int, head_dim: int,
           capacity: int, dtype: Any = jnp.bfloat16, *, layer: int | None = None) -> "VQCache":
    """An empty cache.

    Args:
      fmt: a `VQFormat` or a VQ preset name (``"cq4"``, ``"cq2"``).
      codebooks: a `jaxkv.vq.VQCodebooks` (with ``layer``), or one layer's
        ``(k_codebook, v_codebook)``, each ``[Hkv, S, D/v, 2^b, v]``.
      batch: number of sequences B.
      kv_heads: number of KV heads Hkv.
      head_dim: channels per head D.
      capacity: maximum tokens per sequence.
      dtype: dtype of full-precision K/V (residual, inputs).
      layer: which layer of a `VQCodebooks` to use (an int in ``[0, L)``).
    """
    fmt = vq.as_vq_format(fmt)
    dtype = check_dims(fmt, batch, kv_heads, head_dim, capacity, dtype)
    if isinstance(codebooks, vq.VQCodebooks):
      if not fmt.same_codebooks(codebooks.fmt):
        raise ValueError(f"codebooks were learned for {codebooks.fmt}, not {fmt}")
      if layer is None:
        raise ValueError("layer=None: pass the layer index of these VQCodebooks")
      codebooks.validate()
      check_layer_index(layer, codebooks.num_layers, "layer")
      codebooks = codebooks.layer(layer)
    elif layer is not None:  # it would be ignored: a pair is one layer's codebooks already
      raise ValueError(f"layer={layer!r} is only for VQCodebooks: a (k_codebook, v_codebook) "
                       "pair is one layer's codebooks already")
    if not isinstance(codebooks, (tuple, list)) or len(codebooks) != 2:
      raise TypeError(f"codebooks must be a VQCodebooks or a (k_codebook, v_codebook) pair, "
                      f"got {type(codebooks).__name__}")
    k_cb, v_cb = vq.check_codebooks(fmt, *codebooks, kv_heads, head_dim)
    align = max(STORAGE_ALIGN, fmt.token_group)
    storage = -(-capacity // align) * align
    res_shape = (batch, kv_heads, fmt.residual, head_dim)

    def codes(side):
      return jnp.zeros((batch, kv_heads, storage, fmt.spec(side).code_width(head_dim)), jnp.uint8)

    return cls(
        k_codes=codes("k"), v_codes=codes("v"), k_codebook=k_cb, v_codebook=v_cb,
        k_residual=jnp.zeros(res_shape, dtype), v_residual=jnp.zeros(res_shape, dtype),
        lengths=jnp.zeros((batch,), jnp.int32), overflow=jnp.zeros((batch,), bool),
        nonfinite=jnp.zeros((batch,), bool), fmt=fmt, capacity=int(capacity),
        **empty_sinks(fmt, (batch, fmt.sink_tokens, kv_heads, head_dim), dtype))

  # -------------------------------------------------------------- properties
  @property
  def storage_len(self) -> int:
    """Token rows of the packed storage (capacity rounded up for kernels)."""
    return self.k_codes.shape[2]

  def check(self) -> "VQCache":
    """Raises ValueError if any sequence is flagged (``overflow``, ``nonfinite``); returns self.

    A no-op on traced flags (inside `jit`); call it on the returned cache.
    """
    return self._raise_flagged("a NaN/inf in k or v (attention returns NaN for these "
                               "sequences)")

  def _extend_traced(self, k_new, v_new, num_new) -> "VQCache":
    st = self._stage(k_new, v_new, num_new)
    g = self.fmt.token_group

    def do_flush(codes):
      return tuple(_write_rows(dst, _quantize_groups(staged[:, :, : st.flush_rows], book, g),
                               st.old_packed, st.flush)
                   for dst, staged, book in ((codes[0], st.k, self.k_codebook),
                                             (codes[1], st.v, self.v_codebook)))

    k_codes, v_codes = jax.lax.cond(jnp.any(st.flush > 0), do_flush, lambda c: c,
                                    (self.k_codes, self.v_codes))
    nonfinite = (self.nonfinite | nonfinite_rows(k_new, st.num_new)
                 | nonfinite_rows(v_new, st.num_new))
    return self._finish(st, nonfinite, k_codes=k_codes, v_codes=v_codes,
                        **appended_sinks(self, k_new, v_new, self.lengths, st.num_new))

  # ---------------------------------------------------------------- readback
  def dequantize(self, view: str = "target") -> tuple[jax.Array, jax.Array]:
    """Returns ``(k, v)``, each float32 ``[B, capacity, Hkv, D]``, zero past ``lengths``.

    Tokens ``[0, packed_len)`` are the summed centroids of their codes;
    ``[packed_len, L)`` the exact residual values; with sinks, tokens
    ``[0, min(S, L))`` their exact copies. Attention over the cache must
    match attention over these. ``view``: only ``"target"`` (the `KVCache`
    signature; a VQ cache has no draft view).
    """
    if view != "target":
      raise ValueError(f"view={view!r}: a VQ cache has only the 'target' view")
    c = self.capacity  # gather centroids only for rows a token can occupy
    return with_sinks(self, *self._assemble(vq_dequantize(self.k_codes[:, :, :c], self.k_codebook),
                                            vq_dequantize(self.v_codes[:, :, :c], self.v_codebook)))


# Float32 distances one quantization step may hold ([B, H, chunk, n, E]).
_DISTANCE_BUDGET = 1 << 26


def _quantize_groups(x, codebook, group: int):
  """`jaxkv.vq.quantize` of ``x [B, H, T, D]`` (T a multiple of G) in token chunks.

  Chunks of a power-of-two number of tokens (at most G) bound the
  ``[B, H, chunk, n, E]`` distance array to about 256 MiB; codes do not
  depend on the chunking (each token is quantized on its own).
  """
  b, h, t, d = x.shape
  _, _, n, entries, _ = codebook.shape
  chunk = group
  while chunk > 1 and b * h * chunk * n * entries > _DISTANCE_BUDGET:
    chunk //= 2
  blocks = x.reshape(b, h, t // chunk, chunk, d).transpose(2, 0, 1, 3, 4)   # [T/c, B, H, c, D]
  codes = jax.lax.map(lambda blk: vq.quantize(blk, codebook), blocks)      # [T/c, B, H, c, W]
  return codes.transpose(1, 2, 0, 3, 4).reshape(b, h, t, -1)


def _write_rows(dst, src, start, count):
  """Writes rows ``[0, count_b)`` of ``src [B, H, n, W]`` at ``start_b`` of ``dst [B, H, C, W]``."""
  def put(dst, src, first, num):
    pos = jnp.arange(src.shape[1])
    rows = jnp.where(pos < num, first + pos, dst.shape[1])  # out of bounds: dropped
    return dst.at[:, rows].set(src, mode="drop")

  return jax.vmap(put)(dst, src, start, count)

