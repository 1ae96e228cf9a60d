"""bench/bench_results.py, the layer every benchmark writes its report through: the percentile definition, the report's
name, provenance and atomic write, the file locks, and that it imports with the standard library alone (the vLLM
benchmarks import it from .venv-vllm without the checkout on sys.path)."""

import fcntl
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_results  # noqa: E402


@pytest.mark.parametrize("values, share, expected", [
    ([3.0], 0.99, 3.0),
    (list(range(1, 101)), 0.99, 99),  # nearest rank: the 99th smallest of 100
    (list(range(1, 51)), 0.99, 50),  # of 50: the largest
    (list(range(10, 0, -1)), 0.9, 9),  # order does not matter
    (list(range(1, 11)), 0.5, 5),
    (list(range(1, 11)), 0.0, 1),
])
def test_percentile_is_the_nearest_rank(values, share, expected):
    assert bench_results.percentile(values, share) == expected


def test_percentile_of_nothing_is_refused():
    with pytest.raises(ValueError, match="no values"):
        bench_results.percentile([], 0.9)


def test_a_report_is_named_recorded_and_written_whole(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FDC_COMMIT", "abc123")
    report = bench_results.record("decode", "NVIDIA H200", quick=True, rows=[1, 2])
    assert report["benchmark"] == "decode" and report["device"] == "NVIDIA H200"
    assert (report["commit"], report["dirty"]) == ("abc123", False)
    assert {"torch", "python", "cpu_capability"} <= report.keys() and report["rows"] == [1, 2]
    path = bench_results.write_report(report, tmp_path / "gpu", "NVIDIA H200", "decode", quick=True)
    assert path.parent == tmp_path / "gpu" and path.name.startswith("nvidia-h200-decode-quick-")
    assert path.suffix == ".json" and json.loads(path.read_text()) == report
    assert f"wrote {path}" in capsys.readouterr().out
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left beside it"


def test_the_commit_is_this_checkouts():
    commit, _ = bench_results.git_commit()
    expected = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if expected.returncode != 0:
        pytest.skip("not a git checkout")
    if os.environ.get("FDC_COMMIT"):
        pytest.skip("FDC_COMMIT names the commit")
    assert commit == expected.stdout.strip()


def lock_is_free(path, shared: bool = False) -> bool:
    """Whether a flock on path can be taken now (a separate open file, so it competes with any holder)."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def test_exclusive_holds_the_lock_only_inside(tmp_path):
    lock = tmp_path / "timing.lock"
    with bench_results.exclusive(str(lock)):
        assert not lock_is_free(lock, shared=True)
    assert lock_is_free(lock)
    with pytest.raises(RuntimeError):
        with bench_results.exclusive(str(lock)):
            raise RuntimeError("a failed server run")
    assert lock_is_free(lock)  # released on errors too
    with bench_results.exclusive(None):  # no --lock: nothing taken
        assert lock_is_free(lock)


def test_shared_then_exclusive(tmp_path):
    lock = tmp_path / "timing.lock"
    with bench_results.shared_then_exclusive(str(lock)) as make_exclusive:
        assert lock_is_free(lock, shared=True) and not lock_is_free(lock)  # start-ups may share
        make_exclusive()
        assert not lock_is_free(lock, shared=True)  # the timed phase has it alone
    assert lock_is_free(lock)


def test_it_imports_with_the_standard_library_alone():
    code = ("import sys; sys.path.insert(0, 'bench'); import bench_results; "
            "loaded = {'torch', 'numpy', 'fdc_ops'} & {m.split('.')[0] for m in sys.modules}; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-I", "-c", code], cwd=ROOT, check=True)
