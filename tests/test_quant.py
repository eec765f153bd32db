"""Reference quantization and packing against the numpy oracle."""

import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import quant
from tests.oracle import np_quantize


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("n", [16, 64, 128])
def test_pack_unpack_roundtrip_bitwise(bits, n):
  rng = np.random.default_rng(bits * 1000 + n)
  codes = rng.integers(0, 2 ** bits, size=(3, 5, n), dtype=np.uint8)
  packed = quant.pack(jnp.asarray(codes), bits)
  assert packed.shape == (3, 5, n * bits // 8) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(quant.unpack(packed, bits)), codes)
  # And the other direction: every byte pattern survives unpack -> pack.
  raw = rng.integers(0, 256, size=(4, n * bits // 8), dtype=np.uint8)
  np.testing.assert_array_equal(np.asarray(quant.pack(quant.unpack(jnp.asarray(raw), bits), bits)), raw)


@pytest.mark.parametrize("bits", [4, 2])
def test_planar_layout_documented(bits):
  """Byte j holds element j + i*W in bits [i*b, (i+1)*b) (quant.py docstring)."""
  n = 32
  per, width = 8 // bits, 32 * bits // 8
  codes = np.random.default_rng(0).integers(0, 2 ** bits, size=(n,), dtype=np.uint8)
  packed = np.asarray(quant.pack(jnp.asarray(codes), bits))
  for j in range(width):
    for i in range(per):
      assert (packed[j] >> (i * bits)) & (2 ** bits - 1) == codes[j + i * width]


CASES = [
    # (bits, axis, group, scale_dtype)
    (8, "token", 64, "float16"), (4, "token", 16, "float16"), (2, "token", 32, "bfloat16"),
    (4, "channel", 32, "float16"), (2, "channel", 16, "float32"), (8, "channel", 64, "float16"),
]


def _data(rng, kind, shape):
  if kind == "normal":
    return rng.normal(size=shape).astype(np.float32) * 3
  if kind == "big":      # values near 1e4
    return (1e4 + rng.normal(size=shape) * 50).astype(np.float32)
  if kind == "tiny":     # ranges near 1e-6 (scale underflows fp16)
    return (0.5 + rng.uniform(size=shape) * 1e-6).astype(np.float32)
  if kind == "constant":  # constant groups
    return np.full(shape, rng.normal(), np.float32)
  raise ValueError(kind)


@pytest.mark.parametrize("bits,axis,group,sdt", CASES)
@pytest.mark.parametrize("kind", ["normal", "big", "tiny", "constant"])
def test_quantize_matches_oracle_and_error_bound(bits, axis, group, sdt, kind):
  # zlib.crc32, not hash(): str hashes change per process (PYTHONHASHSEED).
  rng = np.random.default_rng(zlib.crc32(repr((bits, axis, group, kind)).encode()))
  x = _data(rng, kind, (128, 64))
  packed, scale, zero = quant.quantize(jnp.asarray(x), bits, axis=axis, group=group,
                                       scale_dtype=sdt)
  code, s_ref, z_ref = np_quantize(x, bits, axis, group, np.dtype(jnp.dtype(sdt)))
  np.testing.assert_array_equal(np.asarray(quant.unpack(packed, bits)), code)
  np.testing.assert_array_equal(np.asarray(scale, np.float32), s_ref.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(zero, np.float32), z_ref.astype(np.float32))

  x_hat = np.asarray(quant.dequantize(packed, scale, zero, bits, axis=axis))
  assert np.all(np.isfinite(x_hat))
  # |x - x_hat| <= scale/2, up to the rounding of the stored scale/zero: the
  # grid actually stored spans [z, z + (2^b-1) s]; values outside it (by the
  # rounding of min -> z and of the scale) clip to its ends.
  s = np.asarray(scale, np.float64)
  z = np.asarray(zero, np.float64)
  levels = 2 ** bits - 1
  if axis == "token":
    xg = x.reshape(128, 64 // group, group).astype(np.float64)
    s, z = s[..., None], z[..., None]
    lo, hi = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    err = np.abs(xg - x_hat.reshape(xg.shape))
  else:
    xg = x.reshape(128 // group, group, 64).astype(np.float64)
    s, z = s[:, None], z[:, None]
    lo, hi = xg.min(1, keepdims=True), xg.max(1, keepdims=True)
    err = np.abs(xg - x_hat.reshape(xg.shape))
  rounding = np.abs(lo - z) + np.maximum(0, hi - (z + levels * s))
  eps = 4 * np.finfo(np.float32).eps * np.abs(xg)
  bound = s / 2 + rounding + eps
  # A scale that underflowed to 0 stores only the zero: the error is the range.
  bound = np.where(s > 0, bound, (hi - lo) + np.abs(lo - z) + eps)
  assert np.all(err <= bound), float((err - bound).max())
  if kind == "constant":
    np.testing.assert_array_equal(np.asarray(quant.unpack(packed, bits)), 0)
    np.testing.assert_array_equal(x_hat, np.asarray(zero, np.float32).max())


def test_bad_bits_raise():
  with pytest.raises(ValueError, match="bits=3"):
    quant.pack(jnp.zeros((4, 8), jnp.uint8), 3)
  with pytest.raises(ValueError, match="axis='row'"):
    quant.quantize(jnp.ones((4, 8)), 4, axis="row", group=4)
  with pytest.raises(TypeError, match="uint8"):
    quant.unpack(jnp.zeros((4, 8), jnp.int32), 4)


@pytest.mark.parametrize("sdt", ["float16", "bfloat16", "float32"])
def test_round_codes_half_way_cases_exact(sdt):
  """round((x - zero) / scale) of the exact quotient: half-way points go up,
  one float32 step below them goes down, whatever the division rounds to."""
  rng = np.random.default_rng(7)
  levels = 255
  scale = rng.uniform(1e-3, 10.0, 4096).astype(sdt).astype(np.float32)
  scale = np.where(np.arange(4096) % 7 == 0, np.float32(2.0 ** -20) * scale, scale)
  k = rng.integers(0, levels, 4096).astype(np.float32)
  zero = rng.normal(size=4096).astype(np.float32)
  half = ((k + np.float32(0.5)).astype(np.float64) * scale.astype(np.float64))
  d = half.astype(np.float32)
  exact = d.astype(np.float64) == half          # d is exactly (k + 1/2) * scale
  x = zero + d
  d_real = (x - zero).astype(np.float64)        # the float32 difference the code rounds
  want = np.clip(np.floor(d_real / scale + 0.5), 0, levels)
  got = np.asarray(quant.round_codes(jnp.asarray(x), jnp.asarray(zero), jnp.asarray(scale), levels))
  np.testing.assert_array_equal(got, want)
  below = np.nextafter(d, np.float32(-np.inf))
  xb = zero + below
  want_b = np.clip(np.floor((xb - zero).astype(np.float64) / scale + 0.5), 0, levels)
  got_b = np.asarray(quant.round_codes(jnp.asarray(xb), jnp.asarray(zero), jnp.asarray(scale), levels))
  np.testing.assert_array_equal(got_b, want_b)
  if sdt != "float32":  # (k + 1/2) * scale is rarely a float32 when scale has 24 bits
    assert exact.mean() > 0.3  # the case really holds many exact half-way points
