"""Autoregressive generation on a quantized KV cache: one jitted program.

`generate` splits an NNX model (``nnx.split``) and runs a single jitted pure
function of ``(graphdef, state, prompts, caches, ...)``: prefill of the
right-padded prompts, then a `lax.while_loop` that decodes one token per
sequence per iteration until every sequence has hit a stop token or
``max_new_tokens`` are out. The per-layer caches are created empty, passed in
and donated, so the loop updates them in place. Static settings (sampler,
``top_k``, loop length, attention implementation) form one hashable
`GenerateSettings`; repeated calls with the same shapes and settings reuse the
compiled program.

The model contract (met by `models.llama.Llama`):
  ``model.init_cache(kv_format, batch, capacity, dtype) -> caches``,
  ``model.prefill(tokens [B,T], lengths [B], caches) -> (logits [B,V], caches)``,
  ``model.decode(tokens [B,S], caches, implementation=) -> (logits [B,S,V], caches)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.formats import KVFormat

SAMPLERS = ("greedy", "sample", "temperature", "top_k", "top_p")


# ------------------------------------------------------------------ samplers
def greedy(logits: jax.Array) -> jax.Array:
  """``[B, V]`` logits -> ``[B]`` int32 argmax tokens."""
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample_logits(logits: jax.Array, rng: jax.Array, *, temperature=1.0,
                  top_k: int | None = None, top_p=None) -> jax.Array:
  """Samples one token per row from ``softmax(logits / temperature)``.

  Optionally restricted to the ``top_k`` most likely tokens (static int) and
  then to the smallest prefix of the sorted distribution whose probability
  reaches ``top_p`` (nucleus sampling; the most likely token is always kept).

  Args:
    logits: ``[B, V]`` float.
    rng: a PRNG key.
    temperature: scalar > 0 (may be traced).
    top_k: None or an int in ``[1, V]``.
    top_p: None or a scalar in ``(0, 1]`` (may be traced).
  Returns:
    ``[B]`` int32 tokens.
  """
  logits = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
  vocab = logits.shape[-1]
  if top_k is not None:
    if not 1 <= top_k <= vocab:
      raise ValueError(f"top_k={top_k} must be in [1, {vocab}]")
    vals, idx = jax.lax.top_k(logits, top_k)  # sorted descending
  elif top_p is not None:
    idx = jnp.argsort(-logits, axis=-1)
    vals = jnp.take_along_axis(logits, idx, axis=-1)
  else:
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)
  if top_p is not None:
    probs = jax.nn.softmax(vals, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive cumsum
    keep = mass_before < jnp.asarray(top_p, jnp.float32)
    keep = keep.at[..., 0].set(True)
    vals = jnp.where(keep, vals, -jnp.inf)
  choice = jax.random.categorical(rng, vals, axis=-1)
  return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class GenerateSettings:
  """Static settings of the generation program (hashable; one jit cache entry each).

  Attributes:
    max_new_tokens: tokens generated per sequence (loop bound).
    sampler: ``"greedy"``, ``"sample"``, or a callable
      ``(logits [B, V] float32, rng) -> tokens [B] int32``.
    top_k: static top-k for ``"sample"`` (None = off).
    use_top_p: whether ``"sample"`` applies nucleus filtering.
    implementation: `jaxkv.decode_attention` implementation.
    progress: optional host callback ``progress(step)`` called once per
      generated token (through `jax.debug.callback`).
  """

  max_new_tokens: int
  sampler: Any = "greedy"
  top_k: int | None = None
  use_top_p: bool = False
  implementation: str | None = None
  progress: Callable[[Any], None] | None = None

  def sample(self, logits, rng, temperature, top_p):
    if self.sampler == "greedy":
      return greedy(logits)
    if callable(self.sampler):
      return self.sampler(logits, rng).astype(jnp.int32)
    return sample_logits(logits, rng, temperature=temperature, top_k=self.top_k,
                         top_p=top_p if self.use_top_p else None)


# --------------------------------------------------------------- decode step
def decode_step(model, tokens: jax.Array, caches, *, implementation: str | None = None):
  """One decode step: feeds one token per sequence, returns next-token logits.

  Pure and traceable: put it in your own `jax.jit` / `lax.scan`, e.g.::

    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnames="caches")
    def step(state, tokens, caches):
      return jaxkv.decode_step(nnx.merge(graphdef, state), tokens, caches)

  Args:
    model: a model meeting the contract in this module's docstring.
    tokens: ``[B]`` int32, the latest token of each sequence.
    caches: the model's per-layer caches (their K/V for ``tokens`` are
      appended here).
    implementation: `jaxkv.decode_attention` implementation.
  Returns:
    ``(logits [B, V] float32, caches)``.
  """
  logits, caches = model.decode(tokens[:, None], caches, implementation=implementation)
  return logits[:, 0], caches


def _is_stop(tokens, stop_tokens):
  """``tokens [B]``, ``stop_tokens [B, K]`` (-1 = unused) -> ``[B]`` bool."""
  if stop_tokens.shape[1] == 0:
    return jnp.zeros(tokens.shape, bool)
  return jnp.any(tokens[:, None] == stop_tokens, axis=-1)


@functools.partial(jax.jit, static_argnames=("settings",), donate_argnames=("caches",))
def _generate_program(graphdef, state, prompt_tokens, prompt_lengths, caches, rng, stop_tokens,
                      temperature, top_p, pad_token_id, num_steps, *,
                      settings: GenerateSettings):
  """Prefill + while-loop decode. Returns ``(tokens [B, N], lengths [B], caches)``."""
  model = nnx.merge(graphdef, state)
  batch = prompt_tokens.shape[0]
  n = settings.max_new_tokens
  logits, caches = model.prefill(prompt_tokens, prompt_lengths, caches)
  rng, key = jax.random.split(rng)
  token = settings.sample(logits, key, temperature, top_p)
  out = jnp.full((batch, n), pad_token_id, jnp.int32).at[:, 0].set(token)
  done = _is_stop(token, stop_tokens)
  num_generated = jnp.ones((batch,), jnp.int32)
  if settings.progress is not None:
    jax.debug.callback(settings.progress, 0)

  def cond(carry):
    step, _, _, _, _, done, _ = carry
    return (step < jnp.minimum(num_steps, n)) & ~jnp.all(done)

  def body(carry):
    step, caches, out, token, rng, done, num_generated = carry
    logits, caches = decode_step(model, token, caches, implementation=settings.implementation)
    rng, key = jax.random.split(rng)
    token = settings.sample(logits, key, temperature, top_p)
    token = jnp.where(done, pad_token_id, token)
    out = jax.lax.dynamic_update_slice(out, token[:, None], (0, step))
    num_generated = num_generated + (~done).astype(jnp.int32)
    done = done | _is_stop(token, stop_tokens)
    if settings.progress is not None:
      jax.debug.callback(settings.progress, step)
    return step + 1, caches, out, token, rng, done, num_generated

  carry = (jnp.int32(1), caches, out, token, rng, done, num_generated)
  _, caches, out, _, _, _, num_generated = jax.lax.while_loop(cond, body, carry)
  return out, num_generated, caches


def _stop_array(stop_tokens, batch: int) -> np.ndarray:
  """None | int | [ints] (shared) | [[ints] per sequence] -> ``[B, K]`` int32, -1 padded."""
  if stop_tokens is None:
    return np.zeros((batch, 0), np.int32)
  if isinstance(stop_tokens, (int, np.integer)):
    return np.full((batch, 1), int(stop_tokens), np.int32)
  if isinstance(stop_tokens, (jax.Array, np.ndarray)) and np.ndim(stop_tokens) == 2:
    arr = np.asarray(stop_tokens, np.int32)
    if arr.shape[0] != batch:
      raise ValueError(f"stop_tokens.shape={arr.shape} must be [{batch}, K]")
    return arr
  items = list(stop_tokens)
  if all(isinstance(t, (int, np.integer)) for t in items):
    return np.tile(np.asarray(items, np.int32).reshape(1, -1), (batch, 1))
  if len(items) != batch:
    raise ValueError(f"per-sequence stop_tokens need {batch} entries, got {len(items)}")
  rows = [[int(t) for t in ([s] if isinstance(s, (int, np.integer)) else (s or []))]
          for s in items]
  k = max(1, max(len(r) for r in rows))
  return np.asarray([r + [-1] * (k - len(r)) for r in rows], np.int32)


def generate(model, prompt_tokens, prompt_lengths, *, kv_format: KVFormat | str = "bf16",
             max_new_tokens: int, sampler: str | Callable = "greedy", temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, stop_tokens=None,
             rng: jax.Array | None = None, capacity: int | None = None,
             implementation: str | None = None, cache_dtype=None, pad_token_id: int = 0,
             return_cache: bool = False, progress: Callable[[Any], None] | None = None,
             num_steps: int | None = None):
  """Generates ``max_new_tokens`` tokens per prompt with a (quantized) KV cache.

  Args:
    model: an NNX model meeting this module's contract (`models.llama.Llama`).
    prompt_tokens: ``[B, T]`` int, right-padded: row ``b`` holds
      ``prompt_lengths[b]`` real tokens first.
    prompt_lengths: ``[B]`` int in ``[1, T]``.
    kv_format: `KVFormat` or preset name for every layer's cache.
    max_new_tokens: tokens to generate per sequence (>= 1).
    sampler: ``"greedy"``; ``"sample"`` (temperature, then optional top-k and
      top-p); ``"temperature"``, ``"top_k"``, ``"top_p"`` as aliases of
      ``"sample"``; or a callable ``(logits [B, V], rng) -> [B] int32`` (it
      is a static setting: pass the same object to reuse the compiled program).
    temperature: softmax temperature for sampling.
    top_k: keep the k most likely tokens (static).
    top_p: nucleus mass in ``(0, 1]``.
    stop_tokens: None; an int or list of ints shared by all sequences; or a
      list of B lists / a ``[B, K]`` array (-1 = unused) per sequence. A
      sequence stops after emitting one (it is included in the output).
    rng: PRNG key for sampling (default ``jax.random.key(0)``).
    capacity: cache tokens per sequence; default ``T + max_new_tokens``.
    implementation: `jaxkv.decode_attention` implementation.
    cache_dtype: full-precision K/V dtype of the cache; default the model's.
    pad_token_id: written after a sequence's stop token.
    return_cache: also return the final per-layer caches.
    progress: host callback ``progress(step)`` once per generated token.
    num_steps: generate only the first ``num_steps`` tokens (the rest of the
      output is padding). Passed as data, so it reuses the program compiled
      for ``max_new_tokens``: benchmarks time ``num_steps=1`` (prefill and
      first token) against the full run.
  Returns:
    ``(tokens [B, max_new_tokens] int32, lengths [B] int32)`` where
    ``lengths[b]`` counts generated tokens up to and including the stop
    token; with ``return_cache`` a third element, the caches.
  """
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  if prompt_tokens.ndim != 2:
    raise ValueError(f"prompt_tokens.shape={prompt_tokens.shape} must be [B, T]")
  batch, prompt_len = prompt_tokens.shape
  if isinstance(prompt_lengths, (list, tuple, np.ndarray)):
    lengths_np = np.asarray(prompt_lengths)
    if lengths_np.shape != (batch,):
      raise ValueError(f"prompt_lengths.shape={lengths_np.shape} must be ({batch},)")
    if lengths_np.min() < 1 or lengths_np.max() > prompt_len:
      raise ValueError(f"prompt_lengths={lengths_np.tolist()} must lie in [1, T={prompt_len}]")
  prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
  if prompt_lengths.shape != (batch,):
    raise ValueError(f"prompt_lengths.shape={prompt_lengths.shape} must be ({batch},)")
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
  if isinstance(kv_format, str):
    kv_format = KVFormat.preset(kv_format)
  needed = prompt_len + max_new_tokens - 1  # the last token is never appended
  capacity = prompt_len + max_new_tokens if capacity is None else capacity
  if capacity < needed:
    raise ValueError(f"capacity={capacity} < prompt length {prompt_len} + "
                     f"max_new_tokens {max_new_tokens} - 1")

  if sampler in ("temperature", "top_k", "top_p"):
    if sampler == "top_k" and top_k is None:
      raise ValueError("sampler='top_k' needs top_k")
    if sampler == "top_p" and top_p is None:
      raise ValueError("sampler='top_p' needs top_p")
    sampler = "sample"
  if not (sampler in ("greedy", "sample") or callable(sampler)):
    raise ValueError(f"sampler={sampler!r} must be one of {SAMPLERS} or a callable")
  if sampler == "sample":
    if not temperature > 0:
      raise ValueError(f"temperature={temperature!r} must be > 0")
    if top_p is not None and not 0 < top_p <= 1:
      raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
    if top_k is not None and not 1 <= top_k <= model.config.vocab_size:
      raise ValueError(f"top_k={top_k!r} must be in [1, {model.config.vocab_size}]")
  settings = GenerateSettings(
      max_new_tokens=int(max_new_tokens), sampler=sampler,
      top_k=None if sampler != "sample" or top_k is None else int(top_k),
      use_top_p=sampler == "sample" and top_p is not None,
      implementation=implementation, progress=progress)

  rng = jax.random.key(0) if rng is None else rng
  stops = jnp.asarray(_stop_array(stop_tokens, batch))
  caches = model.init_cache(kv_format, batch, capacity, dtype=cache_dtype)
  graphdef, state = nnx.split(model)
  tokens, lengths, caches = _generate_program(
      graphdef, state, prompt_tokens, prompt_lengths, caches, rng, stops,
      jnp.float32(temperature), jnp.float32(1.0 if top_p is None else top_p),
      jnp.int32(pad_token_id), jnp.int32(max_new_tokens if num_steps is None else num_steps),
      settings=settings)
  if return_cache:
    return tokens, lengths, caches
  return tokens, lengths


def cache_nbytes(model, kv_format: KVFormat | str, batch: int, capacity: int, dtype=None) -> int:
  """Device bytes of the per-layer caches `generate` would allocate (no allocation)."""
  caches = jax.eval_shape(lambda: model.init_cache(kv_format, batch, capacity, dtype=dtype))
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(caches))


__all__ = ["GenerateSettings", "cache_nbytes", "decode_step", "generate", "greedy",
           "sample_logits"]
