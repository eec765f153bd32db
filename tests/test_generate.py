"""`jaxkv.generate` / `decode_step` (`jaxkv.decoding`) on a small random Llama (CPU, float32)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv.formats import PRESETS, KVFormat
from jaxkv import decoding as gen_mod
from jaxkv.decoding import decode_step, generate, sample_logits
from models import llama
from tests.model_fixtures import rel_err

CFG = llama.LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=32, rope_theta=500000.0,
    rope_scaling=llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 64), eos_token_ids=(2,))


@pytest.fixture(scope="module")
def model():
  return llama.random_model(CFG, seed=21, dtype=jnp.float32)


def _prompts(seed, batch, length, lengths):
  rng = np.random.default_rng(seed)
  return rng.integers(0, CFG.vocab_size, (batch, length)), np.asarray(lengths)


# ------------------------------------------------------- quantized presets
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_end_to_end(model, preset):
  """Prompts longer than R so tokens are quantized; sequence 0 crosses a flush (L=256)."""
  tokens, lengths = _prompts(1, 2, 250, [250, 200])
  n = 12
  out, out_len, caches = generate(model, tokens, lengths, kv_format=preset, max_new_tokens=n,
                                  cache_dtype=jnp.float32, return_cache=True)
  out = np.asarray(out)
  assert out.shape == (2, n) and out.dtype == np.int32
  assert out.min() >= 0 and out.max() < CFG.vocab_size
  np.testing.assert_array_equal(np.asarray(out_len), [n, n])
  for cache in caches.layers():
    assert cache.fmt == PRESETS[preset]
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + n - 1)
    assert not np.asarray(cache.overflow).any()
    np.testing.assert_array_equal(np.asarray(cache.packed_lens),
                                  [cache.fmt.packed_len(int(L)) for L in lengths + n - 1])
  # The first token comes from the (exact) prefill logits, whatever the format.
  ref, _ = generate(model, tokens, lengths, kv_format="bf16", max_new_tokens=1,
                    cache_dtype=jnp.float32)
  np.testing.assert_array_equal(out[:, 0], np.asarray(ref)[:, 0])


def _kivi4_error_bound(k, v, lengths, fmt: KVFormat):
  """Per-element bounds |x - x_hat| for kivi4 from DESIGN.md's contract.

  Packed tokens t < packed_len(L): K per channel over groups of G tokens, V per
  token over the whole head, 4 bits: ``|x - x_hat| <= scale/2`` with
  ``scale = (max - min) / 15``, plus the fp16 rounding of the stored scale and
  zero (relative 2^-11 each; an edge value can be off the rounded grid by
  ``|zero - zero_s| + 15 |scale - scale_s|``), counted twice over here.
  Residual tokens are exact (bound 0).
  """
  b, t, h, d = k.shape
  g = fmt.token_group
  ek, ev = np.zeros_like(k), np.zeros_like(v)
  slack = 2.0 ** -10
  for i in range(b):
    packed = fmt.packed_len(int(lengths[i]))
    kg = k[i, :packed].reshape(packed // g, g, h, d)
    lo, hi = kg.min(axis=1, keepdims=True), kg.max(axis=1, keepdims=True)
    scale = (hi - lo) / 15
    e = 0.5 * scale * (1 + slack) + slack * (np.abs(lo) + 15 * scale)
    ek[i, :packed] = np.broadcast_to(e, kg.shape).reshape(packed, h, d)
    vp = v[i, :packed]
    lo, hi = vp.min(axis=-1, keepdims=True), vp.max(axis=-1, keepdims=True)
    scale = (hi - lo) / 15
    ev[i, :packed] = 0.5 * scale * (1 + slack) + slack * (np.abs(lo) + 15 * scale)
  return ek, ev


def test_kivi4_first_step_logits_within_derived_bound(model):
  """First decode step with kivi4 vs the unquantized cache.

  1. Oracle (tight): kivi4 logits equal the logits of the same step run on an
     unquantized cache that holds the *dequantized* kivi4 K/V (DESIGN.md: the
     attention must match exact attention over ``cache.dequantize()``).
  2. Bound (derived): the step's logits are a smooth function F(K, V) of every
     layer's cached K/V. With per-element quantization errors |dK| <= eK,
     |dV| <= eV (contract: scale/2 plus scale/zero fp16 rounding, see
     `_kivi4_error_bound`), to first order
     ``|F(K^, V^) - F(K, V)|_i <= sum_j |dF_i/dK_j| eK_j + |dF_i/dV_j| eV_j``,
     with the Jacobian taken at the exact K/V. This is a worst case (all errors
     aligned with the gradient sign); the second-order remainder is O(e^2)
     and is dwarfed by the slack of that worst case (the test asserts the
     measured error is below the bound, no extra margin). Measured: max
     err/bound ~0.02 -- the worst case is loose.
  Attention runs the float32 reference implementation everywhere here, so the
  oracle holds to float32 rounding on GPU too (the Pallas kernels' own
  precision is tested in the kernel tests).
  3. Typical size (statistical): modelling each rounding error as independent
     and uniform on [-e, e] (variance e^2/3), the first-order error of logit i
     has std ``sigma_i = sqrt(sum_j J_ij^2 e_j^2 / 3)``; we require every
     |error| <= 6 sigma_i. Errors within a group share a scale, so they are not
     fully independent; measured max err/sigma is ~3.3 on this case.
  """
  fmt = PRESETS["kivi4"]
  tokens, lengths = _prompts(2, 2, 200, [200, 170])  # packed_len = 128 before and after
  b = tokens.shape[0]
  cap = 208
  tok = jnp.asarray(np.random.default_rng(3).integers(0, CFG.vocab_size, (b,)), jnp.int32)
  tokens = jnp.asarray(tokens, jnp.int32)

  def first_step(kv_format):
    caches = model.init_cache(kv_format, b, cap, dtype=jnp.float32)
    _, caches = model.prefill(tokens, lengths, caches)
    logits, _ = decode_step(model, tok, caches, implementation="reference")
    return logits, caches

  logits_x, caches_x = first_step("bf16")
  logits_q, caches_q = first_step(fmt)
  t = tokens.shape[1]
  kx, vx = zip(*[[a[:, :t] for a in c.dequantize()] for c in caches_x.layers()])
  kq, vq = zip(*[[a[:, :t] for a in c.dequantize()] for c in caches_q.layers()])

  def logits_from_kv(ks, vs):  # F: per-layer K/V -> first-step logits
    caches = jaxkv.ModelCache.from_layers(
        [jaxkv.KVCache.init("bf16", b, CFG.num_kv_heads, CFG.head_dim, cap,
                            jnp.float32).prefill(k, v, jnp.asarray(lengths))
         for k, v in zip(ks, vs)])
    return decode_step(model, tok, caches, implementation="reference")[0]

  assert rel_err(logits_from_kv(kx, vx), logits_x) < 1e-6  # F reproduces the exact step
  assert rel_err(logits_q, logits_from_kv(kq, vq)) < 1e-5  # oracle (1)
  for c in caches_q.layers():
    np.testing.assert_array_equal(np.asarray(c.packed_lens), [128, 128])

  jac_k, jac_v = jax.jacrev(logits_from_kv, argnums=(0, 1))(kx, vx)
  bound = np.zeros(logits_x.shape)
  variance = np.zeros(logits_x.shape)
  for layer in range(CFG.num_layers):
    ek, ev = _kivi4_error_bound(np.asarray(kx[layer]), np.asarray(vx[layer]), lengths, fmt)
    # jac [B, V, B, T, H, D]; sequences are independent, keep the diagonal b == b'.
    for jac, e in ((jac_k[layer], ek), (jac_v[layer], ev)):
      jac = np.asarray(jac)
      bound += np.stack([np.einsum("vthd,thd->v", np.abs(jac[i, :, i]), e[i]) for i in range(b)])
      variance += np.stack([np.einsum("vthd,thd->v", jac[i, :, i] ** 2, e[i] ** 2 / 3)
                            for i in range(b)])
  err = np.abs(np.asarray(logits_q) - np.asarray(logits_x))
  assert err.max() > 0  # tokens were really quantized
  print(f"kivi4 first step: max err {err.max():.3e}, max bound {bound.max():.3e}, "
        f"max err/bound {np.max(err / bound):.3f}, max err/sigma {np.max(err / np.sqrt(variance)):.2f}, "
        f"logit range {np.ptp(np.asarray(logits_x)):.2f}")
  assert np.all(err <= 6 * np.sqrt(variance)), f"max err/sigma {np.max(err / np.sqrt(variance))}"
  assert np.all(err <= bound), (
      f"max err/bound {np.max(err / bound):.3f}; max err {err.max():.3e}, "
      f"max bound {bound.max():.3e}")


# ---------------------------------------------------------- jit behaviour
def test_generate_traces_once(model, monkeypatch):
  """Repeated calls with the same shapes/settings reuse one compiled program."""
  traces = []
  orig = llama.Llama.decode

  def counting_decode(self, *args, **kwargs):
    traces.append(1)  # runs only while tracing
    return orig(self, *args, **kwargs)

  monkeypatch.setattr(llama.Llama, "decode", counting_decode)
  size0 = gen_mod._generate_program.compiled()
  for seed in range(3):  # fresh prompts, lengths and rng every call
    tokens, lengths = _prompts(10 + seed, 3, 37, [37, 20 + seed, 9])
    out, _ = generate(model, tokens, lengths, kv_format="kivi2", max_new_tokens=5,
                      sampler="sample", temperature=0.8, top_p=0.9,
                      rng=jax.random.key(seed), cache_dtype=jnp.float32)
    out.block_until_ready()
  assert len(traces) == 1
  assert gen_mod._generate_program.compiled() == size0 + 1


def test_generate_program_donates_caches(model):
  """The jitted program consumes (donates) the caches it is given."""
  tokens, lengths = _prompts(4, 2, 24, [24, 13])
  caches = model.init_cache("kivi4", 2, 40, dtype=jnp.float32)
  graphdef, state = nnx.split(model)
  settings = gen_mod.GenerateSettings(max_new_tokens=8)
  out, _, new_caches = gen_mod._generate_program.at(2)(
      graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32),
      caches, jax.random.key(0), jnp.zeros((2, 0), jnp.int32), jnp.float32(1), jnp.float32(1),
      jnp.int32(0), jnp.int32(8), settings=settings)
  assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(caches))
  np.testing.assert_array_equal(np.asarray(new_caches.lengths), lengths + 7)
  want, _ = generate(model, tokens, lengths, kv_format="kivi4", max_new_tokens=8,
                     capacity=40, cache_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_decode_step_in_user_scan(model):
  """`decode_step` inside a user's jit + lax.scan with donated caches == generate."""
  tokens, lengths = _prompts(5, 2, 30, [30, 18])
  n = 6
  graphdef, state = nnx.split(model)

  @jax.jit
  def prefill(state, tokens, lengths, caches):
    return nnx.merge(graphdef, state).prefill(tokens, lengths, caches)

  def loop(state, first, caches):
    m = nnx.merge(graphdef, state)

    def body(carry, _):
      tok, caches = carry
      logits, caches = decode_step(m, tok, caches)
      nxt = jnp.argmax(logits, -1).astype(jnp.int32)
      return (nxt, caches), nxt

    (_, caches), toks = jax.lax.scan(body, (first, caches), None, length=n - 1)
    return toks.T, caches

  loop = jax.jit(loop, donate_argnames="caches")
  caches = model.init_cache("int8", 2, 64, dtype=jnp.float32)
  logits, caches = prefill(state, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths), caches)
  first = jnp.argmax(logits, -1).astype(jnp.int32)
  rest, new_caches = loop(state, first, caches)
  assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(caches))
  got = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)
  want, _ = generate(model, tokens, lengths, kv_format="int8", max_new_tokens=n, capacity=64,
                     cache_dtype=jnp.float32)
  np.testing.assert_array_equal(got, np.asarray(want))


# ------------------------------------------------------ stops and samplers
def test_per_sequence_stop_tokens(model):
  tokens, lengths = _prompts(6, 3, 20, [20, 11, 15])
  n = 10
  free, _ = generate(model, tokens, lengths, kv_format="bf16", max_new_tokens=n,
                     cache_dtype=jnp.float32)
  free = np.asarray(free)
  stop_at = [3, 6, None]  # sequence 2 never meets its stop token
  stops = [[int(free[0, 3]), -5], [int(free[1, 6])], [CFG.vocab_size + 1]]
  for b, k in enumerate(stop_at):  # stop steps must be the first occurrences
    if k is not None:
      assert stops[b][0] not in free[b, :k]
  out, out_len = generate(model, tokens, lengths, kv_format="bf16", max_new_tokens=n,
                          cache_dtype=jnp.float32, stop_tokens=stops, pad_token_id=-1)
  out = np.asarray(out)
  np.testing.assert_array_equal(np.asarray(out_len), [4, 7, n])
  for b, k in enumerate(stop_at):
    m = n if k is None else k + 1
    np.testing.assert_array_equal(out[b, :m], free[b, :m])
    assert np.all(out[b, m:] == -1)


def test_finished_sequences_append_nothing(model):
  """After its stop token a sequence is fed padding (here -1, not an id); none of it
  (nor the stop token) reaches the cache: the returned cache holds the prompt and
  the generated tokens before the stop, as prefilling that history at once does,
  and no sequence is flagged invalid."""
  tokens, lengths = _prompts(6, 3, 20, [20, 11, 15])
  n = 10
  free = np.asarray(generate(model, tokens, lengths, kv_format="bf16", max_new_tokens=n,
                             cache_dtype=jnp.float32)[0])
  stops = [[int(free[0, 3])], [int(free[1, 6])], [CFG.vocab_size + 1]]
  assert stops[0][0] not in free[0, :3] and stops[1][0] not in free[1, :6]
  for fmt in ("bf16", "kivi4"):
    out, out_len, cache = generate(model, tokens, lengths, kv_format=fmt, max_new_tokens=n,
                                   cache_dtype=jnp.float32, stop_tokens=stops,
                                   pad_token_id=-1, return_cache=True)
    out, out_len = np.asarray(out), np.asarray(out_len)
    np.testing.assert_array_equal(out_len, [4, 7, n])
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + out_len - 1)
    cache.check()  # the -1 padding was never appended, so nothing is flagged
    if fmt != "bf16":
      continue
    # Oracle: the same history prefilled in one go.
    hist = [np.concatenate([tokens[b, :lengths[b]], out[b, :out_len[b] - 1]]) for b in range(3)]
    width = max(len(h) for h in hist)
    padded = np.stack([np.pad(h, (0, width - len(h))) for h in hist])
    ref = model.init_cache("bf16", 3, cache.capacity, jnp.float32)
    _, ref = model.prefill(padded, [len(h) for h in hist], ref)
    np.testing.assert_array_equal(np.asarray(ref.lengths), np.asarray(cache.lengths))
    (k, v), (rk, rv) = cache.dequantize(), ref.dequantize()
    for b, h in enumerate(hist):
      np.testing.assert_allclose(np.asarray(k[:, b, :len(h)]), np.asarray(rk[:, b, :len(h)]),
                                 rtol=2e-4, atol=2e-4)
      np.testing.assert_allclose(np.asarray(v[:, b, :len(h)]), np.asarray(rv[:, b, :len(h)]),
                                 rtol=2e-4, atol=2e-4)
      assert not np.any(np.asarray(k[:, b, len(h):]))  # nothing past the length


def test_decode_active_mask(model):
  """`model.decode(..., active=)`: inactive sequences append nothing and their ids are
  not checked; a bad mask is refused."""
  tokens, lengths = _prompts(9, 2, 12, [12, 7])
  cache = model.init_cache("kivi2", 2, 40, jnp.float32)
  _, cache = model.prefill(tokens, lengths, cache)
  step = jnp.asarray([[5], [-1]], jnp.int32)  # row 1 holds padding
  _, after = model.decode(step, cache, active=np.asarray([True, False]))
  np.testing.assert_array_equal(np.asarray(after.lengths), [13, 7])
  after.check()
  (k0, _), (k1, _) = cache.dequantize(), after.dequantize()
  np.testing.assert_array_equal(np.asarray(k1[:, 1]), np.asarray(k0[:, 1]))
  with pytest.raises(ValueError, match=r"tokens must lie in \[0, 95\]"):
    model.decode(step, cache, active=np.asarray([True, True]))
  for bad in (np.asarray([1, 0]), np.asarray([True])):
    with pytest.raises(ValueError, match="active .* must be a \\[2\\] bool array"):
      model.decode(step, cache, active=bad)


def test_sampling_modes(model):
  tokens, lengths = _prompts(7, 2, 16, [16, 10])
  kw = dict(kv_format="bf16", max_new_tokens=8, cache_dtype=jnp.float32)
  greedy, _ = generate(model, tokens, lengths, **kw)
  for extra in (dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4)):
    out, _ = generate(model, tokens, lengths, sampler="sample", rng=jax.random.key(1),
                      **extra, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(greedy), err_msg=str(extra))
  a, _ = generate(model, tokens, lengths, sampler="sample", rng=jax.random.key(1), **kw)
  b, _ = generate(model, tokens, lengths, sampler="sample", rng=jax.random.key(1), **kw)
  c, _ = generate(model, tokens, lengths, sampler="sample", rng=jax.random.key(2), **kw)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(a), np.asarray(c))
  custom, _ = generate(model, tokens, lengths, **kw,
                       sampler=lambda logits, key: jnp.argmin(logits, -1))
  assert not np.array_equal(np.asarray(custom), np.asarray(greedy))


def test_num_steps_reuses_program(model):
  tokens, lengths = _prompts(12, 2, 16, [16, 7])
  kw = dict(kv_format="bf16", max_new_tokens=9, cache_dtype=jnp.float32, pad_token_id=-1)
  full, _ = generate(model, tokens, lengths, **kw)
  size = gen_mod._generate_program.compiled()
  part, part_len = generate(model, tokens, lengths, num_steps=4, **kw)
  assert gen_mod._generate_program.compiled() == size
  np.testing.assert_array_equal(np.asarray(part)[:, :4], np.asarray(full)[:, :4])
  assert np.all(np.asarray(part)[:, 4:] == -1)
  np.testing.assert_array_equal(np.asarray(part_len), [4, 4])
  for bad in (-3, 0, 10, 2.0, True):
    with pytest.raises(ValueError, match=f"num_steps={bad!r} must be an int in"):
      generate(model, tokens, lengths, num_steps=bad, **kw)
  for bad in (1.5, 2**40, True):
    with pytest.raises(ValueError, match=f"pad_token_id={bad!r} must be an int"):
      generate(model, tokens, lengths, **dict(kw, pad_token_id=bad))
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    generate(model, tokens, lengths, mesh="data=2", **kw)


def test_prefill_chunk_matches_one_chunk(model):
  """``prefill_chunk`` prefills in chunks (`model.prefill(chunk_size=)`): the
  same greedy tokens and cache lengths as one chunk, ragged prompts (one
  shorter than a chunk), a quantized cache (K/V quantized at the flush from
  the chunks' K/V: codes can move by float rounding, tokens should not)."""
  fmt = dataclasses.replace(PRESETS["kivi4"], token_group=16, residual=16)
  tokens, lengths = _prompts(14, 2, 40, [40, 11])
  kw = dict(kv_format=fmt, max_new_tokens=6, cache_dtype=jnp.float32, return_cache=True)
  want, want_len, want_cache = generate(model, tokens, lengths, **kw)
  got, got_len, got_cache = generate(model, tokens, lengths, prefill_chunk=16, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_len), np.asarray(want_len))
  np.testing.assert_array_equal(np.asarray(got_cache.lengths), np.asarray(want_cache.lengths))
  for bad in (0, -4, 2.5, True, "16"):
    with pytest.raises(ValueError, match=f"prefill_chunk={bad!r} must be an int >= 1"):
      generate(model, tokens, lengths, prefill_chunk=bad, **kw)


def test_sample_logits_filters():
  probs = np.array([0.05, 0.5, 0.15, 0.3], np.float32)
  logits = jnp.tile(jnp.log(probs)[None], (4000, 1))
  key = jax.random.key(0)
  top2 = np.asarray(sample_logits(logits, key, top_k=2))
  assert set(np.unique(top2)) == {1, 3}
  nucleus = np.asarray(sample_logits(logits, key, top_p=0.7))  # keeps 0.5 and 0.3
  assert set(np.unique(nucleus)) == {1, 3}
  frac = np.mean(nucleus == 1)
  assert abs(frac - 0.5 / 0.8) < 0.03, frac  # renormalized over the kept tokens
  both = np.asarray(sample_logits(logits, key, top_k=3, top_p=0.6))  # 0.5 then 0.3
  assert set(np.unique(both)) == {1, 3}


def test_argument_errors(model):
  tokens, lengths = _prompts(8, 2, 10, [10, 4])
  with pytest.raises(ValueError, match="capacity=8 < prompt length 10"):
    generate(model, tokens, lengths, max_new_tokens=4, capacity=8)
  with pytest.raises(ValueError, match="sampler='beam'"):
    generate(model, tokens, lengths, max_new_tokens=4, sampler="beam")
  with pytest.raises(ValueError, match=r"prompt_lengths=\[10, 0\]"):
    generate(model, tokens, [10, 0], max_new_tokens=4)
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    generate(model, tokens, lengths, max_new_tokens=0)
  with pytest.raises(ValueError, match="unknown preset 'int3'"):
    generate(model, tokens, lengths, max_new_tokens=4, kv_format="int3")
  with pytest.raises(ValueError, match="top_k=500"):
    generate(model, tokens, lengths, max_new_tokens=4, sampler="sample", top_k=500)


def test_cache_nbytes_matches_allocation(model):
  for preset in ("bf16", "kivi2"):
    cache = model.init_cache(preset, 2, 300)
    assert gen_mod.cache_nbytes(model, preset, 2, 300) == cache.nbytes
  assert gen_mod.cache_nbytes(model, "kivi2", 2, 4096) < gen_mod.cache_nbytes(
      model, "bf16", 2, 4096) / 3


def test_bf16_model_generates(model):
  """bf16 weights with the default (bf16) cache dtype run through the same program."""
  m16 = llama.random_model(dataclasses.replace(CFG, num_layers=1), seed=2, dtype=jnp.bfloat16)
  tokens, lengths = _prompts(9, 2, 140, [140, 99])
  out, out_len = generate(m16, tokens, lengths, kv_format="kivi4", max_new_tokens=4)
  assert np.asarray(out).shape == (2, 4) and np.all(np.asarray(out_len) == 4)


def test_split_model_matches_model_and_is_a_snapshot(model):
  """`SplitModel` gives the model's tokens, reuses its programs, and holds the weights it was built with."""
  tokens, lengths = _prompts(31, 2, 12, [12, 5])
  kw = dict(kv_format="kivi4", max_new_tokens=6, cache_dtype=jnp.float32)
  want, want_len = generate(model, tokens, lengths, **kw)
  split = jaxkv.SplitModel(model)
  size = gen_mod._generate_program.compiled()
  got, got_len = generate(split, tokens, lengths, **kw)
  assert gen_mod._generate_program.compiled() == size  # same graphdef: same program
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_len), np.asarray(want_len))
  # decode_steps from the same prefilled cache, model vs split.
  outs = []
  for m in (model, split):
    cache = model.init_cache("kivi4", 2, 32, dtype=jnp.float32)
    _, cache = model.prefill(jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32), cache)
    out, _, cache = jaxkv.decode_steps(m, jnp.asarray([3, 7]), cache, 4)
    outs.append((np.asarray(out), np.asarray(cache.lengths)))
  np.testing.assert_array_equal(outs[0][0], outs[1][0])
  np.testing.assert_array_equal(outs[0][1], lengths + 4)
  # A snapshot: changing the model's weights afterwards changes the model's
  # output but not the split's, until refresh().
  other = llama.random_model(CFG, seed=99, dtype=jnp.float32)
  changed = llama.random_model(CFG, seed=21, dtype=jnp.float32)
  snap = jaxkv.SplitModel(changed)
  nnx.update(changed, nnx.state(other))
  new, _ = generate(changed, tokens, lengths, **kw)
  old, _ = generate(snap, tokens, lengths, **kw)
  fresh, _ = generate(snap.refresh(), tokens, lengths, **kw)
  np.testing.assert_array_equal(np.asarray(old), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(fresh), np.asarray(new))
  assert not np.array_equal(np.asarray(new), np.asarray(want))
  assert "SplitModel(Llama" in repr(snap)
