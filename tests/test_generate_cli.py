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


def test_generate_command_errors(checkpoint, tmp_path, capsys):
  assert cli.main(["generate", "--checkpoint", str(tmp_path), "--prompt", "w3"]) == 2
  assert "has no config.json" in capsys.readouterr().err
  assert cli.main(["generate", "--checkpoint", checkpoint, "--kv", "int3", "--prompt", "w3"]) == 2
  assert "unknown preset 'int3'" in capsys.readouterr().err


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


def test_unknown_command_lists_commands(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["generat", "--model", "x"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "unknown command 'generat'" in err and "demo, generate, formats" in err


@pytest.mark.parametrize("argv", [["demo", "--batch", "0"], ["--new-tokens", "-3"],
                                  ["generate", "--model", "x", "--max-new-tokens", "0"],
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


def test_demo_command(capsys):
  rc = cli.main(["--random", "--prompt-len", "140", "--new-tokens", "4", "--formats", "kivi4",
                 "--batch", "1"])  # no subcommand = demo
  out = capsys.readouterr().out
  assert rc == 0
  lines = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
  assert "bf16" in lines and "kivi4" in lines and "decode tok/s" in out


def test_formats_command(capsys):
  assert cli.main(["formats"]) == 0
  assert "kivi2" in capsys.readouterr().out
