#!/usr/bin/env bash
# Optional benchmark baselines for the GPU machine (no network there): builds
# .whl/site (git-ignored) with tokamax and the pure-Python dependencies the
# GPU image lacks (pytest-xdist for the parallel GPU suite among them), as
# wheels for its Python 3.12. bench/gpu_tests.sh puts
# .whl/site on PYTHONPATH; pass `carry=[".whl"]` to the device tool.
# tokamax >= 0.0.17 wants jax >= 0.11.1 (the GPU machine has 0.11.2).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl/site
python3 -m pip install -q --target .whl/site --no-deps --python-version 3.12 \
  --only-binary=:all: --ignore-requires-python --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 \
  "tokamax>=0.0.17" einshape jaxtyping wadler-lindig pydantic pydantic-core annotated-types \
  typing-inspection qwix "typeguard==2.13.3" immutabledict tensorboardx pytest-xdist execnet
# tokamax >= 0.0.17 imports xprof (its profiler CLI, 77 MB unzipped: over the
# device tool's 64 MiB carry) at import time, only for its "xprof" timing
# method; a stub module lets it import, and any use of that method raises.
mkdir -p .whl/site/xprof/cli
: > .whl/site/xprof/__init__.py
: > .whl/site/xprof/cli/__init__.py
cat > .whl/site/xprof/cli/tools.py <<'PY'
"""Stub (bench/fetch_wheels.sh): tokamax imports this; xprof itself is not carried."""


class _Missing:
  def __getattr__(self, name):
    raise RuntimeError("xprof is not installed (stub from bench/fetch_wheels.sh)")


get_kernel_stats_tool = _Missing()
PY
du -sh .whl/site
