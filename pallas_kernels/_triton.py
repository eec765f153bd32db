"""Small helpers shared by the Pallas-Triton kernels of this package.

They paper over the differences between the JAX versions the project runs on
(0.10.2 on CPU/CI, 0.11.2 on the GPU machines).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_COMPILER_PARAMS_CLS = getattr(plgpu, "CompilerParams", None) or getattr(
    plgpu, "TritonCompilerParams")


def compiler_params(*, num_warps: int, num_stages: int):
  """Explicit Triton compiler params (some JAX versions route elsewhere without)."""
  return _COMPILER_PARAMS_CLS(num_warps=num_warps, num_stages=num_stages)


def offsets_overflow(*arrays) -> str | None:
  """Why the Pallas Triton lowering would address one of ``arrays`` (arrays or
  `jax.ShapeDtypeStruct`s; entries without a shape are skipped) at wrong
  places, or None.

  The lowering computes a ref's element offsets in int32 unless the array
  holds more than 2**32 bytes, so an array of more than 2**31 elements and at
  most 2**32 bytes (1-byte codes of 2-4 GiB) overflows them: loads and stores
  land at wrong addresses, silently (jax 0.10.2 and 0.11.2,
  `jax/_src/pallas/triton/lowering.py`; H200, 2026-11-29: a kivi4 cache of 160
  sequences x 32768 tokens, 2.7 GB of codes per side, read sequences 130 and
  on with errors of 0.2-0.3 while the Mosaic kernel read them right).
  """
  for x in arrays:
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
      continue
    size = int(np.prod(shape, dtype=np.int64))
    nbytes = size * jnp.dtype(x.dtype).itemsize
    if size > 2**31 and nbytes <= 2**32:
      return (f"a {jnp.dtype(x.dtype).name} array of shape {tuple(shape)} ({nbytes} bytes): "
              f"Pallas Triton addresses arrays of more than 2**31 elements and at most 2**32 "
              f"bytes with 32-bit offsets that overflow")
  return None


def word_view(codes: jax.Array) -> jax.Array:
  """``[..., W]`` uint8 code bytes as ``[..., W / 2]`` little-endian uint16 words
  (a bitcast: the same bytes). Half the elements, so a 2-4 GiB code array is
  addressed right (`offsets_overflow`) by a kernel that writes whole words."""
  return jax.lax.bitcast_convert_type(
      codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2), jnp.uint16)


def byte_view(words: jax.Array) -> jax.Array:
  """The inverse of `word_view`."""
  return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(
      *words.shape[:-1], words.shape[-1] * 2)


def check_offsets(*arrays) -> None:
  """ValueError naming the array when `offsets_overflow` finds one."""
  why = offsets_overflow(*arrays)
  if why:
    raise ValueError(f"{why} (decode attention: implementation='mosaic' or 'xla' reads it; "
                     f"or another cache size)")


def pallas_call(kernel, **kwargs):
  """`pl.pallas_call` whose call first refuses (`check_offsets`) any operand or
  output the Triton lowering would address wrongly; every Pallas Triton kernel
  of this package launches through it."""
  call = pl.pallas_call(kernel, **kwargs)

  def checked(*args):
    check_offsets(*jax.tree.leaves(args), *jax.tree.leaves(kwargs.get("out_shape")))
    return call(*args)

  return checked


def is_int(value) -> bool:
  """Whether ``value`` is a Python or numpy integer (not a bool)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_launch(config) -> None:
  """ValueErrors for a kernel config's ``num_splits`` (if it has one), ``num_warps``
  and ``num_stages``: each a non-bool int (Python or numpy) in range."""
  for name in ("num_splits", "num_warps", "num_stages"):
    value = getattr(config, name, 1)
    if not is_int(value):
      raise ValueError(f"{name}={value!r} must be an int, got {type(value).__name__}")
  if getattr(config, "num_splits", 1) < 1:
    raise ValueError(f"num_splits={config.num_splits} must be >= 1")
  if config.num_warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"num_warps={config.num_warps} must be a power of two <= 16")
  if config.num_stages < 1:
    raise ValueError(f"num_stages={config.num_stages} must be >= 1")


def check_scale(scale) -> None:
  """ValueError/TypeError naming ``scale`` unless it is None, a real scalar, or a
  real scalar array whose value, when concrete, is finite in float32 (the
  kernels take it as a float32 operand: 1e39 would be inf). Traced values are
  checked for shape and dtype only."""
  if scale is None:
    return
  if isinstance(scale, (bool, np.bool_, complex, np.complexfloating)):
    raise TypeError(f"scale={scale!r} must be a real number")
  if hasattr(scale, "shape") and hasattr(scale, "dtype"):
    if tuple(scale.shape) != ():
      raise ValueError(f"scale must be a scalar, got shape {tuple(scale.shape)}")
    if not (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)):
      raise TypeError(f"scale.dtype={scale.dtype} must be a real (float or int) dtype")
    if isinstance(scale, jax.core.Tracer):
      return
  elif not isinstance(scale, numbers.Real):
    raise TypeError(f"scale={scale!r} must be a real number, got {type(scale).__name__}")
  try:
    value = float(scale)
  except OverflowError:  # a Python int past the float64 range
    value = float("inf")
  with np.errstate(over="ignore"):
    value = np.float32(value)
  if not np.isfinite(value):
    raise ValueError(f"scale={scale!r} must be finite in float32")


def check_counts(name: str, x, batch: int, upper: int, upper_name: str) -> None:
  """A ``[batch]`` integer array of counts: ValueError/TypeError naming ``name`` for
  another shape or a non-integer dtype, and for concrete (non-traced) values
  outside ``[0, upper]`` (the message names the bound as ``upper_name``)."""
  if getattr(x, "shape", None) != (batch,):
    raise ValueError(f"{name}.shape={getattr(x, 'shape', None)} must be ({batch},)")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name}.dtype={x.dtype} must be an integer dtype")
  if not isinstance(x, jax.core.Tracer):
    values = np.asarray(x)
    if values.min(initial=0) < 0 or values.max(initial=0) > upper:
      raise ValueError(f"{name}={values.tolist()} must lie in [0, {upper_name}={upper}]")


def next_pow2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def prev_pow2(n: int) -> int:
  """Largest power of two <= ``n`` (1 for n <= 1)."""
  return 1 << (max(1, int(n)).bit_length() - 1)


def is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def stack_last(values: list[jax.Array]) -> jax.Array:
  """``jnp.stack(values, -1)`` for a power-of-two count, using only the
  two-operand stacks that the Triton lowering supports."""
  if len(values) == 1:
    return values[0][..., None]
  evens = stack_last(values[0::2])
  odds = stack_last(values[1::2])
  joined = jnp.stack([evens, odds], axis=-1)
  return joined.reshape(*joined.shape[:-2], len(values))


def flags_block(values: jax.Array, fill: int = 0):
  """Per-row int32 ``values [n]`` padded to one power-of-two block (>= 16) with
  ``fill``, and the `pl.BlockSpec` that hands every program the whole block."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  n = values.shape[0]
  n_pad = max(16, next_pow2(n))
  padded = jnp.full((n_pad,), fill, jnp.int32).at[:n].set(values.astype(jnp.int32))
  return padded, pl.BlockSpec((n_pad,), lambda *_: (0,))


def any_nonfinite(x, axis=None):
  """``any(~isfinite(x), axis)`` as an int32 max: Pallas Triton cannot lower
  boolean ``reduce_or`` (jax 0.11.2, H100), while integer max reductions lower."""
  return jnp.max(jnp.where(jnp.isfinite(x), 0, 1).astype(jnp.int32), axis=axis) > 0


def nonfinite_query_rows(q, seq_bad, kv_heads: int, rows: int):
  """``[B, Hkv, rows]`` int32, 1 where a combine kernel writes NaN (README
  "Input policy"): query row ``r = g S + s`` of a kv head (q head ``g`` of its
  group, query ``s``) holds a NaN/inf, or its sequence is flagged
  ``seq_bad [B]``; rows past ``G S`` are 0. For combines that run in XLA
  (a select over their output); the Pallas combine kernels find the same rows
  themselves (`query_row_flags`)."""
  b, s, hq, _ = q.shape
  g = hq // kv_heads
  bad = ~jnp.all(jnp.isfinite(q), axis=-1) | seq_bad[:, None, None]      # [B, S, Hq]
  bad = bad.reshape(b, s, kv_heads, g).transpose(0, 2, 3, 1).reshape(b, kv_heads, g * s)
  return jnp.pad(bad, ((0, 0), (0, 0), (0, rows - g * s))).astype(jnp.int32)


def query_row_flags(qh_ref, seq_bad_ref, *, rows: int, q_rows: int):
  """In a combine kernel (Pallas Triton): ``[rows]`` bool, row ``r`` of the
  program's kv head comes out NaN (README "Input policy"): ``r < q_rows`` and
  its query row ``qh_ref[r, :]`` holds a NaN/inf or the sequence is flagged
  (``seq_bad_ref [1]`` int32). ``qh_ref``: the ``[N, D]`` query rows the split
  kernel read (`nonfinite_query_rows`' rows, ``N >= rows``), so the flags
  need no XLA kernel and q no second consumer (its producer, RoPE in a
  model, then fuses into the split kernel's query preparation)."""
  qv = qh_ref[pl.ds(0, rows), :]                                          # [rows, D]
  # NaN fails every comparison: |x| <= max is False exactly for NaN and inf
  finite = jnp.abs(qv.astype(jnp.float32)) <= jnp.finfo(jnp.float32).max
  nonfinite = jnp.min(finite.astype(jnp.int32), axis=1) == 0               # [rows]
  r = jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  return (nonfinite | (seq_bad_ref[0] != 0)) & (r < q_rows)


def compute_capability() -> tuple[int, int]:
  """``(major, minor)`` of the default GPU; ``(0, 0)`` off a GPU or when unknown."""
  cc = getattr(jax.devices()[0], "compute_capability", None)
  try:
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)
  except (ValueError, TypeError):
    return 0, 0


def num_sms() -> int:
  """Streaming multiprocessors of the default device (132 on H100/H200)."""
  return int(getattr(jax.devices()[0], "core_count", 0) or 132)


# ------------------------------------------------------------- sink formats
# A format with ``sink_tokens = S`` keeps its first S tokens exactly beside the
# packed storage. The split-K kernels (Triton and Mosaic) then attend only the
# packed tokens ``[skip, packed)`` and the caller attends the prefix
# ``[0, min(skip, packed))`` exactly (`jaxkv.sink_attention`), ``skip`` the
# smallest multiple of the kernel's token block >= S: every block a kernel
# reads still starts on a block (TMA tiles stay aligned, per-channel K steps
# never cross a token group).
def sink_skip(sink_tokens: int, block: int) -> int:
  """Packed tokens a kernel of ``block``-token steps leaves to the caller for
  ``sink_tokens`` S: ``ceil(S / block) * block`` (0 for S = 0)."""
  return -(-int(sink_tokens) // block) * block


def skip_refusal(sink_tokens: int, skip_tokens: int, block: int | None = None,
                 block_name: str = "block_k") -> str:
  """Why a kernel cannot run with ``skip_tokens`` (empty when it can): a format
  with ``sink_tokens`` S needs ``skip_tokens >= S`` (the sinks' packed rows
  hold only their quantized values), a multiple of the kernel's ``block``."""
  if not is_int(skip_tokens) or skip_tokens < 0:
    return f"skip_tokens={skip_tokens!r} must be an int >= 0"
  if skip_tokens < sink_tokens:
    return (f"sink_tokens={sink_tokens}: the kernels read no exact sink rows; pass "
            f"skip_tokens >= {sink_tokens} and attend the prefix exactly "
            f"(jaxkv.decode_attention does), got skip_tokens={skip_tokens}")
  if block is not None and skip_tokens % block:
    return f"skip_tokens={skip_tokens} must be a multiple of {block_name}={block}"
  return ""


def split_range(packed, split, num_splits: int, block: int, skip: int = 0):
  """``(start, stop)``: split ``split``'s slice of the packed tokens ``[lo, packed)``,
  ``lo = min(skip, packed)``, in whole ``block``s (``per_split`` a multiple of
  ``block``; empty past ``packed``). ``skip = 0`` traces exactly the ops of a
  kernel without sinks."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  if not skip:
    per_split = pl.cdiv(pl.cdiv(packed, num_splits), block) * block
    start = split * per_split
  else:
    lo = jnp.minimum(skip, packed)
    per_split = pl.cdiv(pl.cdiv(packed - lo, num_splits), block) * block
    start = lo + split * per_split
  return start, jnp.minimum(start + per_split, packed)
