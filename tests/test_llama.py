"""`models.llama` without HF: config parsing, checkpoint errors, cache paths vs full forward."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import llama
from models.checkpoint import load_llama, save_llama
from tests.model_fixtures import SMALL, full_f32_matmuls, rel_err  # noqa: F401  (autouse fixture)





# ------------------------------------------------------------------- config
def test_named_configs():
  c = llama.LlamaConfig.named("llama-3.1-8b")
  assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (32, 32, 8, 128)
  assert c.rope_scaling.rope_type == "llama3" and hash(c) == hash(llama.CONFIGS["llama-3.1-8b"])
  with pytest.raises(ValueError, match="unknown config 'llama-9'"):
    llama.LlamaConfig.named("llama-9")


def test_from_hf_dict_rope_styles():
  base = dict(vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2)
  scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=8192)
  hub = llama.LlamaConfig.from_hf_dict(
      {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
  v5 = llama.LlamaConfig.from_hf_dict(
      {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
  old = llama.LlamaConfig.from_hf_dict(
      {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
  assert hub == v5 == old
  assert hub.head_dim == 16 and hub.rope_scaling.factor == 8.0
  plain = llama.LlamaConfig.from_hf_dict({**base, "rope_scaling": None})
  assert plain.rope_scaling is None and plain.rope_theta == 10000.0
  for bad, match in [
      ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
      ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
       "unsupported rope type 'dynamic'"),
      ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope parameters lack"),
      ({"num_key_value_heads": 3}, "multiple of num_kv_heads=3"),
      ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
      ({"attention_bias": True}, "attention_bias"),
      ({"model_type": "mistral"}, "model_type='mistral'"),
  ]:
    with pytest.raises(ValueError, match=match):
      llama.LlamaConfig.from_hf_dict({**base, **bad})


def test_llama3_inv_freq_scaling():
  """Long wavelengths divided by factor, short kept (Llama 3.1 rule)."""
  plain = llama._inv_freq(128, 500000.0, None)
  scaled = llama._inv_freq(128, 500000.0, llama.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
  wavelen = 2 * np.pi / plain
  np.testing.assert_array_equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
  np.testing.assert_allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=1e-6)
  mid = (wavelen >= 2048) & (wavelen <= 8192)
  assert mid.any() and np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8)


# -------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  model = llama.random_model(SMALL, seed=3, dtype=jnp.float32)
  path = str(tmp_path_factory.mktemp("ckpt"))
  save_llama(model, path)
  return model, path


def _copy_ckpt(src, dst, edit_tensors=None, edit_config=None):
  import shutil

  from safetensors.numpy import load_file, save_file
  shutil.copytree(src, dst)
  if edit_tensors:
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
  if edit_config:
    with open(os.path.join(dst, "config.json")) as f:
      cfg = json.load(f)
    edit_config(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
      json.dump(cfg, f)
  return dst


def test_roundtrip_and_dtype(saved):
  model, path = saved
  loaded = load_llama(path)
  assert loaded.dtype == jnp.float32 and loaded.config == model.config
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 12)), jnp.int32)
  np.testing.assert_array_equal(np.asarray(loaded(tokens)), np.asarray(model(tokens)))
  as_bf16 = llama.from_pretrained(path, dtype=jnp.bfloat16)
  assert as_bf16.embed_tokens[...].dtype == jnp.bfloat16
  assert rel_err(as_bf16(tokens), model(tokens)) < 0.1


def test_missing_tensor(saved, tmp_path):
  path = _copy_ckpt(saved[1], tmp_path / "c",
                    edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
    load_llama(path)


def test_unexpected_tensor(saved, tmp_path):
  def add(t):
    t["model.layers.7.self_attn.q_proj.weight"] = np.ones((4, 4), np.float32)
  path = _copy_ckpt(saved[1], tmp_path / "c", edit_tensors=add)
  with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.7\.self_attn"):
    load_llama(path)


def test_wrong_shape(saved, tmp_path):
  def bad(t):
    t["model.layers.0.self_attn.k_proj.weight"] = np.ones((32, 64), np.float32)
  path = _copy_ckpt(saved[1], tmp_path / "c", edit_tensors=bad)
  with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight: "
                     r"stored \(32, 64\), expected \(64, 64\)"):
    load_llama(path)


def test_unknown_rope_type(saved, tmp_path):
  def bad(cfg):
    cfg["rope_scaling"] = {"rope_type": "longrope", "factor": 2.0}
  path = _copy_ckpt(saved[1], tmp_path / "c", edit_config=bad)
  with pytest.raises(ValueError, match="unsupported rope type 'longrope'"):
    load_llama(path)


def test_missing_files(saved, tmp_path):
  os.makedirs(tmp_path / "empty")
  with pytest.raises(ValueError, match="has no config.json"):
    load_llama(tmp_path / "empty")
  path = _copy_ckpt(saved[1], tmp_path / "c")
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
    load_llama(path)
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}, f)
  with pytest.raises(ValueError, match="shards listed in .* are missing"):
    load_llama(path)


# ------------------------------------------------------------ cache paths
@pytest.mark.parametrize("tied,lengths", [(False, (11, 30, 20)), (True, (11, 30, 20)),
                                          (False, (17,))])
def test_prefill_then_decode_matches_full_forward(tied, lengths):
  """Right-padded prefill + S=1 and S=3 decode steps == full causal forward.

  Model logic only: attention runs the float32 reference everywhere (the
  kernels' precision is tested in the kernel tests). One sequence: its S=1
  step carries a twin row through the layers (`Llama.decode`).
  """
  cfg = dataclasses.replace(SMALL, tie_word_embeddings=tied)
  model = llama.random_model(cfg, seed=5, dtype=jnp.float32)
  rng = np.random.default_rng(7)
  b, t = len(lengths), 30
  tokens = rng.integers(0, cfg.vocab_size, (b, t + 4))
  lengths = np.array(lengths)
  full = np.asarray(model(jnp.asarray(tokens, jnp.int32)))  # per-row causal reference
  # Jitted steps (eager per-op dispatch took twice the CPU time; the eager checks are
  # tested in test_cache_batch_and_capacity_checked).
  prefill = jax.jit(model.prefill)
  decode = jax.jit(lambda x, c: model.decode(x, c, implementation="reference"))
  caches = model.init_cache("bf16", b, 64, dtype=jnp.float32)
  last, caches = prefill(jnp.asarray(tokens[:, :t], jnp.int32), jnp.asarray(lengths), caches)
  rows = np.arange(b)
  assert rel_err(last, full[rows, lengths - 1]) < 1e-5
  nxt = tokens[rows, lengths]
  logits, caches = decode(jnp.asarray(nxt[:, None], jnp.int32), caches)
  assert rel_err(logits[:, 0], full[rows, lengths]) < 1e-5
  three = np.stack([tokens[rows, lengths + 1 + i] for i in range(3)], axis=1)
  logits, caches = decode(jnp.asarray(three, jnp.int32), caches)
  for i in range(3):
    assert rel_err(logits[:, i], full[rows, lengths + 1 + i]) < 1e-5
  np.testing.assert_array_equal(np.asarray(caches.lengths), lengths + 4)


def test_bf16_model_close_to_f32():
  """bf16 weights/activations track the float32 model (sanity, loose: bf16 eps 2^-8)."""
  m32 = llama.random_model(SMALL, seed=9, dtype=jnp.float32)
  m16 = llama.random_model(SMALL, seed=9, dtype=jnp.bfloat16)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 16)), jnp.int32)
  out16 = m16(tokens)
  assert out16.dtype == jnp.float32
  assert rel_err(out16, m32(tokens)) < 0.1


def test_bad_cache_argument():
  model = llama.random_model(SMALL, seed=0, dtype=jnp.float32)
  cache = model.init_cache("bf16", 1, 16)
  with pytest.raises(TypeError, match="cache must be a jaxkv.ModelCache"):
    model.decode(jnp.zeros((1, 1), jnp.int32), cache.layers())
  other = llama.random_model(dataclasses.replace(SMALL, num_layers=3), seed=0).init_cache(
      "bf16", 1, 16)
  with pytest.raises(ValueError, match=r"cache \(num_layers=3.*does not fit the model"):
    model.decode(jnp.zeros((1, 1), jnp.int32), other)
  assert cache.dtype == jnp.float32  # default: the model dtype


def test_cache_batch_and_capacity_checked():
  """Eager: a token batch that is not the cache's, or growth past capacity,
  raises a ValueError naming the argument (nothing is appended)."""
  import jaxkv
  model = llama.random_model(SMALL, seed=0, dtype=jnp.float32)
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 96, (2, 20)), jnp.int32)
  cache = model.init_cache("kivi4", 2, 32)
  _, cache = model.prefill(tokens, [20, 10], cache)
  with pytest.raises(ValueError, match="tokens has batch 3 but the cache holds 2"):
    model.decode(jnp.zeros((3, 1), jnp.int32), cache)
  with pytest.raises(ValueError, match="tokens has batch 3"):
    model.prefill(jnp.zeros((3, 4), jnp.int32), [1, 1, 1], cache)
  with pytest.raises(ValueError, match=r"prompt_lengths: sequences \[0\] would grow past "
                                       r"capacity=32 \(lengths \[20\]"):
    model.prefill(tokens, [20, 5], cache, chunk_size=8)
  with pytest.raises(ValueError, match=r"num_steps: sequences \[0\] would grow past"):
    jaxkv.decode_steps(model, jnp.array([1, 1]), cache, 13)
  full = model.decode(jnp.ones((2, 12), jnp.int32), cache)[1]   # exactly to capacity
  np.testing.assert_array_equal(np.asarray(full.lengths), [32, 22])
  with pytest.raises(ValueError, match=r"tokens: sequences \[0\] would grow past"):
    model.decode(jnp.ones((2, 1), jnp.int32), full)


def test_jitted_chunked_prefill_past_capacity_skips_the_whole_prompt():
  """Under jit a prompt that does not fit is not appended at all (no chunk of
  it: a later short chunk must not splice in after a skipped one) and its
  sequence is flagged; the other sequence's prompt is appended as usual."""
  model = llama.random_model(SMALL, seed=0, dtype=jnp.float32)
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 96, (2, 20)), jnp.int32)
  cache = model.init_cache("kivi4", 2, 32)
  _, cache = model.prefill(tokens, [20, 10], cache)
  before = cache.layer(0).dequantize()
  prefill = jax.jit(lambda t, n, c: model.prefill(t, n, c, chunk_size=8))
  _, out = prefill(tokens, jnp.array([20, 5]), cache)
  np.testing.assert_array_equal(np.asarray(out.lengths), [20, 15])
  np.testing.assert_array_equal(np.asarray(out.overflow), [True, False])
  with pytest.raises(ValueError, match=r"overflow.*sequences \[0\]"):
    out.check()
  after = out.layer(0).dequantize()
  for x, y in zip(before, after):  # sequence 0 untouched
    np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(y)[0])
  # Sequence 1 took its 5 tokens: equal to appending them alone.
  _, alone = prefill(tokens, jnp.array([0, 5]), cache)
  for x, y in zip(alone.layer(0).dequantize(), after):
    np.testing.assert_array_equal(np.asarray(x)[1], np.asarray(y)[1])


def test_corrupt_checkpoint_files_are_named(saved, tmp_path):
  _, src = saved
  cut = str(tmp_path / "cut")
  _copy_ckpt(src, cut)
  st = os.path.join(cut, "model.safetensors")
  with open(st, "rb") as f:
    data = f.read()
  with open(st, "wb") as f:
    f.write(data[: len(data) // 2])
  with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
    load_llama(cut)
  bad_cfg = str(tmp_path / "cfg")
  _copy_ckpt(src, bad_cfg)
  with open(os.path.join(bad_cfg, "config.json"), "w") as f:
    f.write("[1, 2]")
  with pytest.raises(ValueError, match="config.json must hold a JSON object, got a list"):
    load_llama(bad_cfg)
  with open(os.path.join(bad_cfg, "config.json"), "w") as f:
    f.write("{bad json")
  with pytest.raises(ValueError, match="config.json is not valid JSON"):
    load_llama(bad_cfg)


@pytest.mark.parametrize("direct_out", [False, True])
@pytest.mark.parametrize("rows", [1, 2, llama.DIRECT_OUT_ROWS, llama.DIRECT_OUT_ROWS + 1, 150])
def test_linear_rounds_a_float32_sum_once(rows, direct_out):
  """`llama.linear` on bfloat16 at every row count (one row padded to two, the
  float32 dot then a cast, and with ``direct_out`` past `DIRECT_OUT_ROWS` a dot
  asked for bfloat16): each output is the exact product rounded once to
  bfloat16, up to float32 summation order (float64 numpy oracle), in the
  input's leading shape; the dot asks for bfloat16 exactly in that last case."""
  rng = np.random.default_rng(rows)
  lead = (rows,) if rows % 2 else (2, rows // 2)
  x = jnp.asarray(rng.standard_normal((*lead, 96)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((96, 40)) * 0.1, jnp.bfloat16)
  fn = functools.partial(llama.linear, direct_out=direct_out)
  dots = [e for e in jax.make_jaxpr(fn)(x, w).jaxpr.eqns if e.primitive.name == "dot_general"]
  direct = direct_out and rows > llama.DIRECT_OUT_ROWS
  assert [e.params["preferred_element_type"] for e in dots] == [
      jnp.dtype(jnp.bfloat16 if direct else jnp.float32)]
  y = jax.jit(fn)(x, w)
  assert y.shape == (*lead, 40) and y.dtype == jnp.bfloat16
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  # one rounding: within half a bfloat16 ulp (2**-8 relative), plus float32 sums
  bound = 2.0 ** -8 * np.abs(exact) + 1e-5 * np.sqrt(96)
  assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= bound)
  assert np.mean(np.asarray(y, np.float64) == np.asarray(exact.astype(jnp.bfloat16), np.float64)) > 0.99


def test_only_column_parallel_products_write_bfloat16_directly():
  """Past `DIRECT_OUT_ROWS` rows a layer's q, k, v, gate and up dots ask for
  bfloat16 (their summed dimension is never split over devices) and o and down
  keep float32 outputs (a row-parallel sum split over a ``"model"`` axis would
  be rounded per device); at fewer rows every dot keeps float32."""
  model = llama.random_model(SMALL, seed=3, dtype=jnp.bfloat16)
  layer, c = model.layers[0], SMALL
  for rows, want in ((llama.DIRECT_OUT_ROWS + 3, 5), (4, 0)):
    x = jnp.ones((1, rows, c.hidden_size), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(rows), (1, rows))
    def run(x):
      q, k, v = layer.self_attn.qkv(x, pos)
      return layer.self_attn.out(q), layer.mlp(x), k, v
    dots = [e for e in jax.make_jaxpr(run)(x).jaxpr.eqns if e.primitive.name == "dot_general"]
    kinds = [e.params["preferred_element_type"] for e in dots]
    assert len(dots) == 7
    assert kinds.count(jnp.dtype(jnp.bfloat16)) == want, (rows, kinds)
