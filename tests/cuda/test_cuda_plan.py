"""The device decode planner (csrc/cuda/decode_plan.cu) against the host one: the same plan integer for integer on
fresh random configurations, with and without a sliding window, inside a replayed CUDA graph, and the status entry
for negative lengths. Needs a GPU and a build with the CUDA kernels; skipped otherwise."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import capture_graph, case_generator, random_layout, random_lengths, skip_without_cuda_kernels
from fdc_ops import ops
from fdc_ops.plans import DECODE_HEADER, DecodePlan, Status

skip_without_cuda_kernels("decode_plan")

CASES = int(os.environ.get("FDC_CUDA_CASES", 200))
WORKER_COUNTS = (1, 7, 132, 264)


def plans(lengths: list[int], layout, workers: int, window_left: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU plan and the CUDA plan (copied back) of the same inputs."""
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    cpu = ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group, num_workers=workers,
                          window_left=window_left)
    cuda = ops.decode_plan(seqlens.cuda(), layout.qk_offsets, layout.v_offsets, layout.group, num_workers=workers,
                           window_left=window_left)
    assert cuda.device.type == "cuda" and cuda.dtype == torch.int32
    return cpu, cuda.cpu()


def assert_same_plan(cpu: torch.Tensor, cuda: torch.Tensor, what: str):
    assert cpu.shape == cuda.shape, f"{what}: sizes {cpu.numel()} vs {cuda.numel()}"
    differ = (cpu != cuda).nonzero()
    assert differ.numel() == 0, (f"{what}: {differ.numel()} entries differ, first at {int(differ[0])}: "
                                 f"cpu {int(cpu[differ[0]])} vs cuda {int(cuda[differ[0]])}")
    assert torch.equal(cpu, cuda), what


@pytest.mark.parametrize("case", range(CASES))
def test_cuda_plan_equals_cpu_plan(case):
    _, rng, replay = case_generator("cuda_decode_plan", case)
    layout = random_layout(rng)
    batch = rng.choice([0, 1, 2, 5, 33, rng.randint(1, 256), 256])
    lengths = random_lengths(rng, batch, choices=(0, 0, 1, 2, 15, 16, 17, 255, 256, 257, 1000, 4096, 30000))
    if batch and rng.random() < 0.3:
        lengths[rng.randrange(batch)] = 100_000  # one long request among many short ones: it gets split
    workers = rng.choice(WORKER_COUNTS)
    cpu, cuda = plans(lengths, layout, workers)
    assert_same_plan(cpu, cuda, f"B={batch} H_kv={layout.num_kv_heads} N={workers} {replay}")


@pytest.mark.parametrize("workers", WORKER_COUNTS + (33, 1024))
def test_cuda_plan_equals_cpu_plan_edge_cases(workers):
    _, rng, replay = case_generator("cuda_decode_plan_edges", workers)
    layout = random_layout(rng)
    cases = {
        "empty batch": [],
        "only empty requests": [0] * 9,
        "one 100K request among short ones": [1, 0, 7, 100_000] + [rng.randint(0, 64) for _ in range(200)],
        "equal lengths (all ties)": [512] * 64,
        # Loads pass 2^42 on few workers, so the assignment rebases its relative loads.
        "lengths near INT32_MAX": [2**31 - 7] * 8,
    }
    for what, lengths in cases.items():
        cpu, cuda = plans(lengths, layout, workers)
        assert_same_plan(cpu, cuda, f"{what}, N={workers} {replay}")


def test_cuda_plan_sort_in_global_memory():
    """More than 16K tasks: the bitonic sort's scratch exceeds shared memory and runs in the global workspace."""
    _, rng, replay = case_generator("cuda_decode_plan_global", 0)
    layout = random_layout(rng)
    layout.qk_dims, layout.v_dims = [16] * 8, [8] * 8
    lengths = random_lengths(rng, 2200, choices=(0, 1, 33, 257, 600))
    cpu, cuda = plans(lengths, layout, 132)
    assert_same_plan(cpu, cuda, f"B=2200 H_kv=8 N=132 {replay}")


def test_cuda_plan_default_workers_are_the_sms():
    _, rng, _ = case_generator("cuda_decode_plan_default", 0)
    layout = random_layout(rng)
    seqlens = torch.tensor(random_lengths(rng, 17), dtype=torch.int32)
    plan = ops.decode_plan(seqlens.cuda(), layout.qk_offsets, layout.v_offsets, layout.group)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert int(plan[3]) == sms
    cpu = ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group, num_workers=sms)
    assert_same_plan(cpu, plan.cpu(), "default worker count")


def test_cuda_plan_in_a_replayed_graph():
    """The plan is built on the device from the lengths current at replay time: no host read, no sync."""
    _, rng, replay = case_generator("cuda_decode_plan_graph", 0)
    layout = random_layout(rng)
    batch, workers = 48, 132
    seqlens = torch.tensor(random_lengths(rng, batch), dtype=torch.int32, device="cuda")

    def step():
        return ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group, num_workers=workers)

    graph, plan = capture_graph(step)
    for round_ in range(4):
        new = random_lengths(rng, batch, choices=(0, 1, 16, 300, 5000))
        if round_ == 3:
            new[0] = 100_000
        seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        cpu = ops.decode_plan(torch.tensor(new, dtype=torch.int32), layout.qk_offsets, layout.v_offsets,
                              layout.group, num_workers=workers)
        assert_same_plan(cpu, plan.cpu(), f"replay {round_} {replay}")


# Windows whose start falls on, before and after a 16-key (kChunkAlign) boundary, shorter and longer than a chunk.
WINDOWS = (0, 1, 14, 15, 16, 17, 255, 256, 257, 271, 1000, 5000, 99_999)


def _window_start(length: int, window_left: int) -> int:
    return 0 if window_left < 0 or length == 0 else max(0, length - 1 - window_left)


def assert_windowed_chunks(plan: torch.Tensor, lengths: list[int], window_left: int, what: str):
    """What the attention kernels check record by record: each request's chunks cover exactly its window, the first
    starting at the window's start, the others on 16-key boundaries, the last ending at its length."""
    decoded = DecodePlan.from_tensor(plan)
    covered = [0] * (decoded.batch * decoded.num_kv_heads)
    for pair, chunk, start, end in decoded.records:
        length = lengths[pair // decoded.num_kv_heads]
        chunks = decoded.split_offsets[pair + 1] - decoded.split_offsets[pair]
        first = _window_start(length, window_left)
        assert (start == first) if chunk == 0 else (start > first and start % 16 == 0), f"{what}: record {pair, chunk}"
        assert chunk != chunks - 1 or end == length, f"{what}: record {pair, chunk} ends at {end} of {length}"
        covered[pair] += end - start
    for pair, keys in enumerate(covered):
        length = lengths[pair // decoded.num_kv_heads]
        assert keys == length - _window_start(length, window_left), f"{what}: pair {pair} covers {keys} keys"


@pytest.mark.parametrize("case", range(CASES))
def test_cuda_windowed_plan_equals_cpu_plan(case):
    _, rng, replay = case_generator("cuda_decode_plan_windowed", case)
    layout = random_layout(rng)
    batch = rng.choice([0, 1, 2, 5, 33, rng.randint(1, 256), 256])
    lengths = random_lengths(rng, batch, choices=(0, 0, 1, 2, 15, 16, 17, 255, 256, 257, 1000, 4096, 30000))
    if batch and rng.random() < 0.3:
        lengths[rng.randrange(batch)] = 100_000
    window_left = rng.choice(WINDOWS + (rng.randint(0, 40_000),))
    workers = rng.choice(WORKER_COUNTS)
    cpu, cuda = plans(lengths, layout, workers, window_left)
    what = f"B={batch} H_kv={layout.num_kv_heads} N={workers} window={window_left} {replay}"
    assert_same_plan(cpu, cuda, what)
    assert_windowed_chunks(cuda, lengths, window_left, what)


@pytest.mark.parametrize("window_left", WINDOWS)
def test_cuda_windowed_plan_edge_cases(window_left):
    _, rng, replay = case_generator("cuda_decode_plan_windowed_edges", window_left)
    layout = random_layout(rng)
    cases = {
        "only empty requests": [0] * 9,
        "one 100K request among short ones": [1, 0, 7, 100_000, 100_003] + [rng.randint(0, 300) for _ in range(200)],
        "lengths around the window": [window_left + d for d in (0, 1, 2, 15, 16, 17)],
        "lengths near INT32_MAX": [2**31 - 7] * 8,
    }
    for what, lengths in cases.items():
        for workers in (1, 132, 1024):
            cpu, cuda = plans(lengths, layout, workers, window_left)
            assert_same_plan(cpu, cuda, f"{what}, N={workers}, window={window_left} {replay}")
            assert_windowed_chunks(cuda, lengths, window_left, f"{what}, N={workers}, window={window_left} {replay}")


def test_cuda_windowed_plan_in_a_replayed_graph():
    """The window travels in the planner's kernel parameters: a captured windowed plan, replayed over new lengths,
    is the CPU planner's windowed plan of those lengths."""
    _, rng, replay = case_generator("cuda_decode_plan_windowed_graph", 0)
    layout = random_layout(rng)
    batch, workers, window_left = 48, 132, 1000 + rng.randint(0, 15)
    seqlens = torch.tensor(random_lengths(rng, batch), dtype=torch.int32, device="cuda")

    def step():
        return ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group, num_workers=workers,
                               window_left=window_left)

    graph, plan = capture_graph(step)
    for round_ in range(4):
        new = random_lengths(rng, batch, choices=(0, 1, 16, 300, 1001, 1017, 5000))
        if round_ == 3:
            new[0] = 100_000
        seqlens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        cpu = ops.decode_plan(torch.tensor(new, dtype=torch.int32), layout.qk_offsets, layout.v_offsets,
                              layout.group, num_workers=workers, window_left=window_left)
        assert_same_plan(cpu, plan.cpu(), f"replay {round_} window={window_left} {replay}")
        assert_windowed_chunks(plan, new, window_left, f"replay {round_} {replay}")


@pytest.mark.parametrize("position", [0, 5, 99])
def test_cuda_plan_negative_length_sets_status(position):
    _, rng, _ = case_generator("cuda_decode_plan_negative", position)
    layout = random_layout(rng)
    lengths = random_lengths(rng, 100)
    lengths[position] = -3
    workers = 7
    plan = ops.decode_plan(torch.tensor(lengths, dtype=torch.int32, device="cuda"), layout.qk_offsets,
                           layout.v_offsets, layout.group, num_workers=workers).cpu()
    assert plan.numel() == ops.decode_plan_size(100, layout.num_kv_heads, workers)
    assert int(plan[7]) == Status.BAD_SEQLENS
    assert int(plan[5]) == 0, "a failed plan has no tasks"
    offsets_end = DECODE_HEADER + 100 * layout.num_kv_heads + 1 + workers + 1
    assert (plan[DECODE_HEADER:offsets_end] == 0).all()
    assert (plan[offsets_end:] == -1).all()
    with pytest.raises(RuntimeError, match="cache_seqlens must be non-negative"):
        ops.decode_plan(torch.tensor(lengths, dtype=torch.int32), layout.qk_offsets, layout.v_offsets, layout.group,
                        num_workers=workers)


def test_cuda_plan_host_checks():
    layout_rng = case_generator("cuda_decode_plan_checks", 0)[1]
    layout = random_layout(layout_rng)
    seqlens = torch.ones(4, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="fdc::decode_plan: num_workers must be at most 1024 on CUDA"):
        ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group, num_workers=1025)
    with pytest.raises(RuntimeError, match="fdc::decode_plan: cache_seqlens must be int32"):
        ops.decode_plan(seqlens.long(), layout.qk_offsets, layout.v_offsets, layout.group)
    with pytest.raises(RuntimeError, match="fdc::decode_plan: qk_offsets must be a CPU tensor"):
        ops.decode_plan(seqlens, layout.qk_offsets.cuda(), layout.v_offsets, layout.group)
