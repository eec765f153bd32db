"""`jaxkv.fidelity`: metric arithmetic on known cases, and the decode path
against the model's own full forward pass (tiny random Llama, CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import fidelity, generate
from models import llama
from tests.model_fixtures import SMALL, full_f32_matmuls  # noqa: F401  (autouse fixture)

CFG = llama.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0)




@pytest.fixture(scope="module")
def model():
  return llama.random_model(CFG, seed=3, dtype=jnp.float32)


def test_perplexity_of_uniform_distribution_is_vocab_size():
  vocab = 37
  logprobs = np.full((3, 11), -np.log(vocab))
  assert fidelity.perplexity(logprobs) == pytest.approx(vocab, rel=1e-12)
  # Known non-uniform case: p = (1/2, 1/8) -> exp(-(log 1/2 + log 1/8) / 2) = 4.
  assert fidelity.perplexity(np.log([0.5, 0.125])) == pytest.approx(4.0, rel=1e-12)
  with pytest.raises(ValueError, match="zero tokens"):
    fidelity.perplexity([])


def test_kl_divergence_known_values():
  p = np.array([0.5, 0.25, 0.25])
  q = np.array([0.25, 0.25, 0.5])
  want = 0.5 * np.log(2) + 0.25 * np.log(0.5)  # sum p log(p/q)
  got = fidelity.kl_divergence(np.log(p)[None], np.log(q)[None])
  np.testing.assert_allclose(got, [want], rtol=1e-12)
  rng = np.random.default_rng(0)
  lp = jax.nn.log_softmax(rng.normal(size=(4, 9)))
  np.testing.assert_allclose(fidelity.kl_divergence(lp, lp), 0.0, atol=1e-6)
  with pytest.raises(ValueError, match="shapes differ"):
    fidelity.kl_divergence(lp, lp[:2])


def test_kl_and_perplexity_refuse_what_is_not_a_log_probability(model):
  # A token of probability 0 in the reference adds 0 (it gave NaN from 0 * -inf).
  with np.errstate(divide="ignore"):
    ref = np.log([[0.5, 0.5, 0.0]])
  got = fidelity.kl_divergence(ref, np.log([[0.4, 0.4, 0.2]]))
  np.testing.assert_allclose(got, [np.log(0.5 / 0.4)], rtol=1e-12)
  with pytest.raises(ValueError, match="normalised log-probabilities"):
    fidelity.kl_divergence(np.array([[0.5, 0.5]]), np.array([[0.9, 0.1]]))  # not logs
  with pytest.raises(ValueError, match="holds NaN"):
    fidelity.kl_divergence(np.log([[0.5, 0.5]]), np.array([[np.nan, -1.0]]))
  for bad in ([0.5, 0.2], [np.nan, -1.0]):
    with pytest.raises(ValueError, match="must be log-probabilities"):
      fidelity.perplexity(bad)
  # The reference of `evaluate` must be a 16-bit format (it is reported as "vs bf16").
  with pytest.raises(ValueError, match="must be a 16-bit KVFormat such as 'bf16', got 'kivi4'"):
    fidelity.evaluate(model, None, {"kivi4": "kivi4", "bf16": "bf16"})


def test_first_divergence():
  ref = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
  other = np.array([[1, 2, 3, 4], [1, 9, 3, 4], [0, 5, 5, 5]])
  np.testing.assert_array_equal(fidelity.first_divergence(ref, other), [4, 1, 0])


def test_bytes_per_token_counts_all_layers():
  fmt = fidelity.KIVI_FORMATS["kivi2-g32"]
  # K: 32 ch * 2 bit / 8 + 2 fp16 * 32 ch / 32 tokens; V: 8 + 2 fp16 * 32 / 32 channels.
  per_head = (8 + 2 * 2 * 32 / 32) + (8 + 2 * 2 * 32 / 32)
  assert fidelity.bytes_per_token(fmt, CFG) == per_head * CFG.num_kv_heads * CFG.num_layers


def test_build_suite_rows():
  tokens = np.arange(1000) % 120
  suite = fidelity.build_suite(tokens, [[1, 2, 3], [4, 5]], contexts=(40, 64), sequences=2,
                               steps=16)
  np.testing.assert_array_equal(suite.context, [40, 40, 64, 64, 0, 0])
  np.testing.assert_array_equal(suite.prompt_lengths, [24, 24, 48, 48, 3, 2])
  assert suite.prompt_tokens.shape == (6, 48) and suite.targets.shape == (6, 16)
  np.testing.assert_array_equal(suite.targets[3], tokens[64 + 48:64 + 64])  # window 1 of 64
  np.testing.assert_array_equal(suite.teacher, [True] * 4 + [False] * 2)
  with pytest.raises(ValueError, match="need 3000 tokens"):
    fidelity.build_suite(tokens, [], contexts=(1000,), sequences=3, steps=16)


def test_forced_decode_matches_full_forward_and_generate(model):
  """Teacher-forced rows: the log-softmax of the full causal forward at the same
  positions (unquantized cache). Free-running rows: `jaxkv.generate` greedy."""
  rng = np.random.default_rng(7)
  steps, t = 12, 20
  tokens = rng.integers(0, CFG.vocab_size, (3, t + steps))
  lengths = np.array([t, 13, 17])
  prompts = tokens[:, :t].copy()
  targets = np.stack([tokens[b, n:n + steps] for b, n in enumerate(lengths)])
  teacher = np.array([True, True, False])
  logprobs, preds = fidelity.forced_decode(model, prompts, lengths, targets, teacher,
                                           kv_format="bf16", cache_dtype=jnp.float32)
  assert logprobs.shape == (3, steps, CFG.vocab_size) and preds.shape == (3, steps)
  for b in (0, 1):
    n = lengths[b]
    full = np.asarray(model(jnp.asarray(tokens[b:b + 1, :n + steps - 1], jnp.int32)))[0]
    want = jax.nn.log_softmax(full[n - 1:n + steps - 1], axis=-1)
    np.testing.assert_allclose(logprobs[b], want, atol=1e-4)
  greedy, _ = generate(model, prompts[2:], lengths[2:], kv_format="bf16", max_new_tokens=steps,
                       cache_dtype=jnp.float32)
  np.testing.assert_array_equal(preds[2], np.asarray(greedy)[0])


def test_forced_decode_rejects_out_of_range_ids(model):
  with pytest.raises(ValueError, match=r"targets hold ids outside \[0, 128\)"):
    fidelity.forced_decode(model, np.ones((1, 4)), [4], np.full((1, 2), 128), [True],
                           kv_format="bf16")
  with pytest.raises(ValueError, match=r"prompt_tokens \(0, 4\) holds no sequence"):
    fidelity.forced_decode(model, np.ones((0, 4)), [], np.ones((0, 2)), [], kv_format="bf16")


class _CharTokenizer:
  """Bytes as tokens (mod vocab): enough text machinery for `evaluate`."""

  def encode(self, text):
    return [b % CFG.vocab_size for b in text.encode()]


def test_evaluate_rows(model):
  formats = {"bf16": fidelity.default_formats(32)["bf16"],
             "kivi2-g32": fidelity.KIVI_FORMATS["kivi2-g32"]}
  result = fidelity.evaluate(model, _CharTokenizer(), formats, contexts=(224,), sequences=1,
                             steps=16, questions=0, cache_dtype=jnp.float32, log=None)
  ref, low = result["rows"]
  assert ref["kl_vs_bf16"]["224"] == 0.0 and "greedy_agreement" not in ref
  assert low["kl_vs_bf16"]["224"] > 0.0  # 96 of 208 prompt tokens quantized
  assert low["bytes_vs_bf16"] == pytest.approx(24 / 128)  # 24 B/head vs 128 B at D=32
  assert 1.0 < ref["perplexity"]["224"] < 10 * CFG.vocab_size


def test_evaluate_vq_format(model):
  """A VQ format gets codebooks fitted on the text right after the perplexity windows;
  `forced_decode` refuses a VQ format without codebooks."""
  formats = {"bf16": fidelity.default_formats(32)["bf16"], "cq2": "cq2"}
  logs = []
  result = fidelity.evaluate(model, _CharTokenizer(), formats, contexts=(160,), sequences=1,
                             steps=8, questions=0, cache_dtype=jnp.float32, calibration=256,
                             log=logs.append)
  assert logs[0] == "fitted codebooks of cq2 on text tokens [160, 416)"
  row = result["rows"][1]
  assert row["k_vector"] == 4 and row["kl_vs_bf16"]["160"] > 0.0  # 128 of 152 tokens coded
  assert row["bytes_vs_bf16"] == pytest.approx((8 + 8 + 2 * 32 * 256 * 2 / 8192) / 128)
  with pytest.raises(ValueError, match="is a VQ format: pass codebooks="):
    fidelity.forced_decode(model, np.ones((1, 4)), [4], np.ones((1, 2)), [True],
                           kv_format="cq2")
