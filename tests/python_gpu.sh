#!/bin/sh
# python_gpu.sh: the qkeep Python package with torch and transformers on a CUDA GPU (make check-gpu):
# tests/python/gpu_torch.py. Skips (77) without a python3 that has torch and transformers, a CUDA
# device, the cuda-nvfp4 plugin or the engine forward.
build=${QKEEP_TEST_BUILDDIR:-.}
src=${QKEEP_TEST_SRCDIR:-.}
py=
for candidate in "${PYTHON:-}" python3; do  # configure's, else PATH's: the first that has torch
  if [ -n "$candidate" ] && [ "$candidate" != ":" ] && command -v "$candidate" >/dev/null 2>&1 &&
    "$candidate" -c "import torch, transformers" 2>/dev/null; then
    py=$candidate
    break
  fi
done
if [ -z "$py" ]; then
  echo "SKIP: no python3 with torch and transformers"; exit 77
fi
QKEEP_LIBRARY="$build/libqkeep/.libs/libqkeep.so.0" PYTHONPATH="$src/python:$src/tests/python" \
  PYTHONDONTWRITEBYTECODE=1 QKEEP_PLUGIN_PATH="$build/plugins/cuda/.libs:${QKEEP_PLUGIN_PATH:-$build/plugins/cpu/.libs}" \
  exec "$py" "$src/tests/python/gpu_torch.py" "$@"
