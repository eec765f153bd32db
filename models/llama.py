"""Llama 2 / 3 / 3.1 in Flax NNX, decoding on a quantized `jaxkv.ModelCache`.

The model mirrors HF transformers' ``LlamaForCausalLM`` (rotate-half RoPE,
RMSNorm computed in float32 then cast back, SiLU-gated MLP, GQA or MHA, tied
or untied embeddings, ``head_dim`` taken from the config) so HF checkpoints
load without permuting weights (`from_pretrained`).

Three entry points:

* ``model(tokens)``: full causal forward, ``[B, T]`` -> float32 logits
  ``[B, T, vocab]``; no cache. The reference for everything else
  (``model.forward_kv(tokens)`` also returns every layer's K/V).
* ``model.prefill(tokens, prompt_lengths, cache, chunk_size=None)``: appends
  right-padded prompts (row ``b`` holds ``prompt_lengths[b]`` real tokens
  first) to a `jaxkv.ModelCache` that may already hold tokens (multi-turn),
  optionally in chunks; each chunk attends to the stored history plus
  causally within itself. Returns the logits of each prompt's last real token.
* ``model.decode(tokens, cache)``: ``S >= 1`` new tokens per sequence at
  positions ``cache.lengths + [0, S)``: appends their K/V to each layer, then
  `jaxkv.decode_attention` over the (quantized) cache.

The cache is one `jaxkv.ModelCache`: every layer's storage stacked on a
leading layer axis, ``lengths`` once. Vector-quantized formats take a
`jaxkv.VQModelCache` (``init_cache("cq2", B, capacity, codebooks=books)``),
the same interface over codes plus each layer's codebooks. It travels as data: methods return a new
cache, never mutate the module. The layers' parameters are separate arrays per
layer (``model.layers[i]``), run unrolled (see `Llama`).

Weights are stored as ``[in, out]`` kernels (HF stores ``[out, in]``) and the
embedding as ``[vocab, hidden]``; activations run in the weights' dtype with
float32 accumulation, RoPE angles and softmax in float32, logits in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxkv
import jaxkv.sharding  # noqa: F401  (per-shard attention on a mesh)
from jaxkv.formats import KVFormat

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
    "llama-3.1-70b": LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
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


class RopeTable(NamedTuple):
  """RoPE's ``cos`` and ``sin``, each ``[B, T, 1, D]`` float32 (`rope_table`)."""
  cos: jax.Array
  sin: jax.Array


def rope_table(positions: jax.Array, inv_freq: np.ndarray) -> RopeTable:
  """`RopeTable` of ``positions [B, T]`` (int), computed once for every layer.

  The cos / sin sit behind an optimization barrier: without it XLA fuses them
  into each layer's RoPE fusion, where sin and cos of large angles (128K
  positions) cost ~1.8 us per layer and side on an H200
  (`bench/results/e2e-NOTES.md`, 2026-11-28 twelfth session).
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, D]
  return RopeTable(*jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles))))


def _config_rope(config: LlamaConfig, positions: jax.Array) -> RopeTable:
  """`rope_table` with ``config``'s frequencies (theta, scaling, head_dim)."""
  return rope_table(positions, _inv_freq(config.head_dim, config.rope_theta,
                                         config.rope_scaling))


def apply_rope(x: jax.Array, positions, inv_freq: np.ndarray | None = None) -> jax.Array:
  """Rotate-half RoPE (HF convention).

  Args:
    x: ``[B, T, H, D]``.
    positions: ``[B, T]`` int positions, or their `RopeTable`.
    inv_freq: ``[D // 2]`` float32 (not needed with a `RopeTable`).
  Returns:
    ``[B, T, H, D]`` in ``x``'s dtype; angles and products in float32.
  """
  if isinstance(positions, RopeTable):
    table = positions
  elif inv_freq is None:
    raise ValueError("apply_rope: inv_freq is needed with integer positions (or pass a "
                     "RopeTable from rope_table)")
  else:
    table = rope_table(positions, inv_freq)
  xf = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
  return (xf * table.cos + rotated * table.sin).astype(x.dtype)


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
  check_causal_implementation(implementation)
  if implementation is None:
    implementation = "xla"
    if jax.default_backend() == "gpu" and _cudnn_compiles(
        jnp.dtype(q.dtype).name, q.shape[2], k.shape[2], q.shape[3]):
      try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
      except Exception:  # pylint: disable=broad-except  # shape cuDNN rejects
        pass
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def check_causal_implementation(value, name: str = "implementation") -> None:
  """ValueError naming ``name`` unless ``value`` is a `causal_attention` implementation
  (jax's own error, "Unsupported implementation option", named no argument)."""
  if value is not None and value not in ("xla", "cudnn"):
    raise ValueError(f"{name}={value!r} must be None, 'xla' or 'cudnn'")


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


def _normal_param(rngs: nnx.Rngs, shape, std: float, dtype) -> nnx.Param:
  """A parameter drawn from N(0, std^2); ``init_std`` is kept as its metadata.

  (`random_model(mesh=)` redraws each parameter on its shards from that.)
  """
  value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, init_std=std)


class Linear(nnx.Module):
  """Bias-free projection with an ``[in, out]`` kernel."""

  def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
    self.kernel = _normal_param(rngs, (in_features, out_features), in_features ** -0.5, dtype)

  def __call__(self, x: jax.Array, out_dtype=None, *,
               direct_out: bool = False) -> jax.Array:  # [..., in] -> [..., out]
    return linear(x, self.kernel[...], out_dtype, direct_out=direct_out)


DIRECT_OUT_ROWS = 64
"""Past this many rows ``linear(..., direct_out=True)`` lets the dot write its
output dtype itself."""


def linear(x: jax.Array, w: jax.Array, out_dtype=None, *, direct_out: bool = False) -> jax.Array:
  """``x [..., in] @ w [in, out]`` accumulated in float32 and rounded once to
  ``out_dtype`` (default ``x.dtype``; another dtype: a plain dot, e.g.
  float32 logits).

  A single row is padded to two. On an H100 (jax 0.11.2) 32 layers' MLP
  weights read by one-row dots took 2.98 ms (separate arrays) and 13.0 ms
  (static slices of stacked arrays), two-row dots 2.63-2.66 ms; the floor is
  2.51 ms (`bench/results/e2e-NOTES.md`).

  ``direct_out`` (for products whose summed dimension is never split over
  devices: Megatron's column-parallel q, k, v, gate and up, `models.sharding`)
  asks the dot for ``x.dtype`` itself past `DIRECT_OUT_ROWS` rows. The sum is
  still float32 and rounded once, but the cuBLAS GEMMs XLA picks at those
  sizes then write bfloat16 themselves instead of float32 plus a convert kernel
  (gate and up: two ~4.2 us kernels per layer at 188 rows on an H200); split-K
  GEMMs keep float32 partials either way. On that GPU the outputs were bit-equal
  to float32-then-cast at 65, 188 and 4096 rows for every Llama-3.1-8B weight
  shape (`bench/results/e2e-NOTES.md`, 2026-11-30); XLA:CPU sums in another
  order for the two forms (3-5 in 10,000 outputs one bfloat16 ulp apart;
  `bench/linear_out_probe.py`).
  A row-parallel product (o, down) under a ``"model"`` mesh axis would round each
  device's partial sum to bfloat16 before the all-reduce, so they never ask.
  """
  if out_dtype is not None and jnp.dtype(out_dtype) != jnp.dtype(x.dtype):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)
  lead = x.shape[:-1]
  rows = math.prod(lead)
  if rows == 1:
    x2 = jnp.pad(x.reshape(1, -1), ((0, 1), (0, 0)))
    y = jnp.dot(x2, w, preferred_element_type=jnp.float32)[:1]
    return y.reshape(*lead, w.shape[-1]).astype(x.dtype)
  if direct_out and rows > DIRECT_OUT_ROWS:
    return jnp.dot(x, w, preferred_element_type=x.dtype)
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm as HF computes it: normalize in float32, cast back, scale."""

  def __init__(self, dim: int, *, eps: float, dtype):
    self.weight = nnx.Param(jnp.ones((dim,), dtype), init_std=None)  # None: ones
    self.eps = eps

  def __call__(self, x: jax.Array) -> jax.Array:
    return rms_norm(x, self.weight[...], self.eps)


def rms_scale(x: jax.Array, eps: float) -> jax.Array:
  """``rsqrt(mean(x**2) + eps)`` over the last axis in float32: ``[..., 1]``."""
  xf = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """`RMSNorm`'s computation: ``weight * (x rms_scale(x))`` with the normalization
  in float32, cast back to x's dtype before the weight (HF's order)."""
  return weight * (x.astype(jnp.float32) * rms_scale(x, eps)).astype(x.dtype)


class Attention(nnx.Module):
  """Projections and RoPE of one attention layer; the attention itself is passed in.

  A draft model (`models.draft_weights.draft_model`) may add a ``qkv_proj``
  module (q, k and v as one 4-bit product), which `qkv` then runs instead of
  the three projections."""

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, dtype=dtype, rngs=rngs)
    self.k_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, dtype=dtype, rngs=rngs)
    self.v_proj = Linear(c.hidden_size, c.num_kv_heads * c.head_dim, dtype=dtype, rngs=rngs)
    self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, dtype=dtype, rngs=rngs)

  def qkv(self, x: jax.Array, positions):
    """``x [B, T, hidden]``, ``positions [B, T]`` (or their `RopeTable`) -> q
    ``[B,T,Hq,D]``, k, v ``[B,T,Hkv,D]``."""
    c = self.config
    b, t, _ = x.shape
    rope = positions if isinstance(positions, RopeTable) else _config_rope(c, positions)
    fused = getattr(self, "qkv_proj", None)  # a draft's fused q/k/v product
    if fused is not None:
      nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
      q, k, v = jnp.split(fused(x), [nq, nq + nk], axis=-1)   # [B, T, (Hq + 2 Hkv) D]
    else:
      q, k, v = (p(x, direct_out=True) for p in (self.q_proj, self.k_proj, self.v_proj))
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    return apply_rope(q, rope), apply_rope(k, rope), v

  def out(self, o: jax.Array) -> jax.Array:
    """``[B, T, Hq, D]`` -> ``[B, T, hidden]``."""
    b, t, _, _ = o.shape
    return self.o_proj(o.reshape(b, t, -1))


class MLP(nnx.Module):
  """SiLU-gated feed-forward.

  A draft model (`models.draft_weights.draft_model`) may add a ``gate_up_proj``
  module (gate and up as one 4-bit product), run instead of the two."""

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    self.gate_proj = Linear(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)
    self.up_proj = Linear(config.hidden_size, config.intermediate_size, dtype=dtype, rngs=rngs)
    self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    fused = getattr(self, "gate_up_proj", None)  # a draft's fused gate/up product
    if fused is not None:
      gate, up = jnp.split(fused(x), 2, axis=-1)               # [..., 2 * intermediate]
    else:
      gate, up = self.gate_proj(x, direct_out=True), self.up_proj(x, direct_out=True)
    return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
  """Pre-norm attention + MLP block."""

  def __init__(self, config: LlamaConfig, *, dtype, rngs: nnx.Rngs):
    self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
    self.self_attn = Attention(config, dtype=dtype, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                            dtype=dtype)
    self.mlp = MLP(config, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array, positions, attend: Callable, cache=None):
    """One layer at ``positions [B, T]`` (or their `RopeTable`, shared by all layers);
    ``attend(q, k, v, cache) -> (o, cache)`` does the attention."""
    q, k, v = self.self_attn.qkv(self.input_layernorm(x), positions)
    o, cache = attend(q, k, v, cache)
    x = x + self.self_attn.out(o)
    x = x + self.mlp(self.post_attention_layernorm(x))
    return x, cache


def _check_int_dtype(name: str, value) -> None:
  """TypeError naming ``name`` unless ``value`` (traced or not) has an integer dtype.

  The dtype is static, so a traced float array is refused too (a cast to
  int32 would silently truncate it).
  """
  dtype = getattr(value, "dtype", None)
  if dtype is None:
    dtype = np.asarray(value).dtype
  if int(np.prod(np.shape(value))) and (
      dtype == np.bool_ or not jnp.issubdtype(dtype, jnp.integer)):
    raise TypeError(f"{name}.dtype={dtype} must be an integer dtype")


def _check_int_array(name: str, value, shape, low: int, high: int) -> None:
  """ValueError naming ``name`` if a concrete integer array leaves ``[low, high]``;
  TypeError for a non-integer dtype (traced arrays too).

  Traced values are not checked here (callers flag them in the cache instead).
  """
  _check_int_dtype(name, value)
  if isinstance(value, jax.core.Tracer):
    return
  arr = np.asarray(value)
  if shape is not None and arr.shape != tuple(shape):
    raise ValueError(f"{name}.shape={arr.shape} must be {tuple(shape)}")
  if arr.size and (arr.min() < low or arr.max() > high):
    bad = arr[(arr < low) | (arr > high)]
    raise ValueError(f"{name} must lie in [{low}, {high}]; got out-of-range values "
                     f"{bad.ravel()[:8].tolist()}")


def check_token_ids(name: str, tokens, vocab_size: int, real=None) -> jax.Array:
  """``tokens`` as int32. ValueError naming ``name`` for a rank other than 2
  (traced too: the rank is static) and for concrete ids outside ``[0, vocab)``
  at the ``real`` positions (a concrete ``[B, T]`` bool mask, e.g. a prompt's
  real tokens before its padding; None: every position); TypeError for a
  non-integer dtype (traced too)."""
  if isinstance(tokens, (list, tuple)):
    tokens = np.asarray(tokens)
  _check_int_dtype(name, tokens)
  if getattr(tokens, "ndim", None) != 2:
    raise ValueError(f"{name}.shape={getattr(tokens, 'shape', None)} must be [B, T]")
  if not isinstance(tokens, jax.core.Tracer) and not isinstance(real, jax.core.Tracer):
    arr = np.asarray(tokens)
    _check_int_array(name, arr if real is None else arr[np.asarray(real, bool)], None, 0,
                     vocab_size - 1)
  return jnp.asarray(tokens, jnp.int32)


def _active_rows(active, tokens):
  """``active [B]`` bool (checked) broadcast over ``tokens [B, S]``'s positions:
  the mask `check_token_ids` reads (a tracer when ``active`` is traced)."""
  if not hasattr(active, "dtype"):
    active = np.asarray(active)
  shape, dtype = active.shape, active.dtype
  b = np.shape(tokens)[0] if np.ndim(tokens) else None
  if tuple(shape) != (b,) or dtype != np.bool_:
    raise ValueError(f"active (shape {tuple(shape)}, dtype {dtype}) must be a [{b}] bool array")
  if isinstance(active, jax.core.Tracer):
    return active
  return np.broadcast_to(np.asarray(active)[:, None], np.shape(tokens))


class Llama(nnx.Module):
  """Llama causal LM (HF ``LlamaForCausalLM`` semantics).

  Attributes:
    config: the `LlamaConfig` (static).
    dtype: parameter and activation dtype.
    embed_tokens: ``[vocab, hidden]`` embedding.
    layers: ``num_layers`` `DecoderLayer` modules, each with its own
      parameter arrays (``layers[i].self_attn.q_proj.kernel[...]`` is
      ``[hidden, Hq * D]``). Not stacked for a `jax.lax.scan`: on GPU XLA
      copies a layer's slice of stacked weights before every GEMM inside a
      loop (a full weight copy per decode step; `bench/results/e2e-NOTES.md`),
      so the layers run unrolled and compile time grows with depth.
    norm: final RMSNorm.
    lm_head: `Linear` ``[hidden, vocab]``, or None when embeddings are tied.
  """

  def __init__(self, config: LlamaConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(self.dtype, jnp.floating):  # int weights: a model of garbage
      raise TypeError(f"dtype={self.dtype} must be a floating dtype (float32, bfloat16, float16)")
    self.embed_tokens = _normal_param(rngs, (c.vocab_size, c.hidden_size), 1.0, dtype)

    self.layers = _ModuleList([DecoderLayer(c, dtype=dtype, rngs=rngs)
                               for _ in range(c.num_layers)])
    self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=dtype)
    self.lm_head = (None if c.tie_word_embeddings
                    else Linear(c.hidden_size, c.vocab_size, dtype=dtype, rngs=rngs))

  # --------------------------------------------------------------- helpers
  def layer_params(self, index: int) -> DecoderLayer:
    """Layer ``index`` (``self.layers[index]``; its parameters, not a copy)."""
    if not 0 <= index < self.config.num_layers:
      raise ValueError(f"index={index} must be in [0, {self.config.num_layers})")
    return self.layers[index]

  def quantize_weights(self, *, bits: int = 4, group_size: int = 128,
                       layout: str = "auto", fuse_qkv: bool = True, fuse_mlp: bool = True,
                       fit: str = "mse") -> dict:
    """Group-wise ``bits``-bit copies of every linear layer (`models.draft_weights`)."""
    from models.draft_weights import quantize_weights  # pylint: disable=import-outside-toplevel
    return quantize_weights(self, bits=bits, group_size=group_size, layout=layout,
                            fuse_qkv=fuse_qkv, fuse_mlp=fuse_mlp, fit=fit)

  def with_draft_weights(self, weights: dict, *, use_kernel: bool = True,
                         defer_norms: bool = True) -> "Llama":
    """This model with its linear layers reading ``weights`` (from `quantize_weights`);
    ``use_kernel=False`` keeps the 4-bit layers off the Pallas kernel (a mesh);
    ``defer_norms``: `models.draft_weights.draft_model`'s."""
    from models.draft_weights import draft_model  # pylint: disable=import-outside-toplevel
    return draft_model(self, weights, use_kernel=use_kernel, defer_norms=defer_norms)

  def rope(self, positions: jax.Array) -> RopeTable:
    """`RopeTable` of ``positions [B, T]`` for this model's RoPE (once per forward pass)."""
    return _config_rope(self.config, positions)

  def _run_layers(self, body: Callable, carry):
    """``carry = body(layer, index, carry)`` for every layer, in order (unrolled)."""
    for index, layer in enumerate(self.layers):
      carry = body(layer, index, carry)
    return carry

  def _embed(self, tokens: jax.Array, mesh=None) -> jax.Array:  # [B, T] -> [B, T, hidden]
    ids = jnp.clip(tokens, 0, self.config.vocab_size - 1)  # invalid ids are flagged, not read OOB
    if mesh is not None:  # vocabulary-split table: local lookups + one all-reduce
      from models.sharding import vocab_parallel_embed  # pylint: disable=import-outside-toplevel
      return vocab_parallel_embed(self.embed_tokens[...], ids, mesh)
    return jnp.take(self.embed_tokens[...], ids, axis=0)

  def _logits(self, h: jax.Array) -> jax.Array:  # [..., hidden] -> float32 [..., vocab]
    h = self.norm(h)
    if self.lm_head is None:  # tied: contract with the [vocab, hidden] embedding directly
      return jnp.einsum("...h,vh->...v", h, self.embed_tokens[...],
                        preferred_element_type=jnp.float32)
    return self.lm_head(h, out_dtype=jnp.float32)  # a `Linear` or a draft's `QuantizedLinear`

  def _check_cache(self, cache, batch: int | None = None, name: str = "tokens") -> None:
    if not isinstance(cache, jaxkv.ModelCache):
      raise TypeError(f"cache must be a jaxkv.ModelCache from init_cache, got "
                      f"{type(cache).__name__}")
    if batch is not None and batch != cache.batch:
      raise ValueError(f"{name} has batch {batch} but the cache holds {cache.batch} sequences")
    cache.check_model(self.config)

  def _invalid_ids(self, tokens, real=None) -> jax.Array:
    """``[B]`` bool: a (real) token id outside ``[0, vocab)``."""
    bad = (tokens < 0) | (tokens >= self.config.vocab_size)
    if real is not None:
      bad = bad & real
    return jnp.any(bad, axis=1)

  def init_cache(self, kv_format: KVFormat | jaxkv.VQFormat | str, batch: int, capacity: int,
                 dtype=None, *, codebooks: jaxkv.VQCodebooks | None = None,
                 **kwargs) -> "jaxkv.ModelCache":
    """An empty `jaxkv.ModelCache` (`jaxkv.VQModelCache` for a VQ format) for every layer.

    Args:
      kv_format: a `jaxkv.KVFormat` or preset name, or a `jaxkv.VQFormat` or
        VQ preset name (``"cq4"``, ``"cq2"``).
      batch: sequences B.
      capacity: tokens per sequence (prompt + generated).
      dtype: full-precision K/V dtype (residual block, 16-bit sides);
        default: the model dtype.
      codebooks: VQ formats only, and required there: every layer's
        `jaxkv.VQCodebooks` (``[num_layers, num_kv_heads, ...]``, learned with
        `jaxkv.vq.fit` on this model's K/V for ``kv_format``).
      **kwargs: forwarded to `jaxkv.ModelCache.init` (e.g. ``use_kernel``).
    Raises:
      ValueError: a VQ format without ``codebooks`` (or codebooks for another
        format, layer count, kv-head count or head_dim); ``codebooks`` with a
        non-VQ format.
    """
    c = self.config
    dtype = self.dtype if dtype is None else dtype
    if jaxkv.vq.is_vq_format(kv_format):
      return jaxkv.VQModelCache.init(kv_format, c.num_layers, batch, c.num_kv_heads, c.head_dim,
                                     capacity, dtype, codebooks=codebooks, **kwargs)
    if codebooks is not None:
      raise ValueError(f"codebooks= is only for VQ formats (jaxkv.VQFormat, "
                       f"{sorted(jaxkv.VQ_PRESETS)}), got kv_format={kv_format!r}")
    return jaxkv.ModelCache.init(kv_format, c.num_layers, batch, c.num_kv_heads, c.head_dim,
                                 capacity, dtype, **kwargs)

  # --------------------------------------------------------------- forward
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
               attention_impl: str | None = None) -> jax.Array:
    """Full causal forward without a cache.

    Args:
      tokens: ``[B, T]`` int32 in ``[0, vocab)``.
      positions: ``[B, T]`` integer positions (ValueError for another shape,
        TypeError for a float dtype); default ``arange(T)``.
      attention_impl: see `causal_attention`.
    Returns:
      float32 logits ``[B, T, vocab]``.
    """
    return self._forward(tokens, positions, attention_impl, keep_kv=False)[0]

  def forward_kv(self, tokens: jax.Array, positions: jax.Array | None = None, *,
                 attention_impl: str | None = None):
    """The full causal forward (``model(tokens)``) and the K/V every layer computes.

    The K/V are what `prefill` would append to a cache (keys after RoPE, in
    the model dtype): calibration data for VQ codebooks
    (`jaxkv.vq.calibration_kv`). Under `jit` the unused outputs cost nothing.

    Returns:
      ``(logits [B, T, vocab] float32, k, v)``, ``k``/``v``
      ``[num_layers, B, T, num_kv_heads, head_dim]``.
    """
    return self._forward(tokens, positions, attention_impl, keep_kv=True)

  def _forward(self, tokens, positions, attention_impl, *, keep_kv: bool):
    """`__call__` / `forward_kv` (``keep_kv=False``: no layer's K/V is kept, so an
    eager forward holds one layer's at a time)."""
    check_causal_implementation(attention_impl, "attention_impl")
    tokens = check_token_ids("tokens", tokens, self.config.vocab_size)
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    else:  # static checks: a [1, 1] array broadcast silently to every token before
      if isinstance(positions, (list, tuple)):
        positions = np.asarray(positions)
      _check_int_dtype("positions", positions)
      if tuple(getattr(positions, "shape", ())) != (b, t):
        raise ValueError(f"positions.shape={getattr(positions, 'shape', None)} must be the "
                         f"tokens' [B, T] = {(b, t)}")
      positions = jnp.asarray(positions, jnp.int32)
    rope = self.rope(positions)

    def body(layer, index, carry):
      x, ks, vs = carry

      def attend(q, k, v, cache):
        if keep_kv:
          ks.append(k)
          vs.append(v)
        return causal_attention(q, k, v, implementation=attention_impl), cache

      return layer(x, rope, attend)[0], ks, vs

    x, ks, vs = self._run_layers(body, (self._embed(tokens), [], []))
    logits = self._logits(x)
    return (logits, jnp.stack(ks), jnp.stack(vs)) if keep_kv else (logits,)

  def prefill(self, tokens: jax.Array, prompt_lengths: jax.Array, cache: "jaxkv.ModelCache",
              chunk_size: int | None = None, *, attention_impl: str | None = None,
              mesh=None) -> tuple[jax.Array, "jaxkv.ModelCache"]:
    """Appends right-padded prompts to a cache (empty or holding earlier turns).

    Row ``b`` continues sequence ``b`` at position ``cache.lengths[b]``; its
    ``prompt_lengths[b]`` real tokens attend to everything the cache holds
    (exactly as stored: `jaxkv.KVCache.dequantize` semantics) and causally to
    each other in full precision (`jaxkv.chunk_attention`), then their K/V
    are appended. Long prompts run in chunks of ``chunk_size`` tokens (one
    `jax.lax.scan` over chunks, so compile time does not grow with T); the
    result is the same as one chunk, up to float rounding, and the cache
    bitwise the same.

    Args:
      tokens: ``[B, T]`` int32, row ``b`` = ``prompt_lengths[b]`` real tokens
        in ``[0, vocab)`` then padding (any ids).
      prompt_lengths: ``[B]`` ints in ``[0, T]`` (0 leaves a sequence as is).
      cache: a `jaxkv.ModelCache` from `init_cache` (with room for the tokens).
      chunk_size: tokens per chunk; None = all T at once.
      attention_impl: `jaxkv.chunk_attention` implementation.
      mesh: a `jaxkv.make_mesh` mesh: each layer's append and attention run
        per shard (`jaxkv.sharding.per_shard_attend`); the cache should be
        placed with `jaxkv.shard_cache` and the weights with
        `models.sharding.shard_model`.
    Returns:
      ``(logits [B, vocab] float32 at each prompt's last real token (zeros for
      an empty prompt), cache)``. Under `jit`, out-of-range ids or lengths set
      ``cache.invalid`` for their sequences (lengths are clipped to [0, T]).
    """
    jaxkv.sharding.check_mesh(mesh, optional=True)
    if isinstance(tokens, (list, tuple)):
      tokens = np.asarray(tokens)
    if getattr(tokens, "ndim", None) != 2:
      raise ValueError(f"tokens.shape={getattr(tokens, 'shape', None)} must be [B, T]")
    b, t = tokens.shape
    if t < 1:
      raise ValueError(f"tokens.shape={tokens.shape}: prefill needs T >= 1 token columns")
    if isinstance(prompt_lengths, (list, tuple)):
      prompt_lengths = np.asarray(prompt_lengths)
    _check_int_array("prompt_lengths", prompt_lengths, (b,), 0, t)
    # Only the real tokens must be ids: the padding after them may be anything
    # (traced lengths: nothing checked here, the trace flags `cache.invalid`).
    real_np = (np.zeros((b, t), bool) if isinstance(prompt_lengths, jax.core.Tracer)
               else np.arange(t)[None, :] < np.asarray(prompt_lengths)[:, None])
    tokens = check_token_ids("tokens", tokens, self.config.vocab_size, real=real_np)
    self._check_cache(cache, b)
    lengths = jnp.asarray(prompt_lengths, jnp.int32)
    if lengths.shape != (b,):
      raise ValueError(f"prompt_lengths.shape={lengths.shape} must be ({b},)")
    if chunk_size is None:
      chunk_size = t
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) \
        or chunk_size < 1:
      raise ValueError(f"chunk_size={chunk_size!r} must be an int >= 1 or None")
    c = int(min(chunk_size, t))
    cache.check_room(prompt_lengths, "prompt_lengths")
    bad = (lengths < 0) | (lengths > t)
    lengths = jnp.clip(lengths, 0, t)
    real = jnp.arange(t)[None, :] < lengths[:, None]
    cache = cache.flag_invalid(bad | self._invalid_ids(tokens, real))
    # A prompt that does not fit is not appended at all (no chunk of it), and
    # its sequence is flagged: chunk by chunk, a later short chunk could fit
    # after a skipped one and splice the prompt.
    room = cache.lengths + lengths <= cache.capacity
    cache = cache.flag_overflow(~room)
    lengths = jnp.where(room, lengths, 0)

    n = -(-t // c)
    chunks = jnp.pad(tokens, ((0, 0), (0, n * c - t))).reshape(b, n, c).swapaxes(0, 1)
    x_last = jnp.zeros((b, self.config.hidden_size), self.dtype)

    def chunk_step(carry, xs):
      cache, x_last = carry
      chunk_tokens, j = xs                                         # [B, c], scalar
      n_real = jnp.clip(lengths - j * c, 0, c)                     # [B]
      positions = cache.lengths[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
      rope = self.rope(positions)  # once for all layers
      plan = cache.plan_append(n_real, max_new=c)

      def body(layer, index, carry):
        x, new_cache = carry

        def layer_attend(q, k, v, new_cache, index, plan, n_real):
          k, v = k.astype(new_cache.dtype), v.astype(new_cache.dtype)
          # Write first, then attend to the layer's history as it was before
          # the write (see `append_layer_with_history`): nothing is copied.
          written, history = new_cache.append_layer_with_history(index, k, v, plan)

          def general():
            return jaxkv.chunk_attention(q, history, k, v, n_real,
                                         implementation=attention_impl).astype(q.dtype)

          if attention_impl is not None:
            return general(), written

          def fresh():  # no history anywhere: plain causal attention (cuDNN on GPU)
            return causal_attention(q.astype(k.dtype), k, v).astype(q.dtype)

          # The first chunk of a prompt on an empty cache takes the flash path;
          # chunks with history merge it with the chunk (`jaxkv.chunk_attention`).
          o = jax.lax.cond(jnp.all(history.lengths == 0), fresh, general)
          return o, written

        if mesh is not None:
          layer_attend = jaxkv.sharding.per_shard_attend(layer_attend, mesh, new_cache, plan,
                                                         num_seq_args=1)

        def attend(q, k, v, _):
          return layer_attend(q, k, v, new_cache, index, plan, n_real)

        return layer(x, rope, attend)

      x, new_cache = self._run_layers(body, (self._embed(chunk_tokens, mesh), cache))
      last = lengths - 1 - j * c                                   # [B]
      here = (last >= 0) & (last < c)
      x_at = jnp.take_along_axis(x, jnp.clip(last, 0, c - 1)[:, None, None], axis=1)[:, 0]
      return (new_cache.commit(plan), jnp.where(here[:, None], x_at, x_last)), None

    if n == 1:  # one chunk: no loop around the layer scan
      (cache, x_last), _ = chunk_step((cache, x_last), (chunks[0], jnp.int32(0)))
    else:
      (cache, x_last), _ = jax.lax.scan(chunk_step, (cache, x_last),
                                        (chunks, jnp.arange(n, dtype=jnp.int32)))
    logits = self._logits(x_last)
    return jnp.where((lengths > 0)[:, None], logits, 0.0), cache

  def decode(self, tokens: jax.Array, cache: "jaxkv.ModelCache", *,
             implementation: str | None = None, mesh=None, active: jax.Array | None = None
             ) -> tuple[jax.Array, "jaxkv.ModelCache"]:
    """Runs ``S`` new tokens per sequence against the cache.

    Args:
      tokens: ``[B, S]`` int32 in ``[0, vocab)``, placed at positions
        ``cache.lengths + [0, S)``.
      cache: the `jaxkv.ModelCache` (from `prefill` or earlier `decode` calls).
      implementation: `jaxkv.decode_attention` implementation (None = Pallas
        on GPU, reference elsewhere).
      mesh: run each layer's append and attention per shard of this mesh
        (see `prefill`).
      active: optional ``[B]`` bool: the sequences whose tokens are appended.
        The others keep their cache unchanged and their ids unchecked (e.g.
        padding after a stop token); their logits are meaningless. None: all.
    Returns:
      ``(logits [B, S, vocab] float32, cache)`` with every (active) sequence
      grown by S (out-of-range ids under `jit` set ``cache.invalid``).
    """
    jaxkv.sharding.check_mesh(mesh, optional=True)
    tokens = check_token_ids("tokens", tokens, self.config.vocab_size,
                             real=None if active is None else _active_rows(active, tokens))
    b, s = tokens.shape
    if s < 1:
      raise ValueError(f"tokens.shape={tokens.shape}: decode needs at least one token per row")
    self._check_cache(cache, b)
    # Only active sequences grow: a full, finished one must not block the others.
    concrete = active is not None and not isinstance(active, jax.core.Tracer)
    cache.check_room(np.where(np.asarray(active), s, 0) if concrete else s, "tokens")
    on = jnp.ones((b,), bool) if active is None else jnp.asarray(active)
    cache = cache.flag_invalid(self._invalid_ids(tokens) & on)
    positions = cache.lengths[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]
    rope = self.rope(positions)  # once for all layers
    # once for all layers; an inactive sequence appends nothing
    plan = cache.plan_append(jnp.where(on, s, 0).astype(jnp.int32), max_new=s)
    # One token in all: the layers carry a twin row (the same hidden state) so
    # every weight GEMM has two rows without a pad kernel before it (`linear`
    # pads a single row to two: measured faster dots, but ~4 pad kernels per
    # layer). The attention sees the real row only; the twin is dropped
    # before the logits. Rows never mix, so the real row's values are unchanged.
    twin = b * s == 1 and mesh is None

    def layer_attend(q, k, v, cache, index, plan):
      if k.dtype != cache.dtype:  # appends take the cache dtype (no op when the model's is it)
        k, v = k.astype(cache.dtype), v.astype(cache.dtype)
      new_cache = cache.append_layer(index, k, v, plan)
      o = jaxkv.decode_attention(q, new_cache.layer_view(index, plan),
                                 implementation=implementation)
      return o, new_cache

    def body(layer, index, carry):
      x, cache = carry
      fn = layer_attend
      if mesh is not None:  # per device: its sequences and KV heads, no gather
        fn = jaxkv.sharding.per_shard_attend(layer_attend, mesh, cache, plan)

      def attend(q, k, v, _):
        if not twin:
          return fn(q, k, v, cache, index, plan)
        o, new_cache = fn(q[:1], k[:1], v[:1], cache, index, plan)
        return jnp.broadcast_to(o, (2, *o.shape[1:])), new_cache

      return layer(x, rope, attend)

    x = self._embed(tokens, mesh)                                   # [B, S, hidden]
    if twin:
      x = jnp.broadcast_to(x, (2, *x.shape[1:]))                    # [2, 1, hidden]
    x, cache = self._run_layers(body, (x, cache))
    return self._logits(x[:b]), cache.commit(plan)


# ---------------------------------------------------------------- factories
def random_model(config: LlamaConfig | str, *, seed: int = 0, dtype=jnp.bfloat16,
                 mesh=None) -> Llama:
  """A Llama with random weights (normal, std 1/sqrt(fan_in); unit norms).

  Args:
    config: a `LlamaConfig` or a name in `CONFIGS`.
    seed: PRNG seed.
    dtype: parameter dtype.
    mesh: a `jaxkv.make_mesh` mesh: every parameter is drawn straight onto its
      shards as `models.sharding` places it, one small jitted program per
      parameter shape (never the whole model on one device: a 70B model fits
      where no single GPU holds it). The draws are keyed by parameter path,
      so they do not depend on the mesh, but they differ from ``mesh=None``'s
      (same distributions); for one device's values on a mesh use
      ``models.sharding.shard_model(random_model(config), mesh)``.
  """
  jaxkv.sharding.check_mesh(mesh, optional=True)
  seed = jaxkv.cache.check_seed(seed)  # a Python int: nnx.Rngs refuses numpy ints
  if isinstance(config, str):
    config = LlamaConfig.named(config)
  build = lambda: Llama(config, dtype=dtype, rngs=nnx.Rngs(params=seed))  # noqa: E731
  if mesh is None:
    return build()
  # As `models.checkpoint` loads onto a mesh: an abstract model, each parameter
  # then set from a value created on its shards (here drawn with its init_std).
  from models.checkpoint import set_param  # pylint: disable=import-outside-toplevel
  from models.sharding import param_shardings_by_variable  # pylint: disable=import-outside-toplevel
  model = nnx.eval_shape(build)
  shardings = param_shardings_by_variable(model, mesh)
  base = jax.random.key(seed)

  @functools.lru_cache(maxsize=None)
  def drawer(shape, std, sharding):  # one compiled program per parameter kind
    if std is None:
      return jax.jit(lambda key: jnp.ones(shape, dtype), out_shardings=sharding)
    return jax.jit(lambda key: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype),
                   out_shardings=sharding)

  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Param):
      key = jax.random.fold_in(base, zlib.crc32("/".join(map(str, path)).encode()))
      set_param(node, drawer(tuple(node.shape), node.init_std, shardings[id(node)])(key))
  return model


def from_pretrained(path, dtype=None, *, mesh=None) -> Llama:
  """Loads a HF Llama checkpoint directory; see `models.checkpoint.load_llama`.

  With ``mesh`` the parameters are placed as `models.sharding` says: HF
  checkpoints tensor by tensor from host memory onto their shards; GGUF files
  are loaded first, then placed (`models.sharding.shard_model`).
  """
  jaxkv.sharding.check_mesh(mesh, optional=True)
  from models.gguf import is_gguf_file, load_gguf  # pylint: disable=import-outside-toplevel
  if is_gguf_file(path):
    model = load_gguf(path, dtype=dtype)
    if mesh is not None:
      from models.sharding import shard_model  # pylint: disable=import-outside-toplevel
      model = shard_model(model, mesh)
    return model
  from models.checkpoint import load_llama  # pylint: disable=import-outside-toplevel
  return load_llama(path, dtype=dtype, mesh=mesh)


def quantize_weights(model: Llama, *, bits: int = 4, group_size: int = 128,
                     layout: str = "auto", fuse_qkv: bool = True, fuse_mlp: bool = True,
                     fit: str = "mse") -> dict:
  """QuantSpec's draft weights: group-wise ``bits``-bit copies of every linear layer.

  The same as ``model.quantize_weights(...)``; see `models.draft_weights`.
  """
  return model.quantize_weights(bits=bits, group_size=group_size, layout=layout,
                                fuse_qkv=fuse_qkv, fuse_mlp=fuse_mlp, fit=fit)


def param_count(model: Llama) -> int:
  """Number of parameters."""
  return sum(x.size for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))


__all__ = [
    "CONFIGS", "Llama", "LlamaConfig", "RopeScaling", "RopeTable", "apply_rope", "causal_attention",
    "check_token_ids", "from_pretrained", "param_count", "quantize_weights", "random_model",
    "rms_norm", "rms_scale", "rope_table",
]
