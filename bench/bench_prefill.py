"""Prefill benchmark: fdc prefill_attention over packed heads of adaptive widths against full-width, padded and bucketed
SDPA on the same shapes, in one process; plus the balance ablation of the prefill plan (row-block rescaling and the
last-round redistribution, the paper's /KE) and the cost of planning.

What is measured (docs/design.md section 6):
- matmul peak: torch.matmul of two 8192 x 8192 bfloat16 matrices, 2 * 8192^3 / median time;
- useful TFLOP/s of each method: per query head of KV head j, 2 * (d_qk[j] + d_v[j]) * (visible keys summed over
  its query rows), visible keys counted exactly (causal: bottom-right aligned, s(s+1)/2 for s_q = s_k = s), / median
  time; full-width SDPA counts d = 128, every other method the compressed layout's widths (what it must compute);
  and that as a share of the matmul peak;
- baselines, each the best over SDPA backends (flash, efficient, cudnn, math; those that exist and accept the
  shapes) with GQA through enable_gqa=True where this torch has it, else (or where a backend refuses it) K/V
  repeated per query head inside the timed call:
    sdpa_full      full-width heads (D = 128), q (1, H, s, D), K/V (1, H_kv, s, D);
    sdpa_padded    every head padded to the layout's largest qk width (q, K) and largest v width (V);
    sdpa_bucketed  one SDPA call per bucket of KV heads with equal (d_qk, d_v), each bucket's tensors on their own.
  Varlen batches run one SDPA call per sequence ("per_sequence"), and, where this torch's nested (jagged) tensors
  take them, one call on nested tensors ("nested"); the faster is kept and named in the row's backend column.
- fdc rows: fdc_attention (prefill_attention with a plan made beforehand) and fdc_step (prefill_plan inside the
  call, as a model layer calls it). Packed q (T, G * sum d_qk), k (T, sum d_qk), v (T, sum d_v), int32 cu_seqlens.

Targets, each printed PASS or MISS, from the prefill rows of bench_common.TARGETS (the one table of every benchmark's
targets, with the reason for each number):
- fdc time <= 1.25 * (useful FLOPs of fdc / useful FLOPs of full width) * full-width SDPA time;
- fdc is faster than sdpa_padded and sdpa_bucketed.

Balance ablation: a layout with half the KV heads 16/16 wide and half 128/128; plans built here in the format of
include/fdc/prefill_plan.h by a Python copy of the planner (checked equal to prefill_plan's plan, integer for integer,
with both features on):
    lpt                    the op's plan: row blocks rescaled per head, full rounds to the least-loaded worker, the
                           last partial round split evenly over all workers;
    no_rescale             every head row_block rows, otherwise the same;
    no_redistribution      rescaled row blocks, whole tasks dealt round-robin in descending cost order;
    no_redistribution_lpt  rescaled row blocks, whole tasks each to the least-loaded worker (only the last-round
                           split removed);
    neither                every head row_block rows, whole tasks round-robin in descending cost order.
On a GPU the plans have one worker per SM; on the CPU, 7. Each reports time and makespan (the largest per-worker
cost summed from the plan's records, cost = d_sum * visible keys as in prefill_plan.h, d_sum = d_qk + d_v + 1) and
makespan over the ideal (total cost / workers).

Planning cost: prefill_plan on the device for shapes not planned before in this process (first call, wall clock
with synchronisation) and again (median of repeated calls; the CUDA planner caches per shape), against the attention
time with that plan.

Timing: warm-up, then the median of per-call timings (CUDA events on a GPU, with a 256 MiB buffer written before each
call so no call finds the previous one's data in L2; perf_counter on the CPU); the number of timed calls adapts to
the call's length (about --budget seconds per measurement, between 3 and --repeats). Prints tables and writes JSON to
bench/results/gpu/ (or --out) with the device, torch version, commit and every row. --quick runs tiny shapes and works
on the CPU. Needs only torch, numpy and the standard library besides fdc_ops.
"""

from __future__ import annotations

import heapq
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

# bench_common first: it puts the repository root on sys.path for fdc_ops.
from bench_common import (
    GROUP,
    HEAD_DIM,
    NUM_KV_HEADS,
    SCALE,
    SDPA_REFUSALS,
    SdpaSweep,
    Timer,
    ablation_dims,
    adaptive_dims,
    bench_parser,
    cell,
    detail,
    device_line,
    dtype_name,
    faster_than,
    finite,
    first_line,
    git_commit,
    has_enable_gqa,
    head_buckets,
    layout_line,
    layout_record,
    median,
    num_workers_for,
    phase_targets,
    print_header,
    progress,
    provenance,
    randn,
    release,
    sdpa_backends,
    setup,
    target,
    useful_flops,
    write_report,
)
from fdc_ops import ops
from fdc_ops.apps.provenance import device_name
from fdc_ops.plans import ROW_STEP, PrefillPlan, concat_workers, visible_keys

# Mean of the adaptive widths (bench_common.adaptive_dims): 64, 50% of D, the middle of the paper's 40-60%.
DIM_MEAN = 64
# The math backend materialises (heads, s_q, s_k) scores and softmax in float32: skip it beyond this share of free
# device memory (at 32K it would need ~400 GiB).
MATH_MEMORY_SHARE = 0.5
# Workers of the ablation's plans on the CPU, where intra-op threads are few: 7 does not divide the 32 heads, so the
# policies differ (as 132 SMs do not divide them on an H100).
CPU_ABLATION_WORKERS = 7


@dataclass
class Case:
    name: str
    lengths: list[int]
    causal: bool
    dtype: torch.dtype


@dataclass
class Row:
    case: str
    causal: bool
    dtype: str
    method: str
    label: str
    micros: float
    useful_flops: float
    tflops: float
    peak_share: float | None
    vs_full: float | None
    backend: str = ""
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------- timing


def matmul_peak(device: torch.device, n: int, timer: Timer) -> float:
    """TFLOP/s of an n x n x n bfloat16 torch.matmul (the device's practical tensor-core peak)."""
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    seconds = median(timer(lambda: torch.matmul(a, b), flush=False))
    a = b = None  # released: the timed closures above hold them
    return 2 * n ** 3 / seconds / 1e12


# ----------------------------------------------------------------------------------------------------------- layout


def mixed_lengths(total: int, seed: int, low: int = 300, high: int = 16384) -> list[int]:
    """Seeded sequence lengths, log-uniform in [low, high], odd and even, summing to exactly `total`."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(round(math.exp(rng.uniform(math.log(low), math.log(high))))))
    lengths[-1] -= sum(lengths) - total  # stays >= 1: the lengths before it summed to less than total
    return lengths


# ------------------------------------------------------------------------------------------------------------- SDPA


def sdpa(q, k, v, causal: bool, gqa: str):
    """SDPA of q (b, H, s, dq) against k (b, H_kv, s, dq), v (b, H_kv, s, dv); GQA by enable_gqa or by repeating."""
    if gqa == "enable_gqa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE, enable_gqa=True)
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=causal,
                                          scale=SCALE)


class Dense:
    """One baseline's inputs: for each head bucket (KV heads, d_qk, d_v), per sequence (b=1) tensors and, for
    varlen batches, nested jagged tensors over all sequences."""

    def __init__(self, lengths: list[int], buckets: list[tuple[int, int, int]], dtype, device, nested: bool):
        self.calls = []
        for heads, dq, dv in buckets:
            per_seq = [(randn((1, GROUP * heads, s, dq), dtype, device), randn((1, heads, s, dq), dtype, device),
                        randn((1, heads, s, dv), dtype, device)) for s in lengths]
            self.calls.append(per_seq)
        self.nested = None
        if nested and len(lengths) > 1:
            self.nested = []
            for per_seq in self.calls:
                self.nested.append(tuple(
                    torch.nested.nested_tensor([t[0].transpose(0, 1) for t in tensors], layout=torch.jagged)
                    .transpose(1, 2) for tensors in zip(*per_seq)))  # (B, heads, j, d) with jagged j

    def run(self, causal: bool, gqa: str, mode: str):
        if mode == "nested":
            return lambda: [nested_sdpa(q, k, v, causal) for q, k, v in self.nested]
        return lambda: [sdpa(q, k, v, causal, gqa) for per_seq in self.calls for q, k, v in per_seq]


def nested_sdpa(q, k, v, causal: bool):
    """SDPA on nested jagged (B, H, j, d) tensors; GQA by repeating K/V heads inside the call (jagged SDPA takes no
    enable_gqa)."""
    g = q.size(1) // k.size(1)
    if g > 1:
        k = k.transpose(1, 2).repeat_interleave(g, 2).transpose(1, 2)
        v = v.transpose(1, 2).repeat_interleave(g, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE)


# Nested-tensor SDPA logs every backend it rejects as a warning; its refusals are recorded in the row instead.
logging.getLogger("torch.nested._internal.sdpa").setLevel(logging.ERROR)


def best_sdpa(dense: Dense, case: Case, device: torch.device, timer: Timer, gqa_default: str, math_bytes: int):
    """Times the baseline under each SDPA backend, GQA mode and varlen mode; returns (times of the best,
    "backend/gqa/mode", {"backend/gqa/mode": median us or why it did not run})."""
    sweep = SdpaSweep(timer, SDPA_REFUSALS + (TypeError,))  # nested (jagged) SDPA refuses with TypeError too
    modes = ["per_sequence"] + (["nested"] if dense.nested is not None else [])
    for backend in sdpa_backends(device):
        if backend.name == "MATH" and device.type == "cuda" and \
                math_bytes > MATH_MEMORY_SHARE * torch.cuda.mem_get_info(device)[0]:
            sweep.skip("math", f"would materialise {math_bytes / 2**30:.1f} GiB of scores")
            continue
        for mode in modes:
            gqa_modes = [gqa_default] if mode == "per_sequence" else ["repeat"]
            if gqa_default == "enable_gqa" and mode == "per_sequence":
                gqa_modes.append("repeat")  # only tried when a backend refuses enable_gqa
            for gqa in gqa_modes:
                if sweep.time(f"{backend.name.lower()}/{gqa}/{mode}", backend, dense.run(case.causal, gqa, mode)):
                    break  # this backend took this GQA mode: the repeat fallback is not needed
                release(device)
    return sweep.result()


# -------------------------------------------------------------------------------------------------------------- fdc


class FdcInputs:
    """Packed q, k, v and int32 cu_seqlens of one case on the device."""

    def __init__(self, lengths: list[int], causal: bool, qk_dims, v_dims, dtype, device):
        self.qk_offsets, self.v_offsets = ops.prefix_sums(qk_dims), ops.prefix_sums(v_dims)
        self.qk_dims, self.v_dims, self.causal, self.lengths = qk_dims, v_dims, causal, lengths
        tokens = sum(lengths)
        self.cu = ops.prefix_sums(lengths).to(device)
        self.q = randn((tokens, GROUP * sum(qk_dims)), dtype, device)
        self.k = randn((tokens, sum(qk_dims)), dtype, device)
        self.v = randn((tokens, sum(v_dims)), dtype, device)

    def plan(self, num_workers: int | None = None, row_block: int = ops.DEFAULT_ROW_BLOCK) -> torch.Tensor:
        return ops.prefill_plan(self.cu, self.cu, self.qk_offsets, self.v_offsets, GROUP, self.causal, num_workers,
                                row_block)

    def attention(self, plan: torch.Tensor | None) -> torch.Tensor:
        return ops.prefill_attention(self.q, self.k, self.v, self.cu, self.cu, self.qk_offsets, self.v_offsets, GROUP,
                                     SCALE, self.causal, plan)


# --------------------------------------------------------------------------------------------------- prefill plans


def python_plan(lengths: list[int], qk_dims: list[int], v_dims: list[int], causal: bool, num_workers: int,
                row_block: int, rescale: bool, assign: str) -> PrefillPlan:
    """A prefill plan built in Python (s_q = s_k per sequence).

    rescale: rows per task max(16, round_down(row_block * d_sum_max / d_sum, 16)) as the planner does, else
    row_block for every head. assign: "planner" (tasks sorted by cost, descending and stable; full rounds to the
    least-loaded worker, lowest index on ties; the last partial round cut into 16-row pieces of at most
    ceil(W_last / N), each to the least-loaded worker: prefill_plan's algorithm), "lpt_whole" (every task whole to
    the least-loaded worker) or "round_robin" (every task whole, dealt in turn in sorted order)."""
    heads = NUM_KV_HEADS * GROUP
    d_sum = [qk_dims[h // GROUP] + v_dims[h // GROUP] + 1 for h in range(heads)]
    max_d_sum = max(d_sum)
    tasks = []  # (b, h, r0, r1, cost) in enumeration order
    for b, s in enumerate(lengths):
        for h in range(heads):
            rows = max(ROW_STEP, row_block * max_d_sum // d_sum[h] // ROW_STEP * ROW_STEP) if rescale else row_block
            for r0 in range(0, s, rows):
                r1 = min(s, r0 + rows)
                tasks.append((b, h, r0, r1, d_sum[h] * visible_keys(r0, r1, s, s, causal)))
    tasks.sort(key=lambda t: -t[4])  # stable: ties keep enumeration order
    pool = [(0, w) for w in range(num_workers)]  # (load, worker): the heap's minimum is the planner's choice
    per_worker: list[list[tuple]] = [[] for _ in range(num_workers)]

    def take(record, cost):
        load, w = heapq.heappop(pool)
        heapq.heappush(pool, (load + cost, w))
        per_worker[w].append(record)

    if assign == "round_robin":
        for i, t in enumerate(tasks):
            per_worker[i % num_workers].append(t[:4])
    elif assign == "lpt_whole":
        for t in tasks:
            take(t[:4], t[4])
    elif assign == "planner":
        full = len(tasks) // num_workers * num_workers
        for t in tasks[:full]:
            take(t[:4], t[4])
        wl = -(-sum(t[4] for t in tasks[full:]) // num_workers)
        for b, h, r0, r1, _ in tasks[full:]:
            s = lengths[b]
            p0 = r0
            while p0 < r1:
                p1 = min(r1, p0 + ROW_STEP)
                cost = d_sum[h] * visible_keys(p0, p1, s, s, causal)
                while p1 < r1:
                    nxt = min(r1, p1 + ROW_STEP)
                    step = d_sum[h] * visible_keys(p1, nxt, s, s, causal)
                    if cost + step > wl:
                        break
                    cost, p1 = cost + step, nxt
                take((b, h, p0, p1), cost)
                p0 = p1
    else:
        raise ValueError(f"python_plan: unknown assignment {assign!r}")
    return PrefillPlan(len(lengths), heads, num_workers, causal, row_block, GROUP, *concat_workers(per_worker))


def makespan(plan: PrefillPlan, lengths: list[int], qk_dims, v_dims) -> tuple[int, float]:
    """(largest per-worker cost, that over the ideal total / N); cost of a record = d_sum * visible keys."""
    loads = plan.worker_loads(qk_dims, v_dims, lengths, lengths)
    return max(loads), max(loads) / max(sum(loads) / plan.num_workers, 1)


ABLATION_POLICIES = {  # name: (rescale, assignment)
    "lpt": (True, "planner"),
    "no_rescale": (False, "planner"),
    "no_redistribution": (True, "round_robin"),
    "no_redistribution_lpt": (True, "lpt_whole"),
    "neither": (False, "round_robin"),
}


def balance_ablation(shapes: list[tuple[str, list[int], bool]], dtype, device, timer: Timer) -> list[dict]:
    """The op's plan against plans without rescaling and/or the last-round split, half-16 / half-128 layout."""
    qk_dims, v_dims = ablation_dims()
    workers = num_workers_for(device) if device.type == "cuda" else CPU_ABLATION_WORKERS
    out = []
    for name, lengths, causal in shapes:
        inputs = FdcInputs(lengths, causal, qk_dims, v_dims, dtype, device)
        cu = inputs.cu.cpu()  # the host planner: the device planner's plans equal it (tests/cuda/test_cuda_prefill.py)
        op_plan = ops.prefill_plan(cu, cu, inputs.qk_offsets, inputs.v_offsets, GROUP, causal, workers)
        entry = dict(case=name, lengths=lengths, causal=causal, dtype=dtype_name(dtype),
                     qk_dims=qk_dims, v_dims=v_dims, workers=workers, row_block=ops.DEFAULT_ROW_BLOCK, policies={})
        reference = None
        for policy, (rescale, assign) in ABLATION_POLICIES.items():
            plan = python_plan(lengths, qk_dims, v_dims, causal, workers, ops.DEFAULT_ROW_BLOCK, rescale, assign)
            if policy == "lpt":
                entry["python_planner_matches_op"] = plan == PrefillPlan.from_tensor(op_plan)
            span, over_ideal = makespan(plan, lengths, qk_dims, v_dims)
            result = dict(makespan=span, makespan_over_ideal=over_ideal, records=plan.num_records)
            plan_t = plan.to_tensor(device)
            try:
                out_t = inputs.attention(plan_t)
                if reference is None:
                    reference = out_t.float()
                result["max_abs_diff_vs_lpt"] = float((out_t.float() - reference).abs().max())
                result["micros"] = median(timer(lambda inputs=inputs, plan_t=plan_t: inputs.attention(plan_t))) * 1e6
            except (RuntimeError, NotImplementedError) as error:
                result["micros"] = float("nan")
                result["error"] = first_line(error)
            entry["policies"][policy] = result
        base = entry["policies"]["lpt"]
        for result in entry["policies"].values():
            result["time_vs_lpt"] = result["micros"] / base["micros"] if base["micros"] else float("nan")
            result["makespan_vs_lpt"] = result["makespan"] / max(base["makespan"], 1)
        out.append(entry)
        inputs = op_plan = None  # released: the timed closures above hold them
        release(device)
    return out


def plan_cost(shapes: list[tuple[str, list[int], bool]], qk_dims, v_dims, dtype, device, timer: Timer) -> list[dict]:
    """prefill_plan's first call for a shape new to this process, then cached calls, against the attention time."""
    out = []
    for name, lengths, causal in shapes:
        inputs = FdcInputs(lengths, causal, qk_dims, v_dims, dtype, device)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
        entry = dict(case=name, lengths=lengths, causal=causal, batch=len(lengths))
        try:
            sync(device)
            begin = time.perf_counter()
            plan = inputs.plan()
            sync(device)
            entry["first_us"] = (time.perf_counter() - begin) * 1e6
            cached = timer(inputs.plan, repeats=max(timer.repeats, 20), flush=False)
            entry.update(records=PrefillPlan.from_tensor(plan).num_records, cached_us=median(cached) * 1e6,
                         cached_max_us=max(cached) * 1e6)
            entry["attention_us"] = median(timer(lambda inputs=inputs, plan=plan: inputs.attention(plan))) * 1e6
            entry["step_us"] = median(timer(lambda inputs=inputs: inputs.attention(None))) * 1e6
            entry["first_share"] = entry["first_us"] / entry["attention_us"]
            entry["cached_share"] = entry["cached_us"] / entry["attention_us"]
        except (RuntimeError, NotImplementedError) as error:
            entry["error"] = first_line(error)
        out.append(entry)
        inputs = None  # released: the timed closures above hold them
        release(device)
    return out


# ------------------------------------------------------------------------------------------------------------ cases


def cases(quick: bool) -> list[Case]:
    if quick:
        shapes = [("1 x 256", [256]), ("varlen 3 seqs", [200, 37, 96])]
        out = [Case(name, lengths, c, torch.bfloat16) for name, lengths in shapes for c in (True, False)]
        return out + [Case("1 x 256 fp16", [256], True, torch.float16)]
    shapes = [("1 x 1K", [1024]), ("1 x 4K", [4096]), ("1 x 16K", [16384]), ("1 x 32K", [32768]),
              ("varlen 16K", mixed_lengths(16384, 1, high=8192)), ("varlen 64K", mixed_lengths(65536, 2))]
    out = [Case(name, lengths, c, torch.bfloat16) for name, lengths in shapes for c in (True, False)]
    return out + [Case("1 x 4K fp16", [4096], True, torch.float16)]


def bench_case(case: Case, qk_dims, v_dims, device, timer: Timer, peak: float, gqa: str) -> list[Row]:
    dtype = case.dtype
    full_flops = useful_flops(case.lengths, case.causal, [HEAD_DIM] * NUM_KV_HEADS, [HEAD_DIM] * NUM_KV_HEADS)
    fdc_flops = useful_flops(case.lengths, case.causal, qk_dims, v_dims)
    math_bytes = 3 * 4 * NUM_KV_HEADS * GROUP * max(case.lengths) ** 2  # per-sequence scores, softmax and a copy
    rows: list[Row] = []
    full_time: float | None = None

    def add(method, label, times, flops, backend="", **extra):
        nonlocal full_time
        seconds = median(times)
        if method == "sdpa_full":
            full_time = seconds
        tflops = flops / seconds / 1e12
        rows.append(Row(case.name, case.causal, dtype_name(dtype), method, label, seconds * 1e6,
                        flops, tflops, tflops / peak if peak else None, seconds / full_time if full_time else None,
                        backend, extra))

    def baseline(method, label, buckets, flops):
        dense = Dense(case.lengths, buckets, dtype, device, nested=True)
        times, name, tried = best_sdpa(dense, case, device, timer, gqa, math_bytes)
        add(method, label, times, flops, name, backends=tried)
        del dense
        release(device)

    baseline("sdpa_full", "SDPA full width", [(NUM_KV_HEADS, HEAD_DIM, HEAD_DIM)], full_flops)
    baseline("sdpa_padded", f"SDPA padded to {max(qk_dims)}/{max(v_dims)}",
             [(NUM_KV_HEADS, max(qk_dims), max(v_dims))], fdc_flops)
    buckets = head_buckets(qk_dims, v_dims)
    baseline("sdpa_bucketed", f"SDPA per bucket ({len(buckets)} calls)", buckets, fdc_flops)

    inputs = FdcInputs(case.lengths, case.causal, qk_dims, v_dims, dtype, device)
    for method, label, make in (("fdc_attention", "fdc prefill_attention (plan given)", lambda: inputs.plan()),
                                ("fdc_step", "fdc prefill_plan + prefill_attention", lambda: None)):
        try:
            plan = make()
            times = timer(lambda plan=plan: inputs.attention(plan))
            add(method, label, times, fdc_flops)
        except (RuntimeError, NotImplementedError) as error:  # e.g. a build without the CUDA prefill kernels
            rows.append(Row(case.name, case.causal, dtype_name(dtype), method, label, float("nan"),
                            fdc_flops, float("nan"), None, None, "", {"error": first_line(error)}))
    inputs = None  # released: the timed closures above hold them
    release(device)
    for r in rows:
        r.extra.setdefault("flops_ratio", fdc_flops / full_flops)
    return rows


def targets_for(rows: list[Row], device: torch.device) -> list[dict]:
    """PASS/MISS of every target (bench_common.TARGETS' prefill row for the device), per case and fdc method."""
    goal = phase_targets("prefill", device)
    out = []
    dense: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        if r.method.startswith("sdpa"):
            dense.setdefault((r.case, r.causal, r.dtype), {})[r.method] = r
    for r in rows:
        if not r.method.startswith("fdc") or not math.isfinite(r.micros):
            continue
        base = dense[(r.case, r.causal, r.dtype)]
        where = f"{r.case} {'causal' if r.causal else 'full'} {r.dtype} {r.method}"
        limit = goal.full_ratio_slack * r.extra["flops_ratio"]
        out.append(target(where, f"time <= {goal.full_ratio_slack} x (useful FLOPs fdc/full) x full-width SDPA",
                          r.vs_full, limit, r.vs_full <= limit))
        out += faster_than(where, r.micros, base, goal.faster_than)
    return out


# ------------------------------------------------------------------------------------------------------- reporting


def print_tables(rows: list[Row], targets: list[dict], ablation: list[dict], planning: list[dict]) -> None:
    header = (f"{'case':<14} {'mask':<6} {'dtype':<8} {'method':<14} {'us':>11} {'TFLOP/s':>8} {'% peak':>7} "
              f"{'vs full':>8}  detail")
    print_header(header)
    for r in rows:
        share = cell(r.peak_share, "{:.1f}", scale=100)
        print(f"{r.case:<14} {'causal' if r.causal else 'full':<6} {r.dtype:<8} {r.method:<14} {r.micros:>11.1f} "
              f"{cell(r.tflops, '{:.2f}'):>8} {share:>7} {cell(r.vs_full, '{:.3f}x'):>8}  {detail(r)}")
    print("\ntargets")
    for t in targets:
        print(f"  {t['verdict']:<5} {t['where']:<48} {t['target']} (value {t['value']:.3f}, threshold "
              f"{t['threshold']:.3f})")
    print("\nbalance ablation (half the KV heads 16/16 wide, half 128/128; makespan = largest worker cost, "
          "d_sum x visible keys)")
    for a in ablation:
        print(f"  {a['case']} {'causal' if a['causal'] else 'full'}, {a['workers']} workers, python planner == op: "
              f"{a['python_planner_matches_op']}")
        for policy, p in a["policies"].items():
            error = f" ERROR {p['error']}" if "error" in p else ""
            print(f"    {policy:<22} {p['micros']:11.1f} us ({p['time_vs_lpt']:.2f}x lpt)  makespan "
                  f"{p['makespan']:>14} ({p['makespan_over_ideal']:.3f}x ideal, {p['makespan_vs_lpt']:.2f}x lpt)  "
                  f"{p['records']} records{error}")
    print("\nplanning cost (prefill_plan on the device; first call = shape new to this process)")
    for p in planning:
        if "error" in p:
            print(f"  {p['case']:<22} ERROR {p['error']}")
            continue
        print(f"  {p['case']:<22} {'causal' if p['causal'] else 'full':<6} plan first {p['first_us']:9.1f} us, "
              f"cached {p['cached_us']:8.1f} us ({p['records']} records) | attention with plan "
              f"{p['attention_us']:10.1f} us, plan inside {p['step_us']:10.1f} us | share first "
              f"{100 * p['first_share']:.2f}%, cached {100 * p['cached_share']:.2f}%")


def main(argv: list[str] | None = None) -> int:
    args = bench_parser(__doc__, repeats_help="most timed calls per measurement (median)", topic="gpu",
                        budget=True).parse_args(argv)
    device, repeats = setup(args)
    budget = args.budget if args.budget is not None else (0.05 if args.quick else 0.5)
    timer = Timer(device, repeats, warmup=1 if args.quick else 3, budget=budget)
    peak_n = 512 if args.quick or device.type != "cuda" else 8192
    peak = matmul_peak(device, peak_n, timer)
    gqa = "enable_gqa" if has_enable_gqa(device) else "repeat"
    qk_dims, v_dims = adaptive_dims(DIM_MEAN)

    # Planning cost first, so its first calls meet shapes no earlier call has planned.
    planning_shapes = ([("plan 1 x 300", [300], True), ("plan varlen 5 seqs", [90, 7, 160, 33, 64], True)]
                       if args.quick else
                       [("plan 1 x 32K", [32768 + 17], True), ("plan varlen 64K", mixed_lengths(65536, 3), True),
                        ("plan varlen 16K", mixed_lengths(16384, 4, high=8192), False)])
    planning = plan_cost(planning_shapes, qk_dims, v_dims, torch.bfloat16, device, timer)

    all_cases = cases(args.quick)
    rows: list[Row] = []
    for case in all_cases:
        started = time.perf_counter()
        rows += bench_case(case, qk_dims, v_dims, device, timer, peak, gqa)
        progress(f"{case.name}: {time.perf_counter() - started:.1f} s")
    targets = targets_for(rows, device)
    ablation_shapes = ([("1 x 256", [256], True), ("varlen 3 seqs", [200, 37, 96], False)] if args.quick else
                       [("1 x 16K", [16384], True), ("1 x 4K", [4096], False), ("1 x 4K", [4096], True),
                        ("varlen 32K", mixed_lengths(32768, 5), True)])
    ablation = balance_ablation(ablation_shapes, torch.bfloat16, device, timer)

    name = device_name(device)
    commit, dirty = git_commit()
    print(f"{device_line(name, commit, dirty, device)}; bf16 matmul peak ({peak_n}^3) {peak:.1f} TFLOP/s")
    print(f"{layout_line(qk_dims, v_dims)}; SDPA GQA via {gqa}")
    for c in all_cases:
        if len(c.lengths) > 1:
            print(f"  {c.name}: lengths {c.lengths}")
    print_tables(rows, targets, ablation, planning)

    report = {
        **provenance("prefill", name, device, args.quick), "max_repeats": repeats,
        "budget_s": budget, "matmul_peak_tflops": peak, "matmul_peak_n": peak_n,
        "layout": layout_record(qk_dims, v_dims),
        "cases": [{"name": c.name, "lengths": c.lengths, "causal": c.causal, "dtype": dtype_name(c.dtype)}
                  for c in all_cases],
        "sdpa_gqa": gqa,
        "rows": [asdict(r) for r in rows],
        "targets": targets,
        "balance_ablation": ablation,
        "planning": planning,
    }
    write_report(finite(report), args.out, name, "prefill", args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
