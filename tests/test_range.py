"""README "Input policy", row by row: range, non-finite values, lengths, scale, use_kernel.

Every attention result is checked on both implementations (reference and
Pallas interpret mode) against the float64 oracle over `cache.dequantize()`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
import pallas_kernels as pk
from jaxkv import KVCache, KVFormat, quant
from tests.oracle import np_attention_dequantized, np_quantize

IMPLS = ("reference", "pallas")


def _kv(seed, batch, t, heads=1, head_dim=64, dtype=jnp.float32, scale=1.0):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(batch, t, heads, head_dim)) * scale
  v = rng.normal(size=(batch, t, heads, head_dim))
  return np.asarray(k, np.float32), np.asarray(v, np.float32)


def _q(seed, batch, s=1, hq=4, head_dim=64, dtype=jnp.float32, scale=1.0):
  rng = np.random.default_rng(seed + 1000)
  return jnp.asarray(rng.normal(size=(batch, s, hq, head_dim)) * scale, dtype)


def _oracle(q, cache, scale=None):
  k, v = (np.asarray(x, np.float64) for x in cache.dequantize())
  return np_attention_dequantized(np.asarray(q.astype(jnp.float32)), k, v,
                                  np.asarray(cache.lengths), scale,
                                  np.asarray(cache.nonfinite))


def _check_attention(q, cache, *, tol, scale=None):
  """Both implementations: the oracle's NaN pattern exactly, finite values within tol."""
  want = _oracle(q, cache, scale)
  for impl in IMPLS:
    got = np.asarray(jaxkv.decode_attention(q, cache, scale=scale, implementation=impl)
                     .astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=impl)
    ok = ~np.isnan(want)
    np.testing.assert_allclose(got[ok], want[ok], atol=tol, rtol=tol, err_msg=impl)
  return want


_jit_prefill = jax.jit(lambda c, k, v, n: c.prefill(k, v, n))
_jit_append = jax.jit(lambda c, k, v: c.append(k, v))


# ---------------------------------------------------------------------- range
@pytest.mark.parametrize("preset", ["kivi4", "int8", pytest.param("int4-token-g4", marks=pytest.mark.slow),
                                    pytest.param("k8v4", marks=pytest.mark.slow),
                                    pytest.param("kivi2", marks=pytest.mark.slow)])
def test_bf16_beyond_float16_scale_range_raises_or_flags(preset):
  """-70000 in a bf16 K: the float16 zero point would be -inf (issue 18)."""
  k, v = _kv(1, 2, 300)
  k[0, 5, 0, 3] = -70000.0
  kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
  cache = KVCache.init(preset, 2, 1, 64, 512, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"prefill: k has \|k\| up to 7.*sequences \[0\].*float32"):
    cache.prefill(kb, vb, [300, 300])
  flagged = _jit_prefill(cache, kb, vb, jnp.array([300, 300]))
  np.testing.assert_array_equal(np.asarray(flagged.nonfinite), [True, False])
  np.testing.assert_array_equal(np.asarray(flagged.overflow), [False, False])
  kd, _ = flagged.dequantize()
  assert np.isnan(np.asarray(kd[0, 5, 0, 3]))          # the group shows it
  assert np.isfinite(np.asarray(kd[1])).all()
  with pytest.raises(ValueError, match=r"non-finite values in sequences \[0\]"):
    flagged.check()
  q = _q(1, 2, dtype=jnp.bfloat16)
  want = _check_attention(q, flagged, tol=2e-2)
  assert np.isnan(want[0]).all() and np.isfinite(want[1]).all()


def test_positive_big_value_fits_float16_scales_and_float32_scales_fit_all():
  k, v = _kv(2, 1, 300)
  k[0, 5, 0, 3] = 70000.0                           # zero = min stays finite
  kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
  cache = KVCache.init("kivi4", 1, 1, 64, 512, jnp.bfloat16).prefill(kb, vb, [300])
  assert not np.asarray(cache.nonfinite).any()
  k[0, 6, 0, 3] = -70000.0
  fmt = dataclasses.replace(KVFormat.preset("kivi4"), scale_dtype="float32")
  kb = jnp.asarray(k, jnp.bfloat16)
  cache = KVCache.init(fmt, 1, 1, 64, 512, jnp.bfloat16).prefill(kb, vb, [300])
  assert not np.asarray(cache.nonfinite).any()
  kd, _ = cache.dequantize()
  assert np.isfinite(np.asarray(kd)).all()
  # float32 scales of a bf16 cache: float32 dots would be exact; bf16 q operands.
  _check_attention(_q(2, 1, dtype=jnp.float32), cache, tol=2e-2)


@pytest.mark.parametrize("preset", ["kivi4", "k8v4", pytest.param("int8", marks=pytest.mark.slow),
                                    pytest.param("int4-token-g4", marks=pytest.mark.slow)])
def test_float16_cache_large_keys_and_queries(preset):
  """|k| up to 6e4, q ~ N(0, 30^2): the Pallas path gave zeros (issue 18)."""
  rng = np.random.default_rng(3)
  k = jnp.asarray(rng.uniform(-6e4, 6e4, size=(2, 300, 1, 64)), jnp.float16)
  v = jnp.asarray(rng.normal(size=(2, 300, 1, 64)) * 100, jnp.float16)
  q = jnp.asarray(rng.normal(size=(2, 2, 4, 64)) * 30, jnp.float16)
  cache = KVCache.init(preset, 2, 1, 64, 512, jnp.float16).prefill(k, v, [300, 170])
  assert not np.asarray(cache.nonfinite).any()
  want = _oracle(q, cache)
  assert np.isfinite(want).all()
  got = np.asarray(jaxkv.decode_attention(q, cache, implementation="pallas"), np.float64)
  # Logits ~1e6: one key dominates each row; the f16 output rounding remains.
  np.testing.assert_allclose(got, want, atol=0.1, rtol=1e-2)
  assert np.abs(got).max() > 1  # not the all-zero output


@pytest.mark.parametrize("preset", ["int8", "kivi4"])
def test_float16_cache_tiny_values_keep_precision(preset):
  """V ranges of 1e-3: float16 operands p * scale would be subnormal without normalization."""
  rng = np.random.default_rng(4)
  k = jnp.asarray(rng.normal(size=(1, 400, 1, 64)), jnp.float16)
  v = jnp.asarray(rng.normal(size=(1, 400, 1, 64)) * 1e-3, jnp.float16)
  q = jnp.asarray(rng.normal(size=(1, 1, 4, 64)), jnp.float16)
  cache = KVCache.init(preset, 1, 1, 64, 512, jnp.float16).prefill(k, v, [400])
  want = _oracle(q, cache)
  got = np.asarray(jaxkv.decode_attention(q, cache, implementation="pallas"), np.float64)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-2)


# ----------------------------------------------------------------- non-finite
@pytest.mark.parametrize("where,what", [
    ("residual", "nan_k"), ("packed", "nan_k"),
    pytest.param("packed", "inf_v", marks=pytest.mark.slow),
    pytest.param("residual", "inf_v", marks=pytest.mark.slow),
    pytest.param("residual", "neg_inf_k", marks=pytest.mark.slow),
    pytest.param("packed", "neg_inf_k", marks=pytest.mark.slow)])
def test_nonfinite_kv_same_on_both_paths_and_never_dropped(where, what):
  fmt = KVFormat(k_bits=4, v_bits=4, token_group=32, residual=32)
  k, v = _kv(5, 2, 60)
  pos = 59 if where == "residual" else 3   # residual: newest; packed: group 0
  bad = {"nan_k": np.nan, "inf_v": np.inf, "neg_inf_k": -np.inf}[what]
  (v if what == "inf_v" else k)[1, pos, 0, 7] = bad
  cache = KVCache.init(fmt, 2, 1, 64, 256, jnp.float32)
  with pytest.raises(ValueError, match=r"holds NaN/inf in sequences \[1\]"):
    cache.prefill(jnp.asarray(k), jnp.asarray(v), [60, 60])
  cache = _jit_prefill(cache, jnp.asarray(k), jnp.asarray(v), jnp.array([60, 60]))
  np.testing.assert_array_equal(np.asarray(cache.nonfinite), [False, True])
  q = _q(5, 2, s=2)
  _check_attention(q, cache, tol=1e-5)
  # Flush the bad token into the packed region with R more steps: it stays
  # visible (NaN group), the flag stays, the other sequence stays exact.
  for i in range(40):
    kn, vn = _kv(100 + i, 2, 1)
    cache = _jit_append(cache, jnp.asarray(kn), jnp.asarray(vn))
  assert fmt.packed_len(100) > pos
  kd, vd = (np.asarray(x) for x in cache.dequantize())
  side = vd if what == "inf_v" else kd
  assert np.isnan(side[1, pos, 0, 7]) and not np.isnan(side[0]).any()
  np.testing.assert_array_equal(np.asarray(cache.nonfinite), [False, True])
  want = _check_attention(q, cache, tol=1e-5)
  assert np.isnan(want[1]).all() and np.isfinite(want[0]).all()
  with pytest.raises(ValueError, match="non-finite"):
    cache.check()


def test_nonfinite_query_row_is_nan_on_both_paths():
  k, v = _kv(6, 2, 200)
  cache = KVCache.init("kivi4", 2, 1, 64, 256, jnp.float32).prefill(
      jnp.asarray(k), jnp.asarray(v), [200, 150])
  q = _q(6, 2, s=1)
  q = q.at[0, 0, 2, 5].set(jnp.nan).at[1, 0, 0, 0].set(jnp.inf)
  want = _check_attention(q, cache, tol=1e-5)
  assert np.isnan(want[0, 0, 2]).all() and np.isnan(want[1, 0, 0]).all()
  assert np.isfinite(want[0, 0, [0, 1, 3]]).all()


def test_nonfinite_query_rows_and_flagged_sequence_with_several_queries():
  """S = 3 queries, 2 kv heads of 4 q heads each: the kernels' combine maps each
  NaN/inf query row (query s, q head h) to its own output row, and a sequence
  flagged ``nonfinite`` comes out NaN everywhere (the input policy)."""
  k, v = _kv(8, 3, 200, heads=2)
  cache = KVCache.init("kivi4", 3, 2, 64, 256, jnp.float32).prefill(
      jnp.asarray(k), jnp.asarray(v), [200, 150, 181])
  cache = dataclasses.replace(cache, nonfinite=jnp.asarray([False, False, True]))
  q = _q(8, 3, s=3, hq=8)
  q = q.at[0, 2, 5, 7].set(jnp.nan).at[1, 0, 1, 0].set(-jnp.inf)
  want = _check_attention(q, cache, tol=1e-5)
  bad = np.zeros(want.shape[:3], bool)
  bad[0, 2, 5] = bad[1, 0, 1] = True
  bad[2] = True
  np.testing.assert_array_equal(np.isnan(want).all(-1), bad)
  assert not np.isnan(want[~bad]).any()


@pytest.mark.parametrize("bits,axis,group,scale_dtype", [
    (4, "channel", 32, "float16"), (8, "token", 64, "float16"), (2, "token", 16, "bfloat16"),
    (4, "channel", 16, "float32"), (8, "channel", 16, "bfloat16"), (4, "token", 32, "float32")])
def test_pack_kernel_nonfinite_groups_bitwise(bits, axis, group, scale_dtype):
  rng = np.random.default_rng(bits + group)
  x = rng.normal(size=(3, 64, 64)).astype(np.float32)
  x[0, 1, 2] = np.nan
  x[1, 40, 5] = -np.inf
  x[2, 10, 60] = 1e5          # overflows a float16 zero/scale only together with:
  x[2, 11, 60] = -7e4
  x[2, 20, 0] = 3.3e38        # a float32 range past 3.4e38
  x[2, 20, 1] = -3.3e38
  xj = jnp.asarray(x)
  got = pk.quantize_pack(xj, bits, axis=axis, group=group, scale_dtype=scale_dtype, interpret=True)
  ref = quant.quantize(xj, bits, axis=axis, group=group, scale_dtype=scale_dtype)
  for name, g, r in zip(("codes", "scale", "zero"), got, ref):
    assert g.dtype == r.dtype, name
    # As float32: numpy's NaN == NaN in assert_array_equal skips bfloat16.
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32), err_msg=name)
  sdt = np.dtype(jnp.dtype(scale_dtype))
  for i in range(3):
    code, s, z = np_quantize(x[i], bits, axis, group, sdt)
    np.testing.assert_array_equal(np.asarray(quant.unpack(ref[0][i], bits)), code)
    np.testing.assert_array_equal(np.asarray(ref[1][i], np.float32), s.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(ref[2][i], np.float32), z.astype(np.float32))
  deq = np.asarray(quant.dequantize(*ref, bits, axis=axis))
  assert np.isnan(deq[0, 1, 2]) and np.isnan(deq[1, 40, 5])
  # +-3.3e38 share a group only per token (channels 0, 1 of token 20); alone,
  # 3.3e38 overflows only a float16 scale.
  assert np.isnan(deq[2, 20, 0]) == (axis == "token" or scale_dtype == "float16")
  assert np.isnan(deq[2, 11, 60]) == (scale_dtype == "float16")
  assert np.isfinite(deq[2, 32:]).all()


# -------------------------------------------------------------------- lengths
def test_jitted_prefill_lengths_out_of_range_flag_overflow():
  k, v = _kv(7, 3, 40)
  cache = KVCache.init("kivi4", 3, 1, 64, 256, jnp.float32).prefill(
      jnp.asarray(k), jnp.asarray(v), [30, 10, 5])
  before = [np.asarray(x) for x in cache.dequantize()]
  out = _jit_prefill(cache, jnp.asarray(k), jnp.asarray(v), jnp.array([41, -1, 40]))
  np.testing.assert_array_equal(np.asarray(out.overflow), [True, True, False])
  np.testing.assert_array_equal(np.asarray(out.lengths), [30, 10, 45])
  after = [np.asarray(x) for x in out.dequantize()]
  for b_, a_ in zip(before, after):
    np.testing.assert_array_equal(a_[:2], b_[:2])          # untouched sequences
  with pytest.raises(ValueError, match=r"overflow .* sequences \[0, 1\]"):
    out.check()


@pytest.mark.parametrize("lengths", [jnp.array([5, 1]), jnp.array([-1, 2]), np.array([2, 9])])
def test_concrete_lengths_validated_eagerly(lengths):
  cache = KVCache.init("kivi4", 2, 1, 64, 64, jnp.float32)
  x = jnp.ones((2, 4, 1, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"lengths=\[.*\] must lie in \[0, T=4\]"):
    cache.prefill(x, x, lengths)
  with pytest.raises(TypeError, match="lengths.dtype=float32"):
    cache.prefill(x, x, jnp.array([1.0, 2.0]))


# ---------------------------------------------------------------------- scale
def test_scale_accepts_python_numpy_and_concrete_jax():
  k, v = _kv(8, 2, 300)
  cache = KVCache.init("kivi4", 2, 1, 64, 512, jnp.float32).prefill(
      jnp.asarray(k), jnp.asarray(v), [300, 99])
  q = _q(8, 2, s=2)
  want = _oracle(q, cache, 0.25)
  for scale in (0.25, np.float32(0.25), np.float64(0.25), jnp.float32(0.25),
                jnp.asarray(0.25, jnp.bfloat16), np.array(0.25), 1 / 4):
    for impl in IMPLS:
      out = jaxkv.decode_attention(q, cache, scale=scale, implementation=impl)
      np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5, err_msg=impl)


def test_traced_scale_on_both_paths():
  k, v = _kv(9, 2, 300)
  cache = KVCache.init("int4-token-g4", 2, 1, 128, 512, jnp.float32).prefill(
      jnp.asarray(k.repeat(2, -1)), jnp.asarray(v.repeat(2, -1)), [300, 260])
  q = _q(9, 2, s=1, head_dim=128)
  for impl in IMPLS:
    f = jax.jit(lambda q, c, s: jaxkv.decode_attention(q, c, scale=s, implementation=impl))
    for scale in (0.05, 0.3):
      np.testing.assert_allclose(np.asarray(f(q, cache, jnp.float32(scale))),
                                 _oracle(q, cache, scale), atol=2e-5, rtol=2e-5, err_msg=impl)


@pytest.mark.parametrize("scale,err,match", [
    (float("nan"), ValueError, "scale=nan must be finite"),
    (np.float32(np.inf), ValueError, "scale=inf must be finite"),
    (True, TypeError, "scale=True must be a real number"),
    (1j, TypeError, "must be a real number"),
    (jnp.ones(2), ValueError, r"scale must be a scalar, got shape \(2,\)"),
    (jnp.array(1, jnp.uint8) > 0, TypeError, "scale.dtype=bool"),
    ("0.1", TypeError, "scale must be a real number or a scalar array, got str"),
])
def test_bad_scale_raises_naming_scale(scale, err, match):
  cache = KVCache.init("kivi4", 1, 1, 64, 64, jnp.float32)
  x = jnp.ones((1, 3, 1, 64), jnp.float32)
  cache = cache.prefill(x, x, [3])
  for impl in IMPLS:
    with pytest.raises(err, match=match):
      jaxkv.decode_attention(jnp.ones((1, 1, 2, 64)), cache, scale=scale, implementation=impl)


# ----------------------------------------------------------------- use_kernel
@pytest.mark.parametrize("preset", ["kivi4", "int4-token-g4"])
def test_use_kernel_off_gpu_runs_interpret_and_is_bitwise(preset):
  k, v = _kv(10, 2, 300, head_dim=128)
  a = KVCache.init(preset, 2, 1, 128, 512, jnp.float32, use_kernel=True)
  b = KVCache.init(preset, 2, 1, 128, 512, jnp.float32, use_kernel=False)
  a = a.prefill(jnp.asarray(k), jnp.asarray(v), [300, 140])
  b = b.prefill(jnp.asarray(k), jnp.asarray(v), [300, 140])
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # A jitted append that flushes (the kernel path packs K and V in one launch).
  k2, v2 = _kv(11, 2, 130, head_dim=128)
  append = jax.jit(lambda c, k_, v_: c.append(k_, v_))
  a = append(a, jnp.asarray(k2), jnp.asarray(v2))
  b = append(b, jnp.asarray(k2), jnp.asarray(v2))
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_use_kernel_unsupported_format_fails_at_init():
  with pytest.raises(ValueError, match=r"use_kernel=True.*head_dim=48"):
    KVCache.init("int8", 1, 1, 48, 64, use_kernel=True)
  KVCache.init("int8", 1, 1, 48, 64, use_kernel=False)  # the jnp path stores it
  KVCache.init("bf16", 1, 1, 48, 64, use_kernel=True)   # nothing to pack


def test_kernel_alone_propagates_nan_never_zero():
  """Without the wrapper's rule: NaN scores reach the output as NaN, not as zeros."""
  k, v = _kv(11, 1, 200)
  cache = KVCache.init("kivi4", 1, 1, 64, 256, jnp.float32).prefill(
      jnp.asarray(k), jnp.asarray(v), [200])
  q = _q(11, 1).at[0, 0, 1, 0].set(jnp.nan)
  out = np.asarray(pk.pallas_decode_attention(q, cache, interpret=True))
  assert np.isnan(out[0, 0, 1]).all() and np.isfinite(out[0, 0, [0, 2, 3]]).all()
