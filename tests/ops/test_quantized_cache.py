"""Quantized KV caches (int8, float8_e4m3fn, int4 two per byte in uint8; include/fdc/kv_format.h): append_kv
quantizes rows as the float64 reference does, touching nothing else; decode_attention reads the codes in place, on
every CPU path, and prefill_attention the pages, giving the reference's attention over the dequantized cache; bad
caches get errors naming the op and the argument."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import (
    assert_close_to_cpu,
    assert_close_to_reference,
    case_generator,
    cases,
    offsets,
    randn,
    random_block_table,
    random_layout,
    random_lengths,
    strided_rows,
)
from fdc_ops import ops, reference
from test_ops import CASES, CPU_ISAS, DTYPES, READ_AHEADS

FORMATS = (torch.int8, torch.float8_e4m3fn, torch.uint8)  # uint8: int4 codes, two per byte
POISON = 0xFF  # every byte of an unwritten slot: code -1 (int8, both int4 nibbles) or NaN (e4m3), and a NaN scale


def _empty_cache(qk_offsets, v_offsets, dtype, batch: int, capacity: int, block_table, num_pages: int,
                 page_size: int):
    """NaN-poisoned (every byte POISON) K and V caches, contiguous or paged."""
    caches = []
    for offs in (qk_offsets, v_offsets):
        width = ops.cache_width(offs, dtype)
        shape = (batch, capacity, width) if block_table is None else (num_pages, width, page_size)
        caches.append(torch.full(shape, POISON, dtype=torch.uint8).view(dtype))
    return caches


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _dims(offs: torch.Tensor) -> list[int]:
    values = offs.tolist()
    return [values[j + 1] - values[j] for j in range(len(values) - 1)]


def _rows_of(cache: torch.Tensor, b: int, t0: int, t1: int, block_table, paged: bool) -> torch.Tensor:
    """Rows [t0, t1) of request b of a float (dequantized) cache, token-major."""
    if not paged:
        return cache[b, t0:t1]
    page_size = cache.shape[2]
    return torch.stack([cache[int(block_table[b, t // page_size]), :, t % page_size] for t in range(t0, t1)]) \
        if t1 > t0 else cache.new_zeros((0, cache.shape[1]))


def appended_rows(gen, rng, layout, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """New K and V rows for append_kv: keys of a random magnitude in non-contiguous rows, sometimes an all-zero head
    (scale 0, zero codes) in the first key row and a NaN (a NaN scale, zero codes) in the last value row."""
    k_new = strided_rows(randn((rows, layout.qk_width), torch.float32, gen).mul(rng.choice([0.01, 1, 300])).to(dtype),
                         rng)
    v_new = randn((rows, layout.v_width), dtype, gen)
    if rows and rng.random() < 0.3:
        k_new[0, : layout.qk_dims[0]] = 0
    if rows and rng.random() < 0.3:
        v_new[rows - 1, rng.randrange(layout.v_width)] = float("nan")
    return k_new, v_new


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", cases(CASES // 2))
def test_append_kv_quantizes_like_the_reference(case, paged):
    """Two appends (a prompt, then a step) into a poisoned cache: the written rows hold exactly the reference's scales
    and codes (all-zero heads and heads holding a NaN included), and every byte outside them is untouched."""
    gen, rng, replay = case_generator(f"quantized append_kv paged={paged}", case)
    layout = random_layout(rng, max_kv_heads=5, max_group=1)
    fmt, dtype = rng.choice(FORMATS), rng.choice(DTYPES)
    batch = rng.randint(1, 4)
    prompt = random_lengths(rng, batch, choices=(0, 1, 5, 20, 33))
    step = [rng.choice([0, 1]) for _ in range(batch)]
    capacity = max(p + s for p, s in zip(prompt, step)) + rng.randint(0, 3)
    page_size = rng.choice([1, 3, 16])
    block_table, num_pages = (random_block_table([capacity] * batch, capacity, page_size, rng) if paged
                              else (None, 0))
    k_cache, v_cache = _empty_cache(layout.qk_offsets, layout.v_offsets, fmt, batch, capacity, block_table, num_pages,
                                    page_size)
    seqlens = torch.zeros(batch, dtype=torch.int32)
    written_k, written_v = [], []
    for counts in (prompt, step):
        cu = offsets(counts)
        rows = int(cu[-1])
        k_new, v_new = appended_rows(gen, rng, layout, rows, dtype)
        before_k, before_v = _bytes(k_cache).clone(), _bytes(v_cache).clone()
        ops.append_kv(k_cache, v_cache, k_new, v_new, cu, seqlens, layout.qk_offsets, layout.v_offsets, block_table)
        # Bytes outside the appended rows are untouched: mark the appended rows in a copy of the old bytes.
        expected_untouched_k, expected_untouched_v = before_k.clone(), before_v.clone()
        actual_k, actual_v = _bytes(k_cache).clone(), _bytes(v_cache).clone()
        for cache_bytes in (expected_untouched_k, expected_untouched_v, actual_k, actual_v):
            for b in range(batch):
                for t in range(int(seqlens[b]), int(seqlens[b]) + counts[b]):
                    if block_table is None:
                        cache_bytes[b, t] = 0
                    else:
                        page = int(block_table[b, t // page_size])
                        width = cache_bytes.shape[1] - 4 * layout.num_kv_heads
                        cache_bytes[page, :width, t % page_size] = 0
                        scale_bytes = cache_bytes[page, width:].reshape(layout.num_kv_heads, page_size, 4)
                        scale_bytes[:, t % page_size] = 0
        assert torch.equal(actual_k, expected_untouched_k), f"append_kv wrote outside its K rows {replay}"
        assert torch.equal(actual_v, expected_untouched_v), f"append_kv wrote outside its V rows {replay}"
        written_k.append((k_new, seqlens.clone(), counts))
        written_v.append((v_new, seqlens.clone(), counts))
        seqlens += torch.tensor(counts, dtype=torch.int32)

    for cache, offs, written in ((k_cache, layout.qk_offsets, written_k), (v_cache, layout.v_offsets, written_v)):
        stored = reference.dequantize_cache_ref(cache, offs, paged=paged)
        for rows, start, counts in written:
            codes, scales = reference.quantize_kv_ref(rows, offs, fmt)
            expected = codes * torch.repeat_interleave(scales, torch.tensor(_dims(offs)), dim=1)
            cu = offsets(counts).tolist()
            for b in range(batch):
                got = _rows_of(stored, b, int(start[b]), int(start[b]) + counts[b], block_table, paged)
                want = expected[cu[b]:cu[b + 1]]
                assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), \
                    f"quantized rows are not the reference's {fmt} {dtype} {replay}"


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", cases(CASES // 2))
def test_decode_attention_reads_quantized_caches(case, paged, isa, monkeypatch):
    """Caches filled by append_kv (unused slots poisoned: NaN scales, e4m3 NaN codes), read by every CPU path and
    read-ahead, sometimes with a window (contiguous), soft-capping or sinks: the float64 reference's attention over
    the dequantized cache."""
    check_quantized_decode(f"quantized decode_attention paged={paged}", case, paged, isa, monkeypatch)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", cases(2))
def test_decode_attention_reads_quantized_caches_of_many_kv_heads(case, fmt, paged, monkeypatch):
    """17 to 40 KV heads (multi-head models: Llama-2-7B's 32), the default CPU path: a contiguous row's scales of 16
    heads fill one register, so the decode gathers a block's scales for the rest in a second one."""
    check_quantized_decode(f"quantized decode_attention {fmt} paged={paged}, many KV heads", case, paged, "",
                           monkeypatch, fmt=fmt, kv_heads=(17, 40), max_group=2)


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("fmt", [torch.int8, torch.uint8])
@pytest.mark.parametrize("case", cases(CASES // 4))
def test_decode_attention_reads_integer_caches_with_half_precision_queries(case, fmt, paged, isa, monkeypatch):
    """The integer caches' own paths with half-precision queries, every case, where the CPU has AVX-512-BF16 and
    VNNI: int8 rows and pages by int16 queries and weights and vpdpwssd (a page's columns as rows for the scores, its
    token runs paired for the value sums); int4 rows' scores by vpdpbusd on the nibbles against 14-bit queries split
    in two int8 parts, their value sums as int8's; int4 pages read packed, a byte row's byte as a pair of columns; as
    above."""
    check_quantized_decode(f"integer caches {fmt} paged={paged}, half-precision queries", case, paged, isa,
                           monkeypatch, fmt=fmt, dtypes=(torch.bfloat16, torch.float16))


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", cases(CASES // 4))
def test_decode_attention_reads_e4m3_with_bf16_queries(case, paged, isa, monkeypatch):
    """e4m3 caches with bf16 queries, every case: where the CPU has AVX-512-BF16 the codes are converted to bf16 as
    they are loaded and go through the bf16 cache's kernels (rows, 16-token pages, wider pages, and the float value
    sums of pages of other sizes); as above."""
    check_quantized_decode(f"e4m3 paged={paged}, bf16 queries", case, paged, isa, monkeypatch,
                           fmt=torch.float8_e4m3fn, dtypes=(torch.bfloat16,))


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_decode_attention_reads_every_e4m3_code(isa, monkeypatch):
    """Each of e4m3fn's 254 finite codes, subnormals and both zeros included, as one key's dim and one value's, in a
    request of its own (two keys: that one and a zero one), contiguous and in pages of 16, 32 and 3 tokens: the query
    is scaled so that the key's score is 1, so a code read as any other value moves the output well beyond bf16's
    rounding."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    check_every_e4m3_code(torch.device("cpu"), isa)


def check_every_e4m3_code(device: torch.device, where: str):
    """test_decode_attention_reads_every_e4m3_code's check, the caches written and read on `device` (the reference
    on the CPU)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).double()
    batch, width = len(codes), 8
    qk_offsets = v_offsets = torch.tensor([0, width], dtype=torch.int32)
    rows = torch.zeros(batch, 2, width, dtype=torch.float64)
    rows[:, 1, 0] = values
    rows[:, 1, 1] = 448.0  # each row's scale is 448 / 448 = 1, so dim 0 stores the code itself
    rows = rows.reshape(2 * batch, width).to(torch.bfloat16)
    q = torch.zeros(batch, width, dtype=torch.float64)
    q[:, 0] = torch.where(values == 0, 1.0, 1.0 / values)
    q = q.to(torch.bfloat16)
    seqlens = torch.full((batch,), 2, dtype=torch.int32)
    cu = offsets([2] * batch)
    for page_size in (None, 16, 32, 3):
        paged = page_size is not None
        block_table = torch.arange(batch, dtype=torch.int32).view(batch, 1) if paged else None
        table_there = None if block_table is None else block_table.to(device)
        k_cache, v_cache = (c.to(device) for c in _empty_cache(qk_offsets, v_offsets, torch.float8_e4m3fn, batch, 2,
                                                               block_table, batch if paged else 0, page_size or 0))
        ops.append_kv(k_cache, v_cache, rows.to(device), rows.to(device), cu.to(device),
                      torch.zeros_like(seqlens).to(device), qk_offsets, v_offsets, table_there)
        k_float = reference.dequantize_cache_ref(k_cache.cpu(), qk_offsets, paged=paged)
        v_float = reference.dequantize_cache_ref(v_cache.cpu(), v_offsets, paged=paged)
        stored = torch.stack([_rows_of(k_float, b, 1, 2, block_table, paged)[0, 0] for b in range(batch)])
        assert torch.equal(stored, values.to(stored.dtype)), f"append_kv did not store each code, pages {page_size}"
        out = ops.decode_attention(q.to(device), k_cache, v_cache, seqlens.to(device), qk_offsets, v_offsets, 1, 1.0,
                                   block_table=table_there).cpu()
        expected = reference.decode_attention_ref(q, k_float, v_float, seqlens, qk_offsets, v_offsets, 1, 1.0,
                                                  block_table=block_table)
        message = f"e4m3 codes read wrongly ({where}, pages {page_size})"
        torch.testing.assert_close(out.double(), expected.double(), rtol=2 ** -7, atol=0.0,
                                   msg=lambda m, message=message: f"{message}: {m}")


def check_quantized_decode(name: str, case: int, paged: bool, isa: str, monkeypatch, fmt=None, dtypes=DTYPES,
                           kv_heads: tuple[int, int] = (1, 6), max_group: int = 10):
    """One random decode_attention case over a quantized cache (of ``fmt``, or a random format; kv_heads: the range
    of H_kv) against the float64 reference."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng, replay = case_generator(name, case)
    read_ahead = rng.choice(READ_AHEADS)
    monkeypatch.setenv("FDC_CPU_READ_AHEAD", read_ahead)
    layout = random_layout(rng, min_kv_heads=kv_heads[0], max_kv_heads=kv_heads[1], max_group=max_group)
    fmt, dtype = fmt or rng.choice(FORMATS), rng.choice(dtypes)
    batch = rng.randint(1, 5)
    lengths = random_lengths(rng, batch, choices=(0, 1, 5, 64, 65, 300, 700))
    if rng.random() < 0.2:
        lengths[0] = 2500  # split into pieces or chunks
    capacity = max(lengths) + rng.randint(0, 20)
    page_size = rng.choice([1, 3, 16, 64, 100, 256])
    block_table, num_pages = (random_block_table(lengths, capacity, page_size, rng) if paged else (None, 0))
    k_cache, v_cache = _empty_cache(layout.qk_offsets, layout.v_offsets, fmt, batch, capacity, block_table, num_pages,
                                    page_size)
    cu = offsets(lengths)
    k_rows = randn((int(cu[-1]), layout.qk_width), dtype, gen)
    v_rows = randn((int(cu[-1]), layout.v_width), dtype, gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    ops.append_kv(k_cache, v_cache, k_rows, v_rows, cu, torch.zeros_like(seqlens), layout.qk_offsets,
                  layout.v_offsets, block_table)
    q = strided_rows(randn((batch, layout.group * layout.qk_width), dtype, gen), rng)
    scale = rng.uniform(0.05, 0.5)
    window_left = rng.choice([-1, -1, 0, 40]) if not paged else rng.choice([-1, -1, 2, 70])
    softcap = rng.choice([0.0, 0.0, 5.0])
    sinks = torch.randn(layout.num_kv_heads * layout.group, generator=gen) if rng.random() < 0.25 else None
    plan = None
    if rng.random() < 0.5:
        plan = ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group,
                               num_workers=rng.choice([1, 3, 8]), window_left=window_left)
    variants = dict(window_left=window_left, softcap=softcap, sinks=sinks)
    out = ops.decode_attention(q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group,
                               scale, plan=plan, block_table=block_table, **variants)
    k_float = reference.dequantize_cache_ref(k_cache, layout.qk_offsets, paged=paged)
    v_float = reference.dequantize_cache_ref(v_cache, layout.v_offsets, paged=paged)
    args = (q, k_float, v_float, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, scale)
    expected = reference.decode_attention_ref(*args, block_table=block_table, **variants)
    torch_lowp = reference.decode_attention_ref(*args, block_table=block_table, compute_dtype=dtype, **variants)
    assert_close_to_reference(out, expected, torch_lowp,
                              f"decode_attention {fmt} paged={paged} read_ahead={read_ahead!r} {variants} {replay}")


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("case", cases(CASES // 3))
def test_prefill_attention_reads_quantized_pages(case, isa, monkeypatch):
    """New tokens after a cached prefix, every key and value in a quantized paged cache (append_kv wrote them all,
    prefix and new rows, as a chunked prefill does), causal, sometimes windowed, soft-capped or with sinks: the
    float64 reference's attention over the dequantized pages; unused slots poisoned."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    check_quantized_prefill("quantized prefill_attention", case, torch.device("cpu"), FORMATS, DTYPES)


def check_quantized_prefill(name: str, case: int, device: torch.device, formats, dtypes) -> None:
    """One random prefill_attention case over quantized pages on ``device`` (caches written there by append_kv)
    against the float64 reference, and, off the CPU, against the CPU op over the same bytes."""
    gen, rng, replay = case_generator(name, case)
    layout = random_layout(rng, max_kv_heads=5, max_group=6)
    fmt, dtype = rng.choice(formats), rng.choice(dtypes)
    batch = rng.randint(1, 4)
    new = random_lengths(rng, batch, choices=(0, 1, 7, 33, 80))
    prefix = random_lengths(rng, batch, choices=(0, 5, 64, 300))
    keys = [p + n for p, n in zip(prefix, new)]
    capacity = max(keys) + rng.randint(0, 9)
    page_size = rng.choice([1, 3, 16, 64, 256])
    block_table, num_pages = random_block_table(keys, capacity, page_size, rng)
    k_pages, v_pages = (c.to(device) for c in _empty_cache(layout.qk_offsets, layout.v_offsets, fmt, batch, capacity,
                                                           block_table, num_pages, page_size))
    cu_k, table = offsets(keys), block_table.to(device)
    ops.append_kv(k_pages, v_pages, randn((int(cu_k[-1]), layout.qk_width), dtype, gen).to(device),
                  randn((int(cu_k[-1]), layout.v_width), dtype, gen).to(device), cu_k.to(device),
                  torch.zeros(batch, dtype=torch.int32, device=device), layout.qk_offsets, layout.v_offsets, table)
    cu_q = offsets(new)
    q = randn((int(cu_q[-1]), layout.group * layout.qk_width), dtype, gen)
    window_left = rng.choice([-1, -1, 20])
    softcap = rng.choice([0.0, 0.0, 5.0])
    sinks = torch.randn(layout.num_kv_heads * layout.group, generator=gen) if rng.random() < 0.25 else None
    args = (layout.qk_offsets, layout.v_offsets, layout.group, rng.uniform(0.05, 0.5), True)
    out = ops.prefill_attention(q.to(device), k_pages, v_pages, cu_q.to(device), cu_k.to(device), *args,
                                window_left=window_left, softcap=softcap,
                                sinks=None if sinks is None else sinks.to(device), block_table=table).cpu()
    k_host, v_host = k_pages.cpu(), v_pages.cpu()
    k_float = reference.dequantize_cache_ref(k_host, layout.qk_offsets, paged=True)
    v_float = reference.dequantize_cache_ref(v_host, layout.v_offsets, paged=True)
    ref_args = (q, k_float, v_float, cu_q, cu_k, *args, window_left, softcap, sinks)
    expected = reference.prefill_attention_ref(*ref_args, block_table=block_table)
    torch_lowp = reference.prefill_attention_ref(*ref_args, block_table=block_table, compute_dtype=dtype)
    what = (f"{device.type} prefill over {fmt} pages of {page_size}, {dtype}, window={window_left}, softcap={softcap}, "
            f"sinks={sinks is not None} {replay}")
    assert_close_to_reference(out, expected, torch_lowp, what)
    if device.type != "cpu":
        cpu = ops.prefill_attention(q, k_host, v_host, cu_q, cu_k, *args, window_left=window_left, softcap=softcap,
                                    sinks=sinks, block_table=block_table)
        assert_close_to_cpu(out, cpu, expected, torch_lowp, what)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_decode_stays_near_the_float_cache(fmt):
    """What quantization costs the attention itself: against the same rows in a float32 cache, the output's error
    stays near what per-token scales give (measured 1.2% of the output's size for int8, 5.5% for e4m3's 3 mantissa
    bits and 15.6% for int4's 15 levels; bounds 3%, 12% and 30%), far below what a scale missed or applied twice
    would give (the size itself)."""
    gen = torch.Generator().manual_seed(5)
    layout_offsets, group, length = offsets([64, 32, 16]), 3, 500
    width = int(layout_offsets[-1])
    k_rows, v_rows = randn((length, width), torch.float32, gen), randn((length, width), torch.float32, gen)
    q = randn((1, group * width), torch.float32, gen)
    seqlens, cu = torch.tensor([length], dtype=torch.int32), offsets([length])
    outs = []
    for dtype in (torch.float32, fmt):
        caches = [torch.zeros(1, length, ops.cache_width(layout_offsets, dtype), dtype=dtype) for _ in range(2)]
        ops.append_kv(*caches, k_rows, v_rows, cu, torch.zeros_like(seqlens), layout_offsets, layout_offsets)
        outs.append(ops.decode_attention(q, *caches, seqlens, layout_offsets, layout_offsets, group, 0.3))
    error = float((outs[1] - outs[0]).abs().max() / outs[0].abs().max())
    bound = {torch.int8: 0.03, torch.float8_e4m3fn: 0.12, torch.uint8: 0.3}[fmt]
    assert 0 < error < bound, f"{fmt}: relative error {error:.4f}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("paged", [False, True])
def test_quantized_ops_pass_opcheck(fmt, paged):
    check_quantized_opcheck(fmt, paged, torch.device("cpu"))


def check_quantized_opcheck(fmt: torch.dtype, paged: bool, device: torch.device):
    """opcheck of decode_attention and append_kv over a quantized cache on `device` (bf16 activations), and of
    prefill_attention over its pages."""
    qk_offsets, v_offsets, group = offsets([8, 16]), offsets([16, 8]), 2
    gen = torch.Generator().manual_seed(0)
    seqlens = torch.tensor([3, 2], dtype=torch.int32, device=device)
    one_row_each = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    block_table = torch.tensor([[1, 0], [2, -1]], dtype=torch.int32, device=device) if paged else None
    rng = random.Random(0)
    k_cache, v_cache = (c.to(device) for c in _empty_cache(qk_offsets, v_offsets, fmt, 2, 6, block_table, 3, 4))
    ops.append_kv(k_cache, v_cache, randn((5, 24), torch.bfloat16, gen).to(device),
                  randn((5, 24), torch.bfloat16, gen).to(device), offsets([3, 2]).to(device),
                  torch.zeros(2, dtype=torch.int32, device=device), qk_offsets, v_offsets, block_table)
    q = strided_rows(randn((2, group * 24), torch.bfloat16, gen).to(device), rng)
    rows = randn((2, 24), torch.bfloat16, gen).to(device)
    decode = (q, k_cache, v_cache, seqlens, qk_offsets, v_offsets, group, 0.25, None, block_table)
    append = (k_cache, v_cache, rows, rows, one_row_each, seqlens, qk_offsets, v_offsets, block_table)
    # the last cached key of each request as its one new token
    prefill = (q, k_cache, v_cache, one_row_each, offsets([3, 2]).to(device), qk_offsets, v_offsets, group, 0.25,
               True, None, -1, 0.0, None, block_table)
    # opcheck's schema test compares tensors by arithmetic that torch has no CPU kernel for on float8 ("mul" on
    # Float8_e4m3fn): for e4m3 it is replaced by the same question asked of the bytes, what each op mutates.
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if fmt == torch.float8_e4m3fn:
        utils = utils[1:]
        before = [_bytes(t).cpu().clone() for t in (k_cache, v_cache, q, rows)]
        torch.ops.fdc.decode_attention(*decode)
        if paged:
            torch.ops.fdc.prefill_attention(*prefill)
        assert all(torch.equal(_bytes(t).cpu(), b) for t, b in zip((k_cache, v_cache, q, rows), before))
        torch.ops.fdc.append_kv(*append)
        assert not torch.equal(_bytes(k_cache).cpu(), before[0])
        assert not torch.equal(_bytes(v_cache).cpu(), before[1])
        assert torch.equal(_bytes(rows).cpu(), before[3])
    torch.library.opcheck(torch.ops.fdc.decode_attention.default, decode, test_utils=utils)
    if paged:
        torch.library.opcheck(torch.ops.fdc.prefill_attention.default, prefill, test_utils=utils)
    torch.library.opcheck(torch.ops.fdc.append_kv.default, append, test_utils=utils)


def test_quantized_cache_errors():
    qk_offsets = v_offsets = offsets([8, 16])
    seqlens = torch.tensor([2], dtype=torch.int32)
    q = torch.randn(1, 24)
    narrow = torch.zeros(1, 4, 24, dtype=torch.int8)  # the data columns without the scales
    with pytest.raises(RuntimeError, match=r"fdc::decode_attention: k_cache must have shape \(B=1, S_max, 32\) "
                                           r"\(the data columns, then 4 bytes of scale per KV head\)"):
        ops.decode_attention(q, narrow, narrow, seqlens, qk_offsets, v_offsets, 1, 0.3)
    wide = torch.zeros(1, 4, 33, dtype=torch.int8)[:, :, 1:]  # the right width, one byte off a float32 boundary
    with pytest.raises(RuntimeError, match="fdc::decode_attention: k_cache is a quantized cache, whose float32 scales "
                                           "need 4-byte alignment"):
        ops.decode_attention(q, wide, wide, seqlens, qk_offsets, v_offsets, 1, 0.3)
    with pytest.raises(RuntimeError, match=r"fdc::decode_attention: k_cache must have the dtype of q \(Float\), or be "
                                           r"int8, float8_e4m3fn or uint8 \(int4 codes two per byte\)"):
        ops.decode_attention(q, torch.zeros(1, 4, 24, dtype=torch.int16), torch.zeros(1, 4, 24, dtype=torch.int16),
                             seqlens, qk_offsets, v_offsets, 1, 0.3)
    int4_full_width = torch.zeros(1, 4, 32, dtype=torch.uint8)  # int4 packs two codes per byte: 12 + 8 bytes a row
    with pytest.raises(RuntimeError, match=r"fdc::decode_attention: k_cache must have shape \(B=1, S_max, 20\) "
                                           r"\(the data columns two per byte, then 4 bytes of scale per KV head\)"):
        ops.decode_attention(q, int4_full_width, int4_full_width, seqlens, qk_offsets, v_offsets, 1, 0.3)
    rows = torch.zeros(2, 32, dtype=torch.int8)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"fdc::prefill_attention: k is quantized \(int8\): quantized keys are "
                                           r"read from a paged cache \(block_table\)"):
        ops.prefill_attention(torch.randn(2, 24), rows, rows, cu, cu, qk_offsets, v_offsets, 1, 0.3, True)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", cases(CASES // 4))
def test_eviction_moves_quantized_rows_with_their_scales(case, paged):
    """compact_kv on a quantized cache (poisoned, filled by append_kv) is compact_kv of its dequantized cache: each kept
    token's codes travel with its scales (a contiguous row's, or a page's scale rows), for all KV heads at once or per
    KV head, every other slot keeps what it held; window_scores of a quantized cache are those of its dequantized
    keys."""
    from fdc_ops import eviction

    gen, rng, replay = case_generator(f"quantized eviction paged={paged}", case)
    layout = random_layout(rng, max_kv_heads=4, max_group=3)
    fmt, dtype = rng.choice(FORMATS), rng.choice(DTYPES)
    batch = rng.randint(1, 3)
    lengths = random_lengths(rng, batch, choices=(0, 1, 7, 33, 70))
    capacity = max(lengths) + rng.randint(0, 5)
    page_size = rng.choice([1, 4, 16])
    block_table, num_pages = (random_block_table(lengths, capacity, page_size, rng) if paged else (None, 0))
    k_cache, v_cache = _empty_cache(layout.qk_offsets, layout.v_offsets, fmt, batch, capacity, block_table, num_pages,
                                    page_size)
    cu = offsets(lengths)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    ops.append_kv(k_cache, v_cache, randn((int(cu[-1]), layout.qk_width), dtype, gen),
                  randn((int(cu[-1]), layout.v_width), dtype, gen), cu, torch.zeros_like(seqlens), layout.qk_offsets,
                  layout.v_offsets, block_table)
    policy = eviction.EvictionPolicy("snapkv", keep=rng.choice([0.3, 0.6]), window=4)
    if not paged:
        q = randn((int(cu[-1]), layout.group * layout.qk_width), dtype, gen)
        args = (q, cu, k_cache, seqlens, layout.qk_offsets, layout.group, 0.2, policy)
        k_float = reference.dequantize_cache_ref(k_cache, layout.qk_offsets).float()
        torch.testing.assert_close(eviction.window_scores(*args),
                                   eviction.window_scores(q, cu, k_float, *args[3:]), msg=replay)
    heads = layout.num_kv_heads if rng.random() < 0.5 else 1  # per KV head, or one choice for all
    index, kept = eviction.select_tokens(torch.rand((batch * heads, capacity), generator=gen),
                                         seqlens.repeat_interleave(heads), policy)
    kept = kept[::heads]
    floats = [reference.dequantize_cache_ref(cache, offs, paged=paged)
              for cache, offs in ((k_cache, layout.qk_offsets), (v_cache, layout.v_offsets))]
    columns = {}
    if heads > 1:
        index = index.view(batch, heads, -1)
        selections = [[index[b, j, : kept[b]].tolist() for j in range(heads)] for b in range(batch)]
        columns = dict(qk_offsets=layout.qk_offsets, v_offsets=layout.v_offsets)
        expected = reference.compact_kv_ref(*floats, selections, block_table, (layout.qk_offsets, layout.v_offsets))
    else:
        selections = [index[b, : kept[b]].tolist() for b in range(batch)]
        expected = reference.compact_kv_ref(*floats, selections, block_table)
    eviction.compact_kv(k_cache, v_cache, seqlens, index, kept, block_table, num_kv_heads=layout.num_kv_heads,
                        **columns)
    assert seqlens.tolist() == kept, replay
    for cache, offs, want in ((k_cache, layout.qk_offsets, expected[0]), (v_cache, layout.v_offsets, expected[1])):
        got = reference.dequantize_cache_ref(cache, offs, paged=paged)
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), f"{fmt} {replay}"


def test_paged_quantized_eviction_needs_the_kv_head_count_and_takes_an_empty_pool():
    from fdc_ops import eviction

    pages = torch.zeros(2, ops.cache_width(offsets([8, 16]), torch.int8), 4, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"fdc_ops.eviction.compact_kv: paged quantized caches \(torch.int8\) keep "
                                         r"each page's scales in its last 4 \* num_kv_heads byte rows: pass "
                                         r"num_kv_heads"):
        eviction.compact_kv(pages, pages, torch.tensor([2], dtype=torch.int32), torch.tensor([[1]]), [1],
                            torch.tensor([[0]], dtype=torch.int32))
    empty_pool, seqlens = pages[:0], torch.zeros(1, dtype=torch.int32)  # no request holds a token: nothing moves
    eviction.compact_kv(empty_pool, empty_pool.clone(), seqlens, torch.zeros(1, 0, dtype=torch.int64), [0],
                        torch.zeros(1, 1, dtype=torch.int32), num_kv_heads=2)
    assert seqlens.tolist() == [0]

