"""The CPU prefill's attention variants (sliding window, logit soft-capping, sinks) against the float64 reference:
random varlen batches, then the edges of csrc/cpu/prefill_attention.cpp's tile loop: window edges inside and across
its 256-key blocks, windows of 0 keys and longer than the sequence, rows whose window starts past the tile's first
block, rows that see no key (with a sink too), a cached prefix (s_k > s_q), and caller plans made with and without
the window."""
from __future__ import annotations

import pytest
import torch

from conftest import (
    DTYPES,
    assert_close_to_reference,
    case_generator,
    cases,
    offsets,
    randn,
    random_layout,
    random_lengths,
    strided_rows,
)
from fdc_ops import ops, reference

CASES = 30
# The default ISA (bf16 on torch's bf16 GEMM micro-kernel where it runs), the float32 path with AVX-512 softmax loops
# (where the CPU has AVX-512) and the portable loops; the long cases, whose float64 reference takes seconds, run the
# default and the portable ones.
ISAS = ("", "avx512", "portable")
LONG_ISAS = ("", "portable")


def _check(args, what, plan=None, **variant):
    """The op (with `plan`, or its own) against the reference for the variant's keyword arguments; returns both."""
    out = ops.prefill_attention(*args, plan=plan, **variant)
    expected = reference.prefill_attention_ref(*args, **variant)
    torch_lowp = reference.prefill_attention_ref(*args, **variant, compute_dtype=args[0].dtype)
    assert_close_to_reference(out, expected, torch_lowp, f"{what} {variant}")
    return out, expected


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", cases(CASES))
def test_prefill_variants_random(case, isa, monkeypatch):
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng, replay = case_generator(f"prefill_variants isa={isa!r}", case)
    layout = random_layout(rng, max_kv_heads=4, max_group=4)
    dtype = rng.choice(DTYPES)
    causal = rng.random() < 0.5
    batch = rng.randint(1, 4)
    lengths_q = random_lengths(rng, batch, choices=(0, 1, 7, 33, 100, 257, 600))
    lengths_k = [s + rng.choice([0, 9, 300]) if rng.random() < 0.5 else s for s in lengths_q]  # cached prefixes
    if rng.random() < 0.2:  # rows before the first key (causal): they see nothing
        lengths_k = [max(0, s - rng.randint(0, 40)) for s in lengths_q]
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q = strided_rows(randn((int(cu_q[-1]), layout.group * layout.qk_width), dtype, gen), rng)
    k = strided_rows(randn((int(cu_k[-1]), layout.qk_width), dtype, gen), rng)
    v = strided_rows(randn((int(cu_k[-1]), layout.v_width), dtype, gen), rng)
    window_left = rng.choice([-1, 0, 1, 15, 100, 255, 256, 300, 5000])
    softcap = rng.choice([0.0, 0.0, 5.0, 30.0])
    sinks = randn((layout.num_kv_heads * layout.group,), torch.float32, gen) * 2 if rng.random() < 0.5 else None
    scale = rng.uniform(0.05, 0.5)
    args = (q, k, v, cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group, scale, causal)
    plan = None
    if rng.random() < 0.5:  # a caller's plan, balanced for the window or not: the same attention either way
        plan = ops.prefill_plan(cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group, causal,
                                num_workers=rng.choice([1, 3, 7]), row_block=rng.choice([16, 64, 256]),
                                window_left=rng.choice([-1, window_left]))
    _check(args, f"prefill_attention causal={causal} {replay}", window_left=window_left, softcap=softcap, sinks=sinks,
           plan=plan)


def _long_inputs(dtype, seed):
    """Sequences spanning many key blocks and row tiles, one with a cached prefix (1313 keys for 600 queries), on a
    layout with narrow and 256-wide heads."""
    gen = torch.Generator().manual_seed(seed)
    qk_dims, v_dims, group = [8, 256, 40], [256, 16, 72], 2
    qk_offsets, v_offsets = offsets(qk_dims), offsets(v_dims)
    cu_q, cu_k = offsets([1100, 37, 600]), offsets([1100, 37, 1313])
    q = randn((int(cu_q[-1]), group * sum(qk_dims)), dtype, gen)
    k = randn((int(cu_k[-1]), sum(qk_dims)), dtype, gen)
    v = randn((int(cu_k[-1]), sum(v_dims)), dtype, gen)
    sinks = randn((group * len(qk_dims),), torch.float32, gen) * 3
    return (q, k, v, cu_q, cu_k, qk_offsets, v_offsets, group, 0.125), sinks


@pytest.mark.parametrize("isa", LONG_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_window_long_sequences(causal, dtype, isa, monkeypatch):
    """Windows whose edge falls inside a 256-key block (37: the rows of one 256-row tile start their windows blocks
    apart) and on a block boundary (256), and one longer than every sequence, which is the unwindowed attention
    exactly (random cases cover windows of 0, 1 and 255 keys)."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    base, _ = _long_inputs(dtype, 7)
    args = (*base, causal)
    for window_left in (37, 256):
        _check(args, f"prefill_attention long causal={causal} isa={isa!r}", window_left=window_left)
    torch.testing.assert_close(ops.prefill_attention(*args, window_left=1500), ops.prefill_attention(*args),
                               rtol=0, atol=0)


@pytest.mark.parametrize("isa", LONG_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_all_variants_at_once(causal, dtype, isa, monkeypatch):
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    base, sinks = _long_inputs(dtype, 11)
    _check((*base, causal), f"all at once causal={causal} isa={isa!r}", window_left=300, softcap=5.0, sinks=sinks)


@pytest.mark.parametrize("isa", LONG_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_caller_plan_with_and_without_window(dtype, isa, monkeypatch):
    """A plan only schedules the rows: balanced for the window or not, it gives the windowed attention."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    base, sinks = _long_inputs(dtype, 13)
    args = (*base, True)
    q, k, v, cu_q, cu_k, qk_offsets, v_offsets, group = base[:8]
    variant = {"window_left": 200, "softcap": 30.0, "sinks": sinks}

    def plan(window_left):
        return ops.prefill_plan(cu_q, cu_k, qk_offsets, v_offsets, group, True, num_workers=3, row_block=64,
                                window_left=window_left)

    balanced, _ = _check(args, "plan balanced for the window", plan=plan(200), **variant)
    torch.testing.assert_close(ops.prefill_attention(*args, plan=plan(-1), **variant), balanced)


def test_prefill_rows_that_see_no_key_are_zero_with_sinks():
    """Causal rows before the first key (s_q > s_k) see nothing: zeros, sink or not, window or not."""
    gen = torch.Generator().manual_seed(5)
    qk_offsets, v_offsets = offsets([16, 8]), offsets([8, 24])
    cu_q, cu_k = offsets([20, 300]), offsets([5, 290])
    q = randn((320, 2 * 24), torch.float32, gen)
    k, v = randn((295, 24), torch.float32, gen), randn((295, 32), torch.float32, gen)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    args = (q, k, v, cu_q, cu_k, qk_offsets, v_offsets, 2, 0.3, True)
    for window_left in (-1, 0, 3):
        out, _ = _check(args, "rows without keys", window_left=window_left, sinks=sinks)
        assert out[:15].abs().max() == 0 and out[20:30].abs().max() == 0
        assert out[15:20].abs().min() > 0
