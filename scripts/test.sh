#!/usr/bin/env bash
# Runs every test: sets up (or refreshes) the checkout, checks the house style (scripts/lint.sh), then the C++ tests
# of the torch-free headers (CMake + ctest) and the Python test suite (pytest). CUDA tests skip, saying why, where no
# GPU is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/lint.sh

cmake_bin=.venv/bin/cmake
ctest_bin=.venv/bin/ctest
"$cmake_bin" -S . -B build/cpp -DCMAKE_BUILD_TYPE=Release > /dev/null
"$cmake_bin" --build build/cpp -j "${MAX_JOBS:-2}"
"$ctest_bin" --test-dir build/cpp --output-on-failure

.venv/bin/python -m pytest tests "$@"
