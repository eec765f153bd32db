"""Autotuning of the Pallas decode-attention kernels on the current GPU.

`autotune` times every candidate `DecodeAttentionConfig` on the caller's own
``q`` and cache and returns the fastest; results can be kept in a JSON file
keyed by GPU name, format and shape (`save_config` / `load_config`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

# A module import, not a name import: `import pallas_kernels` first loads jaxkv
# (for the reference quantizer), which must not need pallas_kernels' names yet.
import pallas_kernels as pk


def device_time(fn: Callable, firsts: Sequence, *rest, reps: int = 10, warmup: int = 2) -> dict:
  """Device time of one ``fn(first, *rest)`` call, in seconds.

  Traces ``len(firsts)`` back-to-back calls (one per distinct first argument,
  so none is elided and no extra op runs between them) into one jitted
  function and times ``reps`` dispatches of it with ``block_until_ready``;
  compilation and warm-up are excluded and reported separately.

  Returns:
    ``{"median", "min", "max", "compile"}`` seconds per call of ``fn``.
  """
  firsts = list(firsts)

  @jax.jit
  def many(firsts_, *rest_args):
    return [fn(x, *rest_args) for x in firsts_]

  t0 = time.perf_counter()
  compiled = many.lower(firsts, *rest).compile()
  compile_s = time.perf_counter() - t0
  for _ in range(warmup):
    jax.block_until_ready(compiled(firsts, *rest))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(firsts, *rest))
    times.append((time.perf_counter() - t0) / len(firsts))
  return {"median": statistics.median(times), "min": min(times), "max": max(times),
          "compile": compile_s}


def search_space(q, cache) -> list[pk.DecodeAttentionConfig]:
  """Candidate configs: splits around the heuristic, block_k, warps, stages."""
  fmt = cache.fmt
  batch, _, q_heads, head_dim = q.shape
  base = pk.DecodeAttentionConfig.default(
      batch=batch, tokens=cache.storage_len, q_heads=q_heads, kv_heads=cache.kv_heads,
      head_dim=head_dim, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
      token_group=fmt.token_group, k_axis=fmt.k_axis)
  blocks = [b for b in (32, 64, 128, 256) if cache.storage_len % b == 0]
  splits = sorted({max(1, base.num_splits // 2), base.num_splits, base.num_splits * 2})
  out = []
  for block_k, num_splits, num_warps, num_stages, defer in itertools.product(
      blocks, splits, (4, 8), (2, 3), (True, False)):
    if num_splits * block_k > cache.storage_len * 2:
      continue
    out.append(pk.DecodeAttentionConfig(block_k, num_splits, num_warps, num_stages, defer))
  return out or [base]


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


def autotune(q: jax.Array, cache, *, scale: float | None = None,
             candidates: Sequence[pk.DecodeAttentionConfig] | None = None,
             path: str | None = None, reps: int = 5) -> pk.DecodeAttentionConfig:
  """Times candidate configs on the current GPU and returns the fastest.

  Args:
    q: ``[B, S, Hq, D]`` queries, as in `jaxkv.decode_attention`.
    cache: the `KVCache` to attend over (its contents are read, not changed).
    scale: softmax scale.
    candidates: configs to try; `search_space` when None.
    path: JSON file: a saved entry for this GPU/shape is returned without
      timing; a new result is saved there.
    reps: timed dispatches per candidate.

  Returns:
    The fastest `DecodeAttentionConfig`.
  """
  if path is not None:
    saved = load_config(path, q, cache)
    if saved is not None:
      return saved
  candidates = list(candidates or search_space(q, cache))
  best, best_t = None, float("inf")
  for config in candidates:
    fn = lambda q_, cache_, _c=config: pk.pallas_decode_attention(q_, cache_, scale=scale, config=_c)
    try:
      qs = [q + jnp.asarray(i * 1e-3, q.dtype) for i in range(4)]
      t = device_time(fn, qs, cache, reps=reps, warmup=1)["median"]
    except Exception:  # noqa: BLE001 - a config the compiler rejects is skipped
      continue
    if t < best_t:
      best, best_t = config, t
  if best is None:
    raise ValueError(f"no candidate config ran for {config_key(q, cache)}")
  if path is not None:
    save_config(path, q, cache, best)
  return best
