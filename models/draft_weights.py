"""Low-bit group-wise copies of a Llama's linear layers: the draft model of QuantSpec.

`quantize_weights` quantizes every `models.llama.Linear` kernel ``[in, out]``
with asymmetric round-to-nearest (the cache's rule, `jaxkv.quant`): one
(scale, zero) per output column per group of ``group_size`` consecutive input
rows. 4-bit codes are stored as XLA ``uint4`` arrays (half a byte each), so a
jitted program holds the full weights and the draft copy side by side.
`draft_model` gives the model with its kernels replaced by the dequantized
copies; inside `jax.jit` the dequantization (a convert, a multiply and an
add) is next to the dot that consumes it, for XLA to fuse.

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

_CODE_DTYPES = {4: jnp.uint4, 8: jnp.uint8}


def _static(**kw):
  return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A ``[in, out]`` kernel in ``bits``-bit groups of ``group`` input rows.

  Attributes:
    codes: ``[in, out]`` uint4 (4 bits) or uint8 (8 bits).
    scale, zero: ``[in // group, out]`` float32.
    group: input rows per group (static).
  """

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  group: int = _static()

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[in, out]`` in ``dtype`` (float32 arithmetic)."""
    n_in, n_out = self.codes.shape
    c = self.codes.astype(jnp.float32).reshape(n_in // self.group, self.group, n_out)
    w = c * self.scale[:, None, :] + self.zero[:, None, :]
    return w.reshape(n_in, n_out).astype(dtype)


def quantize_kernel(w: jax.Array, *, bits: int = 4, group_size: int = 128) -> QuantizedWeight:
  """Quantizes one ``[in, out]`` kernel; the group is ``gcd(in, group_size)``."""
  if bits not in _CODE_DTYPES:
    raise ValueError(f"bits={bits!r} must be one of {sorted(_CODE_DTYPES)}")
  if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) \
      or group_size < 1:
    raise ValueError(f"group_size={group_size!r} must be a positive int")
  n_in, n_out = w.shape
  group = math.gcd(n_in, int(group_size))
  wg = w.astype(jnp.float32).reshape(n_in // group, group, n_out)
  codes, scale, zero = quant.quantize_groups(wg, bits, -2, "float32")
  return QuantizedWeight(codes.reshape(n_in, n_out).astype(_CODE_DTYPES[bits]), scale, zero,
                         group=group)


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
    bits: 4 (uint4 codes) or 8.
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


def draft_model(model, weights: dict[str, QuantizedWeight]):
  """``model`` with its linear kernels replaced by the dequantized ``weights``.

  A new module graph over the same arrays (``model`` is not changed); call it
  inside `jax.jit` so the dequantization sits next to each dot.
  """
  draft = nnx.clone(model)  # new Variables over the same (immutable) arrays
  found = 0
  for path, m in _linears(draft):
    w = weights.get(_key(path))
    if w is None:
      continue
    if w.codes.shape != m.kernel.shape:
      raise ValueError(f"draft weight {_key(path)} has shape {w.codes.shape}, the model's "
                       f"kernel {m.kernel.shape}")
    m.kernel[...] = w.dequantize(m.kernel.dtype)
    found += 1
  if found != len(weights):
    raise ValueError(f"{len(weights) - found} draft weights name no linear layer of the model")
  return draft


def nbytes(weights: dict[str, QuantizedWeight]) -> int:
  """Bytes of the draft copy (4-bit codes count half a byte)."""
  total = 0.0
  for w in weights.values():
    total += w.codes.size * jnp.iinfo(w.codes.dtype).bits / 8 + 4 * (w.scale.size + w.zero.size)
  return int(total)


__all__ = ["QuantizedWeight", "draft_model", "nbytes", "quantize_kernel", "quantize_weights"]
