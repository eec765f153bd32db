"""Independent numpy oracles (written from DESIGN.md, not from jaxkv code).

`np_quantize_*` implement the contract's asymmetric quantization with numpy;
`np_attention` is float64 attention with the decode causal rule.
"""

from __future__ import annotations

import numpy as np


def np_quantize_groups(xg: np.ndarray, bits: int, axis: int, scale_dtype):
  """Quantizes float32 ``xg`` with one (scale, zero) per slice along ``axis``."""
  levels = np.float32(2 ** bits - 1)
  xg = xg.astype(np.float32)
  with np.errstate(over="ignore", invalid="ignore"):
    lo = xg.min(axis=axis, keepdims=True)
    hi = xg.max(axis=axis, keepdims=True)
    scale_s = ((hi - lo) * np.float32(1.0 / float(levels))).astype(scale_dtype)
    zero_s = lo.astype(scale_dtype)
  # Non-finite groups (README "Input policy"): a NaN/inf in the group, or a
  # stored scale/zero that overflows its dtype, stores NaN scale and zero.
  bad = (~np.isfinite(xg).all(axis=axis, keepdims=True) | ~np.isfinite(scale_s.astype(np.float32))
         | ~np.isfinite(zero_s.astype(np.float32)))
  scale_s = np.where(bad, np.nan, scale_s).astype(scale_dtype)
  zero_s = np.where(bad, np.nan, zero_s).astype(scale_dtype)
  s = scale_s.astype(np.float32)
  z = zero_s.astype(np.float32)
  # round((x - zero) / scale), half-way up, of the float32 difference: the
  # float64 quotient is close enough to exact to decide every half-way case.
  with np.errstate(over="ignore", invalid="ignore"):
    d = (xg - z).astype(np.float64)
    q = d / np.where(s > 0, s, np.float32(1)).astype(np.float64)
    code = np.where(s > 0, np.clip(np.floor(q + 0.5), 0, levels), 0)
  code = np.where(np.isfinite(code), code, 0).astype(np.uint8)
  return code, np.squeeze(scale_s, axis), np.squeeze(zero_s, axis)


def np_quantize(x: np.ndarray, bits: int, axis: str, group: int, scale_dtype):
  """``x [T, D]`` -> (codes [T, D], scale, zero) as DESIGN.md defines them."""
  t, d = x.shape
  if axis == "token":
    code, s, z = np_quantize_groups(x.reshape(t, d // group, group), bits, -1, scale_dtype)
  else:
    code, s, z = np_quantize_groups(x.reshape(t // group, group, d), bits, -2, scale_dtype)
  return code.reshape(t, d), s, z


def np_dequantize(code, scale, zero, axis: str) -> np.ndarray:
  t, d = code.shape
  c = code.astype(np.float64)
  if axis == "token":
    ng = scale.shape[-1]
    x = c.reshape(t, ng, d // ng) * scale.astype(np.float64)[..., None] \
        + zero.astype(np.float64)[..., None]
  else:
    ng = scale.shape[0]
    x = c.reshape(ng, t // ng, d) * scale.astype(np.float64)[:, None] \
        + zero.astype(np.float64)[:, None]
  return x.reshape(t, d)


def np_attention(q, k, v, lengths, scale=None):
  """float64 decode attention: q [B,S,Hq,D], k/v [B,T,Hkv,D] -> [B,S,Hq,D]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, s, hq, d = q.shape
  hkv = k.shape[2]
  scale = d ** -0.5 if scale is None else scale
  out = np.zeros((b, s, hq, d))
  for bi in range(b):
    for si in range(s):
      last = int(lengths[bi]) - s + si  # attends keys [0, last]
      if last < 0:
        continue
      for h in range(hq):
        kh = h // (hq // hkv)
        logits = k[bi, : last + 1, kh] @ q[bi, si, h] * scale
        p = np.exp(logits - logits.max())
        out[bi, si, h] = (p / p.sum()) @ v[bi, : last + 1, kh]
  return out


def np_attention_dequantized(q, k, v, lengths, scale=None, seq_bad=None):
  """Vectorized float64 decode attention with the non-finite rules.

  ``q [B,S,Hq,D]``, ``k, v [B,T,Hkv,D]`` (dequantized cache). NaN for query
  rows holding a NaN/inf and for every output of sequences whose K/V
  ``[0, L_b)`` hold one (or flagged in ``seq_bad``); zeros for a query with no
  visible key.
  """
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, s, hq, d = q.shape
  t, h = k.shape[1], k.shape[2]
  lengths = np.asarray(lengths)
  scale = d ** -0.5 if scale is None else float(scale)
  in_seq = np.arange(t)[None, :] < lengths[:, None]
  kv_bad = (~np.isfinite(k) | ~np.isfinite(v)).any(axis=(2, 3))
  bad_seq = (in_seq & kv_bad).any(axis=1)
  if seq_bad is not None:
    bad_seq = bad_seq | np.asarray(seq_bad)
  k0 = np.where(np.isfinite(k), k, 0.0)
  v0 = np.where(np.isfinite(v), v, 0.0)
  q0 = np.where(np.isfinite(q), q, 0.0)
  qf = q0.reshape(b, s, h, hq // h, d)
  logits = np.einsum("bshgd,bthd->bshgt", qf, k0) * scale
  limit = lengths[:, None] - s + np.arange(s)[None, :]
  mask = (np.arange(t)[None, None, :] <= limit[:, :, None])[:, :, None, None, :]
  logits = np.where(mask, logits, -np.inf)
  m = logits.max(-1, keepdims=True)
  p = np.where(mask, np.exp(logits - np.where(np.isfinite(m), m, 0.0)), 0.0)
  den = p.sum(-1, keepdims=True)
  p = p / np.where(den > 0, den, 1.0)
  out = np.einsum("bshgt,bthd->bshgd", p, v0).reshape(b, s, hq, d)
  row_bad = ~np.isfinite(q).all(axis=-1, keepdims=True) | bad_seq[:, None, None, None]
  return np.where(row_bad, np.nan, out)
