"""Probe: inside a while loop of decode steps, are layer weights copied each step?"""
import json, time
import jax, jax.numpy as jnp
from probe_layer_weights import L, H, F, body, v_list, v_unroll_static, v_scan

def in_loop(layer_fn, n=8):
  def f(x, *ws):
    return jax.lax.fori_loop(0, n, lambda i, x: layer_fn(x, *ws), x)
  return f

def timeit(f, *args, n=5, steps=8):
  f = jax.jit(f)
  y = f(*args); y.block_until_ready()
  t = time.perf_counter()
  for _ in range(n):
    y = f(*args)
  y.block_until_ready()
  return round((time.perf_counter() - t) / n / steps * 1e3, 3)

key = jax.random.PRNGKey(0)
W1 = (jax.random.normal(key, (L, H, F), jnp.float32) * 0.01).astype(jnp.bfloat16)
W2 = (jax.random.normal(key, (L, F, H), jnp.float32) * 0.01).astype(jnp.bfloat16)
res = {}
for B in (2, 16):
  x = jax.random.normal(key, (B, H), jnp.bfloat16)
  res[f"loop static B={B}"] = timeit(in_loop(v_unroll_static), x, W1, W2)
  res[f"loop scan B={B}"] = timeit(in_loop(v_scan), x, W1, W2)
w1s = [W1[i] + 0 for i in range(L)]; w2s = [W2[i] + 0 for i in range(L)]
del W1, W2
for B in (2, 16):
  x = jax.random.normal(key, (B, H), jnp.bfloat16)
  res[f"loop list B={B}"] = timeit(in_loop(lambda x, a, b: v_list(x, a, b)), x, w1s, w2s)
res["floor_ms"] = 2 * L * H * F * 2 / 3.0e12 * 1e3
print(json.dumps(res))
