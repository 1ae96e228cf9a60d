"""Operator benchmark: fdc prefill and decode attention at adaptive compressed widths against full-width SDPA,
pad-to-max-width SDPA and one SDPA call per bucket of equally wide heads, on the same shapes, in one process: the CPU
benchmark (bench_decode.py and bench_prefill.py are the GPU ones, with more baselines), and a quick look on a GPU.

What is measured (docs/design.md section 6):
- copy bandwidth of the machine: one large tensor copy, (bytes read + bytes written) / time, once at the start (the
  header) and again for each decode row, right before and after its calls (the row's share and target use the mean);
- decode: one query token per request against a long cache, contiguous and paged (pages of 16 and 128 tokens);
  achieved bandwidth = bytes of compressed K/V the step needs (sum over requests of length x (qk width + v width) x
  element size) / time, as a share of the copy bandwidth measured beside it;
- prefill: useful TFLOP/s = sum over query heads of 2 (d_qk + d_v) x visible keys (causal: s(s+1)/2 per sequence),
  / time;
- windowed decode (phase "window"): a 1024-key window over the decode shapes' caches, contiguous and paged, against
  decode over caches of only 1024 keys (bench_windowed_decode);
- quantized decode (phase "quantized", bf16): int8, e4m3 and int4 caches (on a GPU int8 and e4m3, the caches its
  kernels take) against the bf16 decode of the same rows (bench_quantized_decode), and on the CPU at B=4 x 2K too,
  a cache small enough for the last-level cache, each format timed back to back, without a target (the formats'
  arithmetic alone);
- prefill over a cached prefix (phase "prefix"): new tokens after a prefix in a paged cache, the op reading the pages
  against a gather into rows and the packed op, and reading the same keys from quantized pages (int8, e4m3 and int4;
  on a GPU int8 and e4m3 with half-precision queries) against the float pages (bench_prefix_prefill).
Baselines: "SDPA padded" pads every head to the widest width of the layer; "SDPA per bucket" makes one call per bucket
of KV heads that share a width max(d_qk, d_v), each padded only to its bucket's width (SDPA's fused CPU kernel takes
one head size for Q, K and V, so a bucket of unequal d_qk and d_v would otherwise fall back to its unfused math path).
The layer is bench_decode.py's: 32 query / 8 KV heads of 128, widths from bench_common.adaptive_dims averaging ~40%
of D (the same seed, so the same widths).

Targets, from bench_common.TARGETS (the one table of every benchmark's targets, with the reason for each number) for
the device type; on the CPU: decode time <= 1.25 (w / W) full-width SDPA time and >= 60% of copy bandwidth; prefill
time <= 1.25 (useful FLOPs ratio) full-width SDPA time; and every fdc row faster than both padded baselines. Each fdc
row says PASS or MISS for each.

Timing: bench_common.Timer: warm-up, then the median of repeated calls (perf_counter on the CPU; CUDA events with L2
flushed between calls on a GPU); a prefill shape's four methods are called in turn, round by round
(Timer.interleaved), so that a slow spell of the machine weighs on all of them alike. Prints a table and writes JSON
to bench/results/ops/ (or --out) with the device, torch version, threads and git commit. --quick runs a small smoke
configuration (seconds).
"""

from __future__ import annotations

import sys
from dataclasses import asdict

import torch
import torch.nn.functional as F

# bench_common first: it puts the repository root on sys.path for fdc_ops.
from bench_common import (
    GROUP,
    HEAD_DIM,
    NUM_KV_HEADS,
    SCALE,
    OpRow,
    Timer,
    adaptive_dims,
    bench_parser,
    copy_bandwidth,
    device_line,
    dtype_name,
    git_commit,
    layout_line,
    layout_record,
    median,
    phase_targets,
    print_op_rows,
    provenance,
    setup,
    useful_flops,
    verdict,
    width_ratio,
    write_report,
)
from fdc_ops import ops
from fdc_ops.apps.provenance import device_name
from fdc_ops.plans import visible_keys

# Mean of the adaptive widths (bench_common.adaptive_dims): 51, ~40% of D, the regime the paper's removal rates give;
# bench_decode.py's value, so both benchmarks measure the same layer.
DIM_MEAN = 51
# Warm-up calls before each measurement: the first call allocates and faults in its buffers.
WARMUP = 2
# Page sizes of the paged decode rows: 16 tokens (a GPU engine's usual block) and 128 (vLLM's CPU block size, what
# the vLLM plugin's steps read).
PAGE_SIZES = (16, 128)
# The windowed decode rows' window_left: a 1024-key window (Mistral 7B v0.1's is 4096; Gemma 2's local layers 4096,
# Gemma 3's 1024), so the 8K and 16K caches hold 8 and 16 times what a query sees.
WINDOW_LEFT = 1023


def shuffled_pages(batch: int, keys: int, page_size: int, qk_dims: list[int], v_dims: list[int], dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A paged cache for `batch` requests of `keys` keys ((num_pages, width, page_size), docs/design.md section 3),
    random values, and its block table (batch, pages per request) int32, the pages shuffled over the pool as a serving
    engine's block tables leave them (a fixed seed: every call the same order)."""
    per_request = -(-keys // page_size)
    order = torch.randperm(batch * per_request, generator=torch.Generator().manual_seed(0))
    table = order.view(batch, per_request).to(device=device, dtype=torch.int32)
    k_pages = torch.randn(batch * per_request, sum(qk_dims), page_size, dtype=dtype, device=device)
    v_pages = torch.randn(batch * per_request, sum(v_dims), page_size, dtype=dtype, device=device)
    return k_pages, v_pages, table


def bench_decode(batch: int, context: int, qk_dims: list[int], v_dims: list[int], dtype: torch.dtype,
                 device: torch.device, copy_mb: int, timer: Timer) -> list[OpRow]:
    qk_offsets, v_offsets = ops.prefix_sums(qk_dims), ops.prefix_sums(v_dims)
    width, full_width = sum(qk_dims) + sum(v_dims), 2 * NUM_KV_HEADS * HEAD_DIM
    heads = NUM_KV_HEADS * GROUP
    share = width_ratio(qk_dims, v_dims)
    config = f"B={batch} ctx={context} H={heads}/{NUM_KV_HEADS} dims~{share:.2f}D"
    goal = phase_targets("decode", device)
    rows = []

    q_full = torch.randn(batch, heads, 1, HEAD_DIM, dtype=dtype, device=device)
    k_full = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype=dtype, device=device)
    v_full = torch.randn_like(k_full)
    full = median(timer(lambda: F.scaled_dot_product_attention(q_full, k_full, v_full, enable_gqa=True)))
    full_bytes = batch * context * full_width * dtype.itemsize
    rows.append(OpRow("decode", config, str(dtype), "SDPA full width", full * 1e3, full_bytes / full / 1e9, "GB/s",
                      1.0))
    k_full = v_full = None  # released: the timed closures above hold them

    pad = max(max(qk_dims), max(v_dims))
    q_pad = torch.randn(batch, heads, 1, pad, dtype=dtype, device=device)
    k_pad = torch.randn(batch, NUM_KV_HEADS, context, pad, dtype=dtype, device=device)
    v_pad = torch.randn_like(k_pad)
    padded = median(timer(lambda: F.scaled_dot_product_attention(q_pad, k_pad, v_pad, enable_gqa=True)))
    padded_bytes = batch * context * 2 * NUM_KV_HEADS * pad * dtype.itemsize
    rows.append(OpRow("decode", config, str(dtype), f"SDPA padded to {pad}", padded * 1e3,
                      padded_bytes / padded / 1e9, "GB/s", padded / full))
    k_pad = v_pad = None  # released: the timed closures above hold them

    buckets = width_buckets(qk_dims, v_dims)
    bucket_tensors = [(torch.randn(batch, n * GROUP, 1, w, dtype=dtype, device=device),
                       torch.randn(batch, n, context, w, dtype=dtype, device=device),
                       torch.randn(batch, n, context, w, dtype=dtype, device=device)) for n, w in buckets]
    bucketed = median(timer(lambda: [F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                                     for q, k, v in bucket_tensors]))
    bucketed_bytes = sum(t[1].nbytes + t[2].nbytes for t in bucket_tensors)
    rows.append(OpRow("decode", config, str(dtype), f"SDPA per bucket ({len(buckets)} calls)", bucketed * 1e3,
                      bucketed_bytes / bucketed / 1e9, "GB/s", bucketed / full))
    bucket_tensors = None  # released: the timed closure above holds them

    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, GROUP * sum(qk_dims), dtype=dtype, device=device)
    k_cache = torch.randn(batch, context, sum(qk_dims), dtype=dtype, device=device)
    v_cache = torch.randn(batch, context, sum(v_dims), dtype=dtype, device=device)
    needed = batch * context * width * dtype.itemsize
    plan = ops.decode_plan(seqlens, qk_offsets, v_offsets, GROUP)
    time_limit = goal.full_ratio_slack * share

    def paged(page_size: int):
        """The same lengths in a paged cache of shuffled pages."""
        k_pages, v_pages, table = shuffled_pages(batch, context, page_size, qk_dims, v_dims, dtype, device)
        return lambda: ops.decode_attention(q, k_pages, v_pages, seqlens, qk_offsets, v_offsets, GROUP, SCALE, plan,
                                            table)

    def fdc_calls():
        """(method, call) pairs, made one at a time: a paged cache exists only while its call is timed."""
        yield "fdc decode, plan passed", lambda: ops.decode_attention(q, k_cache, v_cache, seqlens, qk_offsets,
                                                                      v_offsets, GROUP, SCALE, plan)
        yield "fdc decode, plan inside", lambda: ops.decode_attention(q, k_cache, v_cache, seqlens, qk_offsets,
                                                                      v_offsets, GROUP, SCALE)
        for size in PAGE_SIZES:
            yield f"fdc decode, paged ({size}-token pages)", paged(size)

    for method, call in fdc_calls():
        # The copy that sets the bandwidth target is timed right before and right after the row's calls: a 2-core
        # machine's copy bandwidth was seen to move by up to 1.7x from one minute to the next (AMD EPYC: 44 and 76
        # GB/s) while decode times held, so a probe taken once at the start could misjudge a row timed minutes later.
        # Not call by call: each copy leaves the caches full of dirty lines, whose write-back the next decode call
        # paid (B=8 x 16K bf16 took 7.9-9.8 ms so against 7.2-8.5 back to back); the row's warm-up calls pay it here.
        copy_before = copy_bandwidth(device, copy_mb, timer)
        seconds = median(timer(call))
        copy_gbps = (copy_before + copy_bandwidth(device, copy_mb, timer)) / 2
        call = None  # the paged cache it holds is released before the next one is made
        gbps, bandwidth_floor = needed / seconds / 1e9, goal.copy_share * copy_gbps
        time_ok, bandwidth_ok = seconds <= time_limit * full, gbps >= bandwidth_floor
        beats_ok = seconds < min(padded, bucketed)
        rows.append(OpRow("decode", config, str(dtype), method, seconds * 1e3, gbps, "GB/s", seconds / full,
                          f"<= {time_limit:.3f}x full; >= {bandwidth_floor:.1f} GB/s; < padded, per bucket",
                          f"{verdict(time_ok)}; {verdict(bandwidth_ok)} ({gbps / copy_gbps:.0%} of copy); "
                          f"{verdict(beats_ok)}",
                          {"share_of_copy_bandwidth": gbps / copy_gbps, "copy_bandwidth_gbps": copy_gbps,
                           "width_ratio": share}))
    return rows


# A windowed decode may take this much longer than the same decode over a cache of only the window's keys: both read
# the same bytes, and the windowed one only starts its chunks at the window; the slack is the noise between two
# interleaved medians of a 2-core machine.
WINDOW_SLACK = 1.15


def bench_windowed_decode(batch: int, context: int, window_left: int, qk_dims: list[int], v_dims: list[int],
                          dtype: torch.dtype, device: torch.device, timer: Timer) -> list[OpRow]:
    """Decode with a sliding window (each query sees its own key and the window_left before it) over long caches,
    contiguous and paged (vLLM's CPU block of 128 tokens, shuffled pages), against the same decode without a window
    over caches that hold only the window's keys: what a windowed layer costs should be what its visible keys cost."""
    qk_offsets, v_offsets = ops.prefix_sums(qk_dims), ops.prefix_sums(v_dims)
    visible = window_left + 1
    q = torch.randn(batch, GROUP * sum(qk_dims), dtype=dtype, device=device)
    k_cache = torch.randn(batch, context, sum(qk_dims), dtype=dtype, device=device)
    v_cache = torch.randn(batch, context, sum(v_dims), dtype=dtype, device=device)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    short = torch.full((batch,), visible, dtype=torch.int32, device=device)
    k_short, v_short = k_cache[:, :visible].contiguous(), v_cache[:, :visible].contiguous()
    page_size = PAGE_SIZES[-1]
    k_pages, v_pages, table = shuffled_pages(batch, context, page_size, qk_dims, v_dims, dtype, device)
    calls = [
        lambda: ops.decode_attention(q, k_short, v_short, short, qk_offsets, v_offsets, GROUP, SCALE),
        lambda: ops.decode_attention(q, k_cache, v_cache, seqlens, qk_offsets, v_offsets, GROUP, SCALE,
                                     window_left=window_left),
        lambda: ops.decode_attention(q, k_pages, v_pages, seqlens, qk_offsets, v_offsets, GROUP, SCALE,
                                     block_table=table, window_left=window_left),
    ]
    base, contiguous, paged = map(median, timer.interleaved(calls))
    needed = batch * visible * (sum(qk_dims) + sum(v_dims)) * dtype.itemsize
    config = f"B={batch} ctx={context} window={visible}"
    rows = [OpRow("window", config, str(dtype), f"unwindowed decode, {visible}-key cache", base * 1e3,
                  needed / base / 1e9, "GB/s", 1.0)]
    for method, seconds in ((f"fdc decode, window of {visible}", contiguous),
                            (f"fdc decode, window, paged ({page_size})", paged)):
        rows.append(OpRow("window", config, str(dtype), method, seconds * 1e3, needed / seconds / 1e9, "GB/s",
                          seconds / base, f"<= {WINDOW_SLACK:.2f}x the {visible}-key cache",
                          verdict(seconds <= WINDOW_SLACK * base)))
    return rows


# The quantized decode rows' speed-up over the bf16 decode of the same layout, per cache dtype: what a cache of a byte
# per element plus a float32 scale per (token, KV head) can give, at most (2 W) / (W + 4 H_kv) of bf16's time (1.79x
# at this layout's widths), half a byte per element (int4) at most (2 W) / (W / 2 + 4 H_kv) (3.2x); the quantized-cache
# issue's targets: 1.6x for int8 (e4m3 reads the same bytes) and 2.5x for int4.
QUANTIZED_SPEEDUP = {torch.int8: 1.6, torch.float8_e4m3fn: 1.6, torch.uint8: 2.5}


def quantized_formats(device: torch.device) -> tuple[torch.dtype, ...]:
    """The quantized caches decode and prefill read on this device: all three on the CPU, int8 and e4m3 on CUDA (int4
    has no CUDA kernel)."""
    return tuple(QUANTIZED_SPEEDUP) if device.type == "cpu" else ops.CUDA_QUANTIZED_CACHE_DTYPES


def bench_quantized_decode(batch: int, context: int, qk_dims: list[int], v_dims: list[int], device: torch.device,
                           copy_mb: int, timer: Timer, targeted: bool = True) -> list[OpRow]:
    """Decode from the quantized caches of quantized_formats (ops.cache_width: codes, then a float32 scale per token
    and KV head) written by append_kv from the same bf16 rows, against the bf16 decode of that cache, contiguous and
    paged (128-token shuffled pages), all called in turn (Timer.interleaved). Achieved bandwidth counts the bytes each
    cache holds for the keys read. targeted=False: a reference shape without the issue's targets, each cache timed
    back to back instead (its calls in a row, so a cache that fits the last-level cache is read from there: the
    formats' arithmetic alone), the speed-up still recorded."""
    qk_offsets, v_offsets = ops.prefix_sums(qk_dims), ops.prefix_sums(v_dims)
    goal = phase_targets("decode", device)
    formats = quantized_formats(device)
    config = f"B={batch} ctx={context} H={NUM_KV_HEADS * GROUP}/{NUM_KV_HEADS}" + ("" if targeted else ", back to back")
    seqlens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, GROUP * sum(qk_dims), dtype=torch.bfloat16, device=device)
    k_rows = torch.randn(batch * context, sum(qk_dims), dtype=torch.bfloat16, device=device)
    v_rows = torch.randn(batch * context, sum(v_dims), dtype=torch.bfloat16, device=device)
    cu = ops.prefix_sums(seqlens)
    page_size = PAGE_SIZES[-1]
    table = torch.randperm(batch * (context // page_size), generator=torch.Generator().manual_seed(0))
    table = table.view(batch, -1).to(device=device, dtype=torch.int32)
    rows = []
    for paged in (False, True):
        calls, byte_counts = [], []
        for dtype in (torch.bfloat16, *formats):
            k_width, v_width = ops.cache_width(qk_offsets, dtype), ops.cache_width(v_offsets, dtype)
            shapes = ((table.numel(), k_width, page_size), (table.numel(), v_width, page_size)) if paged else \
                ((batch, context, k_width), (batch, context, v_width))
            k_cache, v_cache = (torch.empty(shape, dtype=dtype, device=device) for shape in shapes)
            block_table = table if paged else None
            ops.append_kv(k_cache, v_cache, k_rows, v_rows, cu, torch.zeros_like(seqlens), qk_offsets, v_offsets,
                          block_table)
            calls.append(lambda k=k_cache, v=v_cache, t=block_table: ops.decode_attention(
                q, k, v, seqlens, qk_offsets, v_offsets, GROUP, SCALE, block_table=t))
            byte_counts.append(batch * context * (k_width + v_width) * dtype.itemsize)
        copy_before = copy_bandwidth(device, copy_mb, timer)
        times = list(map(median, timer.interleaved(calls) if targeted else map(timer, calls)))
        copy_gbps = (copy_before + copy_bandwidth(device, copy_mb, timer)) / 2
        kind = f"paged ({page_size})" if paged else "contiguous"
        rows.append(OpRow("quantized", config, "torch.bfloat16", f"fdc decode bf16, {kind}", times[0] * 1e3,
                          byte_counts[0] / times[0] / 1e9, "GB/s", 1.0))
        for dtype, seconds, needed in zip(formats, times[1:], byte_counts[1:]):
            gbps, floor, target = needed / seconds / 1e9, goal.copy_share * copy_gbps, QUANTIZED_SPEEDUP[dtype]
            measured = f"{times[0] / seconds:.2f}x faster than bf16; {gbps / copy_gbps:.0%} of copy"
            rows.append(OpRow("quantized", config, "torch.bfloat16", f"fdc decode {cache_name(dtype)} cache, {kind}",
                              seconds * 1e3, gbps, "GB/s", seconds / times[0],
                              f">= {target}x faster than bf16; >= {floor:.1f} GB/s" if targeted else "none",
                              f"{verdict(times[0] / seconds >= target)} ({times[0] / seconds:.2f}x); "
                              f"{verdict(gbps >= floor)} ({gbps / copy_gbps:.0%} of copy)" if targeted else measured,
                              {"speedup_over_bf16": times[0] / seconds, "share_of_copy_bandwidth": gbps / copy_gbps,
                               "copy_bandwidth_gbps": copy_gbps}))
    return rows


def bench_prefill(lengths: list[int], causal: bool, qk_dims: list[int], v_dims: list[int], dtype: torch.dtype,
                  device: torch.device, timer: Timer) -> list[OpRow]:
    qk_offsets, v_offsets = ops.prefix_sums(qk_dims), ops.prefix_sums(v_dims)
    config = f"seqs={lengths} causal={causal}"
    useful_full = useful_flops(lengths, causal, [HEAD_DIM] * NUM_KV_HEADS, [HEAD_DIM] * NUM_KV_HEADS)
    useful = useful_flops(lengths, causal, qk_dims, v_dims)
    goal = phase_targets("prefill", device)
    rows = []

    def sdpa_per_sequence(dim: int, kv_heads: int = NUM_KV_HEADS):
        qs = [torch.randn(1, kv_heads * GROUP, s, dim, dtype=dtype, device=device) for s in lengths]
        ks = [torch.randn(1, kv_heads, s, dim, dtype=dtype, device=device) for s in lengths]
        vs = [torch.randn_like(k) for k in ks]
        return lambda: [F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                        for q, k, v in zip(qs, ks, vs)]

    pad = max(max(qk_dims), max(v_dims))
    buckets = width_buckets(qk_dims, v_dims)
    bucket_calls = [sdpa_per_sequence(w, n) for n, w in buckets]
    total = sum(lengths)
    cu = ops.prefix_sums(lengths).to(device)
    q = torch.randn(total, GROUP * sum(qk_dims), dtype=dtype, device=device)
    k = torch.randn(total, sum(qk_dims), dtype=dtype, device=device)
    v = torch.randn(total, sum(v_dims), dtype=dtype, device=device)
    # Timed in turn, call by call (Timer.interleaved): the verdicts compare these times with each other.
    full, padded, bucketed, seconds = map(median, timer.interleaved([
        sdpa_per_sequence(HEAD_DIM), sdpa_per_sequence(pad), lambda: [call() for call in bucket_calls],
        lambda: ops.prefill_attention(q, k, v, cu, cu, qk_offsets, v_offsets, GROUP, SCALE, causal)]))
    rows.append(OpRow("prefill", config, str(dtype), "SDPA full width", full * 1e3, useful_full / full / 1e12,
                      "TFLOP/s", 1.0))
    rows.append(OpRow("prefill", config, str(dtype), f"SDPA padded to {pad}", padded * 1e3, useful / padded / 1e12,
                      "TFLOP/s", padded / full))
    rows.append(OpRow("prefill", config, str(dtype), f"SDPA per bucket ({len(buckets)} calls)", bucketed * 1e3,
                      useful / bucketed / 1e12, "TFLOP/s", bucketed / full))
    ratio = useful / useful_full
    limit = goal.full_ratio_slack * ratio
    rows.append(OpRow("prefill", config, str(dtype), "fdc prefill", seconds * 1e3, useful / seconds / 1e12, "TFLOP/s",
                      seconds / full, f"<= {limit:.3f}x full; < padded, per bucket",
                      f"{verdict(seconds <= limit * full)}; {verdict(seconds < min(padded, bucketed))}",
                      {"useful_flops_ratio": ratio}))
    return rows


# A prefill over quantized pages may take this much longer than over the float pages of the same keys: the pages are
# dequantized as the key blocks are packed, a pass the float pages take too (converting to the product's dtype); the
# quantized-cache issue's target.
QUANTIZED_PREFILL_SLACK = 1.15


def bench_prefix_prefill(batch: int, prefix: int, chunk: int, page_size: int, qk_dims: list[int], v_dims: list[int],
                         dtype: torch.dtype, device: torch.device, timer: Timer) -> list[OpRow]:
    """A causal chunk of `chunk` new tokens per request after `prefix` cached ones, all in a paged cache of shuffled
    pages (what a chunked prefill's later chunks and a prefix-cache hit run in the vLLM plugin): prefill_attention
    reading the pages through the block table, against gathering each request's context into rows first and the
    packed prefill over them (what the plugin's backend did before the op read pages)."""
    qk_offsets, v_offsets = ops.prefix_sums(qk_dims), ops.prefix_sums(v_dims)
    seq = prefix + chunk
    k_pages, v_pages, table = shuffled_pages(batch, seq, page_size, qk_dims, v_dims, dtype, device)
    q = torch.randn(batch * chunk, GROUP * sum(qk_dims), dtype=dtype, device=device)
    cu_q, cu_k = ops.prefix_sums([chunk] * batch).to(device), ops.prefix_sums([seq] * batch).to(device)
    # The backend's gather: token t of request b is slot t % page_size of page table[b, t // page_size].
    token = torch.arange(seq, device=device).repeat(batch)
    request = torch.arange(batch, device=device).repeat_interleave(seq)
    pages, slots = table.long()[request, token // page_size], token % page_size

    def gathered():
        k, v = k_pages[pages, :, slots], v_pages[pages, :, slots]  # (batch * seq, width)
        return ops.prefill_attention(q, k, v, cu_q, cu_k, qk_offsets, v_offsets, GROUP, SCALE, True)

    def paged():
        return ops.prefill_attention(q, k_pages, v_pages, cu_q, cu_k, qk_offsets, v_offsets, GROUP, SCALE, True,
                                     block_table=table)

    calls = [gathered, paged]
    # The same keys in quantized pages (written by append_kv from the float pages' rows, same table): int8, e4m3 and
    # int4 on the CPU, int8 and e4m3 with half-precision queries on CUDA.
    formats = quantized_formats(device) if device.type == "cpu" or dtype != torch.float32 else ()
    for fmt in formats:
        k_q, v_q = (torch.empty(table.numel(), ops.cache_width(offsets, fmt), page_size, dtype=fmt, device=device)
                    for offsets in (qk_offsets, v_offsets))
        ops.append_kv(k_q, v_q, k_pages[pages, :, slots], v_pages[pages, :, slots], cu_k,
                      torch.zeros(batch, dtype=torch.int32, device=device), qk_offsets, v_offsets, table)
        calls.append(lambda k=k_q, v=v_q: ops.prefill_attention(q, k, v, cu_q, cu_k, qk_offsets, v_offsets, GROUP,
                                                                 SCALE, True, block_table=table))
    gather_s, paged_s, *quantized_s = map(median, timer.interleaved(calls))
    useful = float(2 * GROUP * sum(dq + dv for dq, dv in zip(qk_dims, v_dims))
                   * batch * visible_keys(0, chunk, chunk, seq, True))
    config = f"B={batch} prefix={prefix} chunk={chunk} page={page_size}"
    rows = [OpRow("prefix", config, str(dtype), "gather + fdc prefill", gather_s * 1e3,
                  useful / gather_s / 1e12, "TFLOP/s", 1.0),
            OpRow("prefix", config, str(dtype), "fdc paged prefill", paged_s * 1e3, useful / paged_s / 1e12,
                  "TFLOP/s", paged_s / gather_s, "< gather + prefill", verdict(paged_s < gather_s))]
    for fmt, seconds in zip(formats, quantized_s):
        rows.append(OpRow("prefix", config, str(dtype), f"fdc paged prefill, {cache_name(fmt)} pages", seconds * 1e3,
                          useful / seconds / 1e12, "TFLOP/s", seconds / gather_s,
                          f"<= {QUANTIZED_PREFILL_SLACK}x the {dtype_name(dtype)} pages",
                          f"{verdict(seconds <= QUANTIZED_PREFILL_SLACK * paged_s)} ({seconds / paged_s:.2f}x)"))
    return rows


def cache_name(dtype: torch.dtype) -> str:
    """A cache dtype's name in the tables: int4 for the uint8 that stores its codes two per byte."""
    return "int4" if dtype == torch.uint8 else dtype_name(dtype)


def width_buckets(qk_dims: list[int], v_dims: list[int]) -> list[tuple[int, int]]:
    """(number of KV heads, width) for each distinct max(d_qk, d_v) of the layout, narrowest first."""
    widths = [max(dq, dv) for dq, dv in zip(qk_dims, v_dims)]
    return [(widths.count(w), w) for w in sorted(set(widths))]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats_help="timed calls per measurement (median)", topic="ops")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32", "all"], default="all")
    parser.add_argument("--phase", choices=["decode", "window", "quantized", "prefill", "prefix", "all"],
                        nargs="+", default=["all"],
                        help="time only decode, windowed decode, decode from int8 / e4m3 / int4 caches against bf16, "
                             "prefill or prefill over a paged cached prefix; several may be named (a full CPU run "
                             "takes minutes)")
    args = parser.parse_args(argv)
    everything = {"decode", "window", "quantized", "prefill", "prefix"}
    phases = everything if "all" in args.phase else set(args.phase)
    device, repeats = setup(args)
    timer = Timer(device, repeats, warmup=WARMUP)
    dtypes = [torch.bfloat16, torch.float32] if args.dtype == "all" else [getattr(torch, args.dtype)]
    # Prefix shapes: (requests, cached prefix, new tokens, page size); 128 is vLLM's CPU block size, 16 a GPU
    # engine's, and a chunk of 256 after 4K is a chunked prefill's later chunk or a prefix hit's new suffix.
    if args.quick:
        decode_shapes, prefill_shapes, copy_mb = [(2, 1024)], [[256, 128]], 64
        prefix_shapes, quantized_reference_shapes = [(2, 300, 64, 16)], [(1, 512)]
    elif device.type == "cuda":
        decode_shapes, prefill_shapes, copy_mb = [(32, 8192)], [[1024] * 16, [4096] * 4, [16384]], 1024
        prefix_shapes, quantized_reference_shapes = [(16, 8192, 512, 16), (16, 8192, 512, 128)], []
    else:
        decode_shapes, prefill_shapes, copy_mb = [(4, 8192), (8, 16384)], [[1024, 512, 2048, 512], [4096]], 1024
        prefix_shapes = [(4, 4096, 256, 128), (4, 4096, 256, 16), (16, 1024, 64, 128)]
        # The quantized decode at a cache every format keeps in a server CPU's last-level cache (bf16 13 MB), each
        # format timed back to back: where no format waits on memory, the speed-up is the kernels' arithmetic alone; no
        # target.
        quantized_reference_shapes = [(4, 2048)]
    qk_dims, v_dims = adaptive_dims(DIM_MEAN)

    copy_gbps = copy_bandwidth(device, copy_mb, timer)
    rows: list[OpRow] = []
    for dtype in dtypes:
        for batch, context in decode_shapes if "decode" in phases else []:
            rows += bench_decode(batch, context, qk_dims, v_dims, dtype, device, copy_mb, timer)
        for batch, context in decode_shapes if "window" in phases else []:
            rows += bench_windowed_decode(batch, context, WINDOW_LEFT, qk_dims, v_dims, dtype, device, timer)
        quantized = "quantized" in phases and dtype == torch.bfloat16
        for batch, context in decode_shapes if quantized else []:
            rows += bench_quantized_decode(batch, context, qk_dims, v_dims, device, copy_mb, timer)
        for batch, context in quantized_reference_shapes if quantized else []:
            rows += bench_quantized_decode(batch, context, qk_dims, v_dims, device, copy_mb, timer, targeted=False)
        for lengths in prefill_shapes if "prefill" in phases else []:
            for causal in (True, False):
                rows += bench_prefill(lengths, causal, qk_dims, v_dims, dtype, device, timer)
        for batch, prefix, chunk, page_size in prefix_shapes if "prefix" in phases else []:
            rows += bench_prefix_prefill(batch, prefix, chunk, page_size, qk_dims, v_dims, dtype, device, timer)

    name = device_name(device)
    commit, dirty = git_commit()
    print(f"{device_line(name, commit, dirty, device)}; threads {torch.get_num_threads()}; "
          f"copy bandwidth {copy_gbps:.1f} GB/s")
    print(layout_line(qk_dims, v_dims))
    print_op_rows(rows, 40, 15, 34)

    report = {**provenance("ops", name, device, args.quick), "repeats": repeats,
              "dtypes": [dtype_name(d) for d in dtypes], "phase": sorted(phases), "copy_bandwidth_gbps": copy_gbps,
              "layout": layout_record(qk_dims, v_dims), "rows": [asdict(r) for r in rows]}
    write_report(report, args.out, name, "ops", args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
