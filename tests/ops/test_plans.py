"""The schedules through torch.ops.fdc.prefill_plan / decode_plan: exact coverage of the work, the same loads as a
plain-Python LPT, LPT's bounds, and a small worked example pinned with expecttest. The plan codec (fdc_ops/plans.py):
its constants against the C++ headers, round trips of the plans the ops produce, the loads it reports, and the
malformed plans it rejects."""

from __future__ import annotations

import itertools
import os
import re

import expecttest
import pytest
import torch

from conftest import Layout, case_generator, cases, offsets, random_layout
from fdc_ops import ops, plans
from fdc_ops.plans import DecodePlan, PrefillPlan, Status, prefill_plan_size

CASES = 60


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


@pytest.mark.parametrize("case", cases(CASES))
def test_decode_plan_covers_each_key_once_and_matches_plain_lpt(case):
    gen, rng, replay = case_generator("decode_plan", case)
    layout = random_layout(rng)
    batch, workers = rng.randint(0, 8), rng.choice([1, 2, 3, 7, 16, 132])
    lengths = [rng.choice([0, 1, 17, 255, 256, 257, 1000, 8192, 40000]) for _ in range(batch)]
    plan = DecodePlan.from_tensor(ops.decode_plan(torch.tensor(lengths, dtype=torch.int32), layout.qk_offsets,
                                                  layout.v_offsets, layout.group, num_workers=workers))
    hkv = layout.num_kv_heads
    covered = {}
    costs, loads = [], []
    for records, worker_costs in zip(plan.records_by_worker(), plan.costs_by_worker(layout.qk_dims, layout.v_dims)):
        assert worker_costs == sorted(worker_costs, reverse=True), replay
        costs += worker_costs
        loads.append(sum(worker_costs))
        for pair, chunk, start, end in records:
            assert chunk < plan.split_offsets[pair + 1] - plan.split_offsets[pair], replay
            for key in range(start, end):
                assert (pair, key) not in covered, replay
                covered[(pair, key)] = True
    assert len(covered) == sum(lengths) * hkv, replay
    assert loads == plain_lpt(costs, workers), replay
    check_lpt_bounds(costs, max(loads, default=0), workers, replay)


@pytest.mark.parametrize("case", cases(CASES))
def test_prefill_plan_covers_each_row_once(case):
    gen, rng, replay = case_generator("prefill_plan", case)
    layout = random_layout(rng)
    batch, workers, causal = rng.randint(0, 5), rng.choice([1, 2, 5, 16, 132]), rng.random() < 0.5
    lengths_q = [rng.choice([0, 1, 15, 16, 17, 100, 640, 2000]) for _ in range(batch)]
    lengths_k = [s if rng.random() < 0.6 else rng.choice([0, 1, 50, 3000]) for s in lengths_q]
    tensor = ops.prefill_plan(offsets(lengths_q), offsets(lengths_k), layout.qk_offsets, layout.v_offsets,
                              layout.group, causal, num_workers=workers, row_block=rng.choice([16, 64, 128]))
    plan = PrefillPlan.from_tensor(tensor)
    assert tensor.numel() == prefill_plan_size(workers, plan.num_records), replay
    heads = layout.num_kv_heads * layout.group
    covered = set()
    for records in plan.records_by_worker():
        for b, h, start, end in records:
            assert 0 <= start < end <= lengths_q[b] and start % 16 == 0, replay
            rows = {(b, h, r) for r in range(start, end)}
            assert not rows & covered, replay
            covered |= rows
    assert len(covered) == sum(lengths_q) * heads, replay
    assert sum(len(r) for r in plan.records_by_worker()) <= heads * (sum(lengths_q) // 16 + batch), replay


@pytest.mark.parametrize("case", cases(40))
def test_lpt_within_its_bound_of_the_optimum(case):
    """Graham's bound, (4/3 - 1/(3N)) x optimal, on task sets small enough to search exhaustively."""
    _, rng, replay = case_generator("lpt_optimum", case)
    workers = rng.randint(1, 3)
    costs = [rng.randint(1, 30) for _ in range(rng.randint(1, 7))]
    assert max(plain_lpt(costs, workers)) <= (4 / 3 - 1 / (3 * workers)) * optimal_makespan(costs, workers) + 1e-9


def render_decode(plan: torch.Tensor) -> str:
    parsed = DecodePlan.from_tensor(plan)
    hkv = parsed.num_kv_heads
    lines = []
    for w, records in enumerate(parsed.records_by_worker()):
        tasks = ", ".join(f"r{pair // hkv}h{pair % hkv}[{start}:{end}]" for pair, _, start, end in records)
        lines.append(f"worker {w}: {tasks}")
    return "\n".join(lines)


def render_prefill(plan: torch.Tensor) -> str:
    return "\n".join(f"worker {w}: " + ", ".join(f"s{b}q{h}[{start}:{end}]" for b, h, start, end in records)
                     for w, records in enumerate(PrefillPlan.from_tensor(plan).records_by_worker()))


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


# ------------------------------------------------------------------------------------------------------- the codec

INCLUDE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "include", "fdc")


def _header_constants(name: str) -> dict[str, int]:
    """`constexpr <type> kName = value;` and enum entries `kName = value,` of include/fdc/<name>."""
    with open(os.path.join(INCLUDE, name)) as f:
        text = f.read()
    pattern = r"^\s*(?:constexpr\s+\w+\s+)?(k[A-Z]\w*)\s*=\s*(0x[0-9A-Fa-f]+|\d+)\s*[;,]"
    return {key: int(value, 0) for key, value in re.findall(pattern, text, flags=re.MULTILINE)}


def test_codec_constants_mirror_the_headers():
    """The C++ headers are the source of truth: every constant the codec mirrors has the header's value."""
    decode, prefill, common = (_header_constants(n) for n in ("decode_plan.h", "prefill_plan.h", "common.h"))
    assert (plans.DECODE_PLAN_TAG, plans.DECODE_HEADER, plans.DECODE_RECORD_FIELDS, plans.DECODE_CHUNKS_PER_WORKER) \
        == (decode["kDecodePlanTag"], decode["kDecodeHeader"], decode["kDecodeRecordFields"],
            decode["kChunksPerWorker"])
    assert (plans.PREFILL_PLAN_TAG, plans.PREFILL_HEADER, plans.PREFILL_RECORD_FIELDS, plans.ROW_STEP,
            plans.DEFAULT_ROW_BLOCK) == (prefill["kPrefillPlanTag"], prefill["kPrefillHeader"],
                                         prefill["kPrefillRecordFields"], prefill["kRowStep"],
                                         prefill["kDefaultRowBlock"])
    assert {s.name: s.value for s in Status} == {
        re.sub(r"(?<!^)(?=[A-Z])", "_", key[1:]).upper(): value for key, value in common.items()
        if key in ("kOk", "kBadOffsets", "kBadSeqlens", "kBadArgument", "kCapacityExceeded")}
    assert ops.DEFAULT_ROW_BLOCK == plans.DEFAULT_ROW_BLOCK and ops.decode_plan_size is plans.decode_plan_size


def _op_decode_plan(rng) -> tuple[torch.Tensor, list[int], Layout]:
    """The CPU op's decode plan of a random layout, lengths and worker count: (plan, lengths, layout)."""
    layout = random_layout(rng)
    lengths = [rng.choice([0, 1, 17, 256, 257, 1000, 8192, 40000]) for _ in range(rng.randint(0, 8))]
    plan = ops.decode_plan(torch.tensor(lengths, dtype=torch.int32), layout.qk_offsets, layout.v_offsets,
                           layout.group, num_workers=rng.choice([1, 2, 7, 16, 132]))
    return plan, lengths, layout


def _op_prefill_plan(rng, window_left: int = -1) -> tuple[torch.Tensor, list[int], list[int], Layout]:
    """The CPU op's prefill plan of a random layout, lengths, mask and worker count: (plan, s_q, s_k, layout)."""
    layout = random_layout(rng)
    lengths_q = [rng.choice([0, 1, 15, 16, 17, 100, 640, 2000]) for _ in range(rng.randint(0, 5))]
    lengths_k = [s if rng.random() < 0.6 else rng.choice([0, 1, 50, 3000]) for s in lengths_q]
    plan = ops.prefill_plan(offsets(lengths_q), offsets(lengths_k), layout.qk_offsets, layout.v_offsets,
                            layout.group, rng.random() < 0.5, num_workers=rng.choice([1, 2, 5, 16, 132]),
                            row_block=rng.choice([16, 64, 128]), window_left=window_left)
    return plan, lengths_q, lengths_k, layout


@pytest.mark.parametrize("case", cases(20))
def test_decode_codec_round_trips_op_plans(case):
    """from_tensor reads every header field of an op's plan; to_tensor gives back the same integers; the loads are
    the plan's whole work (every key of every (request, KV head) once, at d_sum per key)."""
    _, rng, replay = case_generator("decode_codec", case)
    tensor, lengths, layout = _op_decode_plan(rng)
    plan = DecodePlan.from_tensor(tensor)
    header = tensor[:plans.DECODE_HEADER].tolist()
    assert [plan.batch, plan.num_kv_heads, plan.num_workers, plan.capacity, plan.num_tasks, plan.group,
            plan.status] == header[1:], replay
    assert tensor.numel() == plans.decode_plan_size(len(lengths), layout.num_kv_heads, plan.num_workers), replay
    assert torch.equal(plan.to_tensor(), tensor), replay
    assert DecodePlan.from_tensor(plan.to_tensor()) == plan, replay
    d_sum = plans.d_sums(layout.qk_dims, layout.v_dims)
    assert sum(plan.worker_loads(layout.qk_dims, layout.v_dims)) == sum(s * sum(d_sum) for s in lengths), replay


@pytest.mark.parametrize("case", cases(20))
def test_prefill_codec_round_trips_op_plans(case):
    """As for decode; the loads sum to d_sum(h) x every row's visible keys, over every (sequence, head)."""
    _, rng, replay = case_generator("prefill_codec", case)
    tensor, lengths_q, lengths_k, layout = _op_prefill_plan(rng)
    plan = PrefillPlan.from_tensor(tensor)
    header = tensor[:plans.PREFILL_HEADER].tolist()
    assert [plan.batch, plan.num_heads, plan.num_workers, plan.num_records, plan.causal, plan.row_block,
            plan.group] == header[1:], replay
    assert plan.num_records <= plans.prefill_plan_capacity(sum(lengths_q), len(lengths_q), plan.num_heads), replay
    assert torch.equal(plan.to_tensor(), tensor), replay
    assert PrefillPlan.from_tensor(plan.to_tensor()) == plan, replay
    d_sum = plans.d_sums(layout.qk_dims, layout.v_dims)
    expected = sum(d_sum[h // layout.group] * plans.visible_keys(0, s_q, s_q, s_k, plan.causal)
                   for s_q, s_k in zip(lengths_q, lengths_k) for h in range(plan.num_heads))
    assert sum(plan.worker_loads(layout.qk_dims, layout.v_dims, lengths_q, lengths_k)) == expected, replay


@pytest.mark.parametrize("case", cases(20))
def test_visible_keys_counts_each_rows_keys(case):
    """The closed form against a count row by row, causal or not, with and without a window (include/fdc's
    attention_variant.h: row r at position r + s_k - s_q sees [max(0, p - window_left), min(p + 1, s_k)))."""
    _, rng, replay = case_generator("visible_keys", case)
    s_q, s_k = rng.randint(0, 70), rng.randint(0, 70)
    r0 = rng.randint(0, s_q)
    r1 = rng.randint(r0, s_q)
    causal, window_left = rng.random() < 0.5, rng.choice([-1, 0, 1, 5, 30, 100])

    def seen(r):
        p = r + s_k - s_q
        end = min(p + 1, s_k) if causal else s_k
        start = 0 if window_left < 0 else min(max(0, p - window_left), s_k)
        return max(0, end - start)

    assert plans.visible_keys(r0, r1, s_q, s_k, causal, window_left) == sum(map(seen, range(r0, r1))), replay


@pytest.mark.parametrize("case", cases(10))
def test_windowed_prefill_plans_cost_the_visible_keys(case):
    """A plan made with a sliding window: the loads the codec computes for that window sum to every row's visible keys
    at d_sum each (what the planner's LPT balanced)."""
    _, rng, replay = case_generator("prefill_codec_window", case)
    window_left = rng.choice([0, 15, 100, 700])
    tensor, lengths_q, lengths_k, layout = _op_prefill_plan(rng, window_left)
    plan = PrefillPlan.from_tensor(tensor)
    d_sum = plans.d_sums(layout.qk_dims, layout.v_dims)
    expected = sum(d_sum[h // layout.group] * plans.visible_keys(0, s_q, s_q, s_k, plan.causal, window_left)
                   for s_q, s_k in zip(lengths_q, lengths_k) for h in range(plan.num_heads))
    loads = plan.worker_loads(layout.qk_dims, layout.v_dims, lengths_q, lengths_k, window_left)
    assert sum(loads) == expected, replay


def test_a_failed_decode_plan_encodes_as_documented():
    """A plan with a failure status (what the device planner writes for a negative length): no tasks, every offset
    0, every record entry -1; it decodes back."""
    plan = DecodePlan(batch=3, num_kv_heads=2, num_workers=4, group=2, split_offsets=[0] * 7,
                      worker_offsets=[0] * 5, records=[], status=Status.BAD_SEQLENS)
    tensor = plan.to_tensor()
    assert tensor[:plans.DECODE_HEADER].tolist() == [plans.DECODE_PLAN_TAG, 3, 2, 4, 18, 0, 2, 2]
    offsets_end = plans.DECODE_HEADER + 7 + 5
    assert (tensor[plans.DECODE_HEADER:offsets_end] == 0).all() and (tensor[offsets_end:] == -1).all()
    assert DecodePlan.from_tensor(tensor) == plan


def test_hand_built_plans_run_like_the_planners():
    """Plans built with the codec instead of the planner are accepted by the ops and compute the same attention: the
    schedule only distributes work."""
    gen = torch.Generator().manual_seed(0)
    qk_offsets, v_offsets, group = offsets([16, 64]), offsets([32, 48]), 2
    lengths = [70, 0, 33]
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(3, group * 80, generator=gen)
    k_cache, v_cache = torch.randn(3, 70, 80, generator=gen), torch.randn(3, 70, 80, generator=gen)
    planned = DecodePlan.from_tensor(ops.decode_plan(seqlens, qk_offsets, v_offsets, group, num_workers=3))
    one_worker = DecodePlan(planned.batch, planned.num_kv_heads, 3, group, planned.split_offsets,
                            [0, planned.num_tasks, planned.num_tasks, planned.num_tasks], planned.records[::-1])
    expected = ops.decode_attention(q, k_cache, v_cache, seqlens, qk_offsets, v_offsets, group, 0.1)
    torch.testing.assert_close(ops.decode_attention(q, k_cache, v_cache, seqlens, qk_offsets, v_offsets, group, 0.1,
                                                    one_worker.to_tensor()), expected)
    cu = offsets(lengths)
    qp = torch.randn(103, group * 80, generator=gen)
    kp, vp = torch.randn(103, 80, generator=gen), torch.randn(103, 80, generator=gen)
    records = [(b, h, 0, s) for b, s in enumerate(lengths) if s for h in range(4)]
    whole = PrefillPlan(3, 4, 2, True, 64, group, [0, 3, len(records)], records)
    torch.testing.assert_close(
        ops.prefill_attention(qp, kp, vp, cu, cu, qk_offsets, v_offsets, group, 0.1, True, whole.to_tensor()),
        ops.prefill_attention(qp, kp, vp, cu, cu, qk_offsets, v_offsets, group, 0.1, True))


def test_visible_keys_counts_what_the_mask_lets_each_row_see():
    """plans.visible_keys (the prefill planner's cost, the benchmarks' useful FLOPs) against counting the causal
    mask, bottom-right aligned, row by row; over whole sequences and row ranges inside them."""
    for s_q, s_k in ((100, 100), (100, 130), (100, 40), (1, 1), (33, 0), (17, 5)):
        assert plans.visible_keys(0, s_q, s_q, s_k, False) == s_q * s_k
        per_row = [sum(1 for c in range(s_k) if c <= r + s_k - s_q) for r in range(s_q)]
        assert plans.visible_keys(0, s_q, s_q, s_k, True) == sum(per_row)
        for r0, r1 in ((0, 1), (s_q // 3, s_q // 2 + 1), (s_q - 1, s_q), (5, 5)):
            assert plans.visible_keys(r0, r1, s_q, s_k, True) == sum(per_row[r0:r1]), (s_q, s_k, r0, r1)


def _set(index: int, value: int):
    """A mutation of a plan's integers: entry `index` set to `value`."""
    def mutate(p: list[int]) -> list[int]:
        p[index] = value
        return p
    return mutate


def _decode_field(name: str) -> int:
    """Index in the reference decode plan below (B=2, H_kv=2, N=3) of the first entry of a section."""
    return {"split": 8, "worker": 8 + 5, "records": 8 + 5 + 4}[name]


def _reference_decode_plan() -> torch.Tensor:
    """The op's decode plan for B=2 (lengths 600, 40), H_kv=2 (d_sum 49 and 113), N=3: 8 chunks."""
    return ops.decode_plan(torch.tensor([600, 40], dtype=torch.int32), offsets([16, 64]), offsets([32, 48]), 2,
                           num_workers=3)


DECODE_REJECTIONS = {  # name: (mutation of the plan's integers, what the error says)
    "tag": (_set(0, plans.PREFILL_PLAN_TAG), r"plan\[0\] \(tag\) must be kDecodePlanTag .* \(a prefill plan\)"),
    "batch": (_set(1, -1), r"plan\[1\] \(batch\) must be non-negative but got -1"),
    "num_kv_heads": (_set(2, 0), r"plan\[2\] \(num_kv_heads\) must be at least 1"),
    "num_workers": (_set(3, 0), r"plan\[3\] \(num_workers\) must be at least 1"),
    "capacity": (_set(4, 99), r"plan\[4\] \(capacity\) must be B \* H_kv \+ 3 \* N = 13 but got 99"),
    "num_tasks": (_set(5, 14), r"plan\[5\] \(num_tasks\) must be in \[0, capacity = 13\] but got 14"),
    "group": (_set(6, 0), r"plan\[6\] \(group\) must be at least 1"),
    "status": (_set(7, 9), r"plan\[7\] \(status\) must be a Status code"),
    "failed with tasks": (_set(7, 2), r"records must be empty in a plan with status BAD_SEQLENS"),
    "length": (lambda p: p + [-1], r"the plan's length must be decode_plan_size\(B=2, H_kv=2, N=3\) = 69 but got 70"),
    "split start": (_set(_decode_field("split"), 1), r"split_offsets\[0\] must be 0"),
    "split order": (_set(_decode_field("split") + 1, 9), r"split_offsets\[2\] must be at least split_offsets\[1\]"),
    "worker end": (_set(_decode_field("worker") + 3, 9), r"worker_offsets\[3\] must be num_tasks = 8 but got 9"),
    "pair": (_set(_decode_field("records"), 4),
             r"records\[0\]\[0\] \(b \* H_kv \+ j\) must be in \[0, B \* H_kv = 4\)"),
    "chunk": (_set(_decode_field("records") + 1, 7), r"records\[0\]\[1\] \(chunk\) must be in \[0, "),
    "empty chunk": (lambda p: _set(_decode_field("records") + 3, p[_decode_field("records") + 2])(p),
                    r"records\[0\]\[2:4\] \(kv_start, kv_end\) must be 0 <= kv_start < kv_end"),
    "duplicate": (lambda p: p[:_decode_field("records") + 4] + p[_decode_field("records"):_decode_field("records") + 4]
                  + p[_decode_field("records") + 8:], r"records\[1\] must be the only record of pair"),
    "padding": (_set(-1, 0), r"every record entry past num_tasks = 8 must be -1 but got \[0\]"),
}


@pytest.mark.parametrize("name", DECODE_REJECTIONS)
def test_decode_codec_rejects_malformed_plans(name):
    tensor = _reference_decode_plan()
    assert DecodePlan.from_tensor(tensor).num_tasks == 8  # the indices above assume this plan
    mutate, message = DECODE_REJECTIONS[name]
    with pytest.raises(ValueError, match=r"^DecodePlan\.from_tensor: " + message):
        DecodePlan.from_tensor(torch.tensor(mutate(tensor.tolist()), dtype=torch.int32))


def _reference_prefill_plan() -> torch.Tensor:
    """The op's prefill plan for B=2 (lengths 100, 37), H=4 (G=2), N=3, causal, row block 32: 18 records."""
    cu = offsets([100, 37])
    return ops.prefill_plan(cu, cu, offsets([16, 64]), offsets([32, 48]), 2, True, num_workers=3, row_block=32)


PREFILL_RECORDS = 8 + 4  # index of the first record in the reference prefill plan (N=3)
PREFILL_REJECTIONS = {
    "tag": (_set(0, plans.DECODE_PLAN_TAG), r"plan\[0\] \(tag\) must be kPrefillPlanTag .* \(a decode plan\)"),
    "batch": (_set(1, -2), r"batch must be non-negative but got -2"),
    "num_heads": (_set(2, 3), r"num_heads must be a positive multiple of group = 2"),
    "num_workers": (_set(3, 0), r"plan\[3\] \(num_workers\) must be at least 1"),
    "num_records": (_set(4, -1), r"plan\[4\] \(num_records\) must be non-negative"),
    "causal": (_set(5, 2), r"plan\[5\] \(causal\) must be 0 or 1 but got 2"),
    "row_block": (_set(6, 24), r"row_block must be a positive multiple of 16 but got 24"),
    "group": (_set(7, 0), r"group must be at least 1 but got 0"),
    "length": (lambda p: p[:-1], r"the plan's length must be prefill_plan_size\(N=3, R=18\) = 84 but got 83"),
    "worker order": (_set(9, 30), r"worker_offsets\[2\] must be at least worker_offsets\[1\] = 30"),
    "sequence": (_set(PREFILL_RECORDS, 2), r"records\[0\]\[0\] \(b\) must be in \[0, B = 2\) but got 2"),
    "head": (_set(PREFILL_RECORDS + 1, -1), r"records\[0\]\[1\] \(h\) must be in \[0, H = 4\) but got -1"),
    "rows": (_set(PREFILL_RECORDS + 2, 200), r"records\[0\]\[2:4\] \(row_start, row_end\) must be 0 <= row_start"),
}


@pytest.mark.parametrize("name", PREFILL_REJECTIONS)
def test_prefill_codec_rejects_malformed_plans(name):
    tensor = _reference_prefill_plan()
    assert PrefillPlan.from_tensor(tensor).num_records == 18  # the indices above assume this plan
    mutate, message = PREFILL_REJECTIONS[name]
    with pytest.raises(ValueError, match=r"^PrefillPlan\.from_tensor: " + message):
        PrefillPlan.from_tensor(torch.tensor(mutate(tensor.tolist()), dtype=torch.int32))


@pytest.mark.parametrize("codec", [DecodePlan, PrefillPlan])
def test_codecs_reject_what_is_not_a_plan_tensor(codec):
    name = codec.__name__
    with pytest.raises(TypeError, match=rf"^{name}\.from_tensor: plan must be a torch.Tensor but got list"):
        codec.from_tensor([0] * 20)
    for bad, what in ((torch.zeros(20, dtype=torch.int64), "1-D torch.int64"),
                      (torch.zeros(2, 10, dtype=torch.int32), "2-D torch.int32")):
        with pytest.raises(ValueError, match=rf"^{name}\.from_tensor: plan must be a 1-D int32 tensor but got {what}"):
            codec.from_tensor(bad)
    with pytest.raises(ValueError, match=rf"^{name}\.from_tensor: plan must hold at least its 8-entry header"):
        codec.from_tensor(torch.zeros(5, dtype=torch.int32))


def test_to_tensor_checks_hand_built_plans():
    """A hand-built plan that breaks the format is refused before it reaches an op, naming the field."""
    with pytest.raises(ValueError, match=r"^DecodePlan\.to_tensor: the length of worker_offsets must be 3 but got 2"):
        DecodePlan(1, 1, 2, 1, [0, 1], [0, 1], [(0, 0, 0, 5)]).to_tensor()
    with pytest.raises(ValueError, match=r"^DecodePlan\.to_tensor: status must be a Status code in \[0, 1, 2, 3, 4\] "
                                         r"but got 7"):
        DecodePlan(1, 1, 1, 1, [0, 0], [0, 0], [], status=7).to_tensor()
    with pytest.raises(ValueError, match=r"^PrefillPlan\.to_tensor: records\[0\]\[1\] \(h\) must be in \[0, H = 2\)"):
        PrefillPlan(1, 2, 1, False, 64, 1, [0, 1], [(0, 2, 0, 16)]).to_tensor()
    with pytest.raises(ValueError, match=r"^DecodePlan\.costs_by_worker: qk_dims and v_dims must be one width per KV "
                                         r"head \(H_kv = 1\) but got 2 widths"):
        DecodePlan(1, 1, 1, 1, [0, 1], [0, 1], [(0, 0, 0, 5)]).worker_loads([8, 8], [8, 8])
