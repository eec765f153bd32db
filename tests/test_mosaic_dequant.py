"""4-bit codes -> wgmma A-operand registers (`pallas_kernels.mosaic_dequant`).

On a Hopper GPU the probes run compiled: the register contents must equal the
numpy codes of the permuted channels exactly, and the wgmma scores with q
permuted the same way must equal ``codes @ q^T`` in float64. Elsewhere the
probes are lowered for CUDA (the Pallas -> Mosaic GPU lowering, the inline
MLIR included, stops before PTX), as in `tests/test_mosaic_attention.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import is_hopper
from pallas_kernels import mosaic_dequant as md

ON_HOPPER = is_hopper()


def _codes(width, seed):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (64, width)), jnp.uint8)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_permutation_is_a_bijection_of_planar_channels(head_dim):
  perm = md.k4_permutation(head_dim)
  np.testing.assert_array_equal(np.sort(perm), np.arange(head_dim))
  # Each thread's two columns of a register come from one 32-bit word: bytes
  # 2 apart in the same nibble plane.
  width = head_dim // 2
  for col in range(0, head_dim, 2):
    a, b = perm[col], perm[col + 1]
    assert (a >= width) == (b >= width) and b - a == 2


def test_reference_reads_planar_nibbles():
  codes = np.asarray(_codes(64, 0))
  ref = md.k4_registers_reference(codes)
  perm = md.k4_permutation(128)
  for col in (0, 1, 2, 9, 63, 64, 127):
    ch = perm[col]
    want = codes[:, ch] & 15 if ch < 64 else codes[:, ch - 64] >> 4
    np.testing.assert_array_equal(ref[:, col], want)
  with pytest.raises(ValueError, match="head_dim=96"):
    md.k4_permutation(96)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_dequant_k4_registers(head_dim):
  codes = _codes(head_dim // 2, head_dim)
  if not ON_HOPPER:
    jax.jit(md.probe_dequant_k4).trace(codes).lower(lowering_platforms=("cuda",))
    return
  got = np.asarray(md.probe_dequant_k4(codes), np.float32)
  np.testing.assert_array_equal(got, md.k4_registers_reference(np.asarray(codes)))


@pytest.mark.parametrize("head_dim,n", [(64, 8), (128, 8), (128, 16)])
def test_dequant_k4_as_wgmma_operand(head_dim, n):
  codes = _codes(head_dim // 2, head_dim + n)
  q = jax.random.normal(jax.random.PRNGKey(n), (n, head_dim), jnp.float32).astype(jnp.bfloat16)
  if not ON_HOPPER:
    jax.jit(md.probe_scores_k4).trace(codes, q).lower(lowering_platforms=("cuda",))
    return
  got = np.asarray(md.probe_scores_k4(codes, q), np.float64)
  c = np.asarray(codes)
  channels = np.concatenate([c & 15, c >> 4], axis=1).astype(np.float64)   # [64, D]
  want = channels @ np.asarray(q, np.float64).T
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
