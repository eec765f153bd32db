"""The kernel path of sink formats (`jaxkv.sink_attention`, "option 1"): a split-K
kernel over the packed tokens from ``skip`` on, the prefix ``[0, min(skip,
packed_len))`` attended exactly in XLA, merged by log-sum-exp.

Every case is checked against float64 numpy attention over ``cache.dequantize()``
(which holds the exact sink rows at ``[0, S)``). On CPU the Triton kernels run in
Pallas interpret mode; ``JAXKV_TEST_GPU=1`` on a GPU runs them compiled. The
Mosaic kernels run only on a Hopper GPU; elsewhere their sink path (kernel with
``skip_tokens``, prefix, merge) is lowered for CUDA, as in
tests/test_mosaic_attention.py.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import attention, sink_attention, vq
from jaxkv.formats import KVFormat
from jaxkv.sink_attention import sink_decode_attention
from pallas_kernels import DecodeAttentionConfig
from pallas_kernels import _triton
from pallas_kernels.mosaic_attention import MosaicAttentionConfig
from pallas_kernels.vq_attention import VQAttentionConfig

ON_HOPPER = attention.is_hopper()


def _kv_fmt(base="kivi2-g32", sinks=4):
  """A preset with G = R = 32 and ``sinks`` exact tokens (kivi2-g32-s4 style)."""
  return dataclasses.replace(KVFormat.preset(base), token_group=32, residual=32,
                             sink_tokens=sinks)


def _key(*parts):
  return jax.random.PRNGKey(zlib.crc32(repr(parts).encode()))


def _data(name, b, hkv, group, d, s, t, dtype):
  """Fresh random K/V ``[B, T, Hkv, D]`` (a large-norm sink token 0, as real models
  have) and q ``[B, s, Hq, D]``."""
  k1, k2, k3 = jax.random.split(_key(name, b, hkv, group, d, s, t), 3)
  k = jax.random.normal(k1, (b, t, hkv, d)) * 1.5 + 0.2
  k = k.at[:, 0].multiply(6.0)
  v = jax.random.normal(k2, (b, t, hkv, d))
  q = jax.random.normal(k3, (b, s, hkv * group, d))
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _vq_books(fmt, layers, hkv, d, seed):
  rng = np.random.default_rng(seed)
  sides = [jnp.asarray(rng.standard_normal((layers, *fmt.codebook_shape(side, hkv, d))) * 0.8
                       + 0.1, fmt.codebook_dtype) for side in ("k", "v")]
  return vq.VQCodebooks(k=sides[0], v=sides[1], fmt=dataclasses.replace(fmt, sink_tokens=0))


def _oracle(q, kd, vd, lengths, scale=None):
  """float64 ``(out [B, s, Hq, D], lse [B, s, Hq])`` over dequantized ``kd, vd
  [B, T, Hkv, D]``: query i of sequence b sees keys ``[0, L_b - s + i]``; none
  visible: zeros and -inf."""
  q, kd, vd = (np.asarray(x, np.float64) for x in (q, kd, vd))
  b, s, hq, d = q.shape
  g = hq // kd.shape[2]
  scale = d ** -0.5 if scale is None else scale
  out, lse = np.zeros(q.shape), np.full((b, s, hq), -np.inf)
  for i in range(b):
    for j in range(s):
      n = int(lengths[i]) - s + j + 1
      if n <= 0:
        continue
      for head in range(hq):
        sc = kd[i, :n, head // g] @ q[i, j, head] * scale
        m = sc.max()
        p = np.exp(sc - m)
        out[i, j, head] = (p / p.sum()) @ vd[i, :n, head // g]
        lse[i, j, head] = m + np.log(p.sum())
  return out, lse


_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _check(got, want, dtype, what=""):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  assert np.isfinite(got).all(), what
  err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
  assert err < _TOL[dtype], f"{what}: max err {err:.2e}"


# (format, B, Hkv, Hq/Hkv, D, q_len, lengths, capacity, config, check the lse)
# S = 4, G = R = 32: packed_len(L) = 32 floor(L / 32). Lengths below S (3), between
# S and the skip (20: nothing packed yet; 40 with skip 128: the whole packed region
# is prefix), just past a group (33), 0, and long (several splits).
KV_CASES = [
    ("kivi2-g32", 4, 2, 4, 64, 1, (3, 40, 33, 230), 256, None, False),       # skip 128
    ("kivi2-g32", 4, 1, 1, 128, 3, (0, 20, 70, 281), 512,
     DecodeAttentionConfig(block_k=16, num_splits=3), True),                  # skip 16
    ("kivi4-g32", 3, 2, 8, 64, 2, (65, 6, 200), 256,
     DecodeAttentionConfig(block_k=64, num_splits=2), False),                 # block > G
    ("int4-token-g4", 2, 2, 4, 128, 1, (150, 37), 256,
     DecodeAttentionConfig(block_k=32, num_splits=2, num_warps=1), False),    # K per token
]
_KV_IDS = [f"{n}_{b=}_{h=}_{g=}_{d=}_{s=}_bk{c.block_k if c else 'dflt'}"
           for n, b, h, g, d, s, _, _, c, _ in KV_CASES]


@pytest.mark.parametrize("name,b,hkv,group,d,s,lengths,capacity,config,lse", KV_CASES,
                         ids=_KV_IDS)
def test_triton_sink_attention(name, b, hkv, group, d, s, lengths, capacity, config, lse):
  """`decode_attention(implementation="triton")` over a `KVCache` with 4 sinks == the
  float64 oracle over ``cache.dequantize()``; with ``lse`` the merged log-sum-exp
  of `sink_decode_attention` too (-inf for queries that see nothing)."""
  fmt = _kv_fmt(name)
  q, k, v = _data(name, b, hkv, group, d, s, max(lengths), jnp.float32)
  cache = jaxkv.KVCache.init(fmt, b, hkv, d, capacity, jnp.float32).prefill(
      k, v, np.asarray(lengths))
  want, want_lse = _oracle(q, *cache.dequantize(), lengths)
  got = jaxkv.decode_attention(q, cache, implementation="triton", config=config)
  _check(got, want, jnp.float32)
  if not lse:
    return
  plain = jaxkv.decode_attention(q, dataclasses.replace(cache, fmt=dataclasses.replace(
      fmt, sink_tokens=0), k_sink=None, v_sink=None), implementation="reference")
  assert np.abs(np.asarray(plain, np.float64) - want).max() > 1e-3  # the sinks matter
  block = (config or attention._triton_default(q, cache)).block_k  # pylint: disable=protected-access
  skip = _triton.sink_skip(4, block)
  o_k, lse_k = attention._kernel_attention(  # pylint: disable=protected-access
      "triton", q, cache, scale=None, config=config, layer=None, view="target",
      return_lse=True, skip_tokens=skip)
  seen = np.isfinite(want_lse)
  assert not seen.all()  # a sequence of length 0
  # the jnp prefix + merge, and the fused kernel (`pallas_kernels.sink_prefix`, interpret)
  for use_kernel in (False, True):
    out, got_lse = sink_decode_attention(q, cache, lambda **_: (o_k, lse_k), block=block,
                                         scale=None, seq_bad=cache.nonfinite, return_lse=True,
                                         use_kernel=use_kernel)
    _check(out, want, jnp.float32, f"{use_kernel=}")
    np.testing.assert_array_equal(np.isfinite(np.asarray(got_lse)), seen)
    np.testing.assert_allclose(np.asarray(got_lse, np.float64)[seen], want_lse[seen], atol=2e-5,
                               rtol=2e-5)


def test_triton_layer_view_at_a_traced_layer():
  """A `ModelCache.layer_view` at a traced index (GQA 4, q_len 2, bfloat16 cache):
  the kernel reads the layer in place, the prefix its rows and sinks."""
  fmt = _kv_fmt("kivi2-g32")
  b, hkv, g, d, lengths = 3, 2, 4, 64, np.asarray([100, 2, 45])
  layers = []
  for layer in range(2):
    q, k, v = _data(("layer", layer), b, hkv, g, d, 2, 100, jnp.bfloat16)
    layers.append(jaxkv.KVCache.init(fmt, b, hkv, d, 256, jnp.bfloat16).prefill(k, v, lengths))
  cache = jaxkv.ModelCache.from_layers(layers)
  run = jax.jit(lambda q, c, i: jaxkv.decode_attention(q, c.layer_view(i),
                                                       implementation="triton"))
  _check(run(q, cache, jnp.int32(1)), _oracle(q, *layers[1].dequantize(), lengths)[0],
         jnp.bfloat16)


@pytest.mark.parametrize("fused", [False, True])
def test_triton_sink_input_policy(fused, monkeypatch):
  """README "Input policy": an inf query row and every query of a flagged sequence
  are NaN, the rest equal the oracle; a sequence of length 0 gives zeros. With
  ``fused`` `decode_attention` takes the GPU path of the prefix (one
  `pallas_kernels.sink_prefix` launch, here in interpret mode)."""
  monkeypatch.setattr(sink_attention, "_on_gpu", lambda: fused)  # on a GPU too
  fmt = _kv_fmt("kivi2-g32")
  b, hkv, g, d = 3, 2, 2, 64
  q, k, v = _data("policy", b, hkv, g, d, 1, 90, jnp.float32)
  k = k.at[2, 50, 1, 3].set(jnp.nan)
  prefill = jax.jit(lambda c, k, v, n: c.prefill(k, v, n))  # traced: flags, no error
  cache = prefill(jaxkv.KVCache.init(fmt, b, hkv, d, 256, jnp.float32), k, v,
                  jnp.asarray([0, 90, 90], jnp.int32))
  assert np.asarray(cache.nonfinite).tolist() == [False, False, True]
  q = q.at[1, 0, 3, 5].set(jnp.inf)
  config = DecodeAttentionConfig(block_k=16, num_splits=2)
  run = lambda q, c: jaxkv.decode_attention(q, c, implementation="triton", config=config)  # noqa: E731
  # the fused path: the prefix kernel and no XLA log-sum-exp merge
  assert ("jaxkv_sink_prefix" in str(jax.make_jaxpr(run)(q, cache))) == fused
  got = np.asarray(run(q, cache))
  bad = np.zeros(got.shape, bool)
  bad[2], bad[1, 0, 3] = True, True
  np.testing.assert_array_equal(np.isnan(got), bad)
  np.testing.assert_array_equal(got[0], 0.0)
  with np.errstate(invalid="ignore"):  # the inf query row's scores
    want = _oracle(q[:2], *(x[:2] for x in cache.dequantize()), [0, 90])[0]
  np.testing.assert_allclose(got[:2][~bad[:2]], want[~bad[:2]], atol=2e-5, rtol=2e-5)


VQ_CASES = [
    # (format, B, Hkv, Hq/Hkv, D, q_len, lengths, capacity, config, layer view)
    ("cq2-s4", 3, 2, 4, 64, 2, (300, 3, 140), 512, None, True),               # skip 64
    ("cq2-s4", 2, 1, 1, 128, 1, (129, 0), 256, VQAttentionConfig(block_k=16, num_splits=2),
     False),
]


@pytest.mark.parametrize("name,b,hkv,group,d,s,lengths,capacity,config,view", VQ_CASES,
                         ids=[f"{c[0]}_b{c[1]}_g{c[3]}_d{c[4]}_s{c[5]}" for c in VQ_CASES])
def test_triton_vq_sink_attention(name, b, hkv, group, d, s, lengths, capacity, config, view,
                                  monkeypatch):
  """The Triton VQ kernel with the prefix: `VQCache` and (``view``) a `VQModelCache`
  layer view at a traced index == the float64 oracle over ``dequantize()``.
  Without ``view``, the GPU path of the prefix (one `pallas_kernels.sink_prefix`
  launch, here in interpret mode)."""
  if not view:
    monkeypatch.setattr(sink_attention, "_on_gpu", lambda: True)
  fmt = vq.VQ_PRESETS[name]
  books = _vq_books(fmt, 2, hkv, d, zlib.crc32(name.encode()) + b)
  q, k, v = _data(name, b, hkv, group, d, s, max(lengths), jnp.float32)
  one = jaxkv.VQCache.init(fmt, books, b, hkv, d, capacity, jnp.float32, layer=1).prefill(
      k, v, np.asarray(lengths))
  want = _oracle(q, *one.dequantize(), lengths)[0]
  _check(jaxkv.decode_attention(q, one, implementation="triton", config=config), want,
         jnp.float32)
  if not view:
    return
  stacked = jaxkv.VQModelCache.init(fmt, 2, b, hkv, d, capacity, jnp.float32, codebooks=books)
  plan = stacked.plan_append(jnp.asarray(lengths, jnp.int32), max_new=k.shape[1])
  for layer in range(2):  # layer 0 gets other data: the view must read layer 1
    stacked = stacked.append_layer(layer, k * (1 + layer) - layer, v, plan)
  stacked = stacked.commit(plan)
  run = jax.jit(lambda q, c, i: jaxkv.decode_attention(q, c.layer_view(i),
                                                       implementation="triton", config=config))
  _check(run(q, stacked, jnp.int32(1)), _oracle(q, *stacked.layer(1).dequantize(), lengths)[0],
         jnp.float32)


def test_supports_and_skip_checks():
  """``supports`` names the sinks without a skip and a skip off the block; the
  kernels refuse both; the dispatch serves sink formats on Triton."""
  import pallas_kernels  # pylint: disable=import-outside-toplevel
  fmt = _kv_fmt("kivi2-g32")
  ok, why = pallas_kernels.supports(fmt, head_dim=64)
  assert not ok and "sink_tokens=4" in why
  ok, why = pallas_kernels.supports(fmt, head_dim=64, skip_tokens=24, block_k=16)
  assert not ok and "multiple of block_k=16" in why
  assert pallas_kernels.supports(fmt, head_dim=64, skip_tokens=32, block_k=16)[0]
  assert _triton.sink_skip(4, 128) == 128 and _triton.sink_skip(32, 16) == 32
  assert _triton.sink_skip(0, 64) == 0
  q, k, v = _data("checks", 2, 2, 2, 64, 1, 50, jnp.float32)
  cache = jaxkv.KVCache.init(fmt, 2, 2, 64, 256, jnp.float32).prefill(k, v, [50, 9])
  with pytest.raises(ValueError, match="multiple of block_k=32"):
    pallas_kernels.pallas_decode_attention(
        q, cache, interpret=True, config=DecodeAttentionConfig(block_k=32), skip_tokens=16)
  assert attention.resolve_implementation(q, cache, ("triton", "reference")) == "triton"


def test_triton_kernels_with_skip_lower_for_cuda():
  """The compiled (non-interpret) Triton kernels with ``skip_tokens`` and
  ``return_lse`` lower to Triton custom calls (the GPU path, checked on CPU)."""
  import pallas_kernels  # pylint: disable=import-outside-toplevel
  from pallas_kernels import vq_attention as vk  # pylint: disable=import-outside-toplevel
  q = jnp.ones((2, 1, 8, 128), jnp.bfloat16)
  cache = jaxkv.KVCache.init(_kv_fmt("kivi2"), 2, 2, 128, 512, jnp.bfloat16)
  kv = lambda q, c: pallas_kernels.pallas_decode_attention(  # noqa: E731
      q, c, config=DecodeAttentionConfig(block_k=32, num_splits=4), interpret=False,
      return_lse=True, skip_tokens=32)
  fmt = vq.VQ_PRESETS["cq2-s4"]
  vc = jaxkv.VQCache.init(fmt, _vq_books(fmt, 1, 2, 128, 3), 2, 2, 128, 512, jnp.bfloat16,
                         layer=0)
  vqk = lambda q, c: vk.vq_decode_attention(  # noqa: E731
      q, c.k_codes, c.k_codebook, c.v_codes, c.v_codebook, c.k_residual, c.v_residual,
      c.lengths, k_spec=fmt.spec("k"), v_spec=fmt.spec("v"), token_group=fmt.token_group,
      config=VQAttentionConfig(block_k=64, num_splits=4), interpret=False, return_lse=True,
      skip_tokens=64)
  for fn, c in ((kv, cache), (vqk, vc)):
    assert "__gpu$xla.gpu.triton" in jax.jit(fn).trace(q, c).lower(
        lowering_platforms=("cuda",)).as_text()


def test_autotune_times_the_sink_path(monkeypatch):
  """`jaxkv.autotune` on a sink cache times what `decode_attention` runs (the kernel
  from its skip on plus the exact prefix): its calls equal the oracle."""
  from jaxkv import tuning  # pylint: disable=import-outside-toplevel
  fmt = _kv_fmt("kivi2-g32")
  q, k, v = _data("autotune", 2, 2, 2, 64, 1, 100, jnp.float32)
  cache = jaxkv.KVCache.init(fmt, 2, 2, 64, 256, jnp.float32).prefill(k, v, [100, 40])
  want = _oracle(q, *cache.dequantize(), [100, 40])[0]
  seen = []

  def fake_time(fn, args, calls):
    del calls
    seen.append(fn(*args[0]))
    return {"kernel": 1.0}

  monkeypatch.setattr(tuning, "kernel_time", fake_time)
  config = DecodeAttentionConfig(block_k=32, num_splits=2)
  assert jaxkv.autotune(q, cache, candidates=[config]) == config
  (out,) = seen
  _check(out, want, jnp.float32, "autotune's call")  # its first args are q itself


# ------------------------------------------------------------------- Mosaic
MOSAIC_CASES = [
    # (format, B, Hkv, Hq/Hkv, D, q_len, lengths, capacity, config, layer view)
    ("kivi2", 3, 2, 4, 128, 1, (3, 100, 700), 1024, None, True),
    ("kivi4", 2, 2, 8, 64, 2, (300, 129), 512, MosaicAttentionConfig(block_k=64, num_splits=3),
     False),
]


@pytest.mark.parametrize("name,b,hkv,group,d,s,lengths,capacity,config,layer_view", MOSAIC_CASES,
                         ids=[f"{c[0]}_g{c[3]}_d{c[4]}_s{c[5]}" for c in MOSAIC_CASES])
def test_mosaic_sink_attention(name, b, hkv, group, d, s, lengths, capacity, config, layer_view,
                               monkeypatch):
  """On Hopper: `decode_attention(implementation="mosaic")` with 4 sinks (KVCache and,
  with ``layer_view``, a layer view at a traced index) == the float64 oracle.
  Elsewhere the same calls lower for CUDA (Mosaic kernel with ``skip_tokens``,
  prefix and merge; the direct call with the GPU's fused prefix kernel)."""
  fmt = dataclasses.replace(KVFormat.preset(name), sink_tokens=4)
  q, k, v = _data(name, b, hkv, group, d, s, max(lengths), jnp.bfloat16)
  one = jaxkv.KVCache.init(fmt, b, hkv, d, capacity, jnp.bfloat16, use_kernel=False).prefill(
      k, v, np.asarray(lengths))
  stacked = jaxkv.ModelCache.from_layers([one, one])
  direct = jax.jit(lambda q, c: jaxkv.decode_attention(q, c, implementation="mosaic",
                                                       config=config))
  view = jax.jit(lambda q, c, i: jaxkv.decode_attention(q, c.layer_view(i),
                                                        implementation="mosaic", config=config))
  if not ON_HOPPER:
    monkeypatch.setattr(attention, "is_hopper", lambda: True)
    # the GPU path of the prefix too: the compiled `pallas_kernels.sink_prefix` kernel
    monkeypatch.setattr(sink_attention, "_on_gpu", lambda: True)
    monkeypatch.setattr(sink_attention, "PREFIX_KERNEL_MAX_ROWS", 1 << 30)  # skip 128 here
    monkeypatch.setattr(sink_attention, "_interpret", lambda: False)
    text = direct.trace(q, one).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "jaxkv_sink_prefix" in text and "xla.gpu.triton" in text
    if layer_view:
      assert "mosaic_gpu" in view.trace(q, stacked, jnp.int32(1)).lower(
          lowering_platforms=("cuda",)).as_text()
    return
  want = _oracle(q, *one.dequantize(), lengths)[0]
  _check(direct(q, one), want, jnp.bfloat16, "KVCache")
  if layer_view:
    _check(view(q, stacked, jnp.int32(1)), want, jnp.bfloat16, "layer view")


def test_mosaic_vq_sink_attention(monkeypatch):
  """cq2-s4 on the Mosaic VQ kernel (one and two warpgroups): a `VQCache` and a
  `VQModelCache` layer view == the oracle on Hopper; lowered for CUDA elsewhere."""
  fmt = vq.VQ_PRESETS["cq2-s4"]
  b, hkv, group, d, lengths = 2, 2, 4, 128, (600, 70)
  books = _vq_books(fmt, 2, hkv, d, 5)
  q, k, v = _data("mosaic-vq", b, hkv, group, d, 1, max(lengths), jnp.bfloat16)
  one = jaxkv.VQCache.init(fmt, books, b, hkv, d, 1024, jnp.bfloat16, layer=1).prefill(
      k, v, np.asarray(lengths))
  stacked = jaxkv.VQModelCache.init(fmt, 2, b, hkv, d, 1024, jnp.bfloat16, codebooks=books)
  plan = stacked.plan_append(jnp.asarray(lengths, jnp.int32), max_new=k.shape[1])
  for layer in range(2):
    stacked = stacked.append_layer(layer, k, v, plan)
  stacked = stacked.commit(plan)
  # the default (two warpgroups, 128-token blocks: skip 128) and one warpgroup (skip 64)
  configs = [None, MosaicAttentionConfig(block_k=64, num_splits=3)]
  if not ON_HOPPER:
    monkeypatch.setattr(attention, "is_hopper", lambda: True)
  want = _oracle(q, *one.dequantize(), lengths)[0] if ON_HOPPER else None
  for config in configs:
    direct = jax.jit(lambda q, c, _cfg=config: jaxkv.decode_attention(
        q, c, implementation="mosaic", config=_cfg))
    view = jax.jit(lambda q, c, i, _cfg=config: jaxkv.decode_attention(
        q, c.layer_view(i), implementation="mosaic", config=_cfg))
    if not ON_HOPPER:
      assert "mosaic_gpu" in (view.trace(q, stacked, jnp.int32(1)) if config is None else
                              direct.trace(q, one)).lower(lowering_platforms=("cuda",)).as_text()
      continue
    _check(direct(q, one), want, jnp.bfloat16, f"{config=}")
    _check(view(q, stacked, jnp.int32(1)), want, jnp.bfloat16, f"view {config=}")
