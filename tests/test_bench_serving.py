"""bench/bench_serving.py's helpers that need no vLLM: the servers' max_model_len in whole blocks (its lock and
percentiles are bench_results', tests/test_bench_results.py). The benchmark itself runs vLLM servers for minutes; its
figures are in bench/results/serving/README.md."""

import importlib.util
import os
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
