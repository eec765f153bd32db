"""`KVFormat.sink_tokens`: the first S tokens kept exactly beside the packed storage:
caches, the reference attention, models and dispatch. CPU. The kernel path of sink
formats (kernel from a skip on + exact prefix) is tests/test_sink_kernels.py."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jaxkv
from jaxkv import KVCache, ModelCache
from jaxkv.formats import KVFormat, PRESETS
from tests.model_fixtures import SMALL, full_f32_matmuls  # noqa: F401  (autouse fixture)


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


def test_reference_attention_reads_the_sinks():
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


def test_sink_tokens_checked():
  for bad in (-1, 33, 2.0, True, "4", None):
    with pytest.raises(ValueError, match=f"sink_tokens={re.escape(repr(bad))} must be an int in"):
      _fmt(sinks=bad)
  with pytest.raises(ValueError, match="sink_tokens=4 is not supported with hierarchical"):
    dataclasses.replace(PRESETS["quantspec"], sink_tokens=4)
  assert KVCache.init(_fmt(sinks=0), 1, 1, 32, 64).k_sink is None
  assert ModelCache.init(_fmt(sinks=0), 2, 1, 1, 32, 64).k_sink is None
  assert ModelCache.init(_fmt(sinks=3), 2, 1, 1, 32, 64).k_sink.shape == (2, 1, 3, 1, 32)
  assert KVFormat().sink_tokens == 0


# ------------------------------------------------------------------ oracles
def _oracle_kv(fmt, k, v, lengths):
  """float64 ``(k, v) [B, C, H, D]``: the whole history quantized at once with ``fmt``
  *without* sinks, rows ``[0, min(S, L_b))`` replaced by the exact K/V."""
  s = fmt.sink_tokens
  plain = dataclasses.replace(fmt, sink_tokens=0)
  b, _, h, d = k.shape
  cache = KVCache.init(plain, b, h, d, 128, k.dtype).prefill(k, v, lengths)
  kd, vd = (np.array(x, np.float64) for x in cache.dequantize())
  for i, n in enumerate(lengths):
    m = min(s, int(n))
    kd[i, :m] = np.asarray(k[i, :m], np.float64)
    vd[i, :m] = np.asarray(v[i, :m], np.float64)
  return kd, vd


def _attend64(q, kd, vd, lengths):
  """float64 decode attention: query i of ``q [B, Sq, Hq, D]`` sees keys ``[0, L - Sq + i]``."""
  q = np.asarray(q, np.float64)
  b, sq, hq, d = q.shape
  g = hq // kd.shape[2]
  out = np.zeros(q.shape)
  for i in range(b):
    for j in range(sq):
      n = int(lengths[i]) - sq + j + 1
      for head in range(hq):
        sc = kd[i, :n, head // g] @ q[i, j, head] / np.sqrt(d)
        p = np.exp(sc - sc.max())
        out[i, j, head] = (p / p.sum()) @ vd[i, :n, head // g]
  return out


def _rows(x, start, n, width):
  """Rows ``[start_b, start_b + n_b)`` of ``x [B, T, ...]`` right-padded to ``width`` (random
  padding: rows past ``n_b`` must be ignored)."""
  pad = np.random.default_rng(99).standard_normal((width, *x.shape[2:]))
  return jnp.asarray(np.stack([np.concatenate([np.asarray(x[i, start[i]:start[i] + n[i]]),
                                               pad[n[i]:]]) for i in range(x.shape[0])]),
                     x.dtype)


def _append_in_steps(cache, layers, lengths, steps):
  """``cache`` (a model cache) after appending every layer's ``(k, v) [B, T, H, D]``
  in chunks of ``steps`` tokens (each sequence up to its ``lengths``)."""
  start = np.zeros(len(lengths), int)
  for step in steps:
    n = np.clip(lengths - start, 0, step)
    plan = cache.plan_append(jnp.asarray(n, jnp.int32), max_new=step)
    for layer, (k, v) in enumerate(layers):
      cache = cache.append_layer(layer, _rows(k, start, n, step), _rows(v, start, n, step), plan)
    cache = cache.commit(plan)
    start += n
  return cache


# ------------------------------------------------------------ ModelCache
@pytest.mark.parametrize("name,sinks,use_kernel", [
    pytest.param("kivi2", 4, False, marks=pytest.mark.slow),  # the kernel case below covers it in CI
    ("kivi4", 32, False), ("int8", 1, False), ("kivi2", 4, True)])
def test_model_cache_appends_equal_one_shot_and_the_oracle(name, sinks, use_kernel):
  """Decode-token appends (the R == G one-token path, with and without the Pallas
  token-append kernel), ragged chunks crossing S and a flush: every layer's packed
  storage and sinks bitwise a one-shot `KVCache` prefill's, and `dequantize` equal to
  the oracle (whole history quantized without sinks, rows [0, S) exact)."""
  rng = np.random.default_rng(3)
  layers, b, h, d, t = 2, 3, 2, 32, 75
  fmt = _fmt(name, sinks)
  ks = [_kv(rng, b, t, h, d) for _ in range(layers)]
  lengths = np.asarray([75, 2, 40])
  cache = ModelCache.init(fmt, layers, b, h, d, 128, jnp.float32, use_kernel=use_kernel)
  # a chunk from 3 -> 6 crosses S = 4
  cache = _append_in_steps(cache, ks, lengths, (1, 1, 3, 1, 25, 1, 1, 50))
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
  kd, vd = cache.dequantize()
  for layer, (k, v) in enumerate(ks):
    one = KVCache.init(fmt, b, h, d, 128, jnp.float32).prefill(k, v, lengths)
    got = cache.layer(layer)
    for a, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(one)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    ok, ov = _oracle_kv(fmt, k, v, lengths)
    np.testing.assert_array_equal(np.asarray(kd[layer], np.float64), ok)
    np.testing.assert_array_equal(np.asarray(vd[layer], np.float64), ov)


@pytest.mark.parametrize("d,group,sq", [(64, 1, 1), (128, 4, 3), (64, 4, 2)])
def test_layer_view_attention_reads_the_sinks(d, group, sq):
  """`decode_attention` over a `ModelCache.layer_view` (GQA 1 / 4, q_len 1-3) == float64
  attention over the oracle K/V (the kernels: tests/test_sink_kernels.py)."""
  rng = np.random.default_rng(4)
  b, h, t = 3, 2, 70
  fmt = _fmt("kivi2", 4)
  lengths = np.asarray([70, 3 + sq, 45])
  layers = [_kv(rng, b, t, h, d) for _ in range(2)]
  cache = ModelCache.from_layers([KVCache.init(fmt, b, h, d, 128, jnp.float32).prefill(
      k, v, lengths) for k, v in layers])
  q = jnp.asarray(rng.standard_normal((b, sq, h * group, d)), jnp.float32)
  for index, (k, v) in enumerate(layers):
    got = jaxkv.decode_attention(q, cache.layer_view(index))
    want = _attend64(q, *_oracle_kv(fmt, k, v, lengths), lengths)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)


def test_default_dispatch_takes_the_kernels():
  """On a GPU ``implementation=None`` takes the first Pallas family that serves the
  input: sink formats too (kernel + exact prefix), the family their sink-free twin gets."""
  from jaxkv import attention  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(5)
  cache = KVCache.init(_fmt("kivi2", 4), 2, 2, 64, 128, jnp.float32).prefill(
      *_kv(rng, 2, 50, 2, 64), [50, 9])
  q = jnp.asarray(rng.standard_normal((2, 1, 8, 64)), jnp.float32)
  impl, why = attention._best_pallas(q, cache)  # pylint: disable=protected-access
  plain = KVCache.init(_fmt("kivi2", 0), 2, 2, 64, 128, jnp.float32)
  # the family the same cache without sinks gets (Triton here: Mosaic needs 16-bit caches)
  assert impl == attention._best_pallas(q, plain)[0] == "triton", why  # pylint: disable=protected-access
  assert "sink_tokens" not in why
  assert attention.resolve_implementation(q, cache, ("triton", "reference")) == "triton"


# ------------------------------------------------------------------- model
def _small(**kw):
  return dataclasses.replace(SMALL, **kw)


@pytest.mark.parametrize("chunk,impl", [(None, None), pytest.param(7, "reference", marks=pytest.mark.slow),
                                        (5, "xla")])
def test_model_with_sinks_covering_the_packed_region_is_the_full_forward(chunk, impl):
  """S = G = R = 16: while L < 2G the packed region is exactly the sink rows, so the
  cached model (prefill, chunked prefill attending its history, decode steps of 1 and
  2 tokens) must give the full-precision forward's logits; kivi2 without sinks must not."""
  from models import llama  # pylint: disable=import-outside-toplevel
  cfg = _small()
  model = llama.random_model(cfg, seed=11, dtype=jnp.float32)
  rng = np.random.default_rng(6)
  lengths = np.asarray([28, 11, 23])  # chunks of 5 / 7 attend a history with 16 packed rows
  b, t = 3, 28
  tokens = rng.integers(3, cfg.vocab_size, (b, t + 3))
  rows = np.arange(b)
  full = np.asarray(model(jnp.asarray(tokens, jnp.int32)), np.float64)
  fmt = dataclasses.replace(PRESETS["kivi2"], token_group=16, residual=16, sink_tokens=16)

  # Jitted (one program per step instead of eager per-op dispatch: half the CPU time).
  prefill = jax.jit(lambda x, n, c: model.prefill(x, n, c, chunk_size=chunk,
                                                  attention_impl=impl))
  decode = jax.jit(model.decode)

  def run(fmt):
    cache = model.init_cache(fmt, b, 64, dtype=jnp.float32)
    last, cache = prefill(jnp.asarray(tokens[:, :t], jnp.int32), jnp.asarray(lengths), cache)
    one, cache = decode(jnp.asarray(tokens[rows, lengths][:, None], jnp.int32), cache)
    two = np.stack([tokens[rows, lengths + 1 + i] for i in range(2)], axis=1)
    logits, cache = decode(jnp.asarray(two, jnp.int32), cache)
    assert cache.fmt == fmt and np.all(np.asarray(cache.lengths) == lengths + 3)
    return [np.asarray(last), np.asarray(one[:, 0]), *(np.asarray(logits[:, i]) for i in range(2))]

  want = [full[rows, lengths - 1 + i] for i in range(4)]
  for got, w in zip(run(fmt), want):
    assert _rel(got, w) < 2e-5
  plain = run(dataclasses.replace(fmt, sink_tokens=0))
  assert max(_rel(g, w) for g, w in zip(plain, want)) > 1e-2  # the test can tell


def _rel(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.abs(got - want).max() / np.abs(want).max())


def test_model_decode_with_sinks_matches_exact_sink_emulation(monkeypatch):
  """kivi2 (G = 32) with S = 4 sinks vs the same model on kivi2 without sinks whose
  decode attention is replaced by float64 numpy attention over the dequantized
  layer with rows [0, 4) overwritten by the prompt's full-precision K/V (the
  emulation of bench/sink_fidelity_probe.py): same logits. Without the emulation the
  plain kivi2 logits differ."""
  from models import llama  # pylint: disable=import-outside-toplevel
  cfg = _small(head_dim=64)
  model = llama.random_model(cfg, seed=12, dtype=jnp.float32)
  rng = np.random.default_rng(8)
  b, t, s = 3, 60, 4
  lengths = np.asarray([60, 37, 45])
  tokens = rng.integers(3, cfg.vocab_size, (b, t + 4))
  rows = np.arange(b)
  _, k_all, v_all = model.forward_kv(jnp.asarray(tokens[:, :t], jnp.int32))
  exact_k = np.asarray(k_all[:, :, :s], np.float64)                    # [L, B, S, H, D]
  exact_v = np.asarray(v_all[:, :, :s], np.float64)
  fmt = _fmt("kivi2", s)
  steps = [tokens[rows, lengths][:, None],
           np.stack([tokens[rows, lengths + 1 + i] for i in range(2)], axis=1),
           tokens[rows, lengths + 3][:, None]]

  def run(fmt):
    cache = model.init_cache(fmt, b, 128, dtype=jnp.float32)
    _, cache = model.prefill(jnp.asarray(tokens[:, :t], jnp.int32), lengths, cache)
    out = []
    for step in steps:
      logits, cache = model.decode(jnp.asarray(step, jnp.int32), cache)
      out.append(np.asarray(logits))
    return out

  got = run(fmt)
  plain = run(dataclasses.replace(fmt, sink_tokens=0))
  real = jaxkv.decode_attention

  def emulated(q, view, implementation=None):
    del implementation
    layer = view.materialize()
    kd, vd = (np.array(x, np.float64) for x in layer.dequantize())
    index = int(view.index)
    kd[:, :s], vd[:, :s] = exact_k[index], exact_v[index]
    return jnp.asarray(_attend64(q, kd, vd, np.asarray(layer.lengths)), q.dtype)

  monkeypatch.setattr(jaxkv, "decode_attention", emulated)
  want = run(dataclasses.replace(fmt, sink_tokens=0))
  monkeypatch.setattr(jaxkv, "decode_attention", real)
  for g, w, p in zip(got, want, plain):
    assert _rel(g, w) < 1e-4
    assert _rel(p, w) > 1e-2  # the sinks change the answer: the comparison can tell


# ---------------------------------------------------------------------- VQ
def _vq_fmt(sinks=4, **kw):
  from jaxkv import vq  # pylint: disable=import-outside-toplevel
  return dataclasses.replace(vq.VQ_PRESETS["cq2"], token_group=32, residual=32,
                             k_index_bits=5, v_index_bits=5, sink_tokens=sinks, **kw)


def _vq_books(fmt, layers, h, d, seed):
  """Random (finite, non-zero) ``[L, Hkv, S, n, E, v]`` codebooks of every layer."""
  from jaxkv import vq  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  sides = [jnp.asarray(rng.standard_normal((layers, *fmt.codebook_shape(side, h, d))) * 0.8,
                       fmt.codebook_dtype) for side in ("k", "v")]
  return vq.VQCodebooks(k=sides[0], v=sides[1], fmt=dataclasses.replace(fmt, sink_tokens=0))


def _vq_oracle_kv(fmt, books, layer, k, v, lengths):
  """float64 ``(k, v)``: one-shot VQ without sinks, rows ``[0, min(S, L_b))`` exact."""
  plain = dataclasses.replace(fmt, sink_tokens=0)
  b, _, h, d = k.shape
  cache = jaxkv.VQCache.init(plain, books, b, h, d, 128, k.dtype, layer=layer)
  kd, vd = (np.array(x, np.float64) for x in cache.prefill(k, v, lengths).dequantize())
  for i, n in enumerate(lengths):
    m = min(fmt.sink_tokens, int(n))
    kd[i, :m], vd[i, :m] = np.asarray(k[i, :m]), np.asarray(v[i, :m])
  return kd, vd


def test_vq_caches_store_and_read_the_sinks():
  """`VQCache` and `VQModelCache` (codebooks learned for the format without sinks):
  ragged token / chunk appends crossing S bitwise equal one prefill per layer, and
  `dequantize` equal to the oracle; attention over a layer view (GQA 4, q_len 2) equals
  float64 attention over it; the dispatch serves the format with a VQ kernel."""
  from jaxkv import attention, vq_attention  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(21)
  layers, b, h, d, t = 2, 3, 2, 64, 70
  fmt = _vq_fmt(4)
  books = _vq_books(fmt, layers, h, d, 22)
  data = [_kv(rng, b, t, h, d) for _ in range(layers)]
  lengths = np.asarray([70, 3, 38])
  cache = jaxkv.VQModelCache.init(fmt, layers, b, h, d, 128, jnp.float32, codebooks=books)
  assert cache.k_sink.shape == (layers, b, 4, h, d)
  cache = _append_in_steps(cache, data, lengths, (1, 2, 1, 30, 1, 40))
  kd, vd = cache.dequantize()
  q = jnp.asarray(rng.standard_normal((b, 2, 4 * h, d)), jnp.float32)
  for layer, (k, v) in enumerate(data):
    one = jaxkv.VQCache.init(fmt, books, b, h, d, 128, jnp.float32, layer=layer).prefill(
        k, v, lengths)
    for a, w in zip(jax.tree_util.tree_leaves(cache.layer(layer)),
                    jax.tree_util.tree_leaves(one)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
    ok, ov = _vq_oracle_kv(fmt, books, layer, k, v, lengths)
    np.testing.assert_array_equal(np.asarray(kd[layer], np.float64), ok)
    np.testing.assert_array_equal(np.asarray(vd[layer], np.float64), ov)
    got = jaxkv.decode_attention(q, cache.layer_view(layer))
    np.testing.assert_allclose(np.asarray(got, np.float64), _attend64(q, ok, ov, lengths),
                               rtol=2e-5, atol=2e-5)
    # what implementation=None tries on a GPU: a kernel (with the exact prefix beside it)
    # (the family the format without sinks gets: Triton for these float32 caches)
    plain = jaxkv.VQCache.init(dataclasses.replace(fmt, sink_tokens=0), books, b, h, d, 128,
                               jnp.float32, layer=layer)
    assert (vq_attention.resolve(q, one, ("mosaic", "triton", "reference"))
            == vq_attention.resolve(q, plain, ("mosaic", "triton", "reference")) == "triton")


@pytest.mark.parametrize("vq_cache", [False, True])
def test_chunk_attention_paths_read_the_sinks(vq_cache):
  """A prefill chunk over a history with sinks: the blocked ("xla") path, which reads
  the packed rows itself, equals the dense reference over `dequantize()` (sinks
  included) and differs from the same history without sinks."""
  rng = np.random.default_rng(23)
  b, h, d, t, c = 2, 2, 64, 80, 5
  k, v = _kv(rng, b, t, h, d)
  lengths = np.asarray([80, 45])

  def history(sinks):
    if vq_cache:
      fmt = _vq_fmt(sinks)
      books = _vq_books(fmt, 1, h, d, 24)
      return jaxkv.VQCache.init(fmt, books, b, h, d, 128, jnp.float32, layer=0).prefill(
          k, v, lengths)
    return KVCache.init(_fmt("kivi2", sinks), b, h, d, 128, jnp.float32).prefill(k, v, lengths)

  q = jnp.asarray(rng.standard_normal((b, c, 2 * h, d)) * 2.0, jnp.float32)
  kc, vc = _kv(rng, b, c, h, d)
  with_s, without = history(4), history(0)
  ref = jaxkv.chunk_attention(q, with_s, kc, vc, implementation="reference")
  xla = jaxkv.chunk_attention(q, with_s, kc, vc, implementation="xla", block_k=32)
  np.testing.assert_allclose(np.asarray(xla), np.asarray(ref), rtol=1e-5, atol=1e-5)
  plain = jaxkv.chunk_attention(q, without, kc, vc, implementation="xla", block_k=32)
  assert np.abs(np.asarray(plain) - np.asarray(ref)).max() > 1e-3


def test_vq_format_sinks_checked_and_counted():
  from jaxkv import vq  # pylint: disable=import-outside-toplevel
  for bad in (-1, 129, 1.5, True, "4"):
    with pytest.raises(ValueError, match=f"sink_tokens={re.escape(repr(bad))} must be an int in"):
      dataclasses.replace(vq.VQ_PRESETS["cq2"], sink_tokens=bad)
  cq2, s4 = vq.VQ_PRESETS["cq2"], vq.VQ_PRESETS["cq2-s4"]
  assert s4 == dataclasses.replace(cq2, sink_tokens=4) and cq2.sink_tokens == 0
  assert s4.same_codebooks(cq2) and not s4.same_codebooks(vq.VQ_PRESETS["cq4"])
  h, d = 3, 64
  extra = 2 * 4 * d * 2 * h  # K and V, 4 bf16 rows, per sequence
  assert s4.bytes_per_token(h, d, context=4096) == pytest.approx(
      cq2.bytes_per_token(h, d, context=4096) + extra / 4096)
  assert s4.bytes_per_token(h, d, context=8 * 4096, sequence_length=4096) == pytest.approx(
      cq2.bytes_per_token(h, d, context=8 * 4096) + extra / 4096)
  with pytest.raises(ValueError, match="sequence_length=0 must be"):
    s4.bytes_per_token(h, d, sequence_length=0)
  with pytest.raises(ValueError, match="codebooks were learned for"):
    jaxkv.VQCache.init(s4, _vq_books(vq.VQ_PRESETS["cq4"], 1, 1, 64, 0), 1, 1, 64, 64, layer=0)


def test_calibration_leaves_out_the_sink_rows():
  """`calibration_kv(..., sink_tokens=S)`: each row's real tokens from position S on, in
  order (the forward as without it)."""
  from jaxkv import vq  # pylint: disable=import-outside-toplevel
  from models import llama  # pylint: disable=import-outside-toplevel
  model = llama.random_model(_small(), seed=2, dtype=jnp.float32)
  tokens = np.random.default_rng(25).integers(3, 96, (3, 12))
  lengths = np.asarray([12, 3, 9])
  k_all, v_all = vq.calibration_kv(model, tokens, lengths)
  k_s, v_s = vq.calibration_kv(model, tokens, lengths, sink_tokens=4)
  keep = [np.arange(12) < n for n in lengths]
  rows = np.concatenate([np.flatnonzero(m) for m in keep])             # position per sample
  assert k_all.shape[1] == lengths.sum() and k_s.shape[1] == (12 - 4) + 0 + (9 - 4)
  np.testing.assert_array_equal(np.asarray(k_s), np.asarray(k_all)[:, rows >= 4])
  np.testing.assert_array_equal(np.asarray(v_s), np.asarray(v_all)[:, rows >= 4])
  for bad in (-1, 2.0):
    with pytest.raises(ValueError, match="sink_tokens=.* must be an int >= 0"):
      vq.calibration_kv(model, tokens, lengths, sink_tokens=bad)


def test_vq_model_with_sinks_covering_the_packed_region_is_the_full_forward():
  """A VQ format with S = G = R = 16 on the model (codebooks fitted on its own K/V without
  the sink rows): while L < 2G the cached model's logits are the full forward's."""
  from jaxkv import vq  # pylint: disable=import-outside-toplevel
  from models import llama  # pylint: disable=import-outside-toplevel
  model = llama.random_model(_small(), seed=13, dtype=jnp.float32)
  rng = np.random.default_rng(26)
  fmt = vq.VQFormat(k_vector=4, v_vector=4, k_index_bits=4, v_index_bits=4, token_group=16,
                    residual=16, sink_tokens=16)
  calib = rng.integers(3, 96, (2, 40))
  books = vq.fit(*vq.calibration_kv(model, calib, sink_tokens=16), fmt, iters=4)
  b, t = 2, 24
  lengths = np.asarray([24, 13])
  tokens = rng.integers(3, 96, (b, t + 2))
  rows = np.arange(b)
  full = np.asarray(model(jnp.asarray(tokens, jnp.int32)), np.float64)

  prefill = jax.jit(lambda x, n, c: model.prefill(x, n, c, chunk_size=9))  # (not eager: faster)
  decode = jax.jit(model.decode)

  def run(fmt):
    cache = model.init_cache(fmt, b, 64, dtype=jnp.float32, codebooks=books)
    _, cache = prefill(jnp.asarray(tokens[:, :t], jnp.int32), jnp.asarray(lengths), cache)
    two = np.stack([tokens[rows, lengths + i] for i in range(2)], axis=1)
    logits, _ = decode(jnp.asarray(two, jnp.int32), cache)
    return np.asarray(logits)

  got = run(fmt)
  plain = run(dataclasses.replace(fmt, sink_tokens=0))
  for i in range(2):
    want = full[rows, lengths + i]
    assert _rel(got[:, i], want) < 2e-5
    assert _rel(plain[:, i], want) > 1e-2


def test_direct_kernel_calls_refuse_sink_formats_and_staged_attention_reads_them():
  """Below the dispatch the Triton entry point (`pallas_kernels.supports`, which
  `pallas_decode_attention` checks) refuses a sink format without ``skip_tokens``
  instead of reading the sinks' quantized rows; a staged (speculative) attention
  forced onto the kernel (its skip + the exact prefix + the staged rows) equals
  float64 attention over the oracle."""
  import pallas_kernels  # pylint: disable=import-outside-toplevel
  from jaxkv.staged_cache import StagedCache  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(27)
  cache = KVCache.init(_fmt("kivi2", 4), 2, 2, 64, 256, jnp.float32).prefill(
      *_kv(rng, 2, 200, 2, 64), [200, 9])
  q = jnp.asarray(rng.standard_normal((2, 2, 4, 64)), jnp.float32)
  ok, why = pallas_kernels.supports(cache.fmt, head_dim=64)
  assert not ok and "sink_tokens=4" in why
  with pytest.raises(ValueError, match="sink_tokens=4"):
    pallas_kernels.pallas_decode_attention(q, cache, interpret=True)
  staged = StagedCache.wrap(cache, 4).append(*_kv(rng, 2, 3, 2, 64))
  k, v = staged.dequantize()
  want = _attend64(q, np.asarray(k, np.float64), np.asarray(v, np.float64),
                   np.asarray(staged.lengths))
  for impl in ("triton", None):
    np.testing.assert_allclose(np.asarray(staged.attention(q, implementation=impl), np.float64),
                               want, rtol=2e-5, atol=2e-5)


def test_generate_and_sharding_specs_carry_the_sinks():
  """`jaxkv.generate` (the jitted decode loop, cache in its carry) with a sink format gives
  the tokens of an eager prefill + greedy decode steps on the same format, and
  `cache_specs` / `shard_cache` place the sink leaves (batch and kv heads as the storage)."""
  from models import llama  # pylint: disable=import-outside-toplevel
  from jaxkv import sharding  # pylint: disable=import-outside-toplevel
  model = llama.random_model(_small(), seed=14, dtype=jnp.float32)
  fmt = dataclasses.replace(PRESETS["kivi2"], token_group=16, residual=16, sink_tokens=4)
  rng = np.random.default_rng(28)
  b, t, n = 2, 30, 5
  lengths = np.asarray([30, 19])
  prompts = rng.integers(3, 96, (b, t))
  out, _, cache = jaxkv.generate(model, prompts, lengths, kv_format=fmt, max_new_tokens=n,
                                 capacity=64, cache_dtype=jnp.float32, return_cache=True)
  assert cache.k_sink.shape == (2, b, 4, 2, 32)
  eager = model.init_cache(fmt, b, 64, dtype=jnp.float32)
  logits, eager = model.prefill(jnp.asarray(prompts, jnp.int32), lengths, eager)
  want = []
  for _ in range(n):
    nxt = np.asarray(jnp.argmax(logits.reshape(b, -1), axis=-1))
    want.append(nxt)
    logits, eager = model.decode(jnp.asarray(nxt[:, None], jnp.int32), eager)
  np.testing.assert_array_equal(np.asarray(out), np.stack(want, axis=1))
  # the same rows up to the float rounding of a jitted vs an eager forward
  np.testing.assert_allclose(np.asarray(cache.k_sink), np.asarray(eager.k_sink), rtol=1e-5,
                             atol=1e-5)
  assert np.abs(np.asarray(eager.k_sink)).min(axis=-1).max() > 0  # written, not zeros
  mesh = sharding.make_mesh(1, 1)
  specs = sharding.cache_specs(eager, mesh)
  is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
  assert jax.tree_util.tree_structure(specs, is_leaf=is_spec) == jax.tree_util.tree_structure(
      eager)
  res = specs.k_residual                                    # [L, B, Hkv, R, D]
  assert specs.k_sink == jax.sharding.PartitionSpec(res[0], res[1], None, res[2], None)
  placed = sharding.shard_cache(eager, mesh)
  np.testing.assert_array_equal(np.asarray(placed.v_sink), np.asarray(eager.v_sink))
