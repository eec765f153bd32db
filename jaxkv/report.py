"""`python -m jaxkv formats`: memory and attention error of every preset."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxkv.attention import decode_attention, reference_attention
from jaxkv.cache import KVCache
from jaxkv.formats import PRESETS


def format_report(*, batch: int = 2, length: int = 1000, kv_heads: int = 8, q_heads: int = 32,
                  head_dim: int = 128, seed: int = 0) -> list[dict]:
  """Measures each preset on one random cache (Llama-3-8B-like head shapes).

  Returns one row per preset: bytes per token per layer, compression over
  bf16, and the relative L2 error of decode attention against full
  precision (float32 K/V, the same random data for every preset).
  """
  rng = np.random.default_rng(seed)
  shape = (batch, length, kv_heads, head_dim)
  k = jnp.asarray(rng.normal(size=shape), jnp.float32)
  v = jnp.asarray(rng.normal(size=shape), jnp.float32)
  q = jnp.asarray(rng.normal(size=(batch, 1, q_heads, head_dim)), jnp.float32)
  lengths = jnp.full((batch,), length, jnp.int32)
  exact = np.asarray(reference_attention(q, k, v, lengths), np.float64)
  bf16_bytes = PRESETS["bf16"].bytes_per_token(kv_heads, head_dim)
  rows = []
  for name, fmt in PRESETS.items():
    cache = KVCache.init(fmt, batch, kv_heads, head_dim, length, jnp.float32).prefill(k, v, lengths)
    out = np.asarray(decode_attention(q, cache), np.float64)
    per_tok = fmt.bytes_per_token(kv_heads, head_dim)
    rows.append(dict(format=name, k_bits=fmt.k_bits, v_bits=fmt.v_bits,
                     bytes_per_token=per_tok, compression=bf16_bytes / per_tok,
                     attention_rel_err=float(np.linalg.norm(out - exact) / np.linalg.norm(exact))))
  return rows


def print_report(rows: list[dict]) -> None:
  print(f"{'format':<15}{'K/V bits':>9}{'bytes/token/layer':>19}{'vs bf16':>9}{'attn rel err':>14}")
  for r in rows:
    print(f"{r['format']:<15}{str(r['k_bits']) + '/' + str(r['v_bits']):>9}"
          f"{r['bytes_per_token']:>19.1f}{r['compression']:>8.2f}x{r['attention_rel_err']:>14.2e}")
