#!/bin/sh
# python_gpu.sh: the qkeep Python package with torch and transformers on a CUDA GPU (make check-gpu):
# tests/python/gpu_torch.py. Skips (77) without python3, torch, transformers, a CUDA device or the
# cuda-nvfp4 plugin.
build=${QKEEP_TEST_BUILDDIR:-.}
src=${QKEEP_TEST_SRCDIR:-.}
py=${PYTHON:-python3}
if [ "$py" = ":" ] || ! command -v "$py" >/dev/null 2>&1; then
  echo "SKIP: no python3"; exit 77
fi
QKEEP_LIBRARY="$build/libqkeep/.libs/libqkeep.so.0" PYTHONPATH="$src/python:$src/tests/python" \
  PYTHONDONTWRITEBYTECODE=1 QKEEP_PLUGIN_PATH="$build/plugins/cuda/.libs:${QKEEP_PLUGIN_PATH:-$build/plugins/cpu/.libs}" \
  exec "$py" "$src/tests/python/gpu_torch.py" "$@"
