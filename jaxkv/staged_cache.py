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

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import hierarchical
from jaxkv.attention import reference_attention
from jaxkv.cache import KVCache


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


def staged_attention(q: jax.Array, cache: KVCache, k_stage: jax.Array, v_stage: jax.Array,
                     staged: jax.Array, *, view: str = "target", scale=None) -> jax.Array:
  """Decode attention of the S newest (staged) queries over cache + staged tokens.

  Args:
    q: ``[B, S, Hq, D]``, the queries of the last S staged tokens.
    cache: the committed `KVCache` (lengths ``L_b``).
    k_stage, v_stage: ``[B, P, Hkv, D]`` staged K/V; rows ``[0, staged_b)`` valid.
    staged: ``[B]`` staged tokens (``>= S``).
    view: committed tokens read as ``cache.dequantize(view)``.
  Returns:
    ``[B, S, Hq, D]`` in q's dtype; query i sees tokens ``[0, L + staged - S + i]``.
  """
  hierarchical.check_view(view)
  k_hist, v_hist = cache.dequantize(view)
  k, v = assemble(k_hist, v_hist, cache.lengths, k_stage, v_stage, staged)
  return reference_attention(q, k, v, cache.lengths + staged, scale=scale)


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
    staged tokens or pass the cache's capacity; under `jit` such a sequence
    is left unchanged and its ``cache.overflow`` flag is set.
    """
    self.cache._validate_kv(k, v, "append")  # pylint: disable=protected-access
    s = k.shape[1]
    fits = ((self.staged + s <= self.staging)
            & (self.lengths + s <= self.cache.capacity))
    if _is_concrete(fits) and not bool(np.all(np.asarray(fits))):
      bad = np.nonzero(~np.asarray(fits))[0].tolist()
      raise ValueError(f"append: sequences {bad} would hold more than staging={self.staging} "
                       f"staged tokens or pass capacity={self.cache.capacity} (S={s}); flush first")
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
    lengths = jnp.asarray(lengths, jnp.int32) if not isinstance(lengths, jax.Array) else lengths
    if lengths.shape != (self.cache.batch,):
      raise ValueError(f"rollback: lengths.shape={lengths.shape} must be ({self.cache.batch},)")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
      raise TypeError(f"rollback: lengths.dtype={lengths.dtype} must be an integer dtype")
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

  def attention(self, q: jax.Array, *, view: str = "target", scale=None) -> jax.Array:
    """`staged_attention` of ``q [B, S, Hq, D]`` (the last S staged tokens)."""
    return staged_attention(q, self.cache, self.k_stage, self.v_stage, self.staged, view=view,
                            scale=scale)


__all__ = ["StagedCache", "assemble", "staged_attention", "write_staged"]
