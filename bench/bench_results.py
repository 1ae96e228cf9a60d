"""The results layer every benchmark writes through: where a report comes from (the checkout's commit, the device,
torch and Python), its file name and atomic write, the one percentile definition, and the file locks that keep the
timed phases of benchmarks on a shared machine apart.

The standard library only at import, and nothing put on sys.path: the vLLM benchmarks import it from .venv-vllm,
where fdc_ops must be the installed copy (the checkout's extension is built for .venv's torch), as the others do from
.venv. A script imports it after putting its own folder, bench/, on sys.path (Python does that for
``python bench/bench_X.py`` unless PYTHONSAFEPATH is set, which the vLLM benchmarks run with). torch and fdc_ops are
imported by the functions that need them, from whichever copy the running Python has.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import math
import platform
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout these benchmarks are in


def git_commit() -> tuple[str, bool]:
    """(commit of this checkout, whether its tracked files differ from it); FDC_COMMIT names the commit of a copy
    without its git folder (a lent GPU machine gets the working tree only)."""
    from fdc_ops.apps import provenance

    return provenance.git_commit(ROOT)


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile: the smallest value with at least ``share`` of the values at or below it (P99 of
    100 timings is the 99th smallest, of 50 the largest)."""
    if not values:
        raise ValueError("bench_results.percentile: no values")
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(share * len(ordered)))) - 1]


def record(benchmark: str, device: str, **more) -> dict:
    """The first keys of a report: which benchmark, on which device (with the widest vector instructions torch finds
    on its processor: CPU kernels differ by them, and CPU names often do not say), torch, Python and commit; then
    ``more``."""
    import torch

    commit, dirty = git_commit()
    return {"benchmark": benchmark, "device": device, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "python": platform.python_version(), "commit": commit, "dirty": dirty, **more}


def report_path(folder: str | Path, device: str, benchmark: str, quick: bool = False) -> Path:
    """folder/<device slug>-<benchmark>-[quick-]<UTC time stamp>.json"""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:40]
    return Path(folder) / f"{slug}-{benchmark}-{'quick-' if quick else ''}{stamp}.json"


def write_report(report: dict, folder: str | Path, device: str, benchmark: str, quick: bool = False) -> Path:
    """Writes report to report_path(...) whole or not at all (a stopped run leaves no half file), says where, and
    returns the path."""
    from fdc_ops import files

    path = report_path(folder, device, benchmark, quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_json_atomically(path, report, indent=1)
    print(f"wrote {path}", flush=True)
    return path


@contextlib.contextmanager
def exclusive(lock_path: str | None) -> Iterator[None]:
    """An exclusive flock on lock_path for the duration, released on errors too (nothing when lock_path is None)."""
    with shared_then_exclusive(lock_path) as make_exclusive:
        make_exclusive()
        yield


@contextlib.contextmanager
def shared_then_exclusive(lock_path: str | None):
    """Holds a shared flock on lock_path and yields a function that makes it exclusive (for the timed phase after a
    start-up that others may share); released at the end, on errors too (nothing when lock_path is None)."""
    if lock_path is None:
        yield lambda: None
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        try:
            yield lambda: fcntl.flock(handle, fcntl.LOCK_EX)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
