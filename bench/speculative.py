"""Self-speculative decoding (QuantSpec): acceptance on a real model, round times on a GPU.

Acceptance (default mode): greedy `jaxkv.speculative_generate` on
SmolLM2-135M (GGUF, offline) over English text windows from Python's
reference documentation (`jaxkv.fidelity.reference_text`): for each gamma,
the fraction of drafted tokens the target accepts and the tokens emitted per
verification pass, with the draft reading the cache's upper 4-bit plane and
(``--draft int4``) 4-bit group-wise weights. Each output is checked token
for token against plain greedy `jaxkv.generate` on the same ``quantspec``
cache. Writes ``bench/results/speculative-<tag>.json`` and ``.png``; wall
times include compilation (CPU runs measure acceptance, not speed).

Timing (``--timing``): Llama-3.1-8B shapes with random bf16 weights
(``--model-config``, `models.llama.random_model`), B=1, per context
(``--contexts``, default 32K,128K) on caches filled with random K/V
(`bench.e2e.fill_cache`):

1. the autoregressive step inside a jitted `jaxkv.decode_steps` loop for the
   bf16, kivi4 and quantspec caches (`bench.e2e.time_decode_loop`), beside
   its bytes floor (weights + cache bytes read) / measured HBM bandwidth;
2. per gamma, the time per round of `jaxkv.speculative_steps` (draft
   weights of ``--draft-bits``, default 4, in the ``--draft-layout`` kernels'
   layout; ``--rounds`` rounds per jitted call; compile and a warm-up call
   excluded, median over ``--reps``) and the acceptance it saw (random
   weights: not a model's acceptance);
3. last, at the longest context on a fresh cache (``--no-components`` skips
   it): one draft step, one verify pass (``gamma + 1`` queries) and one
   commit, each in its own small jitted loop;
4. the *modeled* speedup over autoregressive decoding:
   ``E(gamma) * AR step time / round time``, with ``E(gamma)`` the tokens per
   verification of the real model's CPU run (``--acceptance``, default
   ``bench/results/speculative-cpu.json``, the rows of the same draft bits):
   acceptance measured on CPU, times measured here.

Writes ``speculative-timing-<gpu>-<date>.json`` under ``--out`` and prints a
table. CPU smoke run (tiny model, under a minute)::

  python bench/speculative.py --timing --model-config tiny --contexts 512 \
      --gammas 2,4 --rounds 4 --reps 1

On a GPU: ``python bench/speculative.py --timing --contexts 32768,131072``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")  # before jax starts

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxkv  # noqa: E402
from bench import e2e  # noqa: E402
from jaxkv import fidelity  # noqa: E402
from jaxkv import timing  # noqa: E402
from jaxkv.attention import pallas_order  # noqa: E402
from jaxkv.speculative import block_forward  # noqa: E402
from models import draft_weights as dw  # noqa: E402
from models import llama  # noqa: E402
from models.gguf import SMOLLM2_INSTALL, find_smollm2  # noqa: E402
from models.tokenizer import load_tokenizer  # noqa: E402


def text_prompts(tokenizer, count: int, length: int) -> np.ndarray:
  """``[count, length]`` token windows spread over the reference text."""
  tokens = tokenizer.encode(fidelity.reference_text())
  starts = np.linspace(0, len(tokens) - length - 1, count).astype(int)
  return np.stack([np.asarray(tokens[s:s + length]) for s in starts])


DOC_QUESTION = ("Question: what is the main topic of the document above, and which of its "
                "details matter most? Answer in a few sentences.")


def doc_question_prompts(tokenizer, lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
  """One chat prompt per target length: a user turn holding a window of the
  reference text (sized so the rendered chat is about that many tokens; the
  windows start at spread-out points) and `DOC_QUESTION`, with the
  generation prompt. Returns right-padded ``[B, max_len]`` ids and the lengths."""
  tokens = tokenizer.encode(fidelity.reference_text(), add_bos=False)
  overhead = len(tokenizer.encode_chat([{"role": "user", "content": "\n\n" + DOC_QUESTION}]))
  starts = np.linspace(0, len(tokens) - max(lengths) - 1, len(lengths)).astype(int)
  ids = []
  for start, length in zip(starts, lengths):
    doc = tokenizer.decode(tokens[start:start + length - overhead])
    ids.append(tokenizer.encode_chat([{"role": "user", "content": f"{doc}\n\n{DOC_QUESTION}"}]))
  out = np.zeros((len(ids), max(map(len, ids))), np.int32)
  for i, row in enumerate(ids):
    out[i, :len(row)] = row
  return out, np.array([len(r) for r in ids])


def plot(result: dict, path: str) -> None:
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:  # the `bench` extra; the JSON is written already
    print(f"no plot {path}: matplotlib is not installed (pip install -e '.[bench]')")
    return
  rows = result["rows"]
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for draft in sorted({r["draft_weights"] for r in rows}):
    sel = [r for r in rows if r["draft_weights"] == draft]
    g = [r["gamma"] for r in sel]
    axes[0].plot(g, [r["acceptance_rate"] for r in sel], "o-", label=f"draft weights {draft}")
    axes[1].plot(g, [r["tokens_per_verification"] for r in sel], "o-",
                 label=f"draft weights {draft}")
  axes[0].set(xlabel="gamma (draft tokens per verification)", ylabel="acceptance rate",
              ylim=(0, 1), title="drafted tokens accepted")
  axes[1].set(xlabel="gamma", ylabel="tokens per verification",
              title="tokens emitted per target pass")
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle(f"QuantSpec on {result['settings']['model']} "
               f"({result['settings']['platform']}, greedy)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)


# ------------------------------------------------------------------ timing
AR_FORMATS = ("bf16", "kivi4", "quantspec")
_stats = e2e._stats  # pylint: disable=protected-access  (median/min/max in us)
ACCEPTANCE_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                               "speculative-cpu.json")
MODELED_NOTE = (
    "MODELED, not measured end to end: modeled_speedup_vs_<fmt>_ar = E(gamma) x "
    "ar_step_us[<fmt>] / round_us, where E(gamma) is tokens_per_verification of the real "
    "model's greedy CPU run (acceptance file, the rows of the timed draft bits), ar_step_us "
    "the B=1 decode step measured here in a jitted jaxkv.decode_steps loop, and round_us "
    "one round of jaxkv.speculative_steps measured here (gamma draft steps on the draft view, one "
    "target verify pass of gamma+1 tokens, accept, commit) with random weights. A round's "
    "work does not depend on what is accepted except the commit size (<= gamma+1 tokens). "
    "floor_modeled_speedup_vs_bf16_ar uses the bytes floors of both instead of the times. "
    "The acceptance model (acceptance_source.settings.model) is not the timed one; see the "
    "caveats in bench/results/speculative-NOTES.md.")


def acceptance_table(path: str, draft: str = "int4") -> tuple[dict, dict]:
  """``({gamma: row}, settings)`` of the ``draft``-weight rows of a `main` result file."""
  with open(path) as f:
    result = json.load(f)
  rows = {r["gamma"]: r for r in result["rows"] if r["draft_weights"] == draft}
  return rows, result.get("settings", {})


def _timed(run, reps: int, after=None) -> tuple[float, list[float], list]:
  """``(compile_plus_first_s, times_s, timed results)``: ``run()`` once to compile, once
  to warm (discarded), then ``reps`` timed calls; each call waits for its result, and
  ``after(result)`` (if given) runs after every call, outside the timed region."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(run())
  compile_s = time.perf_counter() - t0
  times, outs = [], []
  for rep in range(reps + 1):
    if after is not None:
      after(out)
    t0 = time.perf_counter()
    out = jax.block_until_ready(run())
    if rep:
      times.append(time.perf_counter() - t0)
      outs.append(out)
  if after is not None:
    after(out)
  return compile_s, times, outs


def time_spec_rounds(split, weights, cache, token, *, gamma: int, rounds: int, reps: int):
  """Per-round time of `jaxkv.speculative_steps` (``rounds`` rounds per call).

  One call compiles, one warms (discarded), ``reps`` are timed; each call
  starts from the previous one's last emitted token. Returns ``(row, token
  [B], cache)``; ``row`` holds the median, min and max per round and the
  acceptance the timed calls saw.
  """
  box = dict(token=token, cache=cache)

  def call():
    tokens, counts, st, box["cache"] = jaxkv.speculative_steps(
        split, box["token"], box["cache"], rounds, gamma=gamma, draft_weights=weights)
    return tokens, counts, st

  def next_token(out):  # outside the timed region (its own dispatch)
    tokens, counts, _ = out
    box["token"] = jax.block_until_ready(tokens[jnp.arange(tokens.shape[0]), counts - 1])

  compile_s, call_times, outs = _timed(call, reps, after=next_token)
  times = [t / rounds for t in call_times]
  stats = [st for _, _, st in outs]
  verifs = sum(int(st["verifications"].sum()) for st in stats)
  accepted = sum(int(st["accepted"].sum()) for st in stats)
  emitted = sum(st["tokens_per_verification"] * int(st["verifications"].sum()) for st in stats)
  row = dict(gamma=gamma, rounds_per_call=rounds, compile_plus_first_call_s=compile_s,
             **_round_stats_us(times),
             random_weights_acceptance_rate=accepted / max(1, gamma * verifs),
             random_weights_tokens_per_verification=emitted / max(1, verifs))
  return row, box["token"], box["cache"]


def _round_stats_us(times_s) -> dict:
  s = _stats(times_s)
  return dict(round_median_us=s["median_us"], round_min_us=s["min_us"],
              round_max_us=s["max_us"], timed_calls=s["steps"])


@functools.partial(jax.jit, static_argnames=("gamma", "iters", "defer_norms"))
def _draft_loop(graphdef, state, draft_state, token, cache, *, gamma: int, iters: int,
                defer_norms: bool = True):
  """``iters`` draft steps (``draft_state``'s weights, draft view, one token each) over
  ``cache`` (``defer_norms``: `models.draft_weights.draft_model`'s)."""
  draft = nnx.merge(graphdef, state).with_draft_weights(draft_state, defer_norms=defer_norms)
  b = token.shape[0]
  empty = tuple(jnp.zeros((b, gamma + 1, cache.kv_heads, cache.head_dim), cache.dtype)
                for _ in range(cache.num_layers))

  def step(i, tok):
    logits, _, _ = block_forward(draft, tok[:, None], cache, empty, empty,
                                 jnp.full((b,), i % gamma, jnp.int32), view="draft")
    return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)

  return jax.lax.fori_loop(0, iters, step, token)


@functools.partial(jax.jit, static_argnames=("gamma", "iters"))
def _verify_loop(graphdef, state, token, cache, *, gamma: int, iters: int):
  """``iters`` target passes over ``gamma + 1`` tokens (target view) over ``cache``."""
  model = nnx.merge(graphdef, state)
  b = token.shape[0]
  empty = tuple(jnp.zeros((b, gamma + 1, cache.kv_heads, cache.head_dim), cache.dtype)
                for _ in range(cache.num_layers))
  vocab = model.config.vocab_size

  def step(_, tok):
    block = (tok[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]) % vocab
    logits, _, _ = block_forward(model, block, cache, empty, empty, jnp.zeros((b,), jnp.int32),
                                 view="target")
    y = jnp.argmax(logits, axis=-1).astype(jnp.int32)           # [B, gamma+1], all used
    return jnp.sum(y, axis=1) % vocab

  return jax.lax.fori_loop(0, iters, step, token)


@functools.partial(jax.jit, static_argnames=("gamma", "iters"), donate_argnames=("cache",))
def _commit_loop(cache, key, *, gamma: int, iters: int):
  """``iters`` commits of ``gamma + 1`` staged tokens per sequence (all accepted), as
  `jaxkv.speculative._spec_step` commits them."""
  shape = (cache.batch, gamma + 1, cache.kv_heads, cache.head_dim)
  keys = jax.random.split(key, 2 * cache.num_layers)
  sk = [jax.random.normal(keys[2 * i], shape).astype(cache.dtype)
        for i in range(cache.num_layers)]
  sv = [jax.random.normal(keys[2 * i + 1], shape).astype(cache.dtype)
        for i in range(cache.num_layers)]

  def step(_, cache):
    plan = cache.plan_append(jnp.full((cache.batch,), gamma + 1, jnp.int32), max_new=gamma + 1)
    return cache.append_layers(sk, sv, plan).commit(plan)

  return jax.lax.fori_loop(0, iters, step, cache)


def time_components(split, weights, cache, token, *, gamma: int, iters: int, reps: int):
  """Per-step times of a draft step, a verify pass and a commit (``iters`` per jitted loop)."""
  graphdef, state = split.graphdef, split.state
  rows = {}
  for name, run in (
      ("draft_step", lambda: _draft_loop(graphdef, state, weights, token, cache, gamma=gamma,
                                         iters=iters)),
      ("verify_pass", lambda: _verify_loop(graphdef, state, token, cache, gamma=gamma,
                                           iters=iters))):
    compile_s, times, _ = _timed(run, reps)
    rows[name] = dict(compile_plus_first_s=compile_s, iters_per_call=iters,
                      **_stats(np.asarray(times) / iters))
  box = dict(cache=cache)

  def commit():
    box["cache"] = _commit_loop(box["cache"], jax.random.key(1), gamma=gamma, iters=iters)
    return box["cache"].lengths

  compile_s, times, _ = _timed(commit, reps)
  rows["commit"] = dict(compile_plus_first_s=compile_s, iters_per_call=iters,
                        tokens_per_commit=gamma + 1,
                        **_stats(np.asarray(times) / iters))
  return rows, box["cache"]


def _capacity(args, case: str, context: int) -> int:
  """Context plus the tokens every timed call of a case may append."""
  if case == "components":  # only the commits append
    return context + (args.reps + 2) * args.rounds * (args.component_gamma + 1) + 8
  room = (args.reps + 2) * args.loop_steps  # e2e.time_decode_loop: compile + reps + 1 loops
  if case == "quantspec":
    room += sum((args.reps + 2) * args.rounds * (g + 1) for g in args.gamma_list)
  return context + room + 8


class TimingRun:
  """The --timing cases, in order under a time budget; every outcome recorded."""

  def __init__(self, args, model, weights, bandwidth: float, acceptance: dict):
    self.args = args
    self.model = model
    self.split = jaxkv.SplitModel(model)  # no per-call nnx.split in the timed calls
    self.weights = weights
    self.bandwidth = bandwidth
    self.acceptance = acceptance
    self.weight_bytes = e2e.weight_bytes(model)
    linear = sum(m.kernel[...].nbytes for _, m in nnx.iter_modules(model)
                 if isinstance(m, llama.Linear))
    # What a draft step reads: the int4 linears, everything else as is.
    self.draft_read_bytes = self.weight_bytes - linear + dw.nbytes(weights)
    self.start = time.perf_counter()
    self.skipped, self.errors = [], []

  # Records a skipped case once --time-budget has passed (uses start, args, skipped).
  over_budget = e2e.Runner.over_budget

  def guard(self, what: str, fn) -> None:
    """Runs ``fn()`` unless over budget; an exception is recorded (its caches freed)."""
    if self.over_budget(what):
      return
    t0 = time.perf_counter()
    try:
      fn()
    except Exception as e:  # pylint: disable=broad-except
      tb = traceback.format_exc()
      self.errors.append(dict(case=what, error=f"{type(e).__name__}: {str(e)[:500]}",
                              traceback=tb[-3000:]))
      print(f"  FAILED {what}: {type(e).__name__}: {str(e)[:300]}\n{tb[-1500:]}", flush=True)
      gc.collect()
      return
    print(f"  {what} ({time.perf_counter() - t0:.1f}s)", flush=True)

  def _floor_us(self, nbytes: float) -> float:
    return nbytes / self.bandwidth * 1e6

  def _filled(self, case: str, fmt: str, context: int):
    """``(cache, capacity, fill_s, first token [1])``: a B=1 cache of random K/V."""
    capacity = _capacity(self.args, case, context)
    t0 = time.perf_counter()
    cache = e2e.fill_cache(self.model, fmt, 1, context, capacity, seed=context)
    token = jnp.asarray(np.random.default_rng(context).integers(
        0, self.model.config.vocab_size, (1,)), jnp.int32)
    return cache, capacity, time.perf_counter() - t0, token

  def format_case(self, fmt: str, context: int, row: dict) -> None:
    """Times the AR step on a filled cache; on quantspec then the speculative rounds."""
    a = self.args
    cache, capacity, fill_s, token = self._filled(fmt, fmt, context)
    read = e2e.cache_read_bytes(cache, context)
    loop, token, cache = e2e.time_decode_loop(self.split, cache, token,
                                              loop_steps=a.loop_steps, reps=a.reps)
    row["ar"][fmt] = dict(capacity=capacity, fill_s=fill_s, cache_read_bytes=read,
                          floor_us=self._floor_us(self.weight_bytes + read),
                          peak_bytes_in_use=timing.peak_bytes(), **loop)
    print(f"    AR {fmt}: {loop['median_us']:.0f} us/step "
          f"(floor {row['ar'][fmt]['floor_us']:.0f})", flush=True)
    if fmt == "quantspec":
      cache = self.speculative_cases(cache, token, context, row)
    cache.check()  # no append overflowed the capacity
    del cache  # the next case's cache needs the memory
    gc.collect()

  def speculative_cases(self, cache, token, context: int, row: dict):
    """Round times per gamma on a filled quantspec cache."""
    a = self.args
    read_t = e2e.cache_read_bytes(cache, context)
    read_d = e2e.cache_read_bytes(cache, context, view="draft")
    for gamma in a.gamma_list:
      if self.over_budget(f"speculative ctx={context} gamma={gamma}"):
        continue
      r, token, cache = time_spec_rounds(self.split, self.weights, cache, token, gamma=gamma,
                                         rounds=a.rounds, reps=a.reps)
      r["floor_round_us"] = self._floor_us(gamma * (self.draft_read_bytes + read_d)
                                           + self.weight_bytes + read_t)
      # The same if the draft read bf16 weights: what a dequantize-then-dot draft costs in
      # a loop (XLA hoists the loop-invariant dequantization and keeps the bf16 copies).
      r["floor_round_us_if_draft_reads_bf16_weights"] = self._floor_us(
          gamma * (self.weight_bytes + read_d) + self.weight_bytes + read_t)
      r["random_weights_us_per_emitted_token"] = (
          r["round_median_us"] / r["random_weights_tokens_per_verification"])
      r["peak_bytes_in_use"] = timing.peak_bytes()
      _model_speedup(r, row["ar"], self.acceptance.get(gamma))
      row["speculative"].append(r)
      print(f"    speculative gamma={gamma}: {r['round_median_us']:.0f} us/round "
            f"(floor {r['floor_round_us']:.0f}), modeled speedup vs bf16 AR "
            f"{_fmt(r.get('modeled_speedup_vs_bf16_ar'))}", flush=True)
    return cache

  def components_case(self, context: int, row: dict) -> None:
    """A draft step, a verify pass and a commit timed apart on a fresh quantspec cache."""
    a, g = self.args, self.args.component_gamma
    cache, capacity, _, token = self._filled("components", "quantspec", context)
    read_t = e2e.cache_read_bytes(cache, context)
    read_d = e2e.cache_read_bytes(cache, context, view="draft")
    comps, cache = time_components(self.split, self.weights, cache, token, gamma=g,
                                   iters=a.rounds, reps=a.reps)
    comps.update(
        gamma=g, capacity=capacity,
        sum_gamma_draft_verify_commit_us=(g * comps["draft_step"]["median_us"]
                                          + comps["verify_pass"]["median_us"]
                                          + comps["commit"]["median_us"]),
        floor_draft_step_us=self._floor_us(self.draft_read_bytes + read_d),
        floor_draft_step_us_if_bf16_weights=self._floor_us(self.weight_bytes + read_d),
        floor_verify_pass_us=self._floor_us(self.weight_bytes + read_t),
        peak_bytes_in_use=timing.peak_bytes())
    row["components"] = comps
    cache.check()
    del cache
    gc.collect()


def timing_main(args) -> int:
  """`--timing`: AR step and speculative round times at 8B shapes; see the module doc."""
  args.gamma_list = [int(g) for g in args.gammas.split(",")]
  contexts = sorted((int(c) for c in args.contexts.split(",")), reverse=True)
  args.component_gamma = (4 if 4 in args.gamma_list
                          else args.gamma_list[len(args.gamma_list) // 2])
  e_rows, e_settings = acceptance_table(args.acceptance, f"int{args.draft_bits}")
  dev = jax.devices()[0]
  print(f"speculative timing: {args.model_config} random bf16 weights on {dev.device_kind} "
        f"({dev.platform}), jax {jax.__version__}", flush=True)
  gib = args.bandwidth_gib or (4.0 if dev.platform == "gpu" else 0.25)
  bandwidth = timing.hbm_read_probe(int(gib * 2**30))["best"]
  print(f"HBM read bandwidth (best of {gib:g} GiB read probes): {bandwidth / 1e9:.0f} GB/s", flush=True)
  t0 = time.perf_counter()
  model = llama.random_model(args.model_config, seed=0, dtype=jnp.bfloat16)
  weights = model.quantize_weights(bits=args.draft_bits, group_size=args.group_size,
                                   layout=args.draft_layout,
                                   fuse_qkv=args.draft_qkv == "fused",
                                   fuse_mlp=args.draft_mlp == "fused")
  layouts = sorted({w.layout for w in weights.values()})
  jax.block_until_ready((nnx.state(model), weights))
  init_s = time.perf_counter() - t0
  run = TimingRun(args, model, weights, bandwidth, e_rows)
  # The longest context first: what the budget cuts is the least important; the
  # components (optional) last.
  results = [dict(context=c, batch=1, ar={}, speculative=[], components=None)
             for c in contexts]
  for row in results:
    for fmt in AR_FORMATS:
      run.guard(f"ctx={row['context']} {fmt}",
                lambda fmt=fmt, row=row: run.format_case(fmt, row["context"], row))
  if args.components:
    run.guard(f"ctx={contexts[0]} components gamma={args.component_gamma}",
              lambda: run.components_case(contexts[0], results[0]))

  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  slug = "".join(ch if ch.isalnum() else "-" for ch in dev.device_kind.lower()).strip("-")
  import flax  # pylint: disable=import-outside-toplevel
  result = dict(
      meta=dict(
          gpu=dev.device_kind, platform=dev.platform, jax_version=jax.__version__,
          jaxlib_version=e2e._jaxlib_version(),  # pylint: disable=protected-access
          flax_version=flax.__version__,
          date=datetime.datetime.now().isoformat(timespec="seconds"),
          model=args.model_config, weights="random bf16 (models.llama.random_model, seed 0)",
          draft_weights=(f"int{args.draft_bits}, group {args.group_size}, code layouts "
                         f"{layouts}, q/k/v {args.draft_qkv}, gate/up {args.draft_mlp} "
                         f"(models.draft_weights)"),
          model_init_s=init_s, weight_bytes=run.weight_bytes,
          draft_read_bytes=run.draft_read_bytes, draft_weight_copy_bytes=dw.nbytes(weights),
          hbm_read_bytes_per_s=bandwidth, bandwidth_probe_gib=gib, batch=1,
          kv_format_speculative="quantspec", sampler="greedy",
          # the staged attention's family per view (`jaxkv.attention.pallas_order`;
          # Mosaic first for the draft view since 2026-11-28, the target view
          # since 2026-11-29)
          attention_order={
              view: list(pallas_order(jaxkv.KVFormat.preset("quantspec"), jnp.bfloat16, 128,
                                      view=view))
              for view in ("draft", "target")},
          cache_fill="random N(0,1) K/V through ModelCache.append_layer (bench.e2e.fill_cache)",
          ar_timing=("per step inside one jitted jaxkv.decode_steps loop of --loop-steps steps "
                     "(bench.e2e.time_decode_loop); compile and a warm-up loop excluded"),
          round_timing=("per round: wall time of one jaxkv.speculative_steps call of --rounds "
                        "rounds (one jitted lax.fori_loop, cache donated, stats read back) / "
                        "rounds; compile and a warm-up call excluded; median over --reps"),
          components=("draft_step / verify_pass: jitted fori_loops of --rounds iterations of "
                      "block_forward (draft: int4 weights, draft view, 1 token; verify: full "
                      "weights, target view, gamma+1 tokens); commit: a fori_loop of "
                      "--rounds commits of gamma+1 tokens (plan_append, append_layer per "
                      "layer, commit); per iteration"),
          floors=("ar floor_us = (weight bytes + cache bytes read) / HBM read bandwidth (as "
                  "bench/e2e.py); floor_round_us = (gamma * (draft weight bytes read [int4 "
                  "linears + the rest] + cache bytes of the draft view) + weight bytes + cache "
                  "bytes of the target view) / bandwidth; commits not included. Weight bytes "
                  "count the whole embedding table, as e2e does. *_if_draft_reads_bf16_weights: "
                  "the same with the draft reading bf16 weights, as a draft that dequantizes its "
                  "int4 copies apart from the dot does (the CPU path: XLA hoists the "
                  "loop-invariant dequantization); on a GPU the draft runs the int4 kernel"),
          peak_bytes_in_use="device peak so far when the row was written (monotone)",
          modeled=MODELED_NOTE,
          acceptance_source=dict(
              path=os.path.relpath(args.acceptance), settings=e_settings,
              draft_weights=f"int{args.draft_bits}",
              tokens_per_verification={g: r["tokens_per_verification"]
                                       for g, r in e_rows.items()},
              acceptance_rate={g: r["acceptance_rate"] for g, r in e_rows.items()}),
          args=dict(vars(args)), total_s=time.perf_counter() - run.start),
      results=results, skipped=run.skipped, errors=run.errors)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"speculative-timing-{slug}-{stamp}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"\nwrote {path}")
  print_timing_table(result)
  return 0 if not run.errors else 1


def _model_speedup(r: dict, ar: dict, e_row) -> None:
  """Adds the modeled speedups (see `MODELED_NOTE`) to a speculative row ``r``."""
  if e_row is None:
    r["modeled_note"] = ("no row of these draft bits for this gamma in the acceptance file: "
                         "not modeled")
    return
  e = e_row["tokens_per_verification"]
  r["cpu_real_model_tokens_per_verification"] = e
  r["cpu_real_model_acceptance_rate"] = e_row["acceptance_rate"]
  r["modeled_us_per_token"] = r["round_median_us"] / e
  for fmt, a in ar.items():
    r[f"modeled_speedup_vs_{fmt}_ar"] = e * a["median_us"] / r["round_median_us"]
  if "bf16" in ar:
    r["floor_modeled_speedup_vs_bf16_ar"] = e * ar["bf16"]["floor_us"] / r["floor_round_us"]


def _fmt(x, spec=".2f", unit="x") -> str:
  return "-" if x is None else f"{x:{spec}}{unit}"


def print_timing_table(result: dict) -> None:
  ctx = e2e._ctx  # pylint: disable=protected-access
  m = result["meta"]
  print(f"\n== {m['model']} B=1 on {m['gpu']} (HBM read {m['hbm_read_bytes_per_s'] / 1e9:.0f} "
        "GB/s): AR step us (floor) ==")
  print(f"{'context':>8}" + "".join(f"{f:>20}" for f in AR_FORMATS))
  for row in result["results"]:
    cells = [f"{row['ar'][f]['median_us']:.0f} ({row['ar'][f]['floor_us']:.0f})"
             if f in row["ar"] else "-" for f in AR_FORMATS]
    print(f"{ctx(row['context']):>8}" + "".join(f"{c:>20}" for c in cells))
  draft = m["draft_weights"].split(",")[0]
  print(f"\n== speculative round (quantspec cache, {draft} draft); speedups MODELED: "
        "E(gamma) from the real model's CPU run x AR step / round ==")
  print(f"{'context':>8}{'gamma':>6}{'round us':>10}{'floor us':>10}{'bf16-dr fl':>11}"
        f"{'E cpu':>7}"
        f"{'acc rnd':>8}{'us/token':>10}{'vs bf16':>9}{'vs kivi4':>9}{'vs qspec':>9}"
        f"{'floor vs bf16':>14}")
  for row in result["results"]:
    for r in row["speculative"]:
      print(f"{ctx(row['context']):>8}{r['gamma']:>6}{r['round_median_us']:>10.0f}"
            f"{r['floor_round_us']:>10.0f}"
            f"{r['floor_round_us_if_draft_reads_bf16_weights']:>11.0f}"
            f"{_fmt(r.get('cpu_real_model_tokens_per_verification'), '.2f', ''):>7}"
            f"{r['random_weights_acceptance_rate']:>8.2f}"
            f"{_fmt(r.get('modeled_us_per_token'), '.0f', ''):>10}"
            f"{_fmt(r.get('modeled_speedup_vs_bf16_ar')):>9}"
            f"{_fmt(r.get('modeled_speedup_vs_kivi4_ar')):>9}"
            f"{_fmt(r.get('modeled_speedup_vs_quantspec_ar')):>9}"
            f"{_fmt(r.get('floor_modeled_speedup_vs_bf16_ar')):>14}")
  for row in result["results"]:
    c = row["components"]
    if c:
      print(f"\n== components at {ctx(row['context'])}, gamma={c['gamma']} (us; floor) ==")
      print(f"draft step {c['draft_step']['median_us']:.0f} ({c['floor_draft_step_us']:.0f}; "
            f"{c['floor_draft_step_us_if_bf16_weights']:.0f} if it reads bf16 weights), "
            f"verify pass {c['verify_pass']['median_us']:.0f} "
            f"({c['floor_verify_pass_us']:.0f}), commit {c['commit']['median_us']:.0f}; "
            f"gamma*draft+verify+commit {c['sum_gamma_draft_verify_commit_us']:.0f}")
  if result["skipped"] or result["errors"]:
    print(f"\nskipped {len(result['skipped'])} cases, {len(result['errors'])} errors (see JSON)")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
  p.add_argument("--gammas", default=None,
                 help="comma-separated (default 1,...,8; with --timing 2,4,6)")
  p.add_argument("--draft", default="int4",
                 help="comma-separated draft weights: int4,int8,full; int4-rtn / int8-rtn: "
                      "round-to-nearest scales instead of the default least-squares fit")
  p.add_argument("--prompts", type=int, default=4, help="text windows (the batch)")
  p.add_argument("--prompt-len", type=int, default=448, help="tokens per window")
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--doc-question", default=None, metavar="LENS",
                 help="comma-separated prompt lengths (e.g. 1024,2048,4096,8000): one chat "
                      "prompt each, a document window plus a question (`DOC_QUESTION`), "
                      "run as one ragged batch (replaces --prompts / --prompt-len)")
  p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                 help="prefill in chunks of N tokens (generate / speculative_generate "
                      "prefill_chunk; long prompts need it on CPU)")
  p.add_argument("--no-check", action="store_true", help="skip the plain greedy comparison")
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  p.add_argument("--tag", default=None, help="file name tag (default: the platform)")
  t = p.add_argument_group("--timing (GPU round times; see the module doc)")
  t.add_argument("--timing", action="store_true",
                 help="time AR steps and speculative rounds at --model-config shapes")
  t.add_argument("--model-config", default="llama-3.1-8b", help="models.llama.CONFIGS name")
  t.add_argument("--contexts", default="32768,131072", help="comma-separated B=1 contexts")
  t.add_argument("--rounds", type=int, default=8, help="rounds per speculative_steps call")
  t.add_argument("--reps", type=int, default=2, help="timed calls per case (after a warm-up)")
  t.add_argument("--loop-steps", type=int, default=16, help="steps per AR decode_steps loop")
  t.add_argument("--group-size", type=int, default=128, help="draft weight group")
  t.add_argument("--draft-bits", type=int, default=4, choices=(4, 8),
                 help="draft weight bits (the acceptance rows of the same draft model)")
  t.add_argument("--draft-layout", default="auto", choices=("auto", *dw.LAYOUTS),
                 help="draft weights' code layout (out_major: 4 bits only)")
  t.add_argument("--draft-qkv", default="fused", choices=("fused", "separate"),
                 help="q, k and v as one draft product per layer (quantize_weights(fuse_qkv=))")
  t.add_argument("--draft-mlp", default="fused", choices=("fused", "separate"),
                 help="gate and up as one draft product per layer (quantize_weights(fuse_mlp=))")
  t.add_argument("--no-components", dest="components", action="store_false",
                 help="skip timing a draft step, verify pass and commit apart (longest "
                      "context, gamma 4 or the middle one)")
  t.add_argument("--acceptance", default=ACCEPTANCE_JSON,
                 help="real-model acceptance file (this script's default mode) for E(gamma)")
  t.add_argument("--bandwidth-gib", type=float, default=None,
                 help="size of the bandwidth probe (default 4 GiB on GPU, 0.25 on CPU)")
  t.add_argument("--time-budget", type=float, default=330.0,
                 help="seconds after start; cases starting later are skipped (recorded)")
  args = p.parse_args(argv)
  if args.timing:
    args.gammas = args.gammas or "2,4,6"
    return timing_main(args)
  args.gammas = args.gammas or "1,2,3,4,5,6,7,8"
  path = args.model or find_smollm2()
  if path is None:
    p.error(f"no --model and SmolLM2 is not installed: {SMOLLM2_INSTALL}")
  dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  t0 = time.perf_counter()
  model = llama.from_pretrained(path, dtype=dtype)
  if args.doc_question:
    prompts, lengths = doc_question_prompts(
        load_tokenizer(path), [int(x) for x in args.doc_question.split(",")])
    print(f"document-question prompts of {lengths.tolist()} tokens", flush=True)
  else:
    prompts = text_prompts(load_tokenizer(path), args.prompts, args.prompt_len)
    lengths = np.full((args.prompts,), args.prompt_len)
  print(f"loaded {os.path.basename(path)} in {time.perf_counter() - t0:.1f}s", flush=True)
  plain = None
  if not args.no_check:
    plain, _ = jaxkv.generate(model, prompts, lengths, kv_format="quantspec",
                              max_new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk)
    plain = np.asarray(plain)
  rows = []
  for draft in args.draft.split(","):
    weights = draft
    if draft.endswith("-rtn"):  # round-to-nearest draft weights (the default fit is mse)
      if draft not in ("int4-rtn", "int8-rtn"):
        p.error(f"--draft {draft!r}: -rtn goes with int4 or int8")
      weights = model.quantize_weights(bits=int(draft[3:-4]), fit="rtn")
    for gamma in (int(g) for g in args.gammas.split(",")):
      t1 = time.perf_counter()
      tokens, _, st = jaxkv.speculative_generate(
          model, prompts, lengths, max_new_tokens=args.new_tokens, gamma=gamma,
          draft_weights=weights, prefill_chunk=args.prefill_chunk)
      tokens = np.asarray(tokens)
      row = dict(draft_weights=draft, gamma=gamma, acceptance_rate=st["acceptance_rate"],
                 tokens_per_verification=st["tokens_per_verification"],
                 per_sequence_acceptance=(st["accepted"] / np.maximum(
                     1, gamma * st["verifications"])).round(4).tolist(),
                 verifications=st["verifications"].tolist(),
                 wall_s_with_compile=round(time.perf_counter() - t1, 1))
      if plain is not None:
        row["matches_plain_greedy"] = float(np.mean(tokens == plain))
      rows.append(row)
      print(json.dumps(row), flush=True)
  result = dict(settings=dict(model=os.path.basename(path), platform=jax.default_backend(),
                              dtype=jnp.dtype(dtype).name, prompts=len(lengths),
                              prompt_len=args.prompt_len if not args.doc_question else None,
                              prompt_lengths=np.asarray(lengths).tolist(),
                              new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk,
                              kv_format="quantspec", sampler="greedy",
                              text="pydoc_data.topics windows (jaxkv.fidelity.reference_text)"
                              + (f", as chat prompts: window + {DOC_QUESTION!r}"
                                 if args.doc_question else ""),
                              jax=jax.__version__, wall_s=round(time.perf_counter() - t0, 1)),
                rows=rows)
  tag = args.tag or jax.default_backend()
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f"speculative-{tag}")
  with open(stem + ".json", "w") as f:
    json.dump(result, f, indent=1)
  plot(result, stem + ".png")
  print(f"\n| draft | gamma | acceptance | tokens/verification |\n|---|---|---|---|")
  for r in rows:
    print(f"| {r['draft_weights']} | {r['gamma']} | {r['acceptance_rate']:.3f} | "
          f"{r['tokens_per_verification']:.2f} |")
  print(f"\nwrote {stem}.json and .png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
