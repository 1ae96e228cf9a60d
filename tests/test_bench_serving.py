"""bench/bench_serving.py's helpers that need no vLLM: the servers' max_model_len in whole blocks, and the per-server
exclusive lock. (The benchmark itself runs vLLM servers for minutes; its figures are in
bench/results/serving/README.md.)"""

import fcntl
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


def try_lock(path) -> bool:
    """Whether an exclusive flock on path can be taken now (a separate open file, so it competes with any holder)."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


def test_exclusive_holds_the_lock_only_inside(bench_serving, tmp_path):
    lock = tmp_path / "timing.lock"
    with bench_serving.exclusive(str(lock)):
        assert not try_lock(lock)
    assert try_lock(lock)
    with pytest.raises(RuntimeError):
        with bench_serving.exclusive(str(lock)):
            raise RuntimeError("a failed server run")
    assert try_lock(lock)  # released on errors too
    with bench_serving.exclusive(None):  # no --lock: nothing taken
        assert try_lock(lock)
