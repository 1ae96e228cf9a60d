"""Operator benchmark: fdc prefill and decode attention at adaptive compressed widths against full-width SDPA and
pad-to-max-width SDPA on the same shapes, in one process.

What is measured (DESIGN.md section 6):
- copy bandwidth of the machine: one large tensor copy, (bytes read + bytes written) / time;
- decode: one query token per request against a long cache; achieved bandwidth = bytes of compressed K/V the step
  needs (sum over requests of length x (qk width + v width) x element size) / time, as a share of copy bandwidth;
- prefill: useful TFLOP/s = sum over heads of 2 (d_qk + d_v) s_q s_k, halved when causal, / time.
Targets (issue 2, long contexts): decode time <= 1.25 (w / W) full-width SDPA time and >= 60% of copy bandwidth;
prefill time <= 1.25 (useful FLOPs ratio) full-width SDPA time. Each row says PASS or MISS.

Timing: warm-up, then the median of repeated runs (CUDA events on a GPU, perf_counter on the CPU). Prints a table and
writes JSON to bench/results/ with the device, torch version, threads and git commit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

# bench_common first: it puts the repository root on sys.path for fdc_ops.
from bench_common import ROOT, prefix, verdict, write_json
from fdc_ops import ops
from fdc_ops.apps.provenance import device_name, git_commit

# Llama-3-8B-like attention: 32 query / 8 KV heads of 128 (the reference shape).
NUM_KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128
# Adaptive widths averaging ~40% of D, the regime the paper's removal rates give; drawn once from a fixed seed so
# runs compare.
COMPRESSED_SHARE, LAYOUT_SEED = 0.4, 0


@dataclass
class Row:
    phase: str
    config: str
    dtype: str
    method: str
    millis: float
    metric: float  # GB/s for decode, useful TFLOP/s for prefill
    metric_unit: str
    vs_full: float  # time / full-width SDPA time
    target: str = ""
    verdict: str = ""
    extra: dict = field(default_factory=dict)


def timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median seconds of fn() after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """GB/s of a large copy, counting bytes read and written. The buffer is far larger than any cache (1 GiB by
    default), so this is memory bandwidth."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, repeats=5)
    return 2 * src.numel() * 4 / seconds / 1e9


def adaptive_dims() -> tuple[list[int], list[int]]:
    """Per-KV-head qk and v widths, multiples of 8, averaging COMPRESSED_SHARE of HEAD_DIM, skewed across heads."""
    gen = torch.Generator().manual_seed(LAYOUT_SEED)
    weights = torch.rand(2, NUM_KV_HEADS, generator=gen) + 0.5
    dims = weights / weights.mean(dim=1, keepdim=True) * COMPRESSED_SHARE * HEAD_DIM
    dims = (torch.round(dims / 8) * 8).clamp(8, HEAD_DIM).int()
    return dims[0].tolist(), dims[1].tolist()


def bench_decode(batch: int, context: int, dtype: torch.dtype, device: torch.device, copy_gbps: float,
                 repeats: int) -> list[Row]:
    qk_dims, v_dims = adaptive_dims()
    qk_offsets, v_offsets = prefix(qk_dims), prefix(v_dims)
    width, full_width = sum(qk_dims) + sum(v_dims), 2 * NUM_KV_HEADS * HEAD_DIM
    heads = NUM_KV_HEADS * GROUP
    config = f"B={batch} ctx={context} H={heads}/{NUM_KV_HEADS} dims~{width / full_width:.2f}D"
    rows = []

    q_full = torch.randn(batch, heads, 1, HEAD_DIM, dtype=dtype, device=device)
    k_full = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=dtype, device=device)
    v_full = torch.randn_like(k_full)
    full = timed(lambda: F.scaled_dot_product_attention(q_full, k_full, v_full, enable_gqa=True), device, repeats)
    full_bytes = batch * context * full_width * dtype.itemsize
    rows.append(Row("decode", config, str(dtype), "SDPA full width", full * 1e3, full_bytes / full / 1e9, "GB/s", 1.0))
    del k_full, v_full

    pad = max(max(qk_dims), max(v_dims))
    q_pad = torch.randn(batch, heads, 1, pad, dtype=dtype, device=device)
    k_pad = torch.randn(batch, NUM_KV_HEADS, context, pad, dtype=dtype, device=device)
    v_pad = torch.randn_like(k_pad)
    padded = timed(lambda: F.scaled_dot_product_attention(q_pad, k_pad, v_pad, enable_gqa=True), device, repeats)
    padded_bytes = batch * context * 2 * NUM_KV_HEADS * pad * dtype.itemsize
    rows.append(Row("decode", config, str(dtype), f"SDPA padded to {pad}", padded * 1e3,
                    padded_bytes / padded / 1e9, "GB/s", padded / full))
    del k_pad, v_pad

    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, GROUP * sum(qk_dims), dtype=dtype, device=device)
    k_cache = torch.randn(batch, context, sum(qk_dims), dtype=dtype, device=device)
    v_cache = torch.randn(batch, context, sum(v_dims), dtype=dtype, device=device)
    needed = batch * context * width * dtype.itemsize
    share = width / full_width
    plan = ops.decode_plan(seqlens, qk_offsets, v_offsets, GROUP)
    for method, call in (
        ("fdc decode, plan passed", lambda: ops.decode_attention(q, k_cache, v_cache, seqlens, qk_offsets, v_offsets,
                                                                 GROUP, HEAD_DIM ** -0.5, plan)),
        ("fdc decode, plan inside", lambda: ops.decode_attention(q, k_cache, v_cache, seqlens, qk_offsets, v_offsets,
                                                                 GROUP, HEAD_DIM ** -0.5)),
    ):
        seconds = timed(call, device, repeats)
        gbps = needed / seconds / 1e9
        time_ok, bandwidth_ok = seconds <= 1.25 * share * full, gbps >= 0.6 * copy_gbps
        rows.append(Row("decode", config, str(dtype), method, seconds * 1e3, gbps, "GB/s", seconds / full,
                        f"<= {1.25 * share:.3f}x full; >= {0.6 * copy_gbps:.1f} GB/s",
                        f"{verdict(time_ok)}; {verdict(bandwidth_ok)} ({gbps / copy_gbps:.0%} of copy)",
                        {"share_of_copy_bandwidth": gbps / copy_gbps, "width_ratio": share}))
    return rows


def bench_prefill(lengths: list[int], causal: bool, dtype: torch.dtype, device: torch.device,
                  repeats: int) -> list[Row]:
    qk_dims, v_dims = adaptive_dims()
    qk_offsets, v_offsets = prefix(qk_dims), prefix(v_dims)
    heads = NUM_KV_HEADS * GROUP
    config = f"seqs={lengths} causal={causal}"
    factor = 0.5 if causal else 1.0
    useful_full = sum(factor * 2 * 2 * HEAD_DIM * s * s * heads for s in lengths)
    useful = sum(factor * 2 * (qk + v) * s * s * GROUP for s in lengths for qk, v in zip(qk_dims, v_dims))
    rows = []

    def sdpa_per_sequence(dim: int):
        qs = [torch.randn(1, heads, s, dim, dtype=dtype, device=device) for s in lengths]
        ks = [torch.randn(1, NUM_KV_HEADS, s, dim, dtype=dtype, device=device) for s in lengths]
        vs = [torch.randn_like(k) for k in ks]
        return lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                        for q, k, v in zip(qs, ks, vs)]

    full = timed(sdpa_per_sequence(HEAD_DIM), device, repeats)
    rows.append(Row("prefill", config, str(dtype), "SDPA full width", full * 1e3, useful_full / full / 1e12,
                    "TFLOP/s", 1.0))
    pad = max(max(qk_dims), max(v_dims))
    padded = timed(sdpa_per_sequence(pad), device, repeats)
    rows.append(Row("prefill", config, str(dtype), f"SDPA padded to {pad}", padded * 1e3, useful / padded / 1e12,
                    "TFLOP/s", padded / full))

    total = sum(lengths)
    cu = prefix(lengths).to(device)
    q = torch.randn(total, GROUP * sum(qk_dims), dtype=dtype, device=device)
    k = torch.randn(total, sum(qk_dims), dtype=dtype, device=device)
    v = torch.randn(total, sum(v_dims), dtype=dtype, device=device)
    seconds = timed(lambda: ops.prefill_attention(q, k, v, cu, cu, qk_offsets, v_offsets, GROUP, HEAD_DIM ** -0.5,
                                                  causal), device, repeats)
    ratio = useful / useful_full
    rows.append(Row("prefill", config, str(dtype), "fdc prefill", seconds * 1e3, useful / seconds / 1e12, "TFLOP/s",
                    seconds / full, f"<= {1.25 * ratio:.3f}x full", verdict(seconds <= 1.25 * ratio * full),
                    {"useful_flops_ratio": ratio}))
    return rows


def print_table(rows: list[Row]) -> None:
    header = f"{'phase':<8} {'config':<40} {'dtype':<15} {'method':<24} {'ms':>9} {'rate':>14} {'vs full':>8}  target"
    print(header)
    print("-" * len(header))
    for r in rows:
        rate = f"{r.metric:.2f} {r.metric_unit}" if r.metric_unit == "GB/s" else f"{r.metric:.4f} {r.metric_unit}"
        print(f"{r.phase:<8} {r.config:<40} {r.dtype:<15} {r.method:<24} {r.millis:>9.2f} {rate:>14} "
              f"{r.vs_full:>7.3f}x  {r.target} {r.verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small smoke configuration (seconds)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="folder for the JSON")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32", "all"], default="all")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtypes = [torch.bfloat16, torch.float32] if args.dtype == "all" else [getattr(torch, args.dtype)]
    if args.quick:
        decode_shapes, prefill_shapes, repeats, copy_mb = [(2, 1024)], [[256, 128]], 3, 64
    elif device.type == "cuda":
        decode_shapes, prefill_shapes, repeats, copy_mb = [(32, 8192)], [[1024] * 16, [4096] * 4, [16384]], 20, 1024
    else:
        decode_shapes, prefill_shapes, repeats, copy_mb = [(4, 8192), (8, 16384)], [[1024, 512, 2048, 512], [4096]], \
            5, 1024

    copy_gbps = copy_bandwidth(device, copy_mb)
    rows: list[Row] = []
    for dtype in dtypes:
        for batch, context in decode_shapes:
            rows += bench_decode(batch, context, dtype, device, copy_gbps, repeats)
        for lengths in prefill_shapes:
            for causal in (True, False):
                rows += bench_prefill(lengths, causal, dtype, device, repeats)

    name = device_name(device)
    commit, dirty = git_commit()
    qk_dims, v_dims = adaptive_dims()
    print(f"device: {name}; torch {torch.__version__}; threads {torch.get_num_threads()}; commit {commit[:12]}"
          f"{' (dirty)' if dirty else ''}; copy bandwidth {copy_gbps:.1f} GB/s")
    print(f"layout: {NUM_KV_HEADS * GROUP} query / {NUM_KV_HEADS} KV heads, D={HEAD_DIM}; qk dims {qk_dims}, "
          f"v dims {v_dims}")
    print_table(rows)

    write_json({"device": name, "device_type": device.type, "torch": torch.__version__,
                "threads": torch.get_num_threads(), "commit": commit, "dirty": dirty, "quick": args.quick,
                "copy_bandwidth_gbps": copy_gbps, "qk_dims": qk_dims, "v_dims": v_dims,
                "rows": [asdict(r) for r in rows]}, args.out, name, "ops", args.quick)


if __name__ == "__main__":
    main()
