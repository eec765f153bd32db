"""The fused VQ attention kernel vs a float64 oracle over the dequantized cache.

CPU/CI runs every case in Pallas interpret mode; ``JAXKV_TEST_GPU=1`` runs
the same cases compiled on the GPU. The cases cover every VQ preset and the
format options (vector 2/4/8, 1-2 stages, fewer than 256 entries), GQA
1/3/4/8, head_dim 64/128, 1-8 new queries and ragged lengths, including an
empty and a full packed region.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import vq
from pallas_kernels import vq_attention as vk
from tests.oracle import np_attention_dequantized

INTERPRET = os.environ.get("JAXKV_TEST_GPU", "0") != "1"

# Attention tolerance: base[dtype] * sqrt(T) (T = keys attended), as in
# tests/test_pallas_kernels.py.
_TOL_BASE = {jnp.float32: 2e-6, jnp.bfloat16: 2e-3}

FORMATS = {
    "cq4": vq.VQ_PRESETS["cq4"],
    "cq2": vq.VQ_PRESETS["cq2"],
    "cq4-f32-g32": dataclasses.replace(vq.VQ_PRESETS["cq4"], token_group=32, residual=64,
                                       codebook_dtype="float32"),
    "k8x2-v4b6": vq.VQFormat(k_vector=8, v_vector=4, k_stages=2, v_index_bits=6,
                             token_group=32, residual=64),
    "cq2x2-bf16cb": dataclasses.replace(vq.VQ_PRESETS["cq2"], k_stages=2, v_stages=2,
                                        codebook_dtype="bfloat16"),
}

CASES = [
    # (format, B, Hkv, Hq/Hkv, D, S, lengths, capacity, dtype)
    ("cq4", 2, 2, 4, 128, 1, (300, 129), 512, jnp.float32),       # mid-group ends
    ("cq2", 2, 1, 8, 64, 3, (260, 17), 512, jnp.bfloat16),        # empty packed region (17)
    ("cq4-f32-g32", 1, 2, 3, 64, 8, (200,), 256, jnp.float32),    # GQA 3, S 8
    ("k8x2-v4b6", 2, 1, 4, 64, 5, (150, 40), 256, jnp.float32),   # vector 8, 2 stages, 64 entries
    # test_dispatch_reference_and_custom_scale: GQA 1, D 128, 2 stages, full packed region.
    pytest.param("cq2", 2, 2, 1, 128, 2, (385, 128), 512, jnp.float32, marks=pytest.mark.slow),
    pytest.param("cq2x2-bf16cb", 1, 2, 4, 64, 4, (512,), 512, jnp.float32,
                 marks=pytest.mark.slow),
    pytest.param("cq4", 1, 1, 8, 128, 1, (70,), 256, jnp.bfloat16, marks=pytest.mark.slow),
]


def _case_id(c):
  c = c.values if hasattr(c, "values") else c
  return (f"{c[0]}_B{c[1]}_H{c[2]}_gqa{c[3]}_D{c[4]}_S{c[5]}_L{'-'.join(map(str, c[6]))}"
          f"_{jnp.dtype(c[8]).name}")


def _key(*parts):
  return jax.random.PRNGKey(zlib.crc32(repr(parts).encode()))


def _make_case(name, batch, kv_heads, group_q, head_dim, num_queries, lengths, capacity, dtype):
  fmt = FORMATS[name]
  books = []
  for side in ("k", "v"):
    shape = fmt.codebook_shape(side, kv_heads, head_dim)
    books.append((jax.random.normal(_key(name, side, head_dim), shape) * 0.8 + 0.1)
                 .astype(fmt.codebook_dtype))
  k1, k2, k3 = jax.random.split(_key(name, batch, kv_heads, group_q, head_dim, lengths), 3)
  t = max(lengths)
  k = (jax.random.normal(k1, (batch, t, kv_heads, head_dim)) * 1.5 + 0.2).astype(dtype)
  v = jax.random.normal(k2, (batch, t, kv_heads, head_dim)).astype(dtype)
  q = jax.random.normal(k3, (batch, num_queries, kv_heads * group_q, head_dim)).astype(dtype)
  cache = jaxkv.VQCache.init(fmt, tuple(books), batch, kv_heads, head_dim, capacity, dtype)
  return q, cache.prefill(k, v, np.asarray(lengths))


def _oracle(q, cache, scale=None):
  kd, vd = cache.dequantize()
  return np_attention_dequantized(np.asarray(q.astype(jnp.float32)), kd, vd,
                                  np.asarray(cache.lengths), scale=scale)


def _kernel(q, cache, **kw):
  return vk.vq_decode_attention(
      q, cache.k_codes, cache.k_codebook, cache.v_codes, cache.v_codebook, cache.k_residual,
      cache.v_residual, cache.lengths, k_spec=cache.fmt.spec("k"), v_spec=cache.fmt.spec("v"),
      token_group=cache.fmt.token_group, interpret=INTERPRET, **kw)


@pytest.mark.parametrize(
    "name,batch,kv_heads,group_q,head_dim,num_queries,lengths,capacity,dtype", CASES,
    ids=[_case_id(c) for c in CASES])
def test_vq_attention_matches_oracle(name, batch, kv_heads, group_q, head_dim, num_queries,
                                     lengths, capacity, dtype):
  q, cache = _make_case(name, batch, kv_heads, group_q, head_dim, num_queries, lengths,
                        capacity, dtype)
  out = _kernel(q, cache)
  assert out.shape == q.shape and out.dtype == q.dtype
  got = np.asarray(out.astype(jnp.float32), np.float64)
  assert not np.isnan(got).any()
  tol = _TOL_BASE[dtype] * np.sqrt(max(lengths))
  np.testing.assert_allclose(got, _oracle(q, cache), atol=tol, rtol=tol)


def test_dispatch_reference_and_custom_scale():
  """`jaxkv.decode_attention` routes a VQCache; the jnp reference and a runtime scale agree.

  Also the GQA 1, head_dim 128, two-stage, bf16-codebook, full-packed-region case.
  """
  q, cache = _make_case("cq2x2-bf16cb", 2, 2, 1, 128, 2, (256, 33), 256, jnp.float32)
  assert int(cache.packed_lens[0]) == 256 and int(cache.packed_lens[1]) == 0
  tol = _TOL_BASE[jnp.float32] * np.sqrt(256)
  want = _oracle(q, cache, 0.3)
  ref = vk.vq_decode_attention_reference(
      q, cache.k_codes, cache.k_codebook, cache.v_codes, cache.v_codebook, cache.k_residual,
      cache.v_residual, cache.lengths, token_group=cache.fmt.token_group, scale=0.3)
  np.testing.assert_allclose(np.asarray(ref, np.float64), want, atol=tol, rtol=tol)
  for impl in ("reference", "triton"):
    got = jax.jit(lambda q, c, s, _i=impl: jaxkv.decode_attention(
        q, c, scale=s, implementation=_i))(q, cache, jnp.float32(0.3))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)
  # The default scale gives a different answer (the scale is really used).
  assert np.abs(_oracle(q, cache) - want).max() > 10 * tol
  with pytest.raises(ValueError, match="view='draft': a VQ cache has only the 'target' view"):
    jaxkv.decode_attention(q, cache, view="draft")


@pytest.mark.parametrize("name", ["cq4", "cq2", "k8x2-v4b6"])
def test_vq_kernel_lowers_for_cuda(name):
  """The compiled (non-interpret) kernel lowers to a Triton custom call."""
  fmt = FORMATS[name]
  b, h, d, cap = 2, 2, 128, 512
  k_spec, v_spec = fmt.spec("k"), fmt.spec("v")
  q = jnp.ones((b, 1, 4 * h, d), jnp.bfloat16)
  args = (q, jnp.zeros((b, h, cap, k_spec.code_width(d)), jnp.uint8),
          jnp.ones(k_spec.codebook_shape(h, d), fmt.codebook_dtype),
          jnp.zeros((b, h, cap, v_spec.code_width(d)), jnp.uint8),
          jnp.ones(v_spec.codebook_shape(h, d), fmt.codebook_dtype),
          jnp.ones((b, h, fmt.residual, d), jnp.bfloat16),
          jnp.ones((b, h, fmt.residual, d), jnp.bfloat16), jnp.array([300, 7], jnp.int32))

  def f(*a):
    return vk.vq_decode_attention(*a, k_spec=k_spec, v_spec=v_spec,
                                  token_group=fmt.token_group, interpret=False)

  text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  assert "jaxkv_vq_attention" in text
