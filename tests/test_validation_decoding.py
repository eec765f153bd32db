"""Argument validation of the decoding entry points, `KVFormat` and the CLI (fast, CPU)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv import cli, decoding
from jaxkv.decoding import _stop_array, decode_steps, generate, sample_logits
from jaxkv.formats import KVFormat
from jaxkv.speculative import _accept_sample, speculative_generate, speculative_steps
from models import llama
from tests.model_fixtures import SMALL, full_f32_matmuls  # noqa: F401  (autouse)

QS_SMALL = dataclasses.replace(KVFormat.preset("quantspec"), token_group=16, residual=32)


@pytest.fixture(scope="module")
def model():  # one layer: the end-to-end checks below compile two programs
  return llama.random_model(dataclasses.replace(SMALL, num_layers=1), seed=3, dtype=jnp.float32)


def _prompts():
  tokens = np.random.default_rng(0).integers(3, SMALL.vocab_size, (2, 8))
  return tokens, np.asarray([8, 5])


# ------------------------------------------------------------- temperature
BAD_TEMPERATURE_VALUES = [0.0, -1.0, 1e-50, 1e-40, float("inf"), float("nan"), 1e39, 10**400]
BAD_TEMPERATURE_TYPES = ["1", None, True, jnp.ones(2), [1.0]]


@pytest.mark.parametrize("temperature", BAD_TEMPERATURE_VALUES, ids=repr)
def test_temperature_zero_subnormal_or_nonfinite_in_float32_rejected(model, temperature):
  tokens, lengths = _prompts()
  match = re.escape(f"temperature={temperature!r} must be a finite float32")
  with pytest.raises(ValueError, match=match):
    generate(model, tokens, lengths, max_new_tokens=2, sampler="sample", temperature=temperature)
  with pytest.raises(ValueError, match=match):
    decode_steps(model, jnp.asarray([5, 6]), model.init_cache("bf16", 2, 16), 2,
                 sampler="sample", temperature=temperature)
  with pytest.raises(ValueError, match=match):
    speculative_generate(model, tokens, lengths, kv_format=QS_SMALL, max_new_tokens=2,
                         draft_weights="full", sampler="sample", temperature=temperature)
  with pytest.raises(ValueError, match=match):
    speculative_steps(model, jnp.asarray([5, 6]), model.init_cache(QS_SMALL, 2, 16), 1,
                      gamma=2, draft_weights="full", sampler="sample", temperature=temperature)


@pytest.mark.parametrize("temperature", BAD_TEMPERATURE_TYPES, ids=repr)
def test_non_numeric_temperature_is_a_type_error(model, temperature):
  tokens, lengths = _prompts()
  with pytest.raises(TypeError, match=r"temperature=.* must be a real number"):
    generate(model, tokens, lengths, max_new_tokens=2, sampler="sample", temperature=temperature)
  with pytest.raises(TypeError, match=r"temperature=.* must be a real number"):
    speculative_generate(model, tokens, lengths, kv_format=QS_SMALL, max_new_tokens=2,
                         draft_weights="full", sampler="sample", temperature=temperature)


def test_tiny_temperature_samples_the_greedy_token(model):
  """A normal float32 temperature of 1e-30 made logits / T overflow to +-inf (NaN)."""
  logits = jax.random.normal(jax.random.key(0), (64, SMALL.vocab_size)) * 5
  want = np.argmax(np.asarray(logits), axis=-1)
  for extra in ({}, dict(top_k=3), dict(top_p=0.5)):
    got = sample_logits(logits, jax.random.key(1), temperature=1e-30, **extra)
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(extra))
  # End to end, with a 1-D jax array of stop tokens (it raised "iteration over a 0-d array");
  # greedy reference: the full forward (causal, so the right padding does not matter).
  tokens, lengths = _prompts()
  forward = jax.jit(lambda x: jnp.argmax(model(x), axis=-1))
  seq = np.zeros((2, 12), np.int32)
  for b in range(2):
    seq[b, :lengths[b]] = tokens[b, :lengths[b]]
  stop = int(forward(seq)[0, lengths[0] - 1])  # sequence 0 stops at its first token
  out, n = generate(model, tokens, lengths, kv_format="bf16", max_new_tokens=4,
                    cache_dtype=jnp.float32, pad_token_id=-1, sampler="sample",
                    temperature=np.float32(1e-30), rng=jax.random.key(2),
                    stop_tokens=jnp.asarray([stop, SMALL.vocab_size - 1]))
  out, n = np.asarray(out), np.asarray(n)
  assert n[0] == 1 and out[0, 0] == stop and np.all(out[0, 1:] == -1)
  seq[1, lengths[1]:lengths[1] + n[1]] = out[1, :n[1]]
  np.testing.assert_array_equal(out[1, :n[1]],
                                forward(seq)[1, lengths[1] - 1:lengths[1] - 1 + n[1]])

def test_speculative_acceptance_at_tiny_temperature_is_greedy():
  """Speculative sampling's target distribution stays one-hot (no NaN) at T = 1e-30."""
  logits_t = jax.random.normal(jax.random.key(0), (4, 3, 16)) * 5  # [B, g+1, V]
  y = jnp.argmax(logits_t, axis=-1).astype(jnp.int32)
  drafts = y[:, :2].at[1, 0].set((y[1, 0] + 1) % 16)  # sequence 1 is rejected at once
  q_probs = jax.nn.one_hot(drafts, 16)
  n, emitted = jax.jit(_accept_sample)(drafts, q_probs, logits_t, jnp.float32(1e-30),
                                       jax.random.key(3))
  np.testing.assert_array_equal(np.asarray(n), [2, 0, 2, 2])
  np.testing.assert_array_equal(np.asarray(emitted)[[0, 2, 3]], np.asarray(y)[[0, 2, 3]])
  assert int(emitted[1, 0]) == int(y[1, 0])


def test_cli_rejects_float32_zero_temperature(capsys):
  for value in ("1e-50", "inf", "nan"):
    rc = cli.main(["generate", "--model", "/nonexistent", "--prompt-ids", "5", "--sampler",
                   "sample", "--temperature", value])
    assert rc == 2
    assert f"--temperature={float(value)!r} must be a finite float32" in capsys.readouterr().err


# ------------------------------------------------------- num_steps, top_k
def test_decode_steps_error_names_num_steps(model):
  for bad in (0, -2, 1.5, True):
    with pytest.raises(ValueError, match=rf"num_steps={bad!r} must be an int >= 1"):
      decode_steps(model, jnp.asarray([5, 6]), model.init_cache("bf16", 2, 16), bad)


@pytest.mark.parametrize("top_k", [2.5, True, np.True_, 2.0, "2"], ids=repr)
def test_top_k_must_be_an_int(model, top_k):
  tokens, lengths = _prompts()
  match = re.escape(f"top_k={top_k!r} must be an int")
  with pytest.raises(ValueError, match=match):
    generate(model, tokens, lengths, max_new_tokens=2, sampler="sample", top_k=top_k)
  with pytest.raises(ValueError, match=match):
    sample_logits(jnp.zeros((1, 8)), jax.random.key(0), top_k=top_k)


def test_numpy_int_top_k_accepted():
  logits = jnp.log(jnp.asarray([[0.05, 0.5, 0.15, 0.3]] * 200))
  got = np.asarray(sample_logits(logits, jax.random.key(0), top_k=np.int64(2)))
  assert set(np.unique(got)) == {1, 3}


# ------------------------------------------------------------- stop_tokens
@pytest.mark.parametrize("stops, want", [
    (7, [[7], [7]]),
    (np.int64(7), [[7], [7]]),
    (np.array(7), [[7], [7]]),
    (jnp.asarray(7), [[7], [7]]),
    ([7, 9], [[7, 9], [7, 9]]),
    (np.array([7, 9]), [[7, 9], [7, 9]]),
    (jnp.asarray([7, 9], jnp.int32), [[7, 9], [7, 9]]),
    ([jnp.int32(7), np.uint8(9)], [[7, 9], [7, 9]]),
    ([], np.zeros((2, 0), np.int32)),
    ([[7], [9, 4]], [[7, -1], [9, 4]]),
    ([7, None], [[7], [-1]]),
    ([np.array([7, 8]), jnp.asarray([9])], [[7, 8], [9, -1]]),
    (np.array([[7], [9]], np.uint16), [[7], [9]]),
    (jnp.asarray([[7, -1], [9, 4]]), [[7, -1], [9, 4]]),
], ids=lambda x: repr(x) if not isinstance(x, list) or len(x) < 3 else None)
def test_stop_tokens_forms(stops, want):
  got = _stop_array(stops, 2)
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.asarray(want, np.int32).reshape(2, -1))


@pytest.mark.parametrize("stops, error, match", [
    (2.5, TypeError, r"stop_tokens=2\.5 must be"),
    (True, TypeError, r"stop_tokens=True must be"),
    ("5", TypeError, r"stop_tokens='5' must be"),
    (np.array([[5.7], [6.2]]), TypeError, r"stop_tokens.dtype=float64 must be an integer dtype"),
    (jnp.asarray([5.0, 6.0]), TypeError, r"stop_tokens.dtype=float32 must be an integer"),
    (np.array([True, False]), TypeError, r"stop_tokens.dtype=bool must be an integer"),
    ([[5.5], [6]], TypeError, r"stop_tokens\[0\]=\[5\.5\] must hold ints"),
    ([2**40], ValueError, r"stop_tokens must be int32 token ids; got \[1099511627776\]"),
    (np.array([2**40]), ValueError, r"stop_tokens must be int32 token ids"),
    ([[1], [2], [3]], ValueError, r"per-sequence stop_tokens need 2 entries, got 3"),
    (np.zeros((3, 1), np.int32), ValueError, r"stop_tokens.shape=\(3, 1\) must be \[2, K\]"),
    (np.zeros((2, 1, 1), np.int32), ValueError, r"stop_tokens.shape=\(2, 1, 1\)"),
], ids=repr)
def test_stop_tokens_errors(stops, error, match):
  with pytest.raises(error, match=match):
    _stop_array(stops, 2)


def test_stop_tokens_validated_before_tracing(model):
  tokens, lengths = _prompts()
  with pytest.raises(TypeError, match="stop_tokens.dtype=float64"):
    generate(model, tokens, lengths, max_new_tokens=2, stop_tokens=np.array([[5.7], [6.2]]))
  with pytest.raises(ValueError, match="stop_tokens must be int32"):
    speculative_generate(model, tokens, lengths, kv_format=QS_SMALL, max_new_tokens=2,
                         draft_weights="full", stop_tokens=[2**40])


# ------------------------------------------------------------------ formats
@pytest.mark.parametrize("kwargs, match", [
    (dict(scale_dtype="fp16"), r"scale_dtype='fp16' must be one of"),
    (dict(scale_dtype="int8"), r"scale_dtype='int8' must be one of"),
    (dict(token_group=True, residual=2), r"token_group=True must be"),
    (dict(channel_group=True), r"channel_group=True must be"),
    (dict(residual=True), r"residual=True must be"),
    (dict(residual=np.True_), r"residual=(np\.)?True_? must be"),
], ids=repr)
def test_kvformat_rejects_bad_fields(kwargs, match):
  with pytest.raises(ValueError, match=match):
    KVFormat(k_bits=4, v_bits=4, **kwargs)


def test_bytes_per_token_rejects_nonpositive_sizes():
  fmt = KVFormat.preset("kivi4")
  for bad in (-1, 0, True, 2.0):
    with pytest.raises(ValueError, match=re.escape(f"kv_heads={bad!r} must be a positive int")):
      fmt.bytes_per_token(bad, 128)
  for bad in (0, -2, float("nan"), float("inf"), True, "2"):
    with pytest.raises(ValueError, match=re.escape(f"dtype_bytes={bad!r} must be a positive")):
      KVFormat.preset("bf16").bytes_per_token(8, 128, dtype_bytes=bad)
  assert fmt.bytes_per_token(np.int64(2), 128) == 2 * fmt.bytes_per_token(1, 128)
  assert KVFormat.preset("bf16").bytes_per_token(1, 128, dtype_bytes=4) == 2 * 128 * 4


# ---------------------------------------------------------------------- CLI
@pytest.mark.parametrize("flag, value", [("--top-k", "3"), ("--top-p", "0.9")])
def test_cli_rejects_top_k_top_p_with_greedy(capsys, flag, value):
  for sampler in ([], ["--sampler", "greedy"]):
    with pytest.raises(SystemExit) as e:
      cli.main(["generate", "--model", "/nonexistent", "--prompt-ids", "5", *sampler, flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag} {float(value) if flag == '--top-p' else value} needs --sampler sample" \
        in err



@pytest.mark.parametrize("argv, match", [
    (["--temperature", "0.7"], "--temperature 0.7 needs --sampler sample"),
    (["--prompt", "hi"], "give --prompt or --prompt-ids, not both"),
    (["--system", "be brief"], "--system needs the chat template"),
    (["--draft-weights", "int8"], "--draft-weights int8 needs --speculative GAMMA"),
])
def test_cli_refuses_flags_that_would_be_ignored(capsys, argv, match):
  with pytest.raises(SystemExit) as e:
    cli.main(["generate", "--model", "/nonexistent", "--prompt-ids", "5", *argv])
  assert e.value.code == 2
  assert match in capsys.readouterr().err


# ------------------------------------------------- sampling arguments in use
def test_sample_logits_checks_concrete_arguments():
  """A negative temperature inverted the distribution and top_p <= 0 acted as greedy."""
  logits = jnp.asarray([[0.0, 1.0, 5.0]])
  key = jax.random.key(0)
  with pytest.raises(ValueError, match=re.escape("temperature=-1.0 must be a finite float32")):
    sample_logits(logits, key, temperature=-1.0)
  for top_p in (-0.5, 0.0, 1.5):
    with pytest.raises(ValueError, match=re.escape(f"top_p={top_p!r} must be in (0, 1]")):
      sample_logits(logits, key, top_p=top_p)
  # Traced values are the caller's to check (the programs pass checked ones).
  got = jax.jit(lambda t, p: sample_logits(logits, key, temperature=t, top_p=p))(
      jnp.float32(1e-30), jnp.float32(0.5))
  assert int(got[0]) == 2


def test_greedy_or_callable_sampler_refuses_sampling_arguments(model):
  tokens, lengths = _prompts()
  kw = dict(kv_format="bf16", max_new_tokens=2)
  for extra, shown in ((dict(top_p=5.0), "top_p=5.0"), (dict(temperature=-3.0), "temperature=-3.0"),
                       (dict(top_k=3), "top_k=3")):
    with pytest.raises(ValueError, match=re.escape(f"{shown} would be ignored by greedy")):
      generate(model, tokens, lengths, **kw, **extra)
    with pytest.raises(ValueError, match=re.escape(f"{shown} would be ignored by greedy")):
      decode_steps(model, jnp.asarray([5, 6]), model.init_cache("bf16", 2, 16), 2, **extra)
  with pytest.raises(ValueError, match="top_k=3, top_p=0.1 would be ignored by a callable"):
    generate(model, tokens, lengths, **kw, sampler=lambda logits, key: jnp.argmax(logits, -1),
             top_k=3, top_p=0.1)
  # The defaults (and an explicit 1.0) are fine with greedy.
  generate(model, tokens, lengths, **kw, temperature=1.0)


def test_decode_step_needs_one_token_per_sequence(model):
  from jaxkv.decoding import decode_step  # pylint: disable=import-outside-toplevel
  cache = model.init_cache("bf16", 2, 16)
  with pytest.raises(ValueError, match=r"tokens.shape=\(2, 1\) must be \[B\]"):
    jax.eval_shape(lambda t, c: decode_step(model, t, c), jnp.zeros((2, 1), jnp.int32), cache)
  with pytest.raises(ValueError, match=r"tokens.shape=\(2,\) must be \[B, T\]"):
    jax.eval_shape(lambda t, c: model.decode(t, c), jnp.zeros((2,), jnp.int32), cache)


def test_speculative_generate_takes_a_split_model_and_checks_group_size(model):
  from jaxkv.decoding import SplitModel  # pylint: disable=import-outside-toplevel
  tokens, lengths = _prompts()
  kw = dict(kv_format=QS_SMALL, max_new_tokens=3, gamma=2, draft_weights="full")
  want, want_n, _ = speculative_generate(model, tokens, lengths, **kw)
  got, got_n, _ = speculative_generate(SplitModel(model), tokens, lengths, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_n), np.asarray(want_n))
  for bad in (-3, 0, 2.5, True):
    with pytest.raises(ValueError, match=re.escape(f"group_size={bad!r} must be an int >= 1")):
      speculative_generate(model, tokens, lengths, **dict(kw, group_size=bad))


def test_head_dim_must_not_be_a_bool():
  # True == 1: a bf16 cache of head_dim 1 was built before.
  with pytest.raises(ValueError, match=r"head_dim=True must be a positive int"):
    jaxkv.KVCache.init("bf16", 1, 1, True, 16)
  with pytest.raises(ValueError, match=r"head_dim=True must be a positive int"):
    KVFormat.preset("bf16").bytes_per_token(1, True)


def test_empty_batch_is_refused_naming_prompt_tokens(model):
  # Before: numpy's "zero-size array to reduction operation minimum" from the lengths check.
  tokens, lengths = _prompts()
  with pytest.raises(ValueError, match=r"prompt_tokens.shape=\(0, 8\): need at least one"):
    generate(model, tokens[:0], lengths[:0], max_new_tokens=2)
  with pytest.raises(ValueError, match=r"prompt_tokens.shape=\(0, 8\): need at least one"):
    speculative_generate(model, tokens[:0], lengths[:0], kv_format=QS_SMALL, max_new_tokens=2)


BAD_RNGS = [0, "key", np.zeros(2, np.int32), jax.random.split(jax.random.key(0), 2)]


@pytest.mark.parametrize("rng", BAD_RNGS, ids=lambda r: f"{type(r).__name__}{np.shape(r)}")
def test_rng_must_be_one_prng_key(model, rng):
  # Before: JAX's "invalid PRNG key data" / "split accepts a single key" from inside the
  # program, naming no argument. Checked before anything is built or traced.
  tokens, lengths = _prompts()
  match = r"rng must be one PRNG key"
  with pytest.raises(TypeError, match=match):
    generate(model, tokens, lengths, max_new_tokens=2, sampler="sample", rng=rng)
  with pytest.raises(TypeError, match=match):
    decode_steps(model, jnp.asarray([5, 6]), model.init_cache("bf16", 2, 16), 2, rng=rng)
  with pytest.raises(TypeError, match=match):
    speculative_generate(model, tokens, lengths, kv_format=QS_SMALL, max_new_tokens=2, rng=rng,
                         draft_weights="full")
  with pytest.raises(TypeError, match=match):
    speculative_steps(model, jnp.asarray([5, 6]), model.init_cache(QS_SMALL, 2, 16), 1,
                      gamma=2, rng=rng, draft_weights="full")


def test_raw_uint32_key_still_accepted(model):
  tokens, lengths = _prompts()
  kw = dict(max_new_tokens=2, sampler="sample")
  got, _ = generate(model, tokens, lengths, **kw, rng=jax.random.PRNGKey(1))
  want, _ = generate(model, tokens, lengths, **kw,
                     rng=jax.random.wrap_key_data(jax.random.PRNGKey(1)))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_generate_takes_a_sequence_of_implementations_and_checks_progress(model):
  # Before: a list (what decode_attention takes) failed as "Non-hashable static arguments";
  # progress=5 failed inside jax.debug.callback; decode_steps(cache=None) was an
  # AttributeError on .batch.
  tokens, lengths = _prompts()
  kw = dict(kv_format="kivi4", max_new_tokens=3)
  want, want_n = generate(model, tokens, lengths, **kw, implementation="reference")
  got, got_n = generate(model, tokens, lengths, **kw, implementation=["reference"])
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_n), np.asarray(want_n))
  with pytest.raises(TypeError, match=r"implementation=\[3\] must hold only str names"):
    generate(model, tokens, lengths, **kw, implementation=[3])
  with pytest.raises(TypeError, match=r"progress=5 must be a callable or None"):
    generate(model, tokens, lengths, **kw, progress=5)
  for bad in (None, (1, 2)):
    with pytest.raises(TypeError, match=r"cache must be the model's cache"):
      decode_steps(model, jnp.asarray([5, 6]), bad, 2)


def test_speculative_group_size_is_refused_where_the_draft_weights_ignore_it(model):
  # Before: group_size=64 with draft_weights="full" or a dict of quantized weights was
  # silently ignored (the dict keeps its own groups).
  tokens, lengths = _prompts()
  kw = dict(kv_format=QS_SMALL, max_new_tokens=2, gamma=2)
  weights = model.quantize_weights(group_size=32)
  for draft, shown in (("full", "'full'"), (weights, "a dict")):
    with pytest.raises(ValueError, match=re.escape(f"group_size=64 would be ignored with "
                                                   f"draft_weights={shown}")):
      speculative_generate(model, tokens, lengths, **kw, draft_weights=draft, group_size=64)
    with pytest.raises(ValueError, match=r"group_size=64 would be ignored"):
      speculative_steps(model, jnp.asarray([5, 6]), model.init_cache(QS_SMALL, 2, 16), 1,
                        gamma=2, draft_weights=draft, group_size=64)
  with pytest.raises(TypeError, match=r"draft_weights must be a string or a dict, got int"):
    speculative_generate(model, tokens, lengths, **kw, draft_weights=5, group_size=64)
  # where it applies, and at its default with a dict, it is taken
  speculative_generate(model, tokens, lengths, **kw, draft_weights="int4", group_size=32)
  speculative_generate(model, tokens, lengths, **kw, draft_weights=weights)


def _run_env(code: str, **env_vars) -> subprocess.CompletedProcess:
  """``python -c code`` on the CPU with the merger variables unset but ``env_vars``."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  for name in ("JAXKV_XLA_DOT_MERGER_MB", "JAXKV_XLA_DOT_MERGER_MAX_ROWS"):
    env.pop(name, None)
  env.update(env_vars)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                        text=True, check=False)


@pytest.mark.parametrize("value,expect", [("", "1024 0"), ("0", "None None"), ("64", "64 0"),
                                          ("2147483647", "2147483647 0"), ("-1", "error"),
                                          ("2147483648", "error"), ("lots", "error")],
                         ids=["unset", "zero", "64", "int32-max", "negative", "past-int32",
                              "not-a-number"])
def test_dot_merger_threshold_from_the_environment(value, expect):
  """``JAXKV_XLA_DOT_MERGER_MB`` (read at import): unset -> 1024 MiB up to the
  row limit and 0 (nothing merged) past it; 0 -> XLA's own default at every
  row count (the option left out); a value XLA's int32 field cannot hold or not
  a number -> a ValueError naming the variable."""
  code = ("import jaxkv; key = 'xla_gpu_dot_merger_threshold_mb'; "
          "print(*(jaxkv.decode_compiler_options(r).get(key) for r in (1, 200)))")
  run = _run_env(code, JAXKV_XLA_DOT_MERGER_MB=value)
  if expect == "error":
    assert run.returncode != 0 and "JAXKV_XLA_DOT_MERGER_MB" in run.stderr, run.stderr[-500:]
  else:
    assert run.returncode == 0, run.stderr[-500:]
    assert " ".join(run.stdout.split()[-2:]) == expect


@pytest.mark.parametrize("value,expect", [("", "64"), ("8", "8"), ("0", "0"),
                                          ("-3", "error"), ("8.5", "error")],
                         ids=["unset", "8", "zero", "negative", "not-whole"])
def test_dot_merger_row_limit_from_the_environment(value, expect):
  """``JAXKV_XLA_DOT_MERGER_MAX_ROWS`` (read at import): the decode programs'
  options carry the raised merger threshold at ``rows <= limit`` and a threshold
  of 0 (no merged dots) past it (unset -> 64); a negative or fractional value ->
  a ValueError naming the variable."""
  code = ("import jaxkv, jaxkv.decoding as d; key = 'xla_gpu_dot_merger_threshold_mb'; "
          "opts = [jaxkv.decode_compiler_options(r)[key] for r in range(1, 200)]; "
          "assert set(opts) <= {0, d.DOT_MERGER_MB}, opts; "
          "print(d.DOT_MERGER_MAX_ROWS, [r for r, v in enumerate(opts, 1) if v][-1:])")
  run = _run_env(code, JAXKV_XLA_DOT_MERGER_MAX_ROWS=value)
  if expect == "error":
    assert run.returncode != 0 and "JAXKV_XLA_DOT_MERGER_MAX_ROWS" in run.stderr, \
        run.stderr[-500:]
  else:
    assert run.returncode == 0, run.stderr[-500:]
    limit, last = run.stdout.strip().split(" ", 1)
    assert limit == expect
    assert last == ("[]" if expect == "0" else f"[{expect}]")


def _spy_programs(monkeypatch, module, name: str, ran: list):
  """Replaces ``module.name`` (a `decoding.RowsProgram`) by one whose variants
  append ``"merged"`` / ``"plain"`` to ``ran`` as they are called."""
  program = getattr(module, name)

  def spy(label, fn):
    def call(*args, **kwargs):
      ran.append(label)
      return fn(*args, **kwargs)
    return call

  monkeypatch.setattr(module, name, decoding.RowsProgram(
      merged=spy("merged", program.merged), plain=spy("plain", program.plain)))
  return program


def test_decode_programs_pick_the_merger_by_rows(model, monkeypatch):
  """Every decode program runs its merged variant at ``rows <= limit`` token rows
  per step and the plain one past it: `decode_steps` and `generate` by batch,
  `speculative_steps` by batch x (gamma + 1) (the verify pass's rows),
  `jaxkv.fidelity.forced_decode` by batch; `program_rows` splits the batch
  over a mesh's ``data`` axis; `jaxkv.decode_compiler_options` rejects a row
  count that is not a positive int."""
  from jaxkv import fidelity, speculative  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(decoding, "DOT_MERGER_MAX_ROWS", 2)
  merges = decoding.DOT_MERGER_MB > 0
  program = decoding._decode_steps_program  # pylint: disable=protected-access
  assert program.at(1) is (program.merged if merges else program.plain)
  assert program.at(2) is program.at(1)
  assert program.at(3) is program.plain
  assert program.merged is not program.plain
  want = ["merged", "plain"] if merges else ["plain", "plain"]
  ran = []
  _spy_programs(monkeypatch, decoding, "_decode_steps_program", ran)
  for batch in (2, 3):
    decode_steps(model, jnp.arange(5, 5 + batch), model.init_cache("bf16", batch, 16), 1)
  assert ran == want
  ran.clear()
  _spy_programs(monkeypatch, decoding, "_generate_program", ran)
  for batch in (2, 3):
    generate(model, np.full((batch, 3), 5), [3] * batch, kv_format="bf16", max_new_tokens=2)
  assert ran == want
  ran.clear()
  _spy_programs(monkeypatch, speculative, "_speculative_steps_program", ran)
  for gamma in (1, 2):  # one sequence: 2 and 3 rows
    speculative_steps(model, jnp.asarray([5]), model.init_cache(QS_SMALL, 1, 16), 1,
                      gamma=gamma, draft_weights="full")
  assert ran == want
  ran.clear()
  _spy_programs(monkeypatch, fidelity, "_forced_program", ran)
  for batch in (2, 3):
    fidelity.forced_decode(model, np.full((batch, 3), 5), [3] * batch, np.full((batch, 2), 6),
                           [True] * batch, kv_format="bf16")
  assert ran == want
  two_way = types.SimpleNamespace(shape={"data": 2, "model": 4})  # what it reads of a Mesh
  assert decoding.program_rows(5, two_way, 3) == 9  # 3 of the 5 sequences on a device
  assert decoding.program_rows(128, two_way) == 64
  assert decoding.program_rows(5, None, 2) == 10
  for bad in (0, -1, 2.0, "4"):
    with pytest.raises((TypeError, ValueError), match="rows"):
      jaxkv.decode_compiler_options(bad)
