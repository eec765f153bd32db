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
