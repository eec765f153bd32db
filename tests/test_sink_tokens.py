"""`KVFormat.sink_tokens`: the first S tokens kept exactly beside the packed storage
(`KVCache` and the reference attention only, for now). CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import jax.numpy as jnp

import jaxkv
from jaxkv import KVCache, ModelCache
from jaxkv.formats import KVFormat, PRESETS


def _fmt(name="kivi2", sinks=4, **kw):
  return dataclasses.replace(PRESETS[name], token_group=32, residual=32, sink_tokens=sinks, **kw)


def _kv(rng, b, t, h, d):
  return (jnp.asarray(rng.standard_normal((b, t, h, d)) * 2.0, jnp.float32),
          jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32))


@pytest.mark.parametrize("name", ["kivi2", "kivi4", "int8"])
def test_sinks_exact_and_the_rest_as_without_them(name):
  """Incremental appends equal one prefill; rows [0, S) come back exactly, every other
  row bitwise as the same format without sinks stores it."""
  rng = np.random.default_rng(1)
  b, h, d, s = 3, 2, 32, 4
  k, v = _kv(rng, b, 90, h, d)
  lengths = np.asarray([90, 3, 41])
  with_s, without = _fmt(name, s), _fmt(name, 0)
  one = KVCache.init(with_s, b, h, d, 128, jnp.float32).prefill(k, v, lengths)
  inc = KVCache.init(with_s, b, h, d, 128, jnp.float32)
  start = np.zeros(b, int)
  for step in (2, 1, 5, 30, 52):  # ragged chunks crossing the sink rows and a flush
    n = np.clip(lengths - start, 0, step)
    rows = np.stack([np.pad(np.asarray(k[i, start[i]:start[i] + n[i]]),
                            ((0, step - n[i]), (0, 0), (0, 0))) for i in range(b)])
    rows_v = np.stack([np.pad(np.asarray(v[i, start[i]:start[i] + n[i]]),
                              ((0, step - n[i]), (0, 0), (0, 0))) for i in range(b)])
    inc = inc.prefill(jnp.asarray(rows), jnp.asarray(rows_v), n)
    start += n
  ref = KVCache.init(without, b, h, d, 128, jnp.float32).prefill(k, v, lengths)
  (k1, v1), (ki, vi), (k0, v0) = one.dequantize(), inc.dequantize(), ref.dequantize()
  np.testing.assert_array_equal(np.asarray(ki), np.asarray(k1))
  np.testing.assert_array_equal(np.asarray(vi), np.asarray(v1))
  for i, n in enumerate(lengths):
    m = min(s, n)
    np.testing.assert_array_equal(np.asarray(k1[i, :m]), np.asarray(k[i, :m]))
    np.testing.assert_array_equal(np.asarray(v1[i, :m]), np.asarray(v[i, :m]))
    np.testing.assert_array_equal(np.asarray(k1[i, m:]), np.asarray(k0[i, m:]))
    np.testing.assert_array_equal(np.asarray(v1[i, m:]), np.asarray(v0[i, m:]))
  np.testing.assert_array_equal(np.asarray(one.k_sink[1, 3:]), 0)  # past L = 3: zero


def test_reference_attention_reads_the_sinks_and_kernels_refuse():
  rng = np.random.default_rng(2)
  b, h, g, d = 2, 2, 2, 32
  k, v = _kv(rng, b, 70, h, d)
  cache = KVCache.init(_fmt("kivi2"), b, h, d, 128, jnp.float32).prefill(k, v, [70, 37])
  q = jnp.asarray(rng.standard_normal((b, 1, h * g, d)), jnp.float32)
  got = np.asarray(jaxkv.decode_attention(q, cache), np.float64)
  kd, vd = (np.asarray(x, np.float64) for x in cache.dequantize())
  for i, n in enumerate((70, 37)):
    for head in range(h * g):
      kv_h = head // g
      sc = kd[i, :n, kv_h] @ np.asarray(q[i, 0, head], np.float64) / np.sqrt(d)
      p = np.exp(sc - sc.max())
      want = (p / p.sum()) @ vd[i, :n, kv_h]
      np.testing.assert_allclose(got[i, 0, head], want, rtol=1e-5, atol=1e-5)
  for impl in ("triton", "mosaic"):
    with pytest.raises(ValueError, match="sink_tokens > 0"):
      jaxkv.decode_attention(q, cache, implementation=impl)


def test_sink_tokens_checked():
  for bad in (-1, 33, 2.0, True):
    with pytest.raises(ValueError, match="sink_tokens=.* must be an int in"):
      _fmt(sinks=bad)
  with pytest.raises(ValueError, match="not supported with hierarchical"):
    dataclasses.replace(PRESETS["quantspec"], sink_tokens=4)
  with pytest.raises(ValueError, match="KVCache only for now"):
    ModelCache.init(_fmt(), 2, 1, 1, 32, 64, jnp.float32)
  assert KVCache.init(_fmt(sinks=0), 1, 1, 32, 64).k_sink is None
  assert KVFormat().sink_tokens == 0
