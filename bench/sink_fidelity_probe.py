"""A probe, not a feature: what keeping the first S tokens exact (attention sinks) would
do to cq2 / kivi2-g32 fidelity at a 4096-token window (CPU, SmolLM2-135M-Instruct).

jaxkv has no sink buffer. This emulates one: the decode steps' reference attention
dequantizes each layer (`LayerView.materialize().dequantize()`), and the monkeypatch
below overwrites rows [0, S) of the dequantized K/V with the window's own K/V in bf16
(what a full-precision sink buffer would hold; its bytes are not counted). Caches are
traced afresh per row (`jax.clear_caches`), since S is read at trace time. Everything
else is `bench/vq_fidelity.py --prompt 3968 --steps 128 --windows 1 --calib 16384`.
Results: `bench/results/vq-fidelity-window4096-sinks-20261126-cpu.json`, vq-NOTES.

  python bench/sink_fidelity_probe.py [OFFSET]   # ~15 min on 2 CPU cores

OFFSET (default 0): the window's first token in the reference text (it must end
before the calibration tokens, the text's last 16384); results of OFFSET > 0 go
to ``vq-fidelity-window4096-sinks-off{OFFSET}-cpu.json``.

``--exclude`` (2026-11-27, third session): a closer emulation of a real sink
buffer, which would keep the first S tokens out of the quantized region
altogether. The prefill stores rows [0, S) as copies of row S (so the sinks no
longer widen the first K group's per-channel range), the VQ codebooks are fit
without each calibration row's first S tokens, and the decode steps still see
the exact sinks. Rows: bf16, then cq2 / kivi2-g32 / kivi2 with S = 0 and 4;
results to ``...-sinks-excl[-off{OFFSET}]-cpu.json``.
"""
import os, sys, time, json
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "bench"))
import numpy as np, jax, jax.numpy as jnp
from flax import nnx
import jaxkv
from jaxkv import fidelity, vq
from jaxkv.cache import KVCache
from jaxkv.vq_cache import VQCache
from jaxkv.model_cache import LayerView, ModelCache
from models import llama
from models.gguf import find_smollm2
from models.tokenizer import load_tokenizer
import vq_fidelity as VF

SINK = {"exact": None, "n": 0}
_mat = LayerView.materialize
def materialize(self):
  out = _mat(self)
  object.__setattr__(out, "_sink_layer", self.index)
  return out
LayerView.materialize = materialize
def patch(cls):
  orig = cls.dequantize
  def dequantize(self, *a, **kw):
    k, v = orig(self, *a, **kw)
    layer = getattr(self, "_sink_layer", None)
    if SINK["exact"] is None or layer is None or SINK["n"] == 0:
      return k, v
    ek, ev = SINK["exact"]
    n = SINK["n"]
    lk = jax.lax.dynamic_index_in_dim(ek, layer, 0, keepdims=False)[:, :n]   # [B, n, H, D]
    lv = jax.lax.dynamic_index_in_dim(ev, layer, 0, keepdims=False)[:, :n]
    return k.at[:, :n].set(lk.astype(k.dtype)), v.at[:, :n].set(lv.astype(v.dtype))
  cls.dequantize = dequantize
patch(KVCache); patch(VQCache)
EXCLUDE = "--exclude" in sys.argv
_with_history = ModelCache.append_layer_with_history
def append_layer_with_history(self, index, k_new, v_new, plan, **kw):
  n = SINK["n"]
  if EXCLUDE and n and k_new.shape[1] > n:   # the prefill: rows [0, n) stored as row n
    k_new = k_new.at[:, :n].set(jnp.broadcast_to(k_new[:, n:n + 1], k_new[:, :n].shape))
    v_new = v_new.at[:, :n].set(jnp.broadcast_to(v_new[:, n:n + 1], v_new[:, :n].shape))
  return _with_history(self, index, k_new, v_new, plan, **kw)
ModelCache.append_layer_with_history = append_layer_with_history

PROMPT, STEPS, CALIB = 3968, 128, 16384
t0 = time.time()
path = find_smollm2()
model = llama.from_pretrained(path, dtype=jnp.float32)
tokens = np.asarray(load_tokenizer(path).encode(fidelity.reference_text()), np.int32)
graphdef, state = nnx.split(model)
span = PROMPT + STEPS + 1
ARGS = [a for a in sys.argv[1:] if a != "--exclude"]
OFFSET = int(ARGS[0]) if ARGS else 0
if OFFSET < 0 or OFFSET + span > len(tokens) - CALIB:
  raise SystemExit(f"OFFSET={OFFSET}: the window must lie in [0, {len(tokens) - CALIB - span}]")
windows = tokens[OFFSET:OFFSET + span][None]
w = PROMPT + STEPS
calib = tokens[-CALIB:][None][:, : CALIB // w * w].reshape(-1, w)
k_calib, v_calib = vq.calibration_kv(model, calib)
prompt = jnp.asarray(windows[:, :PROMPT])
inputs = jnp.asarray(windows[:, PROMPT:PROMPT + STEPS].T)
targets = windows[:, PROMPT + 1:PROMPT + STEPS + 1]
ek, ev = nnx.merge(graphdef, state).forward_kv(jnp.asarray(windows[:, :8]))[1:]   # [L, B, 8, H, D]
SINK["exact"] = (ek.astype(jnp.bfloat16), ev.astype(jnp.bfloat16))
print(f"setup {time.time()-t0:.0f}s", flush=True)
books = vq.fit(k_calib, v_calib, vq.VQ_PRESETS["cq2"], seed=0, iters=16)
RUNS = [("bf16", 0), ("cq2", 0), ("cq2", 4), ("kivi2-g32", 0), ("kivi2-g32", 4)]
if EXCLUDE:   # codebooks without each calibration row's first 4 tokens (the sinks)
  def drop_sinks(x, n=4):   # [L, rows * w, H, D] -> [L, rows * (w - n), H, D]
    x = x.reshape(x.shape[0], -1, w, *x.shape[2:])[:, :, n:]
    return x.reshape(x.shape[0], -1, *x.shape[3:])
  books_s = vq.fit(drop_sinks(k_calib), drop_sinks(v_calib), vq.VQ_PRESETS["cq2"], seed=0, iters=16)
  RUNS = [("bf16", 0), ("cq2", 0), ("cq2", 4), ("kivi2-g32", 0), ("kivi2-g32", 4), ("kivi2", 0),
          ("kivi2", 4)]
rows, ref = [], None
for name, n in RUNS:
  t1 = time.time()
  jax.clear_caches()
  SINK["n"] = n
  if name == "cq2":
    cache = model.init_cache(vq.VQ_PRESETS["cq2"], 1, w, jnp.bfloat16,
                             codebooks=books_s if EXCLUDE and n else books)
  else:
    cache = model.init_cache(jaxkv.KVFormat.preset(name), 1, w, jnp.bfloat16, use_kernel=False)
  fn = jax.jit(VF._forced_logp.__wrapped__, static_argnums=0) if hasattr(VF._forced_logp, "__wrapped__") else VF._forced_logp
  logp = np.asarray(fn(graphdef, state, cache, prompt, inputs))
  tl = np.take_along_axis(logp, targets.T[:, :, None], axis=-1)[..., 0]
  if ref is None:
    ref = logp
  row = {"format": name, "sink_tokens": n, "perplexity": fidelity.perplexity(tl),
         "kl_vs_bf16": float(fidelity.kl_divergence(ref, logp).mean()), "seconds": time.time() - t1}
  rows.append(row); print(row, flush=True)
json.dump({"settings": {"prompt": PROMPT, "steps": STEPS, "calib": CALIB, "offset": OFFSET,
                        "jax": jax.__version__,
                        "device": jax.default_backend(), "emulation": "rows [0, n) of each decode step's dequantized K/V replaced by the window's bf16 K/V"
                        + ("; the prefill stores rows [0, n) as copies of row n and cq2's codebooks"
                           " are fit without each calibration row's first 4 tokens" if EXCLUDE else "")},
           "rows": rows}, open(os.path.join(ROOT, "bench", "results", "vq-fidelity-window4096-sinks"
                                 + ("-excl" if EXCLUDE else "") + (f"-off{OFFSET}" if OFFSET else "") + "-cpu.json"), "w"),
          indent=1)
