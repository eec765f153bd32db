"""How fast the register-level 4-bit K path streams (a v3 rate probe, H100/H200).

Times `pallas_kernels.mosaic_dequant.probe_k4_score_stream` (TMA tiles ->
`dequant_codes` registers -> wgmma against q, elementwise max) over
``programs x tokens`` token-heads of 4-bit K codes by profiler kernel time,
beside its bytes floor (the HBM read probe of the same process). Checks the
result against numpy first.

Usage (GPU machine): python bench/mosaic_k4_rate.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxkv import timing  # noqa: E402
from pallas_kernels import mosaic_dequant as md  # noqa: E402


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--tokens", type=int, default=131072, help="tokens per kv head")
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--n", type=int, default=8, help="query rows (GQA x q_len, padded to 8)")
  ap.add_argument("--out", default="/tmp")
  a = ap.parse_args(argv)
  hbm = timing.hbm_read_probe()["best"]                                   # bytes/s
  rows = []
  # small check first: the stream's max equals numpy's
  rng = np.random.default_rng(0)
  c_small = jnp.asarray(rng.integers(0, 256, (2, 256, 64)), jnp.uint8)
  q = jax.random.normal(jax.random.PRNGKey(1), (a.n, 128), jnp.float32).astype(jnp.bfloat16)
  got = np.asarray(md.probe_k4_score_stream(c_small, q))
  ch = np.concatenate([np.asarray(c_small) & 15, np.asarray(c_small) >> 4], -1).astype(np.float64)
  s = ch @ np.asarray(q, np.float64).T                                   # [P, T, N]
  want = s.reshape(2, -1, 64, a.n).max(axis=1)
  err = float(np.abs(got - want).max() / np.abs(want).max())
  print(f"check: max rel err {err:.2e}")
  for programs_per_head in (16, 32, 64):
    programs = a.heads * programs_per_head
    per = a.tokens // programs_per_head
    codes = [jnp.asarray(np.random.default_rng(i).integers(0, 256, (programs, per, 64)), jnp.uint8)
             for i in range(3)]
    for stages in (2, 4, 6):
      fn = lambda c, stages=stages: md.probe_k4_score_stream(c, q, stages=stages)  # noqa: E731
      t = timing.kernel_time(fn, [(c,) for c in codes], calls=10)["kernel"] * 1e6
      nbytes = programs * per * 64
      rows.append(dict(programs=programs, stages=stages, us=t, bytes=nbytes,
                       floor_us=nbytes / hbm * 1e6))
      print(f"  programs {programs:4d} stages {stages}: {t:7.1f} us for "
            f"{a.heads * a.tokens / 1e6:.2f}M token-heads ({nbytes / t / 1e3:.0f} GB/s"
            f", floor {rows[-1]['floor_us']:.1f} us)", flush=True)
  gpu = jax.devices()[0].device_kind
  with open(os.path.join(a.out, f"mosaic-k4-rate-{gpu.replace(' ', '-').lower()}.json"), "w") as f:
    json.dump(dict(gpu=gpu, jax_version=jax.__version__, hbm_read_gbps=hbm / 1e9, check_rel_err=err,
                   tokens=a.tokens, heads=a.heads, n=a.n, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
