"""Group-wise affine weight quantization that minimizes the squared error.

The draft's weights (`models.draft_weights`) are ``code * scale + zero`` per
group of input rows and output column. Round-to-nearest over the group's
``[min, max]`` (`jaxkv.quant.quantize_groups`) spends its 16 levels on the
extremes; this fit keeps the same storage and searches, per group:

1. the range shrunk about its centre by each factor of ``shrinks`` (1 = the
   plain min/max grid), codes rounded to it;
2. for each, ``iters`` least-squares refits of (scale, zero) to the codes
   (the affine line through the (code, weight) pairs), the codes re-rounded
   to the refit grid after each;

and keeps the candidate with the smallest squared error, plain
round-to-nearest included, so no group is worse than before. Groups with a
non-finite weight keep `quantize_groups`' NaN scale and zero. Deterministic,
jitted per shape; the numpy oracle in `tests/test_weight_fit.py` checks the
per-group optimality against every candidate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv import quant

SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
ITERS = 2


def _sq_err(w, codes, scale, zero):
  """Squared error per (group, column) of ``codes * scale + zero`` against ``w``."""
  deq = codes.astype(jnp.float32) * scale[:, None] + zero[:, None]
  return jnp.sum(jnp.square(deq - w), axis=1)


def _round(w, scale, zero, levels):
  return quant.round_codes(w, zero[:, None], scale[:, None], levels)


def _refit(w, codes, scale, zero):
  """Least-squares (scale, zero) of ``w ~ codes * scale + zero`` per (group, column);
  the old pair where the codes are constant or the slope is not positive."""
  c = codes.astype(jnp.float32)
  cm, wm = jnp.mean(c, axis=1), jnp.mean(w, axis=1)
  cov = jnp.mean((c - cm[:, None]) * (w - wm[:, None]), axis=1)
  var = jnp.mean(jnp.square(c - cm[:, None]), axis=1)
  slope = cov / jnp.where(var > 0, var, 1.0)
  ok = (var > 0) & (slope > 0) & jnp.isfinite(slope)
  return jnp.where(ok, slope, scale), jnp.where(ok, wm - slope * cm, zero)


@functools.partial(jax.jit, static_argnames=("bits", "shrinks", "iters"))
def fit_groups(wg: jax.Array, bits: int, *, shrinks: tuple[float, ...] = SHRINKS,
               iters: int = ITERS) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``wg`` float ``[groups, group, out]`` -> codes uint8 ``[groups, group, out]``,
  float32 scale and zero ``[groups, out]`` (the least squared error found)."""
  w = wg.astype(jnp.float32)
  levels = (1 << bits) - 1
  codes, scale, zero = quant.quantize_groups(w, bits, -2, "float32")   # round-to-nearest
  best = _sq_err(w, codes, scale, zero)
  lo, hi = jnp.min(w, axis=1), jnp.max(w, axis=1)
  finite = jnp.isfinite(best)
  for s in shrinks:
    half = 0.5 * (hi - lo) * s
    mid = 0.5 * (hi + lo)
    c_scale, c_zero = 2.0 * half / levels, mid - half
    c_scale = jnp.where(c_scale > 0, c_scale, scale)
    c_codes = _round(w, c_scale, c_zero, levels)
    for it in range(iters + 1):
      if it:
        c_scale, c_zero = _refit(w, c_codes, c_scale, c_zero)
        c_codes = _round(w, c_scale, c_zero, levels)
      err = _sq_err(w, c_codes, c_scale, c_zero)
      take = finite & (err < best)
      codes = jnp.where(take[:, None], c_codes, codes)
      scale, zero = jnp.where(take, c_scale, scale), jnp.where(take, c_zero, zero)
      best = jnp.where(take, err, best)
  return codes, scale, zero


__all__ = ["ITERS", "SHRINKS", "fit_groups"]
