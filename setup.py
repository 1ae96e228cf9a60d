"""Builds fdc_ops._C: the CPU kernels always, the CUDA kernels whenever a CUDA toolkit and a CUDA build of torch are
present (a visible GPU is not needed). FDC_CUDA=1 requires the CUDA build, FDC_CUDA=0 skips it.

The toolkit is CUDA_HOME when set; otherwise it is asked of `nvcc` on PATH (its --dryrun names the real toolkit
folder, which may differ from where a wrapper script on PATH lives).
"""

import glob
import os
import shutil
import subprocess
import sysconfig

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
# sm_90 (H100/H200) is the target; sm_80 (A100) costs one more device pass per CUDA file.
CUDA_ARCHS = os.environ.get("FDC_CUDA_ARCHS", "80;90")


def find_cuda_home():
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return os.path.normpath(line.split("=", 1)[1].strip())
    return None


def use_cuda(cuda_sources, cuda_home):
    forced = os.environ.get("FDC_CUDA")
    available = torch.version.cuda is not None and cuda_home is not None
    if forced == "0":
        return False
    if forced == "1":
        if not available:
            raise RuntimeError("FDC_CUDA=1 but no CUDA toolkit (CUDA_HOME or nvcc) or torch is a CPU build "
                               f"(torch {torch.__version__})")
        return bool(cuda_sources)
    return available and bool(cuda_sources)


def extension():
    cpu_sources = ["csrc/registration.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/**/*.cu", recursive=True))
    cuda_home = find_cuda_home()
    include_dirs = [os.path.join(ROOT, "include"), os.path.join(ROOT, "csrc")]
    # -fno-trapping-math: nothing here uses floating-point traps, and without it GCC keeps the float compares of the
    # softmax loops (exp clamping, max) as branches instead of vector selects. -Wno-psabi: the 32-byte vector helpers
    # of csrc/cpu/vec_math.cpp are always inlined, so the ABI note GCC prints for them concerns no real call.
    # -fopenmp: at::parallel_for is an inline template that only spreads work over threads when the including
    # file is compiled with OpenMP, as torch itself is; without it every CPU kernel runs on one thread.
    cxx_flags = ["-O3", "-std=c++20", "-fvisibility=hidden", "-fno-trapping-math", "-Wno-psabi", "-fopenmp"]
    link_flags = ["-fopenmp"]
    if not use_cuda(cuda_sources, cuda_home):
        return CppExtension("fdc_ops._C", cpu_sources, include_dirs=include_dirs,
                            extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)
    os.environ["CUDA_HOME"] = cuda_home
    import torch.utils.cpp_extension as cpp_ext
    cpp_ext.CUDA_HOME = cuda_home
    # ATen's CUDA headers include cusparse.h, which pip's torch ships in the nvidia/cu13 wheel folder.
    site = sysconfig.get_paths()["purelib"]
    include_dirs += [p for p in glob.glob(os.path.join(site, "nvidia", "cu*", "include")) if os.path.isdir(p)]
    gencode = []
    for arch in CUDA_ARCHS.split(";"):
        gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    nvcc_flags = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"] + gencode
    return CUDAExtension("fdc_ops._C", cpu_sources + cuda_sources, include_dirs=include_dirs,
                         extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, extra_link_args=link_flags)


setup(
    name="fdc_ops",
    version="0.1.0",
    description="FDC: post-RoPE KV dimensionality compression operators for PyTorch",
    packages=find_packages(include=["fdc_ops", "fdc_ops.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
)
