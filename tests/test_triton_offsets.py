"""Arrays the Pallas Triton lowering would address wrongly are refused.

The lowering computes element offsets in int32 unless an array holds more than
2**32 bytes, so 1-byte arrays of 2-4 GiB overflow them (`_triton.offsets_overflow`;
a kivi4 cache of 160 x 32768 tokens read wrong values on an H200). Every Triton
launch refuses them with a ValueError, and the dispatchers fall back to a path
that reads them right, except the model cache's token append, which writes
such code arrays as uint16 words. Shapes only (`jax.eval_shape`) on the CPU:
nothing of that size is allocated there.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import attention as attn
from jaxkv.cache import QuantizedKV, _pack_addressable, quantize_kv
from jaxkv.formats import KVFormat
from jaxkv.model_cache import ModelCache
import pallas_kernels as pk
from pallas_kernels import _triton

S = jax.ShapeDtypeStruct
BIG_B = 136  # kivi4, 8 kv heads, 32768 tokens, D 128: 2.28e9 bytes of codes per side


@pytest.mark.parametrize("shape,dtype,bad", [
    ((2**31,), jnp.uint8, False),            # last offset 2**31 - 1: fits
    ((2**31 + 64,), jnp.uint8, True),
    ((2**32,), jnp.int8, True),              # 2**32 bytes: still 32-bit offsets
    ((2**32 + 1,), jnp.uint8, False),        # > 2**32 bytes: 64-bit offsets
    ((2**31 + 2,), jnp.bfloat16, False),     # > 2**32 bytes
    ((2**30 + 1,), jnp.bfloat16, False),     # < 2**31 elements
    ((BIG_B, 8, 32768, 64), jnp.uint8, True),
])
def test_offsets_overflow_window(shape, dtype, bad):
  why = _triton.offsets_overflow(S(shape, dtype), None, 3)
  assert (why is not None) == bad
  if bad:
    assert str(tuple(shape)) in why and "2**31" in why
    with pytest.raises(ValueError, match="implementation='mosaic' or 'xla'"):
      _triton.check_offsets(S(shape, dtype))


def _kivi4_cache_shapes(batch):
  fmt = KVFormat.preset("kivi4")
  return fmt, jax.eval_shape(functools.partial(
      jaxkv.KVCache.init, fmt, batch, 8, 128, 32768, jnp.bfloat16))


def test_triton_kernel_refuses_before_launch():
  fmt, cache = _kivi4_cache_shapes(BIG_B)
  q = S((BIG_B, 1, 32, 128), jnp.bfloat16)
  args = (q, cache.k.codes, cache.k.scale, cache.k.zero, cache.v.codes, cache.v.scale,
          cache.v.zero, cache.k_residual, cache.v_residual, cache.lengths)
  with pytest.raises(ValueError, match=r"\(136, 8, 32768, 64\).*2\*\*31"):
    jax.eval_shape(functools.partial(pk.dequant_decode_attention, fmt=fmt), *args)


def test_dispatch_does_not_pick_triton_for_such_a_cache():
  _, cache = _kivi4_cache_shapes(BIG_B)
  q = S((BIG_B, 1, 32, 128), jnp.bfloat16)
  ok, why = attn._triton_supported(q, cache)  # pylint: disable=protected-access
  assert not ok and "2**31" in why
  # a cache half that size is served
  _, small = _kivi4_cache_shapes(BIG_B // 2)
  ok, _ = attn._triton_supported(S((BIG_B // 2, 1, 32, 128), jnp.bfloat16), small)
  assert ok
  with pytest.raises(ValueError, match="2\\*\\*31"):
    jax.eval_shape(lambda q, c: jaxkv.decode_attention(q, c, implementation="triton"), q, cache)


def test_pack_kernel_left_for_the_jnp_quantizer():
  # a flush block whose 4-bit codes would be 2.28e9 bytes: the jnp quantizer
  x = S((BIG_B, 8, 32768, 128), jnp.bfloat16)
  assert not _pack_addressable(x, 4)
  assert _pack_addressable(S((BIG_B // 2, 8, 32768, 128), jnp.bfloat16), 4)
  side = _kivi4_cache_shapes(BIG_B)[1].v  # 4-bit codes per token
  assert isinstance(side, QuantizedKV)
  out = jax.eval_shape(lambda x: side.quantize(x, "float16", use_kernel=True), x)
  assert out[0].shape == (BIG_B, 8, 32768, 64) and out[0].dtype == jnp.uint8
  # T short of a block: the kernel writes codes padded to 64 tokens, which cross
  # 2**31 bytes where the unpadded ones would not
  t = 11184810
  x = S((1, 3, t, 128), jnp.bfloat16)
  assert 3 * t * 64 <= 2**31 < 3 * (-(-t // 64) * 64) * 64
  assert not _pack_addressable(x, 4)
  jax.eval_shape(lambda x: side.quantize(x, "float16", use_kernel=True), x)
  # K and V packed in one launch: the same fallback (per-channel K, 128-token groups)
  k_side = _kivi4_cache_shapes(BIG_B)[1].k
  x = S((BIG_B, 8, 32768, 128), jnp.bfloat16)
  out = jax.eval_shape(lambda a, b: quantize_kv(k_side, side, a, b, "float16", use_kernel=True),
                       x, x)
  assert out[0][0].shape == out[1][0].shape == (BIG_B, 8, 32768, 64)


def test_every_triton_launch_goes_through_the_check():
  root = pathlib.Path(__file__).resolve().parents[1] / "pallas_kernels"
  for path in root.glob("*.py"):
    text = path.read_text()
    if path.name != "_triton.py":
      assert "pl.pallas_call(" not in text, f"{path.name} launches Pallas Triton unchecked"


@pytest.mark.parametrize("field", ["edge_masks", "unmasked_guards"])
@pytest.mark.parametrize("num_queries,differs", [(1, True), (2, False)])
def test_unmasked_steps_change_the_program_only_at_one_query(num_queries, differs, field):
  """The kernel's jaxpr: the unmasked packed steps (no masks, no -inf guards) are
  taken at q_len 1 only.
  (Not the lowered text: on jax 0.11.2 the serialized Mosaic module differs
  between the two configs even at q_len 2, where the jaxprs are equal; the
  cause was not traced.)"""
  from pallas_kernels import mosaic_attention as ma
  from pallas_kernels.side_spec import SideSpec
  fmt = KVFormat.preset("kivi4")
  cache = jaxkv.KVCache.init(fmt, 1, 2, 128, 1024, jnp.bfloat16)
  q = jnp.zeros((1, num_queries, 8, 128), jnp.bfloat16)

  def text(on):
    config = ma.MosaicAttentionConfig(block_k=128, num_splits=2, **{field: on})
    call = functools.partial(
        ma.mosaic_decode_attention, k_side=SideSpec.of(fmt, "k", 128),
        v_side=SideSpec.of(fmt, "v", 128), token_group=fmt.token_group, residual=fmt.residual,
        sm_scale=0.1, config=config)
    return str(jax.make_jaxpr(call)(
        q, cache.k.codes, cache.k.scale, cache.k.zero, cache.v.codes, cache.v.scale,
        cache.v.zero, cache.k_residual, cache.v_residual, cache.lengths))

  assert (text(True) != text(False)) == differs


@pytest.mark.parametrize("batch,capacity", [(8, 32768), (1, 131072 + 256)])
def test_model_cache_append_writes_words(batch, capacity):
  """Stacked code arrays of 2-4 GiB (32 layers of kivi4: 8 x 32K, or one
  sequence of a little more than 128K) keep the one-launch token append: it
  writes them as uint16 words (no per-layer flush `lax.cond`, which costs ~1 ms
  per 32-layer step on an H200 through its host round trips)."""
  cache = jax.eval_shape(lambda: ModelCache.init("kivi4", 32, batch, 8, 128, capacity,
                                                 use_kernel=True))
  assert _triton.offsets_overflow(cache.k.codes) is not None
  k = S((batch, 1, 8, 128), jnp.bfloat16)

  def step(cache, k):
    plan = cache.plan_append(jnp.ones((batch,), jnp.int32))
    return cache.append_layer(31, k, k, plan)

  def primitives(jaxpr):  # outside the Pallas kernels' bodies
    for eqn in jaxpr.eqns:
      yield eqn.primitive.name, eqn.params
      if eqn.primitive.name == "pallas_call":
        continue
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
          if hasattr(sub, "eqns"):
            yield from primitives(sub)

  found = list(primitives(jax.make_jaxpr(step)(cache, k).jaxpr))
  names = [name for name, _ in found]
  assert "cond" not in names
  kernels = [str(p.get("name_and_src_info", p.get("name", ""))) for n, p in found
             if n == "pallas_call"]
  assert any("jaxkv_token_append" in x for x in kernels), kernels
  out = jax.eval_shape(step, cache, k)
  assert out.k.codes.shape == cache.k.codes.shape
  assert np.dtype(out.k.codes.dtype) == np.uint8


@pytest.mark.parametrize("preset,d", [("kivi4", 64), ("kivi4", 128), ("kivi2", 64),
                                      ("int8", 64), ("k8v4", 128), ("int4-token-g4", 128)])
def test_token_append_words_equal_bytes(preset, d):
  """The token append's uint16-word writes (`_triton.word_view`, taken for
  2-4 GiB code arrays) store the same bytes as its byte writes: a flush, a
  plain row and a skipped sequence, bit for bit (interpret mode). D 128 at
  4 bits: two column blocks per channel group; int4-token-g4: two per-token
  chunks per plane."""
  from pallas_kernels import token_append
  fmt = KVFormat.preset(preset)
  layers, b, h, cap = 2, 3, 2, 512
  r = fmt.residual
  cache = ModelCache.init(fmt, layers, b, h, d, cap, jnp.float32)
  keys = iter(jax.random.split(jax.random.PRNGKey(zlib.crc32(preset.encode())), 16))

  def fill(x):
    if np.dtype(x.dtype) == np.uint8:
      return jax.random.bits(next(keys), x.shape, jnp.uint8)
    return jax.random.normal(next(keys), x.shape, x.dtype)

  sides = [tuple(fill(x) for x in ((s.codes,) if s.bits == 16 else (s.codes, s.scale, s.zero)))
           for s in (cache.k, cache.v)]
  k_res, v_res = fill(cache.k_residual), fill(cache.v_residual)
  k_new, v_new = (jax.random.normal(next(keys), (b, h, d), jnp.float32) for _ in range(2))
  row = jnp.asarray([r - 1, 5, r], jnp.int32)      # flush, one row, none
  start = jnp.asarray([128, 0, 0], jnp.int32)
  info = [(s.bits, s.axis, s.group) for s in (cache.k, cache.v)]
  assert token_append.supported(*info, k_res.shape, fmt.token_group)
  outs = [token_append.append_token(
      k_res, v_res, k_new, v_new, row, row == r - 1, start, *sides, layer=1, k_side=info[0],
      v_side=info[1], interpret=True, words=words) for words in (False, True)]
  flat = [jax.tree_util.tree_leaves(o) for o in outs]
  for a, w in zip(*flat):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
  # the flush did write: sequence 0's group at packed rows [128, 256) of layer 1 changed
  for out, side in ((outs[0][2], sides[0]), (outs[0][3], sides[1])):
    assert not np.array_equal(np.asarray(out[0][1, 0, :, 128:256]),
                              np.asarray(side[0][1, 0, :, 128:256]))


def test_token_append_addressable_only_with_word_writes():
  """`token_append.addressable`: 2-4 GiB quantized code arrays are (as words),
  unless their rows or per-token runs are odd; any other 1-byte operand of
  that size is not (a 16-bit side stored in float8), and the model cache then
  takes its XLA path instead of raising."""
  from pallas_kernels import token_append
  res = S((32, 8, 8, 128, 128), jnp.bfloat16)
  codes = S((32, 8, 8, 32768, 64), jnp.uint8)       # 2**32 bytes: in the window
  scale = S((32, 8, 8, 32768, 1), jnp.float16)
  kivi_k, kivi_v = (4, "channel", 128), (4, "token", 128)
  assert token_append.addressable(kivi_k, kivi_v, res, res, (codes, scale, scale),
                                  (codes, scale, scale))
  per_token_1 = (4, "token", 1)                      # runs of one channel
  assert not token_append.addressable(kivi_k, per_token_1, res, res, (codes, scale, scale),
                                      (codes, scale, scale))
  f8 = S((32, 3, 8, 32768, 128), jnp.float8_e4m3fn)  # a 16-bit side's values, 1 byte
  assert not token_append.addressable((16, "token", None), (16, "token", None), res, res,
                                      (f8,), (f8,))
  cache = jax.eval_shape(lambda: ModelCache.init("bf16", 32, 3, 8, 128, 32768,
                                                 jnp.float8_e4m3fn, use_kernel=True))
  k = S((3, 1, 8, 128), jnp.float8_e4m3fn)

  def step(cache, k):
    plan = cache.plan_append(jnp.ones((3,), jnp.int32))
    return cache.append_layer(31, k, k, plan)

  out = jax.eval_shape(step, cache, k)
  assert out.k.codes.shape == cache.k.codes.shape


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="allocates ~5 GB on a GPU")
def test_large_cache_read_right_by_default_on_gpu():
  """A kivi4 cache of 136 sequences x 32768 tokens (2.28e9 bytes of codes per
  side): forced Triton refuses it; the default path (Mosaic on Hopper, else
  the XLA path) gives the spec's output for a sequence below the 2**31-th byte
  and one past it (sequence 135; Triton read those wrong, H200 2026-11-29)."""
  from pallas_kernels.dequant_attention import dequant_decode_attention_reference
  fmt = KVFormat.preset("kivi4")
  b, t = BIG_B, 32768
  cache = jaxkv.KVCache.init(fmt, b, 8, 128, t, jnp.bfloat16)
  keys = iter(jax.random.split(jax.random.PRNGKey(3), 9))

  def side(s):
    codes = jax.random.bits(next(keys), s.codes.shape, jnp.uint8)
    scale = jax.random.uniform(next(keys), s.scale.shape, jnp.float32, 0.03, 0.1)
    zero = jax.random.uniform(next(keys), s.zero.shape, jnp.float32, -1.0, 0.0)
    return dataclasses.replace(s, codes=codes, scale=scale.astype(s.scale.dtype),
                               zero=zero.astype(s.zero.dtype))

  cache = dataclasses.replace(
      cache, k=side(cache.k), v=side(cache.v),
      k_residual=jax.random.normal(next(keys), cache.k_residual.shape, jnp.bfloat16),
      v_residual=jax.random.normal(next(keys), cache.v_residual.shape, jnp.bfloat16),
      lengths=jnp.full((b,), t - 7, jnp.int32))
  q = jax.random.normal(next(keys), (b, 1, 32, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"2\*\*31"):
    jaxkv.decode_attention(q, cache, implementation="triton")
  out = np.asarray(jaxkv.decode_attention(q, cache), np.float64)
  for s in (0, b - 1):
    arrays = [x[s:s + 1] for x in (cache.k.codes, cache.k.scale, cache.k.zero, cache.v.codes,
                                  cache.v.scale, cache.v.zero, cache.k_residual,
                                  cache.v_residual)]
    ref = np.asarray(dequant_decode_attention_reference(
        q[s:s + 1], *arrays, cache.lengths[s:s + 1], fmt=fmt), np.float64)
    err = np.abs(out[s:s + 1] - ref).max() / np.abs(ref).max()
    assert err < 2e-2, f"sequence {s}: relative error {err:.2e}"


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="allocates ~4.5 GB on a GPU")
def test_word_append_flushes_the_top_of_a_large_cache_on_gpu():
  """A stacked kivi4 cache of 32 layers x 1 sequence x 131328 tokens (2**31 +
  4 Mi code bytes per side): the token that fills the last group of layer 31
  flushes it at the arrays' highest addresses (past the 2**31-th byte), through
  the word writes; the bytes written equal those of the same block flushed by
  a one-layer cache (byte writes) at its start."""
  fmt = KVFormat.preset("kivi4")
  cap, layers, h, d = 131072 + 256, 32, 8, 128
  big = ModelCache.init(fmt, layers, 1, h, d, cap, jnp.bfloat16)
  small = ModelCache.init(fmt, 1, 1, h, d, 256, jnp.bfloat16)
  assert _triton.offsets_overflow(big.k.codes) and not _triton.offsets_overflow(small.k.codes)
  key = jax.random.PRNGKey(11)
  k1, k2, k3, k4 = jax.random.split(key, 4)
  res = [jax.random.normal(k, (1, h, fmt.residual, d), jnp.bfloat16) for k in (k1, k2)]
  new = [jax.random.normal(k, (1, 1, h, d), jnp.bfloat16) for k in (k3, k4)]

  def staged(cache, layer, packed):  # group [packed, packed + R) holds R - 1 rows
    return dataclasses.replace(
        cache, k_residual=cache.k_residual.at[layer].set(res[0]),
        v_residual=cache.v_residual.at[layer].set(res[1]),
        lengths=jnp.full((1,), packed + fmt.residual - 1, jnp.int32))

  def flush(cache, layer):
    plan = cache.plan_append(jnp.ones((1,), jnp.int32))
    return cache.append_layer(layer, *new, plan)

  top = cap - fmt.residual
  got = jax.jit(flush, static_argnums=1, donate_argnums=0)(staged(big, layers - 1, top),
                                                           layers - 1)
  want = jax.jit(flush, static_argnums=1)(staged(small, 0, 0), 0)
  for g, w in ((got.k, want.k), (got.v, want.v)):
    np.testing.assert_array_equal(np.asarray(g.codes[layers - 1, 0, :, top:]),
                                  np.asarray(w.codes[0, 0, :, :fmt.residual]))
    assert np.asarray(w.codes[0, 0, :, :fmt.residual]).any()
