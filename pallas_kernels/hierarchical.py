"""QuantSpec's hierarchical INT8: an upper INT4 plane for drafting plus a lower INT4 plane.

Per quantization group (the groups of `jaxkv.quant`: K per channel over G
tokens, V per token over Gd channels)::

    S_U  = (max - min) / 15       (stored, scale dtype)    zero = min (stored)
    C_U  = clip(round((x - zero) / S_U), 0, 15)            upper code (= plain 4-bit)
    C_L  = clip(round((x - zero - C_U S_U) / (S_U / 16)), -8, 7)
    target: x_hat = (16 C_U + C_L) * S_U / 16 + zero       (8 bits)
    draft:  x_hat = C_U * S_U + zero                        (upper 4 bits only)

``round`` is round-half-up of the exact quotient (`jaxkv.quant.round_codes`):
``C_L`` is computed as ``round((x - zero) / (S_U / 16)) - 16 C_U``, which in
exact arithmetic is the rounded error of the upper code, so every backend
gets the same bits. Error bounds (up to the rounding of the stored scale):
draft ``|x - x_hat| <= S_U / 2``; target ``<= S_U / 32``, or ``<= S_U / 16``
where ``C_L`` clips at +7.

Storage: one uint8 array ``[..., T, D]`` per side holding both planes, each
in the planar 4-bit layout of `jaxkv.quant` (``D/2`` bytes per token), the
lower codes stored as ``C_L + 8`` in ``[0, 15]``, **plane-blocked**: in
every block of ``block`` tokens (the format's token group G), the block's
``block * D`` bytes are the upper planes of its tokens (``block`` rows of
``D/2`` bytes) followed by their lower planes. Seen as ``[..., 2T, D/2]``
(a free reshape), token ``t``'s upper plane is row ``2 block (t // block) +
t % block`` (`plane_row`) and its lower plane ``block`` rows further. So the
draft view reads whole contiguous runs of ``block * D/2`` bytes (a plain
4-bit side: the same scale and zero) and never the lower plane; the target
view combines the planes into the 8-bit code ``c8 = 16 C_U + C_L + 8`` with
scale ``S_U / 16`` and zero ``min - S_U / 2``. A cache writes whole token
groups at group-aligned rows (the residual rule), so the row writes of
`jaxkv.KVCache` keep this layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import layout as quant

VIEWS = ("target", "draft")


def check_view(view: str) -> str:
  """Returns ``view`` if it is ``"target"`` or ``"draft"``; ValueError naming it otherwise."""
  if not isinstance(view, str) or view not in VIEWS:
    raise ValueError(f"view={view!r} must be one of {VIEWS}")
  return view


def _quantize_groups(xg: jax.Array, axis: int, scale_dtype):
  """``xg`` float32 grouped along ``axis`` -> (upper, lower [0, 15] uint8, scale, zero)."""
  upper, scale, zero = quant._quantize_groups(xg, 4, axis, scale_dtype)  # pylint: disable=protected-access
  s = jnp.expand_dims(scale, axis).astype(jnp.float32)
  z = jnp.expand_dims(zero, axis).astype(jnp.float32)
  # round((x - zero) / (S_U / 16)): S_U / 16 is exact in float32, the rounding exact.
  fine = quant.round_codes(xg, z, s * jnp.float32(1.0 / 16.0), 255).astype(jnp.int32)
  lower = jnp.clip(fine - 16 * upper.astype(jnp.int32), -8, 7) + 8
  return upper, lower.astype(jnp.uint8), scale, zero


def quantize(x: jax.Array, *, axis: str, group: int, block: int, scale_dtype="float16"):
  """Hierarchically quantizes ``x [..., T, D]`` and packs both planes.

  Args:
    x: ``[..., T, D]`` floats (``D`` even; ``T % group == 0`` for ``axis="channel"``).
    axis: ``"channel"`` (one scale per channel per ``group`` tokens) or ``"token"``.
    group: group size along the reduced axis.
    block: tokens per plane block (the module docstring); ``T % block == 0``.
    scale_dtype: dtype of the stored ``S_U`` and zero.
  Returns:
    ``(codes [..., T, D] uint8, scale, zero)``: codes plane-blocked; scale/zero
    as `jaxkv.quant.quantize` returns them for 4 bits.
  """
  quant.check_group("group", group)  # before `d % group` (0: ZeroDivisionError)
  quant.check_group("block", block)
  *lead, t, d = x.shape
  xf = x.astype(jnp.float32)
  if d % 2:
    raise ValueError(f"head_dim={d} must be even for hierarchical codes")
  if t % block:
    raise ValueError(f"num tokens {t} must be a multiple of the plane block={block}")
  if axis == "token":
    if d % group:
      raise ValueError(f"head_dim={d} must be divisible by {group=}")
    xg = xf.reshape(*lead, t, d // group, group)
    upper, lower, scale, zero = _quantize_groups(xg, -1, scale_dtype)
  elif axis == "channel":
    if t % group:
      raise ValueError(f"num tokens {t} must be a multiple of {group=}")
    xg = xf.reshape(*lead, t // group, group, d)
    upper, lower, scale, zero = _quantize_groups(xg, -2, scale_dtype)
  else:
    raise ValueError(f"axis={axis!r} must be 'token' or 'channel'")
  packed = [quant.pack(p.reshape(*lead, t, d), 4, check=False).reshape(
      *lead, t // block, 1, block, d // 2) for p in (upper, lower)]
  codes = jnp.concatenate(packed, axis=-3).reshape(*lead, t, d)  # [.., T/B, 2, B, D/2]
  return codes, scale, zero


def plane_row(t, block: int):
  """Row of token ``t``'s upper plane in the ``[..., 2T, D/2]`` view of the
  codes (int or array); its lower plane is ``block`` rows further."""
  return 2 * block * (t // block) + t % block


def plane_view(codes: jax.Array) -> jax.Array:
  """``codes [..., T, D]`` as the ``[..., 2T, D/2]`` rows of one plane each (a free
  reshape); with plane-blocked codes token ``t``'s upper plane is row `plane_row`."""
  *lead, t, d = codes.shape
  return codes.reshape(*lead, 2 * t, d // 2)


def packed_planes(codes: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """``codes [..., T, D]`` uint8 (plane-blocked) -> the packed ``(upper, lower)``
  planes ``[..., T, D/2]`` in token order."""
  *lead, t, d = codes.shape
  quant.check_group("block", block)
  if t % block or d % 2:
    raise ValueError(f"codes.shape={codes.shape}: T must be a multiple of the plane "
                     f"block={block} and D even")
  blocks = codes.reshape(*lead, t // block, 2, block, d // 2)
  return tuple(blocks[..., i, :, :].reshape(*lead, t, d // 2) for i in range(2))


def planes(codes: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
  """``codes [..., T, D]`` uint8 -> unpacked ``(upper [..., T, D] in [0, 15], lower C_L + 8)``."""
  return tuple(quant.unpack(p, 4) for p in packed_planes(codes, block))


def _check_target_operands(codes, scale, zero, axis: str) -> None:
  """The target view's operands as `quantize` returns them (no broadcasting): the
  draft view gets these checks from `quant.dequantize`; here a scale of the other
  axis broadcast silently into a wrong result before."""
  if axis not in ("token", "channel"):
    raise ValueError(f"axis={axis!r} must be 'token' or 'channel'")
  if getattr(codes, "dtype", None) != jnp.uint8 or codes.ndim < 2 or codes.shape[-1] % 2:
    raise ValueError(f"codes (shape {getattr(codes, 'shape', None)}, dtype "
                     f"{getattr(codes, 'dtype', None)}) must be uint8 [..., T, D], D even")
  quant._check_scale_zero(codes, scale, zero)  # pylint: disable=protected-access
  *lead, t, d = codes.shape
  if axis == "token":
    ng = scale.shape[-1]
    if ng < 1 or d % ng or scale.shape != (*lead, t, ng):
      raise ValueError(f"scale.shape={scale.shape} must be {(*lead, t)} + (D // Gd,) with "
                       f"D={d} a multiple of Gd, for codes.shape={codes.shape}, axis='token'")
  else:
    ng = scale.shape[-2]
    if ng < 1 or t % ng or scale.shape != (*lead, ng, d):
      raise ValueError(f"scale.shape={scale.shape} must be {tuple(lead)} + (T // G, D={d}) "
                       f"with T={t} a multiple of G, for codes.shape={codes.shape}, "
                       "axis='channel'")


def dequantize(codes: jax.Array, scale: jax.Array, zero: jax.Array, *, axis: str,
               block: int, view: str = "target") -> jax.Array:
  """Inverse of `quantize` in one view: float32 ``[..., T, D]``.

  ``view="draft"`` reads only the upper plane.
  """
  check_view(view)
  if view == "target":
    _check_target_operands(codes, scale, zero, axis)
  upper, lower = packed_planes(codes, block)
  return _dequantize_planes(upper, None if view == "draft" else lower, scale, zero, axis=axis)


def _dequantize_planes(upper: jax.Array, lower: jax.Array | None, scale: jax.Array,
                      zero: jax.Array, *, axis: str) -> jax.Array:
  """Float32 ``[..., T, D]`` from packed planes ``[..., T, D/2]`` in token order
  (`packed_planes`): the draft view when ``lower`` is None, else the target view."""
  if lower is None:
    return quant.dequantize(upper, scale, zero, 4, axis=axis)
  code8 = (16.0 * quant.unpack(upper, 4).astype(jnp.float32)
           + (quant.unpack(lower, 4).astype(jnp.float32) - 8.0))  # [-8, 247]
  fine = scale.astype(jnp.float32) * jnp.float32(1.0 / 16.0)
  if axis == "token":
    *lead, t, d = code8.shape
    ng = scale.shape[-1]
    x = code8.reshape(*lead, t, ng, d // ng) * fine[..., None] \
        + zero.astype(jnp.float32)[..., None]
    return x.reshape(*lead, t, d)
  if axis == "channel":
    *lead, t, d = code8.shape
    ng = scale.shape[-2]
    x = code8.reshape(*lead, ng, t // ng, d) * fine[..., None, :] \
        + zero.astype(jnp.float32)[..., None, :]
    return x.reshape(*lead, t, d)
  raise ValueError(f"axis={axis!r} must be 'token' or 'channel'")


__all__ = ["VIEWS", "check_view", "dequantize", "packed_planes", "plane_row", "plane_view",
           "planes", "quantize"]
