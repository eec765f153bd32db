"""Probe: compile and run one Mosaic attention case with timings and a watchdog."""
import faulthandler, sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
import jaxkv
from tests import test_mosaic_attention as t

faulthandler.dump_traceback_later(int(sys.argv[2]) if len(sys.argv) > 2 else 80, exit=True)
for case in t.CASES:
  if case[0] not in sys.argv[1].split(","):
    continue
  name, b, hkv, g, d, s, lengths, cap, dtype = case
  fmt = t._fmt(name)
  cache = t._cache(fmt, b, hkv, d, lengths, cap, dtype, t._key(name))
  q = jax.random.normal(jax.random.PRNGKey(1), (b, s, hkv * g, d)).astype(dtype)
  cfg = t.ma.MosaicAttentionConfig(block_k=64, num_splits=3)
  f = jax.jit(t._call, static_argnums=2)
  t0 = time.time(); low = f.trace(q, cache, cfg).lower(); t1 = time.time()
  comp = low.compile(); t2 = time.time()
  print(f"{name}: lower {t1-t0:.1f}s compile {t2-t1:.1f}s", flush=True)
  out = comp(q, cache, cfg) if False else f(q, cache, cfg); out.block_until_ready(); t3 = time.time()
  kd, vd = cache.dequantize()
  ref = t.np_attention(np.asarray(q, np.float64), np.asarray(kd), np.asarray(vd), lengths)
  err = np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max()
  print(f"{name}: run {t3-t2:.2f}s err {err:.2e} finite {np.isfinite(np.asarray(out, np.float32)).all()}", flush=True)
