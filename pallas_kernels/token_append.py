"""A decode step's whole cache write for one layer in one launch (Pallas Triton).

With ``R == G`` a one-token append either writes the token into its
residual row, or (when the token fills the block, ``res_len == G - 1``)
flushes the block: the ``G - 1`` residual rows plus the token are one
quantization group, stored at packed row ``old_packed``, and the block
becomes zeros. `residual_write` does the first in place and leaves the
second to XLA under a `lax.cond` (its conditional node and predicate copy
cost ~3.6 us plus launch gaps per layer on every step, 2026-11-26 anatomy).
This kernel does both: one program per sequence over every kv head packs the
block with `pack`'s own per-channel / per-token bodies (the same bits as the
pack kernel, hence as `jaxkv.quant`), stores codes, scales and zeros in
place into the stacked packed arrays (aliased), clears the block, and
reports NaN/inf tokens like `residual_write`.

Pallas Triton takes one indexer per load or store, so the pack bodies see
small adapters (`_Rows`, `_At`) that prepend the head and offset the token
rows instead of ``ref.at[...]`` views.

Code arrays of 2-4 GiB, which the Triton lowering would address with
overflowing int32 offsets (`_triton.offsets_overflow`), are written as uint16
words (`_triton.word_view`; the pack bodies' ``words=True``): see
`addressable` for what that covers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _triton, pack
from pallas_kernels.residual_write import token_codes


class _Rows:
  """Reads rows ``[t0, t0 + n)`` of head ``h`` of a residual block ``[H, R, D]``
  with row ``sub`` replaced by the new token ``new_ref [H, D]`` (the block to
  flush: the residual rows before it plus the token)."""

  def __init__(self, res_ref, new_ref, h, t0, n, sub):
    self._res, self._new, self._h, self._t0, self._n, self._sub = res_ref, new_ref, h, t0, n, sub
    self.shape = (n, res_ref.shape[-1])
    self.dtype = res_ref.dtype

  def __getitem__(self, idx):
    rows, cols = idx
    assert rows == slice(None), rows
    tile = self._res[self._h, pl.ds(self._t0, self._n), cols]          # [n, w]
    new = self._new[self._h, cols]                                      # [w]
    row = self._t0 + jax.lax.broadcasted_iota(jnp.int32, (self._n, 1), 0)
    return jnp.where(row == self._sub, new[None, :].astype(tile.dtype), tile)


class _At:
  """Stores into ``ref [H, C, X]`` at head ``h`` and token rows ``rows`` (a
  `pl.ds`, or one row index for a per-channel scale row): ``at[cols] = v``,
  ``at[:, cols] = v``, or ``at[...] = v`` (columns ``cols``, default all)."""

  def __init__(self, ref, h, rows, cols=None):
    self._ref, self._h, self._rows = ref, h, rows
    self._cols = slice(None) if cols is None else cols
    self.dtype = ref.dtype

  def __setitem__(self, idx, value):
    if idx is Ellipsis:
      idx = self._cols
    elif isinstance(idx, tuple):   # (all rows of the block, cols)
      assert idx[0] == slice(None), idx
      idx = idx[1]
    self._ref[self._h, self._rows, idx] = value.astype(self._ref.dtype)


def _pack_side(side, res_ref, new_ref, refs, h, start, *, rows: int, block_t: int,
               words: bool = False):
  """Quantizes the flushed block of head ``h`` into ``refs`` (codes[, scale, zero]
  ``[H, C, ...]``) at packed token row ``start`` (a multiple of G). ``words``:
  a quantized side's codes are `_triton.word_view` words (``[H, C, W / 2]``
  uint16)."""
  bits, axis, group = side
  if bits == 16:
    for t0 in range(0, rows, block_t):
      x = _Rows(res_ref, new_ref, h, t0, block_t, rows - 1)[slice(None), slice(None)]
      refs[0][h, pl.ds(start + t0, block_t), :] = x.astype(refs[0].dtype)
    return
  codes, scale, zero = refs
  if axis == "channel":  # one group of G = rows tokens: scale/zero row start // G
    width = res_ref.shape[-1] * bits // 8 // (2 if words else 1)   # code columns
    block_w = min(16, width)
    x = _Rows(res_ref, new_ref, h, 0, rows, rows - 1)
    grp = start // rows
    for j in range(width // block_w):
      pack._pack_per_channel_kernel(
          x, _At(codes, h, pl.ds(start, rows), pl.ds(j * block_w, block_w)),
          _At(scale, h, grp), _At(zero, h, grp), bits=bits, block_w=block_w, col_block=j,
          words=words)
    return
  for t0 in range(0, rows, block_t):
    pack._pack_per_token_kernel(
        _Rows(res_ref, new_ref, h, t0, block_t, rows - 1),
        _At(codes, h, pl.ds(start + t0, block_t)), _At(scale, h, pl.ds(start + t0, block_t)),
        _At(zero, h, pl.ds(start + t0, block_t)), bits=bits, channel_group=group, words=words)


def _kernel(code_ref, start_ref, k_new_ref, v_new_ref, *refs, rows: int, heads: int,
            k_side, v_side, nk: int, nv: int, block_t: int, barrier: bool, words: bool):
  outs = refs[2 + nk + nv:]  # the inputs before them are aliased to them
  bad_out = outs[-1]
  k_out, v_out = outs[0], outs[1]
  k_packed, v_packed = outs[2:2 + nk], outs[2 + nk:2 + nk + nv]
  b = pl.program_id(0)  # read outside `pl.when` (interpret mode needs it there)
  row = code_ref[b]      # -1: flush the block and clear it; [0, rows): write that row
  start = start_ref[b]   # packed row of the flushed group
  # The flush's heads run in a loop (one layer's kernel is compiled per layer
  # index). The flags and the common one-row write take every head at once
  # when the head count is a power of two (Triton's tensors must be): one
  # [H, D] load per side instead of a serial chain of per-head loads (~4.5 ->
  # ~2 us per layer of a B = 1 step).
  vector = _triton.is_pow2(heads)
  if vector:
    bad = jnp.maximum(_triton.any_nonfinite(k_new_ref[...]).astype(jnp.int32),
                      _triton.any_nonfinite(v_new_ref[...]).astype(jnp.int32))
  else:
    def flags(h, bad):  # an int32 max: Triton has no max of bools
      for x in (k_new_ref[h, :], v_new_ref[h, :]):
        bad = jnp.maximum(bad, _triton.any_nonfinite(x).astype(jnp.int32))
      return bad

    bad = jax.lax.fori_loop(0, heads, flags, jnp.zeros((), jnp.int32))

  @pl.when(row == -1)
  def _():
    def flush(h, carry):
      _pack_side(k_side, k_out, k_new_ref, k_packed, h, start, rows=rows, block_t=block_t,
                 words=words)
      _pack_side(v_side, v_out, v_new_ref, v_packed, h, start, rows=rows, block_t=block_t,
                 words=words)
      return carry

    jax.lax.fori_loop(0, heads, flush, 0)
    if barrier:  # every warp's reads of the block before any warp clears it
      plt.debug_barrier()

    def clear(h, carry):
      k_out[h, :, :] = jnp.zeros(k_out.shape[1:], k_out.dtype)
      v_out[h, :, :] = jnp.zeros(v_out.shape[1:], v_out.dtype)
      return carry

    jax.lax.fori_loop(0, heads, clear, 0)

  @pl.when((row >= 0) & (row < rows))
  def _():
    if vector:
      k_out[:, pl.ds(row, 1), :] = k_new_ref[...][:, None, :].astype(k_out.dtype)
      v_out[:, pl.ds(row, 1), :] = v_new_ref[...][:, None, :].astype(v_out.dtype)
      return

    def write(h, carry):
      k_out[h, pl.ds(row, 1), :] = k_new_ref[h, :][None, :].astype(k_out.dtype)
      v_out[h, pl.ds(row, 1), :] = v_new_ref[h, :][None, :].astype(v_out.dtype)
      return carry

    jax.lax.fori_loop(0, heads, write, 0)

  written = (row == -1) | ((row >= 0) & (row < rows))
  bad_out[b] = jnp.where(written, bad, 0)


def _word_writes(side, head_dim: int) -> bool:
  """Whether a quantized side's codes can be written as uint16 words: rows of
  an even number of bytes and, per token, runs of an even number (>= 2) of
  channels per plane (the pack body's chunks)."""
  bits, axis, group = side
  width = head_dim * bits // 8
  return width % 2 == 0 and (axis != "token" or min(width, group) % 2 == 0)


def addressable(k_side, v_side, k_residual, v_residual, k_packed, v_packed) -> bool:
  """Whether `append_token` addresses these operands right: every operand
  outside the Triton lowering's overflowing int32 offsets
  (`_triton.offsets_overflow`), or only quantized code arrays inside them and
  those writable as words (`_word_writes`). Otherwise `append_token` raises
  `ValueError` (the model cache takes its XLA path)."""
  head_dim = k_residual.shape[-1]
  others = [k_residual, v_residual]
  for side, packed in ((k_side, tuple(k_packed)), (v_side, tuple(v_packed))):
    if side[0] < 16 and _triton.offsets_overflow(packed[0]):
      if not _word_writes(side, head_dim):
        return False
      others += packed[1:]
    else:
      others += packed
  return _triton.offsets_overflow(*others) is None


def supported(k_side, v_side, residual_shape, token_group: int) -> bool:
  """Whether `append_token` serves these sides (``(bits, axis, group)``; no
  hierarchical ones) and a residual ``[L, B, H, R, D]`` with ``R == G``."""
  _, _, _, r, d = residual_shape
  if r != token_group or not (_triton.is_pow2(r) and _triton.is_pow2(d)):
    return False
  for bits, axis, group in (k_side, v_side):
    if bits not in (16, 8, 4, 2):
      return False
    if bits < 16 and axis == "channel" and group != r:
      return False
    if bits < 16 and axis == "token" and (d % group or not _triton.is_pow2(group)):
      return False
  return True


@functools.partial(jax.jit, static_argnames=("layer", "k_side", "v_side", "interpret", "words"))
def append_token(k_residual, v_residual, k_new, v_new, row, clear, start, k_packed, v_packed,
                 *, layer: int, k_side, v_side, interpret: bool = False,
                 words: bool | None = None):
  """One decode token per sequence into layer ``layer``: its residual row, or the
  flush of the filled block into the packed region, in place.

  Args:
    k_residual, v_residual: ``[L, B, H, R, D]`` with ``R == G``.
    k_new, v_new: ``[B, H, D]`` the tokens.
    row: ``[B]`` int32 residual row of each token; ``>= R``: none.
    clear: ``[B]`` bool: the token fills the block (``row == R - 1``): quantize
      the block with it into packed rows ``[start_b, start_b + G)`` and zero it.
    start: ``[B]`` int32 packed row of the flushed group (``old_packed``).
    k_packed, v_packed: each side's stacked packed arrays, ``(codes, scale,
      zero)`` (``(codes,)`` for a 16-bit side), ``[L, B, H, C, ...]``.
    layer: static layer index.
    k_side, v_side: static ``(bits, axis, group)`` of each side.
    interpret: Pallas interpret mode (CPU).
    words: write the quantized sides' codes as `_triton.word_view` uint16
      words (same bytes). None: where a code array of 2-4 GiB would
      otherwise be addressed wrongly (`_triton.offsets_overflow`; a stacked
      kivi4 cache of 32 layers at one sequence of more than 128K tokens, or
      5-8 sequences of 32K).
  Returns:
    ``(k_residual, v_residual, k_packed, v_packed, nonfinite [B])``, each array
    updated in place under an outer `jit` with donated or loop-carried
    buffers.
  """
  num_layers, b, h, r, d = k_residual.shape
  if not 0 <= layer < num_layers:
    raise ValueError(f"layer={layer} must be in [0, {num_layers})")
  if not supported(k_side, v_side, k_residual.shape, r):
    raise ValueError(f"sides {k_side}, {v_side} with residual {k_residual.shape} are not "
                     "supported (token_append.supported)")
  code, flags = token_codes(row, clear)
  start_pad, _ = _triton.flags_block(start)
  k_packed, v_packed = tuple(k_packed), tuple(v_packed)
  quantized = [(s, p) for s, p in ((k_side, k_packed), (v_side, v_packed)) if s[0] < 16]
  if words is None:
    words = any(_triton.offsets_overflow(p[0]) for _, p in quantized)
  if words and not all(_word_writes(s, d) for s, _ in quantized):
    raise ValueError(f"sides {k_side}, {v_side} of head_dim {d}: codes not writable as "
                     "uint16 words (odd row bytes or per-token runs of one channel)")
  if words:  # the code arrays as uint16 words (free views)
    k_packed, v_packed = _codes_viewed(k_side, v_side, k_packed, v_packed, _triton.word_view)
  token = pl.BlockSpec((None, h, d), lambda i: (i, 0, 0))

  def whole(x):  # the sequence's [H, ...] slab of the layer, indexed in the kernel
    return pl.BlockSpec((None, None, *x.shape[2:]), lambda i: (layer, i) + (0,) * (x.ndim - 2))

  stacked = (k_residual, v_residual, *k_packed, *v_packed)
  specs = [whole(x) for x in stacked]
  first = 4  # code, start, k_new, v_new
  out = _triton.pallas_call(
      functools.partial(_kernel, rows=r, heads=h, k_side=k_side, v_side=v_side,
                        nk=len(k_packed), nv=len(v_packed), block_t=min(64, r),
                        barrier=not interpret, words=words),
      grid=(b,),
      in_specs=[flags, flags, token, token, *specs],
      out_specs=[*specs, flags],
      out_shape=[*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in stacked),
                 jax.ShapeDtypeStruct(code.shape, jnp.int32)],
      input_output_aliases={first + i: i for i in range(len(stacked))},
      compiler_params=_triton.compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name="jaxkv_token_append",
  )(code, start_pad, k_new, v_new, *stacked)
  nk = len(k_packed)
  k_out, v_out = tuple(out[2:2 + nk]), tuple(out[2 + nk:-1])
  if words:
    k_out, v_out = _codes_viewed(k_side, v_side, k_out, v_out, _triton.byte_view)
  return (out[0], out[1], k_out, v_out, out[-1][:b] > 0)


def _codes_viewed(k_side, v_side, k_packed, v_packed, view):
  """Each side's arrays with a quantized side's codes through ``view``."""
  return tuple((view(p[0]), *p[1:]) if s[0] < 16 else p
               for s, p in ((k_side, k_packed), (v_side, v_packed)))


__all__ = ["addressable", "append_token", "supported"]
