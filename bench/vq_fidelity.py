"""VQ presets (cq4, cq2) against KIVI on a real model: perplexity and next-token KL.

Every format runs through the model's own cache (`model.init_cache`: a
`jaxkv.ModelCache`, or a `jaxkv.VQModelCache` with the learned codebooks):
``model.prefill`` of the prompt (full-precision causal attention over it, its
K/V then stored), then ``steps`` teacher-forced ``model.decode`` steps over
the (quantized) cache in one jitted `lax.scan`. Codebooks are learned with
`jaxkv.vq.fit` on the K/V (`jaxkv.vq.calibration_kv`) of *other* text of
the same document (the last ``--calib`` tokens, never an evaluated window),
cut into rows of the evaluated window's length: keys are stored after RoPE,
so codebooks fitted on positions the cache never serves fit it worse (cq2 KL
0.385 with one 8192-token row against 0.074 with 512-token rows,
`bench/results/vq-NOTES.md`).

  python bench/vq_fidelity.py                    # SmolLM2, 1 window of 384 + 128 tokens
  python bench/vq_fidelity.py --windows 2 --calib 8192     # 16 calibration rows of 512

Writes ``vq-fidelity-<platform>.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxkv  # noqa: E402
from jaxkv import fidelity, vq  # noqa: E402
from models import llama  # noqa: E402
from models.gguf import SMOLLM2_INSTALL, find_smollm2  # noqa: E402
from models.tokenizer import load_tokenizer  # noqa: E402

FORMATS = ("bf16", "kivi4", "kivi2", "kivi4-g32", "kivi2-g32", "cq4", "cq2")


@functools.partial(jax.jit, static_argnums=0)
def _forced_logp(graphdef, state, cache, prompt, inputs):
  """Prefills ``prompt [B, P]``, then teacher-forces ``inputs [steps, B]`` one token a step.

  Returns the log-probabilities ``[steps, B, V]`` of every step. As every
  user of the model: the prompt attends to itself in the cache dtype (bf16)
  and the decode steps run `jaxkv.decode_attention` over the stored cache.
  """
  model = nnx.merge(graphdef, state)
  b, p = prompt.shape
  _, cache = model.prefill(prompt, jnp.full((b,), p, jnp.int32), cache)

  def step(cache, token):
    logits, cache = model.decode(token[:, None], cache, implementation="reference")
    return cache, jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)

  _, logp = jax.lax.scan(step, cache, inputs)
  return logp


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
  p.add_argument("--prompt", type=int, default=384, help="prompt tokens per window")
  p.add_argument("--steps", type=int, default=128, help="teacher-forced scored tokens")
  p.add_argument("--windows", type=int, default=1, help="text windows (batch rows)")
  p.add_argument("--calib", type=int, default=2048, help="calibration tokens for k-means")
  p.add_argument("--iters", type=int, default=16, help="Lloyd iterations")
  p.add_argument("--calib-window", type=int, default=None,
                 help="calibrate on rows of this many tokens (default: the evaluated window, "
                      "prompt + steps), so the keys sit at the positions the windows use "
                      "(post-RoPE codebooks depend on them); 0 = one row of --calib tokens")
  p.add_argument("--formats", default=",".join(FORMATS),
                 help="presets (VQ ones include sink variants such as cq2-s4); a KV preset "
                      "with '-sN' appended keeps its first N tokens exact (sink_tokens=N)")
  p.add_argument("--offset", type=int, default=0,
                 help="first token of the first window in the reference text (the windows "
                      "must end before the calibration tokens, the text's last --calib)")
  p.add_argument("--amortize", type=int, default=8192,
                 help="tokens the VQ codebooks are amortized over in bytes/token")
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  args = p.parse_args(argv)
  path = args.model or find_smollm2()
  if path is None:
    p.error(f"no --model and SmolLM2 is not installed: {SMOLLM2_INSTALL}")
  t0 = time.perf_counter()
  dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  model = llama.from_pretrained(path, dtype=dtype)
  cfg = model.config
  tokens = np.asarray(load_tokenizer(path).encode(fidelity.reference_text()), np.int32)
  graphdef, state = nnx.split(model)
  span = args.prompt + args.steps + 1
  end = args.offset + args.windows * span
  if args.offset < 0 or end > len(tokens) - args.calib:
    p.error(f"--offset {args.offset}: the windows end at token {end}, past the start of "
            f"the calibration tokens ({len(tokens) - args.calib} of {len(tokens)})")
  windows = np.stack([tokens[args.offset + j * span:args.offset + (j + 1) * span]
                      for j in range(args.windows)])
  calib = tokens[-args.calib:][None]  # the end of the text: disjoint from the windows
  w = args.prompt + args.steps if args.calib_window is None else args.calib_window
  if w:  # rows of w tokens: keys at positions 0..w-1, the positions the windows use
    if args.calib < w:
      raise ValueError(f"--calib {args.calib} is shorter than one calibration row "
                       f"(--calib-window {w})")
    calib = calib[:, : args.calib // w * w].reshape(-1, w)
  print(f"loaded {os.path.basename(path)} in {time.perf_counter() - t0:.0f}s; "
        f"{len(tokens)} text tokens", flush=True)

  k_calib, v_calib = vq.calibration_kv(model, calib)  # [L, N, Hkv, D]

  def without_sinks(x, sinks):  # each calibration row's first `sinks` tokens left out
    if not sinks:              # (what `vq.calibration_kv(..., sink_tokens=)` returns)
      return x
    per_row = x.reshape(x.shape[0], calib.shape[0], calib.shape[1], *x.shape[2:])
    return per_row[:, :, sinks:].reshape(x.shape[0], -1, *x.shape[2:])

  prompt = jnp.asarray(windows[:, :args.prompt])
  inputs = jnp.asarray(windows[:, args.prompt:args.prompt + args.steps].T)   # [steps, B]
  targets = windows[:, args.prompt + 1:args.prompt + args.steps + 1]         # [B, steps]
  b = windows.shape[0]
  capacity = args.prompt + args.steps

  rows, ref_logp = [], None
  for name in args.formats.split(","):
    t1 = time.perf_counter()
    if name in vq.VQ_PRESETS:
      fmt = vq.VQ_PRESETS[name]
      books = vq.fit(without_sinks(k_calib, fmt.sink_tokens),
                     without_sinks(v_calib, fmt.sink_tokens), fmt, seed=0, iters=args.iters)
      cache = model.init_cache(fmt, b, capacity, jnp.bfloat16, codebooks=books)
      bpt = fmt.bytes_per_token(cfg.num_kv_heads, cfg.head_dim, context=args.amortize,
                                sequence_length=capacity)  # sinks over the window
    else:
      base, _, sinks = name.rpartition("-s")
      if base and sinks.isdigit() and base in jaxkv.PRESETS:  # e.g. kivi2-g32-s4
        fmt = dataclasses.replace(jaxkv.KVFormat.preset(base), sink_tokens=int(sinks))
      else:
        fmt = jaxkv.KVFormat.preset(name)
      cache = model.init_cache(fmt, b, capacity, jnp.bfloat16, use_kernel=False)
      # KVFormat.bytes_per_token leaves the sinks out: bf16 K and V rows over the window
      bpt = (fmt.bytes_per_token(cfg.num_kv_heads, cfg.head_dim)
             + 2 * fmt.sink_tokens * cfg.num_kv_heads * cfg.head_dim * 2 / capacity)
    logp = np.asarray(_forced_logp(graphdef, state, cache, prompt, inputs))  # [steps, B, V]
    target_lp = np.take_along_axis(logp, targets.T[:, :, None], axis=-1)[..., 0]
    if ref_logp is None:
      ref_logp = logp
    row = {"format": name, "bytes_per_token_all_layers": bpt * cfg.num_layers,
           "perplexity": fidelity.perplexity(target_lp),
           "kl_vs_first": float(fidelity.kl_divergence(ref_logp, logp).mean()),
           "seconds": time.perf_counter() - t1}
    rows.append(row)
    print(f"{name:6s} ppl {row['perplexity']:.3f}  KL {row['kl_vs_first']:.4f}  "
          f"bytes/token {row['bytes_per_token_all_layers']:.0f}  ({row['seconds']:.0f}s)",
          flush=True)

  result = {"settings": {**vars(args), "model": os.path.basename(path),
                         "device": jax.default_backend(), "jax": jax.__version__,
                         "cache_dtype": "bfloat16", "model_dtype": jnp.dtype(dtype).name,
                         "text": "pydoc_data.topics; calibration = the last --calib tokens",
                         "wall_s": time.perf_counter() - t0},
            "rows": rows}
  os.makedirs(args.out, exist_ok=True)
  out = os.path.join(args.out, f"vq-fidelity-{jax.default_backend()}.json")
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  print("\n| format | perplexity | KL vs " + rows[0]["format"] + " | bytes/token (all layers) |")
  print("|---|---|---|---|")
  for r in rows:
    print(f"| {r['format']} | {r['perplexity']:.3f} | {r['kl_vs_first']:.4f} | "
          f"{r['bytes_per_token_all_layers']:.0f} |")
  print(f"\nwrote {out} ({result['settings']['wall_s']:.0f}s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
