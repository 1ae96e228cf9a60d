"""Decode benchmark: fdc decode_attention over an adaptive compressed KV cache against full-width, padded, bucketed
and Palu-style SDPA decode on the same shapes, in one process; plus the LPT balance ablation, the scheduler's share
of a decode step, and the decode step captured in a CUDA graph.

What is measured (docs/design.md section 6):
- copy bandwidth: one large device-to-device copy_, (bytes read + bytes written) / median time;
- achieved bandwidth of each method: the bytes of cached K/V it must read (fdc: sum over requests and KV heads of
  seqlen * (d_qk + d_v) * element size; q and the output are left out, which understates fdc) / median time, and
  that as a share of the copy bandwidth;
- baselines, each the best over SDPA backends (flash, efficient, cudnn, math; those that exist and accept the
  shapes) and two ways of expressing GQA (enable_gqa=True, or the G query heads of a KV head folded into G query rows
  of one head, which reads each K/V row once; repeat_interleave where enable_gqa does not exist):
    sdpa_full      full-width heads (D = 128), q (B, H, 1, D), K/V (B, H_kv, S, D);
    sdpa_padded    every head padded to the layout's largest qk width (K) and largest v width (V);
    sdpa_bucketed  one SDPA call per bucket of KV heads with equal (d_qk, d_v), each bucket's cache on its own;
    palu_sdpa      Palu-style: keys cached as a per-KV-head pre-RoPE latent of rank d_qk[j]; every step rebuilds
                   K_j = latent_j @ B_j (B_j: (d_qk[j], D)), applies RoPE at each cached position (cos/sin tables),
                   then full-width SDPA. Values stay compressed, B_V folded into the output projection as in Palu
                   and fdc_ops.hf.modules.PaluAttention (no V reconstruction); one SDPA call needs one V width, so V
                   rows are stored at the layout's largest v width.
  Requests of different lengths (the mixed case) are grouped by length, one call per group, for every baseline.
- fdc rows: fdc_attention (decode_attention with a precomputed plan), fdc_step (decode_plan + decode_attention,
  eager: what one layer pays per token), fdc_step_graph (the same two ops captured once in a CUDA graph, replayed);
  contiguous (B, S_max, W) and paged (num_pages, W, page_size) caches, pages in a shuffled order.

Targets, each printed PASS or MISS, from the decode rows of bench_common.TARGETS (the one table of every benchmark's
targets, with the reason for each number) for the device type: on a GPU
- fdc achieves >= 85% of the copy bandwidth (60% on the CPU);
- fdc time <= 1.10 * (compressed bytes / full bytes) * full-width SDPA time (1.25 on the CPU);
- fdc is faster than sdpa_padded, sdpa_bucketed and palu_sdpa;
- decode_plan is at most 2% of a decode step (4% on the CPU).

Balance ablation: a layout with half the KV heads 16 wide and half 128 wide; the LPT plan of fdc_ops.ops.decode_plan
against static plans in the same format and with the same chunks, built here: tasks enumerated head-major
(KV head, request, chunk) and dealt to workers in contiguous blocks or round-robin. Reports the time and the makespan
(largest per-worker cost, sum of (kv_end - kv_start) * (d_qk + d_v + 1) over a worker's records) of each plan.

Scheduler cost: decode_plan alone against the eager decode step (plan + attention), median and P99.

Timing: warm-up, then the median of per-call timings (CUDA events on a GPU, with a 256 MiB buffer written between
calls so no call finds the previous one's K/V in L2; perf_counter on the CPU). Prints tables and writes JSON to
bench/results/gpu/ (or --out) with the device, torch version, commit and every row. --quick runs tiny shapes and works
on the CPU. Needs only torch, numpy and the standard library besides fdc_ops.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

# bench_common first: it puts the repository root on sys.path for fdc_ops.
from bench_common import (
    GROUP,
    HEAD_DIM,
    NUM_KV_HEADS,
    SCALE,
    SdpaSweep,
    Timer,
    ablation_dims,
    adaptive_dims,
    bench_parser,
    cell,
    copy_bandwidth,
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
    p99,
    phase_targets,
    print_header,
    progress,
    provenance,
    randn,
    release,
    sdpa_backends,
    setup,
    target,
    verdict,
    write_report,
)
from fdc_ops import ops
from fdc_ops.apps.provenance import device_name
from fdc_ops.plans import DecodePlan, concat_workers

# Mean of the adaptive widths (bench_common.adaptive_dims): 51, ~40% of D.
DIM_MEAN = 51


@dataclass
class Case:
    name: str
    lengths: list[int]
    dtype: torch.dtype
    caches: list[str]  # "contiguous", "paged16", "paged64"


@dataclass
class Row:
    case: str
    cache: str
    dtype: str
    method: str
    label: str
    micros: float
    p99_micros: float
    bytes_read: int
    gbps: float
    copy_share: float | None
    vs_full: float | None
    backend: str = ""
    extra: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------- layout


def length_groups(lengths: list[int]) -> list[tuple[int, int]]:
    """(length, number of requests) for each distinct non-zero length, longest first."""
    counts: dict[int, int] = {}
    for s in lengths:
        if s:
            counts[s] = counts.get(s, 0) + 1
    return sorted(counts.items(), reverse=True)


# ------------------------------------------------------------------------------------------------------------- SDPA


def gqa_modes(device: torch.device) -> list[str]:
    """How GQA is expressed to SDPA: "fold" (G query heads as G query rows of their KV head: K/V read once) and
    "enable_gqa", or "repeat" (repeat_interleave of K/V) where this torch has no enable_gqa."""
    return ["fold", "enable_gqa" if has_enable_gqa(device) else "repeat"]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str) -> torch.Tensor:
    """Decode attention of q (b, n, G, d_qk) (query heads j*G .. j*G+G-1 of KV head j) against k (b, n, S, d_qk),
    v (b, n, S, d_v)."""
    b, n, g, dq = q.shape
    if mode == "fold":
        return F.scaled_dot_product_attention(q, k, v, scale=SCALE)
    q_heads = q.view(b, n * g, 1, dq)
    if mode == "enable_gqa":
        return F.scaled_dot_product_attention(q_heads, k, v, scale=SCALE, enable_gqa=True)
    return F.scaled_dot_product_attention(q_heads, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), scale=SCALE)


def best_sdpa(make_run, device: torch.device, timer: Timer, modes: list[str]):
    """Times make_run(mode)() under each SDPA backend and GQA mode; returns (times of the best, "backend/mode",
    {"backend/mode": median us or the reason it did not run})."""
    sweep = SdpaSweep(timer)
    for backend in sdpa_backends(device):
        for mode in modes:
            sweep.time(f"{backend.name.lower()}/{mode}", backend, make_run(mode))
    return sweep.result()


def sdpa_dense(groups, dims: list[tuple[int, int, int]], dtype, device):
    """Inputs of one SDPA call per (length group, head bucket): dims lists (heads in bucket, d_qk, d_v)."""
    calls = []
    for length, count in groups:
        for heads, dq, dv in dims:
            calls.append((randn((count, heads, GROUP, dq), dtype, device), randn((count, heads, length, dq), dtype,
                                                                                 device),
                          randn((count, heads, length, dv), dtype, device)))

    def make_run(mode):
        return lambda: [attend(q, k, v, mode) for q, k, v in calls]

    return make_run


def palu_inputs(groups, qk_dims: list[int], v_dims: list[int], dtype, device):
    """Palu-style decode: per length group, the pre-RoPE key latent (b, S, sum r), per-head up-projections
    B_j (r_j, D), values at the largest v width, RoPE tables, and a (H_kv, b, S, D) buffer for rebuilt keys."""
    offsets = ops.prefix_sums(qk_dims).tolist()
    bases = [randn((r, HEAD_DIM), dtype, device) / math.sqrt(r) for r in qk_dims]
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=device, dtype=torch.float32) / HEAD_DIM))
    groups_data = []
    for length, count in groups:
        angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)  # (S, D), Llama's rotate_half convention
        groups_data.append(dict(
            q=randn((count, NUM_KV_HEADS, GROUP, HEAD_DIM), dtype, device),
            latent=randn((count, length, offsets[-1]), dtype, device),
            v=randn((count, NUM_KV_HEADS, length, max(v_dims)), dtype, device),
            cos=angles.cos().to(dtype), sin=angles.sin().to(dtype),
            keys=torch.empty((NUM_KV_HEADS, count, length, HEAD_DIM), dtype=dtype, device=device)))

    def rebuild(g):
        for j in range(NUM_KV_HEADS):  # K_j = latent_j @ B_j, one GEMM per KV head
            torch.matmul(g["latent"][:, :, offsets[j]:offsets[j + 1]], bases[j], out=g["keys"][j])
        k = g["keys"].transpose(0, 1)  # (b, H_kv, S, D)
        half = HEAD_DIM // 2
        rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
        return k * g["cos"] + rotated * g["sin"]

    def make_run(mode):
        return lambda: [attend(g["q"], rebuild(g), g["v"], mode) for g in groups_data]

    return make_run


# -------------------------------------------------------------------------------------------------------------- fdc


class FdcInputs:
    """q, caches (contiguous or paged, shuffled pages), cache_seqlens of one case on the device."""

    def __init__(self, lengths: list[int], qk_dims, v_dims, dtype, device, cache: str, seed: int = 0):
        self.qk_offsets, self.v_offsets = ops.prefix_sums(qk_dims), ops.prefix_sums(v_dims)
        wq, wv, batch = sum(qk_dims), sum(v_dims), len(lengths)
        self.seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.q = randn((batch, GROUP * wq), dtype, device)
        self.block_table = None
        if cache == "contiguous":
            s_max = max(max(lengths), 1)
            self.k = randn((batch, s_max, wq), dtype, device)
            self.v = randn((batch, s_max, wv), dtype, device)
        else:
            page = int(cache.removeprefix("paged"))
            pages = [-(-s // page) for s in lengths]
            num_pages = max(sum(pages), 1)
            order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
            table = torch.full((batch, max(max(pages), 1)), -1, dtype=torch.int32)
            taken = 0
            for b, n in enumerate(pages):
                table[b, :n] = order[taken:taken + n]
                taken += n
            self.block_table = table.to(device)
            self.k = randn((num_pages, wq, page), dtype, device)
            self.v = randn((num_pages, wv, page), dtype, device)

    def plan(self, num_workers: int | None = None) -> torch.Tensor:
        return ops.decode_plan(self.seqlens, self.qk_offsets, self.v_offsets, GROUP, num_workers)

    def attention(self, plan: torch.Tensor | None) -> torch.Tensor:
        return ops.decode_attention(self.q, self.k, self.v, self.seqlens, self.qk_offsets, self.v_offsets, GROUP,
                                    SCALE, plan, self.block_table)

    def step(self) -> torch.Tensor:
        return self.attention(self.plan())


def capture_step(inputs: FdcInputs, device: torch.device):
    """decode_plan + decode_attention captured once in a CUDA graph: (graph, its static output)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            inputs.step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = inputs.step()
    return graph, out


# --------------------------------------------------------------------------------------------------- decode plans

def makespan(plan: torch.Tensor, qk_dims: list[int], v_dims: list[int]) -> tuple[int, float]:
    """(largest per-worker cost, that over the ideal total / N); cost of a record = keys * (d_qk + d_v + 1)."""
    decoded = DecodePlan.from_tensor(plan)
    loads = decoded.worker_loads(qk_dims, v_dims)
    ideal = max(sum(loads) / decoded.num_workers, 1)
    return max(loads), max(loads) / ideal


def static_plan(lpt: torch.Tensor, policy: str) -> torch.Tensor:
    """A "no balancing" plan with the LPT plan's chunks: tasks in head-major order (KV head j, request b, chunk c),
    given to workers in contiguous blocks of equal task counts ("blocks") or one by one in turn ("round_robin")."""
    plan = DecodePlan.from_tensor(lpt)
    hkv, workers = plan.num_kv_heads, plan.num_workers
    records = sorted(plan.records, key=lambda r: (r[0] % hkv, r[0] // hkv, r[1]))
    n = len(records)
    if policy == "blocks":
        owner = [min(workers - 1, i * workers // max(n, 1)) for i in range(n)]
    elif policy == "round_robin":
        owner = [i % workers for i in range(n)]
    else:
        raise ValueError(f"static_plan: unknown policy {policy!r}")
    per_worker: list[list[tuple]] = [[] for _ in range(workers)]
    for record, w in zip(records, owner):
        per_worker[w].append(record)
    return DecodePlan(plan.batch, hkv, workers, plan.group, plan.split_offsets,
                      *concat_workers(per_worker)).to_tensor(lpt.device)


# ------------------------------------------------------------------------------------------------------------ cases


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("B=2 x 512", [512] * 2, torch.bfloat16, ["contiguous", "paged16"]),
                Case("mixed 1x1K + 3x64", [1024] + [64] * 3, torch.float16, ["paged16"])]
    return [Case("B=32 x 8K", [8192] * 32, torch.bfloat16, ["contiguous", "paged16", "paged64"]),
            Case("B=32 x 8K fp16", [8192] * 32, torch.float16, ["contiguous"]),
            Case("B=1 x 32K", [32768], torch.bfloat16, ["contiguous", "paged64"]),
            Case("B=8 x 16K", [16384] * 8, torch.bfloat16, ["contiguous", "paged64"]),
            Case("mixed 1x64K + 31x1K", [65536] + [1024] * 31, torch.bfloat16, ["contiguous", "paged64"])]


def bench_case(case: Case, qk_dims, v_dims, device, timer: Timer, copy_gbps: float, modes) -> list[Row]:
    dtype, size = case.dtype, case.dtype.itemsize
    tokens = sum(case.lengths)
    groups = length_groups(case.lengths)
    compressed = tokens * (sum(qk_dims) + sum(v_dims)) * size
    full_bytes = tokens * 2 * NUM_KV_HEADS * HEAD_DIM * size
    padded_bytes = tokens * NUM_KV_HEADS * (max(qk_dims) + max(v_dims)) * size
    palu_bytes = tokens * (sum(qk_dims) + NUM_KV_HEADS * max(v_dims)) * size
    rows: list[Row] = []
    full_time: float | None = None

    def add(cache, method, label, times, bytes_read, backend="", **extra):
        nonlocal full_time
        seconds = median(times)
        if method == "sdpa_full":
            full_time = seconds
        gbps = bytes_read / seconds / 1e9
        rows.append(Row(case.name, cache, dtype_name(dtype), method, label, seconds * 1e6,
                        p99(times) * 1e6, bytes_read, gbps, gbps / copy_gbps if copy_gbps else None,
                        seconds / full_time if full_time else None, backend, extra))

    def baseline(method, label, make_run, bytes_read):
        times, name, tried = best_sdpa(make_run, device, timer, modes)
        add("dense", method, label, times, bytes_read, name, backends=tried)

    baseline("sdpa_full", "SDPA full width", sdpa_dense(groups, [(NUM_KV_HEADS, HEAD_DIM, HEAD_DIM)], dtype, device),
             full_bytes)
    release(device)
    baseline("sdpa_padded", f"SDPA padded to {max(qk_dims)}/{max(v_dims)}",
             sdpa_dense(groups, [(NUM_KV_HEADS, max(qk_dims), max(v_dims))], dtype, device), padded_bytes)
    release(device)
    buckets = head_buckets(qk_dims, v_dims)
    baseline("sdpa_bucketed", f"SDPA per bucket ({len(buckets)} calls)", sdpa_dense(groups, buckets, dtype, device),
             compressed)
    release(device)
    baseline("palu_sdpa", "Palu rebuild K + RoPE + SDPA", palu_inputs(groups, qk_dims, v_dims, dtype, device),
             palu_bytes)
    release(device)

    for cache in case.caches:
        inputs = FdcInputs(case.lengths, qk_dims, v_dims, dtype, device, cache)
        plan = inputs.plan()
        add(cache, "fdc_attention", "fdc decode_attention (plan given)",
            timer(lambda inputs=inputs, plan=plan: inputs.attention(plan)), compressed)
        add(cache, "fdc_step", "fdc decode_plan + decode_attention", timer(inputs.step), compressed)
        if device.type == "cuda":
            try:
                graph, graph_out = capture_step(inputs, device)
                times = timer(graph.replay)
                graph.replay()
                eager = inputs.step()
                diff = float((graph_out.float() - eager.float()).abs().max())
                add(cache, "fdc_step_graph", "fdc plan + attention, CUDA graph replay", times, compressed,
                    max_abs_diff_vs_eager=diff)
                del graph, graph_out
            except RuntimeError as error:
                rows.append(Row(case.name, cache, dtype_name(dtype), "fdc_step_graph",
                                "fdc plan + attention, CUDA graph replay", float("nan"), float("nan"), compressed,
                                float("nan"), None, None, "", {"error": first_line(error)}))
        inputs = plan = None  # released: the timed closures above hold them
        release(device)
    for r in rows:
        r.extra.setdefault("width_ratio", compressed / full_bytes)
    return rows


def targets_for(rows: list[Row], device: torch.device) -> list[dict]:
    """PASS/MISS of every target (bench_common.TARGETS' decode row for the device), per case, cache and fdc method."""
    goal = phase_targets("decode", device)
    out = []
    by_case: dict[str, dict[str, Row]] = {}
    for r in rows:
        if r.cache == "dense":
            by_case.setdefault(r.case, {})[r.method] = r
    for r in rows:
        if not r.method.startswith("fdc") or not math.isfinite(r.micros):
            continue
        base = by_case[r.case]
        where = f"{r.case} {r.cache} {r.method}"
        out.append(target(where, f"achieved bandwidth >= {goal.copy_share:.0%} of copy", r.copy_share,
                          goal.copy_share, r.copy_share >= goal.copy_share))
        limit = goal.full_ratio_slack * r.extra["width_ratio"]
        out.append(target(where, f"time <= {goal.full_ratio_slack} x (compressed/full bytes) x full-width SDPA",
                          r.vs_full, limit, r.vs_full <= limit))
        out += faster_than(where, r.micros, base, goal.faster_than)
    return out


# ---------------------------------------------------------------------------------------------- ablation, scheduler


def balance_ablation(lengths_list, dtype, device, timer: Timer) -> list[dict]:
    """LPT against static head-major plans on a half-16 / half-128 layout, same chunks, same worker count."""
    qk_dims, v_dims = ablation_dims()
    workers = num_workers_for(device)
    out = []
    for name, lengths in lengths_list:
        inputs = FdcInputs(lengths, qk_dims, v_dims, dtype, device, "contiguous")
        lpt = inputs.plan(workers)
        plans = {"lpt": lpt, "static_blocks": static_plan(lpt, "blocks"),
                 "static_round_robin": static_plan(lpt, "round_robin")}
        results = {}
        for policy, plan in plans.items():
            span, over_ideal = makespan(plan, qk_dims, v_dims)
            try:
                seconds = median(timer(lambda inputs=inputs, plan=plan: inputs.attention(plan)))
            except RuntimeError as error:
                seconds, span_error = float("nan"), first_line(error)
                results[policy] = dict(micros=seconds, makespan=span, makespan_over_ideal=over_ideal,
                                       error=span_error)
                continue
            results[policy] = dict(micros=seconds * 1e6, makespan=span, makespan_over_ideal=over_ideal)
        for policy in ("static_blocks", "static_round_robin"):
            out.append(dict(case=name, dtype=dtype_name(dtype), qk_dims=qk_dims, v_dims=v_dims,
                            workers=workers, baseline=policy, lpt=results["lpt"], static=results[policy],
                            time_gain=results[policy]["micros"] / results["lpt"]["micros"],
                            makespan_gain=results[policy]["makespan"] / max(results["lpt"]["makespan"], 1)))
        inputs = None  # released: the timed closures above hold them
        release(device)
    return out


def workers_sweep(case: Case, qk_dims, v_dims, device, timer: Timer, copy_gbps: float) -> list[dict]:
    """decode_attention on the first case's first cache with plans for 1, 2, 4 and 8 workers per SM (per thread on
    the CPU, 1 and 2): one CUDA block per worker, so more workers put more blocks, and more K/V bytes in flight, on
    each SM (the first H200 run read 15% of the copy bandwidth at one worker per SM)."""
    inputs = FdcInputs(case.lengths, qk_dims, v_dims, case.dtype, device, case.caches[0])
    base = num_workers_for(device)
    compressed = sum(case.lengths) * (sum(qk_dims) + sum(v_dims)) * case.dtype.itemsize
    out = []
    for per_unit in ((1, 2, 4, 8) if device.type == "cuda" else (1, 2)):
        plan = inputs.plan(base * per_unit)
        seconds = median(timer(lambda plan=plan: inputs.attention(plan)))
        gbps = compressed / seconds / 1e9
        out.append(dict(case=case.name, cache=case.caches[0], workers=base * per_unit, per_unit=per_unit,
                        unit="SM" if device.type == "cuda" else "thread",
                        micros=seconds * 1e6, gbps=gbps, copy_share=gbps / copy_gbps if copy_gbps else None))
    inputs = plan = None  # released: the timed closures above hold them
    release(device)
    return out


def scheduler_cost(case: Case, qk_dims, v_dims, device, timer: Timer, repeats: int) -> dict:
    inputs = FdcInputs(case.lengths, qk_dims, v_dims, case.dtype, device, case.caches[0])
    plan_times = timer(inputs.plan, repeats=repeats)
    step_times = timer(inputs.step, repeats=repeats)
    out = dict(case=case.name, cache=case.caches[0], repeats=repeats,
               plan_us=median(plan_times) * 1e6, plan_p99_us=p99(plan_times) * 1e6,
               step_us=median(step_times) * 1e6, step_p99_us=p99(step_times) * 1e6)
    out["share"] = out["plan_us"] / out["step_us"]
    out["p99_share"] = out["plan_p99_us"] / out["step_p99_us"]
    out["threshold"] = phase_targets("decode", device).scheduler_share
    out["verdict"] = verdict(out["share"] <= out["threshold"])
    inputs = None  # released: the timed closures above hold them
    release(device)
    return out


# ------------------------------------------------------------------------------------------------------- reporting


def print_tables(rows: list[Row], targets: list[dict], ablation: list[dict], sweep: list[dict],
                 scheduler: dict) -> None:
    header = (f"{'case':<22} {'cache':<10} {'dtype':<8} {'method':<15} {'us':>10} {'p99 us':>10} {'GB/s':>9} "
              f"{'% copy':>7} {'vs full':>8}  detail")
    print_header(header)
    for r in rows:
        share = cell(r.copy_share, "{:.1f}", scale=100)
        print(f"{r.case:<22} {r.cache:<10} {r.dtype:<8} {r.method:<15} {r.micros:>10.1f} {r.p99_micros:>10.1f} "
              f"{r.gbps:>9.1f} {share:>7} {cell(r.vs_full, '{:.3f}x'):>8}  {detail(r)}")
    print("\ntargets")
    for t in targets:
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        print(f"  {t['verdict']:<10} {t['where']:<52} {t['target']} (value {value}, threshold {t['threshold']:.3f})")
    print("\nbalance ablation (half the KV heads 16 wide, half 128; same chunks and workers)")
    for a in ablation:
        print(f"  {a['case']:<22} LPT {a['lpt']['micros']:9.1f} us makespan {a['lpt']['makespan']:>10} "
              f"({a['lpt']['makespan_over_ideal']:.2f}x ideal) | {a['baseline']:<18} {a['static']['micros']:9.1f} us "
              f"makespan {a['static']['makespan']:>10} ({a['static']['makespan_over_ideal']:.2f}x ideal) | "
              f"gain {a['time_gain']:.2f}x time, {a['makespan_gain']:.2f}x makespan")
    print(f"\nworkers per {sweep[0]['unit']} (decode_attention, {sweep[0]['case']}, {sweep[0]['cache']})")
    for w in sweep:
        share = cell(w["copy_share"], "{:.1f}", scale=100)
        print(f"  {w['per_unit']} per {w['unit']} ({w['workers']:>5} workers) {w['micros']:10.1f} us "
              f"{w['gbps']:9.1f} GB/s {share:>6}% of copy")
    s = scheduler
    print(f"\nscheduler cost ({s['case']}, {s['cache']}): decode_plan {s['plan_us']:.1f} us "
          f"(P99 {s['plan_p99_us']:.1f}), plan + attention {s['step_us']:.1f} us (P99 {s['step_p99_us']:.1f}); "
          f"share {100 * s['share']:.2f}% (P99 {100 * s['p99_share']:.2f}%), target <= {100 * s['threshold']:.0f}% "
          f"-> {s['verdict']}")


def main(argv: list[str] | None = None) -> int:
    args = bench_parser(__doc__, repeats_help="timed calls per measurement (median)", topic="gpu").parse_args(argv)
    device, repeats = setup(args)
    timer = Timer(device, repeats, warmup=1 if args.quick else 5)
    copy_gbps = copy_bandwidth(device, 64 if args.quick else 1024, timer)
    modes = gqa_modes(device)
    qk_dims, v_dims = adaptive_dims(DIM_MEAN)

    all_cases = cases(args.quick)
    rows: list[Row] = []
    for case in all_cases:
        started = time.perf_counter()
        rows += bench_case(case, qk_dims, v_dims, device, timer, copy_gbps, modes)
        progress(f"{case.name}: {time.perf_counter() - started:.1f} s")
    targets = targets_for(rows, device)
    ablation_shapes = ([("B=2 x 512", [512] * 2), ("mixed 1x1K + 3x64", [1024] + [64] * 3)] if args.quick else
                       [("B=32 x 8K", [8192] * 32), ("mixed 1x64K + 31x1K", [65536] + [1024] * 31)])
    ablation = balance_ablation(ablation_shapes, torch.bfloat16, device, timer)
    sweep = workers_sweep(all_cases[0], qk_dims, v_dims, device, timer, copy_gbps)
    scheduler = scheduler_cost(all_cases[0], qk_dims, v_dims, device, timer,
                               repeats=20 if args.quick else 500)

    name = device_name(device)
    commit, dirty = git_commit()
    print(f"{device_line(name, commit, dirty, device)}; copy bandwidth {copy_gbps:.1f} GB/s")
    print(f"{layout_line(qk_dims, v_dims)}; SDPA GQA modes {modes}")
    print_tables(rows, targets, ablation, sweep, scheduler)

    report = {
        **provenance("decode", name, device, args.quick), "repeats": repeats,
        "copy_bandwidth_gbps": copy_gbps,
        "layout": layout_record(qk_dims, v_dims),
        "cases": [{"name": c.name, "lengths": c.lengths, "dtype": dtype_name(c.dtype), "caches": c.caches}
                  for c in all_cases],
        "sdpa_gqa_modes": modes,
        "rows": [asdict(r) for r in rows],
        "targets": targets,
        "balance_ablation": ablation,
        "workers_sweep": sweep,
        "scheduler": scheduler,
    }
    write_report(finite(report), args.out, name, "decode", args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
