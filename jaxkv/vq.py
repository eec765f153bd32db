"""Vector-quantized KV formats and their codebooks (VQ-LLM; issue 15).

A VQ format stores one uint8 index per sub-vector of ``v`` consecutive
channels of a head (``v`` in 2, 4, 8), into a codebook of ``2^b`` entries
(``b <= 8``) learned per layer, kv head and channel sub-space; with two
residual stages the second codebook quantizes what the first left over.
``cq4`` (2 channels, 256 entries) spends 4 bits per channel, ``cq2`` (4
channels, 256 entries) 2 bits. Storage layout: `pallas_kernels.vq_attention`.

Quantization is nearest-centroid, per stage on the residual of the previous
stages: the squared distance ``sum_i (x_i - c_i)^2`` is computed in float32
(terms added in channel order) against the *stored* codebook read back as
float32, and ties go to the lowest index. It is per token (no group
statistics), so the cache reached by any sequence of appends equals the one
made by quantizing the whole history at once, bit for bit.

Codebooks (`fit`): k-means per (layer, kv head, sub-space, stage) over
calibration K/V: k-means++ initialisation, then a fixed number of Lloyd
iterations (an empty cluster keeps its centroid), all jitted and
deterministic for a seed. `VQCodebooks.save`/`load` round-trip bit-exactly
(``.npz``). `calibration_kv` gets a model's own K/V of some tokens to fit on:
``vq.fit(*vq.calibration_kv(model, tokens, lengths), "cq2")``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.cache import check_seed
from jaxkv.formats import check_dtype_bytes
from pallas_kernels._triton import is_pow2 as _is_pow2
from pallas_kernels.vq_attention import VQSideSpec

VALID_VECTORS = (2, 4, 8)
VALID_STAGES = (1, 2)
VALID_CODEBOOK_DTYPES = ("float16", "bfloat16", "float32")


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclasses.dataclass(frozen=True)
class VQFormat:
  """Storage format of a vector-quantized KV cache.

  Attributes:
    k_vector, v_vector: channels per sub-vector of K / V (2, 4 or 8).
    k_index_bits, v_index_bits: b, codebook entries ``2^b`` (1..8; uint8 codes).
    k_stages, v_stages: residual VQ stages (1 or 2).
    token_group: G, tokens flushed from the residual block at a time
      (power of two). VQ has no per-group statistics; G only sets the flush
      granularity, as in `jaxkv.KVFormat`.
    residual: R, full-precision residual rows; a multiple of G.
    codebook_dtype: dtype name of the stored centroids.
    sink_tokens: S, the first tokens of each sequence also kept exactly (the
      attention sinks) and read in place of their codes, as
      `jaxkv.KVFormat.sink_tokens`; in ``[0, token_group]``, 0 = none. The
      codebooks do not depend on it (`same_codebooks`), but they fit better
      without the sink rows (`calibration_kv`'s ``sink_tokens``;
      bench/results/vq-NOTES.md, 2026-11-27). The VQ kernels serve such
      formats with an exact prefix beside them (`jaxkv.sink_attention`).
  """

  k_vector: int = 2
  v_vector: int = 2
  k_index_bits: int = 8
  v_index_bits: int = 8
  k_stages: int = 1
  v_stages: int = 1
  token_group: int = 128
  residual: int = 128
  codebook_dtype: str = "float16"
  sink_tokens: int = 0

  def __post_init__(self):
    for side in ("k", "v"):
      vec = getattr(self, f"{side}_vector")
      if not _is_int(vec) or vec not in VALID_VECTORS:
        raise ValueError(f"{side}_vector={vec!r} must be one of {VALID_VECTORS} channels")
      bits = getattr(self, f"{side}_index_bits")
      if not _is_int(bits) or not 1 <= bits <= 8:
        raise ValueError(f"{side}_index_bits={bits!r} must be an int in [1, 8] (uint8 codes)")
      stages = getattr(self, f"{side}_stages")
      if not _is_int(stages) or stages not in VALID_STAGES:
        raise ValueError(f"{side}_stages={stages!r} must be one of {VALID_STAGES}")
    if not _is_int(self.token_group) or not _is_pow2(int(self.token_group)):
      raise ValueError(f"token_group={self.token_group!r} must be a positive power of two")
    if not _is_int(self.residual) or self.residual <= 0 or self.residual % self.token_group:
      raise ValueError(f"residual={self.residual!r} must be a positive multiple of "
                       f"token_group={self.token_group}")
    try:
      cd = np.dtype(self.codebook_dtype).name
    except TypeError:
      cd = None
    if cd not in VALID_CODEBOOK_DTYPES:
      raise ValueError(
          f"codebook_dtype={self.codebook_dtype!r} must be one of {VALID_CODEBOOK_DTYPES}")
    object.__setattr__(self, "codebook_dtype", cd)
    if not _is_int(self.sink_tokens) or not 0 <= self.sink_tokens <= self.token_group:
      raise ValueError(f"sink_tokens={self.sink_tokens!r} must be an int in [0, "
                       f"token_group={self.token_group}]")
    object.__setattr__(self, "sink_tokens", int(self.sink_tokens))

  @classmethod
  def preset(cls, name: str) -> "VQFormat":
    """Returns a named VQ format (`VQ_PRESETS`)."""
    if not isinstance(name, str):
      raise TypeError(f"name={name!r} must be a VQ preset name (str), one of {sorted(VQ_PRESETS)}")
    try:
      return VQ_PRESETS[name]
    except KeyError:
      raise ValueError(f"unknown VQ preset {name!r}; choose one of {sorted(VQ_PRESETS)}") from None

  @property
  def is_quantized(self) -> bool:
    return True

  def same_codebooks(self, other: "VQFormat") -> bool:
    """Whether codebooks learned for ``other`` serve this format: every field equal
    but ``sink_tokens`` (the codebooks are the same arrays with or without sinks)."""
    return (isinstance(other, VQFormat)
            and dataclasses.replace(self, sink_tokens=0) == dataclasses.replace(other,
                                                                                sink_tokens=0))

  @property
  def hierarchical(self) -> bool:
    """False: no draft view (`jaxkv.KVFormat.hierarchical`; QuantSpec needs a KV format)."""
    return False

  def spec(self, side: str) -> VQSideSpec:
    """The static kernel description of side ``"k"`` or ``"v"``."""
    if side not in ("k", "v"):
      raise ValueError(f"side={side!r} must be 'k' or 'v'")
    return VQSideSpec(vector=getattr(self, f"{side}_vector"),
                      entries=1 << getattr(self, f"{side}_index_bits"),
                      stages=getattr(self, f"{side}_stages"))

  def bits_per_channel(self, side: str) -> float:
    """Code bits per channel: ``stages * 8 / vector`` (uint8 indices)."""
    spec = self.spec(side)
    return spec.stages * 8 / spec.vector

  def validate_head_dim(self, head_dim: int) -> None:
    """Raises ValueError if heads of ``head_dim`` channels cannot be cut into sub-vectors."""
    if not _is_int(head_dim) or head_dim <= 0:
      raise ValueError(f"head_dim={head_dim!r} must be a positive int")
    for side in ("k", "v"):
      vec = getattr(self, f"{side}_vector")
      if head_dim % vec:
        raise ValueError(f"head_dim={head_dim} must be a multiple of {side}_vector={vec}")

  def codebook_shape(self, side: str, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """``(Hkv, stages, D / vector, 2^b, vector)``: one layer's codebooks of a side."""
    self.validate_head_dim(head_dim)
    return self.spec(side).codebook_shape(kv_heads, head_dim)

  def packed_len(self, length):
    """Tokens held quantized: ``G * max(0, floor((L - R + G) / G))`` (as `KVFormat`)."""
    g, r = self.token_group, self.residual
    if _is_int(length):
      return g * max(0, (int(length) - r + g) // g)
    return g * jnp.maximum(0, (length - r + g) // g)

  def bytes_per_token(self, kv_heads: int, head_dim: int, dtype_bytes: int = 2, *,
                      context: int = 8192, sequence_length: int | None = None) -> float:
    """Bytes per token of one layer's packed cache, K and V, codebooks and sinks amortized.

    Codes: ``stages * D / vector`` bytes per head per side. The layer's
    codebooks (``stages * D * 2^b`` centroid values per head per side) are
    spread over ``context`` tokens: the tokens the codebooks serve, e.g.
    batch * sequence length. The sink rows (``sink_tokens`` tokens of
    ``dtype_bytes`` per value, K and V, per sequence) are spread over
    ``sequence_length`` tokens (default ``context``: one sequence). The
    residual block is not included, as in `KVFormat.bytes_per_token`;
    ``dtype_bytes`` counts only for the sinks.
    """
    if not _is_int(kv_heads) or kv_heads < 1:
      raise ValueError(f"kv_heads={kv_heads!r} must be a positive int")
    self.validate_head_dim(head_dim)
    if not _is_int(context) or context <= 0:
      raise ValueError(f"context={context!r} must be a positive int")
    sequence_length = context if sequence_length is None else sequence_length
    if not _is_int(sequence_length) or sequence_length <= 0:
      raise ValueError(f"sequence_length={sequence_length!r} must be a positive int or None")
    check_dtype_bytes(dtype_bytes)
    cb_bytes = np.dtype(self.codebook_dtype).itemsize
    total = 2 * self.sink_tokens * head_dim * dtype_bytes / sequence_length
    for side in ("k", "v"):
      spec = self.spec(side)
      total += spec.code_width(head_dim)
      total += spec.stages * head_dim * spec.entries * cb_bytes / context
    return total * kv_heads


VQ_PRESETS: dict[str, VQFormat] = {
    "cq4": VQFormat(k_vector=2, v_vector=2),   # 2 channels per 8-bit index: 4 bits/channel
    "cq2": VQFormat(k_vector=4, v_vector=4),   # 4 channels per 8-bit index: 2 bits/channel
    # cq2 with each sequence's first 4 tokens exact (reference attention only for now):
    # half cq2's KL on SmolLM2 at 4096 tokens (bench/results/vq-NOTES.md, 2026-11-27).
    "cq2-s4": VQFormat(k_vector=4, v_vector=4, sink_tokens=4),
}
"""Named VQ formats (VQ-LLM's CQ-4 and CQ-2; R = G = 128 as KIVI; ``cq2-s4``: cq2 with
4 exact sink tokens, codebooks shared with cq2)."""


def is_vq_format(fmt) -> bool:
  """Whether ``fmt`` is a `VQFormat` or the name of a VQ preset."""
  return isinstance(fmt, VQFormat) or (isinstance(fmt, str) and fmt in VQ_PRESETS)


def as_vq_format(fmt) -> VQFormat:
  """A `VQFormat` from itself or a `VQ_PRESETS` name; TypeError otherwise."""
  if isinstance(fmt, str):
    return VQFormat.preset(fmt)
  if not isinstance(fmt, VQFormat):
    raise TypeError(f"fmt={fmt!r} must be a VQFormat or a VQ preset name "
                    f"({sorted(VQ_PRESETS)})")
  return fmt


# ------------------------------------------------------------ nearest centroid
def squared_distances(x: jax.Array, codebook: jax.Array) -> jax.Array:
  """``x [..., v]``, ``codebook [..., E, v]`` -> float32 ``[..., E]``.

  ``sum_i (x_i - c_i)^2`` in float32, terms added in channel order (no
  ``|x|^2 - 2 x.c + |c|^2`` expansion: exact differences, no cancellation).
  Leading dims of ``codebook`` broadcast against those of ``x``.
  """
  xs, cs = tuple(getattr(x, "shape", ())), tuple(getattr(codebook, "shape", ()))
  if not xs or len(cs) < 2 or cs[-1] != xs[-1]:  # a wider codebook summed only x's channels
    raise ValueError(f"codebook.shape={cs} must be [..., E, v] with v = x.shape[-1] "
                     f"(x.shape={xs})")
  x = x.astype(jnp.float32)
  c = codebook.astype(jnp.float32)
  d = None
  for i in range(x.shape[-1]):
    term = jnp.square(x[..., i, None] - c[..., i])
    d = term if d is None else d + term
  return d


def nearest_centroid(x: jax.Array, codebook: jax.Array) -> jax.Array:
  """Index of the nearest centroid, ties to the lowest index: ``[..., v]`` -> int32 ``[...]``."""
  return jnp.argmin(squared_distances(x, codebook), axis=-1).astype(jnp.int32)


def quantize(x: jax.Array, codebook: jax.Array) -> jax.Array:
  """Residual VQ of one side.

  Args:
    x: ``[B, H, T, D]`` floats.
    codebook: ``[H, S, n, E, v]`` with ``n * v == D``.
  Returns:
    ``[B, H, T, S * n]`` uint8 codes (column ``s * n + j``: stage s, sub-vector j).
    Stage ``s`` quantizes ``x`` minus the float32 sum of the centroids the
    earlier stages chose.
  """
  if getattr(codebook, "ndim", None) != 5:
    raise ValueError(f"codebook must be [H, S, n, E, v], got shape {getattr(codebook, 'shape', None)}")
  h, stages, n, entries, vec = codebook.shape
  if entries > 256:  # the uint8 codes would wrap
    raise ValueError(f"codebook.shape={codebook.shape}: {entries} entries do not fit uint8 "
                     "codes (at most 256)")
  if getattr(x, "ndim", None) != 4 or x.shape[1] != h or x.shape[3] != n * vec:
    raise ValueError(f"x.shape={getattr(x, 'shape', None)} must be [B, {h}, T, {n * vec}] "
                     f"for codebook.shape={codebook.shape}")
  b, _, t, d = x.shape
  rest = x.astype(jnp.float32).reshape(b, h, t, n, vec)
  heads = jnp.arange(h)[None, :, None, None]
  subs = jnp.arange(n)[None, None, None, :]
  codes = []
  for s in range(stages):
    cb = codebook[:, s].astype(jnp.float32)[None, :, None]         # [1, H, 1, n, E, v]
    idx = nearest_centroid(rest, cb)                                # [B, H, T, n]
    codes.append(idx.astype(jnp.uint8))
    if s + 1 < stages:
      rest = rest - codebook[:, s].astype(jnp.float32)[heads, subs, idx]
  return jnp.concatenate(codes, axis=-1)


# -------------------------------------------------------------------- k-means
def kmeans_plus_plus(key: jax.Array, points: jax.Array, entries: int) -> jax.Array:
  """k-means++ seeds: ``points [N, v]`` -> ``[entries, v]`` float32 rows of ``points``.

  The first seed is a uniformly drawn point; each next one is drawn with
  probability proportional to its squared distance to the nearest seed so
  far (inverse-CDF on the float32 cumulative sum). When every point already
  coincides with a seed the draw is uniform.
  """
  points = points.astype(jnp.float32)
  n = points.shape[0]
  first = jax.random.randint(jax.random.fold_in(key, 0), (), 0, n)
  seeds = jnp.zeros((entries, points.shape[1]), jnp.float32).at[0].set(points[first])
  d2 = squared_distances(points, points[first][None])[:, 0]            # [N]

  def body(i, carry):
    seeds, d2 = carry
    k_draw, k_uniform = jax.random.split(jax.random.fold_in(key, i))
    cdf = jnp.cumsum(d2)
    total = cdf[-1]
    u = jax.random.uniform(k_draw, (), jnp.float32) * total
    drawn = jnp.minimum(jnp.searchsorted(cdf, u, side="right"), n - 1)
    pick = jnp.where(total > 0, drawn, jax.random.randint(k_uniform, (), 0, n))
    d2 = jnp.minimum(d2, squared_distances(points, points[pick][None])[:, 0])
    return seeds.at[i].set(points[pick]), d2

  seeds, _ = jax.lax.fori_loop(1, entries, body, (seeds, d2))
  return seeds


def lloyd(points: jax.Array, centroids: jax.Array, iters: int) -> jax.Array:
  """``iters`` Lloyd iterations from ``centroids [E, v]`` over ``points [N, v]`` (float32).

  Each iteration assigns every point to its nearest centroid (ties: lowest
  index) and moves each centroid to the mean of its points; a centroid with
  no points stays where it is.
  """
  points = points.astype(jnp.float32)
  entries = centroids.shape[0]

  def step(_, c):
    assign = nearest_centroid(points, c)                                 # [N]
    sums = jax.ops.segment_sum(points, assign, num_segments=entries)     # [E, v]
    counts = jax.ops.segment_sum(jnp.ones_like(assign, jnp.float32), assign,
                                 num_segments=entries)
    return jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1.0)[:, None], c)

  return jax.lax.fori_loop(0, iters, step, centroids.astype(jnp.float32))


def kmeans(key: jax.Array, points: jax.Array, entries: int, iters: int) -> jax.Array:
  """k-means++ seeding then ``iters`` Lloyd iterations: ``[N, v]`` -> float32 ``[entries, v]``."""
  return lloyd(points, kmeans_plus_plus(key, points, entries), iters)


def _stage_residual(x, codebook):
  """``x [N, H, n, v]`` minus the stored centroids nearest to it (float32)."""
  cb = codebook.astype(jnp.float32)                                     # [H, n, E, v]
  idx = nearest_centroid(x, cb[None])                                    # [N, H, n]
  heads = jnp.arange(cb.shape[0])[None, :, None]
  subs = jnp.arange(cb.shape[1])[None, None, :]
  return x - cb[heads, subs, idx]


@functools.partial(jax.jit, static_argnames=("spec", "iters", "dtype", "batch_size"))
def _fit_side(key, x, spec: VQSideSpec, iters: int, dtype: str, batch_size: int):
  """Codebooks ``[H, S, n, E, v]`` (``dtype``) of one layer's side, ``x [N, H, D]``."""
  num, h, d = x.shape
  n = d // spec.vector
  rest = x.astype(jnp.float32).reshape(num, h, n, spec.vector)
  stages = []
  for s in range(spec.stages):
    pts = rest.transpose(1, 2, 0, 3).reshape(h * n, num, spec.vector)  # [H*n, N, v]
    keys = jax.vmap(lambda i, _k=jax.random.fold_in(key, s): jax.random.fold_in(_k, i))(
        jnp.arange(h * n))
    cents = jax.lax.map(lambda a: kmeans(a[0], a[1], spec.entries, iters), (keys, pts),
                        batch_size=batch_size)
    cb = cents.reshape(h, n, spec.entries, spec.vector).astype(dtype)
    stages.append(cb)
    if s + 1 < spec.stages:
      rest = _stage_residual(rest, cb)
  return jnp.stack(stages, axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VQCodebooks:
  """Every layer's codebooks of a `VQFormat`.

  Attributes:
    k: ``[L, Hkv, Sk, D/vk, 2^bk, vk]`` in ``fmt.codebook_dtype``.
    v: ``[L, Hkv, Sv, D/vv, 2^bv, vv]``.
    fmt: the format they were learned for (static).
  """

  k: jax.Array
  v: jax.Array
  fmt: VQFormat = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):  # the static field only: k / v may be tracers or tree placeholders
    if not isinstance(self.fmt, VQFormat):
      raise TypeError(f"fmt={self.fmt!r} must be a VQFormat (e.g. VQFormat.preset('cq2'))")

  @property
  def num_layers(self) -> int:
    return self.k.shape[0]

  @property
  def kv_heads(self) -> int:
    return self.k.shape[1]

  @property
  def head_dim(self) -> int:
    return self.k.shape[3] * self.k.shape[5]

  def layer(self, index: int) -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` codebooks of one layer (``[Hkv, S, n, E, v]`` each).

    A concrete ``index`` must lie in ``[0, num_layers)`` (ValueError; no
    negative indices); a traced one is clamped into that range.
    """
    from jaxkv.model_cache import check_layer_index  # pylint: disable=import-outside-toplevel
    check_layer_index(index, self.num_layers)
    return self.k[index], self.v[index]

  def save(self, path) -> None:
    """Writes an ``.npz``: raw centroid bits, their dtype, and the format as JSON."""
    meta = json.dumps(dataclasses.asdict(self.fmt), sort_keys=True)
    arrays = {}
    for side, x in (("k", self.k), ("v", self.v)):
      x = np.asarray(x)
      arrays[side] = x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))
      arrays[f"{side}_dtype"] = np.array(x.dtype.name)
    np.savez(path, fmt=np.array(meta), **arrays)

  @classmethod
  def load(cls, path) -> "VQCodebooks":
    """Reads what `save` wrote, bit for bit (``path`` as given to `save`: numpy
    adds ``.npz`` to a name without it, so ``load`` looks there too)."""
    path = os.fspath(path)
    if not os.path.exists(path) and not path.endswith(".npz") and os.path.exists(path + ".npz"):
      path += ".npz"
    with np.load(path, allow_pickle=False) as f:
      fmt = VQFormat(**json.loads(str(f["fmt"])))
      sides = {}
      for side in ("k", "v"):
        dtype = jnp.dtype(str(f[f"{side}_dtype"]))
        sides[side] = jnp.asarray(f[side].view(dtype))
    out = cls(k=sides["k"], v=sides["v"], fmt=fmt)
    out.validate()
    return out

  def validate(self, kv_heads: int | None = None, head_dim: int | None = None) -> "VQCodebooks":
    """Checks the codebooks against ``fmt`` (and the given sizes); returns self.

    Raises:
      ValueError: a shape unlike ``[L, Hkv, S, D/vector, 2^bits, vector]`` of
        ``fmt``, or k and v with different layer, kv-head or head_dim counts.
      TypeError: a non-floating codebook dtype.
    """
    for side, x in (("k", self.k), ("v", self.v)):
      if getattr(x, "ndim", None) != 6:
        raise ValueError(f"codebooks.{side} must be [L, Hkv, S, n, E, v], got shape "
                         f"{getattr(x, 'shape', type(x))}")
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"codebooks.{side}.dtype={x.dtype} must be floating")
    for what, k_size, v_size in (
        ("layers", self.k.shape[0], self.v.shape[0]),
        ("kv heads", self.k.shape[1], self.v.shape[1]),
        ("head_dim", self.k.shape[3] * self.k.shape[5], self.v.shape[3] * self.v.shape[5])):
      if k_size != v_size:
        raise ValueError(f"codebooks.k covers {k_size} {what} but codebooks.v covers {v_size} "
                         f"(k.shape={tuple(self.k.shape)}, v.shape={tuple(self.v.shape)})")
    for side, x in (("k", self.k), ("v", self.v)):  # each side against the format
      h = x.shape[1] if kv_heads is None else kv_heads
      d = x.shape[3] * x.shape[5] if head_dim is None else head_dim
      want = (x.shape[0], *self.fmt.codebook_shape(side, h, d))
      if tuple(x.shape) != want:
        raise ValueError(f"codebooks.{side}.shape={tuple(x.shape)} must be {want} "
                         f"for kv_heads={h}, head_dim={d} and {self.fmt}")
    return self


def check_codebooks(fmt: VQFormat, k_codebook, v_codebook, kv_heads: int, head_dim: int):
  """Validates one layer's codebooks; returns copies in ``fmt.codebook_dtype``.

  Raises:
    ValueError: wrong shape, or (when concrete) untrained codebooks: a
      non-finite centroid, a centroid outside the finite range of
      ``fmt.codebook_dtype`` (it would be stored as inf), or a side whose
      centroids are all zero (the placeholder that `fit` never returns).
    TypeError: a non-floating codebook.
  """
  out = []
  for side, cb in (("k", k_codebook), ("v", v_codebook)):
    if cb is None:
      raise ValueError(f"{side}_codebook is None: learn codebooks with jaxkv.vq.fit first")
    want = fmt.codebook_shape(side, kv_heads, head_dim)
    if tuple(getattr(cb, "shape", ())) != want:
      raise ValueError(f"{side}_codebook.shape={tuple(getattr(cb, 'shape', ()))} must be "
                       f"{want} (Hkv, stages, D/vector, 2^bits, vector)")
    if not jnp.issubdtype(cb.dtype, jnp.floating):
      raise TypeError(f"{side}_codebook.dtype={cb.dtype} must be floating")
    # A copy: a cache owns its leaves, so donating it never deletes the caller's codebooks.
    with np.errstate(over="ignore"):  # an overflow is reported below, not warned
      stored = jnp.array(cb, fmt.codebook_dtype, copy=True)
    if not isinstance(cb, jax.core.Tracer):
      host = np.asarray(cb, np.float32)
      if not np.isfinite(host).all():
        raise ValueError(f"{side}_codebook holds non-finite centroids: untrained or corrupt")
      if not host.any():
        raise ValueError(f"{side}_codebook is all zeros: untrained (learn it with jaxkv.vq.fit)")
      if not np.isfinite(np.asarray(stored, np.float32)).all():
        limit = float(jnp.finfo(fmt.codebook_dtype).max)
        raise ValueError(
            f"{side}_codebook holds centroids up to |x|={float(np.abs(host).max()):.3g}, outside "
            f"the range of codebook_dtype={fmt.codebook_dtype} (|x| <= {limit:.6g}): they "
            "would be stored as inf")
    out.append(stored)
  return tuple(out)


def fit(k_samples, v_samples, fmt: VQFormat | str, *, seed: int = 0, iters: int = 16,
        batch_size: int = 64) -> VQCodebooks:
  """Learns every layer's codebooks from calibration K/V with k-means.

  Args:
    k_samples, v_samples: ``[L, N, Hkv, D]`` calibration keys / values per
      layer (N tokens, e.g. a prompt's K/V flattened over batch and time).
    fmt: a `VQFormat` or a `VQ_PRESETS` name.
    seed: the PRNG seed; the same seed and data give the same codebooks.
    iters: Lloyd iterations per codebook.
    batch_size: sub-spaces clustered at once (memory: ``batch_size * N * 2^b``
      float32 distances).
  Returns:
    `VQCodebooks` in ``fmt.codebook_dtype``. Stage 2 is fitted on the
    residuals left by the *stored* (rounded) stage-1 codebook.
  """
  fmt = as_vq_format(fmt)
  for name, x in (("k_samples", k_samples), ("v_samples", v_samples)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be [L, N, Hkv, D], got shape {getattr(x, 'shape', type(x))}")
    dtype = jnp.dtype(x.dtype)
    if dtype == jnp.bool_ or not (jnp.issubdtype(dtype, jnp.floating)
                                  or jnp.issubdtype(dtype, jnp.integer)):
      raise TypeError(f"{name}.dtype={dtype} must be a real (floating or integer) dtype")
  if k_samples.shape != v_samples.shape:
    raise ValueError(f"k_samples.shape={k_samples.shape} != v_samples.shape={v_samples.shape}")
  layers, num, kv_heads, head_dim = k_samples.shape
  fmt.validate_head_dim(head_dim)
  for name, x in (("k_samples", k_samples), ("v_samples", v_samples)):
    if not isinstance(x, jax.core.Tracer) and not np.isfinite(np.asarray(x, np.float32)).all():
      raise ValueError(f"{name} holds NaN/inf: k-means needs finite calibration data")
  for side in ("k", "v"):
    entries = fmt.spec(side).entries
    if num < entries:
      raise ValueError(f"{side}: N={num} calibration tokens per layer must be >= "
                       f"{entries} codebook entries")
  if not _is_int(iters) or iters < 0:
    raise ValueError(f"iters={iters!r} must be an int >= 0")
  if not _is_int(batch_size) or batch_size < 1:
    raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
  key = jax.random.PRNGKey(check_seed(seed))
  per_side = {"k": [], "v": []}
  for layer in range(layers):
    for side_id, (side, x) in enumerate((("k", k_samples), ("v", v_samples))):
      side_key = jax.random.fold_in(jax.random.fold_in(key, layer), side_id)
      per_side[side].append(_fit_side(side_key, jnp.asarray(x[layer]), spec=fmt.spec(side),
                                      iters=int(iters), dtype=fmt.codebook_dtype,
                                      batch_size=int(batch_size)))
  books = VQCodebooks(k=jnp.stack(per_side["k"]), v=jnp.stack(per_side["v"]), fmt=fmt)
  for side in ("k", "v"):
    cb = getattr(books, side)
    if not isinstance(cb, jax.core.Tracer) and not np.isfinite(np.asarray(cb, np.float32)).all():
      raise ValueError(
          f"{side}_samples: centroids overflow codebook_dtype={jnp.dtype(fmt.codebook_dtype).name} "
          f"(|values| up to {float(jnp.max(jnp.abs(k_samples if side == 'k' else v_samples))):.3g}); "
          f"use a format with a wider codebook dtype or rescale the data")
  return books


@functools.partial(jax.jit, static_argnums=0)
def _forward_kv(graphdef, state, tokens):
  return nnx.merge(graphdef, state).forward_kv(tokens)[1:]


def calibration_kv(model, tokens, lengths=None, *,
                   sink_tokens: int = 0) -> tuple[jax.Array, jax.Array]:
  """Every layer's K/V of the real tokens of right-padded prompts: what `fit` learns from.

  One jitted full-precision causal forward (``model.forward_kv``,
  `models.llama.Llama.forward_kv`): the K/V each layer would append to its
  cache (keys after RoPE, in the model dtype). Because keys are rotated by
  their position, calibrate on rows that cover the positions the cache will
  serve: on SmolLM2-135M, cq2 evaluated at positions 0..511 reached KL 0.074
  with 8192 calibration tokens as 16 rows of 512, and 0.385 with the same
  tokens as one row (`bench/results/vq-NOTES.md`).

  Args:
    model: an NNX model with ``forward_kv(tokens [B, T]) -> (logits, k, v)``,
      ``k``/``v`` ``[L, B, T, Hkv, D]``.
    tokens: ``[B, T]`` int token ids, row ``b`` right-padded after
      ``lengths[b]`` real tokens (in ``[0, vocab)``; padding may be any id).
    lengths: ``[B]`` ints in ``[1, T]``; None = every token is real.
    sink_tokens: leave out each row's first ``sink_tokens`` tokens (an int
      >= 0; e.g. ``fmt.sink_tokens``): a format with sinks never reads their
      codes, and its codebooks fit the other tokens better without the
      outlier sink vectors (bench/results/vq-NOTES.md, 2026-11-27). The
      forward still sees them (the other tokens' K/V depend on them).
  Returns:
    ``(k, v)``, each ``[L, N, Hkv, D]`` with ``N = sum(max(lengths -
    sink_tokens, 0))`` (row-major).
  """
  tokens = np.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"tokens.shape={tokens.shape} must be [B, T]")
  if tokens.size and (tokens.dtype == np.bool_ or not np.issubdtype(tokens.dtype, np.integer)):
    raise TypeError(f"tokens.dtype={tokens.dtype} must be an integer dtype")
  b, t = tokens.shape
  lengths = np.full((b,), t) if lengths is None else np.asarray(lengths)
  if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer) \
      or lengths.min(initial=1) < 1 or lengths.max(initial=t) > t:
    raise ValueError(f"lengths={lengths.tolist()} must be {b} ints in [1, T={t}]")
  if not _is_int(sink_tokens) or sink_tokens < 0:
    raise ValueError(f"sink_tokens={sink_tokens!r} must be an int >= 0")
  real = np.arange(t)[None, :] < lengths[:, None]                        # [B, T]
  vocab = getattr(getattr(model, "config", None), "vocab_size", None)
  if vocab is not None:  # the real tokens only: padding may hold any id
    from jaxkv.decoding import _check_ids  # pylint: disable=import-outside-toplevel
    _check_ids("tokens", tokens[real], vocab)
  tokens = tokens.astype(np.int32)
  graphdef, state = nnx.split(model)
  k, v = _forward_kv(graphdef, state, jnp.asarray(tokens))
  keep = real & (np.arange(t)[None, :] >= sink_tokens)                   # [B, T]
  return k[:, keep], v[:, keep]
