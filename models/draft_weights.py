"""Low-bit group-wise copies of a Llama's linear layers: the draft model of QuantSpec.

`quantize_weights` quantizes every `models.llama.Linear` kernel ``[in, out]``
(by default each attention layer's q, k and v kernels as one ``[in, q + k +
v]`` weight, ``"<layer>.self_attn.qkv_proj"``: one product instead of three,
and each MLP's gate and up kernels as one ``"<layer>.mlp.gate_up_proj"``)
into asymmetric codes with one (scale, zero) per output column per group of
``group_size`` consecutive input rows, the pair fitted for the least squared
error (``fit="mse"``, `models.weight_fit`: on SmolLM2 the draft's acceptance
rose from 0.851 / 0.781 to 0.891 / 0.816 at gamma 2 / 4 against ``fit="rtn"``,
the cache's round-to-nearest over each group's min/max, `jaxkv.quant`). 4-bit
codes are packed two per byte, planar inside each group
(`pallas_kernels.int4_matmul.pack_weight`), so a jitted program holds the full
weights and the draft copy side by side at half a byte per weight; 8-bit
codes are plain uint8.

`draft_model` gives the model with its linear layers replaced by
`QuantizedLinear` modules over these weights. On a GPU a 4-bit layer runs a
Pallas kernel (codes read once, never dequantized into HBM: XLA's fused
``x @ dequantize(W)`` took 3.3x the bf16 dot's time on an H100):

- ``layout="in_major"``, codes ``[in / 2, out]``: the Triton kernel
  `pallas_kernels.int4_matmul` (any GPU);
- ``layout="out_major"``, codes ``[in / 128, out, 64]`` (group 128: each
  group's codes for 128 output rows one contiguous 8 KB tile; in the H200
  draft step 17.4 us per MLP product against 20.8 with ``[out, in / 2]``
  rows): the Hopper kernel `pallas_kernels.mosaic_int4_matmul`, weight rows
  as the MMA's M.
  Alone on an H200 (B = 1) it takes 14.0 / 13.8 us for Llama-3.1-8B's gate
  (up) and down products where the Triton kernel takes 27.6 / 24.7, and 8.5 /
  6.6 us for the fused q/k/v ``[4096, 6144]`` and o ``[4096, 4096]`` (Triton
  15.0 / 9.6; `bench/results/speculative-NOTES.md`, 2026-11-28), so
  ``quantize_kernel``'s default (``layout="auto"``) picks it on Hopper for
  kernels of at least `MOSAIC_MIN_WEIGHTS` weights (all of Llama-3.1-8B's but
  separate k and v products, ``fuse_qkv=False``; on a mesh every layer takes
  the dequantize + dot path whatever its layout). The Mosaic kernel feeds x to
  the MMA as bf16 and rounds each group's scale and zero, then each
  dequantized weight, to bf16, so a
  float32 x takes the dequantize + dot path instead.

Elsewhere (CPU, 8 bits, more than the kernel's rows, groups it does not tile)
the layer dequantizes next to a plain dot.

The embedding (and the tied LM head that reuses it) stays in full precision.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import quant
from jaxkv.attention import is_hopper
from models import weight_fit
from pallas_kernels import int4_matmul as i4
from pallas_kernels import mosaic_int4_matmul as m4

_BITS = (4, 8)
_QKV = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")
# fused products: name -> the products it replaces (in its parent module)
_FUSED = {"qkv_proj": _QKV, "gate_up_proj": _GATE_UP}
# a decoder layer's norms -> (the submodule reading their output, its fused product)
_LAYER_NORMS = {"input_layernorm": ("self_attn", "qkv_proj"),
                "post_attention_layernorm": ("mlp", "gate_up_proj")}
LAYOUTS = ("in_major", "out_major")


class ScaledRows(NamedTuple):
  """``(rows [..., in], scale [..., 1] float32)``: the rows ``rows * scale``, left for
  the next product to scale its output by (`DeferredRMSNorm`, `QuantizedLinear`)."""
  rows: jax.Array
  scale: jax.Array

  @property
  def shape(self):
    return self.rows.shape

  @property
  def dtype(self):
    return self.rows.dtype


class DeferredRMSNorm(nnx.Module):
  """A draft's RMSNorm whose consumers are all `QuantizedLinear` layers: returns
  `ScaledRows` ``(x * weight, rsqrt(mean(x**2) + eps))`` and each product
  scales its output rows by the second (``(x w) r @ W = r (x w @ W)``), so the
  normalization needs no kernel of its own after its reduction (in the H200
  draft step each RMSNorm was a reduction and an apply kernel, ~1.3 us each).
  The rounding differs from `models.llama.RMSNorm`'s (``x * w`` rounded to
  the dtype instead of ``x r``, then ``w`` times that): a draft's numerics
  only; the target model keeps Hugging Face's. The rows are not normalized,
  so in float16 (range 65504) ``x * w`` could overflow where the normalized
  rows do not: float16 inputs take the plain norm. The weight is the wrapped
  norm's Param at the same path (``.../input_layernorm/weight``)."""

  def __init__(self, norm):
    self.weight = norm.weight  # the same Param
    self.eps = norm.eps

  def __call__(self, x: jax.Array) -> ScaledRows | jax.Array:
    from models.llama import rms_norm, rms_scale  # pylint: disable=import-outside-toplevel
    if x.dtype == jnp.float16:
      return rms_norm(x, self.weight[...], self.eps)
    rows = x.astype(jnp.float32) * self.weight[...].astype(jnp.float32)
    return ScaledRows(rows.astype(x.dtype), rms_scale(x, self.eps))

  def plain(self):
    """The target's `models.llama.RMSNorm` over the same weight Param (outside a trace)."""
    from models.llama import RMSNorm  # pylint: disable=import-outside-toplevel
    norm = RMSNorm(self.weight.shape[0], eps=self.eps, dtype=self.weight.dtype)
    norm.weight = self.weight
    return norm


FITS = ("mse", "rtn")  # `quantize_kernel`'s choices of each group's scale and zero
# `layout="auto"` picks the Mosaic kernel's layout on Hopper from this many
# weights up (Llama-3.1-8B's fused q/k/v, o, MLP products and LM head; see the
# module doc).
MOSAIC_MIN_WEIGHTS = 1 << 24


def _static(**kw):
  return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A ``[in, out]`` kernel in ``bits``-bit groups of ``group`` input rows.

  Attributes:
    codes: uint8, ``[in / 2, out]`` for 4 bits (two codes per byte, planar
      per group: `pallas_kernels.int4_matmul.pack_weight`), ``[in, out]`` for 8;
      with ``layout="out_major"`` the 4-bit codes group-major, ``[in / 128, out,
      64]`` (`pallas_kernels.mosaic_int4_matmul.transpose_packed`).
    scale, zero: ``[in // group, out]`` float32.
    group: input rows per group (static).
    bits: 4 or 8 (static).
    layout: ``"in_major"`` or ``"out_major"`` (static; 4 bits, group 128 only):
      which kernel a GPU runs (module doc).
  """

  codes: jax.Array
  scale: jax.Array
  zero: jax.Array
  group: int = _static()
  bits: int = _static(default=4)
  layout: str = _static(default="in_major")

  def __post_init__(self):
    """ValueError naming the field for a weight whose parts disagree (a ``[1, out]``
    scale broadcast over every group before). Leaves without a shape (pytree
    placeholders inside JAX transformations) are not checked."""
    if isinstance(self.bits, bool) or self.bits not in _BITS:
      raise ValueError(f"bits={self.bits!r} must be one of {list(_BITS)}")
    if isinstance(self.group, bool) or not isinstance(self.group, (int, np.integer)) \
        or self.group < 1 or (self.bits == 4 and self.group % 2):
      raise ValueError(f"group={self.group!r} must be a positive int (even for 4 bits)")
    if self.layout not in LAYOUTS:
      raise ValueError(f"layout={self.layout!r} must be one of {list(LAYOUTS)}")
    _check_out_major(self.layout, self.bits, self.group)
    shapes = [getattr(x, "shape", None) for x in (self.codes, self.scale, self.zero)]
    if any(sh is None for sh in shapes):
      return
    if len(shapes[0]) != (3 if self.layout == "out_major" else 2):
      raise ValueError(f"codes.shape={tuple(shapes[0])} must be [in / (8 / bits), out] "
                       f"([in / 128, out, 64] for layout='out_major')")
    if self.layout == "out_major" and shapes[0][2] != m4.GROUP // 2:
      raise ValueError(f"codes.shape={tuple(shapes[0])} must end in {m4.GROUP // 2} "
                       f"(the bytes of one 128-input group) for layout='out_major'")
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
    if self.layout == "out_major":
      groups, n_out, _ = self.codes.shape
      return (groups * m4.GROUP, n_out)
    rows, n_out = self.codes.shape
    return (rows * (8 // self.bits), n_out)

  def unpacked_codes(self) -> jax.Array:
    """Codes ``[in, out]`` (uint8)."""
    if self.bits == 8:
      return self.codes
    packed = self.codes                                                  # [in / 2, out]
    if self.layout == "out_major":                # [in / 128, out, 64] -> [in / 2, out]
      packed = m4.untranspose_packed(packed)
    return i4.unpack_weight(packed, self.group)

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """``[in, out]`` in ``dtype`` (float32 arithmetic)."""
    return i4.dequantize_groups(self.unpacked_codes(), self.scale, self.zero,
                                self.group).astype(dtype)

  def kernel_ok(self, rows: int, dtype=jnp.bfloat16) -> bool:
    """Whether ``x @ self`` with ``rows`` rows of ``x.dtype == dtype`` runs a Pallas
    kernel on this backend (the layout's: module doc; the Mosaic kernel rounds x
    to bf16, so a float32 x keeps the float32 dequantize + dot)."""
    if self.bits != 4 or jax.default_backend() != "gpu":
      return False
    if self.layout == "out_major":
      return (jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and is_hopper()
              and m4.supports(*self.shape, self.group, rows)[0])
    return i4.supports(*self.shape, self.group, rows)[0]

  def matmul(self, x: jax.Array, out_dtype=None, *, use_kernel: bool = True) -> jax.Array:
    """``x @ W``: ``[..., in] -> [..., out]``, accumulated in float32, returned in
    ``out_dtype`` (default ``x.dtype``). ``use_kernel=False`` always takes the
    dequantize + dot path (XLA partitions it on a mesh; the kernel is one
    device's)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if use_kernel and self.kernel_ok(math.prod(x.shape[:-1]), x.dtype):
      matmul = m4.mosaic_int4_matmul if self.layout == "out_major" else i4.int4_matmul
      y = matmul(x, self.codes, self.scale, self.zero, group=self.group)
      return y.astype(out_dtype)
    from models.llama import linear  # pylint: disable=import-outside-toplevel
    return linear(x, self.dequantize(x.dtype), out_dtype)


def _check_out_major(layout: str, bits: int, group: int, why: str = "") -> None:
  """ValueError unless an ``"out_major"`` weight is 4-bit in groups of 128."""
  if layout == "out_major" and (bits != 4 or group != m4.GROUP):
    raise ValueError(f"layout='out_major' holds 4-bit codes in groups of {m4.GROUP} (the "
                     f"Mosaic kernel's), got bits={bits}, group={group}{why}")


def default_layout(n_in: int, n_out: int, bits: int, group: int) -> str:
  """``layout="auto"``: ``"out_major"`` (the Mosaic kernel) on a Hopper GPU for 4-bit
  kernels of at least `MOSAIC_MIN_WEIGHTS` weights it serves, else ``"in_major"``."""
  if (bits == 4 and n_in * n_out >= MOSAIC_MIN_WEIGHTS and is_hopper()
      and m4.supports(n_in, n_out, group, 1)[0]):
    return "out_major"
  return "in_major"


def _check_args(w, bits, group_size, layout: str, fit: str) -> tuple[int, int]:
  """`quantize_kernel`'s arguments checked (ValueError naming the value); returns
  ``(bits, group)`` with the group ``gcd(in, group_size)``."""
  if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits not in _BITS:
    raise ValueError(f"bits={bits!r} must be one of {list(_BITS)} (an int)")
  if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) \
      or group_size < 1:
    raise ValueError(f"group_size={group_size!r} must be a positive int")
  if layout != "auto" and layout not in LAYOUTS:
    raise ValueError(f"layout={layout!r} must be 'auto' or one of {list(LAYOUTS)}")
  if fit not in FITS:
    raise ValueError(f"fit={fit!r} must be one of {list(FITS)}")
  if getattr(w, "ndim", None) != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"w (shape {getattr(w, 'shape', None)}, dtype {getattr(w, 'dtype', None)}) "
                     f"must be a 2-D [in, out] float kernel")
  group = math.gcd(w.shape[0], int(group_size))
  if bits == 4 and group % 2:
    raise ValueError(f"4-bit weights pack two rows per byte: the group gcd({w.shape[0]}, "
                     f"{group_size}) = {group} must be even")
  return int(bits), group


def quantize_kernel(w: jax.Array, *, bits: int = 4, group_size: int = 128,
                    layout: str = "auto", fit: str = "mse") -> QuantizedWeight:
  """Quantizes one ``[in, out]`` kernel; the group is ``gcd(in, group_size)``;
  ``layout``: ``"auto"`` (`default_layout`) or one of `LAYOUTS`; ``fit``: one of
  `FITS`, ``"mse"`` (`models.weight_fit.fit_groups`: the least squared error per
  group; the default) or ``"rtn"`` (round to nearest over each group's min/max)."""
  bits, group = _check_args(w, bits, group_size, layout, fit)
  n_in, n_out = w.shape
  if layout == "auto":
    layout = default_layout(n_in, n_out, bits, group)
  else:
    _check_out_major(layout, bits, group, f" (gcd({n_in}, group_size={group_size}))")
  wg = w.astype(jnp.float32).reshape(n_in // group, group, n_out)
  if fit == "mse":
    codes, scale, zero = weight_fit.fit_groups(wg, bits)
  else:
    codes, scale, zero = quant.quantize_groups(wg, bits, -2, "float32")
  codes = codes.reshape(n_in, n_out).astype(jnp.uint8)
  if bits == 4:
    codes = i4.pack_weight(codes, group)
    if layout == "out_major":
      codes = m4.transpose_packed(codes)
  return QuantizedWeight(codes, scale, zero, group=group, bits=bits, layout=layout)


class QuantizedLinear(nnx.Module):
  """A `models.llama.Linear` whose kernel is a `QuantizedWeight` (the draft's layers)."""

  def __init__(self, weight: QuantizedWeight, *, use_kernel: bool = True):
    self.codes = nnx.Variable(weight.codes)
    self.scale = nnx.Variable(weight.scale)
    self.zero = nnx.Variable(weight.zero)
    self.group = weight.group
    self.bits = weight.bits
    self.layout = weight.layout
    self.use_kernel = use_kernel

  @property
  def weight(self) -> QuantizedWeight:
    return QuantizedWeight(self.codes[...], self.scale[...], self.zero[...], group=self.group,
                           bits=self.bits, layout=self.layout)

  def __call__(self, x, out_dtype=None, *, direct_out: bool = False) -> jax.Array:
    """``[..., in] -> [..., out]``; ``direct_out`` (`models.llama.linear`'s) is
    accepted for the `Linear` interface and has no effect here."""
    del direct_out
    if isinstance(x, ScaledRows):  # a `DeferredRMSNorm`'s rows
      rows = math.prod(x.shape[:-1])
      if not (self.use_kernel and self.weight.kernel_ok(rows, x.dtype)):
        # the dequantize + dot (`models.llama.linear`, its one-row padding kept):
        # the rows scaled first, which XLA can fuse into the dot's operand
        x = (x.rows.astype(jnp.float32) * x.scale).astype(x.dtype)
        return self.weight.matmul(x, out_dtype, use_kernel=False)
      # the kernel: its float32 output rows scaled (no kernel for the norm's apply)
      y = self.weight.matmul(x.rows, jnp.float32) * x.scale
      return y.astype(x.dtype if out_dtype is None else out_dtype)
    return self.weight.matmul(x, out_dtype, use_kernel=self.use_kernel)


def _linears(model):
  """``(path, Linear)`` for every linear layer of ``model``."""
  from models.llama import Linear  # pylint: disable=import-outside-toplevel
  return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Linear)]


def _key(path) -> str:
  return ".".join(str(p) for p in path)


def quantize_weights(model, *, bits: int = 4, group_size: int = 128,
                     layout: str = "auto", fuse_qkv: bool = True, fuse_mlp: bool = True,
                     fit: str = "mse") -> dict[str, QuantizedWeight]:
  """Group-wise ``bits``-bit copies of every linear layer's kernel.

  Args:
    model: a `models.llama.Llama`.
    bits: 4 (codes packed two per byte) or 8 (uint8 codes).
    group_size: input rows per (scale, zero); a kernel whose input size it
      does not divide uses ``gcd(in, group_size)`` (SmolLM2's 576: 64).
    layout: each kernel's code layout, ``"auto"`` (`default_layout`, per kernel)
      or one of `LAYOUTS` for all.
    fuse_qkv: each attention layer's q, k and v kernels as one ``[in, q + k + v]``
      weight, ``"<layer>.self_attn.qkv_proj"`` (one product instead of three;
      the same codes, scales and zeros column for column). The default: on an
      H200 the three Triton products took 19.2 us per Llama-3.1-8B layer and
      the fused one 14.3 (draft step, 4 layers + LM head: 171 -> 156 kernels,
      785 -> 757 us kernel time; `bench/results/speculative-NOTES.md`).
    fuse_mlp: each MLP's gate and up kernels as one ``[in, 2 * intermediate]``
      weight, ``"<layer>.mlp.gate_up_proj"`` (one product instead of two on
      the same input; the same codes column for column).
    fit: how each group's scale and zero are chosen (`quantize_kernel`).
  Returns:
    ``{"layers.0.self_attn.qkv_proj": QuantizedWeight, "layers.0.self_attn.o_proj":
    ..., "layers.0.mlp.gate_up_proj": ..., "lm_head": ...}`` (a pytree;
    ``...q_proj``, ``k_proj``, ``v_proj`` keys instead with ``fuse_qkv=False``,
    ``gate_proj`` and ``up_proj`` with ``fuse_mlp=False``).
  """
  def quantize(kernel):
    return quantize_kernel(kernel, bits=bits, group_size=group_size, layout=layout, fit=fit)

  linears = {_key(path): m for path, m in _linears(model)}
  weights, skip = {}, set()
  fuse = {"qkv_proj": fuse_qkv, "gate_up_proj": fuse_mlp}
  for fused_name, parts in _FUSED.items():
    if not fuse[fused_name]:
      continue
    for key in [k for k in linears if k.endswith("." + parts[0])]:
      base = key[:-len(parts[0])]
      names = [base + n for n in parts]
      if all(n in linears for n in names):   # [in, sum(out)]
        weights[base + fused_name] = _fused(
            [linears[n].kernel[...] for n in names], bits, group_size, layout, fit)
        skip.update(names)
  weights.update({k: quantize(m.kernel[...]) for k, m in linears.items() if k not in skip})
  if not weights:
    raise ValueError(f"model {type(model).__name__} has no models.llama.Linear layers")
  return weights


def _fused(kernels, bits, group_size, layout, fit) -> QuantizedWeight:
  """One weight ``[in, sum(out)]`` of ``kernels`` side by side, each quantized on its own
  (scales and zeros are per column: the same codes column for column as quantizing the
  concatenation, with no dependence of a fit's float rounding on the fused shape)."""
  bits, group = _check_args(kernels[0], bits, group_size, layout, fit)
  if layout == "auto":  # the fused shape's choice, for every part
    layout = default_layout(kernels[0].shape[0], sum(k.shape[1] for k in kernels), bits, group)
  parts = [quantize_kernel(k, bits=bits, group_size=group_size, layout=layout, fit=fit)
           for k in kernels]
  cat = [jnp.concatenate([getattr(p, f) for p in parts], axis=1)
         for f in ("codes", "scale", "zero")]
  return QuantizedWeight(*cat, group=group, bits=bits, layout=layout)


def draft_model(model, weights: dict[str, QuantizedWeight], *, use_kernel: bool = True,
                defer_norms: bool = True):
  """``model`` with its linear layers replaced by `QuantizedLinear` over ``weights``.

  A new module graph over the same arrays (``model`` is not changed); every
  linear layer named in ``weights`` must exist with the weight's shape. A
  ``"<layer>.self_attn.qkv_proj"`` weight (`quantize_weights`' fused q, k and
  v) becomes the attention layer's ``qkv_proj`` module, which
  `models.llama.Attention` then runs instead of its q, k and v layers; a
  ``"<layer>.mlp.gate_up_proj"`` weight the MLP's ``gate_up_proj``, run
  instead of its gate and up layers.
  ``use_kernel=False``: the layers never run the Pallas kernel (a model
  sharded on a mesh, where XLA partitions the dequantize + dot instead).
  ``defer_norms``: each RMSNorm whose consumers are all quantized (a layer's
  two, and the final one before a quantized LM head) becomes a
  `DeferredRMSNorm`, its normalization applied to the products' outputs.
  """
  draft = nnx.clone(model)  # new Variables over the same (immutable) arrays
  found = 0
  for key, w in weights.items():
    fused_name = key.rsplit(".", 1)[-1]
    if fused_name in _FUSED:
      _install_fused(draft, key, w, weights, use_kernel)
      found += 1
  for path, m in _linears(draft):
    w = weights.get(_key(path))
    if w is None:
      continue
    for fused_name, parts in _FUSED.items():
      if path[-1] in parts and getattr(_module_at(draft, path[:-1]), fused_name,
                                       None) is not None:
        raise ValueError(f"draft weight {_key(path)}: its layer already runs a fused "
                         f"{fused_name}, which would ignore it")
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
  if defer_norms:
    _defer_norms(draft)
  else:  # a draft of a draft: the target's norms back
    _restore_norms(draft)
  return draft


def _quantized(*modules) -> bool:
  return bool(modules) and all(isinstance(m, QuantizedLinear) for m in modules)


def _defer_norms(draft) -> None:
  """`DeferredRMSNorm` in place of each of ``draft``'s norms whose consumers are all
  `QuantizedLinear` layers (a fused product, when present, is the one consumer)."""
  def defer(owner, name):
    if not isinstance(getattr(owner, name), DeferredRMSNorm):  # (a draft of a draft)
      setattr(owner, name, DeferredRMSNorm(getattr(owner, name)))

  for layer in draft.layers:
    for name, (sub, fused) in _LAYER_NORMS.items():
      module = getattr(layer, sub)
      one = getattr(module, fused, None)
      if _quantized(*([one] if one is not None else
                      [getattr(module, n, None) for n in _FUSED[fused]])):
        defer(layer, name)
  if _quantized(getattr(draft, "lm_head", None)):
    defer(draft, "norm")


def _restore_norms(draft) -> None:
  """Each `DeferredRMSNorm` of ``draft`` replaced by the norm it wraps."""
  for owner, names in [*((layer, _LAYER_NORMS) for layer in draft.layers), (draft, ["norm"])]:
    for name in names:
      if isinstance(getattr(owner, name, None), DeferredRMSNorm):
        setattr(owner, name, getattr(owner, name).plain())


def _module_at(root, path):
  """The submodule at ``path`` (attribute names and list indices), or None."""
  node = root
  for p in path:
    if isinstance(p, int) or (isinstance(p, str) and p.isdigit()):
      try:
        node = node[int(p)]
      except (IndexError, KeyError, TypeError):
        return None
    else:
      node = getattr(node, p, None)
    if node is None:
      return None
  return node


def _install_fused(draft, key: str, w: QuantizedWeight, weights: dict,
                   use_kernel: bool) -> None:
  """Sets ``draft``'s layer named by ``key`` (``"<layer>.self_attn.qkv_proj"`` or
  ``"<layer>.mlp.gate_up_proj"``) the fused product over ``w`` after checking its
  shape ``[in, sum(out)]`` of the products it replaces."""
  fused_name = key.rsplit(".", 1)[-1]
  names = _FUSED[fused_name]
  base = key[:-len(fused_name)]
  layer = _module_at(draft, key.split(".")[:-1])
  parts = [getattr(layer, n, None) for n in names]
  if any(getattr(p, "kernel", None) is None for p in parts):
    raise ValueError(f"draft weight {key} names no layer of the model with "
                     f"{' / '.join(names)} Linear layers (at {base[:-1]!r})")
  both = [base + n for n in names if base + n in weights]
  if both:
    raise ValueError(f"draft weights hold {key} and {both}: the fused product would "
                     f"ignore the separate ones")
  want = (parts[0].kernel.shape[0], sum(p.kernel.shape[1] for p in parts))
  if w.shape != want:
    raise ValueError(f"draft weight {key} has shape {w.shape}, the layer's "
                     f"{' + '.join(names)} {want}")
  setattr(layer, fused_name, QuantizedLinear(w, use_kernel=use_kernel))


def nbytes(weights: dict[str, QuantizedWeight]) -> int:
  """Bytes of the draft copy: codes (4-bit ones packed two per byte) plus scales and zeros."""
  return int(sum(w.codes.size * w.codes.dtype.itemsize + 4 * (w.scale.size + w.zero.size)
                 for w in weights.values()))


__all__ = ["DeferredRMSNorm", "FITS", "LAYOUTS", "MOSAIC_MIN_WEIGHTS", "QuantizedLinear",
           "QuantizedWeight", "ScaledRows", "default_layout", "draft_model", "nbytes",
           "quantize_kernel", "quantize_weights"]
