"""decode_attention's variants on the CPU (sliding window, soft-capping, sinks) against the float64 reference, at the
edges the CPU decode has: windows of 0 keys, shorter than, equal to and longer than a request, empty and one-key
requests, windows starting inside a page (the AVX-512 way masks the keys its first block reads before the window),
requests split into chunks or pieces whose partials merge before the sink applies, and a caller's plan made with or
without the same window. Every cache slot the op must not read holds NaN: slots past each length, and the keys before
the window (on a paged cache, every page before the window's first page); the keys of that page before the window,
which the AVX-512 way reads and masks, hold keys scaled up 40 times, whose scores would dominate any unmasked
softmax."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import (
    DTYPES,
    assert_close_to_reference,
    case_generator,
    cases,
    offsets,
    randn,
    random_block_table,
    random_layout,
    strided_rows,
    to_pages,
)
from fdc_ops import ops, reference
from fdc_ops.plans import DecodePlan

CASES = 30  # random configurations per way and run; with the fixed edge cases below, every branch is drawn
# FDC_CPU_ISA: "" is the widest this CPU has (AVX-512 where present), "portable" the plan-driven kernels.
CPU_ISAS = ("", "avx512", "portable")
READ_AHEADS = ("", "stream", "loads", "prefetch_l2")
# How far past the window's start the poisoned keys lie scaled up (see the module docstring).
EDGE_KEY_SCALE = 40.0


def first_visible(length: int, window_left: int) -> int:
    """The first key a decode query at the end of `length` keys sees (fdc/attention_variant.h)."""
    return 0 if window_left < 0 or length == 0 else max(0, length - 1 - window_left)


def make_inputs(gen, rng, layout, dtype, lengths, window_left, page_size=None):
    """q, caches and cache_seqlens for these lengths (contiguous, or paged with page_size tokens a page, shuffled), with
    the slots the op must not read poisoned as the module docstring says, and the block table (None when contiguous)."""
    batch = len(lengths)
    capacity = max(lengths, default=0) + rng.randint(0, 20)
    k_cache = torch.full((batch, capacity, layout.qk_width), float("nan"), dtype=dtype)
    v_cache = torch.full((batch, capacity, layout.v_width), float("nan"), dtype=dtype)
    for b, length in enumerate(lengths):
        first = first_visible(length, window_left)
        unread = first if page_size is None else first - first % page_size
        keys = randn((length, layout.qk_width), torch.float32, gen)
        keys[unread:first] *= EDGE_KEY_SCALE
        k_cache[b, unread:length] = keys[unread:].to(dtype)
        v_cache[b, unread:length] = randn((length - unread, layout.v_width), dtype, gen)
    q = strided_rows(randn((batch, layout.group * layout.qk_width), dtype, gen), rng)
    block_table = None
    if page_size is not None:
        block_table, num_pages = random_block_table(lengths, max(capacity, 1), page_size, rng)
        k_cache = to_pages(k_cache, lengths, block_table, num_pages, page_size)
        v_cache = to_pages(v_cache, lengths, block_table, num_pages, page_size)
    return q, k_cache, v_cache, torch.tensor(lengths, dtype=torch.int32), block_table


def random_sinks(rng, gen, num_heads: int, scale: str):
    """None, or one sink logit per query head: "small" ones that barely change a row, "large" ones that take most of
    its weight, or "mixed" (both kinds and ordinary ones)."""
    if scale == "none":
        return None
    if scale == "small":
        return torch.randn(num_heads, generator=gen) - 8.0
    if scale == "large":
        return torch.randn(num_heads, generator=gen) + 8.0
    return torch.randn(num_heads, generator=gen) * 6.0


def check(out, args, block_table, window_left, softcap, sinks, dtype, what):
    kwargs = dict(block_table=block_table, window_left=window_left, softcap=softcap, sinks=sinks)
    expected = reference.decode_attention_ref(*args, **kwargs)
    torch_lowp = reference.decode_attention_ref(*args, **kwargs, compute_dtype=dtype)
    assert_close_to_reference(out, expected, torch_lowp, what)


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", cases(CASES))
def test_decode_variants_random(case, paged, isa, monkeypatch):
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng, replay = case_generator(f"decode_variants paged={paged}", case)
    read_ahead = rng.choice(READ_AHEADS)
    monkeypatch.setenv("FDC_CPU_READ_AHEAD", read_ahead)
    layout = random_layout(rng, max_group=16)
    dtype = rng.choice(DTYPES)
    lengths = [rng.choice((0, 1, 2, 5, 17, 64, 65, 300, 700)) for _ in range(rng.randint(1, 5))]
    if rng.random() < 0.25:
        lengths[0] = 3000  # split into chunks or pieces
    longest = max(lengths)
    window_left = rng.choice([-1, 0, 1, 15, 16, 17, rng.randint(0, longest), longest - 1, longest + 5])
    softcap = rng.choice([0.0, 5.0, 30.0])
    sinks = random_sinks(rng, gen, layout.group * layout.num_kv_heads, rng.choice(["none", "small", "large", "mixed"]))
    page_size = rng.choice([1, 3, 16, 64, 100, 256]) if paged else None
    q, k_cache, v_cache, seqlens, block_table = make_inputs(gen, rng, layout, dtype, lengths, window_left, page_size)
    plan = None
    if rng.random() < 0.5:
        plan = ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group,
                               num_workers=rng.choice([1, 3, 8, 40]), window_left=window_left)
    args = (q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, rng.uniform(0.05, 0.5))
    out = ops.decode_attention(*args, plan=plan, block_table=block_table, window_left=window_left, softcap=softcap,
                               sinks=sinks)
    check(out, args, block_table, window_left, softcap, sinks, dtype,
          f"decode variants paged={paged} page_size={page_size} window_left={window_left} softcap={softcap} "
          f"lengths={lengths} read_ahead={read_ahead!r} {replay}")


# window_left against a request of 40 keys: none, 0 (the query's own key), shorter (starting on and off a 16-key grid
# and a page), one short of, equal to and longer than the request.
WINDOWS = (-1, 0, 5, 15, 16, 24, 38, 39, 40, 1000)


@pytest.mark.parametrize("isa", ("", "portable"))
@pytest.mark.parametrize("page_size", [None, 1, 16, 32])
@pytest.mark.parametrize("window_left", WINDOWS)
def test_decode_window_edges(window_left, page_size, isa, monkeypatch):
    """Requests of 40, 0, 1 and 17 keys under each window, every dtype, GQA, with and without a plan."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng = torch.Generator().manual_seed(5), random.Random(5)
    layout = random_layout(random.Random(7), max_kv_heads=3, max_group=4, max_dim=64)
    for dtype in DTYPES:
        q, k_cache, v_cache, seqlens, block_table = make_inputs(gen, rng, layout, dtype, [40, 0, 1, 17], window_left,
                                                                page_size)
        args = (q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, 0.3)
        for plan in (None, ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group, num_workers=3,
                                           window_left=window_left)):
            out = ops.decode_attention(*args, plan=plan, block_table=block_table, window_left=window_left)
            check(out, args, block_table, window_left, 0.0, None, dtype,
                  f"window_left={window_left} page_size={page_size} {dtype} plan={plan is not None}")
            assert bool((out[1] == 0).all()), "an empty request gives zeros"


def test_decode_window_plan_covers_visible_keys():
    """decode_plan(window_left=w) has tasks over each request's visible keys only; a window longer than every request
    gives the plan without a window."""
    qk_offsets, v_offsets = offsets([64, 16]), offsets([32, 64])
    lengths = [8192, 3, 0, 1, 1000]
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    for window_left in (0, 7, 1023, 5000):
        plan = DecodePlan.from_tensor(ops.decode_plan(seqlens, qk_offsets, v_offsets, 2, num_workers=4,
                                                      window_left=window_left))
        covered = {}
        for pair, _, start, end in plan.records:
            covered.setdefault(pair, []).append((start, end))
        for pair in range(len(lengths) * 2):
            length = lengths[pair // 2]
            spans = sorted(covered.get(pair, []))
            keys = [t for start, end in spans for t in range(start, end)]
            assert keys == list(range(first_visible(length, window_left), length)), (window_left, pair)
    unwindowed = ops.decode_plan(seqlens, qk_offsets, v_offsets, 2, num_workers=4)
    assert torch.equal(ops.decode_plan(seqlens, qk_offsets, v_offsets, 2, num_workers=4, window_left=8191),
                       unwindowed)


@pytest.mark.parametrize("isa", ("", "portable"))
def test_decode_plan_window_mismatch_is_refused(isa, monkeypatch):
    """A caller's plan must be made with the attention's window_left: one without it (covering keys outside the
    window) and one with it given to an attention without a window (covering too few keys) are refused."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng = torch.Generator().manual_seed(3), random.Random(3)
    layout = random_layout(random.Random(3), max_kv_heads=2, max_group=2, max_dim=32)
    q, k_cache, v_cache, seqlens, _ = make_inputs(gen, rng, layout, torch.float32, [300, 20], -1)
    args = (q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, 0.3)
    plain = ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group, num_workers=2)
    windowed = ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group, num_workers=2,
                               window_left=99)
    message = "fdc::decode_attention: .*make the plan from the same cache_seqlens and window_left"
    with pytest.raises(RuntimeError, match=message):
        ops.decode_attention(*args, plan=plain, window_left=99)
    with pytest.raises(RuntimeError, match=message):
        ops.decode_attention(*args, plan=windowed)
    with pytest.raises(RuntimeError, match=message):
        ops.decode_attention(*args, plan=windowed, window_left=98)
    check(ops.decode_attention(*args, plan=windowed, window_left=99), args, None, 99, 0.0, None, torch.float32,
          "the matching plan")


@pytest.mark.parametrize("isa", ("", "portable"))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_variants_split_over_threads(dtype, paged, isa, monkeypatch):
    """Long requests on 2 threads: the window's keys are cut into several chunks (a plan for 8 workers) or pieces, so
    sinks apply after the log-sum-exp merge; softcap 5 and large and small sinks, all at once and each alone."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng = torch.Generator().manual_seed(17), random.Random(17)
    layout = random_layout(random.Random(17), max_kv_heads=4, max_group=4, max_dim=64)
    lengths, window_left = [5000, 2600, 1], 2999
    q, k_cache, v_cache, seqlens, block_table = make_inputs(gen, rng, layout, dtype, lengths, window_left,
                                                            16 if paged else None)
    args = (q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, 0.2)
    heads = layout.group * layout.num_kv_heads
    sinks = torch.cat([torch.full((heads - heads // 2,), 9.0), torch.full((heads // 2,), -9.0)])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for plan_workers in (None, 8):
            plan = None if plan_workers is None else ops.decode_plan(
                seqlens, layout.qk_offsets, layout.v_offsets, layout.group, num_workers=plan_workers,
                window_left=window_left)
            if plan is not None:
                decoded = DecodePlan.from_tensor(plan)
                assert decoded.split_offsets[1] - decoded.split_offsets[0] > 1, "the window is split"
            for softcap, sink in ((5.0, sinks), (0.0, sinks), (5.0, None), (0.0, None)):
                out = ops.decode_attention(*args, plan=plan, block_table=block_table, window_left=window_left,
                                           softcap=softcap, sinks=sink)
                check(out, args, block_table, window_left, softcap, sink, dtype,
                      f"split {dtype} paged={paged} plan={plan_workers} softcap={softcap} sinks={sink is not None}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ("", "portable"))
@pytest.mark.parametrize("paged", [False, True])
def test_decode_softcap_and_sinks_matter(paged, isa, monkeypatch):
    """Scores far above softcap 5 (so capping changes the output), and sinks large and small: the op follows the
    reference where the variant-less output differs from it; an empty request stays zero with a sink."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng = torch.Generator().manual_seed(23), random.Random(23)
    layout = random_layout(random.Random(23), max_kv_heads=3, max_group=4, max_dim=64)
    q, k_cache, v_cache, seqlens, block_table = make_inputs(gen, rng, layout, torch.float32, [700, 0, 33], -1,
                                                            64 if paged else None)
    args = (q * 4, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, 0.5)
    plain = ops.decode_attention(*args, block_table=block_table)
    heads = layout.group * layout.num_kv_heads
    for softcap, sinks in ((5.0, None), (0.0, torch.full((heads,), 100.0)), (0.0, torch.full((heads,), -30.0)),
                           (5.0, torch.linspace(-10, 10, heads))):
        out = ops.decode_attention(*args, block_table=block_table, softcap=softcap, sinks=sinks)
        check(out, args, block_table, -1, softcap, sinks, torch.float32, f"softcap={softcap} sinks={sinks}")
        assert bool((out[1] == 0).all()), "an empty request gives zeros with a sink"
        if softcap > 0:
            assert float((out - plain).abs().max()) > 0.1, "capping changes the output"
        if sinks is not None and float(sinks.min()) == 100.0:
            assert float(out.abs().max()) < 1e-6, "a sink far above every score takes all the weight"
