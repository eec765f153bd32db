"""VQ caches in the model (`jaxkv.VQModelCache`, issue 15): Llama prefill / decode / generate.

Oracles:
* the cache after chunked prefill and decode appends == quantizing each
  layer's whole K/V history at once (`jaxkv.vq.quantize`), codes bit for bit,
  residual rows exact (the K/V the model appended are recorded by a spy);
* decode logits == the same model with attention in float64 over the
  dequantized cache, the rows an append flushes replaced by their centroids;
* with codebooks whose entries *are* the model's K/V sub-vectors (so VQ
  stores every value exactly) chunked, multi-turn prefill, decode and
  `generate` == the full-precision forward / the float32 ("bf16") cache.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv import VQCache, VQModelCache, vq
from models import llama
from tests.model_fixtures import SMALL, full_f32_matmuls, rel_err  # noqa: F401  (autouse fixture)
from tests.test_model_cache import _fresh_cache_sized_buffers, _pointers, _stacked_shapes

CFG = SMALL  # 2 layers, 4 query / 2 kv heads, head_dim 32
# R == G: a one-token decode step takes `ModelCache._append_token`.
FAST = vq.VQFormat(k_vector=4, v_vector=2, token_group=16, residual=16,
                   codebook_dtype="float32")
# R == 2G, two K stages, small V codebook, float16 centroids: the general append.
GENERAL = vq.VQFormat(k_vector=2, v_vector=4, k_stages=2, v_index_bits=5, token_group=16,
                      residual=32)


@pytest.fixture(scope="module")
def model():
  return llama.random_model(CFG, seed=51, dtype=jnp.float32)


def random_books(fmt: vq.VQFormat, seed: int) -> vq.VQCodebooks:
  """Random (untrained but valid) codebooks for every layer; stage 2 smaller."""
  key = jax.random.key(seed)
  sides = {}
  for i, side in enumerate("kv"):
    shape = (CFG.num_layers, *fmt.codebook_shape(side, CFG.num_kv_heads, CFG.head_dim))
    x = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
    x = x * jnp.asarray([1.0, 0.3][: shape[2]])[None, None, :, None, None, None]
    sides[side] = x.astype(fmt.codebook_dtype)
  return vq.VQCodebooks(k=sides["k"], v=sides["v"], fmt=fmt)


@functools.partial(jax.jit, static_argnums=0)
def _forward_kv(graphdef, state, tokens):
  """Full causal forward without a cache: logits ``[B, T, V]``, K/V ``[L, B, T, Hkv, D]``."""
  return nnx.merge(graphdef, state).forward_kv(tokens)


def exact_books(model, fmt: vq.VQFormat, seqs) -> vq.VQCodebooks:
  """Codebooks whose entries are the sub-vectors of every K/V the model computes for
  ``seqs`` (a list of token lists; at most ``2^b`` tokens in all; one stage each).

  VQ then stores each of those values exactly (distance 0). The K/V of the same
  tokens computed another way (chunked, decoded) differ by float rounding only,
  far less than the gaps between entries, so they pick the same entry.
  """
  tokens = np.zeros((len(seqs), max(len(s) for s in seqs)), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  ks, vs = vq.calibration_kv(model, tokens, [len(s) for s in seqs])  # [L, N, H, D]
  sides = {}
  for side, x in (("k", ks), ("v", vs)):
    spec = fmt.spec(side)
    assert spec.stages == 1 and x.shape[1] <= spec.entries
    x = np.asarray(x)
    layers, n, h, d = x.shape
    sub = x.reshape(layers, n, h, d // spec.vector, spec.vector).transpose(0, 2, 3, 1, 4)
    pad = np.repeat(sub[:, :, :, :1], spec.entries - n, axis=3)           # repeats: same value
    sides[side] = jnp.asarray(np.concatenate([sub, pad], axis=3)[:, :, None], fmt.codebook_dtype)
  return vq.VQCodebooks(k=sides["k"], v=sides["v"], fmt=fmt)


def _full_logits(model, seq) -> np.ndarray:
  graphdef, state = nnx.split(model)
  return np.asarray(_forward_kv(graphdef, state, jnp.asarray([seq], jnp.int32))[0][0])


# ------------------------------------------------ incremental == at once
@pytest.mark.parametrize("fmt", [FAST, GENERAL], ids=["r_eq_g", "r_2g_2stage"])
def test_cache_equals_quantizing_the_whole_history(model, fmt, monkeypatch):
  """Chunked ragged prefill, 1- and 2-token decode steps across flushes (jitted): each
  layer's codes == `vq.quantize` of the K/V the model appended, bit for bit; residual
  rows exact, zero past the length; == `VQCache.prefill` of that history (from_layers)."""
  records = []  # (layer, k, v, num_new) of every append, in order

  def spy(method):
    def wrapped(self, index, k_new, v_new, plan, *args, **kwargs):
      jax.debug.callback(lambda k, v, n, i=index: records.append((i, k, v, n)), k_new, v_new,
                         plan.num_new, ordered=True)
      return method(self, index, k_new, v_new, plan, *args, **kwargs)
    return wrapped

  # The two leaves every append goes through (`append_layer` calls one of them).
  for name in ("append_layer_with_history", "_append_token"):
    monkeypatch.setattr(VQModelCache, name, spy(getattr(VQModelCache, name)))
  rng = np.random.default_rng(7)
  b, cap = 3, 96
  books = random_books(fmt, seed=3)
  graphdef, state = nnx.split(model)
  prefill = jax.jit(lambda s, t, n, c: nnx.merge(graphdef, s).prefill(t, n, c, chunk_size=16))
  decode = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode(t, c))
  cache = model.init_cache(fmt, b, cap, codebooks=books)
  lengths = np.array([45, 17, 31])
  tokens = rng.integers(0, CFG.vocab_size, (b, 45))
  _, cache = prefill(state, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths), cache)
  for s in (1, 1, 2, 1):
    _, cache = decode(state, jnp.asarray(rng.integers(0, CFG.vocab_size, (b, s)), jnp.int32),
                      cache)
  jax.effects_barrier()
  lengths = lengths + 5
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
  packed = np.asarray(cache.packed_lens)
  assert (packed > 0).sum() >= 2  # flushed groups in most sequences
  per_layer = []
  for layer in range(CFG.num_layers):
    rows = {"k": [[] for _ in range(b)], "v": [[] for _ in range(b)]}
    for i, k, v, n in records:
      if i == layer:
        for seq in range(b):
          rows["k"][seq].append(k[seq, :n[seq]])
          rows["v"][seq].append(v[seq, :n[seq]])
    hist = {}
    for side in "kv":
      hist[side] = np.zeros((b, cap, CFG.num_kv_heads, CFG.head_dim), np.float32)
      for seq in range(b):
        h = np.concatenate(rows[side][seq])
        assert len(h) == lengths[seq]
        hist[side][seq, :len(h)] = h
    view = cache.layer(layer)
    for side, codes, residual, book in (("k", view.k_codes, view.k_residual, books.k[layer]),
                                        ("v", view.v_codes, view.v_residual, books.v[layer])):
      want_codes = np.asarray(vq.quantize(jnp.asarray(hist[side].swapaxes(1, 2)), book))
      for seq in range(b):
        p, n = packed[seq], lengths[seq]
        np.testing.assert_array_equal(np.asarray(codes)[seq, :, :p], want_codes[seq, :, :p])
        res = np.asarray(residual)[seq]                                   # [H, R, D]
        np.testing.assert_array_equal(res[:, :n - p], hist[side][seq, p:n].swapaxes(0, 1))
        assert not res[:, n - p:].any()
    per_layer.append(VQCache.init(fmt, books, b, CFG.num_kv_heads, CFG.head_dim, cap,
                                  jnp.float32, layer=layer).prefill(
                                      jnp.asarray(hist["k"]), jnp.asarray(hist["v"]),
                                      jnp.asarray(lengths)))
  stacked = VQModelCache.from_layers(per_layer)
  for got, want in zip(jax.tree_util.tree_leaves(cache), jax.tree_util.tree_leaves(stacked)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------- decode == float64 oracle
def _centroid_sums(codes, book):
  """``codes [m, H, S*n]`` ints, ``book [H, S, n, E, v]`` -> float64 ``[m, H, n*v]``."""
  h, stages, n, _, vec = book.shape
  book = np.asarray(book, np.float64)
  idx = np.asarray(codes).reshape(codes.shape[0], h, stages, n)
  out = np.zeros((codes.shape[0], h, n, vec))
  for s in range(stages):
    out += book[np.arange(h)[None, :, None], s, np.arange(n)[None, None, :], idx[:, :, s]]
  return out.reshape(codes.shape[0], h, n * vec)


def _attention64(q, k, v, lengths):
  """float64 attention; query i of sequence b sees keys ``[0, lengths_b - S + i]``."""
  b, s, hq, d = q.shape
  g = hq // k.shape[2]
  out = np.zeros(q.shape)
  for seq in range(b):
    for i in range(s):
      last = lengths[seq] - s + i
      for h in range(hq):
        logits = k[seq, :last + 1, h // g] @ q[seq, i, h] / np.sqrt(d)
        p = np.exp(logits - logits.max())
        out[seq, i, h] = (p / p.sum()) @ v[seq, :last + 1, h // g]
  return out


def oracle_decode(model, tokens, cache: VQModelCache) -> np.ndarray:
  """Logits ``[B, S, V]`` of ``tokens [B, S]`` decoded over ``cache.dequantize()``.

  Per layer: the history as stored, the new K/V appended exactly, the rows
  the append flushes (`fmt.packed_len`) replaced by the centroids of their
  nearest codes (`jaxkv.vq.quantize`), then float64 attention. Projections,
  MLPs and norms are the model's own (float32).
  """
  fmt, (b, s) = cache.fmt, tokens.shape
  lengths = np.asarray(cache.lengths)
  k_all, v_all = (np.asarray(x, np.float64) for x in cache.dequantize())  # [L, B, C, H, D]
  positions = jnp.asarray(lengths[:, None] + np.arange(s)[None, :], jnp.int32)
  x = model._embed(jnp.asarray(tokens, jnp.int32))  # pylint: disable=protected-access
  for layer_index, layer in enumerate(model.layers):
    def attend(q, k, v, _, li=layer_index):
      hist = []
      for full, new, book in ((k_all[li].copy(), k, cache.k.codebook[li]),
                              (v_all[li].copy(), v, cache.v.codebook[li])):
        new = np.asarray(new, np.float64)
        for seq in range(b):
          n = int(lengths[seq])
          full[seq, n:n + s] = new[seq]
          old_p, new_p = fmt.packed_len(n), fmt.packed_len(n + s)
          if new_p > old_p:  # these rows are quantized by this append
            rows = jnp.asarray(full[seq, old_p:new_p].swapaxes(0, 1)[None], jnp.float32)
            codes = np.asarray(vq.quantize(rows, book))[0].swapaxes(0, 1)  # [m, H, W]
            full[seq, old_p:new_p] = _centroid_sums(codes, book)
        hist.append(full)
      o = _attention64(np.asarray(q, np.float64), *hist, lengths + s)
      return jnp.asarray(o, q.dtype), None
    x, _ = layer(x, positions, attend)
  return np.asarray(model._logits(x))  # pylint: disable=protected-access


@pytest.mark.parametrize("fmt", [FAST, GENERAL], ids=["r_eq_g", "r_2g_2stage"])
def test_decode_logits_match_float64_oracle_over_dequantized_cache(model, fmt):
  """Lossy (random) codebooks, ragged lengths, steps of 1 and 2 tokens, some flushing."""
  rng = np.random.default_rng(11)
  b = 3
  books = random_books(fmt, seed=5)
  graphdef, state = nnx.split(model)
  decode = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode(t, c))
  lengths = np.array([31, 47, 20])     # 31 -> 32 and 47 -> 48 flush a group (R == G)
  tokens = rng.integers(0, CFG.vocab_size, (b, 47))
  cache = model.init_cache(fmt, b, 64, codebooks=books)
  _, cache = jax.jit(lambda s, t, n, c: nnx.merge(graphdef, s).prefill(t, n, c))(
      state, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths), cache)
  flushed = 0
  for s in (1, 2, 1):
    new = rng.integers(0, CFG.vocab_size, (b, s))
    want = oracle_decode(model, new, cache)
    before = np.asarray(cache.packed_lens)
    got, cache = decode(state, jnp.asarray(new, jnp.int32), cache)
    flushed += int((np.asarray(cache.packed_lens) > before).sum())
    assert got.shape == (b, s, CFG.vocab_size)
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
  assert flushed >= 2  # the steps crossed group boundaries


def test_chunk_attention_over_vq_history_matches_float64():
  """`jaxkv.chunk_attention` on a `VQCache` history: every implementation == dense float64."""
  rng = np.random.default_rng(13)
  b, h, hq, d, c = 3, 2, 4, 32, 24
  hist = [150, 37, 0]
  books = random_books(GENERAL, seed=9)
  k, v = (jnp.asarray(rng.standard_normal((b, 150, h, d)), jnp.float32) for _ in range(2))
  cache = VQCache.init(GENERAL, books, b, h, d, 256, jnp.float32, layer=1).prefill(
      k, v, jnp.asarray(hist))
  q = rng.standard_normal((b, c, hq, d)).astype(np.float32)
  kc, vc = (rng.standard_normal((b, c, h, d)).astype(np.float32) for _ in range(2))
  kh, vh = (np.asarray(x, np.float64) for x in cache.dequantize())
  want = np.zeros((b, c, hq, d))
  for seq in range(b):  # history, then the chunk causally
    n = hist[seq]
    keys = np.concatenate([kh[seq, :n], kc[seq]])
    vals = np.concatenate([vh[seq, :n], vc[seq]])
    want[seq] = _attention64(q[seq][None].astype(np.float64), keys[None], vals[None],
                             np.asarray([n + c]))[0]
  for impl in ("reference", "xla", "pallas"):
    got = jaxkv.chunk_attention(jnp.asarray(q), cache, jnp.asarray(kc), jnp.asarray(vc),
                                implementation=impl, block_q=16, block_k=64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=impl)


# ------------------------------- exact codebooks: == full-precision model
def test_exact_codebooks_chunked_and_multi_turn_equal_full_forward(model):
  """Codebooks holding the model's own K/V: one-shot and chunked prefill (16, 7), a decode
  turn and a second chunked turn == the full forward; the same codes for every chunking."""
  rng = np.random.default_rng(17)
  b = 2
  turn1, len1 = rng.integers(0, CFG.vocab_size, (b, 40)), np.array([40, 23])
  steps = rng.integers(0, CFG.vocab_size, (b, 3))
  turn2, len2 = rng.integers(0, CFG.vocab_size, (b, 21)), np.array([9, 21])
  last = rng.integers(0, CFG.vocab_size, (b, 1))
  seqs = [list(turn1[i, :len1[i]]) + list(steps[i]) + list(turn2[i, :len2[i]]) + list(last[i])
          for i in range(b)]
  books = exact_books(model, FAST, seqs)
  graphdef, state = nnx.split(model)
  prefill = jax.jit(lambda s, t, n, c, size: nnx.merge(graphdef, s).prefill(
      t, n, c, chunk_size=size), static_argnums=4)
  decode = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode(t, c))
  full = [_full_logits(model, seq) for seq in seqs]
  caches = {}
  for size in (None, 16, 7):
    cache = model.init_cache(FAST, b, 80, codebooks=books)
    logits, cache = prefill(state, jnp.asarray(turn1, jnp.int32), jnp.asarray(len1), cache, size)
    for i in range(b):
      err = rel_err(logits[i], full[i][len1[i] - 1])
      assert err < 1e-5, (size, i, err)
    caches[size] = cache
  for size in (16, 7):
    for got, want in zip((caches[size].k.codes, caches[size].v.codes),
                         (caches[None].k.codes, caches[None].v.codes)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  cache = caches[7]
  for j in range(3):
    logits, cache = decode(state, jnp.asarray(steps[:, j:j + 1], jnp.int32), cache)
    for i in range(b):
      assert rel_err(logits[i, 0], full[i][len1[i] + j]) < 1e-5, (j, i)
  logits, cache = prefill(state, jnp.asarray(turn2, jnp.int32), jnp.asarray(len2), cache, 7)
  for i in range(b):
    assert rel_err(logits[i], full[i][len1[i] + 3 + len2[i] - 1]) < 1e-5, i
  logits, cache = decode(state, jnp.asarray(last, jnp.int32), cache)
  for i in range(b):
    assert rel_err(logits[i, 0], full[i][-1]) < 1e-5, i
  np.testing.assert_array_equal(np.asarray(cache.lengths), len1 + 3 + len2 + 1)
  assert (np.asarray(cache.packed_lens) > 32).all()
  # Stored exactly: the dequantized cache is the full forward's K/V.
  graphdef, state = nnx.split(model)
  for i, seq in enumerate(seqs):
    _, ks, vs = _forward_kv(graphdef, state, jnp.asarray([seq], jnp.int32))
    for got, want in zip(cache.dequantize(), (ks, vs)):
      np.testing.assert_allclose(np.asarray(got)[:, i, :len(seq)], np.asarray(want)[:, 0],
                                 rtol=1e-5, atol=1e-5)


def test_lossy_chunked_prefill_first_layer_cache_equals_one_shot(model):
  """Lossy (random) codebooks: chunked prefill stores layer 0 (whose K/V do not depend
  on attention) as one-shot prefill does: the same codes; residual rows equal up to
  the float rounding of the K/V projection, which on XLA:CPU depends on the chunk's
  shape (measured: 6e-7 between 22- and 24-row chunks; test (a) checks exactness)."""
  rng = np.random.default_rng(19)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 70)), jnp.int32)
  lengths = jnp.asarray([70, 53])
  graphdef, state = nnx.split(model)
  books = random_books(GENERAL, seed=21)
  prefill = jax.jit(lambda s, t, n, c, size: nnx.merge(graphdef, s).prefill(
      t, n, c, chunk_size=size), static_argnums=4)
  layers = {}
  for size in (None, 24):
    cache = model.init_cache(GENERAL, 2, 96, codebooks=books)
    layers[size] = prefill(state, tokens, lengths, cache, size)[1].layer(0)
  got, want = layers[24], layers[None]
  assert (np.asarray(got.packed_lens) > 0).all()
  for name in ("k_codes", "v_codes", "lengths"):
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))
  for name in ("k_residual", "v_residual"):
    np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                               rtol=0, atol=2e-6)


# ---------------------------------------------- jit, scan, donation, generate
def test_generate_and_decode_steps_with_exact_codebooks_equal_float_cache(model):
  """`generate(kv_format=VQ, codebooks=)` and `decode_steps` on a donated VQ cache give the
  greedy tokens of the float32 ("bf16") cache when the codebooks hold the model's K/V;
  the jitted step is traced once and updates the cache in place."""
  rng = np.random.default_rng(23)
  # B = 3: no attention temporary [B, Hkv, G, R, D] shares the HLO shape of the
  # stacked residual [L, B, Hkv, R, D] (the cache-sized-buffer check goes by shape).
  b, t, new = 3, 30, 6
  prompts, lengths = rng.integers(0, CFG.vocab_size, (b, t)), np.array([30, 19, 25])
  want, want_n = jaxkv.generate(model, prompts, lengths, kv_format="bf16", max_new_tokens=new,
                                cache_dtype=jnp.float32)
  seqs = [list(prompts[i, :lengths[i]]) + list(np.asarray(want[i])) for i in range(b)]
  books = exact_books(model, FAST, seqs)
  got, got_n = jaxkv.generate(model, prompts, lengths, kv_format=FAST, codebooks=books,
                              max_new_tokens=new)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_n), np.asarray(want_n))

  graphdef, state = nnx.split(model)
  cache = model.init_cache(FAST, b, 48, codebooks=books)
  logits, cache = jax.jit(lambda s, tk, n, c: nnx.merge(graphdef, s).prefill(tk, n, c))(
      state, jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths), cache)
  first = jnp.argmax(logits, -1).astype(jnp.int32)
  np.testing.assert_array_equal(np.asarray(first), np.asarray(want[:, 0]))

  @functools.partial(jax.jit, donate_argnames="cache")
  @chex.assert_max_traces(n=1)
  def step(state, tokens, cache):
    return jaxkv.decode_step(nnx.merge(graphdef, state), tokens, cache)

  hlo = step.lower(state, first, cache).compile().as_text()
  assert _fresh_cache_sized_buffers(hlo, _stacked_shapes(cache)) == []
  before, old = _pointers(cache), cache
  token = first
  for j in range(2):  # fresh values, same shapes: one trace
    logits, cache = step(state, token, cache)
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    np.testing.assert_array_equal(np.asarray(token), np.asarray(want[:, j + 1]))
  assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(old))
  assert _pointers(cache) == before                  # donated buffers updated in place
  out, _, cache2 = jaxkv.decode_steps(model, token, cache, new - 3)
  assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(cache))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want[:, 3:]))
  np.testing.assert_array_equal(np.asarray(cache2.lengths), lengths + new - 1)


def test_flags_and_check(model):
  """Overflow under jit is flagged, not written; NaN K/V poison only their sequence."""
  books = random_books(FAST, seed=29)
  graphdef, state = nnx.split(model)
  cache = model.init_cache(FAST, 2, 20, codebooks=books)
  tokens = jnp.asarray(np.random.default_rng(31).integers(0, CFG.vocab_size, (2, 20)),
                       jnp.int32)
  _, cache = jax.jit(lambda s, t, n, c: nnx.merge(graphdef, s).prefill(t, n, c))(
      state, tokens, jnp.asarray([20, 6]), cache)
  _, cache = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode(t, c))(
      state, tokens[:, :1], cache)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [20, 7])
  np.testing.assert_array_equal(np.asarray(cache.overflow), [True, False])
  with pytest.raises(ValueError, match=r"overflow.*sequences \[0\]"):
    cache.check()
  with pytest.raises(ValueError, match="would grow past capacity=20"):
    model.decode(tokens[:, :1], cache)


# ------------------------------------------------------------------ errors
def test_errors(model):
  books = random_books(FAST, seed=37)
  with pytest.raises(ValueError, match=r"needs codebooks=.*jaxkv.vq.fit"):
    model.init_cache(FAST, 2, 64)
  with pytest.raises(ValueError, match=r"needs codebooks="):
    model.init_cache("cq2", 2, 64)
  with pytest.raises(ValueError, match="codebooks were learned for"):
    model.init_cache("cq2", 2, 64, codebooks=books)
  with pytest.raises(ValueError, match=r"codebooks= is only for VQ formats"):
    model.init_cache("kivi4", 2, 64, codebooks=books)
  three = vq.VQCodebooks(k=jnp.concatenate([books.k, books.k[:1]]),
                         v=jnp.concatenate([books.v, books.v[:1]]), fmt=FAST)
  with pytest.raises(ValueError, match=r"codebooks.k holds 3 layers but the cache has "
                     r"num_layers=2"):
    model.init_cache(FAST, 2, 64, codebooks=three)
  with pytest.raises(ValueError, match=r"codebooks.v holds 1 kv heads but the cache has "
                     r"kv_heads=2"):
    model.init_cache(FAST, 2, 64, codebooks=(books.k, books.v[:, :1]))
  wide = random_books(FAST, seed=1)
  wide = vq.VQCodebooks(k=jnp.concatenate([wide.k, wide.k], axis=3), v=wide.v, fmt=FAST)
  with pytest.raises(ValueError, match=r"codebooks.k cover head_dim=64 .* head_dim=32"):
    model.init_cache(FAST, 2, 64, codebooks=wide)
  with pytest.raises(ValueError, match=r"must be \[L, Hkv, S, D/vector, 2\^bits, vector\]"):
    model.init_cache(FAST, 2, 64, codebooks=(books.k[0], books.v[0]))
  with pytest.raises(TypeError, match="codebooks must be a jaxkv.VQCodebooks"):
    model.init_cache(FAST, 2, 64, codebooks={"k": books.k})
  with pytest.raises(ValueError, match="all zeros: untrained"):
    model.init_cache(FAST, 2, 64, codebooks=(jnp.zeros_like(books.k), books.v))
  with pytest.raises(ValueError, match=r"is a VQ format: use jaxkv.VQModelCache.init"):
    jaxkv.ModelCache.init("cq4", 2, 1, 2, 32, 64)
  with pytest.raises(ValueError, match=r"needs codebooks="):
    jaxkv.generate(model, np.ones((1, 4), np.int32), [4], kv_format="cq2", max_new_tokens=2)
  cache = model.init_cache(FAST, 2, 64, codebooks=books)
  with pytest.raises(ValueError, match="must be hierarchical"):
    jaxkv.speculative_steps(model, jnp.asarray([1, 2]), cache, 1)
  with pytest.raises(ValueError, match="only the 'target' view"):
    cache.dequantize("draft")
  with pytest.raises(TypeError, match="non-empty sequence of jaxkv.VQCache"):
    VQModelCache.from_layers([])
  # The cache owns a copy: donating it never deletes the caller's codebooks.
  assert cache.k.codebook is not books.k
  assert cache.codebooks.fmt == FAST and cache.codebooks.num_layers == CFG.num_layers


# ------------------------------------------ calibration K/V, cache bytes, presets
def test_calibration_kv_and_cache_nbytes(model):
  """`vq.calibration_kv` == the full forward's K/V of the real tokens, in row order;
  `cache_nbytes` of a VQ format == the bytes of every array of the cache it allocates
  (codes, residual rows, flags, every layer's codebooks)."""
  rng = np.random.default_rng(41)
  tokens, lengths = rng.integers(0, CFG.vocab_size, (2, 24)), np.array([24, 9])
  k, v = vq.calibration_kv(model, tokens, lengths)
  assert k.shape == v.shape == (CFG.num_layers, 33, CFG.num_kv_heads, CFG.head_dim)
  graphdef, state = nnx.split(model)
  _, k_full, v_full = _forward_kv(graphdef, state, jnp.asarray(tokens, jnp.int32))
  for got, full in ((k, k_full), (v, v_full)):
    want = np.concatenate([np.asarray(full)[:, 0], np.asarray(full)[:, 1, :9]], axis=1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-6)
  with pytest.raises(ValueError, match=r"lengths=\[24, 0\] must be 2 ints in \[1, T=24\]"):
    vq.calibration_kv(model, tokens, [24, 0])
  for fmt in (FAST, GENERAL, "cq2"):
    books = random_books(vq.as_vq_format(fmt), 43)
    cache = model.init_cache(fmt, 3, 100, jnp.bfloat16, codebooks=books)
    leaves = jax.tree_util.tree_leaves(cache)
    assert any(x is cache.k.codebook for x in leaves)
    assert jaxkv.decoding.cache_nbytes(model, fmt, 3, 100, jnp.bfloat16) == \
        sum(x.nbytes for x in leaves)
  with pytest.raises(ValueError, match=r"'cq2' is a VQ preset, not a KVFormat"):
    jaxkv.KVFormat.preset("cq2")
