"""`SideSpec`: the static description of one cache side (K or V) for kernels.

Kernels take raw arrays plus one of these per side instead of re-deriving
``(bits, axis, group)`` from a format object, so `pallas_kernels` needs
nothing from `jaxkv`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class CacheFormat(Protocol):
  """What the kernels read of a cache format (`jaxkv.KVFormat` satisfies it).

  A protocol, so `pallas_kernels` depends on no `jaxkv` class.
  """

  k_bits: int
  v_bits: int
  k_axis: str
  token_group: int
  residual: int

  def channel_group_for(self, head_dim: int) -> int: ...

  def validate_head_dim(self, head_dim: int) -> None: ...

  def packed_len(self, length): ...


@dataclasses.dataclass(frozen=True)
class SideSpec:
  """How one side of the cache is stored.

  Attributes:
    bits: 8, 4 or 2 (packed planar codes, `pallas_kernels.layout`) or 16 (values kept
      in the cache dtype).
    axis: ``"token"`` (one scale/zero per token per ``group`` channels) or
      ``"channel"`` (one scale/zero per channel per ``group`` tokens).
    group: channels (token axis) or tokens (channel axis) per scale group;
      1 for 16-bit sides.
  """

  bits: int
  axis: str = "token"
  group: int = 1

  def __post_init__(self):
    if self.bits not in (2, 4, 8, 16):
      raise ValueError(f"bits={self.bits} must be 2, 4, 8 or 16")
    if self.axis not in ("token", "channel"):
      raise ValueError(f"axis={self.axis!r} must be 'token' or 'channel'")
    if self.group < 1:
      raise ValueError(f"group={self.group} must be >= 1")

  @classmethod
  def of(cls, fmt, side: str, head_dim: int) -> "SideSpec":
    """The spec of side ``"k"`` or ``"v"`` of a format (duck-typed `KVFormat`)."""
    bits = fmt.k_bits if side == "k" else fmt.v_bits
    if bits == 16:
      return cls(16, "token", 1)
    axis = fmt.k_axis if side == "k" else "token"
    group = fmt.token_group if axis == "channel" else fmt.channel_group_for(head_dim)
    return cls(bits, axis, group)
