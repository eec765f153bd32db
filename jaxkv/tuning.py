"""Autotuning of the Pallas decode-attention kernels on the current GPU.

`autotune` (re-exported as `jaxkv.autotune`) times candidate
`DecodeAttentionConfig`s on the caller's own ``q`` and cache with
`jaxkv.timing.kernel_time` and returns the fastest: by default a greedy walk
from the config the call would use anyway (`pallas_kernels.default_config`)
over its `neighbours` (`greedy_search`, ~10-20 configs), or the whole
`search_space` grid, or the caller's candidates. Results can be kept in a
JSON file keyed by GPU name, format and shape (`save_config` / `load_config`).
`bench/tune_table.py` uses the same walk to build the table shipped with
`pallas_kernels`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from jaxkv.cache import check_int
from jaxkv.timing import kernel_time


def _default(q, cache, *, use_table: bool) -> pk.DecodeAttentionConfig:
  """`pallas_kernels.default_config` for this call (table and heuristic, or the heuristic)."""
  batch, num_queries, q_heads, head_dim = q.shape
  config, _ = pk.default_config(
      cache.fmt, batch=batch, q_heads=q_heads, kv_heads=cache.kv_heads, head_dim=head_dim,
      num_queries=num_queries, capacity=cache.storage_len,
      itemsize=jnp.dtype(cache.k_residual.dtype).itemsize, use_table=use_table)
  return config


def search_space(q, cache) -> list[pk.DecodeAttentionConfig]:
  """Candidate configs: splits around the heuristic, block_k, warps, stages."""
  base = _default(q, cache, use_table=False)
  blocks = [b for b in (32, 64, 128, 256) if cache.storage_len % b == 0]
  splits = sorted({max(1, base.num_splits // 2), base.num_splits, base.num_splits * 2})
  out = []
  for block_k, num_splits, num_warps, num_stages, defer in itertools.product(
      blocks, splits, (2, 4), (2, 3), (True, False)):
    if num_splits * block_k > cache.storage_len * 2:
      continue
    out.append(pk.DecodeAttentionConfig(block_k, num_splits, num_warps, num_stages, defer,
                                        residual_program=base.residual_program))
  return out or [base]


def neighbours(config, tokens: int) -> list:
  """Configs one step from ``config``: splits x1/2 and x2, the other block sizes,
  warps and stages, and (split kernel) ``defer_sums`` / ``residual_program``
  flipped. ``config``: a `DecodeAttentionConfig` or a VQ kernel's
  `VQAttentionConfig`; ``tokens``: the cache capacity every block must tile."""
  rep = dataclasses.replace
  out = [rep(config, num_splits=max(1, config.num_splits // 2)),
         rep(config, num_splits=config.num_splits * 2)]
  if isinstance(config, pk.DecodeAttentionConfig):
    blocks, warps, stages = (32, 64, 128, 256), (1, 2, 4), (2, 3, 4)
    out += [rep(config, defer_sums=not config.defer_sums),
            rep(config, residual_program=not config.residual_program)]
  else:
    blocks, warps, stages = (32, 64, 128), (2, 4, 8), (1, 2, 3)
  out += [rep(config, block_k=b) for b in blocks if b != config.block_k and tokens % b == 0]
  out += [rep(config, num_warps=w) for w in warps if w != config.num_warps]
  out += [rep(config, num_stages=n) for n in stages if n != config.num_stages]
  seen, unique = {config}, []
  for c in out:
    if c not in seen and c.num_splits <= 256:
      seen.add(c)
      unique.append(c)
  return unique


def greedy_search(measure: Callable, start, tokens: int, *, max_evals: int = 16):
  """Walks from ``start`` to its fastest neighbour until none is faster.

  Args:
    measure: ``config -> time``; ``inf`` for a config that failed.
    start: the first config (timed first).
    tokens: the cache capacity (`neighbours`).
    max_evals: configs timed at most, ``start`` included.

  Returns:
    ``(best, best_time, timed)``, ``timed`` a dict of every config tried and
    its time, in the order tried.
  """
  timed = {start: measure(start)}
  best, best_t = start, timed[start]
  moved = True
  while moved and len(timed) < max_evals:
    moved = False
    for cand in neighbours(best, tokens):
      if len(timed) >= max_evals:
        break
      if cand in timed:
        continue
      timed[cand] = measure(cand)
      if timed[cand] < best_t:
        best, best_t, moved = cand, timed[cand], True
  return best, best_t, timed


def config_key(q, cache) -> str:
  """JSON key: GPU name, format and shape."""
  b, s, hq, d = q.shape
  return (f"{jax.devices()[0].device_kind}|{cache.fmt}|B={b}|S={s}|Hq={hq}|"
          f"Hkv={cache.kv_heads}|D={d}|C={cache.storage_len}|{jnp.dtype(q.dtype).name}")


def load_config(path: str, q, cache) -> pk.DecodeAttentionConfig | None:
  """The saved config for this GPU/format/shape, or None."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    entry = json.load(f).get(config_key(q, cache))
  return None if entry is None else pk.DecodeAttentionConfig(**entry)


def save_config(path: str, q, cache, config: pk.DecodeAttentionConfig) -> None:
  """Adds (or replaces) this GPU/format/shape's config in the JSON file."""
  table = {}
  if os.path.exists(path):
    with open(path) as f:
      table = json.load(f)
  table[config_key(q, cache)] = dataclasses.asdict(config)
  with open(path, "w") as f:
    json.dump(table, f, indent=1, sort_keys=True)


def _attend(q, cache, *, scale, config, interpret):
  """What `jaxkv.decode_attention` runs with ``config``: for a sink format the
  kernel from its skip on plus the exact prefix (`jaxkv.sink_attention`)."""
  attend = functools.partial(pk.pallas_decode_attention, q, cache, scale=scale, config=config,
                             interpret=interpret)
  if not cache.fmt.sink_tokens:
    return attend()
  from jaxkv.sink_attention import sink_decode_attention  # pylint: disable=import-outside-toplevel
  return sink_decode_attention(q, cache, attend, block=config.block_k, scale=scale,
                               seq_bad=cache.nonfinite)


def autotune(q: jax.Array, cache, *, scale: float | None = None,
             candidates: Sequence[pk.DecodeAttentionConfig] | None = None,
             search: str = "greedy", max_evals: int = 16,
             path: str | None = None, reps: int = 5,
             interpret: bool | None = None) -> pk.DecodeAttentionConfig:
  """Times candidate configs on the current GPU and returns the fastest.

  Args:
    q: ``[B, S, Hq, D]`` queries, as in `jaxkv.decode_attention`.
    cache: the `KVCache` to attend over (its contents are read, not changed).
    scale: softmax scale.
    candidates: configs to time, all of them; overrides ``search``.
    search: without candidates, ``"greedy"`` (`greedy_search` from
      `pallas_kernels.default_config`, at most ``max_evals`` configs) or
      ``"grid"`` (every config of `search_space`).
    max_evals: the greedy walk's budget of timed configs.
    path: JSON file: a saved entry for this GPU/shape is returned without
      timing; a new result is saved there.
    reps: timed calls per candidate (`kernel_time`).
    interpret: run the kernels in Pallas interpret mode; default: when the
      default backend is not a GPU (timings are then meaningless, but the
      search, the JSON and the returned config work the same).

  Returns:
    The fastest `DecodeAttentionConfig`.
  """
  from jaxkv.cache import KVCache  # pylint: disable=import-outside-toplevel
  if not isinstance(cache, KVCache):  # a layer view / model cache has no single storage
    raise TypeError(f"cache must be a jaxkv.KVCache (e.g. model_cache.layer(i)), got "
                    f"{type(cache).__name__}")
  if search not in ("greedy", "grid"):
    raise ValueError(f"search={search!r} must be 'greedy' or 'grid'")
  check_int("max_evals", max_evals)
  if candidates is not None:
    candidates = list(candidates)
    if not candidates:  # an empty list ran the whole grid before
      raise ValueError("candidates=[] gives nothing to time: pass configs or None (search)")
    bad = [c for c in candidates if not isinstance(c, pk.DecodeAttentionConfig)]
    if bad:
      raise TypeError(f"candidates must be pallas_kernels.DecodeAttentionConfig, got {bad[0]!r}")
  if path is not None:
    saved = load_config(path, q, cache)
    if saved is not None:
      return saved
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  errors = []
  args = [(q + jnp.asarray(i * 1e-3, q.dtype), cache) for i in range(2)]

  def measure(config) -> float:
    fn = functools.partial(_attend, scale=scale, config=config, interpret=interpret)
    try:
      return kernel_time(fn, args, calls=reps)["kernel"]
    except Exception as e:  # noqa: BLE001 - a config the compiler rejects is skipped
      errors.append(f"{config}: {type(e).__name__}: {str(e)[:200]}")
      return math.inf

  if candidates is None and search == "greedy":
    start = _default(q, cache, use_table=True)
    best, best_t, _ = greedy_search(measure, start, cache.storage_len, max_evals=max_evals)
    best = None if math.isinf(best_t) else best
  else:
    best, best_t = None, math.inf
    for config in candidates if candidates is not None else search_space(q, cache):
      t = measure(config)
      if t < best_t:
        best, best_t = config, t
  if best is None:
    raise ValueError(f"no candidate config ran for {config_key(q, cache)}; first error: "
                     f"{errors[0] if errors else 'no candidates'}")
  if path is not None:
    save_config(path, q, cache, best)
  return best


__all__ = ["autotune", "config_key", "greedy_search", "load_config", "neighbours", "save_config",
           "search_space"]
