"""The Mosaic family's combine kernel (`pallas_kernels.combine_t`) vs float64 attention.

Oracle: split a random attention problem into J parts, form each part's
unnormalized ``O^T``, ``l`` and ``m`` in float64 numpy, and compare the merged
result with softmax attention over all keys at once. CPU runs the kernel in
Pallas interpret mode (and lowers it for CUDA); ``JAXKV_TEST_GPU=1`` runs it
compiled.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import combine_t as ct
from pallas_kernels import mosaic_attention as ma

INTERPRET = os.environ.get("JAXKV_TEST_GPU", "0") != "1"


def _partial(s, v):
  """One split's unnormalized statistics of scores ``s [T, R]`` and values ``v [T,
  D]`` (float64): ``m, l [R]`` and ``o^T [D, R]``."""
  m = s.max(axis=0)
  p = np.exp(s - m)
  return m, p.sum(axis=0), v.T @ p


def _empty(batch, heads, parts, head_dim, rows, width):
  """Zeroed partials ``o_t, l, m`` (``m = -inf``: no key) and an answer ``[B, H, rows,
  D]`` to fill (float64)."""
  return (np.zeros((batch, heads, parts, head_dim, width)), np.zeros((batch, heads, parts, width)),
          np.full((batch, heads, parts, width), -np.inf), np.zeros((batch, heads, rows, head_dim)))


def _problem(seed, batch, heads, parts, head_dim, rows, width, empty_part=None):
  """Partials of random attention split into ``parts`` (numpy float64) and its answer."""
  rng = np.random.default_rng(seed)
  o_t, l, m, want = _empty(batch, heads, parts, head_dim, rows, width)
  for b in range(batch):
    for h in range(heads):
      lens = rng.integers(1, 40, parts)
      if empty_part is not None:
        lens[empty_part] = 0
      s = [rng.normal(0, 3, (n, rows)) for n in lens]               # scores [T_j, rows]
      v = [rng.normal(0, 1, (n, head_dim)) for n in lens]
      for j in range(parts):
        if lens[j]:
          m[b, h, j, :rows], l[b, h, j, :rows], o_t[b, h, j, :, :rows] = _partial(s[j], v[j])
      s_all, v_all = np.concatenate(s), np.concatenate(v)
      p_all = np.exp(s_all - s_all.max(axis=0))
      want[b, h] = (p_all / p_all.sum(axis=0)).T @ v_all
  return o_t, l, m, want


@pytest.mark.parametrize("batch,heads,parts,head_dim,rows,width,permuted,empty,tail", [
    (1, 2, 5, 128, 8, 16, True, 1, 1),     # GQA 8 rows, value-MMA width 16, a split with no keys
    (2, 1, 34, 128, 4, 16, True, None, 1),  # 33 splits + residual (non-power-of-two J)
    (1, 3, 3, 64, 16, 16, False, 0, 1),
    (1, 1, 49, 64, 64, 64, True, None, 1),
    (2, 2, 10, 128, 8, 16, True, 9, 2),    # two residual partials (two warpgroups), one empty
])
def test_combine_matches_full_attention(batch, heads, parts, head_dim, rows, width, permuted,
                                        empty, tail):
  o_t, l, m, want = _problem(parts * head_dim + rows, batch, heads, parts, head_dim, rows, width,
                             empty)
  packed_rows = None
  if permuted:  # packed partials hold channel perm[r] in row r; the last `tail` in order
    perm = np.random.default_rng(7).permutation(head_dim)
    o_t[:, :, :-tail] = o_t[:, :, :-tail][:, :, :, perm]
    packed_rows = np.argsort(perm)
  args = [jnp.asarray(x, jnp.float32) for x in (o_t, l, m)]
  got = ct.combine_t(*args, rows=rows, packed_rows=packed_rows, interpret=INTERPRET,
                     plain_tail=tail)
  assert got.shape == (batch, heads, rows, head_dim)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)
  ref = ct.combine_t_reference(*args, rows=rows, packed_rows=packed_rows, plain_tail=tail)
  np.testing.assert_allclose(np.asarray(ref, np.float64), want, rtol=2e-5, atol=2e-5)
  if INTERPRET:
    lowered = jax.jit(lambda o, l_, m_: ct.combine_t(
        o, l_, m_, rows=rows, packed_rows=packed_rows, plain_tail=tail)).trace(*args).lower(
            lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()


def test_no_visible_key_gives_zeros_and_nan_stays_nan():
  o_t, l, m, _ = _problem(3, 1, 2, 3, 64, 8, 8)
  l[0, 0, :, 0] = 0.0       # row 0: no key in any part
  m[0, 0, :, 0] = -np.inf
  o_t[0, 0, :, :, 0] = 0.0
  l[0, 1, 1, 3] = np.nan    # row 3 of head 1: a NaN sum
  got = np.asarray(ct.combine_t(*(jnp.asarray(x, jnp.float32) for x in (o_t, l, m)), rows=8,
                                interpret=INTERPRET))
  assert (got[0, 0, 0] == 0).all()
  assert np.isnan(got[0, 1, 3]).all()
  assert np.isfinite(np.delete(got[0, 1], 3, axis=0)).all()


@pytest.mark.parametrize("num_queries,q_heads,heads,rows", [(1, 8, 2, 4), (2, 12, 3, 8),
                                                            (3, 4, 1, 16)])
def test_flags_from_q_in_the_kernel(num_queries, q_heads, heads, rows):
  """With q's rows as the split kernel reads them (``qh``: `mosaic_attention.query_rows`,
  scaled, padded) and ``seq_bad`` the kernel flags the rows itself: query row
  ``g S + s`` of kv head ``h`` is NaN iff q[b, s, h G + g] holds a NaN/inf or
  sequence b is flagged (numpy oracle); every other row is the unflagged
  result bit for bit. GQA 4 / q_len 2 / q_len 3 (rows past G S padded)."""
  batch, head_dim, width = 3, 64, max(rows, 8)
  o_t, l, m, _ = _problem(11 + rows, batch, heads, 5, head_dim, rows, width)
  args = tuple(jnp.asarray(x, jnp.float32) for x in (o_t, l, m))
  rng = np.random.default_rng(rows)
  q = rng.normal(size=(batch, num_queries, q_heads, head_dim)).astype(np.float32)
  q[0, num_queries - 1, q_heads - 1, 5] = np.nan
  q[1, 0, 0, head_dim - 1] = np.inf
  q[1, num_queries - 1, q_heads // 2, 0] = -np.inf
  seq_bad = np.array([False, False, True])
  group = q_heads // heads
  want = np.zeros((batch, heads, rows), bool)
  for b in range(batch):
    for h in range(heads):
      for g in range(group):
        for s_ in range(num_queries):
          want[b, h, g * num_queries + s_] = (seq_bad[b]
                                              or not np.isfinite(q[b, s_, h * group + g]).all())
  q_rows = group * num_queries

  def rows_of(q):  # what the Mosaic split kernel reads: [B, H, N', D], scaled
    return ma.query_rows(jnp.asarray(q), heads, 0.125, jnp.bfloat16, width)

  plain = np.asarray(ct.combine_t(*args, rows=rows, interpret=INTERPRET))
  got = np.asarray(ct.combine_t(*args, rows=rows, interpret=INTERPRET, qh=rows_of(q),
                                q_rows=q_rows, seq_bad=jnp.asarray(seq_bad)))
  flagged = np.broadcast_to(want[..., None], got.shape)
  assert want.any() and not want.all()
  assert np.isnan(got[flagged]).all()
  np.testing.assert_array_equal(got[~flagged], plain[~flagged])
  # without seq_bad: only the non-finite rows
  got = np.asarray(ct.combine_t(*args, rows=rows, interpret=INTERPRET, qh=rows_of(q),
                                q_rows=q_rows))
  assert np.isnan(got[0, heads - 1, group * num_queries - 1]).all()  # q[0, S-1, Hq-1] has a NaN
  assert np.isfinite(got[2]).all()
  if INTERPRET:  # the Triton lowering of the flags (no GPU needed)
    lowered = jax.jit(lambda o, l_, m_, q_, sb: ct.combine_t(
        o, l_, m_, rows=rows, qh=q_, q_rows=q_rows, seq_bad=sb)).trace(
            *args, rows_of(q), jnp.asarray(seq_bad)).lower(
                lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()


def test_bad_arguments():
  o_t = jnp.zeros((1, 1, 3, 64, 16))
  l = jnp.zeros((1, 1, 3, 16))
  with pytest.raises(ValueError, match="rows=6"):
    ct.combine_t(o_t, l, l, rows=6)
  with pytest.raises(ValueError, match="rows=32"):
    ct.combine_t(o_t, l, l, rows=32)
  qh = jnp.zeros((1, 1, 8, 64))
  with pytest.raises(ValueError, match="q_rows=4"):   # 4 query rows, 2 merged
    ct.combine_t(o_t, l, l, rows=2, qh=qh, q_rows=4)
  with pytest.raises(ValueError, match=r"qh.shape=\(1, 8, 64\)"):
    ct.combine_t(o_t, l, l, rows=4, qh=qh[0], q_rows=4)
  with pytest.raises(ValueError, match="seq_bad needs q"):
    ct.combine_t(o_t, l, l, rows=4, seq_bad=jnp.zeros((1,), bool))
  with pytest.raises(ValueError, match=r"seq_bad.shape=\(2,\)"):
    ct.combine_t(o_t, l, l, rows=4, qh=qh, q_rows=4, seq_bad=jnp.zeros((2,), bool))
  with pytest.raises(ValueError, match="permutation of range"):
    ct.combine_t(o_t, l, l, rows=8, packed_rows=np.zeros(64, int))
  with pytest.raises(ValueError, match="l .* and m"):
    ct.combine_t(o_t, l[:, :, :2], l, rows=8)
  with pytest.raises(ValueError, match="plain_tail=4"):
    ct.combine_t(o_t, l, l, rows=8, plain_tail=4)


@pytest.mark.parametrize("q_rows,n_rows,rows", [(4, 8, 4), (6, 16, 8), (1, 8, 1)])
def test_flags_from_the_kernels_query_rows(q_rows, n_rows, rows):
  """With ``qh`` (the split kernel's query rows ``[B, H, N', D]``) and ``q_rows`` the
  kernel flags row ``r < q_rows`` of kv head ``h`` iff ``qh[b, h, r]`` holds a
  NaN/inf or sequence b is flagged (numpy oracle); padding rows never; every
  other row is the unflagged result bit for bit."""
  batch, heads, head_dim, width = 3, 2, 64, max(rows, 8)
  o_t, l, m, _ = _problem(23 + rows + q_rows, batch, heads, 5, head_dim, rows, width)
  args = tuple(jnp.asarray(x, jnp.float32) for x in (o_t, l, m))
  rng = np.random.default_rng(q_rows)
  qh = rng.normal(size=(batch, heads, n_rows, head_dim)).astype(np.float32)
  qh[0, 1, q_rows - 1, 3] = np.nan
  qh[1, 0, 0, head_dim - 1] = -np.inf
  qh[1, 1, n_rows - 1, 0] = np.inf          # a padding row: never flagged
  seq_bad = np.array([False, False, True])
  want = np.zeros((batch, heads, rows), bool)
  for b in range(batch):
    for h in range(heads):
      for r in range(min(rows, q_rows)):
        want[b, h, r] = seq_bad[b] or not np.isfinite(qh[b, h, r]).all()
  plain = np.asarray(ct.combine_t(*args, rows=rows, interpret=INTERPRET))
  got = np.asarray(ct.combine_t(*args, rows=rows, interpret=INTERPRET,
                                qh=jnp.asarray(qh, jnp.bfloat16), q_rows=q_rows,
                                seq_bad=jnp.asarray(seq_bad)))
  flagged = np.broadcast_to(want[..., None], got.shape)
  assert want.any() and not want.all()
  assert np.isnan(got[flagged]).all()
  np.testing.assert_array_equal(got[~flagged], plain[~flagged])
  with pytest.raises(ValueError, match="q_rows"):
    ct.combine_t(*args, rows=rows, interpret=True, qh=jnp.asarray(qh), q_rows=rows + 1)


@pytest.mark.parametrize("staged,heads,num_queries,group,n_stage,head_dim,parts,rows", [
    ((6,), 2, 5, 4, 6, 128, 9, 32),    # verify: 5 queries of GQA 4, P 6, rows padded 20 -> 32
    ((4, 1, 5), 3, 1, 8, 5, 64, 4, 8),  # draft steps: one query of GQA 8, ragged staged counts
    ((3, 5), 1, 3, 1, 6, 128, 34, 4),  # GQA 1, staged == S and > S, 33 splits + residual
])
def test_staged_rows_merged_in_the_kernel(staged, heads, num_queries, group, n_stage, head_dim,
                                          parts, rows):
  """``stage``: the staged rows attended exactly and merged with the partials give
  softmax attention over the partials' keys plus each query's visible staged rows
  (float64 numpy: row ``s G + g`` sees staged rows ``p <= staged - S + s``)."""
  batch, staged = len(staged), np.asarray(staged)
  rng = np.random.default_rng(batch * 100 + n_stage)
  q_rows = num_queries * group
  width = max(rows, 16)
  scale = head_dim ** -0.5
  bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)  # noqa: E731
  # q and the staged rows as the kernel reads them (bfloat16); the committed
  # part: random keys split into parts, scored with the same q
  q = bf16(rng.normal(size=(batch, heads, q_rows, head_dim)))
  k_st, v_st = (bf16(rng.normal(size=(batch, n_stage, heads, head_dim))) for _ in range(2))
  o_t, l, m, want = _empty(batch, heads, parts, head_dim, rows, width)
  for b in range(batch):
    for h in range(heads):
      lens = rng.integers(0, 30, parts)
      ks = [rng.normal(size=(n, head_dim)) for n in lens]
      vs = [rng.normal(size=(n, head_dim)) for n in lens]
      for j in range(parts):
        if lens[j]:
          m[b, h, j, :q_rows], l[b, h, j, :q_rows], o_t[b, h, j, :, :q_rows] = _partial(
              ks[j] @ q[b, h].T * scale, vs[j])                           # scores [T_j, R]
      for r in range(q_rows):
        vis = np.arange(n_stage) <= staged[b] - num_queries + r // group
        k_all = np.concatenate([*ks, k_st[b, vis, h]])
        v_all = np.concatenate([*vs, v_st[b, vis, h]])
        s = k_all @ q[b, h, r] * scale
        p = np.exp(s - s.max())
        want[b, h, r] = p @ v_all / p.sum()
  args = [jnp.asarray(x, jnp.float32) for x in (o_t, l, m)]
  stage = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k_st, jnp.bfloat16),
           jnp.asarray(v_st, jnp.bfloat16), jnp.asarray(staged, jnp.int32), scale, num_queries)
  got = np.asarray(ct.combine_t(*args, rows=rows, interpret=INTERPRET, stage=stage), np.float64)
  np.testing.assert_allclose(got[:, :, :q_rows], want[:, :, :q_rows], rtol=2e-5, atol=2e-5)
  ref = np.asarray(ct.combine_t_reference(*args, rows=rows, stage=stage), np.float64)
  np.testing.assert_allclose(ref[:, :, :q_rows], want[:, :, :q_rows], rtol=2e-5, atol=2e-5)
  if INTERPRET:
    lowered = jax.jit(lambda o, l_, m_: ct.combine_t(o, l_, m_, rows=rows, stage=stage)).trace(
        *args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text().lower()
  # The input policy: a NaN/inf in a staged K or V row p < staged of any kv
  # head (here the last staged row, which the first queries do not see) makes
  # that sequence NaN; one in a row p >= staged (stale, or not staged yet)
  # changes nothing.
  for side, value, bad_b in ((1, np.nan, 0), (2, np.inf, batch - 1)):
    bad = [np.array(k_st), np.array(v_st)]
    bad[side - 1][bad_b, staged[bad_b] - 1, heads - 1, 3] = value
    stale = [b for b in range(batch) if b != bad_b and staged[b] < n_stage]
    for b in stale:
      bad[2 - side][b, staged[b], 0, 0] = value
    bad_stage = (stage[0], *(jnp.asarray(x, jnp.bfloat16) for x in bad), *stage[3:])
    for fn in (functools.partial(ct.combine_t, interpret=INTERPRET), ct.combine_t_reference):
      out = np.asarray(fn(*args, rows=rows, stage=bad_stage), np.float64)
      assert np.isnan(out[bad_b]).all()
      others = [b for b in range(batch) if b != bad_b]
      np.testing.assert_array_equal(out[others], np.asarray(
          fn(*args, rows=rows, stage=stage), np.float64)[others])
  assert len(set(staged.tolist())) == batch  # ragged counts: each sequence reads its own


def test_stage_with_flags_and_packed_rows():
  """``stage`` beside the query-row flags (``qh``, ``seq_bad``) and permuted packed
  rows, as the Mosaic path calls it: the flagged rows are NaN, every other row the
  reference's (staged rows merged, rows in channel order); a sequence with no
  committed key and no staged row gives zeros."""
  batch, heads, num_queries, group, n_stage, head_dim, rows, width = 3, 2, 2, 4, 4, 64, 8, 16
  o_t, l, m, _ = _problem(21, batch, heads, 6, head_dim, rows, width)
  o_t[2], l[2], m[2] = 0.0, 0.0, -np.inf          # sequence 2: nothing committed ...
  staged = np.array([4, 2, 0])                    # ... and nothing staged
  perm = np.random.default_rng(3).permutation(head_dim)
  o_t[:, :, :-1] = o_t[:, :, :-1][:, :, :, perm]
  args = [jnp.asarray(x, jnp.float32) for x in (o_t, l, m)]
  rng = np.random.default_rng(4)
  q = rng.normal(size=(batch, heads, num_queries * group, head_dim)).astype(np.float32)
  q[0, 1, 5, 7] = np.nan                          # one flagged row of sequence 0
  k_st, v_st = (jnp.asarray(rng.normal(size=(batch, n_stage, heads, head_dim)), jnp.bfloat16)
                for _ in range(2))
  stage = (jnp.asarray(q), k_st, v_st, jnp.asarray(staged, jnp.int32), 0.125, num_queries)
  seq_bad = jnp.asarray([False, True, False])
  qh = ma.query_rows(jnp.asarray(q.reshape(batch, 1, heads * num_queries * group, head_dim)),
                     heads, 0.125, jnp.bfloat16, width)
  got = np.asarray(ct.combine_t(*args, rows=rows, packed_rows=np.argsort(perm), qh=qh,
                                q_rows=num_queries * group, seq_bad=seq_bad, stage=stage,
                                interpret=INTERPRET), np.float64)
  q_clean = np.where(np.isnan(q), 0.0, q)
  want = np.asarray(ct.combine_t_reference(
      *args, rows=rows, packed_rows=np.argsort(perm),
      stage=(jnp.asarray(q_clean), *stage[1:])), np.float64)
  flagged = np.zeros(got.shape[:3], bool)
  flagged[0, 1, 5] = True
  flagged[1] = True
  assert np.isnan(got[flagged]).all()
  np.testing.assert_allclose(got[~flagged], want[~flagged], rtol=2e-5, atol=2e-5)
  assert (got[2] == 0).all()


def test_stage_refusals():
  o_t, l, m, _ = _problem(5, 1, 2, 3, 64, 8, 8)
  args = [jnp.asarray(x, jnp.float32) for x in (o_t, l, m)]
  q = jnp.ones((1, 2, 8, 64))
  kv = jnp.ones((1, 4, 2, 64))
  staged = jnp.full((1,), 4, jnp.int32)
  with pytest.raises(ValueError, match="S=3"):
    ct.combine_t(*args, rows=8, stage=(q, kv, kv, staged, 0.1, 3), interpret=True)
  with pytest.raises(TypeError, match="S=2.0"):
    ct.combine_t(*args, rows=8, stage=(q, kv, kv, staged, 0.1, 2.0), interpret=True)
  with pytest.raises(ValueError, match="R=8 rows, more than rows=4"):
    ct.combine_t(*args, rows=4, stage=(q, kv, kv, staged, 0.1, 2), interpret=True)
  with pytest.raises(ValueError, match="staged"):
    ct.combine_t(*args, rows=8, stage=(q, kv, kv, staged.astype(jnp.float32), 0.1, 2),
                 interpret=True)
  with pytest.raises(ValueError, match="stage k"):
    ct.combine_t(*args, rows=8, stage=(q, kv[:, :, :1], kv, staged, 0.1, 2), interpret=True)
  with pytest.raises(ValueError, match="stage q"):
    ct.combine_t(*args, rows=8, stage=(q[:, :1], kv, kv, staged, 0.1, 2), interpret=True)
