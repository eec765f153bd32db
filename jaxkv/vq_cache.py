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
import numpy as np

from jaxkv import vq
from jaxkv.cache import (STORAGE_ALIGN, _check_int, _is_concrete, nonfinite_rows, _static,
                         flush_groups, shift_residual, stage_residual)
from pallas_kernels.vq_attention import vq_dequantize


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VQCache:
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
      layer: which layer of a `VQCodebooks` to use.
    """
    fmt = vq.as_vq_format(fmt)
    _check_int("batch", batch)
    _check_int("kv_heads", kv_heads)
    _check_int("capacity", capacity)
    fmt.validate_head_dim(head_dim)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"dtype={dtype} must be a floating dtype")
    if isinstance(codebooks, vq.VQCodebooks):
      if codebooks.fmt != fmt:
        raise ValueError(f"codebooks were learned for {codebooks.fmt}, not {fmt}")
      if layer is None:
        raise ValueError("layer=None: pass the layer index of these VQCodebooks")
      if not 0 <= layer < codebooks.num_layers:
        raise ValueError(f"layer={layer} must lie in [0, {codebooks.num_layers})")
      codebooks = codebooks.layer(layer)
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
        nonfinite=jnp.zeros((batch,), bool), fmt=fmt, capacity=int(capacity))

  # -------------------------------------------------------------- properties
  @property
  def batch(self) -> int:
    return self.k_residual.shape[0]

  @property
  def kv_heads(self) -> int:
    return self.k_residual.shape[1]

  @property
  def head_dim(self) -> int:
    return self.k_residual.shape[3]

  @property
  def dtype(self):
    return self.k_residual.dtype

  @property
  def storage_len(self) -> int:
    """Token rows of the packed storage (capacity rounded up for kernels)."""
    return self.k_codes.shape[2]

  @property
  def packed_lens(self) -> jax.Array:
    """``[B]`` tokens held quantized."""
    return self.fmt.packed_len(self.lengths)

  @property
  def residual_lens(self) -> jax.Array:
    """``[B]`` tokens held in the full-precision residual block."""
    return self.lengths - self.packed_lens

  @property
  def nbytes(self) -> int:
    """Device bytes held by the cache's arrays (codebooks included)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

  def check(self) -> "VQCache":
    """Raises ValueError if any sequence is flagged (``overflow``, ``nonfinite``); returns self.

    A no-op on traced flags (inside `jit`); call it on the returned cache.
    """
    for flags, what in ((self.overflow, f"overflow (capacity={self.capacity}): updates that "
                         "would pass capacity, or prefill lengths outside [0, T], were not "
                         "applied"),
                        (self.nonfinite, "non-finite values (attention returns NaN for these "
                         "sequences)")):
      if _is_concrete(flags) and bool(np.any(np.asarray(flags))):
        bad = np.nonzero(np.asarray(flags))[0].tolist()
        raise ValueError(f"VQ cache {what}: sequences {bad}")
    return self

  # ------------------------------------------------------------------ update
  def _validate_kv(self, k, v, what):
    for name, x in (("k", k), ("v", v)):
      if not hasattr(x, "shape") or x.ndim != 4:
        raise ValueError(f"{what}: {name} must be [B, T, Hkv, D], got shape "
                         f"{getattr(x, 'shape', type(x))}")
    if k.shape != v.shape:
      raise ValueError(f"{what}: k.shape={k.shape} != v.shape={v.shape}")
    b, t, h, d = k.shape
    if (b, h, d) != (self.batch, self.kv_heads, self.head_dim):
      raise ValueError(
          f"{what}: k/v shape {k.shape} does not match cache "
          f"(batch={self.batch}, kv_heads={self.kv_heads}, head_dim={self.head_dim})")
    if t < 1:
      raise ValueError(f"{what}: need at least one token, got T={t}")
    for name, x in (("k", k), ("v", v)):
      if x.dtype != self.dtype:
        raise TypeError(f"{what}: {name}.dtype={x.dtype} must equal the cache dtype {self.dtype}")

  def prefill(self, k: jax.Array, v: jax.Array, lengths) -> "VQCache":
    """Appends the first ``lengths[b]`` rows of ``k, v [B, T, Hkv, D]`` to each sequence."""
    self._validate_kv(k, v, "prefill")
    t = k.shape[1]
    if isinstance(lengths, (list, tuple, np.ndarray)) or np.isscalar(lengths):
      lengths = np.asarray(lengths)
    if lengths.shape != (self.batch,):
      raise ValueError(f"prefill: lengths.shape={lengths.shape} must be ({self.batch},)")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise TypeError(f"prefill: lengths.dtype={lengths.dtype} must be an integer dtype")
    if _is_concrete(lengths):
      ln = np.asarray(lengths)
      if ln.min() < 0 or ln.max() > t:
        raise ValueError(f"prefill: lengths={ln.tolist()} must lie in [0, T={t}]")
    return self._extend(k, v, jnp.asarray(lengths, jnp.int32), "prefill")

  def append(self, k_new: jax.Array, v_new: jax.Array) -> "VQCache":
    """Appends ``S`` tokens to every sequence; ``k_new, v_new [B, S, Hkv, D]``."""
    self._validate_kv(k_new, v_new, "append")
    s = k_new.shape[1]
    return self._extend(k_new, v_new, jnp.full((self.batch,), s, jnp.int32), "append")

  def _extend(self, k_new, v_new, num_new, what) -> "VQCache":
    cap = self.capacity
    if _is_concrete(self.lengths) and _is_concrete(num_new):
      grown = np.asarray(self.lengths) + np.asarray(num_new)
      if grown.max() > cap:
        bad = np.nonzero(grown > cap)[0].tolist()
        raise ValueError(f"VQ cache overflow: sequences {bad} would reach lengths "
                         f"{grown[bad].tolist()} > capacity={cap}")
    out = _extend_jit(self, k_new, v_new, num_new)
    if _is_concrete(out.nonfinite) and _is_concrete(self.nonfinite):
      new_bad = np.asarray(out.nonfinite) & ~np.asarray(self.nonfinite)
      if new_bad.any():
        raise ValueError(f"{what}: k or v holds NaN/inf in sequences "
                         f"{np.nonzero(new_bad)[0].tolist()}; a VQ code cannot store it")
    return out

  def _extend_traced(self, k_new, v_new, num_new) -> "VQCache":
    fmt, cap = self.fmt, self.capacity
    g, r = fmt.token_group, fmt.residual
    t = k_new.shape[1]
    fits = (self.lengths + num_new <= cap) & (num_new >= 0) & (num_new <= t)
    num_new = jnp.where(fits, num_new, 0)
    old_len = self.lengths
    new_len = old_len + num_new
    old_packed = fmt.packed_len(old_len)
    new_packed = fmt.packed_len(new_len)
    flush = new_packed - old_packed           # [B], multiple of G
    n_groups = flush_groups(fmt, t)
    k_stage = stage_residual(self.k_residual, k_new, old_len - old_packed, num_new,
                             n_groups * g + r)
    v_stage = stage_residual(self.v_residual, v_new, old_len - old_packed, num_new,
                             n_groups * g + r)

    def do_flush(codes):
      out = []
      for dst, staged, codebook in ((codes[0], k_stage, self.k_codebook),
                                    (codes[1], v_stage, self.v_codebook)):
        new_codes = _quantize_groups(staged[:, :, : n_groups * g], codebook, g)
        out.append(_write_rows(dst, new_codes, old_packed, flush))
      return tuple(out)

    k_codes, v_codes = jax.lax.cond(jnp.any(flush > 0), do_flush, lambda c: c,
                                    (self.k_codes, self.v_codes))
    nonfinite = self.nonfinite | nonfinite_rows(k_new, num_new) | nonfinite_rows(v_new, num_new)
    new_res_len = new_len - new_packed
    return dataclasses.replace(
        self, k_codes=k_codes, v_codes=v_codes,
        k_residual=shift_residual(k_stage, flush, new_res_len, r),
        v_residual=shift_residual(v_stage, flush, new_res_len, r),
        lengths=new_len, overflow=self.overflow | ~fits, nonfinite=nonfinite)

  # ---------------------------------------------------------------- readback
  def dequantize(self) -> tuple[jax.Array, jax.Array]:
    """Returns ``(k, v)``, each float32 ``[B, capacity, Hkv, D]``, zero past ``lengths``.

    Tokens ``[0, packed_len)`` are the summed centroids of their codes;
    ``[packed_len, L)`` the exact residual values. Attention over the cache
    must match attention over these.
    """
    pos = jnp.arange(self.capacity)[None, :]            # [1, C]
    packed = self.packed_lens[:, None]                  # [B, 1]
    in_packed = pos < packed
    in_residual = (pos >= packed) & (pos < self.lengths[:, None])
    ridx = jnp.clip(pos - packed, 0, self.fmt.residual - 1)

    def assemble(codes, codebook, residual):
      full = vq_dequantize(codes[:, :, : self.capacity], codebook)      # [B, H, C, D]
      res = jnp.take_along_axis(residual.astype(jnp.float32), ridx[:, None, :, None], axis=2)
      out = jnp.where(in_packed[:, None, :, None], full,
                      jnp.where(in_residual[:, None, :, None], res, 0.0))
      return jnp.swapaxes(out, 1, 2)                     # [B, C, H, D]

    return (assemble(self.k_codes, self.k_codebook, self.k_residual),
            assemble(self.v_codes, self.v_codebook, self.v_residual))


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


# Jitted once per (format, shapes): eager calls do not dispatch op by op, and
# inside a user's jit these simply inline.
_extend_jit = jax.jit(VQCache._extend_traced)
