"""VQ formats, k-means codebooks and `VQCache` (issue 15).

Oracles are numpy, float64, written from the `jaxkv.vq` docstring: Lloyd
iterations from a given seed set, argmin nearest-centroid (first minimum on
ties), residual VQ stage by stage. The cache's main oracle is the contract's:
token-by-token appends give bit for bit the cache of one prefill.
"""

from __future__ import annotations

import dataclasses
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import vq, vq_cache
from tests.oracle import np_attention_dequantized


def _key(*parts):
  return jax.random.PRNGKey(zlib.crc32(repr(parts).encode()))


def _codebooks(fmt, kv_heads, head_dim, *parts):
  """Random (finite, non-zero) per-layer codebooks in the format's dtype."""
  out = []
  for side in ("k", "v"):
    shape = fmt.codebook_shape(side, kv_heads, head_dim)
    out.append((jax.random.normal(_key(side, *parts), shape) * 0.7 + 0.1)
               .astype(fmt.codebook_dtype))
  return tuple(out)


# --------------------------------------------------------------- numpy oracles
def np_nearest(x, codebook):
  """float64 squared distances, argmin (first minimum): ``[N, v]``, ``[E, v]`` -> ``[N]``."""
  x, c = np.asarray(x, np.float64), np.asarray(codebook, np.float64)
  return np.argmin(((x[:, None, :] - c[None, :, :]) ** 2).sum(-1), axis=1)


def np_lloyd(points, centroids, iters):
  points, c = np.asarray(points, np.float64), np.array(centroids, np.float64)
  for _ in range(iters):
    assign = np_nearest(points, c)
    for e in range(c.shape[0]):
      members = points[assign == e]
      if len(members):
        c[e] = members.mean(axis=0)
  return c, np_nearest(points, c)


def np_vq_codes(x, codebook):
  """Residual VQ of ``x [T, D]`` with ``codebook [S, n, E, v]`` -> ``[T, S*n]``."""
  stages, n, _, vec = codebook.shape
  rest = np.asarray(x, np.float64).reshape(-1, n, vec)
  cb = np.asarray(codebook, np.float64)
  codes = np.zeros((rest.shape[0], stages * n), np.int64)
  for s in range(stages):
    for j in range(n):
      idx = np_nearest(rest[:, j], cb[s, j])
      codes[:, s * n + j] = idx
      rest[:, j] -= cb[s, j][idx]
  return codes


# ------------------------------------------------------------------- k-means
@pytest.mark.parametrize("vector,entries", [(2, 32), (8, 8)])
def test_lloyd_matches_numpy_from_the_same_seeds(vector, entries):
  stretch = jnp.array([1.0, 2.0] * 4)[:vector]  # unequal spreads per channel
  points = jax.random.normal(_key("pts", vector), (600, vector)) * stretch
  seed_fn = jax.jit(vq.kmeans_plus_plus, static_argnums=2)
  seeds = seed_fn(_key("init", vector), points, entries)
  # k-means++ seeds are distinct rows of the data, reproducible for a key.
  pts = np.asarray(points)
  rows = [np.nonzero((pts == s).all(axis=1))[0] for s in np.asarray(seeds)]
  assert all(len(r) == 1 for r in rows) and len({int(r[0]) for r in rows}) == entries
  np.testing.assert_array_equal(seeds, seed_fn(_key("init", vector), points, entries))
  assert not np.array_equal(seeds, seed_fn(_key("other"), points, entries))
  got = jax.jit(vq.lloyd, static_argnums=2)(points, seeds, 12)
  want, assign = np_lloyd(points, seeds, 12)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(vq.nearest_centroid(points, got)), assign)
  # Lloyd moved the seeds and lowered the distortion.
  def distortion(c):
    c = np.asarray(c, np.float64)
    return ((pts - c[np_nearest(pts, c)]) ** 2).sum()
  assert distortion(got) < 0.9 * distortion(seeds)


def test_nearest_centroid_exact_and_ties_to_lowest_index():
  # Small integers: float32 distances are exact, so ties are real ties.
  rng = np.random.default_rng(7)
  cb = rng.integers(-4, 5, size=(64, 4)).astype(np.float32)
  cb[10] = cb[3]                           # duplicate entry: always a tie
  x = rng.integers(-5, 6, size=(4000, 4)).astype(np.float32)
  got = np.asarray(vq.nearest_centroid(jnp.asarray(x), jnp.asarray(cb)))
  np.testing.assert_array_equal(got, np_nearest(x, cb))
  assert not (got == 10).any()
  # Gaussian data against float64.
  xg = rng.normal(size=(3000, 2)).astype(np.float32)
  cg = rng.normal(size=(256, 2)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(vq.nearest_centroid(xg, cg)), np_nearest(xg, cg))


def test_residual_quantize_matches_numpy():
  # Dyadic values (multiples of 1/8 up to 4): every float32 residual is exact.
  rng = np.random.default_rng(3)
  h, d, vec, entries = 2, 16, 4, 32
  cb = (rng.integers(-16, 17, size=(h, 2, d // vec, entries, vec)) / 8).astype(np.float32)
  x = (rng.integers(-32, 33, size=(2, h, 50, d)) / 8).astype(np.float32)
  got = np.asarray(vq.quantize(jnp.asarray(x), jnp.asarray(cb)))
  assert got.dtype == np.uint8 and got.shape == (2, h, 50, 2 * d // vec)
  for b in range(2):
    for hh in range(h):
      np.testing.assert_array_equal(got[b, hh], np_vq_codes(x[b, hh], cb[hh]))


def test_fit_is_deterministic_and_stage_two_helps():
  # K and V share one spec: one k-means program to compile.
  fmt = vq.VQFormat(k_vector=4, v_vector=4, k_index_bits=6, v_index_bits=6, k_stages=2,
                    v_stages=2, codebook_dtype="float32")
  x = jax.random.normal(_key("fit"), (2, 300, 2, 32))
  k_s, v_s = x * 1.5 + 0.3, x[:, ::-1] * 0.5
  books = vq.fit(k_s, v_s, fmt, seed=3, iters=6)
  assert books.k.shape == books.v.shape == (2, 2, 2, 8, 64, 4)
  assert not np.array_equal(books.k, books.v)
  again = vq.fit(k_s, v_s, fmt, seed=3, iters=6)
  np.testing.assert_array_equal(books.k, again.k)
  np.testing.assert_array_equal(books.v, again.v)
  assert not np.array_equal(books.k, vq.fit(k_s, v_s, fmt, seed=4, iters=6).k)
  assert not np.array_equal(books.k[0], books.k[1])  # one codebook per layer
  # The second stage lowers the error on the calibration keys of layer 1.
  k1 = jnp.swapaxes(k_s[1], 0, 1)[None]                     # [1, H, N, D]
  from pallas_kernels.vq_attention import vq_dequantize
  err = []
  for stages in (1, 2):
    cb = books.k[1][:, :stages]
    err.append(float(jnp.sum((vq_dequantize(vq.quantize(k1, cb), cb) - k1) ** 2)))
  assert err[1] < 0.7 * err[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_codebooks_save_load_bit_exact(tmp_path, dtype):
  fmt = dataclasses.replace(vq.VQ_PRESETS["cq2"], codebook_dtype=dtype, v_stages=2)
  k_cb, v_cb = _codebooks(fmt, 2, 32, "io", dtype)
  books = vq.VQCodebooks(k=jnp.stack([k_cb, k_cb * 2]), v=jnp.stack([v_cb, -v_cb]), fmt=fmt)
  path = tmp_path / "books.npz"
  books.save(path)
  back = vq.VQCodebooks.load(path)
  assert back.fmt == fmt
  for a, b in ((books.k, back.k), (books.v, back.v)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16 if a.dtype.itemsize == 2
                                                      else np.uint32),
                                  np.asarray(b).view(np.uint16 if b.dtype.itemsize == 2
                                                     else np.uint32))


def test_bytes_per_token():
  cq4, cq2 = vq.VQ_PRESETS["cq4"], vq.VQ_PRESETS["cq2"]
  assert cq4.bits_per_channel("k") == 4 and cq2.bits_per_channel("v") == 2
  h, d = 8, 128
  huge = 1 << 40
  # Codes only: 4 (2) bits per channel for K and V.
  assert cq4.bytes_per_token(h, d, context=huge) == pytest.approx(h * d * 4 / 8 * 2)
  assert cq2.bytes_per_token(h, d, context=huge) == pytest.approx(h * d * 2 / 8 * 2)
  # The codebooks are one layer's centroid arrays spread over the context.
  cb = _codebooks(cq4, h, d, "bytes")
  cb_bytes = sum(x.size * x.dtype.itemsize for x in cb)
  extra = cq4.bytes_per_token(h, d, context=1000) - cq4.bytes_per_token(h, d, context=huge)
  assert extra == pytest.approx(cb_bytes / 1000)


# ----------------------------------------------------------------- the cache
FMT_SMALL = {
    "cq4": dataclasses.replace(vq.VQ_PRESETS["cq4"], token_group=16, residual=32),
    "cq2-2stage-k8": vq.VQFormat(k_vector=4, v_vector=8, k_stages=2, v_index_bits=6,
                                 token_group=16, residual=16, codebook_dtype="float32"),
}


@pytest.mark.parametrize("name", sorted(FMT_SMALL))
def test_incremental_equals_one_shot(name, monkeypatch):
  fmt = FMT_SMALL[name]
  b, h, d, t, cap = 2, 2, 32, 75, 100
  books = _codebooks(fmt, h, d, name)
  k = (jax.random.normal(_key("k", name), (b, t, h, d)) * 1.3 - 0.2)
  v = jax.random.normal(_key("v", name), (b, t, h, d))
  empty = jaxkv.VQCache.init(fmt, books, b, h, d, cap, jnp.float32)
  one_shot = empty.prefill(k, v, np.array([t, t]))

  chex.clear_trace_counter()

  @chex.assert_max_traces(n=1)
  def run(cache, ks, vs):  # token by token inside a scan, the cache donated
    def step(c, kv):
      return c.append(kv[0][:, None], kv[1][:, None]), None
    return jax.lax.scan(step, cache, (jnp.swapaxes(ks, 0, 1), jnp.swapaxes(vs, 0, 1)))[0]

  run_jit = jax.jit(run, donate_argnums=0)
  inc = run_jit(empty, k[:, :20], v[:, :20])
  inc = run_jit(inc, k[:, 20:40], v[:, 20:40])  # traced once (assert_max_traces)
  inc = inc.prefill(k[:, 40:], v[:, 40:], np.array([35, 35]))  # a chunked prefill
  for a, c in zip(jax.tree_util.tree_leaves(one_shot), jax.tree_util.tree_leaves(inc)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
  # Packed rows hold the numpy oracle's codes; residual rows the exact tokens.
  packed = fmt.packed_len(t)
  assert packed > 0 and int(one_shot.residual_lens[0]) == t - packed
  for side, x, codes, cb in (("k", k, one_shot.k_codes, books[0]),
                             ("v", v, one_shot.v_codes, books[1])):
    for hh in range(h):
      np.testing.assert_array_equal(np.asarray(codes[1, hh, :packed]),
                                    np_vq_codes(np.asarray(x[1, :packed, hh]), np.asarray(cb[hh])),
                                    err_msg=side)
  kd, vd = one_shot.dequantize()
  np.testing.assert_array_equal(np.asarray(kd[:, packed:t]), np.asarray(k[:, packed:]))
  if name == "cq4":  # quantizing in small token chunks (a large batch) changes nothing
    monkeypatch.setattr(vq_cache, "_DISTANCE_BUDGET", 2 * h * 16 * 256 * 3)
    chunked = jaxkv.VQCache.init(fmt, books, b, h, d, cap + 1, jnp.float32).prefill(
        k, v, np.array([t, t]))
    np.testing.assert_array_equal(chunked.k_codes, one_shot.k_codes)
    np.testing.assert_array_equal(chunked.v_codes, one_shot.v_codes)
  assert not np.asarray(vd[:, t:]).any()


def test_ragged_prefill_then_attention_matches_numpy():
  fmt = FMT_SMALL["cq4"]
  b, h, d = 3, 2, 32
  books = _codebooks(fmt, h, d, "ragged")
  lengths = np.array([70, 3, 33])
  k = jax.random.normal(_key("rk"), (b, 70, h, d))
  v = jax.random.normal(_key("rv"), (b, 70, h, d))
  cache = jaxkv.VQCache.init(fmt, books, b, h, d, 96, jnp.float32).prefill(k, v, lengths)
  np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
  kd, vd = cache.dequantize()
  q = jax.random.normal(_key("rq"), (b, 2, 2 * h, d))
  got = jaxkv.decode_attention(q, cache, implementation="reference")
  want = np_attention_dequantized(q, kd, vd, lengths)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5, rtol=2e-5)


def test_overflow_and_nonfinite():
  fmt = FMT_SMALL["cq4"]
  books = _codebooks(fmt, 1, 32, "flags")
  cache = jaxkv.VQCache.init(fmt, books, 2, 1, 32, 20, jnp.float32)
  x = jax.random.normal(_key("flags"), (2, 20, 1, 32))
  with pytest.raises(ValueError, match="capacity=20"):
    cache.prefill(x, x, np.array([20, 20])).append(x[:, :1], x[:, :1])
  bad = x.at[1, 5, 0, 3].set(jnp.nan)
  with pytest.raises(ValueError, match=r"NaN/inf in sequences \[1\]"):
    cache.prefill(bad, x, np.array([20, 20]))
  traced = jax.jit(lambda c, k, v: c.prefill(k, v, jnp.array([20, 20])))(cache, bad, x)
  np.testing.assert_array_equal(np.asarray(traced.nonfinite), [False, True])
  with pytest.raises(ValueError, match="non-finite"):
    traced.check()
  q = jax.random.normal(_key("fq"), (2, 1, 2, 32))
  out = np.asarray(jaxkv.decode_attention(q, traced, implementation="reference"))
  assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()
  over = jax.jit(lambda c, k, v: c.append(k, v))(traced, x[:, :1], x[:, :1])
  np.testing.assert_array_equal(np.asarray(over.overflow), [True, True])
  np.testing.assert_array_equal(np.asarray(over.lengths), [20, 20])


def test_bad_inputs_name_the_value():
  with pytest.raises(ValueError, match="k_vector=3"):
    vq.VQFormat(k_vector=3)
  with pytest.raises(ValueError, match="v_index_bits=9"):
    vq.VQFormat(v_index_bits=9)
  with pytest.raises(ValueError, match="k_stages=3"):
    vq.VQFormat(k_stages=3)
  with pytest.raises(ValueError, match="codebook_dtype='int8'"):
    vq.VQFormat(codebook_dtype="int8")
  with pytest.raises(ValueError, match="unknown VQ preset 'cq3'"):
    jaxkv.VQCache.init("cq3", None, 1, 1, 32, 64)
  with pytest.raises(TypeError, match="VQFormat"):
    jaxkv.VQCache.init(jaxkv.KVFormat.preset("kivi4"), None, 1, 1, 32, 64)
  fmt = vq.VQ_PRESETS["cq2"]
  with pytest.raises(ValueError, match="head_dim=66 must be a multiple of k_vector=4"):
    fmt.validate_head_dim(66)
  k_cb, v_cb = _codebooks(fmt, 2, 32, "bad")
  with pytest.raises(ValueError, match=r"k_codebook.shape=\(2, 1, 8, 256, 4\) must be "
                     r"\(3, 1, 8, 256, 4\)"):
    jaxkv.VQCache.init(fmt, (k_cb, v_cb), 1, 3, 32, 64)
  with pytest.raises(ValueError, match="v_codebook.shape"):
    jaxkv.VQCache.init(fmt, (k_cb, v_cb[..., :128, :]), 1, 2, 32, 64)
  with pytest.raises(ValueError, match="k_codebook is all zeros: untrained"):
    jaxkv.VQCache.init(fmt, (jnp.zeros_like(k_cb), v_cb), 1, 2, 32, 64)
  with pytest.raises(ValueError, match="v_codebook holds non-finite"):
    jaxkv.VQCache.init(fmt, (k_cb, v_cb.at[0, 0, 0, 0, 0].set(jnp.inf)), 1, 2, 32, 64)
  with pytest.raises(ValueError, match="k_codebook is None"):
    jaxkv.VQCache.init(fmt, (None, v_cb), 1, 2, 32, 64)
  with pytest.raises(TypeError, match="k_codebook.dtype=int32"):
    jaxkv.VQCache.init(fmt, (k_cb.astype(jnp.int32), v_cb), 1, 2, 32, 64)
  books = vq.VQCodebooks(k=k_cb[None], v=v_cb[None], fmt=fmt)
  with pytest.raises(ValueError, match="layer=None"):
    jaxkv.VQCache.init(fmt, books, 1, 2, 32, 64)
  with pytest.raises(ValueError, match="learned for"):
    jaxkv.VQCache.init(vq.VQ_PRESETS["cq4"], books, 1, 2, 32, 64, layer=0)
  x = jnp.ones((1, 100, 2, 32))
  with pytest.raises(ValueError, match="N=100 calibration tokens per layer must be >= 256"):
    vq.fit(x, x, fmt)
  with pytest.raises(ValueError, match=r"k_samples must be \[L, N, Hkv, D\]"):
    vq.fit(x[0], x[0], fmt)
  with pytest.raises(ValueError, match="v_samples holds NaN/inf"):
    y = jnp.ones((1, 300, 2, 32))
    vq.fit(y, y.at[0, 7, 1, 3].set(jnp.nan), fmt)
  cache = jaxkv.VQCache.init(fmt, books, 1, 2, 32, 64, layer=0)
  q = jnp.ones((1, 1, 4, 32))
  # A forced Mosaic kernel names why it cannot run (no Hopper GPU, or D = 32).
  with pytest.raises(ValueError, match=r"mosaic: (the Mosaic GPU kernels need a Hopper|"
                                       r"head_dim=32 \(Mosaic VQ kernel: 64 or 128\))"):
    jaxkv.decode_attention(q, cache, implementation="mosaic")
  small_fmt = vq.VQFormat(token_group=16, residual=16)
  small = jaxkv.VQCache.init(small_fmt, _codebooks(small_fmt, 1, 16, "d16"), 1, 1, 16, 32)
  with pytest.raises(ValueError, match=r"head_dim=16 must be a power of two in \[32, 256\]"):
    jaxkv.decode_attention(jnp.ones((1, 1, 1, 16)), small, implementation="triton")
  with pytest.raises(TypeError, match="VQAttentionConfig"):
    jaxkv.decode_attention(q, cache, config=object())


def test_fit_rejects_overflowing_centroids_and_bad_batch_size():
  fmt = vq.VQ_PRESETS["cq4"]
  s = jax.random.normal(jax.random.PRNGKey(0), (1, 300, 1, 32))
  with pytest.raises(ValueError, match="k_samples: centroids overflow codebook_dtype=float16"):
    vq.fit(s * 1e6, s, fmt, iters=1)
  for bad in (0, -1, 2.5):
    with pytest.raises(ValueError, match=f"batch_size={bad!r} must be an int >= 1"):
      vq.fit(s, s, fmt, iters=1, batch_size=bad)


def test_quantize_checks_shapes():
  fmt = vq.VQ_PRESETS["cq2"]
  k_cb, _ = _codebooks(fmt, 2, 32, "shapes")
  x = jnp.ones((1, 2, 5, 32))
  assert vq.quantize(x, k_cb).shape == (1, 2, 5, 8)
  with pytest.raises(ValueError, match=r"x.shape=\(1, 3, 5, 32\) must be \[B, 2, T, 32\]"):
    vq.quantize(jnp.ones((1, 3, 5, 32)), k_cb)
  with pytest.raises(ValueError, match=r"x.shape=\(2, 5, 32\)"):
    vq.quantize(jnp.ones((2, 5, 32)), k_cb)
