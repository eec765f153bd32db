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
  --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 \
  tokamax einshape jaxtyping wadler-lindig pydantic pydantic-core annotated-types \
  typing-inspection qwix "typeguard==2.13.3" immutabledict tensorboardx pytest-xdist execnet
du -sh .whl/site
