"""Argument checks of the attention entry points, quantization and packing.

Each bad argument raises a ValueError/TypeError naming it, in Python before
anything runs. Tiny shapes; nothing here runs a kernel past its checks except
where a good argument must still be accepted.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
import pallas_kernels as pk
from jaxkv import hierarchical, quant
from jaxkv.chunked_attention import chunk_attention
from jaxkv.formats import PRESETS, VALID_SCALE_DTYPES
from pallas_kernels import layout
from pallas_kernels.mosaic_attention import MosaicAttentionConfig

FMT = dataclasses.replace(PRESETS["kivi4"], token_group=32, residual=32)
B, HKV, HQ, D, CAP = 2, 2, 4, 64, 128


@pytest.fixture(scope="module")
def case():
  """An empty kivi4 cache and one query: the checks run before any data is read."""
  cache = jaxkv.KVCache.init(FMT, batch=B, kv_heads=HKV, head_dim=D, capacity=CAP,
                             dtype=jnp.float32)
  q = jnp.asarray(np.random.default_rng(0).standard_normal((B, 1, HQ, D)), jnp.float32)
  return q, cache


def _raw_args(cache):
  return [cache.k.codes, cache.k.scale, cache.k.zero, cache.v.codes, cache.v.scale,
          cache.v.zero, cache.k_residual, cache.v_residual]


# ------------------------------------------------------------- decode_attention
@pytest.mark.parametrize("impl", [None, "reference", "triton", ("triton", "reference")])
def test_decode_attention_config_must_be_a_kernel_config(case, impl):
  q, cache = case
  with pytest.raises(TypeError, match="config='junk' must be a pallas_kernels.DecodeAttention"):
    jaxkv.decode_attention(q, cache, implementation=impl, config="junk")


def test_decode_attention_config_family_must_match_the_implementation(case):
  q, cache = case
  with pytest.raises(ValueError, match="implementation='triton'.*MosaicAttentionConfig"):
    jaxkv.decode_attention(q, cache, implementation="triton", config=MosaicAttentionConfig())
  with pytest.raises(ValueError, match="implementation='mosaic'.*DecodeAttentionConfig"):
    jaxkv.decode_attention(q, cache, implementation="mosaic",
                           config=pk.DecodeAttentionConfig(block_k=32, num_splits=2))


@pytest.mark.parametrize("impl,err,match", [
    (3, TypeError, "implementation=3 must be a str"),
    ((), ValueError, r"implementation=\(\) must name at least one"),
    ([], ValueError, r"implementation=\[\] must name at least one"),
    (("triton", 3), TypeError, r"implementation=\('triton', 3\) must hold only str"),
])
def test_decode_attention_implementation_type(case, impl, err, match):
  q, cache = case
  with pytest.raises(err, match=match):
    jaxkv.decode_attention(q, cache, implementation=impl)


@pytest.mark.parametrize("scale", [1e39, 2 ** 1100, np.float64(1e39)])
def test_scale_that_overflows_float32_raises(case, scale):
  q, cache = case
  with pytest.raises(ValueError, match="must be finite"):
    jaxkv.decode_attention(q, cache, scale=scale)
  with pytest.raises(ValueError, match="must be finite in float32"):
    pk.pallas_decode_attention(q, cache, scale=scale, interpret=True)


# ------------------------------------------------------ dequant_decode_attention
@pytest.mark.parametrize("index,cut,match", [
    (3, "heads", r"v_codes.shape=\(2, 1, "),
    (4, "heads", r"v_scale.shape=\(2, 1, "),
    (5, "tokens", r"v_zero.shape="),
    (1, "tokens", r"k_scale.shape="),
    (6, "heads", r"k_residual.shape=\(2, 1, "),
    (7, "tokens", r"v_residual.shape="),
])
def test_raw_kernel_checks_every_operand_shape(case, index, cut, match):
  q, cache = case
  args = _raw_args(cache)
  args[index] = args[index][:, :1] if cut == "heads" else args[index][:, :, :1]
  with pytest.raises(ValueError, match=match):
    pk.dequant_decode_attention(q, *args, cache.lengths, fmt=FMT, interpret=True)


@pytest.mark.parametrize("lengths", [[500, 50], [-5, 50]])
def test_raw_kernel_checks_concrete_lengths(case, lengths):
  q, cache = case
  with pytest.raises(ValueError, match=r"lengths=\[.*\] must lie in \[0, C \+ R"):
    pk.dequant_decode_attention(q, *_raw_args(cache), jnp.array(lengths), fmt=FMT,
                                interpret=True)


def test_raw_kernel_checks_scale_dtypes_and_seq_bad(case):
  q, cache = case
  args = _raw_args(cache)
  with pytest.raises(ValueError, match="scale=nan must be finite"):
    pk.dequant_decode_attention(q, *args, cache.lengths, fmt=FMT, scale=float("nan"),
                                interpret=True)
  bad = list(args)
  bad[0] = bad[0].astype(jnp.int32)
  with pytest.raises(TypeError, match="k_codes.dtype=int32 must be uint8"):
    pk.dequant_decode_attention(q, *bad, cache.lengths, fmt=FMT, interpret=True)
  with pytest.raises(ValueError, match=r"seq_bad must be a bool \[2\] array"):
    pk.dequant_decode_attention(q, *args, cache.lengths, fmt=FMT, interpret=True,
                                seq_bad=jnp.zeros((5,), bool))


def test_raw_kernel_traces_with_traced_lengths_scale_and_layer(case):
  """Traced lengths, scale and layer pass the checks (no value is read)."""
  q, cache = case
  stacked = [x[None] for x in _raw_args(cache)]
  config = pk.DecodeAttentionConfig(block_k=32, num_splits=2)
  out = jax.eval_shape(lambda q, args, lengths, s, i: pk.dequant_decode_attention(
      q, *args, lengths, fmt=FMT, scale=s, config=config, interpret=True, layer=i),
                       q, stacked, jnp.array([70, 50]), jnp.float32(0.1), jnp.int32(0))
  assert out.shape == q.shape
  with pytest.raises(ValueError, match=r"layer=1 must lie in \[0, 1\)"):
    pk.dequant_decode_attention(q, *stacked, jnp.array([70, 50]), fmt=FMT, interpret=True,
                                layer=1)


# ---------------------------------------------------------------- configs
@pytest.mark.parametrize("kwargs,match", [
    (dict(num_splits=2.5), "num_splits=2.5 must be an int"),
    (dict(num_splits=True), "num_splits=True must be an int"),
    (dict(num_stages=2.5), "num_stages=2.5 must be an int"),
    (dict(num_warps=4.0), "num_warps=4.0 must be an int"),
    (dict(block_k=64.0), "block_k=64.0 must be an int"),
])
def test_decode_attention_config_int_fields(kwargs, match):
  with pytest.raises(ValueError, match=match):
    pk.DecodeAttentionConfig(**kwargs)


def test_decode_attention_config_takes_numpy_ints():
  config = pk.DecodeAttentionConfig(block_k=np.int64(64), num_splits=np.int32(4))
  assert config == pk.DecodeAttentionConfig(block_k=64, num_splits=4)
  assert type(config.block_k) is int and type(config.num_splits) is int


# ------------------------------------------------------- pallas_chunk_attention
def _chunk_operands(cache):
  rng = np.random.default_rng(1)
  k_hist = v_hist = jnp.asarray(rng.standard_normal((B, CAP, HKV, D)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((B, 8, HQ, D)), jnp.float32)
  kc = jnp.asarray(rng.standard_normal((B, 8, HKV, D)), jnp.float32)
  return q, k_hist, v_hist, kc


@pytest.mark.parametrize("hist_len,err,match", [
    (jnp.array([500, 50]), ValueError, r"hist_len=\[500, 50\] must lie in \[0, C=128\]"),
    (jnp.array([-3, 50]), ValueError, r"hist_len=\[-3, 50\] must lie in"),
    (jnp.array([99.9, 50.5]), TypeError, "hist_len.dtype=float32 must be an integer"),
    (jnp.array([100, 50, 7]), ValueError, r"hist_len.shape=\(3,\) must be \(2,\)"),
])
def test_pallas_chunk_attention_checks_hist_len(case, hist_len, err, match):
  q, k_hist, v_hist, kc = _chunk_operands(case[1])
  with pytest.raises(err, match=match):
    pk.pallas_chunk_attention(q, k_hist, v_hist, hist_len, kc, kc, scale=0.125, interpret=True)


def test_pallas_chunk_attention_checks_scale_and_q(case):
  q, k_hist, v_hist, kc = _chunk_operands(case[1])
  hist_len = jnp.array([70, 50])
  with pytest.raises(ValueError, match="scale=nan must be finite"):
    pk.pallas_chunk_attention(q, k_hist, v_hist, hist_len, kc, kc, scale=float("nan"),
                              interpret=True)
  with pytest.raises(TypeError, match="q.dtype=int32 must be floating"):
    pk.pallas_chunk_attention(q.astype(jnp.int32), k_hist, v_hist, hist_len, kc, kc,
                              scale=0.125, interpret=True)
  # A float32 history under bfloat16 queries was rounded silently.
  with pytest.raises(TypeError, match="k_hist.dtype=float32 must equal q.dtype=bfloat16"):
    pk.pallas_chunk_attention(q.astype(jnp.bfloat16), k_hist, v_hist, hist_len,
                              kc.astype(jnp.bfloat16), kc.astype(jnp.bfloat16), scale=0.125,
                              interpret=True)


# ------------------------------------------------------------ chunk_attention
def test_chunk_attention_checks_chunk_dtypes_and_lengths(case):
  _, cache = case
  q, _, _, kc = _chunk_operands(cache)
  for bad in (kc.astype(jnp.int32), kc > 0, kc.astype(jnp.bfloat16)):
    with pytest.raises(TypeError, match=f"k_chunk.dtype={bad.dtype} must be the cache dtype"):
      chunk_attention(q, cache, bad, kc, implementation="reference")
  with pytest.raises(TypeError, match="v_chunk.dtype=int32 must be the cache dtype"):
    chunk_attention(q, cache, kc, kc.astype(jnp.int32), implementation="reference")
  with pytest.raises(TypeError, match="chunk_lengths.dtype=float32 must be an integer"):
    chunk_attention(q, cache, kc, kc, jnp.array([1.5, 2.5]), implementation="reference")
  with pytest.raises(ValueError, match=r"chunk_lengths=\[100, -3\] must lie in \[0, c=8\]"):
    chunk_attention(q, cache, kc, kc, jnp.array([100, -3]), implementation="reference")


def test_chunk_attention_block_sizes(case):
  _, cache = case
  q, _, _, kc = _chunk_operands(cache)
  with pytest.raises(TypeError, match="block_q=True must be an int"):
    chunk_attention(q, cache, kc, kc, implementation="xla", block_q=True)
  with pytest.raises(TypeError, match="config='junk' must be a ChunkAttentionConfig"):
    chunk_attention(q, cache, kc, kc, implementation="reference", config="junk")
  out = jax.eval_shape(lambda q: chunk_attention(q, cache, kc, kc, implementation="xla",
                                                 block_q=np.int32(8), block_k=np.int64(64)), q)
  assert out.shape == q.shape


# ---------------------------------------------------------------- pack
@pytest.mark.parametrize("codes,bits", [([[20, 0, 3, 1]], 4), ([[-1, 0]], 4), ([[4, 0, 1, 2]], 2),
                                        ([[300, 0]], 8)])
def test_pack_rejects_out_of_range_codes(codes, bits):
  with pytest.raises(ValueError, match=f"must lie in \\[0, {(1 << bits) - 1}\\] for bits={bits}"):
    quant.pack(jnp.array(codes, jnp.int32), bits)


def test_pack_rejects_float_codes_and_accepts_ints():
  with pytest.raises(TypeError, match="codes.dtype=float32 must be an integer dtype"):
    quant.pack(jnp.array([[1.7, 2.2]], jnp.float32), 4)
  packed = quant.pack(jnp.array([[15, 0, 3, 1]], jnp.int32), 4)
  np.testing.assert_array_equal(np.asarray(quant.unpack(packed, 4)), [[15, 0, 3, 1]])
  traced = jax.jit(lambda c: quant.pack(c, 4))(jnp.array([[15, 0, 3, 1]], jnp.int32))
  np.testing.assert_array_equal(np.asarray(traced), np.asarray(packed))


# ------------------------------------------------------ quantize / dequantize
def test_scale_dtypes_agree_with_kvformat():
  """pallas_kernels cannot import jaxkv: its copy of the list must stay the same."""
  assert layout.SCALE_DTYPES == VALID_SCALE_DTYPES


@pytest.mark.parametrize("sdt", ["int8", "float64", "bogus"])
def test_quantize_rejects_scale_dtype(sdt):
  x = jnp.ones((2, 8, 16), jnp.float32)
  with pytest.raises(ValueError, match=f"scale_dtype='{sdt}' must be one of"):
    quant.quantize(x, 4, axis="token", group=8, scale_dtype=sdt)
  with pytest.raises(ValueError, match=f"scale_dtype='{sdt}' must be one of"):
    pk.quantize_pack(jnp.ones((2, 32, 64), jnp.float32), 4, axis="token", group=32,
                     scale_dtype=sdt, interpret=True)


@pytest.mark.parametrize("group", [0, -8, 8.0, True])
def test_quantize_rejects_group(group):
  x = jnp.ones((2, 8, 16), jnp.float32)
  for axis in ("token", "channel"):
    with pytest.raises(ValueError, match=f"group={group!r} must be a positive int"):
      quant.quantize(x, 4, axis=axis, group=group)
  with pytest.raises(ValueError, match=f"group={group!r} must be a power of two"):
    pk.quantize_pack(jnp.ones((2, 32, 64), jnp.float32), 4, axis="token", group=group,
                     interpret=True)


def test_dequantize_checks_scale_shapes_and_bits():
  """[2, 8, 16] at 4 bits: per token with Gd = 8, per channel with G = 4."""
  p = pc = jnp.zeros((2, 8, 8), jnp.uint8)
  s = z = jnp.ones((2, 8, 2), jnp.float16)
  sc = zc = jnp.ones((2, 2, 16), jnp.float16)
  for bad_s, bad_z in ((s[:, :1], z[:, :1]), (s[:1], z[:1])):
    with pytest.raises(ValueError, match=r"scale.shape=\(.*\) must be"):
      quant.dequantize(p, bad_s, bad_z, 4, axis="token")
  with pytest.raises(ValueError, match=r"zero.shape=\(2, 1, 2\) must equal scale.shape"):
    quant.dequantize(p, s, z[:, :1], 4, axis="token")
  with pytest.raises(TypeError, match="scale.dtype=int8 must be floating"):
    quant.dequantize(p, s.astype(jnp.int8), z, 4, axis="token")
  with pytest.raises(ValueError, match=r"scale.shape=\(1, 2, 16\) must be"):
    quant.dequantize(pc, sc[:1], zc[:1], 4, axis="channel")
  with pytest.raises(ValueError, match="bits=8 does not fit"):
    quant.dequantize(pc, sc, zc, 8, axis="channel")
  shape = jax.eval_shape(lambda *a: quant.dequantize(*a, 4, axis="channel"), pc, sc, zc).shape
  assert shape == (2, 8, 16)


def test_a_config_is_never_silently_ignored(case):
  """On CPU the default (and 'reference') ran the reference and dropped the config."""
  q, cache = case
  cfg = pk.DecodeAttentionConfig(block_k=32, num_splits=2)
  for impl in (None, "reference"):
    with pytest.raises(ValueError, match="is for a Pallas kernel, but decode_attention runs"):
      jaxkv.decode_attention(q, cache, implementation=impl, config=cfg)
  q2, _, _, kc = _chunk_operands(cache)
  from pallas_kernels.chunk_attention import ChunkAttentionConfig  # pylint: disable=import-outside-toplevel
  for kw in (dict(config=ChunkAttentionConfig()), dict(interpret=True)):
    with pytest.raises(ValueError, match="are for implementation='pallas'"):
      chunk_attention(q2, cache, kc, kc, implementation="reference", **kw)


def test_autotune_checks_cache_and_candidates(case):
  q, cache = case
  model_cache = jaxkv.ModelCache.init(FMT, 1, B, HKV, D, CAP, jnp.float32)
  for bad in (model_cache, model_cache.layer_view(0), "kivi4"):
    with pytest.raises(TypeError, match="cache must be a jaxkv.KVCache"):
      jaxkv.autotune(q, bad)
  with pytest.raises(ValueError, match=r"candidates=\[\] gives nothing to time"):
    jaxkv.autotune(q, cache, candidates=[])
  with pytest.raises(TypeError, match="candidates must be pallas_kernels.DecodeAttentionConfig"):
    jaxkv.autotune(q, cache, candidates=["fast"])


def test_kernel_entry_points_refuse_what_they_would_ignore(case):
  """Third review (2026-11-27): flags that are not bools, a view a format has not,
  a hand-built draft weight whose parts disagree, timing helpers with no calls."""
  q, cache = case
  with pytest.raises(ValueError, match="fast_exp='no' must be a bool"):
    pk.DecodeAttentionConfig(fast_exp="no")
  with pytest.raises(ValueError, match="defer_sums=None must be a bool"):
    pk.DecodeAttentionConfig(defer_sums=None)
  assert pk.DecodeAttentionConfig(prefetch=np.bool_(False)).prefetch is False
  from pallas_kernels.dequant_attention import dequant_decode_attention_reference  # pylint: disable=import-outside-toplevel
  for view in ("draft", "nonsense"):
    with pytest.raises(ValueError, match=f"view='{view}' must be 'target'"):
      dequant_decode_attention_reference(q, *_raw_args(cache), cache.lengths, fmt=cache.fmt,
                                         view=view)
  from models.draft_weights import QuantizedWeight, quantize_kernel  # pylint: disable=import-outside-toplevel
  w = jnp.asarray(np.random.default_rng(2).standard_normal((256, 32)), jnp.float32)
  qw = quantize_kernel(w, group_size=64)
  with pytest.raises(ValueError, match=r"scale.shape=\(1, 32\) must be \(4, 32\)"):
    QuantizedWeight(qw.codes, qw.scale[:1], qw.zero[:1], group=64, bits=4)
  for kw, match in ((dict(bits=2), "bits=2 must be one of"), (dict(group=48), "group=48 must divide"),
                    (dict(group=3), "group=3 must be a positive int")):
    with pytest.raises(ValueError, match=match):
      QuantizedWeight(qw.codes, qw.scale, qw.zero, **{"group": 64, "bits": 4, **kw})
  with pytest.raises(ValueError, match="must be a 2-D"):
    quantize_kernel(w[0])
  from jaxkv import timing  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match="firsts must hold at least one"):
    timing.device_time(lambda x: x, [])
  with pytest.raises(ValueError, match="reps=0 must be an int >= 1"):
    timing.device_time(lambda x: x, [jnp.ones(2)], reps=0)
  with pytest.raises(ValueError, match="calls=2.5 must be an int >= 1"):
    timing.kernel_time(lambda x: x, [(jnp.ones(2),)], calls=2.5)


def test_hierarchical_dequantize_checks_scale_shape_and_group():
  # Before: the target view broadcast a scale of the other axis into a wrong [..., T, D]
  # result (the draft view already refused it), and group=0 was a ZeroDivisionError.
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16, 8)), jnp.float32)
  for axis, other in (("token", "channel"), ("channel", "token")):
    codes, scale, zero = hierarchical.quantize(x, axis=axis, group=8, block=8,
                                               scale_dtype="float16")
    for view in ("target", "draft"):
      with pytest.raises(ValueError, match=r"scale\.shape=\("):
        hierarchical.dequantize(codes, scale, zero, axis=other, block=8, view=view)
    with pytest.raises(ValueError, match=r"scale.shape=\(.* must have the rank of codes"):
      hierarchical.dequantize(codes, scale[0], zero[0], axis=axis, block=8)
    # the right operands: within the target view's bound S_U / 16 (+ rounding of S_U)
    got = hierarchical.dequantize(codes, scale, zero, axis=axis, block=8)
    bound = np.asarray(scale, np.float32).max() / 16
    assert np.abs(np.asarray(got) - np.asarray(x)).max() <= bound * 1.01
  for bad in (0, -1, True):
    with pytest.raises(ValueError, match=re.escape(f"group={bad!r} must be a positive int")):
      hierarchical.quantize(x, axis="token", group=bad, block=8, scale_dtype="float16")
