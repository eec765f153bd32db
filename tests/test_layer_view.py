"""Decode attention over one layer of a `ModelCache` read in place (`layer_view`).

The Triton kernel gets the stacked ``[L, B, H, ...]`` arrays and a (traced)
layer index instead of a slice, so XLA has no layer-sized buffer to copy for
the kernel call. Oracle: float64 attention over the layer's dequantized K/V.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from tests.oracle import np_attention


def _model_cache(fmt, layers, b, hkv, d, lengths, capacity, dtype, seed):
  caches = []
  for i in range(layers):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed + i))
    t = max(lengths)
    k = (jax.random.normal(k1, (b, t, hkv, d)) * 1.3 - 0.2).astype(dtype)
    v = jax.random.normal(k2, (b, t, hkv, d)).astype(dtype)
    c = jaxkv.KVCache.init(fmt, b, hkv, d, capacity, dtype, use_kernel=False)
    caches.append(c.prefill(k, v, jnp.asarray(lengths, jnp.int32)))
  return jaxkv.ModelCache.from_layers(caches)


@pytest.mark.parametrize("fmt,group,s,dtype", [
    ("kivi4", 4, 1, jnp.float32), ("int8", 2, 3, jnp.float32), ("bf16", 4, 1, jnp.bfloat16),
])
def test_layer_view_matches_float64(fmt, group, s, dtype):
  b, hkv, d, lengths = 2, 2, 64, (300, 141)
  seed = zlib.crc32(fmt.encode())
  mc = _model_cache(fmt, 3, b, hkv, d, lengths, 512, dtype, seed)
  q = jax.random.normal(jax.random.PRNGKey(seed + 99), (b, s, hkv * group, d)).astype(dtype)

  @jax.jit
  def attend(q, mc, index):  # traced layer index, as inside the layer scan
    return jaxkv.decode_attention(q, mc.layer_view(index), implementation="triton")

  for index in (2, 0):
    got = np.asarray(attend(q, mc, jnp.int32(index)), np.float64)
    kd, vd = mc.layer(index).dequantize()
    ref = np_attention(np.asarray(q, np.float64), np.asarray(kd), np.asarray(vd), lengths)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max(), rtol=0)
    # The reference path takes the materialized slice and agrees.
    via_ref = jaxkv.decode_attention(q, mc.layer_view(index), implementation="reference")
    np.testing.assert_allclose(np.asarray(via_ref, np.float64), ref,
                               atol=tol * np.abs(ref).max(), rtol=0)


def test_layer_view_lowers_for_cuda_without_slicing_the_cache():
  """Compiled-kernel lowering (Triton for CUDA) takes the stacked arrays whole."""
  import pallas_kernels as pk
  mc = _model_cache("kivi4", 3, 1, 2, 128, (700,), 1024, jnp.bfloat16, 5)  # 3 layers: not a power of two
  q = jnp.ones((1, 1, 8, 128), jnp.bfloat16)

  def f(q, mc, i):
    return pk.dequant_decode_attention(
        q, mc.k.codes, mc.k.scale, mc.k.zero, mc.v.codes, mc.v.scale, mc.v.zero,
        mc.k_residual, mc.v_residual, mc.lengths, fmt=mc.fmt, interpret=False, layer=i)

  text = jax.jit(f).trace(q, mc, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  # No slice of the stacked storage is taken outside the kernel.
  assert "dynamic_slice" not in text


# (format, Hq/Hkv, S, dtype, Mosaic config or None for the heuristic default)
MOSAIC_CASES = [
    ("kivi4", 4, 1, jnp.bfloat16, None),
    ("kivi2", 8, 2, jnp.float16, None),
    ("int8", 4, 1, jnp.bfloat16, None),
    ("kivi4", 4, 3, jnp.bfloat16, "v1"),  # query rows on M (the v1 kernel)
    ("bf16", 2, 1, jnp.bfloat16, None),
]


def _mosaic_config(which):
  from pallas_kernels import mosaic_attention as ma
  if which == "v1":
    return ma.MosaicAttentionConfig(block_k=64, num_splits=3, tokens_m=False,
                                    fold_scales=False, register_k=False, register_v=False)
  return None


@pytest.mark.parametrize("fmt,group,s,dtype,which", MOSAIC_CASES,
                         ids=[f"{c[0]}-g{c[1]}-s{c[2]}-{c[4] or 'default'}" for c in MOSAIC_CASES])
def test_layer_view_mosaic(fmt, group, s, dtype, which):
  """The Mosaic family reads the layer in place too: on a Hopper GPU compiled
  against float64 over the layer's dequantized K/V (traced layer index); off
  Hopper its CUDA lowering takes the stacked arrays whole (no slice)."""
  from jaxkv.attention import is_hopper
  from pallas_kernels import mosaic_attention as ma
  from pallas_kernels.side_spec import SideSpec
  b, hkv, d, lengths = 2, 2, 128, (700, 141)
  seed = zlib.crc32(f"mosaic-{fmt}-{group}-{s}".encode())
  mc = _model_cache(fmt, 3, b, hkv, d, lengths, 1024, dtype, seed)
  q = jax.random.normal(jax.random.PRNGKey(seed + 7), (b, s, hkv * group, d)).astype(dtype)
  config = _mosaic_config(which)
  if not is_hopper():
    mf = mc.fmt
    cfg = config or ma.MosaicAttentionConfig(block_k=64, num_splits=3)

    def f(q, mc, i):
      return ma.mosaic_decode_attention(
          q, mc.k.codes, mc.k.scale, mc.k.zero, mc.v.codes, mc.v.scale, mc.v.zero,
          mc.k_residual, mc.v_residual, mc.lengths, k_side=SideSpec.of(mf, "k", d),
          v_side=SideSpec.of(mf, "v", d), token_group=mf.token_group, residual=mf.residual,
          sm_scale=d ** -0.5, config=cfg, layer=i)

    text = jax.jit(f).trace(q, mc, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert "dynamic_slice" not in text  # the stacked storage goes to the kernel whole
    return

  @jax.jit
  def attend(q, mc, index):
    return jaxkv.decode_attention(q, mc.layer_view(index), implementation="mosaic",
                                  config=config)

  for index in (2, 0, 1):
    got = np.asarray(attend(q, mc, jnp.int32(index)), np.float64)
    kd, vd = mc.layer(index).dequantize()
    ref = np_attention(np.asarray(q, np.float64), np.asarray(kd), np.asarray(vd), lengths)
    tol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max(), rtol=0)


def _vq_model_cache(fmt_name, layers, b, hkv, d, lengths, capacity, dtype, seed):
  """A `VQModelCache` of ``layers`` prefilled `VQCache`s (each its own codebooks)."""
  fmt = jaxkv.VQ_PRESETS[fmt_name]
  caches = []
  for i in range(layers):
    keys = jax.random.split(jax.random.PRNGKey(seed + i), 4)
    books = tuple((jax.random.normal(keys[j], fmt.codebook_shape(side, hkv, d)) * 0.8 + 0.1)
                  .astype(fmt.codebook_dtype) for j, side in enumerate("kv"))
    t = max(lengths)
    k = (jax.random.normal(keys[2], (b, t, hkv, d)) * 1.5 + 0.2).astype(dtype)
    v = jax.random.normal(keys[3], (b, t, hkv, d)).astype(dtype)
    c = jaxkv.VQCache.init(fmt, books, b, hkv, d, capacity, dtype)
    caches.append(c.prefill(k, v, np.asarray(lengths)))
  return jaxkv.VQModelCache.from_layers(caches)


@pytest.mark.parametrize("block_k", [64, 128])
def test_layer_view_vq(block_k):
  """A `VQModelCache` layer through `decode_attention`: float64 over the layer's
  dequantized K/V (reference off a GPU; on a Hopper GPU the Mosaic VQ kernels,
  one and two warpgroups, reading the stacked codes in place); off Hopper the
  Mosaic kernel's CUDA lowering takes the stacked codes whole."""
  from jaxkv.attention import is_hopper
  from pallas_kernels import mosaic_attention as ma
  from pallas_kernels import mosaic_vq_attention as mv
  b, hkv, group, d, lengths = 2, 2, 4, 128, (700, 141)
  mc = _vq_model_cache("cq2", 3, b, hkv, d, lengths, 1024, jnp.bfloat16, 77 + block_k)
  q = jax.random.normal(jax.random.PRNGKey(block_k), (b, 1, hkv * group, d)).astype(jnp.bfloat16)
  config = ma.MosaicAttentionConfig(block_k=block_k, num_splits=3,
                                    max_concurrent_steps=2 if block_k == 128 else 4)
  if is_hopper():
    impl, cfg, tol = "mosaic", config, 2e-2
  else:
    impl, cfg, tol = "reference", None, 4e-3  # the output is bfloat16
    fmt = mc.fmt

    def f(q, mc, i):
      layer = mc.layer(i)  # codebooks only: [H, ...] slices
      return mv.mosaic_vq_decode_attention(
          q, mc.k.codes, layer.k_codebook, mc.v.codes, layer.v_codebook, mc.k_residual,
          mc.v_residual, mc.lengths, k_spec=fmt.spec("k"), v_spec=fmt.spec("v"),
          token_group=fmt.token_group, config=config, layer=i)

    text = jax.jit(f).trace(q, mc, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    codes_slice = "x".join(map(str, (1, *mc.k.codes.shape[1:])))  # one layer of the codes
    assert f"tensor<{codes_slice}xui8>" not in text    # not sliced out: read in place

  @jax.jit
  def attend(q, mc, index):
    return jaxkv.decode_attention(q, mc.layer_view(index), implementation=impl, config=cfg)

  for index in (2, 0):
    got = np.asarray(attend(q, mc, jnp.int32(index)), np.float64)
    kd, vd = mc.layer(index).dequantize()
    ref = np_attention(np.asarray(q, np.float64), np.asarray(kd, np.float64),
                       np.asarray(vd, np.float64), lengths)
    np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max(), rtol=0)


def _mosaic_module_text(lowered_text: str) -> str:
  """The Mosaic GPU kernel of a lowered call with sizes and constants masked
  (`bench.mosaic_module.module_text`)."""
  from bench.mosaic_module import module_text
  try:
    return module_text(lowered_text, masked=True)
  except ImportError as e:  # pragma: no cover  (jax internals moved)
    pytest.skip(f"cannot parse Mosaic GPU modules with this jax: {e}")


@pytest.mark.parametrize("fmt", ["kivi2", "kivi4"])
def test_mosaic_layer_kernel_is_the_single_cache_kernel(fmt):
  """Reading one layer of the stacked arrays in place, or a batch of
  sequences, compiles to the same kernel as a single sequence's cache (only
  array sizes differ): every cache array, q and the partial outputs are
  indexed by one row (`mosaic_attention.head_rows`). The
  two-index form cost the 2-bit kernel 17 registers and a program per SM in
  the decode step (168 -> 185 registers, H200, mosaic-NOTES 2026-11-27)."""
  import dataclasses as dc
  from jaxkv import attention as jattn
  from pallas_kernels import mosaic_attention as ma
  config = dc.replace(ma.MosaicAttentionConfig.default(batch=1, tokens=4096, kv_heads=8,
                                                       k_bits=int(fmt[-1]), v_bits=int(fmt[-1])),
                      num_splits=8)
  q = jnp.zeros((1, 1, 32, 128), jnp.bfloat16)
  single = jaxkv.KVCache.init(fmt, 1, 8, 128, 4096, jnp.bfloat16, use_kernel=False)
  stacked = jaxkv.ModelCache.init(fmt, 3, 1, 8, 128, 4096, jnp.bfloat16, use_kernel=False)

  def one(q, c):
    return jattn._mosaic_attention(q, c, scale=None, config=config, seq_bad=c.nonfinite)

  def layered(q, c, i):  # what decode_attention hands the kernel for a layer view
    view = c.layer_view(i)
    c = dc.replace(view.stacked, lengths=view.lengths, overflow=view.overflow)
    return jattn._mosaic_attention(q, c, scale=None, config=config, layer=view.index,
                                   seq_bad=c.nonfinite)

  lower = lambda f, *a: jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()
  a = _mosaic_module_text(lower(one, q, single))
  b = _mosaic_module_text(lower(layered, q, stacked, jnp.int32(2)))
  assert "mosaic_gpu" in a
  assert a == b
  # Several sequences: q and the partial outputs are flat rows too, so a batch
  # compiles to the B = 1 kernel (kivi2 at B = 8 had 187 registers against
  # 168 at B = 1 with [B, H, ...] q and outputs, H200 2026-11-27).
  batch3 = jaxkv.KVCache.init(fmt, 3, 8, 128, 4096, jnp.bfloat16, use_kernel=False)
  q3 = jnp.zeros((3, 1, 32, 128), jnp.bfloat16)
  assert _mosaic_module_text(lower(one, q3, batch3)) == a
