"""A short run of the long-loop stability harness (`bench/stability.py`).

Greedy decoding of the tiny Llama on a quantized `ModelCache` in jitted
chunks, over two wrap-free cycles: the incremental cache must equal the
one-shot quantization of the recorded K/V history bit for bit, every packed
value must sit within its error bound, and the chunk must compile once.
The 100K-step run is `python bench/stability.py` (results in bench/results/).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "stability.py")


@pytest.fixture(scope="module")
def stability():
  spec = importlib.util.spec_from_file_location("jaxkv_bench_stability", _PATH)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_two_cycles_bitwise_one_shot_and_one_compile(stability):
  r = stability.run(preset="kivi2-g32", steps=512, capacity=288, chunk=128, batch=2,
                    prompt_len=32, log=lambda _: None)
  assert len(r["cycles"]) == 2
  assert [c["length"] for c in r["cycles"]] == [288, 288]
  assert r["all_equal"], r["cycles"]
  assert r["max_error_over_bound"] <= 1.0, r["max_error_over_bound"]
  assert r["compiles"] == 1
  assert r["live_bytes_first_last"][0] == r["live_bytes_first_last"][1]


def test_refuses_formats_whose_newest_token_can_leave_the_residual(stability):
  with pytest.raises(ValueError, match="residual R > token_group G"):
    stability.run(preset="kivi4", steps=8, capacity=256, chunk=8, batch=1, prompt_len=8)
