"""`models.llama` against HF transformers' LlamaForCausalLM (PyTorch CPU, float32).

Random tiny configs are saved with ``save_pretrained`` (one file, and sharded
with ``max_shard_size``), loaded with `models.llama.from_pretrained`, and
compared on full-forward logits and on 32 greedy steps through `jaxkv.generate`
with an unquantized cache (``"bf16"`` format, float32 cache dtype).

Logit tolerance: ``max|ours - hf| <= 1e-4 * max|hf|`` (normwise relative, so
near-zero logits do not make the check meaningless). Both sides compute in
float32; the difference is summation order only (~1e-6 observed).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxkv.decoding import generate  # noqa: E402
from models import llama  # noqa: E402

VOCAB = 160
LOGIT_RTOL = 1e-4

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

# name -> (HF config kwargs, write hub-style config.json, sharded)
CASES = {
    # Llama 2: MHA, plain RoPE theta 1e4, untied, head_dim = hidden / heads.
    "llama2-mha-untied": (dict(num_attention_heads=4, num_key_value_heads=4, hidden_size=64,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                               tie_word_embeddings=False, rms_norm_eps=1e-6), False, False),
    # Llama 3.1: GQA, llama3 rope scaling, head_dim (32) != hidden / heads (16).
    "llama3-gqa-scaled": (dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                               head_dim=32, rope_parameters=LLAMA3_ROPE,
                               tie_word_embeddings=False, rms_norm_eps=1e-5), False, True),
    # Llama 3.2 style: tied embeddings, GQA, hub-style config.json (rope_scaling).
    "llama3-gqa-tied-hubcfg": (dict(num_attention_heads=4, num_key_value_heads=1,
                                    hidden_size=64, rope_parameters=LLAMA3_ROPE,
                                    tie_word_embeddings=True, rms_norm_eps=1e-5), True, True),
    # MHA with tied embeddings, plain RoPE.
    "mha-tied": (dict(num_attention_heads=2, num_key_value_heads=2, hidden_size=64,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      tie_word_embeddings=True, rms_norm_eps=1e-6), False, False),
}


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
  """float32 matmuls at full precision (GPUs default to TF32-like passes)."""
  with jax.default_matmul_precision("highest"):
    yield


def make_hf_model(seed: int, **kwargs):
  """A HF Llama with random weights at a scale that gives peaked attention."""
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2,
                                 max_position_embeddings=256, bos_token_id=1,
                                 eos_token_id=2, **kwargs)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim == 2:
        std = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
        p.copy_(torch.randn_like(p) * std)
      else:  # RMSNorm gains
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
  return model


def to_hub_style(path):
  """Rewrites a transformers-5 config.json (rope_parameters) in hub style."""
  cfg_path = os.path.join(path, "config.json")
  with open(cfg_path) as f:
    cfg = json.load(f)
  rope = dict(cfg.pop("rope_parameters"))
  cfg["rope_theta"] = rope.pop("rope_theta")
  cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
  with open(cfg_path, "w") as f:
    json.dump(cfg, f)


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_pair(request, tmp_path_factory):
  """(name, HF model, our model loaded from its save_pretrained directory)."""
  name = request.param
  kwargs, hub_style, sharded = CASES[name]
  hf = make_hf_model(seed=sorted(CASES).index(name), **kwargs)
  path = str(tmp_path_factory.mktemp(name))
  hf.save_pretrained(path, **({"max_shard_size": "20KB"} if sharded else {}))
  if sharded:
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
  if hub_style:
    to_hub_style(path)
  ours = llama.from_pretrained(path, dtype=jnp.float32)
  return name, hf, ours


def test_config_parsed(hf_pair):
  name, hf, ours = hf_pair
  c, h = ours.config, hf.config
  assert (c.num_heads, c.num_kv_heads, c.head_dim) == (
      h.num_attention_heads, h.num_key_value_heads, h.head_dim)
  assert c.tie_word_embeddings == h.tie_word_embeddings
  assert (ours.lm_head is None) == h.tie_word_embeddings
  rope = h.rope_parameters
  assert c.rope_theta == rope["rope_theta"]
  assert (c.rope_scaling is None) == (rope["rope_type"] == "default"), name


def test_logits_match_hf(hf_pair):
  name, hf, ours = hf_pair
  tokens = np.random.default_rng(11).integers(0, VOCAB, (3, 48))
  with torch.no_grad():
    want = hf(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
  assert got.dtype == np.float32 and got.shape == want.shape
  err = np.abs(got - want).max()
  assert err <= LOGIT_RTOL * np.abs(want).max(), f"{name}: max err {err}"


def test_prefill_logits_match_hf(hf_pair):
  """Right-padded prefill returns each prompt's last-token logits."""
  name, hf, ours = hf_pair
  rng = np.random.default_rng(12)
  lengths = np.array([17, 40, 5])
  tokens = rng.integers(0, VOCAB, (3, 40))
  caches = ours.init_cache("bf16", 3, 64, dtype=jnp.float32)
  got, caches = ours.prefill(jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths), caches)
  np.testing.assert_array_equal(np.asarray(caches.lengths), lengths)
  for b, n in enumerate(lengths):
    with torch.no_grad():
      want = hf(torch.tensor(tokens[b:b + 1, :n])).logits.numpy()[0, -1]
    err = np.abs(np.asarray(got[b]) - want).max()
    assert err <= LOGIT_RTOL * np.abs(want).max(), f"{name} seq {b}: max err {err}"


def test_single_sequence_greedy_matches_hf(hf_pair):
  """B=1: every decode step runs the twin-row path of `Llama.decode`."""
  name, hf, ours = hf_pair
  steps = 12
  tokens = np.random.default_rng(29).integers(0, VOCAB, (1, 14))
  got, got_len = generate(ours, tokens, np.array([14]), kv_format="bf16",
                          max_new_tokens=steps, cache_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(got_len), [steps])
  with torch.no_grad():
    want = hf.generate(torch.tensor(tokens), max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, eos_token_id=None, pad_token_id=0).numpy()[0, 14:]
  np.testing.assert_array_equal(np.asarray(got[0]), want, err_msg=name)


def test_greedy_generation_matches_hf(hf_pair):
  """32 greedy tokens, ragged batch (right-padded for us, per-sequence for HF)."""
  name, hf, ours = hf_pair
  steps = 32
  rng = np.random.default_rng(13)
  lengths = np.array([9, 23, 16])
  tokens = rng.integers(0, VOCAB, (3, 23))
  got, got_len = generate(ours, tokens, lengths, kv_format="bf16", max_new_tokens=steps,
                          cache_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(got_len), [steps] * 3)
  for b, n in enumerate(lengths):
    with torch.no_grad():
      want = hf.generate(torch.tensor(tokens[b:b + 1, :n]), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, eos_token_id=None,
                         pad_token_id=0).numpy()[0, n:]
    assert len(want) == steps
    np.testing.assert_array_equal(np.asarray(got[b]), want, err_msg=f"{name} seq {b}")
