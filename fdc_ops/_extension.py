"""Loads the C++ extension (fdc_ops._C, which registers torch.ops.fdc) on import and, when it cannot load, says why
and what to do. The extension is built against one torch and loads into that one only: setup.py records that torch's
version in fdc_ops/_build_info.py as it builds."""

from __future__ import annotations

import torch

REBUILD = ("rebuild it against this torch: scripts/setup.sh in a checkout, or `pip install --no-build-isolation "
           "--force-reinstall .` from the source (with build isolation pip would build against another torch)")


def load() -> None:
    try:
        from ._build_info import TORCH_VERSION as built_for
    except ImportError:
        built_for = None  # built before the build recorded its torch: the import below tells
    if built_for is not None and built_for != torch.__version__:
        raise ImportError(f"fdc_ops: the extension fdc_ops._C was built against torch {built_for}, and this is torch "
                          f"{torch.__version__}; a C++ extension loads only into the torch it was built for: {REBUILD}")
    try:
        from . import _C  # noqa: F401  (loads the op registrations)
    except ImportError as error:
        raise ImportError(f"fdc_ops: the extension fdc_ops._C could not be loaded ({error}); if it was never built, or "
                          f"built for another torch, {REBUILD}") from error


load()
