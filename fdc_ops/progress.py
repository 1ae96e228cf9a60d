"""Progress reporting. The library draws tqdm bars for steps that take seconds (calibration, perplexity, HumanEval)
when asked to (their ``progress`` argument). The command-line jobs configure it once: bars only on a terminal, since
in a file or a CI log every refresh becomes a line; there each job prints one line per finished stage instead
(:class:`Stages`), and ``--quiet`` drops both, leaving the results.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterable, Iterator, TypeVar

Item = TypeVar("Item")

_bars_allowed = True  # set by configure(); the library's own default is to honour each call's progress argument


def configure(*, quiet: bool) -> None:
    """For a command-line job: bars only when stderr is a terminal and the job is not quiet."""
    global _bars_allowed
    _bars_allowed = not quiet and sys.stderr.isatty()
    if not _bars_allowed:  # transformers draws its own bars (loading weights) unless told not to
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def bar(items: Iterable[Item], description: str, unit: str, enabled: bool = True,
        total: int | None = None) -> Iterable[Item]:
    """``items`` wrapped in a tqdm bar when ``enabled`` and bars are allowed, else ``items`` itself."""
    if not (enabled and _bars_allowed):
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=description, unit=unit, total=total)


class Stages:
    """One printed line per stage of a job, when the stage ends: ``[2/5] calibration: ... (27.1 s)``. Quiet prints
    nothing. The line's text may be completed inside the stage (``stage.note = ...``), once the result is known."""

    def __init__(self, count: int, quiet: bool = False):
        self.count, self.quiet, self.done = count, quiet, 0
        self.note = ""

    @contextlib.contextmanager
    def __call__(self, title: str) -> Iterator["Stages"]:
        self.note = ""
        begin = time.perf_counter()
        yield self
        self.done += 1
        if not self.quiet:
            note = f": {self.note}" if self.note else ""
            print(f"[{self.done}/{self.count}] {title}{note} ({time.perf_counter() - begin:.1f} s)", flush=True)
