"""fdc_ops: FDC KV-cache dimensionality compression operators for PyTorch (torch.ops.fdc), calibration, and
compressed Hugging Face models.

``import fdc_ops`` registers the operators; the model side (``fdc_ops.calibration``, ``fdc_ops.hf``,
``fdc_ops.nn``, ...) is imported on first use, so operator users do not pay for importing transformers.
"""

import importlib

from . import ops
from .calibration import FDCArtifact, calibrate
from .ops import append_kv, decode_attention, decode_plan, prefill_attention, prefill_plan, rotate_compress

_SUBMODULES = ("calibration", "compare", "datasets", "demo", "evaluation", "hf", "models", "nn", "ops_demo",
               "provenance", "reference", "report")

__all__ = ["ops", "rotate_compress", "prefill_plan", "prefill_attention", "decode_plan", "decode_attention",
           "append_kv", "calibrate", "FDCArtifact", *_SUBMODULES]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fdc_ops' has no attribute {name!r}")
