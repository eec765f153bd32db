"""The Mosaic GPU 4-bit weight product (`pallas_kernels.mosaic_int4_matmul`).

On a Hopper GPU the kernel runs compiled against `int4_matmul_reference` (the
jnp spec over the unpacked codes). Elsewhere: the host-side operands are
checked by a float64 emulation of what the kernel's registers and MMA compute
(codes as ``c 2**(b - 133)`` per MMA column), and the kernel lowers for CUDA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.attention import is_hopper
from pallas_kernels import int4_matmul as im
from pallas_kernels import mosaic_dequant
from pallas_kernels import mosaic_int4_matmul as mm

ON_HOPPER = is_hopper()


def _weight(key, n_in, n_out):
  k1, k2, k3 = jax.random.split(key, 3)
  codes = jax.random.randint(k1, (n_in, n_out), 0, 16, jnp.int32)
  groups = n_in // 128
  scale = jax.random.uniform(k2, (groups, n_out), jnp.float32, 0.002, 0.02)
  zero = jax.random.uniform(k3, (groups, n_out), jnp.float32, -0.1, 0.1)
  return im.pack_weight(codes, 128), scale, zero


def test_operands_emulate_the_product():
  """float64 emulation of the kernel over `_operands`: registers ``c 2**(b - 133)``
  (column ``k`` holds the stored planar position `code_permutation`[k] of
  `transpose_packed`'s tile) times the x tile (input order), ``* scale 2**64 + zero
  sum(x)``."""
  n_in, n_out, rows = 256, 128, 3
  packed, scale, zero = _weight(jax.random.PRNGKey(0), n_in, n_out)
  x = jax.random.normal(jax.random.PRNGKey(1), (rows, n_in), jnp.float32).astype(jnp.bfloat16)
  n = 8
  xs, sums = mm._operands(x, rows, n)
  xs = np.asarray(xs.astype(jnp.float32), np.float64).reshape(n_in // 128, n, 128)
  tiles = np.asarray(mm.transpose_packed(packed))                       # [groups, out, 64]
  stored = np.concatenate([tiles & 15, tiles >> 4], axis=-1)            # planar positions
  perm = mosaic_dequant.code_permutation(128, 4)
  exps = mosaic_dequant.code_column_exponents(128, 4)
  y = np.zeros((n_out, n))
  for g in range(n_in // 128):
    regs = stored[g][:, perm].astype(np.float64) * 2.0 ** (exps - 133.0)  # [out, 128]
    prod = regs @ xs[g].T                                                # [out, N]
    y += (prod * np.asarray(scale[g], np.float64)[:, None] * 2.0 ** 64
          + np.asarray(zero[g], np.float64)[:, None] * np.asarray(sums[g, :n], np.float64)[None])
  want = np.asarray(im.int4_matmul_reference(x, packed, scale, zero, group=128), np.float64)
  np.testing.assert_allclose(y[:, :rows].T, want, rtol=1e-2, atol=1e-3)
  assert not y[:, rows:].any()
  assert sums.shape == (n_in // 128, 32) and not np.asarray(sums)[:, rows:].any()


def test_folded_operand_emulates_the_product():
  """float64 emulation of the folded kernel: `registers_rows_reference` (each weight
  rounded once to bf16, times ``2**-K_SHIFT``) times `_folded_operand`'s x tiles,
  summed over groups in one accumulator, against the float32 spec."""
  n_in, n_out, rows = 384, 128, 5
  packed, scale, zero = _weight(jax.random.PRNGKey(2), n_in, n_out)
  x = jax.random.normal(jax.random.PRNGKey(3), (rows, n_in), jnp.float32).astype(jnp.bfloat16)
  n = 8
  xs = mm._folded_operand(x, rows, n)
  xs = np.asarray(xs.astype(jnp.float32), np.float64).reshape(n_in // 128, n, 128)
  tiles = np.asarray(mm.transpose_packed(packed))                       # [groups, out, 64]
  y = np.zeros((n_out, n))
  for g in range(n_in // 128):
    regs = mosaic_dequant.registers_rows_reference(tiles[g], scale[g], zero[g])  # [out, 128]
    y += (np.asarray(regs, np.float64) * 2.0 ** -mosaic_dequant.K_SHIFT) @ xs[g].T
  want = np.asarray(im.int4_matmul_reference(x, packed, scale, zero, group=128), np.float64)
  np.testing.assert_allclose(y[:, :rows].T, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
  assert not y[:, rows:].any()
  # x_direct reads x itself (input order, unscaled; rows past `rows` zero) and
  # scales the accumulator instead: the same operand up to the exact 2**K_SHIFT
  xd = np.asarray(x, np.float64).reshape(rows, n_in // 128, 128).transpose(1, 0, 2)
  np.testing.assert_array_equal(xs[:, :rows] * 2.0 ** -mosaic_dequant.K_SHIFT, xd)


def test_default_splits_of_the_timed_shapes():
  """The split rule (about 3 programs per SM, rounded up, dividing the groups) gives
  the counts timed on the H200 (132 SMs; `mosaic_int4_matmul.default_splits`)."""
  want = {(4096, 6144): 8, (4096, 4096): 8, (4096, 28672): 2, (14336, 4096): 8,
          (4096, 14336): 4, (4096, 128256): 1}
  got = {shape: mm.default_splits(*shape, num_sms=132) for shape in want}
  assert got == want
  for n_in, n_out in want:  # always a divisor of the groups
    assert (n_in // 128) % mm.default_splits(n_in, n_out, num_sms=114) == 0


def test_refusals():
  packed, scale, zero = _weight(jax.random.PRNGKey(0), 256, 256)
  x = jnp.ones((2, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match="uint8"):
    mm.mosaic_int4_matmul(x, packed, scale, zero)                         # not transposed
  with pytest.raises(ValueError, match="group=64"):
    mm.mosaic_int4_matmul(x, mm.transpose_packed(packed), scale, zero, group=64)
  with pytest.raises(ValueError, match="x_direct=True needs fold=True"):
    mm.mosaic_int4_matmul(x, mm.transpose_packed(packed), scale, zero, fold=False,
                          x_direct=True)
  with pytest.raises(ValueError, match="65 rows"):
    mm.mosaic_int4_matmul(jnp.ones((65, 256), jnp.bfloat16), mm.transpose_packed(packed),
                          scale, zero)
  with pytest.raises(ValueError, match="num_splits=3"):
    mm.mosaic_int4_matmul(x, mm.transpose_packed(packed), scale, zero, num_splits=3)
  with pytest.raises(ValueError, match=r"packed.shape=\(96, 256\) must be \[in / 2, out\]"):
    mm.transpose_packed(packed[:96])
  with pytest.raises(ValueError, match=r"\[in / 128, out, 64\] = \[2, 256, 64\]"):
    mm.mosaic_int4_matmul(x, mm.transpose_packed(packed)[:, :128], scale, zero)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("n_in,n_out,lead,splits", [
    (256, 128, (1,), None), (512, 256, (2, 3), 2), (384, 128, (16,), 3), (256, 384, (40,), 1),
    (384, 768, (3,), None)])
def test_kernel(n_in, n_out, lead, splits, fold):
  packed, scale, zero = _weight(jax.random.PRNGKey(n_in + n_out), n_in, n_out)
  x = jax.random.normal(jax.random.PRNGKey(7), (*lead, n_in)).astype(jnp.bfloat16)
  codes = mm.transpose_packed(packed)
  if not ON_HOPPER:
    fn = lambda x, c, s, z: mm.mosaic_int4_matmul(x, c, s, z, num_splits=splits or 1,  # noqa: E731
                                                  fold=fold)
    text = jax.jit(fn).trace(x, codes, scale, zero).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return
  got = np.asarray(mm.mosaic_int4_matmul(x, codes, scale, zero, num_splits=splits, fold=fold),
                   np.float64)
  want = np.asarray(im.int4_matmul_reference(x, packed, scale, zero, group=128), np.float64)
  assert got.shape == (*lead, n_out)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("fold,n_in,n_out,lead", [(False, 512, 384, (5,)), (True, 512, 384, (5,)),
                                                  (True, 4096, 14336, (1,))])
def test_row_width_leaves_the_product_unchanged(fold, n_in, n_out, lead):
  """``wide_rows`` (code tiles as 128-byte rows) reads the same bytes into the
  same registers: the product is bit for bit the one of 64-byte rows; so is
  ``x_direct=False`` (x prepared as scaled, padded tiles by XLA). At a draft
  width, a regression guard for the barriers the kernel places itself (its
  former option of Pallas's automatic barriers returned wrong products there
  now and then, H200, 2026-11-29): each product three times, at 2 splits and
  at the default count, the first against the dequantize + dot spec."""
  packed, scale, zero = _weight(jax.random.PRNGKey(11), n_in, n_out)
  x = jax.random.normal(jax.random.PRNGKey(12), (*lead, n_in)).astype(jnp.bfloat16)
  codes = mm.transpose_packed(packed)
  combos = [dict(wide_rows=True), dict(wide_rows=False)]
  if fold:  # x read as it is, the 2**K_SHIFT on the accumulator: the same bits
    combos += [dict(x_direct=False)]
  if not ON_HOPPER:
    for kw in combos:
      fn = lambda x, c, s, z, _kw=kw: mm.mosaic_int4_matmul(x, c, s, z, num_splits=2,  # noqa: E731
                                                            fold=fold, **_kw)
      assert "mosaic_gpu" in jax.jit(fn).trace(x, codes, scale, zero).lower(
          lowering_platforms=("cuda",)).as_text()
    return
  reps = 3 if n_out > 1024 else 1
  outs = [np.asarray(mm.mosaic_int4_matmul(x, codes, scale, zero, num_splits=2, fold=fold, **kw))
          for kw in combos for _ in range(reps)]
  combos = [kw for kw in combos for _ in range(reps)]
  for kw, out in zip(combos[1:], outs[1:]):
    np.testing.assert_array_equal(out, outs[0], err_msg=str(kw))
  if reps > 1:  # the default split count (4 at 4096 x 14336 on 132 SMs): the same
    # bits every time, and the spec (float64) within the kernel's tolerance
    runs = [np.asarray(mm.mosaic_int4_matmul(x, codes, scale, zero, fold=fold))
            for _ in range(reps)]
    for run in runs[1:]:
      np.testing.assert_array_equal(run, runs[0])
    want = np.asarray(im.int4_matmul_reference(x, packed, scale, zero, group=128), np.float64)
    for got in (outs[0], runs[0]):
      np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-2,
                                 atol=2e-2 * np.abs(want).max())
