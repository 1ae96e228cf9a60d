#!/usr/bin/env bash
# Builds fdc_ops._C here, for the lent GPU machines, so that it travels prebuilt (scripts/gpu_check.sh's PREBUILT):
# against their Python (3.12) and torch (2.11.0+cu130, the same wheel as on the package index), CUDA kernels for
# sm_90 only. The build runs in a copy of the checkout (the in-place build would replace the fdc_ops/_build_info.py
# of this checkout's own build) and leaves _C.cpython-312-*.so and _build_info.py in build/gpu-prebuilt, which a
# device call names in its carry list.
#
#   scripts/gpu_prebuild.sh            GPU_PYTHON (default: python3.12 on PATH), GPU_TORCH (default 2.11.0)
set -euo pipefail
cd "$(dirname "$0")/.."

root=$PWD
venv=build/venv-gpu
source_copy=build/gpu-prebuild-src
out=build/gpu-prebuilt
torch_release=${GPU_TORCH:-2.11.0}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('$torch_release')"; then
  "${GPU_PYTHON:-python3.12}" -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$torch_release" numpy setuptools wheel ninja
fi
# What the build reads, copied with its timestamps, so that a second run rebuilds only the sources that changed.
mkdir -p "$source_copy" "$out"
cp -r --preserve=timestamps setup.py csrc include fdc_ops "$source_copy"/
(cd "$source_copy" && FDC_CUDA=1 FDC_CUDA_ARCHS=90 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$root/$venv/bin/python" setup.py build_ext --inplace)
rm -f "$out"/_C.*.so
cp "$source_copy"/fdc_ops/_C.cpython-312-*.so "$source_copy"/fdc_ops/_build_info.py "$out"/
ls -l "$out"
