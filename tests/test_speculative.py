"""Self-speculative decoding (QuantSpec, issue 14): `jaxkv.speculative_generate`,
`jaxkv.speculative_steps`.

Oracles: plain greedy `jaxkv.generate` (for `speculative_steps`: plain greedy
`jaxkv.decode_steps` on an identically prefilled cache) with the same
hierarchical format and full weights (greedy must match it token for token),
and the target model's
exact next-token probabilities (speculative sampling must reproduce them;
chi-square test with a stated power).
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats as sps

import jaxkv
from jaxkv import speculative as spec_mod
from jaxkv.speculative import speculative_generate, speculative_steps
from models import draft_weights as dw
from models import llama
from tests.model_fixtures import SMALL, full_f32_matmuls  # noqa: F401  (autouse fixture)

# The preset's hierarchy with small groups, so short sequences quantize.
QS_SMALL = dataclasses.replace(jaxkv.KVFormat.preset("quantspec"), token_group=16, residual=32)


@pytest.fixture(scope="module")
def model():
  return llama.random_model(SMALL, seed=3, dtype=jnp.float32)


def test_greedy_matches_plain_greedy_ragged_batch(model):
  rng = np.random.default_rng(7)
  prompts = rng.integers(3, SMALL.vocab_size, (3, 40))
  lengths = np.asarray([40, 9, 23])
  n = 48  # the sequences pass 2G = 32 tokens: groups are flushed while speculating
  want, want_len, want_cache = jaxkv.generate(model, prompts, lengths, kv_format=QS_SMALL,
                                              max_new_tokens=n, return_cache=True)
  for gamma in (3,):  # the prompt prefilled in chunks of 16 (`prefill_chunk`)
    got, got_len, st, cache = speculative_generate(
        model, prompts, lengths, kv_format=QS_SMALL, max_new_tokens=n, gamma=gamma,
        group_size=32, return_cache=True, prefill_chunk=16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{gamma=}")
    np.testing.assert_array_equal(np.asarray(got_len), np.asarray(want_len))
    # Statistics are consistent: every round emits accepted + 1 tokens (the last may be cut).
    assert 0 < st["acceptance_rate"] <= 1
    assert 1 <= st["tokens_per_verification"] <= gamma + 1
    assert np.all(st["accepted"] <= gamma * st["verifications"])
    assert np.all(n - 1 <= st["accepted"] + st["verifications"])
    # The cache holds the same history as plain decoding (the residual rule holds).
    np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(want_cache.lengths))
    np.testing.assert_array_equal(np.asarray(cache.packed_lens),
                                  QS_SMALL.packed_len(np.asarray(cache.lengths)))
    # K/V computed block-wise differ from one-token decoding by float rounding, which
    # can move a code across a rounding boundary: one target step (S_U / 16) at most.
    for a, w, side in zip(cache.dequantize(), want_cache.dequantize(), (cache.k, cache.v)):
      step = float(np.nanmax(np.asarray(side.scale, np.float32))) / 16
      np.testing.assert_allclose(np.asarray(a), np.asarray(w), rtol=0, atol=step + 1e-5)


def _prefilled(model, prompts, lengths, capacity):
  """A QS_SMALL cache holding the prompts, and the greedy first token ``[B]``."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def prefill(state, tokens, lengths, cache):
    logits, cache = nnx.merge(graphdef, state).prefill(tokens, lengths, cache)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

  cache = model.init_cache(QS_SMALL, prompts.shape[0], capacity)
  return prefill(state, jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32), cache)


def test_speculative_steps_matches_decode_steps_ragged_batch(model):
  rng = np.random.default_rng(9)
  prompts = rng.integers(3, SMALL.vocab_size, (2, 40))
  lengths = np.asarray([40, 9])
  gamma, rounds, capacity = 3, 3, 80
  token, cache = _prefilled(model, prompts, lengths, capacity)
  want_token, want_cache = _prefilled(model, prompts, lengths, capacity)
  steps = 2 * rounds * (gamma + 1)
  want, _, want_cache = jaxkv.decode_steps(model, want_token, want_cache, steps)
  want = np.asarray(want)
  weights = model.quantize_weights(bits=4, group_size=32)
  # Two calls of `rounds` rounds (one compiled program); the second starts from the
  # first's last emitted token.
  got, got_counts = [], []
  program = spec_mod._speculative_steps_program  # pylint: disable=protected-access
  compiled = program.compiled()
  for _ in range(2):
    tokens, counts, st, cache = speculative_steps(model, token, cache, rounds, gamma=gamma,
                                                  draft_weights=weights)
    tokens, counts = np.asarray(tokens), np.asarray(counts)
    assert tokens.shape == (2, rounds * (gamma + 1))
    assert np.all((rounds <= counts) & (counts <= rounds * (gamma + 1)))
    np.testing.assert_array_equal(st["verifications"], [rounds, rounds])
    assert st["tokens_per_verification"] == pytest.approx(counts.sum() / (2 * rounds))
    for b in range(2):  # padding after the emitted tokens
      assert np.all(tokens[b, counts[b]:] == 0)
    got.append(tokens)
    got_counts.append(counts)
    token = jnp.asarray(tokens[np.arange(2), counts - 1])
  # One compiled program for both calls.
  assert program.compiled() == compiled + 1
  for b in range(2):
    seq = np.concatenate([got[0][b, :got_counts[0][b]], got[1][b, :got_counts[1][b]]])
    np.testing.assert_array_equal(seq, want[b, :len(seq)], err_msg=f"sequence {b}")
  # The cache holds the prompt, the first token and every emitted token but the last.
  np.testing.assert_array_equal(np.asarray(cache.lengths),
                                lengths + got_counts[0] + got_counts[1])
  np.testing.assert_array_equal(np.asarray(cache.packed_lens),
                                QS_SMALL.packed_len(np.asarray(cache.lengths)))
  assert not np.any(np.asarray(cache.overflow))


def test_speculative_steps_argument_errors(model):
  token = jnp.asarray([5, 6])
  cache = model.init_cache(QS_SMALL, 2, 16)
  with pytest.raises(ValueError, match="must be hierarchical"):
    speculative_steps(model, token, model.init_cache("kivi4", 2, 16), 1, gamma=2)
  with pytest.raises(ValueError, match="num_rounds=0"):
    speculative_steps(model, token, cache, 0)
  with pytest.raises(ValueError, match="gamma=17"):
    speculative_steps(model, token, cache, 1, gamma=17)
  with pytest.raises(ValueError, match=r"token.shape=\(3,\)"):
    speculative_steps(model, jnp.asarray([5, 6, 7]), cache, 1)
  with pytest.raises(ValueError, match="must lie in"):
    speculative_steps(model, jnp.asarray([5, SMALL.vocab_size]), cache, 1)
  # 5 rounds of gamma 3 may commit 20 tokens: more than an empty cache of 16 holds.
  with pytest.raises(ValueError, match="needs capacity >= 20"):
    speculative_steps(model, token, cache, 5, gamma=3)
  # 3 rounds (12 tokens) fit an empty cache, not one already holding 10 tokens.
  held = dataclasses.replace(cache, lengths=jnp.asarray([10, 2], jnp.int32))
  with pytest.raises(ValueError, match="needs capacity >= 22"):
    speculative_steps(model, token, held, 3, gamma=3)
  with pytest.raises(TypeError, match="jaxkv.ModelCache"):
    speculative_steps(model, token, cache.layer(0), 1)
  other = llama.random_model(dataclasses.replace(SMALL, num_layers=3), seed=0)
  with pytest.raises(ValueError, match=r"cache \(num_layers=3.*does not fit the model"):
    speculative_steps(model, token, other.init_cache(QS_SMALL, 2, 16), 1)


@pytest.mark.slow
def test_greedy_with_stop_tokens_and_full_weight_draft(model):
  rng = np.random.default_rng(8)
  prompts = rng.integers(3, SMALL.vocab_size, (2, 12))
  lengths = np.asarray([12, 5])
  plain, _ = jaxkv.generate(model, prompts, lengths, kv_format=QS_SMALL, max_new_tokens=24)
  # A stop token that the plain run emits mid-way in sequence 0.
  stop = int(np.asarray(plain)[0, 6])
  want, want_len = jaxkv.generate(model, prompts, lengths, kv_format=QS_SMALL,
                                  max_new_tokens=24, stop_tokens=[stop])
  got, got_len, st = speculative_generate(model, prompts, lengths, kv_format=QS_SMALL,
                                          max_new_tokens=24, gamma=3, draft_weights="full",
                                          stop_tokens=[stop])
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_len), np.asarray(want_len))
  assert int(np.asarray(got_len)[0]) <= 7
  # Full weights: the draft differs from the target only through the 4-bit cache view.
  assert st["acceptance_rate"] > 0.5


# A vocabulary of 6 tokens: every joint of two tokens has 36 cells.
TINY_VOCAB = dataclasses.replace(SMALL, vocab_size=6, eos_token_ids=())


def test_speculative_sampling_matches_target_distribution():
  """Chi-square: (y1, y2) and (y1, y3) of 3000 sampled rows vs the target's exact joint.

  The prompt and outputs stay inside the full-precision residual block, so
  the target is the plain forward pass and its probabilities are exact. The
  draft (4-bit weights at group 8) differs from it; the test's power against
  "output distributed as the draft" is computed from the noncentral
  chi-square and required to exceed 0.999 at alpha = 1e-3.
  """
  model = llama.random_model(TINY_VOCAB, seed=5, dtype=jnp.float32)
  weights = dw.quantize_weights(model, bits=4, group_size=8)
  draft = dw.draft_model(model, weights)
  n_rows, temp = 3000, 1.0
  prompt = np.asarray([[1, 4, 0, 3, 5]])
  prompts = np.repeat(prompt, n_rows, axis=0)
  lengths = np.full((n_rows,), prompt.shape[1])
  tokens, _, st = speculative_generate(model, prompts, lengths, kv_format=QS_SMALL,
                                       max_new_tokens=3, gamma=2, sampler="sample",
                                       temperature=temp, draft_weights=weights,
                                       rng=jax.random.key(1234))
  tokens = np.asarray(tokens)
  assert 0 < st["acceptance_rate"] < 1  # both branches (accept, resample) were taken

  def joint(m):  # exact p(y1, y2, y3) of model m, [6, 6, 6]
    v = TINY_VOCAB.vocab_size
    seqs = np.asarray([[*prompt[0], a, b] for a in range(v) for b in range(v)])
    logits = np.asarray(m(jnp.asarray(seqs)), np.float64) / temp
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p = p.reshape(v, v, *p.shape[1:])
    p1 = p[0, 0, prompt.shape[1] - 1]                     # [v]
    p2 = p[:, 0, prompt.shape[1]]                         # [a, v]
    p3 = p[:, :, prompt.shape[1] + 1]                     # [a, b, v]
    return p1[:, None, None] * p2[:, :, None] * p3

  p_target, p_draft = joint(model), joint(draft)
  alpha = 1e-3
  for name, axis in (("(y1, y2)", 2), ("(y1, y3)", 1)):
    exp_t = p_target.sum(axis).ravel() * n_rows
    exp_d = p_draft.sum(axis).ravel() * n_rows
    cols = (0, 1) if axis == 2 else (0, 2)        # output columns of y1 and y2 / y3
    idx = tokens[:, cols[0]] * 6 + tokens[:, cols[1]]
    obs = np.bincount(idx, minlength=36).astype(np.float64)
    keep = exp_t >= 5                                      # pool the sparse cells
    pool = (lambda x: np.append(x[keep], x[~keep].sum())) if np.any(~keep) else (
        lambda x: x)
    obs_k, exp_k, alt_k = pool(obs), pool(exp_t), pool(exp_d)
    dof = len(obs_k) - 1
    stat = float(np.sum((obs_k - exp_k) ** 2 / exp_k))
    crit = sps.chi2.ppf(1 - alpha, dof)
    power = sps.ncx2.sf(crit, dof, float(np.sum((alt_k - exp_k) ** 2 / exp_k)))
    assert power > 0.999, f"{name}: the test cannot tell the draft from the target ({power=})"
    assert stat < crit, f"{name}: chi2={stat:.1f} >= {crit:.1f} (dof={dof})"


def test_argument_errors(model):
  p, n = np.ones((1, 4), np.int64), np.asarray([4])
  with pytest.raises(ValueError, match="gamma=0"):
    speculative_generate(model, p, n, max_new_tokens=2, gamma=0)
  with pytest.raises(ValueError, match="must be hierarchical"):
    speculative_generate(model, p, n, max_new_tokens=2, kv_format="kivi4")
  with pytest.raises(ValueError, match="draft_weights='int3'"):
    speculative_generate(model, p, n, max_new_tokens=2, draft_weights="int3")
  with pytest.raises(ValueError, match="sampler='top_k'"):
    speculative_generate(model, p, n, max_new_tokens=2, sampler="top_k")
  with pytest.raises(ValueError, match=r"prompt_lengths=\[5\]"):
    speculative_generate(model, p, np.asarray([5]), max_new_tokens=2)
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    speculative_generate(model, p, n, max_new_tokens=0)
  with pytest.raises(ValueError, match="prefill_chunk=0 must be an int >= 1"):
    speculative_generate(model, p, n, max_new_tokens=2, prefill_chunk=0)
  with pytest.raises(ValueError, match="bits=3"):
    dw.quantize_weights(model, bits=3)
  for bits in (4.0, True):  # 4.0 == 4 passed the membership test before
    with pytest.raises(ValueError, match=rf"bits={bits!r} must be one of \[4, 8\]"):
      dw.quantize_weights(model, bits=bits)


def test_draft_weights_against_numpy_model(model):
  w = model.layers[1].mlp.down_proj.kernel[...]                         # [128, 64]
  rtn = dw.quantize_kernel(w, bits=4, group_size=32, fit="rtn")
  assert rtn.codes.dtype == jnp.uint8 and rtn.codes.shape == (64, 64) and rtn.shape == (128, 64)
  assert rtn.group == 32 and rtn.bits == 4
  wn = np.asarray(w, np.float64).reshape(4, 32, 64)
  lo, hi = wn.min(1, keepdims=True), wn.max(1, keepdims=True)
  scale = (hi - lo) / 15
  err = np.abs(np.asarray(rtn.dequantize(), np.float64).reshape(4, 32, 64) - wn)
  assert np.all(err <= scale / 2 * (1 + 1e-5) + 1e-7)
  np.testing.assert_allclose(np.asarray(rtn.scale)[:, None], scale, rtol=1e-6)
  q = dw.quantize_kernel(w, bits=4, group_size=32)            # the default fit: least squares
  sq = np.square(np.asarray(q.dequantize(), np.float64).reshape(4, 32, 64) - wn).sum(1)
  assert np.all(sq <= np.square(err).sum(1) * (1 + 1e-5))     # never worse than rtn per group
  weights = dw.quantize_weights(model, group_size=32)
  assert len(weights) == 4 * SMALL.num_layers + 1  # qkv, o, gate_up, down + lm_head
  # Half a byte per weight plus a float32 (scale, zero) per group and column.
  assert dw.nbytes(weights) == sum(x.shape[0] * x.shape[1] // 2 + 8 * x.scale.size
                                   for x in weights.values())
  d = dw.draft_model(model, weights)
  # The model itself is unchanged; the draft's layers read the 4-bit copies.
  layer = d.layers[1].mlp.down_proj
  assert isinstance(layer, dw.QuantizedLinear)
  np.testing.assert_array_equal(np.asarray(layer.weight.dequantize()), np.asarray(q.dequantize()))
  x = jax.random.normal(jax.random.key(3), (2, 3, 128), jnp.float32)
  np.testing.assert_allclose(np.asarray(layer(x), np.float64),
                             np.asarray(x, np.float64) @ np.asarray(q.dequantize(), np.float64),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(model.layers[1].mlp.down_proj.kernel[...]),
                                np.asarray(w))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_deferred_norms_against_numpy(dtype):
  """`draft_model(defer_norms=True)`: each norm whose consumers are all quantized
  returns ``(x w, rsqrt(mean(x**2) + eps))`` and the products scale their output rows:
  equal to float64 numpy's ``rmsnorm(x) @ W`` within the dtype's rounding, and the
  draft's logits within rounding of the draft with the target's norms. Norms with a
  full-precision consumer (some weights not quantized, an LM head left in full
  precision) stay plain. (On a CPU the products take the dequantize + dot route,
  the rows scaled before it; on a Hopper GPU the kernel's output rows are scaled.)"""
  m = llama.random_model(SMALL, seed=3, dtype=dtype)
  norms = [m.norm] + [n for layer in m.layers
                      for n in (layer.input_layernorm, layer.post_attention_layernorm)]
  for i, n in enumerate(norms):  # not ones: the norms' weights must reach the products
    n.weight[...] = jax.random.uniform(jax.random.key(40 + i), n.weight.shape,
                                       jnp.float32, 0.5, 1.5).astype(dtype)
  weights = dw.quantize_weights(m, group_size=32)
  d = dw.draft_model(m, weights)
  plain = dw.draft_model(m, weights, defer_norms=False)
  norm, qkv = d.layers[0].input_layernorm, d.layers[0].self_attn.qkv_proj
  assert isinstance(norm, dw.DeferredRMSNorm) and isinstance(d.norm, dw.DeferredRMSNorm)
  assert isinstance(d.layers[1].post_attention_layernorm, dw.DeferredRMSNorm)
  assert not isinstance(plain.layers[0].input_layernorm, dw.DeferredRMSNorm)
  x = (jax.random.normal(jax.random.key(7), (2, 3, SMALL.hidden_size), jnp.float32) * 3
       + 1).astype(dtype)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2

  def check(norm, product, x, eps=None):  # against float64 numpy's rmsnorm(x) @ W
    xn, g = np.asarray(x, np.float64), np.asarray(norm.weight[...], np.float64)
    eps = norm.eps if eps is None else eps
    want = (xn / np.sqrt(np.mean(xn * xn, axis=-1, keepdims=True) + eps) * g
            @ np.asarray(product.weight.dequantize(), np.float64))
    got = np.asarray(jax.jit(lambda x: product(norm(x)))(x), np.float64)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())

  check(norm, qkv, x)
  check(d.layers[1].post_attention_layernorm, d.layers[1].mlp.gate_up_proj, x)
  check(d.norm, d.lm_head, x)
  # rows of very different scales, one near zero, and an eps that matters
  wide = x * jnp.asarray([1e-3, 1.0, 30.0], dtype)[None, :, None]
  check(norm, qkv, wide)
  big_eps = dw.DeferredRMSNorm(norm)
  big_eps.eps = 0.5
  check(big_eps, qkv, wide, eps=0.5)
  tokens = jnp.asarray([[3, 9, 4, 1]], jnp.int32)
  a = np.asarray(d(tokens)[0], np.float64)
  b = np.asarray(plain(tokens)[0], np.float64)
  np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())
  # a norm with a full-precision consumer stays as the target's
  part = {k: w for k, w in weights.items() if not k.startswith("layers.0.mlp.")}
  p = dw.draft_model(m, part)
  assert isinstance(p.layers[0].input_layernorm, dw.DeferredRMSNorm)
  assert not isinstance(p.layers[0].post_attention_layernorm, dw.DeferredRMSNorm)
  no_head = dw.draft_model(m, {k: w for k, w in weights.items() if k != "lm_head"})
  assert not isinstance(no_head.norm, dw.DeferredRMSNorm)
  # a draft of a draft: deferred norms are not wrapped twice, and defer_norms=False
  # gives the target's norms back (the same weight Params)
  again = dw.draft_model(d, {})
  assert type(again.layers[0].input_layernorm.weight) is type(norm.weight)
  assert isinstance(again.layers[0].input_layernorm, dw.DeferredRMSNorm)
  undone = dw.draft_model(d, {}, defer_norms=False)
  assert isinstance(undone.layers[0].input_layernorm, llama.RMSNorm)
  assert isinstance(undone.norm, llama.RMSNorm)
  np.testing.assert_array_equal(np.asarray(undone(tokens)[0], np.float64), b)


def test_deferred_norm_in_float16_and_scaled_rows_copy():
  """float16 rows ``x * w`` could overflow (65504) where the normalized rows do not:
  a float16 input takes the plain norm (finite, equal to `models.llama.RMSNorm`).
  `ScaledRows` is a NamedTuple (a pytree; copyable)."""
  norm = llama.RMSNorm(64, eps=1e-5, dtype=jnp.float16)
  norm.weight[...] = jnp.full((64,), 20.0, jnp.float16)
  x = jnp.full((2, 64), 4000.0, jnp.float16).at[1].set(-3.0)
  got = dw.DeferredRMSNorm(norm)(x)
  assert not isinstance(got, dw.ScaledRows)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(norm(x)))
  assert np.isfinite(np.asarray(got, np.float32)).all()
  rows = dw.DeferredRMSNorm(norm)(x.astype(jnp.bfloat16))
  assert isinstance(rows, dw.ScaledRows) and rows.dtype == jnp.bfloat16
  assert copy.copy(rows).scale is rows.scale
  leaves = jax.tree_util.tree_leaves(rows)
  assert len(leaves) == 2 and leaves[1].dtype == jnp.float32


@pytest.mark.parametrize("n_in,n_out,lead", [(256, 128, (1,)), (384, 256, (2, 3))])
def test_out_major_layout_is_the_same_weight(n_in, n_out, lead):
  """The Mosaic kernel's layout (codes ``[in / 128, out, 64]``) holds the same codes as the
  Triton kernel's: equal dequantization, and ``x @ W`` (the Hopper kernel on an H100 /
  H200, the dequantize + dot elsewhere) equal to float64 numpy on the dequantized weight."""
  w = jax.random.normal(jax.random.key(n_in), (n_in, n_out), jnp.float32)
  a = dw.quantize_kernel(w, group_size=128, layout="in_major")
  b = dw.quantize_kernel(w, group_size=128, layout="out_major")
  assert b.codes.shape == (n_in // 128, n_out, 64) and b.shape == a.shape == (n_in, n_out)
  np.testing.assert_array_equal(np.asarray(b.unpacked_codes()), np.asarray(a.unpacked_codes()))
  np.testing.assert_array_equal(np.asarray(b.dequantize()), np.asarray(a.dequantize()))
  x = jax.random.normal(jax.random.key(1), (*lead, n_in), jnp.float32).astype(jnp.bfloat16)
  want = np.asarray(x, np.float64) @ np.asarray(a.dequantize(), np.float64)
  got = np.asarray(jax.jit(lambda x, w: w.matmul(x, jnp.float32))(x, b), np.float64)
  np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
  assert dw.nbytes({"a": a}) == dw.nbytes({"b": b})


def test_draft_model_on_out_major_weights_equals_in_major():
  """A jitted draft forward over Mosaic-layout weights (QuantizedLinear carries the
  layout) gives the Triton-layout draft's logits."""
  cfg = dataclasses.replace(llama.LlamaConfig.named("llama-3.1-8b"), num_layers=1,
                            hidden_size=256, intermediate_size=512, vocab_size=512)
  m = llama.random_model(cfg, seed=4, dtype=jnp.bfloat16)
  tokens = jnp.asarray([[3, 17, 400, 9]], jnp.int32)
  logits = {}
  for layout in dw.LAYOUTS:
    weights = m.quantize_weights(layout=layout)
    assert {w.layout for w in weights.values()} == {layout}
    d = m.with_draft_weights(weights)
    assert d.layers[0].mlp.gate_up_proj.weight.layout == layout
    graphdef, state = nnx.split(d)
    logits[layout] = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens),
                                np.float64)
  ref = logits["in_major"]
  np.testing.assert_allclose(logits["out_major"], ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def test_fused_qkv_draft_equals_separate_products():
  """``fuse_qkv=True`` and ``fuse_mlp=True`` (the defaults): one ``[in, q + k + v]`` draft
  weight per attention layer and one ``[in, 2 * intermediate]`` per MLP hold the same codes
  column for column, so the draft's logits equal the unfused draft's."""
  cfg = dataclasses.replace(llama.LlamaConfig.named("llama-3.1-8b"), num_layers=2,
                            hidden_size=256, intermediate_size=512, vocab_size=512)
  m = llama.random_model(cfg, seed=4, dtype=jnp.bfloat16)
  tokens = jnp.asarray([[3, 17, 400, 9]], jnp.int32)
  sep, fused = m.quantize_weights(fuse_qkv=False, fuse_mlp=False), m.quantize_weights()
  assert sorted(fused) == sorted(
      [k for k in sep if not k.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))]
      + [f"layers.{i}.self_attn.qkv_proj" for i in range(2)]
      + [f"layers.{i}.mlp.gate_up_proj" for i in range(2)])
  gu = fused["layers.0.mlp.gate_up_proj"]
  np.testing.assert_array_equal(np.asarray(gu.dequantize()), np.concatenate(
      [np.asarray(sep[f"layers.0.mlp.{n}_proj"].dequantize()) for n in ("gate", "up")], 1))
  w = fused["layers.1.self_attn.qkv_proj"]
  parts = [sep[f"layers.1.self_attn.{n}_proj"] for n in "qkv"]
  np.testing.assert_array_equal(np.asarray(w.dequantize()),
                                np.concatenate([np.asarray(p.dequantize()) for p in parts], 1))
  logits = []
  for weights in (sep, fused):
    graphdef, state = nnx.split(m.with_draft_weights(weights))
    logits.append(np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens),
                             np.float64))
  np.testing.assert_allclose(logits[1], logits[0], rtol=2e-2, atol=2e-2 * np.abs(logits[0]).max())
  bad = dict(fused)
  bad["layers.1.self_attn.qkv_proj"] = sep["layers.0.mlp.gate_proj"]
  with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj has shape"):
    m.with_draft_weights(bad)
  bad = dict(fused)
  bad["layers.1.mlp.gate_up_proj"] = sep["layers.0.mlp.gate_proj"]
  with pytest.raises(ValueError, match="layers.1.mlp.gate_up_proj has shape"):
    m.with_draft_weights(bad)
  with pytest.raises(ValueError, match=r"would ignore the separate ones"):
    m.with_draft_weights({**fused, "layers.0.mlp.up_proj": sep["layers.0.mlp.up_proj"]})
  with pytest.raises(ValueError, match="already runs a fused gate_up_proj"):
    m.with_draft_weights(fused).with_draft_weights({"layers.0.mlp.gate_proj":
                                                    sep["layers.0.mlp.gate_proj"]})
  # Refused, never silently ignored: a fused weight beside its separate ones, separate
  # ones on a draft that already runs the fused product, a key naming no attention layer.
  with pytest.raises(ValueError, match=r"would ignore the separate ones"):
    m.with_draft_weights({**fused, "layers.1.self_attn.k_proj": sep["layers.1.self_attn.k_proj"]})
  with pytest.raises(ValueError, match="already runs a fused qkv_proj"):
    m.with_draft_weights(fused).with_draft_weights({"layers.0.self_attn.q_proj":
                                                    sep["layers.0.self_attn.q_proj"]})
  for key in ("layers.0.mlp.qkv_proj", "layers.9.self_attn.qkv_proj",
              "layers.0.self_attn.gate_up_proj"):
    with pytest.raises(ValueError, match=f"{key} names no layer"):
      m.with_draft_weights({key: w})


def test_layout_choice_and_refusals():
  w = jax.random.normal(jax.random.key(0), (256, 128), jnp.float32)
  # "auto" takes the Mosaic layout only on Hopper and for large kernels
  assert dw.quantize_kernel(w).layout == "in_major"
  assert dw.default_layout(4096, 1024, 4, 128) == "in_major"   # below the threshold anywhere
  with pytest.raises(ValueError, match="inv_freq is needed"):
    llama.apply_rope(jnp.ones((1, 2, 1, 8)), jnp.zeros((1, 2), jnp.int32))
  for n_in, n_out in ((4096, 14336), (4096, 4096)):   # at and above the threshold
    assert dw.default_layout(n_in, n_out, 4, 128) == (
        "out_major" if jax.default_backend() == "gpu" and jaxkv.attention.is_hopper()
        else "in_major")
  assert dw.default_layout(4096, 14336, 8, 128) == "in_major"
  with pytest.raises(ValueError, match="layout='rows' must be 'auto' or one of"):
    dw.quantize_kernel(w, layout="rows")
  with pytest.raises(ValueError, match="got bits=8, group=128"):
    dw.quantize_kernel(w, bits=8, layout="out_major")
  with pytest.raises(ValueError, match="got bits=4, group=64"):
    dw.quantize_kernel(w, group_size=64, layout="out_major")
  q = dw.quantize_kernel(w, layout="out_major")
  with pytest.raises(ValueError, match="layout='cols' must be one of"):
    dw.QuantizedWeight(q.codes, q.scale, q.zero, group=128, bits=4, layout="cols")
  q = dw.quantize_kernel(jnp.concatenate([w, w], axis=1), layout="out_major")  # [256, 256]
  with pytest.raises(ValueError, match=r"scale.shape=\(2, 256\) must be \(4, 128\)"):
    dw.QuantizedWeight(q.codes.reshape(4, 128, 64), q.scale, q.zero, group=128, bits=4,
                       layout="out_major")
  with pytest.raises(ValueError, match="must end in 64"):
    dw.QuantizedWeight(q.codes.reshape(2, 512, 32), q.scale, q.zero, group=128, bits=4,
                       layout="out_major")
  with pytest.raises(ValueError, match=r"\(\[in / 128, out, 64\] for layout='out_major'\)"):
    dw.QuantizedWeight(q.codes.reshape(256, 128), q.scale, q.zero, group=128, bits=4,
                       layout="out_major")


@pytest.mark.slow
def test_cli_speculative_flag_matches_plain_quantspec(tmp_path_factory, capsys):
  from jaxkv import cli
  from tests.test_generate_cli import CFG
  from models.checkpoint import save_llama
  path = str(tmp_path_factory.mktemp("spec_ckpt"))
  save_llama(llama.random_model(CFG, seed=6, dtype=jnp.float32), path)
  common = ["generate", "--checkpoint", path, "--prompt-ids", "5,6,7,9", "--max-new-tokens", "7",
            "--no-stop", "--no-progress"]
  assert cli.main(common + ["--kv", "quantspec"]) == 0
  plain = capsys.readouterr().out
  assert cli.main(common + ["--speculative", "3", "--draft-weights", "int8"]) == 0
  out, err = capsys.readouterr()
  assert out == plain and len(out.split()) == 4 + 7
  assert "acceptance" in err and "KV cache quantspec" in err
  assert cli.main(common + ["--speculative", "2", "--kv", "kivi4"]) == 2
  assert "--speculative needs a hierarchical --kv-format" in capsys.readouterr().err
