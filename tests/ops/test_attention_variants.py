"""The attention variants of today's models (sliding windows, logit soft-capping, attention sinks) in
prefill_attention and decode_attention on the CPU, against the float64 references, over freshly drawn random
configurations; and the references themselves against Hugging Face transformers' own definitions (Gemma 2's
soft-capping, gpt-oss's sinks, the sliding-window mask of Mistral, Qwen2 and Gemma)."""

from __future__ import annotations

import types

import pytest
import torch

from conftest import (
    DTYPES,
    Layout,
    assert_close_to_reference,
    case_generator,
    cases,
    nan_padded_caches,
    offsets,
    randn,
    random_block_table,
    random_layout,
    random_lengths,
    strided_rows,
    to_pages,
)
from fdc_ops import ops, reference

CASES = 40  # per op, cache kind and ISA: every variant alone and together, windows below, at and past the lengths


def _hf_mask(window: int, s_q: int, s_k: int) -> torch.Tensor:
    """(s_q, s_k) additive float64 mask of transformers' sliding-window causal mask function (a model config's
    `sliding_window` = window), queries at the last s_q positions."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    visible = sliding_window_causal_mask_function(window)
    q_idx = torch.arange(s_k - s_q, s_k)[:, None]
    kv_idx = torch.arange(s_k)[None, :]
    allowed = visible(0, 0, q_idx, kv_idx).expand(s_q, s_k)
    return torch.zeros(s_q, s_k, dtype=torch.float64).masked_fill(~allowed, float("-inf"))


def _full_width_inputs(heads_kv: int, group: int, dim: int, s_q: int, s_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads_kv * group, s_q, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, heads_kv, s_k, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, heads_kv, s_k, dim, generator=gen, dtype=torch.float64)
    return q, k, v


def _packed(q, k, v):
    """transformers' (1, heads, S, D) tensors in the packed layout: (S, heads * D)."""
    return (t[0].transpose(0, 1).reshape(t.shape[2], -1) for t in (q, k, v))


@pytest.mark.parametrize("s_q", [1, 5, 23])
def test_references_follow_transformers(s_q):
    """window_left = sliding_window - 1, softcap as Gemma 2 applies it, sinks as gpt-oss adds them: the references
    give transformers' eager attention (with its own sliding-window mask) to its own rounding."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_attention
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_attention

    heads_kv, group, dim, s_k, window, scale = 2, 3, 16, 23, 6, 0.3
    q, k, v = _full_width_inputs(heads_kv, group, dim, s_q, s_k, seed=s_q)
    mask = _hf_mask(window, s_q, s_k)[None, None]
    widths = offsets([dim] * heads_kv)
    cu_q, cu_k = torch.tensor([0, s_q], dtype=torch.int32), torch.tensor([0, s_k], dtype=torch.int32)
    packed = (*_packed(q, k, v), cu_q, cu_k, widths, widths, group, scale, True)

    module = types.SimpleNamespace(num_key_value_groups=group, head_dim=dim, training=False)
    expected, _ = gemma2_attention(module, q, k, v, mask, scaling=scale, softcap=2.5)
    ours = reference.prefill_attention_ref(*packed, window_left=window - 1, softcap=2.5)
    # Gemma 2's eager softmax runs in float32 even for float64 inputs; a misplaced window edge or cap is off by 1e-1.
    torch.testing.assert_close(ours, expected.reshape(s_q, -1), rtol=1e-5, atol=1e-6)

    module.sinks = torch.randn(heads_kv * group, dtype=torch.float64, generator=torch.Generator().manual_seed(7)) * 2
    expected, _ = gpt_oss_attention(module, q, k, v, mask, scaling=scale)
    ours = reference.prefill_attention_ref(*packed, window_left=window - 1, sinks=module.sinks)
    torch.testing.assert_close(ours, expected.reshape(s_q, -1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window_left", [-1, 0, 3, 40])
def test_decode_reference_is_the_last_prefill_row(window_left):
    """A decode step is the last row of a causal prefill over the same keys, with every variant."""
    gen = torch.Generator().manual_seed(window_left + 5)
    qk, v_offsets, group, length = offsets([8, 24]), offsets([16, 8]), 2, 30
    q = torch.randn(1, group * 32, generator=gen, dtype=torch.float64)
    k = torch.randn(length, 32, generator=gen, dtype=torch.float64)
    v = torch.randn(length, 24, generator=gen, dtype=torch.float64)
    sinks = torch.randn(4, generator=gen)
    variants = dict(window_left=window_left, softcap=1.5, sinks=sinks)
    cu_q, cu_k = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, length], dtype=torch.int32)
    prefill = reference.prefill_attention_ref(q, k, v, cu_q, cu_k, qk, v_offsets, group, 0.4, True, **variants)
    decode = reference.decode_attention_ref(q, k[None], v[None], torch.tensor([length], dtype=torch.int32), qk,
                                            v_offsets, group, 0.4, **variants)
    torch.testing.assert_close(decode, prefill, rtol=1e-12, atol=1e-12)


def _random_variant(rng, gen, layout, longest: int) -> dict:
    """window_left, softcap and sinks, each on or off: windows of 0 keys, shorter than, near and past the
    longest sequence; caps small enough to matter; sinks from far below to far above the scores."""
    variant = {}
    if rng.random() < 0.7:
        variant["window_left"] = rng.choice([0, 1, 7, 63, 200, max(0, longest - 1), longest + 50])
    if rng.random() < 0.5:
        variant["softcap"] = rng.choice([0.5, 5.0, 30.0])
    if rng.random() < 0.5:
        spread = rng.choice([1.0, 5.0, 20.0])
        variant["sinks"] = torch.randn(layout.num_kv_heads * layout.group, generator=gen) * spread
    return variant


@pytest.mark.parametrize("isa", ("", "portable"))
@pytest.mark.parametrize("case", cases(CASES))
def test_prefill_attention_variants(case, isa, monkeypatch):
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng, replay = case_generator("prefill_attention variants", case)
    layout = random_layout(rng)
    dtype = rng.choice(DTYPES)
    causal = rng.random() < 0.7
    batch = rng.randint(1, 4)
    q_lengths = random_lengths(rng, batch, choices=(0, 1, 7, 64, 100, 300))
    if rng.random() < 0.2:
        q_lengths[0] = 700  # key blocks of 256 (the CPU tile) on both sides of a window's edge
    prefixes = [rng.choice([0, 0, 5, 90]) for _ in range(batch)]  # cached keys before the new queries
    k_lengths = [s + p for s, p in zip(q_lengths, prefixes, strict=True)]
    cu_q = ops.prefix_sums(torch.tensor(q_lengths))
    cu_k = ops.prefix_sums(torch.tensor(k_lengths))
    q = strided_rows(randn((int(cu_q[-1]), layout.group * layout.qk_width), dtype, gen), rng)
    k = randn((int(cu_k[-1]), layout.qk_width), dtype, gen)
    v = randn((int(cu_k[-1]), layout.v_width), dtype, gen)
    scale = rng.uniform(0.1, 0.6)
    variant = _random_variant(rng, gen, layout, max(k_lengths))
    plan = None
    if rng.random() < 0.5:
        plan_window = variant.get("window_left", -1) if rng.random() < 0.7 else -1  # balance only: same result
        plan = ops.prefill_plan(cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group, causal,
                                num_workers=rng.choice([1, 3, 8]), window_left=plan_window)
    args = (q, k, v, cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group, scale, causal)
    out = ops.prefill_attention(*args, plan=plan, **variant)
    expected = reference.prefill_attention_ref(*args, **variant)
    torch_lowp = reference.prefill_attention_ref(*args, **variant, compute_dtype=dtype)
    shown = {name: (value if name != "sinks" else "on") for name, value in variant.items()}
    assert_close_to_reference(out, expected, torch_lowp, f"prefill_attention causal={causal} {shown} {replay}")


@pytest.mark.parametrize("isa", ("", "portable"))
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", cases(CASES))
def test_decode_attention_variants(case, paged, isa, monkeypatch):
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng, replay = case_generator(f"decode_attention variants paged={paged}", case)
    layout = random_layout(rng, max_group=16)
    dtype = rng.choice(DTYPES)
    batch = rng.randint(1, 6)
    lengths = random_lengths(rng, batch, choices=(0, 1, 5, 64, 65, 300, 700))
    if rng.random() < 0.3:
        lengths[0] = 3000  # split into several chunks or pieces, the window's edge inside one of them
    capacity = max(lengths) + rng.randint(0, 20)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    k_cache, v_cache = nan_padded_caches(layout, lengths, capacity, dtype, gen)
    variant = _random_variant(rng, gen, layout, max(lengths))
    window_left = variant.get("window_left", -1)
    if window_left >= 0:  # keys outside the window are never read: poison them
        for b, length in enumerate(lengths):
            k_cache[b, :max(0, length - 1 - window_left)] = float("nan")
            v_cache[b, :max(0, length - 1 - window_left)] = float("nan")
    q = strided_rows(randn((batch, layout.group * layout.qk_width), dtype, gen), rng)
    scale = rng.uniform(0.05, 0.5)
    block_table = None
    if paged:
        page_size = rng.choice([1, 3, 16, 64, 100, 256])
        block_table, num_pages = random_block_table(lengths, capacity, page_size, rng)
        k_cache = to_pages(k_cache, lengths, block_table, num_pages, page_size)
        v_cache = to_pages(v_cache, lengths, block_table, num_pages, page_size)
    plan = None
    if rng.random() < 0.5:
        plan = ops.decode_plan(seqlens, layout.qk_offsets, layout.v_offsets, layout.group,
                               num_workers=rng.choice([1, 3, 8, 40]), window_left=window_left)
    args = (q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, scale)
    out = ops.decode_attention(*args, plan=plan, block_table=block_table, **variant)
    expected = reference.decode_attention_ref(*args, block_table=block_table, **variant)
    torch_lowp = reference.decode_attention_ref(*args, block_table=block_table, **variant, compute_dtype=dtype)
    shown = {name: (value if name != "sinks" else "on") for name, value in variant.items()}
    assert_close_to_reference(out, expected, torch_lowp, f"decode_attention paged={paged} {shown} {replay}")


SOFT_CAPS = (1.0, 30.0, 50.0, 500.0, 5000.0)


def _on(device: torch.device, *tensors):
    """The tensors on device (None stays None); the layouts (offsets) stay on the CPU on every device."""
    return [None if t is None else t.to(device) for t in tensors]


def check_soft_cap(op: str, softcap: float, dtype: torch.dtype, case: int, device: torch.device) -> None:
    """One soft-capped prefill (rows or pages) or decode (contiguous or paged) on ``device`` against the float64
    reference under FlashAttention's rule (tests/conftest.py), with scaled scores from near zero (scale 1e-3, and keys
    shrunk by 1e-4 now and then) to tens: far below a large cap a capped score is nearly the score itself, and its
    error must stay a few ulps of it, not of the cap."""
    gen, rng, replay = case_generator(f"soft cap {op} {softcap} {dtype}", case)
    layout = random_layout(rng, max_kv_heads=4, max_group=4) if case else Layout([8], [8], 1)
    scale = rng.choice([1e-3, 0.05, 0.3])
    batch = rng.randint(1, 3) if case else 1
    lengths = [rng.choice([1, 2, 17, 130]) for _ in range(batch)] if case else [2]
    shrink = torch.where(torch.rand(sum(lengths), 1, generator=gen) < 0.3, 1e-4, 1.0)
    k = (randn((sum(lengths), layout.qk_width), torch.float32, gen) * shrink).to(dtype)
    v = randn((sum(lengths), layout.v_width), dtype, gen)
    cu_k = offsets(lengths)
    common = (layout.qk_offsets, layout.v_offsets, layout.group, scale)
    block_table = None
    if op.startswith("prefill"):
        q_lengths = [rng.randint(1, n) for n in lengths] if case else [1]
        cu_q = offsets(q_lengths)
        q = randn((int(cu_q[-1]), layout.group * layout.qk_width), dtype, gen)
        causal = case > 0 and rng.random() < 0.5
        if op == "prefill_paged":
            page_size = rng.choice([1, 3, 16])
            block_table, num_pages = random_block_table(lengths, max(lengths), page_size, rng)
            k_rows, v_rows = torch.zeros(batch, max(lengths), k.shape[1], dtype=dtype), \
                torch.zeros(batch, max(lengths), v.shape[1], dtype=dtype)
            for b, n in enumerate(lengths):
                k_rows[b, :n], v_rows[b, :n] = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
            k = to_pages(k_rows, lengths, block_table, num_pages, page_size)
            v = to_pages(v_rows, lengths, block_table, num_pages, page_size)
        args = (q, k, v, cu_q, cu_k, *common, causal)
        out = ops.prefill_attention(*_on(device, q, k, v, cu_q, cu_k), *common, causal, softcap=softcap,
                                    block_table=_on(device, block_table)[0]).cpu()
        expected = reference.prefill_attention_ref(*args, softcap=softcap, block_table=block_table)
        torch_lowp = reference.prefill_attention_ref(*args, softcap=softcap, block_table=block_table,
                                                     compute_dtype=dtype)
    else:
        k_cache = torch.full((batch, max(lengths), layout.qk_width), float("nan"), dtype=dtype)
        v_cache = torch.full((batch, max(lengths), layout.v_width), float("nan"), dtype=dtype)
        for b, n in enumerate(lengths):
            k_cache[b, :n], v_cache[b, :n] = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        if op == "decode_paged":
            page_size = rng.choice([1, 3, 16])
            block_table, num_pages = random_block_table(lengths, max(lengths), page_size, rng)
            k_cache = to_pages(k_cache, lengths, block_table, num_pages, page_size)
            v_cache = to_pages(v_cache, lengths, block_table, num_pages, page_size)
        q = randn((batch, layout.group * layout.qk_width), dtype, gen)
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        args = (q, k_cache, v_cache, seqlens, *common)
        out = ops.decode_attention(*_on(device, q, k_cache, v_cache, seqlens), *common, softcap=softcap,
                                   block_table=_on(device, block_table)[0]).cpu()
        expected = reference.decode_attention_ref(*args, softcap=softcap, block_table=block_table)
        torch_lowp = reference.decode_attention_ref(*args, softcap=softcap, block_table=block_table,
                                                    compute_dtype=dtype)
    assert_close_to_reference(out, expected, torch_lowp, f"{op} softcap={softcap} scale={scale} {dtype} {replay}")


@pytest.mark.parametrize("isa", ("", "avx512", "portable"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", SOFT_CAPS)
@pytest.mark.parametrize("op", ("prefill", "prefill_paged", "decode", "decode_paged"))
def test_soft_cap_error_stays_torch_s_at_every_cap(op, softcap, dtype, isa, monkeypatch):
    """Every capping op on every ISA path within FlashAttention's rule at caps from 1 to 5000 (tests/conftest.py);
    the first case is the smallest one that showed the old cancellation (1 query, 2 keys, D = 8)."""
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    for case in range(8):
        check_soft_cap(op, softcap, dtype, case, torch.device("cpu"))


def test_decode_plan_from_another_window_is_refused():
    """A plan covers the keys its window makes visible; one made for another window is refused by name."""
    qk, v_offsets, group = offsets([8, 16]), offsets([16, 8]), 2
    seqlens = torch.tensor([40, 7], dtype=torch.int32)
    k_cache, v_cache = torch.randn(2, 40, 24), torch.randn(2, 40, 24)
    q = torch.randn(2, group * 24)
    unwindowed = ops.decode_plan(seqlens, qk, v_offsets, group, num_workers=2)
    with pytest.raises(RuntimeError, match="fdc::decode_attention: .*window_left"):
        ops.decode_attention(q, k_cache, v_cache, seqlens, qk, v_offsets, group, 0.3, plan=unwindowed, window_left=9)
    windowed = ops.decode_plan(seqlens, qk, v_offsets, group, num_workers=2, window_left=9)
    with pytest.raises(RuntimeError, match="fdc::decode_attention: .*window_left"):
        ops.decode_attention(q, k_cache, v_cache, seqlens, qk, v_offsets, group, 0.3, plan=windowed)
