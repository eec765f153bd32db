"""`KVFormat`: how a KV cache stores keys and values.

A format fixes the bit width of K and V (16 = kept in the cache dtype), the
quantization axis of K, the group sizes, the full-precision residual block and
the dtype of the stored scales and zeros. See DESIGN.md "The contract".
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

VALID_BITS = (16, 8, 4, 2)
VALID_K_AXES = ("channel", "token")
VALID_SCALE_DTYPES = ("float16", "bfloat16", "float32")


def _is_pow2(n: int) -> bool:
  return n > 0 and (n & (n - 1)) == 0


def _is_int(x) -> bool:
  """A Python or numpy int that is not a bool (``True`` is no group size)."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_dtype_bytes(dtype_bytes) -> None:
  """``dtype_bytes`` of a bytes-per-token count: a positive finite real (not a bool)."""
  if (isinstance(dtype_bytes, (bool, np.bool_))
      or not isinstance(dtype_bytes, (int, float, np.integer, np.floating))
      or not 0 < dtype_bytes < float("inf")):
    raise ValueError(f"dtype_bytes={dtype_bytes!r} must be a positive number")


@dataclasses.dataclass(frozen=True)
class KVFormat:
  """Storage format of a quantized KV cache.

  Attributes:
    k_bits: bits per key element, one of 16, 8, 4, 2 (16 = unquantized).
    v_bits: bits per value element, one of 16, 8, 4, 2.
    k_axis: ``"channel"``: one (scale, zero) per channel per group of
      ``token_group`` tokens (KIVI/BitDecoding); ``"token"``: one (scale, zero)
      per token per group of ``channel_group`` channels.
    token_group: G, tokens per group for per-channel K, and the granularity at
      which residual tokens are flushed into the packed region. Power of two.
    channel_group: Gd, channels per group for per-token quantization (V
      always, K when ``k_axis="token"``); ``None`` = the whole head.
    residual: R, capacity of the full-precision residual block; a multiple of
      G. ``R = G`` is KIVI/BitDecoding, ``R = 2G`` QuantSpec's double buffer.
    scale_dtype: dtype name of stored scales and zeros.
    hierarchical: QuantSpec's hierarchical INT8 (``k_bits == v_bits == 8``):
      each 8-bit code is an upper 4-bit code (asymmetric, scale ``S_U``,
      zero ``min``) and a lower 4-bit code (symmetric, scale ``S_U / 16``)
      of the upper's error, stored as two separate planes so a draft reads
      the upper plane only (`jaxkv.hierarchical`). Both views share one cache.
    sink_tokens: S, the first tokens of each sequence also kept exactly (the
      attention sinks); `KVCache.dequantize` and the attention read them in
      place of their quantized rows (the packed rows stay as they are). In
      ``[0, token_group]``; 0 = none. `KVCache` and `ModelCache` (so the
      model) store them; the kernels attend the packed rows from a block
      past the sinks and an exact prefix attention the rest, merged by
      log-sum-exp (`jaxkv.sink_attention`; bench/results/vq-NOTES.md).
  """

  k_bits: int = 16
  v_bits: int = 16
  k_axis: Literal["channel", "token"] = "channel"
  token_group: int = 128
  channel_group: int | None = None
  residual: int = 128
  scale_dtype: str = "float16"
  hierarchical: bool = False
  sink_tokens: int = 0

  def __post_init__(self):
    for name in ("k_bits", "v_bits"):
      bits = getattr(self, name)
      if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits not in VALID_BITS:
        raise ValueError(f"{name}={bits!r} must be one of {VALID_BITS}")
    if self.k_axis not in VALID_K_AXES:
      raise ValueError(f"k_axis={self.k_axis!r} must be one of {VALID_K_AXES}")
    if not _is_int(self.token_group) or not _is_pow2(int(self.token_group)):
      raise ValueError(f"token_group={self.token_group!r} must be a positive power of two")
    if self.channel_group is not None and (
        not _is_int(self.channel_group) or self.channel_group <= 0):
      raise ValueError(f"channel_group={self.channel_group!r} must be a positive int or None")
    if (not _is_int(self.residual) or self.residual <= 0
        or self.residual % self.token_group):
      raise ValueError(
          f"residual={self.residual!r} must be a positive multiple of "
          f"token_group={self.token_group}")
    try:  # numpy's own error ("data type 'fp16' not understood") names no argument
      sd = np.dtype(self.scale_dtype).name if self.scale_dtype is not None else None
    except TypeError:
      sd = None
    if sd not in VALID_SCALE_DTYPES:
      raise ValueError(f"scale_dtype={self.scale_dtype!r} must be one of {VALID_SCALE_DTYPES}")
    object.__setattr__(self, "scale_dtype", sd)
    if not isinstance(self.hierarchical, (bool, np.bool_)):
      raise TypeError(f"hierarchical={self.hierarchical!r} must be a bool")
    if self.hierarchical and (self.k_bits, self.v_bits) != (8, 8):
      raise ValueError(f"hierarchical=True needs k_bits=v_bits=8, got k_bits={self.k_bits}, "
                       f"v_bits={self.v_bits}")
    if not _is_int(self.sink_tokens) or not 0 <= self.sink_tokens <= self.token_group:
      raise ValueError(f"sink_tokens={self.sink_tokens!r} must be an int in [0, "
                       f"token_group={self.token_group}]")
    object.__setattr__(self, "sink_tokens", int(self.sink_tokens))
    if self.sink_tokens and self.hierarchical:
      raise ValueError(f"sink_tokens={self.sink_tokens} is not supported with hierarchical "
                       "formats (hierarchical=True) yet")

  # ----------------------------------------------------------------- presets
  @classmethod
  def preset(cls, name: str) -> "KVFormat":
    """Returns a named format; see `PRESETS` for the list."""
    try:
      return PRESETS[name]
    except KeyError:
      pass
    from jaxkv.vq import VQ_PRESETS  # pylint: disable=import-outside-toplevel  (no jax at import)
    if name in VQ_PRESETS:
      raise ValueError(f"{name!r} is a VQ preset, not a KVFormat: it needs learned codebooks "
                       f"(jaxkv.VQFormat.preset({name!r}); jaxkv.generate(..., codebooks=), "
                       "model.init_cache(..., codebooks=), jaxkv.VQCache)")
    raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")

  @property
  def is_quantized(self) -> bool:
    return self.k_bits < 16 or self.v_bits < 16

  @property
  def plane_block(self) -> int:
    """Tokens per plane block of a hierarchical format's codes (its G,
    `jaxkv.hierarchical`); 0 for every other format."""
    return self.token_group if self.hierarchical else 0

  def channel_group_for(self, head_dim: int) -> int:
    """Channels per per-token group for a head of ``head_dim`` channels."""
    gd = head_dim if self.channel_group is None else self.channel_group
    if head_dim % gd:
      raise ValueError(f"head_dim={head_dim} must be divisible by channel_group={gd}")
    return gd

  def validate_head_dim(self, head_dim: int) -> None:
    """Raises ValueError if this format cannot store heads of ``head_dim``."""
    if not _is_int(head_dim) or head_dim <= 0:  # a bool is no head size (True == 1)
      raise ValueError(f"head_dim={head_dim!r} must be a positive int")
    self.channel_group_for(head_dim)
    for name, bits in (("k_bits", self.k_bits), ("v_bits", self.v_bits)):
      if bits < 16 and head_dim % (8 // bits):
        raise ValueError(f"head_dim={head_dim} must be a multiple of {8 // bits} for {name}={bits}")
    if self.hierarchical and head_dim % 2:
      raise ValueError(f"head_dim={head_dim} must be even for a hierarchical format (two "
                       "4-bit planes)")

  def packed_len(self, length):
    """Tokens held quantized for a sequence of ``length`` tokens (int or array).

    ``G * max(0, floor((L - R + G) / G))``: tokens ``[packed_len, L)`` stay in
    the full-precision residual block.
    """
    g, r = self.token_group, self.residual
    if isinstance(length, (int, np.integer)):
      return g * max(0, (int(length) - r + g) // g)
    import jax.numpy as jnp  # local: keep this module importable without jax
    return g * jnp.maximum(0, (length - r + g) // g)

  def bytes_per_token(self, kv_heads: int, head_dim: int, dtype_bytes: int = 2, *,
                      view: str = "target") -> float:
    """Bytes one token takes in the packed cache (codes + scales/zeros), K and V.

    Full-precision sides count ``dtype_bytes`` per element. The residual block
    (a fixed ``R`` tokens per sequence) is not included, nor are the sink rows
    (a fixed ``sink_tokens`` full-precision tokens per sequence, K and V:
    ``2 * sink_tokens * D * dtype_bytes`` bytes per kv head per sequence;
    `jaxkv.VQFormat.bytes_per_token` spreads them over a sequence length). ``view`` (hierarchical
    formats): ``"target"`` reads both 4-bit planes, ``"draft"`` the upper
    plane only (the same scales and zeros).
    """
    if view not in ("target", "draft"):
      raise ValueError(f"view={view!r} must be 'target' or 'draft'")
    if view == "draft" and not self.hierarchical:
      raise ValueError("view='draft' needs a hierarchical format (KVFormat.preset('quantspec'))")
    if not _is_int(kv_heads) or kv_heads <= 0:
      raise ValueError(f"kv_heads={kv_heads!r} must be a positive int")
    check_dtype_bytes(dtype_bytes)
    self.validate_head_dim(head_dim)
    sbytes = np.dtype(self.scale_dtype).itemsize
    gd = self.channel_group_for(head_dim)
    total = 0.0
    for bits, per_channel in ((self.k_bits, self.k_axis == "channel"), (self.v_bits, False)):
      if bits == 16:
        total += head_dim * dtype_bytes
        continue
      total += head_dim * (4 if view == "draft" else bits) / 8
      if per_channel:  # one (scale, zero) per channel per G tokens
        total += 2 * sbytes * head_dim / self.token_group
      else:  # one (scale, zero) per channel group per token
        total += 2 * sbytes * head_dim / gd
    return total * kv_heads


PRESETS: dict[str, KVFormat] = {
    "bf16": KVFormat(k_bits=16, v_bits=16),
    "int8": KVFormat(k_bits=8, v_bits=8, k_axis="token"),
    "kivi4": KVFormat(k_bits=4, v_bits=4, k_axis="channel", token_group=128, residual=128),
    "kivi2": KVFormat(k_bits=2, v_bits=2, k_axis="channel", token_group=128, residual=128),
    "int4-token-g4": KVFormat(k_bits=4, v_bits=4, k_axis="token", channel_group=32),
    "k8v4": KVFormat(k_bits=8, v_bits=4, k_axis="token"),
    # KIVI's own grouping: K per channel over 32 tokens, V per token over 32 channels, R = 128
    # (bench/results/fidelity-cpu.json: kivi4-g32 holds perplexity on SmolLM2, kivi2-g32 does not).
    "kivi4-g32": KVFormat(k_bits=4, v_bits=4, k_axis="channel", token_group=32, channel_group=32,
                          residual=128),
    "kivi2-g32": KVFormat(k_bits=2, v_bits=2, k_axis="channel", token_group=32, channel_group=32,
                          residual=128),
    # 0.25x bf16 bytes at head_dim 64 (bench/results/fidelity-cpu-2bit-candidates.json,
    # SmolLM2 at 2K: k4v2-g32 +1.7 % perplexity, kivi2-g16 +8.1 %, kivi2-g32 +29 %).
    "k4v2-g32": KVFormat(k_bits=4, v_bits=2, k_axis="channel", token_group=32, channel_group=32,
                         residual=128),
    "kivi2-g16": KVFormat(k_bits=2, v_bits=2, k_axis="channel", token_group=16, channel_group=16,
                          residual=128),
    # QuantSpec: hierarchical INT8 = upper INT4 (draft) + lower INT4; K per channel over 128
    # tokens, V per token, double full-precision buffer R = 2G (`jaxkv.hierarchical`).
    "quantspec": KVFormat(k_bits=8, v_bits=8, k_axis="channel", token_group=128, residual=256,
                          hierarchical=True),
}
"""Named formats. ``int4-token-g4`` has 4 channel groups at head_dim 128
(``channel_group=32``); at other head dims use ``dataclasses.replace``."""
