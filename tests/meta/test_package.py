"""The package's layering: the operator library imports without the model side, and every layer imports."""

import re
import subprocess
import sys

import pytest

HEAVY_MODULES = ("transformers", "matplotlib", "gensim", "safetensors")


def _modules_after(statement: str) -> set[str]:
    """Top-level module names loaded by a fresh interpreter after running statement."""
    code = f"import sys\n{statement}\nprint(' '.join(sorted({{name.split('.')[0] for name in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


@pytest.mark.parametrize("statement", ["import fdc_ops", "import fdc_ops.ops", "import fdc_ops.reference",
                                       "import fdc_ops.plans"])
def test_operator_library_imports_no_model_side(statement):
    loaded = _modules_after(statement)
    assert not loaded & set(HEAVY_MODULES), f"{statement!r} imported {sorted(loaded & set(HEAVY_MODULES))}"


def test_every_layer_imports():
    loaded = _modules_after("import fdc_ops.calibration, fdc_ops.parallel, fdc_ops.hf, fdc_ops.hf.loading, "
                            "fdc_ops.apps.cli, fdc_ops.apps.demo, fdc_ops.apps.eval, fdc_ops.apps.calibration_report, "
                            "fdc_ops.apps.ops_demo")
    assert "fdc_ops" in loaded and "transformers" in loaded


def _runpy_supported() -> dict:
    import runpy
    from pathlib import Path

    return runpy.run_path(str(Path(__file__).resolve().parents[2] / "fdc_ops" / "supported.py"))


def test_declared_ranges_have_one_source():
    """requirements.txt, pyproject.toml and scripts/setup_vllm.sh say what fdc_ops/supported.py says (setup.py reads
    it directly): the test environments are the ends of the ranges the package declares."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    supported = _runpy_supported()
    within = supported["within"]
    requirements = {line.split("#")[0].strip() for line in (root / "requirements.txt").read_text().splitlines()}
    for name, bound in {**supported["HF_EXTRA"], "numpy": supported["NUMPY"]}.items():
        assert name + bound in requirements, f"requirements.txt should say {name}{bound}, as fdc_ops/supported.py"
    pinned = [line for line in requirements if line.startswith("torch==")]
    assert pinned and within(pinned[0][len("torch=="):], supported["TORCH"]), pinned
    assert f'"torch{supported["TORCH"]}"' in (root / "pyproject.toml").read_text()
    script = (root / "scripts" / "setup_vllm.sh").read_text()
    vllm = re.search(r"^VLLM_VERSION=(\S+)$", script, re.M).group(1)
    assert within(vllm, supported["VLLM"]), vllm
    lower, upper = re.search(r'^TRANSFORMERS_REQUIREMENT="transformers>=([\d.]+),<([\d.]+)"$', script, re.M).groups()
    assert within(lower, supported["TRANSFORMERS"]), "vLLM's transformers range starts inside the supported range"
    ours = re.search(r"<([\d.]+)", supported["TRANSFORMERS"]).group(1)
    assert tuple(map(int, upper.split("."))) <= tuple(map(int, ours.split("."))), "and ends inside it"


def test_an_extension_built_for_another_torch_is_refused_with_what_to_do():
    code = "import torch\ntorch.__version__ = '2.99.0'\nimport fdc_ops\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "was built against torch" in result.stderr and "this is torch 2.99.0" in result.stderr, result.stderr
    assert "--no-build-isolation" in result.stderr
