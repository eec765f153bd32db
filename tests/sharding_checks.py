"""Sharded decoding checks; run by `tests/test_sharding.py` in a fresh process.

JAX must see 8 (CPU) devices from process start, so this runs as a script
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``. Every case
compares a sharded run with the same model on one device (the oracle):
prefill and decode logits within tolerance, greedy tokens identical, cache
leaves placed as `jaxkv.sharding.cache_specs` declares after jitted steps,
and no all-gather of a cache-sized buffer in the compiled decode step.
Prints one ``OK <case> <seconds>`` line per case; raises on the first failure.
"""

from __future__ import annotations

import functools
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxkv
from jaxkv import decoding, sharding
from models import llama
from models.sharding import param_specs, shard_model, vocab_parallel_embed
from tests.model_fixtures import rel_err

FMT = "kivi4"
BATCH, PROMPT, NEW = 8, 12, 5
# GQA with 8 KV heads (divisible by every model axis here) and a config with
# 2 KV heads (fewer than model=4 / 8: the kv-head axis is replicated).
WIDE = llama.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=16, num_kv_heads=8, head_dim=16, rope_theta=10000.0)
NARROW = llama.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=8, num_kv_heads=2, head_dim=16, rope_theta=10000.0)


def cases(n: int) -> tuple:
  """Meshes over ``n`` devices: all model, all data, 2 x n/2, and 2 KV heads on model=n."""
  out = [(f"1x{n}", 1, n, WIDE), (f"{n}x1", n, 1, WIDE)]
  if n >= 4:
    out.insert(1, (f"2x{n // 2}", 2, n // 2, WIDE))
  if n > 2:
    out.append((f"kv2_1x{n}", 1, n, NARROW))
  return tuple(out)


CASES = cases(8)


def mixed_mesh(n: int):
  """2 x n/2 (both axes split) when n >= 4, else 1 x n (heads split)."""
  data = 2 if n >= 4 else 1
  return sharding.make_mesh(data=data, model=n // data)


def inputs(seed: int = 0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, WIDE.vocab_size, (BATCH, PROMPT)).astype(np.int32)
  lengths = rng.integers(4, PROMPT + 1, (BATCH,)).astype(np.int32)
  return tokens, lengths


def make_steps(model, mesh):
  """Jitted prefill and decode step of ``model`` (per shard of ``mesh`` if given)."""
  graphdef, _ = nnx.split(model)

  @jax.jit
  def prefill(state, tokens, lengths, cache):
    return nnx.merge(graphdef, state).prefill(tokens, lengths, cache, mesh=mesh)

  @functools.partial(jax.jit, donate_argnames=("cache",))
  def step(state, token, cache):
    return jaxkv.decode_step(nnx.merge(graphdef, state), token, cache, mesh=mesh)

  return prefill, step


def oracle(config):
  """One-device prefill logits, decode logits and greedy tokens."""
  model = llama.random_model(config, seed=1, dtype=jnp.float32)
  tokens, lengths = inputs()
  prefill, step = make_steps(model, None)
  state = nnx.state(model)
  cache = model.init_cache(FMT, BATCH, PROMPT + NEW)
  pre_logits, cache = prefill(state, tokens, lengths, cache)
  token = jnp.argmax(pre_logits, -1).astype(jnp.int32)
  dec_logits, _ = step(state, token, cache)
  out, _ = jaxkv.generate(model, tokens, lengths, kv_format=FMT, max_new_tokens=NEW)
  return np.asarray(pre_logits), np.asarray(dec_logits), np.asarray(out)


def check_placement(cache, mesh, what):
  """Every leaf of ``cache`` sits as `cache_specs` declares (no silent replication)."""
  want = sharding.cache_shardings(cache, mesh)
  leaves = jax.tree_util.tree_leaves_with_path(cache)
  wants = jax.tree_util.tree_leaves(want, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  assert len(leaves) == len(wants), (len(leaves), len(wants))
  for (path, leaf), w in zip(leaves, wants):
    if not leaf.sharding.is_equivalent_to(w, leaf.ndim):
      raise AssertionError(f"{what}: {jax.tree_util.keystr(path)} is {leaf.sharding}, "
                           f"declared {w}")


def check_hlo(hlo: str, cache, what, *, allow_small: bool):
  """No all-gather in the decode step gathers cache storage.

  Cache-sized: uint8 (only packed codes are), an output with the storage's
  token-row dimension, or one at least as large as one layer's largest
  storage leaf. With ``allow_small=False`` no all-gather may appear at all
  (heads split like the cache: q/k/v are already local); small all-gathers
  of activations are expected when KV heads are replicated (q is gathered).
  XLA's own partitioning of the append (no `shard_map`) fails this check: it
  all-gathers the flushed uint8 code rows and scales.
  """
  storage_len = cache.k.codes.shape[3]
  limit = max(x.size // cache.num_layers for x in jax.tree_util.tree_leaves(cache)
              if x.ndim >= 5)
  for line in hlo.splitlines():
    if "all-gather(" not in line or "=" not in line:
      continue
    out_type = line.split("=", 1)[1].split("all-gather(", 1)[0]
    if not allow_small:
      raise AssertionError(f"{what}: unexpected all-gather {line.strip()[:200]}")
    for dtype, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", out_type):
      shape = [int(d) for d in dims.split(",") if d]
      if dtype == "u8" or storage_len in shape or int(np.prod(shape or [1])) >= limit:
        raise AssertionError(f"{what}: all-gather of a cache-sized buffer {shape} "
                             f"(storage rows {storage_len}, layer leaf {limit}): "
                             f"{line.strip()[:200]}")


def run_case(name, data, model_size, config, want):
  t0 = time.time()
  want_pre, want_dec, want_out = want
  mesh = sharding.make_mesh(data=data, model=model_size)
  model = shard_model(llama.random_model(config, seed=1, dtype=jnp.float32), mesh)
  # Parameters placed as declared (Megatron columns / rows, vocab split).
  params = nnx.state(model, nnx.Param)
  for leaf, spec in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(
      param_specs(model, mesh), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
    assert leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), leaf.ndim)
  q_spec = model.layers[1].self_attn.q_proj.kernel[...].sharding.spec
  assert q_spec == jax.sharding.PartitionSpec(None, "model" if model_size > 1 else None) \
      or model_size == 1, q_spec

  tokens, lengths = inputs()
  prefill, step = make_steps(model, mesh)
  state = nnx.state(model)
  cache = sharding.init_sharded(lambda: model.init_cache(FMT, BATCH, PROMPT + NEW), mesh)
  check_placement(cache, mesh, f"{name} init_sharded")
  spec = sharding.cache_specs(cache, mesh).k_residual
  # [L, B, Hkv, R, D]: batch over "data"; kv heads over "model" when divisible.
  assert spec[1] == "data", spec
  assert spec[2] == ("model" if config.num_kv_heads % model_size == 0 else None), spec

  pre_logits, cache = prefill(state, tokens, lengths, cache)
  assert rel_err(pre_logits, want_pre) < 1e-4, (name, "prefill", rel_err(pre_logits, want_pre))
  check_placement(cache, mesh, f"{name} after prefill")
  token = jnp.argmax(pre_logits, -1).astype(jnp.int32)
  check_hlo(step.lower(state, token, cache).compile().as_text(), cache, name,
            allow_small=config.num_kv_heads % model_size != 0)
  dec_logits, cache = step(state, token, cache)
  assert rel_err(dec_logits, want_dec) < 1e-4, (name, "decode", rel_err(dec_logits, want_dec))
  check_placement(cache, mesh, f"{name} after decode step")

  out, _, gen_cache = jaxkv.generate(model, tokens, lengths, kv_format=FMT,
                                     max_new_tokens=NEW, mesh=mesh, return_cache=True)
  np.testing.assert_array_equal(np.asarray(out), want_out, err_msg=f"{name}: greedy tokens")
  check_placement(gen_cache, mesh, f"{name} after generate")
  print(f"OK {name} {time.time() - t0:.1f}s", flush=True)


def run_kernel_case(n: int = 8):
  """`sharded_decode_attention` with the Pallas (Triton) kernel per shard vs one device.

  Interpreted on CPU; compiled for the GPU when the devices are GPUs.
  """
  t0 = time.time()
  b, s, hq, hkv, d, length = 4, 1, 8, 4, 64, 40
  rng = np.random.default_rng(1)
  k, v = (jnp.asarray(rng.standard_normal((b, length, hkv, d)), jnp.float32) for _ in range(2))
  lengths = jnp.asarray([40, 17, 33, 5], jnp.int32)
  cache = jaxkv.KVCache.init(FMT, b, hkv, d, 64, jnp.float32).prefill(k, v, lengths)
  q = jnp.asarray(rng.standard_normal((b, s, hq, d)), jnp.float32)
  want = jaxkv.decode_attention(q, cache, implementation="reference")
  mesh = mixed_mesh(n)
  placed = sharding.shard_cache(cache, mesh)
  check_placement(placed, mesh, "KVCache")
  assert placed.k.codes.sharding.is_equivalent_to(jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data", "model")), 4), placed.k.codes.sharding
  for impl in ("triton",):  # the reference path runs in every model case
    fn = jax.jit(functools.partial(sharding.sharded_decode_attention, mesh=mesh,
                                   implementation=impl))
    got = fn(q, placed)
    assert rel_err(got, want) < 1e-5, (impl, rel_err(got, want))
    assert got.sharding.is_equivalent_to(jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data", None, "model", None)), 4), got.sharding
    hlo = fn.lower(q, placed).compile().as_text()
    assert "all-gather(" not in hlo, f"{impl}: the kernel path gathers"
  print(f"OK kernel_per_shard {time.time() - t0:.1f}s", flush=True)


def run_formats_case(n: int = 8):
  """VQ and QuantSpec caches: placed by `cache_specs` (codebooks with their heads),
  `sharded_decode_attention` with their kernels per shard equal to one device,
  and no all-gather in the compiled call."""
  t0 = time.time()
  b, s, hq, hkv, d, length = 4, 2, 8, 4, 64, 300
  rng = np.random.default_rng(3)
  k, v = (jnp.asarray(rng.standard_normal((b, length, hkv, d)), jnp.float32) for _ in range(2))
  lengths = jnp.asarray([300, 129, 260, 7], jnp.int32)
  q = jnp.asarray(rng.standard_normal((b, s, hq, d)), jnp.float32)
  books = jaxkv.vq.fit(k[None, 0], v[None, 0], "cq4", iters=2)
  caches = {
      "cq4": jaxkv.VQCache.init("cq4", books, b, hkv, d, 512, jnp.float32, layer=0),
      "quantspec": jaxkv.KVCache.init("quantspec", b, hkv, d, 512, jnp.float32),
  }
  mesh = mixed_mesh(n)
  for name, cache in caches.items():
    cache = cache.prefill(k, v, lengths)
    placed = sharding.shard_cache(cache, mesh)
    check_placement(placed, mesh, name)
    views = ("draft", "target") if name == "quantspec" else (None,)
    for view in views:
      kw = {} if view is None else {"view": view}
      want = jaxkv.decode_attention(q, cache, implementation="reference", **kw)
      fn = jax.jit(functools.partial(sharding.sharded_decode_attention, mesh=mesh,
                                     implementation="triton", **kw))
      got = fn(q, placed)
      assert rel_err(got, want) < 1e-4, (name, view, rel_err(got, want))
      assert "all-gather(" not in fn.lower(q, placed).compile().as_text(), (name, "gathers")
  books_spec = sharding.cache_specs(caches["cq4"], mesh).k_codebook
  assert books_spec[0] == "model" and all(a is None for a in books_spec[1:]), books_spec
  print(f"OK formats_per_shard {time.time() - t0:.1f}s", flush=True)


def run_vq_model_case(n: int = 8):
  """A `VQModelCache` (codebooks [L, Hkv, ...] with their kv heads) on a mixed mesh: placed
  as declared, prefill / decode per shard / `generate(codebooks=)` equal to one device,
  no all-gather in the decode step. G = R = 4, so prefill and decode flush groups."""
  t0 = time.time()
  fmt = jaxkv.VQFormat(k_vector=4, v_vector=2, token_group=4, residual=4)
  key = jax.random.key(7)
  books = jaxkv.VQCodebooks(fmt=fmt, **{
      side: jax.random.normal(jax.random.fold_in(key, i), (
          WIDE.num_layers, *fmt.codebook_shape(side, WIDE.num_kv_heads, WIDE.head_dim)),
          jnp.float32).astype(fmt.codebook_dtype) for i, side in enumerate("kv")})
  tokens, lengths = inputs(1)
  one = llama.random_model(WIDE, seed=1, dtype=jnp.float32)
  init = lambda m: m.init_cache(fmt, BATCH, PROMPT + NEW, codebooks=books)  # noqa: E731
  prefill, step = make_steps(one, None)
  want_pre, cache = prefill(nnx.state(one), tokens, lengths, init(one))
  token = jnp.argmax(want_pre, -1).astype(jnp.int32)
  want_dec, _ = step(nnx.state(one), token, cache)
  want_out, _ = jaxkv.generate(one, tokens, lengths, kv_format=fmt, codebooks=books,
                               max_new_tokens=NEW)

  mesh = mixed_mesh(n)
  model = shard_model(one, mesh)
  prefill, step = make_steps(model, mesh)
  state = nnx.state(model)
  cache = sharding.init_sharded(lambda: init(model), mesh)
  check_placement(cache, mesh, "vq_model init_sharded")
  spec = sharding.cache_specs(cache, mesh).k.codebook
  assert spec[1] == "model" and all(a is None for a in (spec[0], *spec[2:])), spec
  pre, cache = prefill(state, tokens, lengths, cache)
  assert rel_err(pre, want_pre) < 1e-4, ("vq_model prefill", rel_err(pre, want_pre))
  check_placement(cache, mesh, "vq_model after prefill")
  check_hlo(step.lower(state, token, cache).compile().as_text(), cache, "vq_model",
            allow_small=False)
  dec, cache = step(state, token, cache)
  assert rel_err(dec, want_dec) < 1e-4, ("vq_model decode", rel_err(dec, want_dec))
  check_placement(cache, mesh, "vq_model after decode step")
  assert (np.asarray(cache.packed_lens) > 0).all()
  out, _ = jaxkv.generate(model, tokens, lengths, kv_format=fmt, codebooks=books,
                          max_new_tokens=NEW, mesh=mesh)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out), err_msg="vq_model tokens")
  print(f"OK vq_model_per_shard {time.time() - t0:.1f}s", flush=True)


def run_speculative_case(n: int = 8):
  """`speculative_generate(mesh=)` (QuantSpec cache, int4 draft weights): the same greedy
  tokens and statistics as one device, the cache placed as declared afterwards."""
  t0 = time.time()
  tokens, lengths = inputs()
  one = llama.random_model(WIDE, seed=4, dtype=jnp.float32)
  kw = dict(max_new_tokens=NEW + 3, gamma=3, kv_format="quantspec", draft_weights="int4",
            group_size=32)
  want, want_n, want_stats = jaxkv.speculative_generate(one, tokens, lengths, **kw)
  mesh = mixed_mesh(n)
  model = shard_model(one, mesh)
  out, num, stats, cache = jaxkv.speculative_generate(model, tokens, lengths, mesh=mesh,
                                                      return_cache=True, **kw)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want), err_msg="speculative tokens")
  np.testing.assert_array_equal(np.asarray(num), np.asarray(want_n))
  np.testing.assert_array_equal(stats["accepted"], want_stats["accepted"])
  check_placement(cache, mesh, "speculative_generate")
  # The compiled program (draft, verify, commit in one while loop) gathers no
  # cache storage: the staged attention and the commit's appends run per shard.
  from jaxkv import speculative  # pylint: disable=import-outside-toplevel
  fresh = sharding.init_sharded(lambda: model.init_cache("quantspec", BATCH, PROMPT + NEW + 3),
                                mesh)
  graphdef, state = nnx.split(model)
  rows = decoding.program_rows(BATCH, mesh, kw["gamma"] + 1)
  hlo = speculative._speculative_program.at(rows).lower(  # pylint: disable=protected-access
      graphdef, state, model.quantize_weights(bits=4, group_size=32, fuse_qkv=False,
                                              fuse_mlp=False),
      jnp.asarray(tokens),
      jnp.asarray(lengths), fresh, jax.random.key(0),
      speculative._stop_array(None, BATCH), np.float32(1), np.int32(0),  # pylint: disable=protected-access
      settings=speculative.SpecSettings(NEW + 3, kw["gamma"], "greedy", mesh)).compile().as_text()
  check_hlo(hlo, fresh, "speculative_generate", allow_small=True)
  print(f"OK speculative_mesh {time.time() - t0:.1f}s", flush=True)


def run_embed_case(n: int = 8):
  """`vocab_parallel_embed` equals ``table[ids]`` exactly and gathers nothing."""
  t0 = time.time()
  mesh = mixed_mesh(n)
  rng = np.random.default_rng(2)
  vocab, hidden = 64 * n, 24
  table = jnp.asarray(rng.standard_normal((vocab, hidden)), jnp.bfloat16)
  ids = rng.integers(0, vocab, (4, 5)).astype(np.int32)
  ids[0, :2] = (0, vocab - 1)  # both ends of the vocabulary
  placed = jax.device_put(table, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("model", None)))
  fn = jax.jit(functools.partial(vocab_parallel_embed, mesh=mesh))
  np.testing.assert_array_equal(np.asarray(fn(placed, ids), np.float32),
                                np.asarray(table, np.float32)[ids])
  assert "all-gather(" not in fn.lower(placed, ids).compile().as_text(), "embedding gathered"
  print(f"OK embed_vocab_parallel {time.time() - t0:.1f}s", flush=True)


def run_random_case(n: int = 8):
  """`random_model(mesh=)`: drawn on its shards, the same on every mesh, one device's stds."""
  t0 = time.time()
  meshes = (sharding.make_mesh(data=1, model=n), mixed_mesh(n), sharding.make_mesh(data=n, model=1))
  models = [llama.random_model(WIDE, seed=5, dtype=jnp.float32, mesh=m) for m in meshes]
  ref = jax.tree_util.tree_leaves(nnx.state(llama.random_model(WIDE, seed=5, dtype=jnp.float32),
                                            nnx.Param))
  for mesh, model in zip(meshes, models):
    specs = jax.tree_util.tree_leaves(param_specs(model, mesh), is_leaf=lambda x: isinstance(
        x, jax.sharding.PartitionSpec))
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    first = jax.tree_util.tree_leaves(nnx.state(models[0], nnx.Param))
    for leaf, spec, same, one in zip(leaves, specs, first, ref, strict=True):
      assert leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), leaf.ndim)
      np.testing.assert_array_equal(np.asarray(leaf), np.asarray(same))  # mesh-independent
      a, b = np.asarray(leaf, np.float64), np.asarray(one, np.float64)
      assert abs(a.std() - b.std()) <= 0.1 * b.std() + 1e-12 and abs(a.mean() - b.mean()) < 0.05, \
          (a.shape, a.std(), b.std(), a.mean(), b.mean())
  print(f"OK random_model_mesh {time.time() - t0:.1f}s", flush=True)


def run_load_case(n: int = 8):
  """`from_pretrained(path, mesh=)` places every tensor as declared, values unchanged."""
  import tempfile  # pylint: disable=import-outside-toplevel
  from models.checkpoint import save_llama  # pylint: disable=import-outside-toplevel
  t0 = time.time()
  mesh = mixed_mesh(n)
  model = llama.random_model(WIDE, seed=3, dtype=jnp.float32)
  with tempfile.TemporaryDirectory() as path:
    save_llama(model, path)
    loaded = llama.from_pretrained(path, dtype=jnp.float32, mesh=mesh)
  want = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
  got = jax.tree_util.tree_leaves(nnx.state(loaded, nnx.Param))
  specs = jax.tree_util.tree_leaves(param_specs(loaded, mesh),
                                    is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  for w, g, spec in zip(want, got, specs, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert g.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), g.ndim), \
        (g.sharding, spec)
  assert loaded.layers[1].mlp.down_proj.kernel[...].sharding.spec[0] == "model"
  print(f"OK load_sharded {time.time() - t0:.1f}s", flush=True)


def check_mesh_sizes(n: int) -> None:
  """`make_mesh` with a data size that does not divide the devices raises (it used a
  prefix of them silently); explicit sizes take the first data x model devices."""
  if n > 2:  # (n - 1 divides n = 2)
    try:
      sharding.make_mesh(data=n - 1)
    except ValueError as e:
      assert f"does not divide the {n} devices" in str(e), e
    else:
      raise AssertionError(f"make_mesh(data={n - 1}) on {n} devices did not raise")
  mesh = sharding.make_mesh(data=1, model=n // 2)
  assert list(mesh.devices.ravel()) == jax.devices()[:n // 2], mesh.devices


def main(argv) -> int:
  """``sharding_checks.py [--devices N] [CASE ...]``: N (default 8, even) devices' meshes."""
  args = list(argv[1:])
  n = 8
  if args[:1] == ["--devices"]:
    n, args = int(args[1]), args[2:]
  if n < 2 or n % 2 or jax.device_count() < n:
    raise SystemExit(f"needs {n} (an even number >= 2) devices, got {jax.device_count()} "
                     "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count)")
  all_cases = cases(n)
  names = set(args) or {c[0] for c in all_cases}
  print(f"devices: {n} x {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  check_mesh_sizes(n)
  jax.config.update("jax_default_matmul_precision", "highest")
  if not args or "kernel" in names:
    run_kernel_case(n)
  if not args or "formats" in names:
    run_formats_case(n)
  if not args or "vq_model" in names:
    run_vq_model_case(n)
  if not args or "speculative" in names:
    run_speculative_case(n)
  if not args or "load" in names:
    run_load_case(n)
  if not args or "embed" in names:
    run_embed_case(n)
  if not args or "random" in names:
    run_random_case(n)
  oracles = {}
  for name, data, model_size, config in all_cases:
    if name not in names:
      continue
    if config not in oracles:
      t0 = time.time()
      oracles[config] = oracle(config)
      print(f"OK oracle {config.num_kv_heads}kv {time.time() - t0:.1f}s", flush=True)
    run_case(name, data, model_size, config, oracles[config])
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
