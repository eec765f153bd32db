"""`models.tokenizer`: GGUF metadata and HF directories -> text <-> ids.

Oracles: hand-computed BPE ids on a tiny synthetic GGUF vocabulary; and, on
the real SmolLM2 GGUF (skipped when not installed), transformers' tokenizer
for the same file (ids, chat template rendering) on stdlib docstrings.
"""

from __future__ import annotations

import argparse
import json
import os
import textwrap

import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from models.tokenizer import load_tokenizer  # noqa: E402
from tests import smollm2  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_chars() -> list[str]:
  """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
  chars, extra = {}, 0
  for b in range(256):
    if b in keep:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return [chars[b] for b in range(256)]


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["t h", "th e", "Ġ the", "Ġ c", "a t", "Ġc at"]


def write_tokenizer_gguf(path, *, model="gpt2", pre="gpt2", template=TEMPLATE):
  """A GGUF with only tokenizer metadata: 3 control tokens, 256 bytes, 6 merges."""
  w = gguf.GGUFWriter(path, "llama")
  merged = ["th", "the", "Ġthe", "Ġc", "at", "Ġcat"]
  tokens = SPECIAL + byte_chars() + merged
  w.add_tokenizer_model(model)
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
  w.add_token_merges(MERGES)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_add_bos_token(False)
  if template:
    w.add_chat_template(template)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return {tok: i for i, tok in enumerate(tokens)}


def test_synthetic_gguf_bpe(tmp_path):
  path = str(tmp_path / "tok.gguf")
  vocab = write_tokenizer_gguf(path)
  tok = load_tokenizer(path)
  assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and not tok.add_bos
  # "the cat the" -> the | Ġcat | Ġthe (merges applied in rank order).
  assert tok.encode("the cat the") == [vocab["the"], vocab["Ġcat"], vocab["Ġthe"]]
  # Control tokens written in the text are matched whole, and skipped by decode.
  ids = tok.encode("<|im_start|>the<|im_end|>")
  assert ids == [1, vocab["the"], 2]
  assert tok.decode(ids) == "the"
  assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>the<|im_end|>"
  text = "Ünïcödé\ttabs  and\n\nnewlines 123 \U0001F600"
  assert tok.decode(tok.encode(text)) == text  # byte-level: every string round trips
  with pytest.raises(ValueError, match=r"outside the vocabulary"):
    tok.decode([len(vocab) + 5])


def test_synthetic_chat_template(tmp_path):
  path = str(tmp_path / "tok.gguf")
  write_tokenizer_gguf(path)
  tok = load_tokenizer(path)
  msgs = [{"role": "user", "content": "the cat"}]
  assert tok.apply_chat_template(msgs) == (
      "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n")
  assert tok.encode_chat(msgs)[:1] == [1]
  path2 = str(tmp_path / "plain.gguf")
  write_tokenizer_gguf(path2, template=None)
  with pytest.raises(ValueError, match="no chat template"):
    load_tokenizer(path2).apply_chat_template(msgs)


@pytest.mark.parametrize("field,value,match", [
    ("model", "llama", "tokenizer model 'llama'"),
    ("pre", "qwen2-unknown", "pre-tokenizer 'qwen2-unknown'"),
])
def test_unsupported_gguf_tokenizer(tmp_path, field, value, match):
  path = str(tmp_path / "tok.gguf")
  write_tokenizer_gguf(path, **{field: value})
  with pytest.raises(ValueError, match=match):
    load_tokenizer(path)


def test_hf_directory(tmp_path):
  """tokenizer.json + tokenizer_config.json (bos/eos by name, chat template)."""
  vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.save(str(tmp_path / "tokenizer.json"))
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True,
               "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                                "{% endfor %}"}, f)
  tok = load_tokenizer(str(tmp_path))
  assert tok.encode("hello world") == [1, 3, 4]
  assert tok.eos_token_ids == (2,)
  assert tok.apply_chat_template([{"role": "user", "content": "world"}]) == "<s>world"
  with pytest.raises(ValueError, match="has no tokenizer.json"):
    load_tokenizer(str(tmp_path / "nowhere"))


# ------------------------------------------------------------ the real model
TEXTS = [json.__doc__, argparse.__doc__, textwrap.__doc__, os.__doc__,
         "12345 hello  world\n\n x été \U0001F600 <|im_start|>user\nhi<|im_end|>"]


def test_smollm2_ids_match_transformers():
  smollm2.require()
  ours, hf = smollm2.our_tokenizer(), smollm2.hf_tokenizer()
  for text in TEXTS:
    ids = ours.encode(text)
    assert ids == hf(text).input_ids, text[:40]
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_smollm2_chat_template_matches_transformers():
  smollm2.require()
  ours, hf = smollm2.our_tokenizer(), smollm2.hf_tokenizer()
  for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                   [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "Name a color."}]):
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(messages) == want
    assert ours.encode_chat(messages) == hf(want, add_special_tokens=False).input_ids
  assert ours.eos_token_ids == (hf.eos_token_id,)
