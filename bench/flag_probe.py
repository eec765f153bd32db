"""Decode-step time of Llama-3.1-8B widths with fewer layers, for A/B runs of
process-wide settings (``XLA_FLAGS``, ``JAXKV_*`` variables): run it in
alternating processes.

Times ``jaxkv.decode_steps`` loops (the way `generate` runs) at one batch and
context, per format; prints one JSON line per format, with the decode
programs' own compiler options (`jaxkv.decode_compiler_options`), which take
precedence over the same keys in ``XLA_FLAGS`` (change those with
``JAXKV_XLA_DOT_MERGER_MB`` / ``JAXKV_XLA_DOT_MERGER_MAX_ROWS`` /
``JAXKV_XLA_REMAT``; past 64 sequences the merger is off unless
``JAXKV_XLA_DOT_MERGER_MAX_ROWS`` is raised). ``peak_gib`` is the
process's peak device allocation so far (cumulative over the formats run
before). Usage (GPU machine)::

  XLA_FLAGS=--xla_gpu_enable_pdl=true python bench/flag_probe.py --layers 8 \
      --formats bf16,kivi4 --context 131072
  JAXKV_XLA_DOT_MERGER_MB=0 python bench/flag_probe.py --batch 27 --context 32768
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import e2e  # noqa: E402
import jaxkv  # noqa: E402
from jaxkv import timing  # noqa: E402
from models import llama  # noqa: E402


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--formats", default="bf16,kivi4")
  p.add_argument("--context", type=int, default=131072)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--loop-steps", type=int, default=32)
  p.add_argument("--reps", type=int, default=5)
  a = p.parse_args(argv)
  config = dataclasses.replace(llama.LlamaConfig.named("llama-3.1-8b"), num_layers=a.layers)
  model = llama.random_model(config)
  split = jaxkv.SplitModel(model)
  for name in a.formats.split(","):
    capacity = a.context + (a.reps + 2) * a.loop_steps + 256
    cache = e2e.fill_cache(model, name, a.batch, a.context, capacity, seed=0)
    tokens = jax.numpy.ones((a.batch,), jax.numpy.int32)
    row, _, cache = e2e.time_decode_loop(split, cache, tokens, loop_steps=a.loop_steps,
                                         reps=a.reps)
    print(json.dumps(dict(format=name, layers=a.layers, context=a.context, batch=a.batch,
                          xla_flags=os.environ.get("XLA_FLAGS", ""),
                          decode_compiler_options=jaxkv.decode_compiler_options(a.batch),
                          gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
                          peak_gib=None if (peak := timing.peak_bytes()) is None
                          else round(peak / 2**30, 3),
                          **{k: v for k, v in row.items() if not k.startswith("compile")})),
          flush=True)
    del cache
  return 0


if __name__ == "__main__":
  sys.exit(main())
