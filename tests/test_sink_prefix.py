"""The fused prefix + merge kernel of sink formats (`pallas_kernels.sink_prefix`)
vs float64 numpy attention.

Oracle: a random decode problem over two disjoint key sets, the prefix rows
(visible to query ``s`` iff ``t < packed_len`` and ``t <= L - S + s``) and
"kernel" keys; the kernel part's ``(o, lse)`` is formed from its keys in
float64 numpy, and the kernel's merged result must equal softmax attention
over the union of both sets at once. On CPU the kernel runs in Pallas
interpret mode (and is lowered for CUDA); ``JAXKV_TEST_GPU=1`` runs it compiled.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import sink_prefix as sp

INTERPRET = os.environ.get("JAXKV_TEST_GPU", "0") != "1"


def _softmax_rows(scores, values):
  """float64 ``(o [D], lse)`` of one query over ``scores [T]``; zeros / -inf if T = 0."""
  if scores.size == 0:
    return np.zeros(values.shape[-1]), -np.inf
  m = scores.max()
  p = np.exp(scores - m)
  return (p / p.sum()) @ values, m + np.log(p.sum())


def _problem(seed, b, hkv, g, d, s, n, lengths, packed, empty_kernel):
  """Random q, prefix kv ``[B, Hkv, 2, n, D]``, the kernel part's ``(o, lse)`` (float64
  numpy from its own keys) and the answer over both key sets."""
  rng = np.random.default_rng(seed)
  hq, scale = hkv * g, d ** -0.5
  q = rng.normal(size=(b, s, hq, d))
  kv = rng.normal(size=(b, hkv, 2, n, d)) * np.array([1.5, 1.0])[None, None, :, None, None]
  kv[:, :, 0, 0] *= 4.0  # a large-norm sink token
  for i in range(b):  # stale rows past packed_len: NaN must never reach the output
    kv[i, :, :, packed[i]:] = np.nan
  o = np.zeros((b, s, hq, d))
  lse = np.full((b, s, hq), -np.inf)
  want, want_lse = np.zeros_like(o), np.full_like(lse, -np.inf)
  for i in range(b):
    for j in range(s):
      limit = lengths[i] - s + j
      for h in range(hq):
        kk = rng.normal(size=(int(rng.integers(1, 50)), d)) * 1.5   # the kernel's keys
        vk = rng.normal(size=(kk.shape[0], d))
        if (i, j, h) in empty_kernel:
          kk, vk = kk[:0], vk[:0]
        o[i, j, h], lse[i, j, h] = _softmax_rows(kk @ q[i, j, h] * scale, vk)
        seen = [t for t in range(n) if t < packed[i] and t <= limit]
        kp, vp = kv[i, h // g, 0, seen], kv[i, h // g, 1, seen]
        want[i, j, h], want_lse[i, j, h] = _softmax_rows(
            np.concatenate([kk, kp]) @ q[i, j, h] * scale, np.concatenate([vk, vp]))
  return q, kv, o, lse, want, want_lse, scale


# (B, Hkv, G, D, q_len, n, lengths, packed_len): an empty prefix (packed 0), a
# length below q_len (queries 0 and 1 of L = 2 see rows < 0 and < 1: the rule
# alone, whatever packed_len says), causal cuts inside the prefix (L = 30 = packed),
# prefixes shorter than n, several blocks of the online softmax (n = 128).
CASES = [
    (2, 2, 1, 64, 1, 32, (40, 0), (32, 0)),
    (3, 2, 4, 128, 2, 128, (300, 1, 70), (128, 0, 70)),
    (2, 1, 8, 64, 3, 32, (30, 2), (30, 32)),
]


@pytest.mark.parametrize("b,hkv,g,d,s,n,lengths,packed", CASES,
                         ids=[f"g{c[2]}_d{c[3]}_s{c[4]}_n{c[5]}" for c in CASES])
def test_merged_equals_attention_over_both_parts(b, hkv, g, d, s, n, lengths, packed):
  # kernel parts with lse = -inf: two, and query 0 of sequences whose prefix it cannot see
  empty = {(0, 0, 0), (b - 1, s - 1, hkv * g - 1)} | {
      (i, 0, 0) for i in range(b) if packed[i] == 0 or lengths[i] < s}
  q, kv, o, lse, want, want_lse, scale = _problem(n + d + g, b, hkv, g, d, s, n, lengths,
                                                  packed, empty)
  args = [jnp.asarray(x, jnp.float32) for x in (q, kv)] + [
      jnp.asarray(lengths, jnp.int32), jnp.asarray(packed, jnp.int32),
      jnp.asarray(o, jnp.float32), jnp.asarray(lse, jnp.float32)]
  got, got_lse = sp.sink_prefix_attention(*args, scale=scale, interpret=INTERPRET)
  ref, ref_lse = sp.sink_prefix_reference(*args, scale=scale)
  seen = np.isfinite(want_lse)
  assert not seen.all()  # some query sees nothing at all
  for out, out_lse in ((got, got_lse), (ref, ref_lse)):
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.isfinite(np.asarray(out_lse)), seen)
    np.testing.assert_allclose(np.asarray(out_lse, np.float64)[seen], want_lse[seen],
                               rtol=2e-5, atol=2e-5)


def test_input_policy_and_dtypes():
  """A NaN/inf query row and every row of a flagged sequence are NaN, the rest as
  the reference (bfloat16 q / o in, bfloat16 out)."""
  b, hkv, g, d, s, n = 3, 2, 2, 64, 1, 32
  q, kv, o, lse, *_, scale = _problem(9, b, hkv, g, d, s, n, (33, 20, 50), (32, 20, 32), ())
  q[1, 0, 3, 5] = np.inf
  args = [jnp.asarray(q, jnp.bfloat16), jnp.asarray(kv, jnp.float32),
          jnp.asarray([33, 20, 50], jnp.int32), jnp.asarray([32, 20, 32], jnp.int32),
          jnp.asarray(o, jnp.bfloat16), jnp.asarray(lse, jnp.float32)]
  seq_bad = jnp.asarray([False, False, True])
  got, _ = sp.sink_prefix_attention(*args, scale=scale, seq_bad=seq_bad, interpret=INTERPRET)
  ref, _ = sp.sink_prefix_reference(*args, scale=scale, seq_bad=seq_bad)
  assert got.dtype == jnp.bfloat16
  got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
  bad = np.zeros(got.shape, bool)
  bad[2], bad[1, 0, 3] = True, True
  np.testing.assert_array_equal(np.isnan(got), bad)
  np.testing.assert_array_equal(np.isnan(ref), bad)
  np.testing.assert_allclose(got[~bad], ref[~bad], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("d,g,s,n,dtype", [(128, 8, 1, 256, jnp.bfloat16),
                                           (64, 4, 3, 32, jnp.float32)])
def test_lowers_for_cuda(d, g, s, n, dtype):
  """The compiled kernel (64 query rows and 256 prefix rows; 12 rows, padded)
  lowers to a Triton call, with a traced scale (no GPU needed)."""
  b, hkv = 2, 2
  q = jnp.ones((b, s, hkv * g, d), dtype)
  kv = jnp.ones((b, hkv, 2, n, d), jnp.float32)
  lens = jnp.full((b,), 300, jnp.int32)
  lse = jnp.zeros((b, s, hkv * g), jnp.float32)
  fn = jax.jit(lambda q, kv, lens, o, lse, scale: sp.sink_prefix_attention(
      q, kv, lens, lens, o, lse, scale=scale, seq_bad=lens > 0))
  text = fn.trace(q, kv, lens, q, lse, jnp.float32(0.1)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and "jaxkv_sink_prefix" in text


def test_bad_arguments():
  q = jnp.zeros((1, 1, 4, 64))
  kv = jnp.zeros((1, 2, 2, 32, 64))
  lens, lse = jnp.zeros((1,), jnp.int32), jnp.zeros((1, 1, 4))
  with pytest.raises(ValueError, match="kv.shape"):
    sp.sink_prefix_attention(q, kv[:, :, :1], lens, lens, q, lse, scale=1.0, interpret=True)
  with pytest.raises(ValueError, match="multiple of Hkv"):
    sp.sink_prefix_attention(q, jnp.zeros((1, 3, 2, 32, 64)), lens, lens, q, lse, scale=1.0,
                             interpret=True)
  with pytest.raises(ValueError, match="head_dim=48"):
    sp.sink_prefix_attention(q[..., :48], kv[..., :48], lens, lens, q[..., :48], lse,
                             scale=1.0, interpret=True)
  assert not sp.supported(96) and sp.supported(64)
