"""`models.weight_fit.fit_groups` against a float64 numpy search over the same candidates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import quant
from models import draft_weights as dw
from models import weight_fit


def _numpy_candidates(w: np.ndarray, bits: int, shrinks, iters: int):
  """Squared error per (group, column) of every candidate the fit may pick, in float64:
  round-to-nearest over min/max, and each shrunk range with its least-squares refits."""
  levels = (1 << bits) - 1
  lo, hi = w.min(1), w.max(1)

  def err(scale, zero):
    codes = np.clip(np.floor((w - zero[:, None]) / scale[:, None] + 0.5), 0, levels)
    return np.square(codes * scale[:, None] + zero[:, None] - w).sum(1), codes

  out = [err((hi - lo) / levels, lo)[0]]
  for s in shrinks:
    half, mid = 0.5 * (hi - lo) * s, 0.5 * (hi + lo)
    scale, zero = 2 * half / levels, mid - half
    e, codes = err(scale, zero)
    out.append(e)
    for _ in range(iters):
      cm, wm = codes.mean(1), w.mean(1)
      var = np.square(codes - cm[:, None]).mean(1)
      slope = ((codes - cm[:, None]) * (w - wm[:, None])).mean(1) / np.where(var > 0, var, 1)
      ok = (var > 0) & (slope > 0)
      scale, zero = np.where(ok, slope, scale), np.where(ok, wm - slope * cm, zero)
      e, codes = err(scale, zero)
      out.append(e)
  return np.stack(out)                                                  # [candidates, G, out]


@pytest.mark.parametrize("bits,group,dist", [(4, 128, "t"), (4, 32, "normal"), (8, 64, "t")])
def test_fit_is_the_best_candidate_per_group(bits, group, dist):
  key = jax.random.PRNGKey(bits * group)
  shape = (3, group, 48)
  w = (jax.random.t(key, 3.0, shape) if dist == "t" else jax.random.normal(key, shape)) * 0.02
  codes, scale, zero = weight_fit.fit_groups(w, bits)
  assert codes.dtype == jnp.uint8 and int(codes.max()) <= (1 << bits) - 1
  assert scale.shape == zero.shape == (3, 48) and scale.dtype == jnp.float32
  wn = np.asarray(w, np.float64)
  got = np.square(np.asarray(codes, np.float64) * np.asarray(scale, np.float64)[:, None]
                  + np.asarray(zero, np.float64)[:, None] - wn).sum(1)
  cands = _numpy_candidates(wn, bits, weight_fit.SHRINKS, weight_fit.ITERS)
  # the fit's float32 choice matches the best float64 candidate up to rounding
  np.testing.assert_allclose(got, cands.min(0), rtol=2e-3, atol=1e-12)
  assert np.all(got <= cands[0] * (1 + 1e-5) + 1e-12)                  # never worse than rtn
  if bits == 4 and dist == "t":                                         # heavy tails: it pays
    assert got.sum() < 0.95 * cands[0].sum()


def test_non_finite_and_constant_groups():
  w = np.array(jax.random.normal(jax.random.PRNGKey(1), (3, 32, 4)), np.float32)
  w[0, 5, 1] = np.nan
  w[1, :, 2] = 0.25
  codes, scale, zero = weight_fit.fit_groups(jnp.asarray(w), 4)
  rtn = quant.quantize_groups(jnp.asarray(w), 4, -2, "float32")
  assert np.isnan(scale[0, 1]) and np.isnan(zero[0, 1])                 # rtn's NaN kept
  np.testing.assert_array_equal(np.asarray(scale)[0, 1], np.asarray(rtn[1])[0, 1])
  deq = np.asarray(codes, np.float32)[1, :, 2] * scale[1, 2] + zero[1, 2]
  np.testing.assert_array_equal(deq, w[1, :, 2])                        # exact
  assert np.all(np.isfinite(np.asarray(scale)[np.arange(3) != 0]))


def test_quantize_kernel_fit_option():
  w = jax.random.t(jax.random.PRNGKey(2), 3.0, (256, 64)) * 0.02
  q = dw.quantize_kernel(w, group_size=128)
  r = dw.quantize_kernel(w, group_size=128, fit="rtn")
  codes, scale, zero = quant.quantize_groups(w.reshape(2, 128, 64), 4, -2, "float32")
  np.testing.assert_array_equal(np.asarray(r.unpacked_codes()), np.asarray(codes).reshape(256, 64))
  np.testing.assert_array_equal(np.asarray(r.scale), np.asarray(scale))
  f = weight_fit.fit_groups(w.reshape(2, 128, 64), 4)
  np.testing.assert_array_equal(np.asarray(q.unpacked_codes()), np.asarray(f[0]).reshape(256, 64))
  np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(f[1]))
  with pytest.raises(ValueError, match="fit='gptq' must be one of"):
    dw.quantize_kernel(w, fit="gptq")
