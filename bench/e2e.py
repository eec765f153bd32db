"""End-to-end Llama decode on quantized KV caches, against its bytes floor.

Llama-3.1-8B shapes with random bf16 weights (`models.llama.random_model`),
the model-level cache `jaxkv.ModelCache`, per format (bf16, int8, k8v4,
kivi4, kivi2):

1. B=1 decode step at contexts 4K..128K, timed two ways: inside one jitted
   multi-step loop (`jaxkv.decode_steps`, the way `generate` runs: no host
   dispatch between steps) and per call of one jitted, cache-donating step
   (adds the host dispatch of every call). Each is printed beside its bytes
   floor: (weight bytes + cache bytes the step reads) / HBM read bandwidth,
   the bandwidth measured in the same run: the best of four read-bound XLA
   kernels (`jaxkv.timing.hbm_read_probe`: sums and bf16 GEMVs).
2. At 32K context: the largest batch whose cache fits next to the weights,
   per format, and the decode tokens/s it reaches (loop timing).
3. Prompt prefill, one shot vs in chunks (``--prefill-chunk``, 4K), 8K..128K.

The decode caches are filled with random N(0, 1) K/V written through
`ModelCache.append_layer` in chunks (recorded as ``cache_fill``), not by
running the model over a 128K prompt. Compile time is measured apart; step
times are medians over ``--steps`` (min and max kept in the JSON).

``--profile DIR`` writes a `jax.profiler` trace of a few decode steps per
format and prints device time per step grouped by kernel family (weight
GEMV/matmul, attention kernels, cache update/flush/pack, copies, other),
parsed from the trace (GPU stream events; on CPU the XLA thunk events).

Results: ``bench/results/e2e-<gpu>-<date>.json`` (GPU name and versions
inside) plus PNG plots; a short table is printed last. ``--quick`` runs the
cases the issue's targets need. A ``--time-budget`` skips (and records)
whatever does not fit; the most important cases run first.

CPU smoke run (tiny model, a minute)::

  python bench/e2e.py --config tiny --contexts 512,1024 --batch-context 1024 \
      --max-batch 4 --prefill-lens 1024 --prefill-chunk 256 --steps 3 \
      --profile /tmp/e2e-trace
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")  # before jax starts

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import decoding  # noqa: E402
from jaxkv import timing  # noqa: E402
from jaxkv import vq_attention  # noqa: E402,F401  (jaxkv.vq_attention.resolve)
from jaxkv.decoding import as_format, cache_nbytes, decode_step  # noqa: E402
from models import llama  # noqa: E402
import pallas_kernels as pk  # noqa: E402

CONTEXTS = (4096, 16384, 32768, 65536, 131072)
FORMATS = ("bf16", "int8", "k8v4", "kivi4", "kivi2")
QUICK_CONTEXTS = (32768, 131072)
QUICK_FORMATS = ("bf16", "kivi4", "kivi2")
PREFILL_LENS = "8192,32768,131072"
BATCH_CONTEXT = 32768
TARGETS = {  # issue 4
    "b1_128k_kivi4_speedup_vs_bf16": 1.45,
    "maxbatch_32k_kivi4_throughput_vs_bf16": 2.9,
    "maxbatch_32k_kivi2_throughput_vs_bf16": 4.2,
}
FILL_TOKENS = 1 << 15  # batch * chunk tokens of random K/V per fill call (its temporaries
# scale with it: 1 << 18 needed ~10 GiB at kivi4 B=41 and OOMed the max-batch cases)
FAMILIES = ("weights", "attention", "cache_update", "copies", "collectives", "other")


def _jaxlib_version():
  try:
    import jaxlib  # pylint: disable=import-outside-toplevel
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return None


def _is_oom(e: Exception) -> bool:
  msg = str(e)
  return "RESOURCE_EXHAUSTED" in msg or "Out of memory" in msg or "out of memory" in msg


# ------------------------------------------------------------- bandwidth
def weight_bytes(model) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(nnx.state(model)))


def cache_read_bytes(cache: jaxkv.ModelCache, context: int, view: str = "target") -> int:
  """Bytes one decode step reads from the cache: packed tokens plus the residual block.

  ``view="draft"`` (hierarchical formats): the upper 4-bit plane only.
  """
  fmt = cache.fmt
  dtype_bytes = jnp.dtype(cache.dtype).itemsize
  packed = fmt.packed_len(context)
  if isinstance(fmt, jaxkv.VQFormat):  # codes, and each layer's codebooks once
    per_token = fmt.bytes_per_token(cache.kv_heads, cache.head_dim,
                                    context=max(1, packed * cache.batch))
  else:
    per_token = fmt.bytes_per_token(cache.kv_heads, cache.head_dim, dtype_bytes, view=view)
  residual = 2 * cache.kv_heads * fmt.residual * cache.head_dim * dtype_bytes
  return int(cache.num_layers * cache.batch * (per_token * packed + residual))


# ------------------------------------------------------------------ jitted
@functools.partial(jax.jit, donate_argnames="cache", static_argnames="chunk")
def _fill_chunk(cache, key, *, chunk: int):
  """Appends ``chunk`` random N(0,1) tokens to every sequence of every layer."""
  plan = cache.plan_append(jnp.full((cache.batch,), chunk, jnp.int32))
  shape = (cache.batch, chunk, cache.kv_heads, cache.head_dim)

  def layer(i, cache):
    kk, kv = jax.random.split(jax.random.fold_in(key, i))
    k = jax.random.normal(kk, shape, jnp.float32).astype(cache.dtype)
    v = jax.random.normal(kv, shape, jnp.float32).astype(cache.dtype)
    return cache.append_layer(i, k, v, plan)

  return jax.lax.fori_loop(0, cache.num_layers, layer, cache).commit(plan)


# `--mesh`: a `jaxkv.make_mesh` mesh the model, caches and attention are sharded on.
MESH = None


@decoding.jit_by_rows(donate_argnames="cache", static_argnames=("implementation", "mesh"))
def _decode_program(graphdef, state, tokens, cache, *, implementation=None, mesh=None):
  logits, cache = decode_step(nnx.merge(graphdef, state), tokens, cache,
                              implementation=implementation, mesh=mesh)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def _decode(graphdef, state, tokens, cache, **kwargs):
  """One jitted greedy decode step, with the decode programs' options for ``tokens [B]``."""
  rows = decoding.program_rows(tokens.shape[0], kwargs.get("mesh"))
  return _decode_program.at(rows)(graphdef, state, tokens, cache, **kwargs)


@functools.partial(jax.jit, donate_argnames="cache", static_argnames=("chunk_size", "mesh"))
def _prefill(graphdef, state, tokens, lengths, cache, *, chunk_size=None, mesh=None):
  logits, cache = nnx.merge(graphdef, state).prefill(tokens, lengths, cache,
                                                     chunk_size=chunk_size, mesh=mesh)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def init_cache(model, fmt, batch: int, capacity: int):
  """``model.init_cache`` (on ``MESH`` when set); a VQ format gets random N(0, 1)
  codebooks (timing only: the entries do not matter to the kernels' speed)."""
  extra = {}
  if isinstance(fmt, jaxkv.VQFormat):
    c = model.config
    keys = jax.random.split(jax.random.key(7), 2)
    extra["codebooks"] = jaxkv.VQCodebooks(fmt=fmt, **{
        side: jax.random.normal(key, (c.num_layers, *fmt.codebook_shape(
            side, c.num_kv_heads, c.head_dim)), jnp.float32).astype(fmt.codebook_dtype)
        for side, key in zip("kv", keys)})
  if MESH is None:
    return model.init_cache(fmt, batch, capacity, **extra)
  return jaxkv.sharding.init_sharded(lambda: model.init_cache(fmt, batch, capacity, **extra),
                                     MESH)


def attention_implementation(model, cache, implementation) -> str:
  """The implementation `decode_attention` picks for a decode step over ``cache``."""
  q = jnp.zeros((cache.batch, 1, model.config.num_heads, cache.head_dim), cache.dtype)
  view = cache.layer_view(0)
  if isinstance(cache.fmt, jaxkv.VQFormat):
    return jaxkv.vq_attention.resolve(q, view.materialize(), implementation)
  return jaxkv.attention.resolve_implementation(q, view, implementation)


def fill_cache(model, fmt, batch: int, context: int, capacity: int, seed: int):
  """A `ModelCache` (`VQModelCache`) holding ``context`` random tokens per sequence."""
  cache = init_cache(model, fmt, batch, capacity)
  key = jax.random.key(seed)
  chunk = max(128, min(context, (FILL_TOKENS // batch) // 128 * 128))
  done = 0
  while done < context:
    n = min(chunk, context - done)
    key, sub = jax.random.split(key)
    cache = _fill_chunk(cache, sub, chunk=n)
    done += n
  jax.block_until_ready(cache)
  return cache


def _stats(times_s) -> dict:
  t = np.asarray(times_s) * 1e6
  return dict(median_us=float(np.median(t)), min_us=float(t.min()), max_us=float(t.max()),
              steps=len(t))


def time_decode_calls(graphdef, state, cache, tokens, *, steps: int, warmup: int,
                      implementation=None):
  """Per-call time of one jitted, cache-donating decode step (host dispatch included)."""
  t0 = time.perf_counter()
  tokens, cache = _decode(graphdef, state, tokens, cache, implementation=implementation,
                            mesh=MESH)
  tokens.block_until_ready()
  compile_s = time.perf_counter() - t0
  for _ in range(warmup):
    tokens, cache = _decode(graphdef, state, tokens, cache, implementation=implementation,
                            mesh=MESH)
  tokens.block_until_ready()
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    tokens, cache = _decode(graphdef, state, tokens, cache, implementation=implementation,
                            mesh=MESH)
    tokens.block_until_ready()
    times.append(time.perf_counter() - t0)
  return dict(compile_plus_first_step_s=compile_s, **_stats(times)), tokens, cache


def attention_config(num_heads: int, cache) -> dict:
  """The split kernel's launch config a decode step over ``cache`` uses, and its
  source (`pk.default_config`: the shipped tuned table or the heuristic)."""
  config, source = pk.default_config(
      cache.fmt, batch=cache.batch, q_heads=num_heads, kv_heads=cache.kv_heads,
      head_dim=cache.head_dim, num_queries=1, capacity=cache.k.codes.shape[3],
      itemsize=jnp.dtype(cache.dtype).itemsize)
  return dict(source=source, **dataclasses.asdict(config))


def time_decode_loop(model, cache, tokens, *, loop_steps: int, reps: int, implementation=None):
  """Per-step time inside one jitted `decode_steps` loop of ``loop_steps`` steps."""
  t0 = time.perf_counter()
  out, _, cache = jaxkv.decode_steps(model, tokens, cache, loop_steps,
                                     implementation=implementation, mesh=MESH)
  out.block_until_ready()
  compile_s = time.perf_counter() - t0
  times = []
  for rep in range(reps + 1):  # rep 0 warms (the first call after compile runs slower)
    last = out[:, -1]  # sliced outside the timed region (its own dispatch, first use compiles)
    last.block_until_ready()
    t0 = time.perf_counter()
    out, _, cache = jaxkv.decode_steps(model, last, cache, loop_steps,
                                       implementation=implementation, mesh=MESH)
    out.block_until_ready()
    if rep:
      times.append((time.perf_counter() - t0) / loop_steps)
  return dict(compile_plus_first_loop_s=compile_s, loop_steps=loop_steps,
              **_stats(times)), out[:, -1], cache


# ----------------------------------------------------------------- profile
def _classify(name: str) -> str:
  n = name.lower()
  if any(k in n for k in ("dequant", "attention", "combine", "flash", "fmha", "cudnn")):
    return "attention"
  if any(k in n for k in ("gemv", "gemm", "matmul", "dot", "cublas", "cutlass", "nvjet",
                          "xmma", "ynn_fusion")):
    return "weights"
  if any(k in n for k in ("scatter", "dynamic_update_slice", "dynamic-update-slice",
                          "quantize", "pack", "flush", "residual_write")):
    return "cache_update"
  if any(k in n for k in ("nccl", "all-reduce", "allreduce", "all-gather", "allgather",
                          "reduce-scatter", "reducescatter", "all-to-all")):
    return "collectives"
  if "copy" in n or "memcpy" in n or "memset" in n:
    return "copies"
  return "other"


def _trace_events(trace_dir: str) -> tuple[list[tuple[str, float]], str, int, dict]:
  """What a trace holds: ``(events, source, devices, memcpy_sources)``.

  ``events``: ``[(name, duration_ns)]`` of device kernels (GPU) or XLA thunks
  (CPU); ``devices``: GPUs with stream events (0 on CPU); ``memcpy_sources``:
  ``"<hlo_module> / <hlo_op> / <memcpy_details>"`` (the CUPTI stats of each
  ``Memcpy*`` event) -> ``[count, total_us]``.
  """
  from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  from jaxkv.timing import gpu_kernel_events  # pylint: disable=import-outside-toplevel
  gpu = gpu_kernel_events(trace_dir, details=True)
  if gpu:
    sources = collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur, _, stats in gpu:
      if "memcpy" in name.lower():
        key = " / ".join(str(stats.get(k, "?"))
                         for k in ("hlo_module", "hlo_op", "memcpy_details"))
        sources[key][0] += 1
        sources[key][1] += dur / 1e3
    return ([(n, d) for n, _, d, _, _ in gpu], "gpu streams (CUPTI)",
            len({dev for _, _, _, dev, _ in gpu}), dict(sources))
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  events = []
  for plane in ProfileData.from_file(paths[-1]).planes if paths else []:
    if not plane.name.startswith("/host:CPU"):
      continue
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):
        continue
      for ev in line.events:
        if ev.name.startswith(("ThreadpoolListener", "ThunkExecutor", "end: ")):
          continue
        events.append((ev.name, ev.duration_ns))
  return events, "host XLA thunks (CPU)", 0, {}


def _profile(run, trace_dir: str, steps: int) -> dict:
  """Device time per step and device by family while ``run()`` runs ``steps`` decode steps.

  On a mesh the kernels of every GPU are in the trace: the figures are their
  sum divided by the number of GPUs (time per step on one GPU, on average).
  """
  os.makedirs(trace_dir, exist_ok=True)
  jax.profiler.start_trace(trace_dir)
  try:
    run()
  finally:
    jax.profiler.stop_trace()
  events, source, devices, memcpy = _trace_events(trace_dir)
  per = steps * max(devices, 1)
  per_family = collections.defaultdict(float)
  top = collections.defaultdict(float)
  count = collections.Counter()
  for name, dur in events:
    per_family[_classify(name)] += dur / per / 1e3  # us per step and device
    top[name] += dur / per / 1e3
    count[name] += 1
  memcpy = dict(sorted(memcpy.items(), key=lambda kv: -kv[1][1])[:10])
  return dict(source=source, trace_dir=trace_dir, steps=steps, devices=devices,
              family_us_per_step={f: per_family.get(f, 0.0) for f in FAMILIES},
              top_kernels_us_per_step=dict(sorted(top.items(), key=lambda kv: -kv[1])[:15]),
              kernels_per_step=len(events) / per,
              # every kernel: [us per step, launches per step], longest first
              kernels={n: [round(us, 2), count[n] / per]
                       for n, us in sorted(top.items(), key=lambda kv: -kv[1])},
              memcpy_sources={k: dict(count=c, us_per_step=us / per) for k, (c, us) in
                              memcpy.items()})


def profile_decode(model, cache, tokens, trace_dir: str, steps: int, loop_steps: int,
                   implementation=None) -> tuple[dict, dict, object]:
  """Traces ``steps`` per-call decode steps and one ``decode_steps`` loop (both warm).

  Returns ``(per_call_profile, loop_profile, cache)``.
  """
  graphdef, state = decoding._split(model)  # pylint: disable=protected-access
  box = dict(tokens=tokens, cache=cache)

  def calls():
    for _ in range(steps):
      box["tokens"], box["cache"] = _decode(graphdef, state, box["tokens"], box["cache"],
                                            implementation=implementation, mesh=MESH)
    box["tokens"].block_until_ready()

  def loop():
    out, _, box["cache"] = jaxkv.decode_steps(model, box["tokens"], box["cache"], loop_steps,
                                              implementation=implementation, mesh=MESH)
    box["tokens"] = out[:, -1]
    box["tokens"].block_until_ready()

  calls()  # warm (both programs were compiled by the timed cases)
  per_call = _profile(calls, trace_dir + "-calls", steps)
  in_loop = _profile(loop, trace_dir + "-loop", loop_steps)
  return per_call, in_loop, box["cache"]


# ------------------------------------------------------------------- cases
class Runner:
  """Runs cases in priority order under a time budget; records every outcome."""

  def __init__(self, args, model, bandwidth: float):
    self.args = args
    self.model = model
    # decode_steps is timed as a loop-driving user should call it: split once.
    self.split = jaxkv.SplitModel(model)
    self.graphdef, self.state = self.split.graphdef, self.split.state
    self.weight_bytes = weight_bytes(model)
    self.bandwidth = bandwidth
    self.start = args.started  # the whole run's clock: the max-batch children count too
    self.skipped = []
    self.memory_note = {}
    self.profiles = []

  def over_budget(self, what: str) -> bool:
    elapsed = time.perf_counter() - self.start
    if elapsed > self.args.time_budget:
      self.skipped.append(dict(case=what, reason=f"time budget ({elapsed:.0f}s elapsed)"))
      print(f"  skip {what}: time budget", flush=True)
      return True
    return False

  def _capacity(self, context: int) -> int:
    a = self.args
    alts = len(a.alt_implementations)
    # compile + warm loop per implementation (the main one twice with alternatives),
    # the profile one more
    loops = (a.reps + 2) * (1 + alts + (1 if alts else 0)) + (1 if a.profile else 0)
    return context + loops * a.loop_steps + a.warmup + a.steps + 2 * a.profile_steps + 8

  def decode_case(self, fmt_name: str, context: int, batch: int) -> dict:
    a = self.args
    fmt = as_format(fmt_name)
    capacity = self._capacity(context)
    row = dict(format=fmt_name, context=context, batch=batch, capacity=capacity,
               cache_bytes=cache_nbytes(self.model, fmt, batch, capacity))
    t0 = time.perf_counter()
    cache = fill_cache(self.model, fmt, batch, context, capacity, seed=context + batch)
    row["fill_s"] = time.perf_counter() - t0
    row["cache_read_bytes"] = cache_read_bytes(cache, context)
    if jax.default_backend() == "gpu":
      row["attention_implementation"] = attention_implementation(self.model, cache,
                                                                 a.implementation)
      if row["attention_implementation"] == "triton" and not isinstance(fmt, jaxkv.VQFormat):
        row["attention_config"] = attention_config(self.model.config.num_heads, cache)
    row["weight_bytes"] = self.weight_bytes
    w_split, c_split = self.splits(batch)
    row["floor_us"] = (self.weight_bytes / w_split + row["cache_read_bytes"] / c_split) \
        / self.bandwidth * 1e6
    if MESH is not None:
      row["mesh"] = dict(MESH.shape)
      row["floor_note"] = (f"per device: weights / {w_split}, cache / {c_split}; "
                           "collectives not included")
    tokens = jnp.asarray(np.random.default_rng(context).integers(
        0, self.model.config.vocab_size, (batch,)), jnp.int32)
    loop, tokens, cache = time_decode_loop(self.split, cache, tokens, loop_steps=a.loop_steps,
                                           reps=a.reps, implementation=a.implementation)
    calls, tokens, cache = time_decode_calls(self.graphdef, self.state, cache, tokens,
                                             steps=a.steps, warmup=a.warmup,
                                             implementation=a.implementation)
    # --implementations: each alternative in the same loop over the same cache,
    # then the main implementation once more (drift check).
    if a.alt_implementations:
      row["alt_loops"] = {}
      for impl in a.alt_implementations:
        row["alt_loops"][impl], tokens, cache = time_decode_loop(
            self.split, cache, tokens, loop_steps=a.loop_steps, reps=a.reps, implementation=impl)
      again, tokens, cache = time_decode_loop(self.split, cache, tokens, loop_steps=a.loop_steps,
                                              reps=a.reps, implementation=a.implementation)
      row["alt_loops"][f"{a.implementation or 'default'} (again)"] = again
    # Profiled: the longest B=1 context, and each max-batch child's case.
    if a.profile and a.profile_steps and (
        a.batch_only or (batch == 1 and context == max(self.args.context_list, default=None))):
      prof, loop_prof, cache = profile_decode(
          self.split, cache, tokens, os.path.join(a.profile, f"{fmt_name}-{context}-b{batch}"),
          a.profile_steps, a.loop_steps, implementation=a.implementation)
      prof.update(format=fmt_name, context=context, batch=batch, mode="per_call",
                  in_loop=loop_prof)
      self.profiles.append(prof)
    cache.check()
    del cache
    row["loop"] = loop
    row["per_call"] = calls
    row["median_us"] = loop["median_us"]
    row["per_call_median_us"] = calls["median_us"]
    row["x_floor"] = row["median_us"] / row["floor_us"]
    row["tokens_per_s"] = batch / (row["median_us"] * 1e-6)
    return row

  def splits(self, batch: int) -> tuple[int, int]:
    """Ways the weights and a batch's cache are split over ``MESH`` (1, 1 without one).

    Weights by ``"model"`` (norms replicated: negligible); the cache by kv
    heads over ``"model"`` when they divide, and by batch over ``"data"``.
    """
    if MESH is None:
      return 1, 1
    m, d = MESH.shape["model"], MESH.shape["data"]
    kv = m if self.model.config.num_kv_heads % m == 0 else 1
    return m, kv * (d if batch % d == 0 else 1)

  def max_batch(self, fmt_name: str, context: int) -> int:
    """Largest batch whose cache fits in free device memory (estimate, per device)."""
    a = self.args
    fmt = as_format(fmt_name)
    data = 1 if MESH is None else MESH.shape["data"]
    # Bytes one sequence puts on each device (its data shard holds it whole, heads split).
    per_seq = cache_nbytes(self.model, fmt, 1, self._capacity(context)) \
        / self.splits(data)[1] * data
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
      self.memory_note = dict(note="no device memory stats; used --max-batch")
      return a.max_batch
    free = limit - stats.get("bytes_in_use", 0)
    headroom = a.headroom_gb * 2**30 + 0.03 * limit
    batch = int(max(1, min(a.max_batch // data, (free - headroom) // per_seq))) * data
    self.memory_note = dict(bytes_limit=int(limit), bytes_free=int(free),
                            headroom_bytes=int(headroom), cache_bytes_per_seq=int(per_seq),
                            estimated_batch=batch)
    return batch

  def batch_case(self, fmt_name: str, context: int, batch: int | None = None,
                 retries: int = 5) -> dict:
    if batch is None:
      batch = self.max_batch(fmt_name, context)
    else:
      self.memory_note = dict(note="batch given by the parent process (--batch-size)")
    tries = []
    for _ in range(retries):
      try:
        row = self.decode_case(fmt_name, context, batch)
        row["oom_retries"] = tries
        row["memory"] = self.memory_note
        return row
      except Exception as e:  # pylint: disable=broad-except
        if not _is_oom(e) or batch == 1:
          raise
        tries.append(batch)
        print(f"  OOM at batch {batch}; retrying smaller", flush=True)
        gc.collect()
        data = 1 if MESH is None else MESH.shape["data"]
        batch = max(data, int(batch * 0.85) // data * data)
    raise RuntimeError(f"RESOURCE_EXHAUSTED: out of memory at batches {tries}")

  def prefill_case(self, fmt_name: str, prompt_len: int, chunk_size, repeats: int = 2) -> dict:
    fmt = as_format(fmt_name)
    vocab = self.model.config.vocab_size
    tokens = jnp.asarray(np.random.default_rng(prompt_len).integers(0, vocab, (1, prompt_len)),
                         jnp.int32)
    lengths = jnp.full((1,), prompt_len, jnp.int32)
    times, compile_s = [], None
    for i in range(repeats + 1):
      cache = init_cache(self.model, fmt, 1, prompt_len + 128)
      jax.block_until_ready(cache)
      t0 = time.perf_counter()
      out, cache = _prefill(self.graphdef, self.state, tokens, lengths, cache,
                            chunk_size=chunk_size, mesh=MESH)
      out.block_until_ready()
      if i == 0:
        compile_s = time.perf_counter() - t0
      else:
        times.append(time.perf_counter() - t0)
      del cache
    s = _stats(times)
    return dict(format=fmt_name, prompt_len=prompt_len, chunk_size=chunk_size,
                compile_plus_first_s=compile_s, median_ms=s["median_us"] / 1e3,
                min_ms=s["min_us"] / 1e3, max_ms=s["max_us"] / 1e3,
                tokens_per_s=prompt_len / (s["median_us"] * 1e-6))


def _guard_case(runner: Runner, what: str, fn, sink: list, errors: list):
  if runner.over_budget(what):
    return
  t0 = time.perf_counter()
  try:
    row = fn()
  except Exception as e:  # pylint: disable=broad-except
    errors.append(dict(case=what, error=f"{type(e).__name__}: {str(e)[:500]}"))
    print(f"  FAILED {what}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    gc.collect()
    return
  sink.append(row)
  if "median_us" in row:
    summary = (f"{row['median_us']:.0f} us/step in loop, {row['per_call_median_us']:.0f} us "
               f"per call, floor {row['floor_us']:.0f} us ({row['x_floor']:.2f}x)")
  else:
    summary = f"{row['median_ms']:.1f} ms"
  print(f"  {what}: {summary} (case {time.perf_counter() - t0:.1f}s)", flush=True)


def _ratio(rows, key, fmt, base="bf16", **where):
  def pick(f):
    for r in rows:
      if r["format"] == f and all(r.get(k) == v for k, v in where.items()):
        return r[key]
    return None
  a, b = pick(fmt), pick(base)
  return None if a is None or b is None else a / b


def summarize(latency, batch_rows) -> dict:
  """Speedups vs the bf16 cache: B=1 at 128K (latency) and max batch (tokens/s)."""
  s = {}
  for f in _formats(latency + batch_rows)[1:]:
    r = _ratio(latency, "median_us", "bf16", base=f, context=131072, batch=1)  # bf16 / fmt
    if r is not None:
      s[f"b1_128k_{f}_speedup_vs_bf16"] = r
    r = _ratio(batch_rows, "tokens_per_s", f)
    if r is not None:
      s[f"maxbatch_32k_{f}_throughput_vs_bf16"] = r
  s["targets"] = {k: dict(target=v, measured=s.get(k),
                          met=None if s.get(k) is None else s[k] >= v)
                  for k, v in TARGETS.items()}
  return s


def plot(latency, batch_rows, prefix: str, model_name: str) -> list[str]:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return []
  files = []
  if latency:
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, f in enumerate(_formats(latency)):
      pts = sorted((r["context"], r["median_us"], r["floor_us"]) for r in latency
                   if r["format"] == f and r["batch"] == 1)
      if pts:
        line, = ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=f)
        ax.plot([p[0] for p in pts], [p[2] / 1e3 for p in pts], ls=":",
                color=line.get_color(), label=f"{f} floor" if i == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step, B=1 (ms); dotted: bytes floor")
    ax.set_title(f"{model_name} decode latency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(prefix + "-latency.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
  if batch_rows:
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar([r["format"] for r in batch_rows], [r["tokens_per_s"] for r in batch_rows])
    for bar, r in zip(bars, batch_rows):
      ax.annotate(f"B={r['batch']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                  ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Largest batch that fits, {_ctx(batch_rows[0]['context'])} context")
    fig.tight_layout()
    files.append(prefix + "-throughput.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
  return files


def _formats(rows) -> list[str]:
  """`FORMATS` then any other format of ``rows`` (VQ presets), in order."""
  return list(dict.fromkeys([*FORMATS, *(r["format"] for r in rows)]))


def _ctx(c: int) -> str:
  return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def print_table(latency, batch_rows, prefill_rows, profiles, summary, skipped, errors, bw):
  print(f"\n== decode step, B=1: loop us / per-call us / floor us "
        f"(HBM read {bw / 1e9:.0f} GB/s) ==")
  contexts = sorted({r["context"] for r in latency})
  print(f"{'format':<8}" + "".join(f"{_ctx(c):>22}" for c in contexts))
  for f in _formats(latency):
    cells = []
    for c in contexts:
      r = [x for x in latency if x["format"] == f and x["context"] == c]
      cells.append(f"{r[0]['median_us']:>8.0f}/{r[0]['per_call_median_us']:.0f}/"
                   f"{r[0]['floor_us']:.0f}".rjust(22) if r else f"{'-':>22}")
    if any(c.strip() != "-" for c in cells):
      print(f"{f:<8}" + "".join(cells))
  alts = [r for r in latency + batch_rows if r.get("alt_loops")]
  if alts:
    print("\n== in-loop us per step by attention implementation (same process, same cache) ==")
    for r in alts:
      cells = " ".join(f"{k}={v['median_us']:.0f}" for k, v in r["alt_loops"].items())
      print(f"{r['format']:<8}{_ctx(r['context']):>6} B={r['batch']:<4} main={r['median_us']:.0f} "
            f"{cells}")
  if batch_rows:
    print(f"\n== largest batch at {_ctx(batch_rows[0]['context'])} ==")
    print(f"{'format':<8}{'batch':>7}{'step ms':>10}{'floor ms':>10}{'tok/s':>10}"
          f"{'cache GiB':>11}")
    for r in batch_rows:
      print(f"{r['format']:<8}{r['batch']:>7}{r['median_us'] / 1e3:>10.2f}"
            f"{r['floor_us'] / 1e3:>10.2f}{r['tokens_per_s']:>10.0f}"
            f"{r['cache_bytes'] / 2**30:>11.1f}")
  if prefill_rows:
    print("\n== prefill (model, B=1) ==")
    for r in prefill_rows:
      how = "one shot" if r["chunk_size"] is None else f"chunks of {r['chunk_size']}"
      print(f"{r['format']:<8}{r['prompt_len']:>8} tokens {how:<16}{r['median_ms']:>10.1f} ms "
            f"({r['tokens_per_s']:.0f} tok/s)")
  if profiles:
    print("\n== device time per decode step by kernel family (us) ==")
    print(f"{'format':<8}{'context':>8}{'mode':>9}" + "".join(f"{f:>13}" for f in FAMILIES))
    for p in profiles:
      for mode, q in (("per-call", p), ("in-loop", p.get("in_loop"))):
        if q:
          name = p["format"] + ("" if p.get("batch", 1) == 1 else f"@B{p['batch']}")
          print(f"{name:<8}{_ctx(p['context']):>8}{mode:>9}"
                + "".join(f"{q['family_us_per_step'][f]:>13.0f}" for f in FAMILIES))
      if p.get("in_loop"):
        top = list(p["in_loop"]["top_kernels_us_per_step"].items())[:6]
        print("    in-loop top: " + ", ".join(f"{n[:40]} {us:.0f}" for n, us in top))
        for src, m in list(p["in_loop"].get("memcpy_sources", {}).items())[:3]:
          print(f"    in-loop memcpy {m['us_per_step']:.0f} us/step x{m['count']}: {src[:150]}")
  print("\n== targets ==")
  for k, t in summary["targets"].items():
    m = "n/a" if t["measured"] is None else f"{t['measured']:.3f}x"  # 1.449x is not 1.45x
    ok = {True: "MET", False: "MISSED", None: "not run"}[t["met"]]
    print(f"{k:<42} >= {t['target']:.2f}x  measured {m:>7}  {ok}")
  if skipped or errors:
    print(f"\nskipped {len(skipped)} cases, {len(errors)} errors (see JSON)")


def mesh_compare(args, plain: Runner, formats, contexts, bandwidth, dev) -> int:
  """B=1 decode without a mesh and on ``args.mesh_compare``, alternating, one process.

  The meshed model is a second copy of the weights placed on the mesh (same
  seed); each (format, context) is timed plain, meshed, plain, meshed, so
  drift of the GPU clock shows up as the spread of the plain pair.
  """
  global MESH  # pylint: disable=global-statement
  mesh = jaxkv.make_mesh(**jaxkv.sharding.parse_mesh(args.mesh_compare))
  MESH = mesh
  meshed = Runner(args, llama.random_model(args.config, seed=0, dtype=jnp.bfloat16, mesh=mesh),
                  bandwidth)
  MESH = None
  rows, errors = [], []
  for c in sorted(contexts, reverse=True):
    for f in formats:
      pair = {"format": f, "context": c, "plain": [], "mesh": []}
      for rep in range(2):
        for key, runner, m in (("plain", plain, None), ("mesh", meshed, mesh)):
          MESH = m
          out = []
          _guard_case(runner, f"decode {f} ctx={c} B=1 {key} rep {rep}",
                      lambda f=f, c=c, runner=runner: runner.decode_case(f, c, 1), out, errors)
          MESH = None
          if out:
            pair[key].append({k: out[0][k] for k in ("median_us", "per_call_median_us",
                                                      "floor_us", "loop", "per_call")})
      if pair["plain"] and pair["mesh"]:
        for t in ("median_us", "per_call_median_us"):
          best = {k: min(r[t] for r in pair[k]) for k in ("plain", "mesh")}
          pair[f"mesh_over_plain_{t}"] = best["mesh"] / best["plain"]
          pair[f"plain_spread_{t}"] = (max(r[t] for r in pair["plain"])
                                       / min(r[t] for r in pair["plain"]))
      rows.append(pair)
  os.makedirs(args.out, exist_ok=True)
  slug = "".join(ch if ch.isalnum() else "-" for ch in dev.device_kind.lower()).strip("-")
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  path = os.path.join(args.out, f"e2e-mesh-compare-{slug}-{stamp}.json")
  with open(path, "w") as fh:
    json.dump(dict(meta=dict(gpu=dev.device_kind, jax_version=jax.__version__,
                             jaxlib_version=_jaxlib_version(), model=args.config,
                             mesh=dict(mesh.shape), hbm_read_bytes_per_s=bandwidth,
                             method=mesh_compare.__doc__.strip()),
                   rows=rows, errors=errors), fh, indent=2)
  print(f"\nwrote {path}")
  print(f"{'format':8} {'ctx':>7} {'loop plain/mesh us':>22} {'ratio':>6} {'spread':>6} "
        f"{'per-call plain/mesh us':>24} {'ratio':>6}")
  for r in rows:
    if "mesh_over_plain_median_us" not in r:
      print(f"{r['format']:8} {r['context']:>7} failed")
      continue
    lp = min(x["median_us"] for x in r["plain"])
    lm = min(x["median_us"] for x in r["mesh"])
    cp = min(x["per_call_median_us"] for x in r["plain"])
    cm = min(x["per_call_median_us"] for x in r["mesh"])
    print(f"{r['format']:8} {r['context']:>7} {lp:10.0f}/{lm:<11.0f} "
          f"{r['mesh_over_plain_median_us']:6.3f} {r['plain_spread_median_us']:6.3f} "
          f"{cp:11.0f}/{cm:<12.0f} {r['mesh_over_plain_per_call_median_us']:6.3f}")
  return 0 if not errors else 1


def _use_subprocess(args) -> bool:
  if args.batch_subprocess != "auto":
    return args.batch_subprocess == "on"
  cpu_only = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
  return not cpu_only and shutil.which("nvidia-smi") is not None


PARTIAL = "e2e-partial.json"


def gpu_name() -> str:
  """The first GPU's name from nvidia-smi (the parent of the max-batch children
  does not touch the GPU), else the first JAX device's kind."""
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         check=True, capture_output=True, text=True, timeout=30).stdout
    return out.splitlines()[0].strip()
  except (OSError, subprocess.SubprocessError, IndexError):
    return jax.devices()[0].device_kind


def write_partial(args, gpu: str, **sections) -> None:
  """The rows measured so far, rewritten after every case to ``<out>/e2e-partial.json``,
  so a run cut short (an outer timeout) keeps them; removed once the final
  JSON is written."""
  os.makedirs(args.out, exist_ok=True)
  meta = dict(gpu=gpu, jax_version=jax.__version__, partial=True,
              date=datetime.datetime.now().isoformat(timespec="seconds"), model=args.config)
  with open(os.path.join(args.out, PARTIAL), "w") as fh:
    json.dump(dict(meta=meta, **sections), fh, indent=1)


def batch_children(argv: list[str], formats, args) -> tuple[list, list, list]:
  """Each max-batch case in a fresh process: ``(rows, errors, profiles)``.

  One process ran every case before: its largest batches OOMed at the memory
  estimate on a 24-26 GiB cache array with ~59 GiB reported free (memory of
  the earlier cases, or allocator fragmentation), and the batches settled at
  ~0.6x the estimate. A child starts from an empty GPU: the estimate (free
  memory after the weights, less ``--headroom-gb``), and on an OOM the parent
  starts a new child at 0.92x the batch. Runs before the parent touches the
  GPU, so the parent holds no device memory meanwhile.
  """
  rows, errors, profiles = [], [], []
  gpu = gpu_name()
  for f in formats:
    elapsed = time.perf_counter() - args.started
    if elapsed > args.time_budget:
      errors.append(dict(case=f"max-batch {f} ctx={args.batch_context}",
                         error=f"skipped: time budget ({elapsed:.0f}s elapsed)"))
      print(f"  skip max-batch {f}: time budget", flush=True)
      continue
    batch, tries = None, []
    for _ in range(6):
      with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--formats", f,
               "--contexts", str(args.batch_context), "--prefill-lens", "",
               "--batch-only", path,
               "--profile-steps", str(args.profile_steps if args.profile else 0)]
        cmd += ["--batch-size", str(batch)] if batch else []
        print(f"  max-batch {f}: fresh process" + (f", batch {batch}" if batch else ""),
              flush=True)
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="true")
        proc = subprocess.run(cmd, check=False, env=env)
        out = json.load(open(path)) if os.path.exists(path) else dict(
            error=f"child exited {proc.returncode} without a result")
      if "row" in out:
        out["row"].update(process="fresh", parent_oom_retries=tries)
        rows.append(out["row"])
        profiles.extend(out.get("profiles", []))
        print(f"  max-batch {f}: batch {out['row']['batch']}, "
              f"{out['row']['tokens_per_s']:.0f} tok/s", flush=True)
        write_partial(args, gpu, max_batch=rows, errors=errors)
        break
      if "oom_batch" not in out:
        errors.append(dict(case=f"max-batch {f} ctx={args.batch_context}", error=out["error"]))
        break
      tries.append(out["oom_batch"])
      if out["oom_batch"] <= 1:
        errors.append(dict(case=f"max-batch {f}", error=f"OOM at batch 1 ({tries})"))
        break
      batch = max(1, int(out["oom_batch"] * 0.92))
  return rows, errors, profiles


def compact_weights(model) -> None:
  """Re-places the weights as one contiguous run at the bottom of device memory.

  Eager random init leaves holes between the parameters (each draw's float32
  and random-bit temporaries are freed after its bf16 result is placed): a
  child at the estimated batch OOMed on one 21 GiB cache array with a ~19 GiB
  hole after the weights and ~58 GiB free in all. A round trip through host
  memory (device arrays deleted in between) leaves the free memory in one block.
  """
  state = nnx.state(model)
  host = jax.device_get(state)
  for leaf in jax.tree.leaves(state):
    leaf.delete()
  gc.collect()
  nnx.update(model, jax.device_put(host, jax.devices()[0]))
  jax.block_until_ready(nnx.state(model))


def batch_child(args, runner) -> int:
  """``--batch-only PATH``: one max-batch case, its row (or the OOM) written to PATH."""
  f = args.formats.split(",")[0]
  try:
    row = runner.batch_case(f, args.batch_context, batch=args.batch_size, retries=1)
    row["hbm_read_bytes_per_s"] = runner.bandwidth
    out = dict(row=row, profiles=runner.profiles)
  except Exception as e:  # pylint: disable=broad-except
    batch = args.batch_size or runner.memory_note.get("estimated_batch", 1)
    out = (dict(oom_batch=batch, error=str(e)[:300]) if _is_oom(e)
           else dict(error=f"{type(e).__name__}: {str(e)[:500]}"))
  with open(args.batch_only, "w") as fh:
    json.dump(out, fh)
  return 0


def main(argv=None) -> int:
  global MESH  # pylint: disable=global-statement
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="target-relevant cases only")
  p.add_argument("--config", default="llama-3.1-8b", help="models.llama.CONFIGS name")
  p.add_argument("--formats", default=None, help="comma-separated presets")
  p.add_argument("--contexts", default=None,
                 help="comma-separated B=1 contexts ('' or 0: none; default: 4K..128K)")
  p.add_argument("--batch-context", type=int, default=BATCH_CONTEXT)
  p.add_argument("--prefill-lens", default=None,
                 help=f"comma-separated prompt lengths (default {PREFILL_LENS}); '' = none")
  p.add_argument("--prefill-chunk", type=int, default=4096, help="chunk size of chunked prefill")
  p.add_argument("--steps", type=int, default=None, help="timed per-call steps per case")
  p.add_argument("--loop-steps", type=int, default=16, help="steps per jitted decode loop")
  p.add_argument("--reps", type=int, default=3, help="timed decode loops per case")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--max-batch", type=int, default=512)
  p.add_argument("--headroom-gb", type=float, default=3.0, help="memory kept free at max batch")
  p.add_argument("--batch-subprocess", choices=("auto", "on", "off"), default="auto",
                 help="each max-batch case in a fresh process (auto: when a GPU is present)")
  p.add_argument("--batch-size", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--batch-only", default=None, help=argparse.SUPPRESS)
  p.add_argument("--implementation", default=None, help="decode_attention implementation")
  p.add_argument("--implementations", default="",
                 help="comma-separated alternative implementations, each timed in the decode "
                      "loop on the same cache after the main one (A/B in one process)")
  p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                 help="shard weights, caches and attention on a device mesh; floors and "
                      "max batch are per device (weights / model, cache / its shards)")
  p.add_argument("--mesh-compare", default=None, metavar="data=D,model=M",
                 help="in one process, time every B=1 decode case without a mesh and on this "
                      "mesh (a second model placed on it), alternating, and report the ratio; "
                      "e.g. data=1,model=1 for the cost of the mesh code path on one GPU")
  p.add_argument("--bandwidth-gib", type=float, default=None,
                 help="size of the bandwidth probe (default 4 GiB on GPU, 0.25 on CPU)")
  p.add_argument("--profile", default=None, metavar="DIR",
                 help="write a profiler trace of decode steps (B=1, longest context) per "
                      "format under DIR and print time per kernel family")
  p.add_argument("--profile-steps", type=int, default=5)
  p.add_argument("--time-budget", type=float, default=380.0,
                 help="seconds after model init; cases starting later are skipped")
  p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                               "results"))
  argv = list(sys.argv[1:] if argv is None else argv)
  args = p.parse_args(argv)
  args.alt_implementations = [x for x in args.implementations.split(",") if x.strip()]
  formats = (args.formats.split(",") if args.formats
             else list(QUICK_FORMATS if args.quick else FORMATS))
  # No flag: the default contexts; "--contexts ''" or "--contexts 0": no B=1
  # decode cases (as "--prefill-lens ''" means no prefill cases).
  contexts = ([int(c) for c in args.contexts.split(",") if c.strip()]
              if args.contexts is not None
              else list(QUICK_CONTEXTS if args.quick else CONTEXTS))
  contexts = [c for c in contexts if c > 0]
  args.context_list = contexts
  lens = PREFILL_LENS if args.prefill_lens is None else args.prefill_lens
  prefill_lens = [int(x) for x in lens.split(",") if x.strip()]
  if args.quick and args.prefill_lens is None:
    prefill_lens = [32768]
  args.steps = args.steps or (10 if args.quick else 20)
  if not args.profile:
    args.profile_steps = 0

  args.started = time.perf_counter()
  child_rows, child_errors, child_profiles = [], [], []
  if args.batch_only is None and args.batch_context > 0 and _use_subprocess(args):
    child_rows, child_errors, child_profiles = batch_children(argv, formats, args)
  dev = jax.devices()[0]
  print(f"e2e: {args.config} random bf16 weights on {dev.device_kind} ({dev.platform}), "
        f"jax {jax.__version__}", flush=True)
  gib = args.bandwidth_gib or (4.0 if dev.platform == "gpu" else 0.25)
  probes = timing.hbm_read_probe(int(gib * 2**30))
  bandwidth = probes["best"]
  print(f"HBM read bandwidth (best of {gib:g} GiB read probes): {bandwidth / 1e9:.0f} GB/s "
        + " ".join(f"{k}={v / 1e9:.0f}" for k, v in probes.items()), flush=True)
  t0 = time.perf_counter()
  if args.mesh:  # weights drawn on their shards (70B fits where one GPU does not)
    MESH = jaxkv.make_mesh(**jaxkv.sharding.parse_mesh(args.mesh))
  model = llama.random_model(args.config, seed=0, dtype=jnp.bfloat16, mesh=MESH)
  jax.block_until_ready(nnx.state(model))
  if args.batch_only and MESH is None:
    compact_weights(model)
  init_s = time.perf_counter() - t0
  runner = Runner(args, model, bandwidth)
  runner.profiles.extend(child_profiles)
  if args.batch_only:
    return batch_child(args, runner)
  latency, batch_rows, prefill_rows, errors = [], child_rows, [], child_errors
  if args.mesh_compare:
    return mesh_compare(args, runner, formats, contexts, bandwidth, dev)

  def _guard(runner, what, fn, sink, errors):  # each case's row also kept in the partial file
    _guard_case(runner, what, fn, sink, errors)
    write_partial(args, dev.device_kind, decode_b1=latency, max_batch=batch_rows,
                  prefill=prefill_rows, errors=errors)

  # Priority: the target cases first (longest context B=1, max batch), then the rest.
  top = max(contexts, default=0)
  for f in formats if top else ():
    _guard(runner, f"decode {f} ctx={top} B=1", lambda f=f: runner.decode_case(f, top, 1),
           latency, errors)
  in_process = args.batch_context > 0 and not child_rows and not child_errors
  for f in formats if in_process else ():  # --batch-context 0: no max-batch cases
    _guard(runner, f"max-batch {f} ctx={args.batch_context}",
           lambda f=f: runner.batch_case(f, args.batch_context), batch_rows, errors)
  for c in sorted(contexts, reverse=True)[1:]:
    for f in formats:
      _guard(runner, f"decode {f} ctx={c} B=1", lambda f=f, c=c: runner.decode_case(f, c, 1),
             latency, errors)
  for n in prefill_lens:
    for f in formats[:2]:
      for chunk in (None, args.prefill_chunk):
        if chunk is not None and chunk >= n:
          continue
        _guard(runner, f"prefill {f} T={n} chunk={chunk}",
               lambda f=f, n=n, chunk=chunk: runner.prefill_case(f, n, chunk),
               prefill_rows, errors)

  summary = summarize(latency, batch_rows)
  os.makedirs(args.out, exist_ok=True)
  slug = "".join(ch if ch.isalnum() else "-" for ch in dev.device_kind.lower()).strip("-")
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  prefix = os.path.join(args.out, f"e2e-{slug}-{stamp}{'-quick' if args.quick else ''}")
  plots = plot(latency, batch_rows, prefix, args.config)
  import flax  # pylint: disable=import-outside-toplevel
  result = dict(
      meta=dict(
          gpu=dev.device_kind, platform=dev.platform, device_count=jax.device_count(),
          jax_version=jax.__version__, jaxlib_version=_jaxlib_version(),
          flax_version=flax.__version__, python=platform.python_version(),
          date=datetime.datetime.now().isoformat(timespec="seconds"),
          model=args.config, weights="random bf16 (models.llama.random_model, seed 0)",
          model_init_s=init_s, hbm_read_bytes_per_s=bandwidth, bandwidth_probe_gib=gib,
          hbm_read_probes=probes,
          weight_bytes=runner.weight_bytes,
          cache_fill=("random N(0,1) K/V written with ModelCache.append_layer in chunks (the "
                      "model's prefill is not run for the decode cases; see 'prefill')"),
          decode_timing=("'loop': per step inside one jitted jaxkv.decode_steps loop of "
                         "--loop-steps steps (how generate runs); 'per_call': one jitted "
                         "decode step per call, cache donated, block_until_ready each; "
                         "compile excluded"),
          floor=("(weight bytes + cache bytes read: packed tokens at the format's "
                 "bytes/token + the residual block) / measured HBM read bandwidth"),
          implementation=args.implementation or "default (Pallas on GPU)",
          decode_compiler_options={  # per device: rows <= the limit merge
              "merged_up_to_rows": decoding.DOT_MERGER_MAX_ROWS,
              "merged": decoding._options(True),  # pylint: disable=protected-access
              "plain": decoding._options(False)},  # pylint: disable=protected-access
          args={k: v for k, v in vars(args).items()}, total_s=time.perf_counter() - runner.start),
      decode_b1=latency, max_batch=batch_rows, prefill=prefill_rows, profile=runner.profiles,
      summary=summary, skipped=runner.skipped, errors=errors,
      plots=[os.path.basename(f) for f in plots])
  with open(prefix + ".json", "w") as fh:
    json.dump(result, fh, indent=2)
  if os.path.exists(os.path.join(args.out, PARTIAL)):
    os.remove(os.path.join(args.out, PARTIAL))
  print(f"\nwrote {prefix}.json" + "".join(f", {os.path.basename(f)}" for f in plots))
  print_table(latency, batch_rows, prefill_rows, runner.profiles, summary, runner.skipped,
              errors, bandwidth)
  return 0 if not errors else 1


if __name__ == "__main__":
  sys.exit(main())
