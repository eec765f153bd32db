"""Autotuning of the Pallas decode-attention kernels on the current GPU.

`autotune` (re-exported as `jaxkv.autotune`) times every candidate
`DecodeAttentionConfig` on the caller's own ``q`` and cache with
`jaxkv.timing.kernel_time` and returns the fastest; results can be kept in a
JSON file keyed by GPU name, format and shape (`save_config` / `load_config`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
from typing import Sequence

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from jaxkv.timing import kernel_time


def search_space(q, cache) -> list[pk.DecodeAttentionConfig]:
  """Candidate configs: splits around the heuristic, block_k, warps, stages."""
  fmt = cache.fmt
  batch, _, q_heads, head_dim = q.shape
  base = pk.DecodeAttentionConfig.default(
      batch=batch, tokens=cache.storage_len, q_heads=q_heads, kv_heads=cache.kv_heads,
      head_dim=head_dim, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
      token_group=fmt.token_group, k_axis=fmt.k_axis, residual=fmt.residual)
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
  return pk.pallas_decode_attention(q, cache, scale=scale, config=config, interpret=interpret)


def autotune(q: jax.Array, cache, *, scale: float | None = None,
             candidates: Sequence[pk.DecodeAttentionConfig] | None = None,
             path: str | None = None, reps: int = 5,
             interpret: bool | None = None) -> pk.DecodeAttentionConfig:
  """Times candidate configs on the current GPU and returns the fastest.

  Args:
    q: ``[B, S, Hq, D]`` queries, as in `jaxkv.decode_attention`.
    cache: the `KVCache` to attend over (its contents are read, not changed).
    scale: softmax scale.
    candidates: configs to try; `search_space` when None.
    path: JSON file: a saved entry for this GPU/shape is returned without
      timing; a new result is saved there.
    reps: timed calls per candidate (`kernel_time`).
    interpret: run the kernels in Pallas interpret mode; default: when the
      default backend is not a GPU (timings are then meaningless, but the
      search, the JSON and the returned config work the same).

  Returns:
    The fastest `DecodeAttentionConfig`.
  """
  if path is not None:
    saved = load_config(path, q, cache)
    if saved is not None:
      return saved
  candidates = list(candidates or search_space(q, cache))
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  best, best_t, errors = None, float("inf"), []
  args = [(q + jnp.asarray(i * 1e-3, q.dtype), cache) for i in range(2)]
  for config in candidates:
    fn = functools.partial(_attend, scale=scale, config=config, interpret=interpret)
    try:
      t = kernel_time(fn, args, calls=reps)["kernel"]
    except Exception as e:  # noqa: BLE001 - a config the compiler rejects is skipped
      errors.append(f"{config}: {type(e).__name__}: {str(e)[:200]}")
      continue
    if t < best_t:
      best, best_t = config, t
  if best is None:
    raise ValueError(f"no candidate config ran for {config_key(q, cache)}; first error: "
                     f"{errors[0] if errors else 'no candidates'}")
  if path is not None:
    save_config(path, q, cache, best)
  return best


__all__ = ["autotune", "config_key", "load_config", "save_config", "search_space"]
