"""The shipped tuned-config table (`pallas_kernels.tuned`) and its lookup.

The table's timings come from a GPU (`bench/tune_table.py`); here the table is
checked for well-formed entries, and the lookup for hits, misses and
entries that do not fit the launch (using tables written to tmp files).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxkv.cache import KVCache
from jaxkv.formats import PRESETS
from pallas_kernels import dequant_attention as da
from pallas_kernels import tuned

SHAPE = dict(batch=2, q_heads=8, kv_heads=2, head_dim=64, num_queries=1, capacity=512,
             itemsize=2)


def _write(tmp_path, table, name="t.json"):
  path = tmp_path / name
  path.write_text(json.dumps(table))
  return str(path)


def test_shipped_table_entries_are_valid_measured_wins():
  table = tuned.load_table(tuned.TABLE_PATH)
  assert isinstance(table, dict)
  for device, entries in table.items():
    assert device and isinstance(entries, dict)
    for key, entry in entries.items():
      fields = dict(kv.split("=") for kv in key.split("|")[1:])
      assert set(fields) == {"G", "R", "D", "itemsize", "rows", "work", "tokens"}, key
      config = pk.DecodeAttentionConfig(**entry["config"])
      # The bucket's capacity is a power of two: the tuned block must tile it.
      assert int(fields["tokens"]) % config.block_k == 0, key
      assert 0 < entry["us"] < entry["heuristic_us"], (key, entry)
      assert entry["tuned_on"], key


def test_lookup_hit_miss_and_misfit(tmp_path, monkeypatch):
  fmt = PRESETS["kivi4"]
  key = da.tuned_key(fmt, **SHAPE)
  tuned_cfg = pk.DecodeAttentionConfig(block_k=64, num_splits=3, num_warps=2, num_stages=2,
                                       defer_sums=False)
  table = {}
  tuned.store(table, "Fake GPU", key, tuned_cfg, us=10.0, heuristic_us=12.0, shape="test")
  monkeypatch.setenv(tuned.ENV_VAR, _write(tmp_path, table))

  config, source = pk.default_config(fmt, device_kind="Fake GPU", **SHAPE)
  assert (config, source) == (tuned_cfg, "tuned")
  heuristic = da.DecodeAttentionConfig.default(
      batch=2, tokens=512, q_heads=8, kv_heads=2, head_dim=64, k_bits=4, v_bits=4,
      token_group=fmt.token_group, k_axis=fmt.k_axis, residual=fmt.residual)
  # Another GPU, another format, another shape class: the heuristic.
  assert pk.default_config(fmt, device_kind="Other GPU", **SHAPE) == (heuristic, "heuristic")
  assert pk.default_config(PRESETS["kivi2"], device_kind="Fake GPU", **SHAPE)[1] == "heuristic"
  assert pk.default_config(fmt, device_kind="Fake GPU",
                           **{**SHAPE, "num_queries": 2})[1] == "heuristic"
  # Same bucket (batch * kv_heads and capacity rounded down to powers of two).
  assert pk.default_config(fmt, device_kind="Fake GPU",
                           **{**SHAPE, "batch": 3, "capacity": 960})[1] == "tuned"
  # A capacity its block_k does not divide: the heuristic, not a failing launch.
  assert pk.default_config(fmt, device_kind="Fake GPU",
                           **{**SHAPE, "capacity": 544})[1] == "heuristic"
  # An entry with a field this version does not know: ignored.
  bad = {"Fake GPU": {key: {"config": {**dataclasses.asdict(tuned_cfg), "warp_size": 64}}}}
  monkeypatch.setenv(tuned.ENV_VAR, _write(tmp_path, bad, "bad.json"))
  assert pk.default_config(fmt, device_kind="Fake GPU", **SHAPE)[1] == "heuristic"
  # "" turns the table off; no GPU (CPU backend) never looks it up.
  monkeypatch.setenv(tuned.ENV_VAR, "")
  assert pk.default_config(fmt, device_kind="Fake GPU", **SHAPE)[1] == "heuristic"


def test_hierarchical_views_are_different_classes():
  fmt = PRESETS["quantspec"]
  shape = {**SHAPE, "capacity": 1024}
  assert da.tuned_key(fmt, view="draft", **shape) != da.tuned_key(fmt, view="target", **shape)


def test_table_must_be_an_object(tmp_path):
  with pytest.raises(ValueError, match="JSON object"):
    tuned.load_table(_write(tmp_path, [1, 2]))


def test_tuned_config_runs_through_the_kernel(tmp_path, monkeypatch):
  """A table entry reaches the kernel when no config is given (interpret mode)."""
  fmt = PRESETS["kivi4"]
  rng = np.random.default_rng(5)
  b, hkv, d, cap = 2, 2, 64, 512
  k = jnp.asarray(rng.standard_normal((b, 300, hkv, d)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((b, 300, hkv, d)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((b, 1, 8, d)), jnp.float32)
  cache = KVCache.init(fmt, b, hkv, d, cap, jnp.float32, use_kernel=False)
  cache = cache.prefill(k, v, np.array([300, 211]))
  cfg = pk.DecodeAttentionConfig(block_k=64, num_splits=3, num_warps=4, num_stages=1)
  key = da.tuned_key(fmt, batch=b, q_heads=8, kv_heads=hkv, head_dim=d, num_queries=1,
                     capacity=cache.storage_len, itemsize=4)
  table = {}
  tuned.store(table, "Fake GPU", key, cfg, us=1.0, heuristic_us=2.0, shape="test")
  monkeypatch.setenv(tuned.ENV_VAR, _write(tmp_path, table))
  seen = []
  real = da.default_config

  def spy(*args, **kwargs):
    out = real(*args, **{**kwargs, "device_kind": "Fake GPU"})
    seen.append(out)
    return out

  monkeypatch.setattr(da, "default_config", spy)
  jax.clear_caches()  # the jitted wrapper must trace again to consult the table
  out = pk.pallas_decode_attention(q, cache, interpret=True)
  assert seen == [(cfg, "tuned")]
  ref = pk.pallas_decode_attention(q, cache, config=da.DecodeAttentionConfig.default(
      batch=b, tokens=cache.storage_len, q_heads=8, kv_heads=hkv, head_dim=d, k_bits=4,
      v_bits=4, itemsize=4, num_sms=4), interpret=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5)
