"""Loading HF Llama checkpoints (config.json + safetensors) into `models.llama.Llama`.

Supported layouts: ``model.safetensors`` (one file) or shards listed in
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file),
as written by ``save_pretrained`` with or without ``max_shard_size``.
Every tensor is checked: missing, unexpected and mis-shaped tensors raise
`ValueError` naming them. HF ``[out, in]`` projection weights are transposed
to the model's ``[in, out]`` kernels.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.llama import Llama, LlamaConfig

# Tensors some exporters write that carry no weights.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _read_json(fname: str):
  """``json.load`` of ``fname``; ValueError naming the file if it is not valid
  JSON or not a JSON object."""
  try:
    with open(fname) as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f"{fname} is not valid JSON: {e}") from e
  if not isinstance(raw, dict):
    raise ValueError(f"{fname} must hold a JSON object, got a {type(raw).__name__}")
  return raw


def _safetensors(fname: str):
  """``safe_open(fname)``; ValueError naming the file if it is not a readable
  safetensors file (truncated, corrupt header)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  try:
    return safe_open(fname, framework="flax")
  except Exception as e:  # pylint: disable=broad-except  (SafetensorError, OSError, ...)
    raise ValueError(f"{fname} is not a readable safetensors file: {e}") from e


def read_config(path) -> LlamaConfig:
  """`LlamaConfig` from ``path/config.json``."""
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise ValueError(f"{path!r} has no config.json")
  return LlamaConfig.from_hf_dict(_read_json(cfg_path))


def expected_tensors(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> HF shape for a Llama of ``config``."""
  c = config
  h, d = c.hidden_size, c.head_dim
  shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
  if not c.tie_word_embeddings:
    shapes["lm_head.weight"] = (c.vocab_size, h)
  for i in range(c.num_layers):
    p = f"model.layers.{i}."
    shapes.update({
        p + "self_attn.q_proj.weight": (c.num_heads * d, h),
        p + "self_attn.k_proj.weight": (c.num_kv_heads * d, h),
        p + "self_attn.v_proj.weight": (c.num_kv_heads * d, h),
        p + "self_attn.o_proj.weight": (h, c.num_heads * d),
        p + "mlp.gate_proj.weight": (c.intermediate_size, h),
        p + "mlp.up_proj.weight": (c.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, c.intermediate_size),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    })
  return shapes


def weight_files(path) -> dict[str, str]:
  """Tensor name -> safetensors file, from the index or the single file."""
  index = os.path.join(path, "model.safetensors.index.json")
  single = os.path.join(path, "model.safetensors")
  if os.path.isfile(index):
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()):
      raise ValueError(f"{index} has no 'weight_map' of tensor name -> file name")
    files = {name: os.path.join(path, fname) for name, fname in weight_map.items()}
    absent = sorted({f for f in files.values() if not os.path.isfile(f)})
    if absent:
      raise ValueError(f"shards listed in {index} are missing: {absent}")
    return files
  if os.path.isfile(single):
    with _safetensors(single) as f:
      return {name: single for name in f.keys()}
  present = sorted(os.listdir(path)) if os.path.isdir(path) else []
  raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r} "
                   f"(found {present})")


def _iter_tensors(files: dict[str, str], names) -> Iterator[tuple[str, jax.Array]]:
  by_file: dict[str, list[str]] = {}
  for name in names:
    by_file.setdefault(files[name], []).append(name)
  for fname, fnames in by_file.items():
    with _safetensors(fname) as f:
      available = set(f.keys())
      for name in fnames:
        if name not in available:
          raise ValueError(f"tensor {name!r} is listed for {fname} but not stored there")
        yield name, f.get_tensor(name)


def _fmt_list(names, limit=8) -> str:
  names = sorted(names)
  more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more


def load_llama(path, dtype=None, *, mesh=None) -> Llama:
  """Builds a `Llama` from a HF checkpoint directory.

  Args:
    path: directory with ``config.json`` and safetensors weights.
    dtype: parameter dtype (floating); None keeps the checkpoint's (config
      ``dtype`` / ``torch_dtype``, else the embedding's stored dtype).
    mesh: a `jaxkv.make_mesh` mesh: each parameter goes from host memory
      straight to its shards (`models.sharding`), never whole onto one device.
  Raises:
    TypeError: ``dtype`` is not a floating dtype (checked before any file is read).
    ValueError: unsupported config, missing files, or missing / unexpected /
      mis-shaped tensors (all named).
  """
  if dtype is not None:
    _check_float_dtype(dtype, "dtype")
  path = os.fspath(path)
  config = read_config(path)
  files = weight_files(path)
  expected = expected_tensors(config)
  stored = {n for n in files if not _IGNORED.fullmatch(n)}
  if config.tie_word_embeddings:
    stored.discard("lm_head.weight")  # some exporters keep the tied copy
  missing = set(expected) - stored
  unexpected = stored - set(expected)
  if missing or unexpected:
    parts = []
    if missing:
      parts.append(f"missing tensors: {_fmt_list(missing)}")
    if unexpected:
      parts.append(f"unexpected tensors: {_fmt_list(unexpected)}")
    raise ValueError(f"checkpoint {path!r} does not match its config: " + "; ".join(parts))

  if dtype is None:
    raw = _read_json(os.path.join(path, "config.json"))
    name = raw.get("dtype") or raw.get("torch_dtype")
    dtype = jnp.dtype(name) if name in ("float32", "bfloat16", "float16") else None
  return build_llama(config, _iter_tensors(files, sorted(expected)), dtype=dtype, source=path,
                     mesh=mesh)


def build_llama(config: LlamaConfig, tensors: Iterable[tuple[str, Any]], *, dtype=None,
                source: str = "checkpoint", mesh=None) -> Llama:
  """Builds a `Llama` from ``(HF tensor name, array)`` pairs in HF orientation.

  The one place every loader (HF safetensors, GGUF) fills a model: names and
  shapes are those of `expected_tensors` (projection weights ``[out, in]``).
  Each tensor goes to its parameter (``model.layers.{i}.*`` to
  ``model.layers[i]``) through a host buffer, moved to the device at the end.

  Args:
    config: the model config.
    tensors: every tensor of `expected_tensors(config)` exactly once (jax or
      numpy arrays).
    dtype: parameter dtype (floating); None = the first tensor's dtype.
    source: named in error messages.
    mesh: place each parameter on this mesh's shards (`models.sharding`).
  Raises:
    TypeError: ``dtype`` (given or taken from the first tensor) is not floating.
    ValueError: missing, unexpected or mis-shaped tensors (all named).
  """
  if dtype is not None:
    _check_float_dtype(dtype, "dtype")
  expected = expected_tensors(config)
  model = nnx.eval_shape(lambda: Llama(config, dtype=dtype or jnp.float32, rngs=nnx.Rngs(0)))
  targets = _param_targets(model)
  buffers: dict[int, np.ndarray] = {}  # id(param) -> host buffer in the final dtype
  bad_shapes, seen = [], set()
  for name, tensor in tensors:
    if name not in expected:
      raise ValueError(f"{source!r}: unexpected tensor {name!r}")
    if tuple(tensor.shape) != expected[name]:
      bad_shapes.append(f"{name}: stored {tuple(tensor.shape)}, expected {expected[name]}")
      continue
    if dtype is None:  # first tensor decides
      dtype = _check_float_dtype(tensor.dtype, f"dtype of tensor {name!r}")
      model = nnx.eval_shape(lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(0)))
      targets = _param_targets(model)
    param, transpose = targets[name]
    value = tensor.T if transpose else tensor
    buffers[id(param)] = np.asarray(jnp.asarray(value, dtype))  # round as jnp does, then host
    seen.add(name)
  if bad_shapes:
    raise ValueError(f"checkpoint {source!r} has mis-shaped tensors: " + "; ".join(bad_shapes))
  missing = set(expected) - seen
  if missing:
    raise ValueError(f"checkpoint {source!r} lacks tensors: {_fmt_list(missing)}")
  shardings = {}
  if mesh is not None:
    from models.sharding import param_shardings_by_variable  # pylint: disable=import-outside-toplevel
    shardings = param_shardings_by_variable(model, mesh)
  for param, _ in targets.values():
    if id(param) in buffers:
      host = buffers.pop(id(param))
      set_param(param, jax.device_put(host, shardings[id(param)]) if mesh is not None
           else jnp.asarray(host))
  return model


def _check_float_dtype(dtype, what: str):
  """``jnp.dtype(dtype)``; TypeError naming ``what`` unless it is a floating dtype."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"{what}={dtype!r} is not a dtype") from None
  if not jnp.issubdtype(dt, jnp.floating):
    raise TypeError(f"{what}={dt} must be a floating dtype (float32, bfloat16, float16)")
  return dt


def set_param(param: nnx.Variable, value: jax.Array) -> None:
  """Replaces a parameter's value (flax 0.12's ``set_value``, ``.value`` before)."""
  if hasattr(param, "set_value"):  # flax >= 0.12
    param.set_value(value)
  else:
    param.value = value


def _param_targets(model: Llama) -> dict[str, tuple[nnx.Param, bool]]:
  """HF tensor name -> (model Param, whether to transpose)."""
  t = {"model.embed_tokens.weight": (model.embed_tokens, False),
       "model.norm.weight": (model.norm.weight, False)}
  if model.lm_head is not None:
    t["lm_head.weight"] = (model.lm_head.kernel, True)
  for i, layer in enumerate(model.layers):
    p = f"model.layers.{i}."
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
      t[p + f"self_attn.{proj}.weight"] = (getattr(layer.self_attn, proj).kernel, True)
    for proj in ("gate_proj", "up_proj", "down_proj"):
      t[p + f"mlp.{proj}.weight"] = (getattr(layer.mlp, proj).kernel, True)
    t[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, False)
    t[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, False)
  return t


def save_llama(model: Llama, path) -> None:
  """Writes ``config.json`` + ``model.safetensors`` loadable by `load_llama` and HF.

  Intended for small models (tests, demos): all tensors go through host memory.
  """
  from safetensors.flax import save_file  # pylint: disable=import-outside-toplevel
  c = model.config
  os.makedirs(path, exist_ok=True)
  cfg = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
      "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
      "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
      "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
      "rope_scaling": (None if c.rope_scaling is None else {
          "rope_type": c.rope_scaling.rope_type, "factor": c.rope_scaling.factor,
          "low_freq_factor": c.rope_scaling.low_freq_factor,
          "high_freq_factor": c.rope_scaling.high_freq_factor,
          "original_max_position_embeddings":
              c.rope_scaling.original_max_position_embeddings}),
      "tie_word_embeddings": c.tie_word_embeddings,
      "max_position_embeddings": c.max_position_embeddings,
      "bos_token_id": c.bos_token_id,
      "eos_token_id": list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0],
      "hidden_act": "silu", "torch_dtype": model.dtype.name,
  }
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f, indent=2)
  tensors = {}
  for name, (param, transpose) in _param_targets(model).items():
    arr = param[...]
    tensors[name] = jnp.asarray(arr.T if transpose else arr)
  save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
