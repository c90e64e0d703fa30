#!/bin/sh
# python.sh: the qkeep Python package's tests (tests/python/test_*.py, unittest) against the libqkeep,
# plugins, qkeep command and examples of this build tree. Skips (77) without a python3 that has
# numpy, and under the sanitizers (an ASan libqkeep cannot be loaded into an uninstrumented python).
build=${QKEEP_TEST_BUILDDIR:-.}
src=${QKEEP_TEST_SRCDIR:-.}
# The package is pure Python: any python3 >= 3.9 with numpy runs the tests, configure's first
# ($PYTHON), else the one on PATH, else Debian's (a PATH may put a python3 without numpy first).
py=
for candidate in "${PYTHON:-}" python3 /usr/bin/python3; do
  if [ -n "$candidate" ] && [ "$candidate" != ":" ] && command -v "$candidate" >/dev/null 2>&1 &&
    "$candidate" -c "import sys, numpy; sys.exit(sys.version_info < (3, 9))" 2>/dev/null; then
    py=$candidate
    break
  fi
done
if [ -z "$py" ]; then
  echo "SKIP: no python3 >= 3.9 with numpy (Debian: python3 python3-numpy)"; exit 77
fi
echo "python: $py ($("$py" -c 'import sys, numpy; print(sys.version.split()[0], "numpy", numpy.__version__)'))"
lib="$build/libqkeep/.libs/libqkeep.so.0"
if ! probe=$("$py" -c "import ctypes, sys; ctypes.CDLL(sys.argv[1])" "$lib" 2>&1); then
  case $probe in
  *AddressSanitizer* | *ASan*) echo "SKIP: libqkeep is built with the sanitizers"; exit 77 ;;
  esac
  echo "FAIL: $py cannot load $lib: $probe"; exit 1
fi
QKEEP_LIBRARY=$lib PYTHONPATH="$src/python:$src/tests/python" PYTHONDONTWRITEBYTECODE=1 \
  exec "$py" -m unittest discover -s "$src/tests/python" -p 'test_*.py' -v
