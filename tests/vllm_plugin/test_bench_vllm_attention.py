"""bench/bench_vllm_attention.py (fdc against vLLM's own CPU attention) runs end to end in vLLM's environment in its
--quick configuration: every method's rows, vLLM's outputs checked against float64 attention, fdc's verdicts."""

import json
import os
import subprocess
import sys

from .conftest import REPOSITORY


def test_bench_vllm_attention_quick(tmp_path):
    env = {**os.environ, "PYTHONSAFEPATH": "1"}  # the installed fdc_ops, as the benchmark is documented to run
    result = subprocess.run([sys.executable, str(REPOSITORY / "bench" / "bench_vllm_attention.py"), "--quick",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (written,) = tmp_path.glob("*-vllm-attention-quick-*.json")
    report = json.loads(written.read_text())
    assert report["vllm"] and report["copy_bandwidth_gbps"] > 0 and report["block_size"] == 128
    rows = report["rows"]
    assert {(r["phase"], r["dtype"]) for r in rows} == {(p, d) for p in ("decode", "prefill")
                                                          for d in ("bfloat16", "float32")}
    for row in rows:
        assert row["millis"] > 0 and row["metric"] > 0
        if row["method"].startswith("vllm"):
            assert row["extra"]["isa"] and row["extra"]["max_abs_error_vs_float64"] < 3e-2
        else:
            assert row["method"] == "fdc" and row["verdict"].count("PASS") + row["verdict"].count("MISS") == 2
    assert "vllm full width" in result.stdout and "fdc" in result.stdout
