"""Low-bit group-wise copies of a Llama's linear layers: the draft model of QuantSpec.

`quantize_weights` quantizes every `models.llama.Linear` kernel ``[in, out]``
with asymmetric round-to-nearest (the cache's rule, `jaxkv.quant`): one
(scale, zero) per output column per group of ``group_size`` consecutive input
rows. 4-bit codes are packed two per byte, planar inside each group
(`pallas_kernels.int4_matmul.pack_weight`), so a jitted program holds the full
weights and the draft copy side by side at half a byte per weight; 8-bit
codes are plain uint8.

`draft_model` gives the model with its linear layers replaced by
`QuantizedLinear` modules over these weights. On a GPU a 4-bit layer runs the
Pallas kernel `pallas_kernels.int4_matmul` (codes read once, never
dequantized into HBM: XLA's fused ``x @ dequantize(W)`` took 3.3x the bf16
dot's time on an H100); elsewhere (CPU, 8 bits, more than
`int4_matmul.MAX_ROWS` rows, groups the kernel does not tile) the layer
dequantizes next to a plain dot.

The embedding (and the tied LM head that reuses it) stays in full precision.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import quant
from pallas_kernels import int4_matmul as i4

_BITS = (4, 8)


def _static(**kw):
  return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A ``[in, out]`` kernel in ``bits``-bit groups of ``group`` input rows.

  Attributes:
    codes: uint8, ``[in / 2, out]`` for 4 bits (two codes per byte, planar
      per group: `pallas_kernels.int4_matmul.pack_weight`), ``[in, out]`` for 8.
    scale, zero: ``[in // group, out]`` float32.
    group: input rows per group (static).
    bits: 4 or 8 (static).
  """

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  group: int = _static()
  bits: int = _static(default=4)

  def __post_init__(self):
    """ValueError naming the field for a weight whose parts disagree (a ``[1, out]``
    scale broadcast over every group before). Leaves without a shape (pytree
    placeholders inside JAX transformations) are not checked."""
    if isinstance(self.bits, bool) or self.bits not in _BITS:
      raise ValueError(f"bits={self.bits!r} must be one of {list(_BITS)}")
    if isinstance(self.group, bool) or not isinstance(self.group, (int, np.integer)) \
        or self.group < 1 or (self.bits == 4 and self.group % 2):
      raise ValueError(f"group={self.group!r} must be a positive int (even for 4 bits)")
    shapes = [getattr(x, "shape", None) for x in (self.codes, self.scale, self.zero)]
    if any(sh is None for sh in shapes):
      return
    if len(shapes[0]) != 2:
      raise ValueError(f"codes.shape={tuple(shapes[0])} must be 2-D [in / (8 / bits), out]")
    if getattr(self.codes, "dtype", jnp.uint8) != jnp.uint8:
      raise ValueError(f"codes.dtype={self.codes.dtype} must be uint8")
    n_in, n_out = self.shape
    if n_in % self.group:
      raise ValueError(f"group={self.group} must divide the {n_in} input rows")
    want = (n_in // self.group, n_out)
    for name, sh in (("scale", shapes[1]), ("zero", shapes[2])):
      if tuple(sh) != want:
        raise ValueError(f"{name}.shape={tuple(sh)} must be {want} (one per group of "
                         f"{self.group} rows and output column)")

  @property
  def shape(self) -> tuple[int, int]:
    """``(in, out)`` of the kernel this weight stands for."""
    rows, n_out = self.codes.shape
    return (rows * (8 // self.bits), n_out)

  def unpacked_codes(self) -> jax.Array:
    """Codes ``[in, out]`` (uint8)."""
    return i4.unpack_weight(self.codes, self.group) if self.bits == 4 else self.codes

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[in, out]`` in ``dtype`` (float32 arithmetic)."""
    return i4.dequantize_groups(self.unpacked_codes(), self.scale, self.zero,
                                self.group).astype(dtype)

  def kernel_ok(self, rows: int) -> bool:
    """Whether ``x @ self`` with ``rows`` rows runs the Pallas kernel on this backend."""
    return (self.bits == 4 and jax.default_backend() == "gpu"
            and i4.supports(*self.shape, self.group, rows)[0])

  def matmul(self, x: jax.Array, out_dtype=None, *, use_kernel: bool = True) -> jax.Array:
    """``x @ W``: ``[..., in] -> [..., out]``, accumulated in float32, returned in
    ``out_dtype`` (default ``x.dtype``). ``use_kernel=False`` always takes the
    dequantize + dot path (XLA partitions it on a mesh; the kernel is one
    device's)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if use_kernel and self.kernel_ok(math.prod(x.shape[:-1])):
      y = i4.int4_matmul(x, self.codes, self.scale, self.zero, group=self.group)
      return y.astype(out_dtype)
    from models.llama import linear  # pylint: disable=import-outside-toplevel
    return linear(x, self.dequantize(x.dtype), out_dtype)


def quantize_kernel(w: jax.Array, *, bits: int = 4, group_size: int = 128) -> QuantizedWeight:
  """Quantizes one ``[in, out]`` kernel; the group is ``gcd(in, group_size)``."""
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits not in _BITS:
    raise ValueError(f"bits={bits!r} must be one of {list(_BITS)} (an int)")
  bits = int(bits)
  if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) \
      or group_size < 1:
    raise ValueError(f"group_size={group_size!r} must be a positive int")
  if getattr(w, "ndim", None) != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"w (shape {getattr(w, 'shape', None)}, dtype {getattr(w, 'dtype', None)}) "
                     f"must be a 2-D [in, out] float kernel")
  n_in, n_out = w.shape
  group = math.gcd(n_in, int(group_size))
  if bits == 4 and group % 2:
    raise ValueError(f"4-bit weights pack two rows per byte: the group gcd({n_in}, "
                     f"{group_size}) = {group} must be even")
  wg = w.astype(jnp.float32).reshape(n_in // group, group, n_out)
  codes, scale, zero = quant.quantize_groups(wg, bits, -2, "float32")
  codes = codes.reshape(n_in, n_out).astype(jnp.uint8)
  if bits == 4:
    codes = i4.pack_weight(codes, group)
  return QuantizedWeight(codes, scale, zero, group=group, bits=bits)


class QuantizedLinear(nnx.Module):
  """A `models.llama.Linear` whose kernel is a `QuantizedWeight` (the draft's layers)."""

  def __init__(self, weight: QuantizedWeight, *, use_kernel: bool = True):
    self.codes = nnx.Variable(weight.codes)
    self.scale = nnx.Variable(weight.scale)
    self.zero = nnx.Variable(weight.zero)
    self.group = weight.group
    self.bits = weight.bits
    self.use_kernel = use_kernel

  @property
  def weight(self) -> QuantizedWeight:
    return QuantizedWeight(self.codes[...], self.scale[...], self.zero[...], group=self.group,
                           bits=self.bits)

  def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:  # [..., in] -> [..., out]
    return self.weight.matmul(x, out_dtype, use_kernel=self.use_kernel)


def _linears(model):
  """``(path, Linear)`` for every linear layer of ``model``."""
  from models.llama import Linear  # pylint: disable=import-outside-toplevel
  return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Linear)]


def _key(path) -> str:
  return ".".join(str(p) for p in path)


def quantize_weights(model, *, bits: int = 4, group_size: int = 128) -> dict[str, QuantizedWeight]:
  """Group-wise ``bits``-bit copies of every linear layer's kernel.

  Args:
    model: a `models.llama.Llama`.
    bits: 4 (codes packed two per byte) or 8 (uint8 codes).
    group_size: input rows per (scale, zero); a kernel whose input size it
      does not divide uses ``gcd(in, group_size)`` (SmolLM2's 576: 64).
  Returns:
    ``{"layers.0.self_attn.q_proj": QuantizedWeight, ...}`` (a pytree).
  """
  weights = {_key(path): quantize_kernel(m.kernel[...], bits=bits, group_size=group_size)
             for path, m in _linears(model)}
  if not weights:
    raise ValueError(f"model {type(model).__name__} has no models.llama.Linear layers")
  return weights


def draft_model(model, weights: dict[str, QuantizedWeight], *, use_kernel: bool = True):
  """``model`` with its linear layers replaced by `QuantizedLinear` over ``weights``.

  A new module graph over the same arrays (``model`` is not changed); every
  linear layer named in ``weights`` must exist with the weight's shape.
  ``use_kernel=False``: the layers never run the Pallas kernel (a model
  sharded on a mesh, where XLA partitions the dequantize + dot instead).
  """
  draft = nnx.clone(model)  # new Variables over the same (immutable) arrays
  found = 0
  for path, m in _linears(draft):
    w = weights.get(_key(path))
    if w is None:
      continue
    if w.shape != tuple(m.kernel.shape):
      raise ValueError(f"draft weight {_key(path)} has shape {w.shape}, the model's "
                       f"kernel {tuple(m.kernel.shape)}")
    parent = draft
    for p in path[:-1]:
      parent = parent[p] if isinstance(p, int) else getattr(parent, p)
    setattr(parent, path[-1], QuantizedLinear(w, use_kernel=use_kernel))
    found += 1
  if found != len(weights):
    raise ValueError(f"{len(weights) - found} draft weights name no linear layer of the model")
  return draft


def nbytes(weights: dict[str, QuantizedWeight]) -> int:
  """Bytes of the draft copy: codes (4-bit ones packed two per byte) plus scales and zeros."""
  return int(sum(w.codes.size * w.codes.dtype.itemsize + 4 * (w.scale.size + w.zero.size)
                 for w in weights.values()))


__all__ = ["QuantizedLinear", "QuantizedWeight", "draft_model", "nbytes", "quantize_kernel", "quantize_weights"]
