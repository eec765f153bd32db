"""Command line: ``python -m jaxkv [demo | generate | formats] ...``.

* ``demo`` (default): a small random-weight Llama decodes the same prompt with
  the bf16 cache and with every preset; prints memory per token, decode
  tokens/s and greedy agreement with the bf16 cache. CPU: well under a minute;
  on a GPU the Pallas kernels are used.
* ``generate``: text generation from a HF Llama checkpoint directory
  (config.json, safetensors, tokenizer.json) on a chosen cache format.
* ``formats``: memory and attention error of every preset (`jaxkv.report`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

COMMANDS = ("demo", "generate", "formats")


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxkv", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command")

  d = sub.add_parser("demo", help="random tiny Llama: bf16 cache vs every preset")
  d.add_argument("--config", default="tiny", help="built-in model config (models.llama.CONFIGS)")
  d.add_argument("--prompt-len", type=int, default=384, help="prompt tokens per sequence")
  d.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
  d.add_argument("--batch", type=int, default=2)
  d.add_argument("--formats", default="all", help="comma-separated presets, or 'all'")
  d.add_argument("--seed", type=int, default=0)
  d.add_argument("--implementation", default=None, help="decode_attention implementation")

  g = sub.add_parser("generate", help="generate text from a HF Llama checkpoint")
  g.add_argument("--checkpoint", required=True, help="HF model directory")
  g.add_argument("--kv", default="kivi4", help="cache format preset")
  g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
  g.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
  g.add_argument("--max-new-tokens", type=int, default=128)
  g.add_argument("--sampler", default="greedy", choices=["greedy", "sample"])
  g.add_argument("--temperature", type=float, default=1.0)
  g.add_argument("--top-k", type=int, default=None)
  g.add_argument("--top-p", type=float, default=None)
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--dtype", default=None, choices=[None, "bfloat16", "float32", "float16"],
                 help="parameter dtype (default: the checkpoint's)")
  g.add_argument("--capacity", type=int, default=None, help="cache tokens per sequence")
  g.add_argument("--implementation", default=None, help="decode_attention implementation")
  g.add_argument("--no-stop", action="store_true", help="ignore EOS tokens")
  g.add_argument("--no-progress", action="store_true", help="no progress bar")

  sub.add_parser("formats", help="memory and attention error of every preset")
  return p


def main(argv=None) -> int:
  """Entry point; returns a process exit code."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
    argv = ["demo"] + argv
  args = _parser().parse_args(argv)
  try:
    if args.command == "generate":
      return _generate(args)
    if args.command == "formats":
      return _formats()
    return _demo(args)
  except ValueError as e:  # user errors: bad checkpoint, format, prompt
    print(f"error: {e}", file=sys.stderr)
    return 2


# ------------------------------------------------------------------ formats
def _formats() -> int:
  from jaxkv.report import format_report, print_report  # pylint: disable=import-outside-toplevel
  print_report(format_report())
  return 0


def _mib(n: float) -> str:
  return f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------- demo
def _demo(args) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxkv.formats import PRESETS, KVFormat
  from jaxkv.decoding import cache_nbytes, generate
  from models import llama

  config = llama.LlamaConfig.named(args.config)
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32  # CPU bf16 matmuls are slow
  names = list(PRESETS) if args.formats == "all" else args.formats.split(",")
  for name in names:
    KVFormat.preset(name)  # ValueError for unknown names
  if "bf16" not in names:
    names = ["bf16"] + names
  model = llama.random_model(config, seed=args.seed, dtype=dtype)
  rng = np.random.default_rng(args.seed)
  b, t, n = args.batch, args.prompt_len, args.new_tokens
  tokens = rng.integers(0, config.vocab_size, (b, t))
  lengths = np.full((b,), t)
  capacity = t + n
  print(f"jaxkv demo: random-weight Llama {args.config!r} ({llama.param_count(model) / 1e6:.1f}M "
        f"params, {config.num_layers} layers, Hq={config.num_heads}, Hkv={config.num_kv_heads}, "
        f"D={config.head_dim}), {jax.devices()[0].platform.upper()} "
        f"({jax.devices()[0].device_kind}), batch {b}, prompt {t}, {n} new tokens, "
        f"greedy, bf16 cache dtype")

  def run(fmt, steps):
    out, _ = generate(model, tokens, lengths, kv_format=fmt, max_new_tokens=n,
                      cache_dtype=jnp.bfloat16, implementation=args.implementation,
                      num_steps=steps)
    return np.asarray(out)

  def best_time(fmt, steps, repeats=3):
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      out = run(fmt, steps)
      times.append(time.perf_counter() - t0)
    return min(times), out

  rows, ref = [], None
  for name in names:
    fmt = KVFormat.preset(name)
    t0 = time.perf_counter()
    run(fmt, 1)  # compile + prefill + first token
    compile_s = time.perf_counter() - t0
    prefill_s, _ = best_time(fmt, 1)
    total_s, out = best_time(fmt, n)
    decode_s = max(total_s - prefill_s, 1e-9)
    if ref is None:
      ref = out
    differs = out != ref
    first_diff = np.where(differs.any(axis=1), np.argmax(differs, axis=1), n)  # per sequence
    packed = fmt.bytes_per_token(config.num_kv_heads, config.head_dim) * config.num_layers
    rows.append(dict(format=name, bytes_per_token=packed,
                     cache_bytes=cache_nbytes(model, fmt, b, capacity, jnp.bfloat16),
                     decode_tok_s=b * (n - 1) / decode_s, prefill_s=prefill_s,
                     compile_s=compile_s, agreement=float(np.mean(first_diff) / n),
                     first_divergence=int(first_diff.min())))
  base = rows[0]["bytes_per_token"]
  print(f"\n{'format':<14} {'KB/token':>9} {'vs bf16':>8} {'cache':>10} {'decode tok/s':>13} "
        f"{'agree':>6} {'1st diff':>8}")
  for r in rows:
    print(f"{r['format']:<14} {r['bytes_per_token'] / 1024:>9.2f} "
          f"{base / r['bytes_per_token']:>7.2f}x {_mib(r['cache_bytes']):>10} "
          f"{r['decode_tok_s']:>13.1f} {r['agreement']:>6.1%} {r['first_divergence']:>8}")
  print("\nKB/token: packed K+V bytes over all layers (codes + scales); cache: allocated bytes "
        f"for {b}x{capacity} tokens incl. the {PRESETS['kivi4'].residual}-token full-precision "
        "residual block. agree: mean fraction of greedy tokens identical to the bf16 cache's "
        "before a sequence first differs; 1st diff: first step where any sequence differs. Random weights give flat next-token distributions, so "
        "agreement understates what trained models show.")
  return 0


# ----------------------------------------------------------------- generate
def _load_tokenizer(path):
  tok_path = os.path.join(path, "tokenizer.json")
  if not os.path.isfile(tok_path):
    return None
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  return Tokenizer.from_file(tok_path)


def _stop_ids(path, config) -> list[int]:
  stops = set(config.eos_token_ids)
  gen_cfg = os.path.join(path, "generation_config.json")
  if os.path.isfile(gen_cfg):
    with open(gen_cfg) as f:
      eos = json.load(f).get("eos_token_id")
    if eos is not None:
      stops.update(eos if isinstance(eos, list) else [eos])
  return sorted(stops)


def _generate(args) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxkv.formats import KVFormat
  from jaxkv.decoding import cache_nbytes, generate
  from models import llama

  fmt = KVFormat.preset(args.kv)
  t0 = time.perf_counter()
  model = llama.from_pretrained(args.checkpoint, dtype=args.dtype)
  load_s = time.perf_counter() - t0
  config = model.config
  tokenizer = _load_tokenizer(args.checkpoint)
  if args.prompt_ids:
    prompts = [[int(x) for x in args.prompt_ids.split(",") if x.strip()]]
  else:
    if not args.prompt:
      raise ValueError("give --prompt TEXT (or --prompt-ids)")
    if tokenizer is None:
      raise ValueError(f"{args.checkpoint!r} has no tokenizer.json; use --prompt-ids")
    prompts = [tokenizer.encode(p).ids for p in args.prompt]
  if any(len(p) == 0 for p in prompts):
    raise ValueError("empty prompt")
  b, t, n = len(prompts), max(len(p) for p in prompts), args.max_new_tokens
  tokens = np.zeros((b, t), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p  # right padding
  lengths = np.array([len(p) for p in prompts])
  stops = [] if args.no_stop else _stop_ids(args.checkpoint, config)
  capacity = args.capacity or t + n


  def progress(step):
    stamps.append(time.perf_counter())
    if bar is not None:
      bar.update(1)

  print(f"loaded {args.checkpoint} ({llama.param_count(model) / 1e6:.1f}M params, "
        f"{model.dtype.name}) in {load_s:.1f}s; {jax.devices()[0].device_kind}", file=sys.stderr)
  stamps = []
  bar = None
  if not args.no_progress:
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    bar = tqdm(total=n, unit="tok", desc=f"generate ({args.kv})", file=sys.stderr)
  t0 = time.perf_counter()
  out, out_len = generate(
      model, tokens, lengths, kv_format=fmt, max_new_tokens=n, sampler=args.sampler,
      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
      stop_tokens=stops or None, rng=jax.random.key(args.seed), capacity=capacity,
      implementation=args.implementation, progress=progress)
  out, out_len = np.asarray(out), np.asarray(out_len)
  total_s = time.perf_counter() - t0
  if bar is not None:
    bar.close()

  for i in range(b):
    ids = prompts[i] + out[i, :out_len[i]].tolist()  # decode together: spacing is right
    text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
    if b > 1:
      print(f"--- [{i}]")
    print(text)
  generated = int(out_len.sum())
  steps = len(stamps)
  decode_s = stamps[-1] - stamps[0] if steps > 1 else float("nan")
  cache = cache_nbytes(model, fmt, b, capacity)
  print(f"\n{generated} tokens in {total_s:.2f}s (compile + prefill {stamps[0] - t0:.2f}s); "
        f"decode {b * (steps - 1) / decode_s:.1f} tokens/s ({steps - 1} steps x batch {b}); "
        f"KV cache {args.kv}: {_mib(cache)} for {b}x{capacity} tokens "
        f"({cache / (b * capacity) / 1024:.1f} KB/token)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
