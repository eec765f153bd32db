"""The Mosaic GPU (Hopper) dequant-attention kernel.

On a Hopper GPU every case runs compiled and is compared with a float64 numpy
oracle over ``cache.dequantize()``. Elsewhere (CI) JAX's Mosaic GPU interpret
mode cannot run these kernels (jax 0.10.2: no discharge rule for TMA copies
under ``interpret=True``; the GPU interpreter fails on the barrier shapes), so
the CPU cases lower the kernel for CUDA (``lowering_platforms=("cuda",)``),
which runs the whole Pallas -> Mosaic GPU lowering, layout checks included,
and stops before PTX.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import is_hopper
from jaxkv.formats import PRESETS
from pallas_kernels import mosaic_attention as ma
from pallas_kernels.side_spec import SideSpec
from tests.oracle import np_attention

ON_HOPPER = is_hopper()

# (format, B, Hkv, Hq/Hkv, D, S, lengths, capacity, dtype)
CASES = [
    ("kivi4", 2, 2, 4, 128, 1, (300, 129), 512, jnp.bfloat16),   # mid-group end
    ("kivi4", 2, 1, 8, 128, 1, (512, 60), 512, jnp.bfloat16),    # full / empty packed (slow)
    ("kivi4", 1, 2, 3, 64, 4, (451,), 512, jnp.bfloat16),        # GQA 3, S 4, D 64
    ("kivi4", 1, 2, 6, 128, 8, (777,), 1024, jnp.float16),       # GQA 6, S 8, f16 (slow)
    ("kivi2", 2, 1, 8, 128, 1, (511, 250), 512, jnp.bfloat16),
    ("kivi2", 1, 4, 1, 128, 2, (1000,), 1024, jnp.float16),      # GQA 1
    ("int8", 2, 2, 4, 128, 1, (300, 7), 512, jnp.bfloat16),
    ("int8", 1, 1, 4, 64, 3, (200,), 256, jnp.float16),
    ("k8v4", 2, 2, 4, 128, 1, (1000, 513), 1024, jnp.bfloat16),
    ("bf16", 2, 2, 4, 128, 1, (300, 129), 512, jnp.bfloat16),
    ("kivi4-r2g", 1, 2, 4, 128, 1, (700,), 1024, jnp.bfloat16),  # R = 2G
    # K growing along the sequence: the lazy running max must move mid-split.
    ("kivi4-grow", 1, 2, 4, 128, 1, (1000,), 1024, jnp.bfloat16),  # (slow)
    ("k8v4-grow", 2, 1, 4, 64, 2, (900, 700), 1024, jnp.float16),
]
# Off Hopper a case only lowers its configs for CUDA, so the lengths and the data
# (full / empty packed, growing K) are never run, and these cases lower the same
# programs as kept ones (GQA 8 D 128: kivi2; S > 1 with f16: kivi2, int8,
# k8v4-grow; kivi4 D 128 bf16 at GQA 4: the first case). They stay in the full
# run (`pytest tests`), which is what runs them on Hopper.
_SLOW_CASES = {1, 3, 11}
_TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}  # max |out - oracle| / max |oracle|


def _fmt(name):
  if name.endswith("-r2g"):
    return dataclasses.replace(PRESETS[name[:-4]], token_group=64, residual=128)
  return PRESETS[name.removesuffix("-grow")]


def _grows_within_splits(q, kd, lengths, parts=3, first=64):
  """Whether, in each of ``parts`` equal token ranges of every sequence, some
  query's score exceeds that range's first-``first``-token max by more than
  the lazy max's margin (so the kernels' exact-rescale branch runs)."""
  qf = np.asarray(q, np.float64)                       # [B, S, Hq, D]
  kf = np.asarray(kd, np.float64)                      # [B, T, Hkv, D]
  group = qf.shape[2] // kf.shape[2]
  for b, n in enumerate(lengths):
    s = np.einsum("shd,thd->sht", qf[b], np.repeat(kf[b, :n], group, axis=1)) / np.sqrt(
        qf.shape[-1])
    for lo in range(0, n - first, max(1, n // parts)):
      hi = min(n, lo + n // parts)
      if not (s[..., lo + first:hi].max(-1) - s[..., lo:lo + first].max(-1)
              > ma.LAZY_MARGIN).any():
        return False
  return True


def _key(*parts):
  return jax.random.PRNGKey(zlib.crc32(repr(parts).encode()))


def _cache(fmt, b, hkv, d, lengths, capacity, dtype, key, grow=False):
  t = max(lengths)
  k1, k2 = jax.random.split(key)
  k = jax.random.normal(k1, (b, t, hkv, d)) * 1.5 + 0.2
  if grow:  # scores grow along the sequence (x1 -> x12)
    k = k * (1.0 + 11.0 * jnp.arange(t) / t)[None, :, None, None]
  k = k.astype(dtype)
  v = jax.random.normal(k2, (b, t, hkv, d)).astype(dtype)
  cache = jaxkv.KVCache.init(fmt, b, hkv, d, capacity, dtype, use_kernel=False)
  return cache.prefill(k, v, jnp.asarray(lengths, jnp.int32))


def _call(q, cache, config):
  fmt, d = cache.fmt, cache.head_dim
  return ma.mosaic_decode_attention(
      q, cache.k.codes, cache.k.scale, cache.k.zero, cache.v.codes, cache.v.scale,
      cache.v.zero, cache.k_residual, cache.v_residual, cache.lengths,
      k_side=SideSpec.of(fmt, "k", d), v_side=SideSpec.of(fmt, "v", d),
      token_group=fmt.token_group, residual=fmt.residual, sm_scale=d ** -0.5, config=config)


def _assert_lowers(q, cache, config) -> str:
  """The call lowers for CUDA through Mosaic GPU (stops before PTX; runs off
  Hopper too); returns the lowered module's text."""
  text = jax.jit(_call, static_argnums=2).trace(q, cache, config).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  return text


def _checked_outputs(q, cache, lengths, configs, dtype):
  """Off Hopper: each config lowers for CUDA (returns None). On Hopper: each
  output is finite and within `_TOL` of the float64 oracle; returns ``{config:
  output, "oracle": reference}``."""
  if not ON_HOPPER:
    for config in configs:
      _assert_lowers(q, cache, config)
    return None
  kd, vd = cache.dequantize()
  ref = np_attention(np.asarray(q, np.float64), np.asarray(kd), np.asarray(vd), lengths)
  outs = {"oracle": ref}
  for config in configs:
    out = np.asarray(jax.jit(_call, static_argnums=2)(q, cache, config), np.float64)
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert np.isfinite(out).all(), f"{config=}"
    assert err < _TOL[dtype], f"{config=}: max rel err {err:.2e}"
    outs[config] = out
  return outs


@pytest.mark.parametrize(
    "name,b,hkv,group,d,s,lengths,capacity,dtype",
    [pytest.param(*c, marks=[pytest.mark.slow] if i in _SLOW_CASES else [],
                  id=f"{c[0]}_b={c[1]}_hkv={c[2]}_g={c[3]}_d={c[4]}_s={c[5]}_{jnp.dtype(c[8]).name}")
     for i, c in enumerate(CASES)])
def test_mosaic_attention(name, b, hkv, group, d, s, lengths, capacity, dtype):
  fmt = _fmt(name)
  ok, why = ma.supports(SideSpec.of(fmt, "k", d), SideSpec.of(fmt, "v", d), head_dim=d,
                        q_rows=group * s, dtype=dtype, token_group=fmt.token_group,
                        residual=fmt.residual)
  assert ok, why
  key = _key(name, b, hkv, group, d, s, lengths)
  cache = _cache(fmt, b, hkv, d, lengths, capacity, dtype, key, grow=name.endswith("-grow"))
  q = jax.random.normal(jax.random.fold_in(key, 1), (b, s, hkv * group, d)).astype(dtype)
  if name.endswith("-grow"):  # the case must really exercise the lazy max's rescale branch
    assert _grows_within_splits(q, cache.dequantize()[0], lengths)
  # Tokens on M (v2, the default) with and without folded scales, and query
  # rows on M (v1).
  configs = [ma.MosaicAttentionConfig(block_k=64, num_splits=3, tokens_m=t, fold_scales=f,
                                      register_k=False, register_v=False)
             for t, f in ((True, True), (True, False), (False, False))]
  # K (and V) through the register dequant (`mosaic_dequant`; ignored where it
  # does not apply).
  configs.append(ma.MosaicAttentionConfig(block_k=64, num_splits=3, register_k=True))
  configs.append(ma.MosaicAttentionConfig(block_k=64, num_splits=3, register_k=True,
                                          register_v=True, register_vt=False))
  # 4-bit V as the value MMA's register operand (ldmatrix), unswizzled tiles too.
  configs.append(ma.MosaicAttentionConfig(block_k=64, num_splits=3, register_vt=True,
                                          vt_swizzle=False))
  # The exact per-step max (no lazy reference), V built after the softmax.
  configs.append(ma.MosaicAttentionConfig(block_k=64, num_splits=3, lazy_max=False,
                                          early_v=False))
  k_side = SideSpec.of(fmt, "k", d)
  if (k_side.bits in (2, 4) and k_side.axis == "channel" and fmt.token_group % 128 == 0
      and fmt.residual % 128 == 0 and capacity % 128 == 0):
    configs.append(ma.MosaicAttentionConfig(block_k=128, num_splits=2, register_k=True,
                                            register_v=True))
  # Codes as exact integers (magic-number subtraction) instead of bf16 subnormals
  # (`mosaic_dequant.K_SHIFT`, ``P_SHIFT``): the scores agree bit for bit, the
  # value MMA's f32 sums by a few units in the last place (H100), so the two
  # outputs are within one rounding to q's dtype of each other.
  twins = (configs[-1], dataclasses.replace(configs[-1], subnormal_k=False,
                                                subnormal_v=False))
  configs.append(twins[1])
  # Subnormal codes shifted to the bottom of their bytes (no byte masks: a shift
  # per pair) against the default byte masks (one shift per word: K's registers
  # the same, V's product rows brought back by powers of two).
  assert twins[0].byte_masks
  byte_twin = dataclasses.replace(twins[0], byte_masks=False)
  configs.append(byte_twin)
  # K scale/zero pairs shared by warp shuffles: the same K registers, so the
  # same output bit for bit.
  shuffle_twin = dataclasses.replace(twins[0], shuffle_scales=True)
  configs.append(shuffle_twin)
  # Code tiles as one token per 64-byte row (and narrower) with Pallas's automatic
  # barriers: the same bytes into the same registers, so the same output bit for bit.
  narrow_twin = dataclasses.replace(twins[0], wide_rows=False, lean_barriers=False)
  barrier_twin = dataclasses.replace(twins[0], lean_barriers=False)  # one switch alone
  configs += [narrow_twin, barrier_twin]
  # Masks on the packed steps too (`edge_masks` off): the same scores, so the
  # same output bit for bit. o, l and the zero sums multiplied by one on the
  # lazy steps too (`lazy_rescale` off): the same arithmetic up to the float32
  # contraction of the exact steps' multiply-adds (checked below).
  mask_twin = dataclasses.replace(twins[0], edge_masks=False)
  rescale_twin = dataclasses.replace(twins[0], lazy_rescale=False)
  # The -inf guards kept on the unmasked steps: dead there, the same output.
  guard_twin = dataclasses.replace(twins[0], unmasked_guards=not twins[0].unmasked_guards)
  configs += [mask_twin, rescale_twin, guard_twin]
  if dtype == jnp.bfloat16:  # (float16 caches keep natural-log scores anyway)
    # Natural-log scores (q without log2(e), a multiply per score before ex2):
    # another rounding of q, checked against the oracle like every config.
    configs.append(dataclasses.replace(twins[0], log2_scores=not twins[0].log2_scores))
  outs = _checked_outputs(q, cache, lengths, configs, dtype)
  if outs is None:
    return
  ref = outs.pop("oracle")
  np.testing.assert_array_equal(outs[shuffle_twin], outs[twins[0]])
  np.testing.assert_array_equal(outs[narrow_twin], outs[twins[0]])
  np.testing.assert_array_equal(outs[barrier_twin], outs[twins[0]])
  np.testing.assert_array_equal(outs[mask_twin], outs[twins[0]])
  np.testing.assert_array_equal(outs[guard_twin], outs[twins[0]])
  ulp = 2.0 ** -(7 if dtype == jnp.bfloat16 else 10)  # one unit, relative
  # float32 rounding of sums whose terms are as large as V (where the output
  # cancels to ~1e-4, a unit of its float32 sums is a few units of q's dtype
  # there): within 2**-16 of the output's scale, far below the quantization
  # error (_TOL). (The byte-mask twin once differed by 4.8e-7 at an output of
  # ~5.4e-5, 1.1 bf16 units, H200, 2026-11-29 (kivi2, B=2, GQA 8): one unit
  # relative alone does not bound outputs that cancel.)
  f32_floor = 2.0 ** -16 * np.abs(ref).max()
  for other in (twins[1], byte_twin):
    a, b = outs[twins[0]], outs[other]
    np.testing.assert_array_less(np.abs(a - b),
                                 ulp * np.maximum(np.abs(a), np.abs(b)) + f32_floor,
                                 err_msg=f"{other=}")
  np.testing.assert_allclose(outs[rescale_twin], outs[twins[0]], rtol=ulp, atol=f32_floor)
  # And through the public entry point with the default config.
  got = jaxkv.decode_attention(q, cache, implementation="mosaic")
  err2 = np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max()
  assert err2 < _TOL[dtype], f"default config: max rel err {err2:.2e}"


def test_log2_scale_is_float32_whatever_the_scale_dtype():
  """`log2_scores`' ``sm_scale * log2(e)`` is computed in float32 for a traced
  bfloat16 / float16 scale too (a bf16 product is off by 0.33 % at 128**-0.5:
  another softmax temperature than the staged rows', which take the scale as
  it is)."""
  want = np.float64(128.0) ** -0.5 * np.log2(np.e)
  for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
    scale = jnp.asarray(128.0 ** -0.5, dt)
    got = jax.jit(ma.log2_scale)(scale)
    assert got.dtype == jnp.float32
    exact = np.float64(np.asarray(scale, np.float32)) * np.log2(np.e)
    assert abs(float(got) - exact) <= 2.0 ** -23 * exact, dt
  assert abs(float(ma.log2_scale(128.0 ** -0.5)) - want) <= 2.0 ** -23 * want


@pytest.mark.parametrize("name,k_mag,v_mag", [("kivi4", 1e4, 1e-4), ("kivi4", 1e-4, 1e4),
                                              ("kivi2", 3e3, 3e-3)])
def test_mosaic_magnitudes(name, k_mag, v_mag):
  """Large and tiny K and V through the default config (subnormal codes for kivi4:
  the powers of two q, the K rows and P carry must not overflow or flush)."""
  fmt, lengths = PRESETS[name], (900, 317)
  key = _key(name, k_mag, v_mag)
  k1, k2, k3 = jax.random.split(key, 3)
  k = (jax.random.normal(k1, (2, 900, 2, 128)) * k_mag).astype(jnp.bfloat16)
  v = (jax.random.normal(k2, (2, 900, 2, 128)) * v_mag + 0.5 * v_mag).astype(jnp.bfloat16)
  cache = jaxkv.KVCache.init(fmt, 2, 2, 128, 1024, jnp.bfloat16, use_kernel=False)
  cache = cache.prefill(k, v, jnp.asarray(lengths, jnp.int32))
  q = (jax.random.normal(k3, (2, 1, 8, 128)) / k_mag).astype(jnp.bfloat16)  # scores ~ 1
  config = ma.MosaicAttentionConfig.default(
      batch=2, tokens=1024, kv_heads=2, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
      token_group=fmt.token_group, residual=fmt.residual)
  assert config.subnormal_k and config.subnormal_v and config.byte_masks
  if not ON_HOPPER:
    _assert_lowers(q, cache, config)
    return
  kd, vd = cache.dequantize()
  ref = np_attention(np.asarray(q, np.float64), np.asarray(kd), np.asarray(vd), lengths)
  got = np.asarray(jax.jit(_call, static_argnums=2)(q, cache, config), np.float64)
  err = np.abs(got - ref).max() / np.abs(ref).max()
  assert np.isfinite(got).all() and err < _TOL[jnp.bfloat16], f"max rel err {err:.2e}"


@pytest.mark.parametrize("name,d,why", [
    ("int4-token-g4", 128, "per-token groups"),
    ("kivi2", 64, "under 32 bytes"),
])
def test_mosaic_refuses_with_reason(name, d, why):
  fmt = PRESETS[name]
  ok, reason = ma.supports(SideSpec.of(fmt, "k", d), SideSpec.of(fmt, "v", d), head_dim=d,
                           q_rows=4, dtype=jnp.bfloat16, token_group=fmt.token_group,
                           residual=fmt.residual)
  assert not ok and why in reason


def test_mosaic_refuses_f32_and_many_rows():
  fmt = PRESETS["kivi4"]
  sides = SideSpec.of(fmt, "k", 128), SideSpec.of(fmt, "v", 128)
  common = dict(head_dim=128, token_group=128, residual=128)
  assert not ma.supports(*sides, q_rows=4, dtype=jnp.float32, **common)[0]
  assert not ma.supports(*sides, q_rows=65, dtype=jnp.bfloat16, **common)[0]


def test_forced_mosaic_off_hopper_raises():
  if ON_HOPPER:
    pytest.skip("runs only where Mosaic is unavailable")
  cache = jaxkv.KVCache.init("kivi4", 1, 1, 128, 256, jnp.bfloat16)
  q = jnp.ones((1, 1, 4, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="mosaic"):
    jaxkv.decode_attention(q, cache, implementation="mosaic")
  # A sequence falls back in order.
  out = jaxkv.decode_attention(q, cache, implementation=("mosaic", "reference"))
  assert out.shape == q.shape


def test_residual_not_in_whole_tiles_is_refused():
  """The residual block runs as one program per block_k rows: a residual that
  is not a multiple of block_k (or arrays of another row count) would drop
  rows, so the kernel refuses it before tracing anything."""
  fmt = PRESETS["kivi4"]
  b, h, c, d = 1, 2, 256, 128
  sides = SideSpec.of(fmt, "k", d), SideSpec.of(fmt, "v", d)
  q = jnp.ones((b, 1, 4 * h, d), jnp.bfloat16)
  codes = jnp.zeros((b, h, c, d // 2), jnp.uint8)
  kscale = jnp.ones((b, h, c // 128, d), jnp.float16)
  vscale = jnp.ones((b, h, c, 1), jnp.float16)
  lengths = jnp.full((b,), 200, jnp.int32)
  config = ma.MosaicAttentionConfig(block_k=128, num_splits=1)
  for k_rows, v_rows, residual in ((64, 64, 64), (256, 256, 128), (128, 256, 128)):
    k_res = jnp.ones((b, h, k_rows, d), jnp.bfloat16)
    v_res = jnp.ones((b, h, v_rows, d), jnp.bfloat16)
    with pytest.raises(ValueError, match="residual"):
      ma.mosaic_decode_attention(q, codes, kscale, kscale, codes, vscale, vscale, k_res, v_res,
                                 lengths, k_side=sides[0], v_side=sides[1], token_group=128,
                                 residual=residual, sm_scale=0.1, config=config)
  assert ma.residual_parts(256, 128) == 2 and ma.residual_parts(128, 64) == 2


def test_config_validation():
  with pytest.raises(ValueError, match="block_k"):
    ma.MosaicAttentionConfig(block_k=32)
  with pytest.raises(ValueError, match="num_splits"):
    ma.MosaicAttentionConfig(num_splits=0)


def test_side_spec_of_formats():
  assert SideSpec.of(PRESETS["kivi4"], "k", 128) == SideSpec(4, "channel", 128)
  assert SideSpec.of(PRESETS["kivi4"], "v", 128) == SideSpec(4, "token", 128)
  assert SideSpec.of(PRESETS["int4-token-g4"], "k", 128) == SideSpec(4, "token", 32)
  assert SideSpec.of(PRESETS["bf16"], "v", 64) == SideSpec(16, "token", 1)
  with pytest.raises(ValueError):
    SideSpec(3)


@pytest.mark.parametrize("name,tokens,block_k,stages", [
    ("kivi2", 32768, 128, 2), ("kivi4", 16384, 64, 2), ("kivi4", 32768, 128, 2),
    ("kivi4", 131072, 128, 2),
    ("k8v4", 32768, 64, 4), ("int8", 32768, 64, 3), ("kivi2-r2g", 32768, 64, 4),
])
def test_default_config_per_format(name, tokens, block_k, stages):
  fmt = _fmt(name)
  config = ma.MosaicAttentionConfig.default(
      batch=1, tokens=tokens, kv_heads=8, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
      token_group=fmt.token_group, residual=fmt.residual)
  assert (config.block_k, config.max_concurrent_steps) == (block_k, stages)
  # 4-bit or 2-bit K and V: subnormal codes; V built while the score MMA runs
  assert config.subnormal_k and config.subnormal_v and config.byte_masks
  assert config.early_v
  # the plain rescale for kivi4 in 128-token blocks of a single sequence at 2
  # programs per SM (32K); the lazy one at 3 (128K: 48 splits)
  assert config.lazy_rescale == (name != "kivi4" or block_k == 64 or tokens == 131072)
  # K scale pairs by warp shuffles: 2-bit K, and 4-bit K (in 128-token blocks up
  # to 64 (sequence, kv head) pairs: here 8)
  assert config.shuffle_scales == (fmt.k_bits in (2, 4))
  # The default always fits the format (dispatch checks supports() with it).
  ok, why = ma.supports(SideSpec.of(fmt, "k", 128), SideSpec.of(fmt, "v", 128), head_dim=128,
                        q_rows=4, dtype=jnp.bfloat16, token_group=fmt.token_group,
                        residual=fmt.residual, block_k=config.block_k)
  assert ok, why


def test_default_splits_leave_the_wave_to_every_residual_program():
  """The residual block takes one program per block_k rows (`residual_parts`):
  QuantSpec's draft view (4-bit sides, R = 256 in 128-token blocks) at one
  long sequence keeps all its programs in the 3-per-SM wave its kivi4-like
  kernel runs at there (49 per (sequence, kv head) on 132 SMs), where counting
  one residual program put 8 of 272 programs of the former 2-per-SM wave in a
  second one."""
  config = ma.MosaicAttentionConfig.default(batch=1, tokens=131072, kv_heads=8, k_bits=4,
                                            v_bits=4, token_group=128, residual=256)
  parts = ma.residual_parts(256, config.block_k)
  assert (config.block_k, parts) == (128, 2)
  assert 8 * (config.num_splits + parts) == 392  # <= 3 * 132 slots
  assert ma.one_wave_splits(396, 8, 1024, residual_programs=2) == 47
  assert ma.one_wave_splits(264, 8, 1024, residual_programs=2) == 31
  assert ma.one_wave_splits(264, 8, 1024) == 32


@pytest.mark.parametrize("kv_heads,splits,lazy", [(8, 48, True), (4, 64, False), (2, 64, False),
                                                   (1, 64, False)])
def test_long_sequence_runs_3_per_sm_only_where_that_adds_programs(kv_heads, splits, lazy):
  """kivi4 at (1, 131072): 3 programs per SM with the lazy rescale at 8 kv heads;
  with 1-4 kv heads both waves are capped at 64 splits, so the 2-per-SM config
  (plain rescale) stays."""
  config = ma.MosaicAttentionConfig.default(batch=1, tokens=131072, kv_heads=kv_heads,
                                            k_bits=4, v_bits=4, num_sms=132)
  assert (config.num_splits, config.lazy_rescale) == (splits, lazy)


@pytest.mark.parametrize("name,batch,tokens,splits", [
    ("kivi4", 1, 131072, 48), ("kivi4", 1, 49152, 48), ("kivi4", 1, 48896, 32),
    ("kivi4", 1, 32768, 32), ("kivi4", 1, 65536, 48),
    ("kivi4", 8, 32768, 6), ("kivi4", 4, 32768, 12),
    ("kivi2", 1, 131072, 48), ("kivi2", 1, 32768, 32), ("kivi2", 8, 32768, 6),
    ("k8v4", 1, 131072, 47), ("k8v4", 8, 32768, 6),
    ("kivi4", 1, 2048, 8), ("kivi4", 16, 32768, 4), ("kivi4", 24, 32768, 2),
    ("kivi4", 25, 32768, 6), ("kivi4", 31, 32768, 2), ("kivi4", 32, 32768, 4),
    ("kivi4", 47, 32768, 4),
    ("kivi4", 48, 32768, 4), ("kivi4", 64, 32768, 4), ("kivi4", 96, 32768, 4),
    ("kivi4", 100, 32768, 4), ("kivi4", 64, 4096, 4), ("kivi4", 200, 1024, 2),
    ("kivi2", 16, 32768, 3), ("kivi2", 24, 32768, 2), ("kivi2", 40, 32768, 4),
    ("kivi2", 47, 32768, 4), ("kivi2", 48, 32768, 4), ("kivi2", 96, 32768, 4),
    ("kivi2", 186, 32768, 4), ("kivi2", 64, 2048, 4), ("kivi2", 64, 1536, 3)])
def test_default_splits_follow_the_documented_rule(name, batch, tokens, splits):
  """One wave at 4 programs per SM for 4-bit K/V in 64-token blocks (and in
  128-token blocks over more than 64 (sequence, kv head) pairs; 3 over 9-64
  pairs, 2 over <= 8 but 3 where each split keeps >= 8 blocks), 3 for k8v4 and
  for 2-bit K/V (over <= 8 pairs only where each split keeps >= 8 blocks, else
  2; over more pairs at least 2 splits)
  (132 SMs, 8 kv heads); a long single sequence leaves slots for the residual
  programs (one per block of the residual: k8v4's 128 rows in 64-token blocks
  take two); at least two waves where one would leave more than a tenth of the
  slots idle (large batches); never fewer than 4 blocks per split. kivi4 over
  more than 64 pairs whose 4-per-SM count fills its last wave at the 2 per SM
  it runs at under 90 % (24 sequences: 6 splits, 1152 programs in 5 waves of
  264) runs 3 per SM instead (shuffled scales), at least 2 splits; so
  do kivi4 and kivi2 over >= 256 pairs (32 sequences and more; 31: kivi4 2
  unshuffled splits by the rule before), with at least 4 splits
  where each keeps >= 4 blocks (64 x 1536 tokens: 12 blocks, 3 splits); V is
  built early everywhere."""
  fmt = _fmt(name)
  config = ma.MosaicAttentionConfig.default(
      batch=batch, tokens=tokens, kv_heads=8, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
      token_group=fmt.token_group, residual=fmt.residual)
  assert config.num_splits == splits
  assert tokens // config.block_k >= 4 * config.num_splits
  # V is built while the score MMA runs
  assert config.early_v
  # 4-bit K in 128-token blocks: shuffled scales up to 64 pairs and where over 64
  # pairs they run 3 per SM
  if name == "kivi4" and config.block_k == 128:
    assert config.shuffle_scales == (batch * 8 <= 64 or batch == 24 or batch >= 32)


@pytest.mark.parametrize("name,dtype,head_dim,first", [
    ("kivi2", jnp.bfloat16, 128, "mosaic"), ("kivi2", jnp.float16, 64, "mosaic"),
    ("kivi4", jnp.bfloat16, 128, "mosaic"), ("kivi4", jnp.float16, 128, "triton"),
    ("kivi4", jnp.bfloat16, 64, "triton"), ("int8", jnp.bfloat16, 128, "triton"),
    ("k8v4", jnp.bfloat16, 128, "triton"), ("quantspec", jnp.bfloat16, 128, "mosaic"),
    ("bf16", jnp.bfloat16, 128, "triton")])
def test_pallas_order_per_format(name, dtype, head_dim, first):
  """Mosaic first where it was measured faster: both sides at most 2 bits, and
  4-bit K and V in a bfloat16 cache at head_dim 128 (the register V operand),
  at any batch."""
  from jaxkv.attention import pallas_order
  order = pallas_order(PRESETS[name], dtype, head_dim)
  assert order[0] == first and set(order) == {"mosaic", "triton"}
  for heads in (1, 64, 392, 4096):
    assert pallas_order(PRESETS[name], dtype, head_dim, heads=heads) == order


@pytest.mark.parametrize("dtype,head_dim,first", [
    (jnp.bfloat16, 128, "mosaic"), (jnp.float16, 128, "triton"), (jnp.bfloat16, 64, "triton")])
def test_pallas_order_quantspec_views(dtype, head_dim, first):
  """Both views of a hierarchical cache (4-bit reads of one or both planes) follow
  kivi4's rule, short caches at large batch included."""
  from jaxkv.attention import MOSAIC_KIVI4_MIN_TOKENS, pallas_order
  fmt = PRESETS["quantspec"]
  for view in ("draft", "target"):
    assert pallas_order(fmt, dtype, head_dim, view=view)[0] == first
    for heads, tokens in ((8, 131072), (512, 4 * MOSAIC_KIVI4_MIN_TOKENS)):
      assert (pallas_order(fmt, dtype, head_dim, heads=heads, tokens=tokens, view=view)
              == pallas_order(PRESETS["kivi4"], dtype, head_dim, heads=heads, tokens=tokens))
    assert pallas_order(fmt, jnp.bfloat16, 128, heads=32, tokens=MOSAIC_KIVI4_MIN_TOKENS,
                        view=view)[0] == "triton"


def test_pallas_order_short_kivi4_caches_at_batch():
  """kivi4 caches of at most 8192 tokens shared by >= 32 (sequence, kv head)
  pairs go to Triton first (measured as fast or faster there); longer caches
  or fewer pairs stay on Mosaic, and kivi2 is not affected."""
  from jaxkv.attention import MOSAIC_KIVI4_MIN_TOKENS, pallas_order
  kivi4, kivi2 = PRESETS["kivi4"], PRESETS["kivi2"]
  short = MOSAIC_KIVI4_MIN_TOKENS
  assert pallas_order(kivi4, jnp.bfloat16, 128, heads=32, tokens=short)[0] == "triton"
  assert pallas_order(kivi4, jnp.bfloat16, 128, heads=512, tokens=4096)[0] == "triton"
  assert pallas_order(kivi4, jnp.bfloat16, 128, heads=8, tokens=short)[0] == "mosaic"
  assert pallas_order(kivi4, jnp.bfloat16, 128, heads=32, tokens=short + 128)[0] == "mosaic"
  assert pallas_order(kivi2, jnp.bfloat16, 128, heads=512, tokens=4096)[0] == "mosaic"
  if ON_HOPPER:  # through the dispatcher: capacity and batch x kv heads from the call
    from jaxkv.attention import resolve_implementation
    for batch, capacity, want in ((32, 4096, "triton"), (1, 4096, "mosaic"), (32, 16384, "mosaic")):
      cache = jaxkv.KVCache.init("kivi4", batch, 1, 128, capacity, jnp.bfloat16)
      q = jnp.ones((batch, 1, 8, 128), jnp.bfloat16)
      assert resolve_implementation(q, cache, None) == want


def test_default_dispatch_follows_pallas_order():
  """On a Hopper GPU kivi2 and (bfloat16, D 128) kivi4 caches run Mosaic by
  default, k8v4 Triton; elsewhere the reference (no GPU) or Triton."""
  from jaxkv.attention import resolve_implementation
  for name, want in (("kivi2", "mosaic"), ("kivi4", "mosaic"), ("k8v4", "triton")):
    cache = jaxkv.KVCache.init(name, 1, 2, 128, 512, jnp.bfloat16)
    q = jnp.ones((1, 1, 8, 128), jnp.bfloat16)
    got = resolve_implementation(q, cache, None)
    if ON_HOPPER:
      assert got == want
    elif jax.default_backend() == "gpu":
      assert got == "triton"
    else:
      assert got == "reference"


def _np_lse(q, k, lengths, scale):
  """float64 log-sum-exp of each query's scaled scores over its visible keys: ``[B, S, Hq]``."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  b, s, hq, _ = q.shape
  g = hq // k.shape[2]
  out = np.full((b, s, hq), -np.inf)
  for bi, si, h in np.ndindex(b, s, hq):
    last = int(lengths[bi]) - s + si
    if last >= 0:
      x = k[bi, :last + 1, h // g] @ q[bi, si, h] * scale
      out[bi, si, h] = x.max() + np.log(np.exp(x - x.max()).sum())
  return out


@pytest.mark.parametrize("view,b,hkv,group,d,s,lengths,capacity", [
    ("draft", 2, 2, 4, 128, 1, (700, 300), 1024),  # packed groups + residual; one packed group
    ("draft", 1, 2, 4, 128, 5, (900,), 1024),      # q_len 5 (a verification-sized query)
    ("target", 2, 2, 4, 128, 1, (700, 300), 1024),
    ("target", 1, 2, 4, 128, 5, (900,), 1024),
    ("target", 3, 1, 8, 128, 3, (1300, 77, 512), 1536),  # GQA 8, ragged, q_len 3
])
def test_mosaic_views_of_quantspec(view, b, hkv, group, d, s, lengths, capacity):
  """Both views of a hierarchical cache on Mosaic against float64 attention over
  ``cache.dequantize(view)``, with the log-sum-exp the staged attention of
  speculative decoding merges; and the staged path through them. The draft view
  reads the upper-plane rows of the plane-blocked codes in place as a plain
  4-bit side; the target view reads both planes' tiles and joins the 8-bit
  codes in registers."""
  from jaxkv import attention
  from jaxkv.staged_cache import staged_attention, write_staged
  fmt = PRESETS["quantspec"]
  key = _key(view, b, hkv, group, d, s, lengths)
  cache = _cache(fmt, b, hkv, d, lengths, capacity, jnp.bfloat16, key)
  q = jax.random.normal(jax.random.fold_in(key, 1), (b, s, hkv * group, d)).astype(jnp.bfloat16)
  scale = d ** -0.5
  configs = [attention._mosaic_default(cache, view),
             ma.MosaicAttentionConfig(block_k=64, num_splits=3),
             ma.MosaicAttentionConfig(block_k=128, num_splits=2)]  # long contexts' blocks

  def call(q, cache, config):
    return attention._mosaic_attention(q, cache, scale=None, config=config, view=view,
                                       return_lse=True)

  staging = 6
  stage_k, stage_v = (jax.random.normal(jax.random.fold_in(key, i), (b, s + 1, hkv, d))
                      .astype(jnp.bfloat16) for i in (2, 3))
  zero = jnp.zeros((b,), jnp.int32)
  stage_k = write_staged(jnp.zeros((b, staging, hkv, d), jnp.bfloat16), stage_k, zero)
  stage_v = write_staged(jnp.zeros((b, staging, hkv, d), jnp.bfloat16), stage_v, zero)
  staged = jnp.full((b,), s + 1, jnp.int32)

  def staged_call(q, cache):
    return staged_attention(q, cache, stage_k, stage_v, staged, view=view,
                            implementation="mosaic")

  if not ON_HOPPER:
    for config in configs:
      text = jax.jit(call, static_argnums=2).trace(q, cache, config).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "mosaic_gpu" in text
    with pytest.raises(ValueError, match="Hopper"):
      staged_call(q, cache)
    return
  kd, vd = cache.dequantize(view)
  ref = np_attention(np.asarray(q, np.float64), np.asarray(kd), np.asarray(vd), lengths)
  lse_ref = _np_lse(q, kd, lengths, scale)
  for config in configs:
    out, lse = jax.jit(call, static_argnums=2)(q, cache, config)
    err = np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max()
    assert err < _TOL[jnp.bfloat16], f"{config=}: max rel err {err:.2e}"
    np.testing.assert_allclose(np.asarray(lse, np.float64), lse_ref, rtol=0, atol=5e-2,
                               err_msg=f"{config=}")
  # Dispatch: both views on Mosaic (kivi4's rule, `pallas_order`).
  assert attention.resolve_implementation(q, cache, None, view=view) == "mosaic"
  got = jaxkv.decode_attention(q, cache, view=view, implementation="mosaic")
  err = np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max()
  assert err < _TOL[jnp.bfloat16], f"dispatch: max rel err {err:.2e}"
  # Staged: the committed tokens on Mosaic merged with the staged rows.
  from jaxkv.staged_cache import assemble
  k_all, v_all = assemble(kd, vd, cache.lengths, stage_k, stage_v, staged)
  want = np_attention(np.asarray(q, np.float64), np.asarray(k_all), np.asarray(v_all),
                      np.asarray(lengths) + s + 1)
  got = np.asarray(jax.jit(staged_call)(q, cache), np.float64)
  err = np.abs(got - want).max() / np.abs(want).max()
  assert err < _TOL[jnp.bfloat16], f"staged: max rel err {err:.2e}"


def test_mosaic_view_refusals():
  """Mosaic reads hierarchical caches at head_dim 128 only (its D = 64 draft case
  failed compiled on an H100), the target view in bfloat16 caches with the
  register paths on only (`target_view_refusal`), and says so."""
  from jaxkv import attention
  for d, dtype, view, why in ((64, jnp.bfloat16, "draft", "head_dim 128"),
                              (64, jnp.bfloat16, "target", "head_dim 128"),
                              (128, jnp.float16, "target", "bfloat16 cache")):
    cache = jaxkv.KVCache.init("quantspec", 1, 2, d, 512, dtype)
    q = jnp.ones((1, 1, 8, d), dtype)
    ok, msg = attention._mosaic_supported(q, cache, view=view)
    assert not ok and why in msg, msg
    with pytest.raises(ValueError, match=why):
      jaxkv.decode_attention(q, cache, view=view, implementation="mosaic")
  # K per token (a hierarchical format may take it): no register K path, so
  # dispatch must not pick Mosaic (Triton serves it), and a forced call refuses.
  token_k = dataclasses.replace(PRESETS["quantspec"], k_axis="token")
  cache = jaxkv.KVCache.init(token_k, 1, 2, 128, 512, jnp.bfloat16)
  q = jnp.ones((1, 1, 8, 128), jnp.bfloat16)
  ok, msg = attention._mosaic_supported(q, cache, view="target")
  assert not ok and "K quantized per channel" in msg, msg
  with pytest.raises(ValueError, match="K quantized per channel"):
    attention._mosaic_attention(q, cache, scale=None,
                                config=attention._mosaic_default(cache, "target"),
                                view="target")
  cache = jaxkv.KVCache.init("quantspec", 1, 2, 128, 512, jnp.bfloat16)
  config = dataclasses.replace(attention._mosaic_default(cache, "target"), register_vt=False,
                               subnormal_k=False)
  ok, msg = attention._mosaic_supported(q, cache, config, view="target")
  assert not ok and "register_vt, subnormal_k=True" in msg, msg
  with pytest.raises(ValueError, match="register_vt, subnormal_k=True"):
    attention._mosaic_attention(q, cache, scale=None, config=config, view="target")


def test_partials_lse_merges_splits_like_float64():
  """`partials_lse`: log(sum_j l_j exp(m_j)) over the split axis; -inf where every
  part is empty (l = 0, m = -inf), NaN where a part's l is NaN."""
  rng = np.random.default_rng(7)
  l = rng.uniform(0.5, 40.0, (2, 3, 5, 4))
  m = rng.normal(0.0, 6.0, (2, 3, 5, 4))
  l[0, 0, 1], m[0, 0, 1] = 0.0, -np.inf          # an empty split
  l[0, 1], m[0, 1] = 0.0, -np.inf                # a head with no visible key at all
  l[1, 2, 3, 2] = np.nan                         # a poisoned part
  got = np.asarray(ma.partials_lse(jnp.asarray(l, jnp.float32), jnp.asarray(m, jnp.float32)),
                   np.float64)
  with np.errstate(divide="ignore", invalid="ignore"):
    want = np.log(np.sum(l * np.exp(m), axis=2))
  np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5)
  assert np.all(got[0, 1] == -np.inf)
  assert np.isnan(got[1, 2, 2]) and np.isfinite(got[1, 2, [0, 1, 3]]).all()


@pytest.mark.parametrize("name,s,tokens_m", [("kivi4", 1, True), ("kivi2", 3, True),
                                             ("kivi4", 2, False)])
def test_mosaic_poison_rows(name, s, tokens_m):
  """``seq_bad`` and NaN/inf query rows: the combine writes NaN for exactly those rows
  (every query of a flagged sequence, each bad (query, q head) row) and leaves every
  other row as the unflagged call computes it, bit for bit (the v1 path by a select)."""
  from jaxkv import attention
  fmt = PRESETS[name]
  key = _key("poison", name, s)
  cache = _cache(fmt, 3, 2, 128, (700, 129, 300), 1024, jnp.bfloat16, key)
  q = jax.random.normal(jax.random.fold_in(key, 1), (3, s, 8, 128)).astype(jnp.bfloat16)
  q = q.at[0, s - 1, 5, 7].set(jnp.nan).at[1, 0, 2, 0].set(jnp.inf)
  seq_bad = jnp.asarray([False, False, True])
  config = attention._mosaic_default(cache)
  if not tokens_m:
    config = dataclasses.replace(config, tokens_m=False)

  def call(q, cache, seq_bad):
    return attention._mosaic_attention(q, cache, scale=None, config=config, seq_bad=seq_bad)

  if not ON_HOPPER:
    text = jax.jit(call).trace(q, cache, seq_bad).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return
  got = np.asarray(jax.jit(call)(q, cache, seq_bad).astype(jnp.float32))
  plain = np.asarray(jax.jit(call)(q, cache, None).astype(jnp.float32))
  bad = np.zeros(got.shape[:3], bool)
  bad[0, s - 1, 5] = bad[1, 0, 2] = True
  bad[2] = True
  np.testing.assert_array_equal(np.isnan(got).all(-1), bad)
  np.testing.assert_array_equal(got[~bad], plain[~bad])


def test_mosaic_draft_view_refuses_v1():
  from jaxkv import attention
  cache = jaxkv.KVCache.init("quantspec", 1, 2, 128, 512, jnp.bfloat16)
  q = jnp.ones((1, 1, 8, 128), jnp.bfloat16)
  ok, why = attention._mosaic_supported(q, cache, ma.MosaicAttentionConfig(tokens_m=False),
                                        view="draft")
  assert not ok and "tokens_m" in why


@pytest.mark.parametrize("name,s,lengths", [("kivi4", 1, (700, 0)), ("kivi2", 3, (1000, 129))])
def test_mosaic_log_sum_exp(name, s, lengths):
  """``return_lse`` of plain formats: the float64 log-sum-exp of each query's scaled
  scores over ``cache.dequantize()``; -inf for an empty sequence."""
  from jaxkv import attention
  fmt = PRESETS[name]
  key = _key("lse", name, s, lengths)
  cache = _cache(fmt, 2, 2, 128, lengths, 1024, jnp.bfloat16, key)
  q = jax.random.normal(jax.random.fold_in(key, 1), (2, s, 8, 128)).astype(jnp.bfloat16)
  config = attention._mosaic_default(cache)

  def call(q, cache):
    return attention._mosaic_attention(q, cache, scale=None, config=config, return_lse=True)

  if not ON_HOPPER:
    text = jax.jit(call).trace(q, cache).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return
  _, lse = jax.jit(call)(q, cache)
  want = _np_lse(q, cache.dequantize()[0], lengths, 128 ** -0.5)
  got = np.asarray(lse, np.float64)
  assert np.array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=0, atol=5e-2)


@pytest.mark.parametrize("name,b,hkv,group,s,lengths,capacity", [
    ("kivi4", 2, 2, 4, 1, (700, 129), 1024),     # N = 8, two sequences
    ("kivi4", 1, 2, 4, 4, (1000,), 1024),        # N = 16 (GQA 4 x q_len 4)
    ("kivi2", 2, 1, 8, 1, (900, 300), 1024),     # 2-bit K
    ("kivi4-grow", 1, 2, 4, 1, (1000,), 1024),   # the lazy max moves mid-split
])
def test_mosaic_k_scale_in_q(name, b, hkv, group, s, lengths, capacity):
  """``k_scale_in_q``: the per-channel K scale folded into q's B operand and the zero
  term as an MMA of ones give the float64 oracle's attention, at 64- and 128-token
  blocks."""
  fmt, d, dtype = _fmt(name), 128, jnp.bfloat16
  key = _key(name, b, hkv, group, d, s, lengths)
  cache = _cache(fmt, b, hkv, d, lengths, capacity, dtype, key, grow=name.endswith("-grow"))
  q = jax.random.normal(jax.random.fold_in(key, 1), (b, s, hkv * group, d)).astype(dtype)
  configs = [ma.MosaicAttentionConfig(block_k=bk, num_splits=3, k_scale_in_q=True)
             for bk in (64, 128)]
  _checked_outputs(q, cache, lengths, configs, dtype)


@pytest.mark.parametrize("name,b,hkv,group,s,lengths,capacity", [
    ("kivi4", 2, 2, 4, 1, (700, 129), 1024),     # N = 8: partials of 8 columns
    ("kivi2", 2, 1, 8, 1, (900, 300), 1024),     # N = 8 at GQA 8
    ("kivi4", 1, 2, 4, 4, (1000,), 1024),        # N = 16: nothing to narrow
])
def test_mosaic_narrow_partials(name, b, hkv, group, s, lengths, capacity):
  """``narrow_partials``: the partials keep only the query rows' columns; the
  combined output matches the float64 oracle and equals the default's bit for
  bit (the dropped columns are zero and never read)."""
  fmt, d, dtype = _fmt(name), 128, jnp.bfloat16
  key = _key("narrow", name, b, hkv, group, s, lengths)
  cache = _cache(fmt, b, hkv, d, lengths, capacity, dtype, key)
  q = jax.random.normal(jax.random.fold_in(key, 1), (b, s, hkv * group, d)).astype(dtype)
  base = ma.MosaicAttentionConfig.default(
      batch=b, tokens=capacity, kv_heads=hkv, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
      token_group=fmt.token_group, residual=fmt.residual)
  configs = [base, dataclasses.replace(base, narrow_partials=True)]
  n = 8 if s * group <= 8 else 16
  for config, width in zip(configs, (16, n)):  # the o^T partials' type in the kernel call
    text = _assert_lowers(q, cache, config)
    assert f"x{d}x{width}xf32>" in text and (width == 16 or f"x{d}x16xf32>" not in text)
  if ON_HOPPER:  # (off Hopper `_checked_outputs` would only lower the same configs again)
    outs = _checked_outputs(q, cache, lengths, configs, dtype)
    np.testing.assert_array_equal(outs[configs[1]], outs[configs[0]])


@pytest.mark.parametrize("batch,tokens,splits", [
    (1, 131072, 31), (1, 32768, 31), (2, 32768, 16), (4, 32768, 8), (8, 32768, 8),
    (8, 4096, 8), (8, 1024, 4), (16, 32768, None), (48, 32768, None), (64, 4096, None)])
def test_target_view_default_splits(batch, tokens, splits):
  """A hierarchical cache's target view takes kivi4's config, except over 9-64
  (sequence, kv head) pairs: one wave at 2 programs per SM, at least 8 splits,
  at most blocks // 4 (None: kivi4's count); and at one sequence, where kivi4
  runs 3 per SM over long contexts, the target view keeps the 2-per-SM count
  and the plain rescale."""
  kw = dict(batch=batch, tokens=tokens, kv_heads=8, k_bits=4, v_bits=4, token_group=128,
            residual=256)
  base = ma.MosaicAttentionConfig.default(**kw)
  got = ma.MosaicAttentionConfig.default(**kw, target_view=True)
  want = dataclasses.replace(base, num_splits=splits or base.num_splits)
  if batch == 1:  # 2 per SM at one sequence, where kivi4 runs 3 at 128K: the plain rescale
    want = dataclasses.replace(want, lazy_rescale=False)
  assert got == want
  assert tokens // got.block_k >= 4 * got.num_splits


@pytest.mark.parametrize("name,view", [("kivi4", "target"), ("quantspec", "draft")])
def test_default_config_of_one_long_sequence(name, view):
  """The default at one long sequence (3 programs per SM: 48 splits for kivi4,
  47 for QuantSpec's draft view with R = 256; the lazy rescale) against
  float64 attention over ``cache.dequantize(view)``, a ragged length with a
  partly filled residual block. Off Hopper: the default lowers for CUDA."""
  from jaxkv import attention
  fmt = PRESETS[name]
  b, hkv, group, d, length, capacity = 1, 8, 4, 128, 49152 + 77, 49152 + 256
  key = _key("long", name, view)
  cache = _cache(fmt, b, hkv, d, (length,), capacity, jnp.bfloat16, key)
  q = jax.random.normal(jax.random.fold_in(key, 1), (b, 1, hkv * group, d)).astype(jnp.bfloat16)
  # the default on 132 SMs (H100 SXM, H200), whatever GPU runs the test
  config = ma.MosaicAttentionConfig.default(
      batch=b, tokens=cache.storage_len, kv_heads=hkv, num_sms=132, k_bits=4, v_bits=4,
      token_group=fmt.token_group, residual=fmt.residual)
  if ON_HOPPER and getattr(jax.devices()[0], "core_count", 132) == 132:
    assert config == attention._mosaic_default(cache, view)  # pylint: disable=protected-access
  parts = ma.residual_parts(fmt.residual, config.block_k)
  assert config.num_splits == (48 if name == "kivi4" else 47) and config.lazy_rescale
  assert 2 * 132 < b * hkv * (config.num_splits + parts) <= 3 * 132  # one wave at 3 per SM

  def call(q, cache, config):
    return attention._mosaic_attention(q, cache, scale=None, config=config, view=view)

  if not ON_HOPPER:
    lowered = jax.jit(call, static_argnums=2).trace(q, cache, config).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    return
  kd, vd = cache.dequantize(view)
  ref = np_attention(np.asarray(q, np.float64), np.asarray(kd), np.asarray(vd), (length,))
  out = np.asarray(jax.jit(call, static_argnums=2)(q, cache, config), np.float64)
  assert np.isfinite(out).all()
  err = np.abs(out - ref).max() / np.abs(ref).max()
  assert err < _TOL[jnp.bfloat16], f"max rel err {err:.2e}"
