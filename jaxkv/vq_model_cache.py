"""`VQModelCache`: every layer's vector-quantized KV cache, stacked on a layer axis.

The VQ sibling of `jaxkv.ModelCache` with the same interface (``init``,
``plan_append`` / ``append_layer`` / ``append_layer_with_history`` /
``commit``, ``layer``, ``layer_view``, ``dequantize``, flags, ``check``), so
`models.llama.Llama` prefills and decodes on it unchanged. It is a subclass:
the residual staging, the one-token decode write, the flush `lax.cond`s and
the flags are `ModelCache`'s own code; only the packed storage differs:

* ``k``, ``v`` are `VQCodes`: uint8 codes ``[L, B, Hkv, C, S*n]`` and the
  codebooks ``[L, Hkv, S, n, 2^b, v]`` of every layer (from a
  `jaxkv.VQCodebooks`), all pytree leaves, so the cache flows through `jit`,
  `lax.scan` and donation;
* a flush writes the nearest-centroid codes of the full groups
  (`jaxkv.vq_cache._quantize_groups`, the function `jaxkv.VQCache` flushes
  with), scattered in place into the layer's rows.

VQ quantizes each token on its own, so the cache after any sequence of
appends is bit for bit the cache of quantizing the whole history at once,
and each layer equals the `jaxkv.VQCache` that saw the same appends.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import vq
from jaxkv.cache import STORAGE_ALIGN, check_dims, check_use_kernel, empty_sinks
from jaxkv.model_cache import (AppendPlan, LayerView, ModelCache, _scatter_rows,
                               check_layer_index, check_layers, stack_sinks)
from jaxkv.vq_cache import VQCache, _quantize_groups


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VQCodes:
  """The packed region of K or V of every layer.

  Attributes:
    codes: ``[L, B, Hkv, C, S*n]`` uint8 codebook indices (column ``s*n + j``:
      stage ``s``, sub-vector ``j``; `pallas_kernels.vq_attention` layout).
    codebook: ``[L, Hkv, S, n, 2^b, v]`` centroids in ``fmt.codebook_dtype``.
  """

  codes: jax.Array
  codebook: jax.Array


def stacked_codebooks(fmt: vq.VQFormat, codebooks, num_layers: int, kv_heads: int,
                      head_dim: int) -> tuple[jax.Array, jax.Array]:
  """Validated copies of every layer's codebooks, ``(k, v)`` each ``[L, Hkv, S, n, E, v]``.

  Args:
    fmt: the cache's `VQFormat`.
    codebooks: a `jaxkv.VQCodebooks` learned for ``fmt`` (`jaxkv.vq.fit`), or
      a ``(k, v)`` pair of stacked arrays of that shape.
    num_layers, kv_heads, head_dim: the cache's (model's) sizes.
  Raises:
    ValueError: no codebooks, another format, or a layer / kv-head / head_dim
      count that differs from the cache's (named in the message); untrained
      (all-zero) or non-finite centroids.
    TypeError: anything but a `VQCodebooks` or a pair.
  """
  if codebooks is None:
    raise ValueError(f"a VQ format ({fmt}) needs codebooks=: every layer's jaxkv.VQCodebooks "
                     "(learn them with jaxkv.vq.fit on calibration K/V)")
  if isinstance(codebooks, vq.VQCodebooks):
    if not fmt.same_codebooks(codebooks.fmt):
      raise ValueError(f"codebooks were learned for {codebooks.fmt}, not {fmt}")
    k_books, v_books = codebooks.k, codebooks.v
  elif isinstance(codebooks, (tuple, list)) and len(codebooks) == 2:
    k_books, v_books = codebooks
  else:
    raise TypeError(f"codebooks must be a jaxkv.VQCodebooks or a (k, v) pair of "
                    f"[L, Hkv, S, D/vector, 2^bits, vector] arrays, got {type(codebooks).__name__}")
  for side, x in (("k", k_books), ("v", v_books)):
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 6:
      raise ValueError(f"codebooks.{side} must be [L, Hkv, S, D/vector, 2^bits, vector], got "
                       f"shape {shape}")
    if shape[0] != num_layers:
      raise ValueError(f"codebooks.{side} holds {shape[0]} layers but the cache has "
                       f"num_layers={num_layers}")
    if shape[1] != kv_heads:
      raise ValueError(f"codebooks.{side} holds {shape[1]} kv heads but the cache has "
                       f"kv_heads={kv_heads}")
    if shape[3] * shape[5] != head_dim:
      raise ValueError(f"codebooks.{side} cover head_dim={shape[3] * shape[5]} (D/vector="
                       f"{shape[3]} x vector={shape[5]}) but the cache has head_dim={head_dim}")
  # Per layer: the shape (stages, entries, vector of fmt), trained, copied to codebook_dtype.
  pairs = [vq.check_codebooks(fmt, k_books[i], v_books[i], kv_heads, head_dim)
           for i in range(num_layers)]
  return jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VQModelCache(ModelCache):
  """Vector-quantized KV caches of all layers of a model, stacked on a leading layer axis.

  Attributes:
    k, v: `VQCodes`: codes ``[L, B, Hkv, C, S*n]`` uint8, codebooks
      ``[L, Hkv, S, n, 2^b, v]``.
    k_residual, v_residual: ``[L, B, Hkv, R, D]`` full-precision rows.
    lengths, overflow, invalid, nonfinite: ``[B]`` as in `jaxkv.ModelCache`.
    fmt: the `jaxkv.VQFormat` (static).
    capacity: tokens per sequence (static).
    use_kernel: write decode rows into the residual with the Pallas
      `residual_write` kernel off GPU too (static; as `ModelCache`).
    k_sink, v_sink: ``[L, B, S, Hkv, D]`` exact sink rows or None (S = 0), as
      `jaxkv.ModelCache` (written by its append paths).
  """

  # ------------------------------------------------------------ construction
  @classmethod
  def init(cls, fmt: vq.VQFormat | str, num_layers: int, batch: int, kv_heads: int,
           head_dim: int, capacity: int, dtype: Any = jnp.bfloat16, *, codebooks=None,
           use_kernel: bool | None = None) -> "VQModelCache":
    """An empty cache; arguments as `jaxkv.ModelCache.init` plus ``codebooks``.

    Args:
      fmt: a `jaxkv.VQFormat` or a VQ preset name (``"cq4"``, ``"cq2"``).
      num_layers, batch, kv_heads, head_dim, capacity, dtype: as `ModelCache.init`.
      codebooks: every layer's codebooks: a `jaxkv.VQCodebooks` learned for
        ``fmt`` (`jaxkv.vq.fit`) or a ``(k, v)`` pair of
        ``[L, Hkv, S, D/v, 2^b, v]`` arrays. The cache keeps its own copy.
      use_kernel: see the class docstring; None = False.
    """
    fmt = vq.as_vq_format(fmt)
    check_use_kernel(use_kernel)
    if isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) \
        or num_layers < 1:
      raise ValueError(f"num_layers={num_layers!r} must be an int >= 1")
    dtype = check_dims(fmt, batch, kv_heads, head_dim, capacity, dtype)
    k_books, v_books = stacked_codebooks(fmt, codebooks, num_layers, kv_heads, head_dim)
    align = max(STORAGE_ALIGN, fmt.token_group)
    storage = -(-capacity // align) * align
    res_shape = (num_layers, batch, kv_heads, fmt.residual, head_dim)

    def side(name, books):
      width = fmt.spec(name).code_width(head_dim)
      return VQCodes(jnp.zeros((num_layers, batch, kv_heads, storage, width), jnp.uint8), books)

    return cls(
        k=side("k", k_books), v=side("v", v_books),
        k_residual=jnp.zeros(res_shape, dtype), v_residual=jnp.zeros(res_shape, dtype),
        lengths=jnp.zeros((batch,), jnp.int32), overflow=jnp.zeros((batch,), bool),
        invalid=jnp.zeros((batch,), bool), nonfinite=jnp.zeros((batch,), bool),
        fmt=fmt, capacity=int(capacity), use_kernel=bool(use_kernel),
        **empty_sinks(fmt, (num_layers, batch, fmt.sink_tokens, kv_heads, head_dim), dtype))

  @classmethod
  def from_layers(cls, caches: Sequence[VQCache]) -> "VQModelCache":
    """Stacks per-layer `jaxkv.VQCache`s that agree on format, shapes and lengths.

    A sequence is flagged (``overflow``, ``nonfinite``) when any layer flags it.
    """
    caches = check_layers(caches, VQCache)
    first = caches[0]
    stack = lambda name: jnp.stack([getattr(c, name) for c in caches])  # noqa: E731
    return cls(
        k=VQCodes(stack("k_codes"), stack("k_codebook")),
        v=VQCodes(stack("v_codes"), stack("v_codebook")),
        k_residual=stack("k_residual"), v_residual=stack("v_residual"),
        lengths=first.lengths, overflow=jnp.any(stack("overflow"), axis=0),
        invalid=jnp.zeros(first.lengths.shape, bool),  # per-layer caches have no such flag
        nonfinite=jnp.any(stack("nonfinite"), axis=0),
        fmt=first.fmt, capacity=first.capacity, **stack_sinks(caches))

  @property
  def codebooks(self) -> vq.VQCodebooks:
    """The cache's codebooks as a `jaxkv.VQCodebooks` (its own arrays, not copies)."""
    return vq.VQCodebooks(k=self.k.codebook, v=self.v.codebook, fmt=self.fmt)

  # ------------------------------------------------------------------ views
  def layer(self, index, plan: AppendPlan | None = None) -> VQCache:
    """Layer ``index``'s `jaxkv.VQCache` (int or traced index; slices of the stacked storage).

    With ``plan`` the view has the lengths after that append, as
    `ModelCache.layer`. A concrete ``index`` must lie in ``[0, num_layers)``
    (ValueError); a traced one is clamped into that range.
    """
    check_layer_index(index, self.num_layers)
    take = lambda x: jax.lax.dynamic_index_in_dim(x, index, 0, keepdims=False)  # noqa: E731
    return VQCache(
        k_codes=take(self.k.codes), v_codes=take(self.v.codes),
        k_codebook=take(self.k.codebook), v_codebook=take(self.v.codebook),
        k_residual=take(self.k_residual), v_residual=take(self.v_residual),
        lengths=self.lengths if plan is None else plan.new_lengths,
        overflow=self.overflow if plan is None else self.overflow | ~plan.fits,
        nonfinite=self.nonfinite, fmt=self.fmt, capacity=self.capacity,
        **self._layer_sinks(take))

  def layer_view(self, index, plan: AppendPlan | None = None) -> LayerView:
    """Layer ``index`` as (stacked storage, index): what `jaxkv.decode_attention` gets.

    The Mosaic VQ kernel reads the layer's codes and residual rows in place
    (a layer index into the stacked arrays: slicing them out would copy
    ``[B, Hkv, C, S*n]`` codes per side on every step); the Triton VQ kernel
    and the reference take `LayerView.materialize()`, the layer's `VQCache`.
    """
    return super().layer_view(index, plan)

  # ----------------------------------------------------------------- append
  def _flush_rows(self, sides, index, rows, plan: AppendPlan) -> tuple[VQCodes, VQCodes]:
    """Nearest-centroid codes of ``rows`` (K and V ``[B, H, n, D]``, ``n`` a
    multiple of G) with layer ``index``'s codebooks; the first
    ``plan.flush[b]`` rows of each are written at ``old_packed``.

    The same quantizer as `jaxkv.VQCache` (bit-exact); computed for every
    sequence, kept only where one flushes (out-of-bounds rows are dropped).
    """
    out = []
    for side, x in zip(sides, rows):
      book = jax.lax.dynamic_index_in_dim(side.codebook, index, 0, keepdims=False)
      codes = _quantize_groups(x, book, self.fmt.token_group)          # [B, H, n, S*n]
      out.append(dataclasses.replace(
          side, codes=_scatter_rows(side.codes, index, codes, plan.old_packed, plan.flush)))
    return tuple(out)

  # --------------------------------------------------------------- readback
  def dequantize(self, view: str = "target") -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` float32 ``[L, B, capacity, Hkv, D]``; see `jaxkv.VQCache.dequantize`."""
    if view != "target":
      raise ValueError(f"view={view!r}: a VQ cache has only the 'target' view")
    pairs = [c.dequantize() for c in self.layers()]
    return jnp.stack([p[0] for p in pairs]), jnp.stack([p[1] for p in pairs])


__all__ = ["VQCodes", "VQModelCache", "stacked_codebooks"]
