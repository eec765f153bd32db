"""`ModelCache`: every layer's quantized KV cache in one pytree, stacked on a layer axis.

Each leaf of the per-layer storage (packed codes, scales, zeros,
full-precision residual; the same storage as `jaxkv.KVCache`) gets a leading
``[num_layers]`` axis, while ``lengths`` and the flags are held once for all
layers: one pytree of a few large buffers, updated in place under `jit` with
donation and in loop carries (never pass it through a scan's ``xs``/``ys``,
which would rebuild it every step).

One append (a decode step or a prefill chunk) is three phases:

1. ``plan = cache.plan_append(num_new, max_new=T)``: once per step, for all layers: which
   sequences fit, their new lengths and how many tokens each flushes into the
   packed region (DESIGN.md "the residual rule").
2. For each layer, ``cache = cache.append_layer(layer, k, v, plan)``:
   writes only what changes: the layer's residual block (a
   `lax.dynamic_update_slice` of ``[B, Hkv, R, D]``) and the flushed token
   groups (a scatter of at most ``flush_groups * G`` rows per sequence;
   sequences that flush nothing scatter out of bounds, which drops the
   rows; in a decode step under a `lax.cond` that skips it when no sequence
   flushes). Nothing cache-sized is copied: under `jit` with the cache
   donated (or in a loop carry) both updates happen in place.
   ``cache.layer(layer, plan)`` is the layer's `jaxkv.KVCache` view (slices of
   the stacked storage, the new lengths), so `jaxkv.decode_attention` and the
   Pallas kernels run unchanged. When every layer's K/V is known first (a
   speculative commit), ``cache = cache.append_layers(ks, vs, plan)`` writes
   them all with one flush cond instead of one per layer.
3. ``cache = cache.commit(plan)``: the new lengths and flags, once.

The storage after any sequence of appends is bitwise the storage a per-layer
`KVCache` reaches with the same appends (both use `jaxkv.cache`'s staging
helpers), hence equal to quantizing the whole history at once.

Flags (per sequence, ``[B]`` bool; `check()` raises on a concrete flagged
cache): ``overflow``: an append under `jit` would have grown the sequence past
``capacity`` and was skipped; ``invalid``: a traced call saw out-of-range
token ids or lengths for the sequence (see `models.llama.Llama.prefill`);
``nonfinite``: an append stored a NaN/inf K or V row in some layer, or a
group of finite values whose scale overflowed ``fmt.scale_dtype`` (stored as
NaN; `commit` checks the flushed rows, bounded by ``plan_append``'s
``max_new``) (README "Input policy"; attention over the sequence is NaN on
every implementation).

Vector-quantized formats (`jaxkv.VQFormat`) have the subclass
`jaxkv.VQModelCache` (`jaxkv/vq_model_cache.py`): the same append and
flag code, codes plus codebooks as the packed storage.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import (KVCache, QuantizedKV, ResidualBlockCache, check_int, flush_groups,
                         nan_groups, nonfinite_rows, quantize_kv, shift_residual, stage_residual,
                         appended_sinks)
from jaxkv import vq
from jaxkv.formats import KVFormat
from pallas_kernels import residual_write, token_append
from pallas_kernels._triton import offsets_overflow


def _static(**kw):
  return dataclasses.field(metadata=dict(static=True), **kw)


def check_layers(caches, layer_type: type) -> list:
  """``caches`` as a list of per-layer caches that `from_layers` can stack.

  Raises:
    TypeError: empty, or an item that is not a ``layer_type``.
    ValueError: a cache whose format, capacity, residual shape, dtype or
      (concrete) lengths differ from ``caches[0]``'s.
  """
  caches = list(caches)
  if not caches or not all(isinstance(c, layer_type) for c in caches):
    raise TypeError(f"caches must be a non-empty sequence of jaxkv.{layer_type.__name__}")
  first = caches[0]
  for i, c in enumerate(caches[1:], 1):
    if (c.fmt, c.capacity, c.k_residual.shape, c.dtype) != (
        first.fmt, first.capacity, first.k_residual.shape, first.dtype):
      raise ValueError(f"caches[{i}] differs from caches[0] in format, capacity or shapes")
    if _is_concrete(c.lengths) and _is_concrete(first.lengths) and not np.array_equal(
        np.asarray(c.lengths), np.asarray(first.lengths)):
      raise ValueError(f"caches[{i}].lengths differ from caches[0].lengths")
  return caches


def _integer_typed(x) -> bool:
  """A Python / numpy int (not a bool) or an array of an integer dtype (traced too)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
  return jnp.issubdtype(dtype, jnp.integer)


def check_layer_index(index, num_layers: int, name: str = "index") -> None:
  """Checks a layer index before it reaches `lax.dynamic_index_in_dim`.

  A concrete index (Python / numpy int, or an array that is not a tracer)
  must lie in ``[0, num_layers)``: negative indices are not supported (the
  dynamic slice would clamp them, as it clamps indices past the end). A
  traced index is only checked for an integer dtype; out of range it is
  clamped into ``[0, num_layers)`` by the slice.

  Raises:
    TypeError: a non-integer (float, bool) index.
    ValueError: a concrete index outside ``[0, num_layers)``, or not a scalar.
  """
  if not _integer_typed(index):
    raise TypeError(f"{name}={index!r} must be an integer layer index")
  if np.ndim(index) != 0:
    raise ValueError(f"{name} must be a scalar layer index, got shape {np.shape(index)}")
  if not _is_concrete(index):
    return
  i = int(index)
  if not 0 <= i < num_layers:
    raise ValueError(f"{name}={i} must lie in [0, num_layers={num_layers}) (negative indices "
                     "are not supported)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AppendPlan:
  """What one append does to each sequence; computed once per step for all layers.

  Attributes (all ``[B]``):
    num_new: tokens appended (0 where the append does not fit).
    old_lengths, new_lengths: lengths before / after.
    old_packed: packed tokens before (where flushed rows start).
    flush: tokens moved from the residual into the packed region (multiple of G).
    fits: False where the append would overflow ``capacity`` (skipped).
    window: (static) packed rows from ``old_packed`` that one append can flush
      at most (``None``: unknown; `ModelCache.commit` then scans every row).
    max_new: (static) the ``max_new`` the plan was made with (``None``:
      unknown); `ModelCache.append_layer` requires ``k_new.shape[1] >= max_new``.
  """

  num_new: jax.Array
  old_lengths: jax.Array
  new_lengths: jax.Array
  old_packed: jax.Array
  flush: jax.Array
  fits: jax.Array
  window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  max_new: int | None = dataclasses.field(default=None, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
  """Quantized KV caches of all layers of a model, stacked on a leading layer axis.

  Attributes:
    k, v: packed regions (`QuantizedKV`) whose arrays are
      ``[num_layers, B, Hkv, C, ...]``.
    k_residual, v_residual: ``[num_layers, B, Hkv, R, D]`` full-precision rows.
    lengths: ``[B]`` int32 tokens held per sequence (the same in every layer).
    overflow: ``[B]`` bool, an append was skipped because it did not fit.
    invalid: ``[B]`` bool, a traced call saw out-of-range ids or lengths.
    nonfinite: ``[B]`` bool, an append stored a NaN/inf K/V value or a NaN group
      (scale overflow) in some layer.
    fmt, capacity, use_kernel: as in `jaxkv.KVCache` (static).
    k_sink, v_sink: ``[num_layers, B, S, Hkv, D]`` exact copies of each
      sequence's first ``S = fmt.sink_tokens`` tokens per layer (rows past
      ``L`` zero), or None (S = 0): as `jaxkv.KVCache.k_sink`. Every append
      path writes them; `layer` / `dequantize` read them in place of the
      quantized rows ``[0, S)``.
  """

  k: QuantizedKV
  v: QuantizedKV
  k_residual: jax.Array
  v_residual: jax.Array
  lengths: jax.Array
  overflow: jax.Array
  invalid: jax.Array
  nonfinite: jax.Array
  fmt: KVFormat = _static()
  capacity: int = _static()
  use_kernel: bool = _static(default=False)
  k_sink: jax.Array | None = None
  v_sink: jax.Array | None = None

  # ------------------------------------------------------------ construction
  @classmethod
  def init(cls, fmt: KVFormat | str, num_layers: int, batch: int, kv_heads: int,
           head_dim: int, capacity: int, dtype: Any = jnp.bfloat16, *,
           use_kernel: bool | None = None) -> "ModelCache":
    """An empty cache; arguments as `jaxkv.KVCache.init` plus ``num_layers``."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) \
        or num_layers < 1:
      raise ValueError(f"num_layers={num_layers!r} must be an int >= 1")
    if vq.is_vq_format(fmt):
      raise ValueError(f"fmt={fmt!r} is a VQ format: use jaxkv.VQModelCache.init(..., "
                       "codebooks=) (or model.init_cache(fmt, ..., codebooks=))")
    one = jax.eval_shape(lambda: KVCache.init(fmt, batch, kv_heads, head_dim, capacity, dtype,
                                              use_kernel=use_kernel))
    stacked = lambda s: jnp.zeros((num_layers, *s.shape), s.dtype)  # noqa: E731
    return cls(
        k=jax.tree_util.tree_map(stacked, one.k), v=jax.tree_util.tree_map(stacked, one.v),
        k_residual=stacked(one.k_residual), v_residual=stacked(one.v_residual),
        lengths=jnp.zeros((batch,), jnp.int32), overflow=jnp.zeros((batch,), bool),
        invalid=jnp.zeros((batch,), bool), nonfinite=jnp.zeros((batch,), bool),
        fmt=one.fmt, capacity=one.capacity, use_kernel=one.use_kernel,
        **stacked_sinks(one, stacked))

  @classmethod
  def from_layers(cls, caches: Sequence[KVCache]) -> "ModelCache":
    """Stacks per-layer caches that agree on format, shapes and lengths.

    A sequence is flagged (``overflow``, ``nonfinite``) when any layer flags it.
    """
    caches = check_layers(caches, KVCache)
    first = caches[0]
    stack = lambda *xs: jnp.stack(xs)  # noqa: E731
    return cls(
        k=jax.tree_util.tree_map(stack, *[c.k for c in caches]),
        v=jax.tree_util.tree_map(stack, *[c.v for c in caches]),
        k_residual=stack(*[c.k_residual for c in caches]),
        v_residual=stack(*[c.v_residual for c in caches]),
        lengths=first.lengths,
        overflow=functools.reduce(jnp.logical_or, [c.overflow for c in caches]),
        invalid=jnp.zeros(first.lengths.shape, bool),  # per-layer caches have no such flag
        nonfinite=functools.reduce(jnp.logical_or, [c.nonfinite for c in caches]),
        fmt=first.fmt, capacity=first.capacity, use_kernel=first.use_kernel,
        **stack_sinks(caches))

  # -------------------------------------------------------------- properties
  @property
  def num_layers(self) -> int:
    return self.k_residual.shape[0]

  @property
  def batch(self) -> int:
    return self.k_residual.shape[1]

  @property
  def kv_heads(self) -> int:
    return self.k_residual.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k_residual.shape[4]

  @property
  def dtype(self):
    return self.k_residual.dtype

  @property
  def packed_lens(self) -> jax.Array:
    """``[B]`` tokens held quantized (every layer)."""
    return self.fmt.packed_len(self.lengths)

  @property
  def nbytes(self) -> int:
    """Device bytes held by the cache's arrays."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))

  def check(self) -> "ModelCache":
    """Raises ValueError if a sequence is flagged (overflow, invalid, nonfinite); returns self."""
    for name, flags, why in (
        ("overflow", self.overflow,
         f"KV cache overflow (capacity={self.capacity}): their appends were not applied"),
        ("invalid", self.invalid,
         "out-of-range token ids or lengths were passed under jit: their outputs are garbage"),
        ("nonfinite", self.nonfinite,
         "a NaN/inf key or value was stored: their attention outputs are NaN")):
      if _is_concrete(flags) and bool(np.any(np.asarray(flags))):
        bad = np.nonzero(np.asarray(flags))[0].tolist()
        raise ValueError(f"{why} (ModelCache.{name} set for sequences {bad})")
    return self

  # ------------------------------------------------------------------ views
  def layer(self, index, plan: AppendPlan | None = None) -> KVCache:
    """Layer ``index``'s `KVCache` (int or traced index; slices of the stacked storage).

    With ``plan`` the view has the lengths after that append (what attention
    over a layer just written by `append_layer` needs). A concrete ``index``
    must lie in ``[0, num_layers)`` (ValueError); a traced one is clamped
    into that range (`lax.dynamic_index_in_dim`).
    """
    check_layer_index(index, self.num_layers)
    take = lambda x: jax.lax.dynamic_index_in_dim(x, index, 0, keepdims=False)  # noqa: E731
    return KVCache(
        k=jax.tree_util.tree_map(take, self.k), v=jax.tree_util.tree_map(take, self.v),
        k_residual=take(self.k_residual), v_residual=take(self.v_residual),
        lengths=self.lengths if plan is None else plan.new_lengths,
        overflow=self.overflow if plan is None else self.overflow | ~plan.fits,
        nonfinite=self.nonfinite,
        fmt=self.fmt, capacity=self.capacity, use_kernel=self.use_kernel,
        **self._layer_sinks(take))

  def layer_view(self, index, plan: AppendPlan | None = None) -> "LayerView":
    """Layer ``index`` without slicing it out (what decode attention should get).

    `jaxkv.decode_attention` hands the stacked arrays and the index to the
    Pallas kernels (Triton and Mosaic), which read the layer in place; the
    reference takes `LayerView.materialize()`. Slicing first (`layer`) makes XLA copy
    the layer's whole storage into a fresh buffer for a kernel call on every
    step (measured on an H100: ~20 ms per Llama-3.1-8B step at 128K).

    A concrete ``index`` must lie in ``[0, num_layers)`` (ValueError); a
    traced one is clamped into that range by the readers.
    """
    check_layer_index(index, self.num_layers)
    return LayerView(
        stacked=self, index=jnp.asarray(index, jnp.int32),
        lengths=self.lengths if plan is None else plan.new_lengths,
        overflow=self.overflow if plan is None else self.overflow | ~plan.fits)

  def layers(self) -> tuple[KVCache, ...]:
    """Every layer's `KVCache` (copies; for inspection and tests)."""
    return tuple(self.layer(i) for i in range(self.num_layers))

  # ----------------------------------------------------------------- append
  def plan_append(self, num_new: jax.Array, max_new: int | None = None) -> AppendPlan:
    """The per-sequence effect of appending ``num_new [B]`` tokens (once per step).

    ``max_new`` (static, optional): the most tokens any sequence appends (the
    chunk length); it bounds the rows `commit` checks for groups stored as NaN.

    Raises:
      TypeError: ``num_new`` of a non-integer dtype.
      ValueError: ``num_new`` not ``[B]`` (or a scalar, for every sequence);
        ``max_new`` not an int >= 0; a concrete ``num_new`` below 0 or above
        ``max_new``; concrete lengths and ``num_new`` that would grow a
        sequence past ``capacity`` (`check_room`). (Traced, such counts are
        not checked: a sequence that does not fit appends nothing and is
        flagged ``overflow``.)
    """
    fmt = self.fmt
    window = None
    if max_new is not None:
      check_int("max_new", max_new, 0)
      max_new = int(max_new)
      g = fmt.token_group
      window = -(-(max_new + fmt.residual) // g) * g
    if isinstance(num_new, (list, tuple)):
      num_new = np.asarray(num_new)
    if not _integer_typed(num_new):
      raise TypeError(f"num_new={num_new!r} must be integer token counts")
    if np.ndim(num_new) == 0:
      num_new = jnp.full((self.batch,), num_new, jnp.int32)
    if tuple(np.shape(num_new)) != (self.batch,):
      raise ValueError(f"num_new.shape={tuple(np.shape(num_new))} must be ({self.batch},) "
                       f"(one count per sequence) or a scalar")
    if _is_concrete(num_new):
      counts = np.asarray(num_new)
      if counts.size and counts.min() < 0:
        raise ValueError(f"num_new={counts.tolist()} must be >= 0")
      if max_new is not None and counts.size and counts.max() > max_new:
        raise ValueError(f"num_new={counts.tolist()} must be <= max_new={max_new}")
      self.check_room(counts, "num_new")  # eager growth past capacity: an error, not a flag
    num_new = jnp.asarray(num_new, jnp.int32)
    fits = self.lengths + num_new <= self.capacity
    num_new = jnp.where(fits, num_new, 0)
    new_len = self.lengths + num_new
    old_packed = fmt.packed_len(self.lengths)
    return AppendPlan(num_new=num_new, old_lengths=self.lengths, new_lengths=new_len,
                      old_packed=old_packed, flush=fmt.packed_len(new_len) - old_packed,
                      fits=fits, window=window, max_new=max_new)

  def append_layer(self, index, k_new: jax.Array, v_new: jax.Array,
                   plan: AppendPlan) -> "ModelCache":
    """Writes the first ``plan.num_new[b]`` rows of ``k_new, v_new [B, T, Hkv, D]`` into a layer.

    Lengths are not advanced (all layers append at the same positions; call
    `commit` once after the last layer). The packed-region write (two pack
    kernels and six scatters per layer) runs under a `lax.cond` on "any
    sequence flushes": a decode step flushes on one step in G. One token per
    sequence with ``R == G`` (a decode step of every preset but quantspec)
    takes `_append_token`, which writes only the new row.

    Raises (checks of static shapes and concrete values only):
      ValueError: a concrete ``index`` outside ``[0, num_layers)`` (a traced
        one is clamped); k/v batch, kv heads or head_dim unlike the cache's;
        fewer rows ``T`` than ``plan.max_new`` (or, without it, than a
        concrete ``plan.num_new``).
      TypeError: k/v not in the cache dtype.
    """
    self._check_append(index, k_new, v_new, plan, "append_layer")
    if self._token_path(k_new):
      new = self._append_token(index, k_new, v_new, plan)
      return dataclasses.replace(new, **new._write_sinks(index, k_new, v_new, plan))
    return self.append_layer_with_history(index, k_new, v_new, plan, lazy_flush=True)[0]

  def _token_path(self, k_new) -> bool:
    """Whether an append of ``k_new [B, T, H, D]`` takes `_append_token` (T = 1, R = G)."""
    return k_new.shape[1] == 1 and self.fmt.residual == self.fmt.token_group

  def _write_sinks(self, index, k_new, v_new, plan: AppendPlan) -> dict:
    """``{k_sink, v_sink}`` with layer ``index``'s new rows at positions ``< S``
    written (a scatter of at most S rows per sequence, in place), or ``{}`` (S = 0)."""
    return appended_sinks(self, k_new, v_new, plan.old_lengths, plan.num_new, layer=index)

  def _layer_sinks(self, take) -> dict:
    """``{k_sink, v_sink}`` of one layer (``take`` slices the layer axis), or ``{}``."""
    if self.k_sink is None:
      return {}
    return dict(k_sink=take(self.k_sink), v_sink=take(self.v_sink))

  def _check_append(self, index, k_new, v_new, plan: AppendPlan, what: str) -> None:
    """The Python-level checks of `append_layer` (nothing is added to a trace)."""
    check_layer_index(index, self.num_layers)
    # The same shape / dtype checks as `KVCache.append` (``self`` has the same
    # batch, kv_heads, head_dim and dtype properties).
    ResidualBlockCache._validate_kv(self, k_new, v_new, what)  # pylint: disable=protected-access
    t = k_new.shape[1]
    if plan.max_new is not None:
      if t < plan.max_new:
        raise ValueError(f"{what}: k_new.shape[1]={t} rows < max_new={plan.max_new} of the plan")
    elif _is_concrete(plan.num_new):
      counts = np.asarray(plan.num_new)
      if counts.size and counts.max() > t:
        raise ValueError(f"{what}: plan.num_new={counts.tolist()} exceeds the "
                         f"k_new.shape[1]={t} rows given")

  def _append_token(self, index, k_new: jax.Array, v_new: jax.Array,
                    plan: AppendPlan) -> "ModelCache":
    """`append_layer` of one token per sequence when ``R == G`` (a decode step).

    With ``R == G`` a one-token append never shifts the residual: the token
    goes to row ``res_len``, and when that fills the block (``res_len ==
    G - 1``) the whole block is the group to flush, after which the residual
    is empty. So a step writes the new row (or zeros over a flushed block)
    into the stacked residual in place (`pallas_kernels.residual_write`)
    instead of restaging the ``[B, Hkv, R, D]`` block (which cost ~3.7 ms of
    a 43 ms kivi4 step at B=49, 32K, H100). The block to flush is quantized
    under the flush `lax.cond` from the stacked residual (read in place) plus
    the new row; the write depends on the cond's output (its "flushed" flags
    for the XLA scatter; the packed K codes, as an input it only waits for,
    for the kernel), so it runs after those reads and updates the buffer in
    place. The storage is bitwise what
    `append_layer_with_history` writes (rows past the length stay zero).

    On a GPU (or with ``use_kernel``) for the plain formats, one launch
    (`pallas_kernels.token_append`) does all of it, the flush included, so
    the decode step has no flush `lax.cond` at all.
    """
    r = self.fmt.residual
    res_len = plan.old_lengths - plan.old_packed                       # [B] in [0, R)
    flushing = plan.flush > 0                                           # [B]
    news = tuple(x[:, 0] for x in (k_new, v_new))                       # [B, H, D] each
    out = {}

    def write(operands):
      sides, residuals = operands[:2], operands[2:]
      blocks = []
      at_row = (jnp.arange(r)[None, :] == res_len[:, None])[:, None, :, None]  # [B, 1, R, 1]
      for residual, new in zip(residuals, news):
        block = jax.lax.dynamic_index_in_dim(residual, index, 0, keepdims=False)  # [B,H,R,D]
        blocks.append(jnp.where(at_row, new[:, :, None, :].astype(block.dtype), block))
      return (*self._flush_rows(sides, index, blocks, plan), flushing)

    def keep(operands):
      return (*operands[:2], jnp.zeros_like(flushing))

    on_gpu = jax.default_backend() == "gpu"
    kernel = ((self.use_kernel or on_gpu) and isinstance(index, (int, np.integer))
              and residual_write.supported(self.k_residual.shape))
    row = jnp.where(plan.num_new > 0, res_len, r)                       # [B]; r: none
    sides = (self.k, self.v)
    if kernel and all(isinstance(s, QuantizedKV) and not s.hierarchical for s in sides):
      info = tuple((s.bits, s.axis, s.group) for s in sides)
      packed = tuple((s.codes,) if s.bits == 16 else (s.codes, s.scale, s.zero)
                     for s in sides)
      if (token_append.supported(*info, self.k_residual.shape, self.fmt.token_group)
          and token_append.addressable(*info, self.k_residual, self.v_residual, *packed)):
        # One launch writes the row or flushes the filled block in place: no
        # flush `lax.cond` (`pallas_kernels.token_append`; it writes 2-4 GiB
        # code arrays as uint16 words, which the Triton lowering addresses
        # right, `pallas_kernels._triton.offsets_overflow`).
        k_res, v_res, k_arr, v_arr, bad = token_append.append_token(
            self.k_residual, self.v_residual, *news, row, flushing, plan.old_packed, *packed,
            layer=int(index), k_side=info[0], v_side=info[1], interpret=not on_gpu)
        k_side, v_side = (dataclasses.replace(s, **dict(zip(("codes", "scale", "zero"), a)))
                          for s, a in zip(sides, (k_arr, v_arr)))
        return dataclasses.replace(self, k=k_side, v=v_side, k_residual=k_res,
                                   v_residual=v_res, nonfinite=self.nonfinite | bad)
    operands = (self.k, self.v, self.k_residual, self.v_residual)
    # The residual write kernel takes the packed K codes as an operand (below):
    # not where the Triton lowering would address them wrongly (1-byte codes of
    # 2-4 GiB, `pallas_kernels._triton.offsets_overflow`).
    kernel = kernel and offsets_overflow(*jax.tree_util.tree_leaves(operands)) is None
    if kernel:  # the cond's flags are `flushing` itself (keep runs only when none flushes)
      out["k"], out["v"] = jax.lax.cond(jnp.any(flushing), lambda o: write(o)[:2],
                                        lambda o: keep(o)[:2], operands)
      cleared = flushing
    else:
      out["k"], out["v"], cleared = jax.lax.cond(jnp.any(flushing), write, keep, operands)
    # A flushed sequence's R rows become zeros, any other sequence gets its
    # new row at res_len (none if it did not fit): one Pallas launch for both
    # sides (on a GPU, or with use_kernel; a static layer index), else one XLA
    # scatter per side (the kernel's reference). Either write must follow the
    # cond's reads of the residual: the XLA one takes the cond's flags, the
    # kernel its packed K codes as an input it only waits for (so no per-layer
    # kernel turns the step-wide flags into the kernel's int vector).
    # The write also reports a NaN/inf in a written token (`nonfinite`): the
    # kernel reads the token anyway (two XLA reductions per layer otherwise).
    args = (self.k_residual, self.v_residual, *news, row, cleared)
    if kernel:
      out["k_residual"], out["v_residual"], bad = residual_write.write_token_rows(
          *args, layer=int(index), interpret=not on_gpu, after=(out["k"].codes,))
    else:
      out["k_residual"], out["v_residual"], bad = residual_write.write_token_rows_reference(
          *args, layer=index)
    out["nonfinite"] = self.nonfinite | bad
    return dataclasses.replace(self, **out)

  def _flush_rows(self, sides, index, rows, plan: AppendPlan) -> tuple[QuantizedKV, QuantizedKV]:
    """Quantizes ``rows`` (K and V ``[B, H, n, D]``) and writes the first
    ``plan.flush[b]`` of each at ``old_packed``.

    Quantized for all sequences, kept only where one flushes: the pack kernel
    skips the sequences that do not (``active``), and packs K and V in one
    launch where it can (`jaxkv.cache.quantize_kv`).
    """
    packed = quantize_kv(*sides, *rows, self.fmt.scale_dtype,  # reads only static fields
                         use_kernel=self.use_kernel, active=plan.flush > 0)
    return tuple(_write_rows(side, index, *arrays, plan.old_packed, plan.flush)
                 for side, arrays in zip(sides, packed))

  def append_layer_with_history(self, index, k_new: jax.Array, v_new: jax.Array,
                                plan: AppendPlan, *, lazy_flush: bool = False
                                ) -> tuple["ModelCache", KVCache]:
    """`append_layer`, also returning the layer's `KVCache` view *before* the append.

    The view is what a prefill chunk attends to. It is read after the write
    (packed rows ``< old_packed`` are never written by an append) except for
    the residual block, whose valid rows are taken from the staging
    temporary (computed before the write). Reading the stacked storage
    before writing it would make XLA copy the whole stacked array to keep
    the old version.

    ``lazy_flush`` (static): quantize and write the flushed groups under a
    `lax.cond` that skips them when no sequence flushes (the write changes
    nothing then). Only the packed sides are the cond's operands: with the
    residual inside it, XLA copied the stacked residual in and out of the
    cond on every layer (`tests/test_model_cache.py` checks the compiled step).

    Raises as `append_layer`.
    """
    self._check_append(index, k_new, v_new, plan, "append_layer_with_history")
    new, old_res, to_pack = self._stage_layer(index, k_new, v_new, plan)
    new = new._flush_layers([(index, to_pack)], plan, lazy=lazy_flush)
    history = dataclasses.replace(new.layer(index), k_residual=old_res[0],
                                  v_residual=old_res[1], lengths=self.lengths,
                                  overflow=self.overflow, nonfinite=self.nonfinite)
    return new, history

  def append_layers(self, k_news, v_news, plan: AppendPlan) -> "ModelCache":
    """`append_layer` of every layer (``k_news`` / ``v_news``: one ``[B, T, Hkv, D]``
    array per layer, in layer order), with one flush `lax.cond` for all layers.

    For a commit of a few tokens (a speculative round's accepted block) where
    every layer's K/V is known before the cache is written: `append_layer`
    per layer runs one flush cond per layer, and a cond's branch choice is a
    host round trip on the GPU (~31 us per layer inside a decode loop on an
    H200, `bench/results/e2e-NOTES.md`, 2026-11-29). Every layer's rows to
    pack (``[B, Hkv, n_groups * G, D]`` per side) stay live until the one
    cond: for prefill-sized T, `append_layer` per layer holds less. The
    storage is bitwise what `append_layer` per layer writes. One-token appends
    with ``R == G`` (every preset's decode step but quantspec's) take
    `append_layer`'s token path per layer: on a GPU one kernel launch per
    layer with no cond (`pallas_kernels.token_append`), elsewhere (or where
    that kernel does not apply) its flush cond per layer.

    Raises as `append_layer`, and ``ValueError`` unless there is one K and one V
    per layer, all of one shape.
    """
    k_news, v_news = list(k_news), list(v_news)
    if len(k_news) != self.num_layers or len(v_news) != self.num_layers:
      raise ValueError(f"append_layers: {len(k_news)} K and {len(v_news)} V arrays for "
                       f"num_layers={self.num_layers} (one of each per layer)")
    shapes = {tuple(np.shape(x)) for x in (*k_news, *v_news)}
    if len(shapes) != 1:
      raise ValueError(f"append_layers: every layer's K and V must have one shape "
                       f"[B, T, Hkv, D]; got {sorted(shapes)}")
    if self._token_path(k_news[0]):
      new = self
      for index, (k_new, v_new) in enumerate(zip(k_news, v_news)):
        new = new.append_layer(index, k_new, v_new, plan)
      return new
    for index, (k_new, v_new) in enumerate(zip(k_news, v_news)):
      self._check_append(index, k_new, v_new, plan, "append_layers")
    new, flushes = self, []
    for index, (k_new, v_new) in enumerate(zip(k_news, v_news)):
      new, _, to_pack = new._stage_layer(index, k_new, v_new, plan)
      flushes.append((index, to_pack))
    return new._flush_layers(flushes, plan, lazy=True)

  def _stage_layer(self, index, k_new: jax.Array, v_new: jax.Array, plan: AppendPlan):
    """The residual half of an append to layer ``index``: ``(cache, old_res, to_pack)``
    with the layer's residual block and sinks written and ``nonfinite`` updated (the
    packed sides unchanged), the history's residual rows ``(K, V)`` (a temporary
    computed before the write; rows past ``res_len`` masked) and the rows to flush
    ``[K, V]`` (``[B, H, n_groups * G, D]`` each, for `_flush_layers`)."""
    fmt, g, r = self.fmt, self.fmt.token_group, self.fmt.residual
    t = k_new.shape[1]
    n_groups = flush_groups(fmt, t)
    res_len = plan.old_lengths - plan.old_packed
    keep = plan.new_lengths - plan.old_packed - plan.flush
    out, old_res, to_pack = {}, [], []
    out["nonfinite"] = (self.nonfinite | nonfinite_rows(k_new, plan.num_new)
                        | nonfinite_rows(v_new, plan.num_new))
    for name, new in (("k", k_new), ("v", v_new)):
      residual = getattr(self, f"{name}_residual")
      layer_res = jax.lax.dynamic_index_in_dim(residual, index, 0, keepdims=False)
      staged = stage_residual(layer_res, new.astype(residual.dtype), res_len, plan.num_new,
                              n_groups * g + r)                     # [B, H, S, D]
      old_res.append(staged[:, :, :r])
      to_pack.append(staged[:, :, : n_groups * g])
      new_res = shift_residual(staged, plan.flush, keep, r)         # [B, H, R, D]
      out[f"{name}_residual"] = jax.lax.dynamic_update_index_in_dim(
          residual, new_res.astype(residual.dtype), index, 0)
    out.update(self._write_sinks(index, k_new, v_new, plan))
    return dataclasses.replace(self, **out), tuple(old_res), to_pack

  def _flush_layers(self, flushes, plan: AppendPlan, *, lazy: bool) -> "ModelCache":
    """Quantizes and writes each ``(index, to_pack)`` of ``flushes`` into the packed
    sides (`_flush_rows`); ``lazy``: under one `lax.cond` that skips them all when no
    sequence flushes. Only the packed sides are the cond's operands (with a
    residual in it XLA copied the stacked residual in and out of the cond)."""
    def write(sides):
      for index, to_pack in flushes:
        sides = self._flush_rows(sides, index, to_pack, plan)
      return sides

    sides = (self.k, self.v)
    if lazy:
      k, v = jax.lax.cond(jnp.any(plan.flush > 0), write, lambda s: s, sides)
    else:
      k, v = write(sides)
    return dataclasses.replace(self, k=k, v=v)

  def commit(self, plan: AppendPlan) -> "ModelCache":
    """Advances ``lengths`` and ``overflow`` after every layer's `append_layer`, and
    flags ``nonfinite`` where a group flushed by this append was stored as NaN
    (finite values whose scale or zero overflows ``fmt.scale_dtype``, as
    `jaxkv.KVCache` flags them): one check over all layers, of the rows
    ``plan.window`` allows."""
    bad = functools.reduce(jnp.logical_or, (nan_groups(side, plan.old_packed, plan.flush,
                                                       plan.window) for side in (self.k, self.v)))
    return dataclasses.replace(self, lengths=plan.new_lengths,
                               overflow=self.overflow | ~plan.fits,
                               nonfinite=self.nonfinite | bad)

  def flag_invalid(self, bad: jax.Array) -> "ModelCache":
    """Sets ``invalid`` for sequences where ``bad [B]`` is True."""
    return dataclasses.replace(self, invalid=self.invalid | bad)

  def flag_overflow(self, bad: jax.Array) -> "ModelCache":
    """Sets ``overflow`` for sequences where ``bad [B]`` is True."""
    return dataclasses.replace(self, overflow=self.overflow | bad)

  def check_model(self, config) -> None:
    """``ValueError`` unless the cache was made for a model of ``config``
    (``num_layers``, ``num_kv_heads``, ``head_dim``)."""
    c = config
    if (self.num_layers, self.kv_heads, self.head_dim) != (
        c.num_layers, c.num_kv_heads, c.head_dim):
      raise ValueError(
          f"cache (num_layers={self.num_layers}, kv_heads={self.kv_heads}, "
          f"head_dim={self.head_dim}) does not fit the model (num_layers={c.num_layers}, "
          f"kv_heads={c.num_kv_heads}, head_dim={c.head_dim})")

  def check_room(self, num_new, name: str) -> None:
    """``ValueError`` naming ``name`` if appending ``num_new`` (``[B]`` or a
    scalar) tokens would grow a sequence past ``capacity``; nothing when the
    lengths or ``num_new`` are traced (then the append is skipped and
    ``overflow`` set)."""
    if not (_is_concrete(self.lengths) and _is_concrete(num_new)):
      return
    lengths = np.asarray(self.lengths, np.int64)
    total = lengths + np.broadcast_to(np.asarray(num_new, np.int64), lengths.shape)
    bad = np.nonzero(total > self.capacity)[0].tolist()
    if bad:
      raise ValueError(
          f"{name}: sequences {bad} would grow past capacity={self.capacity} "
          f"(lengths {lengths[bad].tolist()} + {name} -> {total[bad].tolist()}); "
          f"use a larger capacity in init_cache")

  # --------------------------------------------------------------- readback
  def dequantize(self, view: str = "target") -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` float32 ``[num_layers, B, capacity, Hkv, D]``; see `KVCache.dequantize`."""
    pairs = [c.dequantize(view) for c in self.layers()]
    return jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs])


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def stacked_sinks(one, stacked) -> dict:
  """``{k_sink, v_sink}`` of an empty stacked cache (``stacked`` maps one layer's
  shape to zeros ``[L, ...]``) from one layer's ``one`` (shapes), or ``{}`` (S = 0)."""
  if one.k_sink is None:
    return {}
  return dict(k_sink=stacked(one.k_sink), v_sink=stacked(one.v_sink))


def stack_sinks(caches) -> dict:
  """``{k_sink, v_sink}`` ``[L, B, S, Hkv, D]`` stacked from per-layer caches, or ``{}``."""
  if caches[0].k_sink is None:
    return {}
  return {name: jnp.stack([getattr(c, name) for c in caches]) for name in ("k_sink", "v_sink")}


def _scatter_rows(dst, index, src, start, count):
  """Writes rows ``[0, count_b)`` of ``src [B, H, n, X]`` at rows ``start_b`` of layer ``index``.

  ``dst`` is ``[L, B, H, C, X]``; rows past ``count_b`` go out of bounds and
  are dropped, so nothing else changes and the scatter updates ``dst`` in place.
  """
  b, _, n, _ = src.shape
  pos = jnp.arange(n)[None, :]                                          # [1, n]
  rows = jnp.where(pos < count[:, None], start[:, None] + pos, dst.shape[3])  # [B, n]
  seq = jnp.arange(b)[:, None]                                          # [B, 1]
  # Advanced indices (index, seq, rows) around the head slice: update is [B, n, H, X].
  return dst.at[index, seq, :, rows].set(jnp.swapaxes(src, 1, 2).astype(dst.dtype),
                                         mode="drop")


def _write_rows(side: QuantizedKV, index, codes, scale, zero, start, count) -> QuantizedKV:
  """`QuantizedKV.write` into layer ``index`` of a stacked side."""
  new_codes = _scatter_rows(side.codes, index, codes, start, count)
  if side.bits == 16:
    return dataclasses.replace(side, codes=new_codes)
  if side.axis == "channel":
    g = side.group
    start, count = start // g, count // g
  return dataclasses.replace(
      side, codes=new_codes, scale=_scatter_rows(side.scale, index, scale, start, count),
      zero=_scatter_rows(side.zero, index, zero, start, count))


__all__ = ["AppendPlan", "ModelCache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerView:
  """One layer of a `ModelCache` as (stacked storage, layer index).

  Attributes:
    stacked: the model cache (its lengths may predate ``lengths``).
    index: ``[]`` int32 layer (may be traced, e.g. a scan index).
    lengths, overflow: ``[B]`` the layer's lengths / flags to attend with.
  """

  stacked: ModelCache
  index: jax.Array
  lengths: jax.Array
  overflow: jax.Array

  def materialize(self) -> KVCache:
    """The layer's `KVCache` (a slice of the stacked arrays)."""
    return dataclasses.replace(self.stacked, lengths=self.lengths,
                               overflow=self.overflow).layer(self.index)

  def __getattr__(self, name):
    """Shape facts (fmt, batch, kv_heads, head_dim, dtype, capacity, ...) of the stack."""
    if name in ("fmt", "batch", "kv_heads", "head_dim", "dtype", "capacity", "use_kernel"):
      return getattr(self.stacked, name)
    raise AttributeError(name)

  @property
  def storage_len(self) -> int:
    return self.stacked.k.codes.shape[3]

  @property
  def nonfinite(self) -> jax.Array:
    """``[B]`` the model cache's flag (any layer stored a NaN/inf K/V value)."""
    return self.stacked.nonfinite
