#!/usr/bin/env bash
# Sets up a checkout on a fresh machine, and is cheap to re-run: a virtual environment in .venv with the pinned
# dependencies, and fdc_ops._C built in place (ninja rebuilds only what changed). The checkout is put on the venv's
# path with a .pth file, so `import fdc_ops` works from anywhere without a second, separate build of the extension.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r requirements.txt

echo "building fdc_ops._C (CUDA sources too when a CUDA toolkit is found; FDC_CUDA=0/1 overrides)"
MAX_JOBS=${MAX_JOBS:-2} .venv/bin/python setup.py --quiet build_ext --inplace

site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd > "$site/fdc_ops-checkout.pth"
.venv/bin/python -c 'import fdc_ops, torch; print("fdc_ops ready: torch", torch.__version__, "ops", sorted(n for n in dir(torch.ops.fdc) if not n.startswith("_") and n not in ("name", "op", "qualified_name")))'
