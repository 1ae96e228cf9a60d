"""Progress reporting. The library draws tqdm bars for steps that take seconds (calibration, perplexity, HumanEval)
when asked to (their ``progress`` argument). The command-line jobs configure it once: bars only on a terminal, since
in a file or a CI log every refresh becomes a line; there a bar is one line per item instead (a calibration window, a
perplexity batch: a job is never silent for minutes), each job also prints one line per finished stage
(:class:`Stages`), and ``--quiet`` drops all of them, leaving the results.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterable, Iterator, TypeVar

Item = TypeVar("Item")

_style = "bars"  # "bars", "lines" (one line per item) or "off"; set by configure(). The library's own default is bars,
# honouring each call's progress argument


def configure(*, quiet: bool) -> None:
    """For a command-line job: bars on a terminal, a line per item in a file or a log, nothing when quiet."""
    global _style
    _style = "off" if quiet else "bars" if sys.stderr.isatty() else "lines"
    if _style != "bars":  # transformers draws its own bars (loading weights) unless told not to
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def bar(items: Iterable[Item], description: str, unit: str, enabled: bool = True,
        total: int | None = None) -> Iterable[Item]:
    """``items`` wrapped in a tqdm bar (or, in a log, followed by a line on stderr per item) when ``enabled`` and the
    job is not quiet, else ``items`` itself."""
    if not enabled or _style == "off":
        return items
    if _style == "lines":
        if total is None and hasattr(items, "__len__"):
            total = len(items)
        return _lines(items, description, unit, total)
    from tqdm.auto import tqdm

    return tqdm(items, desc=description, unit=unit, total=total)


def _lines(items: Iterable[Item], description: str, unit: str, total: int | None) -> Iterator[Item]:
    of = f"/{total}" if total is not None else ""
    begin = time.perf_counter()
    for done, item in enumerate(items, 1):
        yield item
        print(f"{description}: {done}{of} {unit} ({time.perf_counter() - begin:.0f} s)", file=sys.stderr, flush=True)


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
