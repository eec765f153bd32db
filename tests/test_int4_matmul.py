"""The 4-bit weight matmul kernel (`pallas_kernels.int4_matmul`) and its storage.

Oracle: float64 numpy on the dequantized weights (``codes * scale + zero``
per group), fresh random codes, scales and zeros. CPU/CI runs the kernel in
Pallas interpret mode; ``JAXKV_TEST_GPU=1`` compiles it on the GPU.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import int4_matmul as i4

INTERPRET = os.environ.get("JAXKV_TEST_GPU", "0") != "1"


def _weights(rng, n_in, n_out, group):
  codes = rng.integers(0, 16, (n_in, n_out)).astype(np.uint8)
  scale = rng.uniform(0.005, 0.05, (n_in // group, n_out)).astype(np.float32)
  zero = rng.normal(0, 0.1, (n_in // group, n_out)).astype(np.float32)
  w = (codes.reshape(n_in // group, group, n_out).astype(np.float64) * scale[:, None, :]
       + zero[:, None, :]).reshape(n_in, n_out)
  return codes, scale, zero, w


def test_pack_layout_and_round_trip():
  rng = np.random.default_rng(0)
  codes = rng.integers(0, 16, (96, 40)).astype(np.uint8)
  packed = np.asarray(i4.pack_weight(jnp.asarray(codes), 32))
  assert packed.shape == (48, 40) and packed.dtype == np.uint8
  # Byte row g * 16 + j: input rows g * 32 + j (low nibble) and g * 32 + 16 + j (high).
  for g in range(3):
    for j in (0, 7, 15):
      np.testing.assert_array_equal(packed[g * 16 + j] & 15, codes[g * 32 + j])
      np.testing.assert_array_equal(packed[g * 16 + j] >> 4, codes[g * 32 + 16 + j])
  np.testing.assert_array_equal(np.asarray(i4.unpack_weight(jnp.asarray(packed), 32)), codes)


@pytest.mark.parametrize("n_in,n_out,group,lead,dtype,config", [
    (256, 96, 64, (1,), jnp.bfloat16, i4.Int4MatmulConfig(block_n=32, num_splits=2)),
    (512, 128, 128, (1, 5), jnp.float32, i4.Int4MatmulConfig(block_n=64, num_splits=4)),
    (192, 48, 32, (3,), jnp.float16, i4.Int4MatmulConfig(block_n=16, num_splits=3)),
    (384, 64, 128, (2, 8), jnp.bfloat16, None),  # 16 rows, default config
])
def test_int4_matmul_matches_float64(n_in, n_out, group, lead, dtype, config):
  rng = np.random.default_rng(n_in + n_out + group)
  codes, scale, zero, w = _weights(rng, n_in, n_out, group)
  x = jnp.asarray(rng.normal(size=(*lead, n_in)), dtype)
  want = np.asarray(x, np.float64) @ w
  got = i4.int4_matmul(x, i4.pack_weight(jnp.asarray(codes), group), jnp.asarray(scale),
                       jnp.asarray(zero), group=group, config=config, interpret=INTERPRET)
  assert got.shape == (*lead, n_out) and got.dtype == jnp.float32
  # Exact codes and float32 accumulation: only float32 rounding remains.
  np.testing.assert_allclose(np.asarray(got, np.float64), want,
                             atol=2e-6 * np.abs(want).max(), rtol=0)
  ref = i4.int4_matmul_reference(x, i4.pack_weight(jnp.asarray(codes), group),
                                 jnp.asarray(scale), jnp.asarray(zero), group=group)
  np.testing.assert_allclose(np.asarray(ref, np.float64), want, atol=2e-6 * np.abs(want).max())


def test_int4_matmul_refuses_what_it_cannot_serve():
  x = jnp.ones((1, 96), jnp.bfloat16)
  packed = jnp.zeros((48, 32), jnp.uint8)
  sc = jnp.ones((4, 32), jnp.float32)
  with pytest.raises(ValueError, match="group=24"):
    i4.int4_matmul(x, packed, sc, sc, group=24, interpret=True)
  with pytest.raises(ValueError, match="65 rows"):
    i4.int4_matmul(jnp.ones((65, 128), jnp.bfloat16), jnp.zeros((64, 32), jnp.uint8),
                   sc, sc, group=32, interpret=True)
  with pytest.raises(ValueError, match="scale"):
    i4.int4_matmul(jnp.ones((1, 128), jnp.bfloat16), jnp.zeros((64, 32), jnp.uint8),
                   sc[:2], sc[:2], group=32, interpret=True)
  with pytest.raises(ValueError, match="block_n=48"):
    i4.Int4MatmulConfig(block_n=48)
  with pytest.raises(ValueError, match="num_warps=3"):
    i4.Int4MatmulConfig(num_warps=3)
  with pytest.raises(ValueError, match="does not tile"):
    i4.int4_matmul(jnp.ones((1, 128), jnp.bfloat16), jnp.zeros((64, 32), jnp.uint8),
                   sc, sc, group=32, config=i4.Int4MatmulConfig(block_n=16, num_splits=3),
                   interpret=True)
