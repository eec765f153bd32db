"""How much a quantized KV cache changes what a model says.

Measured through the real decode path: the prompt is prefilled into the
cache of the format under test, then every further token goes through
``model.decode`` over that (quantized) cache inside one jitted `lax.scan`
(`forced_decode`). Each batch row is either

* teacher-forced (perplexity rows): the next input is the true next token of
  the text, and the log-probabilities of every step are kept; or
* free-running (greedy rows): the next input is the model's own argmax, i.e.
  greedy generation.

From that, per format: perplexity of the text continuation at each context,
next-token KL divergence against the bf16 cache on the same positions, the
fraction of greedy tokens identical to the bf16 cache's before the first
difference, and bytes per token. `evaluate` runs the lot; the text comes from
`reference_text` / `document_question_prompts` (Python's own documentation,
shipped with the interpreter: nothing is downloaded).

The model contract is that of `jaxkv.generate`: ``init_cache``, ``prefill``,
``decode``, ``config`` (``num_layers``, ``num_kv_heads``, ``head_dim``).
Vector-quantized formats (`jaxkv.VQFormat`, ``"cq4"``, ``"cq2"``) take
codebooks; `evaluate` fits them on the model's own K/V of a calibration
window of the text (``model.forward_kv``, `jaxkv.vq.calibration_kv`) unless
given.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import vq
from jaxkv.decoding import as_format, jit_by_rows
from jaxkv.formats import PRESETS, KVFormat

# ------------------------------------------------------------------ text
# (pydoc topic, question): documents of 750-2600 tokens (SmolLM2's BPE), all longer
# than a 128-token residual; the shortest first.
_QUESTIONS = (
    ("with", "Which two methods does a context manager provide, and when is each called?"),
    ("class", "What happens when a class definition is executed?"),
    ("try", "When does the code in a finally clause run, and what happens to an exception that "
            "was raised in the try clause?"),
    ("import", "Describe the two steps that a basic import statement executes."),
    ("execmodel", "What is a code block, and how is a name resolved when it is used?"),
    ("assignment", "How is an assignment to a target list evaluated?"),
)


def reference_text() -> str:
  """English prose from Python's own reference documentation (``pydoc_data``).

  The pydoc topics (~465K characters, ~110K tokens with a BPE vocabulary)
  ship with CPython, in a fixed order: the same text on every machine with
  the same Python minor version.
  """
  from pydoc_data.topics import topics  # pylint: disable=import-outside-toplevel
  return "\n\n".join(topics[k].strip() for k in sorted(topics))


def document_question_prompts(count: int = 2) -> list[tuple[str, str]]:
  """``count`` (document, question) pairs from the pydoc topics."""
  from pydoc_data.topics import topics  # pylint: disable=import-outside-toplevel
  if not 1 <= count <= len(_QUESTIONS):
    raise ValueError(f"count={count} must be in [1, {len(_QUESTIONS)}]")
  return [(topics[key].strip(), question) for key, question in _QUESTIONS[:count]]


def question_messages(document: str, question: str) -> list[dict]:
  """Chat messages asking ``question`` about ``document``."""
  return [{"role": "user", "content": f"Read this document and answer the question.\n\n"
                                      f"{document}\n\nQuestion: {question}"}]


# ----------------------------------------------------------------- metrics
def perplexity(target_logprobs) -> float:
  """``exp(-mean log p(target))`` over all given positions (natural log).

  Raises:
    ValueError: no positions; a NaN or a positive value (not a log-probability:
      probabilities given instead of their logs read as a perplexity near 1).
  """
  lp = np.asarray(target_logprobs, np.float64)
  if lp.size == 0:
    raise ValueError("perplexity of zero tokens is undefined")
  if np.isnan(lp).any() or (lp > 1e-6).any():
    raise ValueError(f"target_logprobs must be log-probabilities (<= 0, no NaN); got values in "
                     f"[{np.nanmin(lp):.3g}, {np.nanmax(lp):.3g}]"
                     + (" and NaN" if np.isnan(lp).any() else ""))
  return float(np.exp(-lp.mean()))


def kl_divergence(ref_logprobs, logprobs) -> np.ndarray:
  """``KL(ref || other)`` per position over the last (vocabulary) axis, in nats.

  Args:
    ref_logprobs, logprobs: ``[..., V]`` normalised log-probabilities (a
      token of probability 0 in ``ref`` adds nothing: ``0 log 0 = 0``).
  Returns:
    ``[...]`` float64, >= 0 up to rounding (inf where ``ref`` gives mass to a
    token ``logprobs`` makes impossible).
  Raises:
    ValueError: shapes that differ, NaN, or rows that are not normalised
      log-probabilities (``logsumexp`` off 0 by more than 1e-3: e.g.
      probabilities passed instead of their logs).
  """
  ref = np.asarray(ref_logprobs, np.float64)
  other = np.asarray(logprobs, np.float64)
  if ref.shape != other.shape:
    raise ValueError(f"shapes differ: {ref.shape} vs {other.shape}")
  for name, x in (("ref_logprobs", ref), ("logprobs", other)):
    if np.isnan(x).any():
      raise ValueError(f"{name} holds NaN")
    lse = np.logaddexp.reduce(x, axis=-1)
    if x.size and np.max(np.abs(lse)) > 1e-3:
      raise ValueError(f"{name} must be normalised log-probabilities over the last axis "
                       f"(logsumexp 0); a row has logsumexp {lse.ravel()[np.argmax(np.abs(lse))]:.4g}")
  p = np.exp(ref)
  with np.errstate(invalid="ignore"):
    terms = p * (ref - other)
  return np.sum(np.where(p > 0, terms, 0.0), axis=-1)


def first_divergence(ref_tokens, tokens) -> np.ndarray:
  """Index of the first differing token per row (the row length if none).

  Args:
    ref_tokens, tokens: ``[B, N]`` ints.
  Returns:
    ``[B]`` int.
  """
  ref, other = np.asarray(ref_tokens), np.asarray(tokens)
  if ref.shape != other.shape or ref.ndim != 2:
    raise ValueError(f"need two [B, N] arrays, got {ref.shape} and {other.shape}")
  differs = ref != other
  return np.where(differs.any(axis=1), np.argmax(differs, axis=1), ref.shape[1])


def bytes_per_token(kv_format: KVFormat | vq.VQFormat, config) -> float:
  """Packed cache bytes of one token over all layers (codes + scales, K and V; VQ:
  codes, codebooks amortized as `jaxkv.VQFormat.bytes_per_token`)."""
  return kv_format.bytes_per_token(config.num_kv_heads, config.head_dim) * config.num_layers


# ------------------------------------------------------------ decode path
@dataclasses.dataclass(frozen=True)
class _Static:
  kv_format: KVFormat | vq.VQFormat
  capacity: int
  cache_dtype: str | None
  implementation: str | None


@jit_by_rows(static_argnames=("static",))
def _forced_program(graphdef, state, prompt_tokens, prompt_lengths, targets, teacher, codebooks,
                    *, static: _Static):
  """Prefill, then a scan of decode steps. Returns ``(logprobs [N,B,V], argmax [N,B])``."""
  model = nnx.merge(graphdef, state)
  batch = prompt_tokens.shape[0]
  extra = {} if codebooks is None else {"codebooks": codebooks}  # VQ formats only
  caches = model.init_cache(static.kv_format, batch, static.capacity,
                            dtype=None if static.cache_dtype is None
                            else jnp.dtype(static.cache_dtype), **extra)
  logits, caches = model.prefill(prompt_tokens, prompt_lengths, caches)

  def step(carry, target):  # target [B]: the true token at this position
    logits, caches = carry
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    token = jnp.where(teacher, target, pred)
    logits, caches = model.decode(token[:, None], caches, implementation=static.implementation)
    return (logits[:, 0], caches), (logprobs, pred)

  _, (logprobs, preds) = jax.lax.scan(step, (logits, caches), targets.T)
  return logprobs, preds


def forced_decode(model, prompt_tokens, prompt_lengths, targets, teacher, *,
                  kv_format: KVFormat | vq.VQFormat | str, cache_dtype=jnp.bfloat16,
                  implementation: str | None = None,
                  codebooks: vq.VQCodebooks | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Prefill + ``N`` decode steps over a ``kv_format`` cache, teacher-forced or greedy per row.

  Step ``i`` scores the logits that predict token ``i`` after the prompt,
  then feeds ``targets[b, i]`` (teacher-forced rows) or the argmax
  (free-running rows) through ``model.decode``.

  Args:
    model: a model meeting the `jaxkv.generate` contract.
    prompt_tokens: ``[B, T]`` int, right-padded prompts.
    prompt_lengths: ``[B]`` int in ``[1, T]``.
    targets: ``[B, N]`` int: the true continuation (ignored on free-running rows).
    teacher: ``[B]`` bool: row is teacher-forced.
    kv_format: cache format (preset name, `KVFormat` or `jaxkv.VQFormat`).
    cache_dtype: full-precision K/V dtype of the cache.
    implementation: `jaxkv.decode_attention` implementation.
    codebooks: a VQ format's `jaxkv.VQCodebooks` (required there).
  Returns:
    ``(logprobs [B, N, V] float32, argmax tokens [B, N] int32)``.
  """
  kv_format = as_format(kv_format)
  if isinstance(kv_format, vq.VQFormat) and codebooks is None:
    raise ValueError(f"kv_format={kv_format} is a VQ format: pass codebooks= (jaxkv.vq.fit on "
                     "jaxkv.vq.calibration_kv(model, tokens))")
  prompt_tokens = np.asarray(prompt_tokens, np.int32)
  targets = np.asarray(targets, np.int32)
  if prompt_tokens.ndim != 2 or targets.ndim != 2 or targets.shape[0] != prompt_tokens.shape[0]:
    raise ValueError(f"prompt_tokens {prompt_tokens.shape} and targets {targets.shape} must be "
                     "[B, T] and [B, N]")
  if prompt_tokens.shape[0] < 1:
    raise ValueError(f"prompt_tokens {prompt_tokens.shape} holds no sequence: batch must be >= 1")
  vocab = model.config.vocab_size
  for name, ids in (("prompt_tokens", prompt_tokens), ("targets", targets)):
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
      raise ValueError(f"{name} hold ids outside [0, {vocab})")
  static = _Static(kv_format, prompt_tokens.shape[1] + targets.shape[1],
                   None if cache_dtype is None else jnp.dtype(cache_dtype).name, implementation)
  graphdef, state = nnx.split(model)
  program = _forced_program.at(prompt_tokens.shape[0])
  logprobs, preds = program(graphdef, state, jnp.asarray(prompt_tokens),
                            jnp.asarray(prompt_lengths, jnp.int32), jnp.asarray(targets),
                            jnp.asarray(teacher, bool), codebooks, static=static)
  return np.asarray(logprobs).swapaxes(0, 1), np.asarray(preds).T


# ------------------------------------------------------------------ suite
KIVI_FORMATS: dict[str, KVFormat] = {
    # KIVI's own settings (Liu et al. 2024, sec. 4): K per channel over groups
    # of 32 tokens, V per token over groups of 32 channels, residual R = 128.
    "kivi4-g32": KVFormat(k_bits=4, v_bits=4, k_axis="channel", token_group=32, channel_group=32,
                          residual=128),
    "kivi2-g32": KVFormat(k_bits=2, v_bits=2, k_axis="channel", token_group=32, channel_group=32,
                          residual=128),
}


# Candidates tried for a preset at <= 0.25x bf16 bytes (head_dim 64); the two
# that held up (k4v2-g32, kivi2-g16) became presets.
CANDIDATE_FORMATS: dict[str, KVFormat] = {
    "k2v4-g32": KVFormat(k_bits=2, v_bits=4, k_axis="channel", token_group=32, channel_group=32,
                         residual=128),
}


def default_formats(head_dim: int) -> dict[str, KVFormat]:
  """Every preset that fits ``head_dim`` (bf16 first), `KIVI_FORMATS`, `CANDIDATE_FORMATS`."""
  formats = {}
  for name, fmt in {**PRESETS, **KIVI_FORMATS, **CANDIDATE_FORMATS}.items():
    try:
      fmt.validate_head_dim(head_dim)
    except ValueError:
      continue
    formats[name] = fmt
  return {"bf16": formats.pop("bf16"), **formats}


@dataclasses.dataclass(frozen=True)
class Suite:
  """The one token batch an evaluation runs through every format.

  Attributes:
    prompt_tokens: ``[B, T]`` right-padded prompts.
    prompt_lengths: ``[B]``.
    targets: ``[B, N]`` true continuations (zeros on greedy rows).
    teacher: ``[B]`` bool, teacher-forced (perplexity) rows.
    context: ``[B]`` total context (prompt + N) of perplexity rows, 0 on greedy rows.
  """

  prompt_tokens: np.ndarray
  prompt_lengths: np.ndarray
  targets: np.ndarray
  teacher: np.ndarray
  context: np.ndarray


def build_suite(tokens: Sequence[int], question_prompts: Sequence[Sequence[int]], *,
                contexts: Sequence[int], sequences: int, steps: int) -> Suite:
  """Perplexity rows (``sequences`` per context) and greedy rows in one batch.

  One batch means one compiled program per format (compilation, not
  arithmetic, dominates a CPU run of a 30-layer model); prompts are
  right-padded to the longest.

  Args:
    tokens: a long token stream (the reference text).
    question_prompts: token ids of document-question prompts (greedy rows).
    contexts: total tokens per perplexity row (prompt ``C - steps``, then
      ``steps`` scored tokens).
    sequences: perplexity rows per context, from disjoint windows of ``tokens``
      (window ``j`` starts at token ``j * max(contexts)`` for every context).
    steps: scored / generated tokens per row.
  """
  tokens = np.asarray(tokens, np.int32)
  stride = max(contexts, default=0)
  if contexts and sequences * stride > tokens.size:
    raise ValueError(f"{sequences} windows of {stride} tokens need {sequences * stride} tokens; "
                     f"the text has {tokens.size}")
  prompts, targets, context = [], [], []
  for ctx in contexts:
    if ctx <= steps:
      raise ValueError(f"context {ctx} must exceed steps={steps}")
    for j in range(sequences):
      window = tokens[j * stride:j * stride + ctx]
      prompts.append(window[:ctx - steps])
      targets.append(window[ctx - steps:])
      context.append(ctx)
  for p in question_prompts:
    prompts.append(np.asarray(p, np.int32))
    targets.append(np.zeros(steps, np.int32))
    context.append(0)
  if not prompts:
    raise ValueError("nothing to evaluate: no contexts and no question prompts")
  batch = np.zeros((len(prompts), max(len(p) for p in prompts)), np.int32)
  for i, p in enumerate(prompts):
    batch[i, :len(p)] = p
  context = np.asarray(context, np.int64)
  return Suite(batch, np.array([len(p) for p in prompts]), np.stack(targets), context > 0,
               context)


def _format_fields(fmt) -> dict:
  """A result row's description of a format: its bits and groups (VQ: every field)."""
  if isinstance(fmt, vq.VQFormat):
    return dataclasses.asdict(fmt)
  return dict(k_bits=fmt.k_bits, v_bits=fmt.v_bits, k_axis=fmt.k_axis,
              token_group=fmt.token_group, channel_group=fmt.channel_group,
              residual=fmt.residual, sink_tokens=fmt.sink_tokens)


def evaluate(model, tokenizer, formats: dict[str, KVFormat | vq.VQFormat] | None = None, *,
             contexts: Sequence[int] = (1024, 2048), sequences: int = 2, steps: int = 128,
             questions: int = 2, cache_dtype=jnp.bfloat16, implementation: str | None = None,
             codebooks: dict[str, vq.VQCodebooks] | None = None, calibration: int = 2048,
             log: Callable[[str], None] | None = print) -> dict:
  """Perplexity, KL vs bf16, greedy agreement and bytes per token of each format.

  Args:
    model: a model meeting the `jaxkv.generate` contract.
    tokenizer: ``encode(text) -> ids`` and ``encode_chat(messages) -> ids``
      (`models.tokenizer.Tokenizer`).
    formats: name -> format (`KVFormat`, `jaxkv.VQFormat` or a preset name);
      the first is the reference (bf16). Default: `default_formats`.
    contexts: perplexity contexts in tokens (prompt + ``steps`` scored tokens).
    sequences: text windows per context.
    steps: scored tokens per perplexity row and generated tokens per greedy row.
    questions: document-question prompts for greedy agreement (0 = none).
    cache_dtype: full-precision K/V dtype of every cache.
    implementation: `jaxkv.decode_attention` implementation.
    codebooks: name -> `jaxkv.VQCodebooks` for VQ formats; a VQ format not
      in it gets codebooks fitted (`jaxkv.vq.fit`, seed 0) on the model's
      K/V of ``calibration`` text tokens right after the perplexity windows.
    calibration: calibration tokens for those fits.
    log: progress lines (None = quiet).
  Returns:
    JSON-ready dict: settings and one row per format.
  """
  config = model.config
  formats = default_formats(config.head_dim) if formats is None else {
      name: as_format(fmt) for name, fmt in formats.items()}
  first, ref_fmt = next(iter(formats.items()), (None, None))
  if not (isinstance(ref_fmt, KVFormat) and ref_fmt.k_bits == 16 and ref_fmt.v_bits == 16):
    raise ValueError(f"the first format is the reference the KL and greedy agreement are "
                     f"measured against ('kl_vs_bf16'): it must be a 16-bit KVFormat such as "
                     f"'bf16', got {first!r}: {ref_fmt}")
  text_ids = tokenizer.encode(reference_text())
  qa = [tokenizer.encode_chat(question_messages(d, q))
        for d, q in document_question_prompts(questions)] if questions else []
  suite = build_suite(text_ids, qa, contexts=contexts, sequences=sequences, steps=steps)
  codebooks = dict(codebooks or {})
  to_fit = [n for n, f in formats.items() if isinstance(f, vq.VQFormat) and n not in codebooks]
  if to_fit:
    start = sequences * max(contexts, default=0)  # disjoint from every perplexity window
    calib = np.asarray(text_ids[start:start + calibration], np.int32)
    if calib.size < calibration:
      raise ValueError(f"calibration={calibration}: the perplexity windows take the first "
                       f"{start} text tokens and calibration the next {calibration}, but the "
                       f"text has {len(text_ids)}")
    calib_kv = {}  # per sink_tokens: a format with sinks fits without them
    for name in to_fit:
      s = formats[name].sink_tokens
      if s not in calib_kv:
        calib_kv[s] = vq.calibration_kv(model, calib[None], sink_tokens=s)
      codebooks[name] = vq.fit(*calib_kv[s], formats[name], seed=0)
    if log is not None:
      log(f"fitted codebooks of {', '.join(to_fit)} on text tokens [{start}, "
          f"{start + calibration})")
  ref_bytes = bytes_per_token(PRESETS["bf16"], config)
  rows, ref = [], None
  greedy_rows = ~suite.teacher
  for name, fmt in formats.items():
    t0 = time.perf_counter()
    logprobs, preds = forced_decode(model, suite.prompt_tokens, suite.prompt_lengths,
                                    suite.targets, suite.teacher, kv_format=fmt,
                                    cache_dtype=cache_dtype, implementation=implementation,
                                    codebooks=codebooks.get(name))
    seconds = time.perf_counter() - t0
    if ref is None:
      ref = logprobs, preds
    row = dict(format=name, **_format_fields(fmt), bytes_per_token=bytes_per_token(fmt, config),
               bytes_vs_bf16=bytes_per_token(fmt, config) / ref_bytes, seconds=seconds,
               perplexity={}, kl_vs_bf16={})
    for ctx in contexts:
      sel = suite.context == ctx
      target_lp = np.take_along_axis(logprobs[sel], suite.targets[sel][..., None], axis=-1)
      row["perplexity"][str(ctx)] = perplexity(target_lp)
      row["kl_vs_bf16"][str(ctx)] = float(kl_divergence(ref[0][sel], logprobs[sel]).mean())
    if greedy_rows.any():
      first = first_divergence(ref[1][greedy_rows], preds[greedy_rows])
      row["greedy_agreement"] = float(np.mean(first) / steps)
      row["greedy_token_match"] = float(np.mean(ref[1][greedy_rows] == preds[greedy_rows]))
      row["first_divergence"] = first.tolist()
      row["greedy_tokens"] = preds[greedy_rows].tolist()
    rows.append(row)
    if log is not None:
      ppl = " ".join(f"ppl@{c}={p:.3f}" for c, p in row["perplexity"].items())
      kl = " ".join(f"kl@{c}={k:.4f}" for c, k in row["kl_vs_bf16"].items())
      agree = f"agree={row['greedy_agreement']:.1%}" if "greedy_agreement" in row else ""
      log(f"{name:<14} {row['bytes_vs_bf16']:.3f}x bytes  {ppl}  {kl}  {agree}  "
          f"({seconds:.0f}s)")
  return dict(
      settings=dict(contexts=list(contexts), sequences=sequences, steps=steps,
                    questions=questions, cache_dtype=jnp.dtype(cache_dtype).name,
                    model_dtype=jnp.dtype(model.dtype).name, implementation=implementation,
                    text="pydoc_data.topics (Python reference documentation)",
                    question_prompt_tokens=[len(p) for p in qa],
                    device=jax.devices()[0].device_kind, jax=jax.__version__),
      rows=rows)


__all__ = ["CANDIDATE_FORMATS", "KIVI_FORMATS", "Suite", "build_suite", "bytes_per_token", "default_formats",
           "document_question_prompts", "evaluate", "first_divergence", "forced_decode",
           "kl_divergence", "perplexity", "question_messages", "reference_text"]
