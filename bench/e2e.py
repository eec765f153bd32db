"""End-to-end Llama decode on quantized KV caches (GPU benchmark).

Llama-3.1-8B shapes with random bf16 weights (`models.llama.random_model`):

1. B=1 per-token decode latency (one `jaxkv.decode_step` of the whole model,
   jitted, caches donated) at contexts 4K..128K for the bf16 cache and the
   int8 / kivi4 / kivi2 presets.
2. At 32K context: the largest batch whose caches fit next to the weights, per
   format, and the decode tokens/s it reaches.
3. Prompt prefill time (the model's `prefill`: cuDNN causal attention + cache
   quantization), separately.

To keep the run short the caches for (1) and (2) are filled with random
N(0, 1) K/V written through `KVCache.prefill` in chunks, not by running the
model over a 128K prompt (recorded in the JSON as ``cache_fill``). Decode
work does not depend on the values.

Compile time is measured apart from run time; step times are per call with
`block_until_ready` (median, min, max over ``--steps`` calls after
``--warmup``). Results: ``bench/results/e2e-<gpu>-<date>.json`` plus two PNG
plots; the table is printed last. ``--quick`` runs the contexts and formats
the issue's targets need. A ``--time-budget`` skips (and records) whatever
does not fit; the most important cases run first.

CPU smoke run (tiny model): ``python bench/e2e.py --config tiny --contexts 512,1024
--batch-context 1024 --max-batch 4 --prefill-lens 256``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")  # before jax starts

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxkv.formats import KVFormat  # noqa: E402
from jaxkv.generate import cache_nbytes, decode_step  # noqa: E402
from models import llama  # noqa: E402

CONTEXTS = (4096, 16384, 32768, 65536, 131072)
FORMATS = ("bf16", "int8", "kivi4", "kivi2")
QUICK_CONTEXTS = (32768, 131072)
QUICK_FORMATS = ("bf16", "kivi4", "kivi2")
BATCH_CONTEXT = 32768
TARGETS = {  # issue 4
    "b1_128k_kivi4_speedup_vs_bf16": 1.45,
    "maxbatch_32k_kivi4_throughput_vs_bf16": 2.9,
    "maxbatch_32k_kivi2_throughput_vs_bf16": 4.2,
}
FILL_TOKENS = 1 << 18  # batch * chunk tokens of random K/V generated per fill call


def _jaxlib_version():
  try:
    import jaxlib  # pylint: disable=import-outside-toplevel
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return None


def _is_oom(e: Exception) -> bool:
  msg = str(e)
  return "RESOURCE_EXHAUSTED" in msg or "Out of memory" in msg or "out of memory" in msg


# ------------------------------------------------------------------ jitted
@functools.partial(jax.jit, donate_argnames="cache", static_argnames="chunk")
def _fill_chunk(cache, key, *, chunk: int):
  """Appends ``chunk`` random N(0,1) tokens to every sequence of one layer's cache."""
  kk, kv = jax.random.split(key)
  shape = (cache.batch, chunk, cache.kv_heads, cache.head_dim)
  k = jax.random.normal(kk, shape, jnp.float32).astype(cache.dtype)
  v = jax.random.normal(kv, shape, jnp.float32).astype(cache.dtype)
  return cache.prefill(k, v, jnp.full((cache.batch,), chunk, jnp.int32))


@functools.partial(jax.jit, donate_argnames="caches", static_argnames="implementation")
def _decode(graphdef, state, tokens, caches, *, implementation=None):
  logits, caches = decode_step(nnx.merge(graphdef, state), tokens, caches,
                               implementation=implementation)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), caches


@functools.partial(jax.jit, donate_argnames="caches")
def _prefill(graphdef, state, tokens, lengths, caches):
  logits, caches = nnx.merge(graphdef, state).prefill(tokens, lengths, caches)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), caches


def fill_caches(model, fmt, batch: int, context: int, capacity: int, seed: int):
  """Per-layer caches holding ``context`` random tokens per sequence."""
  caches = []
  key = jax.random.key(seed)
  chunk = max(128, min(context, (FILL_TOKENS // batch) // 128 * 128))
  for layer_cache in model.init_cache(fmt, batch, capacity):
    done = 0
    while done < context:
      n = min(chunk, context - done)
      key, sub = jax.random.split(key)
      layer_cache = _fill_chunk(layer_cache, sub, chunk=n)
      done += n
    caches.append(layer_cache)
  caches = tuple(caches)
  jax.block_until_ready(caches)
  return caches


def _stats(times_s) -> dict:
  t = np.asarray(times_s) * 1e6
  return dict(median_us=float(np.median(t)), min_us=float(t.min()), max_us=float(t.max()),
              steps=len(t))


def time_decode(graphdef, state, caches, batch: int, vocab: int, *, steps: int, warmup: int,
                implementation=None, seed: int = 0) -> tuple[dict, tuple]:
  """Compiles and times single decode steps; returns (stats, caches)."""
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch,)), jnp.int32)
  t0 = time.perf_counter()
  tokens, caches = _decode(graphdef, state, tokens, caches, implementation=implementation)
  tokens.block_until_ready()
  compile_s = time.perf_counter() - t0
  for _ in range(warmup):
    tokens, caches = _decode(graphdef, state, tokens, caches, implementation=implementation)
  tokens.block_until_ready()
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    tokens, caches = _decode(graphdef, state, tokens, caches, implementation=implementation)
    tokens.block_until_ready()
    times.append(time.perf_counter() - t0)
  if bool(np.any(np.asarray(caches[0].overflow))):
    raise RuntimeError("cache overflow during timing (capacity too small)")
  return dict(compile_plus_first_step_s=compile_s, **_stats(times)), caches


# ------------------------------------------------------------------- cases
class Runner:
  """Runs cases in priority order under a time budget; records every outcome."""

  def __init__(self, args, model):
    self.args = args
    self.model = model
    self.graphdef, self.state = nnx.split(model)
    self.start = time.perf_counter()
    self.skipped = []
    self.memory_note = {}

  def over_budget(self, what: str) -> bool:
    elapsed = time.perf_counter() - self.start
    if elapsed > self.args.time_budget:
      self.skipped.append(dict(case=what, reason=f"time budget ({elapsed:.0f}s elapsed)"))
      print(f"  skip {what}: time budget", flush=True)
      return True
    return False

  def decode_case(self, fmt_name: str, context: int, batch: int) -> dict:
    a = self.args
    fmt = KVFormat.preset(fmt_name)
    capacity = context + a.warmup + a.steps + 2
    row = dict(format=fmt_name, context=context, batch=batch, capacity=capacity,
               cache_bytes=cache_nbytes(self.model, fmt, batch, capacity),
               bytes_per_token_all_layers=fmt.bytes_per_token(
                   self.model.config.num_kv_heads, self.model.config.head_dim)
               * self.model.config.num_layers)
    t0 = time.perf_counter()
    caches = fill_caches(self.model, fmt, batch, context, capacity, seed=context + batch)
    row["fill_s"] = time.perf_counter() - t0
    stats, caches = time_decode(self.graphdef, self.state, caches, batch,
                                self.model.config.vocab_size, steps=a.steps,
                                warmup=a.warmup, implementation=a.implementation)
    del caches
    row.update(stats)
    row["tokens_per_s"] = batch / (row["median_us"] * 1e-6)
    return row

  def max_batch(self, fmt_name: str, context: int) -> int:
    """Largest batch whose caches fit in free device memory (estimate)."""
    a = self.args
    fmt = KVFormat.preset(fmt_name)
    capacity = context + a.warmup + a.steps + 2
    per_seq = cache_nbytes(self.model, fmt, 1, capacity)
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
      self.memory_note = dict(note="no device memory stats; used --max-batch")
      return a.max_batch
    free = limit - stats.get("bytes_in_use", 0)
    headroom = a.headroom_gb * 2**30 + 0.03 * limit
    batch = int(max(1, min(a.max_batch, (free - headroom) // per_seq)))
    self.memory_note = dict(bytes_limit=int(limit), bytes_free=int(free),
                            headroom_bytes=int(headroom), cache_bytes_per_seq=int(per_seq),
                            estimated_batch=batch)
    return batch

  def batch_case(self, fmt_name: str, context: int) -> dict:
    batch = self.max_batch(fmt_name, context)
    tries = []
    for _ in range(5):
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
        batch = max(1, int(batch * 0.85))
    raise RuntimeError(f"OOM after retries {tries}")

  def prefill_case(self, fmt_name: str, prompt_len: int, repeats: int = 3) -> dict:
    fmt = KVFormat.preset(fmt_name)
    vocab = self.model.config.vocab_size
    tokens = jnp.asarray(np.random.default_rng(prompt_len).integers(0, vocab, (1, prompt_len)),
                         jnp.int32)
    lengths = jnp.full((1,), prompt_len, jnp.int32)
    times, compile_s = [], None
    for i in range(repeats + 1):
      caches = self.model.init_cache(fmt, 1, prompt_len + 128)
      jax.block_until_ready(caches)
      t0 = time.perf_counter()
      out, caches = _prefill(self.graphdef, self.state, tokens, lengths, caches)
      out.block_until_ready()
      if i == 0:
        compile_s = time.perf_counter() - t0
      else:
        times.append(time.perf_counter() - t0)
      del caches
    s = _stats(times)
    return dict(format=fmt_name, prompt_len=prompt_len, compile_plus_first_s=compile_s,
                median_ms=s["median_us"] / 1e3, min_ms=s["min_us"] / 1e3,
                max_ms=s["max_us"] / 1e3,
                tokens_per_s=prompt_len / (s["median_us"] * 1e-6))


def _guard(runner: Runner, what: str, fn, sink: list, errors: list):
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
  summary = (f"{row['median_us']:.0f} us/step" if "median_us" in row
             else f"{row['median_ms']:.1f} ms")
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
  for f in FORMATS[1:]:
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
    for f in FORMATS:
      pts = sorted((r["context"], r["median_us"]) for r in latency
                   if r["format"] == f and r["batch"] == 1)
      if pts:
        ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=f)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step, B=1 (ms)")
    ax.set_title(f"{model_name} decode latency")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    files.append(prefix + "-latency.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
  if batch_rows:
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [r["format"] for r in batch_rows]
    vals = [r["tokens_per_s"] for r in batch_rows]
    bars = ax.bar(names, vals)
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


def _ctx(c: int) -> str:
  return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def print_table(latency, batch_rows, prefill_rows, summary, skipped, errors):
  print("\n== decode step, B=1 (median us; compile excluded) ==")
  contexts = sorted({r["context"] for r in latency})
  print(f"{'format':<8}" + "".join(f"{_ctx(c):>10}" for c in contexts))
  for f in FORMATS:
    cells = []
    for c in contexts:
      r = [x for x in latency if x["format"] == f and x["context"] == c]
      cells.append(f"{r[0]['median_us']:>10.0f}" if r else f"{'-':>10}")
    if any(c.strip() != "-" for c in cells):
      print(f"{f:<8}" + "".join(cells))
  if batch_rows:
    print(f"\n== largest batch at {_ctx(batch_rows[0]['context'])} ==")
    print(f"{'format':<8}{'batch':>7}{'step ms':>10}{'tok/s':>10}{'cache GiB':>11}")
    for r in batch_rows:
      print(f"{r['format']:<8}{r['batch']:>7}{r['median_us'] / 1e3:>10.2f}"
            f"{r['tokens_per_s']:>10.0f}{r['cache_bytes'] / 2**30:>11.1f}")
  if prefill_rows:
    print("\n== prefill (model, B=1) ==")
    for r in prefill_rows:
      print(f"{r['format']:<8}{r['prompt_len']:>7} tokens {r['median_ms']:>9.1f} ms "
            f"({r['tokens_per_s']:.0f} tok/s)")
  print("\n== targets ==")
  for k, t in summary["targets"].items():
    m = "n/a" if t["measured"] is None else f"{t['measured']:.2f}x"
    ok = {True: "MET", False: "MISSED", None: "not run"}[t["met"]]
    print(f"{k:<42} >= {t['target']:.2f}x  measured {m:>7}  {ok}")
  if skipped or errors:
    print(f"\nskipped {len(skipped)} cases, {len(errors)} errors (see JSON)")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--quick", action="store_true", help="target-relevant cases only")
  p.add_argument("--config", default="llama-3.1-8b", help="models.llama.CONFIGS name")
  p.add_argument("--formats", default=None, help="comma-separated presets")
  p.add_argument("--contexts", default=None, help="comma-separated B=1 contexts")
  p.add_argument("--batch-context", type=int, default=BATCH_CONTEXT)
  p.add_argument("--prefill-lens", default="4096", help="comma-separated; '' = none")
  p.add_argument("--steps", type=int, default=None, help="timed steps per case")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--max-batch", type=int, default=512)
  p.add_argument("--headroom-gb", type=float, default=3.0, help="memory kept free at max batch")
  p.add_argument("--implementation", default=None, help="decode_attention implementation")
  p.add_argument("--time-budget", type=float, default=380.0,
                 help="seconds after model init; cases starting later are skipped")
  p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                               "results"))
  args = p.parse_args(argv)
  formats = (args.formats.split(",") if args.formats
             else list(QUICK_FORMATS if args.quick else FORMATS))
  contexts = ([int(c) for c in args.contexts.split(",")] if args.contexts
              else list(QUICK_CONTEXTS if args.quick else CONTEXTS))
  prefill_lens = [int(x) for x in args.prefill_lens.split(",") if x.strip()]
  args.steps = args.steps or (10 if args.quick else 20)

  dev = jax.devices()[0]
  print(f"e2e: {args.config} random bf16 weights on {dev.device_kind} ({dev.platform}), "
        f"jax {jax.__version__}", flush=True)
  t0 = time.perf_counter()
  model = llama.random_model(args.config, seed=0, dtype=jnp.bfloat16)
  jax.block_until_ready(nnx.state(model))
  init_s = time.perf_counter() - t0
  runner = Runner(args, model)
  latency, batch_rows, prefill_rows, errors = [], [], [], []

  # Priority: the target cases first (128K B=1, max batch at 32K), then the rest.
  top = max(contexts)
  for f in formats:
    _guard(runner, f"decode {f} ctx={top} B=1", lambda f=f: runner.decode_case(f, top, 1),
           latency, errors)
  for f in formats:
    _guard(runner, f"max-batch {f} ctx={args.batch_context}",
           lambda f=f: runner.batch_case(f, args.batch_context), batch_rows, errors)
  for c in sorted(contexts, reverse=True)[1:]:
    for f in formats:
      _guard(runner, f"decode {f} ctx={c} B=1", lambda f=f, c=c: runner.decode_case(f, c, 1),
             latency, errors)
  for n in prefill_lens:
    for f in (formats if not args.quick else formats[:2]):
      _guard(runner, f"prefill {f} T={n}", lambda f=f, n=n: runner.prefill_case(f, n),
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
          model_init_s=init_s,
          cache_fill=("random N(0,1) K/V written with KVCache.prefill in chunks (the model's "
                      "prefill is not run for the decode cases; see 'prefill' for its time)"),
          decode_timing=("one jitted decode_step (whole model, caches donated) per call, "
                         "block_until_ready per step; compile excluded"),
          implementation=args.implementation or "default (Pallas on GPU)",
          args=vars(args), total_s=time.perf_counter() - runner.start),
      decode_b1=latency, max_batch=batch_rows, prefill=prefill_rows, summary=summary,
      skipped=runner.skipped, errors=errors, plots=[os.path.basename(f) for f in plots])
  with open(prefix + ".json", "w") as fh:
    json.dump(result, fh, indent=2)
  print(f"\nwrote {prefix}.json" + "".join(f", {os.path.basename(f)}" for f in plots))
  print_table(latency, batch_rows, prefill_rows, summary, runner.skipped, errors)
  return 0 if not errors else 1


if __name__ == "__main__":
  sys.exit(main())
