"""Self-speculative decoding on a hierarchical (QuantSpec) KV cache.

One cache serves two models: the *draft* (4-bit weights,
`models.draft_weights`, reading the cache's upper 4-bit plane, ``view=
"draft"``) proposes ``gamma`` tokens one at a time; the *target* (full
weights, both planes, ``view="target"``) scores all of them in one pass of
``gamma + 1`` tokens. Per sequence the longest agreeing prefix is accepted
plus one token of the target's (the correction, or a bonus token when every
draft was accepted), so each verification emits 1 to ``gamma + 1`` tokens.

Drafted and verified K/V are staged in full precision beside the cache
(`jaxkv.staged_cache`) and never quantized; after verification only the
accepted tokens' target K/V are appended to the cache (an ordinary flushing
append, per sequence its own count). So the cache always obeys the residual
rule and equals the cache of plain decoding with the same tokens.

Greedy: the output is the target's greedy output (plain `jaxkv.generate`
with the same format and full weights), token for token up to float
rounding of the block-wise forward. Sampling: speculative sampling (accept a
draft token ``x`` with probability ``min(1, p(x) / q(x))``, on rejection
sample from ``normalize(max(0, p - q))``), so each output token is
distributed as the target's temperature-``T`` distribution.

The whole loop (draft, verify, accept, commit) is one jitted program with a
`lax.while_loop`. `speculative_steps` runs the same rounds from a cache the
caller holds (e.g. after ``model.prefill``): exactly N of them in one jitted
`lax.fori_loop`, cache donated, the speculative analogue of
`jaxkv.decode_steps` (what `bench/speculative.py --timing` times). Attention
(`jaxkv.staged_cache.staged_attention`) reads the committed tokens with a
Pallas kernel on a GPU (each layer in place, the draft or target view; the
Mosaic kernel first on Hopper, whose combine kernel attends and merges the few
staged rows itself; else Triton's, whose log-sum-exp is merged with dense
attention over them); elsewhere it is the jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.decoding import (SplitModel, _check_ids, _check_rng, _check_temperature, _is_stop,
                             _pad_id, _scaled_logits, _split, _stop_array, check_prefill_chunk,
                             jit_by_rows, prefill_kwargs, program_rows)
from jaxkv.formats import KVFormat
from jaxkv.sharding import check_mesh
from jaxkv.cache import check_int
from jaxkv.model_cache import ModelCache
from jaxkv.staged_cache import staged_attention, write_staged

DEFAULT_GROUP_SIZE = 128  # draft weight groups (input rows) of 'int4' / 'int8'


@dataclasses.dataclass(frozen=True)
class SpecSettings:
  """Static settings of the speculative program (hashable)."""

  max_new_tokens: int
  gamma: int
  sampler: str  # "greedy" or "sample"
  mesh: Any = None  # a jaxkv.make_mesh mesh, or None
  prefill_chunk: int | None = None  # model.prefill's chunk_size (None: one chunk)


def block_forward(model, tokens, cache, stage_k, stage_v, staged, *, view: str, mesh=None):
  """Runs ``tokens [B, S]`` after the committed cache and ``staged`` staged tokens.

  Args:
    model: a `models.llama.Llama` (full or draft weights).
    tokens: ``[B, S]`` int32 at positions ``cache.lengths + staged + [0, S)``.
    cache: the committed `jaxkv.ModelCache` (not changed).
    stage_k, stage_v: per layer ``[B, P, Hkv, D]`` staged K/V (tuples).
    staged: ``[B]`` int32 staged tokens before this block.
    view: the cache view attention reads.
    mesh: the mesh the model and cache are sharded on: vocabulary-parallel
      embedding lookups and the staged attention per shard (`jax.shard_map`,
      each device's sequences and KV heads); None without one.
  Returns:
    ``(logits [B, S, V] float32, stage_k, stage_v)`` with the block's K/V
    written at staged rows ``[staged, staged + S)``.
  """
  s = tokens.shape[1]
  positions = (cache.lengths + staged)[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]
  rope = model.rope(positions)  # once for all layers
  x = model._embed(tokens, mesh)  # pylint: disable=protected-access
  new_k, new_v = [], []
  attention = functools.partial(staged_attention, view=view)
  for index, layer in enumerate(model.layers):
    layer_cache = cache.layer_view(index)  # the kernel reads the layer in place
    layer_attention = attention if mesh is None else _per_shard(attention, layer_cache, mesh)

    def attend(q, k, v, _, index=index, layer_cache=layer_cache, fn=layer_attention):
      sk = write_staged(stage_k[index], k, staged)
      sv = write_staged(stage_v[index], v, staged)
      o = fn(q, layer_cache, sk, sv, staged + s)
      return o.astype(q.dtype), (sk, sv)

    x, (sk, sv) = layer(x, rope, attend)
    new_k.append(sk)
    new_v.append(sv)
  return model._logits(x), tuple(new_k), tuple(new_v)  # pylint: disable=protected-access


def _per_shard(attention, layer_cache, mesh):
  """``attention(q, cache, k_stage, v_stage, staged)`` run per shard of ``mesh``: each
  device attends over its own sequences and KV heads (nothing of the cache gathered)."""
  from jaxkv import sharding  # pylint: disable=import-outside-toplevel
  act = sharding.heads_spec(layer_cache, mesh)
  seq = jax.sharding.PartitionSpec(act[0])
  return sharding.shard_map(attention, mesh,
                            (act, sharding.cache_specs(layer_cache, mesh), act, act, seq), act)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecState:
  """Carry of the speculative loop (per sequence ``[B]`` unless noted)."""

  cache: Any
  token: jax.Array          # last emitted token (its K/V not yet in the cache)
  out: jax.Array            # [B, N]
  num_generated: jax.Array
  done: jax.Array
  rng: jax.Array
  verifications: jax.Array  # verification passes the sequence took part in
  accepted: jax.Array       # draft tokens accepted


def _accept_greedy(drafts, logits_t):
  """``drafts [B, g]``, target logits ``[B, g+1, V]`` -> (accepted n [B], emitted [B, g+1])."""
  y = jnp.argmax(logits_t, axis=-1).astype(jnp.int32)                  # [B, g+1]
  n = jnp.sum(jnp.cumprod(drafts == y[:, :-1], axis=1), axis=1)
  return n.astype(jnp.int32), y


def _accept_sample(drafts, q_probs, logits_t, temperature, key):
  """Speculative sampling: ``q_probs [B, g, V]`` draft distributions of the drafts."""
  g = drafts.shape[1]
  p = jax.nn.softmax(_scaled_logits(logits_t, temperature), axis=-1)  # [B, g+1, V]
  k_u, k_r = jax.random.split(key)
  p_x = jnp.take_along_axis(p[:, :g], drafts[..., None], axis=-1)[..., 0]   # [B, g]
  q_x = jnp.take_along_axis(q_probs, drafts[..., None], axis=-1)[..., 0]
  u = jax.random.uniform(k_u, drafts.shape)
  ok = u * q_x < p_x                                    # u < min(1, p / q)
  n = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)        # [B]
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]          # [B, V]
  q_pad = jnp.concatenate([q_probs, jnp.zeros_like(q_probs[:, :1])], axis=1)
  q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]      # zeros when n == g
  resid = jnp.maximum(p_n - q_n, 0.0)
  mass = jnp.sum(resid, axis=-1, keepdims=True)
  resid = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), p_n)
  y_n = jax.random.categorical(k_r, jnp.log(resid), axis=-1).astype(jnp.int32)
  j = jnp.arange(g + 1)[None, :]
  d_pad = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
  emitted = jnp.where(j < n[:, None], d_pad, y_n[:, None])
  return n, emitted


def _spec_step(model, draft, s: SpecState, stop_tokens, temperature, pad_token_id,
               settings: SpecSettings) -> SpecState:
  """One round: draft gamma tokens, verify them, accept, commit."""
  g, n_max = settings.gamma, settings.max_new_tokens
  cache = s.cache
  b = s.token.shape[0]
  stage_shape = (b, g + 1, cache.kv_heads, cache.head_dim)
  empty = tuple(jnp.zeros(stage_shape, cache.dtype) for _ in range(cache.num_layers))
  rng, k_draft, k_accept = jax.random.split(s.rng, 3)
  vocab = model.config.vocab_size

  def draft_step(i, c):
    sk, sv, tok, drafts, q_probs = c
    logits, sk, sv = block_forward(draft, tok[:, None], cache, sk, sv,
                                   jnp.full((b,), i, jnp.int32), view="draft",
                                   mesh=settings.mesh)
    logits = logits[:, 0]
    if settings.sampler == "greedy":
      nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
      q = jax.nn.softmax(_scaled_logits(logits, temperature), axis=-1)
      nxt = jax.random.categorical(jax.random.fold_in(k_draft, i), jnp.log(q), axis=-1)
      nxt = nxt.astype(jnp.int32)
      q_probs = jax.lax.dynamic_update_index_in_dim(q_probs, q, i, 1)
    drafts = jax.lax.dynamic_update_index_in_dim(drafts, nxt, i, 1)
    return sk, sv, nxt, drafts, q_probs

  q_init = jnp.zeros((b, g, vocab if settings.sampler != "greedy" else 1), jnp.float32)
  _, _, _, drafts, q_probs = jax.lax.fori_loop(
      0, g, draft_step, (empty, empty, s.token, jnp.zeros((b, g), jnp.int32), q_init))

  block = jnp.concatenate([s.token[:, None], drafts], axis=1)             # [B, g+1]
  logits_t, sk, sv = block_forward(model, block, cache, empty, empty,
                                   jnp.zeros((b,), jnp.int32), view="target",
                                   mesh=settings.mesh)
  if settings.sampler == "greedy":
    n_acc, emitted = _accept_greedy(drafts, logits_t)
  else:
    n_acc, emitted = _accept_sample(drafts, q_probs, logits_t, temperature, k_accept)

  # Emit up to n_acc + 1 tokens, cut after a stop token and at max_new_tokens.
  j = jnp.arange(g + 1)[None, :]
  stop_at = jnp.where(_is_stop_block(emitted, stop_tokens), j, g + 1)
  first_stop = jnp.min(stop_at, axis=1)                                   # [B]
  count = jnp.minimum(n_acc + 1, first_stop + 1)
  count = jnp.minimum(count, n_max - s.num_generated)
  count = jnp.where(s.done, 0, jnp.maximum(count, 0)).astype(jnp.int32)
  rows = jnp.where(j < count[:, None], s.num_generated[:, None] + j, n_max)  # past N: dropped
  out = s.out.at[jnp.arange(b)[:, None], rows].set(emitted, mode="drop")

  # Commit the K/V of the fed tokens block[:count] (the target's) to the cache.
  plan = cache.plan_append(count, max_new=g + 1)

  append_layers = type(cache).append_layers  # one flush cond for all layers

  if settings.mesh is not None:  # per device: its sequences and KV heads (no gather)
    from jaxkv import sharding  # pylint: disable=import-outside-toplevel
    c_spec, act = sharding.cache_specs(cache, settings.mesh), sharding.heads_spec(cache,
                                                                                 settings.mesh)
    stages = (act,) * cache.num_layers
    append_layers = sharding.shard_map(
        append_layers, settings.mesh,
        (c_spec, stages, stages, sharding.cache_specs(plan, settings.mesh)), c_spec)
  cache = append_layers(cache, sk, sv, plan)
  cache = _constrain(cache.commit(plan), settings.mesh)

  last = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
  num_generated = s.num_generated + count
  hit_stop = (first_stop < count) | (first_stop == count - 1)
  active = (~s.done).astype(jnp.int32)
  return SpecState(
      cache=cache, token=jnp.where(count > 0, last, s.token), out=out,
      num_generated=num_generated,
      done=s.done | (count > 0) & hit_stop | (num_generated >= n_max),
      rng=rng, verifications=s.verifications + active,
      accepted=s.accepted + active * n_acc)


def _is_stop_block(tokens, stop_tokens):
  """``tokens [B, S]``, ``stop_tokens [B, K]`` -> ``[B, S]`` bool."""
  if stop_tokens.shape[1] == 0:
    return jnp.zeros(tokens.shape, bool)
  return jnp.any(tokens[:, :, None] == stop_tokens[:, None, :], axis=-1)


@jit_by_rows(static_argnames=("settings",), donate_argnames=("cache",))
def _speculative_program(graphdef, state, draft_state, prompt_tokens, prompt_lengths, cache,
                         rng, stop_tokens, temperature, pad_token_id, *, settings: SpecSettings):
  model = nnx.merge(graphdef, state)
  draft = model if draft_state is None else model.with_draft_weights(
      draft_state, use_kernel=settings.mesh is None)
  b = prompt_tokens.shape[0]
  mesh = settings.mesh
  chunk = prefill_kwargs(settings.prefill_chunk)
  if mesh is None:
    logits, cache = model.prefill(prompt_tokens, prompt_lengths, cache, **chunk)
  else:
    logits, cache = model.prefill(prompt_tokens, prompt_lengths, _constrain(cache, mesh),
                                  mesh=mesh, **chunk)
    cache = _constrain(cache, mesh)
  rng, key = jax.random.split(rng)
  if settings.sampler == "greedy":
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  else:
    token = jax.random.categorical(key, _scaled_logits(logits, temperature),
                                   axis=-1).astype(jnp.int32)
  out = jnp.full((b, settings.max_new_tokens), pad_token_id, jnp.int32).at[:, 0].set(token)
  zeros = jnp.zeros((b,), jnp.int32)
  loop = SpecState(cache=cache, token=token, out=out, num_generated=jnp.ones((b,), jnp.int32),
                   done=_is_stop(token, stop_tokens) | (settings.max_new_tokens <= 1),
                   rng=rng, verifications=zeros, accepted=zeros)
  loop = jax.lax.while_loop(
      lambda s: ~jnp.all(s.done),
      lambda s: _spec_step(model, draft, s, stop_tokens, temperature, pad_token_id, settings),
      loop)
  return loop.out, loop.num_generated, loop.verifications, loop.accepted, loop.cache


@jit_by_rows(static_argnames=("settings", "num_rounds"), donate_argnames=("cache",))
def _speculative_steps_program(graphdef, state, draft_state, token, cache, rng, stop_tokens,
                               temperature, pad_token_id, *, settings: SpecSettings,
                               num_rounds: int):
  """``num_rounds`` rounds from ``token [B]`` (not yet in the cache), no prefill.

  Returns ``(out [B, N], emitted [B], verifications [B], accepted [B], cache)``
  with ``N = settings.max_new_tokens >= num_rounds * (gamma + 1)``, so the
  max-new-tokens cut of `_spec_step` never ends a sequence early.
  """
  model = nnx.merge(graphdef, state)
  draft = model if draft_state is None else model.with_draft_weights(
      draft_state, use_kernel=settings.mesh is None)
  b = token.shape[0]
  zeros = jnp.zeros((b,), jnp.int32)
  loop = SpecState(cache=_constrain(cache, settings.mesh), token=token,
                   out=jnp.full((b, settings.max_new_tokens), pad_token_id, jnp.int32),
                   num_generated=zeros, done=jnp.zeros((b,), bool), rng=rng,
                   verifications=zeros, accepted=zeros)
  loop = jax.lax.fori_loop(
      0, num_rounds,
      lambda _, s: _spec_step(model, draft, s, stop_tokens, temperature, pad_token_id,
                              settings),
      loop)
  return (loop.out, loop.num_generated, loop.verifications, loop.accepted,
          _constrain(loop.cache, settings.mesh))


def _constrain(cache, mesh):
  """Keeps the cache in its `cache_specs` placement on a mesh (identity without one)."""
  from jaxkv.sharding import constrain_cache  # pylint: disable=import-outside-toplevel
  return constrain_cache(cache, mesh)


def speculative_generate(model, prompt_tokens, prompt_lengths, *, max_new_tokens: int,
                         gamma: int = 4, kv_format: KVFormat | str = "quantspec",
                         draft_weights="int4", sampler: str = "greedy",
                         temperature: float = 1.0, stop_tokens=None,
                         rng: jax.Array | None = None, capacity: int | None = None,
                         cache_dtype=None, pad_token_id: int = 0,
                         group_size: int = DEFAULT_GROUP_SIZE, return_cache: bool = False,
                         mesh=None, prefill_chunk: int | None = None):
  """Self-speculative generation (QuantSpec): draft on 4 bits, verify on 8.

  Args:
    model: a `models.llama.Llama`.
    prompt_tokens: ``[B, T]`` int, right-padded; prompt_lengths: ``[B]`` in ``[1, T]``.
    max_new_tokens: tokens to generate per sequence (>= 1).
    gamma: draft tokens per verification (1 to 16).
    kv_format: a hierarchical `KVFormat` or preset name (``"quantspec"``).
    draft_weights: ``"int4"`` (4-bit group-wise copies, `models.draft_weights`),
      ``"int8"``, ``"full"`` (draft with the full weights: only the cache view
      differs), or a dict from `models.draft_weights.quantize_weights`.
    sampler: ``"greedy"`` or ``"sample"`` (temperature sampling, speculative
      acceptance; no top-k / top-p).
    temperature, stop_tokens, rng, capacity, cache_dtype, pad_token_id: as in
      `jaxkv.generate`.
    group_size: input rows per weight group for ``"int4"``/``"int8"``.
    return_cache: also return the final cache.
    mesh: a `jaxkv.make_mesh` mesh the model is placed on
      (`models.sharding.shard_model` or ``random_model(mesh=)``): the cache is
      created sharded (`jaxkv.shard_cache` placement), the prompt is prefilled
      per shard, and the loop keeps the cache in place. Same tokens as one
      device (greedy).
    prefill_chunk: prefill the prompt in chunks of this many tokens, as in
      `jaxkv.generate` (bounds the prefill's attention memory); None = at once.
  Returns:
    ``(tokens [B, max_new_tokens] int32, lengths [B] int32, stats)`` where
    ``stats`` holds per sequence ``verifications`` and ``accepted`` (draft
    tokens accepted) and the totals ``acceptance_rate`` (accepted / drafted)
    and ``tokens_per_verification``; with ``return_cache`` the cache last.
  """
  check_mesh(mesh, optional=True)
  prompt_tokens = np.asarray(prompt_tokens) if isinstance(prompt_tokens, (list, tuple)) \
      else prompt_tokens
  if getattr(prompt_tokens, "ndim", None) != 2:
    raise ValueError(f"prompt_tokens.shape={getattr(prompt_tokens, 'shape', None)} must be [B, T]")
  b, t = prompt_tokens.shape
  if b < 1:
    raise ValueError(f"prompt_tokens.shape={prompt_tokens.shape}: need at least one sequence")
  lengths = np.asarray(prompt_lengths)
  if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f"prompt_lengths (shape {lengths.shape}, dtype {lengths.dtype}) must be "
                     f"[{b}] integers")
  if lengths.min() < 1 or lengths.max() > t:
    raise ValueError(f"prompt_lengths={lengths.tolist()} must lie in [1, T={t}]")
  real = np.arange(t)[None, :] < lengths[:, None]
  _check_ids("prompt_tokens", np.asarray(prompt_tokens)[real], model.config.vocab_size)
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
  temperature = _check_spec_args(gamma, sampler, temperature)
  prefill_chunk = check_prefill_chunk(prefill_chunk)
  rng = _check_rng(rng)
  if isinstance(kv_format, str):
    kv_format = KVFormat.preset(kv_format)
  if not isinstance(kv_format, KVFormat):
    raise TypeError(f"kv_format={kv_format!r} must be a KVFormat or a preset name")
  if not kv_format.hierarchical:
    raise ValueError(f"kv_format={kv_format} must be hierarchical (e.g. 'quantspec'): the "
                     "draft reads its upper 4-bit plane")
  draft_weights = _draft_state(model, draft_weights, group_size, mesh)
  needed = t + max_new_tokens - 1
  capacity = t + max_new_tokens if capacity is None else capacity
  if capacity < needed:
    raise ValueError(f"capacity={capacity} < prompt length {t} + max_new_tokens "
                     f"{max_new_tokens} - 1")
  if mesh is None:
    cache = model.init_cache(kv_format, b, capacity, dtype=cache_dtype)
  else:  # each device allocates only its shard
    from jaxkv.sharding import init_sharded  # pylint: disable=import-outside-toplevel
    cache = init_sharded(lambda: model.init_cache(kv_format, b, capacity, dtype=cache_dtype),
                         mesh)
  graphdef, state = _split(model)  # an NNX model or a `SplitModel`
  settings = SpecSettings(int(max_new_tokens), int(gamma), sampler, mesh, prefill_chunk)
  rows = program_rows(b, mesh, int(gamma) + 1)  # the verify pass's rows
  tokens, num, verifs, accepted, cache = _speculative_program.at(rows)(
      graphdef, state, draft_weights, jnp.asarray(prompt_tokens, jnp.int32),
      jnp.asarray(lengths, jnp.int32), cache, rng,
      _stop_array(stop_tokens, b), temperature,
      _pad_id(pad_token_id), settings=settings)
  stats = _round_stats(verifs, accepted, np.asarray(num) - 1, gamma)  # the first: prefill's
  if return_cache:
    return tokens, num, stats, cache
  return tokens, num, stats


def _check_spec_args(gamma, sampler, temperature) -> np.float32:
  """Validates the round settings shared by `speculative_generate` and `speculative_steps`.

  Returns the float32 temperature the program takes (1 for greedy, which
  does not read it); errors as `jaxkv.generate`'s.
  """
  if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or not 1 <= gamma <= 16:
    raise ValueError(f"gamma={gamma!r} must be an int in [1, 16]")
  if sampler not in ("greedy", "sample"):
    raise ValueError(f"sampler={sampler!r} must be 'greedy' or 'sample'")
  return _check_temperature(temperature) if sampler == "sample" else np.float32(1.0)


def _draft_state(model, draft_weights, group_size: int, mesh=None):
  """The draft's weights as the program takes them: a dict of `QuantizedWeight`, or None
  (``"full"``: the draft is the model itself, reading the draft view of the cache).
  ``group_size`` is checked whatever the weights (an int >= 1), and refused unless it is
  the default where the weights would ignore it (``"full"``, a dict). Off a mesh q, k
  and v are one product per layer, and gate and up one; on one they stay apart, each
  sharded by its heads or columns (a fused ``[q | k | v]`` or ``[gate | up]`` weight's
  column shards would not line up with them)."""
  check_int("group_size", group_size)
  if isinstance(draft_weights, str) and draft_weights not in ("int4", "int8", "full"):
    raise ValueError(f"draft_weights={draft_weights!r} must be 'int4', 'int8', 'full' or a "
                     "dict from model.quantize_weights()")
  if not (draft_weights is None or isinstance(draft_weights, (str, dict))):
    raise TypeError(f"draft_weights must be a string or a dict, got {type(draft_weights).__name__}")
  if draft_weights not in ("int4", "int8") and group_size != DEFAULT_GROUP_SIZE:
    shown = "a dict" if isinstance(draft_weights, dict) else repr(draft_weights)
    raise ValueError(f"group_size={group_size} would be ignored with draft_weights={shown}: it "
                     "sets the groups of 'int4' / 'int8' (a dict is quantized already)")
  if isinstance(draft_weights, str):
    if draft_weights == "full":
      return None
    model = model.model if isinstance(model, SplitModel) else model
    return model.quantize_weights(bits=int(draft_weights[3:]), group_size=group_size,
                                  fuse_qkv=mesh is None, fuse_mlp=mesh is None)
  return draft_weights


def _round_stats(verifications, accepted, emitted, gamma: int) -> dict:
  """Per sequence ``verifications [B]``, ``accepted [B]``; totals over the rounds that
  emitted ``emitted [B]`` tokens."""
  v, a, e = np.asarray(verifications), np.asarray(accepted), np.asarray(emitted)
  return dict(verifications=v, accepted=a,
              acceptance_rate=float(a.sum() / max(1, gamma * v.sum())),
              tokens_per_verification=float(e.sum() / max(1, v.sum())))


def speculative_steps(model, token, cache, num_rounds: int, *, gamma: int = 4,
                      draft_weights="int4", group_size: int = DEFAULT_GROUP_SIZE,
                      sampler: str = "greedy", temperature: float = 1.0,
                      rng: jax.Array | None = None,
                      stop_tokens=None, pad_token_id: int = 0, mesh=None):
  """Runs ``num_rounds`` speculative rounds from a cache the caller holds; cache donated.

  The speculative analogue of `jaxkv.decode_steps`: the cache already holds
  the prompt (``model.prefill`` on a hierarchical cache, or filled
  otherwise) and ``token`` is the last emitted token, whose K/V is not yet
  in it. Each round drafts ``gamma`` tokens, verifies them in one target
  pass and commits the accepted ones (1 to ``gamma + 1`` tokens per
  sequence). Exactly ``num_rounds`` rounds run in one jitted `lax.fori_loop`
  (compiled once per shapes, ``num_rounds``, ``gamma`` and sampler); a
  sequence that emitted a stop token stays put for the rest.

  Args:
    model: a `models.llama.Llama`, or a `jaxkv.SplitModel` of one (no
      per-call ``nnx.split``; use it when calling this in a loop).
    token: ``[B]`` int, the last emitted token of each sequence.
    cache: a hierarchical (``"quantspec"``) `jaxkv.ModelCache` with room for
      ``num_rounds * (gamma + 1)`` more tokens per sequence; consumed
      (donated), use the returned one. Its lengths are read to check the
      room (the call waits for the cache).
    num_rounds: verification rounds to run (static, >= 1).
    gamma: draft tokens per round (1 to 16).
    draft_weights, group_size, sampler, temperature, stop_tokens,
      pad_token_id: as in `speculative_generate`. Pass a dict from
      ``model.quantize_weights()`` to quantize once when calling repeatedly.
    mesh: the `jaxkv.make_mesh` mesh the model and the cache
      (`jaxkv.shard_cache`) are placed on; None without one.
    rng: PRNG key for ``sampler="sample"`` (default ``jax.random.key(0)``).
  Returns:
    ``(tokens [B, num_rounds * (gamma + 1)] int32, counts [B] int32, stats,
    cache)``: row ``b`` holds ``counts[b]`` emitted tokens then
    ``pad_token_id``; ``stats`` as in `speculative_generate`
    (``tokens_per_verification`` = emitted tokens per round; numpy, so the
    call returns when the program is done); the cache grown by ``counts[b]``
    tokens: ``token`` and every emitted token but the last, which is the
    next call's ``token`` (``tokens[b, counts[b] - 1]``).
  Raises:
    ValueError: a non-hierarchical cache, ``token`` not ``[B]`` in
      ``[0, vocab)``, ``num_rounds < 1``, ``gamma`` outside [1, 16], or a
      cache without room for ``num_rounds * (gamma + 1)`` more tokens.
  """
  if not isinstance(cache, ModelCache):
    raise TypeError(f"cache must be a jaxkv.ModelCache (model.init_cache), got "
                    f"{type(cache).__name__}")
  if not cache.fmt.hierarchical:
    raise ValueError(f"cache format {cache.fmt} must be hierarchical (e.g. 'quantspec'): the "
                     "draft reads its upper 4-bit plane")
  cache.check_model(model.config)
  check_mesh(mesh, optional=True)
  token = jnp.asarray(token) if isinstance(token, (list, tuple)) else token
  if getattr(token, "ndim", None) != 1 or token.shape[0] != cache.batch:
    raise ValueError(f"token.shape={getattr(token, 'shape', None)} must be [{cache.batch}] "
                     "(the cache batch)")
  _check_ids("token", token, model.config.vocab_size)
  if isinstance(num_rounds, bool) or not isinstance(num_rounds, (int, np.integer)) \
      or num_rounds < 1:
    raise ValueError(f"num_rounds={num_rounds!r} must be an int >= 1")
  temperature = _check_spec_args(gamma, sampler, temperature)
  rng = _check_rng(rng)
  room = int(num_rounds) * (int(gamma) + 1)  # each round commits at most gamma + 1 tokens
  if not isinstance(cache.lengths, jax.core.Tracer):
    longest = int(np.max(np.asarray(cache.lengths)))
    if longest + room > cache.capacity:
      raise ValueError(f"cache capacity={cache.capacity} has no room for num_rounds={num_rounds} "
                       f"x (gamma={gamma} + 1) = {room} more tokens after the longest sequence's "
                       f"{longest}: needs capacity >= {longest + room}")
  draft_state = _draft_state(model, draft_weights, group_size, mesh)
  graphdef, state = _split(model)
  settings = SpecSettings(room, int(gamma), sampler, mesh)
  program = _speculative_steps_program.at(program_rows(cache.batch, mesh, int(gamma) + 1))
  tokens, counts, verifs, accepted, cache = program(
      graphdef, state, draft_state, jnp.asarray(token, jnp.int32), cache,
      rng, _stop_array(stop_tokens, cache.batch),
      temperature, _pad_id(pad_token_id), settings=settings,
      num_rounds=int(num_rounds))
  return tokens, counts, _round_stats(verifs, accepted, counts, gamma), cache


__all__ = ["SpecSettings", "block_forward", "speculative_generate", "speculative_steps"]
