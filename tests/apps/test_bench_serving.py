"""bench/bench_serving.py's helpers that need no vLLM: the servers' max_model_len in whole blocks, the KV blocks of
a shared memory budget, the scheduler's figures read from /metrics (its lock and percentiles are bench_results',
tests/apps/test_bench_results.py). The benchmark itself runs vLLM servers for minutes; its figures are in
bench/results/serving/README.md."""

import importlib.util
import os
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench_serving():
    spec = importlib.util.spec_from_file_location("bench_serving", os.path.join(ROOT, "bench", "bench_serving.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("prompt, output, expected", [(256, 64, 384), (100, 12, 128), (100, 13, 256), (1, 1, 128)])
def test_max_model_len_is_whole_blocks(bench_serving, prompt, output, expected):
    args = SimpleNamespace(prompt_tokens=prompt, output_tokens=output)
    assert bench_serving.max_model_len(args) == expected
    assert expected % bench_serving.BLOCK_MULTIPLE == 0


def test_a_kv_budget_is_the_same_bytes_in_whole_blocks_of_each_server(bench_serving):
    sizes = {"uncompressed": 1000, "fdc-0.5": 500, "palu-0.2": 800}
    blocks = bench_serving.budget_blocks(1024, sizes, 128)
    assert blocks == {"uncompressed": 8, "fdc-0.5": 16, "palu-0.2": 10}  # 1024 * 1000 / (128 * 800) = 10.0
    assert all(blocks[label] * 128 * size <= 1024 * 1000 for label, size in sizes.items())


def test_scheduler_figures_are_read_from_prometheus_text(bench_serving):
    text = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="fdc"} 3.0
vllm:num_requests_waiting{engine="0",model_name="fdc"} 5.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0
vllm:num_preemptions_total{engine="0",model_name="fdc"} 2.0
vllm:num_preemptions_created{engine="0",model_name="fdc"} 1.7e+09
"""
    assert bench_serving.read_metrics(text) == {"running": 3.0, "waiting": 5.0, "preemptions": 2.0}


def test_the_plot_draws_every_server_of_the_reports(bench_serving, tmp_path):
    def run(jct):
        row = {"jct_median_s": jct, "jct_p90_s": jct + 1, "tbt_median_s": 0.5, "throughput_rps": 0.1}
        return {"rates": {"4.0": row}}

    args = {"requests": 2, "prompt_tokens": 8, "output_tokens": 4, "kv_budget_tokens": 64}
    first = {"device": "cpu", "args": args, "runs": {"uncompressed": run(9.0), "fdc-0.5": run(5.0)}}
    second = {"device": "cpu", "args": args, "runs": {"palu-0.5": run(7.0), "palu-0.013": run(8.0)}}
    path = tmp_path / "serving.png"
    bench_serving.plot([first, second], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
