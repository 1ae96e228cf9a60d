"""The benchmarks run end to end (their --quick configurations) and write the JSON they promise."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_quick(script: str, out, *options: str) -> tuple[str, dict]:
    """Runs bench/<script> --quick (options added) writing into `out`, from outside the checkout so that the script's
    own folder is what makes bench_common importable; returns (its stdout, the one JSON it wrote)."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--quick", *options, "--out",
                             str(out)], capture_output=True, text=True, timeout=300, cwd=out)
    assert result.returncode == 0, result.stderr
    (written,) = [path for path in out.iterdir() if path.suffix == ".json"]
    return result.stdout, json.loads(written.read_text())


def test_bench_ops_quick(tmp_path):
    stdout, report = run_quick("bench_ops.py", tmp_path, "--dtype", "float32")
    assert "fdc decode" in stdout and "fdc prefill" in stdout
    assert {"device", "torch", "commit", "threads", "copy_bandwidth_gbps", "rows"} <= report.keys()
    assert report["copy_bandwidth_gbps"] > 0
    methods = {row["method"] for row in report["rows"]}
    assert {"SDPA full width", "fdc decode, plan passed", "fdc prefill", "fdc decode, window, paged (128)",
            "fdc paged prefill", "gather + fdc prefill"} <= methods
    for row in report["rows"]:
        assert row["millis"] > 0 and row["metric"] > 0
        if row["method"].startswith("fdc"):
            assert row["verdict"].startswith(("PASS", "MISS"))


def test_bench_decode_quick(tmp_path):
    """bench/bench_decode.py --quick runs on the CPU (no CUDA graph rows there; the targets are bench_common.TARGETS'
    CPU row) and writes the table and JSON it promises: every baseline, the fdc rows, targets, the balance ablation and
    the scheduler cost."""
    stdout, report = run_quick("bench_decode.py", tmp_path, "--device", "cpu")
    for text in ("sdpa_full", "palu_sdpa", "fdc_step", "targets", "balance ablation", "scheduler cost"):
        assert text in stdout, text
    assert {"device", "torch", "commit", "copy_bandwidth_gbps", "layout", "rows", "targets", "balance_ablation",
            "scheduler"} <= report.keys()
    assert report["device_type"] == "cpu" and report["quick"] and report["copy_bandwidth_gbps"] > 0
    layout = report["layout"]
    assert all(d % 8 == 0 and 16 <= d <= 128 for d in layout["qk_dims"] + layout["v_dims"])
    methods = {row["method"] for row in report["rows"]}
    assert {"sdpa_full", "sdpa_padded", "sdpa_bucketed", "palu_sdpa", "fdc_attention", "fdc_step"} <= methods
    assert {row["cache"] for row in report["rows"]} >= {"dense", "contiguous", "paged16"}
    for row in report["rows"]:
        assert row["micros"] > 0 and row["gbps"] > 0 and row["bytes_read"] > 0
        assert row["vs_full"] > 0
    verdicts = {t["verdict"] for t in report["targets"]}
    assert verdicts <= {"PASS", "MISS"} and report["targets"]
    for entry in report["balance_ablation"]:
        assert entry["lpt"]["makespan"] > 0 and entry["static"]["makespan"] > 0
        assert entry["lpt"]["micros"] > 0 and entry["static"]["micros"] > 0
    assert {e["baseline"] for e in report["balance_ablation"]} == {"static_blocks", "static_round_robin"}
    scheduler = report["scheduler"]
    assert 0 < scheduler["share"] and scheduler["plan_p99_us"] >= scheduler["plan_us"] > 0
    assert "workers per thread" in stdout
    sweep = report["workers_sweep"]
    assert [w["per_unit"] for w in sweep] == [1, 2] and sweep[1]["workers"] == 2 * sweep[0]["workers"]
    assert all(w["micros"] > 0 and w["gbps"] > 0 and w["copy_share"] > 0 for w in sweep)


def test_bench_prefill_quick(tmp_path):
    """bench/bench_prefill.py --quick runs on the CPU and writes the table and JSON it promises: the matmul peak,
    every baseline and fdc row, targets, the balance ablation (its Python planner equal to prefill_plan's) and the
    planning cost."""
    stdout, report = run_quick("bench_prefill.py", tmp_path, "--device", "cpu")
    for text in ("sdpa_full", "sdpa_bucketed", "fdc_attention", "targets", "balance ablation", "planning cost"):
        assert text in stdout, text
    assert {"device", "torch", "commit", "matmul_peak_tflops", "layout", "rows", "targets", "balance_ablation",
            "planning"} <= report.keys()
    assert report["device_type"] == "cpu" and report["quick"] and report["matmul_peak_tflops"] > 0
    layout = report["layout"]
    assert all(d % 8 == 0 and 16 <= d <= 128 for d in layout["qk_dims"] + layout["v_dims"])
    assert 0.4 <= layout["width_ratio"] <= 0.6
    methods = {row["method"] for row in report["rows"]}
    assert {"sdpa_full", "sdpa_padded", "sdpa_bucketed", "fdc_attention", "fdc_step"} <= methods
    assert {row["causal"] for row in report["rows"]} == {True, False}
    for row in report["rows"]:
        assert row["micros"] > 0 and row["tflops"] > 0 and row["useful_flops"] > 0 and row["vs_full"] > 0, row
    verdicts = {t["verdict"] for t in report["targets"]}
    assert verdicts <= {"PASS", "MISS"} and report["targets"]
    for entry in report["balance_ablation"]:
        assert entry["python_planner_matches_op"], entry["case"]
        assert set(entry["policies"]) == {"lpt", "no_rescale", "no_redistribution", "no_redistribution_lpt",
                                          "neither"}
        for policy in entry["policies"].values():
            assert policy["micros"] > 0 and policy["makespan"] > 0 and policy["makespan_over_ideal"] >= 1.0
            assert policy["max_abs_diff_vs_lpt"] < 0.1  # every plan computes the same attention
    for entry in report["planning"]:
        assert "error" not in entry and entry["first_us"] > 0 and entry["cached_us"] > 0 and entry["attention_us"] > 0


def test_bench_e2e_quick(tmp_path):
    """bench/bench_e2e.py --quick decodes the bundled SmolLM2 uncompressed and at each compression, and writes the
    JSON (a row per model, TTFT the median of its rotating-order samples, the two targets) and the plot."""
    stdout, report = run_quick("bench_e2e.py", tmp_path, "--compressions", "0,0.5")
    assert "target 0%" in stdout and "target 50%" in stdout
    assert {"device", "torch", "commit", "threads", "model", "dtype", "rows", "targets"} <= report.keys()
    assert [row["model"] for row in report["rows"]] == ["uncompressed (sdpa)", "fdc 0% compressed",
                                                          "fdc 50% compressed"]
    for row in report["rows"]:
        assert len(row["ttft_samples_ms"]) == 3 and row["ttft_ms"] == sorted(row["ttft_samples_ms"])[1]
        assert row["tbt_ms"] > 0 and 0 < row["attention_share"] < 1
    # the compressed models' steps spend part of their attention time reading the cache, the uncompressed none
    assert report["rows"][0]["cache_read_ms"] == 0
    assert all(0 < row["cache_read_ms"] < row["tbt_ms"] * row["attention_share"] for row in report["rows"][1:])
    assert [row["width"] for row in report["rows"]] == [None, 64, 32]
    assert {t["verdict"] for t in report["targets"]} <= {"PASS", "MISS"} and len(report["targets"]) == 2
    assert len(list(tmp_path.glob("*.png"))) == 1


def test_bench_e2e_quick_with_eviction(tmp_path):
    """bench_e2e.py --evict adds, per compression, a model that evicts after the prompt, compared with the same
    widths keeping every token (TTFT, attention per decode step), and times the eviction inside the prompt's pass."""
    stdout, report = run_quick("bench_e2e.py", tmp_path, "--compressions", "0.5", "--evict", "0.5")
    assert [(row["model"], row["eviction_keep"]) for row in report["rows"]] == [
        ("uncompressed (sdpa)", None), ("fdc 50% compressed", None), ("fdc 50%, keep 50%", 0.5)]
    evicted = report["rows"][2]
    assert evicted["ttft_vs_all_tokens"] > 0 and evicted["attention_step_vs_all_tokens"] > 0
    assert evicted["cache_read_vs_all_tokens"] == evicted["cache_read_ms"] / report["rows"][1]["cache_read_ms"]
    assert evicted["tbt_vs_uncompressed"] > 0
    assert 0 < evicted["eviction_share_of_ttft"] < 1 and report["rows"][1]["eviction_share_of_ttft"] == 0
    assert [t["what"] for t in report["targets"]] == [
        "TBT <= 0.75x uncompressed", "TTFT <= 1.05x without eviction",
        "eviction (scoring, selection, compaction) <= 5% of TTFT",
        "attention per step <= 0.60x without eviction", "decode_attention per step <= 0.60x without eviction"], stdout


def test_bench_compile_quick(tmp_path):
    """bench/bench_compile.py --quick times the bundled SmolLM2's decode step eager and compiled (inductor), and each
    compiled model's steps run on one graph (its first 2 layers: inductor's compile of all 30 took 100 s on 2 cores)."""
    stdout, report = run_quick("bench_compile.py", tmp_path)
    assert {"device", "torch", "commit", "threads", "dtype", "rows", "targets"} <= report.keys()
    assert report["layers"] == 2 and "its first 2 layers" in stdout
    assert [(row["model"][:3], row["mode"]) for row in report["rows"]] == [
        (model, mode) for model in ("unc", "fdc") for mode in ("eager, dynamic cache", "eager, static cache",
                                                                "compiled, static cache")]
    assert all(row["tbt_ms"] > 0 and row["steps"] == 4 for row in report["rows"])
    assert [t["verdict"] for t in report["targets"]] == ["PASS", "PASS"], stdout


def test_bench_fingerprint_quick(tmp_path):
    stdout, report = run_quick("bench_fingerprint.py", tmp_path)
    assert "check (in bfloat16)" in stdout and "target:" in stdout
    assert {"device", "torch", "commit", "attention_parameters", "seconds", "target"} <= report.keys()
    assert report["attention_parameters"] == 4 * 4 * 1024 * 1024
    assert all(seconds > 0 for seconds in report["seconds"].values())
    assert report["target"]["passed"] in (True, False)
