"""The Mosaic GPU (Hopper) VQ attention kernel and its codebook gather.

On a Hopper GPU every case runs compiled against float64 numpy oracles: the
gathered registers against `mosaic_dequant.gather_reference` (exact), the
attention against exact attention over ``cache.dequantize()``. Elsewhere
(CI) the kernels are lowered for CUDA (the whole Pallas -> Mosaic GPU
lowering, layout checks included), as in `tests/test_mosaic_attention.py`.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import vq
from jaxkv.attention import is_hopper
from pallas_kernels import mosaic_attention as ma
from pallas_kernels import mosaic_dequant as md
from pallas_kernels import mosaic_vq_attention as mv
from tests.test_mosaic_attention import _grows_within_splits
from tests.test_vq_attention import _key, _oracle

ON_HOPPER = is_hopper()

FORMATS = {
    "cq4": vq.VQ_PRESETS["cq4"],
    "cq2": vq.VQ_PRESETS["cq2"],
    "cq2-bf16cb": dataclasses.replace(vq.VQ_PRESETS["cq2"], codebook_dtype="bfloat16"),
    "k8e64-v4-g64": vq.VQFormat(k_vector=8, v_vector=4, k_index_bits=6, token_group=64,
                                residual=128),
    "cq2-grow": vq.VQ_PRESETS["cq2"],
}

CASES = [
    # (format, B, Hkv, Hq/Hkv, D, S, lengths, capacity, dtype)
    ("cq4", 2, 2, 4, 128, 1, (300, 129), 512, jnp.bfloat16),     # mid-group ends
    ("cq2", 2, 1, 8, 64, 3, (260, 17), 512, jnp.bfloat16),       # empty packed region (17)
    ("cq2", 1, 2, 3, 128, 8, (451,), 512, jnp.float16),          # GQA 3, S 8, float16
    ("cq4", 1, 4, 1, 64, 2, (1000,), 1024, jnp.bfloat16),        # GQA 1, D 64
    ("cq2-bf16cb", 2, 2, 4, 128, 1, (512, 640), 768, jnp.bfloat16),  # full packed, exact books
    ("k8e64-v4-g64", 1, 2, 6, 128, 1, (700,), 1024, jnp.bfloat16),   # vector 8, 64 entries
    # K (and the centroids it picks) growing along the sequence: the lazy max moves mid-split.
    ("cq2-grow", 1, 2, 4, 128, 1, (1000,), 1024, jnp.bfloat16),
]
_TOL_BASE = {jnp.bfloat16: 2e-3, jnp.float16: 5e-4}  # x sqrt(T), as tests/test_vq_attention.py


def _case(name, b, hkv, group, d, s, lengths, capacity, dtype):
  fmt = FORMATS[name]
  grow = name.endswith("-grow")
  books = []
  for side in ("k", "v"):
    shape = fmt.codebook_shape(side, hkv, d)
    book = jax.random.normal(_key(name, side, d), shape) * 0.8 + 0.1
    if grow:  # entries of every magnitude, so growing K picks growing centroids
      book = book * (1.0 + 11.0 * jnp.arange(shape[-2]) / shape[-2])[:, None]
    books.append(book.astype(fmt.codebook_dtype))
  k1, k2, k3 = jax.random.split(_key(name, b, hkv, group, d, lengths), 3)
  t = max(lengths)
  k = jax.random.normal(k1, (b, t, hkv, d)) * 1.5 + 0.2
  if grow:
    k = k * (1.0 + 11.0 * jnp.arange(t) / t)[None, :, None, None]
  k = k.astype(dtype)
  v = jax.random.normal(k2, (b, t, hkv, d)).astype(dtype)
  q = jax.random.normal(k3, (b, s, hkv * group, d)).astype(dtype)
  cache = jaxkv.VQCache.init(fmt, tuple(books), b, hkv, d, capacity, dtype)
  return q, cache.prefill(k, v, np.asarray(lengths))


def _call(q, cache, config=None, scale=None):
  fmt = cache.fmt
  return mv.mosaic_vq_decode_attention(
      q, cache.k_codes, cache.k_codebook, cache.v_codes, cache.v_codebook, cache.k_residual,
      cache.v_residual, cache.lengths, k_spec=fmt.spec("k"), v_spec=fmt.spec("v"),
      token_group=fmt.token_group, scale=scale, config=config)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_vq_permutation_gives_each_thread_a_channel_quarter(head_dim):
  perm = md.vq_permutation(head_dim)
  assert sorted(perm.tolist()) == list(range(head_dim))
  for c in range(4):  # columns 8 j + 2 c + e of thread c: channels [c D/4, (c+1) D/4)
    cols = [8 * j + 2 * c + e for j in range(head_dim // 8) for e in range(2)]
    assert sorted(perm[cols].tolist()) == list(range(c * head_dim // 4, (c + 1) * head_dim // 4))


def test_gather_reference_picks_centroids():
  """The oracle reads entry ``codes[t, j]`` of sub-space j (a hand check)."""
  n, e, v = 16, 4, 4
  book = np.arange(n * e * v, dtype=np.float32).reshape(n, e, v)
  codes = np.zeros((64, n), np.uint8)
  codes[3, 5] = 2
  got = md.gather_reference(codes, book)                      # [64, 64], permuted columns
  inv = np.argsort(md.vq_permutation(n * v))
  x = got[:, inv]                                             # channel order
  np.testing.assert_array_equal(x[3, 20:24], book[5, 2])
  np.testing.assert_array_equal(x[0, 20:24], book[5, 0])


@pytest.mark.parametrize("head_dim,vector,entries,rows,dtype", [
    (128, 4, 256, 64, jnp.bfloat16), (128, 2, 256, 128, jnp.float16),
    (64, 4, 256, 64, jnp.bfloat16), (64, 2, 16, 64, jnp.bfloat16),
    (128, 8, 64, 64, jnp.float16),
])
def test_gather_registers(head_dim, vector, entries, rows, dtype):
  n = head_dim // vector
  key = _key("gather", head_dim, vector, entries, rows)
  codes = jax.random.randint(key, (rows, n), 0, entries).astype(jnp.uint8)
  book = jax.random.normal(jax.random.fold_in(key, 1), (n, entries, vector)).astype(dtype)
  if not ON_HOPPER:
    text = jax.jit(md.probe_gather).trace(codes, book).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return
  got = np.asarray(md.probe_gather(codes, book), np.float32)
  want = md.gather_reference(np.asarray(codes), np.asarray(book, np.float32))
  np.testing.assert_array_equal(got, want)


def test_gather_checks_its_tiles():
  with pytest.raises(ValueError, match="codes per token < 16"):
    md.gather_codebook(None, None, 64, 8, 256)
  with pytest.raises(ValueError, match="vector_size=3"):
    md.gather_codebook(None, None, 64, 3, 256)


@pytest.mark.parametrize(
    "name,b,hkv,group,d,s,lengths,capacity,dtype", CASES,
    ids=[f"{n}_{b=}_{hkv=}_{g=}_{d=}_{s=}_{jnp.dtype(dt).name}"
         for n, b, hkv, g, d, s, _, _, dt in CASES])
def test_mosaic_vq_attention(name, b, hkv, group, d, s, lengths, capacity, dtype):
  q, cache = _case(name, b, hkv, group, d, s, lengths, capacity, dtype)
  fmt = cache.fmt
  if name.endswith("-grow"):  # the case must really exercise the lazy max's rescale branch
    assert _grows_within_splits(q, cache.dequantize()[0], lengths)
  ok, why = mv.supports(head_dim=d, k_spec=fmt.spec("k"), v_spec=fmt.spec("v"),
                        q_rows=group * s, dtype=dtype, token_group=fmt.token_group,
                        residual=fmt.residual, capacity=capacity)
  assert ok, why
  configs = [None, ma.MosaicAttentionConfig(block_k=64, num_splits=3, max_concurrent_steps=2),
             ma.MosaicAttentionConfig(block_k=64, num_splits=3, lazy_max=False, early_v=False)]
  if (capacity % 128 == 0 and fmt.token_group % 128 == 0 and fmt.residual % 128 == 0
      and group * s <= 16):  # the two-warpgroup kernel
    configs.append(ma.MosaicAttentionConfig(block_k=128, num_splits=2, max_concurrent_steps=2))
    configs.append(ma.MosaicAttentionConfig(block_k=128, num_splits=5, max_concurrent_steps=2))
    configs.append(ma.MosaicAttentionConfig(block_k=128, num_splits=3, max_concurrent_steps=2,
                                            lazy_max=False, early_v=False))
  # Masks on the packed steps too: the same scores, so the same output bit for bit;
  # likewise the -inf guards kept there (dead on finite scores).
  twins = [(c, dataclasses.replace(c, **change)) for c in configs[1::2]
           for change in ({"edge_masks": False}, {"unmasked_guards": True})]
  configs += [t for _, t in twins]
  if not ON_HOPPER:
    for config in configs:
      text = jax.jit(_call, static_argnums=2).trace(q, cache, config).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "mosaic_gpu" in text
    return
  want = _oracle(q, cache)
  tol = _TOL_BASE[dtype] * np.sqrt(max(lengths))
  outs = {}
  for config in configs:
    got = np.asarray(jax.jit(_call, static_argnums=2)(q, cache, config).astype(jnp.float32),
                     np.float64)
    assert np.isfinite(got).all(), f"{config=}"
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"{config=}")
    outs[config] = got
  for config, twin in twins:
    np.testing.assert_array_equal(outs[twin], outs[config], err_msg=f"{config=}")
  # The public entry point, with a traced softmax scale.
  got = jax.jit(lambda q, c, sc: jaxkv.decode_attention(q, c, scale=sc, implementation="mosaic"))(
      q, cache, jnp.float32(0.2))
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32), np.float64),
                             _oracle(q, cache, 0.2), atol=tol, rtol=tol)


@pytest.mark.parametrize("fmt,d,dtype,why", [
    (dataclasses.replace(vq.VQ_PRESETS["cq2"], k_stages=2), 128, jnp.bfloat16, "2 residual VQ"),
    (vq.VQFormat(k_vector=8, v_vector=8), 64, jnp.bfloat16, "8 codes per token"),
    (vq.VQ_PRESETS["cq4"], 128, jnp.float32, "bfloat16/float16 only"),
    (vq.VQ_PRESETS["cq4"], 96, jnp.bfloat16, "head_dim=96"),
    (dataclasses.replace(vq.VQ_PRESETS["cq4"], token_group=32, residual=64), 128, jnp.bfloat16,
     "token_group=32 not a multiple"),
])
def test_mosaic_vq_refuses_with_reason(fmt, d, dtype, why):
  ok, reason = mv.supports(head_dim=d, k_spec=fmt.spec("k"), v_spec=fmt.spec("v"), q_rows=4,
                           dtype=dtype, token_group=fmt.token_group, residual=fmt.residual)
  assert not ok and why in reason, reason


def test_mosaic_vq_refuses_many_rows():
  fmt = vq.VQ_PRESETS["cq2"]
  ok, reason = mv.supports(head_dim=128, k_spec=fmt.spec("k"), v_spec=fmt.spec("v"),
                           q_rows=72, dtype=jnp.bfloat16, token_group=128, residual=128)
  assert not ok and "72 query rows" in reason


@pytest.mark.parametrize("batch,tokens,kv_heads,two", list(itertools.product(
    (1, 6, 8, 9, 20, 64), (4096, 131072), (1, 8), (False, True))))
def test_default_config_fills_one_wave(batch, tokens, kv_heads, two):
  config = mv.default_config(batch=batch, tokens=tokens, kv_heads=kv_heads, num_sms=132,
                             two_warpgroups=two, stages=3)
  block_k = 128 if two else 64
  programs = 132 // (batch * kv_heads)
  # the residual's programs: one (two warpgroups) or one per 64 rows of R = 128
  reserved = 1 if two else 2
  want = programs - reserved if programs > 16 else max(1, programs)
  assert config.num_splits == max(1, min(want, tokens // block_k // 4, 64))
  assert config.block_k == block_k and config.max_concurrent_steps == 3


def test_two_warpgroup_config_checked():
  q, cache = _case("cq2", 1, 1, 8, 128, 3, (300,), 512, jnp.bfloat16)   # 24 query rows
  with pytest.raises(ValueError, match="<= 16 query rows"):
    _call(q, cache, ma.MosaicAttentionConfig(block_k=128, num_splits=2))
  q, cache = _case("cq4", 1, 1, 4, 128, 1, (300,), 512, jnp.bfloat16)
  with pytest.raises(ValueError, match="max_concurrent_steps=8 needs"):
    _call(q, cache, ma.MosaicAttentionConfig(block_k=128, num_splits=2, max_concurrent_steps=8))


def test_default_dispatch_and_forced_mosaic():
  """``implementation=None`` takes the Mosaic kernel on a Hopper GPU, the
  reference elsewhere; a forced "mosaic" off Hopper names why it cannot run."""
  from jaxkv import vq_attention as va  # pylint: disable=import-outside-toplevel
  q, cache = _case("cq2", 1, 2, 4, 128, 1, (300,), 512, jnp.bfloat16)
  assert va.resolve(q, cache, None) == ("mosaic" if ON_HOPPER else "reference")
  assert va.resolve(q, cache, ("mosaic", "reference")) == ("mosaic" if ON_HOPPER
                                                          else "reference")
  if not ON_HOPPER:
    with pytest.raises(ValueError, match="mosaic: the Mosaic GPU kernels need a Hopper"):
      jaxkv.decode_attention(q, cache, implementation="mosaic")
  two_stage = dataclasses.replace(vq.VQ_PRESETS["cq2"], k_stages=2)
  books = tuple(jnp.ones(two_stage.codebook_shape(side, 2, 128), jnp.float16)
                for side in ("k", "v"))
  cache2 = jaxkv.VQCache.init(two_stage, books, 1, 2, 128, 512, jnp.bfloat16)
  # No Mosaic kernel for 2 stages: the Triton VQ kernel on a GPU, else the reference.
  assert va.resolve(q, cache2, None) == ("triton" if jax.default_backend() == "gpu"
                                         else "reference")


def test_config_type_picks_the_family():
  """A Triton config never runs the Mosaic kernel and a Mosaic config never the
  Triton one; a forced family that its config does not fit names why."""
  from jaxkv import vq_attention as va  # pylint: disable=import-outside-toplevel
  from pallas_kernels import vq_attention as vk  # pylint: disable=import-outside-toplevel
  q, cache = _case("cq2", 1, 2, 4, 128, 1, (300,), 512, jnp.bfloat16)
  triton_cfg = vk.VQAttentionConfig(block_k=64, num_splits=2)
  mosaic_cfg = ma.MosaicAttentionConfig(block_k=64, num_splits=2)
  with pytest.raises(ValueError, match="config is a VQAttentionConfig"):
    va.resolve(q, cache, "mosaic", triton_cfg)
  with pytest.raises(ValueError, match="triton: config is a MosaicAttentionConfig"):
    va.resolve(q, cache, "triton", mosaic_cfg)
  want = "mosaic" if ON_HOPPER else "reference"
  assert va.resolve(q, cache, None, mosaic_cfg) == want
  assert va.resolve(q, cache, None, triton_cfg) == ("triton" if jax.default_backend() == "gpu"
                                                    else "reference")
