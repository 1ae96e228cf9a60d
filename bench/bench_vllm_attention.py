"""Operator peers on the CPU: fdc's decode and prefill against vLLM's own CPU attention, the kernels its CPU backend
runs over a paged cache (``cpu_attention_with_kv_cache`` with its scheduler metadata), on bench_ops.py's layer and
shapes, in one process, so every ratio is measured in one run. Runs in vLLM's environment, where fdc_ops is the
installed copy (scripts/setup_vllm.sh):

    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_vllm_attention.py

Methods, per shape and dtype (bf16 and float32):
- ``vllm full width``: K and V of D = 128 per KV head in vLLM's paged layout (its kv_cache tensor (blocks, H_kv,
  block, 2 D), viewed and split as its backend does), 128-token blocks (its CPU default), blocks shuffled over the pool,
  the scheduler metadata built once per shape as the backend builds it once per step;
- ``vllm padded``: every head padded to the widest width of the layer (vLLM takes one head size for Q, K and V);
- ``fdc``: decode_attention over fdc's paged cache (128-token pages, shuffled), or prefill_attention over packed
  rows, each with its plan built once per shape.
Decode counts the K/V bytes each method must read; prefill the useful FLOPs (bench_common.useful_flops). The prompts
of a prefill have no cached prefix, for both: vLLM reads their keys from its cache (written before timing), fdc from
the packed rows.

Targets, from bench_common.VLLM_PEER_TARGETS: fdc decode time <= 1.10 x (compressed / full bytes) x vLLM's
full-width time, fdc prefill time <= 1.25 x (useful-FLOP ratio) x vLLM's full-width time, and fdc faster than vLLM
padded. Timing: bench_common.Timer, the methods of a shape called in turn (Timer.interleaved). Prints a table and
writes JSON to bench/results/ops/ (or --out).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

# bench_common and bench_results sit beside this script; under PYTHONSAFEPATH Python puts no folder on sys.path, and
# bench_common then leaves the checkout off it too, so fdc_ops is the copy installed for vLLM's torch.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_common import (  # noqa: E402
    GROUP,
    HEAD_DIM,
    NUM_KV_HEADS,
    SCALE,
    VLLM_PEER_TARGETS,
    OpRow,
    Timer,
    adaptive_dims,
    bench_parser,
    copy_bandwidth,
    device_line,
    git_commit,
    layout_line,
    layout_record,
    median,
    print_op_rows,
    provenance,
    setup,
    useful_flops,
    verdict,
    width_ratio,
    write_report,
)
from fdc_ops import ops  # noqa: E402
from fdc_ops.apps.provenance import device_name  # noqa: E402

DIM_MEAN = 51  # bench_ops.py's layout: widths averaging ~40% of D
BLOCK = 128  # vLLM's default block size on the CPU; fdc's pages the same
WARMUP = 2


class VllmPaged:
    """vLLM's paged cache for `lengths` with head size `dim` (K and V), written with random rows by vLLM's own cache
    write (its kernels keep their own layout inside a block), and its attention call over queries (T, H, dim) for
    the query rows at `query_start_loc`. Keeps the first request's rows, for check()."""

    def __init__(self, lengths: list[int], dim: int, dtype: torch.dtype, query_start_loc: torch.Tensor):
        from vllm import envs
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        # vLLM takes its AMX kernels wherever the CPU has AMX tiles, and Linux lets a process use them only once it
        # asked (arch_prctl): its engine does, this direct call must too, or the first tile instruction is SIGILL.
        if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
            raise SystemExit("bench_vllm_attention.py: the CPU has AMX tiles, but Linux refused this process their use")
        blocks_per_request = [-(-n // BLOCK) for n in lengths]
        num_blocks = sum(blocks_per_request)
        kv_cache = torch.zeros(num_blocks, NUM_KV_HEADS, BLOCK, 2 * dim, dtype=dtype)
        self.key_cache, self.value_cache = kv_cache.view(num_blocks, NUM_KV_HEADS, 2 * BLOCK, dim).chunk(2, dim=2)
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32)
        self.block_table = torch.zeros((len(lengths), max(blocks_per_request)), dtype=torch.int32)
        start = 0
        for b, count in enumerate(blocks_per_request):
            self.block_table[b, :count] = order[start:start + count]
            start += count
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32)
        self.query_start_loc = query_start_loc
        self.isa = _get_attn_isa(dtype, BLOCK, dim)
        for b, n in enumerate(lengths):
            positions = torch.arange(n)
            slots = (self.block_table[b, positions // BLOCK].long() * BLOCK + positions % BLOCK)
            k = torch.randn(n, NUM_KV_HEADS, dim, dtype=dtype)  # (tokens, H_kv, dim)
            v = torch.randn(n, NUM_KV_HEADS, dim, dtype=dtype)
            torch.ops._C.cpu_attn_reshape_and_cache(k, v, self.key_cache, self.value_cache, slots, self.isa, 1.0,
                                                    1.0, "auto")
            if b == 0:
                self.first_k, self.first_v = k, v
        self.metadata = torch.ops._C.get_scheduler_metadata(
            len(lengths), NUM_KV_HEADS * GROUP, NUM_KV_HEADS, dim, self.seq_lens, dtype, query_start_loc, True, -1,
            self.isa, envs.VLLM_CPU_ATTN_SPLIT_KV, None, "auto")

    def attention(self, query: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        torch.ops._C.cpu_attention_with_kv_cache(
            query, self.key_cache, self.value_cache, out, self.query_start_loc, self.seq_lens, SCALE, True, None, -1,
            self.block_table, 0.0, self.metadata, None, None, 1.0, 1.0, "auto")
        return out


def check_vllm(cache: VllmPaged, query: torch.Tensor, queries: list[int]) -> float:
    """Max |vLLM - float64 attention| over the last (at most 16) query rows of the first request: the benchmark must
    be timing attention over the cache it built (a misread layout would run as fast)."""
    out = cache.attention(query, torch.empty_like(query))
    k, v = (t.double().transpose(0, 1) for t in (cache.first_k, cache.first_v))  # (H_kv, n, dim)
    n, s = k.shape[1], queries[0]
    rows = min(s, 16)
    q = query[s - rows:s].double().transpose(0, 1)  # (H, rows, dim): positions n - rows .. n - 1
    scores = (q @ k.repeat_interleave(GROUP, 0).transpose(1, 2)) * SCALE  # (H, rows, n)
    visible = torch.arange(n)[None, :] <= torch.arange(n - rows, n)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    expected = (scores.softmax(-1) @ v.repeat_interleave(GROUP, 0)).transpose(0, 1)  # (rows, H, dim)
    cache.first_k = cache.first_v = None  # checked once; not kept while timing
    return float((out[s - rows:s].double() - expected).abs().max())


def fdc_paged_decode(lengths: list[int], qk_dims, v_dims, dtype: torch.dtype):
    """fdc's decode call over a paged cache of 128-token pages in a shuffled order, its plan built once."""
    qk_offsets, v_offsets = ops.prefix_sums(qk_dims), ops.prefix_sums(v_dims)
    per_request = -(-max(lengths) // BLOCK)
    order = torch.randperm(len(lengths) * per_request, generator=torch.Generator().manual_seed(1))
    table = order.view(len(lengths), per_request).to(torch.int32)
    k_pages = torch.randn(len(lengths) * per_request, sum(qk_dims), BLOCK, dtype=dtype)
    v_pages = torch.randn(len(lengths) * per_request, sum(v_dims), BLOCK, dtype=dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), GROUP * sum(qk_dims), dtype=dtype)
    plan = ops.decode_plan(seqlens, qk_offsets, v_offsets, GROUP)
    return lambda: ops.decode_attention(q, k_pages, v_pages, seqlens, qk_offsets, v_offsets, GROUP, SCALE, plan,
                                        table)


def fdc_prefill(lengths: list[int], qk_dims, v_dims, dtype: torch.dtype):
    """fdc's causal prefill over packed rows, its plan built once."""
    qk_offsets, v_offsets = ops.prefix_sums(qk_dims), ops.prefix_sums(v_dims)
    cu = ops.prefix_sums(lengths)
    total = sum(lengths)
    q = torch.randn(total, GROUP * sum(qk_dims), dtype=dtype)
    k = torch.randn(total, sum(qk_dims), dtype=dtype)
    v = torch.randn(total, sum(v_dims), dtype=dtype)
    plan = ops.prefill_plan(cu, cu, qk_offsets, v_offsets, GROUP, True)
    return lambda: ops.prefill_attention(q, k, v, cu, cu, qk_offsets, v_offsets, GROUP, SCALE, True, plan)


def bench_shape(phase: str, lengths: list[int], qk_dims, v_dims, dtype: torch.dtype, timer: Timer) -> list[OpRow]:
    """vLLM full width, vLLM padded and fdc on one shape: decode (one query per request) or a causal prefill."""
    pad = max(max(qk_dims), max(v_dims))
    queries = [1] * len(lengths) if phase == "decode" else lengths
    query_start_loc = ops.prefix_sums(queries)
    calls, checks = [], {}
    for label, dim in (("full", HEAD_DIM), ("padded", pad)):
        cache = VllmPaged(lengths, dim, dtype, query_start_loc)
        query = torch.randn(sum(queries), NUM_KV_HEADS * GROUP, dim, dtype=dtype)
        error = check_vllm(cache, query, queries)
        if error > (1e-4 if dtype == torch.float32 else 3e-2):  # float32 rounding, or bf16 inputs' (2^-8 relative)
            raise RuntimeError(f"bench_vllm_attention: vLLM's {label} {phase} is {error:.3g} off the float64 "
                               "reference: the cache or its call is not what this benchmark means to time")
        checks[label] = {"max_abs_error_vs_float64": error, "isa": cache.isa}
        out = torch.empty_like(query)
        calls.append(lambda cache=cache, query=query, out=out: cache.attention(query, out))
    calls.append(fdc_paged_decode(lengths, qk_dims, v_dims, dtype) if phase == "decode" else
                 fdc_prefill(lengths, qk_dims, v_dims, dtype))
    full, padded, fdc = map(median, timer.interleaved(calls))

    size = dtype.itemsize
    if phase == "decode":
        work = [sum(lengths) * 2 * NUM_KV_HEADS * d * size for d in (HEAD_DIM, pad)]
        work.append(sum(lengths) * (sum(qk_dims) + sum(v_dims)) * size)
        unit, scale, ratio = "GB/s", 1e9, width_ratio(qk_dims, v_dims)
    else:
        full_flops = useful_flops(lengths, True, [HEAD_DIM] * NUM_KV_HEADS, [HEAD_DIM] * NUM_KV_HEADS)
        fdc_flops = useful_flops(lengths, True, qk_dims, v_dims)
        work, unit, scale, ratio = [full_flops, fdc_flops, fdc_flops], "TFLOP/s", 1e12, fdc_flops / full_flops
    if phase == "decode":
        config = f"B={len(lengths)} ctx={lengths[0]}"
    elif len(set(lengths)) == 1 and len(lengths) > 1:
        config = f"seqs={len(lengths)} x {lengths[0]} causal"
    else:
        config = f"seqs={lengths} causal"
    name = str(dtype).removeprefix("torch.")
    limit = VLLM_PEER_TARGETS[phase] * ratio
    rows = [OpRow(phase, config, name, "vllm full width", full * 1e3, work[0] / full / scale, unit, 1.0,
                  extra=checks["full"]),
            OpRow(phase, config, name, f"vllm padded to {pad}", padded * 1e3, work[1] / padded / scale, unit,
                  padded / full, extra=checks["padded"]),
            OpRow(phase, config, name, "fdc", fdc * 1e3, work[2] / fdc / scale, unit, fdc / full,
                  f"<= {limit:.3f}x vllm full; < vllm padded",
                  f"{verdict(fdc <= limit * full)}; {verdict(fdc < padded)}",
                  {"ratio": ratio, "slack": VLLM_PEER_TARGETS[phase]})]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, repeats_help="timed calls per measurement (median)", topic="ops")
    args = parser.parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("bench_vllm_attention: vLLM's CPU attention runs on the CPU only (--device cpu)")
    import vllm

    device, repeats = setup(args)
    timer = Timer(device, repeats, warmup=WARMUP)
    if args.quick:
        decode_shapes, prefill_shapes, copy_mb = [[1024] * 2], [[256, 128]], 64
    else:
        # [256] * 16: many short prompts at once, the prefill of a server's step at a high request rate (where the
        # serving runs found fdc's prefill at half the throughput it reaches on one long prompt).
        decode_shapes = [[8192] * 4, [16384] * 8]
        prefill_shapes, copy_mb = [[1024, 512, 2048, 512], [4096], [256] * 16], 1024
    qk_dims, v_dims = adaptive_dims(DIM_MEAN)
    copy_gbps = copy_bandwidth(device, copy_mb, timer)
    rows: list[OpRow] = []
    for dtype in (torch.bfloat16, torch.float32):
        for lengths in decode_shapes:
            rows += bench_shape("decode", lengths, qk_dims, v_dims, dtype, timer)
        for lengths in prefill_shapes:
            rows += bench_shape("prefill", lengths, qk_dims, v_dims, dtype, timer)

    name = device_name(device)
    commit, dirty = git_commit()
    print(f"{device_line(name, commit, dirty, device)}; vllm {vllm.__version__}; copy bandwidth {copy_gbps:.1f} GB/s")
    print(layout_line(qk_dims, v_dims))
    print_op_rows(rows, 34, 9, 20)
    report = {**provenance("vllm_attention", name, device, args.quick), "vllm": vllm.__version__,
              "repeats": repeats, "copy_bandwidth_gbps": copy_gbps, "layout": layout_record(qk_dims, v_dims),
              "block_size": BLOCK, "rows": [asdict(r) for r in rows]}
    write_report(report, args.out, name, "vllm-attention", args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
