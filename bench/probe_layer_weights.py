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


def timeit(f, *args, n=20):
  f = jax.jit(f)
  y = f(*args); y.block_until_ready()
  t = time.perf_counter()
  for _ in range(n):
    y = f(*args)
  y.block_until_ready()
  return (time.perf_counter() - t) / n * 1e3


def main(variants):
  key = jax.random.PRNGKey(0)
  W1 = (jax.random.normal(key, (L, H, F), jnp.float32) * 0.01).astype(jnp.bfloat16)
  W2 = (jax.random.normal(key, (L, F, H), jnp.float32) * 0.01).astype(jnp.bfloat16)
  res = {}
  for B in (1, 32):
    x = jax.random.normal(key, (B, H), jnp.bfloat16)
    for name in variants:
      if name == "list":
        w1s = [W1[i] + 0 for i in range(L)]; w2s = [W2[i] + 0 for i in range(L)]
        res[f"{name} B={B}"] = timeit(v_list, x, w1s, w2s)
        del w1s, w2s
      else:
        res[f"{name} B={B}"] = timeit(globals()["v_" + name], x, W1, W2)
  floor = 2 * L * H * F * 2 / 3.0e12 * 1e3
  res["floor_ms@3TB/s"] = floor
  print(json.dumps({"flags": os.environ.get("XLA_FLAGS", ""), "ms": res}))


if __name__ == "__main__":
  if len(sys.argv) > 1:
    main(sys.argv[1].split(","))
  else:
    runs = [("", "scan,fori,unroll_static,scan_unroll4,list"),
            ("--xla_gpu_enable_dynamic_slice_fusion=true", "scan,fori"),
            ("--xla_gpu_enable_triton_gemm=false", "scan,fori,list"),
            ("--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true", "scan,fori"),
            ("--xla_gpu_enable_command_buffer=", "scan,list")]
    for flags, vs in runs:
      env = dict(os.environ, XLA_FLAGS=flags)
      p = subprocess.run([sys.executable, __file__, vs], env=env, capture_output=True, text=True, timeout=200)
      print(p.stdout.strip() or ("FAILED " + flags + " " + p.stderr[-600:]))
