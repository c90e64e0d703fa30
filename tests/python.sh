#!/bin/sh
# python.sh: the qkeep Python package's tests (tests/python/test_*.py, unittest) against the libqkeep,
# plugins, qkeep command and examples of this build tree. Skips (77) without a python3 that has
# numpy, and under the sanitizers (an ASan libqkeep cannot be loaded into an uninstrumented python).
build=${QKEEP_TEST_BUILDDIR:-.}
src=${QKEEP_TEST_SRCDIR:-.}
py=${PYTHON:-python3}
if [ "$py" = ":" ] || ! command -v "$py" >/dev/null 2>&1; then
  echo "SKIP: no python3 (configure found none)"; exit 77
fi
if ! "$py" -c "import numpy" 2>/dev/null; then
  echo "SKIP: $py has no numpy (Debian: python3-numpy)"; exit 77
fi
lib="$build/libqkeep/.libs/libqkeep.so.0"
if ! probe=$("$py" -c "import ctypes, sys; ctypes.CDLL(sys.argv[1])" "$lib" 2>&1); then
  case $probe in
  *AddressSanitizer* | *ASan*) echo "SKIP: libqkeep is built with the sanitizers"; exit 77 ;;
  esac
  echo "FAIL: $py cannot load $lib: $probe"; exit 1
fi
QKEEP_LIBRARY=$lib PYTHONPATH="$src/python:$src/tests/python" PYTHONDONTWRITEBYTECODE=1 \
  exec "$py" -m unittest discover -s "$src/tests/python" -p 'test_*.py' -v
