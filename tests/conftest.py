"""Shared pytest set-up: repo root importable; Hypothesis profiles.

``ci`` (the default) is derandomized: every run tries the same examples, so a
failure reproduces and CI time is stable. ``HYPOTHESIS_PROFILE=dev`` runs
more, random examples (a fuzzing session).
"""

import gc
import os
import sys

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# On CPU, compile time dominates the suite (interpret-mode kernels lower to
# large programs): cheap LLVM passes cut it by about a fifth. XLA's HLO passes
# still run, so the programs compute the same thing; the flags only change how
# hard LLVM optimizes the generated CPU code. Set before JAX starts its
# backend; flags the caller set win, and GPU runs are left alone.
_CHEAP_CPU_FLAGS = ("--xla_backend_optimization_level=0",
                    "--xla_llvm_disable_expensive_passes=true")
if os.environ.get("JAXKV_TEST_GPU", "0") != "1":
  _flags = os.environ.get("XLA_FLAGS", "")
  _flags += "".join(f" {f}" for f in _CHEAP_CPU_FLAGS if f.split("=")[0] not in _flags)
  os.environ["XLA_FLAGS"] = _flags.strip()

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=_SLOW_OK)
settings.register_profile("dev", max_examples=300, deadline=None, print_blob=True,
                          suppress_health_check=_SLOW_OK)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops JAX's compiled programs after each test module.

  The fuzz and interpret-mode kernel tests compile hundreds of programs; kept
  for the whole session, they grew the process until XLA:CPU crashed while
  compiling late modules.
  """
  yield
  import jax
  jax.clear_caches()
  gc.collect()


# The longest single test (one subprocess, about 2 minutes on 2 CPU cores): collected
# first, so that under xdist (-n 2) it starts at once instead of ending the run alone.
_LONGEST_FIRST = ("tests/test_sharding.py::test_sharded_decode_matches_one_device",)


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  items.sort(key=lambda item: item.nodeid not in _LONGEST_FIRST)  # stable: the rest keep order
