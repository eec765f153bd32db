"""Probe: the staged combine's cost at the draft step's shape (B=1, H=8, J=49, D=128, N=8, rows=4)."""
import json, sys
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from jaxkv import timing
from pallas_kernels import combine_t as ct

B, H, J, D, N, ROWS, P = 1, 8, 49, 128, 8, 4, 5
ks = jax.random.split(jax.random.PRNGKey(0), 8)
o = jax.random.normal(ks[0], (B, H, J, D, N), jnp.float32)
l = jax.random.uniform(ks[1], (B, H, J, N), jnp.float32, 0.5, 2.0)
m = jax.random.normal(ks[2], (B, H, J, N), jnp.float32)
perm = np.random.default_rng(0).permutation(D)
qh = jax.random.normal(ks[3], (B, H, N, D), jnp.bfloat16)
q = jax.random.normal(ks[4], (B, H, ROWS, D), jnp.bfloat16)
k = jax.random.normal(ks[5], (B, P, H, D), jnp.bfloat16)
v = jax.random.normal(ks[6], (B, P, H, D), jnp.bfloat16)
staged = jnp.array([4], jnp.int32)
args = [(o + i, l, m, qh, q, k, v, staged) for i in range(4)]

import inspect, textwrap
orig_scores = ct._staged_scores
src = inspect.getsource(orig_scores)
assert "for hh in range(heads):" in src
ns = dict(vars(ct))
exec(src.replace("for hh in range(heads):", "for hh in [h]:").replace("def _staged_scores", "def own_head"), ns)
own_head = ns["own_head"]

def run(stage, min_programs, name):
  ct._MIN_PROGRAMS = min_programs
  def f(o, l, m, qh, q, k, v, staged):
    st = (q, k, v, staged, 0.088, 1) if stage else None
    return ct.combine_t(o, l, m, rows=ROWS, packed_rows=perm, qh=qh, q_rows=ROWS, stage=st)
  ref = None
  t = timing.kernel_time(f, args, calls=32)
  out = jax.jit(f)(*args[0])
  return dict(name=name, us=t["kernel"] * 1e6, kernels=t["kernels"], out=out)

rows = []
base = None
cases = [(False, mp, "all") for mp in (64, 32, 16, 8)] + [(True, mp, "all") for mp in (64, 32, 16, 8)]
cases += [(True, mp, "own") for mp in (64, 16)]
for stage, mp, check in cases:
  ct._staged_scores = orig_scores if check == "all" else own_head
  r = run(stage, mp, f"{'stage' if stage else 'plain'}_min{mp}_{check}")
  if stage:
    if base is None:
      base = r["out"]
    r["err"] = float(jnp.max(jnp.abs(r["out"] - base)))
  r.pop("out")
  rows.append(r)
  print(f"{r['name']:22s} {r['us']:6.2f} us  err {r.get('err')}", flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows),
          open(sys.argv[1] + "/combine-probe.json", "w"), indent=1)
