"""Decode attention over a `KVCache`: one entry point, several implementations.

``implementation="reference"`` (alias ``"xla"``) is plain jnp over
``cache.dequantize()``: it is the spec every kernel is tested against and the
fallback everywhere. ``"pallas"`` runs the fused dequant flash-decoding
kernels of `pallas_kernels` (compiled on GPU, Pallas interpret mode
elsewhere). ``None`` picks Pallas on a GPU when the kernels support the
cache's format, the reference otherwise.

Non-finite inputs give the same result on every implementation (README
"Input policy"): a query row with a NaN/inf returns NaN, and every output of a
sequence whose cache holds a non-finite value (``cache.nonfinite``) is NaN.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import KVCache

IMPLEMENTATIONS = ("reference", "xla", "pallas")


def _causal_mask(lengths, num_queries: int, num_keys: int):
  """``[B, S, T]`` bool: query i of sequence b sees keys ``[0, L_b - S + i]``."""
  last = lengths[:, None] - num_queries + jnp.arange(num_queries)[None, :]  # [B, S]
  return jnp.arange(num_keys)[None, None, :] <= last[:, :, None]


def check_scale(scale):
  """Validates a softmax ``scale``: None, a Python/numpy real or a scalar array.

  A concrete value comes back as a Python float (a non-finite one raises
  ValueError); a traced scalar comes back as a float32 array.
  """
  if scale is None:
    return None
  if isinstance(scale, (bool, np.bool_)) or isinstance(scale, complex):
    raise TypeError(f"scale={scale!r} must be a real number")
  if isinstance(scale, numbers.Real):
    value = float(scale)
  else:
    if not hasattr(scale, "shape") or not hasattr(scale, "dtype"):
      raise TypeError(f"scale must be a real number or a scalar array, got {type(scale).__name__}")
    if tuple(scale.shape) != ():
      raise ValueError(f"scale must be a scalar, got shape {tuple(scale.shape)}")
    if not (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
      raise TypeError(f"scale.dtype={scale.dtype} must be a real (float or int) dtype")
    if isinstance(scale, jax.core.Tracer):
      return jnp.asarray(scale, jnp.float32)
    value = float(np.asarray(scale))
  if not np.isfinite(value):
    raise ValueError(f"scale={value!r} must be finite")
  return value


def _poison(out, q, seq_bad):
  """NaN for query rows holding a NaN/inf and for sequences flagged ``seq_bad [B]``."""
  bad = ~jnp.all(jnp.isfinite(q), axis=-1, keepdims=True) | seq_bad[:, None, None, None]
  return jnp.where(bad, jnp.asarray(jnp.nan, out.dtype), out)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                        *, scale: float | None = None) -> jax.Array:
  """Exact decode attention on plain K/V in float32 at highest precision.

  Args:
    q: ``[B, S, Hq, D]`` queries of the S newest tokens of each sequence.
    k, v: ``[B, T, Hkv, D]`` with ``Hq % Hkv == 0``; only ``[0, L_b)`` is read.
    lengths: ``[B]`` ints L_b (including the S new tokens).
    scale: softmax scale, default ``D ** -0.5``.
  Returns:
    ``[B, S, Hq, D]`` in q's dtype. Query i attends keys ``[0, L_b - S + i]``;
    a query with no visible key returns zeros. A query row with a NaN/inf, and
    every query of a sequence whose K/V ``[0, L_b)`` hold a NaN/inf, return NaN.
  """
  _check_qkv(q, k, v)
  scale = check_scale(scale)
  b, s, hq, d = q.shape
  t, hkv = k.shape[1], k.shape[2]
  if scale is None:
    scale = d ** -0.5
  hi = jax.lax.Precision.HIGHEST
  qf = q.astype(jnp.float32).reshape(b, s, hkv, hq // hkv, d)
  logits = jnp.einsum("bshgd,bthd->bhgst", qf, k.astype(jnp.float32), precision=hi) * scale
  mask = _causal_mask(jnp.asarray(lengths, jnp.int32), s, t)[:, None, None]  # [B,1,1,S,T]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("bhgst,bthd->bshgd", p, v.astype(jnp.float32), precision=hi)
  in_seq = jnp.arange(t)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]  # [B, T]
  kv_bad = jnp.any(~jnp.isfinite(k.astype(jnp.float32)) | ~jnp.isfinite(v.astype(jnp.float32)),
                   axis=(2, 3))
  out = _poison(out.reshape(b, s, hq, d), q, jnp.any(in_seq & kv_bad, axis=1))
  return out.astype(q.dtype)


def _check_qkv(q, k, v):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must have rank 4, got shape {getattr(x, 'shape', type(x))}")
  if k.shape != v.shape:
    raise ValueError(f"k.shape={k.shape} != v.shape={v.shape}")
  if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
    raise ValueError(f"q.shape={q.shape} and k.shape={k.shape} disagree on batch or head_dim")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"num query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"q.dtype={q.dtype} must be floating")


def _check_q_cache(q, cache: KVCache):
  if not isinstance(cache, KVCache):
    raise TypeError(f"cache must be a jaxkv.KVCache, got {type(cache).__name__}")
  if getattr(q, "ndim", None) != 4:
    raise ValueError(f"q must be [B, S, Hq, D], got shape {getattr(q, 'shape', type(q))}")
  b, s, hq, d = q.shape
  if b != cache.batch:
    raise ValueError(f"q batch {b} != cache batch {cache.batch}")
  if d != cache.head_dim:
    raise ValueError(f"q head_dim {d} != cache head_dim {cache.head_dim}")
  if hq % cache.kv_heads:
    raise ValueError(f"num query heads Hq={hq} must be a multiple of kv_heads={cache.kv_heads}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"q.dtype={q.dtype} must be floating")


def _pallas_supported(q, cache) -> tuple[bool, str]:
  try:
    import pallas_kernels
  except ImportError as e:  # pragma: no cover - kernels ship with the package
    return False, f"pallas_kernels failed to import: {e}"
  return pallas_kernels.supports(cache.fmt, head_dim=cache.head_dim,
                                 num_q_heads=q.shape[2], kv_heads=cache.kv_heads,
                                 num_queries=q.shape[1])


def resolve_implementation(q, cache, implementation) -> str:
  """Which implementation `decode_attention` runs for these inputs."""
  if implementation is None:
    if jax.default_backend() == "gpu" and _pallas_supported(q, cache)[0]:
      return "pallas"
    return "reference"
  if isinstance(implementation, str):
    implementation = (implementation,)
  for impl in implementation:
    if impl not in IMPLEMENTATIONS:
      raise ValueError(f"implementation={impl!r} must be one of {IMPLEMENTATIONS} or None")
    if impl in ("reference", "xla"):
      return "reference"
    ok, why = _pallas_supported(q, cache)
    if ok:
      return "pallas"
    if len(implementation) == 1:
      raise ValueError(f"implementation='pallas' does not support this input: {why}")
  return "reference"


def decode_attention(q: jax.Array, cache: KVCache, *, scale: float | None = None,
                     implementation: str | Sequence[str] | None = None,
                     config=None) -> jax.Array:
  """Attention of the S newest queries over a (quantized) KV cache.

  The K/V of the S query tokens must already be in ``cache`` (append first).

  Args:
    q: ``[B, S, Hq, D]``; ``Hq`` a multiple of ``cache.kv_heads``.
    cache: the `KVCache`.
    scale: softmax scale, default ``D ** -0.5``: a Python/numpy real or a
      scalar array (traced ones included); a concrete non-finite one raises.
    implementation: ``None`` (best available), ``"reference"``/``"xla"``,
      ``"pallas"``, or a sequence tried in order.
    config: kernel config for ``"pallas"`` (see `pallas_kernels`); None =
      heuristic default.
  Returns:
    ``[B, S, Hq, D]`` in q's dtype: exact attention over ``cache.dequantize()``
    (float32 accumulation), query i of sequence b seeing keys
    ``[0, L_b - S + i]``. NaN for query rows holding a NaN/inf and for every
    query of a sequence flagged ``cache.nonfinite`` (README "Input policy").
  """
  _check_q_cache(q, cache)
  scale = check_scale(scale)
  impl = resolve_implementation(q, cache, implementation)
  if impl == "pallas":
    import pallas_kernels
    out = pallas_kernels.pallas_decode_attention(
        q, cache, scale=scale, config=config, interpret=jax.default_backend() != "gpu")
  else:
    k, v = cache.dequantize()
    out = reference_attention(q, k, v, cache.lengths, scale=scale)
  return _poison(out, q, cache.nonfinite)

