"""Chunked / multi-turn prefill into a live cache, `jaxkv.chunk_attention`, input validation."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import KVCache
from jaxkv.decoding import generate
from models import llama
from models.checkpoint import save_llama
from pallas_kernels.chunk_attention import ChunkAttentionConfig
from tests.model_fixtures import SMALL, full_f32_matmuls, rel_err  # noqa: F401  (autouse fixture)

CFG = SMALL
INTERPRET = os.environ.get("JAXKV_TEST_GPU", "0") != "1"




@pytest.fixture(scope="module")
def model():
  return llama.random_model(CFG, seed=41, dtype=jnp.float32)


# ------------------------------------------------------ chunk attention
def _numpy_chunk_attention(q, cache, k_chunk, v_chunk, history=None):
  """float64 oracle over ``cache.dequantize()`` (or ``history = (k, v)``) of the
  history plus the chunk (causal)."""
  history = cache.dequantize() if history is None else history
  kh, vh = (np.asarray(a, np.float64) for a in history)
  q, kc, vc = (np.asarray(a, np.float64) for a in (q, k_chunk, v_chunk))
  b, c, hq, d = q.shape
  g = hq // kh.shape[2]
  out = np.zeros_like(q)
  for s in range(b):
    n = int(cache.lengths[s])
    for i in range(c):
      keys = np.concatenate([kh[s, :n], kc[s, :i + 1]])      # [n + i + 1, Hkv, D]
      vals = np.concatenate([vh[s, :n], vc[s, :i + 1]])
      for h in range(hq):
        logits = keys[:, h // g] @ q[s, i, h] / np.sqrt(d)
        p = np.exp(logits - logits.max())
        out[s, i, h] = (p / p.sum()) @ vals[:, h // g]
  return out


@pytest.mark.parametrize("preset", ["kivi4", "int8", "bf16"])
@pytest.mark.parametrize("impl", ["pallas", "xla", "reference"])
def test_chunk_attention_matches_float64(preset, impl):
  """Ragged quantized history (packed + residual) and a chunk spanning several blocks."""
  rng = np.random.default_rng(len(preset) + len(impl))
  b, h, hq, d, c = 3, 2, 4, 32, 40
  hist = [300, 129, 0]
  k = rng.standard_normal((b, 300, h, d)).astype(np.float32)
  v = rng.standard_normal((b, 300, h, d)).astype(np.float32)
  cache = KVCache.init(preset, b, h, d, 512, jnp.float32).prefill(
      jnp.asarray(k), jnp.asarray(v), jnp.asarray(hist))
  q = rng.standard_normal((b, c, hq, d)).astype(np.float32)
  kc = rng.standard_normal((b, c, h, d)).astype(np.float32)
  vc = rng.standard_normal((b, c, h, d)).astype(np.float32)
  pallas_only = (dict(config=ChunkAttentionConfig(block_q=32, block_k=16), interpret=INTERPRET)
                 if impl == "pallas" else {})  # refused elsewhere (they would be ignored)
  got = jaxkv.chunk_attention(jnp.asarray(q), cache, jnp.asarray(kc), jnp.asarray(vc),
                              implementation=impl, block_q=16, block_k=128, **pallas_only)
  want = _numpy_chunk_attention(q, cache, kc, vc)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("preset,hq,hkv,d,c,hist,config", [
    ("kivi4", 8, 8, 64, 33, [200, 61], ChunkAttentionConfig(block_q=32, block_k=16)),
    ("kivi2", 8, 2, 128, 24, [129, 0], ChunkAttentionConfig(block_q=16, block_k=16)),
    ("bf16", 8, 1, 64, 70, [5, 256], None),
    ("quantspec", 4, 1, 64, 9, [256, 130], ChunkAttentionConfig(block_q=16, block_k=16)),
])
def test_pallas_chunk_attention_bf16_matches_float64(preset, hq, hkv, d, c, hist, config):
  """bf16 operands (the GPU path): GQA 1/4/8, ragged histories, odd chunk lengths.

  The oracle runs in float64 on the same bf16 inputs and the dequantized
  history rounded to bf16 (the kernel's K/V operands); the tolerance covers
  bf16 rounding of the probabilities before the P·V product and of the
  output (|out| <~ 3, half an ulp of bf16 at 4 is 2^-7).
  """
  rng = np.random.default_rng(hq * d + c)
  b = len(hist)
  bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)  # noqa: E731
  cache = KVCache.init(preset, b, hkv, d, 256, jnp.bfloat16).prefill(
      bf(b, 256, hkv, d), bf(b, 256, hkv, d), jnp.asarray(hist))
  q, kc, vc = bf(b, c, hq, d), bf(b, c, hkv, d), bf(b, c, hkv, d)
  got = jaxkv.chunk_attention(q, cache, kc, vc, implementation="pallas", config=config,
                              interpret=INTERPRET)
  assert got.dtype == jnp.bfloat16 and got.shape == (b, c, hq, d)
  # The history as the kernel sees it: dequantized, then bf16.
  rounded = tuple(x.astype(jnp.bfloat16) for x in cache.dequantize())
  want = _numpy_chunk_attention(q, cache, kc, vc, history=rounded)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------ model level
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_chunked_and_ragged_prefill_equal_full_forward(model, impl):
  """bf16 format (exact storage), float32: every chunking gives the full forward's logits
  (the chunk attention in jnp and through the Pallas kernel: interpret mode off a GPU)."""
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, CFG.vocab_size, (3, 45))
  lengths = np.array([45, 17, 30])
  full = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
  rows = np.arange(3)
  for chunk in (None, 16, 7):
    cache = model.init_cache("bf16", 3, 64, dtype=jnp.float32)
    last, cache = model.prefill(tokens, lengths, cache, chunk_size=chunk, attention_impl=impl)
    assert rel_err(last, full[rows, lengths - 1]) < 1e-5, chunk
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)


def test_multi_turn_prefill_decode_prefill_decode(model):
  """Prefill, decode 3 steps, prefill a second ragged turn in chunks, decode: == full forward."""
  rng = np.random.default_rng(4)
  b = 2
  turn1 = rng.integers(0, CFG.vocab_size, (b, 20))
  len1 = np.array([20, 9])
  turn2 = rng.integers(0, CFG.vocab_size, (b, 26))
  len2 = np.array([11, 26])
  # Jitted prefill / decode steps (eager per-op dispatch is slow on CPU).
  prefill = jax.jit(model.prefill, static_argnames="chunk_size")
  cache = model.init_cache("bf16", b, 96, dtype=jnp.float32)
  logits, cache = prefill(jnp.asarray(turn1, jnp.int32), jnp.asarray(len1), cache)
  seqs = [list(turn1[i, :len1[i]]) for i in range(b)]
  got = [logits]
  out, _, cache = jaxkv.decode_steps(model, jnp.argmax(logits, -1), cache, 3)
  for i in range(b):
    seqs[i] += [int(jnp.argmax(logits[i]))] + list(np.asarray(out[i, :2]))
  # decode_steps fed argmax, out[0], out[1] (now in the cache); out[2] is not fed.
  logits, cache = prefill(jnp.asarray(turn2, jnp.int32), jnp.asarray(len2), cache, chunk_size=8)
  got.append(logits)
  for i in range(b):
    seqs[i] += list(turn2[i, :len2[i]])
  nxt = jnp.asarray([5, 6], jnp.int32)
  step_logits, cache = jax.jit(model.decode)(nxt[:, None], cache)
  for i in range(b):
    seqs[i] += [int(nxt[i])]
    full = np.asarray(model(jnp.asarray([seqs[i]], jnp.int32)))[0]
    assert rel_err(got[0][i], full[len1[i] - 1]) < 1e-5
    assert rel_err(got[1][i], full[len1[i] + 3 + len2[i] - 1]) < 1e-5
    assert rel_err(step_logits[i, 0], full[-1]) < 1e-5
  np.testing.assert_array_equal(np.asarray(cache.lengths), len1 + 3 + len2 + 1)


def test_quantized_chunked_prefill_cache_equals_one_shot_quantization():
  """kivi4, chunks of 48 across flushes: layer 0's cache == `KVCache.prefill` of its whole K/V.

  Layer 0's K/V do not depend on attention, so the same chunked prefill with
  the unquantized format (float32 storage) holds them exactly; quantizing
  them at once must give the kivi4 cache bit for bit.
  """
  m = llama.random_model(CFG, seed=42, dtype=jnp.float32)
  rng = np.random.default_rng(5)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 300)), jnp.int32)
  lengths = np.array([300, 261])
  caches = {}
  for fmt in ("bf16", "kivi4"):
    cache = m.init_cache(fmt, 2, 320, dtype=jnp.float32)
    caches[fmt] = m.prefill(tokens, lengths, cache, chunk_size=48)[1].layer(0)
  k, v = (x[:, :300] for x in caches["bf16"].dequantize())
  want = KVCache.init("kivi4", 2, CFG.num_kv_heads, CFG.head_dim, 320, jnp.float32).prefill(
      k, v, jnp.asarray(lengths))
  got = caches["kivi4"]
  np.testing.assert_array_equal(np.asarray(got.packed_lens), [256, 256])
  for a, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


# ------------------------------------------------------------ validation
def test_token_and_length_validation(model, tmp_path):
  tokens = np.random.default_rng(6).integers(0, CFG.vocab_size, (2, 10))
  cache = model.init_cache("bf16", 2, 32, dtype=jnp.float32)
  bad = tokens.copy()
  bad[1, 3] = CFG.vocab_size
  with pytest.raises(ValueError, match=r"tokens must lie in \[0, 95\].*\[96\]"):
    model.prefill(bad, [10, 10], cache)
  with pytest.raises(ValueError, match=r"prompt_lengths must lie in \[0, 10\]"):
    model.prefill(tokens, jnp.asarray([11, 3]), cache)
  with pytest.raises(ValueError, match=r"tokens must lie in \[0, 95\].*-1"):
    model.decode(jnp.asarray([[1], [-1]]), cache)
  with pytest.raises(ValueError, match=r"tokens must lie in \[0, 96\).*\[200\]"):
    jaxkv.decode_steps(model, jnp.asarray([200, 1]), cache, 2)
  with pytest.raises(ValueError, match=r"prompt_lengths=\[0, 3\] must lie in \[1, T=10\]"):
    generate(model, tokens, jnp.asarray([0, 3]), max_new_tokens=2)  # concrete jax array
  with pytest.raises(ValueError, match=r"prompt_tokens must lie in \[0, 96\)"):
    generate(model, bad, [10, 4], max_new_tokens=2)
  generate(model, bad, [3, 3], max_new_tokens=1)  # invalid ids only in the padding: fine
  save_llama(model, str(tmp_path))
  with pytest.raises(TypeError, match="dtype=int8 must be a floating dtype"):
    llama.from_pretrained(str(tmp_path), dtype=jnp.int8)


def test_traced_out_of_range_inputs_flag_the_cache(model):
  tokens = jnp.asarray(np.random.default_rng(7).integers(0, CFG.vocab_size, (3, 8)), jnp.int32)
  tokens = tokens.at[0, 2].set(-4)
  prefill = jax.jit(lambda t, n, c: model.prefill(t, n, c))
  cache = model.init_cache("kivi2", 3, 32, dtype=jnp.float32)
  _, cache = prefill(tokens, jnp.asarray([8, 9, 4]), cache)  # seq 1: length 9 > T
  np.testing.assert_array_equal(np.asarray(cache.invalid), [True, True, False])
  _, cache = jax.jit(model.decode)(jnp.asarray([[1], [2], [CFG.vocab_size]]), cache)
  np.testing.assert_array_equal(np.asarray(cache.invalid), [True, True, True])
  with pytest.raises(ValueError, match=r"ModelCache.invalid set for sequences \[0, 1, 2\]"):
    cache.check()


@pytest.mark.parametrize("budget_seqs", [1, 2])
def test_pallas_chunk_attention_batch_slices(monkeypatch, budget_seqs):
  """A history temporary over budget runs the batch in slices (B=3: slices of 1, or 2
  with the last overlapping); the result is the float64 oracle's."""
  import jaxkv.chunked_attention as ca  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(budget_seqs)
  b, h, hq, d, c, cap = 3, 2, 4, 32, 20, 128
  f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  cache = KVCache.init("kivi4", b, h, d, cap, jnp.float32).prefill(
      jnp.asarray(f(b, cap, h, d)), jnp.asarray(f(b, cap, h, d)), jnp.asarray([100, 0, 128]))
  q, kc, vc = f(b, c, hq, d), f(b, c, h, d), f(b, c, h, d)
  monkeypatch.setattr(ca, "PALLAS_HISTORY_BYTES", budget_seqs * 2 * cap * h * d * 4)
  got = jaxkv.chunk_attention(jnp.asarray(q), cache, jnp.asarray(kc), jnp.asarray(vc),
                              implementation="pallas",
                              config=ChunkAttentionConfig(block_q=32, block_k=16),
                              interpret=INTERPRET)
  np.testing.assert_allclose(np.asarray(got), _numpy_chunk_attention(q, cache, kc, vc),
                             rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_q=48), "block_q=48 must be a power of two >= 16"),
    (dict(block_k=8), "block_k=8 must be a power of two >= 16"),
    (dict(block_q=32, block_k=64), "block_k=64 must be <= block_q=32"),
    (dict(num_warps=3), "num_warps=3"),
    (dict(num_stages=0), "num_stages=0"),
])
def test_chunk_attention_config_errors(kwargs, match):
  cache = KVCache.init("kivi4", 1, 2, 32, 256, jnp.float32)
  q = jnp.ones((1, 8, 4, 32), jnp.float32)
  kv = jnp.ones((1, 8, 2, 32), jnp.float32)
  with pytest.raises(ValueError, match=match):
    jaxkv.chunk_attention(q, cache, kv, kv, implementation="pallas",
                          config=ChunkAttentionConfig(**kwargs), interpret=True)


def test_chunk_attention_pallas_rejects_odd_head_dim():
  cache = KVCache.init("bf16", 1, 2, 24, 64, jnp.float32)
  q = jnp.ones((1, 4, 2, 24), jnp.float32)
  kv = jnp.ones((1, 4, 2, 24), jnp.float32)
  with pytest.raises(ValueError, match="power-of-two head_dim"):
    jaxkv.chunk_attention(q, cache, kv, kv, implementation="pallas", interpret=True)


def test_chunk_attention_checks_scale_and_q_dtype():
  cache = KVCache.init("kivi4", 1, 2, 32, 256, jnp.float32)
  q = jnp.ones((1, 8, 4, 32), jnp.float32)
  kv = jnp.ones((1, 8, 2, 32), jnp.float32)
  with pytest.raises(ValueError, match="scale=nan must be finite"):
    jaxkv.chunk_attention(q, cache, kv, kv, scale=float("nan"))
  with pytest.raises(TypeError, match="scale=True"):
    jaxkv.chunk_attention(q, cache, kv, kv, scale=True)
  with pytest.raises(ValueError, match="scale must be a scalar"):
    jaxkv.chunk_attention(q, cache, kv, kv, scale=jnp.array([1.0, 2.0]))
  with pytest.raises(TypeError, match="q.dtype=int32 must be floating"):
    jaxkv.chunk_attention(q.astype(jnp.int32), cache, kv, kv)


@pytest.mark.parametrize("impl", ["reference", "xla", "pallas"])
def test_chunk_attention_nonfinite_sequence_is_all_nan(impl):
  """README "Input policy": a sequence whose cache holds a NaN gives NaN everywhere."""
  rng = np.random.default_rng(2)
  k = rng.normal(size=(2, 40, 2, 32)).astype(np.float32)
  k[0, 3, 1, 5] = np.nan                       # one NaN in sequence 0's history
  v = rng.normal(size=(2, 40, 2, 32)).astype(np.float32)
  cache = jax.jit(lambda c, k, v: c.prefill(k, v, jnp.array([40, 25])))(
      KVCache.init("kivi4", 2, 2, 32, 256, jnp.float32), jnp.asarray(k), jnp.asarray(v))
  np.testing.assert_array_equal(np.asarray(cache.nonfinite), [True, False])
  q = jnp.asarray(rng.normal(size=(2, 8, 4, 32)), jnp.float32)
  kv = jnp.asarray(rng.normal(size=(2, 8, 2, 32)), jnp.float32)
  out = np.asarray(jaxkv.chunk_attention(q, cache, kv, kv, implementation=impl,
                                         interpret=INTERPRET if impl == "pallas" else None))
  assert np.isnan(out[0]).all()
  assert np.isfinite(out[1]).all()
