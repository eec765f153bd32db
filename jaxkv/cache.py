"""`KVCache`: a functional, fixed-capacity, quantized KV cache.

The cache is an immutable pytree (registered dataclass). Every method returns
a new cache, so it flows through `jit`, `lax.scan` and `lax.while_loop` and
can be donated. Storage is head-major (``[B, Hkv, T, ...]``), which is what the
kernels read.

Per sequence ``b`` with length ``L_b`` the first ``packed_len(L_b)`` tokens are
quantized (`jaxkv.quant`), the rest ``[packed_len, L_b)`` sit exactly in the
full-precision residual block of ``R`` rows (DESIGN.md "the residual rule").
Groups are aligned at token 0, so any sequence of `prefill`/`append` calls
gives the same cache as quantizing the whole history at once.

Overflow: an eager call that would grow a sequence past ``capacity`` raises
`ValueError`. Under `jit` the lengths are not known, so such a sequence is left
unchanged (nothing is written, nothing wraps) and its ``overflow`` flag is set;
the same holds for a jitted `prefill` whose ``lengths[b]`` lies outside
``[0, T]``. `KVCache.check()` raises on a concrete flagged cache.

Non-finite values (README "Input policy"): an eager `prefill`/`append` whose
K or V holds a NaN/inf, or a value that the format's scale dtype cannot
represent as a zero point or scale, raises `ValueError`. Under `jit` the
values are stored (a quantized group that holds one stores NaN scale and zero,
`jaxkv.quant`), the sequence's ``nonfinite`` flag is set, `check()` raises on
it, and `jaxkv.decode_attention` returns NaN for every output of that sequence
on every implementation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import hierarchical, quant
from jaxkv.formats import KVFormat

# Packed storage is rounded up to a multiple of this many tokens (and of G) so
# kernels can tile it with power-of-two blocks without bounds checks.
STORAGE_ALIGN = 256


def _static(**kw):
  return dataclasses.field(metadata=dict(static=True), **kw)


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
  """The packed region of K or V for all sequences.

  ``bits < 16``: ``codes`` is uint8 ``[B, H, C, D*bits/8]`` (planar layout,
  `jaxkv.quant`), with ``scale``/``zero`` ``[B, H, C, D/Gd]`` for
  ``axis="token"`` or ``[B, H, C/G, D]`` for ``axis="channel"``.
  ``bits == 16``: ``codes`` holds the values ``[B, H, C, D]`` in the cache
  dtype and ``scale``/``zero`` are None.
  ``hierarchical`` (QuantSpec, ``bits == 8``): ``codes [B, H, C, D]`` holds two
  4-bit planes per token, plane-blocked by ``plane_block`` tokens (the
  format's G: each block's upper planes, then its lower planes;
  `jaxkv.hierarchical`), with the 4-bit scale/zero of the upper code.
  """

  codes: jax.Array
  scale: jax.Array | None
  zero: jax.Array | None
  bits: int = _static()
  axis: str = _static()   # "token" or "channel"
  group: int = _static()  # Gd (channels) for "token", G (tokens) for "channel"
  hierarchical: bool = _static(default=False)
  plane_block: int = _static(default=0)  # hierarchical: tokens per plane block (G)

  @property
  def head_dim(self) -> int:
    return self.codes.shape[-1] * (8 // self.bits if self.bits < 16 else 1)

  def quantize(self, x: jax.Array, scale_dtype: str, *, use_kernel: bool = False,
               active: jax.Array | None = None):
    """``x [B, H, T, D]`` -> (codes, scale, zero) in this tensor's storage form.

    ``active [B]`` (kernel path only): sequences whose result is used; the
    kernel skips the others (their rows are undefined), e.g. the decode steps
    where a sequence flushes nothing.
    """
    if self.bits == 16:
      return x.astype(self.codes.dtype), None, None
    if self.hierarchical:  # no pack kernel for two planes yet: the jnp reference
      return hierarchical.quantize(x, axis=self.axis, group=self.group, block=self.plane_block,
                                   scale_dtype=scale_dtype)
    if use_kernel and _pack_addressable(x, self.bits):
      # Compiled on a GPU, Pallas interpret mode elsewhere (same bits, slowly).
      from pallas_kernels import quantize_pack
      b, h, t, d = x.shape
      mask = None if active is None else jnp.broadcast_to(active[:, None], (b, h)).reshape(b * h)
      codes, scale, zero = quantize_pack(
          x.reshape(b * h, t, d), bits=self.bits, axis=self.axis, group=self.group,
          scale_dtype=scale_dtype, interpret=jax.default_backend() != "gpu", active=mask)
      return (codes.reshape(b, h, *codes.shape[1:]), scale.reshape(b, h, *scale.shape[1:]),
              zero.reshape(b, h, *zero.shape[1:]))
    return quant.quantize(x, self.bits, axis=self.axis, group=self.group, scale_dtype=scale_dtype)

  def fuses_with(self, other: "QuantizedKV") -> bool:
    """Whether the pack kernel can quantize this side (K) and ``other`` (V) in one launch."""
    return all(s.bits < 16 and not s.hierarchical for s in (self, other)) and other.axis == "token"

  def dequantize(self, view: str = "target") -> jax.Array:
    """Whole storage as float32 ``[B, H, C, D]`` (garbage past packed_len).

    ``view``: ``"target"`` (all bits) or, for a hierarchical side,
    ``"draft"`` (the upper 4-bit plane only). Non-hierarchical sides have
    only the target view.
    """
    hierarchical.check_view(view)
    if self.hierarchical:
      return hierarchical.dequantize(self.codes, self.scale, self.zero, axis=self.axis,
                                     block=self.plane_block, view=view)
    if view == "draft":
      raise ValueError("view='draft' needs a hierarchical format (KVFormat.preset('quantspec'))")
    if self.bits == 16:
      return self.codes.astype(jnp.float32)
    return quant.dequantize(self.codes, self.scale, self.zero, self.bits, axis=self.axis)

  def write(self, codes, scale, zero, start, count) -> "QuantizedKV":
    """Writes tokens ``[0, count_b)`` of new codes at ``start_b`` (both [B]).

    Rows of the update beyond ``count_b`` are dropped (scattered out of
    bounds), so nothing outside ``[start, start + count)`` changes.
    """
    def idx(first, num, length, limit):
      pos = jnp.arange(length)
      return jnp.where(pos < num, first + pos, limit)  # out of bounds: dropped

    def put(dst, src, first, num):  # dst [H, C, X], src [H, n, X]
      rows = idx(first, num, src.shape[1], dst.shape[1])
      return dst.at[:, rows].set(src.astype(dst.dtype), mode="drop")

    new_codes = jax.vmap(put)(self.codes, codes, start, count)
    if self.bits == 16:
      return dataclasses.replace(self, codes=new_codes)
    if self.axis == "channel":
      g = self.group
      new_scale = jax.vmap(put)(self.scale, scale, start // g, count // g)
      new_zero = jax.vmap(put)(self.zero, zero, start // g, count // g)
    else:
      new_scale = jax.vmap(put)(self.scale, scale, start, count)
      new_zero = jax.vmap(put)(self.zero, zero, start, count)
    return dataclasses.replace(self, codes=new_codes, scale=new_scale, zero=new_zero)


def _empty_side(fmt: KVFormat, bits: int, axis: str, batch, heads, head_dim, storage, dtype):
  if bits == 16:
    return QuantizedKV(jnp.zeros((batch, heads, storage, head_dim), dtype), None, None,
                       bits=16, axis=axis, group=1)
  sdt = jnp.dtype(fmt.scale_dtype)
  codes = jnp.zeros((batch, heads, storage, head_dim * bits // 8), jnp.uint8)
  if axis == "channel":
    group = fmt.token_group
    sshape = (batch, heads, storage // group, head_dim)
  else:
    group = fmt.channel_group_for(head_dim)
    sshape = (batch, heads, storage, head_dim // group)
  return QuantizedKV(codes, jnp.zeros(sshape, sdt), jnp.zeros(sshape, sdt),
                     bits=bits, axis=axis, group=group, hierarchical=fmt.hierarchical,
                     plane_block=fmt.plane_block)


def check_use_kernel(value) -> None:
  """TypeError unless ``use_kernel`` is None or a bool (a truthy string such as
  ``"no"`` would otherwise switch the kernel on)."""
  if value is not None and not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"use_kernel={value!r} must be None, True or False")


def check_int(name, value, minimum=1):
  """ValueError naming ``name`` unless ``value`` is an int (not a bool) >= ``minimum``."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
    raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def check_seed(value, name: str = "seed") -> int:
  """``value`` as a Python int; ValueError naming ``name`` unless it is an int (not a
  bool) in int64 range (JAX's and nnx's own errors named no argument)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
      or not -2**63 <= value < 2**63:
    raise ValueError(f"{name}={value!r} must be an int in int64 range")
  return int(value)


def check_dims(fmt, batch, kv_heads, head_dim, capacity, dtype):
  """Checks a cache's sizes and dtype before it is built; returns the dtype."""
  check_int("batch", batch)
  check_int("kv_heads", kv_heads)
  check_int("capacity", capacity)
  fmt.validate_head_dim(head_dim)
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"dtype={dtype} must be a floating dtype")
  return dtype


class ResidualBlockCache:
  """What every residual-block cache shares (`KVCache`, `jaxkv.vq_cache.VQCache`).

  The cache holds, per sequence, packed tokens ``[0, packed_len(L))`` in some
  quantized storage and the rest in a full-precision residual block
  (``k_residual, v_residual [B, Hkv, R, D]``), plus ``lengths``, ``overflow``,
  ``nonfinite``, a static ``fmt`` (``token_group``, ``residual``,
  ``packed_len``) and ``capacity``. Shapes, input checks, the eager overflow /
  non-finite errors, the staging of an update and the read-back are the same;
  a subclass supplies ``_extend_traced`` (how full groups are quantized and
  written) and its storage's ``dequantize``.
  """

  _NAME = "KV cache"

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
  def packed_lens(self) -> jax.Array:
    """``[B]`` tokens held quantized."""
    return self.fmt.packed_len(self.lengths)

  @property
  def residual_lens(self) -> jax.Array:
    """``[B]`` tokens held in the full-precision residual block."""
    return self.lengths - self.packed_lens

  @property
  def nbytes(self) -> int:
    """Device bytes held by the cache's arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

  def _raise_flagged(self, nonfinite_reason: str):
    """Raises ValueError naming the sequences flagged ``overflow`` / ``nonfinite``."""
    for flags, what, why in (
        (self.overflow, f"overflow (capacity={self.capacity}) in", "updates that would pass "
         "capacity, or prefill lengths outside [0, T], were not applied"),
        (self.nonfinite, "holds non-finite values in", nonfinite_reason)):
      if _is_concrete(flags) and bool(np.any(np.asarray(flags))):
        bad = np.nonzero(np.asarray(flags))[0].tolist()
        raise ValueError(f"{self._NAME} {what} sequences {bad}: {why}")
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

  def prefill(self, k: jax.Array, v: jax.Array, lengths):
    """Appends a ragged block of tokens: the first ``lengths[b]`` rows of each.

    On an empty cache this is the prompt prefill; on a non-empty one it is a
    chunked prefill (each sequence grows by its own ``lengths[b] >= 0``).

    Args:
      k, v: ``[B, T, Hkv, D]`` in the cache dtype.
      lengths: ``[B]`` ints in ``[0, T]``; rows at positions >= length are ignored.
    """
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
    # Traced lengths outside [0, T] are rejected per sequence in `_extend_traced`
    # (``overflow`` set, nothing written).
    return self._extend(k, v, jnp.asarray(lengths, jnp.int32), "prefill")

  def append(self, k_new: jax.Array, v_new: jax.Array):
    """Appends ``S`` tokens to every sequence; ``k_new, v_new [B, S, Hkv, D]``."""
    self._validate_kv(k_new, v_new, "append")
    s = k_new.shape[1]
    return self._extend(k_new, v_new, jnp.full((self.batch,), s, jnp.int32), "append")

  def _extend(self, k_new, v_new, num_new, what="append"):
    cap = self.capacity
    if _is_concrete(self.lengths) and _is_concrete(num_new):
      grown = np.asarray(self.lengths) + np.asarray(num_new)
      if grown.max() > cap:
        bad = np.nonzero(grown > cap)[0].tolist()
        raise ValueError(f"{self._NAME} overflow: sequences {bad} would reach lengths "
                         f"{grown[bad].tolist()} > capacity={cap}")
    out = _jitted_extend(type(self))(self, k_new, v_new, num_new)
    if _is_concrete(out.nonfinite) and _is_concrete(self.nonfinite):
      new_bad = np.asarray(out.nonfinite) & ~np.asarray(self.nonfinite)
      if new_bad.any():
        raise ValueError(self._nonfinite_message(what, k_new, v_new, num_new, new_bad))
    return out

  def _nonfinite_message(self, what, k_new, v_new, num_new, new_bad) -> str:
    return (f"{what}: k or v holds NaN/inf in sequences {np.nonzero(new_bad)[0].tolist()}; "
            "the cache cannot store it")

  def _stage(self, k_new, v_new, num_new) -> "Staging":
    """The first half of every update: rows that fit, staged residual + new tokens."""
    fmt, g = self.fmt, self.fmt.token_group
    t = k_new.shape[1]
    fits = (self.lengths + num_new <= self.capacity) & (num_new >= 0) & (num_new <= t)
    num_new = jnp.where(fits, num_new, 0)
    old_len = self.lengths
    new_len = old_len + num_new
    old_packed, new_packed = fmt.packed_len(old_len), fmt.packed_len(new_len)
    n_groups = flush_groups(fmt, t)
    rows = n_groups * g + fmt.residual
    return Staging(
        fits=fits, num_new=num_new, new_len=new_len, old_packed=old_packed,
        flush=new_packed - old_packed,  # [B], multiple of G
        flush_rows=n_groups * g,
        k=stage_residual(self.k_residual, k_new, old_len - old_packed, num_new, rows),
        v=stage_residual(self.v_residual, v_new, old_len - old_packed, num_new, rows))

  def _finish(self, st: "Staging", nonfinite, **storage):
    """The second half: the rows after the flushed ones become the residual."""
    keep = st.new_len - self.fmt.packed_len(st.new_len)
    r = self.fmt.residual
    return dataclasses.replace(
        self, **storage, k_residual=shift_residual(st.k, st.flush, keep, r),
        v_residual=shift_residual(st.v, st.flush, keep, r), lengths=st.new_len,
        overflow=self.overflow | ~st.fits, nonfinite=nonfinite)

  # ---------------------------------------------------------------- readback
  def _assemble(self, full_k, full_v) -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` float32 ``[B, capacity, Hkv, D]`` from dequantized ``[B, H, >= C, D]``.

    Tokens ``[0, packed_len)`` from the packed storage, ``[packed_len, L)``
    the exact residual values, zero past ``lengths``.
    """
    pos = jnp.arange(self.capacity)[None, :]            # [1, C]
    packed = self.packed_lens[:, None]                  # [B, 1]
    in_packed = pos < packed
    in_residual = (pos >= packed) & (pos < self.lengths[:, None])
    ridx = jnp.clip(pos - packed, 0, self.fmt.residual - 1)  # [B, C]

    def one(full, residual):
      res = jnp.take_along_axis(residual.astype(jnp.float32), ridx[:, None, :, None], axis=2)
      out = jnp.where(in_packed[:, None, :, None], full[:, :, : self.capacity],
                      jnp.where(in_residual[:, None, :, None], res, 0.0))
      return jnp.swapaxes(out, 1, 2)                     # [B, C, H, D]

    return one(full_k, self.k_residual), one(full_v, self.v_residual)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Staging:
  """One update's staged rows (`ResidualBlockCache._stage`); ``[B]`` unless noted."""

  fits: jax.Array        # the update is applied (else ``overflow``)
  num_new: jax.Array     # tokens appended (0 where it does not fit)
  new_len: jax.Array
  old_packed: jax.Array  # first packed row the flush writes
  flush: jax.Array       # tokens flushed (a multiple of G)
  k: jax.Array           # [B, H, flush_rows + R', D] residual rows + new tokens
  v: jax.Array
  flush_rows: int = _static()  # staged rows that may be quantized (static)


_JITTED = {}


def _jitted_extend(cls):
  """``jax.jit(cls._extend_traced)``, once per class (then per format and shapes)."""
  if cls not in _JITTED:
    _JITTED[cls] = jax.jit(cls._extend_traced)
  return _JITTED[cls]


def _pack_addressable(x: jax.Array, bits: int) -> bool:
  """Whether the pack kernel's input ``x [B, H, T, D]`` and its codes are arrays
  the Triton lowering addresses right (`pallas_kernels._triton.offsets_overflow`;
  otherwise the jnp quantizer, the same bits). The codes are counted with T
  padded to the kernel's largest token block (64), as the kernel writes them."""
  from pallas_kernels._triton import offsets_overflow  # pylint: disable=import-outside-toplevel
  b, h, t, d = x.shape
  codes = jax.ShapeDtypeStruct((b, h, -(-t // 64) * 64, d * bits // 8), jnp.uint8)
  return offsets_overflow(x, codes) is None


def quantize_kv(k_side: QuantizedKV, v_side: QuantizedKV, xk: jax.Array, xv: jax.Array,
                scale_dtype: str, *, use_kernel: bool = False, active: jax.Array | None = None):
  """Both sides' ``(codes, scale, zero)`` of ``xk``/``xv [B, H, T, D]`` (a flush).

  With the pack kernel (``use_kernel``) and two sides it can store, one
  launch packs K and V (`pallas_kernels.pack.quantize_pack_kv`); otherwise
  `QuantizedKV.quantize` per side. The same bits either way.
  """
  if not (use_kernel and k_side.fuses_with(v_side) and _pack_addressable(xk, k_side.bits)
          and _pack_addressable(xv, v_side.bits)):
    return (k_side.quantize(xk, scale_dtype, use_kernel=use_kernel, active=active),
            v_side.quantize(xv, scale_dtype, use_kernel=use_kernel, active=active))
  from pallas_kernels.pack import quantize_pack_kv
  b, h, t, d = xk.shape
  mask = None if active is None else jnp.broadcast_to(active[:, None], (b, h))
  return quantize_pack_kv(
      xk, xv, k_bits=k_side.bits, k_axis=k_side.axis, k_group=k_side.group,
      v_bits=v_side.bits, v_group=v_side.group, scale_dtype=scale_dtype,
      interpret=jax.default_backend() != "gpu", active=mask)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache(ResidualBlockCache):
  """Quantized KV cache for a batch of sequences, one attention layer.

  Attributes:
    k, v: packed regions (`QuantizedKV`), ``C`` token rows each.
    k_residual, v_residual: ``[B, Hkv, R, D]`` full-precision residual rows;
      row ``i`` holds token ``packed_len(L) + i``; rows past ``L`` are zero.
    lengths: ``[B]`` int32 tokens held per sequence.
    overflow: ``[B]`` bool, set when an update under `jit` was not applied to
      the sequence: it would have grown it past ``capacity``, or (prefill) its
      ``lengths[b]`` was outside ``[0, T]``.
    nonfinite: ``[B]`` bool, set when an update under `jit` stored a NaN/inf
      in the sequence, or a value whose quantization group's scale or zero
      overflows ``fmt.scale_dtype`` (that group is stored as NaN).
    fmt: the `KVFormat` (static).
    capacity: tokens per sequence the cache can hold (static).
    use_kernel: quantize with the Pallas pack kernel (static; default: on
      GPU; Pallas interpret mode elsewhere). Results are bitwise identical
      either way.
    k_sink, v_sink: ``[B, S, Hkv, D]`` exact copies of each sequence's first
      ``S = fmt.sink_tokens`` tokens (rows past ``L`` zero), or None (S = 0).
      The packed storage is unchanged; `dequantize` reads these rows instead.
  """

  k: QuantizedKV
  v: QuantizedKV
  k_residual: jax.Array
  v_residual: jax.Array
  lengths: jax.Array
  overflow: jax.Array
  nonfinite: jax.Array
  fmt: KVFormat = _static()
  capacity: int = _static()
  use_kernel: bool = _static(default=False)
  k_sink: jax.Array | None = None
  v_sink: jax.Array | None = None

  # ------------------------------------------------------------ construction
  @classmethod
  def init(cls, fmt: KVFormat | str, batch: int, kv_heads: int, head_dim: int,
           capacity: int, dtype: Any = jnp.bfloat16, *, use_kernel: bool | None = None
           ) -> "KVCache":
    """An empty cache.

    Args:
      fmt: a `KVFormat` or a preset name.
      batch: number of sequences B.
      kv_heads: number of KV heads Hkv.
      head_dim: channels per head D.
      capacity: maximum tokens per sequence.
      dtype: dtype of full-precision K/V (residual, 16-bit sides, inputs).
      use_kernel: quantize with the Pallas pack kernel; None = only on GPU
        (True elsewhere runs it in Pallas interpret mode).
    """
    if isinstance(fmt, str):
      fmt = KVFormat.preset(fmt)
    if not isinstance(fmt, KVFormat):
      raise TypeError(f"fmt={fmt!r} must be a KVFormat or a preset name")
    check_use_kernel(use_kernel)
    dtype = check_dims(fmt, batch, kv_heads, head_dim, capacity, dtype)
    align = max(STORAGE_ALIGN, fmt.token_group)
    storage = -(-capacity // align) * align
    if use_kernel is None:
      use_kernel = jax.default_backend() == "gpu" and fmt.is_quantized
    if use_kernel and fmt.is_quantized:
      _check_pack_kernel(fmt, head_dim)
    res_shape = (batch, kv_heads, fmt.residual, head_dim)
    return cls(
        k=_empty_side(fmt, fmt.k_bits, fmt.k_axis, batch, kv_heads, head_dim, storage, dtype),
        v=_empty_side(fmt, fmt.v_bits, "token", batch, kv_heads, head_dim, storage, dtype),
        k_residual=jnp.zeros(res_shape, dtype),
        v_residual=jnp.zeros(res_shape, dtype),
        lengths=jnp.zeros((batch,), jnp.int32),
        overflow=jnp.zeros((batch,), bool),
        nonfinite=jnp.zeros((batch,), bool),
        fmt=fmt, capacity=int(capacity), use_kernel=bool(use_kernel),
        **empty_sinks(fmt, (batch, fmt.sink_tokens, kv_heads, head_dim), dtype))

  @property
  def storage_len(self) -> int:
    """Token rows of the packed storage (capacity rounded up for kernels)."""
    return self.k.codes.shape[2]

  def check(self) -> "KVCache":
    """Raises ValueError if any sequence is flagged (``overflow``, ``nonfinite``); returns self.

    A no-op on traced flags (inside `jit`); call it on the returned cache.
    """
    return self._raise_flagged(
        "a NaN/inf in k or v, or a value beyond the range of "
        f"scale_dtype={self.fmt.scale_dtype} (attention returns NaN for these sequences)")

  def _nonfinite_message(self, what, k_new, v_new, num_new, new_bad) -> str:
    return _nonfinite_message(what, self, k_new, v_new, num_new, new_bad)

  def _extend_traced(self, k_new, v_new, num_new) -> "KVCache":
    st = self._stage(k_new, v_new, num_new)

    def do_flush(sides):
      packed = quantize_kv(*sides, st.k[:, :, : st.flush_rows], st.v[:, :, : st.flush_rows],
                           self.fmt.scale_dtype, use_kernel=self.use_kernel)
      return tuple(side.write(*arrays, st.old_packed, st.flush)
                   for side, arrays in zip(sides, packed))

    k_side, v_side = jax.lax.cond(jnp.any(st.flush > 0), do_flush, lambda s: s, (self.k, self.v))
    nonfinite = (self.nonfinite | nonfinite_rows(k_new, st.num_new)
                 | nonfinite_rows(v_new, st.num_new) | nan_groups(k_side, st.old_packed, st.flush)
                 | nan_groups(v_side, st.old_packed, st.flush))
    return self._finish(st, nonfinite, k=k_side, v=v_side,
                        **appended_sinks(self, k_new, v_new, self.lengths, st.num_new))

  # ---------------------------------------------------------------- readback
  def dequantize(self, view: str = "target") -> tuple[jax.Array, jax.Array]:
    """Returns ``(k, v)``, each float32 ``[B, capacity, Hkv, D]``, zero past ``lengths``.

    Tokens ``[0, packed_len)`` are dequantized codes; ``[packed_len, L)`` the
    exact residual values. This is what attention over the cache must match.
    ``view``: ``"target"`` (every stored bit) or ``"draft"`` (hierarchical
    formats: the upper 4-bit plane only; `jaxkv.hierarchical`).
    """
    hierarchical.check_view(view)
    return with_sinks(self, *self._assemble(self.k.dequantize(view), self.v.dequantize(view)))


def empty_sinks(fmt, shape, dtype) -> dict:
  """``{k_sink, v_sink}`` zeros of ``shape`` (``[(L,) B, S, Hkv, D]``), or ``{}``
  when ``fmt.sink_tokens`` is 0 (the fields stay None)."""
  if not fmt.sink_tokens:
    return {}
  return dict(k_sink=jnp.zeros(shape, dtype), v_sink=jnp.zeros(shape, dtype))


def appended_sinks(cache, k_new, v_new, lengths, num_new, layer=None) -> dict:
  """``{k_sink, v_sink}`` of ``cache`` with the new rows at positions ``< S``
  written (`write_sinks`), or ``{}`` for a cache without sinks."""
  if cache.k_sink is None:
    return {}
  return dict(k_sink=write_sinks(cache.k_sink, k_new, lengths, num_new, layer),
              v_sink=write_sinks(cache.v_sink, v_new, lengths, num_new, layer))


def with_sinks(cache, k, v) -> tuple[jax.Array, jax.Array]:
  """Dequantized ``k, v [B, C, Hkv, D]`` of ``cache`` with its exact sink rows read in."""
  if cache.k_sink is None:
    return k, v
  return read_sinks(k, cache.k_sink, cache.lengths), read_sinks(v, cache.v_sink, cache.lengths)


def write_sinks(sink: jax.Array, new: jax.Array, lengths: jax.Array,
                num_new: jax.Array, layer=None) -> jax.Array:
  """``sink [B, S, H, D]`` with row ``i < num_new[b]`` of ``new [B, T, H, D]`` written
  at position ``lengths[b] + i`` where that is ``< S`` (the others are dropped).

  With ``layer`` (an int or traced index), ``sink`` is a stack ``[L, B, S, H, D]``
  and only that layer's rows are written (a scatter: in place under `jit`).
  """
  s = sink.shape[-3]
  new = new[:, :s]  # only rows i < S can land at a position < S (lengths >= 0)
  t = new.shape[1]
  pos = lengths[:, None] + jnp.arange(t)[None, :]                      # [B, t]
  pos = jnp.where(jnp.arange(t)[None, :] < num_new[:, None], pos, s)   # s: dropped
  seq = jnp.arange(new.shape[0])[:, None]                               # [B, 1]
  index = (seq, pos) if layer is None else (layer, seq, pos)
  return sink.at[index].set(new.astype(sink.dtype), mode="drop")


def sink_rows(rows: jax.Array, sink: jax.Array, lengths: jax.Array, start) -> jax.Array:
  """Head-major rows ``[B, H, n, D]`` (float32) of positions ``[start, start + n)`` with
  those ``< min(S, L_b)`` taken from ``sink [B, S, H, D]`` (a block of the packed history)."""
  s = sink.shape[1]
  pos = start + jnp.arange(rows.shape[2])[None, :]                      # [1, n]
  use = (pos < s) & (pos < lengths[:, None])                            # [B, n]
  idx = jnp.clip(pos, 0, s - 1)
  exact = jnp.take_along_axis(jnp.swapaxes(sink, 1, 2).astype(jnp.float32),
                              jnp.broadcast_to(idx, use.shape)[:, None, :, None], axis=2)
  return jnp.where(use[:, None, :, None], exact, rows)


def read_sinks(x: jax.Array, sink: jax.Array, lengths: jax.Array) -> jax.Array:
  """``x [B, C, H, D]`` (float32) with rows ``[0, min(S, L_b))`` taken from ``sink``."""
  s = sink.shape[1]
  pos = jnp.arange(x.shape[1])[None, :]
  use = (pos < s) & (pos < lengths[:, None])                            # [B, C]
  idx = jnp.clip(pos, 0, s - 1)
  rows = jnp.take_along_axis(sink.astype(jnp.float32),
                             jnp.broadcast_to(idx, use.shape)[:, :, None, None], axis=1)
  return jnp.where(use[:, :, None, None], rows, x)


# ------------------------------------------------- staging (shared helpers)
# `KVCache` and the model-level `jaxkv.model_cache.ModelCache` append through
# the same three steps, so both reach bitwise the same storage: stage the valid
# residual rows followed by the new tokens, quantize the first
# ``flush_groups * G`` staged rows (only ``flush_b`` of them are written), and
# keep the rows after the flushed ones as the new residual.
def flush_groups(fmt: KVFormat, num_new: int) -> int:
  """Static bound on the token groups one append of ``num_new`` tokens can flush."""
  return (fmt.residual + num_new - 1) // fmt.token_group


def stage_residual(residual, new, res_len, num_new, min_len: int) -> jax.Array:
  """Valid residual rows followed directly by the new tokens.

  Args:
    residual: ``[B, H, R, D]``.
    new: ``[B, T, H, D]`` new tokens; only the first ``num_new[b]`` are used.
    res_len: ``[B]`` valid residual rows.
    num_new: ``[B]`` new tokens per sequence.
    min_len: staged rows wanted (the result has ``max(min_len, R + T)``).
  Returns:
    ``[B, H, S, D]``; rows past ``res_len + num_new`` are zero.
  """
  r, t = residual.shape[2], new.shape[1]
  stage_len = max(min_len, r + t)
  # Row p is residual row p (p < res_len) or new token p - res_len: two
  # gathers with in-range (clipped) indices and a select. (A vmapped
  # dynamic_update_slice of the new rows here was miscompiled by XLA on an
  # H100, jax 0.11.2, inside the whole append: wrong flushed codes for some
  # heads; bench/results/e2e-NOTES.md, 2026-11-26.)
  pos = jnp.arange(stage_len)[None, :]                                     # [1, S]
  res_idx = jnp.minimum(pos, r - 1)                                        # [1, S]
  new_idx = jnp.clip(pos - res_len[:, None], 0, t - 1)                     # [B, S]
  old = jnp.take(residual, res_idx[0], axis=2)                             # [B, H, S, D]
  fresh = jnp.take_along_axis(jnp.swapaxes(new, 1, 2), new_idx[:, None, :, None],
                              axis=2)                                      # [B, H, S, D]
  rlen, n = res_len[:, None, None, None], num_new[:, None, None, None]
  p = pos[:, None, :, None]
  return jnp.where(p < rlen, old, jnp.where(p < rlen + n, fresh.astype(residual.dtype), 0))


def shift_residual(staged, flushed, keep, r: int) -> jax.Array:
  """``staged [B, H, S, D]`` -> new residual ``[B, H, R, D]``: rows ``[flushed, flushed + keep)``."""
  def one(staged, sh, keep):
    out = jax.lax.dynamic_slice_in_dim(staged, sh, r, axis=1)
    return jnp.where(jnp.arange(r)[None, :, None] < keep, out, 0)

  return jax.vmap(one)(staged, flushed, keep)


def _check_pack_kernel(fmt: KVFormat, head_dim: int) -> None:
  """Raises ValueError at `KVCache.init` if the pack kernel cannot store this format."""
  from pallas_kernels import pack
  for name, bits, axis in (("k", fmt.k_bits, fmt.k_axis), ("v", fmt.v_bits, "token")):
    if bits == 16:
      continue
    group = fmt.token_group if axis == "channel" else fmt.channel_group_for(head_dim)
    try:
      pack._check((fmt.token_group, head_dim), bits, axis, group)
    except ValueError as e:
      raise ValueError(f"use_kernel=True: the Pallas pack kernel cannot store {name} of "
                       f"this format at head_dim={head_dim}: {e}; pass use_kernel=False") from None


def nonfinite_rows(x, count):
  """``[B]``: any non-finite value in rows ``[0, count_b)`` of ``x [B, T, H, D]``."""
  rows = jnp.arange(x.shape[1])[None, :] < count[:, None]
  return jnp.any(rows & jnp.any(~jnp.isfinite(x), axis=(2, 3)), axis=1)


def nan_groups(side, start, count, window: int | None = None):
  """``[B]``: a group stored in packed rows ``[start_b, start_b + count_b)`` is NaN.

  The quantizer stores NaN scale/zero for a group whose values are finite but
  overflow the scale dtype (`jaxkv.quant`): that too is a non-finite value.
  ``side``'s arrays may carry leading axes before ``B`` (a `jaxkv.ModelCache`'s
  layers: any layer counts); a side without scales (16-bit, VQ) has none.
  ``window`` (static, token rows): read only that many rows from each
  ``start_b`` (``count_b`` must not exceed it) instead of every row.
  """
  scale = getattr(side, "scale", None)                       # [..., B, H, C', X]
  if scale is None or side.bits == 16:
    return jnp.zeros(start.shape, bool)
  if side.axis == "channel":
    start, count = start // side.group, count // side.group
    window = None if window is None else -(-window // side.group)
  lead, total = scale.ndim - 4, scale.shape[-2]
  if window is None or window >= total:
    part, first = scale, jnp.zeros_like(start)
  else:
    first = jnp.clip(start, 0, total - window)                # dynamic_slice's own clamp
    part = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, window, axis=x.ndim - 2),
                    in_axes=(lead, 0), out_axes=lead)(scale, first)  # [..., B, H, w, X]
  rows = first[:, None] + jnp.arange(part.shape[-2])[None, :]             # [B, w]
  bad = jnp.any(jnp.isnan(part.astype(jnp.float32)),
                axis=(*range(lead), lead + 1, lead + 3))                   # [B, w]
  return jnp.any(bad & (rows >= start[:, None]) & (rows < (start + count)[:, None]), axis=1)


def _nonfinite_message(what, cache, k_new, v_new, num_new, new_bad) -> str:
  """The eager error for sequences whose update stored a non-finite value."""
  seqs = np.nonzero(new_bad)[0].tolist()
  parts = []
  sdt = cache.fmt.scale_dtype
  limit = float(jnp.finfo(jnp.dtype(sdt)).max) / 2  # jnp.finfo knows bfloat16
  for name, x in (("k", k_new), ("v", v_new)):
    xs = [np.asarray(x[b, : int(num_new[b])], np.float32) for b in seqs]
    if any((~np.isfinite(a)).any() for a in xs):
      parts.append(f"{name} holds NaN/inf")
    else:
      peak = max((float(np.abs(a).max()) if a.size else 0.0) for a in xs)
      if peak > limit:
        parts.append(f"{name} has |{name}| up to {peak:.4g}")
  return (f"{what}: {', '.join(parts) or 'k/v'} in sequences {seqs}: quantized groups "
          f"would store a non-finite scale/zero (scale_dtype={sdt}, float16 holds "
          f"|x| <= 65504; use KVFormat(scale_dtype='float32') for larger values). "
          "See README 'Input policy'.")

