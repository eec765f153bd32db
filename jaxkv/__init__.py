"""jaxkv: low-bit KV-cache decoding for JAX.

Public API:
  KVFormat, PRESETS         storage formats (`jaxkv.formats`)
  KVCache                   functional quantized cache (`jaxkv.cache`)
  decode_attention          attention over a cache, `implementation=` switch
  reference_attention       exact attention on plain K/V
  quant                     reference quantize/dequantize/pack/unpack
"""

from jaxkv import quant
from jaxkv.attention import decode_attention, reference_attention
from jaxkv.cache import KVCache, QuantizedKV
from jaxkv.formats import PRESETS, KVFormat

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "KVFormat",
    "PRESETS",
    "QuantizedKV",
    "decode_attention",
    "quant",
    "reference_attention",
]
