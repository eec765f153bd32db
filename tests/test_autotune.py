"""`jaxkv.autotune`: search, JSON save/load, and the device-time helper.

On CPU the candidates run in Pallas interpret mode (the timings mean nothing
there; the search, the returned config and the JSON round trip are checked).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.cache import KVCache
from jaxkv.formats import PRESETS
import pallas_kernels as pk
from pallas_kernels.vq_attention import VQAttentionConfig

from jaxkv import timing
from jaxkv import tuning as at


def _cache_and_q(batch=2, kv_heads=2, group_q=4, head_dim=64, capacity=256):
  fmt = PRESETS["kivi4"]
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(11), 3)
  t = 200
  k = jax.random.normal(k1, (batch, t, kv_heads, head_dim))
  v = jax.random.normal(k2, (batch, t, kv_heads, head_dim))
  q = jax.random.normal(k3, (batch, 1, kv_heads * group_q, head_dim))
  cache = KVCache.init(fmt, batch, kv_heads, head_dim, capacity, jnp.float32, use_kernel=False)
  return q, cache.prefill(k, v, np.array([t, 150]))


CANDIDATES = [pk.DecodeAttentionConfig(block_k=64, num_splits=2, num_warps=4, num_stages=2),
              pk.DecodeAttentionConfig(block_k=128, num_splits=1, num_warps=4, num_stages=2)]


def test_autotune_returns_candidate_and_round_trips_json(tmp_path, monkeypatch):
  q, cache = _cache_and_q()
  path = str(tmp_path / "tuned.json")
  best = jaxkv.autotune(q, cache, candidates=CANDIDATES, path=path, reps=1)
  assert best in CANDIDATES
  table = json.load(open(path))
  assert table == {at.config_key(q, cache): dict(vars(best))}
  assert at.load_config(path, q, cache) == best
  # A saved entry is returned without timing anything.
  monkeypatch.setattr(at, "kernel_time", lambda *a, **k: pytest.fail("timed a saved shape"))
  assert jaxkv.autotune(q, cache, candidates=CANDIDATES, path=path) == best
  # Another shape is a different key: not found.
  q2, cache2 = _cache_and_q(group_q=2)
  assert at.load_config(path, q2, cache2) is None
  # The tuned config gives the same result as the default one.
  out = pk.pallas_decode_attention(q, cache, config=best, interpret=True)
  ref = pk.pallas_decode_attention(q, cache, interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_autotune_reports_why_nothing_ran(monkeypatch):
  q, cache = _cache_and_q()

  def boom(*a, **k):
    raise RuntimeError("compiler said no")
  monkeypatch.setattr(at, "kernel_time", boom)
  with pytest.raises(ValueError, match="compiler said no"):
    jaxkv.autotune(q, cache, candidates=CANDIDATES)


def test_search_space_configs_are_valid():
  q, cache = _cache_and_q()
  space = at.search_space(q, cache)
  assert len(space) > 4 and len(set(space)) == len(space)
  for c in space:
    assert cache.storage_len % c.block_k == 0


@pytest.mark.parametrize("hide", [False, True])
def test_device_time_fields(hide, monkeypatch):
  monkeypatch.setattr(timing, "_LEAD_DIM", 64)  # a CPU-sized lead
  x = [jnp.full((256, 256), float(i)) for i in range(3)]
  tm = timing.device_time(lambda a, b: jnp.tanh(a @ b), x, x[0], reps=3, warmup=1,
                      hide_dispatch=hide)
  assert set(tm) == {"median", "min", "max", "wall", "compile"}
  assert tm["min"] <= tm["median"] <= tm["max"]
  assert tm["wall"] > 0 and tm["compile"] > 0
  if not hide:
    assert tm["min"] > 0


def test_kernel_time_fields_and_arg_validation():
  x = [(jnp.full((128, 128), float(i)),) for i in range(2)]
  tm = timing.kernel_time(lambda a: jnp.tanh(a @ a), x, calls=3)
  assert set(tm) == {"kernel", "span", "kernels", "wall", "compile", "by_name"}
  assert tm["kernel"] > 0 and tm["span"] >= tm["kernel"] * 0.999 and tm["compile"] > 0
  if jax.default_backend() == "gpu":
    assert tm["kernels"] >= 1  # the matmul and the tanh ran on a GPU stream
    # per-name times add up to the call's kernel time
    assert abs(sum(tm["by_name"].values()) - tm["kernel"]) <= 1e-3 * tm["kernel"]
  else:
    assert tm["by_name"] == {}
  with pytest.raises(ValueError, match="args_list"):
    timing.kernel_time(lambda a: a, [])
  with pytest.raises(ValueError, match="calls=0"):
    timing.kernel_time(lambda a: a, x, calls=0)


@pytest.mark.parametrize("batch,kv_heads,bits,want", [
    (32, 1, 4, 8),     # 2 * 132 / 32 = 8.25 -> 8 programs per (b, h): ~2 per SM
    (128, 1, 4, 2),
    (32, 1, 8, 16),    # 8-bit sides: ~4 programs per SM
    (1, 8, 4, 32),
])
def test_default_splits_fill_the_gpu_without_over_splitting(batch, kv_heads, bits, want):
  c = pk.DecodeAttentionConfig.default(batch=batch, tokens=131072, q_heads=8 * kv_heads,
                                       kv_heads=kv_heads, head_dim=128, k_bits=bits,
                                       v_bits=bits, num_sms=132)
  assert c.num_splits == want
  # Never more splits than half the blocks (each split gets >= 2 steps).
  short = pk.DecodeAttentionConfig.default(batch=1, tokens=512, q_heads=8, kv_heads=1,
                                           head_dim=128, k_bits=bits, v_bits=bits, num_sms=132)
  assert short.num_splits * short.block_k * 2 <= 512


@pytest.mark.parametrize("batch,kv_heads,want", [
    (1, 8, 128),   # 8 * 132 / 8 = 132 -> 128 one-warp programs per (b, h): ~8 per SM
    (8, 8, 16),
    (32, 1, 32),
    (64, 8, 2),    # 8 * 132 / 512 -> 2 (at least two splits)
])
def test_default_many_channel_groups_runs_one_warp_programs(batch, kv_heads, want):
  """Four per-token channel groups (int4-token-g4): 1 warp, 32-token steps, ~8 programs per SM."""
  c = pk.DecodeAttentionConfig.default(batch=batch, tokens=32768, q_heads=4 * kv_heads,
                                       kv_heads=kv_heads, head_dim=128, k_bits=4, v_bits=4,
                                       k_axis="token", num_sms=132, channel_groups=4)
  assert (c.num_warps, c.block_k, c.num_splits) == (1, 32, want)
  # Whole-head groups and 8-bit sides keep the multi-warp heuristic.
  for bits, groups in ((4, 1), (8, 4)):
    other = pk.DecodeAttentionConfig.default(batch=batch, tokens=32768, q_heads=4 * kv_heads,
                                             kv_heads=kv_heads, head_dim=128, k_bits=bits,
                                             v_bits=bits, k_axis="token", num_sms=132,
                                             channel_groups=groups)
    assert other.num_warps == 2


@pytest.mark.parametrize("num_queries,gqa,bits,deferred", [
    (1, 4, 4, True), (4, 4, 4, True),     # 4 and 16 rows per program
    (5, 4, 4, False), (5, 4, 2, False),   # 20 rows: QuantSpec's gamma-4 verify pass
    (5, 4, 8, False), (4, 8, 4, False),   # 8-bit sides; 32 rows
])
def test_default_drops_deferred_sums_above_16_rows(num_queries, gqa, bits, deferred):
  """The deferred row sums keep [rows, block_k] accumulators: off above 16 rows per program."""
  c = pk.DecodeAttentionConfig.default(batch=1, tokens=131072, q_heads=8 * gqa, kv_heads=8,
                                       head_dim=128, k_bits=bits, v_bits=bits, num_sms=132,
                                       num_queries=num_queries)
  assert c.defer_sums is deferred


def test_prev_pow2():
  from pallas_kernels import _triton
  assert [_triton.prev_pow2(n) for n in (0, 1, 2, 3, 8, 9, 1000)] == [1, 1, 2, 2, 8, 8, 512]


@pytest.mark.parametrize("fastest", [0, 1, 2])
def test_autotune_picks_the_fastest_by_a_fake_timer(fastest, monkeypatch, tmp_path):
  """The timer is faked, so the pick is known: the smallest "kernel" time wins."""
  q, cache = _cache_and_q()
  cands = CANDIDATES + [pk.DecodeAttentionConfig(block_k=32, num_splits=4, num_warps=2)]
  times = {c: 3e-3 + 1e-3 * i for i, c in enumerate(cands)}
  times[cands[fastest]] = 1e-3
  timed = []

  def fake_kernel_time(fn, args_list, *, calls=20, warmup=1):
    config = fn.keywords["config"]
    timed.append(config)
    return {"kernel": times[config], "span": 1.0, "kernels": 1, "wall": 1.0, "compile": 0.0}
  monkeypatch.setattr(at, "kernel_time", fake_kernel_time)
  path = str(tmp_path / "t.json")
  assert jaxkv.autotune(q, cache, candidates=cands, path=path) == cands[fastest]
  assert timed == cands                      # every candidate timed once, in order
  assert at.load_config(path, q, cache) == cands[fastest]


def test_neighbours_are_valid_distinct_one_step_moves():
  base = pk.DecodeAttentionConfig(block_k=128, num_splits=4, num_warps=4, num_stages=3)
  near = at.neighbours(base, tokens=384)  # 256 does not tile 384
  assert base not in near and len(set(near)) == len(near)
  assert {c.block_k for c in near} == {32, 64, 128}
  assert {c.num_warps for c in near} == {1, 2, 4}
  for c in near:
    changed = [f.name for f in dataclasses.fields(c) if getattr(c, f.name) != getattr(base, f.name)]
    assert len(changed) == 1, changed
  vq = VQAttentionConfig(block_k=64, num_splits=1, num_warps=4, num_stages=2)
  vq_near = at.neighbours(vq, tokens=1024)
  assert all(isinstance(c, VQAttentionConfig) for c in vq_near)
  assert {c.num_splits for c in vq_near} == {1, 2} and {c.num_warps for c in vq_near} == {2, 4, 8}


def test_greedy_search_walks_to_the_minimum_of_a_known_landscape():
  """A fake cost with its minimum two moves away (splits 4 -> 16, then block_k 64)."""
  start = pk.DecodeAttentionConfig(block_k=128, num_splits=4, num_warps=4, num_stages=3)

  def cost(c):
    return (abs(np.log2(c.num_splits) - 4) + (c.block_k != 64) + (c.num_warps != 4)
            + (c.num_stages != 3) + c.residual_program + (not c.defer_sums))

  best, best_t, timed = at.greedy_search(cost, start, 4096, max_evals=100)
  assert (best.num_splits, best.block_k, best_t) == (16, 64, 0)
  assert list(timed)[0] == start and all(cost(c) == t for c, t in timed.items())
  # The budget caps the configs timed, the start included.
  _, _, few = at.greedy_search(cost, start, 4096, max_evals=3)
  assert len(few) == 3
  # A failing config (inf) is never chosen.
  _, t, _ = at.greedy_search(lambda c: np.inf if c.num_splits == 8 else cost(c), start, 4096,
                             max_evals=100)
  assert np.isfinite(t)


def test_autotune_greedy_starts_at_the_default_and_returns_the_fake_fastest(monkeypatch):
  q, cache = _cache_and_q()
  start, _ = pk.default_config(cache.fmt, batch=2, q_heads=8, kv_heads=2, head_dim=64,
                               num_queries=1, capacity=cache.storage_len, itemsize=4)
  target = dataclasses.replace(start, num_stages=2, num_warps=2)  # two moves away
  timed = []

  def fake_kernel_time(fn, args_list, *, calls=20, warmup=1):
    c = fn.keywords["config"]
    timed.append(c)
    t = 1e-3 * (1 + (c.num_stages != 2) + (c.num_warps != 2) + (c.num_splits != start.num_splits)
                + (c.block_k != start.block_k) + (c.defer_sums != start.defer_sums)
                + (c.residual_program != start.residual_program))
    return {"kernel": t, "span": 1.0, "kernels": 1, "wall": 1.0, "compile": 0.0}
  monkeypatch.setattr(at, "kernel_time", fake_kernel_time)
  assert jaxkv.autotune(q, cache, max_evals=40) == target
  assert timed[0] == start and len(timed) <= 40 and len(set(timed)) == len(timed)
  with pytest.raises(ValueError, match="search="):
    jaxkv.autotune(q, cache, search="random")
