"""Decode attention over a `VQCache`; `jaxkv.decode_attention` dispatches here.

``implementation``: ``"reference"``/``"xla"`` is exact attention over
``cache.dequantize()`` (the spec); ``"triton"`` the fused Triton VQ kernel
(`pallas_kernels.vq_attention`; Pallas interpret mode off GPU); ``"mosaic"``
the Hopper kernel with the codebooks in shared memory
(`pallas_kernels.mosaic_vq_attention`; an sm_90 GPU, one VQ stage per side);
``"pallas"`` the Mosaic kernel where it applies, else Triton; ``None`` the
Mosaic kernel on a Hopper GPU where it applies (cq2 1.3-1.9x the best BF16
attention on an H100, 1.0-1.3x on an H200, 4-7x the Triton VQ kernel;
`bench/results/vq-NOTES.md`), else the Triton kernel on a GPU
(`KERNEL_BY_DEFAULT`), else the reference.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxkv.vq_cache import VQCache
from pallas_kernels import mosaic_attention as mosaic_kernel
from pallas_kernels import vq_attention as vq_kernel
from pallas_kernels._triton import offsets_overflow, sink_skip

_NAMES = ("reference", "xla", "triton", "mosaic", "pallas")

# Whether ``implementation=None`` takes the Triton VQ kernel on a GPU where the
# Mosaic one does not apply. On: it passes tests/test_vq_attention.py compiled
# (H100 and H200 suites) and runs 2-2.5x faster than the reference, which
# materializes the dequantized cache (H100, 2026-11-26: cq2 728 vs 1323 us at
# (1, 131072, 32, 8, 128); bench/results/attention-mosaic-vq2-*).
KERNEL_BY_DEFAULT = True


def _check_q(q, cache: VQCache):
  if getattr(q, "ndim", None) != 4:
    raise ValueError(f"q must be [B, S, Hq, D], got shape {getattr(q, 'shape', type(q))}")
  b, _, hq, d = q.shape
  if b != cache.batch:
    raise ValueError(f"q batch {b} != cache batch {cache.batch}")
  if d != cache.head_dim:
    raise ValueError(f"q head_dim {d} != cache head_dim {cache.head_dim}")
  if hq % cache.kv_heads:
    raise ValueError(f"num query heads Hq={hq} must be a multiple of kv_heads={cache.kv_heads}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"q.dtype={q.dtype} must be floating")


def kernel_supports(q, cache: VQCache) -> tuple[bool, str]:
  """Whether the fused VQ kernel serves this query and cache (a sink format: with
  the prefix attended beside it, `jaxkv.sink_attention`)."""
  why = offsets_overflow(*jax.tree_util.tree_leaves(cache))
  if why:
    return False, why
  sinks = cache.fmt.sink_tokens
  return vq_kernel.supports(
      head_dim=cache.head_dim, k_spec=cache.fmt.spec("k"), v_spec=cache.fmt.spec("v"),
      num_q_heads=q.shape[2], kv_heads=cache.kv_heads, num_queries=q.shape[1],
      residual=cache.fmt.residual, capacity=cache.storage_len, sink_tokens=sinks,
      skip_tokens=sinks)


def mosaic_supports(q, cache: VQCache, config=None) -> tuple[bool, str]:
  """Whether the Hopper VQ kernel serves this query and cache (on this machine)."""
  from jaxkv.attention import is_hopper  # pylint: disable=import-outside-toplevel
  from pallas_kernels import mosaic_vq_attention  # pylint: disable=import-outside-toplevel
  if not is_hopper():
    return False, "the Mosaic GPU kernels need a Hopper (sm_90) GPU"
  block_k = 64 if config is None else config.block_k
  sinks = cache.fmt.sink_tokens
  return mosaic_vq_attention.supports(
      head_dim=cache.head_dim, k_spec=cache.fmt.spec("k"), v_spec=cache.fmt.spec("v"),
      q_rows=q.shape[1] * q.shape[2] // cache.kv_heads, dtype=cache.k_residual.dtype,
      token_group=cache.fmt.token_group, residual=cache.fmt.residual,
      capacity=cache.storage_len, block_k=block_k, sink_tokens=sinks,
      skip_tokens=sink_skip(sinks, block_k))


def _kernel_config(q, cache: VQCache, impl: str, config):
  """The config the ``impl`` VQ kernel runs (``config`` or the kernel's own default)."""
  if config is not None:
    return config
  if impl == "triton":
    return vq_kernel.VQAttentionConfig.default(batch=cache.batch, tokens=cache.storage_len,
                                               kv_heads=cache.kv_heads)
  from pallas_kernels import mosaic_vq_attention  # pylint: disable=import-outside-toplevel
  return mosaic_vq_attention.auto_config(
      q_rows=q.shape[1] * q.shape[2] // cache.kv_heads, head_dim=cache.head_dim,
      k_spec=cache.fmt.spec("k"), v_spec=cache.fmt.spec("v"), dtype=cache.k_residual.dtype,
      batch=cache.batch, capacity=cache.storage_len, kv_heads=cache.kv_heads,
      token_group=cache.fmt.token_group, residual=cache.fmt.residual)


def resolve(q, cache: VQCache, implementation, config=None) -> str:
  """``"reference"``, ``"triton"`` or ``"mosaic"``; ValueError naming why a forced
  kernel cannot run. ``None`` tries Mosaic, then Triton on a GPU
  (`KERNEL_BY_DEFAULT`), then the reference."""
  if implementation is None:
    on_gpu = KERNEL_BY_DEFAULT and jax.default_backend() == "gpu"
    implementation = ("mosaic", "triton", "reference") if on_gpu else ("mosaic", "reference")
  names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
  reasons = []
  for name in names:
    if name not in _NAMES:
      raise ValueError(f"implementation={name!r} must be one of {_NAMES} or None")
    if name in ("reference", "xla"):
      return "reference"
    if name in ("mosaic", "pallas"):  # "pallas": Mosaic where it applies, else Triton
      if isinstance(config, vq_kernel.VQAttentionConfig):
        reasons.append("mosaic: config is a VQAttentionConfig (the Triton kernel's)")
      else:
        ok, why = mosaic_supports(q, cache, config)
        if ok:
          return "mosaic"
        reasons.append(f"mosaic: {why}")
      if name == "mosaic":
        continue
    if isinstance(config, mosaic_kernel.MosaicAttentionConfig):
      reasons.append(f"{name}: config is a MosaicAttentionConfig")
      continue
    ok, why = kernel_supports(q, cache)
    if ok:
      return "triton"
    reasons.append(f"{name}: {why}")
  raise ValueError(f"implementation={implementation!r} does not support this VQ cache: "
                   + "; ".join(reasons))


def _kernel(impl: str, q, cache: VQCache, view=None, skip_tokens: int = 0, *, scale, config,
            return_lse: bool = False):
  """The ``impl`` ("mosaic" / "triton") VQ kernel over ``cache``; the Mosaic one reads
  the stacked codes and residuals of a layer ``view`` (`LayerView`) in place."""
  kw = dict(k_spec=cache.fmt.spec("k"), v_spec=cache.fmt.spec("v"),
            token_group=cache.fmt.token_group, scale=scale, config=config,
            return_lse=return_lse, skip_tokens=skip_tokens)
  if impl == "triton":
    return vq_kernel.vq_decode_attention(
        q, cache.k_codes, cache.k_codebook, cache.v_codes, cache.v_codebook, cache.k_residual,
        cache.v_residual, cache.lengths, interpret=jax.default_backend() != "gpu", **kw)
  from pallas_kernels import mosaic_vq_attention  # pylint: disable=import-outside-toplevel
  k_codes, v_codes, k_res, v_res, layer = (cache.k_codes, cache.v_codes, cache.k_residual,
                                           cache.v_residual, None)
  if view is not None:  # the stacked codes and residuals, read in place
    st = view.stacked
    k_codes, v_codes, k_res, v_res = st.k.codes, st.v.codes, st.k_residual, st.v_residual
    layer = view.index
  return mosaic_vq_attention.mosaic_vq_decode_attention(
      q, k_codes, cache.k_codebook, v_codes, cache.v_codebook, k_res, v_res, cache.lengths,
      layer=layer, **kw)


def vq_decode_attention(q: jax.Array, cache: VQCache, *, scale=None,
                        implementation: str | Sequence[str] | None = None,
                        config: vq_kernel.VQAttentionConfig | None = None) -> jax.Array:
  """Attention of the S newest queries over a `VQCache` (see `jaxkv.decode_attention`).

  ``cache`` may also be a `jaxkv.VQModelCache.layer_view` (a `LayerView`):
  the Mosaic kernel reads that layer's codes and residual rows in place (a
  layer index into the stacked arrays); the Triton kernel and the reference
  take the layer's slice. ``scale`` is already validated by the caller
  (`jaxkv.attention.check_scale`). Returns ``[B, S, Hq, D]`` in q's dtype;
  NaN rows as `jaxkv.decode_attention`.
  """
  # pylint: disable-next=import-outside-toplevel
  from jaxkv.attention import _poison, reference_attention, refuse_unused_config
  view = None
  if not isinstance(cache, VQCache):  # a layer view: its slice gives shapes and codebooks
    view, cache = cache, cache.materialize()  # (slices nothing reads are dropped by XLA)
  _check_q(q, cache)
  if config is not None and not isinstance(
      config, (vq_kernel.VQAttentionConfig, mosaic_kernel.MosaicAttentionConfig)):
    raise TypeError(f"config must be a pallas_kernels.vq_attention.VQAttentionConfig (Triton) "
                    f"or a MosaicAttentionConfig (Mosaic) for a VQ cache, got "
                    f"{type(config).__name__}")
  impl = resolve(q, cache, implementation, config)
  refuse_unused_config(config, impl, implementation)
  if impl in ("mosaic", "triton") and cache.fmt.sink_tokens:
    # the kernel from skip on, the prefix [0, skip) exactly, merged (`jaxkv.sink_attention`)
    from jaxkv.sink_attention import sink_decode_attention  # pylint: disable=import-outside-toplevel
    config = _kernel_config(q, cache, impl, config)
    return sink_decode_attention(
        q, cache, functools.partial(_kernel, impl, q, cache, view, scale=scale, config=config),
        block=config.block_k, scale=scale, seq_bad=cache.nonfinite)
  if impl in ("mosaic", "triton"):
    out = _kernel(impl, q, cache, view, scale=scale, config=config)
  else:
    k, v = cache.dequantize()
    out = reference_attention(q, k, v, cache.lengths, scale=scale)
  return _poison(out, q, cache.nonfinite)
