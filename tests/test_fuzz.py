"""Hypothesis fuzzing of the public quant / cache / attention API (README "Input policy").

Random shapes, dtypes (f32/bf16/f16), formats (presets and random valid
`KVFormat`s), lengths (in and out of range), extreme and non-finite values.
Each call either matches the independent float64 numpy oracle (on the
dequantized cache) or raises a ValueError/TypeError that names the offending
argument; under `jit` the right per-sequence flag is set instead.
The "ci" profile (tests/conftest.py) is derandomized; HYPOTHESIS_PROFILE=dev
runs many more random examples.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
import pallas_kernels as pk
from jaxkv import PRESETS, KVCache, KVFormat, quant
from tests.oracle import np_attention_dequantized, np_quantize
from tests.test_cache import check_against_history

# Casting 7e4 to float16 overflows to inf on purpose (a non-finite input).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
VALUE_KINDS = ("normal", "normal", "normal", "big", "f16edge", "tiny", "nan", "inf", "huge")


def _values(rng, kind, shape, dtype):
  """Random values of one kind, cast to ``dtype`` (returned as float32 numpy)."""
  x = rng.normal(size=shape)
  if kind == "big":
    x = x * 3e3 + 1e4
  elif kind == "f16edge":      # around the float16 / float16-scale limit
    x = rng.choice([-7e4, -6.5e4, 6e4, 7e4, 1.0], size=shape)
  elif kind == "tiny":
    x = 0.5 + x * 1e-6
  elif kind == "huge":
    x = x * 1e37
  x = x.astype(np.float32)
  if kind in ("nan", "inf") and x.size:
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size)] = np.nan if kind == "nan" else -np.inf
  return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))


@st.composite
def formats(draw):
  if draw(st.booleans()):
    return PRESETS[draw(st.sampled_from(sorted(PRESETS)))]
  g = draw(st.sampled_from([16, 32]))
  return KVFormat(k_bits=draw(st.sampled_from([16, 8, 4, 2])),
                  v_bits=draw(st.sampled_from([16, 8, 4, 2])),
                  k_axis=draw(st.sampled_from(["channel", "token"])),
                  token_group=g, residual=g * draw(st.sampled_from([1, 2])),
                  channel_group=draw(st.sampled_from([None, 16, 32])),
                  scale_dtype=draw(st.sampled_from(["float16", "bfloat16", "float32"])))


# ------------------------------------------------------------------- quantize
@settings(max_examples=20)
@given(bits=st.sampled_from([8, 4, 2]), axis=st.sampled_from(["token", "channel"]),
       group=st.sampled_from([8, 16, 32, 48]), tokens=st.sampled_from([16, 32, 48]),
       head_dim=st.sampled_from([16, 32, 64]), dtype=st.sampled_from(sorted(DTYPES)),
       sdt=st.sampled_from(["float16", "bfloat16", "float32"]),
       kind=st.sampled_from(VALUE_KINDS), seed=st.integers(0, 2 ** 31 - 1))
def test_fuzz_quantize_matches_oracle_or_names_argument(bits, axis, group, tokens, head_dim,
                                                        dtype, sdt, kind, seed):
  x = _values(np.random.default_rng(seed), kind, (tokens, head_dim), DTYPES[dtype])
  reduced = head_dim if axis == "token" else tokens
  xj = jnp.asarray(x, DTYPES[dtype])
  if reduced % group:
    with pytest.raises(ValueError, match="channel_group|token_group"):
      quant.quantize(xj, bits, axis=axis, group=group, scale_dtype=sdt)
    return
  packed, scale, zero = quant.quantize(xj, bits, axis=axis, group=group, scale_dtype=sdt)
  code, s_ref, z_ref = np_quantize(x, bits, axis, group, np.dtype(jnp.dtype(sdt)))
  np.testing.assert_array_equal(np.asarray(quant.unpack(packed, bits)), code)
  np.testing.assert_array_equal(np.asarray(scale, np.float32), s_ref.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(zero, np.float32), z_ref.astype(np.float32))
  x_hat = np.asarray(quant.dequantize(packed, scale, zero, bits, axis=axis))
  # Never silently dropped: a non-finite input is NaN after dequantization.
  assert np.isnan(x_hat[~np.isfinite(x)]).all()
  assert np.isfinite(x_hat[np.isfinite(x_hat)]).all()


# --------------------------------------------------------------- cache + attn
@st.composite
def cache_cases(draw):
  fmt = draw(formats())
  dtype = draw(st.sampled_from(sorted(DTYPES)))
  batch = draw(st.integers(1, 2))
  kv_heads = draw(st.sampled_from([1, 2]))
  capacity = draw(st.sampled_from([48, 100, 160]))
  ops = draw(st.lists(st.tuples(
      st.sampled_from(["prefill", "append"]),
      st.sampled_from([1, 2, 17, 40]),
      st.lists(st.integers(-2, 42), min_size=batch, max_size=batch),
      st.sampled_from(VALUE_KINDS)), min_size=1, max_size=4))
  jit = draw(st.booleans())
  return fmt, dtype, batch, kv_heads, capacity, ops, jit, draw(st.integers(0, 2 ** 31 - 1))


_prefill = jax.jit(lambda c, k, v, n: c.prefill(k, v, n))
_append = jax.jit(lambda c, k, v: c.append(k, v))


def _run_program(case):
  """Runs the ops; returns (cache, k_hist, v_hist, expected overflow flags)."""
  fmt, dtype, batch, kv_heads, capacity, ops, jit, seed = case
  rng = np.random.default_rng(seed)
  head_dim = 64
  dt = DTYPES[dtype]
  cache = KVCache.init(fmt, batch, kv_heads, head_dim, capacity, dt)
  hist = [[np.zeros((0, kv_heads, head_dim), np.float32)] * 2 for _ in range(batch)]
  overflow = np.zeros(batch, bool)
  for op, t, lens, kind in ops:
    k = _values(rng, kind, (batch, t, kv_heads, head_dim), dt)
    v = _values(rng, kind if rng.random() < 0.5 else "normal", (batch, t, kv_heads, head_dim), dt)
    kj, vj = jnp.asarray(k, dt), jnp.asarray(v, dt)
    lens = np.asarray(lens if op == "prefill" else [t] * batch, np.int32)
    cur = np.asarray(cache.lengths)
    bad_len = (lens < 0) | (lens > t)
    over = ~bad_len & (cur + lens > capacity)
    if not jit:
      try:
        new = cache.prefill(kj, vj, lens) if op == "prefill" else cache.append(kj, vj)
      except ValueError as e:
        msg = str(e)
        if bad_len.any():
          assert re.search(r"lengths=\[.*\] must lie in \[0, T=", msg), msg
          continue
        if over.any():
          assert "overflow" in msg, msg
          continue
        # Only values can be wrong now: the message names k or v, and the
        # jitted twin must flag exactly those sequences.
        assert re.search(r"\b[kv] (holds NaN/inf|has \|[kv]\| up to)", msg), msg
        seqs = [int(s) for s in re.search(r"sequences \[([\d, ]+)\]", msg).group(1).split(",")]
        new = _prefill(cache, kj, vj, lens) if op == "prefill" else _append(cache, kj, vj)
        got = np.asarray(new.nonfinite) & ~np.asarray(cache.nonfinite)
        assert np.nonzero(got)[0].tolist() == seqs
    else:
      new = (_prefill(cache, kj, vj, jnp.asarray(lens)) if op == "prefill"
             else _append(cache, kj, vj))
      overflow |= bad_len | over
    applied = ~(bad_len | over)
    np.testing.assert_array_equal(np.asarray(new.lengths), np.where(applied, cur + lens, cur))
    cache = new
    for b in range(batch):
      if applied[b]:
        hist[b] = [np.concatenate([hist[b][0], k[b, : lens[b]]]),
                   np.concatenate([hist[b][1], v[b, : lens[b]]])]
  return cache, [h[0] for h in hist], [h[1] for h in hist], overflow


def _expected_nonfinite(cache, k_hist, v_hist):
  fmt, sdt = cache.fmt, np.dtype(jnp.dtype(cache.fmt.scale_dtype))
  out = []
  for kh, vh in zip(k_hist, v_hist):
    bad = not (np.isfinite(kh).all() and np.isfinite(vh).all())
    packed = fmt.packed_len(len(kh))
    for side, hist in ((cache.k, kh), (cache.v, vh)):
      if packed and side.bits < 16:
        for h in range(hist.shape[1]):
          _, s, _ = np_quantize(hist[:packed, h], side.bits, side.axis, side.group, sdt)
          bad |= bool(np.isnan(s.astype(np.float32)).any())
    out.append(bad)
  return np.array(out)


def _tolerance(q, cache, dtype_name, impl):
  """Per output row: vmax * c * (1 + |largest logit|), rtol by the output dtype."""
  k, v = (np.asarray(x, np.float64) for x in cache.dequantize())
  k, v = np.nan_to_num(k, posinf=0, neginf=0), np.nan_to_num(v, posinf=0, neginf=0)
  qf = np.nan_to_num(np.asarray(q.astype(jnp.float32), np.float64))
  b, s, hq, d = q.shape
  h = k.shape[2]
  lmax = np.einsum("bshgd,bthd->bshgt", np.abs(qf).reshape(b, s, h, hq // h, d), np.abs(k))
  lmax = lmax.max(-1).reshape(b, s, hq, 1) * d ** -0.5
  vmax = np.abs(v).max(axis=(1, 2, 3))[:, None, None, None]
  c = {"reference": 2e-6, "pallas": {"float32": 2e-5, "bfloat16": 1e-2, "float16": 3e-3}[dtype_name]}
  c = c[impl] if impl == "pallas" else c["reference"]
  rtol = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}[dtype_name]
  return vmax * np.minimum(2.0, c * (8 + lmax)) + 1e-30, rtol


def _check_attention(cache, dtype_name, seed, impls):
  rng = np.random.default_rng(seed + 7)
  s = int(rng.integers(1, 3))
  hq = cache.kv_heads * int(rng.integers(1, 4))
  dt = DTYPES[dtype_name]
  q = rng.normal(size=(cache.batch, s, hq, cache.head_dim)).astype(np.float32)
  if rng.random() < 0.2:
    q[0, 0, 0, 0] = np.nan
  q = jnp.asarray(q, dt)
  k, v = (np.asarray(x, np.float64) for x in cache.dequantize())
  want = np_attention_dequantized(np.asarray(q.astype(jnp.float32)), k, v,
                                  np.asarray(cache.lengths), None, np.asarray(cache.nonfinite))
  for impl in impls:
    if impl == "pallas" and not pk.supports(cache.fmt, head_dim=cache.head_dim, num_q_heads=hq,
                                            kv_heads=cache.kv_heads, num_queries=s)[0]:
      continue
    got = jaxkv.decode_attention(q, cache, implementation=impl)
    assert got.shape == q.shape and got.dtype == q.dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=impl)
    atol, rtol = _tolerance(q, cache, dtype_name, impl)
    ok = ~np.isnan(want)
    err = np.abs(got - want)
    bound = np.broadcast_to(atol, want.shape) + rtol * np.abs(want)
    assert (err[ok] <= bound[ok]).all(), (impl, float((err - bound)[ok].max()))


@settings(max_examples=8)
@given(cache_cases())
def test_fuzz_cache_and_reference_attention(case):
  cache, k_hist, v_hist, overflow = _run_program(case)
  check_against_history(cache, k_hist, v_hist)
  np.testing.assert_array_equal(np.asarray(cache.overflow), overflow)
  np.testing.assert_array_equal(np.asarray(cache.nonfinite),
                                _expected_nonfinite(cache, k_hist, v_hist))
  if overflow.any() or np.asarray(cache.nonfinite).any():
    with pytest.raises(ValueError, match="overflow|non-finite"):
      cache.check()
  _check_attention(cache, case[1], case[-1], ("reference",))


@settings(max_examples=4)
@given(cache_cases())
def test_fuzz_pallas_attention_matches_oracle(case):
  cache, _, _, _ = _run_program(case)
  _check_attention(cache, case[1], case[-1], ("reference", "pallas"))


@pytest.mark.slow
@settings(max_examples=40)
@given(cache_cases())
def test_fuzz_pallas_attention_matches_oracle_long(case):
  cache, _, _, _ = _run_program(case)
  _check_attention(cache, case[1], case[-1], ("reference", "pallas"))
