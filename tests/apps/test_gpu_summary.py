"""scripts/gpu_summary.py reads the logs scripts/gpu_check.sh leaves (the evidence a GPU session commits): pytest's
counts and compute-sanitizer's error totals, and the exit codes of the steps that ran."""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_summary  # noqa: E402

sys.path.pop(0)


def test_pytest_counts_take_the_last_summary_line():
    log = "collected 9\n....\n1 failed, 7 passed, 1 skipped in 3.2s\nrerun\n2 passed, 1 error in 0.5s\n"
    assert gpu_summary.pytest_counts(log) == {"passed": 2, "error": 1}
    assert gpu_summary.pytest_counts("no summary here") == {}


def test_sanitizer_errors_add_up_over_processes():
    log = "========= ERROR SUMMARY: 0 errors\n...\n========= ERROR SUMMARY: 3 errors\n"
    assert gpu_summary.sanitizer_errors(log) == 3
    assert gpu_summary.sanitizer_errors("========= ERROR SUMMARY: 1 error\n") == 1
    assert gpu_summary.sanitizer_errors("the tool never ran") is None


def test_racecheck_errors_and_warnings_add_up_over_processes():
    log = ("========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n"
           "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n")
    assert gpu_summary.sanitizer_errors(log) == 1
    assert gpu_summary.sanitizer_warnings(log) == 2
    assert gpu_summary.sanitizer_warnings("========= ERROR SUMMARY: 0 errors\n") is None


def test_the_last_run_of_a_step_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("FDC_COMMIT", "abc123")
    (tmp_path / "exit-codes").write_text("racecheck 124 300\nracecheck 0 200\n")
    (tmp_path / "racecheck.log").write_text("========= RACECHECK SUMMARY: 1 hazard displayed (0 errors, 1 warning)\n")
    assert gpu_summary.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"]["racecheck"] == {"exit_code": 0, "seconds": 200, "sanitizer_errors": 0,
                                             "sanitizer_warnings": 1}
    assert summary["all_passed"] is False, "a racecheck warning is a hazard still to explain"


def test_summary_of_a_run(tmp_path, monkeypatch):
    monkeypatch.setenv("FDC_COMMIT", "abc123")
    (tmp_path / "exit-codes").write_text("tests 1 42\nmemcheck 0\n")  # seconds since scripts/gpu_check.sh kept them
    (tmp_path / "tests.log").write_text("F.\n1 failed, 1 passed in 0.1s\n")
    (tmp_path / "memcheck.log").write_text("========= ERROR SUMMARY: 0 errors\n2 passed in 9.0s\n")
    assert gpu_summary.main([str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["commit"] == "abc123" and summary["all_passed"] is False
    assert summary["steps"]["tests"] == {"exit_code": 1, "seconds": 42, "pytest": {"failed": 1, "passed": 1}}
    assert summary["steps"]["memcheck"] == {"exit_code": 0, "pytest": {"passed": 2}, "sanitizer_errors": 0}
