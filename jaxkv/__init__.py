"""jaxkv: low-bit KV-cache decoding for JAX.

Public API:
  KVFormat, PRESETS         storage formats (`jaxkv.formats`)
  KVCache                   functional quantized cache (`jaxkv.cache`)
  decode_attention          attention over a cache, `implementation=` switch
  reference_attention       exact attention on plain K/V
  generate, decode_step     jitted decoding with a model (`jaxkv.generate`)
  autotune                  kernel config search on the current GPU
  quant                     reference quantize/dequantize/pack/unpack
"""

from jaxkv import quant
from jaxkv.attention import decode_attention, reference_attention
from jaxkv.autotune import autotune
from jaxkv.cache import KVCache, QuantizedKV
from jaxkv.formats import PRESETS, KVFormat
from jaxkv.generate import decode_step, generate

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "KVFormat",
    "PRESETS",
    "QuantizedKV",
    "autotune",
    "decode_attention",
    "decode_step",
    "generate",
    "quant",
    "reference_attention",
]
