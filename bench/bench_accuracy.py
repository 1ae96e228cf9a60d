"""Accuracy against torch: each attention op's error against the float64 reference, as a multiple of what the same
computation in plain PyTorch at the input's dtype loses (FlashAttention's rule, which the op tests apply:
tests/conftest.py), over freshly drawn random cases, per op, variant, CPU kernel path and dtype.

What is measured, per case: the op's largest error against float64 (fdc_ops/reference.py), PyTorch's own (the
reference with compute_dtype = the input's dtype), their ratio, and the op's excess over twice PyTorch's error in ulps
of the output's dtype at the output's magnitude (+0.3, as the tests' floor: tests/conftest.py). Per group of cases:
the ratio's median, 99th percentile and largest, the largest excess, and how many cases break the tests' rule. The
cases are drawn as the op tests draw theirs (random packed layouts with widths up to 256, GQA up to 16, empty and
1-token requests, contiguous and shuffled paged caches of 1 to 256 tokens a page, soft-capping at caps of 1 to 5000);
the seeds are fixed, so a run repeats. On a GPU the same cases run the CUDA kernels, in float32, float16 and bfloat16
(the CPU runs float32 and bfloat16 on each kernel path).

Prints a table and writes JSON to bench/results/ops/ (or --out) with the device, torch version and commit. --quick
draws 12 cases per group instead of --cases (default 150).
"""

from __future__ import annotations

import math
import os
import random
import sys
import zlib

import torch

# bench_common first: it puts the repository root on sys.path for fdc_ops; the tests' generators come from tests/.
from bench_common import bench_parser, print_header, provenance, setup, write_report
from bench_results import ROOT, percentile

sys.path.insert(0, str(ROOT / "tests"))
from conftest import (  # noqa: E402  (the tests' own case generators, so these cases are the tests' kind)
    nan_padded_caches,
    offsets,
    randn,
    random_block_table,
    random_layout,
    random_lengths,
    to_pages,
)
from fdc_ops import ops, reference  # noqa: E402
from fdc_ops.apps.provenance import device_name  # noqa: E402

SOFT_CAPS = (1.0, 30.0, 50.0, 500.0, 5000.0)


def max_error(actual: torch.Tensor, expected64: torch.Tensor) -> float:
    return float((actual.double() - expected64).abs().max()) if actual.numel() else 0.0


def decode_case(rng: random.Random, gen: torch.Generator, dtype: torch.dtype, paged: bool, capped: bool,
                device: torch.device):
    """(op output, float64 reference, torch at dtype) of one random decode_attention case."""
    layout = random_layout(rng, max_group=16)
    batch = rng.randint(1, 6)
    lengths = random_lengths(rng, batch, choices=(0, 1, 5, 64, 65, 300, 700))
    if rng.random() < 0.2:
        lengths[0] = 3000  # split into chunks or pieces
    capacity = max(lengths) + 3
    k_cache, v_cache = nan_padded_caches(layout, lengths, capacity, dtype, gen)
    q = randn((batch, layout.group * layout.qk_width), dtype, gen)
    scale = rng.uniform(0.05, 0.5)
    softcap = rng.choice(SOFT_CAPS) if capped else 0.0
    block_table = None
    if paged:
        page_size = rng.choice([1, 3, 16, 64, 100, 256])
        block_table, num_pages = random_block_table(lengths, capacity, page_size, rng)
        k_cache = to_pages(k_cache, lengths, block_table, num_pages, page_size)
        v_cache = to_pages(v_cache, lengths, block_table, num_pages, page_size)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    args = (q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, scale)
    out = ops.decode_attention(q.to(device), k_cache.to(device), v_cache.to(device), seqlens.to(device),
                               *args[4:], softcap=softcap,
                               block_table=None if block_table is None else block_table.to(device)).cpu()
    expected = reference.decode_attention_ref(*args, block_table=block_table, softcap=softcap)
    lowp = reference.decode_attention_ref(*args, block_table=block_table, softcap=softcap, compute_dtype=dtype)
    return out, expected, lowp


def prefill_case(rng: random.Random, gen: torch.Generator, dtype: torch.dtype, paged: bool, capped: bool,
                 device: torch.device):
    """(op output, float64 reference, torch at dtype) of one random prefill_attention case."""
    layout = random_layout(rng)
    batch = rng.randint(1, 4)
    lengths_q = random_lengths(rng, batch)
    lengths_k = [s + rng.choice([0, 9, 40]) for s in lengths_q]
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q = randn((int(cu_q[-1]), layout.group * layout.qk_width), dtype, gen)
    k = randn((int(cu_k[-1]), layout.qk_width), dtype, gen)
    v = randn((int(cu_k[-1]), layout.v_width), dtype, gen)
    causal = rng.random() < 0.5
    softcap = rng.choice(SOFT_CAPS) if capped else 0.0
    block_table = None
    if paged:
        page_size = rng.choice([1, 3, 16, 64, 256])
        capacity = max(lengths_k)
        block_table, num_pages = random_block_table(lengths_k, capacity, page_size, rng)
        rows_k = torch.zeros(batch, capacity, layout.qk_width, dtype=dtype)
        rows_v = torch.zeros(batch, capacity, layout.v_width, dtype=dtype)
        for b in range(batch):
            rows_k[b, :lengths_k[b]], rows_v[b, :lengths_k[b]] = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        k = to_pages(rows_k, lengths_k, block_table, num_pages, page_size)
        v = to_pages(rows_v, lengths_k, block_table, num_pages, page_size)
    common = (layout.qk_offsets, layout.v_offsets, layout.group, rng.uniform(0.05, 0.5), causal)
    out = ops.prefill_attention(q.to(device), k.to(device), v.to(device), cu_q.to(device), cu_k.to(device), *common,
                                softcap=softcap,
                                block_table=None if block_table is None else block_table.to(device)).cpu()
    args = (q, k, v, cu_q, cu_k, *common)
    expected = reference.prefill_attention_ref(*args, softcap=softcap, block_table=block_table)
    lowp = reference.prefill_attention_ref(*args, softcap=softcap, block_table=block_table, compute_dtype=dtype)
    return out, expected, lowp


def measure(op: str, paged: bool, capped: bool, dtype: torch.dtype, cases: int, device: torch.device) -> dict:
    """One group's cases: ratio percentiles, largest excess over twice torch's error (ulps) and rule breaks."""
    draw = decode_case if op == "decode_attention" else prefill_case
    ratios, excesses = [], []
    for case in range(cases):
        seed = zlib.crc32(f"{op} {paged} {capped} {dtype} {case}".encode())
        out, expected, lowp = draw(random.Random(seed), torch.Generator().manual_seed(seed), dtype, paged, capped,
                                   device)
        if expected.numel() == 0:
            continue
        error, torch_error = max_error(out, expected), max_error(lowp, expected)
        binade = 2.0 ** math.floor(math.log2(float(expected.abs().max()) + 0.3))
        ulp = binade * torch.finfo(dtype).eps
        if torch_error > 0:
            ratios.append(error / torch_error)
        excesses.append((error - 2 * torch_error) / ulp)
    floor_ulps = max(3 * torch.finfo(torch.float32).eps / torch.finfo(dtype).eps, 1.0)  # tests/conftest.py's floor
    return {"op": op, "paged": paged, "softcap": capped, "dtype": str(dtype).removeprefix("torch."),
            "cases": len(excesses), "ratio_p50": percentile(ratios, 0.5), "ratio_p99": percentile(ratios, 0.99),
            "ratio_max": max(ratios), "excess_ulps_max": max(excesses),
            "rule_breaks": sum(x > floor_ulps for x in excesses)}


def main() -> None:
    parser = bench_parser(__doc__.split("\n\n")[0], "unused (accuracy, not time)", "ops")
    parser.add_argument("--cases", type=int, default=150, help="random cases per group")
    args = parser.parse_args()
    device, _ = setup(args)
    cases = 12 if args.quick else args.cases
    if device.type == "cpu":
        paths = ["", "avx512", "portable"]  # FDC_CPU_ISA: this CPU's own, the float32 AVX-512 path, portable
        dtypes = [torch.float32, torch.bfloat16]
    else:
        paths, dtypes = [""], [torch.float32, torch.float16, torch.bfloat16]
    name = device_name(device)
    report = provenance("accuracy", name, device, args.quick)
    print_header(f"accuracy against torch at the input's dtype, {cases} cases per group (FlashAttention's rule: "
                 "error <= 2x torch's + floor)")
    print(f"{'op':<18} {'cache':<6} {'capped':<6} {'dtype':<9} {'path':<9} {'cases':>5} {'p50':>6} {'p99':>6} "
          f"{'max':>6} {'excess ulps':>11} {'breaks':>6}")
    rows = []
    for path in paths:
        os.environ["FDC_CPU_ISA"] = path
        for op in ("prefill_attention", "decode_attention"):
            for paged in (False, True):
                for capped in (False, True):
                    for dtype in dtypes:
                        row = {"path": path or "default", **measure(op, paged, capped, dtype, cases, device)}
                        rows.append(row)
                        print(f"{op:<18} {'paged' if paged else 'rows':<6} {'yes' if capped else 'no':<6} "
                              f"{row['dtype']:<9} {row['path']:<9} {row['cases']:>5} {row['ratio_p50']:>6.2f} "
                              f"{row['ratio_p99']:>6.2f} {row['ratio_max']:>6.2f} {row['excess_ulps_max']:>11.1f} "
                              f"{row['rule_breaks']:>6}", flush=True)
    report["rows"] = rows
    write_report(report, args.out, name, "accuracy", args.quick)


if __name__ == "__main__":
    main()
