"""Two GPU checks behind the decode programs' large-batch path (2026-11-30 notes).

1. ``jnp.dot`` asked for bfloat16 against float32 output cast to bfloat16,
   under the decode programs' options past `jaxkv.decoding.DOT_MERGER_MAX_ROWS`
   (`models.llama.linear(direct_out=True)`): elements whose bits differ, and
   each form's largest error against float64, at Llama-3.1-8B weight shapes.
2. `pallas_kernels.combine_t` alone on random partials of kivi2's largest-batch
   shape (B = 188, 8 kv heads, 4 splits + 1 residual partial, D = 128, N
   columns, 4 query rows, permuted rows, query flags), by warps and channel
   block: profiler kernel us.

Usage (GPU machine)::

  python bench/linear_out_probe.py --rows 65,188,4096 --out $OUT
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

from jaxkv import decoding, timing  # noqa: E402
from pallas_kernels import _triton, combine_t as ct, mosaic_dequant  # noqa: E402

SHAPES = ((4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096))


def dots(rows_list, log) -> dict:
  opts = decoding._options(False)  # pylint: disable=protected-access
  out, key = {}, jax.random.key(0)
  for rows in rows_list:
    for i, o in SHAPES:
      k1, k2, key = jax.random.split(key, 3)
      x = jax.random.normal(k1, (rows, i), jnp.bfloat16)
      w = (jax.random.normal(k2, (i, o), jnp.float32) * 0.02).astype(jnp.bfloat16)
      direct = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
      cast = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
                     .astype(jnp.bfloat16))
      a = direct.lower(x, w).compile(opts)(x, w)
      b = cast.lower(x, w).compile(opts)(x, w)
      ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
      row = dict(differ=int(np.sum(np.asarray(a.view(jnp.uint16)) != np.asarray(b.view(jnp.uint16)))),
                 elements=int(a.size),
                 err_direct=float(np.max(np.abs(np.asarray(a, np.float64) - ref))),
                 err_cast=float(np.max(np.abs(np.asarray(b, np.float64) - ref))))
      log(f"rows {rows} {i}x{o}: {row['differ']} of {row['elements']} differ; max err "
          f"direct {row['err_direct']:.3e}, cast {row['err_cast']:.3e}")
      out[f"{rows},{i},{o}"] = row
  return out


def combine(width: int, log) -> dict:
  b, h, j, d, rows = 188, 8, 5, 128, 4
  ks = jax.random.split(jax.random.key(1), 4)
  o_t = [jax.random.normal(jax.random.fold_in(ks[0], c), (b, h, j, d, width), jnp.float32)
         for c in range(4)]
  l = jax.random.uniform(ks[1], (b, h, j, width), jnp.float32, 1, 10)
  m = jax.random.normal(ks[2], (b, h, j, width), jnp.float32)
  qh = jax.random.normal(ks[3], (b, h, width, d), jnp.bfloat16)
  packed_rows = np.argsort(mosaic_dequant.vt_permutation(d, 2))
  ref = ct.combine_t_reference(o_t[0], l, m, rows=rows, packed_rows=packed_rows)
  cp, min_programs, out = _triton.compiler_params, ct._MIN_PROGRAMS, {}  # pylint: disable=protected-access
  try:
    for warps in (1, 2, 4, 8):
      for dblk in (128, 64, 32):
        _triton.compiler_params = (lambda num_warps=4, num_stages=1, _w=warps:
                                   cp(num_warps=_w, num_stages=num_stages))
        ct._MIN_PROGRAMS = b * h * (d // dblk)  # pylint: disable=protected-access
        fn = lambda o: ct.combine_t(o, l, m, rows=rows, packed_rows=packed_rows,  # noqa: E731
                                    out_dtype=jnp.bfloat16, qh=qh, q_rows=rows)
        us = timing.kernel_time(fn, [(o,) for o in o_t], calls=40)["kernel"] * 1e6
        err = float(jnp.max(jnp.abs(fn(o_t[0]).astype(jnp.float32) - ref)))
        out[f"warps{warps},dblk{dblk}"] = dict(us=us, err=err)
        log(f"combine N={width} warps={warps} dblk={dblk}: {us:.2f} us, err {err:.2e}")
  finally:
    _triton.compiler_params, ct._MIN_PROGRAMS = cp, min_programs  # pylint: disable=protected-access
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", default="65,188,4096")
  p.add_argument("--widths", default="8,16", help="partial columns N for the combine")
  p.add_argument("--out", default="/tmp")
  a = p.parse_args(argv)
  result = dict(gpu=jax.devices()[0].device_kind, jax_version=jax.__version__,
                dots=dots([int(r) for r in a.rows.split(",") if r], print),
                combine={w: combine(int(w), print) for w in a.widths.split(",") if w})
  os.makedirs(a.out, exist_ok=True)
  path = os.path.join(a.out, f"linear-out-probe-{result['gpu'].replace(' ', '-').lower()}.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
