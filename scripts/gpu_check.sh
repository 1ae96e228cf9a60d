#!/usr/bin/env bash
# Every check the project owes on a GPU, planned for the lent H100/H200 machines: 15 minutes of device time in all
# (machine start and idle included), 10 minutes per command, a bare machine at each start that keeps ignored build
# outputs only while warm (30 s after a call). Two commands on one warm machine:
#
#   first  = prebuilt-or-build, tests, the four sanitizer tools at once   limits 180 + 100 + 300 s (racecheck 360)
#   second = bench                                                       limit 300 s
#
# Measured on 2026-11-27 (bench/results/gpu-check/README.md): the prebuilt extension's check 7 s, the tests 39 s on an
# H100 and 57 s on an H200 (717 tests); one tool at a time on the H100, memcheck reached 119 tests in 150 s, initcheck
# 96 in 70 s, racecheck 5 in 80 s; all four at once on the H200 in 300 s, synccheck finished (102 tests, 45 s),
# memcheck reached 113 of 127, initcheck 100 of 113, racecheck 46 of 75. The slowdown seems to land on the GPU, so
# running them at once saves only the waiting between them; racecheck is the slowest (one random case per test, no G
# sweep, no widest heads). STEPS picks any subset: what is still owed, e.g. racecheck alone in a second call.
#
# "tests" is every CUDA test file plus the bad-input and opcheck files (opcheck runs on CUDA inputs where a GPU is
# visible); the sanitizers run the CUDA tests with fewer random cases (FDC_CUDA_CASES) and without the 32K-key
# sequences, since they slow kernels 10-100x; racecheck and synccheck only the files whose kernels use shared memory and
# barriers; "bench" is the decode and prefill benchmarks' full shapes and bench_ops' quantized decode and prefill over
# cached pages (int8 and e4m3 caches against bf16; not yet timed on a GPU) (decode took 36 s on an H200; prefill with
# 0.1 s of timed calls per measurement instead of 0.5; --quick in a dry run). Each step runs under its limit (timeout),
# so one hang costs its limit, not the call.
#
# The extension travels prebuilt (PREBUILT=DIR holding _C.cpython-*.so and _build_info.py, built here against the GPU
# machine's Python 3.12 and torch 2.11.0+cu130 by scripts/gpu_prebuild.sh): the first step then only checks that it
# loads with its CUDA kernels (4 s here), and falls back to building (sm_90, every core) if it does not. Measured here
# on 2026-11-27 (2-core AMD EPYC, two compiles at a time): the 31 sources (22 CUDA files for sm_90) took 37 minutes
# of compiles, the longest 107 s, so a build on the GPU machine's 16 cores would cost about 2 minutes of its 15; what
# travels is 43 MB of the 64 MiB allowed (the checkout 14.5 MB, the prebuilt extension 28.6 MB).
# Since 2026-11-29 the quantized caches' decode adds 6 CUDA units (28 in all): scripts/gpu_prebuild.sh took 10.5
# minutes here (2 jobs, sm_90), the prebuilt extension is 43.7 MB, and what travels 60.6 MB of the 64 MiB (67.1 MB).
# The quantized prefill (no new units) made it 44.0 MB, what travels 61.0 MB; a full rebuild took 9.7 minutes.
#
#   scripts/gpu_check.sh [WORK_DIR]     WORK_DIR (default build/gpu-check) keeps the logs of every step across calls
#
# Environment: STEPS ("first", "second", or step names: build tests memcheck racecheck synccheck initcheck bench;
# default "first second"), PREBUILT (above), COPY_TO (a folder that receives summary.json, exit-codes, this call's
# logs as logs.tar.gz and the benchmark JSON: $OUT on the device machine, 6 files at most), PYTHON (default python3),
# FDC_CUDA_ARCHS (default 90), FDC_COMMIT (the commit the summary and JSON record, for a copy without .git),
# PYTEST_ARGS (extra pytest arguments for the tests step), DRY_RUN=1 (the CPU rehearsal: every step runs its pytest
# command without compute-sanitizer, so the CUDA tests skip, saying why, and the plumbing is checked end to end).
set -uo pipefail
cd "$(dirname "$0")/.."

work=${1:-build/gpu-check}
mkdir -p "$work"
python=${PYTHON:-python3}
steps=${STEPS:-first second}
steps=${steps//first/build tests memcheck racecheck synccheck initcheck}
steps=${steps//second/bench}
status=0
ran=()

step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND for at most LIMIT_S s, logs to $work/NAME.log, records the exit
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$work/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "gpu_check: $name stopped at its limit of $limit s" >> "$work/$name.log"
  tail -n 12 "$work/$name.log"
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  echo "$name $rc $((SECONDS - start))" >> "$work/exit-codes"  # one line per run; gpu_summary.py reads the last
  ran+=("$name")
  [ $rc -eq 0 ] || status=1
  return $rc
}

wants() { [[ " $steps " == *" $1 "* ]]; }

# Without torch's caching allocator every tensor is its own allocation, so memcheck sees an access past a tensor and
# initcheck a read of memory nothing wrote (a cached block would hide both). Graph capture needs the caching allocator,
# so the sanitizer steps leave the graph tests to the tests step.
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
under() {  # under TOOL CASES: sets the array run_under, the prefix that runs a command under compute-sanitizer's TOOL
  run_under=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 FDC_CUDA_CASES="$2")
  [ "${DRY_RUN:-0}" = 1 ] || run_under+=("$sanitizer" --tool "$1" --error-exitcode 1 --print-limit 50)
}

has_cuda_kernels() {  # the extension in fdc_ops/ loads into this torch and registers CUDA kernels
  "$python" -c "import torch, fdc_ops; assert torch._C._dispatch_has_kernel_for_dispatch_key('fdc::decode_attention',
 'CUDA'), 'fdc_ops._C has no CUDA kernels'; print('fdc_ops._C loads, with CUDA kernels, into torch', torch.__version__)"
}

build() {  # the prebuilt extension if it loads with CUDA kernels, else a build for FDC_CUDA_ARCHS with every core
  if [ -n "${PREBUILT:-}" ]; then
    cp "$PREBUILT"/_C.cpython-*.so "$PREBUILT"/_build_info.py fdc_ops/ && has_cuda_kernels && return 0
    echo "gpu_check: the prebuilt extension in $PREBUILT did not load with CUDA kernels; building it here"
    rm -f fdc_ops/_build_info.py
  fi
  FDC_CUDA=1 FDC_CUDA_ARCHS=${FDC_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "$python" setup.py build_ext --inplace && has_cuda_kernels
}

if wants build; then
  export python
  export -f build has_cuda_kernels
  step build 180 bash -c build || { [ "${DRY_RUN:-0}" = 1 ] || exit 1; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

cuda_tests=(tests/cuda/test_cuda_*.py)
shared_memory_tests=(tests/cuda/test_cuda_decode.py tests/cuda/test_cuda_prefill.py tests/cuda/test_cuda_plan.py
  tests/cuda/test_cuda_quantized.py)
selection="not long and not among_many and not graph and not hf"
quick=(-v -p no:cacheprovider -k "$selection")
fewest=(-v -p no:cacheprovider -k "$selection and not group_sizes and not widest")
# The tests step spreads over 8 processes where pytest-xdist is installed (the GPU machines' image has it): the float64
# references run on the host, and the 32K-key cases are host-bound. Each process gets its share of the cores for
# torch's CPU threads: 8 processes of 16 OpenMP threads each on 16 cores made the references' many small CPU ops
# crawl (seen on the H100 machine on 2026-11-27: single tests past 20 s, the step past its limit).
parallel=()
threads=$(nproc)
if "$python" -c "import xdist" 2> /dev/null; then
  parallel=(-n 8)
  threads=$(( threads / 8 > 0 ? threads / 8 : 1 ))
fi
# shellcheck disable=SC2086
wants tests && step tests 100 env OMP_NUM_THREADS=$threads "$python" -m pytest "${cuda_tests[@]}" \
  tests/ops/test_bad_input.py tests/ops/test_opcheck.py -q -rs -p no:cacheprovider --durations=10 "${parallel[@]}" \
  ${PYTEST_ARGS:-}
# The four sanitizer tools run at once, each over its own pytest-xdist processes (compute-sanitizer follows a
# command's child processes and prints one error summary per process): one tool and one process at a time, memcheck
# reached 119 tests in 150 s, initcheck 96 in 70 s and racecheck 5 in 80 s on the H100, too slow to finish all four
# in one call. Workers per tool roughly in proportion to its tests and slowdown, 15 on 16 cores, one thread each.
sanitize() {  # sanitize TOOL CASES LIMIT WORKERS TEST_ARGS...: one tool's step, in the background
  local tool=$1 cases=$2 limit=$3 workers=$4
  shift 4
  under "$tool" "$cases"
  local spread=()
  [ ${#parallel[@]} -gt 0 ] && spread=(-n "$workers")
  step "$tool" "$limit" env OMP_NUM_THREADS=1 "${run_under[@]}" "$python" -m pytest "$@" --durations=10 "${spread[@]}" &
  pids+=($!)
  names+=("$tool")
}
pids=()
names=()
wants memcheck && sanitize memcheck 4 300 4 "${cuda_tests[@]}" "${quick[@]}"
wants racecheck && sanitize racecheck 1 360 5 "${shared_memory_tests[@]}" "${fewest[@]}"
wants synccheck && sanitize synccheck 2 300 2 "${shared_memory_tests[@]}" "${quick[@]}"
wants initcheck && sanitize initcheck 2 300 4 "${cuda_tests[@]}" "${quick[@]}"
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || status=1
  ran+=("${names[$i]}")
done
size=()
[ "${DRY_RUN:-0}" = 1 ] && size=(--quick)
wants bench && rm -f "$work"/*-decode-*.json "$work"/*-prefill-*.json "$work"/*-ops-*.json && step bench 300 sh -c \
  "'$python' bench/bench_decode.py ${size[*]} --out '$work' && \
   '$python' bench/bench_prefill.py ${size[*]} --budget 0.1 --out '$work' && \
   '$python' bench/bench_ops.py ${size[*]} --phase quantized prefix --dtype bfloat16 --out '$work'"

"$python" scripts/gpu_summary.py "$work" > /dev/null || status=1
if [ -n "${COPY_TO:-}" ]; then  # at most 6 files: the device tool brings back 8
  mkdir -p "$COPY_TO"
  cp "$work/summary.json" "$work/exit-codes" "$COPY_TO"/
  logs=()
  for name in "${ran[@]}"; do logs+=("$name.log"); done
  [ ${#logs[@]} -eq 0 ] || tar -czf "$COPY_TO/logs.tar.gz" -C "$work" "${logs[@]}"
  wants bench && cp "$work"/*-decode-*.json "$work"/*-prefill-*.json "$work"/*-ops-*.json "$COPY_TO"/ 2> /dev/null
fi
exit $status
