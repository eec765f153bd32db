"""Text <-> token ids for the checkpoints `models.llama.from_pretrained` loads.

`load_tokenizer(path)` returns a `Tokenizer` for

* a ``.gguf`` file: built from the ``tokenizer.ggml.*`` metadata (byte-level
  BPE, ``tokenizer.ggml.model = "gpt2"``): tokens, merges, token types
  (control / user-defined tokens become added tokens, matched whole), the
  llama.cpp pre-tokenizer named by ``tokenizer.ggml.pre``, bos/eos ids and
  ``tokenizer.chat_template``;
* a HF checkpoint directory: ``tokenizer.json`` plus ``tokenizer_config.json``
  (bos/eos tokens, ``add_bos_token``, ``chat_template``) or
  ``chat_template.jinja``.

Chat templates are Jinja templates rendered the way transformers renders them
(sandboxed, ``trim_blocks``, ``lstrip_blocks``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

# llama.cpp pre-tokenizer names (``tokenizer.ggml.pre``) -> regexes applied before
# byte-level BPE (llama.cpp ``llama-vocab.cpp``). "gpt2" is ByteLevel's own regex.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "starcoder", "llama-bpe", "llama3")
# ggml token types (llama.cpp ``llama_token_type``).
_CONTROL, _USER_DEFINED = 3, 4


@dataclasses.dataclass
class Tokenizer:
  """A `tokenizers.Tokenizer` with the checkpoint's special ids and chat template.

  Attributes:
    backend: the `tokenizers.Tokenizer` (byte-level BPE or whatever
      ``tokenizer.json`` holds).
    bos_token_id: prepended by `encode` when ``add_bos`` is set.
    eos_token_ids: ids that end generation (eos, eot).
    add_bos: whether plain text encodes with a leading bos.
    chat_template: Jinja source, or None.
  """

  backend: Any
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  add_bos: bool = False
  chat_template: str | None = None

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token(self, token_id: int | None) -> str:
    """The string of one id ('' for None)."""
    return "" if token_id is None else (self.backend.id_to_token(int(token_id)) or "")

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of ``text``; special tokens written in the text map to their ids.

    Args:
      text: the string.
      add_bos: prepend bos; None = the checkpoint's default (`add_bos`).
    """
    ids = self.backend.encode(text, add_special_tokens=False).ids
    add_bos = self.add_bos if add_bos is None else add_bos
    if add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
      ids = [self.bos_token_id] + ids
    return ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of ``ids`` (control tokens dropped unless ``skip_special_tokens=False``)."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict], *,
                          add_generation_prompt: bool = True) -> str:
    """Renders ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

    Raises:
      ValueError: the checkpoint has no chat template, or the template
        rejects the messages.
    """
    if not self.chat_template:
      raise ValueError("this checkpoint has no chat template; encode plain text instead")
    template = _compile_template(self.chat_template)
    try:
      return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                             bos_token=self.token(self.bos_token_id),
                             eos_token=self.token(self.eos_token_ids[0] if self.eos_token_ids
                                                  else None))
    except _TemplateError as e:
      raise ValueError(f"chat template rejected the messages: {e}") from e

  def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = True
                  ) -> list[int]:
    """Token ids of the rendered chat (the template writes bos itself if it wants one)."""
    text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return self.encode(text, add_bos=False)


class _TemplateError(Exception):
  pass


def _compile_template(source: str):
  import jinja2  # pylint: disable=import-outside-toplevel
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=import-outside-toplevel

  def raise_exception(message):
    raise _TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
  env.globals["raise_exception"] = raise_exception
  try:
    return env.from_string(source)
  except jinja2.TemplateError as e:
    raise ValueError(f"chat template does not parse: {e}") from e


# --------------------------------------------------------------------- GGUF
def tokenizer_from_gguf(path) -> Tokenizer:
  """Builds the byte-level BPE tokenizer stored in a GGUF file's metadata.

  Raises:
    ValueError: no tokenizer in the file, a tokenizer model other than
      ``"gpt2"`` (byte-level BPE), or an unknown pre-tokenizer.
  """
  from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer as Backend  # pylint: disable=import-outside-toplevel

  from models.gguf import metadata_value, open_gguf  # pylint: disable=import-outside-toplevel
  reader = open_gguf(os.fspath(path))
  kind = metadata_value(reader, "tokenizer.ggml.model")
  if kind is None:
    raise ValueError(f"GGUF file {path!r} holds no tokenizer (tokenizer.ggml.model)")
  if kind != "gpt2":
    raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, "
                     "'gpt2')")
  pre = metadata_value(reader, "tokenizer.ggml.pre", "default")
  if pre not in SUPPORTED_PRE_TOKENIZERS:
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; "
                     f"supported: {SUPPORTED_PRE_TOKENIZERS}")
  tokens = metadata_value(reader, "tokenizer.ggml.tokens")
  merges = metadata_value(reader, "tokenizer.ggml.merges") or []
  types = metadata_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
  vocab = {tok: i for i, tok in enumerate(tokens)}
  try:
    backend = Backend(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                 fuse_unk=False, byte_fallback=False))
  except Exception as e:  # pylint: disable=broad-except  # tokenizers raises plain Exception
    raise ValueError(f"GGUF tokenizer in {path!r} is inconsistent: {e}") from e
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in (
      "llama-bpe", "llama3"))
  if pre in ("smollm", "starcoder"):  # digits one by one, then GPT-2's regex
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), byte_level])
  elif pre in ("llama-bpe", "llama3"):
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"), byte_level])
  else:
    backend.pre_tokenizer = byte_level
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                              for tok, t in zip(tokens, types) if t == _CONTROL])
  backend.add_tokens([AddedToken(tok, special=False, normalized=False)
                      for tok, t in zip(tokens, types) if t == _USER_DEFINED])
  eos_ids = tuple(dict.fromkeys(int(x) for x in (
      metadata_value(reader, "tokenizer.ggml.eos_token_id"),
      metadata_value(reader, "tokenizer.ggml.eot_token_id")) if x is not None))
  bos = metadata_value(reader, "tokenizer.ggml.bos_token_id")
  return Tokenizer(backend=backend, bos_token_id=None if bos is None else int(bos),
                   eos_token_ids=eos_ids,
                   add_bos=bool(metadata_value(reader, "tokenizer.ggml.add_bos_token", False)),
                   chat_template=metadata_value(reader, "tokenizer.chat_template"))


# ------------------------------------------------------------ HF directory
def tokenizer_from_hf_dir(path) -> Tokenizer:
  """``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``) of a HF directory."""
  from tokenizers import Tokenizer as Backend  # pylint: disable=import-outside-toplevel
  tok_path = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(tok_path):
    raise ValueError(f"{path!r} has no tokenizer.json")
  backend = Backend.from_file(tok_path)
  cfg = {}
  cfg_path = os.path.join(path, "tokenizer_config.json")
  if os.path.isfile(cfg_path):
    with open(cfg_path) as f:
      cfg = json.load(f)
  template = cfg.get("chat_template")
  jinja_path = os.path.join(path, "chat_template.jinja")
  if template is None and os.path.isfile(jinja_path):
    with open(jinja_path) as f:
      template = f.read()
  if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
    template = next((t["template"] for t in template if t.get("name") == "default"), None)

  def token_id(entry):
    if isinstance(entry, dict):
      entry = entry.get("content")
    return None if entry is None else backend.token_to_id(entry)

  bos = token_id(cfg.get("bos_token"))
  eos = token_id(cfg.get("eos_token"))
  gen_path = os.path.join(path, "generation_config.json")
  eos_ids = [eos] if eos is not None else []
  if os.path.isfile(gen_path):
    with open(gen_path) as f:
      gen_eos = json.load(f).get("eos_token_id")
    eos_ids += gen_eos if isinstance(gen_eos, list) else [gen_eos]
  return Tokenizer(backend=backend, bos_token_id=bos,
                   eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos_ids if e is not None)),
                   add_bos=bool(cfg.get("add_bos_token", False)), chat_template=template)


def load_tokenizer(path) -> Tokenizer:
  """The tokenizer of a ``.gguf`` file or a HF checkpoint directory.

  Raises:
    ValueError: no tokenizer there, or one this module cannot build (named).
  """
  from models.gguf import is_gguf_file  # pylint: disable=import-outside-toplevel
  path = os.fspath(path)
  if is_gguf_file(path):
    return tokenizer_from_gguf(path)
  return tokenizer_from_hf_dir(path)


__all__ = ["SUPPORTED_PRE_TOKENIZERS", "Tokenizer", "load_tokenizer", "tokenizer_from_gguf",
           "tokenizer_from_hf_dir"]
