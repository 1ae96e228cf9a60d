"""The package's layering: the operator library imports without the model side, and every layer imports."""

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
