"""Quantized KV caches on a GPU (int8 and float8_e4m3fn codes with a float32 scale per token and KV head;
include/fdc/kv_format.h): append_kv quantizes on the device into exactly the bytes the CPU op writes (which
tests/ops/test_quantized_cache.py holds to the float64 reference), decode_attention reads the codes in place, contiguous
and paged, with NaN-poisoned unused slots and pages, windows, soft-capping, sinks and explicit plans, and
prefill_attention the pages behind a cached prefix, each giving the reference's attention over the dequantized cache;
every e4m3 code is read as its value; a quantized decode step replays from a CUDA graph; opcheck on CUDA inputs; and
what has no CUDA kernel (int4 caches, float32 activations over codes) or breaks its alignment is refused by name. The
CPU-only float64 checks of the formats are in tests/ops/test_quantized_cache.py, whose helpers this reuses."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import (
    assert_close_to_cpu,
    assert_close_to_reference,
    capture_graph,
    case_generator,
    offsets,
    randn,
    random_block_table,
    random_layout,
    random_lengths,
    skip_without_cuda_kernels,
    strided_rows,
)
from fdc_ops import ops, reference
from test_quantized_cache import (
    _bytes,
    _empty_cache,
    appended_rows,
    check_every_e4m3_code,
    check_quantized_opcheck,
    check_quantized_prefill,
)

skip_without_cuda_kernels("append_kv", "decode_plan", "decode_attention", "prefill_attention")

DEVICE = torch.device("cuda")
NUM_SMS = torch.cuda.get_device_properties(DEVICE).multi_processor_count
CASES = int(os.environ.get("FDC_CUDA_CASES", 40))  # per test and run; fewer under compute-sanitizer
FORMATS = ops.CUDA_QUANTIZED_CACHE_DTYPES  # what the CUDA kernels read (int4 is refused)
DTYPES = (torch.float16, torch.bfloat16)  # the activations they take with a quantized cache


def _cuda_bytes(t: torch.Tensor) -> torch.Tensor:
    return _bytes(t).cpu()


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", range(CASES // 2))
def test_append_kv_quantizes_as_the_cpu_does(case, paged):
    """A prompt, then a step, into NaN-poisoned caches on the CPU and on the GPU: the same bytes (codes and scales,
    all-zero heads and heads holding a NaN included, nothing outside the new rows touched)."""
    gen, rng, replay = case_generator(f"cuda quantized append_kv paged={paged}", case)
    layout = random_layout(rng, max_kv_heads=5, max_group=1)
    fmt, dtype = rng.choice(FORMATS), rng.choice(DTYPES)
    batch = rng.randint(1, 4)
    prompt = random_lengths(rng, batch, choices=(0, 1, 5, 20, 33, 200))
    step = [rng.choice([0, 1]) for _ in range(batch)]
    capacity = max(p + s for p, s in zip(prompt, step)) + rng.randint(0, 3)
    page_size = rng.choice([1, 3, 16, 32])
    block_table, num_pages = (random_block_table([capacity] * batch, capacity, page_size, rng) if paged
                              else (None, 0))
    caches = _empty_cache(layout.qk_offsets, layout.v_offsets, fmt, batch, capacity, block_table, num_pages,
                          page_size)
    gpu_caches = [c.to(DEVICE) for c in caches]
    gpu_table = None if block_table is None else block_table.to(DEVICE)
    seqlens = torch.zeros(batch, dtype=torch.int32)
    for counts in (prompt, step):
        cu = offsets(counts)
        rows = int(cu[-1])
        k_new, v_new = appended_rows(gen, rng, layout, rows, dtype)
        ops.append_kv(*caches, k_new, v_new, cu, seqlens, layout.qk_offsets, layout.v_offsets, block_table)
        ops.append_kv(*gpu_caches, k_new.to(DEVICE), v_new.to(DEVICE), cu.to(DEVICE), seqlens.to(DEVICE),
                      layout.qk_offsets, layout.v_offsets, gpu_table)
        for name, cpu, gpu in zip("KV", caches, gpu_caches):
            assert torch.equal(_cuda_bytes(gpu), _bytes(cpu)), \
                f"the GPU's {name} cache bytes differ from the CPU's ({fmt}, {dtype}) {replay}"
        seqlens += torch.tensor(counts, dtype=torch.int32)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", range(CASES))
def test_decode_attention_reads_quantized_caches(case, paged):
    """Caches quantized by append_kv on the GPU (unused slots and pages poisoned: NaN scales, e4m3 NaN codes), read by
    the GPU decode with a random plan, window, soft-capping and sinks: the float64 reference's attention over the
    dequantized cache, and the CPU op's."""
    gen, rng, replay = case_generator(f"cuda quantized decode_attention paged={paged}", case)
    layout = random_layout(rng, max_kv_heads=6, max_group=17)
    fmt, dtype = rng.choice(FORMATS), rng.choice(DTYPES)
    batch = rng.randint(1, 6)
    lengths = random_lengths(rng, batch, choices=(0, 1, 5, 64, 65, 300, 700))
    if rng.random() < 0.3:
        lengths[0] = rng.choice([2500, 9000])  # split into chunks
    capacity = max(lengths) + rng.randint(0, 20)
    page_size = rng.choice([1, 3, 16, 64, 100, 256])
    block_table, num_pages = (random_block_table(lengths, capacity, page_size, rng) if paged else (None, 0))
    k_cache, v_cache = (c.to(DEVICE) for c in _empty_cache(layout.qk_offsets, layout.v_offsets, fmt, batch, capacity,
                                                           block_table, num_pages, page_size))
    gpu_table = None if block_table is None else block_table.to(DEVICE)
    cu = offsets(lengths)
    k_rows = randn((int(cu[-1]), layout.qk_width), dtype, gen)
    v_rows = randn((int(cu[-1]), layout.v_width), dtype, gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    ops.append_kv(k_cache, v_cache, k_rows.to(DEVICE), v_rows.to(DEVICE), cu.to(DEVICE),
                  torch.zeros_like(seqlens).to(DEVICE), layout.qk_offsets, layout.v_offsets, gpu_table)
    q = strided_rows(randn((batch, layout.group * layout.qk_width), dtype, gen), rng)
    scale = rng.uniform(0.05, 0.5)
    variants = dict(window_left=rng.choice([-1, -1, 0, 40, 70]), softcap=rng.choice([0.0, 0.0, 5.0]),
                    sinks=torch.randn(layout.num_kv_heads * layout.group, generator=gen) if rng.random() < 0.25
                    else None)
    gpu_variants = dict(variants, sinks=None if variants["sinks"] is None else variants["sinks"].to(DEVICE))
    plan = None
    if rng.random() < 0.5:
        plan = ops.decode_plan(seqlens.to(DEVICE), layout.qk_offsets, layout.v_offsets, layout.group,
                               num_workers=rng.choice([1, 3, NUM_SMS]), window_left=variants["window_left"])
    out = ops.decode_attention(q.to(DEVICE), k_cache, v_cache, seqlens.to(DEVICE), layout.qk_offsets,
                               layout.v_offsets, layout.group, scale, plan=plan, block_table=gpu_table,
                               **gpu_variants).cpu()
    k_host, v_host = k_cache.cpu(), v_cache.cpu()
    k_float = reference.dequantize_cache_ref(k_host, layout.qk_offsets, paged=paged)
    v_float = reference.dequantize_cache_ref(v_host, layout.v_offsets, paged=paged)
    args = (q, k_float, v_float, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, scale)
    expected = reference.decode_attention_ref(*args, block_table=block_table, **variants)
    torch_lowp = reference.decode_attention_ref(*args, block_table=block_table, compute_dtype=dtype, **variants)
    what = f"cuda decode_attention {fmt} {dtype} paged={paged} pages {page_size} {variants} {replay}"
    assert_close_to_reference(out, expected, torch_lowp, what)
    cpu = ops.decode_attention(q, k_host, v_host, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, scale,
                               block_table=block_table, **variants)
    assert_close_to_cpu(out, cpu, expected, torch_lowp, what)


@pytest.mark.parametrize("case", range(CASES))
def test_prefill_attention_reads_quantized_pages(case):
    """New tokens after a cached prefix in int8 or e4m3 pages written by the GPU's append_kv (a chunked prefill's
    later chunk, a prefix-cache hit), causal, with windows, soft-capping and sinks, unused slots poisoned: the float64
    reference's attention over the dequantized pages, and the CPU op's over the same bytes."""
    check_quantized_prefill("cuda quantized prefill_attention", case, DEVICE, FORMATS, DTYPES)


def test_decode_attention_reads_every_e4m3_code():
    """Each of e4m3fn's 254 finite codes as one key's dim and one value's, stored by the GPU's append_kv and read by its
    decode, contiguous and paged (tests/ops/test_quantized_cache.py's check on the GPU)."""
    check_every_e4m3_code(DEVICE, "cuda")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("paged", [False, True])
def test_quantized_decode_step_replays_from_a_cuda_graph(fmt, paged):
    """append_kv of one new row per request, decode_plan and decode_attention over an int8 or e4m3 cache, captured
    once and replayed after the lengths and the new rows change: each replay equals the eager step on a copy."""
    gen = torch.Generator().manual_seed(1)
    qk_offsets, v_offsets, group, batch, capacity = offsets([16, 40, 8]), offsets([24, 8, 32]), 3, 3, 512
    page_size = 32
    block_table = (torch.randperm(batch * capacity // page_size, generator=gen).view(batch, -1).to(torch.int32)
                   if paged else None)
    num_pages = batch * capacity // page_size if paged else 0
    k_cache, v_cache = (c.to(DEVICE) for c in _empty_cache(qk_offsets, v_offsets, fmt, batch, capacity, block_table,
                                                           num_pages, page_size))
    gpu_table = None if block_table is None else block_table.to(DEVICE)
    lengths = torch.tensor([100, 1, 300], dtype=torch.int32)
    prompt = offsets(lengths.tolist())
    ops.append_kv(k_cache, v_cache, randn((int(prompt[-1]), 64), torch.bfloat16, gen).to(DEVICE),
                  randn((int(prompt[-1]), 64), torch.bfloat16, gen).to(DEVICE), prompt.to(DEVICE),
                  torch.zeros(batch, dtype=torch.int32, device=DEVICE), qk_offsets, v_offsets, gpu_table)
    seqlens = lengths.to(DEVICE)
    one_each = offsets([1] * batch).to(DEVICE)
    k_new, v_new = (torch.zeros(batch, 64, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    q = torch.zeros(batch, group * 64, dtype=torch.bfloat16, device=DEVICE)
    after = torch.empty_like(seqlens)

    def step(kc, vc, lens, out_lengths):
        ops.append_kv(kc, vc, k_new, v_new, one_each, lens, qk_offsets, v_offsets, gpu_table)
        torch.add(lens, 1, out=out_lengths)
        plan = ops.decode_plan(out_lengths, qk_offsets, v_offsets, group)
        return ops.decode_attention(q, kc, vc, out_lengths, qk_offsets, v_offsets, group, 0.2, plan=plan,
                                    block_table=gpu_table)

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    graph, graph_out = capture_graph(lambda: step(k_cache, v_cache, seqlens, after))
    # capture_graph ran the step once eagerly (its warm-up): the eager copy takes that step too
    step(eager_k, eager_v, seqlens, torch.empty_like(seqlens))
    for round_ in range(3):
        seqlens.copy_(after)
        k_new.copy_(randn((batch, 64), torch.bfloat16, gen))
        v_new.copy_(randn((batch, 64), torch.bfloat16, gen))
        q.copy_(randn((batch, group * 64), torch.bfloat16, gen))
        eager_lengths = torch.empty_like(seqlens)
        expected = step(eager_k, eager_v, seqlens, eager_lengths)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(after, eager_lengths), f"round {round_}: lengths"
        assert torch.equal(_cuda_bytes(k_cache), _cuda_bytes(eager_k)), f"round {round_}: K cache bytes"
        assert torch.equal(_cuda_bytes(v_cache), _cuda_bytes(eager_v)), f"round {round_}: V cache bytes"
        assert torch.equal(graph_out, expected), f"round {round_}: the replayed output differs from the eager one"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("paged", [False, True])
def test_quantized_ops_pass_opcheck_on_cuda(fmt, paged):
    check_quantized_opcheck(fmt, paged, DEVICE)


def test_what_has_no_cuda_kernel_is_refused():
    """int4 caches, and float32 queries or rows with int8 / e4m3 caches, in decode_attention, append_kv and
    prefill_attention (pages): errors naming the op and what to use."""
    qk_offsets = v_offsets = offsets([8, 16])
    seqlens = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    int4 = torch.zeros(1, 4, ops.cache_width(qk_offsets, torch.uint8), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(RuntimeError, match="fdc::decode_attention: k_cache is an int4 cache"):
        ops.decode_attention(torch.randn(1, 24, dtype=torch.bfloat16, device=DEVICE), int4, int4, seqlens, qk_offsets,
                             v_offsets, 1, 0.3)
    rows, cu = torch.randn(1, 24, device=DEVICE), torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(RuntimeError, match="fdc::append_kv: k_cache is an int4 cache"):
        ops.append_kv(int4, int4, rows.bfloat16(), rows.bfloat16(), cu, seqlens, qk_offsets, v_offsets)
    for fmt in FORMATS:
        cache = torch.zeros(1, 4, ops.cache_width(qk_offsets, fmt), dtype=torch.uint8, device=DEVICE).view(fmt)
        with pytest.raises(RuntimeError, match="fdc::decode_attention: q is float32, but the CUDA decode_attention "
                                               "takes a quantized cache"):
            ops.decode_attention(torch.randn(1, 24, device=DEVICE), cache, cache, seqlens, qk_offsets, v_offsets, 1,
                                 0.3)
        before = _cuda_bytes(cache).clone()
        with pytest.raises(RuntimeError, match="fdc::append_kv: k is float32, but the CUDA append_kv takes a "
                                               "quantized cache"):
            ops.append_kv(cache, cache, rows, rows, cu, seqlens, qk_offsets, v_offsets)
        assert torch.equal(_cuda_bytes(cache), before), "a refused append_kv wrote to the cache"
    table = torch.tensor([[0]], dtype=torch.int32, device=DEVICE)
    cu_q, cu_k = cu, torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    for fmt in (torch.uint8, *FORMATS):
        pages = torch.zeros(1, ops.cache_width(qk_offsets, fmt), 4, dtype=torch.uint8, device=DEVICE).view(fmt)
        q_dtype, refusal = ((torch.bfloat16, "k is an int4 cache") if fmt == torch.uint8 else
                            (torch.float32, "q is float32, but the CUDA prefill_attention takes a quantized cache"))
        with pytest.raises(RuntimeError, match=f"fdc::prefill_attention: {refusal}"):
            ops.prefill_attention(torch.randn(1, 24, dtype=q_dtype, device=DEVICE), pages, pages, cu_q, cu_k,
                                  qk_offsets, v_offsets, 1, 0.3, True, block_table=table)


def test_misaligned_quantized_caches_are_refused():
    """A quantized cache whose start is 4-byte aligned (as its float32 scales need everywhere) but not 16-byte aligned
    (as the CUDA kernels' packets need): errors naming the op and the cache, and nothing written."""
    qk_offsets = v_offsets = offsets([8, 16])
    width = ops.cache_width(qk_offsets, torch.int8)
    seqlens = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    rows, q = (torch.randn(1, 24, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    storage = torch.zeros(4 * width + 16, dtype=torch.int8, device=DEVICE)
    cache = storage[4:4 + 4 * width].view(1, 4, width)  # 4 bytes past an aligned start
    with pytest.raises(RuntimeError, match="fdc::append_kv: k_cache \\(a quantized cache\\) must start at a "
                                           "16-byte aligned address"):
        ops.append_kv(cache, cache, rows, rows, cu, seqlens, qk_offsets, v_offsets)
    assert not storage.any(), "a refused append_kv wrote to the cache"
    with pytest.raises(RuntimeError, match="fdc::decode_attention: k_cache \\(a quantized cache\\) must start at a "
                                           "16-byte aligned address"):
        ops.decode_attention(q, cache, cache, seqlens, qk_offsets, v_offsets, 1, 0.3)
