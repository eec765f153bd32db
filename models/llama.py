"""Llama 2 / 3 / 3.1 in Flax NNX, decoding on a `jaxkv.KVCache` per layer.

The model mirrors HF transformers' ``LlamaForCausalLM`` (rotate-half RoPE,
RMSNorm computed in float32 then cast back, SiLU-gated MLP, GQA or MHA, tied
or untied embeddings, ``head_dim`` taken from the config) so HF checkpoints
load without permuting weights (`from_pretrained`).

Three entry points:

* ``model(tokens)``: full causal forward, ``[B, T]`` -> float32 logits
  ``[B, T, vocab]``; no cache. The reference for everything else.
* ``model.prefill(tokens, prompt_lengths, caches)``: causal attention over
  right-padded prompts (row ``b`` holds its ``prompt_lengths[b]`` real tokens
  first, padding after; causal masking means real tokens never see the
  padding), then `KVCache.prefill` stores the first ``prompt_lengths[b]``
  tokens' K/V of every layer. Returns the logits of each prompt's last real
  token. The caches must be empty (positions start at 0).
* ``model.decode(tokens, caches)``: ``S >= 1`` new tokens per sequence at
  positions ``caches[0].lengths + [0, S)``: appends their K/V to each layer's
  cache, then `jaxkv.decode_attention` over the (quantized) cache.

The cache is a tuple with one `jaxkv.KVCache` per layer (``caches[i]`` belongs
to ``model.layers[i]``); all share format, batch and capacity. It travels as
data: methods return a new tuple, never mutate the module.

Weights are stored as ``[in, out]`` kernels (HF stores ``[out, in]``) and the
embedding as ``[vocab, hidden]``; activations run in the weights' dtype with
float32 accumulation, RoPE angles and softmax in float32, logits in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxkv
from jaxkv.formats import KVFormat

Caches = tuple  # tuple[jaxkv.KVCache, ...], one per layer

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


# ------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling (static, hashable).

  ``rope_type="llama3"``: Llama 3.1's piecewise scaling of the inverse
  frequencies (``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings``). ``rope_type="linear"``: positions
  divided by ``factor`` (equivalently every inverse frequency).
  """

  rope_type: str = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in ("linear", "llama3"):
      raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: "
                       f"{SUPPORTED_ROPE_TYPES}")
    if not self.factor > 0:
      raise ValueError(f"rope scaling factor={self.factor!r} must be > 0")
    if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"llama3 rope: high_freq_factor={self.high_freq_factor} must exceed "
                       f"low_freq_factor={self.low_freq_factor}")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Static, hashable Llama hyper-parameters.

  Attributes:
    vocab_size, hidden_size, intermediate_size: model widths.
    num_layers: decoder layers.
    num_heads: query heads Hq; num_kv_heads: K/V heads Hkv (Hq % Hkv == 0;
      equal for MHA).
    head_dim: channels per head D (may differ from hidden_size / num_heads).
    rms_norm_eps: RMSNorm epsilon.
    rope_theta: RoPE base.
    rope_scaling: `RopeScaling` or None (plain RoPE).
    tie_word_embeddings: the LM head reuses the embedding matrix.
    max_position_embeddings: informational (the context the model was trained
      for); not enforced.
    bos_token_id: token prepended by the tokenizer, if any.
    eos_token_ids: tokens that end generation.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 4096
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if not self.rope_theta > 0:
      raise ValueError(f"rope_theta={self.rope_theta!r} must be > 0")
    object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

  @property
  def num_groups(self) -> int:
    """Query heads per KV head."""
    return self.num_heads // self.num_kv_heads

  @classmethod
  def named(cls, name: str) -> "LlamaConfig":
    """A built-in config by name; see `CONFIGS`."""
    try:
      return CONFIGS[name]
    except KeyError:
      raise ValueError(f"unknown config {name!r}; choose one of {sorted(CONFIGS)}") from None

  @classmethod
  def from_hf_dict(cls, d: dict) -> "LlamaConfig":
    """Builds a config from a HF ``config.json`` dict.

    Accepts hub-style RoPE (``rope_theta`` + ``rope_scaling``) and
    transformers-5 style (``rope_parameters`` holding ``rope_theta`` and the
    scaling keys). Raises ValueError for configs this model cannot run.
    """
    model_type = d.get("model_type", "llama")
    if model_type != "llama":
      raise ValueError(f"model_type={model_type!r} is not supported (only 'llama')")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
      if key not in d:
        raise ValueError(f"config.json lacks required key {key!r}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
    for key in ("attention_bias", "mlp_bias"):
      if d.get(key, False):
        raise ValueError(f"{key}=True is not supported")
    heads = int(d["num_attention_heads"])
    kv_heads = d.get("num_key_value_heads") or heads
    head_dim = d.get("head_dim") or int(d["hidden_size"]) // heads

    rope = d.get("rope_parameters")
    if rope is not None:  # transformers >= 5
      theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    else:
      rope = d.get("rope_scaling") or {}
      theta = d.get("rope_theta", 10000.0)
    if not isinstance(rope, dict):
      raise ValueError(f"rope parameters must be a dict, got {rope!r}")
    if rope and all(isinstance(v, dict) for v in rope.values()):
      raise ValueError("per-layer-type rope parameters are not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(f"unsupported rope type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
      raise ValueError(f"partial_rotary_factor={prf!r} is not supported (only 1.0)")
    scaling = None
    if rope_type == "linear":
      scaling = RopeScaling("linear", factor=float(rope["factor"]))
    elif rope_type == "llama3":
      missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings") if k not in rope]
      if missing:
        raise ValueError(f"llama3 rope parameters lack {missing}")
      scaling = RopeScaling(
          "llama3", factor=float(rope["factor"]),
          low_freq_factor=float(rope["low_freq_factor"]),
          high_freq_factor=float(rope["high_freq_factor"]),
          original_max_position_embeddings=int(rope["original_max_position_embeddings"]))

    eos = d.get("eos_token_id")
    eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
    return cls(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos,
    )


_LLAMA3_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)

CONFIGS: dict[str, LlamaConfig] = {
    # Small enough for CPU tests and the demo; Llama-3 style (GQA, llama3 RoPE).
    "tiny": LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 1024),
        max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
    "llama-2-7b": LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
        num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,)),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 8192), tie_word_embeddings=True,
        max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
}
"""Built-in configs (shapes of the public checkpoints; weights are random)."""


# --------------------------------------------------------------------- rope
@functools.lru_cache(maxsize=None)
def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """``[head_dim // 2]`` float32 inverse frequencies, computed as HF does."""
  exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
  inv_freq = (np.float32(1.0) / np.power(np.float32(theta), exponent)).astype(np.float32)
  if scaling is None:
    return inv_freq
  factor = np.float32(scaling.factor)
  if scaling.rope_type == "linear":
    return (inv_freq / factor).astype(np.float32)
  # Llama 3.1 (HF `_compute_llama3_parameters`): long wavelengths are divided
  # by `factor`, short ones kept, the band in between interpolated smoothly.
  old_len = np.float32(scaling.original_max_position_embeddings)
  low_freq_wavelen = old_len / np.float32(scaling.low_freq_factor)
  high_freq_wavelen = old_len / np.float32(scaling.high_freq_factor)
  wavelen = np.float32(2 * math.pi) / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - np.float32(scaling.low_freq_factor)) / (
      np.float32(scaling.high_freq_factor) - np.float32(scaling.low_freq_factor))
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotate-half RoPE (HF convention).

  Args:
    x: ``[B, T, H, D]``.
    positions: ``[B, T]`` int positions.
    inv_freq: ``[D // 2]`` float32.
  Returns:
    ``[B, T, H, D]`` in ``x``'s dtype; angles and products in float32.
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * cos + rotated * sin).astype(x.dtype)


# ---------------------------------------------------------------- attention
def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     implementation: str | None = None) -> jax.Array:
  """Causal self-attention over a whole (prompt) block.

  Uses `jax.nn.dot_product_attention` with cuDNN flash attention on GPU when
  the dtype and head size allow it, XLA otherwise (CPU, float32).

  Args:
    q: ``[B, T, Hq, D]``; k, v: ``[B, T, Hkv, D]`` (GQA when Hkv < Hq).
    implementation: None (pick), ``"xla"`` or ``"cudnn"``.
  Returns:
    ``[B, T, Hq, D]`` in q's dtype.
  """
  if implementation is None:
    implementation = "xla"
    if jax.default_backend() == "gpu" and _cudnn_compiles(
        jnp.dtype(q.dtype).name, q.shape[2], k.shape[2], q.shape[3]):
      try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
      except Exception:  # pylint: disable=broad-except  # shape cuDNN rejects
        pass
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


@functools.lru_cache(maxsize=None)
def _cudnn_compiles(dtype: str, q_heads: int, kv_heads: int, head_dim: int) -> bool:
  """Whether cuDNN causal attention compiles here for this dtype and head layout.

  A small probe compile, once per layout: cuDNN support depends on the cuDNN
  and jax versions and can fail at compile time, after tracing succeeded.
  """
  if dtype not in ("bfloat16", "float16") or head_dim > 128 or head_dim % 8:
    return False
  q = jax.ShapeDtypeStruct((1, 128, q_heads, head_dim), dtype)
  kv = jax.ShapeDtypeStruct((1, 128, kv_heads, head_dim), dtype)
  fn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
  try:
    jax.jit(fn).lower(q, kv, kv).compile()
    return True
  except Exception:  # pylint: disable=broad-except
    return False


# ------------------------------------------------------------------ modules
# flax >= 0.12 wants `nnx.List` for lists of modules; older NNX takes plain lists.
_ModuleList = getattr(nnx, "List", list)


def _normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
  """Bias-free projection with an ``[in, out]`` kernel."""

  def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
    self.kernel = nnx.Param(_normal(rngs, (in_features, out_features), in_features ** -0.5, dtype))

  def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
    return jnp.dot(x, self.kernel[...], preferred_element_type=jnp.float32).astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm as HF computes it: normalize in float32, cast back, scale."""

  def __init__(self, dim: int, *, eps: float, dtype):
    self.weight = nnx.Param(jnp.ones((dim,), dtype))
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return self.weight[...] * xf.astype(x.dtype)


class Attention(nnx.Module):
  """Projections and RoPE of one attention layer; the attention itself is passed in."""

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, dtype=dtype, rngs=rngs)
    self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, dtype=dtype, rngs=rngs)
    self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, dtype=dtype, rngs=rngs)
    self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, dtype=dtype, rngs=rngs)

  def qkv(self, x: jax.Array, positions: jax.Array):
    """``x [B, T, hidden]``, ``positions [B, T]`` -> q ``[B,T,Hq,D]``, k, v ``[B,T,Hkv,D]``."""
    c = self.config
    b, t, _ = x.shape
    inv_freq = _inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    q = self.q_proj(x).reshape(b, t, c.num_heads, c.head_dim)
    k = self.k_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

  def out(self, o: jax.Array) -> jax.Array:
    """``[B, T, Hq, D]`` -> ``[B, T, hidden]``."""
    b, t, _, _ = o.shape
    return self.o_proj(o.reshape(b, t, -1))


class MLP(nnx.Module):
  """SiLU-gated feed-forward."""

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    self.gate_proj = Linear(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)
    self.up_proj = Linear(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)
    self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  """Pre-norm attention + MLP block."""

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
    self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                            dtype=dtype)
    self.mlp = MLP(config, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, attend: Callable, cache=None):
    """One layer; ``attend(q, k, v, cache) -> (o, cache)`` does the attention."""
    q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions)
    o, cache = attend(q, k, v, cache)
    x = x + self.self_attn.out(o)
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, cache


class Llama(nnx.Module):
  """Llama causal LM (HF ``LlamaForCausalLM`` semantics).

  Attributes:
    config: the `LlamaConfig` (static).
    dtype: parameter and activation dtype.
    embed_tokens: ``[vocab, hidden]`` embedding.
    layers: `DecoderLayer` list.
    norm: final RMSNorm.
    lm_head: `Linear` ``[hidden, vocab]``, or None when embeddings are tied.
  """

  def __init__(self, config: LlamaConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.dtype = jnp.dtype(dtype)
    self.embed_tokens = nnx.Param(_normal(rngs, (c.vocab_size, c.hidden_size), 1.0, dtype))
    self.layers = _ModuleList(
        [DecoderLayer(c, dtype=dtype, rngs=rngs) for _ in range(c.num_layers)])
    self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
    self.lm_head = (None if c.tie_word_embeddings
                    else Linear(c.hidden_size, c.vocab_size, dtype=dtype, rngs=rngs))

  # --------------------------------------------------------------- helpers
  def _embed(self, tokens: jax.Array) -> jax.Array:  # [B, T] -> [B, T, hidden]
    return jnp.take(self.embed_tokens[...], tokens, axis=0)

  def _logits(self, h: jax.Array) -> jax.Array:  # [..., hidden] -> float32 [..., vocab]
    h = self.norm(h)
    w = self.embed_tokens[...].T if self.lm_head is None else self.lm_head.kernel[...]
    return jnp.dot(h, w, preferred_element_type=jnp.float32)

  def _check_caches(self, caches) -> None:
    if not isinstance(caches, tuple) or len(caches) != self.config.num_layers:
      raise ValueError(f"caches must be a tuple of {self.config.num_layers} KVCache "
                       f"(one per layer), got {type(caches).__name__} of "
                       f"length {len(caches) if hasattr(caches, '__len__') else '?'}")

  def init_cache(self, kv_format: KVFormat | str, batch: int, capacity: int, dtype=None,
                 **kwargs) -> Caches:
    """Empty caches, one `jaxkv.KVCache` per layer.

    Args:
      kv_format: a `jaxkv.KVFormat` or preset name.
      batch: sequences B.
      capacity: tokens per sequence (prompt + generated).
      dtype: full-precision K/V dtype (residual block, 16-bit sides);
        default: the model dtype.
      **kwargs: forwarded to `KVCache.init` (e.g. ``use_kernel``).
    """
    c = self.config
    dtype = self.dtype if dtype is None else dtype
    return tuple(jaxkv.KVCache.init(kv_format, batch, c.num_kv_heads, c.head_dim, capacity,
                                    dtype, **kwargs) for _ in range(c.num_layers))

  # --------------------------------------------------------------- forward
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
               attention_impl: str | None = None) -> jax.Array:
    """Full causal forward without a cache.

    Args:
      tokens: ``[B, T]`` int32.
      positions: ``[B, T]`` positions; default ``arange(T)``.
      attention_impl: see `causal_attention`.
    Returns:
      float32 logits ``[B, T, vocab]``.
    """
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def attend(q, k, v, cache):
      return causal_attention(q, k, v, implementation=attention_impl), cache

    x = self._embed(tokens)
    for layer in self.layers:
      x, _ = layer(x, positions, attend)
    return self._logits(x)

  def prefill(self, tokens: jax.Array, prompt_lengths: jax.Array, caches: Caches, *,
              attention_impl: str | None = None) -> tuple[jax.Array, Caches]:
    """Runs right-padded prompts and stores their K/V in empty caches.

    Args:
      tokens: ``[B, T]`` int32, row ``b`` = ``prompt_lengths[b]`` real tokens
        then padding (any ids).
      prompt_lengths: ``[B]`` int32 in ``[1, T]``.
      caches: empty caches from `init_cache`, capacity >= T.
      attention_impl: see `causal_attention`.
    Returns:
      ``(logits [B, vocab] float32 at each prompt's last real token, caches)``.
    """
    self._check_caches(caches)
    b, t = tokens.shape
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def attend(q, k, v, cache):
      o = causal_attention(q, k, v, implementation=attention_impl)
      cache = cache.prefill(k.astype(cache.dtype), v.astype(cache.dtype), prompt_lengths)
      return o, cache

    x = self._embed(tokens)
    new_caches = []
    for layer, cache in zip(self.layers, caches):
      x, cache = layer(x, positions, attend, cache)
      new_caches.append(cache)
    last = jnp.clip(prompt_lengths - 1, 0, t - 1)
    x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [B, hidden]
    return self._logits(x_last), tuple(new_caches)

  def decode(self, tokens: jax.Array, caches: Caches, *,
             implementation: str | None = None) -> tuple[jax.Array, Caches]:
    """Runs ``S`` new tokens per sequence against the caches.

    Args:
      tokens: ``[B, S]`` int32, placed at positions ``caches[0].lengths + [0, S)``.
      caches: per-layer caches (from `prefill` or earlier `decode` calls).
      implementation: `jaxkv.decode_attention` implementation (None = Pallas
        on GPU, reference elsewhere).
    Returns:
      ``(logits [B, S, vocab] float32, caches)`` with every cache grown by S.
    """
    self._check_caches(caches)
    b, s = tokens.shape
    positions = caches[0].lengths[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]

    def attend(q, k, v, cache):
      cache = cache.append(k.astype(cache.dtype), v.astype(cache.dtype))
      return jaxkv.decode_attention(q, cache, implementation=implementation), cache

    x = self._embed(tokens)
    new_caches = []
    for layer, cache in zip(self.layers, caches):
      x, cache = layer(x, positions, attend, cache)
      new_caches.append(cache)
    return self._logits(x), tuple(new_caches)


# ---------------------------------------------------------------- factories
def random_model(config: LlamaConfig | str, *, seed: int = 0, dtype=jnp.bfloat16) -> Llama:
  """A Llama with random weights (normal, std 1/sqrt(fan_in); unit norms).

  Args:
    config: a `LlamaConfig` or a name in `CONFIGS`.
    seed: PRNG seed.
    dtype: parameter dtype.
  """
  if isinstance(config, str):
    config = LlamaConfig.named(config)
  return Llama(config, dtype=dtype, rngs=nnx.Rngs(params=seed))


def from_pretrained(path, dtype=None) -> Llama:
  """Loads a HF Llama checkpoint directory; see `models.checkpoint.load_llama`."""
  if str(path).endswith(".gguf"):
    from models.gguf import load_gguf  # pylint: disable=import-outside-toplevel
    return load_gguf(path, dtype=dtype)
  from models.checkpoint import load_llama  # pylint: disable=import-outside-toplevel
  return load_llama(path, dtype=dtype)


def param_count(model: Llama) -> int:
  """Number of parameters."""
  return sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


__all__ = [
    "CONFIGS", "Llama", "LlamaConfig", "RopeScaling", "apply_rope", "causal_attention",
    "from_pretrained", "param_count", "random_model",
]
