"""Decoding on a device mesh with JAX's own sharding (DESIGN.md "Beyond one GPU").

A mesh has two axes: ``"data"`` (data parallelism: the batch) and ``"model"``
(Megatron tensor parallelism: attention heads, MLP features, vocabulary).
Arrays carry *logical* axis names (``"batch"``, ``"kv_heads"``, ...) and one
table, `LOGICAL_AXIS_RULES`, maps them to mesh axes (MaxText style). A
logical axis whose size is not a multiple of its mesh axis size is
replicated instead (e.g. 2 KV heads on a ``model=8`` mesh: every model shard
holds both heads and computes their attention redundantly).

Caches (`ModelCache`, `KVCache`) are sharded on the batch axis over ``"data"``
and on the kv-head axis over ``"model"`` (codes, scales, zeros, residual);
lengths and flags over ``"data"``. Appends and attention touch one sequence
and one KV head at a time, so `per_shard` runs them inside `jax.shard_map`:
each device appends to and attends over its own heads and sequences (the
Pallas kernels see plain local arrays), and the cache is never gathered.
Everything else (projections, MLP, logits) is plain `jit` code that XLA
partitions from the parameter shardings (`models.sharding.shard_model`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "model")

# logical axis -> mesh axis (None = replicated). The one table of rules.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("heads", "model"),      # query heads (q_proj columns, o_proj rows)
    ("kv_heads", "model"),   # K/V heads (k/v_proj columns, cache storage)
    ("mlp", "model"),        # MLP features (gate/up columns, down rows)
    ("vocab", "model"),      # embedding rows, LM head columns
    ("embed", None),         # hidden size
    ("layers", None),        # stacked layer axis
    ("cache_seq", None),     # cache token rows
    ("head_dim", None),
)


def _rule(logical: str | None) -> str | None:
  if logical is None:
    return None
  for name, mesh_axis in LOGICAL_AXIS_RULES:
    if name == logical:
      return mesh_axis
  raise ValueError(f"logical axis {logical!r} has no rule in LOGICAL_AXIS_RULES")


# --------------------------------------------------------------------- mesh
def make_mesh(data: int = 1, model: int | None = None, *, devices=None) -> Mesh:
  """A ``("data", "model")`` mesh of ``data * model`` devices.

  Args:
    data: data-parallel size (the batch is split over it).
    model: tensor-parallel size (heads / features / vocab split over it);
      default: every remaining device (``len(devices) // data``, which must
      then use them all). With both sizes given, the first ``data * model``
      devices form the mesh.
    devices: devices to use; default ``jax.devices()``.
  Raises:
    ValueError: sizes that are not positive ints or do not match the devices.
  """
  devices = list(jax.devices() if devices is None else devices)
  if not all(isinstance(d, jax.Device) for d in devices):
    raise TypeError(f"devices must be jax.Device objects (jax.devices()), got {devices!r}")
  if len(set(devices)) != len(devices):
    raise ValueError(f"devices lists a device more than once: {devices}")
  for name, size in (("data", data), ("model", model)):
    if size is None and name == "model":
      continue
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(f"mesh axis {name}={size!r} must be an int >= 1")
  if model is None:
    model = len(devices) // data
    if model < 1:
      raise ValueError(f"mesh data={data} needs {data} devices, only {len(devices)} are available")
    if data * model != len(devices):  # "every remaining device" would leave some out
      raise ValueError(f"mesh data={data} does not divide the {len(devices)} devices: pass "
                       f"model= (the first data x model devices are used) or devices=")
  if data * model > len(devices):
    raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices, "
                     f"only {len(devices)} are available")
  devices = devices[: data * model]
  auto = (jax.sharding.AxisType.Auto,) * 2
  return jax.make_mesh((data, model), MESH_AXES, auto, devices=devices)


def parse_mesh(spec: str) -> dict[str, int]:
  """``"data=1,model=8"`` -> ``{"data": 1, "model": 8}`` (missing axes are 1).

  Raises:
    ValueError: naming the bad part of ``spec``.
  """
  sizes = {"data": 1, "model": 1}
  seen = set()
  for part in str(spec).split(","):
    name, eq, value = part.strip().partition("=")
    name = name.strip()
    if not eq or name not in MESH_AXES:
      raise ValueError(f"mesh spec {spec!r}: {part.strip()!r} must be 'data=N' or 'model=N'")
    if name in seen:
      raise ValueError(f"mesh spec {spec!r}: axis {name!r} given twice")
    try:
      size = int(value)
    except ValueError:
      raise ValueError(f"mesh spec {spec!r}: {name}={value.strip()!r} is not an int") from None
    if size < 1:
      raise ValueError(f"mesh spec {spec!r}: {name}={size} must be >= 1")
    sizes[name] = size
    seen.add(name)
  return sizes


def mesh_from_spec(spec: str, *, devices=None) -> Mesh:
  """`make_mesh` from a ``"data=D,model=M"`` string (the CLI's ``--mesh``)."""
  return make_mesh(**parse_mesh(spec), devices=devices)


# ------------------------------------------------------------ logical specs
def logical_spec(mesh: Mesh, shape, logical_axes, units=None) -> P:
  """The `PartitionSpec` of an array with ``logical_axes`` on ``mesh``.

  A dimension whose mesh axis size does not divide it (or, with ``units``,
  does not divide ``units[i]``, e.g. the head count of a fused
  ``heads * head_dim`` axis) is replicated.
  """
  if len(shape) != len(logical_axes):
    raise ValueError(f"shape {tuple(shape)} and logical axes {tuple(logical_axes)} differ in rank")
  axes = []
  for i, (dim, logical) in enumerate(zip(shape, logical_axes)):
    mesh_axis = _rule(logical)
    n = dim if units is None or units[i] is None else units[i]
    if mesh_axis is None or mesh_axis not in mesh.shape or n % mesh.shape[mesh_axis]:
      axes.append(None)
    else:
      axes.append(mesh_axis)
  return P(*axes)


def _is_spec(x) -> bool:
  return isinstance(x, P)


def named(mesh: Mesh, specs):
  """A pytree of `PartitionSpec`s -> the same tree of `NamedSharding`s."""
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


# -------------------------------------------------------------------- caches
def cache_specs(cache, mesh: Mesh):
  """`PartitionSpec`s of a `ModelCache`, `KVCache`, `VQCache`, `LayerView` or `AppendPlan`.

  Storage ``[(L,) B, Hkv, C, X]`` (codes, scales, hierarchical planes,
  residual rows): batch over ``"data"``, kv heads over ``"model"`` (each
  replicated when not divisible); sink rows ``[(L,) B, S, Hkv, D]`` likewise;
  VQ codebooks ``[(L,) Hkv, ...]`` with their kv heads, replicated over
  ``"data"``; ``[B]`` lengths and flags over ``"data"``; a layer index
  replicated. Works on arrays and on `jax.ShapeDtypeStruct`s
  (`jax.eval_shape` output).
  """
  from jaxkv.cache import KVCache  # pylint: disable=import-outside-toplevel
  from jaxkv.model_cache import AppendPlan, LayerView, ModelCache  # pylint: disable=import-outside-toplevel
  from jaxkv.vq_cache import VQCache  # pylint: disable=import-outside-toplevel

  def per_seq(x):
    return logical_spec(mesh, x.shape, ("batch",))

  if isinstance(cache, AppendPlan):
    return jax.tree_util.tree_map(per_seq, cache)
  if isinstance(cache, LayerView):
    return dataclasses.replace(cache, stacked=cache_specs(cache.stacked, mesh), index=P(),
                               lengths=per_seq(cache.lengths), overflow=per_seq(cache.overflow))
  if isinstance(cache, ModelCache):
    lead, flags = ("layers",), ("overflow", "invalid", "nonfinite")
  elif isinstance(cache, (KVCache, VQCache)):
    lead, flags = (), ("overflow", "nonfinite")
  else:
    raise TypeError(f"cache must be a jaxkv.ModelCache, KVCache or VQCache, "
                    f"got {type(cache).__name__}")
  logical = lead + ("batch", "kv_heads", "cache_seq", None)
  # Storage: heads sharded only together with the batch rule of the residual
  # (one decision for every leaf, so all leaves of a sequence/head agree).
  ref = logical_spec(mesh, cache.k_residual.shape, logical)

  def storage(x):
    return P(*ref[: len(lead) + 2], *([None] * (x.ndim - len(lead) - 2)))

  def side(s):
    from jaxkv.vq_model_cache import VQCodes  # pylint: disable=import-outside-toplevel
    if isinstance(s, VQCodes):  # codebooks [L, Hkv, ...] go with their kv heads
      return VQCodes(codes=storage(s.codes),
                     codebook=P(ref[0], ref[2], *([None] * (s.codebook.ndim - 2))))
    return jax.tree_util.tree_map(storage, s)

  common = dict(k_residual=storage(cache.k_residual), v_residual=storage(cache.v_residual),
                lengths=per_seq(cache.lengths), **{f: per_seq(getattr(cache, f)) for f in flags})
  if getattr(cache, "k_sink", None) is not None:  # [(L,) B, S, Hkv, D]: batch and heads as storage
    n = len(lead)
    sink = P(*ref[: n + 1], None, ref[n + 1], None)
    common.update(k_sink=sink, v_sink=sink)
  if isinstance(cache, VQCache):
    # Codebooks [Hkv, S, n, E, v] go with their kv heads, replicated over "data".
    books = P(ref[1], *([None] * (cache.k_codebook.ndim - 1)))
    return dataclasses.replace(cache, k_codes=storage(cache.k_codes),
                               v_codes=storage(cache.v_codes), k_codebook=books,
                               v_codebook=books, **common)
  return dataclasses.replace(cache, k=side(cache.k), v=side(cache.v), **common)


def cache_shardings(cache, mesh: Mesh):
  """`NamedSharding`s of a cache (see `cache_specs`)."""
  return named(mesh, cache_specs(cache, mesh))


def check_mesh(mesh, *, optional: bool = False) -> None:
  """TypeError unless ``mesh`` is a `jax.sharding.Mesh` (`make_mesh`), or None when ``optional``."""
  if not (isinstance(mesh, Mesh) or (optional and mesh is None)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh (jaxkv.make_mesh)"
                    f"{' or None' if optional else ''}, got {mesh!r}")


def shard_cache(cache, mesh: Mesh):
  """Places a `ModelCache` / `KVCache` / `VQCache` on ``mesh`` (`cache_specs`); returns it placed."""
  check_mesh(mesh)
  return jax.device_put(cache, cache_shardings(cache, mesh))


def init_sharded(init_fn: Callable[[], Any], mesh: Mesh):
  """Builds the cache ``init_fn()`` returns directly in its `cache_specs` placement.

  Each device allocates only its shard (``jax.jit`` with ``out_shardings``),
  never the whole cache, e.g.
  ``init_sharded(lambda: model.init_cache("kivi4", 64, 131072), mesh)``.
  """
  check_mesh(mesh)
  shapes = jax.eval_shape(init_fn)
  return jax.jit(init_fn, out_shardings=cache_shardings(shapes, mesh))()


def heads_spec(cache, mesh: Mesh) -> P:
  """Spec of ``[B, T, H, D]`` activations (q, k, v, attention output) matching the cache.

  Batch over ``"data"`` and heads over ``"model"`` exactly when the cache's
  batch and kv-head axes are (a query head lives with its KV head).
  """
  from jaxkv.model_cache import LayerView  # pylint: disable=import-outside-toplevel
  stacked = cache.stacked if isinstance(cache, LayerView) else cache
  res = cache_specs(stacked, mesh).k_residual
  batch_axis, head_axis = res[-4], res[-3]   # [..., B, Hkv, R, D]
  return P(batch_axis, None, head_axis, None)


# ---------------------------------------------------------------- shard_map
def shard_map(fn: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
  """`jax.shard_map` (JAX >= 0.7) or `jax.experimental.shard_map.shard_map` (older).

  Replication checking is off: Pallas kernels and `lax.cond` inside ``fn``
  have no replication rules on every JAX version.
  """
  if hasattr(jax, "shard_map"):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
  from jax.experimental.shard_map import shard_map as legacy  # pylint: disable=import-outside-toplevel
  return legacy(fn, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def per_shard_attend(fn: Callable, mesh: Mesh, cache, plan, num_seq_args: int = 0
                     ) -> Callable:
  """Wraps a layer's ``fn(q, k, v, cache, index, plan, *seq_args) -> (o, cache)`` in `shard_map`.

  ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]`` and ``o [B, T, Hq, D]`` are
  split like the cache (`heads_spec`); the cache and the plan by
  `cache_specs`; the layer index is replicated; ``num_seq_args`` trailing
  ``[B]`` arrays are split like the batch. Inside, ``fn`` sees one device's
  sequences and heads as ordinary arrays (so the append and the Pallas
  kernels run unchanged) and no collective touches the cache. ``fn`` must not
  close over batch-sized arrays (pass them as ``seq_args``).
  """
  act = heads_spec(cache, mesh)
  c_spec, p_spec = cache_specs(cache, mesh), cache_specs(plan, mesh)
  seq = (P(act[0]),) * num_seq_args
  return shard_map(fn, mesh, in_specs=(act, act, act, c_spec, P(), p_spec, *seq),
                   out_specs=(act, c_spec))


def sharded_decode_attention(q: jax.Array, cache, mesh: Mesh, **kwargs) -> jax.Array:
  """`jaxkv.decode_attention` run per shard of ``mesh`` (no gather of the cache).

  Args:
    q: ``[B, S, Hq, D]``.
    cache: a `KVCache` (any format, QuantSpec's hierarchical one too), a
      `VQCache` or a `ModelCache.layer_view` sharded as `cache_specs` says
      (other placements are resharded to it).
    mesh: a `make_mesh` mesh.
    **kwargs: `jaxkv.decode_attention` keywords (``scale``,
      ``implementation``, ``config``); a traced ``scale`` is replicated.
  Returns:
    ``[B, S, Hq, D]`` sharded like the cache's batch and heads.
  """
  from jaxkv.attention import decode_attention  # pylint: disable=import-outside-toplevel
  check_mesh(mesh)
  act = heads_spec(cache, mesh)
  scale = kwargs.pop("scale", None)
  if isinstance(scale, jax.Array):
    fn = lambda q, c, s: decode_attention(q, c, scale=s, **kwargs)  # noqa: E731
    return shard_map(fn, mesh, (act, cache_specs(cache, mesh), P()), act)(q, cache, scale)
  fn = lambda q, c: decode_attention(q, c, scale=scale, **kwargs)  # noqa: E731
  return shard_map(fn, mesh, (act, cache_specs(cache, mesh)), act)(q, cache)


def constrain_cache(cache, mesh: Mesh | None) -> Any:
  """``with_sharding_constraint`` of a cache to `cache_shardings` (identity without a mesh)."""
  if mesh is None:
    return cache
  return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))


__all__ = [
    "LOGICAL_AXIS_RULES", "MESH_AXES", "cache_shardings", "cache_specs", "constrain_cache",
    "heads_spec", "init_sharded", "logical_spec", "make_mesh", "mesh_from_spec", "named", "parse_mesh",
    "per_shard_attend", "shard_cache", "shard_map", "sharded_decode_attention",
]
