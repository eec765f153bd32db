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
