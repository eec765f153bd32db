"""Decode attention over a `KVCache`: one entry point, several implementations.

``implementation="reference"`` (alias ``"xla"``) is plain jnp over
``cache.dequantize()``: it is the spec every kernel is tested against and the
fallback everywhere. Two Pallas kernel families read the same cache:
``"triton"`` (every recent NVIDIA GPU; Pallas interpret mode on CPU) and
``"mosaic"`` (Hopper only: TMA + wgmma). ``"pallas"`` is the best family for
the device. ``None`` picks the first family of `pallas_order` that serves the
case on a GPU (Mosaic for 2-bit K and V on Hopper, Triton otherwise: see
`PALLAS_ORDER` for the measurements), the reference elsewhere.

Non-finite inputs give the same result on every implementation (README
"Input policy"): a query row with a NaN/inf returns NaN, and every output of a
sequence whose cache holds a non-finite value (``cache.nonfinite``) is NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import hierarchical
from jaxkv.cache import KVCache
from pallas_kernels._triton import check_counts, sink_skip

IMPLEMENTATIONS = ("reference", "xla", "triton", "mosaic", "pallas")


def _causal_mask(lengths, num_queries: int, num_keys: int):
  """``[B, S, T]`` bool: query i of sequence b sees keys ``[0, L_b - S + i]``."""
  last = lengths[:, None] - num_queries + jnp.arange(num_queries)[None, :]  # [B, S]
  return jnp.arange(num_keys)[None, None, :] <= last[:, :, None]


def check_scale(scale):
  """Validates a softmax ``scale``: None, a Python/numpy real or a scalar array.

  A concrete value comes back as a Python float (one that is not finite in
  float32, the kernels' operand dtype, raises ValueError: 1e39 would be inf);
  a traced scalar comes back as a float32 array.
  """
  if scale is None:
    return None
  if isinstance(scale, (bool, np.bool_)) or isinstance(scale, complex):
    raise TypeError(f"scale={scale!r} must be a real number")
  if isinstance(scale, numbers.Real):
    try:
      value = float(scale)
    except OverflowError:  # a Python int past the float64 range
      raise ValueError(f"scale={scale!r} must be finite in float32") from None
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
  with np.errstate(over="ignore"):
    finite = np.isfinite(np.float32(value))
  if not finite:
    raise ValueError(f"scale={value!r} must be finite" + (
        "" if not np.isfinite(value) else " in float32"))
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
  lengths = check_lengths(lengths, b, t)
  if scale is None:
    scale = d ** -0.5
  hi = jax.lax.Precision.HIGHEST
  qf = q.astype(jnp.float32).reshape(b, s, hkv, hq // hkv, d)
  logits = jnp.einsum("bshgd,bthd->bhgst", qf, k.astype(jnp.float32), precision=hi) * scale
  mask = _causal_mask(lengths, s, t)[:, None, None]  # [B,1,1,S,T]
  logits = jnp.where(mask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(logits - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("bhgst,bthd->bshgd", p, v.astype(jnp.float32), precision=hi)
  in_seq = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
  kv_bad = jnp.any(~jnp.isfinite(k.astype(jnp.float32)) | ~jnp.isfinite(v.astype(jnp.float32)),
                   axis=(2, 3))
  out = _poison(out.reshape(b, s, hq, d), q, jnp.any(in_seq & kv_bad, axis=1))
  return out.astype(q.dtype)


def check_lengths(lengths, batch: int, tokens: int):
  """``lengths`` as an int32 ``[batch]`` array; ValueError/TypeError naming it
  for another shape, a non-integer dtype, or concrete values outside
  ``[0, tokens]`` (traced values are not checked)."""
  if isinstance(lengths, (list, tuple, np.ndarray)) or np.isscalar(lengths):
    lengths = np.asarray(lengths)
  check_counts("lengths", lengths, batch, tokens, "T")
  return jnp.asarray(lengths, jnp.int32)


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
  from jaxkv.model_cache import LayerView  # pylint: disable=import-outside-toplevel
  if not isinstance(cache, (KVCache, LayerView)):
    raise TypeError(f"cache must be a jaxkv.KVCache (or a ModelCache.layer_view), "
                    f"got {type(cache).__name__}")
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


def _triton_supported(q, cache, view: str = "target") -> tuple[bool, str]:
  del view  # the Triton family reads both views of every format it takes
  import pallas_kernels  # pylint: disable=import-outside-toplevel
  from pallas_kernels import _triton  # pylint: disable=import-outside-toplevel
  # arrays the Triton lowering would address wrongly (1-byte codes of 2-4 GiB)
  why = _triton.offsets_overflow(*jax.tree_util.tree_leaves(cache))
  if why:
    return False, why
  # A sink format: `decode_attention` attends the prefix [0, skip) itself
  # (`jaxkv.sink_attention`, skip a multiple of the config's block_k >= S).
  return pallas_kernels.supports(cache.fmt, head_dim=cache.head_dim,
                                 num_q_heads=q.shape[2], kv_heads=cache.kv_heads,
                                 num_queries=q.shape[1],
                                 skip_tokens=getattr(cache.fmt, "sink_tokens", 0))


def _mosaic_specs(cache):
  """The Mosaic kernel's K and V `SideSpec`: the storage's, or for a
  hierarchical cache its planes' (plain 4-bit sides with the stored scale and
  zero, for both views: the upper-plane rows of the plane-blocked codes; the
  target view joins the lower planes to them in the kernel)."""
  from pallas_kernels.side_spec import SideSpec  # pylint: disable=import-outside-toplevel
  k_side = SideSpec.of(cache.fmt, "k", cache.head_dim)
  v_side = SideSpec.of(cache.fmt, "v", cache.head_dim)
  if cache.fmt.hierarchical:
    k_side, v_side = (dataclasses.replace(x, bits=4) for x in (k_side, v_side))
  return k_side, v_side


def is_hopper() -> bool:
  """Whether the default device is an sm_90 GPU (H100/H200), where Mosaic GPU runs."""
  dev = jax.devices()[0]
  return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"


def _both_planes(cache, view: str) -> bool:
  """Whether the Mosaic kernel reads both planes of ``cache`` (a hierarchical
  cache's target view: `mosaic_decode_attention`'s ``target_view``)."""
  return bool(cache.fmt.hierarchical and view == "target")


def _mosaic_supported(q, cache, config=None, view: str = "target") -> tuple[bool, str]:
  if _both_planes(cache, view):
    from pallas_kernels import mosaic_attention  # pylint: disable=import-outside-toplevel
    why = mosaic_attention.target_view_refusal(
        config if config is not None else _mosaic_default(cache, view), cache.head_dim,
        cache.dtype, *_mosaic_specs(cache))
    if why:
      return False, why
  if cache.fmt.hierarchical and cache.head_dim != 128:
    # D = 64 failed its compiled test on an H100 (2026-11-26), not yet understood
    return False, (f"the Mosaic views of hierarchical caches need head_dim 128, got "
                   f"{cache.head_dim}")
  if cache.fmt.hierarchical and config is not None and not config.tokens_m:
    return False, ("the Mosaic views of hierarchical caches need tokens_m=True (v1 reads "
                   "whole code rows)")
  if not is_hopper():
    return False, "the Mosaic GPU kernels need a Hopper (sm_90) GPU"
  from pallas_kernels import mosaic_attention  # pylint: disable=import-outside-toplevel
  k_side, v_side = _mosaic_specs(cache)
  block_k = (config if config is not None else _mosaic_default(cache, view)).block_k
  if cache.fmt.hierarchical and cache.fmt.token_group % block_k:
    return False, (f"the Mosaic views of hierarchical caches read plane blocks of token_group="
                   f"{cache.fmt.token_group} tokens: not a multiple of block_k={block_k}")
  sinks = cache.fmt.sink_tokens
  return mosaic_attention.supports(
      k_side, v_side, head_dim=cache.head_dim, q_rows=q.shape[2] // cache.kv_heads * q.shape[1],
      dtype=cache.dtype, token_group=cache.fmt.token_group, residual=cache.fmt.residual,
      block_k=block_k, sink_tokens=sinks, skip_tokens=sink_skip(sinks, block_k))


_SUPPORTED = {"triton": _triton_supported, "mosaic": _mosaic_supported}


# Tried in this order when no implementation is forced (`pallas_order`).
# Measured on H100 and H200 (jax 0.11.2, bench/results/mosaic-NOTES.md,
# 2026-11-26): with 2-bit K and V (kivi2) the Mosaic kernel is 5-8 % faster
# than Triton's on both GPUs and the Llama-3.1-8B decode step with it 3-4 %
# faster (H100, B=1, 32K and 128K). With the register V operand (same day,
# H100) kivi2 takes 13-21 % and kivi4 (bfloat16, head_dim 128) 7-17 % less
# kernel time than Triton; 8-bit K sides are slower on Mosaic.
PALLAS_ORDER = ("triton", "mosaic")
PALLAS_ORDER_MOSAIC = ("mosaic", "triton")
# kivi4 caches this short (capacity, tokens) with >= 32 (sequence, kv head)
# pairs go to Triton first (`pallas_order`).
MOSAIC_KIVI4_MIN_TOKENS = 8192


def pallas_order(fmt, dtype=None, head_dim: int | None = None,
                 heads: int | None = None, view: str = "target",
                 tokens: int | None = None) -> tuple[str, ...]:
  """The Pallas families `decode_attention` tries, in order, for a `KVFormat`
  (and the cache's ``dtype``, ``head_dim``, ``heads`` = batch x kv heads and
  ``tokens`` = its capacity when given) read in ``view``.

  Mosaic first where it was measured faster on an H100 (2026-11-26,
  `bench/results/mosaic-NOTES.md`): K and V of at most 2 bits (kivi2), and 4-bit
  K with 4-bit V in a bfloat16 cache at head_dim 128 (kivi4: V is the value
  MMA's register operand there, 26.7 / 69.5 / 133.9 / 679 us against Triton's
  28.8 / 83.6 / 157.9 / 850 at (1, 32K) / (1, 128K) / (8, 32K) / (48, 32K)),
  except kivi4 caches of at most `MOSAIC_KIVI4_MIN_TOKENS` tokens shared by 32
  or more (sequence, kv head) pairs, where Triton was as fast or faster
  (34.1 / 84.7 / 163.2 us on Mosaic against 30.6 / 85.1 / 160.3 at (32, 8K,
  8, 1) / (128, 8K, 8, 1) / (64, 4K, 32, 8)). The draft view of a
  hierarchical cache (its upper plane, a 4-bit read of the plane-blocked
  codes) follows kivi4's rule: with the residual block's two 128-row tiles as
  two programs it runs within 3-13 % of kivi4 (H200, 2026-11-28, whole call:
  22.2 / 53.3 / 103.6 us on Mosaic against 29.3 / 85.2 / 158.9 on Triton at
  (1, 32K) / (1, 128K) / (8, 32K)); so does the target view (both planes'
  tiles, the 8-bit codes joined in registers: H200, 2026-11-29, whole call
  27.9 / 74.8 us on Mosaic against 39.4 / 117.0 on Triton at (1, 32K) / (1,
  128K), 107.7 vs 158.8 at (1, 128K) with 5 queries
  (`ab-quantspec-target-mosaic-nvidia-h200-20261129s.json`), 148.7 vs 214.2
  at (8, 32K) (`ab-quantspec-target-mosaic-splits-nvidia-h200-20261129s.json`)).
  Triton first elsewhere. ``view`` no longer changes the order (both views of
  a hierarchical cache follow kivi4's rule); kept for callers.
  """
  if not fmt.hierarchical and fmt.k_bits <= 2 and fmt.v_bits <= 2:
    return PALLAS_ORDER_MOSAIC
  bf16 = dtype is None or jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
  short_and_wide = (tokens is not None and tokens <= MOSAIC_KIVI4_MIN_TOKENS
                    and heads is not None and heads >= 32)
  # a hierarchical cache's views: its 4-bit planes (one or both)
  four_bit = fmt.hierarchical or (fmt.k_bits == 4 and fmt.v_bits == 4)
  if four_bit and bf16 and head_dim in (None, 128) and not short_and_wide:
    return PALLAS_ORDER_MOSAIC
  return PALLAS_ORDER


def _best_pallas(q, cache, view: str = "target") -> tuple[str | None, str]:
  """The first family of `pallas_order` that serves the input on this device."""
  reasons = []
  for impl in pallas_order(cache.fmt, cache.dtype, cache.head_dim, q.shape[0] * cache.kv_heads,
                           view, tokens=cache.capacity):
    ok, why = _SUPPORTED[impl](q, cache, view=view)
    if ok:
      return impl, ""
    reasons.append(f"{impl}: {why}")
  return None, "; ".join(reasons)


def check_implementation(implementation) -> tuple[str, ...] | None:
  """``implementation`` as a tuple of names (None stays None): TypeError/ValueError
  naming it unless it is a str or a non-empty sequence of str. Whether each name
  is known is checked by the resolver of the cache type."""
  if implementation is None:
    return None
  if isinstance(implementation, str):
    return (implementation,)
  if not isinstance(implementation, Sequence):
    raise TypeError(f"implementation={implementation!r} must be a str, a sequence of str or "
                    f"None, got {type(implementation).__name__}")
  names = tuple(implementation)
  if not names:
    raise ValueError(f"implementation={implementation!r} must name at least one of "
                     f"{IMPLEMENTATIONS}")
  bad = [n for n in names if not isinstance(n, str)]
  if bad:
    raise TypeError(f"implementation={implementation!r} must hold only str names, got {bad[0]!r}")
  return names


def _config_family(config) -> str | None:
  """``"triton"`` or ``"mosaic"``: the kernel family a ``config`` is for (None
  for None); TypeError naming ``config`` for anything else."""
  if config is None:
    return None
  if _is_mosaic_config(config):
    return "mosaic"
  from pallas_kernels.dequant_attention import DecodeAttentionConfig  # pylint: disable=import-outside-toplevel
  if isinstance(config, DecodeAttentionConfig):
    return "triton"
  raise TypeError(f"config={config!r} must be a pallas_kernels.DecodeAttentionConfig (Triton), "
                  f"a pallas_kernels.MosaicAttentionConfig (Mosaic) or None, got "
                  f"{type(config).__name__}")


def resolve_implementation(q, cache, implementation, config=None, view: str = "target") -> str:
  """Which implementation `decode_attention` runs: "reference", "triton" or "mosaic"
  (for ``view`` of the cache).

  ``None``: on a GPU the first Pallas family of `pallas_order` that serves
  the input, the reference elsewhere. ``"pallas"``: the best
  Pallas family for the device (Triton in interpret mode off GPU). A
  sequence is tried in order; a single forced name that cannot serve the
  input raises `ValueError` saying why. A ``config`` restricts the kernels
  to its family: a Pallas family it is not for cannot serve the input.
  """
  family = _config_family(config)
  requested = implementation
  implementation = check_implementation(implementation)
  if implementation is None:
    if jax.default_backend() == "gpu":
      if config is not None:  # the config's kernel or an error saying why (not the reference)
        implementation = ("mosaic",) if _is_mosaic_config(config) else ("triton",)
      else:
        impl, _ = _best_pallas(q, cache, view)
        return impl or "reference"
    else:
      return "reference"
  for impl in implementation:
    if impl not in IMPLEMENTATIONS:
      raise ValueError(f"implementation={impl!r} must be one of {IMPLEMENTATIONS} or None")
  reasons = []
  for impl in implementation:
    if impl in ("reference", "xla"):
      return "reference"
    if impl == "pallas":
      if family is not None:  # the config's family, or nothing
        ok, why = _SUPPORTED[family](q, cache, *(() if family == "triton" else (config,)),
                                     view=view)
        best = family if ok else None
      elif jax.default_backend() != "gpu":
        ok, why = _triton_supported(q, cache)
        best = "triton" if ok else None
      else:
        best, why = _best_pallas(q, cache, view)
      if best:
        return best
    elif family is not None and family != impl:
      why = f"config is a {type(config).__name__}, for the {family} family"
    else:
      ok, why = _SUPPORTED[impl](q, cache, *(() if impl == "triton" else (config,)), view=view)
      if ok:
        return impl
    reasons.append(f"{impl}: {why}")
  raise ValueError(f"implementation={requested!r} does not support this input: "
                   + "; ".join(reasons))


def refuse_unused_config(config, impl: str, implementation) -> None:
  """ValueError when a kernel ``config`` is given but ``decode_attention``
  resolved ``implementation`` to the reference, which would ignore it."""
  if config is not None and impl == "reference":
    raise ValueError(f"config={config!r} is for a Pallas kernel, but decode_attention runs the "
                     f"reference here (implementation={implementation!r} on "
                     f"{jax.default_backend()}): pass implementation='triton' / 'mosaic' / "
                     f"'pallas' to use it, or leave config out")


def _is_mosaic_config(config) -> bool:
  from pallas_kernels import mosaic_attention  # pylint: disable=import-outside-toplevel
  return isinstance(config, mosaic_attention.MosaicAttentionConfig)


def _mosaic_default(cache, view: str = "target"):
  """The heuristic Mosaic config for a cache read in ``view`` (supports() is
  checked against it)."""
  from pallas_kernels import mosaic_attention  # pylint: disable=import-outside-toplevel
  fmt = cache.fmt
  k_side, v_side = _mosaic_specs(cache)
  return mosaic_attention.MosaicAttentionConfig.default(
      batch=cache.batch, tokens=cache.storage_len, kv_heads=cache.kv_heads,
      num_sms=getattr(jax.devices()[0], "core_count", 132), k_bits=k_side.bits,
      v_bits=v_side.bits, token_group=fmt.token_group, residual=fmt.residual,
      target_view=_both_planes(cache, view))


def _triton_default(q, cache, view: str = "target"):
  """The Triton config a call without ``config=`` runs for this query and cache
  (`pallas_kernels.default_config` on the layer's shapes)."""
  import pallas_kernels  # pylint: disable=import-outside-toplevel
  return pallas_kernels.default_config(
      cache.fmt, batch=cache.batch, q_heads=q.shape[2], kv_heads=cache.kv_heads,
      head_dim=cache.head_dim, num_queries=q.shape[1], capacity=cache.storage_len,
      itemsize=jnp.dtype(cache.dtype).itemsize, view=view)[0]


def _mosaic_attention(q, cache, *, scale, config, layer=None, view: str = "target",
                      return_lse: bool = False, seq_bad=None, skip_tokens: int = 0,
                      stage=None, stage_queries: int = 0):
  """The Mosaic kernel over a `KVCache`, or over layer ``layer`` of a
  `ModelCache`'s stacked arrays (read in place); ``view="draft"`` of a
  hierarchical cache reads the upper planes of its plane-blocked codes in place;
  ``stage``: staged rows merged by the combine kernel (`jaxkv.staged_cache`)."""
  from pallas_kernels import mosaic_attention  # pylint: disable=import-outside-toplevel
  k_side, v_side = _mosaic_specs(cache)
  sm_scale = cache.head_dim ** -0.5 if scale is None else scale
  return mosaic_attention.mosaic_decode_attention(
      q, cache.k.codes, cache.k.scale, cache.k.zero, cache.v.codes, cache.v.scale,
      cache.v.zero, cache.k_residual, cache.v_residual, cache.lengths,
      k_side=k_side, v_side=v_side, token_group=cache.fmt.token_group,
      residual=cache.fmt.residual, sm_scale=sm_scale, config=config, layer=layer,
      return_lse=return_lse, seq_bad=seq_bad, skip_tokens=skip_tokens,
      plane_block=cache.fmt.plane_block,
      target_view=_both_planes(cache, view), stage=stage, stage_queries=stage_queries)


def _kernel_attention(impl: str, q, cache, *, scale, config, layer, view: str,
                      return_lse: bool = False, seq_bad=None, skip_tokens: int = 0):
  """The ``impl`` ("triton" / "mosaic") kernel over a `KVCache` or layer ``layer``
  of a `ModelCache`'s stacked arrays (`decode_attention` after dispatch)."""
  kw = dict(scale=scale, config=config, layer=layer, view=view, return_lse=return_lse,
            seq_bad=seq_bad, skip_tokens=skip_tokens)
  if impl == "mosaic":
    return _mosaic_attention(q, cache, **kw)
  import pallas_kernels  # pylint: disable=import-outside-toplevel
  return pallas_kernels.pallas_decode_attention(
      q, cache, interpret=jax.default_backend() != "gpu", **kw)


def decode_attention(q: jax.Array, cache: KVCache, *, scale: float | None = None,
                     implementation: str | Sequence[str] | None = None,
                     config=None, view: str = "target") -> jax.Array:
  """Attention of the S newest queries over a (quantized) KV cache.

  The K/V of the S query tokens must already be in ``cache`` (append first).

  Args:
    q: ``[B, S, Hq, D]``; ``Hq`` a multiple of ``cache.kv_heads``.
    cache: the `KVCache`, or one layer of a `jaxkv.ModelCache`
      (`ModelCache.layer_view`), which both Pallas kernel families read in
      place (the reference takes `LayerView.materialize()`), or
      a `jaxkv.VQCache` (`jaxkv.vq_attention`: reference or fused VQ kernel).
    scale: softmax scale, default ``D ** -0.5``: a Python/numpy real or a
      scalar array (traced ones included); a concrete non-finite one raises.
    implementation: ``None`` (best available: the faster Pallas family that
      serves the input on a GPU, see `pallas_order`; the reference
      elsewhere), ``"reference"``/``"xla"``, ``"triton"``, ``"mosaic"``,
      ``"pallas"`` (the best Pallas family for the device), or a sequence
      tried in order.
    config: a `pallas_kernels.DecodeAttentionConfig` (Triton) or
      `pallas_kernels.MosaicAttentionConfig` (Mosaic); None = heuristic
      default.
    view: ``"target"`` (every stored bit) or ``"draft"``: a hierarchical
      (``"quantspec"``) cache read through its upper 4-bit plane only
      (`jaxkv.hierarchical`); other formats have only the target view.
  Returns:
    ``[B, S, Hq, D]`` in q's dtype: exact attention over ``cache.dequantize(view)``
    (float32 accumulation), query i of sequence b seeing keys
    ``[0, L_b - S + i]``. NaN for query rows holding a NaN/inf and for every
    query of a sequence flagged ``cache.nonfinite`` (README "Input policy").
    A format with ``sink_tokens`` runs the kernels from a skip on and the
    prefix exactly in XLA (`jaxkv.sink_attention`).
  """
  from jaxkv.model_cache import LayerView  # pylint: disable=import-outside-toplevel
  from jaxkv.vq_cache import VQCache  # pylint: disable=import-outside-toplevel
  from jaxkv.vq_model_cache import VQModelCache  # pylint: disable=import-outside-toplevel
  # a VQ cache, or a layer view of one
  vq_cache = isinstance(cache.stacked if isinstance(cache, LayerView) else cache,
                        (VQCache, VQModelCache))
  if vq_cache and view != "target":
    raise ValueError(f"view={view!r}: a VQ cache has only the 'target' view")
  if vq_cache:  # vector-quantized cache (issue 15): its own kernels
    from jaxkv.vq_attention import vq_decode_attention  # pylint: disable=import-outside-toplevel
    check_implementation(implementation)  # (the other caches: in `resolve_implementation`)
    return vq_decode_attention(q, cache, scale=check_scale(scale),
                               implementation=implementation, config=config)
  _check_q_cache(q, cache)
  scale = check_scale(scale)
  hierarchical.check_view(view)
  if view == "draft" and not cache.fmt.hierarchical:
    raise ValueError(f"view='draft' needs a hierarchical format (KVFormat.preset('quantspec')), "
                     f"got {cache.fmt}")
  impl = resolve_implementation(q, cache, implementation, config, view)
  refuse_unused_config(config, impl, implementation)
  if impl == "mosaic":  # resolved on the layer's shapes, before any unwrapping
    config = config if config is not None else _mosaic_default(cache, view)
  sinks = cache.fmt.sink_tokens if impl in ("triton", "mosaic") else 0
  if sinks and config is None:  # the block the skip is a multiple of
    config = _triton_default(q, cache, view)
  layer = None
  if isinstance(cache, LayerView):
    if impl in ("triton", "mosaic"):  # the kernels read the layer of the stacked arrays in place
      layer = cache.index
      cache = dataclasses.replace(cache.stacked, lengths=cache.lengths, overflow=cache.overflow)
    else:
      cache = cache.materialize()
  nonfinite = cache.nonfinite if hasattr(cache, "nonfinite") else jnp.zeros_like(cache.overflow)
  if impl in ("triton", "mosaic"):
    kernel = functools.partial(_kernel_attention, impl, q, cache, scale=scale, config=config,
                               layer=layer, view=view)
    if sinks:  # the kernel from skip on, the prefix [0, skip) exactly, merged
      from jaxkv.sink_attention import sink_decode_attention  # pylint: disable=import-outside-toplevel
      return sink_decode_attention(
          q, cache, kernel, block=config.block_k, scale=scale, seq_bad=nonfinite, layer=layer)
    # The kernels' combine writes the NaN rows of the input policy (`_poison`)
    # itself: no select kernel after the call.
    return kernel(seq_bad=nonfinite)
  k, v = cache.dequantize(view)
  out = reference_attention(q, k, v, cache.lengths, scale=scale)
  return _poison(out, q, nonfinite)

