"""Decode benchmark: fdc decode_attention over an adaptive compressed KV cache against full-width, padded, bucketed
and Palu-style SDPA decode on the same shapes, in one process; plus the LPT balance ablation, the scheduler's share
of a decode step, and the decode step captured in a CUDA graph.

What is measured (DESIGN.md section 6):
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
                   then full-width SDPA. Values stay compressed, B_V folded into the output projection as in Palu and
                   fdc_ops.nn.PaluAttention (no V reconstruction); one SDPA call needs one V width, so V rows are
                   stored at the layout's largest v width.
  Requests of different lengths (the mixed case) are grouped by length, one call per group, for every baseline.
- fdc rows: fdc_attention (decode_attention with a precomputed plan), fdc_step (decode_plan + decode_attention,
  eager: what one layer pays per token), fdc_step_graph (the same two ops captured once in a CUDA graph, replayed);
  contiguous (B, S_max, W) and paged (num_pages, W, page_size) caches, pages in a shuffled order.

Targets, each printed PASS or MISS (CPU runs report n/a for the bandwidth target):
- fdc achieves >= 80% of the copy bandwidth;
- fdc time <= 1.15 * (compressed bytes / full bytes) * full-width SDPA time;
- fdc is faster than sdpa_padded, sdpa_bucketed and palu_sdpa.

Balance ablation: a layout with half the KV heads 16 wide and half 128 wide; the LPT plan of fdc_ops.ops.decode_plan
against static plans in the same format and with the same chunks, built here: tasks enumerated head-major
(KV head, request, chunk) and dealt to workers in contiguous blocks or round-robin. Reports the time and the makespan
(largest per-worker cost, sum of (kv_end - kv_start) * (d_qk + d_v + 1) over a worker's records) of each plan.

Scheduler cost: decode_plan alone against the eager decode step (plan + attention), median and P99.

Timing: warm-up, then the median of per-call timings (CUDA events on a GPU, with a 256 MiB buffer written between
calls so no call finds the previous one's K/V in L2; perf_counter on the CPU). Prints tables and writes JSON to
bench/results/ (or --out) with the device, torch version, commit and every row. --quick runs tiny shapes and works on
the CPU (no bandwidth target there). Needs only torch, numpy and the standard library besides fdc_ops.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from fdc_ops import ops  # noqa: E402
from fdc_ops.provenance import device_name, git_commit  # noqa: E402

# Llama-3-8B-like attention: 32 query heads, 8 KV heads of 128.
NUM_KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128
SCALE = HEAD_DIM ** -0.5  # FDC keeps the original head dim's scale
# Adaptive widths: multiples of 8 in 16..128, skewed towards small (most heads compress well, a few barely), mean 51
# (~40% of D), drawn once from a fixed seed so runs compare.
DIM_LOW, DIM_HIGH, DIM_MEAN, LAYOUT_SEED = 16, 128, 51, 0
# Targets of the issue.
COPY_SHARE_TARGET = 0.80
FULL_RATIO_SLACK = 1.15
# Written between timed calls on a GPU: larger than any L2 (H100 50 MiB, H200 60 MiB) many times over.
FLUSH_BYTES = 256 * 2**20
BACKEND_NAMES = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
CPU_BACKEND_NAMES = ("FLASH_ATTENTION", "MATH")  # efficient and cudnn attention do not exist on the CPU


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


# ----------------------------------------------------------------------------------------------------------- timing


class Timer:
    """Per-call timings of a callable: CUDA events (L2 flushed before each call) or perf_counter."""

    def __init__(self, device: torch.device, repeats: int, warmup: int):
        self.device, self.repeats, self.warmup = device, repeats, warmup
        self.flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device=device) \
            if device.type == "cuda" else None

    def __call__(self, fn, repeats: int | None = None, flush: bool = True) -> list[float]:
        """Seconds of each of `repeats` calls of fn(), after warm-up."""
        repeats = repeats or self.repeats
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(repeats):
                begin = time.perf_counter()
                fn()
                times.append(time.perf_counter() - begin)
            return times
        torch.cuda.synchronize(self.device)
        events = []
        for _ in range(repeats):
            if flush:
                self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) / 1e3 for s, e in events]


def median(times: list[float]) -> float:
    return statistics.median(times)


def p99(times: list[float]) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def copy_bandwidth(device: torch.device, megabytes: int, timer: Timer) -> float:
    """GB/s of a large device-to-device copy_, counting bytes read and written."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median(timer(lambda: dst.copy_(src), flush=False))
    del src, dst
    return 2 * megabytes * 2**20 / seconds / 1e9


# ----------------------------------------------------------------------------------------------------------- layout


def adaptive_dims(seed: int = LAYOUT_SEED) -> tuple[list[int], list[int]]:
    """Per-KV-head qk and v widths: multiples of 8 in [DIM_LOW, DIM_HIGH], skewed (Beta(1, 2.2): many narrow heads, a
    tail of wide ones), then nudged 8 at a time (seeded) until they average DIM_MEAN."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        x = rng.beta(1.0, 2.2, size=NUM_KV_HEADS)
        dims = DIM_LOW + np.round(x * (DIM_HIGH - DIM_LOW) / 8).astype(int) * 8
        target = int(round(DIM_MEAN * NUM_KV_HEADS / 8)) * 8
        while int(dims.sum()) != target:
            j = int(rng.integers(NUM_KV_HEADS))
            if dims.sum() < target and dims[j] < DIM_HIGH:
                dims[j] += 8
            elif dims.sum() > target and dims[j] > DIM_LOW:
                dims[j] -= 8
        out.append([int(d) for d in dims])
    return out[0], out[1]


def prefix(dims: list[int]) -> torch.Tensor:
    """int32 CPU prefix sums [0, d0, d0 + d1, ...]."""
    return torch.tensor(np.concatenate([[0], np.cumsum(dims)]).tolist(), dtype=torch.int32)


def num_workers_for(device: torch.device) -> int:
    """The backend's default worker count: SMs on a GPU, intra-op threads on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return torch.get_num_threads()


def length_groups(lengths: list[int]) -> list[tuple[int, int]]:
    """(length, number of requests) for each distinct non-zero length, longest first."""
    counts: dict[int, int] = {}
    for s in lengths:
        if s:
            counts[s] = counts.get(s, 0) + 1
    return sorted(counts.items(), reverse=True)


# ------------------------------------------------------------------------------------------------------------- SDPA


def _gqa_modes(device: torch.device) -> list[str]:
    """How GQA is expressed to SDPA: "fold" (G query heads as G query rows of their KV head: K/V read once) and
    "enable_gqa", or "repeat" (repeat_interleave of K/V) where this torch has no enable_gqa."""
    q = torch.zeros(1, 2, 1, 8, device=device)
    kv = torch.zeros(1, 1, 4, 8, device=device)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return ["fold", "enable_gqa"]
    except (TypeError, RuntimeError):
        return ["fold", "repeat"]


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


def sdpa_backends(device: torch.device) -> list:
    from torch.nn.attention import SDPBackend
    names = BACKEND_NAMES if device.type == "cuda" else CPU_BACKEND_NAMES
    return [getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)]


def best_sdpa(make_run, device: torch.device, timer: Timer, modes: list[str]):
    """Times make_run(mode)() under each SDPA backend and GQA mode; returns (times of the best, "backend/mode",
    {"backend/mode": median us or the reason it did not run})."""
    from torch.nn.attention import sdpa_kernel
    best, best_name, tried = None, "", {}
    for backend in sdpa_backends(device):
        for mode in modes:
            name = f"{backend.name.lower()}/{mode}"
            run = make_run(mode)
            try:
                with sdpa_kernel([backend]), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    times = timer(run)
            except (RuntimeError, NotImplementedError, ValueError) as error:  # backend refuses these shapes/dtype
                tried[name] = f"unavailable: {str(error).splitlines()[0][:120]}"
                continue
            tried[name] = round(median(times) * 1e6, 2)
            if best is None or median(times) < median(best):
                best, best_name = times, name
    if best is None:
        raise RuntimeError(f"no SDPA backend ran: {tried}")
    return best, best_name, tried


def randn(shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=device)


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
    offsets = prefix(qk_dims).tolist()
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
        self.qk_offsets, self.v_offsets = prefix(qk_dims), prefix(v_dims)
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

HEADER = 8  # include/fdc/decode_plan.h: kDecodeHeader
FIELDS = 4  # kDecodeRecordFields


def plan_parts(plan: torch.Tensor):
    """(header, split_offsets, worker_offsets, records[num_tasks, 4]) of a decode plan (include/fdc/decode_plan.h)."""
    p = plan.cpu().numpy().astype(np.int64)
    batch, hkv, workers, tasks = int(p[1]), int(p[2]), int(p[3]), int(p[5])
    split = p[HEADER:HEADER + batch * hkv + 1]
    worker = p[HEADER + batch * hkv + 1:HEADER + batch * hkv + workers + 2]
    records = p[HEADER + batch * hkv + workers + 2:].reshape(-1, FIELDS)[:tasks]
    return p[:HEADER], split, worker, records


def makespan(plan: torch.Tensor, qk_dims: list[int], v_dims: list[int]) -> tuple[int, float]:
    """(largest per-worker cost, that over the ideal total / N); cost of a record = keys * (d_qk + d_v + 1)."""
    header, _, worker, records = plan_parts(plan)
    hkv, workers = int(header[2]), int(header[3])
    d_sum = np.array(qk_dims) + np.array(v_dims) + 1
    cost = (records[:, 3] - records[:, 2]) * d_sum[records[:, 0] % hkv]
    loads = np.array([cost[worker[w]:worker[w + 1]].sum() for w in range(workers)])
    ideal = max(cost.sum() / workers, 1)
    return int(loads.max()), float(loads.max() / ideal)


def static_plan(lpt: torch.Tensor, policy: str) -> torch.Tensor:
    """A "no balancing" plan with the LPT plan's chunks: tasks in head-major order (KV head j, request b, chunk c),
    given to workers in contiguous blocks of equal task counts ("blocks") or one by one in turn ("round_robin")."""
    header, split, _, records = plan_parts(lpt)
    batch, hkv, workers, capacity = (int(x) for x in header[1:5])
    order = sorted(range(len(records)), key=lambda r: (records[r][0] % hkv, records[r][0] // hkv, records[r][1]))
    n = len(order)
    if policy == "blocks":
        owner = [min(workers - 1, i * workers // max(n, 1)) for i in range(n)]
    elif policy == "round_robin":
        owner = [i % workers for i in range(n)]
    else:
        raise ValueError(f"static_plan: unknown policy {policy!r}")
    per_worker: list[list[int]] = [[] for _ in range(workers)]
    for i, r in enumerate(order):
        per_worker[owner[i]].append(r)
    worker_offsets = np.zeros(workers + 1, dtype=np.int64)
    body = []
    for w in range(workers):
        worker_offsets[w + 1] = worker_offsets[w] + len(per_worker[w])
        body += [records[r] for r in per_worker[w]]
    rec = np.full((capacity, FIELDS), -1, dtype=np.int64)
    if body:
        rec[:n] = np.stack(body)
    out = np.concatenate([header, split, worker_offsets, rec.reshape(-1)]).astype(np.int32)
    out[7] = 0
    return torch.from_numpy(out).to(lpt.device)


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
        rows.append(Row(case.name, cache, str(dtype).removeprefix("torch."), method, label, seconds * 1e6,
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
    buckets: dict[tuple[int, int], int] = {}
    for dq, dv in zip(qk_dims, v_dims):
        buckets[(dq, dv)] = buckets.get((dq, dv), 0) + 1
    baseline("sdpa_bucketed", f"SDPA per bucket ({len(buckets)} calls)",
             sdpa_dense(groups, [(n, dq, dv) for (dq, dv), n in buckets.items()], dtype, device), compressed)
    release(device)
    baseline("palu_sdpa", "Palu rebuild K + RoPE + SDPA", palu_inputs(groups, qk_dims, v_dims, dtype, device),
             palu_bytes)
    release(device)

    for cache in case.caches:
        inputs = FdcInputs(case.lengths, qk_dims, v_dims, dtype, device, cache)
        plan = inputs.plan()
        add(cache, "fdc_attention", "fdc decode_attention (plan given)", timer(lambda: inputs.attention(plan)),
            compressed)
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
                rows.append(Row(case.name, cache, str(dtype).removeprefix("torch."), "fdc_step_graph",
                                "fdc plan + attention, CUDA graph replay", float("nan"), float("nan"), compressed,
                                float("nan"), None, None, "", {"error": str(error).splitlines()[0][:200]}))
        del inputs, plan
        release(device)
    for r in rows:
        r.extra.setdefault("width_ratio", compressed / full_bytes)
    return rows


def release(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def targets_for(rows: list[Row], device: torch.device) -> list[dict]:
    """PASS/MISS of every target, per case, cache and fdc method."""
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
        if device.type == "cuda":
            out.append(target(where, f"achieved bandwidth >= {COPY_SHARE_TARGET:.0%} of copy", r.copy_share,
                              COPY_SHARE_TARGET, r.copy_share >= COPY_SHARE_TARGET))
        else:
            out.append(dict(where=where, target=f"achieved bandwidth >= {COPY_SHARE_TARGET:.0%} of copy",
                            value=r.copy_share, threshold=COPY_SHARE_TARGET, verdict="n/a (cpu)"))
        limit = FULL_RATIO_SLACK * r.extra["width_ratio"]
        out.append(target(where, f"time <= {FULL_RATIO_SLACK} x (compressed/full bytes) x full-width SDPA",
                          r.vs_full, limit, r.vs_full <= limit))
        for method in ("sdpa_padded", "sdpa_bucketed", "palu_sdpa"):
            ratio = r.micros / base[method].micros
            out.append(target(where, f"faster than {method}", ratio, 1.0, ratio < 1.0))
    return out


def target(where, what, value, threshold, ok) -> dict:
    return dict(where=where, target=what, value=value, threshold=threshold, verdict="PASS" if ok else "MISS")


# ---------------------------------------------------------------------------------------------- ablation, scheduler


def balance_ablation(lengths_list, dtype, device, timer: Timer) -> list[dict]:
    """LPT against static head-major plans on a half-16 / half-128 layout, same chunks, same worker count."""
    qk_dims = [16] * (NUM_KV_HEADS // 2) + [128] * (NUM_KV_HEADS - NUM_KV_HEADS // 2)
    v_dims = list(qk_dims)
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
                seconds = median(timer(lambda: inputs.attention(plan)))
            except RuntimeError as error:
                seconds, span_error = float("nan"), str(error).splitlines()[0][:200]
                results[policy] = dict(micros=seconds, makespan=span, makespan_over_ideal=over_ideal,
                                       error=span_error)
                continue
            results[policy] = dict(micros=seconds * 1e6, makespan=span, makespan_over_ideal=over_ideal)
        for policy in ("static_blocks", "static_round_robin"):
            out.append(dict(case=name, dtype=str(dtype).removeprefix("torch."), qk_dims=qk_dims, v_dims=v_dims,
                            workers=workers, baseline=policy, lpt=results["lpt"], static=results[policy],
                            time_gain=results[policy]["micros"] / results["lpt"]["micros"],
                            makespan_gain=results[policy]["makespan"] / max(results["lpt"]["makespan"], 1)))
        del inputs
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
    out["verdict"] = "PASS" if out["share"] <= 0.04 else "MISS"
    del inputs
    release(device)
    return out


# ------------------------------------------------------------------------------------------------------- reporting


def print_tables(rows: list[Row], targets: list[dict], ablation: list[dict], scheduler: dict) -> None:
    header = (f"{'case':<22} {'cache':<10} {'dtype':<8} {'method':<15} {'us':>10} {'p99 us':>10} {'GB/s':>9} "
              f"{'% copy':>7} {'vs full':>8}  detail")
    print(header)
    print("-" * len(header))
    for r in rows:
        share = f"{100 * r.copy_share:.1f}" if r.copy_share is not None and math.isfinite(r.copy_share) else "-"
        vs = f"{r.vs_full:.3f}x" if r.vs_full is not None and math.isfinite(r.vs_full) else "-"
        detail = r.label + (f" [{r.backend}]" if r.backend else "")
        if "error" in r.extra:
            detail += f" ERROR {r.extra['error']}"
        print(f"{r.case:<22} {r.cache:<10} {r.dtype:<8} {r.method:<15} {r.micros:>10.1f} {r.p99_micros:>10.1f} "
              f"{r.gbps:>9.1f} {share:>7} {vs:>8}  {detail}")
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
    s = scheduler
    print(f"\nscheduler cost ({s['case']}, {s['cache']}): decode_plan {s['plan_us']:.1f} us (P99 {s['plan_p99_us']:.1f})"
          f", plan + attention {s['step_us']:.1f} us (P99 {s['step_p99_us']:.1f}); share {100 * s['share']:.2f}% "
          f"(P99 {100 * s['p99_share']:.2f}%), paper: under ~4% -> {s['verdict']}")


def finite(value):
    """value with every NaN/inf float replaced by None, so the JSON is standard."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, seconds; runs on the CPU too")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="folder for the JSON")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (median)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    repeats = args.repeats or (3 if args.quick else (50 if device.type == "cuda" else 5))
    timer = Timer(device, repeats, warmup=1 if args.quick else 5)
    copy_gbps = copy_bandwidth(device, 64 if args.quick else 1024, timer)
    modes = _gqa_modes(device)
    qk_dims, v_dims = adaptive_dims()
    width_ratio = (sum(qk_dims) + sum(v_dims)) / (2 * NUM_KV_HEADS * HEAD_DIM)

    all_cases = cases(args.quick)
    rows: list[Row] = []
    for case in all_cases:
        rows += bench_case(case, qk_dims, v_dims, device, timer, copy_gbps, modes)
    targets = targets_for(rows, device)
    ablation_shapes = ([("B=2 x 512", [512] * 2), ("mixed 1x1K + 3x64", [1024] + [64] * 3)] if args.quick else
                       [("B=32 x 8K", [8192] * 32), ("mixed 1x64K + 31x1K", [65536] + [1024] * 31)])
    ablation = balance_ablation(ablation_shapes, torch.bfloat16, device, timer)
    scheduler = scheduler_cost(all_cases[0], qk_dims, v_dims, device, timer,
                               repeats=20 if args.quick else 500)

    name = device_name(device)
    commit, dirty = git_commit()
    print(f"device: {name}; torch {torch.__version__}; commit {commit[:12]}{' (dirty)' if dirty else ''}; "
          f"workers {num_workers_for(device)}; copy bandwidth {copy_gbps:.1f} GB/s")
    print(f"layout: {NUM_KV_HEADS * GROUP} query / {NUM_KV_HEADS} KV heads, D={HEAD_DIM}; qk dims {qk_dims}, "
          f"v dims {v_dims} ({width_ratio:.3f} of full width); SDPA GQA modes {modes}")
    print_tables(rows, targets, ablation, scheduler)

    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]
    path = os.path.join(args.out, f"{slug}-decode-{'quick-' if args.quick else ''}{stamp}.json")
    report = {
        "benchmark": "decode", "device": name, "device_type": device.type, "torch": torch.__version__,
        "python": platform.python_version(), "commit": commit, "dirty": dirty, "quick": args.quick,
        "threads": torch.get_num_threads(), "num_workers": num_workers_for(device), "repeats": repeats,
        "copy_bandwidth_gbps": copy_gbps,
        "layout": {"num_heads": NUM_KV_HEADS * GROUP, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                   "qk_dims": qk_dims, "v_dims": v_dims, "width_ratio": width_ratio, "seed": LAYOUT_SEED},
        "cases": [{"name": c.name, "lengths": c.lengths, "dtype": str(c.dtype).removeprefix("torch."),
                   "caches": c.caches} for c in all_cases],
        "sdpa_gqa_modes": modes,
        "rows": [asdict(r) for r in rows],
        "targets": targets,
        "balance_ablation": ablation,
        "scheduler": scheduler,
    }
    with open(path, "w") as f:
        json.dump(finite(report), f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
