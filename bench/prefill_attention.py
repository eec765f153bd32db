"""How fast is a prefill chunk's attention over a cached history?

`jaxkv.chunk_attention` (one chunk of ``c`` queries over ``L`` history
tokens plus itself, causal) for its implementations, beside cuDNN BF16 in the
same process: causal over the chunk alone (the work of an empty history) and
non-causal over ``[history; chunk]`` (a little more work than the chunk
needs: its own part is dense instead of causal). Llama-3.1-8B attention
shapes (Hq 32, Hkv 8, D 128), B=1, bf16 queries; kernel time from the
profiler (`jaxkv.timing.kernel_time`), compile excluded. TFLOP/s counts the
useful work ``4 Hq D (c L + c^2 / 2)``.

  python3 bench/prefill_attention.py --out DIR [--impls pallas,xla]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxkv  # noqa: E402
from jax.experimental.pallas.ops.gpu.attention import mha as jax_mha  # noqa: E402
from jaxkv.timing import kernel_time  # noqa: E402
from pallas_kernels.chunk_attention import ChunkAttentionConfig  # noqa: E402


def parse_config(text: str) -> ChunkAttentionConfig:
  """``"BQxBKxWARPSxSTAGES"`` -> `ChunkAttentionConfig`."""
  bq, bk, w, st = (int(x) for x in text.split("x"))
  return ChunkAttentionConfig(block_q=bq, block_k=bk, num_warps=w, num_stages=st)


def case(fmt: str, hist: int, chunk: int, impls, configs=(None,), hq=32, hkv=8,
         d=128) -> list[dict]:
  rng = np.random.default_rng(hist + chunk)
  bf = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)  # noqa: E731
  cap = max(hist, 1) + 256
  cache = jaxkv.KVCache.init(fmt, 1, hkv, d, cap, jnp.bfloat16)
  if hist:
    cache = cache.prefill(bf(1, hist, hkv, d), bf(1, hist, hkv, d), jnp.asarray([hist]))
  q, kc, vc = bf(1, chunk, hq, d), bf(1, chunk, hkv, d), bf(1, chunk, hkv, d)
  flops = 4 * hq * d * (chunk * hist + chunk * chunk / 2)
  rows = []

  def record(name, fn, args):
    try:
      t = kernel_time(fn, [args], calls=5)
      rows.append(dict(format=fmt, history=hist, chunk=chunk, impl=name,
                       kernel_ms=t["kernel"] * 1e3, span_ms=t["span"] * 1e3,
                       kernels=t["kernels"], tflops=flops / t["kernel"] / 1e12))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(format=fmt, history=hist, chunk=chunk, impl=name,
                       error=f"{type(e).__name__}: {str(e)[:300]}"))

  for impl in impls:
    for cfg in (configs if impl == "pallas" else (None,)):
      name = impl if cfg is None else (f"{impl} {cfg.block_q}x{cfg.block_k}"
                                       f"x{cfg.num_warps}x{cfg.num_stages}")
      record(name, lambda q, c, k, v, impl=impl, cfg=cfg: jaxkv.chunk_attention(
          q, c, k, v, implementation=impl, config=cfg), (q, cache, kc, vc))
  if fmt == "bf16":
    g = hq // hkv
    record("xla-causal-chunk-only",
           lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation="xla"), (q, kc, vc))
    # JAX's own Pallas-Triton flash attention (no GQA: K/V repeated per head).
    record("jax-pallas-mha-causal-chunk-only",
           lambda q, k, v: jax_mha(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2),
                                   None, sm_scale=d ** -0.5, causal=True), (q, kc, vc))
    record("cudnn-causal-chunk-only",
           lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation="cudnn"), (q, kc, vc))
    if hist:
      kh, vh = bf(1, hist, hkv, d), bf(1, hist, hkv, d)
      record("cudnn-dense-hist+chunk",
             lambda q, kh, vh, k, v: jax.nn.dot_product_attention(
                 q, jnp.concatenate([kh, k], 1), jnp.concatenate([vh, v], 1),
                 implementation="cudnn"), (q, kh, vh, kc, vc))
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--formats", default="bf16,kivi4")
  p.add_argument("--histories", default="0,8192,28672")
  p.add_argument("--chunk", type=int, default=4096)
  p.add_argument("--impls", default="pallas")
  p.add_argument("--configs", default="",
                 help="Pallas configs to sweep, comma-separated BQxBKxWARPSxSTAGES "
                      "(default: the kernel's default config)")
  p.add_argument("--tag", default="", help="file name tag of the JSON")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  rows = []
  for fmt in args.formats.split(","):
    for hist in (int(x) for x in args.histories.split(",")):
      configs = [parse_config(c) for c in args.configs.split(",") if c] or [None]
      rows += case(fmt, hist, args.chunk, args.impls.split(","), configs)
      r = rows[-1]
      print(json.dumps(r), flush=True)
  dev = jax.devices()[0]
  meta = dict(device=dev.device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M"))
  print(f"\n{meta}\n{'format':7} {'hist':>6} {'impl':34} {'ms':>8} {'TFLOP/s':>8}")
  for r in rows:
    if "error" in r:
      print(f"{r['format']:7} {r['history']:6} {r['impl']:34} ERROR {r['error'][:80]}")
    else:
      print(f"{r['format']:7} {r['history']:6} {r['impl']:34} {r['kernel_ms']:8.3f} "
            f"{r['tflops']:8.1f}")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    name = dev.device_kind.lower().replace(" ", "-")
    tag = f"-{args.tag}" if args.tag else ""
    with open(os.path.join(args.out, f"prefill-attention{tag}-{name}.json"), "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
