"""Autoregressive decoding on a quantized KV cache: jitted loops.

`generate` splits an NNX model (``nnx.split``) and runs a single jitted pure
function of ``(graphdef, state, prompts, cache, ...)``: prefill of the
right-padded prompts, then a `lax.while_loop` that decodes one token per
sequence per iteration until every sequence has hit a stop token or
``max_new_tokens`` are out. The loop carry is a named `DecodeState`. The
model-level cache (`jaxkv.ModelCache`) is created empty, passed in and
donated, so the loop updates it in place. Static settings (sampler,
``top_k``, loop length, attention implementation) form one hashable
`GenerateSettings`; repeated calls with the same shapes and settings reuse the
compiled program.

`decode_steps` is the same loop for users who drive decoding themselves: N
greedy or sampled steps from a cache they hold, one jitted program, cache
donated. `decode_step` is one step, pure, for the user's own `jit`.

The model contract (met by `models.llama.Llama`):
  ``model.init_cache(kv_format, batch, capacity, dtype) -> cache``,
  ``model.prefill(tokens [B,T], lengths [B], cache) -> (logits [B,V], cache)``,
  ``model.decode(tokens [B,S], cache, implementation=) -> (logits [B,S,V], cache)``,
  ``model.config.vocab_size``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import numbers
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import vq
from jaxkv.attention import check_implementation
from jaxkv.cache import check_int
from jaxkv.formats import KVFormat
from jaxkv.sharding import check_mesh

SAMPLERS = ("greedy", "sample", "temperature", "top_k", "top_p")


_INT32_MAX = 2**31 - 1


def _env_count(name: str, default: int, unit: str) -> int:
  """The whole number (of ``unit``) in environment variable ``name``
  (``default`` when unset or empty); a ValueError naming it unless
  ``0 <= value < 2**31`` (XLA keeps its thresholds as int32)."""
  text = os.environ.get(name, "").strip() or str(default)
  try:
    value = int(text)
  except ValueError:
    value = -1
  if not 0 <= value <= _INT32_MAX:
    raise ValueError(f"{name}={text!r} must be a whole number of {unit} in [0, {_INT32_MAX}]")
  return value


DOT_MERGER_MB = _env_count("JAXKV_XLA_DOT_MERGER_MB", 1024, "MiB")
"""XLA's dot merger threshold in the decode programs up to `DOT_MERGER_MAX_ROWS`
rows (`compiler_options`; past them the threshold is 0: nothing merged), MiB;
``JAXKV_XLA_DOT_MERGER_MB`` (read at import) sets it; 0 leaves XLA's own
default (32 MiB, which merges q, k and v) at every row count."""

DOT_MERGER_MAX_ROWS = _env_count("JAXKV_XLA_DOT_MERGER_MAX_ROWS", 64, "rows")
"""The most token rows per step and device (batch x query tokens) at which the
decode programs raise the dot merger threshold (`compiler_options`); past it
they merge no dots. ``JAXKV_XLA_DOT_MERGER_MAX_ROWS`` (read at import) sets it
(0: no merged dots at any row count)."""

REMAT = os.environ.get("JAXKV_XLA_REMAT", "") == "1"
"""Whether the decode programs keep XLA's rematerialization pass
(``JAXKV_XLA_REMAT=1``, read at import); see `compiler_options`."""


def _merges(rows: int) -> bool:
  """Whether a decode program at ``rows`` token rows per step raises the merger threshold."""
  check_int("rows", rows)
  return bool(DOT_MERGER_MB) and rows <= DOT_MERGER_MAX_ROWS


def _options(merge: bool) -> dict[str, Any]:
  return {
      **({} if REMAT else {"xla_disable_hlo_passes": "rematerialization"}),
      **({"xla_gpu_dot_merger_threshold_mb": DOT_MERGER_MB if merge else 0}
         if DOT_MERGER_MB else {}),
  }


def compiler_options(rows: int) -> dict[str, Any]:
  """XLA options for a decode program whose weight GEMMs see ``rows`` token
  rows per step on each device (batch x query tokens, the batch divided by a
  mesh's ``data`` axis): `generate`, `decode_steps`, the speculative programs
  and `jaxkv.fidelity`'s forced decode compile with them.

  - Rematerialization off: XLA's GPU rematerialization pass budgets ~80 % of
    device memory *minus the program's arguments*; a cache that fills the GPU
    (the largest batch) leaves it a budget at or below zero, so it re-runs
    weight GEMMs without freeing anything that matters (on an H100 at 32K,
    kivi4 B=49 and bf16 B=13 each re-ran two GEMMs per layer, ~2.6-2.9 ms of a
    30-43 ms step). A decode step's own temporaries are a few hundred MB, so
    the pass is off. ``JAXKV_XLA_REMAT=1`` (`REMAT`, read at import) keeps it.
  - Dot merger up to `DOT_MERGER_MB` MiB (``JAXKV_XLA_DOT_MERGER_MB``, 0: XLA's
    default of 32) when ``rows <= DOT_MERGER_MAX_ROWS`` (64): XLA then merges
    Llama's gate and up (112 MiB each at 8B) into one GEMM as it already does
    q, k and v. On an H200 the concatenated weight sits only inside the GEMM's
    fusion (read in place: no copy, same peak memory); the step gains
    ~0.5-1.5 % at one sequence and ~0.7 % at 27, is even (+0.3 %, noise) at
    100 and loses 3.8 % at 188; the merged GEMM alone is within noise of two
    up to 100 rows and 1.2-2.3x slower from 128 (`bench/dot_merger.py`,
    `bench/results/e2e-NOTES.md`, 2026-11-29). 64 is a cautious cut below
    that, not a measured crossover.
  - Past that, a threshold of 0: no dots merged at all, q, k and v included
    (XLA's default merges them). At 188 sequences the merged q/k/v product ran
    as a Triton GEMM over the weights concatenated inside its fusion (47 us
    per layer on an H200); apart, q goes to cuBLAS and k, v to split-K GEMMs
    (~34 us together). With the model's column-parallel projections writing
    bfloat16 straight from those GEMMs past 64 rows
    (`models.llama.linear(direct_out=True)`), the kivi2 step at 188 sequences is 1.6 %
    faster (4 layers, same process) and kivi4's at 100 even (-0.5 %, noise);
    `bench/results/e2e-NOTES.md`, 2026-11-30. ``JAXKV_XLA_DOT_MERGER_MB=0``
    leaves XLA's default (q, k, v merged) in both variants.

  `generate`, the speculative programs and the forced decode also run the
  prompt's prefill (batch x prompt rows) in the same program, with the
  options of their decode rows: the merger's effect on that prefill is not
  yet measured.

  These per-program options take precedence over the same keys in
  ``XLA_FLAGS``: change them with the ``JAXKV_*`` variables. Pass the same
  options to your own ``jax.jit`` of `decode_step`.
  """
  return _options(_merges(rows))


def program_rows(batch: int, mesh=None, tokens_per_sequence: int = 1) -> int:
  """Token rows per step and device of a decode program over ``batch``
  sequences: the batch split over ``mesh``'s ``data`` axis (rounded up) times
  the query tokens each sequence feeds per step."""
  data = 1 if mesh is None else int(dict(mesh.shape).get("data", 1))
  return -(-batch // data) * tokens_per_sequence


@dataclasses.dataclass(frozen=True)
class RowsProgram:
  """One function jitted twice, with and without the dot merger of
  `compiler_options`; ``at(rows)`` is the program for ``rows`` token rows per
  step and device (each compiles on its first call)."""
  merged: Callable
  plain: Callable

  def at(self, rows: int) -> Callable:
    return self.merged if _merges(rows) else self.plain

  def compiled(self) -> int:
    """Compiled executables of both variants."""
    return self.merged._cache_size() + self.plain._cache_size()  # pylint: disable=protected-access


def jit_by_rows(**jit_kwargs) -> Callable[[Callable], RowsProgram]:
  """Decorator: ``fun`` as a `RowsProgram` (``jit_kwargs`` go to both ``jax.jit``)."""
  def wrap(fun: Callable) -> RowsProgram:
    return RowsProgram(merged=jax.jit(fun, compiler_options=_options(True), **jit_kwargs),
                       plain=jax.jit(fun, compiler_options=_options(False), **jit_kwargs))
  return wrap


_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32


def _is_int(x) -> bool:
  """A Python or numpy int that is not a bool."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_temperature(temperature, *, name: str = "temperature") -> np.float32:
  """A sampling temperature as the float32 the programs divide by.

  TypeError unless a real number (a Python or numpy scalar or a concrete 0-d
  array; not a bool); ValueError unless its float32 value is finite and at
  least the smallest normal float32 (``1e-50`` is 0 in float32, ``inf`` is
  not a temperature: use ``sampler="greedy"`` for the limit T -> 0).
  """
  if isinstance(temperature, (np.ndarray, jax.Array)) and not isinstance(
      temperature, jax.core.Tracer) and temperature.ndim == 0 and (
          jnp.issubdtype(temperature.dtype, jnp.floating)
          or jnp.issubdtype(temperature.dtype, jnp.integer)):
    temperature = temperature.item()
  if isinstance(temperature, (bool, np.bool_)) or not isinstance(temperature, numbers.Real):
    raise TypeError(f"{name}={temperature!r} must be a real number (got "
                    f"{type(temperature).__name__})")
  try:
    value = float(temperature)
  except OverflowError:  # an int beyond float64
    value = float("inf")
  with np.errstate(over="ignore"):
    value32 = np.float32(value)
  if not (np.isfinite(value32) and value32 >= _F32_TINY):
    raise ValueError(f"{name}={temperature!r} must be a finite float32 >= {_F32_TINY:.4g} "
                     "(the smallest normal float32); for T -> 0 use the greedy sampler")
  return value32


def _scaled_logits(logits: jax.Array, temperature) -> jax.Array:
  """``(logits - max(logits)) / temperature`` in float32, over the last axis.

  The top logit stays 0 and the others only go to -inf, so a tiny temperature
  gives the near-greedy choice instead of ``logits / T`` overflowing to +-inf
  (NaN in the softmax, garbage tokens).
  """
  logits = logits.astype(jnp.float32)
  return (logits - jnp.max(logits, axis=-1, keepdims=True)) / jnp.asarray(temperature,
                                                                            jnp.float32)


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
  Raises:
    ValueError / TypeError: a concrete ``temperature`` that is not a positive
      normal float32, a concrete ``top_p`` outside ``(0, 1]``, a ``top_k``
      outside ``[1, V]``. (Traced values are not checked.)
  """
  if not isinstance(temperature, jax.core.Tracer):
    _check_temperature(temperature)
  if top_p is not None and not isinstance(top_p, jax.core.Tracer):
    if isinstance(top_p, (bool, np.bool_)) or not 0 < float(np.asarray(top_p)) <= 1:
      raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
  logits = _scaled_logits(logits, temperature)
  vocab = logits.shape[-1]
  if top_k is not None:
    if not _is_int(top_k) or not 1 <= top_k <= vocab:
      raise ValueError(f"top_k={top_k!r} must be an int in [1, {vocab}]")
    top_k = int(top_k)
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
    mesh: a `jaxkv.make_mesh` mesh: the model's appends and attention run per
      shard and the cache keeps its `jaxkv.sharding.cache_specs` placement.
    prefill_chunk: prompt tokens per prefill chunk (``model.prefill``'s
      ``chunk_size``); None = the whole prompt at once.
  """

  max_new_tokens: int
  sampler: Any = "greedy"
  top_k: int | None = None
  use_top_p: bool = False
  implementation: str | None = None
  progress: Callable[[Any], None] | None = None
  mesh: Any = None
  prefill_chunk: int | None = None

  def sample(self, logits, rng, temperature, top_p):
    if self.sampler == "greedy":
      return greedy(logits)
    if callable(self.sampler):
      return self.sampler(logits, rng).astype(jnp.int32)
    return sample_logits(logits, rng, temperature=temperature, top_k=self.top_k,
                         top_p=top_p if self.use_top_p else None)


# --------------------------------------------------------------- split once
class SplitModel:
  """A model split once (``nnx.split``), for code that calls `decode_steps` or `generate` often.

  Both entry points take an NNX model and split it on every call: a graph
  traversal that costs ~15-25 ms of host time for Llama-3.1-8B's 291
  parameters (measured: 1.1 ms per step of a 16-step `decode_steps` loop on
  an H200). Passing ``SplitModel(model)`` instead skips it. It holds a
  *snapshot* of the parameters taken at construction: change the model's
  weights afterwards and build a new one (`refresh`).

  Attributes:
    model: the NNX model (its methods that do not read weights, e.g.
      ``init_cache``, and its ``config`` are used from here).
    graphdef, state: ``nnx.split(model)`` at construction.
  """

  def __init__(self, model):
    if isinstance(model, SplitModel):
      model = model.model
    self.model = model
    self.graphdef, state = nnx.split(model)
    # New Variable objects around the same arrays: flax's split state shares
    # the model's Variables, so in-place updates (``nnx.update``) would leak in.
    self.state = jax.tree_util.tree_map(lambda x: x, state)

  @property
  def config(self):
    return self.model.config

  def init_cache(self, *args, **kwargs):
    return self.model.init_cache(*args, **kwargs)

  def refresh(self) -> "SplitModel":
    """A new snapshot of the (possibly changed) model's weights."""
    return SplitModel(self.model)

  def __repr__(self):
    return f"SplitModel({type(self.model).__name__}, {len(jax.tree_util.tree_leaves(self.state))} arrays)"


def _split(model):
  """``(graphdef, state)`` of an NNX model or a `SplitModel` (no traversal)."""
  if isinstance(model, SplitModel):
    return model.graphdef, model.state
  return nnx.split(model)


# --------------------------------------------------------------- decode step
def decode_step(model, tokens: jax.Array, cache, *, implementation: str | None = None,
                mesh=None, active: jax.Array | None = None):
  """One decode step: feeds one token per sequence, returns next-token logits.

  Pure and traceable: put it in your own `jax.jit` / `lax.scan`, e.g.::

    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnames="cache",
                       compiler_options=jaxkv.decode_compiler_options(batch))
    def step(state, tokens, cache):
      return jaxkv.decode_step(nnx.merge(graphdef, state), tokens, cache)

  Args:
    model: a model meeting the contract in this module's docstring.
    tokens: ``[B]`` int32, the latest token of each sequence.
    cache: the model's cache (the K/V of ``tokens`` are appended here).
    implementation: `jaxkv.decode_attention` implementation.
    mesh: a `jaxkv.make_mesh` mesh to run attention per shard on (the cache
      sharded with `jaxkv.shard_cache`); None: no mesh.
    active: optional ``[B]`` bool, the sequences whose token is appended (the
      others, e.g. finished ones fed padding, keep their cache as it is and
      get meaningless logits); None: all. Passed to ``model.decode`` only
      when given, so models without it keep working.
  Returns:
    ``(logits [B, V] float32, cache)``.
  """
  if getattr(tokens, "ndim", None) != 1:  # static: checked under jit too
    raise ValueError(f"tokens.shape={getattr(tokens, 'shape', None)} must be [B] (one token "
                     f"per sequence)")
  kw = {} if active is None else dict(active=active)
  if mesh is None:  # models without mesh support keep working
    logits, cache = model.decode(tokens[:, None], cache, implementation=implementation, **kw)
  else:
    logits, cache = model.decode(tokens[:, None], cache, implementation=implementation,
                                 mesh=mesh, **kw)
    cache = _constrain(cache, mesh)
  return logits[:, 0], cache


def _constrain(cache, mesh):
  from jaxkv.sharding import constrain_cache  # pylint: disable=import-outside-toplevel
  return constrain_cache(cache, mesh)


def _is_stop(tokens, stop_tokens):
  """``tokens [B]``, ``stop_tokens [B, K]`` (-1 = unused) -> ``[B]`` bool."""
  if stop_tokens.shape[1] == 0:
    return jnp.zeros(tokens.shape, bool)
  return jnp.any(tokens[:, None] == stop_tokens, axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """Carry of the decode loop.

  Attributes:
    step: int32 scalar, next column of ``out`` to write.
    cache: the model's cache (updated in place).
    out: ``[B, N]`` int32 tokens produced so far (padding after).
    token: ``[B]`` int32, the latest token (fed to the next step).
    rng: PRNG key.
    done: ``[B]`` bool, the sequence has emitted a stop token.
    num_generated: ``[B]`` int32 tokens counted up to and including the stop.
  """

  step: jax.Array
  cache: Any
  out: jax.Array
  token: jax.Array
  rng: jax.Array
  done: jax.Array
  num_generated: jax.Array


def _decode_loop(model, state: DecodeState, stop_tokens, temperature, top_p, pad_token_id,
                 num_steps, settings: GenerateSettings) -> DecodeState:
  """Decodes while ``state.step < min(num_steps, N)`` and some sequence is not done."""
  n = state.out.shape[1]

  def cond(s: DecodeState):
    return (s.step < jnp.minimum(num_steps, n)) & ~jnp.all(s.done)

  def body(s: DecodeState) -> DecodeState:
    # A finished sequence is fed its stop token, then padding: none of it is
    # appended, so a returned cache holds only the tokens before the stop.
    logits, cache = decode_step(model, s.token, s.cache, implementation=settings.implementation,
                                mesh=settings.mesh, active=~s.done)
    rng, key = jax.random.split(s.rng)
    token = settings.sample(logits, key, temperature, top_p)
    token = jnp.where(s.done, pad_token_id, token)
    out = jax.lax.dynamic_update_slice(s.out, token[:, None], (0, s.step))
    if settings.progress is not None:
      jax.debug.callback(settings.progress, s.step)
    return DecodeState(step=s.step + 1, cache=cache, out=out, token=token, rng=rng,
                       done=s.done | _is_stop(token, stop_tokens),
                       num_generated=s.num_generated + (~s.done).astype(jnp.int32))

  return jax.lax.while_loop(cond, body, state)


@jit_by_rows(static_argnames=("settings",), donate_argnames=("cache",))
def _generate_program(graphdef, state, prompt_tokens, prompt_lengths, cache, rng, stop_tokens,
                      temperature, top_p, pad_token_id, num_steps, *,
                      settings: GenerateSettings):
  """Prefill + while-loop decode. Returns ``(tokens [B, N], lengths [B], cache)``."""
  model = nnx.merge(graphdef, state)
  batch = prompt_tokens.shape[0]
  chunk = prefill_kwargs(settings.prefill_chunk)
  if settings.mesh is None:
    logits, cache = model.prefill(prompt_tokens, prompt_lengths, cache, **chunk)
  else:
    cache = _constrain(cache, settings.mesh)
    logits, cache = model.prefill(prompt_tokens, prompt_lengths, cache, mesh=settings.mesh,
                                  **chunk)
    cache = _constrain(cache, settings.mesh)
  rng, key = jax.random.split(rng)
  token = settings.sample(logits, key, temperature, top_p)
  out = jnp.full((batch, settings.max_new_tokens), pad_token_id, jnp.int32).at[:, 0].set(token)
  if settings.progress is not None:
    jax.debug.callback(settings.progress, 0)
  loop = DecodeState(step=jnp.int32(1), cache=cache, out=out, token=token, rng=rng,
                     done=_is_stop(token, stop_tokens),
                     num_generated=jnp.ones((batch,), jnp.int32))
  loop = _decode_loop(model, loop, stop_tokens, temperature, top_p, pad_token_id, num_steps,
                      settings)
  return loop.out, loop.num_generated, _constrain(loop.cache, settings.mesh)


@jit_by_rows(static_argnames=("settings",), donate_argnames=("cache",))
def _decode_steps_program(graphdef, state, tokens, cache, rng, stop_tokens, temperature, top_p,
                          pad_token_id, *, settings: GenerateSettings):
  """``settings.max_new_tokens`` decode steps from ``tokens [B]``: ``(out [B, N], lengths, cache)``."""
  model = nnx.merge(graphdef, state)
  batch = tokens.shape[0]
  n = settings.max_new_tokens
  loop = DecodeState(step=jnp.int32(0), cache=cache,
                     out=jnp.full((batch, n), pad_token_id, jnp.int32), token=tokens, rng=rng,
                     done=jnp.zeros((batch,), bool), num_generated=jnp.zeros((batch,), jnp.int32))
  loop = _decode_loop(model, loop, stop_tokens, temperature, top_p, pad_token_id, jnp.int32(n),
                      settings)
  return loop.out, loop.num_generated, _constrain(loop.cache, settings.mesh)


def _settings(model, max_new_tokens, sampler, temperature, top_k, top_p, implementation,
              progress, mesh=None, *, steps_name: str = "max_new_tokens") -> GenerateSettings:
  """Validates the sampling arguments shared by `generate` and `decode_steps`.

  ``steps_name``: the caller's name of the loop length (``num_steps`` for
  `decode_steps`), used in its error message.
  """
  check_mesh(mesh, optional=True)
  if not _is_int(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"{steps_name}={max_new_tokens!r} must be an int >= 1")
  if top_k is not None and not _is_int(top_k):  # 2.5 ran as 2 and True as 1
    raise ValueError(f"top_k={top_k!r} must be an int or None")
  if sampler in ("temperature", "top_k", "top_p"):
    if sampler == "top_k" and top_k is None:
      raise ValueError("sampler='top_k' needs top_k")
    if sampler == "top_p" and top_p is None:
      raise ValueError("sampler='top_p' needs top_p")
    sampler = "sample"
  if not (sampler in ("greedy", "sample") or callable(sampler)):
    raise ValueError(f"sampler={sampler!r} must be one of {SAMPLERS} or a callable")
  if sampler != "sample":  # greedy or a callable: they would be silently ignored
    unused = [f"{name}={value!r}" for name, value, default in (
        ("temperature", temperature, 1.0), ("top_k", top_k, None), ("top_p", top_p, None))
        if not (value is default or (default is not None and _equals(value, default)))]
    if unused:
      which = "greedy decoding" if sampler == "greedy" else "a callable sampler"
      raise ValueError(f"{', '.join(unused)} would be ignored by {which}: pass "
                       f"sampler='sample' (or 'top_k' / 'top_p') to sample with them")
  if sampler == "sample":
    _check_temperature(temperature)
    if top_p is not None and not 0 < top_p <= 1:
      raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
    if top_k is not None and not 1 <= top_k <= model.config.vocab_size:
      raise ValueError(f"top_k={top_k!r} must be in [1, {model.config.vocab_size}]")
  if progress is not None and not callable(progress):  # jax.debug.callback named no argument
    raise TypeError(f"progress={progress!r} must be a callable or None")
  if implementation is not None and not isinstance(implementation, str):
    implementation = check_implementation(implementation)  # a list: hashable static setting
  return GenerateSettings(
      max_new_tokens=int(max_new_tokens), sampler=sampler,
      top_k=None if sampler != "sample" or top_k is None else int(top_k),
      use_top_p=sampler == "sample" and top_p is not None,
      implementation=implementation, progress=progress, mesh=mesh)


def _equals(value, default: float) -> bool:
  """Whether a concrete real ``value`` equals ``default`` (False for anything else)."""
  try:
    return not isinstance(value, (bool, np.bool_, jax.core.Tracer)) and float(value) == default
  except (TypeError, ValueError):
    return False


def _check_ids(name: str, tokens, vocab_size: int) -> None:
  """ValueError naming ``name`` for concrete ids outside ``[0, vocab_size)``
  (TypeError for a non-integer dtype).

  A concrete jax array is always read, even while the computation producing
  it still runs (the previous loop's last token fed back): skipping arrays
  that are not ready yet let bad ids through unchecked depending on timing
  (on a GPU a fresh ``jnp.asarray`` is often not ready). The capacity check
  (`ModelCache.check_room`) reads ``lengths`` and waits for that loop anyway.
  """
  if isinstance(tokens, jax.core.Tracer):
    return
  arr = np.asarray(tokens)
  if arr.size and not np.issubdtype(arr.dtype, np.integer):  # a type error, as the model's
    raise TypeError(f"{name}.dtype={arr.dtype} must be an integer dtype")
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    bad = arr[(arr < 0) | (arr >= vocab_size)]
    raise ValueError(f"{name} must lie in [0, {vocab_size}); got out-of-range ids "
                     f"{bad.ravel()[:8].tolist()}")


def decode_steps(model, tokens, cache, num_steps: int, *, sampler: str | Callable = "greedy",
                 temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, stop_tokens=None, rng: jax.Array | None = None,
                 implementation: str | None = None, pad_token_id: int = 0, mesh=None):
  """Runs ``num_steps`` decode steps in one jitted loop; the cache is donated.

  For users who hold a cache (e.g. after `model.prefill`) and drive decoding
  themselves: step ``i`` feeds the latest token of each sequence and samples
  the next. Compiled once per (shapes, ``num_steps``, sampler settings).

  Args:
    model: a model meeting this module's contract (`models.llama.Llama`), or
      a `SplitModel` of one (no per-call ``nnx.split``: use it when calling
      this in a loop).
    tokens: ``[B]`` int, the latest token of each sequence (not yet in the cache).
    cache: the model's cache; consumed (donated), use the returned one.
    num_steps: steps to run (static, >= 1).
    sampler, temperature, top_k, top_p, stop_tokens, rng, pad_token_id: as in
      `generate`.
    implementation: `jaxkv.decode_attention` implementation.
    mesh: a `jaxkv.make_mesh` mesh: pass the model placed with
      `models.sharding.shard_model` and the cache with `jaxkv.shard_cache`;
      appends and attention then run per shard (no gather of the cache).
  Returns:
    ``(tokens [B, num_steps] int32, lengths [B] int32, cache)``: the next
    tokens (``pad_token_id`` after a sequence's stop token), tokens counted up
    to and including the stop token, the cache grown by ``lengths[b]`` tokens
    (the fed tokens: ``tokens`` and the next ones before the stop token;
    neither the stop token nor the padding after it is appended).
  """
  tokens = jnp.asarray(tokens) if isinstance(tokens, (list, tuple)) else tokens
  if getattr(tokens, "ndim", None) != 1:
    raise ValueError(f"tokens.shape={getattr(tokens, 'shape', None)} must be [B]")
  _check_ids("tokens", tokens, model.config.vocab_size)
  tokens = jnp.asarray(tokens, jnp.int32)
  if not isinstance(getattr(cache, "batch", None), int):  # before: AttributeError on .batch
    raise TypeError(f"cache must be the model's cache (model.init_cache), got "
                    f"{type(cache).__name__}")
  if tokens.shape[0] != cache.batch:
    raise ValueError(f"tokens.shape={tokens.shape} must be [{cache.batch}] (the cache batch)")
  settings = _settings(model, num_steps, sampler, temperature, top_k, top_p, implementation,
                       None, mesh, steps_name="num_steps")
  if hasattr(cache, "check_room"):  # every step appends one token per sequence
    cache.check_room(num_steps, "num_steps")
  graphdef, state = _split(model)
  rng = _check_rng(rng)
  stops = _stop_array(stop_tokens, tokens.shape[0])
  program = _decode_steps_program.at(program_rows(tokens.shape[0], mesh))
  return program(graphdef, state, tokens, cache, rng, stops,
                 _program_temperature(settings, temperature),
                 np.float32(1.0 if top_p is None else top_p), _pad_id(pad_token_id),
                 settings=settings)


def _pad_id(pad_token_id) -> np.int32:
  """``pad_token_id`` as an int32 scalar; ValueError naming it unless an int in int32 range."""
  if (isinstance(pad_token_id, (bool, np.bool_)) or not isinstance(pad_token_id, (int, np.integer))
      or not -2**31 <= int(pad_token_id) < 2**31):
    raise ValueError(f"pad_token_id={pad_token_id!r} must be an int in int32 range")
  return np.int32(pad_token_id)


def _check_rng(rng) -> jax.Array:
  """The PRNG key the program takes (``jax.random.key(0)`` for None). TypeError naming
  ``rng`` unless it is one key: a typed key scalar (``jax.random.key``) or a raw
  uint32 key (``jax.random.PRNGKey``); JAX's own error named no argument."""
  if rng is None:
    return jax.random.key(0)
  dtype, shape = getattr(rng, "dtype", None), tuple(getattr(rng, "shape", (None,)))
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    one = shape == ()
  else:
    one = dtype == np.uint32 and len(shape) == 1
  if not one:
    raise TypeError(f"rng must be one PRNG key (jax.random.key(seed)), got {type(rng).__name__} "
                    f"of shape {getattr(rng, 'shape', None)}, dtype {dtype}")
  return rng


def _program_temperature(settings: GenerateSettings, temperature) -> np.float32:
  """The temperature the program gets: validated when sampling, else unused (1)."""
  return _check_temperature(temperature) if settings.sampler == "sample" else np.float32(1.0)


def _is_int_id(x) -> bool:
  """An int (not a bool) or a 0-d integer array (numpy or jax)."""
  return _is_int(x) or (hasattr(x, "ndim") and hasattr(x, "dtype") and x.ndim == 0
                        and np.issubdtype(np.asarray(x).dtype, np.integer))


def _stop_ids(value, what: str) -> list[int]:
  """An int, a sequence of ints or a 0-/1-D integer array -> ints; errors name ``what``."""
  if _is_int(value):
    return [int(value)]
  if hasattr(value, "ndim") and hasattr(value, "dtype"):  # numpy / jax array or scalar
    arr = np.asarray(value)
    if not np.issubdtype(arr.dtype, np.integer):  # a float array was truncated
      raise TypeError(f"{what}.dtype={arr.dtype} must be an integer dtype")
    if arr.ndim > 1:
      raise ValueError(f"{what}.shape={arr.shape} must be () or [K]")
    return arr.reshape(-1).tolist()
  if isinstance(value, (list, tuple)):
    bad = [t for t in value if not _is_int_id(t)]
    if bad:
      raise TypeError(f"{what}={value!r} must hold ints, got {bad[0]!r}")
    return [int(t) for t in value]
  raise TypeError(f"{what}={value!r} must be an int, a sequence of ints or an integer array")


def _stop_array(stop_tokens, batch: int) -> np.ndarray:
  """`generate`'s ``stop_tokens`` -> ``[B, K]`` int32, -1 padded.

  Shared by every sequence: an int, a sequence of ints, or a 0-/1-D integer
  array (numpy or jax). Per sequence: a sequence of B entries (each None, an
  int, ints or a 1-D integer array), or a ``[B, K]`` integer array (-1 =
  unused). TypeError for non-integers (a float array would be truncated),
  ValueError for a wrong row count or ids outside int32; all name
  ``stop_tokens``.
  """
  if stop_tokens is None:
    return np.zeros((batch, 0), np.int32)
  if hasattr(stop_tokens, "ndim") and np.ndim(stop_tokens) == 2:
    arr = np.asarray(stop_tokens)
    if not np.issubdtype(arr.dtype, np.integer):
      raise TypeError(f"stop_tokens.dtype={arr.dtype} must be an integer dtype")
    if arr.shape[0] != batch:
      raise ValueError(f"stop_tokens.shape={arr.shape} must be [{batch}, K]")
    rows = arr.tolist()
  elif (_is_int(stop_tokens) or hasattr(stop_tokens, "ndim")
        or (isinstance(stop_tokens, (list, tuple)) and all(_is_int_id(t) for t in stop_tokens))):
    rows = [_stop_ids(stop_tokens, "stop_tokens")] * batch  # shared
  elif isinstance(stop_tokens, collections.abc.Sequence) and not isinstance(stop_tokens,
                                                                           (str, bytes)):
    rows = [[] if s is None else _stop_ids(s, f"stop_tokens[{i}]")
            for i, s in enumerate(stop_tokens)]
    if len(rows) != batch:
      raise ValueError(f"per-sequence stop_tokens need {batch} entries, got {len(rows)}")
  else:
    raise TypeError(f"stop_tokens={stop_tokens!r} must be None, an int, a sequence of ints, "
                    "per-sequence sequences or an integer array")
  bad = [t for r in rows for t in r if not -2**31 <= t < 2**31]
  if bad:
    raise ValueError(f"stop_tokens must be int32 token ids; got {sorted(set(bad))[:8]}")
  k = max((len(r) for r in rows), default=0)
  if k == 0:
    return np.zeros((batch, 0), np.int32)
  return np.asarray([r + [-1] * (k - len(r)) for r in rows], np.int32)


def generate(model, prompt_tokens, prompt_lengths, *, kv_format: KVFormat | str = "bf16",
             max_new_tokens: int, sampler: str | Callable = "greedy", temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, stop_tokens=None,
             rng: jax.Array | None = None, capacity: int | None = None,
             implementation: str | None = None, cache_dtype=None, pad_token_id: int = 0,
             return_cache: bool = False, progress: Callable[[Any], None] | None = None,
             num_steps: int | None = None, mesh=None, codebooks=None,
             prefill_chunk: int | None = None):
  """Generates ``max_new_tokens`` tokens per prompt with a (quantized) KV cache.

  Args:
    model: an NNX model meeting this module's contract (`models.llama.Llama`),
      or a `SplitModel` of one.
    prompt_tokens: ``[B, T]`` int, right-padded: row ``b`` holds
      ``prompt_lengths[b]`` real tokens first.
    prompt_lengths: ``[B]`` int in ``[1, T]``.
    kv_format: `KVFormat` or preset name for every layer's cache, or a
      `jaxkv.VQFormat` / VQ preset name (``"cq4"``, ``"cq2"``) with ``codebooks``.
    max_new_tokens: tokens to generate per sequence (>= 1).
    sampler: ``"greedy"``; ``"sample"`` (temperature, then optional top-k and
      top-p); ``"temperature"``, ``"top_k"``, ``"top_p"`` as aliases of
      ``"sample"``; or a callable ``(logits [B, V], rng) -> [B] int32`` (it
      is a static setting: pass the same object to reuse the compiled program).
    temperature: softmax temperature for sampling: a real number whose
      float32 value is finite and normal (>= ~1.18e-38; TypeError /
      ValueError otherwise). Unused by the other samplers.
    top_k: keep the k most likely tokens (static int).
    top_p: nucleus mass in ``(0, 1]``.
    stop_tokens: None; an int, a list of ints or a 0-/1-D integer array
      shared by all sequences; or a list of B lists / a ``[B, K]`` integer
      array (-1 = unused) per sequence. A sequence stops after emitting one
      (it is included in the output). Ids must fit int32.
    rng: PRNG key for sampling (default ``jax.random.key(0)``).
    capacity: cache tokens per sequence; default ``T + max_new_tokens``.
    implementation: `jaxkv.decode_attention` implementation.
    cache_dtype: full-precision K/V dtype of the cache; default the model's.
    pad_token_id: written after a sequence's stop token.
    return_cache: also return the final cache (`jaxkv.ModelCache`): the prompt
      and the generated tokens fed back, ``prompt_lengths + lengths - 1`` per
      sequence (the last token, a stop token included, is not fed; the
      padding after a stop is never appended).
    progress: host callback ``progress(step)`` once per generated token.
    num_steps: generate only the first ``num_steps`` tokens (the rest of the
      output is padding). Passed as data, so it reuses the program compiled
      for ``max_new_tokens``: benchmarks time ``num_steps=1`` (prefill and
      first token) against the full run.
    mesh: a `jaxkv.make_mesh` mesh: the cache is created sharded
      (`jaxkv.shard_cache`) and every layer's append and attention run per
      shard. Place the model first with `models.sharding.shard_model` (else
      XLA replicates its weights). Greedy tokens match one device.
    codebooks: a VQ format's `jaxkv.VQCodebooks` (required there; passed to
      ``model.init_cache``).
    prefill_chunk: prefill the prompt in chunks of this many tokens
      (``model.prefill(..., chunk_size=)``: each chunk attends to the stored
      history and causally within itself), which bounds the prefill's
      attention memory for long prompts; None = the whole prompt at once.
      The result equals one chunk up to float rounding.
  Returns:
    ``(tokens [B, max_new_tokens] int32, lengths [B] int32)`` where
    ``lengths[b]`` counts generated tokens up to and including the stop
    token; with ``return_cache`` a third element, the cache.
  Raises:
    ValueError: bad shapes, ``prompt_lengths`` outside ``[1, T]`` (numpy or
      concrete jax arrays), real prompt token ids outside ``[0, vocab)``.
  """
  if isinstance(prompt_tokens, (list, tuple)):
    prompt_tokens = np.asarray(prompt_tokens)
  if getattr(prompt_tokens, "ndim", None) != 2:
    raise ValueError(f"prompt_tokens.shape={getattr(prompt_tokens, 'shape', None)} must be [B, T]")
  batch, prompt_len = prompt_tokens.shape
  if batch < 1:
    raise ValueError(f"prompt_tokens.shape={prompt_tokens.shape}: need at least one sequence")
  if isinstance(prompt_lengths, (list, tuple)):
    prompt_lengths = np.asarray(prompt_lengths)
  if not isinstance(prompt_lengths, jax.core.Tracer):  # numpy or concrete jax array
    lengths_np = np.asarray(prompt_lengths)
    if lengths_np.shape != (batch,):
      raise ValueError(f"prompt_lengths.shape={lengths_np.shape} must be ({batch},)")
    if not np.issubdtype(lengths_np.dtype, np.integer):
      raise ValueError(f"prompt_lengths.dtype={lengths_np.dtype} must be an integer dtype")
    if lengths_np.min() < 1 or lengths_np.max() > prompt_len:
      raise ValueError(f"prompt_lengths={lengths_np.tolist()} must lie in [1, T={prompt_len}]")
    # Only the real tokens of each row must be valid ids; padding may be anything.
    real = np.arange(prompt_len)[None, :] < lengths_np[:, None]
    if not isinstance(prompt_tokens, jax.core.Tracer):
      _check_ids("prompt_tokens", np.asarray(prompt_tokens)[real], model.config.vocab_size)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
  if prompt_lengths.shape != (batch,):
    raise ValueError(f"prompt_lengths.shape={prompt_lengths.shape} must be ({batch},)")
  settings = dataclasses.replace(
      _settings(model, max_new_tokens, sampler, temperature, top_k, top_p, implementation,
                progress, mesh),
      prefill_chunk=check_prefill_chunk(prefill_chunk))
  if num_steps is not None and (isinstance(num_steps, bool)
                                or not isinstance(num_steps, (int, np.integer))
                                or not 1 <= num_steps <= max_new_tokens):
    raise ValueError(f"num_steps={num_steps!r} must be an int in [1, max_new_tokens="
                     f"{max_new_tokens}] or None")
  kv_format = as_format(kv_format)
  # VQ formats need codebooks; only then is the keyword passed (other models' init_cache).
  extra = {} if codebooks is None else {"codebooks": codebooks}
  needed = prompt_len + max_new_tokens - 1  # the last token is never appended
  capacity = prompt_len + max_new_tokens if capacity is None else capacity
  if capacity < needed:
    raise ValueError(f"capacity={capacity} < prompt length {prompt_len} + "
                     f"max_new_tokens {max_new_tokens} - 1")

  rng = _check_rng(rng)
  stops = jnp.asarray(_stop_array(stop_tokens, batch))
  if mesh is None:
    cache = model.init_cache(kv_format, batch, capacity, dtype=cache_dtype, **extra)
  else:  # each device allocates only its shard
    from jaxkv.sharding import init_sharded  # pylint: disable=import-outside-toplevel
    cache = init_sharded(
        lambda: model.init_cache(kv_format, batch, capacity, dtype=cache_dtype, **extra), mesh)
  graphdef, state = _split(model)
  tokens, lengths, cache = _generate_program.at(program_rows(batch, mesh))(
      graphdef, state, prompt_tokens, prompt_lengths, cache, rng, stops,
      _program_temperature(settings, temperature),
      np.float32(1.0 if top_p is None else top_p),
      _pad_id(pad_token_id), np.int32(max_new_tokens if num_steps is None else num_steps),
      settings=settings)
  if return_cache:
    return tokens, lengths, cache
  return tokens, lengths


def check_prefill_chunk(prefill_chunk) -> int | None:
  """``prefill_chunk`` as an int >= 1, or None; ValueError naming it otherwise."""
  if prefill_chunk is None:
    return None
  check_int("prefill_chunk", prefill_chunk)
  return int(prefill_chunk)


def prefill_kwargs(prefill_chunk: int | None) -> dict:
  """``model.prefill``'s keyword for a chunked prefill (none for one chunk, so a
  model meeting only the module's contract keeps working)."""
  return {} if prefill_chunk is None else {"chunk_size": prefill_chunk}


def as_format(kv_format):
  """A `KVFormat` or `jaxkv.VQFormat` from itself or a preset name (`PRESETS`, `VQ_PRESETS`)."""
  if isinstance(kv_format, str):
    if kv_format in vq.VQ_PRESETS:
      return vq.VQ_PRESETS[kv_format]
    try:
      return KVFormat.preset(kv_format)
    except ValueError as e:  # name the VQ presets too
      raise ValueError(f"{e} (or a VQ preset: {sorted(vq.VQ_PRESETS)})") from None
  return kv_format


def cache_nbytes(model, kv_format: KVFormat | vq.VQFormat | str, batch: int, capacity: int,
                 dtype=None) -> int:
  """Device bytes of the cache `generate` would allocate (no allocation).

  A VQ format counts its codes, residual rows and every layer's codebooks
  (shapes from the format and ``model.config``: ``num_layers``,
  ``num_kv_heads``, ``head_dim``; no codebooks needed).
  """
  kv_format = as_format(kv_format)

  def init():
    if not isinstance(kv_format, vq.VQFormat):
      return model.init_cache(kv_format, batch, capacity, dtype=dtype)
    c = model.config
    books = {side: jnp.ones((c.num_layers, *kv_format.codebook_shape(side, c.num_kv_heads,
                                                                     c.head_dim)),
                            kv_format.codebook_dtype) for side in ("k", "v")}
    return model.init_cache(kv_format, batch, capacity, dtype=dtype,
                            codebooks=vq.VQCodebooks(fmt=kv_format, **books))

  cache = jax.eval_shape(init)
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))


__all__ = ["DecodeState", "GenerateSettings", "SplitModel", "as_format", "cache_nbytes", "decode_step", "decode_steps",
           "generate", "greedy", "sample_logits"]
