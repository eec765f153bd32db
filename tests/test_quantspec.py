"""QuantSpec's hierarchical INT8 cache (issue 14): format, both views, kernels.

Oracle: an independent numpy model of the hierarchical quantizer written
from the issue's definition (upper asymmetric 4-bit code, lower symmetric
4-bit code of the upper's error with scale S_U / 16), and float64 attention
over the dequantized cache.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv import hierarchical
from tests.oracle import np_attention_dequantized

QS = jaxkv.KVFormat.preset("quantspec")
# The preset's hierarchy with small groups, so a few dozen tokens flush.
QS_SMALL = dataclasses.replace(QS, token_group=16, residual=32)
QS_TOKEN_K = dataclasses.replace(QS, k_axis="token", channel_group=32, token_group=16,
                                 residual=32)


def np_hier_groups(xg: np.ndarray, axis: int, scale_dtype="float16"):
  """numpy model: ``xg`` grouped on ``axis`` -> (C_U, C_L, S_U, zero), C_L in [-8, 7]."""
  xg = xg.astype(np.float32)
  lo = xg.min(axis=axis, keepdims=True)
  hi = xg.max(axis=axis, keepdims=True)
  s_u = ((hi - lo) * np.float32(1.0 / 15.0)).astype(scale_dtype).astype(np.float64)
  zero = lo.astype(scale_dtype).astype(np.float64)
  # The contract rounds the float32 difference x - zero (DESIGN.md, `tests.oracle`).
  diff = (xg - zero.astype(np.float32)).astype(np.float64)
  safe = np.where(s_u > 0, s_u, 1.0)
  c_u = np.where(s_u > 0, np.clip(np.floor(diff / safe + 0.5), 0, 15), 0)
  err = diff - c_u * s_u                             # the upper code's error
  c_l = np.where(s_u > 0, np.clip(np.floor(err / (safe / 16) + 0.5), -8, 7), 0)
  return c_u, c_l, s_u, zero


def _fresh(shape, seed, spread=1.0):
  key = jax.random.PRNGKey(seed)
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, shape) * spread
  # A few outliers so some groups have wide ranges.
  return x + 4.0 * spread * (jax.random.uniform(k2, shape) > 0.98)


@pytest.mark.parametrize("axis,group", [("channel", 16), ("channel", 128), ("token", 32),
                                        ("token", 64)])
def test_hierarchical_codes_match_numpy_model_and_error_bounds(axis, group):
  t, d = 256, 64
  x = np.asarray(_fresh((3, t, d), zlib.crc32(f"{axis}{group}".encode()), 1.7), np.float32)
  block = 64  # tokens per plane block (any divisor of T)
  codes, scale, zero = hierarchical.quantize(jnp.asarray(x), axis=axis, group=group, block=block)
  upper, lower = (np.asarray(p) for p in hierarchical.planes(codes, block))
  if axis == "channel":
    xg, red = x.reshape(3, t // group, group, d), -2
  else:
    xg, red = x.reshape(3, t, d // group, group), -1
  c_u, c_l, s_u, z = np_hier_groups(xg, red)
  np.testing.assert_array_equal(upper, c_u.reshape(3, t, d))
  np.testing.assert_array_equal(lower.astype(np.int64) - 8, c_l.reshape(3, t, d))
  np.testing.assert_array_equal(np.asarray(scale, np.float64), np.squeeze(s_u, red))
  np.testing.assert_array_equal(np.asarray(zero, np.float64), np.squeeze(z, red))
  s_b = np.broadcast_to(s_u, xg.shape).reshape(3, t, d)
  clipped = (c_l == 7).reshape(3, t, d)
  # float32 arithmetic of x_hat: a few ulps of the largest magnitude involved.
  ulp = 4 * np.finfo(np.float32).eps * (np.abs(x) + 16 * s_b)
  target = np.asarray(hierarchical.dequantize(codes, scale, zero, axis=axis, block=block),
                      np.float64)
  draft = np.asarray(hierarchical.dequantize(codes, scale, zero, axis=axis, block=block,
                                             view="draft"), np.float64)
  # The stored (fp16) scale may undershoot the range by its rounding (2^-11 relative):
  # x can sit up to 15 * S_U * 2^-11 past the top code.
  slack = 15 * s_b * 2.0 ** -11 + ulp
  err_t = np.abs(target - x)
  assert np.all(err_t[~clipped] <= s_b[~clipped] / 32 + ulp[~clipped])
  assert np.all(err_t[clipped] <= s_b[clipped] / 16 + slack[clipped])
  assert np.all(np.abs(draft - x) <= s_b / 2 + slack)
  # Both views against the numpy model's reconstruction.
  np.testing.assert_allclose(target, ((16 * c_u + c_l) * s_u / 16 + z).reshape(3, t, d),
                             rtol=0, atol=float(ulp.max()))
  np.testing.assert_allclose(draft, (c_u * s_u + z).reshape(3, t, d), rtol=0,
                             atol=float(ulp.max()))
  # The target view is strictly finer on average (this is what drafting gives up).
  assert err_t.mean() < np.abs(draft - x).mean() / 4


def test_constant_group_is_exact_and_upper_plane_is_plain_int4():
  x = jnp.full((1, 16, 32), 0.375)
  codes, scale, zero = hierarchical.quantize(x, axis="channel", group=16, block=16)
  for view in ("target", "draft"):
    np.testing.assert_array_equal(
        np.asarray(hierarchical.dequantize(codes, scale, zero, axis="channel", block=16,
                                           view=view)), 0.375)
  y = _fresh((2, 32, 64), 11)
  codes, scale, zero = hierarchical.quantize(y, axis="token", group=64, block=16)
  c4, s4, z4 = jaxkv.quant.quantize(y, 4, axis="token", group=64)
  np.testing.assert_array_equal(np.asarray(hierarchical.packed_planes(codes, 16)[0]),
                                np.asarray(c4))
  np.testing.assert_array_equal(np.asarray(scale), np.asarray(s4))
  np.testing.assert_array_equal(np.asarray(zero), np.asarray(z4))


def _history(b, t, hkv, d, seed, dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  k = (jax.random.normal(k1, (b, t, hkv, d)) * 1.3 - 0.2).astype(dtype)
  v = jax.random.normal(k2, (b, t, hkv, d)).astype(dtype)
  return k, v


@st.composite
def _programs(draw):
  batch = draw(st.integers(1, 2))
  ops = draw(st.lists(st.one_of(
      st.tuples(st.just("prefill"), st.sampled_from([1, 7, 33]),
                st.lists(st.floats(0, 1), min_size=batch, max_size=batch)),
      st.tuples(st.just("append"), st.sampled_from([1, 5]), st.none())),
      min_size=1, max_size=6))
  return batch, ops, draw(st.integers(0, 2 ** 31 - 1))


@settings(max_examples=5)  # each example compiles new shapes; the ci profile fixes the seed
@given(_programs())
def test_quantspec_cache_incremental_equals_one_shot(program):
  """Any prefill/append sequence gives the storage of quantizing the history at once."""
  batch, ops, seed = program
  hkv, d, cap = 2, 32, 160
  rng = np.random.default_rng(seed)
  cache = jaxkv.KVCache.init(QS_SMALL, batch, hkv, d, cap, jnp.float32, use_kernel=False)
  hist_k = [[] for _ in range(batch)]
  hist_v = [[] for _ in range(batch)]
  for kind, t, fracs in ops:
    k = rng.standard_normal((batch, t, hkv, d)).astype(np.float32)
    v = rng.standard_normal((batch, t, hkv, d)).astype(np.float32)
    n = ([t] * batch if kind == "append" else [int(round(f * t)) for f in fracs])
    if max(len(h) for h in hist_k) + max(n) > cap:
      break
    cache = (cache.append(jnp.asarray(k), jnp.asarray(v)) if kind == "append"
             else cache.prefill(jnp.asarray(k), jnp.asarray(v), np.asarray(n, np.int32)))
    for b in range(batch):
      hist_k[b].extend(k[b, :n[b]])
      hist_v[b].extend(v[b, :n[b]])
  lengths = [len(h) for h in hist_k]
  t_max = max(1, max(lengths))
  k_all = np.zeros((batch, t_max, hkv, d), np.float32)
  v_all = np.zeros_like(k_all)
  for b in range(batch):
    if lengths[b]:
      k_all[b, :lengths[b]] = np.stack(hist_k[b])
      v_all[b, :lengths[b]] = np.stack(hist_v[b])
  one = jaxkv.KVCache.init(QS_SMALL, batch, hkv, d, cap, jnp.float32, use_kernel=False)
  one = one.prefill(jnp.asarray(k_all), jnp.asarray(v_all), np.asarray(lengths, np.int32))
  packed = np.asarray(cache.packed_lens)
  for name in ("k", "v"):
    got, want = getattr(cache, name), getattr(one, name)
    for b in range(batch):
      rows = packed[b]
      np.testing.assert_array_equal(np.asarray(got.codes[b, :, :rows]),
                                    np.asarray(want.codes[b, :, :rows]))
  for view in ("target", "draft"):
    for a, w in zip(cache.dequantize(view), one.dequantize(view)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


def test_cache_views_match_numpy_model():
  b, hkv, d, lengths = 2, 2, 32, (77, 40)
  k, v = _history(b, 80, hkv, d, 3)
  cache = jaxkv.KVCache.init(QS_SMALL, b, hkv, d, 96, jnp.float32, use_kernel=False)
  cache = cache.prefill(k, v, np.asarray(lengths, np.int32))
  packed = np.asarray(cache.packed_lens)
  assert packed.tolist() == [48, 16]  # residual holds [G, 2G) tokens
  for view in ("target", "draft"):
    kd, vd = (np.asarray(a, np.float64) for a in cache.dequantize(view))
    for bi in range(b):
      p = packed[bi]
      # K per channel over 16 tokens, V per token over the whole head.
      kg = np.asarray(k[bi, :p], np.float32).transpose(1, 0, 2).reshape(hkv, p // 16, 16, d)
      cu, cl, s, z = np_hier_groups(kg, -2)
      want = (16 * cu + cl) * s / 16 + z if view == "target" else cu * s + z
      np.testing.assert_allclose(kd[bi, :p], want.reshape(hkv, p, d).transpose(1, 0, 2),
                                 rtol=0, atol=1e-5)
      vg = np.asarray(v[bi, :p], np.float32)[..., None, :]           # [p, H, 1, D]
      cu, cl, s, z = np_hier_groups(vg, -1)
      want = (16 * cu + cl) * s / 16 + z if view == "target" else cu * s + z
      np.testing.assert_allclose(vd[bi, :p], want[..., 0, :], rtol=0, atol=1e-5)
      # Residual rows are exact; nothing past the length.
      np.testing.assert_array_equal(kd[bi, p:lengths[bi]], np.asarray(k[bi, p:lengths[bi]]))
      assert not np.any(kd[bi, lengths[bi]:])


def _np_pack4(c):
  """numpy model of the planar 4-bit layout: byte j = c[j] | c[j + D/2] << 4."""
  c = np.asarray(c, np.uint8)
  half = c.shape[-1] // 2
  return c[..., :half] | (c[..., half:] << 4)


def test_cache_stores_planes_blocked_by_token_group():
  """The storage contract the draft-view kernels rely on: in every token group of
  the packed region, the G upper-plane rows (D/2 bytes each) come first, then
  the G lower-plane rows (C_L + 8), so the draft view reads contiguous bytes."""
  b, hkv, d, g = 2, 2, 32, QS_SMALL.token_group
  k, v = _history(b, 80, hkv, d, 5)
  cache = jaxkv.KVCache.init(QS_SMALL, b, hkv, d, 96, jnp.float32, use_kernel=False)
  cache = cache.prefill(k, v, np.asarray([77, 40], np.int32))
  packed = np.asarray(cache.packed_lens)
  for bi in range(b):
    for grp in range(packed[bi] // g):
      rows = slice(grp * g, (grp + 1) * g)
      kg = np.asarray(k[bi, rows], np.float32).transpose(1, 0, 2)[:, None]   # [H, 1, G, D]
      vg = np.asarray(v[bi, rows], np.float32).transpose(1, 0, 2)[..., None, :]
      for side, (cu, cl, _, _) in ((cache.k, np_hier_groups(kg, -2)),
                                   (cache.v, np_hier_groups(vg, -1))):
        stored = np.asarray(side.codes[bi, :, rows]).reshape(hkv, 2, g, d // 2)
        np.testing.assert_array_equal(stored[:, 0], _np_pack4(cu.reshape(hkv, g, d)))
        np.testing.assert_array_equal(stored[:, 1], _np_pack4((cl + 8).reshape(hkv, g, d)))
  with pytest.raises(ValueError, match="multiple of the plane block=16"):
    hierarchical.quantize(jnp.ones((24, 32)), axis="token", group=32, block=16)
  # The Triton kernel's refusals for plane blocks it cannot read.
  from pallas_kernels import dequant_attention as da
  ok, why = da.supports(dataclasses.replace(QS_TOKEN_K, token_group=8, residual=16), head_dim=64)
  assert not ok and "token_group=8 must be >= 16 for a hierarchical format" in why
  ok, why = da.supports(QS_SMALL, head_dim=64, capacity=40)
  assert not ok and "capacity=40 must be a multiple of token_group=16" in why
  assert da.supports(QS_SMALL, head_dim=64, capacity=48)[0]


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("fmt,s,group,dtype,view", [
    (QS_SMALL, 1, 4, jnp.float32, "draft"), (QS_SMALL, 5, 2, jnp.float32, "target"),
    pytest.param(QS_TOKEN_K, 5, 2, jnp.float32, "draft", marks=_SLOW),
    pytest.param(QS_SMALL, 1, 4, jnp.float32, "target", marks=_SLOW),
    pytest.param(QS_SMALL, 5, 2, jnp.float32, "draft", marks=_SLOW),
    pytest.param(QS_TOKEN_K, 5, 2, jnp.float32, "target", marks=_SLOW),
    pytest.param(QS, 1, 4, jnp.bfloat16, "target", marks=_SLOW),
    pytest.param(QS, 5, 4, jnp.bfloat16, "draft", marks=_SLOW),
], ids=["k-channel_s1_draft", "k-channel_s5_target", "k-token_s5_draft",
        "k-channel_s1_target", "k-channel_s5_draft", "k-token_s5_target",
        "preset_bf16_s1_target", "preset_bf16_s5_draft"])
def test_decode_attention_views_reference_and_triton(fmt, s, group, dtype, view):
  b, hkv, d = 2, 2, 64
  lengths = (300, 141) if fmt is QS else (90, 45)
  seed = zlib.crc32(f"{fmt.k_axis}{s}{view}{dtype}".encode())
  k, v = _history(b, max(lengths), hkv, d, seed, dtype)
  cache = jaxkv.KVCache.init(fmt, b, hkv, d, 512 if fmt is QS else 128, dtype, use_kernel=False)
  cache = cache.prefill(k, v, np.asarray(lengths, np.int32))
  q = jax.random.normal(jax.random.PRNGKey(seed + 1), (b, s, hkv * group, d)).astype(dtype)
  kd, vd = cache.dequantize(view)
  want = np_attention_dequantized(np.asarray(q, np.float64), np.asarray(kd), np.asarray(vd),
                                  lengths)
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  for impl in ("reference", "triton"):
    got = np.asarray(jaxkv.decode_attention(q, cache, implementation=impl, view=view),
                     np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max(),
                               err_msg=f"{impl=}")
  # The two views differ (the draft reads 4 bits): the test can tell them apart.
  other = "draft" if view == "target" else "target"
  ko, vo = cache.dequantize(other)
  far = np_attention_dequantized(np.asarray(q, np.float64), np.asarray(ko), np.asarray(vo),
                                 lengths)
  assert np.abs(far - want).max() > 3 * tol * np.abs(want).max()


@pytest.mark.parametrize("view", ["target", "draft"])
def test_triton_lowers_for_cuda_in_place(view):
  """Compiled-kernel lowering for both views, reading a stacked model cache in place."""
  import pallas_kernels as pk
  caches = []
  for i in range(2):
    k, v = _history(1, 700, 2, 128, 40 + i, jnp.bfloat16)
    c = jaxkv.KVCache.init(QS, 1, 2, 128, 1024, jnp.bfloat16, use_kernel=False)
    caches.append(c.prefill(k, v, np.asarray([700], np.int32)))
  mc = jaxkv.ModelCache.from_layers(caches)
  q = jnp.ones((1, 5, 8, 128), jnp.bfloat16)

  def f(q, mc, i):
    return pk.dequant_decode_attention(
        q, mc.k.codes, mc.k.scale, mc.k.zero, mc.v.codes, mc.v.scale, mc.v.zero,
        mc.k_residual, mc.v_residual, mc.lengths, fmt=mc.fmt, interpret=False, layer=i,
        view=view)

  text = jax.jit(f).trace(q, mc, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  assert f"quantspec_{view}" in text
  assert "dynamic_slice" not in text


def test_bytes_per_token_per_view():
  hkv, d = 8, 128
  target = QS.bytes_per_token(hkv, d)
  draft = QS.bytes_per_token(hkv, d, view="draft")
  scales = 2 * 2 * d / 128 + 2 * 2 * 1  # K: fp16 pair per channel per 128 tokens; V: per token
  assert target == pytest.approx(hkv * (2 * d + scales))
  assert draft == pytest.approx(hkv * (2 * d / 2 + scales))
  assert target == jaxkv.KVFormat.preset("int8").bytes_per_token(hkv, d) - hkv * 0 + \
      hkv * (2 * 2 * d / 128 - 2 * 2 * 1)  # int8 preset stores K per token


def test_bad_inputs_name_the_value():
  with pytest.raises(ValueError, match="hierarchical=True needs k_bits=v_bits=8.*k_bits=4"):
    dataclasses.replace(QS, k_bits=4)
  with pytest.raises(TypeError, match="hierarchical='yes'"):
    jaxkv.KVFormat(k_bits=8, v_bits=8, hierarchical="yes")
  with pytest.raises(ValueError, match="view='upper'"):
    QS.bytes_per_token(2, 64, view="upper")
  with pytest.raises(ValueError, match="view='draft' needs a hierarchical format"):
    jaxkv.KVFormat.preset("kivi4").bytes_per_token(2, 64, view="draft")
  cache = jaxkv.KVCache.init(QS_SMALL, 1, 2, 32, 64, jnp.float32, use_kernel=False)
  k, v = _history(1, 8, 2, 32, 0)
  cache = cache.append(k, v)
  with pytest.raises(ValueError, match="view='both'"):
    cache.dequantize("both")
  q = jnp.ones((1, 1, 4, 32))
  with pytest.raises(ValueError, match="view='both'"):
    jaxkv.decode_attention(q, cache, view="both")
  plain = jaxkv.KVCache.init("int8", 1, 2, 32, 64, jnp.float32).append(k, v)
  with pytest.raises(ValueError, match="view='draft' needs a hierarchical format"):
    jaxkv.decode_attention(q, plain, view="draft")
  with pytest.raises(ValueError, match="view='draft' needs a hierarchical format"):
    plain.dequantize("draft")
  with pytest.raises(ValueError, match="head_dim=6 must be divisible by group=4"):
    hierarchical.quantize(jnp.ones((4, 6)), axis="token", group=4, block=4)


# ------------------------------------------------- staging for speculation
@st.composite
def _spec_programs(draw):
  batch = draw(st.integers(1, 2))
  ops = draw(st.lists(st.one_of(
      st.tuples(st.just("append"), st.sampled_from([1, 3, 5]), st.booleans()),
      st.tuples(st.just("rollback"), st.none(),
                st.lists(st.floats(0, 1), min_size=batch, max_size=batch)),
      st.tuples(st.just("flush"), st.none(), st.none())),
      min_size=2, max_size=12))
  return batch, ops, draw(st.integers(0, 2 ** 31 - 1))


@settings(max_examples=4)
@given(_spec_programs())
def test_staged_append_rollback_flush_equals_one_shot(program):
  """After appends (flush or not), rollbacks and flushes: the accepted history at once."""
  from jaxkv.staged_cache import StagedCache
  batch, ops, seed = program
  hkv, d, cap, staging = 2, 32, 120, 8
  rng = np.random.default_rng(seed)
  sc = StagedCache.wrap(
      jaxkv.KVCache.init(QS_SMALL, batch, hkv, d, cap, jnp.float32, use_kernel=False), staging)
  hist_k = [[] for _ in range(batch)]   # accepted history (committed + staged)
  hist_v = [[] for _ in range(batch)]
  committed = [0] * batch
  for kind, s, arg in ops + [("flush", None, None)]:
    if kind == "append":
      staged_now = [len(hist_k[b]) - committed[b] for b in range(batch)]
      if max(staged_now) + s > staging or max(len(h) for h in hist_k) + s > cap:
        continue
      k = rng.standard_normal((batch, s, hkv, d)).astype(np.float32)
      v = rng.standard_normal((batch, s, hkv, d)).astype(np.float32)
      sc = sc.append(jnp.asarray(k), jnp.asarray(v), flush=arg)
      for b in range(batch):
        hist_k[b].extend(k[b])
        hist_v[b].extend(v[b])
        if arg:
          committed[b] = len(hist_k[b])
    elif kind == "rollback":
      new = [committed[b] + int(round(f * (len(hist_k[b]) - committed[b])))
             for b, f in enumerate(arg)]
      sc = sc.rollback(np.asarray(new, np.int32))
      for b in range(batch):
        del hist_k[b][new[b]:], hist_v[b][new[b]:]
    else:
      sc = sc.flush()
      committed = [len(h) for h in hist_k]
    assert np.asarray(sc.lengths).tolist() == [len(h) for h in hist_k]
    assert np.asarray(sc.cache.lengths).tolist() == committed
    # Staged tokens are read exactly, committed ones as stored.
    kd, _ = sc.dequantize("draft")
    for b in range(batch):
      if len(hist_k[b]) > committed[b]:
        np.testing.assert_array_equal(np.asarray(kd[b, committed[b]:len(hist_k[b])]),
                                      np.stack(hist_k[b][committed[b]:]))
  lengths = [len(h) for h in hist_k]
  t = max(1, max(lengths))
  k_all = np.zeros((batch, t, hkv, d), np.float32)
  v_all = np.zeros_like(k_all)
  for b in range(batch):
    if lengths[b]:
      k_all[b, :lengths[b]], v_all[b, :lengths[b]] = np.stack(hist_k[b]), np.stack(hist_v[b])
  one = jaxkv.KVCache.init(QS_SMALL, batch, hkv, d, cap, jnp.float32, use_kernel=False)
  one = one.prefill(jnp.asarray(k_all), jnp.asarray(v_all), np.asarray(lengths, np.int32))
  np.testing.assert_array_equal(np.asarray(sc.cache.packed_lens),
                                QS_SMALL.packed_len(np.asarray(lengths)))
  for view in ("target", "draft"):
    for a, w in zip(sc.cache.dequantize(view), one.dequantize(view)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


def test_staged_attention_matches_float64_and_rollback_errors():
  from jaxkv.staged_cache import StagedCache
  b, hkv, d = 2, 2, 32
  k, v = _history(b, 70, hkv, d, 21)
  cache = jaxkv.KVCache.init(QS_SMALL, b, hkv, d, 96, jnp.float32, use_kernel=False)
  sc = StagedCache.wrap(cache.prefill(k, v, np.asarray([70, 37], np.int32)), 6)
  k2, v2 = _history(b, 5, hkv, d, 22)
  sc = sc.append(k2, v2)
  q = jax.random.normal(jax.random.PRNGKey(23), (b, 5, 2 * hkv, d))
  for view in ("target", "draft"):
    kd, vd = sc.dequantize(view)
    want = np_attention_dequantized(np.asarray(q, np.float64), np.asarray(kd), np.asarray(vd),
                                    [75, 42])
    got = np.asarray(sc.attention(q, view=view), np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())
  with pytest.raises(ValueError, match=r"would drop flushed tokens of sequences \[1\]"):
    sc.rollback(np.asarray([71, 36], np.int32))
  with pytest.raises(ValueError, match=r"exceed the lengths \[75, 42\]"):
    sc.rollback(np.asarray([76, 40], np.int32))
  for bad in ([72.9, 40.2], np.asarray([72.9, 40.2]), np.asarray([True, True])):
    with pytest.raises(TypeError, match="rollback: lengths.dtype"):
      sc.rollback(bad)
  with pytest.raises(ValueError, match=r"must be \[B, S, Hq, D\] with Hq a multiple"):
    sc.attention(q[:, :, :3])
  with pytest.raises(ValueError, match="staging=6"):
    sc.append(k2[:, :2], v2[:, :2])
  bad_k = np.asarray(k2[:, :1]).copy()
  bad_k[1, 0, 1, 3] = np.nan  # refused when staged, not only at the flush
  with pytest.raises(ValueError, match=r"append: k or v holds NaN/inf in sequences \[1\]"):
    sc.rollback(np.asarray([70, 37], np.int32)).append(jnp.asarray(bad_k), v2[:, :1])
  with pytest.raises(ValueError, match="staging=0"):
    StagedCache.wrap(cache, 0)


@pytest.mark.parametrize("s,group,d", [(5, 4, 64), (1, 1, 32)])
def test_staged_attention_kernel_path(s, group, d):
  """The Triton kernel over the committed tokens (its log-sum-exp) merged with the staged
  rows equals the float64 oracle, for a `KVCache` and for a model cache's layer view
  (whose staged block holds infs past the staged count: never read)."""
  from jaxkv.staged_cache import StagedCache, staged_attention, write_staged
  b, hkv, staging = 3, 2, 6
  lengths = np.asarray([70, 37, 3], np.int32)
  k, v = _history(b, 70, hkv, d, 31 + s)
  cache = jaxkv.KVCache.init(QS_SMALL, b, hkv, d, 96, jnp.float32, use_kernel=False)
  sc = StagedCache.wrap(cache.prefill(k, v, lengths), staging)
  k2, v2 = _history(b, s + 1, hkv, d, 41 + s)
  sc = sc.append(k2, v2)                                 # s + 1 staged rows per sequence
  q = jax.random.normal(jax.random.PRNGKey(51 + s), (b, s, group * hkv, d))
  model_cache = jaxkv.ModelCache.init(QS_SMALL, 2, b, hkv, d, 96, jnp.float32, use_kernel=False)
  plan = model_cache.plan_append(jnp.asarray(lengths))
  k_pad = jnp.pad(k, ((0, 0), (0, 26), (0, 0), (0, 0)))
  v_pad = jnp.pad(v, ((0, 0), (0, 26), (0, 0), (0, 0)))
  for layer in range(2):  # layer 1 holds the history, layer 0 other values
    scale = 1.0 if layer == 1 else -0.5
    model_cache = model_cache.append_layer(layer, k_pad * scale, v_pad * scale, plan)
  model_cache = model_cache.commit(plan)
  for view in ("target", "draft"):
    kd, vd = sc.dequantize(view)
    want = np_attention_dequantized(np.asarray(q, np.float64), np.asarray(kd), np.asarray(vd),
                                    lengths + s + 1)
    tol = 2e-5 * np.abs(want).max()
    got = sc.attention(q, view=view, implementation="triton")
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tol)
    stage_k = write_staged(jnp.zeros((b, staging, hkv, d)), k2, jnp.zeros((b,), jnp.int32))
    stage_v = write_staged(jnp.zeros((b, staging, hkv, d)), v2, jnp.zeros((b,), jnp.int32))
    # rows past the staged count (stale after a rollback) are never read: an
    # inf there must not turn a zero weight into NaN
    stage_k = stage_k.at[:, s + 1:].set(jnp.inf)
    stage_v = stage_v.at[:, s + 1:].set(-jnp.inf)
    got_view = staged_attention(q, model_cache.layer_view(1), stage_k, stage_v,
                                jnp.full((b,), s + 1, jnp.int32), view=view,
                                implementation="triton")
    np.testing.assert_allclose(np.asarray(got_view, np.float64), want, rtol=0, atol=tol)
  # the Mosaic target view: bfloat16 caches at head_dim 128 only
  with pytest.raises(ValueError, match="bfloat16 cache with head_dim 128"):
    sc.attention(q, implementation="mosaic")


def test_chunk_attention_blocked_reads_the_target_view():
  """Chunked / multi-turn prefill over a quantspec history: blocked path == dense spec."""
  b, hkv, d = 2, 2, 32
  k, v = _history(b, 70, hkv, d, 31)
  cache = jaxkv.KVCache.init(QS_SMALL, b, hkv, d, 96, jnp.float32, use_kernel=False)
  cache = cache.prefill(k, v, np.asarray([70, 52], np.int32))
  kc, vc = _history(b, 6, hkv, d, 32)
  q = jax.random.normal(jax.random.PRNGKey(33), (b, 6, 2 * hkv, d))
  got = jaxkv.chunk_attention(q, cache, kc, vc, implementation="xla", block_k=16)
  want = jaxkv.chunk_attention(q, cache, kc, vc, implementation="reference")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                             atol=2e-5 * float(np.abs(np.asarray(want)).max()))
