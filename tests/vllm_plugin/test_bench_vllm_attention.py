"""bench/bench_vllm_attention.py (fdc against vLLM's own CPU attention) runs end to end in vLLM's environment in its
--quick configuration: every method's rows, vLLM's outputs checked against float64 attention, fdc's verdicts."""

from .conftest import quick_benchmark_report


def test_bench_vllm_attention_quick(tmp_path):
    report, printed = quick_benchmark_report("bench_vllm_attention.py", tmp_path, "vllm-attention")
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
    assert "vllm full width" in printed and "fdc" in printed
