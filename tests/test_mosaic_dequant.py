"""4/2-bit codes -> wgmma A-operand registers (`pallas_kernels.mosaic_dequant`).

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


def _codes(width, seed, rows=64):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, (rows, width)), jnp.uint8)


@pytest.mark.parametrize("head_dim,bits", [(64, 4), (128, 4), (64, 2), (128, 2)])
def test_permutation_is_a_bijection_of_planar_channels(head_dim, bits):
  perm = md.code_permutation(head_dim, bits)
  np.testing.assert_array_equal(np.sort(perm), np.arange(head_dim))
  # Each thread's two columns of a register come from one 32-bit word: bytes
  # 2 apart in the same plane.
  width = head_dim * bits // 8
  for col in range(0, head_dim, 2):
    a, b = perm[col], perm[col + 1]
    assert a // width == b // width and b - a == 2


def test_reference_reads_planar_nibbles():
  codes = np.asarray(_codes(64, 0))
  ref = md.registers_reference(codes, 4)
  perm = md.code_permutation(128, 4)
  for col in (0, 1, 2, 9, 63, 64, 127):
    ch = perm[col]
    want = codes[:, ch] & 15 if ch < 64 else codes[:, ch - 64] >> 4
    np.testing.assert_array_equal(ref[:, col], want)
  with pytest.raises(ValueError, match="head_dim=96"):
    md.code_permutation(96, 4)
  with pytest.raises(ValueError, match="bits=3"):
    md.code_permutation(128, 3)
  c2 = np.asarray(_codes(32, 1))
  ref2, perm2 = md.registers_reference(c2, 2), md.code_permutation(128, 2)
  for col in (0, 1, 5, 40, 127):
    plane, byte = divmod(perm2[col], 32)
    np.testing.assert_array_equal(ref2[:, col], (c2[:, byte] >> (2 * plane)) & 3)


@pytest.mark.parametrize("head_dim,bits,rows,wide", [
    (64, 4, 64, False), (128, 4, 64, False), (64, 2, 64, False), (128, 2, 64, False),
    (128, 4, 128, False), (128, 2, 128, False),
    (128, 4, 128, True), (64, 4, 64, True), (128, 2, 64, True), (64, 2, 128, True)])
def test_dequant_registers(head_dim, bits, rows, wide):
  """`dequant_codes` registers equal the numpy reading of the codes; ``wide``: the
  same tile copied as 128-byte rows of several tokens gives the same registers."""
  codes = _codes(head_dim * bits // 8, head_dim + bits + rows, rows)
  if not ON_HOPPER:
    jax.jit(md.probe_dequant, static_argnames=("bits", "wide")).trace(
        codes, bits=bits, wide=wide).lower(lowering_platforms=("cuda",))
    return
  got = np.asarray(md.probe_dequant(codes, bits=bits, wide=wide), np.float32)
  np.testing.assert_array_equal(got, md.registers_reference(np.asarray(codes), bits))


@pytest.mark.parametrize("head_dim,bits,rows,rows_dtype", [
    (64, 4, 64, jnp.bfloat16), (128, 4, 64, jnp.float16), (64, 2, 64, jnp.float16),
    (128, 2, 128, jnp.bfloat16), (128, 4, 128, jnp.float16)])
def test_dequant_registers_affine(head_dim, bits, rows, rows_dtype):
  """Codes times their channel's scale plus its zero, one bf16 rounding, columns permuted
  (float16 scale/zero rows, as the cache stores them, rounded to bfloat16 first)."""
  codes = _codes(head_dim * bits // 8, 7 * head_dim + bits + rows, rows)
  rng = np.random.default_rng(head_dim * bits)
  scale = jnp.asarray(rng.uniform(0.01, 0.5, (1, head_dim)), rows_dtype)
  zero = jnp.asarray(rng.normal(0.0, 2.0, (1, head_dim)), rows_dtype)
  if not ON_HOPPER:
    jax.jit(md.probe_dequant, static_argnames="bits").trace(codes, scale, zero, bits=bits).lower(
        lowering_platforms=("cuda",))
    return
  got = np.asarray(md.probe_dequant(codes, scale, zero, bits=bits), np.float32)
  want = md.registers_reference(np.asarray(codes), bits, np.asarray(scale, np.float64),
                                np.asarray(zero, np.float64))
  np.testing.assert_array_equal(got, want)
  # The oracle itself: column col is channel perm[col] of the dequantized tile.
  plain = md.registers_reference(np.asarray(codes), bits)
  perm = md.code_permutation(head_dim, bits)
  s64, z64 = np.asarray(scale, np.float64)[0, perm], np.asarray(zero, np.float64)[0, perm]
  exact = plain * s64 + z64
  # at most three bf16 roundings (scale, zero, result) apart
  np.testing.assert_array_less(np.abs(want - exact),
                               2 ** -7 * (np.abs(exact) + np.abs(plain * s64) + np.abs(z64)))


def test_dequant_affine_rows_checked():
  codes = _codes(64, 3)
  good = jnp.ones((1, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="scale_smem and zero_smem"):
    jax.jit(md.probe_dequant).trace(codes, good, None).lower(lowering_platforms=("cuda",))
  with pytest.raises(ValueError, match=r"zero must be bfloat16 or float16 \[1, 128\]"):
    jax.jit(md.probe_dequant).trace(codes, good, good[:, :64]).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize("head_dim,n,bits,rows", [(64, 8, 4, 64), (128, 8, 4, 64),
                                                  (128, 16, 4, 64), (64, 8, 2, 64),
                                                  (128, 16, 2, 64), (128, 16, 4, 128)])
def test_dequant_as_wgmma_operand(head_dim, n, bits, rows):
  codes = _codes(head_dim * bits // 8, head_dim + n + bits + rows, rows)
  q = jax.random.normal(jax.random.PRNGKey(n), (n, head_dim), jnp.float32).astype(jnp.bfloat16)
  if not ON_HOPPER:
    jax.jit(md.probe_scores, static_argnames="bits").trace(codes, q, bits=bits).lower(
        lowering_platforms=("cuda",))
    return
  got = np.asarray(md.probe_scores(codes, q, bits=bits), np.float64)
  c = np.asarray(codes)
  mask = (1 << bits) - 1
  channels = np.concatenate([(c >> (bits * p)) & mask for p in range(8 // bits)],
                            axis=1).astype(np.float64)                   # [rows, D] planar
  want = channels @ np.asarray(q, np.float64).T
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# ------------------------------------------------ transposed 4-bit V (ldmatrix)
def test_vt_permutation_is_a_bijection_and_reference_reads_planes():
  for bits, width in ((4, 64), (2, 32)):
    perm = md.vt_permutation(128, bits)
    np.testing.assert_array_equal(np.sort(perm), np.arange(128))
    codes = np.asarray(_codes(width, 5 + bits))
    ref = md.registers_t_reference(codes, bits)                           # [D, rows]
    for row in (0, 7, 8, 63, 64, 100, 127):
      plane, byte = divmod(perm[row], width)
      np.testing.assert_array_equal(ref[row], (codes[:, byte] >> (bits * plane)) & (2**bits - 1))
  with pytest.raises(ValueError, match="head_dim=64"):
    md.vt_permutation(64)
  with pytest.raises(ValueError, match="bits=8"):
    md.vt_permutation(128, 8)


@pytest.mark.parametrize("bits,rows,n,swizzle,wide", [
    (4, 64, 16, 0, False), (4, 64, 16, 64, False), (4, 128, 16, 64, False),
    (4, 64, 32, 64, False), (4, 128, 32, 0, False), (2, 64, 16, 0, False),
    (2, 128, 16, 32, False), (2, 64, 32, 32, False),
    (4, 128, 16, 128, True), (4, 64, 32, 0, True), (2, 128, 16, 128, True),
    (2, 64, 16, 0, True), (4, 64, 16, 128, True), (2, 64, 16, 128, True)])
def test_transposed_codes_as_wgmma_operand(bits, rows, n, swizzle, wide):
  """``dequant_codes_t`` registers as the A operand of ``O^T = V^T P^T``: equals the
  float64 product of the codes with P, rows in `vt_permutation` order; ``wide``:
  the tile copied as 128-byte rows (swizzled by 128 bytes or plain)."""
  codes = _codes(128 * bits // 8, bits + rows + n + swizzle, rows)
  p_t = jax.random.uniform(jax.random.PRNGKey(rows + n), (rows, n), jnp.float32).astype(
      jnp.bfloat16)
  if not ON_HOPPER:
    jax.jit(md.probe_pv, static_argnames=("bits", "swizzle", "wide")).trace(
        codes, p_t, bits=bits, swizzle=swizzle, wide=wide).lower(lowering_platforms=("cuda",))
    return
  got = np.asarray(md.probe_pv(codes, p_t, bits=bits, swizzle=swizzle, wide=wide), np.float64)
  want = md.registers_t_reference(np.asarray(codes), bits).astype(np.float64) @ np.asarray(
      p_t, np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# ------------------------------------------------ subnormal codes (and only)
@pytest.mark.parametrize("head_dim,bits,rows,rows_dtype", [
    (64, 4, 64, jnp.bfloat16), (128, 4, 128, jnp.float16), (128, 2, 128, jnp.bfloat16),
    (64, 2, 64, jnp.float16)])
def test_subnormal_registers(head_dim, bits, rows, rows_dtype):
  """``subnormal=True``: the registers are the codes times 2**-133 (bf16 subnormals),
  and with an affine ``(code * scale + zero) * 2**-K_SHIFT`` with one rounding
  (float16 rows, as kivi caches store them, rounded to bfloat16 first)."""
  codes = _codes(head_dim * bits // 8, 3 * head_dim + bits + rows, rows)
  rng = np.random.default_rng(rows + bits)
  scale = jnp.asarray(rng.uniform(0.01, 0.5, (1, head_dim)), rows_dtype)
  zero = jnp.asarray(rng.normal(0.0, 2.0, (1, head_dim)), rows_dtype)
  probe = jax.jit(md.probe_dequant, static_argnames=("bits", "subnormal"))
  if not ON_HOPPER:
    for extra in ((), (scale, zero)):
      probe.trace(codes, *extra, bits=bits, subnormal=True).lower(lowering_platforms=("cuda",))
    return
  c = np.asarray(codes)
  got = np.asarray(probe(codes, bits=bits, subnormal=True), np.float64)
  np.testing.assert_array_equal(got * 2.0 ** md.SUBNORMAL_EXP, md.registers_reference(c, bits))
  got = np.asarray(probe(codes, scale, zero, bits=bits, subnormal=True), np.float64)
  want = md.registers_reference(c, bits, np.asarray(scale, np.float64),
                                np.asarray(zero, np.float64))
  tiny = np.abs(want) < 2.0 ** -62   # bf16 subnormal after the shift: not exact
  np.testing.assert_array_equal(np.where(tiny, 0, got * 2.0 ** md.K_SHIFT),
                                np.where(tiny, 0, want))


@pytest.mark.parametrize("head_dim,n,bits,rows", [(64, 8, 4, 64), (128, 8, 4, 128),
                                                  (128, 16, 2, 128)])
def test_subnormal_scores_equal_the_plain_path(head_dim, n, bits, rows):
  """Scores from subnormal K registers (q times 2**K_SHIFT) equal the exact-code path's
  bit for bit, and the float64 product of the dequantized tile with q."""
  codes = _codes(head_dim * bits // 8, 5 * head_dim + n + bits, rows)
  rng = np.random.default_rng(n + rows)
  scale = jnp.asarray(rng.uniform(0.01, 0.5, (1, head_dim)), jnp.bfloat16)
  zero = jnp.asarray(rng.normal(0.0, 2.0, (1, head_dim)), jnp.bfloat16)
  q = jax.random.normal(jax.random.PRNGKey(n + 1), (n, head_dim), jnp.float32).astype(
      jnp.bfloat16)
  probe = jax.jit(md.probe_scores, static_argnames=("bits", "subnormal"))
  if not ON_HOPPER:
    probe.trace(codes, q, scale, zero, bits=bits, subnormal=True).lower(
        lowering_platforms=("cuda",))
    return
  got = np.asarray(probe(codes, q, scale, zero, bits=bits, subnormal=True), np.float64)
  plain = np.asarray(probe(codes, q, scale, zero, bits=bits), np.float64)
  np.testing.assert_array_equal(got, plain)
  x = md.registers_reference(np.asarray(codes), bits, np.asarray(scale, np.float64),
                             np.asarray(zero, np.float64))          # [rows, D] MMA columns
  q_perm = np.asarray(q, np.float64)[:, md.code_permutation(head_dim, bits)]
  want = x @ q_perm.T
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("bits,rows,n,swizzle", [(4, 128, 16, 64), (2, 128, 16, 32),
                                                 (4, 64, 32, 0)])
def test_subnormal_transposed_codes_equal_the_plain_path(bits, rows, n, swizzle):
  """``dequant_codes_t(subnormal=True)`` with P scaled by 2**P_SHIFT gives the float64
  product of the codes with P, as the exact-code path does."""
  codes = _codes(128 * bits // 8, 11 * bits + rows + n, rows)
  # probabilities times V scales, some large and some tiny
  p_t = (jax.random.uniform(jax.random.PRNGKey(rows), (rows, n), jnp.float32)
         * jnp.exp2(jax.random.randint(jax.random.PRNGKey(n), (rows, 1), -20, 20))
         ).astype(jnp.bfloat16)
  probe = jax.jit(md.probe_pv, static_argnames=("bits", "swizzle", "subnormal"))
  if not ON_HOPPER:
    probe.trace(codes, p_t, bits=bits, swizzle=swizzle, subnormal=True).lower(
        lowering_platforms=("cuda",))
    return
  got = np.asarray(probe(codes, p_t, bits=bits, swizzle=swizzle, subnormal=True), np.float64)
  plain = np.asarray(probe(codes, p_t, bits=bits, swizzle=swizzle), np.float64)
  want = md.registers_t_reference(np.asarray(codes), bits).astype(np.float64) @ np.asarray(
      p_t, np.float64)
  # Not bit-equal to the plain path on an H100 (the tensor core's f32 sums of
  # the scaled products differ by a few units in the last place): both must
  # meet the float64 oracle.
  np.testing.assert_allclose(plain, want, rtol=0, atol=1e-5 * np.abs(want).max())
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# ------------------------------------------------ byte masks (subnormal codes, one shift a word)
def test_byte_mask_pairs():
  """Each pair's (shift, mask, exponent): whole-byte shifts, the code masked in place;
  the mask picks the same bits as shift-then-mask, and the value is the code times
  2**exponent (bf16 subnormals and the first normal binade share the spacing)."""
  for bits in (4, 2):
    low = (1 << bits) - 1
    for offset in range(0, 16, bits):
      shift, mask, e = md._byte_mask(offset, bits, True)
      assert shift % 8 == 0 and e == offset - shift
      assert int(mask, 16) == ((low << e) | (low << (16 + e)))
      # every code value in place: the bf16 bit pattern's value in units of 2**-133
      for code in range(1 << bits):
        pattern = code << e
        exp_field, mant = pattern >> 7, pattern & 127
        value = mant if exp_field == 0 else (128 + mant) * 2 ** (exp_field - 1)
        assert value == code * 2 ** e
    assert md._byte_mask(12, bits, False) == (12, md._MASK[bits], 0)
  np.testing.assert_array_equal(md.vt_row_factors(128, 4)[[0, 7, 8, 15, 16, 72]],
                                [1, 1, 16, 16, 1, 16])


@pytest.mark.parametrize("head_dim,bits,rows,rows_dtype", [
    (64, 4, 64, jnp.bfloat16), (128, 4, 128, jnp.float16), (128, 2, 128, jnp.bfloat16),
    (64, 2, 64, jnp.float16)])
def test_byte_mask_registers_equal_subnormal(head_dim, bits, rows, rows_dtype):
  """``byte_masks``: K registers (with the affine) are the subnormal path's, bit for bit;
  so are ``shuffle_scales``' on every path."""
  codes = _codes(head_dim * bits // 8, 7 * head_dim + bits + rows, rows)
  rng = np.random.default_rng(rows + 3 * bits)
  scale = jnp.asarray(rng.uniform(0.01, 0.5, (1, head_dim)), rows_dtype)
  zero = jnp.asarray(rng.normal(0.0, 2.0, (1, head_dim)), rows_dtype)
  probe = jax.jit(md.probe_dequant,
                  static_argnames=("bits", "subnormal", "byte_masks", "shuffle_scales", "wide"))
  with pytest.raises(ValueError, match="byte_masks"):
    probe.trace(codes, scale, zero, bits=bits, subnormal=False, byte_masks=True).lower(
        lowering_platforms=("cuda",))
  with pytest.raises(ValueError, match="shuffle_scales"):
    probe.trace(codes, bits=bits, shuffle_scales=True).lower(lowering_platforms=("cuda",))
  if not ON_HOPPER:
    for kw in ({"subnormal": True, "byte_masks": True},
               {"subnormal": True, "byte_masks": True, "shuffle_scales": True},
               {"shuffle_scales": True}, {"shuffle_scales": True, "subnormal": True},
               {"subnormal": True, "byte_masks": True, "shuffle_scales": True, "wide": True}):
      probe.trace(codes, scale, zero, bits=bits, **kw).lower(lowering_platforms=("cuda",))
    return
  got = np.asarray(probe(codes, scale, zero, bits=bits, subnormal=True, byte_masks=True),
                   np.float64)
  want = md.registers_reference(np.asarray(codes), bits, np.asarray(scale, np.float64),
                                np.asarray(zero, np.float64))
  tiny = np.abs(want) < 2.0 ** -62
  np.testing.assert_array_equal(np.where(tiny, 0, got * 2.0 ** md.K_SHIFT),
                                np.where(tiny, 0, want))
  sub = np.asarray(probe(codes, scale, zero, bits=bits, subnormal=True), np.float64)
  np.testing.assert_array_equal(got, sub)
  # shuffle_scales: each lane converts its share of the scale/zero pairs and
  # takes the rest from the lanes of the same columns: the same registers.
  shf = probe(codes, scale, zero, bits=bits, subnormal=True, byte_masks=True,
              shuffle_scales=True)
  np.testing.assert_array_equal(np.asarray(shf, np.float64), got)
  # the tile copied as 128-byte rows (the attention kernel's K tiles): the same registers
  wide = md.probe_dequant(codes, scale, zero, bits=bits, subnormal=True, byte_masks=True,
                          shuffle_scales=True, wide=True)
  np.testing.assert_array_equal(np.asarray(wide, np.float64), got)
  for kw in ({}, {"subnormal": True}):  # exact codes; subnormal without byte masks
    np.testing.assert_array_equal(
        np.asarray(probe(codes, scale, zero, bits=bits, shuffle_scales=True, **kw), np.float64),
        np.asarray(probe(codes, scale, zero, bits=bits, **kw), np.float64), err_msg=f"{kw}")


@pytest.mark.parametrize("bits,rows,n,swizzle,wide", [
    (4, 128, 16, 64, False), (2, 128, 16, 32, False), (4, 64, 32, 0, False),
    (2, 64, 16, 0, False), (4, 128, 16, 128, True), (2, 128, 16, 128, True),
    (4, 64, 16, 128, True)])
def test_byte_mask_transposed_codes(bits, rows, n, swizzle, wide):
  """``dequant_codes_t(byte_masks=True)``: the product with P, its rows' powers of two
  taken off by `scale_halves`, meets the float64 product of the codes with P."""
  codes = _codes(128 * bits // 8, 13 * bits + rows + n, rows)
  p_t = (jax.random.uniform(jax.random.PRNGKey(rows + 5), (rows, n), jnp.float32)
         * jnp.exp2(jax.random.randint(jax.random.PRNGKey(n + 5), (rows, 1), -20, 20))
         ).astype(jnp.bfloat16)
  probe = jax.jit(md.probe_pv,
                  static_argnames=("bits", "swizzle", "subnormal", "byte_masks", "wide"))
  if not ON_HOPPER:
    probe.trace(codes, p_t, bits=bits, swizzle=swizzle, subnormal=True, byte_masks=True,
                wide=wide).lower(lowering_platforms=("cuda",))
    return
  got = np.asarray(probe(codes, p_t, bits=bits, swizzle=swizzle, subnormal=True,
                         byte_masks=True, wide=wide), np.float64)
  want = md.registers_t_reference(np.asarray(codes), bits).astype(np.float64) @ np.asarray(
      p_t, np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# ------------------------------------------------ K scale folded into q (fold_k_operands)
@pytest.mark.parametrize("bits,rows,n,rows_dtype", [(4, 128, 8, jnp.float16),
                                                     (4, 64, 16, jnp.bfloat16),
                                                     (2, 128, 8, jnp.float16)])
def test_fold_scores(bits, rows, n, rows_dtype):
  """Scores with the K scale folded into q and the zero term as an MMA of ones meet
  the float64 product of the dequantized tile (float16 rows rounded to bf16 as the
  register path does) with q, within bf16 operand rounding."""
  codes = _codes(128 * bits // 8, 17 * bits + rows + n, rows)
  rng = np.random.default_rng(n + rows + bits)
  scale = jnp.asarray(rng.uniform(0.01, 0.5, (1, 128)), rows_dtype)
  zero = jnp.asarray(rng.normal(0.0, 2.0, (1, 128)), rows_dtype)
  q = jax.random.normal(jax.random.PRNGKey(n + 7), (n, 128), jnp.float32).astype(jnp.bfloat16)
  np.testing.assert_array_equal(md.code_column_exponents(128, 4)[[0, 7, 8, 15, 16, 24, 32]],
                                [0, 0, 4, 4, 0, 4, 0])
  probe = jax.jit(md.probe_fold_scores, static_argnames=("bits",))
  if not ON_HOPPER:
    probe.trace(codes, q, scale, zero, bits=bits).lower(lowering_platforms=("cuda",))
    return
  got = np.asarray(probe(codes, q, scale, zero, bits=bits), np.float64)
  mask = (1 << bits) - 1
  c = np.asarray(codes)
  chans = np.concatenate([(c >> (bits * p)) & mask for p in range(8 // bits)], axis=-1)
  k = chans * np.asarray(scale, np.float64) + np.asarray(zero, np.float64)   # [rows, D]
  want = k @ np.asarray(q, np.float64).T
  # each q*s product is rounded to bf16 once (relative 2**-9), the zero term kept to ~2**-16
  tol = 2.0 ** -8 * (np.abs(chans * np.asarray(scale, np.float64)) @ np.abs(
      np.asarray(q, np.float64)).T) + 1e-4 * np.abs(want).max()
  assert np.all(np.abs(got - want) <= tol), np.abs(got - want).max()


def test_wide_tiles_refused_where_they_do_not_fit():
  """A wide tile takes only its own row width (128 bytes) as swizzle, and rows
  already `WIDE_ROW` bytes wide have no wide view."""
  p_t = jnp.ones((128, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="[Ss]wizzle.?64"):  # the probe tile or the kernel
    jax.jit(md.probe_pv, static_argnames=("bits", "swizzle", "wide")).trace(
        _codes(64, 3, 128), p_t, bits=4, swizzle=64, wide=True).lower(
            lowering_platforms=("cuda",))
  with pytest.raises(ValueError, match="wide=True needs code rows narrower than 128"):
    jax.jit(md.probe_dequant, static_argnames=("bits", "wide")).trace(
        _codes(128, 4, 64), bits=4, wide=True).lower(lowering_platforms=("cuda",))


# ------------------------------------------------ hierarchical codes (QuantSpec's target view)
def _hier_tiles(rows, head_dim, seed, rows_dtype):
  """Plane tiles of `jaxkv.hierarchical` codes of fresh random K rows (one channel group
  of ``rows`` tokens), their stored scale/zero and the float32 target view."""
  from jaxkv import hierarchical
  x = jax.random.normal(jax.random.PRNGKey(seed), (rows, head_dim), jnp.float32) * 2.0 + 0.5
  codes, scale, zero = hierarchical.quantize(x, axis="channel", group=rows, block=rows,
                                             scale_dtype=rows_dtype)
  upper, lower = hierarchical.packed_planes(codes, rows)
  want = hierarchical.dequantize(codes, scale, zero, axis="channel", block=rows)
  return upper, lower, scale, zero, np.asarray(want, np.float64)


@pytest.mark.parametrize("head_dim,rows,rows_dtype,kw", [
    (128, 128, jnp.float16, {"byte_masks": True, "shuffle_scales": True, "wide": True}),
    (128, 128, jnp.bfloat16, {"byte_masks": True, "shuffle_scales": True}),
    (128, 64, jnp.float16, {"byte_masks": True}),
    (64, 64, jnp.bfloat16, {}),
    (64, 128, jnp.float16, {"shuffle_scales": True})])
def test_hierarchical_registers(head_dim, rows, rows_dtype, kw):
  """``lower_smem``: the two planes joined to 8-bit codes with the target view's affine
  in one rounding: equal to `registers_reference`, and within that rounding of
  `jaxkv.hierarchical.dequantize`'s target view (float32, the library's oracle)."""
  upper, lower, scale, zero, target = _hier_tiles(rows, head_dim, 11 * rows + head_dim,
                                                  rows_dtype)
  probe = jax.jit(md.probe_dequant,
                  static_argnames=("bits", "subnormal", "byte_masks", "shuffle_scales", "wide"))
  with pytest.raises(ValueError, match="lower_smem"):
    probe.trace(upper, scale, zero, bits=4, lower=lower).lower(lowering_platforms=("cuda",))
  with pytest.raises(ValueError, match="lower_smem"):
    probe.trace(upper, scale, zero, bits=4, subnormal=True, lower=lower[:, :16]).lower(
        lowering_platforms=("cuda",))
  if not ON_HOPPER:
    probe.trace(upper, scale, zero, bits=4, subnormal=True, lower=lower, **kw).lower(
        lowering_platforms=("cuda",))
    return
  got = np.asarray(probe(upper, scale, zero, bits=4, subnormal=True, lower=lower, **kw),
                   np.float64) * 2.0 ** md.K_SHIFT
  want = md.registers_reference(np.asarray(upper), 4, scale, zero, lower=np.asarray(lower))
  tiny = np.abs(want) < 2.0 ** -62
  np.testing.assert_array_equal(np.where(tiny, 0, got), np.where(tiny, 0, want))
  # Against the library's target view: the registers carry the scale rounded to
  # bfloat16 (times the 8-bit code / 16 <= 16), the zero term's rounding and the
  # result's (each <= 2**-8 relative: bfloat16's unit roundoff).
  perm = md.code_permutation(head_dim, 4)
  s64 = np.asarray(scale, np.float64).reshape(-1)[perm]
  z64 = np.asarray(zero, np.float64).reshape(-1)[perm]
  code8 = (md.registers_reference(np.asarray(upper), 4) * 16
           + md.registers_reference(np.asarray(lower), 4)).astype(np.float64)
  tol = 2.0 ** -8 * (code8 / 16 * np.abs(s64) + np.abs(z64 - s64 / 2)
                     + 1.01 * np.abs(target[:, perm])) + 1e-6
  assert np.all(np.abs(got - target[:, perm]) <= tol), np.abs(got - target[:, perm]).max()


@pytest.mark.parametrize("rows,n,swizzle,wide,byte_masks", [
    (128, 16, 64, False, True), (128, 32, 128, True, True), (64, 16, 0, False, False),
    (128, 16, 0, False, True)])
def test_hierarchical_transposed_codes(rows, n, swizzle, wide, byte_masks):
  """``dequant_codes_t(lower_smem=...)``: the product of the joined 8-bit codes with P
  meets the float64 product of ``16 C_U + C_L'`` with P (codes from `jaxkv.hierarchical`)."""
  upper, lower, *_ = _hier_tiles(rows, 128, 5 * rows + n, jnp.float16)
  p_t = (jax.random.uniform(jax.random.PRNGKey(rows + n), (rows, n), jnp.float32)
         * jnp.exp2(jax.random.randint(jax.random.PRNGKey(n + 9), (rows, 1), -20, 20))
         ).astype(jnp.bfloat16)
  probe = jax.jit(md.probe_pv,
                  static_argnames=("bits", "swizzle", "subnormal", "byte_masks", "wide"))
  with pytest.raises(ValueError, match="lower_smem"):
    probe.trace(upper, p_t, bits=4, lower=lower).lower(lowering_platforms=("cuda",))
  kw = dict(bits=4, swizzle=swizzle, subnormal=True, byte_masks=byte_masks, wide=wide)
  if not ON_HOPPER:
    probe.trace(upper, p_t, lower=lower, **kw).lower(lowering_platforms=("cuda",))
    return
  got = np.asarray(probe(upper, p_t, lower=lower, **kw), np.float64)
  u, lo = np.asarray(upper, np.int64), np.asarray(lower, np.int64)
  chans = np.concatenate([u & 15, u >> 4], axis=-1) * 16 + np.concatenate([lo & 15, lo >> 4],
                                                                          axis=-1)
  want = chans[:, md.vt_permutation(128, 4)].T.astype(np.float64) @ np.asarray(p_t, np.float64)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
  # Small integer weights: every product and sum is exact in float32, so each
  # token's joined code (both nibbles) is checked exactly.
  p_int = jax.random.randint(jax.random.PRNGKey(rows + 2 * n), (rows, n), 0, 4).astype(
      jnp.bfloat16)
  got = np.asarray(probe(upper, p_int, lower=lower, **kw), np.float64)
  np.testing.assert_array_equal(got, chans[:, md.vt_permutation(128, 4)].T.astype(np.float64)
                                @ np.asarray(p_int, np.float64))
  np.testing.assert_array_equal(
      md.registers_t_reference(np.asarray(upper), 4, lower=np.asarray(lower)),
      chans[:, md.vt_permutation(128, 4)].T)
