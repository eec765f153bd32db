"""Shared pieces of the model tests: a tiny Llama config, full-precision matmuls, `rel_err`."""

import jax
import numpy as np
import pytest

from models import llama

# A tiny Llama-3-style config (GQA 2, llama3 RoPE scaling) for CPU tests.
SMALL = llama.LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=32, rope_theta=500000.0,
    rope_scaling=llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 64), eos_token_ids=(2,))


@pytest.fixture(autouse=True)
def full_f32_matmuls():
  """float32 matmuls at full precision (GPUs default to TF32-like passes).

  Autouse in every module that imports it.
  """
  with jax.default_matmul_precision("highest"):
    yield


def rel_err(got, want) -> float:
  """Largest absolute difference over the largest ``|want|`` (float64)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.abs(got - want).max() / np.abs(want).max())
