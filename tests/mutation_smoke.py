"""Mutation smoke test: do the tests fail when the library is wrong?

Each mutant is one meaningful one-line change (file, exact original line,
replacement line). It is applied to a temporary copy of the repository and
the relevant test subset runs there (``-x``: the first failure kills it).
Prints each mutant's fate and the kill rate; exits 1 if any mutant survives.
Not collected by pytest (no ``test_`` prefix). Run from the repository root:

    python tests/mutation_smoke.py [--only NAME_SUBSTRING] [--keep-going]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

T_RANGE = "tests/test_range.py"
T_CACHE = "tests/test_cache.py"
T_QUANT = "tests/test_quant.py"
T_KERN = "tests/test_pallas_kernels.py"
T_REF = "tests/test_attention_reference.py"

# (name, file, original line (exact, stripped of nothing), replacement, tests)
MUTANTS = [
    ("round ties go down", "pallas_kernels/layout.py",
     "    return two_d - k * hi >= k * lo",
     "    return two_d - k * hi > k * lo",
     [T_QUANT + "::test_round_codes_half_way_cases_exact"]),
    ("scale formula /(levels+1)", "pallas_kernels/layout.py",
     "  scale_s = ((hi - lo) * jnp.float32(1.0 / levels)).astype(scale_dtype)",
     "  scale_s = ((hi - lo) * jnp.float32(1.0 / (levels + 1))).astype(scale_dtype)",
     [T_QUANT]),
    ("dequantize subtracts the zero", "pallas_kernels/layout.py",
     "  x = c * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]",
     "  x = c * scale.astype(jnp.float32)[..., None] - zero.astype(jnp.float32)[..., None]",
     [T_QUANT]),
    ("NaN dropped by quantization", "pallas_kernels/layout.py",
     "  bad = group_is_bad(jnp.any(~jnp.isfinite(x), axis=axis, keepdims=True), scale_s, zero_s)",
     "  bad = jnp.zeros(scale_s.shape, bool)",
     [T_RANGE + "::test_pack_kernel_nonfinite_groups_bitwise"]),
    ("pack kernel scale /(levels+1)", "pallas_kernels/pack.py",
     "  inv_levels = np.float32(1.0 / levels)  # XLA rewrites `/ levels` into this.",
     "  inv_levels = np.float32(1.0 / (levels + 1))",
     [T_KERN + "::test_pack_bitwise"]),
    ("pack kernel ignores NaN (per-channel)", "pallas_kernels/pack.py",
     "    bad = quant.group_is_bad(_triton.any_nonfinite(x, axis=0), scale_s, zero_s)",
     "    bad = jnp.zeros(scale_s.shape, bool)",
     [T_RANGE + "::test_pack_kernel_nonfinite_groups_bitwise"]),
    ("residual rule: packed_len (int)", "jaxkv/formats.py",
     "      return g * max(0, (int(length) - r + g) // g)",
     "      return g * max(0, (int(length) - r) // g)",
     [T_CACHE + "::test_packed_len_literal_edges"]),
    ("residual rule: packed_len (array)", "jaxkv/formats.py",
     "    return g * jnp.maximum(0, (length - r + g) // g)",
     "    return g * jnp.maximum(0, (length - r) // g)",
     [T_CACHE + "::test_packed_len_literal_edges"]),
    ("bytes_per_token drops the zero", "jaxkv/formats.py",
     "        total += 2 * sbytes * head_dim / gd",
     "        total += sbytes * head_dim / gd",
     [T_CACHE + "::test_nbytes_counts_storage"]),
    ("softmax scale off by ~3%", "jaxkv/attention.py",
     "    scale = d ** -0.5",
     "    scale = d ** -0.49",
     [T_REF]),
    ("causal mask off by one", "jaxkv/attention.py",
     "  return jnp.arange(num_keys)[None, None, :] <= last[:, :, None]",
     "  return jnp.arange(num_keys)[None, None, :] < last[:, :, None]",
     [T_REF]),
    ("non-finite rule not applied", "jaxkv/attention.py",
     "  return _poison(out, q, nonfinite)",
     "  return out",
     [T_RANGE + "::test_nonfinite_kv_same_on_both_paths_and_never_dropped"]),
    ("non-finite scale accepted", "jaxkv/attention.py",
     "  if not np.isfinite(value):",
     "  if False:",
     [T_RANGE + "::test_bad_scale_raises_naming_scale"]),
    ("kernel causal limit off by one", "pallas_kernels/dequant_attention.py",
     "  row_limit = length - num_queries + row_s",
     "  row_limit = length - num_queries + row_s + 1",
     [T_KERN + "::test_attention_matches_oracle"]),
    ("kernel softmax scale not applied", "pallas_kernels/dequant_attention.py",
     "    s = jnp.where(valid, k_scores(t0, kb) * k_mult[:, None], -jnp.inf)",
     "    s = jnp.where(valid, k_scores(t0, kb) * (k_mult[:, None] * 1.02), -jnp.inf)",
     [T_KERN + "::test_attention_matches_oracle"]),
    ("kernel V normalization not undone", "pallas_kernels/dequant_attention.py",
     "          part = part * v_mult[g]",
     "          part = part",
     [T_KERN + "::test_attention_matches_oracle"]),
    ("combine turns NaN into zeros", "pallas_kernels/dequant_attention.py",
     "  out_ref[...] = jnp.where((l == 0)[:, None], 0.0, acc / safe[:, None]).astype(out_ref.dtype)",
     "  out_ref[...] = jnp.where((l > 0)[:, None], acc / safe[:, None], 0.0).astype(out_ref.dtype)",
     [T_RANGE + "::test_kernel_alone_propagates_nan_never_zero"]),
    ("capacity bound off by one", "jaxkv/cache.py",
     "    fits = (self.lengths + num_new <= self.capacity) & (num_new >= 0) & (num_new <= t)",
     "    fits = (self.lengths + num_new < self.capacity) & (num_new >= 0) & (num_new <= t)",
     [T_CACHE + "::test_overflow_under_jit_exact_capacity_and_after"]),
    ("jitted prefill lengths unchecked", "jaxkv/cache.py",
     "    fits = (self.lengths + num_new <= self.capacity) & (num_new >= 0) & (num_new <= t)",
     "    fits = self.lengths + num_new <= self.capacity",
     [T_RANGE + "::test_jitted_prefill_lengths_out_of_range_flag_overflow"]),
    ("flush bound one group short", "jaxkv/cache.py",
     "  return (fmt.residual + num_new - 1) // fmt.token_group",
     "  return max(1, (fmt.residual + num_new - 1) // fmt.token_group - 1)",
     [T_CACHE + "::test_flush_heavy_incremental_equals_whole_history"]),
    # (Reading the residual at token L as well is an equivalent mutant: that
    # row is always a zero row, since L - packed_len(L) <= R - 1.)
    ("readback takes token packed_len from the packed region", "jaxkv/cache.py",
     "    in_packed = pos < packed",
     "    in_packed = pos <= packed",
     [T_CACHE + "::test_packed_len_literal_edges"]),
    ("eager non-finite check removed", "jaxkv/cache.py",
     "      if new_bad.any():",
     "      if False:",
     [T_RANGE + "::test_nonfinite_kv_same_on_both_paths_and_never_dropped"]),
    ("model cache forgets non-finite K/V", "jaxkv/model_cache.py",
     '    out["nonfinite"] = (self.nonfinite | nonfinite_rows(k_new, plan.num_new)',
     '    out["nonfinite"] = self.nonfinite | 0 * (nonfinite_rows(k_new, plan.num_new)',
     ["tests/test_model_cache.py::"
      "test_nonfinite_kv_inside_the_model_is_flagged_and_poisons_only_its_sequence"]),
    ("pack kernel skips the sequences that flush", "pallas_kernels/pack.py",
     "    @pl.when(active_ref[pl.program_id(0)] > 0)",
     "    @pl.when(active_ref[pl.program_id(0)] == 0)",
     ["tests/test_model_cache.py::test_pack_kernel_skipping_idle_sequences_changes_no_bit"]),
    ("autotune keeps the slowest", "jaxkv/tuning.py",
     "      if t < best_t:",
     "      if t > best_t or best is None:",
     ["tests/test_autotune.py::test_autotune_picks_the_fastest_by_a_fake_timer"]),
    ("greedy search walks uphill", "jaxkv/tuning.py",
     "      if timed[cand] < best_t:",
     "      if timed[cand] > best_t:",
     ["tests/test_autotune.py::test_greedy_search_walks_to_the_minimum_of_a_known_landscape"]),
    ("tuned table ignores the capacity", "pallas_kernels/tuned.py",
     "  if capacity % config.block_k:",
     "  if False:",
     ["tests/test_tuned_configs.py::test_lookup_hit_miss_and_misfit"]),
]


def _copy_repo(dst):
  def ignore(path, names):
    return [n for n in names if n in (".git", ".ci-venv", "__pycache__", ".hypothesis",
                                      ".pytest_cache", "bench")]
  shutil.copytree(ROOT, dst, ignore=ignore, dirs_exist_ok=True)


def _apply(dst, path, original, replacement):
  full = os.path.join(dst, path)
  with open(full) as f:
    lines = f.read().split("\n")
  hits = [i for i, line in enumerate(lines) if line == original]
  if len(hits) != 1:
    raise SystemExit(f"{path}: original line found {len(hits)} times: {original!r}")
  lines[hits[0]] = replacement
  with open(full, "w") as f:
    f.write("\n".join(lines))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", default="")
  ap.add_argument("--timeout", type=int, default=900)
  args = ap.parse_args()
  mutants = [m for m in MUTANTS if args.only in m[0]]
  env = dict(os.environ, HYPOTHESIS_PROFILE="ci", JAX_PLATFORMS="cpu")
  killed, rows = 0, []
  with tempfile.TemporaryDirectory(prefix="jaxkv-mut-") as tmp:
    base = os.path.join(tmp, "base")
    _copy_repo(base)
    for name, path, original, replacement, tests in mutants:
      work = os.path.join(tmp, "work")
      shutil.rmtree(work, ignore_errors=True)
      shutil.copytree(base, work)
      _apply(work, path, original, replacement)
      t0 = time.time()
      try:
        res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                              "-m", "not slow", *tests], cwd=work, env=env, capture_output=True,
                             text=True, timeout=args.timeout)
        rc = res.returncode
      except subprocess.TimeoutExpired:
        rc = "timeout"
      dead = rc == 1 or rc == "timeout"
      if rc not in (0, 1, "timeout"):
        tail = (res.stdout + res.stderr)[-800:]
        raise SystemExit(f"mutant {name!r}: pytest exited {rc} (not a test failure):\n{tail}")
      killed += dead
      rows.append((name, path, "killed" if dead else "SURVIVED", time.time() - t0))
      print(f"{'killed ' if dead else 'SURVIVED'} {time.time() - t0:6.1f}s  {path}: {name}",
            flush=True)
  print(f"\nkill rate: {killed}/{len(rows)} = {killed / max(1, len(rows)):.0%}")
  return 0 if killed == len(rows) else 1


if __name__ == "__main__":
  sys.exit(main())
