"""bench/bench_ops.py runs end to end (its --quick configuration) and writes the JSON it promises."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_ops_quick(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_ops.py"), "--quick", "--dtype",
                             "float32", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "fdc decode" in result.stdout and "fdc prefill" in result.stdout
    (written,) = list(tmp_path.iterdir())
    report = json.loads(written.read_text())
    assert {"device", "torch", "commit", "threads", "copy_bandwidth_gbps", "rows"} <= report.keys()
    assert report["copy_bandwidth_gbps"] > 0
    methods = {row["method"] for row in report["rows"]}
    assert {"SDPA full width", "fdc decode, plan passed", "fdc prefill"} <= methods
    for row in report["rows"]:
        assert row["millis"] > 0 and row["metric"] > 0
        if row["method"].startswith("fdc"):
            assert row["verdict"].startswith(("PASS", "MISS"))
