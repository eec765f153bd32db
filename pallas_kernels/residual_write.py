"""One decode token per sequence into a layer of the stacked residual block, in place (Pallas).

A decode step with ``R == G`` changes a layer's residual block
``[L, B, H, R, D]`` in one of two ways per sequence: its new token goes to
row ``row_b`` (the residual length before the step), or, on the step that
flushes the block into the packed region, all ``R`` rows become zero. The
XLA formulation (`write_token_rows_reference`, a scatter of ``[B, R, H, D]``
updates whose unused rows go out of bounds) costs time in proportion to
``B * R * H * D`` even when it writes one row per sequence (10 us per side
and layer at B=49, 32K, H100). The kernel runs one program per sequence that
writes only what changes, both sides and every kv head in one launch; the
residual arrays are aliased to the outputs, so untouched rows keep their
bytes. It also reports whether a written token holds a NaN/inf (the cache's
``nonfinite`` flag): it reads the token anyway, and XLA would otherwise
spend two reductions per layer on it (2026-11-26 step anatomy).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _triton


def supported(shape) -> bool:
  """Whether the kernel takes a residual of ``shape`` ``[L, B, H, R, D]`` (R, D powers of two)."""
  return _triton.is_pow2(shape[3]) and _triton.is_pow2(shape[4])


def token_codes(row, clear):
  """``[B]`` rows and clear flags -> one int32 per sequence (``-1``: clear the
  block, else the row), padded to the kernel's flags block (`_triton.flags_block`)."""
  return _triton.flags_block(jnp.where(clear, -1, row.astype(jnp.int32)), fill=-2)


def _kernel(code_ref, k_new_ref, v_new_ref, k_in, v_in, *refs, rows: int, heads: int):
  k_out, v_out, bad_out = refs[-3:]  # refs[:-3]: inputs only ordering the call (`after`)
  del k_in, v_in  # aliased to k_out / v_out: the rows not written keep their bytes
  b = pl.program_id(0)  # read outside `pl.when` (interpret mode needs it there)
  row = code_ref[b]      # -1: clear the block; [0, rows): write that row; else nothing
  bad = jnp.zeros((), jnp.int32)
  for h in range(heads):  # static: one [D] row per side and head
    k_new, v_new = k_new_ref[h, :], v_new_ref[h, :]
    for x in (k_new, v_new):  # an int32 max: Triton has no max of bools
      bad = jnp.maximum(bad, _triton.any_nonfinite(x).astype(jnp.int32))

    @pl.when(row == -1)
    def _():
      k_out[h, :, :] = jnp.zeros(k_out.shape[1:], k_out.dtype)
      v_out[h, :, :] = jnp.zeros(v_out.shape[1:], v_out.dtype)

    @pl.when((row >= 0) & (row < rows))
    def _():
      k_out[h, pl.ds(row, 1), :] = k_new[None, :].astype(k_out.dtype)
      v_out[h, pl.ds(row, 1), :] = v_new[None, :].astype(v_out.dtype)

  written = (row == -1) | ((row >= 0) & (row < rows))
  bad_out[b] = jnp.where(written, bad, 0)


@functools.partial(jax.jit, static_argnames=("layer", "interpret"))
def write_token_rows(k_residual, v_residual, k_new, v_new, row, clear, *, layer: int,
                     interpret: bool = False, after=()):
  """Writes one token per sequence into layer ``layer`` of both residual blocks.

  Args:
    k_residual, v_residual: ``[L, B, H, R, D]``; updated in place under an
      outer `jit` where the buffers are donated or loop-carried (else XLA
      copies them first).
    k_new, v_new: ``[B, H, D]`` the tokens.
    row: ``[B]`` int32 row of each token; ``>= R``: no row is written.
    clear: ``[B]`` bool: zero all ``R`` rows of the sequence's block instead.
    layer: static layer index.
    interpret: Pallas interpret mode (CPU).
    after: arrays the call reads nothing from but must run after (a data
      dependency for XLA, e.g. the output of an op that reads the residual
      before this write; no copy is made).
  Returns:
    ``(k_residual, v_residual, nonfinite)``, equal to
    `write_token_rows_reference`; ``nonfinite [B]`` bool: the sequence's token
    was written (a row, or a cleared block: it was flushed) and holds a NaN/inf
    in K or V (checked in ``k_new``'s / ``v_new``'s own dtype).
  """
  num_layers, b, h, r, d = k_residual.shape
  if v_residual.shape != k_residual.shape:
    raise ValueError(f"v_residual.shape={v_residual.shape} != k_residual.shape="
                     f"{k_residual.shape}")
  if not 0 <= layer < num_layers:
    raise ValueError(f"layer={layer} must be in [0, {num_layers})")
  if not supported(k_residual.shape):
    raise ValueError(f"residual rows {r} and head_dim {d} must be powers of two")
  # One padded int32 per sequence: the 32 layers of a step compute the same
  # one, which XLA shares (a pad kernel per layer otherwise).
  code, flags = token_codes(row, clear)
  after = tuple(after)
  token = pl.BlockSpec((None, h, d), lambda i: (i, 0, 0))
  block = pl.BlockSpec((None, None, h, r, d), lambda i: (layer, i, 0, 0, 0))
  anywhere = [pl.BlockSpec(memory_space=pl.ANY)] * len(after)
  k_out, v_out, bad = _triton.pallas_call(
      functools.partial(_kernel, rows=r, heads=h),
      grid=(b,),
      in_specs=[flags, token, token, block, block, *anywhere],
      out_specs=[block, block, flags],
      out_shape=[jax.ShapeDtypeStruct(k_residual.shape, k_residual.dtype),
                 jax.ShapeDtypeStruct(v_residual.shape, v_residual.dtype),
                 jax.ShapeDtypeStruct(code.shape, jnp.int32)],
      input_output_aliases={3: 0, 4: 1},
      compiler_params=_triton.compiler_params(num_warps=4, num_stages=1),
      interpret=interpret,
      name="jaxkv_residual_write",
  )(code, k_new, v_new, k_residual, v_residual, *after)
  return k_out, v_out, bad[:b] > 0


def write_token_rows_reference(k_residual, v_residual, k_new, v_new, row, clear, *,
                               layer):
  """The spec in XLA: one scatter per side of ``[B, R, H, D]`` updates.

  A cleared sequence's ``R`` rows get zeros; another sequence's row
  ``row_b`` gets its token (none when ``row_b >= R``); every other index is
  out of bounds and dropped. ``layer`` may be traced. Returns ``(k_residual,
  v_residual, nonfinite [B])`` as `write_token_rows`.
  """
  b, r = k_residual.shape[1], k_residual.shape[3]
  pos = jnp.arange(r)[None, :]                                          # [1, R]
  rows = jnp.where(clear[:, None], pos, jnp.where(pos == 0, row[:, None], r))  # [B, R]
  seq = jnp.arange(b)[:, None]                                          # [B, 1]
  out = []
  for x, new in ((k_residual, k_new), (v_residual, v_new)):
    upd = jnp.where(clear[:, None, None], jnp.zeros((), x.dtype), new.astype(x.dtype))
    upd = jnp.broadcast_to(upd[:, None], (b, r, *upd.shape[1:]))        # [B, R, H, D]
    # Advanced indices (layer, seq, rows) around the head slice: update [B, R, H, D].
    out.append(x.at[layer, seq, :, rows].set(upd, mode="drop"))
  written = clear | (row < r)
  bad = jnp.any(~jnp.isfinite(k_new), axis=(1, 2)) | jnp.any(~jnp.isfinite(v_new), axis=(1, 2))
  return (*out, written & bad)
