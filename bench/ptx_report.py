"""What the Triton lowering makes of the jaxkv kernels on this GPU (PTX census).

Dumps XLA's compiled PTX for one decode-attention call per format and counts,
per jaxkv kernel, the instructions that decide speed on Hopper: tensor-core
dots (``mma.sync`` = Ampere-style HMMA, ``wgmma`` = Hopper), global load
widths (``ld.global.v4`` = 16-byte vector loads), async copies and spills.

Usage: python bench/ptx_report.py [DUMP_DIR]
"""

from __future__ import annotations

import collections
import os
import re
import sys
import tempfile

DUMP = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="jaxkv_ptx_")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.attention import random_packed  # noqa: E402
from jaxkv.formats import PRESETS  # noqa: E402
import pallas_kernels as pk  # noqa: E402

PATTERNS = {
    "mma.sync": r"\bmma\.sync", "wgmma": r"\bwgmma\.", "ld.global.v4": r"ld\.global[.\w]*\.v4",
    "ld.global.v2": r"ld\.global[.\w]*\.v2", "ld.global (scalar)": r"ld\.global(?![.\w]*\.v[24])",
    "cp.async": r"\bcp\.async", "ld.local (spill)": r"\bld\.local", "st.local (spill)": r"\bst\.local",
    "ex2": r"\bex2\.", "cvt": r"\bcvt\.",
}


def census(text):
  """Per .entry function in a PTX file: instruction counts."""
  out = {}
  for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\n\}", text, re.S):
    name, body = m.group(1), m.group(0)
    out[name] = {k: len(re.findall(p, body)) for k, p in PATTERNS.items()}
  return out


def main():
  b, t, hq, hkv, d = 1, 8192, 32, 8, 128
  q = jax.random.normal(jax.random.PRNGKey(0), (b, 1, hq, d), jnp.bfloat16)
  for name in ("kivi4", "kivi2", "int4-token-g4", "int8", "k8v4", "bf16"):
    fmt = PRESETS[name]
    data = random_packed(jax.random.PRNGKey(1), fmt, b, t, hkv, d)
    jax.block_until_ready(pk.dequant_decode_attention(q, *data.arrays, data.lengths, fmt=fmt))
    x = jax.random.normal(jax.random.PRNGKey(2), (8, 128, 128), jnp.bfloat16)
    if fmt.k_bits < 16:
      jax.block_until_ready(pk.quantize_pack(x, fmt.k_bits, axis=fmt.k_axis, group=128 if fmt.k_axis == "channel" else fmt.channel_group_for(d)))
  found = collections.OrderedDict()
  for root, _, files in os.walk(DUMP):
    for f in files:
      if f.endswith(".ptx"):
        with open(os.path.join(root, f)) as fh:
          for k, v in census(fh.read()).items():
            if "jaxkv" in k or "pack" in k or "dequant" in k or "combine" in k:
              found[k] = v
  if not found:
    ptx = [f for _, _, fs in os.walk(DUMP) for f in fs if f.endswith(".ptx")]
    print(f"no jaxkv kernels found in {len(ptx)} PTX files under {DUMP}: {ptx[:10]}")
  cols = list(PATTERNS)
  print("kernel".ljust(48) + " ".join(c[:12].rjust(12) for c in cols))
  for k, v in found.items():
    print(k[:47].ljust(48) + " ".join(str(v[c]).rjust(12) for c in cols))


if __name__ == "__main__":
  main()
