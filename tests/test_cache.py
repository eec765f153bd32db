"""KVCache: incremental prefill/append equals quantizing the whole history."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import PRESETS, KVCache, KVFormat, quant
from tests.oracle import np_quantize

ODD_FORMATS = {
    "odd-k4v2-g32-r64": KVFormat(k_bits=4, v_bits=2, k_axis="channel", token_group=32,
                                 residual=64, channel_group=32),
    "odd-tok8-g32-r64": KVFormat(k_bits=8, v_bits=4, k_axis="token", token_group=32,
                                 residual=64, channel_group=32),
    "odd-k16v2-g32-r32": KVFormat(k_bits=16, v_bits=2, token_group=32, residual=32,
                                  channel_group=32),
}
ALL_FORMATS = {**PRESETS, **ODD_FORMATS}


def check_against_history(cache: KVCache, k_hist, v_hist):
  """Compares ``cache`` with an independent numpy quantization of the history.

  ``k_hist[b]``/``v_hist[b]``: ``[L_b, H, D]`` float arrays of every token
  appended to sequence b, in order.
  """
  fmt = cache.fmt
  lengths = np.asarray(cache.lengths)
  sdt = np.dtype(jnp.dtype(fmt.scale_dtype))
  k_deq, v_deq = (np.asarray(a) for a in cache.dequantize())
  for b in range(cache.batch):
    length = len(k_hist[b])
    assert lengths[b] == length
    packed = fmt.packed_len(length)
    for side, hist, res, deq in ((cache.k, k_hist[b], cache.k_residual, k_deq),
                                 (cache.v, v_hist[b], cache.v_residual, v_deq)):
      # Exact residual: tokens [packed_len, L) are held as they came.
      np.testing.assert_array_equal(
          np.asarray(res[b, :, : length - packed], np.float32),
          np.swapaxes(hist[packed:], 0, 1).astype(np.float32))
      np.testing.assert_array_equal(deq[b, packed:length], hist[packed:].astype(np.float32))
      np.testing.assert_array_equal(deq[b, length:], 0)
      if packed == 0:
        continue
      for h in range(cache.kv_heads):
        x = hist[:packed, h].astype(np.float32)
        if side.bits == 16:
          np.testing.assert_array_equal(np.asarray(side.codes[b, h, :packed], np.float32), x)
          continue
        code, scale, zero = np_quantize(x, side.bits, side.axis, side.group, sdt)
        got = np.asarray(quant.unpack(side.codes[b, h, :packed], side.bits))
        np.testing.assert_array_equal(got, code)
        ns = scale.shape[0]
        np.testing.assert_array_equal(np.asarray(side.scale[b, h, :ns], np.float32),
                                      scale.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(side.zero[b, h, :ns], np.float32),
                                      zero.astype(np.float32))


@st.composite
def cache_programs(draw):
  name = draw(st.sampled_from(sorted(ALL_FORMATS)))
  batch = draw(st.integers(1, 3))
  ops = draw(st.lists(
      st.one_of(
          st.tuples(st.just("prefill"), st.sampled_from([1, 9, 40, 131]),
                    st.lists(st.floats(0, 1), min_size=batch, max_size=batch)),
          st.tuples(st.just("append"), st.sampled_from([1, 3]), st.none())),
      min_size=1, max_size=5))
  return name, batch, ops, draw(st.integers(0, 2 ** 31 - 1))


@settings(max_examples=30)
@given(cache_programs())
def test_incremental_equals_whole_history(program):
  name, batch, ops, seed = program
  fmt = ALL_FORMATS[name]
  heads, head_dim = 2, 64
  rng = np.random.default_rng(seed)
  cache = KVCache.init(fmt, batch, heads, head_dim, capacity=700, dtype=jnp.float32)
  k_hist = [np.zeros((0, heads, head_dim), np.float32) for _ in range(batch)]
  v_hist = [np.zeros((0, heads, head_dim), np.float32) for _ in range(batch)]
  for op, t, fracs in ops:
    k = rng.normal(size=(batch, t, heads, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, t, heads, head_dim)).astype(np.float32)
    if op == "prefill":
      lens = np.array([int(round(f * t)) for f in fracs], np.int32)
      cache = cache.prefill(jnp.asarray(k), jnp.asarray(v), lens)
    else:
      lens = np.full(batch, t, np.int32)
      cache = cache.append(jnp.asarray(k), jnp.asarray(v))
    for b in range(batch):
      k_hist[b] = np.concatenate([k_hist[b], k[b, : lens[b]]])
      v_hist[b] = np.concatenate([v_hist[b], v[b, : lens[b]]])
  check_against_history(cache, k_hist, v_hist)
  assert not np.asarray(cache.overflow).any()


def test_bf16_cache_matches_history():
  fmt = PRESETS["kivi4"]
  rng = np.random.default_rng(1)
  k = jnp.asarray(rng.normal(size=(2, 300, 1, 64)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(2, 300, 1, 64)), jnp.bfloat16)
  cache = KVCache.init(fmt, 2, 1, 64, 400, jnp.bfloat16).prefill(k[:, :200], v[:, :200], [200, 77])
  for i in range(5):
    cache = cache.append(k[:, 200 + i: 201 + i], v[:, 200 + i: 201 + i])
  hk = [np.concatenate([np.asarray(k[0, :205], np.float32)]),
        np.concatenate([np.asarray(k[1, :77], np.float32), np.asarray(k[1, 200:205], np.float32)])]
  hv = [np.concatenate([np.asarray(v[0, :205], np.float32)]),
        np.concatenate([np.asarray(v[1, :77], np.float32), np.asarray(v[1, 200:205], np.float32)])]
  check_against_history(cache, hk, hv)


@pytest.mark.parametrize("name", ["kivi4", "odd-k4v2-g32-r64"])
def test_jitted_append_in_scan_traces_once_and_matches(name):
  fmt = ALL_FORMATS[name]
  batch, heads, head_dim, steps = 2, 2, 64, 70
  rng = np.random.default_rng(7)
  k0 = rng.normal(size=(batch, 100, heads, head_dim)).astype(np.float32)
  v0 = rng.normal(size=(batch, 100, heads, head_dim)).astype(np.float32)
  ks = rng.normal(size=(steps, batch, 1, heads, head_dim)).astype(np.float32)
  vs = rng.normal(size=(steps, batch, 1, heads, head_dim)).astype(np.float32)
  prompt = np.array([100, 31], np.int32)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def run(cache, ks, vs):
    def body(c, kv):
      return c.append(*kv), None
    return jax.lax.scan(body, cache, (ks, vs))[0]

  cache = KVCache.init(fmt, batch, heads, head_dim, 256, jnp.float32)
  cache = cache.prefill(jnp.asarray(k0), jnp.asarray(v0), prompt)
  out = run(cache, jnp.asarray(ks), jnp.asarray(vs))
  out2 = run(cache, jnp.asarray(ks) + 1, jnp.asarray(vs))  # same shapes: no retrace
  assert out2.lengths.shape == (batch,)
  hk = [np.concatenate([k0[b, : prompt[b]], ks[:, b, 0]]) for b in range(batch)]
  hv = [np.concatenate([v0[b, : prompt[b]], vs[:, b, 0]]) for b in range(batch)]
  check_against_history(out, hk, hv)


def test_append_with_donated_cache():
  fmt = PRESETS["kivi2"]
  step = jax.jit(lambda c, k, v: c.append(k, v), donate_argnums=0)
  cache = KVCache.init(fmt, 1, 1, 64, 300, jnp.float32)
  rng = np.random.default_rng(3)
  hist = []
  for _ in range(130):
    k = rng.normal(size=(1, 1, 1, 64)).astype(np.float32)
    hist.append(k[0])
    cache = step(cache, jnp.asarray(k), jnp.asarray(k))
  h = np.concatenate(hist)
  check_against_history(cache, [h], [h])


def test_overflow_eager_raises_and_jit_flags():
  fmt = PRESETS["kivi4"]
  cache = KVCache.init(fmt, 2, 1, 64, 130, jnp.float32)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 129, 1, 64)), jnp.float32)
  cache = cache.prefill(x, x, [129, 10])
  with pytest.raises(ValueError, match=r"overflow.*\[0\].*capacity=130"):
    cache.append(x[:, :2], x[:, :2])
  flagged = jax.jit(lambda c, k, v: c.append(k, v))(cache, x[:, :2], x[:, :2])
  np.testing.assert_array_equal(np.asarray(flagged.overflow), [True, False])
  np.testing.assert_array_equal(np.asarray(flagged.lengths), [129, 12])  # seq 0 untouched
  k0, _ = flagged.dequantize()
  k_before, _ = cache.dequantize()
  np.testing.assert_array_equal(np.asarray(k0[0]), np.asarray(k_before[0]))
  with pytest.raises(ValueError, match="overflow"):
    flagged.check()


def test_nbytes_counts_storage():
  cache = KVCache.init("kivi4", 2, 4, 128, 1024, jnp.bfloat16)
  codes = 2 * 2 * 4 * 1024 * 64                     # K and V nibbles
  k_scales = 2 * (2 * 4 * (1024 // 128) * 128 * 2)  # per-channel scale + zero, fp16
  v_scales = 2 * (2 * 4 * 1024 * 1 * 2)             # per-token scale + zero
  residual = 2 * (2 * 4 * 128 * 128 * 2)
  flags = 2 * 1 + 2 * 1                             # overflow, nonfinite
  assert cache.nbytes == codes + k_scales + v_scales + residual + 2 * 4 + flags
  per_tok = KVFormat.preset("kivi4").bytes_per_token(4, 128)
  assert per_tok == 4 * (64 + 2 * 2 * 128 / 128 + 64 + 2 * 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(k_bits=3), "k_bits=3"),
    (dict(v_bits=1), "v_bits=1"),
    (dict(token_group=48), "token_group=48"),
    (dict(token_group=32, residual=48), "residual=48"),
    (dict(k_axis="row"), "k_axis='row'"),
    (dict(scale_dtype="int8"), "scale_dtype='int8'"),
])
def test_bad_formats(kwargs, match):
  with pytest.raises(ValueError, match=match):
    KVFormat(**kwargs)


def test_bad_cache_inputs():
  with pytest.raises(ValueError, match="unknown preset 'int3'"):
    KVFormat.preset("int3")
  with pytest.raises(ValueError, match="head_dim=48 must be divisible by channel_group=32"):
    KVCache.init("int4-token-g4", 1, 1, 48, 64)
  with pytest.raises(ValueError, match="capacity=0"):
    KVCache.init("kivi4", 1, 1, 64, 0)
  with pytest.raises(TypeError, match="dtype=int32"):
    KVCache.init("kivi4", 1, 1, 64, 64, jnp.int32)
  cache = KVCache.init("kivi4", 2, 2, 64, 64, jnp.float32)
  x = jnp.ones((2, 4, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="must be \\[B, T, Hkv, D\\]"):
    cache.append(x[0], x[0])
  with pytest.raises(ValueError, match="does not match cache"):
    cache.append(x[:, :, :1], x[:, :, :1])
  with pytest.raises(TypeError, match="k.dtype=bfloat16"):
    cache.append(x.astype(jnp.bfloat16), x)
  with pytest.raises(ValueError, match=r"lengths=\[5, 1\] must lie in \[0, T=4\]"):
    cache.prefill(x, x, [5, 1])
  with pytest.raises(ValueError, match="lengths.shape"):
    cache.prefill(x, x, [1, 2, 3])
  with pytest.raises(ValueError, match="overflow"):
    cache.prefill(jnp.ones((2, 65, 2, 64)), jnp.ones((2, 65, 2, 64)), [65, 1])


def test_cache_is_pytree_with_static_format():
  cache = KVCache.init("k8v4", 1, 1, 64, 64, jnp.float32)
  leaves, treedef = jax.tree_util.tree_flatten(cache)
  assert all(isinstance(x, jax.Array) for x in leaves)
  again = jax.tree_util.tree_unflatten(treedef, leaves)
  assert again.fmt == cache.fmt and again.capacity == 64
  assert dataclasses.replace(cache, lengths=cache.lengths + 1).lengths[0] == 1


# ------------------------------------------------------------ flush-heavy
FLUSH_FORMATS = {
    "g16-r16-k4v2": KVFormat(k_bits=4, v_bits=2, k_axis="channel", token_group=16,
                             residual=16, channel_group=32),
    "g16-r48-tok8": KVFormat(k_bits=8, v_bits=4, k_axis="token", token_group=16,
                             residual=48, channel_group=16),
    "g32-r64-k2v8": KVFormat(k_bits=2, v_bits=8, k_axis="channel", token_group=32, residual=64),
}


@st.composite
def flush_programs(draw):
  """Many appends and chunked prefills into non-empty residuals: most steps flush,
  many flush several groups at once."""
  name = draw(st.sampled_from(sorted(FLUSH_FORMATS)))
  batch = draw(st.integers(1, 2))
  ops = draw(st.lists(
      st.one_of(
          st.tuples(st.just("prefill"), st.sampled_from([17, 50]),
                    st.lists(st.floats(0, 1), min_size=batch, max_size=batch)),
          st.tuples(st.just("append"), st.sampled_from([1, 16, 33]), st.none())),
      min_size=4, max_size=10))
  return name, batch, ops, draw(st.integers(0, 2 ** 31 - 1))


@settings(max_examples=8)
@given(flush_programs())
def test_flush_heavy_incremental_equals_whole_history(program):
  name, batch, ops, seed = program
  fmt = FLUSH_FORMATS[name]
  heads, head_dim = 1, 64
  rng = np.random.default_rng(seed)
  cache = KVCache.init(fmt, batch, heads, head_dim, capacity=512, dtype=jnp.float32)
  k_hist = [np.zeros((0, heads, head_dim), np.float32) for _ in range(batch)]
  v_hist = [np.zeros((0, heads, head_dim), np.float32) for _ in range(batch)]
  flushes = 0
  for op, t, fracs in ops:
    k = (rng.normal(size=(batch, t, heads, head_dim)) * 2 + 0.5).astype(np.float32)
    v = rng.normal(size=(batch, t, heads, head_dim)).astype(np.float32)
    before = np.asarray(cache.packed_lens)
    if op == "prefill":
      lens = np.array([int(round(f * t)) for f in fracs], np.int32)
      cache = cache.prefill(jnp.asarray(k), jnp.asarray(v), lens)
    else:
      lens = np.full(batch, t, np.int32)
      cache = cache.append(jnp.asarray(k), jnp.asarray(v))
    flushes += int((np.asarray(cache.packed_lens) > before).sum())
    for b in range(batch):
      k_hist[b] = np.concatenate([k_hist[b], k[b, : lens[b]]])
      v_hist[b] = np.concatenate([v_hist[b], v[b, : lens[b]]])
  check_against_history(cache, k_hist, v_hist)
  assert flushes >= 1 or max(len(h) for h in k_hist) < fmt.residual + fmt.token_group


# (format, length, packed_len written out): the residual rule at its edges.
PACKED_LEN_CASES = [
    (KVFormat(k_bits=4, v_bits=4, token_group=32, residual=64), 0, 0),
    (KVFormat(k_bits=4, v_bits=4, token_group=32, residual=64), 63, 0),
    (KVFormat(k_bits=4, v_bits=4, token_group=32, residual=64), 64, 32),
    (KVFormat(k_bits=4, v_bits=4, token_group=32, residual=64), 95, 32),
    (KVFormat(k_bits=4, v_bits=4, token_group=32, residual=64), 96, 64),
    (KVFormat(k_bits=4, v_bits=4, token_group=32, residual=64), 127, 64),
    (KVFormat(k_bits=4, v_bits=4, token_group=32, residual=32), 31, 0),
    (KVFormat(k_bits=4, v_bits=4, token_group=32, residual=32), 32, 32),
    (KVFormat(k_bits=4, v_bits=4, token_group=32, residual=32), 33, 32),
    (KVFormat(k_bits=4, v_bits=4, token_group=32, residual=32), 64, 64),
    (PRESETS["kivi4"], 127, 0),
    (PRESETS["kivi4"], 128, 128),
    (PRESETS["kivi4"], 255, 128),
    (PRESETS["kivi4"], 256, 256),
]


@pytest.mark.parametrize("fmt,length,want", PACKED_LEN_CASES,
                         ids=[f"G{f.token_group}_R{f.residual}_L{n}" for f, n, _ in PACKED_LEN_CASES])
def test_packed_len_literal_edges(fmt, length, want):
  assert fmt.packed_len(length) == want
  assert int(fmt.packed_len(jnp.int32(length))) == want
  rng = np.random.default_rng(length)
  x = rng.normal(size=(1, max(length, 1), 1, 64)).astype(np.float32)
  cache = KVCache.init(fmt, 1, 1, 64, 256, jnp.float32).prefill(
      jnp.asarray(x), jnp.asarray(-x), [length])
  assert int(cache.packed_lens[0]) == want and int(cache.residual_lens[0]) == length - want
  # Residual rows hold tokens [want, L) exactly, zeros after.
  np.testing.assert_array_equal(np.asarray(cache.k_residual[0, 0, : length - want]),
                                x[0, want:length, 0])
  np.testing.assert_array_equal(np.asarray(cache.k_residual[0, 0, length - want:]), 0)
  # Tokens [0, want) are quantized: not equal to the input (4-bit codes), but close.
  kd, _ = cache.dequantize()
  if want:
    got = np.asarray(kd[0, :want, 0])
    assert not np.array_equal(got, x[0, :want, 0])
    np.testing.assert_allclose(got, x[0, :want, 0], atol=1.5)
  np.testing.assert_array_equal(np.asarray(kd[0, want:length, 0]), x[0, want:length, 0])


def test_overflow_under_jit_exact_capacity_and_after():
  fmt = KVFormat(k_bits=4, v_bits=4, token_group=32, residual=32)
  rng = np.random.default_rng(11)
  cap = 100
  x = rng.normal(size=(3, 100, 1, 64)).astype(np.float32)
  prefill = jax.jit(lambda c, k, v, n: c.prefill(k, v, n))
  append = jax.jit(lambda c, k, v: c.append(k, v))
  cache = KVCache.init(fmt, 3, 1, 64, cap, jnp.float32)
  # Exact capacity fits: no flag.
  cache = prefill(cache, jnp.asarray(x), jnp.asarray(x), jnp.array([99, 100, 60]))
  np.testing.assert_array_equal(np.asarray(cache.overflow), [False, False, False])
  np.testing.assert_array_equal(np.asarray(cache.lengths), [99, 100, 60])
  cache.check()
  # One more token: sequence 1 overflows inside the jitted step, 0 and 2 fit.
  y = rng.normal(size=(3, 1, 1, 64)).astype(np.float32)
  cache = append(cache, jnp.asarray(y), jnp.asarray(y))
  np.testing.assert_array_equal(np.asarray(cache.overflow), [False, True, False])
  np.testing.assert_array_equal(np.asarray(cache.lengths), [100, 100, 61])
  # A prefill that overflows sequence 2 (61 + 40 > 100) inside jit.
  z = rng.normal(size=(3, 40, 1, 64)).astype(np.float32)
  cache = prefill(cache, jnp.asarray(z), jnp.asarray(z), jnp.array([0, 0, 40]))
  np.testing.assert_array_equal(np.asarray(cache.overflow), [False, True, True])
  np.testing.assert_array_equal(np.asarray(cache.lengths), [100, 100, 61])
  # Flags are sticky; contents of every sequence equal its applied history.
  cache = prefill(cache, jnp.asarray(z), jnp.asarray(z), jnp.array([0, 0, 39]))
  np.testing.assert_array_equal(np.asarray(cache.overflow), [False, True, True])
  hist = [np.concatenate([x[0, :99], y[0]]), x[1, :100],
          np.concatenate([x[2, :60], y[2], z[2, :39]])]
  check_against_history(cache, hist, hist)
  with pytest.raises(ValueError, match=r"sequences \[1, 2\]"):
    cache.check()


def test_float16_cache_matches_history():
  fmt = KVFormat(k_bits=4, v_bits=8, k_axis="channel", token_group=32, residual=32)
  rng = np.random.default_rng(12)
  k = jnp.asarray(rng.normal(size=(2, 150, 2, 64)) * 1000, jnp.float16)
  v = jnp.asarray(rng.normal(size=(2, 150, 2, 64)) * 1e-3, jnp.float16)
  cache = KVCache.init(fmt, 2, 2, 64, 256, jnp.float16).prefill(k[:, :100], v[:, :100], [100, 41])
  for i in range(3):
    cache = cache.append(k[:, 100 + 10 * i: 110 + 10 * i], v[:, 100 + 10 * i: 110 + 10 * i])
  f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
  hk = [f32(k[0, :130]), np.concatenate([f32(k[1, :41]), f32(k[1, 100:130])])]
  hv = [f32(v[0, :130]), np.concatenate([f32(v[1, :41]), f32(v[1, 100:130])])]
  check_against_history(cache, hk, hv)
  assert not np.asarray(cache.nonfinite).any()
