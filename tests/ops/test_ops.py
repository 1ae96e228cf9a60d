"""Every op on the CPU against the float64 reference, over freshly drawn random configurations each run (opcheck:
tests/ops/test_opcheck.py). Configurations: G in 1..8, H_kv in 1..8, widths multiples of 8 up to 256, varlen batches
with empty and length-1 sequences, causal and not, float32/float16/bfloat16, non-contiguous inputs, NaN in every cache
slot and page that must not be read."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import (
    DTYPES,
    assert_close_to_reference,
    case_generator,
    cases,
    nan_padded_caches,
    offsets,
    randn,
    random_block_table,
    random_layout,
    random_lengths,
    random_rope_inputs,
    rope_tables,
    strided_rows,
    to_pages,
)
from fdc_ops import ops, reference

CASES = 60  # per op and run: enough fresh configurations that every branch (dtype, causal, empty and
# length-1 sequences, widths up to 256, G up to 8) is drawn many times in each run


@pytest.mark.parametrize("isa", ("", "portable"))  # the default picks the AVX-512 tiles where the CPU has them
@pytest.mark.parametrize("case", cases(CASES))
def test_rotate_compress(case, isa, monkeypatch):
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng, replay = case_generator("rotate_compress", case)
    layout = random_layout(rng)
    dtype = rng.choice(DTYPES)
    head_dim = max(max(layout.qk_dims), 8 * rng.randint(1, 32))
    group = rng.choice([1, layout.group])  # keys (group 1) or queries
    tokens = rng.choice([0, 1, 5, 37, 130])
    x = randn((layout.num_kv_heads * group, tokens, head_dim), dtype, gen).transpose(0, 1)  # non-contiguous
    rot = randn((layout.num_kv_heads, head_dim, max(layout.qk_dims) + 8 * rng.randint(0, 2)), dtype, gen)
    out = ops.rotate_compress(x, rot, layout.qk_offsets, group)
    expected = reference.rotate_compress_ref(x, rot, layout.qk_offsets, group)
    torch_lowp = reference.rotate_compress_ref(x, rot, layout.qk_offsets, group, compute_dtype=dtype)
    assert out.dtype == dtype
    assert_close_to_reference(out, expected, torch_lowp, f"rotate_compress {replay}")


@pytest.mark.parametrize("case", cases(CASES))
def test_rope_rotate_compress(case):
    gen, rng, replay = case_generator("rope_rotate_compress", case)
    layout = random_layout(rng)
    dtype = rng.choice(DTYPES)
    group = rng.choice([1, layout.group])
    x, cos, sin, rot = random_rope_inputs(rng, gen, layout, dtype, group)
    out = ops.rope_rotate_compress(x, cos, sin, rot, layout.qk_offsets, group)
    args = (x, cos, sin, rot, layout.qk_offsets, group)
    expected = reference.rope_rotate_compress_ref(*args)
    torch_lowp = reference.rope_rotate_compress_ref(*args, compute_dtype=dtype)
    assert out.dtype == dtype
    assert_close_to_reference(out, expected, torch_lowp,
                              f"rope_rotate_compress rotary_dim={cos.shape[1]} D={x.shape[2]} {replay}")


@pytest.mark.parametrize("rotary_dim", [8, 24, 32])
def test_rope_reference_is_transformers_rope(rotary_dim):
    """The reference RoPE is transformers' apply_rotary_pos_emb (Phi-3's, which handles partial rotary), and the
    fused op equals RoPE followed by rotate_compress."""
    modeling_phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
    gen = torch.Generator().manual_seed(rotary_dim)
    x = torch.randn(6, 4, 32, generator=gen, dtype=torch.float64)  # (T, heads, D)
    cos, sin = rope_tables(torch.arange(6) * 37, rotary_dim, torch.float64)
    theirs, _ = modeling_phi3.apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None],
                                                   sin[None])  # (1, heads, T, D)
    torch.testing.assert_close(reference.rope_ref(x, cos, sin), theirs[0].transpose(0, 1), rtol=0, atol=1e-12)

    qk_offsets, rot = offsets([16, 8]), torch.randn(2, 32, 16, generator=gen)
    fused = ops.rope_rotate_compress(x.float(), cos.float(), sin.float(), rot, qk_offsets, 2)
    two_pass = ops.rotate_compress(reference.rope_ref(x, cos, sin).float(), rot, qk_offsets, 2)
    torch.testing.assert_close(fused, two_pass, rtol=1e-5, atol=1e-5)


def _prefill_inputs(rng, gen, layout, dtype):
    batch = rng.randint(1, 5)
    lengths_q = random_lengths(rng, batch)
    lengths_k = [s + rng.choice([0, 0, 1, 9, 40]) if rng.random() < 0.5 else s for s in lengths_q]
    if rng.random() < 0.3:  # queries that see fewer keys than there are queries
        lengths_k = [max(0, s - rng.randint(0, 5)) for s in lengths_q]
    extra_q_rows = rng.choice([0, 0, 3])  # rows after the last sequence must come back zero
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    total_q, total_k = int(cu_q[-1]) + extra_q_rows, int(cu_k[-1])
    q = strided_rows(randn((total_q, layout.group * layout.qk_width), dtype, gen), rng)
    k = strided_rows(randn((total_k, layout.qk_width), dtype, gen), rng)
    v = strided_rows(randn((total_k, layout.v_width), dtype, gen), rng)
    return q, k, v, cu_q, cu_k


# Prefill runs bf16 on torch's bf16 GEMM micro-kernel where it runs on AMX tiles (with oneDNN), everything else in
# float32 (csrc/cpu/prefill_attention.cpp); "avx512" forces the float32 path with AVX-512 softmax loops, "portable"
# with the portable ones.
PREFILL_ISAS = ("", "avx512", "portable")


@pytest.mark.parametrize("isa", PREFILL_ISAS)
@pytest.mark.parametrize("case", cases(CASES))
def test_prefill_attention(case, isa, monkeypatch):
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng, replay = case_generator(f"prefill_attention isa={isa!r}", case)
    layout = random_layout(rng)
    dtype = rng.choice(DTYPES)
    causal = rng.random() < 0.5
    q, k, v, cu_q, cu_k = _prefill_inputs(rng, gen, layout, dtype)
    scale = rng.uniform(0.05, 0.5)
    args = (q, k, v, cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group, scale, causal)
    plan = None
    if rng.random() < 0.5:
        plan = ops.prefill_plan(cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group, causal,
                                num_workers=rng.choice([1, 3, 7]), row_block=rng.choice([16, 64, 128]))
    out = ops.prefill_attention(*args, plan=plan)
    expected = reference.prefill_attention_ref(*args)
    torch_lowp = reference.prefill_attention_ref(*args, compute_dtype=dtype)
    assert_close_to_reference(out, expected, torch_lowp, f"prefill_attention causal={causal} {replay}")


@pytest.mark.parametrize("isa", PREFILL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_attention_long_sequences(causal, dtype, isa, monkeypatch):
    """Sequences spanning many key blocks and row tiles of the CPU kernel, one with more keys than queries (a prompt
    after cached tokens), on a layout with narrow and 256-wide heads."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(1234)
    qk_dims, v_dims, group = [8, 256, 40], [256, 16, 72], 3
    qk_offsets, v_offsets = offsets(qk_dims), offsets(v_dims)
    cu_q, cu_k = offsets([1100, 37, 600]), offsets([1100, 37, 1313])
    q = randn((int(cu_q[-1]), group * sum(qk_dims)), dtype, gen)
    k = randn((int(cu_k[-1]), sum(qk_dims)), dtype, gen)
    v = randn((int(cu_k[-1]), sum(v_dims)), dtype, gen)
    args = (q, k, v, cu_q, cu_k, qk_offsets, v_offsets, group, 0.125, causal)
    out = ops.prefill_attention(*args)
    expected = reference.prefill_attention_ref(*args)
    torch_lowp = reference.prefill_attention_ref(*args, compute_dtype=dtype)
    assert_close_to_reference(out, expected, torch_lowp, f"prefill_attention long causal={causal} isa={isa!r}")


@pytest.mark.parametrize("isa", PREFILL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_attention_scores_climbing_across_key_blocks(causal, dtype, isa, monkeypatch):
    """Scores whose largest value grows from key block to key block, slowly (a row keeps its softmax reference: the
    bf16 kernel's one-pass exponentiation) and by jumps far beyond exp(16) (the reference moves and the block is
    exponentiated again), keys in a row's first block far above the first 16 (which set the provisional
    reference), and one block of huge scores followed by small ones."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(99)
    qk_dims, v_dims, group = [64, 24], [40, 64], 2
    qk_offsets, v_offsets = offsets(qk_dims), offsets(v_dims)
    lengths = [1500, 700]
    cu = offsets(lengths)
    total = sum(lengths)
    key_scale = torch.linspace(0.2, 8.0, total, dtype=torch.float64)[:, None]  # score spread grows along the keys
    key_scale[40:44] *= 60  # after the first 16 keys of the first block
    key_scale[700:720] *= 20  # a block whose scores jump far above every earlier one
    key_scale[1520:1530] *= 30  # the second sequence's keys 20-29: later scores are far below them
    q = randn((total, group * sum(qk_dims)), torch.float64, gen)
    k = randn((total, sum(qk_dims)), torch.float64, gen) * key_scale
    v = randn((total, sum(v_dims)), torch.float64, gen)
    args = (q.to(dtype), k.to(dtype), v.to(dtype), cu, cu, qk_offsets, v_offsets, group, 0.125, causal)
    out = ops.prefill_attention(*args)
    expected = reference.prefill_attention_ref(*args)
    torch_lowp = reference.prefill_attention_ref(*args, compute_dtype=dtype)
    assert_close_to_reference(out, expected, torch_lowp, f"prefill_attention climbing causal={causal} isa={isa!r}")


@pytest.mark.parametrize("isa", PREFILL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_attention_nan_queries_stay_in_their_sequence(causal, dtype, isa, monkeypatch):
    """NaN queries make every row of their own sequence NaN, as in the reference (the first causal rows see fewer
    keys than a vector's lanes: their maximum must not drop the NaN), and nothing else: on one thread every tile
    shares one accumulator, which the first key block's product overwrites, never scales by zero."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(7)
    qk_dims, v_dims, group = [16, 32], [40, 64], 2
    qk_offsets, v_offsets = offsets(qk_dims), offsets(v_dims)
    lengths = [300, 300, 300]
    cu = offsets(lengths)
    q = randn((900, group * sum(qk_dims)), dtype, gen)
    k = randn((900, sum(qk_dims)), dtype, gen)
    v = randn((900, sum(v_dims)), dtype, gen)
    q[300:600] = float("nan")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = ops.prefill_attention(q, k, v, cu, cu, qk_offsets, v_offsets, group, 0.125, causal)
    finally:
        torch.set_num_threads(threads)
    assert out[300:600].isnan().all()
    for first in (0, 600):  # the sequences before and after, alone
        rows = slice(first, first + 300)
        one = offsets([300])
        args = (q[rows], k[rows], v[rows], one, one, qk_offsets, v_offsets, group, 0.125, causal)
        expected = reference.prefill_attention_ref(*args)
        torch_lowp = reference.prefill_attention_ref(*args, compute_dtype=dtype)
        assert_close_to_reference(out[rows], expected, torch_lowp, f"prefill_attention beside NaN queries {first}")


@pytest.mark.parametrize("isa", PREFILL_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_rows_outside_the_sequences(dtype, isa, monkeypatch):
    """Boundaries that start after row 0 and end before the last row (the vLLM backend hands a step's rows whole,
    its prefill requests' after its decodes): the rows outside every sequence come back zero whatever they hold (NaN
    queries, keys and values there), the others as the same sequences passed alone."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen = torch.Generator().manual_seed(11)
    qk_dims, v_dims, group = [16, 40], [24, 8], 3
    qk_offsets, v_offsets = offsets(qk_dims), offsets(v_dims)
    lead, lengths, tail = 5, [37, 300], 3
    rows = lead + sum(lengths) + tail
    cu = offsets(lengths) + lead
    q = randn((rows, group * sum(qk_dims)), dtype, gen)
    k = randn((rows, sum(qk_dims)), dtype, gen)
    v = randn((rows, sum(v_dims)), dtype, gen)
    for t in (q, k, v):
        t[:lead] = float("nan")
        t[rows - tail:] = float("nan")
    out = ops.prefill_attention(q, k, v, cu, cu, qk_offsets, v_offsets, group, 0.125, True)
    assert not out[:lead].any() and not out[rows - tail:].any()
    inside = slice(lead, rows - tail)
    alone = offsets(lengths)
    args = (q[inside], k[inside], v[inside], alone, alone, qk_offsets, v_offsets, group, 0.125, True)
    assert_close_to_reference(out[inside], reference.prefill_attention_ref(*args),
                              reference.prefill_attention_ref(*args, compute_dtype=dtype),
                              f"prefill_attention rows outside the sequences isa={isa!r}")


def test_prefill_attention_bf16_without_onednn():
    """With torch's oneDNN switched off (torch.backends.mkldnn), bf16 prefill takes the float32 path: same results
    within bf16's tolerance."""
    gen, rng, replay = case_generator("prefill_attention without oneDNN", 0)
    layout = random_layout(rng)
    q, k, v, cu_q, cu_k = _prefill_inputs(rng, gen, layout, torch.bfloat16)
    args = (q, k, v, cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group, 0.2, True)
    with torch.backends.mkldnn.flags(enabled=False):
        out = ops.prefill_attention(*args)
    expected = reference.prefill_attention_ref(*args)
    torch_lowp = reference.prefill_attention_ref(*args, compute_dtype=torch.bfloat16)
    assert_close_to_reference(out, expected, torch_lowp, f"prefill_attention without oneDNN {replay}")


# FDC_CPU_ISA caps the CPU row kernels (csrc/cpu/cpu_common.h): "" runs the widest this CPU has (AVX-512-BF16 where
# present), the others force the AVX-512 kernels without the bf16 dot product, or the portable ones.
CPU_ISAS = ("", "avx512", "portable")
# FDC_CPU_READ_AHEAD picks how the AVX-512 decode kernel brings the next block in (csrc/cpu/decode_attention.cpp): ""
# is this CPU's own way, the others force one, so every way runs on whichever CPU the tests meet.
READ_AHEADS = ("", "stream", "loads", "prefetch_l2")


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", cases(CASES))
def test_decode_attention(case, paged, isa, monkeypatch):
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng, replay = case_generator(f"decode_attention paged={paged}", case)
    read_ahead = rng.choice(READ_AHEADS)
    monkeypatch.setenv("FDC_CPU_READ_AHEAD", read_ahead)
    layout = random_layout(rng, max_group=16)  # above 8 the AVX-512 bf16 key products take query heads in two rounds
    dtype = rng.choice(DTYPES)
    batch = rng.randint(1, 6)
    lengths = random_lengths(rng, batch, choices=(0, 1, 5, 64, 65, 300, 700))
    if rng.random() < 0.2:
        lengths[0] = 3000  # long enough to be split into chunks with several workers
    capacity = max(lengths) + rng.randint(0, 20)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    k_cache, v_cache = nan_padded_caches(layout, lengths, capacity, dtype, gen)
    q = strided_rows(randn((batch, layout.group * layout.qk_width), dtype, gen), rng)
    scale = rng.uniform(0.05, 0.5)
    block_table = None
    if paged:
        page_size = rng.choice([1, 3, 16, 64, 100, 256])  # 256: longer than a paged block of the CPU kernel
        block_table, num_pages = random_block_table(lengths, capacity, page_size, rng)
        k_cache = to_pages(k_cache, lengths, block_table, num_pages, page_size)
        v_cache = to_pages(v_cache, lengths, block_table, num_pages, page_size)
    plan = None
    if rng.random() < 0.6:
        plan = ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group,
                               num_workers=rng.choice([1, 3, 8, 40]))
    args = (q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, scale)
    out = ops.decode_attention(*args, plan=plan, block_table=block_table)
    expected = reference.decode_attention_ref(*args, block_table=block_table)
    torch_lowp = reference.decode_attention_ref(*args, block_table=block_table, compute_dtype=dtype)
    assert_close_to_reference(out, expected, torch_lowp,
                              f"decode_attention paged={paged} read_ahead={read_ahead!r} {replay}")


@pytest.mark.parametrize("read_ahead", READ_AHEADS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_many_blocks_per_piece(dtype, isa, paged, read_ahead, monkeypatch):
    """A wide layer (8 KV heads of 256 + 256 columns) over 2000 keys: whatever block length the read-ahead picks
    (16 rows or 128 to 256 bytes of each page column by prefetch_l2; 160 KiB of K and V, at least 16 rows, or up to
    128 keys of pages otherwise), each piece of the AVX-512 kernel spans many blocks, so the next block's read-ahead and
    the softmax carried from block to block are exercised; keys whose scores jump far above every earlier one make
    later blocks rescale what earlier ones summed. Unused cache rows and slots hold NaN; pages (16 tokens) are
    shuffled over the pool."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    monkeypatch.setenv("FDC_CPU_READ_AHEAD", read_ahead)
    gen = torch.Generator().manual_seed(11)
    dims, group, length = [256] * 8, 2, 2000
    qk_offsets = v_offsets = offsets(dims)
    width = sum(dims)
    key_scale = torch.ones(length, 1)
    key_scale[900:910] = 12.0
    k_cache = torch.full((1, length + 24, width), float("nan"), dtype=dtype)
    v_cache = torch.full((1, length + 24, width), float("nan"), dtype=dtype)
    k_cache[0, :length] = (randn((length, width), torch.float32, gen) * key_scale).to(dtype)
    v_cache[0, :length] = randn((length, width), dtype, gen)
    q = randn((1, group * width), dtype, gen)
    block_table = None
    if paged:
        page_size = 16
        block_table, num_pages = random_block_table([length], length + 24, page_size, random.Random(11))
        k_cache = to_pages(k_cache, [length], block_table, num_pages, page_size)
        v_cache = to_pages(v_cache, [length], block_table, num_pages, page_size)
    args = (q, k_cache, v_cache, torch.tensor([length], dtype=torch.int32), qk_offsets, v_offsets, group, 0.04)
    out = ops.decode_attention(*args, block_table=block_table)
    expected = reference.decode_attention_ref(*args, block_table=block_table)
    torch_lowp = reference.decode_attention_ref(*args, block_table=block_table, compute_dtype=dtype)
    what = f"decode_attention many blocks {dtype} isa={isa!r} paged={paged} read_ahead={read_ahead!r}"
    assert_close_to_reference(out, expected, torch_lowp, what)


@pytest.mark.parametrize("variable, value", [("FDC_CPU_ISA", "avx9000"), ("FDC_CPU_READ_AHEAD", "telepathy")])
def test_cpu_switches_reject_unknown_names(variable, value, monkeypatch):
    monkeypatch.setenv(variable, value)
    q, k, v = torch.randn(1, 16), torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    offsets8 = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=f"fdc::decode_attention: {variable} must be .* but is '{value}'"):
        ops.decode_attention(q, k, v, torch.tensor([4], dtype=torch.int32), offsets8, offsets8, 2, 0.3)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", cases(CASES // 2))
def test_append_kv_then_decode(case, paged):
    """Appending a prompt and then one token per step builds the cache the reference builds; rows outside the
    appended ones stay bit-identical, and decode over the result matches the reference."""
    gen, rng, replay = case_generator(f"append_kv paged={paged}", case)
    layout = random_layout(rng, max_kv_heads=4, max_group=4)
    dtype = rng.choice(DTYPES)
    batch = rng.randint(1, 4)
    start = random_lengths(rng, batch, choices=(0, 1, 5, 20))
    new = random_lengths(rng, batch, choices=(0, 1, 3, 17))
    capacity = max(s + n for s, n in zip(start, new)) + rng.randint(1, 4)
    page_size = rng.choice([1, 4, 16])
    k_cache = randn((batch, capacity, layout.qk_width), dtype, gen)
    v_cache = randn((batch, capacity, layout.v_width), dtype, gen)
    block_table = None
    if paged:
        block_table, num_pages = random_block_table([capacity] * batch, capacity, page_size, rng)
        k_cache = to_pages(k_cache, [capacity] * batch, block_table, num_pages, page_size)
        v_cache = to_pages(v_cache, [capacity] * batch, block_table, num_pages, page_size)
    cu = offsets(new)
    k_new = strided_rows(randn((int(cu[-1]), layout.qk_width), dtype, gen), rng)
    v_new = randn((int(cu[-1]), layout.v_width), dtype, gen)
    seqlens = torch.tensor(start, dtype=torch.int32)
    expected_k, expected_v = reference.append_kv_ref(k_cache, v_cache, k_new, v_new, cu, seqlens, block_table)
    ops.append_kv(k_cache, v_cache, k_new, v_new, cu, seqlens, layout.qk_offsets, layout.v_offsets, block_table)
    assert torch.equal(k_cache.nan_to_num(7.0), expected_k.nan_to_num(7.0)), f"append_kv k {replay}"
    assert torch.equal(v_cache.nan_to_num(7.0), expected_v.nan_to_num(7.0)), f"append_kv v {replay}"
    assert seqlens.tolist() == start, "append_kv must not advance cache_seqlens"

    seqlens = seqlens + torch.tensor(new, dtype=torch.int32)
    q = randn((batch, layout.group * layout.qk_width), dtype, gen)
    args = (q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, 0.2)
    out = ops.decode_attention(*args, block_table=block_table)
    expected = reference.decode_attention_ref(*args, block_table=block_table)
    torch_lowp = reference.decode_attention_ref(*args, block_table=block_table, compute_dtype=dtype)
    assert_close_to_reference(out, expected, torch_lowp, f"decode after append_kv paged={paged} {replay}")


@pytest.mark.parametrize("workers", [1, 3, 7, 64])
def test_plans_do_not_change_results(workers):
    """The schedule only distributes work: any worker count gives the same float32 outputs, up to the rounding
    that differently sized BLAS tiles and split-KV merges bring."""
    gen, rng, replay = case_generator(f"plans workers={workers}", 0)
    layout = random_layout(rng, max_kv_heads=4, max_group=4)
    q, k, v, cu_q, cu_k = _prefill_inputs(rng, gen, layout, torch.float32)
    common = (cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group)
    for causal in (False, True):
        plan = ops.prefill_plan(*common, causal, num_workers=workers)
        with_plan = ops.prefill_attention(q, k, v, *common, 0.3, causal, plan=plan)
        without = ops.prefill_attention(q, k, v, *common, 0.3, causal)
        torch.testing.assert_close(with_plan, without, rtol=1e-4, atol=1e-5, msg=replay)
    lengths = [4000, 1, 0, 700]
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    k_cache = randn((4, 4000, layout.qk_width), torch.float32, gen)
    v_cache = randn((4, 4000, layout.v_width), torch.float32, gen)
    q = randn((4, layout.group * layout.qk_width), torch.float32, gen)
    args = (q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, 0.3)
    plan = ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group, num_workers=workers)
    with_plan = ops.decode_attention(*args, plan=plan)
    torch.testing.assert_close(with_plan, ops.decode_attention(*args), rtol=1e-4, atol=1e-5, msg=replay)
    assert_close_to_reference(with_plan, reference.decode_attention_ref(*args),
                              reference.decode_attention_ref(*args, compute_dtype=torch.float32),
                              f"decode_attention {workers} workers {replay}")


def test_ops_compile_into_one_graph():
    """The fake implementations let torch.compile trace a decode step (plan, append, attention) without graph
    breaks, and the compiled step computes what the eager one does."""
    layout_qk, layout_v, group = offsets([16, 8]), offsets([8, 24]), 3
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(2, 10, 24, generator=gen)
    v_cache = torch.randn(2, 10, 32, generator=gen)
    seqlens = torch.tensor([4, 7], dtype=torch.int32)
    q = torch.randn(2, group * 24, generator=gen)
    k_new, v_new = torch.randn(2, 24, generator=gen), torch.randn(2, 32, generator=gen)
    step_cu = torch.tensor([0, 1, 2], dtype=torch.int32)

    def step(q, k_cache, v_cache, k_new, v_new, seqlens):
        ops.append_kv(k_cache, v_cache, k_new, v_new, step_cu, seqlens, layout_qk, layout_v)
        grown = seqlens + 1
        plan = ops.decode_plan(grown, layout_qk, layout_v, group, num_workers=2)
        return ops.decode_attention(q, k_cache, v_cache, grown, layout_qk, layout_v, group, 0.3, plan)

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    expected = step(q, eager_k, eager_v, k_new, v_new, seqlens)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    actual = compiled(q, k_cache, v_cache, k_new, v_new, seqlens)
    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(k_cache, eager_k)
    torch.testing.assert_close(v_cache, eager_v)


def test_prefix_sums_build_offsets_and_cu_seqlens():
    """fdc_ops.ops.prefix_sums: widths (a list) -> CPU int32 offsets; counts (a tensor) -> int32 on their device."""
    assert ops.prefix_sums([32, 16, 64]).tolist() == [0, 32, 48, 112]
    assert ops.prefix_sums([32, 16, 64]).dtype == torch.int32
    assert ops.prefix_sums([]).tolist() == [0]
    counts = torch.tensor([3, 0, 5], dtype=torch.int64)
    assert ops.prefix_sums(counts).tolist() == [0, 3, 3, 8] and ops.prefix_sums(counts).dtype == torch.int32
    for bad in ([1.5, 2.0], [[1, 2]], torch.ones(2, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"^fdc_ops\.ops\.prefix_sums: sizes must be a 1-D sequence of integers"):
            ops.prefix_sums(bad)
