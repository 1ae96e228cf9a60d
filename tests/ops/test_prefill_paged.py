"""prefill_attention reading its keys and values from a paged cache (block_table) on the CPU: against the float64
reference and against the same keys given as packed rows, for random varlen batches with cached prefixes, page sizes
that do and do not divide the kernel's 256-key blocks, shuffled pages, NaN in every slot and page no query sees
(slots past each request's last key, unused pages, and the pages before a sliding window's reach, whose block-table
entries the op must neither check nor read), soft-capping and sinks; then the argument errors."""
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
)
from fdc_ops import ops, reference

CASES = 24
ISAS = ("", "avx512", "portable")


def paged_context(keys: list[torch.Tensor], page_size: int, rng, dead_pages: list[int]):
    """Rows (s_k, W) of each request as NaN-poisoned dim-major pages (num_pages, W, page_size) in shuffled order,
    and the block table; the first dead_pages[b] pages of request b point at a page of NaN (no query sees them)."""
    width = keys[0].shape[1]
    counts = [-(-k.shape[0] // page_size) for k in keys]
    num_pages = sum(counts) + 2  # one spare page of NaN, one never named
    order = list(range(num_pages))
    rng.shuffle(order)
    nan_page = order.pop()
    pages = torch.full((num_pages, width, page_size), float("nan"), dtype=keys[0].dtype)
    table = torch.full((len(keys), max(counts + [1]) + rng.randint(0, 2)), -1, dtype=torch.int32)
    for b, rows in enumerate(keys):
        for p in range(counts[b]):
            page = nan_page if p < dead_pages[b] else order.pop()
            table[b, p] = page
            if page != nan_page:
                chunk = rows[p * page_size:(p + 1) * page_size]
                pages[page, :, :chunk.shape[0]] = chunk.T
    return pages, table


def _inputs(rng, gen, dtype, page_size, window_left):
    layout = random_layout(rng, max_kv_heads=4, max_group=3)
    batch = rng.randint(1, 4)
    lengths_q = random_lengths(rng, batch, choices=(0, 1, 5, 33, 130, 300))
    lengths_k = [s + rng.choice([0, 3, 17, 256, 700]) for s in lengths_q]  # cached prefixes
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q = randn((int(cu_q[-1]), layout.group * layout.qk_width), dtype, gen)
    k = randn((int(cu_k[-1]), layout.qk_width), dtype, gen)
    v = randn((int(cu_k[-1]), layout.v_width), dtype, gen)
    k_rows = [k[cu_k[b]:cu_k[b + 1]] for b in range(batch)]
    v_rows = [v[cu_k[b]:cu_k[b + 1]] for b in range(batch)]
    # Pages wholly before the first query's window hold no key any query sees.
    dead = [0 if s_q == 0 else max(0, s_k - s_q - window_left) // page_size if window_left >= 0 else 0
            for s_q, s_k in zip(lengths_q, lengths_k)]
    state = rng.getstate()
    k_pages, table = paged_context(k_rows, page_size, rng, dead)
    rng.setstate(state)  # the same page order for v
    v_pages, v_table = paged_context(v_rows, page_size, rng, dead)
    assert torch.equal(table, v_table)
    return layout, (q, k, v, cu_q, cu_k), (k_pages, v_pages, table)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", cases(CASES))
def test_prefill_paged_random(case, isa, monkeypatch):
    monkeypatch.setenv("FDC_CPU_ISA", isa)
    gen, rng, replay = case_generator(f"prefill_paged isa={isa!r}", case)
    dtype = rng.choice(DTYPES)
    page_size = rng.choice([1, 3, 16, 32, 100, 256])
    window_left = rng.choice([-1, -1, 0, 40, 255, 600])
    causal = rng.random() < 0.75
    layout, (q, k, v, cu_q, cu_k), (k_pages, v_pages, table) = _inputs(rng, gen, dtype, page_size, window_left)
    variant = dict(window_left=window_left, softcap=rng.choice([0.0, 0.0, 20.0]),
                   sinks=randn((layout.num_kv_heads * layout.group,), torch.float32, gen)
                   if rng.random() < 0.3 else None)
    common = (cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group, 0.125, causal)
    what = f"paged prefill page_size={page_size} causal={causal} {variant} {replay}"

    out = ops.prefill_attention(q, k_pages, v_pages, *common, block_table=table, **variant)
    expected = reference.prefill_attention_ref(q, k, v, *common, **variant)
    torch_lowp = reference.prefill_attention_ref(q, k, v, *common, **variant, compute_dtype=dtype)
    assert_close_to_reference(out, expected, torch_lowp, what)
    # The reference reading the pages agrees with it on the packed rows.
    from_pages = reference.prefill_attention_ref(q, k_pages, v_pages, *common, block_table=table, **variant)
    torch.testing.assert_close(from_pages, expected, rtol=1e-12, atol=1e-12, msg=what)
    # The kernel computes the same products over the same blocks either way: bit for bit the packed-rows result.
    packed = ops.prefill_attention(q, k, v, *common, **variant)
    assert torch.equal(out, packed), what


def test_prefill_paged_plan_and_strided_queries():
    """A caller's plan (made from the same boundaries) and queries with a row stride read pages like the default."""
    gen, rng, replay = case_generator("prefill_paged_plan", 0)
    layout, (q, k, v, cu_q, cu_k), (k_pages, v_pages, table) = _inputs(rng, gen, torch.float32, 16, -1)
    common = (cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group, 0.2, True)
    plan = ops.prefill_plan(cu_q, cu_k, layout.qk_offsets, layout.v_offsets, layout.group, True, num_workers=3)
    wide = torch.cat([q, torch.full_like(q[:, :8], float("nan"))], dim=1)[:, :q.shape[1]]
    out = ops.prefill_attention(wide, k_pages, v_pages, *common, plan=plan, block_table=table)
    torch.testing.assert_close(out, ops.prefill_attention(q, k, v, *common), rtol=0, atol=0, msg=replay)


def _pages_args(**changes):
    """Two requests (3 queries over 6 keys, 2 over 2) on 4-token pages."""
    qk, vo, group = offsets([8, 16]), offsets([16, 8]), 2
    args = dict(q=torch.randn(5, group * 24), k=torch.randn(3, 24, 4), v=torch.randn(3, 24, 4),
                cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 6, 8], dtype=torch.int32), qk_offsets=qk, v_offsets=vo, group=group,
                scale=0.3, causal=True, block_table=torch.tensor([[2, 0], [1, -1]], dtype=torch.int32))
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, message", [
    (dict(block_table=torch.tensor([[2, 0], [1, -1]], dtype=torch.int64)), "block_table must be int32"),
    (dict(block_table=torch.tensor([[2, 0, 1]], dtype=torch.int32)), r"block_table must have shape \(B=2"),
    (dict(k=torch.randn(3, 24)), "k must have 3 dimensions"),
    (dict(k=torch.randn(3, 16, 4)), r"k must have shape \(num_pages, 24, page_size\)"),
    (dict(v=torch.randn(3, 24, 5)), r"v must have shape \(3, 24, 4\)"),
    (dict(k=torch.randn(3, 4, 24).transpose(1, 2)), "must have contiguous pages"),
    (dict(cu_seqlens_k=torch.tensor([0, 9, 11], dtype=torch.int32)), "request 0 has 9 keys"),
    (dict(block_table=torch.tensor([[2, 3], [1, -1]], dtype=torch.int32)), r"block_table\[0\]\[1\] = 3"),
    (dict(block_table=torch.tensor([[2, 0], [-1, 1]], dtype=torch.int32)), r"block_table\[1\]\[0\] = -1"),
])
def test_prefill_paged_bad_input(changes, message):
    with pytest.raises(RuntimeError, match=rf"^fdc::prefill_attention: (.|\n)*{message}"):
        ops.prefill_attention(**_pages_args(**changes))


def test_prefill_paged_window_skips_entries():
    """Entries of pages before the first query's window are neither checked nor read (-1 there is accepted), while
    the same -1 without the window is refused."""
    args = _pages_args(block_table=torch.tensor([[-1, 0], [1, -1]], dtype=torch.int32),
                       cu_seqlens_k=torch.tensor([0, 7, 9], dtype=torch.int32))
    args["k"], args["v"] = torch.randn(3, 24, 4), torch.randn(3, 24, 4)
    # Request 0: queries at positions 4..6, window 0: keys 4..6 only, all on its second page.
    out = ops.prefill_attention(**args, window_left=0)
    assert out.isfinite().all()
    with pytest.raises(RuntimeError, match=r"block_table\[0\]\[0\] = -1"):
        ops.prefill_attention(**args)
