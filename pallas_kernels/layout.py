"""Reference quantization and bit packing (plain jnp; the spec for the kernels).

Quantization is asymmetric round-to-nearest over a group ``x``::

    zero  = min(x)                         (stored in scale_dtype)
    scale = (max(x) - min(x)) * f32(1 / (2^b - 1))   (stored in scale_dtype)
    code  = clip(round((x - zero_s) / scale_s), 0, 2^b - 1)   (exact; ties up)
    x_hat = code * scale_s + zero_s        (float32 arithmetic)

where ``scale_s``/``zero_s`` are the *stored* (rounded) scale and zero read
back as float32, so ``x_hat`` is the nearest point of the grid that is
actually stored. A group whose stored scale is 0 (constant group, or a range
that underflows the scale dtype) gets codes 0 and ``x_hat == zero_s``.

Non-finite groups (README "Input policy"): a group that holds a NaN or an
infinity, or whose stored scale or zero is not finite in the scale dtype (a
float16 zero of -70000, a float32 range past 3.4e38), stores
``scale_s = zero_s = NaN`` and codes 0, so it dequantizes to NaN: the bad
value stays visible instead of becoming the group minimum. `group_is_bad`
is that test; the pack kernel applies the same one.
The range is multiplied by the float32 constant ``1 / (2^b - 1)``, and the
code is the exactly rounded quotient of the float32 difference by the stored
scale (`round_codes`: an approximate division, then an exact correction), so
the reference, the kernels and every backend (whose divisions differ) compute
the same bits.

Bit layout ("planar"): codes of ``b`` bits along the last axis of length ``N``
are packed into ``N * b / 8`` uint8 bytes. With ``p = 8 // b`` codes per byte
and ``W = N // p`` bytes per row, byte ``j`` holds element ``j + i * W`` in
bits ``[i*b, (i+1)*b)`` for ``i = 0..p-1``:

    int4, N = 128:  byte j = code[j] | code[j + 64] << 4
    int2, N = 128:  byte j = code[j] | code[j+32] << 2 | code[j+64] << 4 | code[j+96] << 6

Why: a row of a head is one contiguous run of ``N*b/8`` bytes (wide,
coalesced loads), and unpacking is ``(byte >> i*b) & mask`` giving ``p``
*contiguous* channel blocks of width ``W``. A kernel never interleaves nibbles
(Pallas-Triton cannot concatenate or slice loaded values); it multiplies
each block by the matching ``W``-wide slice of q (for K) or writes it to the
matching ``W``-wide slice of the output (for V), slicing refs, not values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


# Dtypes of stored scales and zeros (the same list as `jaxkv.formats.VALID_SCALE_DTYPES`,
# kept here because this bottom layer imports nothing from jaxkv).
SCALE_DTYPES = ("float16", "bfloat16", "float32")


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_bits(bits: int) -> None:
  if not _is_int(bits) or bits not in (8, 4, 2):
    raise ValueError(f"bits={bits!r} must be 8, 4 or 2 for packed codes")


def check_scale_dtype(scale_dtype) -> np.dtype:
  """``scale_dtype`` as a numpy dtype; ValueError naming it unless it is one of
  `SCALE_DTYPES`."""
  try:
    dtype = np.dtype(scale_dtype)
  except TypeError:
    dtype = None
  if dtype is None or dtype.name not in SCALE_DTYPES:
    raise ValueError(f"scale_dtype={scale_dtype!r} must be one of {SCALE_DTYPES}")
  return dtype


def check_group(name: str, group) -> None:
  """ValueError naming ``name`` unless ``group`` is a positive (non-bool) int."""
  if not _is_int(group) or group < 1:
    raise ValueError(f"{name}={group!r} must be a positive int")


def pack(codes: jax.Array, bits: int, *, check: bool = True) -> jax.Array:
  """Packs integer codes along the last axis into uint8 (planar layout).

  Args:
    codes: ``[..., N]`` integer codes in ``[0, 2^bits)``; ``N % (8 // bits) == 0``.
      A non-integer dtype raises TypeError; concrete (non-traced) codes outside
      the range raise ValueError (they would spill into their neighbours' bits).
    bits: 8, 4 or 2.
    check: False skips the value check (callers whose codes are in range by
      construction: it reads concrete codes back to the host).
  Returns:
    ``[..., N * bits // 8]`` uint8.
  """
  _check_bits(bits)
  if not check:
    return _pack(codes, bits)
  if not hasattr(codes, "dtype"):
    codes = np.asarray(codes)
  if codes.ndim < 1:
    raise ValueError(f"codes must be [..., N], got shape {codes.shape}")
  if not jnp.issubdtype(codes.dtype, jnp.integer):
    raise TypeError(f"codes.dtype={codes.dtype} must be an integer dtype")
  if not isinstance(codes, jax.core.Tracer) and codes.size and not (
      codes.dtype == np.uint8 and bits == 8):
    lo, hi = (int(v) for v in jax.device_get((codes.min(), codes.max())))
    if lo < 0 or hi >= 1 << bits:
      raise ValueError(f"codes hold values in [{lo}, {hi}]; they must lie in "
                       f"[0, {(1 << bits) - 1}] for {bits=}")
  return _pack(codes, bits)


def _pack(codes, bits: int) -> jax.Array:
  """`pack` without its checks (codes known to be in range)."""
  per_byte = 8 // bits
  n = codes.shape[-1]
  if n % per_byte:
    raise ValueError(f"last axis {n=} must be a multiple of {per_byte} for {bits=}")
  codes = codes.astype(jnp.uint8)
  if bits == 8:
    return codes
  width = n // per_byte
  parts = codes.reshape(*codes.shape[:-1], per_byte, width)
  out = parts[..., 0, :]
  for i in range(1, per_byte):
    out = out | (parts[..., i, :] << jnp.uint8(i * bits))
  return out


def unpack(packed: jax.Array, bits: int) -> jax.Array:
  """Inverse of `pack`: ``[..., N*bits//8]`` uint8 -> ``[..., N]`` uint8 codes."""
  _check_bits(bits)
  if packed.dtype != jnp.uint8:
    raise TypeError(f"packed.dtype={packed.dtype} must be uint8")
  if bits == 8:
    return packed
  mask = jnp.uint8((1 << bits) - 1)
  # code i * W + w is bits [i*bits, (i+1)*bits) of byte w: one broadcast shift
  # (elementwise, so XLA fuses it with its consumer; a concatenate of the
  # planes can stay a kernel of its own)
  shifts = jnp.arange(0, 8, bits, dtype=jnp.uint8)[:, None]            # [8 // bits, 1]
  parts = (packed[..., None, :] >> shifts) & mask                      # [..., 8 // bits, W]
  return parts.reshape(*packed.shape[:-1], -1)


def _quantize_groups(x: jax.Array, bits: int, axis: int, scale_dtype):
  """Quantizes ``x`` (float32) with one (scale, zero) per slice along ``axis``."""
  scale_dtype = check_scale_dtype(scale_dtype)
  levels = (1 << bits) - 1
  lo = jnp.min(x, axis=axis, keepdims=True)
  hi = jnp.max(x, axis=axis, keepdims=True)
  scale_s = ((hi - lo) * jnp.float32(1.0 / levels)).astype(scale_dtype)
  zero_s = lo.astype(scale_dtype)
  bad = group_is_bad(jnp.any(~jnp.isfinite(x), axis=axis, keepdims=True), scale_s, zero_s)
  scale_s = jnp.where(bad, jnp.nan, scale_s).astype(scale_dtype)
  zero_s = jnp.where(bad, jnp.nan, zero_s).astype(scale_dtype)
  # The codes must be computed from the *stored* (rounded) scale and zero.
  # XLA:GPU (allow_excess_precision) folds a float32 -> float16 -> float32
  # round trip away, which changes codes wherever the rounding matters (tiny
  # or subnormal float16 scales); the barrier keeps the round trip.
  scale_s, zero_s = lax.optimization_barrier((scale_s, zero_s))
  code = round_codes(x, zero_s.astype(jnp.float32), scale_s.astype(jnp.float32), levels)
  return code, jnp.squeeze(scale_s, axis), jnp.squeeze(zero_s, axis)


def group_is_bad(x_nonfinite: jax.Array, scale_s: jax.Array, zero_s: jax.Array) -> jax.Array:
  """Groups stored as NaN: non-finite input, or a scale/zero that overflowed its dtype.

  ``x_nonfinite`` is ``any(~isfinite(x))`` over the group (a separate input
  because a GPU ``min``/``max`` may skip NaNs); ``scale_s``/``zero_s`` are
  the rounded, stored values.
  """
  return x_nonfinite | ~jnp.isfinite(scale_s) | ~jnp.isfinite(zero_s)


def round_codes(x: jax.Array, zero: jax.Array, scale: jax.Array, levels: int) -> jax.Array:
  """``clip(round((x - zero) / scale), 0, levels)`` as uint8, exactly; 0 where scale == 0.

  ``round`` is round-half-up of the exact quotient of ``d = x - zero``
  (float32) by ``scale``. A first guess ``c = floor(d * (1/scale) + 0.5)``
  may be one off near a half-way point, by however the backend divides (XLA
  and Triton on a GPU divide approximately, and differently); it is then
  fixed by exact comparisons of ``2d`` with ``(2c -/+ 1) * scale``. So every
  backend, and the Pallas pack kernel that calls this function, gives the
  same codes bit for bit.
  """
  d = x - zero
  safe = jnp.where(scale > 0, scale, 1.0)
  # scale = hi + lo with 12 significant bits each, so k * hi and k * lo are
  # exact for odd |k| <= 2^9; 2d - k*hi is exact when the two are within a
  # factor 2 (Sterbenz) and otherwise far from k*lo, so the sign test is exact.
  hi = lax.bitcast_convert_type(
      lax.bitcast_convert_type(safe, jnp.uint32) & np.uint32(0xFFFFF000), jnp.float32)
  lo = safe - hi
  # Ranges near the float32 limit (scale >= 2^100): 2d and k * hi would
  # overflow, so d, hi and lo are scaled by 2^-8 first. That is exact where it
  # matters: the comparisons decide only near half-way points, where |d| is of
  # the order of the (huge) scale, far above the subnormals.
  shrink = jnp.where(safe >= np.float32(2.0 ** 100), np.float32(2.0 ** -8), np.float32(1.0))
  hi, lo, d_small = hi * shrink, lo * shrink, d * shrink
  two_d = d_small + d_small

  def at_least(k):  # 2d >= k * scale
    return two_d - k * hi >= k * lo

  code = jnp.floor(d * (1.0 / safe) + 0.5)
  code = code - jnp.where(at_least(code + code - 1.0), 0.0, 1.0)
  code = code + jnp.where(at_least(code + code + 1.0), 1.0, 0.0)
  # NaN scale (a non-finite group) fails ``scale > 0``: codes 0, never NaN -> uint8.
  code = jnp.where(scale > 0, jnp.clip(code, 0.0, float(levels)), 0.0)
  return code.astype(jnp.uint8)


def _check_scale_zero(codes, scale, zero) -> None:
  """``scale`` and ``zero``: floating arrays of one shape, of codes' rank."""
  for name, x in (("scale", scale), ("zero", zero)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name}.dtype={x.dtype} must be floating")
  if zero.shape != scale.shape:
    raise ValueError(f"zero.shape={zero.shape} must equal scale.shape={scale.shape}")
  if codes.ndim < 2 or scale.ndim != codes.ndim:
    raise ValueError(f"scale.shape={scale.shape} must have the rank of codes.shape={codes.shape} "
                     "(>= 2)")


def quantize_per_token(x: jax.Array, bits: int, channel_group: int, scale_dtype="float16"):
  """One (scale, zero) per token per group of ``channel_group`` channels.

  Args:
    x: ``[..., T, D]`` floats.
  Returns:
    ``codes [..., T, D]`` uint8 (unpacked), ``scale, zero [..., T, D // channel_group]``.
  """
  _check_bits(bits)
  check_group("channel_group", channel_group)
  if getattr(x, "ndim", 0) < 2:
    raise ValueError(f"x.shape={getattr(x, 'shape', None)} must be [..., T, D]")
  *lead, t, d = x.shape
  if d % channel_group:
    raise ValueError(f"head_dim={d} must be divisible by {channel_group=}")
  xg = x.astype(jnp.float32).reshape(*lead, t, d // channel_group, channel_group)
  code, scale, zero = _quantize_groups(xg, bits, -1, scale_dtype)
  return code.reshape(*lead, t, d), scale, zero


def quantize_per_channel(x: jax.Array, bits: int, token_group: int, scale_dtype="float16"):
  """One (scale, zero) per channel per group of ``token_group`` tokens.

  Args:
    x: ``[..., T, D]`` floats with ``T % token_group == 0`` (groups start at 0).
  Returns:
    ``codes [..., T, D]`` uint8 (unpacked), ``scale, zero [..., T // token_group, D]``.
  """
  _check_bits(bits)
  check_group("token_group", token_group)
  if getattr(x, "ndim", 0) < 2:
    raise ValueError(f"x.shape={getattr(x, 'shape', None)} must be [..., T, D]")
  *lead, t, d = x.shape
  if t % token_group:
    raise ValueError(f"num tokens {t} must be a multiple of {token_group=}")
  xg = x.astype(jnp.float32).reshape(*lead, t // token_group, token_group, d)
  code, scale, zero = _quantize_groups(xg, bits, -2, scale_dtype)
  return code.reshape(*lead, t, d), scale, zero


def dequantize_per_token(codes: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
  """``codes [..., T, D]`` (unpacked), ``scale/zero [..., T, D // Gd]`` -> float32."""
  _check_scale_zero(codes, scale, zero)
  *lead, t, d = codes.shape
  ng = scale.shape[-1]
  if ng < 1 or d % ng or scale.shape != (*lead, t, ng):
    raise ValueError(f"scale.shape={scale.shape} must be (*codes.shape[:-1], D // Gd) = "
                     f"{(*lead, t)} + (a divisor of D={d},) for codes.shape={codes.shape}")
  c = codes.astype(jnp.float32).reshape(*lead, t, ng, d // ng)
  x = c * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]
  return x.reshape(*lead, t, d)


def dequantize_per_channel(codes: jax.Array, scale: jax.Array, zero: jax.Array) -> jax.Array:
  """``codes [..., T, D]`` (unpacked), ``scale/zero [..., T // G, D]`` -> float32."""
  _check_scale_zero(codes, scale, zero)
  *lead, t, d = codes.shape
  ngroups = scale.shape[-2]
  if ngroups < 1 or t % ngroups or scale.shape != (*lead, ngroups, d):
    raise ValueError(f"scale.shape={scale.shape} must be {tuple(lead)} + (T // G, D={d}) with "
                     f"T={t} a multiple of G, for codes.shape={codes.shape}")
  c = codes.astype(jnp.float32).reshape(*lead, ngroups, t // ngroups, d)
  x = c * scale.astype(jnp.float32)[..., None, :] + zero.astype(jnp.float32)[..., None, :]
  return x.reshape(*lead, t, d)


def quantize(x: jax.Array, bits: int, *, axis: str, group: int, scale_dtype="float16"):
  """Quantizes and packs ``x [..., T, D]``.

  Args:
    x: ``[..., T, D]`` floats.
    bits: 8, 4 or 2.
    axis: ``"token"`` (one scale per token per ``group`` channels) or
      ``"channel"`` (one scale per channel per ``group`` tokens).
    group: group size along the reduced axis.
    scale_dtype: dtype of the stored scale and zero.
  Returns:
    ``(packed [..., T, D*bits/8] uint8, scale, zero)``.
  """
  _check_bits(bits)
  check_group("group", group)
  check_scale_dtype(scale_dtype)
  if axis == "token":
    code, scale, zero = quantize_per_token(x, bits, group, scale_dtype)
  elif axis == "channel":
    code, scale, zero = quantize_per_channel(x, bits, group, scale_dtype)
  else:
    raise ValueError(f"axis={axis!r} must be 'token' or 'channel'")
  return _pack(code, bits), scale, zero  # codes in range by construction


def dequantize(packed: jax.Array, scale: jax.Array, zero: jax.Array, bits: int, *, axis: str):
  """Inverse of `quantize` up to rounding: returns float32 ``[..., T, D]``.

  ``scale``/``zero`` must have exactly the shape `quantize` returns for the
  codes (no broadcasting): ``[..., T, D // Gd]`` per token, ``[..., T // G, D]``
  per channel, where the per-channel D must be ``packed.shape[-1] * 8 / bits``.
  """
  _check_bits(bits)
  if axis not in ("token", "channel"):
    raise ValueError(f"axis={axis!r} must be 'token' or 'channel'")
  if getattr(packed, "ndim", 0) < 2:
    raise ValueError(f"packed must be [..., T, D*bits/8], got shape "
                     f"{getattr(packed, 'shape', type(packed).__name__)}")
  head_dim = packed.shape[-1] * 8 // bits
  if axis == "channel" and getattr(scale, "ndim", 0) >= 1 and scale.shape[-1] != head_dim:
    raise ValueError(f"{bits=} does not fit: packed.shape={packed.shape} unpacks to D={head_dim} "
                     f"channels, but scale.shape={scale.shape} has {scale.shape[-1]}")
  codes = unpack(packed, bits)
  if axis == "token":
    return dequantize_per_token(codes, scale, zero)
  if axis == "channel":
    return dequantize_per_channel(codes, scale, zero)
  raise ValueError(f"axis={axis!r} must be 'token' or 'channel'")


quantize_groups = _quantize_groups  # public name (draft weights quantize [G, group, N] blocks)
