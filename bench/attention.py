"""GPU benchmark: jaxkv Pallas low-bit decode attention vs the best BF16 in JAX.

For each shape (B, T, Hq, Hkv, D) and q_len: BF16 baselines (XLA einsum,
cuDNN through `jax.nn.dot_product_attention`, JAX's Pallas `decode_attention`
on a head-major cache, best of 16/32/64 splits), the naive jnp int4 path, and
jaxkv's kernels for each format. Device time: the summed durations of the GPU
kernels of one call, read from a `jax.profiler` (CUPTI) trace of 16
back-to-back calls (`jaxkv.timing.kernel_time`), warmed up, compile
excluded; the calls rotate over enough copies of the cache that none is read
from L2. The stream span per call (kernel gaps included) and the host's wall
clock per call are kept beside it. Effective GB/s (bytes the call must read/write:
packed codes + scales/zeros + residual + q + o), fraction of the HBM read
bandwidth measured in the same run (`jaxkv.timing.hbm_read_probe`), speedup over the
best BF16, and each kernel's relative error against the jnp reference on the
same data. Writes JSON + PNG under bench/results/ (or --out) and prints a
short table last.

Usage: python bench/attention.py [--quick] [--tune N] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxkv import timing  # noqa: E402
from jaxkv.timing import kernel_time  # noqa: E402
from jaxkv.formats import PRESETS, KVFormat  # noqa: E402
import jaxkv  # noqa: E402
import pallas_kernels as pk  # noqa: E402
from pallas_kernels import mosaic_attention as ma  # noqa: E402
from pallas_kernels.side_spec import SideSpec  # noqa: E402

SHAPES = [  # (B, T, Hq, Hkv, D, q_len)
    (32, 8192, 8, 1, 128, 1),
    (128, 8192, 8, 1, 128, 1),
    (1, 32768, 32, 8, 128, 1),
    (1, 32768, 32, 8, 128, 4),
    (1, 131072, 32, 8, 128, 1),
    (8, 32768, 32, 8, 128, 1),
    (64, 4096, 32, 8, 128, 1),
]
FORMATS = ["kivi4", "kivi2", "int4-token-g4", "int8", "k8v4"]
# Timed through the public API on a cache filled with random K/V (their own
# kernels: `jaxkv.VQCache` -> VQ kernel, the hierarchical views -> Triton).
CACHE_FORMATS = ["cq4", "cq2", "quantspec:draft", "quantspec:target"]
UNROLL = 8   # distinct q arrays (and at most this many cache copies) per timing
CALLS = 16   # calls traced per timing
ROTATE_BYTES = 256 << 20  # > 5x the 50 MB L2 of an H100/H200


def shape_id(shape):
  b, t, hq, hkv, d, s = shape
  return f"B{b}_T{t}_Hq{hq}_Hkv{hkv}_D{d}_S{s}"


def rel_err(x, ref):
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def rotating_copies(args, bytes_moved):
  """``args`` plus deep copies, enough (<= UNROLL) that cycling them defeats L2."""
  n_copies = min(UNROLL, -(-ROTATE_BYTES // bytes_moved))
  return [args] + [jax.tree.map(jnp.copy, args) for _ in range(n_copies - 1)]


def nbytes(*arrays):
  return int(sum(a.size * a.dtype.itemsize for a in arrays if a is not None))


# ------------------------------------------------------------------ baselines
def xla_bf16(q, k, v, lengths):
  """Plain XLA: einsum on the [B, T, Hkv, D] cache, float32 softmax."""
  b, s, hq, d = q.shape
  hkv = k.shape[2]
  qg = q.reshape(b, s, hkv, hq // hkv, d)
  logits = jnp.einsum("bshgd,bthd->bhgst", qg, k, preferred_element_type=jnp.float32)
  logits = logits * d ** -0.5
  last = lengths[:, None] - s + jnp.arange(s)[None, :]
  mask = jnp.arange(k.shape[1])[None, None, :] <= last[:, :, None]
  logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
  p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  o = jnp.einsum("bhgst,bthd->bshgd", p, v, preferred_element_type=jnp.float32)
  return o.reshape(b, s, hq, d).astype(q.dtype)


def cudnn_bf16(q, k, v, lengths):
  s = q.shape[1]
  return jax.nn.dot_product_attention(
      q, k, v, implementation="cudnn", is_causal=False,
      query_seq_lengths=jnp.full_like(lengths, s), key_value_seq_lengths=lengths)


def tokamax_bf16(q, k, v, lengths, *, implementation):
  """tokamax's attention (GQA folded into q, split-K) on the [B, T, Hkv, D] cache.

  tokamax is not a dependency: `bench/fetch_wheels.sh` puts its wheel and its
  pure-Python dependencies under .whl/site for the GPU machine.
  """
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    # tokamax reads absl flags; parsed from this script's argv they fail on its
    # own options ("Unknown command line flag 'shapes'"), so parse none.
    flags.FLAGS(sys.argv[:1])
  import tokamax  # pylint: disable=import-outside-toplevel
  s = q.shape[1]
  return tokamax.dot_product_attention(
      q, k, v, is_causal=False, query_seq_lengths=jnp.full_like(lengths, s),
      key_value_seq_lengths=lengths, implementation=implementation)


def pallas_gqa_head_major(q, k_hm, v_hm, lengths, *, k_splits):
  """JAX's Pallas decode kernel on a head-major [B, Hkv, T, D] cache (no transpose)."""
  from jax.experimental.pallas.ops.gpu import decode_attention as da
  b, _, hq, d = q.shape
  hkv, t = k_hm.shape[1], k_hm.shape[2]
  inner = functools.partial(
      da.decode_attn_unbatched, sm_scale=d ** -0.5, block_h=16, block_k=128,
      k_splits=k_splits, num_warps=None, num_stages=2, grid=None, interpret=False,
      debug=False, return_residuals=False, normalize_output=True)
  qh = q.reshape(b, hkv, hq // hkv, d)
  kv_len = jnp.broadcast_to(lengths[:, None], (b, hkv))
  out = jax.vmap(jax.vmap(inner))(qh, k_hm, v_hm, None, kv_len)
  return out.reshape(b, 1, hq, d)


def naive_int4(q, codes_k, sk, zk, codes_v, sv, zv, lengths):
  """What a JAX user writes today: unpack nibbles in jnp, dequantize, einsum."""
  def deq(c, s, z):
    x = jnp.concatenate([c & 15, c >> 4], axis=-1).astype(jnp.bfloat16)
    return x * s.astype(jnp.bfloat16) + z.astype(jnp.bfloat16)
  k = deq(codes_k, sk, zk)  # [B, H, T, D]
  v = deq(codes_v, sv, zv)
  return xla_bf16(q, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), lengths)


# ------------------------------------------------------------------- jaxkv data
@dataclasses.dataclass
class PackedCache:
  """Raw arrays of a full cache (lengths = T), random codes and scales."""

  arrays: tuple
  lengths: jax.Array
  fmt: KVFormat


def random_packed(key, fmt, b, t, hkv, d, dtype=jnp.bfloat16):
  sdt = jnp.dtype(fmt.scale_dtype)
  gd = fmt.channel_group_for(d)
  keys = iter(jax.random.split(key, 16))

  def side(bits, axis):
    if bits == 16:
      return jax.random.normal(next(keys), (b, hkv, t, d), dtype), None, None
    codes = jax.random.randint(next(keys), (b, hkv, t, d * bits // 8), 0, 256, jnp.int32)
    sshape = (b, hkv, t // fmt.token_group, d) if axis == "channel" else (b, hkv, t, d // gd)
    scale = jax.random.uniform(next(keys), sshape, jnp.float32, 0.5, 1.5) / (1 << bits)
    zero = jax.random.uniform(next(keys), sshape, jnp.float32, -1.0, 0.0)
    return codes.astype(jnp.uint8), scale.astype(sdt), zero.astype(sdt)

  k = side(fmt.k_bits, fmt.k_axis)
  v = side(fmt.v_bits, "token")
  k_res = jax.random.normal(next(keys), (b, hkv, fmt.residual, d), dtype)
  v_res = jax.random.normal(next(keys), (b, hkv, fmt.residual, d), dtype)
  lengths = jnp.full((b,), t, jnp.int32)
  # lengths = T: P = packed_len(T) tokens packed, the rest in the residual.
  return PackedCache((*k, *v, k_res, v_res), lengths, fmt)


def jaxkv_call(q, arrays, lengths, *, fmt, config):
  return pk.dequant_decode_attention(q, *arrays, lengths, fmt=fmt, config=config)


def mosaic_call(q, arrays, lengths, *, fmt, config):
  d = q.shape[-1]
  return ma.mosaic_decode_attention(
      q, *arrays, lengths, k_side=SideSpec.of(fmt, "k", d), v_side=SideSpec.of(fmt, "v", d),
      token_group=fmt.token_group, residual=fmt.residual, sm_scale=d ** -0.5, config=config)


def mosaic_supported(fmt, hq, hkv, d, s):
  return ma.supports(SideSpec.of(fmt, "k", d), SideSpec.of(fmt, "v", d), head_dim=d,
                     q_rows=hq // hkv * s, dtype=jnp.bfloat16, token_group=fmt.token_group,
                     residual=fmt.residual)


def mosaic_default(fmt, b, t, hkv):
  """The Mosaic heuristic config for a format and shape (what dispatch uses)."""
  return ma.MosaicAttentionConfig.default(
      batch=b, tokens=t, kv_heads=hkv, num_sms=jax.devices()[0].core_count, k_bits=fmt.k_bits,
      v_bits=fmt.v_bits, token_group=fmt.token_group, residual=fmt.residual)


def mosaic_configs(fmt, b, t, hkv, limit):
  base = mosaic_default(fmt, b, t, hkv)
  rep = dataclasses.replace
  cands = [base, rep(base, num_splits=base.num_splits * 2),
           rep(base, num_splits=max(1, base.num_splits // 2)),
           rep(base, max_concurrent_steps=4), rep(base, max_concurrent_steps=2),
           rep(base, block_k=128)]
  out = []
  for c in cands:
    if c not in out:
      out.append(c)
  return out[:max(1, limit)]


def loop_time(fn, qs, copies, iters=8):
  """Time per call inside one jitted `fori_loop` of dependent calls.

  Each call's output is the next call's query (same shape), and consecutive
  calls read different cache copies, the way a decode loop reads each layer's
  cache once: launch gaps and inter-kernel idle time are included.
  """
  n = len(copies)

  @jax.jit
  def run(q, copies):
    def body(_, q):
      for c in copies:
        q = fn(q, *c)
      return q
    return jax.lax.fori_loop(0, iters, body, q)

  run(qs[0], copies).block_until_ready()
  best = float("inf")
  for rep in range(3):
    t0 = time.perf_counter()
    run(qs[rep % len(qs)], copies).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return best / (iters * n)


def candidate_configs(fmt, b, t, hq, hkv, d, limit, s=1):
  """The config a user gets (`pk.default_config`: tuned table, else heuristic) first."""
  base, _ = pk.default_config(fmt, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d,
                              num_queries=s, capacity=t)
  rep = dataclasses.replace
  other_warps = 4 if base.num_warps == 2 else 2
  cands = [base, rep(base, num_splits=max(1, base.num_splits // 2)),
           rep(base, num_splits=base.num_splits * 2), rep(base, num_warps=other_warps),
           rep(base, block_k=64 if base.block_k == 128 else 128),
           rep(base, num_stages=2 if base.num_stages == 3 else 3),
           rep(base, num_splits=max(1, base.num_splits // 4)),
           rep(base, block_k=64, num_splits=base.num_splits * 2), rep(base, num_warps=8)]
  out = []
  for c in cands:
    if c not in out and t % c.block_k == 0:
      out.append(c)
  return out[:max(1, limit)]


# ---------------------------------------------------------------------- main
def filled_cache(name, key, b, t, hkv, d):
  """A cache of format ``name`` (a preset name such as ``cq2``, ``quantspec:<view>``,
  or a `KVFormat` / `VQFormat`) holding T random tokens (VQ: random codebooks)."""
  kk, kv, kc = jax.random.split(key, 3)
  k = jax.random.normal(kk, (b, t, hkv, d), jnp.bfloat16)
  v = jax.random.normal(kv, (b, t, hkv, d), jnp.bfloat16)
  lengths = jnp.full((b,), t, jnp.int32)
  fmt = name.split(":")[0] if isinstance(name, str) else name
  fmt = jaxkv.VQ_PRESETS.get(fmt, fmt) if isinstance(fmt, str) else fmt
  if isinstance(fmt, jaxkv.VQFormat):
    k1, k2 = jax.random.split(kc)
    books = (jax.random.normal(k1, fmt.codebook_shape("k", hkv, d), fmt.codebook_dtype),
             jax.random.normal(k2, fmt.codebook_shape("v", hkv, d), fmt.codebook_dtype))
    cache = jaxkv.VQCache.init(fmt, books, b, hkv, d, t)
  else:
    cache = jaxkv.KVCache.init(fmt, b, hkv, d, t)
  return jax.jit(lambda c, k, v, n: c.prefill(k, v, n))(cache, k, v, lengths)


def bench_shape(shape, formats, hbm, tune, log, cache_formats=()):
  b, t, hq, hkv, d, s = shape
  key = jax.random.PRNGKey(hash(shape) % (1 << 30))
  kq, kk, kv, kc = jax.random.split(key, 4)
  qs = [jax.random.normal(jax.random.fold_in(kq, i), (b, s, hq, d), jnp.bfloat16)
        for i in range(UNROLL)]
  q = qs[0]
  lengths = jnp.full((b,), t, jnp.int32)
  rows = {}

  def record(name, fn, rest, bytes_moved, out=None, ref=None, extra=None, loop=True):
    # The calls rotate over enough copies of the cache arrays that none is
    # still in L2 when it is read again (each decode layer reads its own).
    copies = rotating_copies(rest, bytes_moved)
    n_copies = len(copies)
    args = [(qi, copies[i % n_copies]) for i, qi in enumerate(qs)]
    try:
      tm = kernel_time(lambda qi, r: fn(qi, *r), args, calls=CALLS)
    except Exception as e:  # noqa: BLE001 - a baseline that does not run is recorded
      rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      log(f"  {name:34s} FAILED {rows[name]['error'][:160]}")
      return None
    finally:
      del args
    row = {"time_us": tm["kernel"] * 1e6, "span_us": tm["span"] * 1e6,
           "wall_us": tm["wall"] * 1e6, "kernels_per_call": tm["kernels"],
           "cache_copies": n_copies, "compile_s": tm["compile"],
           "bytes": bytes_moved, "gbps": bytes_moved / tm["kernel"] / 1e9,
           "frac_hbm": bytes_moved / tm["kernel"] / hbm}
    if out is not None and ref is not None:
      row["rel_err"] = rel_err(out, ref)
    row.update(extra or {})
    if loop:
      try:
        row["loop_us"] = loop_time(fn, qs, copies) * 1e6
      except Exception as e:  # noqa: BLE001
        row["loop_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    rows[name] = row
    del copies
    log(f"  {name:34s} {row['time_us']:9.1f} us (loop {row.get('loop_us', float('nan')):7.1f}, "
        f"span {row['span_us']:7.1f}, "
        f"wall {row['wall_us']:7.1f}, {row['kernels_per_call']:.0f} kernels) "
        f"{row['gbps']:7.0f} GB/s "
        f"{row['frac_hbm']*100:5.1f}% HBM  err="
        + (f"{row['rel_err']:.1e}" if "rel_err" in row else "n/a (no oracle)"))
    return row

  # BF16 baselines.
  k = jax.random.normal(kk, (b, t, hkv, d), jnp.bfloat16)
  v = jax.random.normal(kv, (b, t, hkv, d), jnp.bfloat16)
  io = nbytes(q) * 2
  bf16_bytes = nbytes(k, v) + io
  ref_bf16 = jax.jit(xla_bf16)(q.astype(jnp.float32), k.astype(jnp.float32),
                               v.astype(jnp.float32), lengths)
  record("bf16_xla_einsum", xla_bf16, (k, v, lengths), bf16_bytes,
         jax.jit(xla_bf16)(q, k, v, lengths), ref_bf16)
  try:
    out = jax.jit(cudnn_bf16)(q, k, v, lengths)
  except Exception:  # noqa: BLE001
    out = None
  record("bf16_cudnn", cudnn_bf16, (k, v, lengths), bf16_bytes, out, ref_bf16)
  for impl in ("mosaic", "triton"):
    fn = functools.partial(tokamax_bf16, implementation=impl)
    try:
      out = jax.jit(fn)(q, k, v, lengths)
    except Exception as e:  # noqa: BLE001 - not installed, or no kernel for this shape
      rows[f"bf16_tokamax_{impl}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      log(f"  {'bf16_tokamax_' + impl:34s} FAILED {rows[f'bf16_tokamax_{impl}']['error'][:160]}")
      continue
    record(f"bf16_tokamax_{impl}", fn, (k, v, lengths), bf16_bytes, out, ref_bf16)
  del k, v
  if s == 1:
    k_hm = jax.random.normal(kk, (b, hkv, t, d), jnp.bfloat16)
    v_hm = jax.random.normal(kv, (b, hkv, t, d), jnp.bfloat16)
    ref_hm = jax.jit(xla_bf16)(q.astype(jnp.float32), jnp.swapaxes(k_hm, 1, 2).astype(jnp.float32),
                               jnp.swapaxes(v_hm, 1, 2).astype(jnp.float32), lengths)
    best = None
    for splits in (16, 32, 64):
      fn = functools.partial(pallas_gqa_head_major, k_splits=splits)
      try:
        out = jax.jit(fn)(q, k_hm, v_hm, lengths)
      except Exception:  # noqa: BLE001
        out = None
      row = record(f"bf16_pallas_gqa_hm_s{splits}", fn, (k_hm, v_hm, lengths), bf16_bytes,
                   out, ref_hm)
      if row and (best is None or row["time_us"] < rows[best]["time_us"]):
        best = f"bf16_pallas_gqa_hm_s{splits}"
    if best:
      rows["bf16_pallas_gqa_hm"] = dict(rows[best], splits=int(best.rsplit("s", 1)[1]))
    for splits in (16, 32, 64):
      rows.pop(f"bf16_pallas_gqa_hm_s{splits}", None)
    del k_hm, v_hm
  # A baseline counts only if its output matched the float32 oracle.
  good = {n: r for n, r in rows.items()
          if n.startswith("bf16") and "time_us" in r and r.get("rel_err", 0.0) < 2e-2}
  best_bf16 = min((r["time_us"] for r in good.values()), default=float("nan"))
  best_bf16_wall = min((r["wall_us"] for r in good.values()), default=float("nan"))
  best_bf16_loop = min((r["loop_us"] for r in good.values() if "loop_us" in r),
                       default=float("nan"))

  # Naive jnp int4 (per-token, one group per head).
  nk = random_packed(kc, KVFormat(k_bits=4, v_bits=4, k_axis="token"), b, t, hkv, d)
  ck, sk, zk, cv, sv, zv = nk.arrays[:6]
  record("int4_naive_jnp", naive_int4, (ck, sk, zk, cv, sv, zv, lengths),
         nbytes(ck, sk, zk, cv, sv, zv) + io, loop=False)
  del nk, ck, sk, zk, cv, sv, zv

  def summarize_family(key, tried, data, moved):
    for i in range(len(tried)):
      rows.pop(f"{key}@{i}", None)
    if not tried:
      return
    best = min(tried, key=lambda r: r["time_us"])
    fn = best.pop("fn")
    for r in tried:
      r.pop("fn", None)
    copies = rotating_copies((data.arrays, data.lengths), moved)
    try:
      best["loop_us"] = loop_time(lambda qi, r: fn(qi, *r), qs, [(c,) for c in copies]) * 1e6
    except Exception as e:  # noqa: BLE001
      best["loop_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    del copies
    best = dict(best, speedup_vs_best_bf16=best_bf16 / best["time_us"],
                speedup_vs_best_bf16_wall=best_bf16_wall / best["wall_us"],
                candidates=[{"config": r["config"], "time_us": r["time_us"]} for r in tried])
    if "loop_us" in best:
      best["speedup_vs_best_bf16_loop"] = best_bf16_loop / best["loop_us"]
    rows[key] = best
    log(f"  => {key}: {best['time_us']:.1f} us (loop {best.get('loop_us', float('nan')):.1f}), "
        f"{best['speedup_vs_best_bf16']:.2f}x best BF16 ({best_bf16:.1f} us; loop "
        f"{best.get('speedup_vs_best_bf16_loop', float('nan')):.2f}x of {best_bf16_loop:.1f}), "
        f"config {best['config']}")

  # jaxkv kernels.
  for name in formats:
    fmt = PRESETS[name]
    data = random_packed(jax.random.fold_in(kc, hash(name) % 1000), fmt, b, t, hkv, d)
    moved = nbytes(*data.arrays) + io
    ref = jax.jit(functools.partial(pk.dequant_decode_attention_reference, fmt=fmt))(
        q, *data.arrays, data.lengths)
    def try_configs(key, call, configs):
      """Times ``call`` at each config; the best becomes row ``key`` (with loop time)."""
      tried = []
      for config in configs:
        fn = functools.partial(call, fmt=fmt, config=config)
        try:
          out = jax.jit(fn)(q, data.arrays, data.lengths)
        except Exception as e:  # noqa: BLE001
          log(f"  {key} {config} FAILED {type(e).__name__}: {str(e)[:600]}")
          continue
        row = record(f"{key}@{len(tried)}", fn, (data.arrays, data.lengths), moved,
                     out, ref, {"config": dataclasses.asdict(config)}, loop=False)
        if row:
          row["fn"] = fn
          tried.append(row)
      summarize_family(key, tried, data, moved)

    try_configs(f"jaxkv_{name}", jaxkv_call, candidate_configs(fmt, b, t, hq, hkv, d, tune, s))
    ok, why = mosaic_supported(fmt, hq, hkv, d, s)
    if ok:
      try_configs(f"mosaic_{name}", mosaic_call, mosaic_configs(fmt, b, t, hkv, tune))
    else:
      rows[f"mosaic_{name}"] = {"unsupported": why}
      log(f"  mosaic_{name}: falls back to Triton ({why})")
    del data

  for name in cache_formats:  # default kernel configs, through jaxkv.decode_attention
    view = name.split(":")[1] if ":" in name else "target"
    try:
      cache = filled_cache(name, jax.random.fold_in(kc, hash(name) % 1000), b, t, hkv, d)
    except Exception as e:  # noqa: BLE001 - recorded, the other rows go on
      rows[f"jaxkv_{name}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      log(f"  jaxkv_{name} FAILED to fill: {rows[f'jaxkv_{name}']['error'][:200]}")
      continue
    call = functools.partial(jaxkv.decode_attention, view=view) if view != "target" \
        else jaxkv.decode_attention
    if view == "draft":  # the upper plane + scales of the packed tokens, the residual block
      packed = int(cache.fmt.packed_len(t))
      moved = int(cache.fmt.bytes_per_token(hkv, d, view="draft") * packed * b) \
          + nbytes(cache.k_residual, cache.v_residual) + io
    else:  # whole storage (capacity = T): codes, scales/codebooks, residual
      moved = cache.nbytes + io
    ref = jax.jit(functools.partial(call, implementation="reference"))(q, cache)
    # "pallas" = the best family for the device; a VQ cache also times the
    # Triton VQ kernel beside it (the Mosaic one is "pallas" on a Hopper GPU).
    impls = [(f"jaxkv_{name}", "pallas")]
    if name.split(":")[0] in jaxkv.VQ_PRESETS:  # and the paths a VQ cache could take
      impls += [(f"jaxkv_{name}_triton", "triton"), (f"jaxkv_{name}_reference", "reference")]
    for row_name, impl in impls:
      fn = functools.partial(call, implementation=impl)
      try:
        out = jax.jit(fn)(q, cache)
      except Exception as e:  # noqa: BLE001
        rows[row_name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"  {row_name} FAILED {rows[row_name]['error'][:200]}")
        continue
      row = record(row_name, fn, (cache,), moved, out, ref)
      if row:
        row["speedup_vs_best_bf16"] = best_bf16 / row["time_us"]
        if "loop_us" in row:
          row["speedup_vs_best_bf16_loop"] = best_bf16_loop / row["loop_us"]
        log(f"  => {row_name}: {row['speedup_vs_best_bf16']:.2f}x best BF16 "
            f"(loop {row.get('speedup_vs_best_bf16_loop', float('nan')):.2f}x)")
    del cache
  return {"shape": dict(zip(("B", "T", "Hq", "Hkv", "D", "q_len"), shape)),
          "best_bf16_us": best_bf16, "best_bf16_wall_us": best_bf16_wall,
          "best_bf16_loop_us": best_bf16_loop, "rows": rows}


def flush_configs():
  return [None, pk.PackConfig(block_w=64), pk.PackConfig(block_w=32, num_warps=2),
          pk.PackConfig(block_t=32, block_w=8, num_warps=1), pk.PackConfig(block_w=64, num_warps=8)]


def bench_flush(hbm, log, configs=None):
  """One flush at (1, 131072, 32, 8, 128): pack one token group of K and of V per head.

  Rows: the two single-side pack kernels per pack config, and ``fused``
  (`pallas_kernels.quantize_pack_kv`, one launch, default config: what the
  cache's flush runs).

  K and V are different arrays (equal ones would let XLA merge the two packs
  when both sides use the same quantizer). Every pack config is timed; the
  best is reported, the default beside it.
  """
  del hbm
  out = {}
  for name in ("kivi4", "int4-token-g4", "kivi2", "int8"):
    fmt = PRESETS[name]
    gd = fmt.channel_group_for(128)
    xs = [tuple(jax.random.normal(jax.random.PRNGKey(2 * i + j), (8, fmt.token_group, 128),
                                  jnp.bfloat16) for j in range(2)) for i in range(UNROLL)]
    k_group = fmt.token_group if fmt.k_axis == "channel" else gd

    def flush(xk, xv, config, fmt=fmt, gd=gd, k_group=k_group):
      k = pk.quantize_pack(xk, fmt.k_bits, axis=fmt.k_axis, group=k_group, config=config)
      v = pk.quantize_pack(xv, fmt.v_bits, axis="token", group=gd, config=config)
      return k, v

    want = jax.jit(lambda xk, xv: (
        pk.quantize_pack_reference(xk, fmt.k_bits, axis=fmt.k_axis, group=k_group),
        pk.quantize_pack_reference(xv, fmt.v_bits, axis="token", group=gd)))(*xs[0])

    def fused(xk, xv, config, fmt=fmt, gd=gd, k_group=k_group):
      return pk.quantize_pack_kv(xk, xv, k_bits=fmt.k_bits, k_axis=fmt.k_axis, k_group=k_group,
                                 v_bits=fmt.v_bits, v_group=gd, config=config)

    rows = []
    # Two launches per config, then the one-launch K+V kernel (what a cache flush runs).
    runs = [(dataclasses.asdict(c) if c else "default", functools.partial(flush, config=c))
            for c in configs or flush_configs()]
    runs.append(("fused", functools.partial(fused, config=None)))
    # The fused launch around its two defaults (2-bit K: 2-byte blocks, 8 warps; else
    # 4 bytes, 4 warps). Wider/narrower V blocks, 1-2 warps and 16-byte blocks were
    # slower (`bench/results/flush-*-2026112[56]-*.log`).
    for fc in (pk.PackConfig(block_t=16, block_w=2, num_warps=8),
               pk.PackConfig(block_t=16, block_w=2), pk.PackConfig(block_t=16, block_w=4),
               pk.PackConfig(block_t=16, block_w=4, num_warps=8),
               pk.PackConfig(block_t=16, block_w=8)):
      runs.append((f"fused w{fc.block_w} n{fc.num_warps} t{fc.block_t}",
                   functools.partial(fused, config=fc)))
    for label, fn in runs:
      got = jax.jit(fn)(*xs[0])
      ok = all(bool(jnp.all(a == b_)) for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
      tm = kernel_time(fn, xs, calls=CALLS)
      rows.append({"config": label,
                   "time_us": tm["kernel"] * 1e6, "span_us": tm["span"] * 1e6,
                   "wall_us": tm["wall"] * 1e6, "kernels_per_call": tm["kernels"],
                   "bitwise_equal": ok})
      log(f"  flush {name:14s} {rows[-1]['config']!s:80.80s} {rows[-1]['time_us']:7.2f} us "
          f"(span {rows[-1]['span_us']:6.2f}, {tm['kernels']:.0f} kernels) bitwise={ok}")
    best = min((r for r in rows if r["bitwise_equal"]), key=lambda r: r["time_us"])
    out[name] = dict(best, default_time_us=rows[0]["time_us"], candidates=rows)
  return out


def plot(results, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
  for ax, hkv in zip(axes, (1, 8)):
    for fmt in FORMATS:
      xs, ys = [], []
      for r in results["shapes"]:
        sh = r["shape"]
        row = best_row(r["rows"], fmt)
        if sh["Hkv"] == hkv and sh["q_len"] == 1 and row:
          xs.append(f"B{sh['B']}\nT{sh['T'] // 1024}K")
          ys.append(row["speedup_vs_best_bf16"])
      if xs:
        ax.plot(xs, ys, marker="o", label=fmt)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_title(f"Hkv={hkv}: speedup over best BF16 (q_len 1)")
    ax.set_ylabel("speedup")
    ax.legend()
  fig.suptitle(f"jaxkv Pallas decode attention, {results['gpu']}, jax {results['jax_version']}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="two shapes, two formats")
  ap.add_argument("--tune", type=int, default=4, help="configs tried per (shape, format)")
  ap.add_argument("--shapes", default=None, help="comma-separated shape indices")
  ap.add_argument("--formats", default=None)
  ap.add_argument("--cache-formats", default=",".join(CACHE_FORMATS),
                  help=f"formats timed through jaxkv.decode_attention on a filled cache "
                       f"(default {','.join(CACHE_FORMATS)}; '' = none)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
  ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                  help="merge results of several runs into --out, no GPU needed")
  ap.add_argument("--no-flush", action="store_true", help="skip the flush timings")
  ap.add_argument("--flush-only", action="store_true",
                  help="only the flush timings, for several pack configs")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  if args.merge:
    merge(args.merge, args.out)
    return
  if args.flush_only:
    bench_flush(None, print)
    return
  shapes = SHAPES
  formats = FORMATS
  if args.quick:
    shapes, formats = [SHAPES[0], SHAPES[4]], ["kivi4", "int4-token-g4"]
  if args.shapes:
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")]
  if args.formats:
    formats = args.formats.split(",")
  dev = jax.devices()[0]
  log_lines = []

  def log(msg):
    print(msg, flush=True)
    log_lines.append(msg)

  hbm = timing.hbm_read_probe()["best"]
  log(f"{dev.device_kind}, jax {jax.__version__}: HBM read (4 GiB sum) {hbm/1e9:.0f} GB/s")
  results = {"gpu": dev.device_kind, "jax_version": jax.__version__,
             "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M"),
             "hbm_read_gbps": hbm / 1e9, "calls": CALLS,
             "timing": "summed GPU kernel durations per call from a jax.profiler (CUPTI) "
                       "trace of back-to-back calls over rotating cache copies; span_us adds "
                       "the gaps between kernels; wall_us is the host loop time per call",
             "shapes": []}
  for shape in shapes:
    log(f"shape {shape_id(shape)}")
    results["shapes"].append(bench_shape(
        shape, formats, hbm, args.tune, log,
        [f for f in args.cache_formats.split(",") if f.strip()]))
    with open(os.path.join(args.out, "partial.json"), "w") as f:  # survives a cut-off run
      json.dump(results, f, indent=1)
  if not args.no_flush:
    log("flush (pack K+V of one group, 8 sequences x heads) at (1,131072,32,8,128):")
    results["flush"] = bench_flush(hbm, log)
  write_results(results, args.out)


def best_row(rows, fmt):
  """The faster of a format's Triton (``jaxkv_``) and Mosaic (``mosaic_``) rows
  (the two families the default dispatch chooses between), with ``family``
  added; None when neither was timed."""
  timed = [dict(rows[k], family=fam) for fam, k in (("triton", f"jaxkv_{fmt}"),
                                                  ("mosaic", f"mosaic_{fmt}"))
           if "time_us" in rows.get(k, {})]
  return min(timed, key=lambda r: r["time_us"]) if timed else None


def target_report(results):
  """The issue's targets against what was measured (the faster kernel family of
  each format, `best_row`): met or missed, and by how much."""
  want_speedup = {"kivi4": 3.0, "int4-token-g4": 3.0, "kivi2": 5.0, "int8": 1.7, "k8v4": 1.7}
  out = []
  for r in results["shapes"]:
    t = r["shape"]["T"]
    sid = shape_id(tuple(r["shape"].values()))
    for f, target in want_speedup.items():
      row = best_row(r["rows"], f)
      if row is None or (f == "kivi2" and t < 32768):
        continue
      if f.startswith(("kivi4", "int4")) and t < 32768:
        target = 2.5 if t == 8192 else None
      if target is not None:
        got = row["speedup_vs_best_bf16"]
        out.append({"shape": sid, "format": f, "what": "speedup_vs_best_bf16", "target": target,
                    "measured": got, "met": got >= target, "shortfall": max(1.0, target / got),
                    "family": row["family"]})
      if t >= 32768:
        got = row["frac_hbm"]
        out.append({"shape": sid, "format": f, "what": "fraction_of_hbm_read", "target": 0.75,
                    "measured": got, "met": got >= 0.75, "shortfall": max(1.0, 0.75 / got),
                    "family": row["family"]})
  for f, row in (results.get("flush") or {}).items():
    frac = row.get("fraction_of_attention_call")
    if frac is not None:
      out.append({"shape": shape_id(SHAPES[4]), "format": f, "what": "flush_fraction_of_call",
                  "target": 0.05, "measured": frac, "met": frac <= 0.05,
                  "shortfall": max(1.0, frac / 0.05)})
  return out


def write_results(results, out_dir):
  """JSON + PNG under ``out_dir``, then the short table."""
  tag = results["gpu"].replace(" ", "-").lower()
  long = [r for r in results["shapes"] if shape_id(tuple(r["shape"].values())) == shape_id(SHAPES[4])]
  for name, row in (results.get("flush") or {}).items():
    attn = best_row(long[0]["rows"], name) if long else None
    if attn:  # the target: one flush <= 5% of one attention call at this shape
      row["fraction_of_attention_call"] = row["time_us"] / attn["time_us"]
  results["targets"] = target_report(results)
  jpath = os.path.join(out_dir, f"attention-{tag}.json")
  with open(jpath, "w") as f:
    json.dump(results, f, indent=1)
  try:
    plot(results, os.path.join(out_dir, f"attention-{tag}.png"))
  except Exception as e:  # noqa: BLE001
    print(f"plot failed: {e}")
  formats = [f for f in FORMATS + CACHE_FORMATS
             if any(best_row(r["rows"], f) for r in results["shapes"])]
  print("\nfaster family per format (m = Mosaic), kernel us and x best BF16")
  print("shape                         best_bf16_us " + " ".join(f"{f:>15s}" for f in formats))
  for r in results["shapes"]:
    sh = r["shape"]
    cells = []
    for f in formats:
      row = best_row(r["rows"], f)
      cells.append(f"{row['time_us']:6.1f}us{'m' if row['family'] == 'mosaic' else ' '}"
                   f"{row['speedup_vs_best_bf16']:4.2f}x" if row else "              -")
    print(f"{shape_id(tuple(sh.values())):30s}{r['best_bf16_us']:10.1f}   " + " ".join(
        f"{c:>14s}" for c in cells))
  for name, row in (results.get("flush") or {}).items():
    frac = row.get("fraction_of_attention_call")
    print(f"flush {name}: {row['time_us']:.1f} us" +
          (f" = {frac * 100:.0f}% of one attention call at {shape_id(SHAPES[4])}" if frac else ""))
  print("\nMosaic (Hopper) vs Triton, kernel us / loop us / x best BF16 (kernel, loop):")
  for r in results["shapes"]:
    cells = []
    for f in formats:
      for fam in ("jaxkv", "mosaic"):
        row = r["rows"].get(f"{fam}_{f}") or {}
        if "time_us" in row:
          cells.append(f"{f}/{fam[:3]} {row['time_us']:.0f}/{row.get('loop_us', float('nan')):.0f}"
                       f" {row['speedup_vs_best_bf16']:.2f}x/"
                       f"{row.get('speedup_vs_best_bf16_loop', float('nan')):.2f}x")
    print(f"{shape_id(tuple(r['shape'].values()))} bf16 {r['best_bf16_us']:.0f}/"
          f"{r.get('best_bf16_loop_us', float('nan')):.0f}: " + "; ".join(cells))
  missed = [x for x in results["targets"] if not x["met"]]
  print(f"targets met: {len(results['targets']) - len(missed)}/{len(results['targets'])} "
        "(JSON 'targets' lists each; shortfall = factor still missing, 1.0 = met)")
  print("HBM-fraction of the faster family: " + "; ".join(
      f"{shape_id(tuple(r['shape'].values()))}:" + ",".join(
          f"{f}={best_row(r['rows'], f)['frac_hbm']*100:.0f}%"
          for f in formats if best_row(r["rows"], f)) for r in results["shapes"]))


def merge(paths, out_dir):
  """One results file from several runs (each shape's ratios come from one process)."""
  runs = [json.load(open(p)) for p in paths]
  if len({(r["gpu"], r["jax_version"]) for r in runs}) != 1:
    raise ValueError(f"runs from different GPUs/JAX versions: {paths}")
  merged = dict(runs[0], shapes=[], runs=[])
  for p, r in zip(paths, runs):
    merged["runs"].append({"file": os.path.basename(os.path.dirname(os.path.abspath(p))),
                           "date": r["date"], "hbm_read_gbps": r["hbm_read_gbps"],
                           "shapes": [shape_id(tuple(s["shape"].values())) for s in r["shapes"]]})
    for s in r["shapes"]:
      s["hbm_read_gbps"] = r["hbm_read_gbps"]
      merged["shapes"].append(s)
    if r.get("flush"):
      merged["flush"] = r["flush"]
  order = {shape_id(s): i for i, s in enumerate(SHAPES)}
  merged["shapes"].sort(key=lambda s: order.get(shape_id(tuple(s["shape"].values())), 99))
  merged["hbm_read_gbps"] = min(r["hbm_read_gbps"] for r in runs)
  write_results(merged, out_dir)


if __name__ == "__main__":
  main()
