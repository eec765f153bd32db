"""Autotuning of the Pallas decode-attention kernels on the current GPU.

`autotune` times every candidate `DecodeAttentionConfig` on the caller's own
``q`` and cache and returns the fastest; results can be kept in a JSON file
keyed by GPU name, format and shape (`save_config` / `load_config`).

Timing: `kernel_time` (used by `autotune` and the benchmarks) reads the GPU
kernels' own durations from a profiler trace (CUPTI), so the host's dispatch
cost, which is tens of microseconds per executable, is not in the figure.
`device_time` is the older wall-clock method kept for comparison: it hides
the dispatch behind a lead matmul but still over-reports small calls.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import glob
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

# A module import, not a name import: `import pallas_kernels` first loads jaxkv
# (for the reference quantizer), which must not need pallas_kernels' names yet.
import pallas_kernels as pk


def _lead(big: jax.Array) -> jax.Array:
  """A chain of matmuls (about 1-2 ms on an H100) for the GPU to chew on."""
  y = big
  for _ in range(_LEAD_MATMULS):
    y = jnp.tanh(y @ big)
  return y[:1, :1]


_LEAD_MATMULS = 8
_LEAD_DIM = 4096


def _gpu_kernel_events(trace_dir: str) -> list[tuple[str, float, float]]:
  """(name, start_ns, duration_ns) of every kernel/memcpy on a GPU stream."""
  from jax.profiler import ProfileData  # jax >= 0.4.3x
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  events = []
  if not paths:
    return events
  for plane in ProfileData.from_file(paths[-1]).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if line.name.startswith("Stream"):
        events.extend((ev.name, ev.start_ns, ev.duration_ns) for ev in line.events)
  return events


def kernel_time(fn: Callable, args_list: Sequence[tuple], *, calls: int = 20,
                warmup: int = 1) -> dict:
  """GPU time of one ``fn(*args)`` call from the profiler's kernel records.

  ``fn`` is jitted once; ``calls`` calls are dispatched back to back, cycling
  through ``args_list`` (pass copies of large inputs so that none is still in
  L2 when it is read again), under `jax.profiler` tracing. Compilation and
  warm-up are excluded.

  Returns:
    ``"kernel"``: summed duration of the GPU kernels (and memsets/copies) of
    one call, in seconds, the figure to compare; ``"span"``: first kernel
    start to last kernel end, per call (adds the gaps between kernels, and
    any time the GPU waited for the host); ``"kernels"``: kernels per call;
    ``"wall"``: host wall-clock per call of the same loop (one sync at the
    end); ``"compile"``: seconds to compile. Where the trace has no GPU
    stream (a CPU backend), ``"kernel"`` and ``"span"`` fall back to
    ``"wall"`` and ``"kernels"`` is 0.
  """
  args_list = [tuple(a) for a in args_list]
  if not args_list:
    raise ValueError("args_list must hold at least one argument tuple")
  if calls < 1:
    raise ValueError(f"calls={calls} must be >= 1")
  jitted = jax.jit(fn)
  t0 = time.perf_counter()
  compiled = jitted.lower(*args_list[0]).compile()
  compile_s = time.perf_counter() - t0
  for i in range(max(warmup, 1) * len(args_list)):
    jax.block_until_ready(compiled(*args_list[i % len(args_list)]))
  trace_dir = tempfile.mkdtemp(prefix="jaxkv-trace-")
  try:
    jax.profiler.start_trace(trace_dir)
    try:
      t0 = time.perf_counter()
      out = None
      for i in range(calls):
        out = compiled(*args_list[i % len(args_list)])
      jax.block_until_ready(out)
      wall = (time.perf_counter() - t0) / calls
    finally:
      jax.profiler.stop_trace()
    events = _gpu_kernel_events(trace_dir)
  finally:
    shutil.rmtree(trace_dir, ignore_errors=True)
  if not events:
    return {"kernel": wall, "span": wall, "kernels": 0, "wall": wall, "compile": compile_s}
  busy = sum(d for _, _, d in events) / calls / 1e9
  span = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) / calls / 1e9
  return {"kernel": busy, "span": span, "kernels": len(events) / calls, "wall": wall,
          "compile": compile_s}


def device_time(fn: Callable, firsts: Sequence, *rest, reps: int = 10, warmup: int = 2,
                hide_dispatch: bool | None = None) -> dict:
  """Device time of one ``fn(first, *rest)`` call, in seconds.

  Traces ``len(firsts)`` back-to-back calls (one per distinct first argument,
  so none is elided and no extra op runs between them) into one jitted
  function and times ``reps`` dispatches of it with ``block_until_ready``;
  compilation and warm-up are excluded and reported separately.

  A dispatch + sync of one executable costs the host tens of microseconds,
  which wall-clock time spreads over the calls. With ``hide_dispatch`` (the
  default on a GPU) every timed dispatch first runs a ~ms matmul chain that
  the calls wait behind (an optimization barrier), so the host has enqueued
  them all before the GPU reaches them; the chain timed alone, in the same
  rep, is subtracted. The result is the GPU's time per call back to back,
  launch gaps between kernels included.

  Returns:
    ``{"median", "min", "max"}`` seconds per call of ``fn`` (dispatch hidden
    when ``hide_dispatch``), ``"wall"`` the median plain wall-clock per call
    and ``"compile"`` the compile time.
  """
  firsts = list(firsts)
  n = len(firsts)
  if hide_dispatch is None:
    hide_dispatch = jax.default_backend() == "gpu"

  @jax.jit
  def many(firsts_, *rest_args):
    return [fn(x, *rest_args) for x in firsts_]

  t0 = time.perf_counter()
  compiled = many.lower(firsts, *rest).compile()
  compile_s = time.perf_counter() - t0

  def run(f, *args):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t0

  for _ in range(warmup):
    run(compiled, firsts, *rest)
  wall = [run(compiled, firsts, *rest) / n for _ in range(reps)]
  if not hide_dispatch:
    times = wall
  else:
    big = jax.random.normal(jax.random.PRNGKey(0), (_LEAD_DIM, _LEAD_DIM), jnp.bfloat16)
    big = big * (_LEAD_DIM ** -0.5)

    @jax.jit
    def led(big_, firsts_, *rest_args):
      y, firsts_ = jax.lax.optimization_barrier((_lead(big_), firsts_))
      return y, [fn(x, *rest_args) for x in firsts_]

    lead_c = jax.jit(_lead).lower(big).compile()
    led_c = led.lower(big, firsts, *rest).compile()
    for _ in range(warmup):
      run(lead_c, big)
      run(led_c, big, firsts, *rest)
    times = []
    for _ in range(reps):
      t_lead = run(lead_c, big)
      times.append((run(led_c, big, firsts, *rest) - t_lead) / n)
  return {"median": statistics.median(times), "min": min(times), "max": max(times),
          "wall": statistics.median(wall), "compile": compile_s}


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
      blocks, splits, (2, 4), (2, 3), (True, False)):
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
