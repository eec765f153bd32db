"""jaxkv: low-bit KV-cache decoding for JAX.

Public API:
  KVFormat, PRESETS         storage formats (`jaxkv.formats`)
  KVCache                   functional quantized cache, one layer (`jaxkv.cache`)
  ModelCache                all layers' caches stacked on a layer axis (`jaxkv.model_cache`)
  decode_attention          attention over a cache, `implementation=` switch
  chunk_attention           a prefill chunk over a cached history plus itself
                            (`jaxkv.chunked_attention`)
  reference_attention       exact attention on plain K/V
  generate, decode_steps,   jitted decoding with a model (`jaxkv.decoding`)
  decode_step, decode_compiler_options  (the XLA options those compile with, by rows)
  SplitModel                a model split once, for calling those in a loop
  autotune                  kernel config search on the current GPU (`jaxkv.tuning`;
                            timers in `jaxkv.timing`)
  make_mesh, shard_cache    a ("data", "model") device mesh; a cache placed on it
                            (`jaxkv.sharding`: rules, per-shard attention)
  quant                     reference quantize/dequantize/pack/unpack
  VQFormat, VQ_PRESETS,     vector-quantized formats, cache and k-means codebooks
  VQCache, VQCodebooks, vq  (`jaxkv.vq`, `jaxkv.vq_cache`; issue 15)
  VQModelCache              all layers' VQ caches stacked (`jaxkv.vq_model_cache`):
                            what `model.init_cache("cq2", ..., codebooks=)` returns
  hierarchical              QuantSpec's two-plane INT8 codes (draft / target views)
  StagedCache               a KVCache plus unflushed tokens: append(flush=False),
                            rollback, flush (`jaxkv.staged_cache`)
  speculative_generate,     self-speculative decoding on a "quantspec" cache
  speculative_steps         (`jaxkv.speculative`); the latter: N rounds from a
                            cache the caller holds, like decode_steps
"""

from jaxkv import hierarchical, quant
from jaxkv.attention import decode_attention, reference_attention
from jaxkv.tuning import autotune
from jaxkv.cache import KVCache, QuantizedKV
from jaxkv.chunked_attention import chunk_attention
from jaxkv.decoding import compiler_options as decode_compiler_options
from jaxkv.decoding import SplitModel, decode_step, decode_steps, generate
from jaxkv.formats import PRESETS, KVFormat
from jaxkv.model_cache import ModelCache
from jaxkv import sharding
from jaxkv.sharding import make_mesh, shard_cache, sharded_decode_attention
from jaxkv import vq
from jaxkv.vq import VQ_PRESETS, VQCodebooks, VQFormat
from jaxkv.vq_cache import VQCache
from jaxkv import vq_model_cache
from jaxkv.vq_model_cache import VQModelCache
from jaxkv.speculative import speculative_generate, speculative_steps
from jaxkv.staged_cache import StagedCache

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "KVFormat",
    "ModelCache",
    "PRESETS",
    "QuantizedKV",
    "VQCache",
    "VQCodebooks",
    "VQFormat",
    "VQModelCache",
    "VQ_PRESETS",
    "StagedCache",
    "autotune",
    "chunk_attention",
    "decode_attention",
    "decode_compiler_options",
    "decode_step",
    "decode_steps",
    "generate",
    "SplitModel",
    "hierarchical",
    "make_mesh",
    "quant",
    "reference_attention",
    "shard_cache",
    "sharded_decode_attention",
    "sharding",
    "vq",
    "speculative_generate",
    "speculative_steps",
]
