"""Summarises a scripts/gpu_check.sh run as one JSON file (issue 11's evidence): the device, torch version and commit,
each step's exit code and seconds, the pytest counts of the test steps and the error count each compute-sanitizer
tool reported.

    python scripts/gpu_summary.py OUT_DIR      reads OUT_DIR/*.log and OUT_DIR/exit-codes, writes OUT_DIR/summary.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def pytest_counts(log: str) -> dict[str, int]:
    """The counts of pytest's last summary line ("3 failed, 120 passed, 4 skipped in 10.2s"), {} if there is none."""
    lines = [line for line in log.splitlines() if re.search(r"\b(passed|failed|error|skipped)\b.* in [\d.]+s", line)]
    if not lines:
        return {}
    return {kind.rstrip("s") if kind.startswith("error") else kind: int(n)
            for n, kind in PYTEST_COUNTS.findall(lines[-1])}


RACECHECK_SUMMARY = re.compile(r"RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


def sanitizer_errors(log: str) -> int | None:
    """The sum of compute-sanitizer's "ERROR SUMMARY: N errors" lines and racecheck's errors (one summary per
    process), None if it printed none."""
    counts = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) errors?", log)]
    counts += [int(errors) for errors, _ in RACECHECK_SUMMARY.findall(log)]
    return sum(counts) if counts else None


def sanitizer_warnings(log: str) -> int | None:
    """The sum of racecheck's warnings (hazards it could not prove harmful), None if it printed no summary."""
    counts = [int(warnings) for _, warnings in RACECHECK_SUMMARY.findall(log)]
    return sum(counts) if counts else None


def summarise(out: Path) -> dict:
    import torch

    from fdc_ops.apps.provenance import git_commit

    exit_codes = {}
    codes_file = out / "exit-codes"
    if codes_file.is_file():
        for line in codes_file.read_text().splitlines():
            name, code, *seconds = line.split()  # "NAME EXIT_CODE [SECONDS]"
            exit_codes[name] = (int(code), int(seconds[0]) if seconds else None)
    steps = {}
    for name, (code, seconds) in exit_codes.items():
        log_path = out / f"{name}.log"
        log = log_path.read_text(errors="replace") if log_path.is_file() else ""
        step = {"exit_code": code} if seconds is None else {"exit_code": code, "seconds": seconds}
        if counts := pytest_counts(log):
            step["pytest"] = counts
        if name in SANITIZER_TOOLS:
            step["sanitizer_errors"] = sanitizer_errors(log)
        if name == "racecheck":
            step["sanitizer_warnings"] = sanitizer_warnings(log)
        steps[name] = step
    commit, dirty = git_commit()
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device",
        "torch": torch.__version__,
        "commit": commit,
        "dirty": dirty,
        "steps": steps,
        "all_passed": bool(steps) and all(step["exit_code"] == 0 and not step.get("sanitizer_warnings")
                                          for step in steps.values()),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    summary = summarise(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
