"""Reference decode attention against float64 numpy over the dequantized cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import KVCache, KVFormat
from tests.oracle import np_attention

FORMATS = ["kivi4", "int4-token-g4", "k8v4", "kivi2"]


def _filled_cache(rng, fmt, lengths, heads, head_dim, capacity=400, dtype=jnp.float32):
  batch = len(lengths)
  t = max(lengths)
  k = jnp.asarray(rng.normal(size=(batch, t, heads, head_dim)), dtype)
  v = jnp.asarray(rng.normal(size=(batch, t, heads, head_dim)), dtype)
  return KVCache.init(fmt, batch, heads, head_dim, capacity, dtype).prefill(
      k, v, np.asarray(lengths, np.int32))


@pytest.mark.parametrize("num_queries", [1, 3, 8])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_float64(num_queries, ratio, head_dim):
  rng = np.random.default_rng(num_queries * 100 + ratio * 10 + head_dim)
  fmt = KVFormat.preset(FORMATS[(num_queries + ratio) % len(FORMATS)])
  kv_heads = 2
  # Ragged: ends mid-group, exactly on a group, nothing packed yet (< R).
  lengths = [300, 256, 130, max(num_queries, 20)]
  cache = _filled_cache(rng, fmt, lengths, kv_heads, head_dim)
  q = jnp.asarray(rng.normal(size=(4, num_queries, kv_heads * ratio, head_dim)), jnp.float32)
  out = jaxkv.decode_attention(q, cache, implementation="reference")
  k, v = cache.dequantize()
  want = np_attention(np.asarray(q), np.asarray(k), np.asarray(v), lengths)
  assert out.dtype == jnp.float32 and out.shape == q.shape
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
  assert not np.isnan(np.asarray(out)).any()


def test_reference_attention_plain_and_bf16_output():
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.normal(size=(2, 2, 4, 64)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(2, 50, 2, 64)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(2, 50, 2, 64)), jnp.bfloat16)
  out = jaxkv.reference_attention(q, k, v, jnp.array([50, 7]), scale=0.3)
  assert out.dtype == jnp.bfloat16
  want = np_attention(np.asarray(q, np.float32), np.asarray(k, np.float32),
                      np.asarray(v, np.float32), [50, 7], scale=0.3)
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-2, atol=1e-2)


def test_quantized_attention_close_to_full_precision():
  """Sanity: int8 attention is near the unquantized one (not the contract)."""
  rng = np.random.default_rng(9)
  k = jnp.asarray(rng.normal(size=(1, 300, 1, 64)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(1, 300, 1, 64)), jnp.float32)
  q = jnp.asarray(rng.normal(size=(1, 1, 4, 64)), jnp.float32)
  exact = jaxkv.reference_attention(q, k, v, jnp.array([300]))
  cache = KVCache.init("int8", 1, 1, 64, 300, jnp.float32).prefill(k, v, [300])
  approx = jaxkv.decode_attention(q, cache)
  assert float(jnp.max(jnp.abs(approx - exact))) < 0.02


def test_decode_attention_under_jit():
  rng = np.random.default_rng(2)
  cache = _filled_cache(rng, KVFormat.preset("kivi4"), [200, 40], 1, 64)
  q = jnp.asarray(rng.normal(size=(2, 1, 4, 64)), jnp.float32)
  eager = jaxkv.decode_attention(q, cache)
  jitted = jax.jit(jaxkv.decode_attention)(q, cache)
  np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-6, atol=1e-6)


def test_attention_bad_inputs():
  rng = np.random.default_rng(0)
  cache = _filled_cache(rng, KVFormat.preset("kivi4"), [10, 10], 2, 64)
  q = jnp.ones((2, 1, 4, 64), jnp.float32)
  with pytest.raises(ValueError, match="Hq=3 must be a multiple of kv_heads=2"):
    jaxkv.decode_attention(jnp.ones((2, 1, 3, 64)), cache)
  with pytest.raises(ValueError, match="rank 4|\\[B, S, Hq, D\\]"):
    jaxkv.decode_attention(q[0], cache)
  with pytest.raises(ValueError, match="head_dim 32"):
    jaxkv.decode_attention(jnp.ones((2, 1, 4, 32)), cache)
  with pytest.raises(ValueError, match="batch 3"):
    jaxkv.decode_attention(jnp.ones((3, 1, 4, 64)), cache)
  with pytest.raises(ValueError, match="implementation='cuda'"):
    jaxkv.decode_attention(q, cache, implementation="cuda")
  with pytest.raises(TypeError, match="KVCache"):
    jaxkv.decode_attention(q, {"k": 1})
  with pytest.raises(TypeError, match="q.dtype=int32"):
    jaxkv.decode_attention(q.astype(jnp.int32), cache)
  k = jnp.ones((2, 5, 3, 64))
  with pytest.raises(ValueError, match="multiple of kv heads 3"):
    jaxkv.reference_attention(q, k, k, jnp.array([5, 5]))


def test_reference_attention_checks_lengths():
  q = jnp.ones((2, 1, 4, 16), jnp.float32)
  k = jnp.ones((2, 10, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match=r"lengths=\[20, 5\] must lie in \[0, T=10\]"):
    jaxkv.reference_attention(q, k, k, [20, 5])
  with pytest.raises(TypeError, match="lengths.dtype=float"):
    jaxkv.reference_attention(q, k, k, jnp.array([3.7, 5.0]))
  with pytest.raises(ValueError, match=r"lengths.shape=\(3,\) must be \(2,\)"):
    jaxkv.reference_attention(q, k, k, jnp.array([3, 5, 1]))
  with pytest.raises(ValueError, match=r"lengths.shape=\(\) must be \(2,\)"):
    jaxkv.reference_attention(q, k, k, 3)
