"""fdc_ops: FDC KV-cache dimensionality compression operators for PyTorch (torch.ops.fdc), calibration, and
compressed Hugging Face models.

The package is layered. ``import fdc_ops`` registers the operators and loads nothing else: operator users never pay
for importing transformers (tests/meta/test_package.py checks it). The rest is imported on first use:

- the library: :mod:`fdc_ops.ops` (typed wrappers of the ops), :mod:`fdc_ops.plans` (the plan formats, decoded and
  built; loaded with the ops), :mod:`fdc_ops.reference` (float64 references),
  :mod:`fdc_ops.calibration` (the FDC artifact: rotations, V factors, width allocation), :mod:`fdc_ops.datasets`
  (the bundled calibration and evaluation text), :mod:`fdc_ops.progress`, :mod:`fdc_ops.parallel` (KV heads over
  tensor-parallel ranks);
- :mod:`fdc_ops.hf`: the Hugging Face integration (compressed attention modules, model families, model loading);
- :mod:`fdc_ops.apps`: the command-line applications (``python -m fdc_ops demo | ops-demo | eval | calibrate |
  report``).
"""

import importlib

from . import ops
from .ops import append_kv, decode_attention, decode_plan, prefill_attention, prefill_plan, rotate_compress

_SUBMODULES = ("apps", "calibration", "datasets", "hf", "parallel", "plans", "progress", "reference")
_CALIBRATION_NAMES = ("FDCArtifact", "calibrate")

__all__ = ["ops", "rotate_compress", "prefill_plan", "prefill_attention", "decode_plan", "decode_attention",
           "append_kv", *_CALIBRATION_NAMES, *_SUBMODULES]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _CALIBRATION_NAMES:
        return getattr(importlib.import_module(".calibration", __name__), name)
    raise AttributeError(f"module 'fdc_ops' has no attribute {name!r}")
