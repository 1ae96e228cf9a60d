#!/usr/bin/env bash
# The house style, checked: ruff over the Python sources (pyproject.toml's [tool.ruff]) and clang-format over the C++
# and CUDA sources (.clang-format). The generated kernel variants are left out: scripts/generate_kernels.py writes
# them and tests/meta/test_generated_kernels.py keeps them equal to its output. To fix what it reports:
#   .venv/bin/ruff check --fix .        (unused imports and the like; line lengths by hand)
#   .venv/bin/clang-format -i FILE...
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff check --quiet .
mapfile -t cpp_sources < <(find include csrc tests/cpp \( -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' \) \
  -not -path 'csrc/cuda/generated/*' | sort)
.venv/bin/clang-format --dry-run --Werror "${cpp_sources[@]}"
echo "lint: ruff and clang-format clean (${#cpp_sources[@]} C++/CUDA files)"
