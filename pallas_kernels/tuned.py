"""Shipped tuned configs of the split decode-attention kernel.

`bench/tune_table.py` searches `DecodeAttentionConfig` on a GPU for the
benchmark's shapes and writes the winners into ``tuned_configs.json`` beside
this module, keyed by the GPU's ``device_kind`` and a *shape class*: the
kernel's static geometry (bits, axis and groups of each side, token group,
residual, hierarchical view, head_dim, cache itemsize, query rows) plus the
work buckets that decide the launch: ``batch * kv_heads`` and the cache
capacity, each rounded down to a power of two. `lookup` is what
`dequant_decode_attention` calls when no config is given; a miss (another
GPU, an untuned class) or an entry that does not fit the actual shape falls
back to `DecodeAttentionConfig.default`, the heuristic.

An entry is only written when it beat the heuristic in the same process by
a margin (see the tuning script), so the table holds measured wins, not
noise. ``JAXKV_TUNED_CONFIGS=/path.json`` points the lookup at another table
(``""`` turns the shipped table off). The lookup happens when a call is
traced, and a table is read once per process: set the variable before the
first call.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from pallas_kernels._triton import prev_pow2

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned_configs.json")
ENV_VAR = "JAXKV_TUNED_CONFIGS"


def shape_class(*, k_bits: int, k_axis: str, k_group: int, v_bits: int, v_group: int,
                hier: bool, token_group: int, residual: int, q_rows: int, batch: int,
                kv_heads: int, capacity: int, head_dim: int, itemsize: int) -> str:
  """The table key of one kernel launch, without the GPU name.

  Args:
    k_bits, k_axis, k_group, v_bits, v_group, hier: the kernel's two sides
      (``_Side`` in `dequant_attention`: bits of the codes it reads, the K
      axis, the scale group along it, the QuantSpec target view).
    token_group, residual: the format's G and R.
    q_rows: query rows per kv head, ``Hq / Hkv * S``.
    batch, kv_heads, capacity: bucketed as ``prev_pow2(batch * kv_heads)`` and
      ``prev_pow2(capacity)``.
    head_dim, itemsize: ``D`` and the bytes of the cache dtype.
  """
  k = "k16" if k_bits == 16 else f"k{k_bits}{k_axis[0]}{k_group}"
  v = "v16" if v_bits == 16 else f"v{v_bits}t{v_group}"
  return "|".join([
      f"{k}{v}{'h' if hier else ''}", f"G={token_group}", f"R={residual}", f"D={head_dim}",
      f"itemsize={itemsize}", f"rows={q_rows}", f"work={prev_pow2(batch * kv_heads)}",
      f"tokens={prev_pow2(capacity)}"])


def table_path() -> str:
  return os.environ.get(ENV_VAR, TABLE_PATH)


@functools.lru_cache(maxsize=8)
def _load(path: str) -> dict:
  if not path or not os.path.exists(path):
    return {}
  with open(path) as f:
    table = json.load(f)
  if not isinstance(table, dict):
    raise ValueError(f"{path}: a tuned-config table must be a JSON object, got "
                     f"{type(table).__name__}")
  return table


def load_table(path: str | None = None) -> dict:
  """``{device_kind: {shape_class: config fields}}`` (empty when there is no table)."""
  return _load(table_path() if path is None else path)


def lookup(device_kind: str, key: str, config_cls, *, capacity: int, path: str | None = None):
  """The tuned config of this GPU and shape class, or None.

  None as well when the entry does not fit the actual launch (``capacity``
  not a multiple of its ``block_k``) or names fields ``config_cls`` does not
  have (a table from another version).
  """
  entry = load_table(path).get(device_kind, {}).get(key)
  if entry is None:
    return None
  known = {f.name for f in dataclasses.fields(config_cls)}
  if not set(entry.get("config", {})) <= known:
    return None
  config = config_cls(**entry["config"])
  if capacity % config.block_k:
    return None
  return config


def store(table: dict, device_kind: str, key: str, config, *, us: float,
          heuristic_us: float, shape: str) -> None:
  """Adds one measured entry (the config's fields and its timing) to ``table``."""
  table.setdefault(device_kind, {})[key] = dict(
      config=dataclasses.asdict(config), us=round(us, 2), heuristic_us=round(heuristic_us, 2),
      tuned_on=shape)


__all__ = ["TABLE_PATH", "load_table", "lookup", "shape_class", "store", "table_path"]
