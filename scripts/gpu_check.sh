#!/usr/bin/env bash
# Every check the project owes on a GPU, in one command, for a machine with a CUDA GPU, torch and a CUDA toolkit
# already installed (no network needed): builds fdc_ops._C with its CUDA kernels in place, runs the CUDA tests (and
# opcheck on CUDA inputs), runs a subset of them under compute-sanitizer's four tools (memcheck, racecheck, synccheck,
# initcheck), then the GPU benchmarks; every step's exit code goes to OUT_DIR/exit-codes and, at the end,
# scripts/gpu_summary.py writes OUT_DIR/summary.json (device, torch, commit, pytest counts, sanitizer errors).
#
#   scripts/gpu_check.sh [OUT_DIR]       logs and benchmark JSON go to OUT_DIR (default bench/results/gpu-check)
#
# Where one command may run for 10 minutes at most (the lent GPU machines), run the steps as separate calls on the
# same machine, which keeps the build between them: STEPS=build, then STEPS=tests, STEPS=sanitizer, STEPS=bench
# (exit-codes accumulates over the calls; each call rewrites summary.json).
#
# Environment: PYTHON (default python3), FDC_CUDA_ARCHS (default 90, the H100/H200), STEPS (default
# "build tests sanitizer bench": any subset, in that order), PYTEST_ARGS (extra pytest arguments), FDC_COMMIT (the
# commit the benchmark JSON records, for a copy of the checkout without its .git folder).
set -uo pipefail
cd "$(dirname "$0")/.."

out=${1:-bench/results/gpu-check}
mkdir -p "$out"
python=${PYTHON:-python3}
steps=${STEPS:-build tests sanitizer bench}
status=0

step() {  # step NAME COMMAND...: runs COMMAND, logs to $out/NAME.log, records a failure without stopping
  local name=$1
  shift
  echo "== $name: $*"
  local start=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  { grep -v "^$name " "$out/exit-codes" 2>/dev/null; echo "$name $rc"; } > "$out/exit-codes.new"
  mv "$out/exit-codes.new" "$out/exit-codes"
  [ $rc -eq 0 ] || status=1
  return $rc
}

wants() { [[ " $steps " == *" $1 "* ]]; }

if wants build; then
  FDC_CUDA=1 FDC_CUDA_ARCHS=${FDC_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    step build "$python" setup.py build_ext --inplace || exit 1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

cuda_tests=$(ls tests/test_cuda_*.py)
if wants tests; then
  # shellcheck disable=SC2086
  step tests "$python" -m pytest $cuda_tests tests/test_bad_input.py tests/test_opcheck.py -q -rs ${PYTEST_ARGS:-}
fi

if wants sanitizer; then
  # Fewer random cases (FDC_CUDA_CASES) and no 32K-key sequences: the tools slow kernels down 10-100x. racecheck and
  # synccheck look at shared memory and barriers, which the attention and planner kernels use.
  quick=(-q -x -k "not long and not among_many")
  shared_memory_tests=(tests/test_cuda_decode.py tests/test_cuda_prefill.py tests/test_cuda_plan.py)
  # shellcheck disable=SC2086
  step memcheck env FDC_CUDA_CASES=4 compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$python" -m pytest $cuda_tests "${quick[@]}"
  step racecheck env FDC_CUDA_CASES=2 compute-sanitizer --tool racecheck --error-exitcode 1 \
    "$python" -m pytest "${shared_memory_tests[@]}" "${quick[@]}"
  step synccheck env FDC_CUDA_CASES=2 compute-sanitizer --tool synccheck --error-exitcode 1 \
    "$python" -m pytest "${shared_memory_tests[@]}" "${quick[@]}"
  # shellcheck disable=SC2086
  step initcheck env FDC_CUDA_CASES=2 compute-sanitizer --tool initcheck --error-exitcode 1 \
    "$python" -m pytest $cuda_tests "${quick[@]}"
fi

if wants bench; then
  step bench_decode "$python" bench/bench_decode.py --out "$out"
  step bench_prefill "$python" bench/bench_prefill.py --out "$out"
fi
"$python" scripts/gpu_summary.py "$out" > /dev/null || status=1
exit $status
