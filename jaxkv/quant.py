"""Quantization and bit packing: the jnp spec every kernel matches, bit for bit.

Asymmetric round-to-nearest per group, NaN groups for non-finite input, the
planar bit layout (DESIGN.md "Quantization"; the full statement is the
docstring of `pallas_kernels.layout`, where the code lives because the
kernels, the bottom layer, need the same bits). This module is its public name.
"""

from pallas_kernels.layout import dequantize
from pallas_kernels.layout import dequantize_per_channel
from pallas_kernels.layout import dequantize_per_token
from pallas_kernels.layout import group_is_bad
from pallas_kernels.layout import pack
from pallas_kernels.layout import quantize
from pallas_kernels.layout import quantize_per_channel
from pallas_kernels.layout import quantize_groups
from pallas_kernels.layout import quantize_per_token
from pallas_kernels.layout import round_codes
from pallas_kernels.layout import unpack

__all__ = ["dequantize", "dequantize_per_channel", "dequantize_per_token", "group_is_bad",
           "pack", "quantize", "quantize_groups", "quantize_per_channel", "quantize_per_token", "round_codes",
           "unpack"]
