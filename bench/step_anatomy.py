"""What each kernel of one decode step is: profiler time per HLO op, with the ops it fuses.

Issue 12's profile groups a step's ~720 kernels into families; this script
names the small ones. It compiles the decode step of Llama-3.1-8B widths with
fewer layers (``--layers``; the per-layer kernels do not depend on depth),
fills a cache with random K/V, profiles ``--steps`` jitted decode calls, and
joins each kernel's name (its fusion's name, '.' -> '_'; the CUPTI ``hlo_op``
is the command buffer the whole step runs in) with the optimized HLO of the
step: for every fusion, its kind and the ops inside it. The launch gaps are
the span of a step minus the sum of its kernels.

Usage (GPU machine)::

  python bench/step_anatomy.py --formats kivi4,bf16 --context 32768 --out $OUT
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import e2e  # noqa: E402
from jaxkv.timing import gpu_kernel_events  # noqa: E402
from models import draft_weights as dw  # noqa: E402
from models import llama  # noqa: E402

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%?[\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\(")


def fusion_bodies(hlo: str) -> dict[str, str]:
  """``{fusion instruction name: "kind: op op ..."}`` from optimized HLO text."""
  comps, cur = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head:
      cur = comps.setdefault(head.group(1), [])
      continue
    m = _INSTR.match(line)
    if m and cur is not None:
      cur.append((m.group(1).lstrip("%"), m.group(3), line))
  out = {}
  for instrs in comps.values():
    for name, op, line in instrs:
      if op != "fusion" and op != "custom-call":
        continue
      kind = re.search(r"kind=(\w+)", line)
      called = re.search(r"calls=%?([\w.\-]+)", line)
      shape = line.split("=", 1)[1].split(op, 1)[0].strip()
      body = []
      if called and called.group(1) in comps:
        body = [o for _, o, _ in comps[called.group(1)] if o != "parameter"]
      target = re.search(r'custom_call_target="([^"]+)"', line)
      desc = (kind.group(1) if kind else (target.group(1) if target else op))
      out[re.sub(r"[.\-]", "_", name)] = f"{desc} -> {shape[:60]}: " + " ".join(reversed(body))[:200]
  return out


def _profile(name: str, run, hlo: str, steps: int, layers: int, context: int, log) -> dict:
  """Profiles ``run()`` (``steps`` steps, its result waited for) after one warm-up call;
  groups the kernels by HLO op and joins them with ``hlo``'s fusion bodies."""
  bodies = fusion_bodies(hlo)
  jax.block_until_ready(run())
  trace = tempfile.mkdtemp(prefix=f"anatomy-{name}-")
  jax.profiler.start_trace(trace)
  jax.block_until_ready(run())
  jax.profiler.stop_trace()
  events = gpu_kernel_events(trace, details=True)
  per_op = collections.defaultdict(lambda: [0, 0.0, ""])
  for kname, _, dur, _, stats in events:
    op = kname  # the fusion's name ('.' -> '_'); hlo_op is the command buffer
    per_op[op][0] += 1
    per_op[op][1] += dur / 1e3
    per_op[op][2] = kname
  span_us = ((max(s + d for _, s, d, _, _ in events) - min(s for _, s, _, _, _ in events)) / 1e3
             if events else 0.0)
  kernel_us = sum(d for _, _, d, _, _ in events) / 1e3
  rows = []
  for op, (count, us, kname) in sorted(per_op.items(), key=lambda kv: -kv[1][1]):
    rows.append(dict(hlo_op=op, kernel=kname, per_step=count / steps, us_per_step=us / steps,
                     us_each=us / max(count, 1), body=bodies.get(op, "")))
  log(f"\n== {name}: {len(events) / steps:.0f} kernels per step, kernels "
      f"{kernel_us / steps:.0f} us, span {span_us / steps:.0f} us per step "
      f"({layers} layers, context {context})")
  for r in rows[:60]:
    log(f"  {r['us_per_step']:8.1f} us {r['per_step']:5.1f}x {r['us_each']:6.2f}  "
        f"{r['hlo_op'][:34]:34s} {r['body'][:150]}")
  return dict(format=name, context=context, layers=layers,
              kernels_per_step=len(events) / steps, kernel_us_per_step=kernel_us / steps,
              span_us_per_step=span_us / steps, ops=rows)


def anatomy(name: str, model, context: int, steps: int, log, batch: int = 1) -> dict:
  """The decode step (`bench.e2e`'s jitted step) on a ``name`` cache of ``batch`` sequences of
  ``context`` tokens."""
  capacity = context + 2 * steps + 256
  cache = e2e.fill_cache(model, name, batch, context, capacity, seed=0)
  graphdef, state = nnx.split(model)
  box = dict(tokens=jnp.ones((batch,), jnp.int32), cache=cache)
  hlo = e2e._decode_program.at(batch).lower(graphdef, state, box["tokens"], cache).compile().as_text()  # pylint: disable=protected-access

  def run():
    for _ in range(steps):
      box["tokens"], box["cache"] = e2e._decode(graphdef, state, box["tokens"], box["cache"])  # pylint: disable=protected-access
    return box["tokens"]

  result = _profile(name, run, hlo, steps, model.config.num_layers, context, log)
  return dict(result, batch=batch)


def draft_anatomy(model, context: int, steps: int, log, *, bits: int = 4,
                  layout: str = "auto", fuse_qkv: bool = True, fuse_mlp: bool = True,
                  defer_norms: bool = True, gamma: int = 4) -> dict:
  """QuantSpec's draft step (`bench.speculative._draft_loop`: ``bits``-bit draft weights,
  the ``quantspec`` cache's draft view, one token) on a cache of ``context`` tokens."""
  import speculative  # pylint: disable=import-outside-toplevel
  cache = e2e.fill_cache(model, "quantspec", 1, context, context + 256, seed=0)
  graphdef, state = nnx.split(model)
  weights = model.quantize_weights(bits=bits, layout=layout, fuse_qkv=fuse_qkv,
                                   fuse_mlp=fuse_mlp)
  token = jnp.ones((1,), jnp.int32)
  args = (graphdef, state, weights, token, cache)
  kw = dict(gamma=gamma, iters=steps, defer_norms=defer_norms)
  hlo = speculative._draft_loop.lower(*args, **kw).compile().as_text()  # pylint: disable=protected-access
  return _profile(f"draft-int{bits}-{layout}" + ("-qkv" if fuse_qkv else "")
                  + ("-gate-up" if fuse_mlp else "") + ("-deferred-norms" if defer_norms else ""),
                  lambda: speculative._draft_loop(*args, **kw),  # pylint: disable=protected-access
                  hlo, steps, model.config.num_layers, context, log)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--formats", default="kivi4,bf16")
  p.add_argument("--context", type=int, default=32768)
  p.add_argument("--batch", default="1", metavar="B[,B...]",
                 help="sequences per step, one per format in --formats or one for all")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--draft", default="", metavar="BITS",
                 help="also QuantSpec's draft step with these draft weight bits (e.g. 4,8)")
  p.add_argument("--draft-layout", default="auto", choices=("auto", *dw.LAYOUTS),
                 help="draft weights' code layout (models.draft_weights; out_major: 4 bits)")
  p.add_argument("--draft-qkv", default="fused", choices=("fused", "separate"),
                 help="the draft's q, k and v as one product per layer, or three")
  p.add_argument("--draft-mlp", default="fused", choices=("fused", "separate"),
                 help="the draft's gate and up as one product per layer, or two")
  p.add_argument("--draft-norms", default="deferred", choices=("deferred", "plain"),
                 help="the draft's RMSNorms applied to its products' outputs (draft_model("
                      "defer_norms=)) or as the target's")
  p.add_argument("--out", default="/tmp")
  a = p.parse_args(argv)
  config = dataclasses.replace(llama.LlamaConfig.named("llama-3.1-8b"), num_layers=a.layers)
  model = llama.random_model(config)
  lines = []

  def log(msg):
    print(msg, flush=True)
    lines.append(msg)

  formats = [f for f in a.formats.split(",") if f]
  batches = [int(b) for b in a.batch.split(",")]
  if len(batches) == 1:
    batches *= len(formats)
  if len(batches) != len(formats):
    p.error(f"--batch {a.batch!r}: one batch, or one per format in --formats {a.formats!r}")
  results = [anatomy(f, model, a.context, a.steps, log, batch=b)
             for f, b in zip(formats, batches)]
  results += [draft_anatomy(model, a.context, a.steps, log, bits=int(b), layout=a.draft_layout,
                              fuse_qkv=a.draft_qkv == "fused", fuse_mlp=a.draft_mlp == "fused",
                              defer_norms=a.draft_norms == "deferred")
              for b in a.draft.split(",") if b]
  os.makedirs(a.out, exist_ok=True)
  gpu = jax.devices()[0].device_kind.replace(" ", "-").lower()
  with open(os.path.join(a.out, f"step-anatomy-{gpu}.json"), "w") as f:
    json.dump(dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
                   results=results), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
