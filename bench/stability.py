"""Long-loop stability: does a decode loop of 100K steps drift, recompile or leak?

Formats need a residual R > G (the newest token's exact K/V must still be in
the residual after its step for the harness to record it): kivi4 with R = 2G
(``kivi4-r256``, QuantSpec's double buffer) and kivi2-g32 (R = 4G). The R = G
presets reach the same code paths (the residual rule with other constants);
their incremental == one-shot equality is the property test of tests/test_cache.py.

The tiny Llama decodes greedily on a quantized `jaxkv.ModelCache` inside
jitted chunks of ``--chunk`` steps (`lax.fori_loop`). Every step also copies
the newest token's exact K/V (still in the full-precision residual block right
after the append) into a float32 history buffer. When a cycle fills the
cache's capacity, the history is quantized at once (`jaxkv.KVCache.prefill`
per layer, the oracle) and compared with the incremental cache bit for bit;
then a fresh cache starts the next cycle ("wrap-free refill": positions start
again at 0). Per cycle it records: bitwise equality, the largest
dequantization error relative to its bound, the chunk function's compile
count, live device bytes and the process RSS.

  python bench/stability.py                      # 100K steps per preset (2 CPU cores: ~30 min)
  python bench/stability.py --steps 4000 --capacity 1024   # a quick look

Writes ``bench/results/stability-<device>.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxkv  # noqa: E402  pylint: disable=wrong-import-position
from models import llama  # noqa: E402  pylint: disable=wrong-import-position


def _newest_rows(cache: jaxkv.ModelCache):
  """``(k, v)`` ``[L, B, Hkv, D]``: each sequence's newest token (a residual row)."""
  row = cache.lengths - 1 - cache.fmt.packed_len(cache.lengths)            # [B]
  take = lambda res: jnp.take_along_axis(  # noqa: E731
      res, row[None, :, None, None, None], axis=3)[:, :, :, 0]           # [L, B, H, D]
  return take(cache.k_residual), take(cache.v_residual)


def _record(hist, cache):
  """Writes the newest K/V rows into ``hist`` ``(k, v)`` each ``[L, B, C, Hkv, D]``."""
  k, v = _newest_rows(cache)
  pos = cache.lengths - 1                                                  # [B]
  b = jnp.arange(pos.shape[0])
  return tuple(h.at[:, b, pos].set(x.astype(h.dtype)) for h, x in ((hist[0], k), (hist[1], v)))


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"), donate_argnames=("cache", "hist"))
def decode_chunk(graphdef, state, token, cache, hist, *, steps: int):
  """``steps`` greedy decode steps, recording each new token's K/V into ``hist``."""
  model = nnx.merge(graphdef, state)

  def body(_, carry):
    token, cache, hist = carry
    logits, cache = model.decode(token[:, None], cache)
    hist = _record(hist, cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache, hist

  return jax.lax.fori_loop(0, steps, body, (token, cache, hist))


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def prefill(graphdef, state, tokens, cache):
  """Prefill of a ``[B, P]`` prompt (P <= R: every token stays in the residual)."""
  model = nnx.merge(graphdef, state)
  lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
  logits, cache = model.prefill(tokens, lengths, cache)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def one_shot_equal(cache: jaxkv.ModelCache, hist) -> tuple[bool, float]:
  """(incremental == one-shot bitwise in every layer, max |x - x_hat| / bound).

  The bound of a packed value is half its group's stored scale; residual
  rows must be exact (bound 0: any difference counts as inf).
  """
  fmt = cache.fmt
  equal, worst = True, 0.0
  lengths = np.asarray(cache.lengths)
  for i in range(cache.num_layers):
    inc = cache.layer(i)
    shot = jaxkv.KVCache.init(fmt, inc.batch, inc.kv_heads, inc.head_dim, inc.capacity,
                              inc.dtype).prefill(hist[0][i], hist[1][i], jnp.asarray(lengths))
    for name in ("k", "v", "k_residual", "v_residual", "lengths"):
      a = jax.tree_util.tree_leaves(getattr(inc, name))
      b = jax.tree_util.tree_leaves(getattr(shot, name))
      equal &= all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    kd, vd = inc.dequantize()                                              # [B, C, H, D]
    for d, h, side in ((kd, hist[0][i], inc.k), (vd, hist[1][i], inc.v)):
      err = np.abs(np.asarray(d, np.float64) - np.asarray(h, np.float64))
      bound = _bounds(side, fmt, lengths, err.shape)
      for b, n in enumerate(lengths):
        e, bd = err[b, :n], bound[b, :n]
        with np.errstate(divide="ignore", invalid="ignore"):
          ratio = np.where(bd > 0, e / np.where(bd > 0, bd, 1), np.where(e > 0, np.inf, 0))
        worst = max(worst, float(ratio.max(initial=0.0)))
  return bool(equal), worst


def _bounds(side, fmt, lengths, shape) -> np.ndarray:
  """``[B, C, H, D]`` error bound of each packed value; 0 for residual rows (exact).

  ``scale_s / 2`` (nearest point of the stored grid) plus what the stored
  scale's and zero's rounding can add where a value falls outside the stored
  grid: ``u * (|zero_s| + (2^b - 1) * scale_s)`` with ``u`` the scale dtype's
  unit roundoff, plus float32 arithmetic.
  """
  b, c, h, d = shape
  out = np.zeros(shape)
  if side.bits == 16:
    return out
  u = float(jnp.finfo(fmt.scale_dtype).eps) / 2
  scale = np.abs(np.asarray(side.scale, np.float64))
  zero = np.abs(np.asarray(side.zero, np.float64))
  bound = scale / 2 + u * (zero + (2 ** side.bits - 1) * scale) + 2 ** -22 * (zero + 1e-30)
  if side.axis == "channel":   # [B, H, C/G, D] -> per token
    per = np.repeat(bound, side.group, axis=2)[:, :, :c]                   # [B, H, C, D]
  else:                         # [B, H, C, D/Gd] -> per channel
    per = np.repeat(bound, side.group, axis=3)                              # [B, H, C, D]
  per = np.transpose(per, (0, 2, 1, 3))                                     # [B, C, H, D]
  for i, n in enumerate(lengths):
    p = fmt.packed_len(int(n))
    out[i, :p] = per[i, :p]
  return out


def _rss_mib() -> float:
  """Current resident set size (Linux ``/proc``; peak RSS elsewhere)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
  except OSError:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(*, preset: str, steps: int, capacity: int, chunk: int, batch: int, prompt_len: int,
        config: str = "tiny", seed: int = 0, log=print) -> dict:
  """Decodes ``steps`` steps in cycles of ``capacity`` tokens; one record per cycle."""
  fmt = jaxkv.KVFormat.preset(preset) if isinstance(preset, str) else preset
  if fmt.residual <= fmt.token_group:
    raise ValueError(f"{preset}: needs residual R > token_group G, so that the newest token's "
                     f"exact K/V is still in the residual after its step (R={fmt.residual}, "
                     f"G={fmt.token_group})")
  model = llama.random_model(config, seed=seed, dtype=jnp.float32)
  graphdef, state = nnx.split(model)
  per_cycle = capacity - prompt_len
  if per_cycle % chunk:
    raise ValueError(f"capacity - prompt_len = {per_cycle} must be a multiple of chunk={chunk}")
  c = model.config
  rng = np.random.default_rng(seed)
  base = decode_chunk._cache_size()  # pylint: disable=protected-access
  cycles, done, t0 = [], 0, time.perf_counter()
  while done < steps:
    cache = model.init_cache(fmt, batch, capacity, dtype=jnp.float32)
    hist = tuple(jnp.zeros((c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim),
                           jnp.float32) for _ in range(2))
    prompt = jnp.asarray(rng.integers(3, c.vocab_size, (batch, prompt_len)), jnp.int32)
    token, cache = prefill(graphdef, state, prompt, cache)
    r = cache.fmt.residual
    if prompt_len > r:
      raise ValueError(f"prompt_len={prompt_len} must be <= the residual R={r}")
    hist = tuple(h.at[:, :, :prompt_len].set(jnp.swapaxes(res[:, :, :, :prompt_len], 2, 3))
                 for h, res in zip(hist, (cache.k_residual, cache.v_residual)))
    n = 0
    while n < per_cycle and done < steps:
      token, cache, hist = decode_chunk(graphdef, state, token, cache, hist, steps=chunk)
      n += chunk
      done += chunk
    jax.block_until_ready(cache)
    cache.check()
    equal, worst = one_shot_equal(cache, hist)
    live = sum(x.nbytes for x in jax.live_arrays())
    rec = dict(cycle=len(cycles), steps_done=done, length=int(np.asarray(cache.lengths)[0]),
               bitwise_equal_one_shot=equal, max_error_over_bound=worst,
               compiles_decode_chunk=decode_chunk._cache_size() - base,  # pylint: disable=protected-access
               compiles_prefill=prefill._cache_size(),  # pylint: disable=protected-access
               live_device_bytes=int(live), rss_mib=_rss_mib(),
               elapsed_s=time.perf_counter() - t0)
    cycles.append(rec)
    log(f"cycle {rec['cycle']:3d} steps {done:7d}: one-shot equal {equal}, "
        f"err/bound {worst:.3f}, compiles {rec['compiles_decode_chunk']}, "
        f"live {live / 2**20:.1f} MiB, rss {rec['rss_mib']:.0f} MiB, "
        f"{rec['elapsed_s']:.0f}s")
    del cache, hist
  return dict(preset=preset if isinstance(preset, str) else repr(preset), steps=done, capacity=capacity, chunk=chunk, batch=batch,
              prompt_len=prompt_len, config=config, cycles=cycles,
              all_equal=all(r["bitwise_equal_one_shot"] for r in cycles),
              max_error_over_bound=max(r["max_error_over_bound"] for r in cycles),
              compiles=max(r["compiles_decode_chunk"] for r in cycles),
              live_bytes_first_last=[cycles[0]["live_device_bytes"],
                                     cycles[-1]["live_device_bytes"]],
              rss_mib_first_last=[cycles[0]["rss_mib"], cycles[-1]["rss_mib"]])


def _format(name: str):
  """A preset name, or ``NAME-rR``: the preset with residual ``R`` (e.g. kivi4-r256)."""
  base, sep, r = name.rpartition("-r")
  if sep and r.isdigit():
    import dataclasses  # pylint: disable=import-outside-toplevel
    return dataclasses.replace(jaxkv.KVFormat.preset(base), residual=int(r))
  return name


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--presets", default="kivi4-r256,kivi2-g32",
                 help="presets, or NAME-rR for a preset with residual R")
  p.add_argument("--steps", type=int, default=100_000, help="decode steps per preset")
  p.add_argument("--capacity", type=int, default=4096)
  p.add_argument("--chunk", type=int, default=1000, help="steps per jitted call")
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  a = p.parse_args(argv)
  dev = jax.devices()[0]
  results = dict(meta=dict(device=dev.device_kind, platform=dev.platform,
                           jax=jax.__version__, python=platform.python_version(),
                           date=time.strftime("%Y-%m-%d %H:%M:%S")), runs=[])
  ok = True
  for preset in a.presets.split(","):
    preset = _format(preset)
    print(f"== {preset!r}: {a.steps} steps, capacity {a.capacity}, chunks of {a.chunk}", flush=True)
    r = run(preset=preset, steps=a.steps, capacity=a.capacity, chunk=a.chunk, batch=a.batch,
            prompt_len=a.prompt_len, log=lambda s: print("  " + s, flush=True))
    results["runs"].append(r)
    ok &= r["all_equal"] and r["compiles"] == 1
    print(f"  all cycles bitwise equal: {r['all_equal']}; compiles {r['compiles']}; "
          f"live bytes first/last {r['live_bytes_first_last']}; "
          f"RSS MiB first/last {r['rss_mib_first_last']}", flush=True)
  os.makedirs(a.out, exist_ok=True)
  name = "gpu" if dev.platform == "gpu" else "cpu"
  path = os.path.join(a.out, f"stability-{name}.json")
  with open(path, "w") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {path}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
