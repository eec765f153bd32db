"""What does the structure of a jitted decode loop cost per step?

Suspects: per-call host work (``nnx.split`` of the model: ~15-25 ms for
Llama-3.1-8B), and the while loop's data-dependent condition (copied to the
host every iteration on the GPU before the next body launches). This script times the same greedy decode step
inside differently structured loops, in one process on one cache, so the
per-step cost of the structure shows up as a difference:

- ``decode_steps``: `jaxkv.decode_steps` as a user calls it (host-side
  ``nnx.split`` and argument conversion included).
- ``split``: `jaxkv.decode_steps` on a `jaxkv.SplitModel` (no per-call split).
- ``while``: the same compiled program called with prepared arguments.
- ``fori``: a `lax.fori_loop` with a static trip count, no early exit.
- ``chunked``: a while loop over chunks of ``--chunk`` statically counted
  steps (an early exit checked once per chunk).

Run it again with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=...,WHILE,CONDITIONAL``
to see whether CUDA-graph capture of the loop closes the gap.

Example (GPU machine)::

  python bench/loop_overhead.py --format kivi4 --context 32768 --steps 16
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
from flax import nnx  # noqa: E402

import jaxkv  # noqa: E402
from bench import e2e  # noqa: E402
from jaxkv import decoding  # noqa: E402
from models import llama  # noqa: E402


def _greedy_step(graphdef, state, token, cache):
  logits, cache = jaxkv.decode_step(nnx.merge(graphdef, state), token, cache)
  return decoding.greedy(logits), cache


def _fori(n):
  def run(graphdef, state, token, cache):
    def body(i, carry):
      token, cache, out = carry
      token, cache = _greedy_step(graphdef, state, token, cache)
      return token, cache, out.at[:, i].set(token)
    out = jnp.zeros((token.shape[0], n), jnp.int32)
    return jax.lax.fori_loop(0, n, body, (token, cache, out))
  return jax.jit(run, donate_argnums=3, static_argnums=0)


def _chunked(n, chunk):
  def run(graphdef, state, token, cache):
    def inner(i, carry):
      step, token, cache, out = carry
      token, cache = _greedy_step(graphdef, state, token, cache)
      return step + 1, token, cache, jax.lax.dynamic_update_slice(out, token[:, None], (0, step))

    def outer(carry):
      return jax.lax.fori_loop(0, chunk, inner, carry)

    def cond(carry):
      return carry[0] < n  # stands for "steps left and some sequence not done"

    out = jnp.zeros((token.shape[0], n), jnp.int32)
    return jax.lax.while_loop(cond, outer, (jnp.int32(0), token, cache, out))
  return jax.jit(run, donate_argnums=3, static_argnums=0)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="llama-3.1-8b")
  p.add_argument("--format", default="kivi4")
  p.add_argument("--context", type=int, default=32768)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--steps", type=int, default=16, help="steps per loop (a multiple of --chunk)")
  p.add_argument("--chunk", type=int, default=8)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--variants", default="decode_steps,split,while,fori,chunked")
  p.add_argument("--out", default=None, help="JSON path")
  args = p.parse_args(argv)
  if args.steps % args.chunk:
    raise ValueError(f"--steps={args.steps} must be a multiple of --chunk={args.chunk}")

  model = llama.random_model(llama.LlamaConfig.named(args.config), dtype=jnp.bfloat16)
  graphdef, state = nnx.split(model)
  split = jaxkv.SplitModel(model)
  capacity = args.context + (args.reps + 2) * args.steps * len(args.variants.split(",")) + 256
  cache = e2e.fill_cache(model, jaxkv.KVFormat.preset(args.format), args.batch, args.context,
                         capacity, seed=0)
  token = jnp.zeros((args.batch,), jnp.int32)
  n = args.steps
  settings = decoding._settings(model, n, "greedy", 1.0, None, None, None, None)  # pylint: disable=protected-access
  extra = (jnp.zeros((args.batch, 0), jnp.int32), jnp.float32(1), jnp.float32(1), jnp.int32(0))

  def call(variant, token, cache):
    if variant == "decode_steps":
      out, _, cache = jaxkv.decode_steps(model, token, cache, n)
    elif variant == "split":
      out, _, cache = jaxkv.decode_steps(split, token, cache, n)
    elif variant == "while":
      out, _, cache = decoding._decode_steps_program(  # pylint: disable=protected-access
          graphdef, state, token, cache, jax.random.key(0), *extra, settings=settings)
    elif variant == "fori":
      _, cache, out = fns["fori"](graphdef, state, token, cache)
    elif variant == "chunked":
      _, _, cache, out = fns["chunked"](graphdef, state, token, cache)
    else:
      raise ValueError(f"unknown variant {variant!r}")
    return out, cache

  fns = {"fori": _fori(n), "chunked": _chunked(n, args.chunk)}
  rows = []
  for variant in args.variants.split(","):
    t0 = time.perf_counter()
    out, cache = call(variant, token, cache)
    out.block_until_ready()
    compile_s = time.perf_counter() - t0
    times = []
    for rep in range(args.reps + 1):
      last = out[:, -1]
      last.block_until_ready()
      t0 = time.perf_counter()
      out, cache = call(variant, last, cache)
      out.block_until_ready()
      if rep:
        times.append((time.perf_counter() - t0) / n * 1e6)
    rows.append(dict(variant=variant, us_per_step=float(np.median(times)),
                     min_us=float(np.min(times)), compile_s=compile_s))
    print(f"{variant:14s} {np.median(times):9.1f} us/step (min {np.min(times):.1f}, "
          f"compile+first {compile_s:.1f}s)", flush=True)
  result = dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                xla_flags=os.environ.get("XLA_FLAGS", ""), config=args.config,
                format=args.format, context=args.context, batch=args.batch, steps=n,
                chunk=args.chunk, rows=rows)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
