"""Probe: does reading layer i of stacked weights inside a layer loop copy it?"""
import json, os, subprocess, sys, time
import jax, jax.numpy as jnp

L, H, F = 32, 4096, 14336


def body(x, w1, w2):
  h = jnp.dot(x, w1, preferred_element_type=jnp.float32).astype(x.dtype)
  return x + jnp.dot(jax.nn.silu(h), w2, preferred_element_type=jnp.float32).astype(x.dtype)


def v_scan(x, W1, W2):
  def step(x, ws):
    return body(x, *ws), None
  return jax.lax.scan(step, x, (W1, W2))[0]


def v_fori(x, W1, W2):
  return jax.lax.fori_loop(0, L, lambda i, x: body(
      x, jax.lax.dynamic_index_in_dim(W1, i, keepdims=False),
      jax.lax.dynamic_index_in_dim(W2, i, keepdims=False)), x)


def v_unroll_static(x, W1, W2):
  for i in range(L):
    x = body(x, W1[i], W2[i])
  return x


def v_scan_unroll4(x, W1, W2):
  def step(x, ws):
    return body(x, *ws), None
  return jax.lax.scan(step, x, (W1, W2), unroll=4)[0]


def v_list(x, w1s, w2s):
  for a, b in zip(w1s, w2s):
    x = body(x, a, b)
  return x



def body_bf16(x, w1, w2):
  h = jnp.dot(x, w1)
  return x + jnp.dot(jax.nn.silu(h), w2)


def v_static_bf16(x, W1, W2):
  for i in range(L):
    x = body_bf16(x, W1[i], W2[i])
  return x


def v_static_pad8(x, W1, W2):
  b = x.shape[0]
  xp = jnp.pad(x, ((0, max(0, 8 - b)), (0, 0)))
  for i in range(L):
    xp = body(xp, W1[i], W2[i])
  return xp[:b]


def v_static_pad2(x, W1, W2):
  b = x.shape[0]
  xp = jnp.pad(x, ((0, max(0, 2 - b)), (0, 0)))
  for i in range(L):
    xp = body(xp, W1[i], W2[i])
  return xp[:b]


def v_scan_rowreduce(x, W1T, W2T):  # weights stored [L, out, in]
  def step(x, ws):
    a, b = ws
    h = jnp.einsum("bh,fh->bf", x.astype(jnp.float32), a.astype(jnp.float32)).astype(x.dtype)
    h = jax.nn.silu(h)
    return x + jnp.einsum("bf,hf->bh", h.astype(jnp.float32), b.astype(jnp.float32)).astype(x.dtype), None
  return jax.lax.scan(step, x, (W1T, W2T))[0]


def v_scan_mulreduce(x, W1T, W2T):  # elementwise multiply + reduce, weights [L, out, in]
  def step(x, ws):
    a, b = ws
    h = jnp.sum(x[:, None, :].astype(jnp.float32) * a[None].astype(jnp.float32), -1).astype(x.dtype)
    h = jax.nn.silu(h)
    return x + jnp.sum(h[:, None, :].astype(jnp.float32) * b[None].astype(jnp.float32), -1).astype(x.dtype), None
  return jax.lax.scan(step, x, (W1T, W2T))[0]


def timeit(f, *args, n=20):
  f = jax.jit(f)
  y = f(*args); y.block_until_ready()
  t = time.perf_counter()
  for _ in range(n):
    y = f(*args)
  y.block_until_ready()
  return (time.perf_counter() - t) / n * 1e3


def main():
  key = jax.random.PRNGKey(0)
  W1 = (jax.random.normal(key, (L, H, F), jnp.float32) * 0.01).astype(jnp.bfloat16)
  W2 = (jax.random.normal(key, (L, F, H), jnp.float32) * 0.01).astype(jnp.bfloat16)
  res = {}
  for B in (1, 2, 4, 8, 16, 64):
    x = jax.random.normal(key, (B, H), jnp.bfloat16)
    for name in ("unroll_static", "static_bf16", "static_pad8", "static_pad2"):
      res[f"{name} B={B}"] = round(timeit(globals()["v_" + name], x, W1, W2), 3)
    print(json.dumps(res)); sys.stdout.flush()
  W1T = jnp.swapaxes(W1, 1, 2); W2T = jnp.swapaxes(W2, 1, 2)
  del W1, W2
  for B in (1, 2, 4):
    x = jax.random.normal(key, (B, H), jnp.bfloat16)
    for name in ("scan_rowreduce", "scan_mulreduce"):
      res[f"{name} B={B}"] = round(timeit(globals()["v_" + name], x, W1T, W2T), 3)
  res["floor_ms@3TB/s"] = 2 * L * H * F * 2 / 3.0e12 * 1e3
  print(json.dumps(res))


if __name__ == "__main__":
  main()
