"""The demo's pieces that decide what it reports: the 99% search on a score that is not monotone, and the progress
lines a log gets."""

import random

import pytest

from fdc_ops import progress
from fdc_ops.apps import demo

pytestmark = pytest.mark.model


def test_curve_counts_a_compression_only_when_every_smaller_one_keeps_the_target():
    rng = random.Random()
    for _ in range(50):
        dip = rng.choice(demo.CURVE_GRID)  # a score that falls below the target there and recovers after it
        edge = rng.uniform(0.0, 0.6)  # where the score falls for good

        def score(compression: float, dip=dip, edge=edge) -> float:
            if abs(compression - dip) < 1e-9 or compression > edge:
                return 0.9
            return 1.0

        curve = demo.accuracy_curve("test", score, 0.99)
        tried = dict(curve.points)
        assert all(s >= 0.99 for c, s in tried.items() if c <= curve.best)
        assert curve.best < min(dip, edge + 1e-9)
        failing = [c for c, s in tried.items() if s < 0.99]
        assert failing, "the grid reaches 0.5, so some compression fails"
        # The refinement closes in on the first failure: the best is within one eighth of its grid gap.
        first_fail = min(failing)
        grid_below = max([c for c in demo.CURVE_GRID if c < first_fail], default=0.0)
        grid_gap = min([c for c in demo.CURVE_GRID if c >= first_fail]) - grid_below
        assert first_fail - curve.best <= grid_gap / 2**demo.REFINE_STEPS + 1e-9


def test_curve_of_a_lossless_method_is_the_whole_grid():
    curve = demo.accuracy_curve("lossless", lambda c: 1.0, 0.99)
    assert curve.best == max(demo.CURVE_GRID)
    assert [c for c, _ in curve.points] == list(demo.CURVE_GRID)


@pytest.mark.parametrize("quiet", [False, True])
def test_stages_print_one_line_each_unless_quiet(capsys, quiet):
    stages = progress.Stages(2, quiet)
    with stages("first") as stage:
        stage.note = "a result"
    with stages("second"):
        pass
    lines = capsys.readouterr().out.splitlines()
    if quiet:
        assert lines == []
    else:
        assert len(lines) == 2
        assert lines[0].startswith("[1/2] first: a result (") and lines[1].startswith("[2/2] second (")


def test_bars_are_a_line_per_item_in_a_log_and_off_when_quiet(monkeypatch, capsys):
    items = [1, 2, 3]
    monkeypatch.setattr(progress, "_style", "off")
    assert progress.bar(items, "x", "item") is items
    monkeypatch.setattr(progress, "_style", "lines")
    assert list(progress.bar(items, "calibrating", "seq")) == items
    assert capsys.readouterr().err.splitlines() == [f"calibrating: {n}/3 seq (0 s)" for n in (1, 2, 3)]
    assert list(progress.bar(iter(items), "x", "item")) == items
    assert capsys.readouterr().err.splitlines()[-1] == "x: 3 item (0 s)"
    monkeypatch.setattr(progress, "_style", "bars")
    assert progress.bar(items, "x", "item", enabled=False) is items
    assert list(progress.bar(items, "x", "item")) == items
