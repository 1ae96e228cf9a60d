"""The schedules through torch.ops.fdc.prefill_plan / decode_plan: exact coverage of the work, the same loads as a
plain-Python LPT, LPT's bounds, and a small worked example pinned with expecttest."""

from __future__ import annotations

import itertools

import expecttest
import pytest
import torch

from conftest import case_generator, offsets, random_layout
from fdc_ops import ops

CASES = 60


def parse_decode(plan: torch.Tensor) -> dict:
    p = plan.tolist()
    batch, num_kv_heads, workers, tasks = p[1], p[2], p[3], p[5]
    split = p[8:8 + batch * num_kv_heads + 1]
    worker_offsets = p[8 + len(split):8 + len(split) + workers + 1]
    base = 8 + len(split) + workers + 1
    records = [tuple(p[base + 4 * r:base + 4 * r + 4]) for r in range(tasks)]
    return dict(num_kv_heads=num_kv_heads, workers=workers, split=split,
                per_worker=[records[worker_offsets[w]:worker_offsets[w + 1]] for w in range(workers)])


def parse_prefill(plan: torch.Tensor) -> dict:
    p = plan.tolist()
    workers, count = p[3], p[4]
    worker_offsets = p[8:8 + workers + 1]
    base = 8 + workers + 1
    records = [tuple(p[base + 4 * r:base + 4 * r + 4]) for r in range(count)]
    assert len(p) == base + 4 * count
    return dict(workers=workers, per_worker=[records[worker_offsets[w]:worker_offsets[w + 1]] for w in range(workers)])


def plain_lpt(costs: list[int], workers: int) -> list[int]:
    loads = [0] * workers
    for cost in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += cost
    return loads


def optimal_makespan(costs: list[int], workers: int) -> int:
    return min(max(sum(c for c, w in zip(costs, assignment) if w == k) for k in range(workers))
               for assignment in itertools.product(range(workers), repeat=len(costs)))


def check_lpt_bounds(costs: list[int], makespan: int, workers: int, replay: str):
    """At most average + largest task; within 4/3 of max(average, largest) when no task exceeds a third of it."""
    if not costs:
        return
    average, largest = sum(costs) / workers, max(costs)
    lower = max(average, largest)
    assert makespan <= average + largest, replay
    if 3 * largest <= lower:
        assert makespan <= 4 / 3 * lower + 1e-9, f"makespan {makespan} > 4/3 * {lower} {replay}"


@pytest.mark.parametrize("case", range(CASES))
def test_decode_plan_covers_each_key_once_and_matches_plain_lpt(case):
    gen, rng, replay = case_generator("decode_plan", case)
    layout = random_layout(rng)
    batch, workers = rng.randint(0, 8), rng.choice([1, 2, 3, 7, 16, 132])
    lengths = [rng.choice([0, 1, 17, 255, 256, 257, 1000, 8192, 40000]) for _ in range(batch)]
    plan = parse_decode(ops.decode_plan(torch.tensor(lengths, dtype=torch.int32), layout.qk_offsets,
                                        layout.v_offsets, layout.group, num_workers=workers))
    d_sum = [q + v + 1 for q, v in zip(layout.qk_dims, layout.v_dims)]
    hkv = layout.num_kv_heads
    covered = {}
    costs, loads = [], []
    for records in plan["per_worker"]:
        worker_costs = [(end - start) * d_sum[pair % hkv] for pair, _, start, end in records]
        assert worker_costs == sorted(worker_costs, reverse=True), replay
        costs += worker_costs
        loads.append(sum(worker_costs))
        for pair, chunk, start, end in records:
            assert chunk < plan["split"][pair + 1] - plan["split"][pair], replay
            for key in range(start, end):
                assert (pair, key) not in covered, replay
                covered[(pair, key)] = True
    assert len(covered) == sum(lengths) * hkv, replay
    assert loads == plain_lpt(costs, workers), replay
    check_lpt_bounds(costs, max(loads, default=0), workers, replay)


@pytest.mark.parametrize("case", range(CASES))
def test_prefill_plan_covers_each_row_once(case):
    gen, rng, replay = case_generator("prefill_plan", case)
    layout = random_layout(rng)
    batch, workers, causal = rng.randint(0, 5), rng.choice([1, 2, 5, 16, 132]), rng.random() < 0.5
    lengths_q = [rng.choice([0, 1, 15, 16, 17, 100, 640, 2000]) for _ in range(batch)]
    lengths_k = [s if rng.random() < 0.6 else rng.choice([0, 1, 50, 3000]) for s in lengths_q]
    plan = parse_prefill(ops.prefill_plan(offsets(lengths_q), offsets(lengths_k), layout.qk_offsets,
                                          layout.v_offsets, layout.group, causal, num_workers=workers,
                                          row_block=rng.choice([16, 64, 128])))
    heads = layout.num_kv_heads * layout.group
    covered = set()
    for records in plan["per_worker"]:
        for b, h, start, end in records:
            assert 0 <= start < end <= lengths_q[b] and start % 16 == 0, replay
            rows = {(b, h, r) for r in range(start, end)}
            assert not rows & covered, replay
            covered |= rows
    assert len(covered) == sum(lengths_q) * heads, replay
    assert sum(len(r) for r in plan["per_worker"]) <= heads * (sum(lengths_q) // 16 + batch), replay


@pytest.mark.parametrize("case", range(40))
def test_lpt_within_its_bound_of_the_optimum(case):
    """Graham's bound, (4/3 - 1/(3N)) x optimal, on task sets small enough to search exhaustively."""
    _, rng, replay = case_generator("lpt_optimum", case)
    workers = rng.randint(1, 3)
    costs = [rng.randint(1, 30) for _ in range(rng.randint(1, 7))]
    assert max(plain_lpt(costs, workers)) <= (4 / 3 - 1 / (3 * workers)) * optimal_makespan(costs, workers) + 1e-9


def render_decode(plan: torch.Tensor) -> str:
    parsed = parse_decode(plan)
    hkv = parsed["num_kv_heads"]
    lines = []
    for w, records in enumerate(parsed["per_worker"]):
        tasks = ", ".join(f"r{pair // hkv}h{pair % hkv}[{start}:{end}]" for pair, _, start, end in records)
        lines.append(f"worker {w}: {tasks}")
    return "\n".join(lines)


def render_prefill(plan: torch.Tensor) -> str:
    return "\n".join(f"worker {w}: " + ", ".join(f"s{b}q{h}[{start}:{end}]" for b, h, start, end in records)
                     for w, records in enumerate(parse_prefill(plan)["per_worker"]))


class WorkedExample(expecttest.TestCase):
    """Two KV heads of different widths (d_sum 49 and 113), two query heads each, three workers."""

    qk_offsets, v_offsets = offsets([16, 64]), offsets([32, 48])

    def test_decode(self):
        lengths = torch.tensor([3000, 400, 50], dtype=torch.int32)
        plan = ops.decode_plan(lengths, self.qk_offsets, self.v_offsets, 2, num_workers=3)
        self.assertExpectedInline(render_decode(plan), """\
worker 0: r0h1[0:560], r0h1[1680:2240], r1h1[0:400], r2h1[0:50], r2h0[0:50]
worker 1: r0h1[560:1120], r0h1[2240:2800], r0h1[2800:3000], r0h0[2560:3000], r1h0[0:400]
worker 2: r0h1[1120:1680], r0h0[0:1280], r0h0[1280:2560]""")

    def test_prefill_causal(self):
        cu = offsets([100, 37])
        plan = ops.prefill_plan(cu, cu, self.qk_offsets, self.v_offsets, 2, True, num_workers=3, row_block=32)
        self.assertExpectedInline(render_prefill(plan), """\
worker 0: s0q2[64:96], s0q0[64:100], s0q1[0:64], s0q2[96:100], s1q1[0:37]
worker 1: s0q3[64:96], s0q1[64:100], s0q2[0:32], s1q2[0:32], s0q3[96:100], s1q2[32:37]
worker 2: s0q2[32:64], s0q3[32:64], s0q0[0:64], s0q3[0:32], s1q3[0:32], s1q0[0:37], s1q3[32:37]""")
