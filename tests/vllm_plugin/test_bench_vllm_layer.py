"""bench/bench_vllm_layer.py (one attention layer's step in fdc's and vLLM's backends, against the op calls each
makes) runs end to end in vLLM's environment in its --quick configuration; each backend's step equals its bare op
calls, and fdc's step with its ops stubbed writes the same output (the benchmark checks both before timing, and fails
otherwise)."""

from .conftest import quick_benchmark_report


def test_bench_vllm_layer_quick(tmp_path):
    report, _ = quick_benchmark_report("bench_vllm_layer.py", tmp_path, "vllm-layer")
    assert report["vllm"] and report["block_size"] == 128 and report["layout"]["num_kv_heads"] == 3
    rows = report["rows"]
    assert {(r["dtype"], "prompt" in r["step"]) for r in rows} == {(d, p) for d in ("float32", "bfloat16")
                                                                    for p in (False, True)}
    for row in rows:
        for key in ("fdc_step_us", "fdc_ops_us", "fdc_own_us", "vllm_step_us", "vllm_ops_us", "vllm_own_us",
                    "fdc_per_step_us", "vllm_scheduler_metadata_us"):
            assert row[key] > 0, (key, row)
        assert row["verdict"] in ("PASS", "MISS")
