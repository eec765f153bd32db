"""Input validation of the stacked caches, VQ codebooks, staged attention and the
model's token checks: Python-level errors that name the argument (nothing is
compiled here except one tiny traced-index lookup)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import KVCache, ModelCache, VQCache, VQModelCache, vq
from jaxkv.staged_cache import StagedCache
from models import llama

CFG = llama.LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=32, rope_theta=500000.0, eos_token_ids=(2,))
# Small VQ format: 4 channels per index, 4 entries, G = R = 16.
VQF = vq.VQFormat(k_vector=4, v_vector=4, k_index_bits=2, v_index_bits=2, token_group=16,
                  residual=16)
LAYERS, B, H, D = 2, 2, 2, 16


@pytest.fixture(scope="module")
def model():
  return llama.random_model(CFG, seed=5, dtype=jnp.float32)


def _books(fmt=VQF, layers=LAYERS, kv_heads=H, head_dim=D, seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((layers, *fmt.codebook_shape("k", kv_heads, head_dim)))
  v = rng.standard_normal((layers, *fmt.codebook_shape("v", kv_heads, head_dim)))
  return vq.VQCodebooks(k=jnp.asarray(k, dtype), v=jnp.asarray(v, dtype), fmt=fmt)


def _kv(t, batch=B, kv_heads=H, head_dim=D, dtype=jnp.float32, seed=0):
  x = np.random.default_rng(seed).standard_normal((batch, t, kv_heads, head_dim))
  return jnp.asarray(x, dtype)


# ------------------------------------------------------------- layer index
@pytest.mark.parametrize("bad", [2, -1, np.int64(7), np.int32(-2)])
def test_concrete_layer_index_out_of_range(bad):
  cache = ModelCache.init("kivi4", LAYERS, B, H, D, 64, jnp.float32)
  k = _kv(1)
  plan = cache.plan_append(np.full((B,), 1, np.int32), max_new=1)
  msg = f"index={int(bad)} must lie in \\[0, num_layers=2\\)"
  for call in (lambda: cache.layer(bad), lambda: cache.layer_view(bad),
               lambda: cache.layer_view(jnp.asarray(bad)),
               lambda: cache.append_layer(bad, k, k, plan),
               lambda: cache.append_layer_with_history(bad, k, k, plan)):
    with pytest.raises(ValueError, match=msg):
      call()
  vq_cache = VQModelCache.init(VQF, LAYERS, B, H, D, 64, jnp.float32, codebooks=_books())
  with pytest.raises(ValueError, match=msg):
    vq_cache.layer(bad)
  with pytest.raises(ValueError, match=msg):
    _books().layer(bad)
  with pytest.raises(ValueError, match=f"layer={int(bad)} must lie in"):
    VQCache.init(VQF, _books(), B, H, D, 64, jnp.float32, layer=bad)


def test_layer_index_type_and_traced_index():
  cache = ModelCache.init("kivi4", LAYERS, B, H, D, 64, jnp.float32)
  for bad in (1.5, True, jnp.float32(1)):
    with pytest.raises(TypeError, match="index=.* must be an integer layer index"):
      cache.layer(bad)
  with pytest.raises(TypeError, match="layer=True"):
    VQCache.init(VQF, _books(), B, H, D, 64, jnp.float32, layer=True)
  # In range (also as a concrete array) works; a traced index is not checked (clamped).
  assert cache.layer(jnp.int32(1)).lengths.shape == (B,)
  out = jax.eval_shape(lambda c, i: c.layer(i).k_residual, cache, jnp.int32(5))
  assert out.shape == cache.k_residual.shape[1:]


# -------------------------------------------------------------- from_layers
def test_from_layers_ors_overflow_over_layers():
  base = KVCache.init("kivi4", B, H, D, 64, jnp.float32)
  flagged = dataclasses.replace(base, overflow=jnp.asarray([False, True]))
  stacked = ModelCache.from_layers([base, flagged])
  np.testing.assert_array_equal(np.asarray(stacked.overflow), [False, True])
  np.testing.assert_array_equal(np.asarray(stacked.invalid), [False, False])
  with pytest.raises(ValueError, match=r"overflow.*sequences \[1\]"):
    stacked.check()

  books = _books()
  layers = [VQCache.init(VQF, books, B, H, D, 64, jnp.float32, layer=i) for i in range(LAYERS)]
  layers[1] = dataclasses.replace(layers[1], overflow=jnp.asarray([True, False]))
  np.testing.assert_array_equal(np.asarray(VQModelCache.from_layers(layers).overflow),
                                [True, False])


# ------------------------------------------------------- plan / append checks
def test_plan_append_checks_counts():
  cache = ModelCache.init("kivi4", LAYERS, B, H, D, 64, jnp.float32)
  with pytest.raises(ValueError, match=r"num_new=\[-1, 2\] must be >= 0"):
    cache.plan_append(np.asarray([-1, 2]))
  with pytest.raises(ValueError, match=r"num_new=\[3, 1\] must be <= max_new=2"):
    cache.plan_append(jnp.asarray([3, 1]), max_new=2)
  with pytest.raises(TypeError, match="num_new=.* must be integer"):
    cache.plan_append(np.asarray([1.5, 2.0]))
  # Traced counts are left to the append (no error at trace time).
  jax.eval_shape(lambda c, n: c.plan_append(n, max_new=2).num_new, cache,
                 jnp.asarray([-1, 3]))


def test_append_layer_checks_shapes_and_dtype():
  cache = ModelCache.init("kivi4", LAYERS, B, H, D, 64, jnp.float32)
  plan = cache.plan_append(np.full((B,), 2, np.int32), max_new=2)
  for what, k in (("batch", _kv(2, batch=B + 1)), ("kv heads", _kv(2, kv_heads=H + 1)),
                  ("head_dim", _kv(2, head_dim=2 * D))):
    for append in (cache.append_layer, cache.append_layer_with_history):
      with pytest.raises(ValueError, match="does not match cache"):
        append(0, k, k, plan)
  with pytest.raises(TypeError, match="k.dtype=bfloat16 must equal the cache dtype float32"):
    cache.append_layer(0, _kv(2, dtype=jnp.bfloat16), _kv(2), plan)
  with pytest.raises(ValueError, match=r"k_new.shape\[1\]=1 rows < max_new=2"):
    cache.append_layer(0, _kv(1), _kv(1), plan)
  unbounded = cache.plan_append(np.full((B,), 3, np.int32))
  with pytest.raises(ValueError, match=r"plan.num_new=\[3, 3\] exceeds"):
    cache.append_layer_with_history(1, _kv(2), _kv(2), unbounded)


# ------------------------------------------------------------ staged count
def test_staged_attention_needs_staged_ge_queries():
  cache = KVCache.init("kivi4", 1, 1, 64, 256, jnp.float32)
  k = _kv(8, batch=1, kv_heads=1, head_dim=64)
  sc = StagedCache.wrap(cache, 4).append(k[:, :2], k[:, :2])
  q = jnp.asarray(np.random.default_rng(1).standard_normal((1, 3, 2, 64)), jnp.float32)
  with pytest.raises(ValueError, match=r"staged=\[2\] must be >= S=3"):
    sc.attention(q, implementation="reference")
  # S == staged is fine; under jit the count is traced and not checked.
  jax.eval_shape(lambda x: sc.attention(x, implementation="reference"), q[:, :2])
  jax.eval_shape(lambda s, x: s.attention(x, implementation="reference"), sc, q)


# --------------------------------------------------------------- codebooks
def test_check_codebooks_range_of_codebook_dtype():
  books = _books(layers=1)
  k = np.asarray(books.k[0]).copy()
  k.flat[3] = 1e6                                  # finite in float32, inf in float16
  with pytest.raises(ValueError, match=r"k_codebook .*outside the range of "
                                       r"codebook_dtype=float16 \(\|x\| <= 65504\)"):
    vq.check_codebooks(VQF, k, books.v[0], H, D)
  wide = dataclasses.replace(VQF, codebook_dtype="float32")
  vq.check_codebooks(wide, k, books.v[0], H, D)   # fits float32


def test_codebooks_validate_and_load(tmp_path):
  books = _books()
  cases = (
      ("layers", dict(v=jnp.concatenate([books.v, books.v]))),
      ("kv heads", dict(k=books.k[:, :1])),
      ("head_dim", dict(v=_books(head_dim=2 * D).v)),
  )
  for what, change in cases:
    bad = dataclasses.replace(books, **change)
    with pytest.raises(ValueError, match=f"codebooks.k covers .* {what} but codebooks.v"):
      bad.validate()
    bad.save(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match=what):
      vq.VQCodebooks.load(tmp_path / "bad.npz")
  ints = dataclasses.replace(books, k=books.k.astype(jnp.int8))
  with pytest.raises(TypeError, match="codebooks.k.dtype=int8 must be floating"):
    ints.validate()
  ints.save(tmp_path / "ints.npz")
  with pytest.raises(TypeError, match="int8"):
    vq.VQCodebooks.load(tmp_path / "ints.npz")


def test_vq_fit_format_argument_checks():
  x = np.zeros((1, 8, H, D))
  for dtype in (np.bool_, np.complex64):
    with pytest.raises(TypeError, match=f"k_samples.dtype={np.dtype(dtype).name}"):
      vq.fit(x.astype(dtype), x.astype(np.float32), VQF)
  with pytest.raises(ValueError, match="kv_heads=-2 must be a positive int"):
    VQF.bytes_per_token(-2, D)
  with pytest.raises(ValueError, match="context=-1"):
    VQF.bytes_per_token(2, D, context=-1)
  with pytest.raises(TypeError, match="name=None must be a VQ preset name"):
    vq.VQFormat.preset(None)


def test_calibration_kv_checks_tokens(model):
  tokens = np.asarray([[5, 6, 7, 0], [8, 9, 0, 0]])
  with pytest.raises(TypeError, match="tokens.dtype=float32 must be an integer dtype"):
    vq.calibration_kv(model, tokens.astype(np.float32) + 0.5, [4, 2])
  bad = tokens.copy()
  bad[1, 1] = CFG.vocab_size                       # a real token out of range
  with pytest.raises(ValueError, match=r"tokens must lie in \[0, 96\)"):
    vq.calibration_kv(model, bad, [4, 2])
  neg = tokens.copy()
  neg[0, 0] = -1
  with pytest.raises(ValueError, match="tokens must lie in"):
    vq.calibration_kv(model, neg, None)


# ------------------------------------------------------------- the model
def test_model_token_dtypes_checked_when_traced(model):
  cache = model.init_cache("bf16", 2, 16)
  tokens = jnp.asarray([[5, 6, 7], [8, 9, 0]], jnp.int32)
  with pytest.raises(TypeError, match="prompt_lengths.dtype=float32 must be an integer dtype"):
    jax.eval_shape(lambda t, n, c: model.prefill(t, n, c), tokens, jnp.asarray([3.7, 2.2]),
                   cache)
  with pytest.raises(TypeError, match="tokens.dtype=float32 must be an integer dtype"):
    jax.eval_shape(lambda t, c: model.decode(t, c), jnp.asarray([[5.9], [6.2]]), cache)
  with pytest.raises(TypeError, match="tokens.dtype=float32"):
    model.decode(jnp.asarray([[5.0], [6.0]]), cache)
  with pytest.raises(ValueError, match=r"tokens.shape=\(2, 0\): decode needs at least one"):
    model.decode(jnp.zeros((2, 0), jnp.int32), cache)


def test_model_positions_checked(model):
  """A [1, 1] positions array broadcast silently to every token; floats were accepted."""
  tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
  for bad in (jnp.zeros((1, 1), jnp.int32), jnp.arange(4, dtype=jnp.int32)):
    with pytest.raises(ValueError, match=r"positions.shape=.* must be the tokens' \[B, T\]"):
      model(tokens, bad)
    with pytest.raises(ValueError, match="positions.shape"):
      model.forward_kv(tokens, bad)
  with pytest.raises(TypeError, match="positions.dtype=float32 must be an integer dtype"):
    model(tokens, jnp.full((1, 4), 0.5))
  np.testing.assert_array_equal(np.asarray(model(tokens, jnp.arange(4)[None])),
                                np.asarray(model(tokens)))


def test_eager_prefill_accepts_any_padding_ids(model):
  """Only the real tokens must be ids: -1 padding was refused eagerly (not under jit)."""
  cache = model.init_cache("bf16", 2, 16)
  padded = np.asarray([[5, 6, -1, -1], [7, 8, 9, 10]])
  logits, got = model.prefill(padded, [2, 4], cache)
  _, want = model.prefill(np.where(padded < 0, 0, padded), [2, 4], model.init_cache("bf16", 2, 16))
  np.testing.assert_array_equal(np.asarray(got.lengths), [2, 4])
  got.check()
  np.testing.assert_array_equal(np.asarray(got.dequantize()[0]), np.asarray(want.dequantize()[0]))
  bad = padded.copy()
  bad[0, 1] = -7                                   # a real token out of range
  with pytest.raises(ValueError, match=r"tokens must lie in \[0, \d+\]; got out-of-range values \[-7\]"):
    model.prefill(bad, [2, 4], cache)
  with pytest.raises(ValueError, match=r"tokens.shape=\(2, 0\): prefill needs T >= 1"):
    model.prefill(np.zeros((2, 0), np.int32), [0, 0], cache)


# ------------------------------------------------- review of 2026-11-27 (fifth)
def test_plan_append_checks_shape_max_new_and_room():
  cache = ModelCache.init("kivi4", LAYERS, B, H, D, 8, jnp.float32)
  with pytest.raises(ValueError, match=r"num_new.shape=\(3,\) must be \(2,\)"):
    cache.plan_append(np.asarray([1, 1, 1]))
  with pytest.raises(ValueError, match=r"num_new.shape=\(2, 1\) must be \(2,\)"):
    cache.plan_append(np.asarray([[1], [2]]))
  with pytest.raises(ValueError, match="max_new=2.7 must be an int >= 0"):
    cache.plan_append(np.asarray([1, 1]), max_new=2.7)
  with pytest.raises(ValueError, match=r"num_new: sequences \[0, 1\] would grow past capacity=8"):
    cache.plan_append(9)  # a scalar: every sequence
  np.testing.assert_array_equal(np.asarray(cache.plan_append(3).num_new), [3, 3])


def test_codebooks_validate_checks_the_k_side_and_load_finds_npz(tmp_path):
  good = _books()
  wrong_k = vq.VQCodebooks(k=good.k[..., :2, :], v=good.v, fmt=VQF)  # 2 entries where 4
  with pytest.raises(ValueError, match=r"codebooks.k.shape=.* must be"):
    wrong_k.validate()
  path = str(tmp_path / "books")                  # no suffix: numpy writes books.npz
  good.save(path)
  back = vq.VQCodebooks.load(path)
  np.testing.assert_array_equal(np.asarray(back.k), np.asarray(good.k))
  assert back.fmt == good.fmt


def test_staged_attention_checks_shapes():
  from jaxkv.staged_cache import staged_attention  # pylint: disable=import-outside-toplevel
  cache = KVCache.init("kivi4", B, H, D, 64, jnp.float32)
  q = jnp.ones((B, 1, 2 * H, D), jnp.float32)
  stage = jnp.ones((B, 3, H, D), jnp.float32)
  staged = jnp.asarray([2, 2], jnp.int32)
  staged_attention(q, cache, stage, stage, staged)  # fine
  for k_stage, match in ((stage[:, :, :1], r"k_stage.shape=\(2, 3, 1, 16\) must be"),
                         (stage[:1], r"k_stage.shape=\(1, 3, 2, 16\) must be")):
    with pytest.raises(ValueError, match=match):
      staged_attention(q, cache, k_stage, k_stage, staged)
  with pytest.raises(ValueError, match=r"k_stage.shape=.* != v_stage.shape"):
    staged_attention(q, cache, stage, stage[:, :2], staged)
  with pytest.raises(ValueError, match=r"staged must be \[2\] integer counts"):
    staged_attention(q, cache, stage, stage, jnp.asarray([2.0, 2.0]))
  with pytest.raises(ValueError, match=r"q.shape=\(1, 1, 4, 16\) must be"):
    staged_attention(q[:1], cache, stage, stage, staged)


def test_vq_attention_refuses_a_config_the_reference_would_ignore():
  from pallas_kernels.vq_attention import VQAttentionConfig  # pylint: disable=import-outside-toplevel
  cache = VQCache.init(VQF, _books(layers=1), B, H, D, 64, jnp.float32, layer=0)
  cache = cache.prefill(_kv(20), _kv(20, seed=1), jnp.asarray([20, 9]))
  q = jnp.ones((B, 1, 2 * H, D), jnp.float32)
  for impl in (None, "reference"):
    with pytest.raises(ValueError, match="is for a Pallas kernel, but decode_attention runs"):
      jaxkv.decode_attention(q, cache, implementation=impl, config=VQAttentionConfig())


def test_vq_fit_seed_must_be_an_int():
  # Before: a float seed failed inside jit ("PRNG key seed must be an integer; got
  # JitTracer"), 2**70 with "Python int too large to convert to C long", True was taken as 1.
  x = np.random.default_rng(0).standard_normal((1, 16, H, D)).astype(np.float32)
  for bad in (1.5, True, 2**70, "0"):
    with pytest.raises(ValueError, match=re.escape(f"seed={bad!r} must be an int in int64")):
      vq.fit(x, x, VQF, iters=0, seed=bad)
  assert vq.fit(x, x, VQF, iters=0, seed=np.int64(-3)).k.shape[0] == 1


def test_vq_cache_dequantize_takes_the_kvcache_view_argument():
  # Before: VQCache.dequantize(view=...) was a bare "unexpected keyword argument" TypeError,
  # unlike KVCache / VQModelCache / decode_attention.
  cache = VQCache.init(VQF, _books(layers=1), batch=B, kv_heads=H, head_dim=D, capacity=32,
                       dtype=jnp.float32, layer=0)
  cache = cache.prefill(_kv(20), _kv(20, seed=1), [20, 3])
  k, v = cache.dequantize()
  k_t, v_t = cache.dequantize(view="target")
  np.testing.assert_array_equal(np.asarray(k_t), np.asarray(k))
  np.testing.assert_array_equal(np.asarray(v_t), np.asarray(v))
  with pytest.raises(ValueError, match=r"view='draft': a VQ cache has only the 'target' view"):
    cache.dequantize(view="draft")


@pytest.mark.parametrize("mesh", [None, "data=1,model=1"], ids=repr)
def test_mesh_arguments_are_checked(model, mesh):
  # Before: AttributeError "'str' object has no attribute 'shape'" (or 'NoneType') from
  # inside the sharding code.
  from models.sharding import shard_model  # pylint: disable=import-outside-toplevel
  match = r"mesh must be a jax.sharding.Mesh"
  cache = model.init_cache("bf16", 2, 16)
  tokens = np.ones((2, 3), np.int32)
  if mesh is not None:  # optional there: None is "no mesh"
    with pytest.raises(TypeError, match=match):
      model.prefill(tokens, np.asarray([3, 2]), cache, mesh=mesh)
    with pytest.raises(TypeError, match=match):
      model.decode(tokens[:, :1], cache, mesh=mesh)
    with pytest.raises(TypeError, match=match):
      llama.random_model(CFG, mesh=mesh)
    with pytest.raises(TypeError, match=match):
      llama.from_pretrained("/nonexistent", mesh=mesh)
  with pytest.raises(TypeError, match=match):
    jaxkv.sharding.init_sharded(lambda: model.init_cache("bf16", 2, 16), mesh)
  with pytest.raises(TypeError, match=match):
    shard_model(model, mesh)
  with pytest.raises(TypeError, match=match):
    jaxkv.sharded_decode_attention(jnp.ones((2, 1, 4, 32)), cache.layer(0), mesh)


def test_vq_codebooks_fmt_must_be_a_vqformat():
  # Before: a preset name was accepted, then failed later as "codebooks were learned for
  # cq2, not VQFormat(...)" and `save` as "asdict() should be called on dataclass instances".
  books = _books(layers=1)
  with pytest.raises(TypeError, match=r"fmt='cq2' must be a VQFormat"):
    vq.VQCodebooks(books.k, books.v, "cq2")
  doubled = jax.tree_util.tree_map(lambda x: 2 * x, books)  # tree ops still rebuild it
  assert doubled.fmt == books.fmt


def test_model_attention_impl_and_random_model_arguments(model):
  # Before: jax's "Unsupported implementation option: bogus" (no argument named); an int
  # dtype built a model of truncated weights; a float seed failed in nnx ("Invalid rng
  # value"), and so did a numpy int seed.
  tokens = np.ones((1, 4), np.int32)
  with pytest.raises(ValueError, match=r"attention_impl='bogus' must be None, 'xla' or 'cudnn'"):
    model(tokens, attention_impl="bogus")
  with pytest.raises(ValueError, match=r"attention_impl='bogus' must be None, 'xla' or 'cudnn'"):
    model.forward_kv(tokens, attention_impl="bogus")
  x = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match=r"implementation='bogus' must be None, 'xla' or 'cudnn'"):
    llama.causal_attention(x, x, x, implementation="bogus")
  cfg = dataclasses.replace(CFG, num_layers=1)
  with pytest.raises(TypeError, match=r"dtype=int32 must be a floating dtype"):
    llama.random_model(cfg, dtype=jnp.int32)
  for bad in (1.5, True, 2**64):
    with pytest.raises(ValueError, match=re.escape(f"seed={bad!r} must be an int")):
      llama.random_model(cfg, seed=bad)
  a = llama.random_model(cfg, seed=np.int64(2), dtype=jnp.float32)
  b = llama.random_model(cfg, seed=2, dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(a.embed_tokens[...]), np.asarray(b.embed_tokens[...]))


def test_vq_nearest_centroid_and_quantize_check_codebook_shapes():
  # Before: a codebook of wider vectors than x summed only x's channels (a wrong index,
  # silently), and more than 256 entries wrapped in the uint8 codes.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 2)), jnp.float32)
  with pytest.raises(ValueError, match=r"codebook.shape=\(5, 4\) must be \[..., E, v\]"):
    vq.nearest_centroid(x, jnp.asarray(rng.standard_normal((5, 4)), jnp.float32))
  with pytest.raises(ValueError, match=r"512 entries do not fit uint8 codes"):
    vq.quantize(jnp.ones((1, 1, 2, 4)), jnp.asarray(rng.standard_normal((1, 1, 1, 512, 4))))
  books = jnp.asarray(rng.standard_normal((5, 2)), jnp.float32)
  want = np.argmin(((np.asarray(x)[:, None] - np.asarray(books)[None]) ** 2).sum(-1), -1)
  np.testing.assert_array_equal(np.asarray(vq.nearest_centroid(x, books)), want)


def test_vq_cache_init_refuses_a_layer_it_would_ignore():
  # Before: layer= with a (k, v) pair was silently ignored (the pair's layer was used).
  books = _books()
  pair = books.layer(1)
  kw = dict(batch=B, kv_heads=H, head_dim=D, capacity=32, dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"layer=0 is only for VQCodebooks"):
    VQCache.init(VQF, pair, **kw, layer=0)
  a = VQCache.init(VQF, pair, **kw)
  b = VQCache.init(VQF, books, **kw, layer=1)
  np.testing.assert_array_equal(np.asarray(a.k_codebook), np.asarray(b.k_codebook))


def test_decode_checks_room_only_for_active_sequences(model):
  # Before: a full sequence that is inactive (finished) made model.decode refuse the
  # others ("sequences [0] would grow past capacity") though it appends nothing.
  tokens = np.random.default_rng(0).integers(3, CFG.vocab_size, (2, 8)).astype(np.int32)
  cache = model.init_cache("bf16", 2, 8, jnp.float32)
  _, cache = model.prefill(tokens, np.asarray([8, 5]), cache)
  nxt = np.asarray([[1], [2]], np.int32)
  logits, out = model.decode(nxt, cache, active=np.asarray([False, True]))
  np.testing.assert_array_equal(np.asarray(out.lengths), [8, 6])
  assert not np.asarray(out.overflow).any()
  with jax.default_matmul_precision("highest"):  # oracle: the full forward of sequence 1
    want = model(np.concatenate([tokens[1:, :5], nxt[1:]], axis=1))[0, -1]
  got = np.asarray(logits[1, 0])
  assert np.abs(got - np.asarray(want)).max() <= 1e-4 * np.abs(np.asarray(want)).max()
  with pytest.raises(ValueError, match=r"tokens: sequences \[0\] would grow past capacity=8"):
    model.decode(nxt, cache, active=np.asarray([True, False]))


@pytest.mark.parametrize("value", ["no", 1, 0.0])
def test_use_kernel_must_be_a_bool(value):
  """A truthy string would switch the pack kernel on: only None / True / False pass."""
  with pytest.raises(TypeError, match="use_kernel="):
    jaxkv.KVCache.init("kivi4", 1, 1, 64, 128, use_kernel=value)
  with pytest.raises(TypeError, match="use_kernel="):
    jaxkv.ModelCache.init("kivi4", 2, 1, 1, 64, 128, use_kernel=value)
  cb = vq.VQFormat.preset("cq4")
  with pytest.raises(TypeError, match="use_kernel="):
    jaxkv.VQModelCache.init(cb, 1, 1, 1, 64, 512, use_kernel=value)
  jaxkv.KVCache.init("kivi4", 1, 1, 64, 128, use_kernel=np.bool_(False))  # numpy bools pass
