"""`jaxkv.ModelCache`: stacked appends == per-layer `KVCache`, in-place updates, one trace."""

from __future__ import annotations

import dataclasses
import functools
import re
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
from bench.hlo_copies import loop_program_args, shape_lines
from jaxkv import KVCache, ModelCache, decoding
from jaxkv.formats import PRESETS
from models import llama
from pallas_kernels import residual_write

CFG = llama.LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
    num_kv_heads=2, head_dim=32, rope_theta=500000.0, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def model():
  return llama.random_model(CFG, seed=31, dtype=jnp.float32)


def _leaves_equal(a, b) -> bool:
  """Every leaf the same dtype, shape and bytes (NaNs included)."""
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(la) == len(lb) and all(
      x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
      for x, y in ((np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))


@jax.jit
def _append_all_layers(cache, k, v, n):
  """One planned append of ``k, v [L, B, T, H, D]`` (first ``n [B]`` rows) to every layer."""
  plan = cache.plan_append(n)
  for i in range(cache.num_layers):
    cache = cache.append_layer(i, k[i], v[i], plan)
  return cache.commit(plan)


@pytest.mark.parametrize("preset", ["kivi4", "k8v4"])
def test_stacked_appends_equal_per_layer_caches(preset):
  """Ragged prefills and decode appends through `plan/append_layer/commit` == `KVCache`."""
  rng = np.random.default_rng(zlib.crc32(preset.encode()))
  layers, b, h, d, cap = 2, 3, 2, 32, 600
  cache = ModelCache.init(preset, layers, b, h, d, cap, jnp.float32)
  per = [KVCache.init(preset, b, h, d, cap, jnp.float32) for _ in range(layers)]

  for t, counts in [(200, [200, 5, 0]), (1, None), (1, None), (140, [0, 140, 123])]:
    k = jnp.asarray(rng.standard_normal((layers, b, t, h, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((layers, b, t, h, d)), jnp.float32)
    n = jnp.full((b,), t, jnp.int32) if counts is None else jnp.asarray(counts, jnp.int32)
    cache = _append_all_layers(cache, k, v, n)
    per = [c.prefill(k[i], v[i], n) for i, c in enumerate(per)]
  for i in range(layers):
    assert _leaves_equal(cache.layer(i), per[i]), f"layer {i}"
  np.testing.assert_array_equal(np.asarray(cache.lengths), [202, 147, 125])
  assert _leaves_equal(ModelCache.from_layers(per).k, cache.k)


@pytest.mark.parametrize("preset,use_kernel,h", [
    ("kivi4", False, 2), ("kivi4", True, 2), ("bf16", True, 2), ("int8", False, 2),
    ("int8", True, 2), ("kivi2", True, 2), ("k8v4", True, 2), ("int4-token-g4", True, 2),
    ("kivi4", True, 3)])  # 3 kv heads: the kernel's per-head loops (not a power of two)
def test_one_token_appends_across_flushes_equal_per_layer_caches(preset, use_kernel, h):
  """T=1 appends (the R == G decode path) through group flushes, ragged, skipped, overflowing.

  The oracle is the per-layer `KVCache` (its general stage-and-shift append),
  bit for bit after every step: packed codes, scales, residual rows
  (including the zeros past each length) and flags.
  """
  fmt = jaxkv.KVFormat.preset(preset)
  assert fmt.residual == fmt.token_group  # the fast path's condition
  rng = np.random.default_rng(zlib.crc32(b"one-token" + preset.encode() + bytes([h])))
  layers, b, d, cap = 2, 4, 32, 257
  cache = ModelCache.init(preset, layers, b, h, d, cap, jnp.float32, use_kernel=use_kernel)
  per = [KVCache.init(preset, b, h, d, cap, jnp.float32) for _ in range(layers)]
  # G - 2 and 2G - 2 tokens: sequences 0 and 1 flush on the 2nd / 3rd step;
  # sequence 1 then reaches capacity and its last append overflows.
  steps = [(254, [126, 254, 3, 0])] + [(1, n) for n in (
      [1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 0])]
  for t, counts in steps:
    k = jnp.asarray(rng.standard_normal((layers, b, t, h, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((layers, b, t, h, d)), jnp.float32)
    n = jnp.asarray(counts, jnp.int32)
    cache = _append_all_layers(cache, k, v, n)
    # KVCache refuses an overflowing append eagerly; ModelCache skips and flags it.
    fits = jnp.where(per[0].lengths + n <= cap, n, 0)
    per = [c.prefill(k[i], v[i], fits) for i, c in enumerate(per)]
    for i in range(layers):
      got = dataclasses.replace(cache.layer(i), overflow=per[i].overflow)
      assert _leaves_equal(got, per[i]), f"layer {i} after appending {counts}"
  np.testing.assert_array_equal(np.asarray(cache.lengths), [130, 257, 7, 4])
  np.testing.assert_array_equal(np.asarray(cache.overflow), [False, True, False, False])
  assert int(cache.fmt.packed_len(130)) == 128  # sequence 0 did flush a group


@pytest.mark.parametrize("use_kernel", [False, True])
def test_one_token_append_flags_nonfinite_tokens(use_kernel):
  """A NaN/inf token on the one-token path sets ``nonfinite`` for its sequence only
  when it is stored (a plain row or the token that flushes a group, in any layer),
  the same with the residual-write kernel (which checks the token) and without."""
  layers, b, h, d, cap = 2, 4, 2, 32, 300
  rng = np.random.default_rng(11)
  cache = ModelCache.init("kivi4", layers, b, h, d, cap, jnp.float32, use_kernel=use_kernel)
  k = jnp.asarray(rng.standard_normal((layers, b, 127, h, d)), jnp.float32)
  cache = _append_all_layers(cache, k, -k, jnp.asarray([127, 3, 5, 0], jnp.int32))
  assert not np.asarray(cache.nonfinite).any()
  k, v = (jnp.asarray(rng.standard_normal((layers, b, 1, h, d)), jnp.float32) for _ in range(2))
  k = k.at[1, 0, 0, 1, 4].set(jnp.nan)      # sequence 0, layer 1: its token flushes a group
  v = v.at[0, 1, 0, 0, 0].set(jnp.inf)      # sequence 1, layer 0: a residual row
  k = k.at[0, 2, 0, 1, 31].set(-jnp.inf)    # sequence 2 appends nothing this step
  cache = _append_all_layers(cache, k, v, jnp.asarray([1, 1, 0, 1], jnp.int32))
  np.testing.assert_array_equal(np.asarray(cache.lengths), [128, 4, 5, 1])
  assert int(cache.fmt.packed_len(128)) == 128
  np.testing.assert_array_equal(np.asarray(cache.nonfinite), [True, True, False, False])


# The two axes are independent (the pack kernel or jnp quantizes; `commit` flags the
# sequence whatever quantized): CI runs each value of each axis once, the full run all four.
@pytest.mark.parametrize("use_kernel,max_new", [
    (False, None), pytest.param(True, None, marks=pytest.mark.slow),
    pytest.param(False, "chunk", marks=pytest.mark.slow), (True, "chunk")])
def test_groups_stored_as_nan_are_flagged_like_per_layer_caches(use_kernel, max_new):
  """Finite values whose group's float16 scale overflows are stored as a NaN group;
  `commit` flags the sequence ``nonfinite`` (over all layers, both sides, in one
  chunk or through the one-token path), as the per-layer `KVCache` does."""
  layers, b, h, d, cap = 2, 3, 2, 32, 300
  rng = np.random.default_rng(5)
  k = rng.standard_normal((layers, b, 128, h, d)).astype(np.float32)
  v = rng.standard_normal((layers, b, 128, h, d)).astype(np.float32)
  k[1, 1, 5, 0, 3] = 2e6      # K (per channel), layer 1, sequence 1
  v[0, 2, 127, 1, 0] = -3e6   # V (per token), layer 0, sequence 2, the flushing token
  k, v = jnp.asarray(k), jnp.asarray(v)

  @jax.jit
  def append(cache, k, v, n):
    plan = cache.plan_append(n, max_new=None if max_new is None else k.shape[2])
    for i in range(layers):
      cache = cache.append_layer(i, k[i], v[i], plan)
    return cache.commit(plan)

  full = jnp.full((b,), 128, jnp.int32)
  for chunks in ((128,), (127, 1)):
    cache = ModelCache.init("kivi4", layers, b, h, d, cap, jnp.float32, use_kernel=use_kernel)
    t0 = 0
    for t in chunks:
      cache = append(cache, k[:, :, t0:t0 + t], v[:, :, t0:t0 + t], jnp.full((b,), t, jnp.int32))
      t0 += t
    assert np.isnan(np.asarray(cache.k.scale)).any() and np.isnan(np.asarray(cache.v.scale)).any()
    per = [jax.jit(lambda c, x, y: c.prefill(x, y, full))(
        KVCache.init("kivi4", b, h, d, cap, jnp.float32), k[i], v[i]) for i in range(layers)]
    want = np.logical_or(*(np.asarray(c.nonfinite) for c in per))
    np.testing.assert_array_equal(want, [False, True, True])
    np.testing.assert_array_equal(np.asarray(cache.nonfinite), want, err_msg=str(chunks))
  with pytest.raises(ValueError, match="max_new=-1"):
    cache.plan_append(full, max_new=-1)


def test_token_append_refuses_what_it_cannot_store():
  from pallas_kernels import token_append
  res = jnp.zeros((2, 1, 1, 16, 32))
  tok = jnp.zeros((1, 1, 32))
  one = jnp.zeros((1,), jnp.int32)
  codes = jnp.zeros((2, 1, 1, 64, 16), jnp.uint8)
  scale = jnp.zeros((2, 1, 1, 4, 32), jnp.float16)
  assert not token_append.supported((4, "channel", 16), (4, "token", 32), (2, 1, 1, 32, 32), 16)
  assert not token_append.supported((4, "channel", 8), (4, "token", 32), res.shape, 16)
  assert token_append.supported((4, "channel", 16), (4, "token", 32), res.shape, 16)
  with pytest.raises(ValueError, match="not supported"):
    token_append.append_token(res, res, tok, tok, one, one > 0, one, (codes, scale, scale),
                              (codes,), layer=0, k_side=(4, "channel", 8),
                              v_side=(4, "token", 32), interpret=True)
  with pytest.raises(ValueError, match="layer=2"):
    token_append.append_token(res, res, tok, tok, one, one > 0, one, (codes, scale, scale),
                              (codes,), layer=2, k_side=(4, "channel", 16),
                              v_side=(4, "token", 32), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_residual_write_kernel_matches_reference(dtype):
  """`pallas_kernels.residual_write` == its XLA scatter, every byte (compiled on a GPU)."""
  rng = np.random.default_rng(7)
  shape = (3, 5, 2, 16, 32)                                   # [L, B, H, R, D]
  k_res, v_res = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
  k_new, v_new = (jnp.asarray(rng.standard_normal((5, 2, 32)), jnp.float32) for _ in range(2))
  row = jnp.asarray([0, 15, 16, 7, 3], jnp.int32)             # 16: no row (did not fit)
  clear = jnp.asarray([False, False, False, True, False])
  # NaN/inf tokens: sequence 0 (K, written), 2 (V, not written: no flag), 3 (V,
  # inf, cleared block: the token was flushed, so flagged), 4 only in a later head
  k_new = k_new.at[0, 1, 5].set(jnp.nan)
  v_new = v_new.at[2, 0, 0].set(jnp.nan).at[3, 0, 31].set(jnp.inf).at[4, 1, 9].set(-jnp.inf)
  flagged = [True, False, False, True, True]
  for layer in (0, 2):
    want = residual_write.write_token_rows_reference(k_res, v_res, k_new, v_new, row, clear,
                                                     layer=layer)
    got = residual_write.write_token_rows(k_res, v_res, k_new, v_new, row, clear, layer=layer,
                                          interpret=jax.default_backend() != "gpu")
    assert _leaves_equal(got, want), layer
    np.testing.assert_array_equal(np.asarray(got[2]), flagged)
    # `after` only orders the call: the same result
    later = residual_write.write_token_rows(k_res, v_res, k_new, v_new, row, clear,
                                            layer=layer, after=(k_res[0], row),
                                            interpret=jax.default_backend() != "gpu")
    assert _leaves_equal(later, want), layer
    changed = np.asarray(got[0] != k_res)
    assert changed[layer].any() and not np.delete(changed, layer, axis=0).any()
    assert np.all(np.asarray(got[1][layer, 3]) == 0)           # the cleared block
  with pytest.raises(ValueError, match="layer=3"):
    residual_write.write_token_rows(k_res, v_res, k_new, v_new, row, clear, layer=3,
                                    interpret=True)


def test_overflow_and_invalid_flags():
  cache = ModelCache.init("kivi4", 2, 2, 2, 32, 8, jnp.float32)
  k = jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, 2, 32)), jnp.float32)
  with pytest.raises(ValueError, match=r"num_new: sequences \[1\] would grow past capacity=8"):
    cache.plan_append(jnp.asarray([6, 9], jnp.int32))  # eagerly: an error

  @jax.jit
  def append(cache, k, n):  # traced: sequence 1 does not fit, so it is flagged
    plan = cache.plan_append(n)
    for i in range(2):
      cache = cache.append_layer(i, k, k, plan)
    return cache.commit(plan)

  cache = append(cache, k, jnp.asarray([6, 9], jnp.int32))
  np.testing.assert_array_equal(np.asarray(cache.lengths), [6, 0])
  with pytest.raises(ValueError, match=r"overflow.*sequences \[1\]"):
    cache.check()
  flagged = dataclasses.replace(cache.flag_invalid(jnp.asarray([True, False])),
                                overflow=jnp.zeros((2,), bool))
  with pytest.raises(ValueError, match=r"invalid set for sequences \[0\]"):
    flagged.check()


# ------------------------------------------------------------ no copies
def _stacked_shapes(cache) -> set[str]:
  """HLO spellings (``f32[3,2,2,512,32]``) of the cache's layer-stacked leaves."""
  out = set()
  for x in jax.tree_util.tree_leaves(cache):
    if x.ndim == 5:
      dt = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "uint8": "u8"}[x.dtype.name]
      out.add(f"{dt}[{','.join(map(str, x.shape))}]")
  return out


def _fresh_cache_sized_buffers(hlo: str, shapes: set[str]) -> list[str]:
  """Instructions that materialise a new cache-sized buffer (copies, selects, broadcasts).

  In-place updates (``scatter`` / ``dynamic-update-slice`` of the carried
  buffer) are expected; that they really alias (no fresh buffer behind them)
  is checked at run time by comparing buffer pointers.
  """
  bad = []
  for line in hlo.splitlines():
    m = re.match(r"\s*(ROOT )?%\S+ = (\S+?)\{[^}]*\} (copy|copy-start|copy-done|select|"
                 r"broadcast)\(", line)
    if m and m.group(2) in shapes:
      bad.append(line.strip()[:200])
  return bad


def _pointers(tree):
  return [x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(tree) if x.ndim == 5]


@pytest.mark.parametrize("preset,use_kernel", [("kivi4", False), ("bf16", False),
                                                ("kivi4", True)])
def test_decode_step_updates_cache_in_place(model, preset, use_kernel):
  """Jitted decode step, cache donated: no cache-sized copy in the HLO, same buffers out
  (``use_kernel``: the one-launch token append, `pallas_kernels.token_append`, which
  aliases the stacked packed arrays)."""
  graphdef, state = nnx.split(model)

  @functools.partial(jax.jit, donate_argnames="cache")
  def step(state, tokens, cache):
    return jaxkv.decode_step(nnx.merge(graphdef, state), tokens, cache)

  cache = model.init_cache(preset, 2, 512, dtype=jnp.float32, use_kernel=use_kernel)
  tokens = jnp.asarray([5, 7], jnp.int32)
  hlo = step.lower(state, tokens, cache).compile().as_text()
  shapes = _stacked_shapes(cache)
  assert _fresh_cache_sized_buffers(hlo, shapes) == []
  assert any(s in hlo for s in shapes)  # the check looked at the right names
  before = _pointers(cache)
  _, cache = step(state, tokens, cache)
  assert _pointers(cache) == before  # donated buffers reused: updated in place


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="XLA's dot merger is a GPU pass")
@pytest.mark.skipif(decoding.DOT_MERGER_MB < 113,
                    reason="JAXKV_XLA_DOT_MERGER_MB below one gate weight (112 MiB)")
@pytest.mark.parametrize("batch", [1, 32, decoding.DOT_MERGER_MAX_ROWS + 1])
def test_decode_program_merges_gate_and_up_in_place(batch):
  """The `decode_steps` loop program (`jaxkv.decode_compiler_options`) makes gate
  and up one GEMM (Llama-3.1-8B widths, 112 MiB each, above XLA's default merger
  threshold of 32 MiB) up to `DOT_MERGER_MAX_ROWS` sequences, and its fusion
  reads both weights in place: the merged ``[hidden, 2 x intermediate]`` shape
  appears only inside a GEMM fusion (never a loop-invariant copy hoisted out of
  the loop, nor a concatenation materialised for the product). Past the row
  limit the program merges no dots: neither gate/up nor q/k/v (XLA's default
  would merge the latter) has a merged shape anywhere."""
  cfg = dataclasses.replace(llama.LlamaConfig.named("llama-3.1-8b"), num_layers=1,
                            vocab_size=512)
  m = jax.eval_shape(lambda: llama.random_model(cfg, seed=3))
  args, settings = loop_program_args(m, "kivi4", batch, 1024, steps=4)
  merged = f"bf16[{cfg.hidden_size},{2 * cfg.intermediate_size}]"
  program = decoding._decode_steps_program.at(batch)  # pylint: disable=protected-access
  hlo = program.lower(*args, settings=settings).compile().as_text()
  found = shape_lines(hlo, merged)
  if batch <= decoding.DOT_MERGER_MAX_ROWS:
    assert found and all(in_gemm for _, in_gemm in found), found
  else:
    qkv = f"bf16[{cfg.hidden_size},{(cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim}]"
    assert found == []
    assert shape_lines(hlo, qkv) == []


def test_chunked_prefill_and_decode_steps_in_place(model):
  """Chunked prefill (scan over chunks, scan over layers) and `decode_steps` alias the cache."""
  graphdef, state = nnx.split(model)
  prefill = jax.jit(lambda s, t, n, c: nnx.merge(graphdef, s).prefill(t, n, c, chunk_size=16),
                    donate_argnums=3)
  cache = model.init_cache("kivi4", 2, 512, dtype=jnp.float32)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 40)), jnp.int32)
  lengths = jnp.asarray([40, 33], jnp.int32)
  hlo = prefill.lower(state, tokens, lengths, cache).compile().as_text()
  assert _fresh_cache_sized_buffers(hlo, _stacked_shapes(cache)) == []
  before = _pointers(cache)
  _, cache = prefill(state, tokens, lengths, cache)
  assert _pointers(cache) == before
  _, _, cache = jaxkv.decode_steps(model, jnp.asarray([3, 4]), cache, 4)
  assert _pointers(cache) == before
  np.testing.assert_array_equal(np.asarray(cache.lengths), [44, 37])


def test_decode_step_traces_once(model):
  graphdef, state = nnx.split(model)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, tokens, cache):
    return jaxkv.decode_step(nnx.merge(graphdef, state), tokens, cache)

  cache = model.init_cache("int8", 2, 256, dtype=jnp.float32)
  rng = np.random.default_rng(2)
  for _ in range(3):  # fresh values, same shapes: no retrace
    _, cache = step(state, jnp.asarray(rng.integers(0, CFG.vocab_size, (2,)), jnp.int32), cache)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [3, 3])



def test_nonfinite_kv_inside_the_model_is_flagged_and_poisons_only_its_sequence(model):
  """A NaN embedding row (token 7, sequence 0 only) -> NaN K/V in every layer of seq 0."""
  graphdef, state = nnx.split(model)
  bad_state = jax.tree_util.tree_map_with_path(
      lambda path, x: x.at[7].set(jnp.nan) if "embed_tokens" in jax.tree_util.keystr(path)
      else x, state)
  tokens = jnp.asarray([[5, 7, 9, 11], [5, 6, 9, 11]], jnp.int32)
  lengths = jnp.asarray([4, 4], jnp.int32)

  @jax.jit
  def run(state, tokens, lengths, cache):
    m = nnx.merge(graphdef, state)
    logits, cache = m.prefill(tokens, lengths, cache)
    step_logits, cache = m.decode(tokens[:, :1], cache)
    return logits, step_logits, cache

  fresh = lambda: model.init_cache("kivi4", 2, 256, dtype=jnp.float32)  # noqa: E731
  logits, step_logits, cache = run(bad_state, tokens, lengths, fresh())
  clean_logits, clean_step, clean_cache = run(state, tokens, lengths, fresh())
  np.testing.assert_array_equal(np.asarray(cache.nonfinite), [True, False])
  assert not np.asarray(clean_cache.nonfinite).any()
  with pytest.raises(ValueError, match=r"nonfinite set for sequences \[0\]"):
    cache.check()
  assert np.isnan(np.asarray(step_logits[0])).all()
  # Sequence 1 never saw token 7: its results are those of the clean model.
  np.testing.assert_array_equal(np.asarray(step_logits[1]), np.asarray(clean_step[1]))
  np.testing.assert_array_equal(np.asarray(logits[1]), np.asarray(clean_logits[1]))
  assert np.isfinite(np.asarray(clean_step)).all()


@pytest.mark.parametrize("preset", ["kivi2-g32", "k8v4", "int4-token-g4"])
def test_pack_kernel_skipping_idle_sequences_changes_no_bit(preset):
  """use_kernel=True (the pack kernel skips sequences that flush nothing this
  step; interpret mode here) == the jnp quantization, over ragged flushes."""
  rng = np.random.default_rng(zlib.crc32(preset.encode()) + 1)
  layers, b, h, d, cap = 2, 3, 2, 64, 512
  caches = [ModelCache.init(preset, layers, b, h, d, cap, jnp.float32, use_kernel=uk)
            for uk in (False, True)]

  # Lengths cross group boundaries at different steps per sequence.
  total = np.zeros(b, np.int64)
  for t, counts in [(150, [150, 31, 97]), (1, None), (1, None), (40, [33, 0, 40]), (1, None)]:
    k = jnp.asarray(rng.standard_normal((layers, b, t, h, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((layers, b, t, h, d)), jnp.float32)
    n = np.full((b,), t) if counts is None else np.asarray(counts)
    total += n
    caches = [_append_all_layers(c, k, v, jnp.asarray(n, jnp.int32)) for c in caches]
  np.testing.assert_array_equal(np.asarray(caches[1].lengths), total)
  assert _leaves_equal(caches[0], caches[1])


def test_jitted_chunk_appends_across_flushes_equal_one_append():
  """Chunks of 8 into G = R = 16 (each flush stages residual rows + new rows), jitted:
  the layer equals one append of the whole history, bit for bit. On an H100 (jax
  0.11.2) a vmapped dynamic_update_slice in `stage_residual` was miscompiled inside
  this step (wrong flushed codes of some heads; compiled on the GPU by
  bench/gpu_tests.sh)."""
  fmt = dataclasses.replace(PRESETS["kivi4"], token_group=16, residual=16)
  b, h, d, total, chunk = 2, 2, 32, 40, 8
  lengths = np.array([total, 23])
  kv = np.random.default_rng(31).standard_normal((2, b, total, h, d)).astype(np.float32)

  @jax.jit
  def step(cache, k, v, n_real):
    plan = cache.plan_append(n_real)
    return cache.append_layer_with_history(0, k, v, plan)[0].commit(plan)

  def run(size):
    cache = ModelCache.init(fmt, 2, b, h, d, 64, jnp.float32)
    for j in range(0, total, size):
      n_real = jnp.asarray(np.clip(lengths - j, 0, size), jnp.int32)
      part = [np.zeros((b, size, h, d), np.float32) for _ in range(2)]
      for p, x in zip(part, kv):
        p[:, :min(size, total - j)] = x[:, j:j + size]
      cache = step(cache, jnp.asarray(part[0]), jnp.asarray(part[1]), n_real)
    return cache

  got, want = run(chunk), run(total)
  np.testing.assert_array_equal(np.asarray(got.packed_lens), [32, 16])
  for a, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


_KIVI2_SINKS = dataclasses.replace(PRESETS["kivi2"], token_group=32, residual=64, sink_tokens=4)


@pytest.mark.parametrize("preset,use_kernel", [("quantspec", False), ("kivi4", False),
                                                (_KIVI2_SINKS, False),
                                                pytest.param("k8v4", True,
                                                             marks=pytest.mark.slow)])
def test_append_layers_equals_per_layer_appends_with_one_cond(preset, use_kernel):
  """`append_layers` (a speculative commit: every layer's K/V at once, one flush cond)
  writes bitwise what `append_layer` per layer writes, across ragged multi-token
  appends that flush and ones that do not, and compiles to one conditional (per-layer
  appends: one per layer), with no cache-sized buffer the per-layer appends lack (a
  check that bites on the GPU, where `bench/gpu_tests.sh` compiles it; on the CPU the
  proxy is that no stacked residual is a cond operand or result)."""
  rng = np.random.default_rng(zlib.crc32(str(preset).encode()) + 3)
  layers, b, h, d, cap = 3, 3, 2, 32, 1024
  a = ModelCache.init(preset, layers, b, h, d, cap, jnp.float32, use_kernel=use_kernel)
  per = a

  def by_layers(cache, k, v, n):
    plan = cache.plan_append(n, max_new=k.shape[2])
    return cache.append_layers(list(k), list(v), plan).commit(plan)

  def per_layer(cache, k, v, n):
    plan = cache.plan_append(n, max_new=k.shape[2])
    for i in range(cache.num_layers):
      cache = cache.append_layer(i, k[i], v[i], plan)
    return cache.commit(plan)

  by_layers_jit = jax.jit(by_layers, donate_argnums=0)
  conds, fresh = {}, {}
  residual = _stacked_shapes(dataclasses.replace(a, k=None, v=None, k_sink=None, v_sink=None))
  # 5-token commits from ragged lengths: some flush a group, some do not; one-token
  # appends (with R == G `append_layer`'s token path, per layer)
  for step, (t, counts) in enumerate([(5, [5, 3, 0]), (5, [1, 5, 4]), (300, [300, 17, 260]),
                                      (5, [5, 5, 5]), (2, [2, 0, 1]), (1, [1, 1, 0]),
                                      (1, [1, 1, 1])]):
    k = rng.standard_normal((layers, b, t, h, d)).astype(np.float32)
    if step == 1:
      k[1, 2, 3, 0, 5] = np.nan  # a counted row of sequence 2: flagged nonfinite in both
    k = jnp.asarray(k)
    v = jnp.asarray(rng.standard_normal((layers, b, t, h, d)), jnp.float32)
    n = jnp.asarray(counts, jnp.int32)
    if step == 0:
      for name, fn in (("layers", by_layers), ("per_layer", per_layer)):
        hlo = jax.jit(fn, donate_argnums=0).lower(a, k, v, n).compile().as_text()
        conds[name] = len(re.findall(r"\bconditional\(", hlo))
        fresh[name] = sorted(line.split(" = ")[1].split(" ")[0]
                             for line in _fresh_cache_sized_buffers(hlo, _stacked_shapes(a)))
        # a CPU-visible proxy for the GPU's copies: no stacked residual goes
        # through a cond (on the GPU XLA copied it in and out; the CPU did not)
        cond_types = re.findall(r"= (\(.*?\)) conditional\(", hlo)
        assert not [r for r in residual for ty in cond_types if r in ty], name
    per = jax.jit(per_layer)(per, k, v, n)
    a = by_layers_jit(a, k, v, n)
    assert _leaves_equal(a, per), (preset, step)
  assert int(np.asarray(a.lengths).min()) > 0
  assert np.asarray(a.nonfinite).tolist() == [False, False, True]
  # one flush cond instead of one per layer (interpret-mode kernels add their own)
  assert conds["per_layer"] - conds["layers"] == layers - 1
  assert use_kernel or conds == {"layers": 1, "per_layer": layers}
  # no cache-sized buffer the per-layer appends do not make too (`commit`'s NaN-group
  # check copies the stacked scales at B > 1 on the CPU, in both)
  assert fresh["layers"] == fresh["per_layer"]


def test_append_layers_refuses_a_layer_count_mismatch():
  cache = ModelCache.init("quantspec", 2, 1, 2, 32, 512, jnp.float32)
  k = jnp.ones((1, 3, 2, 32), jnp.float32)
  plan = cache.plan_append(jnp.asarray([3], jnp.int32))
  with pytest.raises(ValueError, match="num_layers=2"):
    cache.append_layers([k], [k], plan)
  with pytest.raises(ValueError, match="one of each per layer"):
    cache.append_layers([k, k], [k], plan)
  with pytest.raises(ValueError, match="one shape"):  # a layer with fewer rows
    cache.append_layers([k, k[:, :1]], [k, k], plan)
