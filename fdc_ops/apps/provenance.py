"""Where a measurement was taken: device name and the checkout's git commit, written into every results JSON."""

from __future__ import annotations

import os
import platform
import re
import subprocess

import torch

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"model name\s*:\s*(.*)", f.read())
        return f"{match.group(1).strip()} ({os.cpu_count()} cpus)" if match else platform.processor()
    except OSError:
        return platform.processor() or "cpu"


def git_commit(checkout: str | os.PathLike = CHECKOUT) -> tuple[str, bool]:
    """(commit of the checkout, by default the one fdc_ops runs from, whether tracked files differ from it).
    FDC_COMMIT names the commit where the checkout is a copy without its git folder (a lent GPU machine gets the
    working tree only)."""
    if os.environ.get("FDC_COMMIT"):
        return os.environ["FDC_COMMIT"], False
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=CHECKOUT,
                                    capture_output=True, text=True).stdout.strip())
        return commit, dirty
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted", True
