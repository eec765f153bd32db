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
  lo = xg.min(axis=axis, keepdims=True)
  hi = xg.max(axis=axis, keepdims=True)
  scale_s = ((hi - lo) * np.float32(1.0 / float(levels))).astype(scale_dtype)
  zero_s = lo.astype(scale_dtype)
  s = scale_s.astype(np.float32)
  z = zero_s.astype(np.float32)
  # round((x - zero) / scale), half-way up, of the float32 difference: the
  # float64 quotient is close enough to exact to decide every half-way case.
  d = (xg - z).astype(np.float64)
  q = d / np.where(s > 0, s, np.float32(1)).astype(np.float64)
  code = np.where(s > 0, np.clip(np.floor(q + 0.5), 0, levels), 0).astype(np.uint8)
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
