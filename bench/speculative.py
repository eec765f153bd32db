"""Self-speculative decoding (QuantSpec): acceptance per gamma on a real model.

Greedy `jaxkv.speculative_generate` on SmolLM2-135M (GGUF, offline) over
English text windows from Python's reference documentation (`jaxkv.fidelity.
reference_text`): for each gamma, the fraction of drafted tokens the target
accepts and the tokens emitted per verification pass, with the draft reading
the cache's upper 4-bit plane and (``--draft int4``) 4-bit group-wise
weights. Each output is checked token for token against plain greedy
`jaxkv.generate` on the same ``quantspec`` cache. Writes
``bench/results/speculative-<tag>.json`` and ``.png``; wall times include
compilation (CPU runs measure acceptance, not speed; GPU timing: see
``bench/results/speculative-NOTES.md``).
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
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import fidelity  # noqa: E402
from models import llama  # noqa: E402
from models.gguf import SMOLLM2_INSTALL, find_smollm2  # noqa: E402
from models.tokenizer import load_tokenizer  # noqa: E402


def text_prompts(tokenizer, count: int, length: int) -> np.ndarray:
  """``[count, length]`` token windows spread over the reference text."""
  tokens = tokenizer.encode(fidelity.reference_text())
  starts = np.linspace(0, len(tokens) - length - 1, count).astype(int)
  return np.stack([np.asarray(tokens[s:s + length]) for s in starts])


def plot(result: dict, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
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


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
  p.add_argument("--gammas", default="1,2,3,4,5,6,7,8")
  p.add_argument("--draft", default="int4", help="comma-separated draft weights: int4,int8,full")
  p.add_argument("--prompts", type=int, default=4, help="text windows (the batch)")
  p.add_argument("--prompt-len", type=int, default=448, help="tokens per window")
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--no-check", action="store_true", help="skip the plain greedy comparison")
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  p.add_argument("--tag", default=None, help="file name tag (default: the platform)")
  args = p.parse_args(argv)
  path = args.model or find_smollm2()
  if path is None:
    p.error(f"no --model and SmolLM2 is not installed: {SMOLLM2_INSTALL}")
  dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  t0 = time.perf_counter()
  model = llama.from_pretrained(path, dtype=dtype)
  prompts = text_prompts(load_tokenizer(path), args.prompts, args.prompt_len)
  lengths = np.full((args.prompts,), args.prompt_len)
  print(f"loaded {os.path.basename(path)} in {time.perf_counter() - t0:.1f}s", flush=True)
  plain = None
  if not args.no_check:
    plain, _ = jaxkv.generate(model, prompts, lengths, kv_format="quantspec",
                              max_new_tokens=args.new_tokens)
    plain = np.asarray(plain)
  rows = []
  for draft in args.draft.split(","):
    for gamma in (int(g) for g in args.gammas.split(",")):
      t1 = time.perf_counter()
      tokens, _, st = jaxkv.speculative_generate(
          model, prompts, lengths, max_new_tokens=args.new_tokens, gamma=gamma,
          draft_weights=draft)
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
                              dtype=jnp.dtype(dtype).name, prompts=args.prompts,
                              prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                              kv_format="quantspec", sampler="greedy",
                              text="pydoc_data.topics windows (jaxkv.fidelity.reference_text)",
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
