"""fdc_ops: FDC KV-cache dimensionality compression operators for PyTorch (torch.ops.fdc), calibration, and
compressed Hugging Face models.

The package is layered. ``import fdc_ops`` registers the operators and loads nothing else: operator users never pay
for importing transformers (tests/meta/test_package.py checks it). The rest is imported on first use:

- the library: :mod:`fdc_ops.ops` (typed wrappers of the ops), :mod:`fdc_ops.plans` (the plan formats, decoded and
  built; loaded with the ops), :mod:`fdc_ops.reference` (float64 references),
  :mod:`fdc_ops.artifact` (the FDC artifact: rotations, V factors, width allocation; model-neutral),
  :mod:`fdc_ops.calibration` (the procedure that makes one from a Hugging Face model), :mod:`fdc_ops.datasets`
  (the bundled calibration and evaluation text), :mod:`fdc_ops.progress`, :mod:`fdc_ops.parallel` (KV heads over
  tensor-parallel ranks);
- :mod:`fdc_ops.hf`: the Hugging Face integration (compressed attention modules, model families, model loading);
- :mod:`fdc_ops.apps`: the command-line applications (``python -m fdc_ops demo | ops-demo | eval | calibrate |
  report``).
"""

import importlib
import sys

_OPS = ("rotate_compress", "prefill_plan", "prefill_attention", "decode_plan", "decode_attention", "append_kv")
_SUBMODULES = ("apps", "artifact", "calibration", "datasets", "hf", "parallel", "plans", "progress", "reference")
_NAMES = {"FDCArtifact": "artifact", "calibrate": "calibration"}  # name: the module that defines it


def _imported_by_the_command_line() -> bool:
    """Whether Python is importing this package to run ``python -m fdc_ops`` (while it locates the module to run,
    ``sys.argv[0]`` is ``-m``; ``sys.orig_argv`` names the module). The command line then parses and checks its
    arguments before torch is imported, and each command imports what it uses."""
    arguments = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and "-m" in arguments and arguments[arguments.index("-m") + 1:][:1] == ["fdc_ops"]


if not _imported_by_the_command_line():
    from . import ops  # noqa: F401, I001  (the package's names, __all__; one import a line would pass 120 columns)
    from .ops import (  # noqa: F401
        append_kv, decode_attention, decode_plan, prefill_attention, prefill_plan, rotate_compress)

__all__ = ["ops", *_OPS, *_NAMES, *_SUBMODULES]


def __getattr__(name: str):
    if name == "ops" or name in _OPS:
        ops = importlib.import_module(".ops", __name__)
        return ops if name == "ops" else getattr(ops, name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'fdc_ops' has no attribute {name!r}")
