"""Timing of GPU work for the autotuner and the benchmarks.

`kernel_time` reads the GPU kernels' own durations from a profiler trace
(CUPTI), so the host's dispatch cost, which is tens of microseconds per
executable, is not in the figure. `device_time` is the older wall-clock
method kept for comparison: it hides the dispatch behind a lead matmul but
still over-reports small calls. `gpu_kernel_events` lists a trace's kernels.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import statistics
import tempfile
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxkv.cache import check_int


def _lead(big: jax.Array) -> jax.Array:
  """A chain of matmuls (about 1-2 ms on an H100) for the GPU to chew on."""
  y = big
  for _ in range(_LEAD_MATMULS):
    y = jnp.tanh(y @ big)
  return y[:1, :1]


_LEAD_MATMULS = 8
_LEAD_DIM = 4096


def gpu_kernel_events(trace_dir: str, *, details: bool = False) -> list[tuple]:
  """(name, start_ns, duration_ns) of every kernel/memcpy on a GPU stream.

  With ``details``, each tuple also holds the GPU (the trace plane's name)
  and the event's CUPTI stats as a dict (``hlo_module``, ``hlo_op``,
  ``memcpy_details``, ...).
  """
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
        events.extend((ev.name, ev.start_ns, ev.duration_ns)
                      + ((plane.name, dict(ev.stats)) if details else ())
                      for ev in line.events)
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
    end); ``"compile"``: seconds to compile; ``"by_name"``: seconds per call
    of each kernel name (empty without a GPU stream). Where the trace has no GPU
    stream (a CPU backend), ``"kernel"`` and ``"span"`` fall back to
    ``"wall"`` and ``"kernels"`` is 0.
  """
  args_list = [tuple(a) for a in args_list]
  if not args_list:
    raise ValueError("args_list must hold at least one argument tuple")
  check_int("calls", calls)
  check_int("warmup", warmup, 0)
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
    events = gpu_kernel_events(trace_dir)
  finally:
    shutil.rmtree(trace_dir, ignore_errors=True)
  if not events:
    return {"kernel": wall, "span": wall, "kernels": 0, "wall": wall, "compile": compile_s,
            "by_name": {}}
  busy = sum(d for _, _, d in events) / calls / 1e9
  span = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) / calls / 1e9
  by_name: dict[str, float] = {}
  for name, _, d in events:
    by_name[name] = by_name.get(name, 0.0) + d / calls / 1e9
  return {"kernel": busy, "span": span, "kernels": len(events) / calls, "wall": wall,
          "compile": compile_s, "by_name": by_name}


def hbm_read_probe(nbytes: int = 4 << 30, *, calls: int = 5) -> dict[str, float]:
  """HBM read bandwidth (bytes/s) reached by plain XLA kernels over ``nbytes`` of bf16.

  Four read-bound programs, each timed by `kernel_time` (profiler kernel
  time): a full sum, row sums of ``[n / 8192, 8192]``, and the two matrix-
  vector products a decode step's weight reads are made of (``v @ W`` and
  ``W @ v``, ``W`` ``[n / 8192, 8192]``). Returns each probe's bandwidth and
  ``"best"``, their maximum: the bandwidth the bytes floors divide by. One
  reduction alone under-reports what the GPU sustains (H100, jax 0.11.2:
  a bf16 ``jnp.sum`` 2.56-2.78 TB/s while the model's weight GEMVs read
  ~3.07 TB/s), which would make floors too generous.
  """
  cols = 8192
  rows = max(1, nbytes // 2 // cols)
  w = jax.random.uniform(jax.random.PRNGKey(7), (rows, cols), jnp.bfloat16)
  read = rows * cols * 2
  v_rows = jnp.ones((1, rows), jnp.bfloat16)
  v_cols = jnp.ones((cols, 1), jnp.bfloat16)
  probes = {
      "sum": (lambda a: jnp.sum(a, dtype=jnp.float32), (w,)),
      "row_sum": (lambda a: jnp.sum(a, axis=1, dtype=jnp.float32), (w,)),
      "gemv_vw": (lambda a, v: v @ a, (w, v_rows)),
      "gemv_wv": (lambda a, v: a @ v, (w, v_cols)),
  }
  out = {}
  for name, (fn, args) in probes.items():
    out[name] = read / kernel_time(fn, [args], calls=calls)["kernel"]
  del w
  out["best"] = max(out.values())
  return out


def device_time(fn: Callable, firsts: Sequence, *rest, reps: int = 10, warmup: int = 2,
                hide_dispatch: bool | None = None,
                compiler_options: dict | None = None) -> dict:
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
  launch gaps between kernels included. ``compiler_options`` (XLA options,
  as for ``jax.jit``) apply to the program of the calls.

  Returns:
    ``{"median", "min", "max"}`` seconds per call of ``fn`` (dispatch hidden
    when ``hide_dispatch``), ``"wall"`` the median plain wall-clock per call
    and ``"compile"`` the compile time.
  """
  firsts = list(firsts)
  n = len(firsts)
  if not n:
    raise ValueError("firsts must hold at least one first argument")
  check_int("reps", reps)
  check_int("warmup", warmup, 0)
  if hide_dispatch is None:
    hide_dispatch = jax.default_backend() == "gpu"

  @functools.partial(jax.jit, compiler_options=compiler_options)
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

    @functools.partial(jax.jit, compiler_options=compiler_options)
    def led(big_, firsts_, *rest_args):
      y, firsts_ = jax.lax.optimization_barrier((_lead(big_), firsts_))
      return y, [fn(x, *rest_args) for x in firsts_]

    lead_c = jax.jit(_lead, compiler_options=compiler_options).lower(big).compile()
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


def peak_bytes() -> int | None:
  """The first device's peak bytes in use so far in this process (monotone), or
  None where the backend keeps no statistics (CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


__all__ = ["device_time", "gpu_kernel_events", "kernel_time", "peak_bytes"]
