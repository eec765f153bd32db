"""`StagedCache`: a `KVCache` plus unflushed tokens, for speculative decoding.

Speculation appends tokens that may be rejected. They are staged in full
precision beside the cache's residual block, never quantized: a staged token
can be dropped (`rollback`) until `flush` appends the accepted ones to the
cache with an ordinary (flushing) append. So the cache proper always obeys
the residual rule (DESIGN.md), and after any history of appends, rollbacks
and flushes it is bitwise the cache made by quantizing the accepted history
at once. Only staged tokens can be rolled back; with QuantSpec's double
buffer (``R = 2G``) the last ``G`` flushed tokens also stay exact in the
residual block, but they are committed.

Attention over a staged cache (`staged_attention`) sees the committed tokens
as stored (``view`` of `KVCache.dequantize`) and the staged ones exactly,
with the decode causal rule over the total length.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import hierarchical
from jaxkv.attention import check_scale, reference_attention
from jaxkv.cache import KVCache, nonfinite_rows


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def write_staged(stage: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes ``new [B, S, H, D]`` into ``stage [B, P, H, D]`` at rows ``start [B]``.

  Rows that would land past ``P`` are dropped.
  """
  s = new.shape[1]
  rows = start[:, None] + jnp.arange(s)[None, :]                        # [B, S]
  seq = jnp.arange(new.shape[0])[:, None]
  return stage.at[seq, rows].set(new.astype(stage.dtype), mode="drop")


def assemble(k_hist: jax.Array, v_hist: jax.Array, lengths: jax.Array, k_stage: jax.Array,
             v_stage: jax.Array, staged: jax.Array):
  """History ``[B, C, H, D]`` with the staged rows placed at ``[L_b, L_b + staged_b)``."""
  cap = k_hist.shape[1]
  pos = jnp.arange(cap)[None, :] - lengths[:, None]                      # [B, C]
  in_stage = (pos >= 0) & (pos < staged[:, None])
  idx = jnp.clip(pos, 0, k_stage.shape[1] - 1)[:, :, None, None]

  def put(hist, stage):
    rows = jnp.take_along_axis(stage.astype(jnp.float32), idx, axis=1)
    return jnp.where(in_stage[:, :, None, None], rows, hist)

  return put(k_hist, k_stage), put(v_hist, v_stage)


def check_staged_count(staged, num_queries: int) -> None:
  """ValueError naming ``staged`` when it is concrete and some ``staged_b <
  num_queries`` (the queries must be the newest staged tokens); nothing when traced."""
  if not _is_concrete(staged):
    return
  counts = np.asarray(staged)
  if counts.size and counts.min() < num_queries:
    bad = np.nonzero(np.atleast_1d(counts) < num_queries)[0]
    raise ValueError(f"staged={counts.tolist()} must be >= S={num_queries} (q.shape[1]: the "
                     f"queries are the newest staged tokens) for sequences {bad.tolist()}")


def check_staged_shapes(q, cache, k_stage, v_stage, staged) -> None:
  """ValueError naming the argument unless ``k_stage, v_stage [B, P, Hkv, D]``,
  ``staged [B]`` (integer) and ``q [B, S, Hq, D]`` match ``cache`` (its batch,
  kv heads and head_dim; ``Hq`` a multiple of ``Hkv``): a staged block of
  another shape broadcast silently against the cache before."""
  b, h, d = cache.batch, cache.kv_heads, cache.head_dim
  for name, x in (("k_stage", k_stage), ("v_stage", v_stage)):
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 4 or (shape[0], shape[2], shape[3]) != (b, h, d):
      raise ValueError(f"{name}.shape={shape} must be [B={b}, P, Hkv={h}, D={d}] (the cache's)")
  if tuple(k_stage.shape) != tuple(v_stage.shape):
    raise ValueError(f"k_stage.shape={tuple(k_stage.shape)} != v_stage.shape="
                     f"{tuple(v_stage.shape)}")
  if not hasattr(staged, "dtype"):  # (a tracer has both: never read its values)
    staged = np.asarray(staged)
  if tuple(staged.shape) != (b,) or not jnp.issubdtype(staged.dtype, jnp.integer):
    raise ValueError(f"staged must be [{b}] integer counts, got shape {tuple(staged.shape)} "
                     f"dtype {staged.dtype}")
  qs = tuple(getattr(q, "shape", ()))
  if len(qs) != 4 or qs[0] != b or qs[3] != d or qs[2] % h:
    raise ValueError(f"q.shape={qs} must be [B, S, Hq, D] with Hq a multiple of the {h} kv "
                     f"heads (B={b}, D={d}: the cache's)")


def staged_attention(q: jax.Array, cache, k_stage: jax.Array, v_stage: jax.Array,
                     staged: jax.Array, *, view: str = "target", scale=None,
                     implementation: str | None = None) -> jax.Array:
  """Decode attention of the S newest (staged) queries over cache + staged tokens.

  Args:
    q: ``[B, S, Hq, D]``, the queries of the last S staged tokens.
    cache: the committed `KVCache` (lengths ``L_b``), or a
      `ModelCache.layer_view` (the kernel then reads the layer in place).
    k_stage, v_stage: ``[B, P, Hkv, D]`` staged K/V; rows ``[0, staged_b)`` valid.
    staged: ``[B]`` staged tokens (``>= S``: the S queries are the newest
      staged tokens). ValueError when ``staged`` is concrete and some
      ``staged_b < S``; under `jit` this is not checked and the
      implementations then disagree.
    view: committed tokens read as ``cache.dequantize(view)``.
    scale: softmax scale, default ``D ** -0.5``.
    implementation: ``"reference"`` (dequantize the committed tokens, dense
      attention over them and the staged rows), ``"triton"`` or ``"mosaic"``
      (that Pallas kernel over the committed tokens merged with exact
      attention over the few staged rows: Triton's log-sum-exp merged in
      XLA, in interpret mode off GPU; Mosaic on Hopper, where it reads both
      views of bfloat16 hierarchical caches at head_dim 128 and its combine
      kernel attends and merges the staged rows, `combine_t`'s ``stage``;
      a sink format's merge stays in XLA),
      ``"pallas"`` (the first of `jaxkv.attention.pallas_order` that serves
      the input), or None: ``"pallas"`` on a GPU when a family serves the
      cache (Mosaic first for both views on Hopper, else Triton), the
      reference elsewhere.
  Returns:
    ``[B, S, Hq, D]`` in q's dtype; query i sees tokens ``[0, L + staged - S + i]``.
  """
  from jaxkv.model_cache import LayerView  # pylint: disable=import-outside-toplevel
  hierarchical.check_view(view)
  scale = check_scale(scale)
  check_staged_shapes(q, cache, k_stage, v_stage, staged)
  check_staged_count(staged, q.shape[1])
  impl = _staged_implementation(q, cache, implementation, view)
  if impl == "reference":
    if isinstance(cache, LayerView):
      cache = cache.materialize()
    k_hist, v_hist = cache.dequantize(view)
    k, v = assemble(k_hist, v_hist, cache.lengths, k_stage, v_stage, staged)
    return reference_attention(q, k, v, cache.lengths + staged, scale=scale)
  return _staged_attention_kernel(q, cache, k_stage, v_stage, staged, view=view, scale=scale,
                                  mosaic=impl == "mosaic")


def _fold_queries(q: jax.Array, kv_heads: int) -> jax.Array:
  """``[B, S, Hq, D]`` -> ``[B, 1, Hkv*S*G, D]`` (kv-head major): every query sees the
  whole committed cache as one decode query of a wider GQA group."""
  b, s, hq, d = q.shape
  g = hq // kv_heads
  return q.reshape(b, s, kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(b, 1, -1, d)


def _staged_implementation(q, cache, implementation, view: str = "target") -> str:
  from jaxkv.attention import resolve_implementation  # pylint: disable=import-outside-toplevel
  on_gpu = jax.default_backend() == "gpu"
  if implementation is None:  # the best Pallas family that serves it (`pallas_order`)
    implementation = ("pallas", "reference") if on_gpu else "reference"
  names = (implementation,) if isinstance(implementation, str) else tuple(implementation)
  return resolve_implementation(_fold_queries(q, cache.kv_heads), cache, names, view=view)


def _staged_attention_kernel(q, cache, k_stage, v_stage, staged, *, view, scale,
                             mosaic: bool = False):
  """A Pallas kernel (Triton, or Mosaic with ``mosaic``) over the committed
  tokens, merged (log-sum-exp) with the staged rows: by the Mosaic combine
  kernel itself, else in XLA. A sink format's committed tokens are the kernel
  from its skip on plus the exact prefix (`jaxkv.sink_attention`). Staged rows
  ``p >= staged`` (stale after a rollback) are never read."""
  from jaxkv import attention  # pylint: disable=import-outside-toplevel
  from jaxkv.attention import _poison  # pylint: disable=import-outside-toplevel
  from jaxkv.model_cache import LayerView  # pylint: disable=import-outside-toplevel
  from jaxkv.sink_attention import lse_attention, merge_lse, sink_decode_attention  # pylint: disable=import-outside-toplevel
  b, s, hq, d = q.shape
  hkv = cache.kv_heads
  g = hq // hkv
  scale = d ** -0.5 if scale is None else scale
  q_fold = _fold_queries(q, hkv)
  config = attention._mosaic_default(cache, view) if mosaic else None  # on the layer's shapes
  sinks = cache.fmt.sink_tokens
  if sinks and config is None:  # the block the skip is a multiple of
    config = attention._triton_default(q_fold, cache, view)
  layer = None
  if isinstance(cache, LayerView):  # read the layer of the stacked arrays in place
    layer = cache.index
    cache = dataclasses.replace(cache.stacked, lengths=cache.lengths, overflow=cache.overflow)
  nonfinite = cache.nonfinite if hasattr(cache, "nonfinite") else jnp.zeros((b,), bool)
  if mosaic and not sinks:  # the staged rows, the merge and the NaN rows in the combine kernel
    out = attention._mosaic_attention(q_fold, cache, scale=scale, config=config, layer=layer,
                                      view=view, seq_bad=nonfinite,
                                      stage=(k_stage, v_stage, staged.astype(jnp.int32)),
                                      stage_queries=s)
    return out.reshape(b, hkv, s, g, d).transpose(0, 2, 1, 3, 4).reshape(b, s, hq, d)
  kernel = functools.partial(attention._kernel_attention, "mosaic" if mosaic else "triton",
                             q_fold, cache, scale=scale, config=config, layer=layer, view=view,
                             return_lse=True)
  if sinks:
    o_c, lse_c = sink_decode_attention(
        q_fold, cache, kernel, block=config.block_k, scale=scale, seq_bad=jnp.zeros((b,), bool),
        layer=layer, return_lse=True)
  else:
    o_c, lse_c = kernel()
  o_c = o_c.astype(jnp.float32).reshape(b, hkv, s, g, d).transpose(0, 2, 1, 3, 4)  # [B,S,H,G,D]
  lse_c = lse_c.reshape(b, hkv, s, g).transpose(0, 2, 1, 3)                       # [B,S,H,G]
  # The staged rows: query i sees rows [0, staged - S + i].
  rows = jnp.arange(k_stage.shape[1])
  limit = staged[:, None] - s + jnp.arange(s)[None, :]                              # [B, S]
  stage_rows = rows[None, :] < staged[:, None]                                      # [B, P]
  k_here, v_here = (jnp.where(stage_rows[:, :, None, None], x, 0).astype(x.dtype)
                    for x in (k_stage, v_stage))  # a stale inf times a zero weight is NaN
  o_s, lse_s = lse_attention(q, jnp.swapaxes(k_here, 1, 2), jnp.swapaxes(v_here, 1, 2),
                             rows[None, None, :] <= limit[:, :, None], scale)
  # Merge the two softmax blocks by their log-sum-exps.
  out, _ = merge_lse(o_c.reshape(b, s, hq, d), lse_c.reshape(b, s, hq), o_s, lse_s)
  stage_bad = jnp.any(stage_rows[:, :, None, None]
                      & ~(jnp.isfinite(k_stage) & jnp.isfinite(v_stage)), axis=(1, 2, 3))
  return _poison(out, q, nonfinite | stage_bad).astype(q.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StagedCache:
  """A `KVCache` (committed tokens) and up to ``P`` staged, unflushed tokens per sequence.

  Attributes:
    cache: the committed `KVCache`; it obeys the residual rule.
    k_stage, v_stage: ``[B, P, Hkv, D]`` staged tokens in the cache dtype.
    staged: ``[B]`` int32 staged tokens per sequence.
  """

  cache: KVCache
  k_stage: jax.Array
  v_stage: jax.Array
  staged: jax.Array

  @classmethod
  def wrap(cls, cache: KVCache, staging: int) -> "StagedCache":
    """``cache`` with room for ``staging`` unflushed tokens per sequence."""
    if not isinstance(cache, KVCache):
      raise TypeError(f"cache must be a jaxkv.KVCache, got {type(cache).__name__}")
    if isinstance(staging, bool) or not isinstance(staging, (int, np.integer)) or staging < 1:
      raise ValueError(f"staging={staging!r} must be an int >= 1")
    shape = (cache.batch, int(staging), cache.kv_heads, cache.head_dim)
    return cls(cache=cache, k_stage=jnp.zeros(shape, cache.dtype),
               v_stage=jnp.zeros(shape, cache.dtype),
               staged=jnp.zeros((cache.batch,), jnp.int32))

  @property
  def lengths(self) -> jax.Array:
    """``[B]`` committed plus staged tokens."""
    return self.cache.lengths + self.staged

  @property
  def staging(self) -> int:
    return self.k_stage.shape[1]

  def append(self, k: jax.Array, v: jax.Array, flush: bool = False) -> "StagedCache":
    """Stages ``k, v [B, S, Hkv, D]`` (not quantized); ``flush=True`` then flushes.

    Raises ValueError (eager) when a sequence would hold more than ``P``
    staged tokens or pass the cache's capacity, or when ``k``/``v`` hold
    NaN/inf. Under `jit`, a sequence that would not fit is left unchanged and
    its ``cache.overflow`` flag is set; non-finite rows are staged, poison
    that sequence's attention outputs and set ``cache.nonfinite`` at the
    flush.
    """
    self.cache._validate_kv(k, v, "append")  # pylint: disable=protected-access
    s = k.shape[1]
    fits = ((self.staged + s <= self.staging)
            & (self.lengths + s <= self.cache.capacity))
    if _is_concrete(fits) and not bool(np.all(np.asarray(fits))):
      bad = np.nonzero(~np.asarray(fits))[0].tolist()
      raise ValueError(f"append: sequences {bad} would hold more than staging={self.staging} "
                       f"staged tokens or pass capacity={self.cache.capacity} (S={s}); flush first")
    if _is_concrete(k) and _is_concrete(v):  # eager: refuse NaN/inf now, not at the flush
      every = jnp.full((k.shape[0],), s, jnp.int32)
      bad = np.nonzero(np.asarray(nonfinite_rows(k, every) | nonfinite_rows(v, every)))[0]
      if bad.size:
        raise ValueError(f"append: k or v holds NaN/inf in sequences {bad.tolist()}; the "
                         "cache cannot store it")
    start = jnp.where(fits, self.staged, self.staging)                   # out of range: dropped
    out = dataclasses.replace(
        self, k_stage=write_staged(self.k_stage, k, start),
        v_stage=write_staged(self.v_stage, v, start),
        staged=self.staged + jnp.where(fits, s, 0),
        cache=dataclasses.replace(self.cache, overflow=self.cache.overflow | ~fits))
    return out.flush() if flush else out

  def rollback(self, lengths) -> "StagedCache":
    """Drops staged tokens so that sequence ``b`` holds ``lengths[b]`` tokens.

    Only staged tokens can be dropped: ``cache.lengths <= lengths <= self.lengths``
    (ValueError naming the sequences otherwise; under `jit` lengths are clipped
    into that range).
    """
    if isinstance(lengths, (list, tuple, np.ndarray)) or np.isscalar(lengths):
      lengths = np.asarray(lengths)  # keep the dtype: floats and bools are refused below
    if lengths.dtype == np.bool_ or not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise TypeError(f"rollback: lengths.dtype={lengths.dtype} must be an integer dtype")
    if isinstance(lengths, np.ndarray):
      if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError(f"rollback: lengths={lengths.tolist()} must lie in [0, 2**31)")
      lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (self.cache.batch,):
      raise ValueError(f"rollback: lengths.shape={lengths.shape} must be ({self.cache.batch},)")
    if _is_concrete(lengths) and _is_concrete(self.staged):
      want, low, high = (np.asarray(a) for a in (lengths, self.cache.lengths, self.lengths))
      if np.any(want < low):
        bad = np.nonzero(want < low)[0].tolist()
        raise ValueError(f"rollback: lengths={want.tolist()} would drop flushed tokens of "
                         f"sequences {bad} (committed lengths {low.tolist()}): only staged "
                         "tokens can be rolled back")
      if np.any(want > high):
        bad = np.nonzero(want > high)[0].tolist()
        raise ValueError(f"rollback: lengths={want.tolist()} exceed the lengths "
                         f"{high.tolist()} of sequences {bad}")
    staged = jnp.clip(lengths - self.cache.lengths, 0, self.staged)
    return dataclasses.replace(self, staged=staged.astype(jnp.int32))

  def flush(self) -> "StagedCache":
    """Appends the staged tokens to the cache (quantizing full groups) and clears them."""
    cache = self.cache._extend(self.k_stage, self.v_stage, self.staged,  # pylint: disable=protected-access
                               "flush")
    return dataclasses.replace(self, cache=cache, staged=jnp.zeros_like(self.staged))

  def dequantize(self, view: str = "target") -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` float32 ``[B, capacity, Hkv, D]``: committed tokens in ``view``, staged exact."""
    k_hist, v_hist = self.cache.dequantize(view)
    return assemble(k_hist, v_hist, self.cache.lengths, self.k_stage, self.v_stage, self.staged)

  def attention(self, q: jax.Array, *, view: str = "target", scale=None,
                implementation: str | None = None) -> jax.Array:
    """`staged_attention` of ``q [B, S, Hq, D]`` (the last S staged tokens).

    Needs ``S <= staged`` per sequence (ValueError when ``staged`` is
    concrete; not checked under `jit`).
    """
    return staged_attention(q, self.cache, self.k_stage, self.v_stage, self.staged, view=view,
                            scale=scale, implementation=implementation)


__all__ = ["StagedCache", "assemble", "staged_attention", "write_staged"]
