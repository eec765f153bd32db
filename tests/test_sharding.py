"""Sharded decoding on an 8-device CPU mesh (`jaxkv.sharding`, `models.sharding`).

The checks need JAX to see 8 devices from process start, so they run in one
subprocess (`tests/sharding_checks.py`) with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``; mesh-spec parsing and
errors are checked here directly.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

import jaxkv
from jaxkv import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_mesh():
  assert sharding.parse_mesh("data=1,model=8") == {"data": 1, "model": 8}
  assert sharding.parse_mesh(" model=2 ") == {"data": 1, "model": 2}
  for bad, match in [("data=1,modle=8", "'modle=8' must be 'data=N' or 'model=N'"),
                     ("data=x", "data='x' is not an int"),
                     ("model=0", "model=0 must be >= 1"),
                     ("model=2,model=4", "axis 'model' given twice"),
                     ("8", "'8' must be")]:
    with pytest.raises(ValueError, match=match):
      sharding.parse_mesh(bad)


def test_make_mesh_errors():
  with pytest.raises(ValueError, match="needs 64 devices"):
    sharding.make_mesh(data=8, model=8)
  with pytest.raises(ValueError, match="mesh axis model=0 must be an int >= 1"):
    sharding.make_mesh(data=1, model=0)
  mesh = sharding.make_mesh(data=1, model=1)
  assert mesh.axis_names == ("data", "model")
  n = len(jax.devices())
  with pytest.raises(ValueError, match=f"mesh data={n + 1} needs {n + 1} devices"):
    sharding.make_mesh(data=n + 1)
  with pytest.raises(ValueError, match="mesh axis data=2.5"):
    sharding.make_mesh(data=2.5)
  d0 = jax.devices()[0]
  with pytest.raises(ValueError, match="more than once"):
    sharding.make_mesh(data=2, model=1, devices=[d0, d0])
  with pytest.raises(TypeError, match="jax.Device"):
    sharding.make_mesh(devices=["cpu:0"])
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    sharding.shard_cache(jaxkv.KVCache.init("kivi4", 1, 1, 32, 128), "data=2")


def test_sharded_decode_matches_one_device():
  """Meshes 1x8, 2x4, 8x1 and 2 KV heads on model=8, VQ and QuantSpec caches per shard,
  the model on a VQ cache, speculative generation on a mesh: against one device."""
  # 8 CPU devices; cheap LLVM passes (compile time dominates, results unchanged).
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
             "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sharding_checks.py")],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
  oks = [line for line in proc.stdout.splitlines() if line.startswith("OK ")]
  assert len(oks) == 13, proc.stdout
