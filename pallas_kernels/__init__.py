"""Pallas GPU kernels of jaxkv: quantize+pack, dequant split-K attention, combine,
prefill-chunk flash attention, and the 4-bit weight matmul of QuantSpec's
draft model.

An implementation detail reached through `jaxkv.decode_attention(...,
implementation="pallas")` and `KVCache`'s pack path. Every kernel sits behind
one entry point (`pallas_decode_attention`, `quantize_pack`) so a Mosaic GPU
variant can sit beside the Triton one.
"""

from pallas_kernels.chunk_attention import ChunkAttentionConfig
from pallas_kernels.chunk_attention import pallas_chunk_attention
from pallas_kernels.dequant_attention import DecodeAttentionConfig
from pallas_kernels.dequant_attention import default_config
from pallas_kernels.dequant_attention import dequant_decode_attention
from pallas_kernels.dequant_attention import dequant_decode_attention_reference
from pallas_kernels.dequant_attention import pallas_decode_attention
from pallas_kernels.dequant_attention import supports
# The module `pallas_kernels.int4_matmul` keeps its name (importing its
# function here would shadow it): use `pallas_kernels.int4_matmul.int4_matmul`.
from pallas_kernels.int4_matmul import Int4MatmulConfig
from pallas_kernels.pack import PackConfig
from pallas_kernels.pack import quantize_pack
from pallas_kernels.pack import quantize_pack_kv
from pallas_kernels.pack import quantize_pack_reference

__all__ = [
    "ChunkAttentionConfig",
    "DecodeAttentionConfig",
    "default_config",
    "Int4MatmulConfig",
    "PackConfig",
    "dequant_decode_attention",
    "dequant_decode_attention_reference",
    "pallas_chunk_attention",
    "pallas_decode_attention",
    "quantize_pack",
    "quantize_pack_kv",
    "quantize_pack_reference",
    "supports",
]
