"""bench/bench_vllm_layer.py (one attention layer's step in fdc's and vLLM's backends, against the op calls each
makes) runs end to end in vLLM's environment in its --quick configuration; each backend's step equals its bare op
calls, and fdc's step with its ops stubbed writes the same output (the benchmark checks both before timing, and fails
otherwise)."""

import json
import os
import subprocess
import sys

from .conftest import REPOSITORY


def test_bench_vllm_layer_quick(tmp_path):
    env = {**os.environ, "PYTHONSAFEPATH": "1"}  # the installed fdc_ops, as the benchmark is documented to run
    result = subprocess.run([sys.executable, str(REPOSITORY / "bench" / "bench_vllm_layer.py"), "--quick",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (written,) = tmp_path.glob("*-vllm-layer-quick-*.json")
    report = json.loads(written.read_text())
    assert report["vllm"] and report["block_size"] == 128 and report["layout"]["num_kv_heads"] == 3
    rows = report["rows"]
    assert {(r["dtype"], "prompt" in r["step"]) for r in rows} == {(d, p) for d in ("float32", "bfloat16")
                                                                    for p in (False, True)}
    for row in rows:
        for key in ("fdc_step_us", "fdc_ops_us", "fdc_own_us", "vllm_step_us", "vllm_ops_us", "vllm_own_us",
                    "fdc_per_step_us", "vllm_scheduler_metadata_us"):
            assert row[key] > 0, (key, row)
        assert row["verdict"] in ("PASS", "MISS")
