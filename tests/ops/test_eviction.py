"""Token eviction (fdc_ops.eviction) against its float64 reference: the window scores of both methods, the selection,
and the in-place compaction of contiguous and paged caches (NaN-poisoned unused slots), plus the refusals."""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import (
    assert_close_to_reference,
    case_generator,
    cases,
    nan_padded_caches,
    randn,
    random_block_table,
    random_layout,
    to_pages,
)
from fdc_ops import eviction, ops, reference

CASES = 24


def _policy(rng: random.Random, method: str) -> eviction.EvictionPolicy:
    return eviction.EvictionPolicy(method, keep=rng.choice([0.05, 0.3, 0.5, 0.77, 1.0]),
                                   window=rng.choice([1, 4, 8, 32]), recent=rng.choice([None, 0, 3]),
                                   kernel=rng.choice([1, 3, 7]), temperature=rng.choice([1.0, 1.5]),
                                   seed=rng.randrange(100))


def _cache_case(rng, gen, dtype, max_dim=64):
    """A layout, lengths, a NaN-poisoned contiguous K cache and each request's last ``queries`` packed query rows."""
    layout = random_layout(rng, max_kv_heads=4, max_group=4, max_dim=max_dim)
    batch = rng.randint(1, 4)
    lengths = [rng.choice([0, 1, 5, 17, 40, 97]) for _ in range(batch)]
    capacity = max(lengths) + rng.randint(0, 9)
    k_cache = torch.full((batch, capacity, layout.qk_width), float("nan"), dtype=dtype)
    for b, length in enumerate(lengths):
        k_cache[b, :length] = randn((length, layout.qk_width), dtype, gen)
    counts = [rng.choice([length, length, rng.randint(0, length)]) for length in lengths]
    q = randn((sum(counts), layout.group * layout.qk_width), dtype, gen)
    return layout, lengths, k_cache, q, ops.prefix_sums(counts)


@pytest.mark.parametrize("method", eviction.METHODS)
def test_window_scores_match_the_reference(method):
    for case in cases(CASES):
        gen, rng, replay = case_generator(f"window_scores_{method}", case)
        dtype = rng.choice([torch.float32, torch.bfloat16])
        layout, lengths, k_cache, q, cu = _cache_case(rng, gen, dtype)
        policy = _policy(rng, method)
        softcap = rng.choice([0.0, 0.0, 5.0])
        scale = layout.qk_dims[0] ** -0.5
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        args = (q, cu, k_cache, seqlens, layout.qk_offsets, layout.group, scale, policy, softcap)
        actual = eviction.window_scores(*args, seed=7)
        expected = reference.window_scores_ref(*args, seed=7)
        # The op computes in float32 from keys and queries of any dtype and returns float32 (as the torch path of
        # other devices does), so the peer of FlashAttention's rule is the same computation in float32.
        torch_float32 = reference.window_scores_ref(*args, seed=7, compute_dtype=torch.float32)
        assert actual.dtype == torch.float32 and actual.shape == expected.shape, replay
        assert torch.isfinite(actual).all(), replay
        assert_close_to_reference(actual, expected, torch_float32, f"window_scores {method} {dtype} {replay}")
        for b, length in enumerate(lengths):  # each query's probabilities sum to 1: the total is the query count
            queries = min(policy.window, int(cu[b + 1] - cu[b]))
            if method == "keyformer" and queries:
                totals = actual[b].sum(1).double()
                torch.testing.assert_close(totals, torch.full_like(totals, float(queries * layout.group)),
                                           rtol=1e-4, atol=1e-4, msg=replay)
            assert (actual[b, :, length:] == 0).all(), replay


@pytest.mark.parametrize("keyformer", [True, False])
def test_window_scores_op_equals_the_torch_path(keyformer):
    """ops.window_scores (the CPU kernel) against the torch operations eviction uses on other devices, with queries
    and keys of different dtypes, NaN-poisoned slots past each length, and odd windows."""
    for case in cases(CASES):
        gen, rng, replay = case_generator(f"window_scores_op_{keyformer}", case)
        layout, lengths, k_cache, q, cu = _cache_case(rng, gen, rng.choice([torch.float32, torch.float16]))
        q = q.to(rng.choice([torch.float32, torch.bfloat16, torch.float16]))
        policy = eviction.EvictionPolicy("keyformer" if keyformer else "snapkv", 0.5, window=rng.choice([1, 5, 32]),
                                         temperature=rng.choice([1.0, 0.6]) if keyformer else 1.0)
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        softcap, seed = rng.choice([0.0, 4.0]), rng.randrange(1000)
        scale = layout.qk_dims[0] ** -0.5
        actual = ops.window_scores(q, cu, k_cache, seqlens, layout.qk_offsets, layout.group, scale, policy.window,
                                   softcap, eviction.noise_state(seed, len(lengths)) if keyformer else None,
                                   policy.temperature)
        assert actual.shape == (len(lengths), layout.num_kv_heads, k_cache.shape[1]), replay
        if k_cache.shape[1] == 0:  # the torch path's caller (window_scores) returns before it for an empty cache
            continue
        expected = eviction._summed_probabilities(q, cu, k_cache, seqlens, layout.qk_offsets, layout.group, scale,
                                                  policy, softcap, seed)
        for b, length in enumerate(lengths):
            torch.testing.assert_close(actual[b, :, :length], expected[b, :, :length], rtol=1e-4,
                                       atol=1e-5 * policy.window * layout.group, msg=replay)
            assert (actual[b, :, length:] == 0).all(), replay


def test_keyformer_noise_is_seeded_and_a_request_scores_the_same_in_any_batch():
    gen, rng, _ = case_generator("keyformer_seed", 0)
    layout = random_layout(rng, max_kv_heads=3, max_group=3, max_dim=32)
    lengths = [30, 9, 17]
    k_cache = randn((3, 32, layout.qk_width), torch.float32, gen)
    q = randn((sum(lengths), layout.group * layout.qk_width), torch.float32, gen)
    cu, seqlens = ops.prefix_sums(lengths), torch.tensor(lengths, dtype=torch.int32)

    policy = eviction.EvictionPolicy("keyformer", 0.5, window=8)

    def scores(seed):
        return eviction.window_scores(q, cu, k_cache, seqlens, layout.qk_offsets, layout.group, 0.1, policy, seed=seed)

    together = scores(1)
    assert torch.equal(together, scores(1))
    assert not torch.equal(together, scores(2))
    alone = eviction.window_scores(q[lengths[0]: lengths[0] + lengths[1]], ops.prefix_sums(lengths[1:2]),
                                   k_cache[1:2], seqlens[1:2], layout.qk_offsets, layout.group, 0.1, policy, seed=1)
    assert torch.equal(alone[0, :, : lengths[1]], together[1, :, : lengths[1]])


def test_selection_matches_the_reference():
    for case in cases(CASES):
        gen, rng, replay = case_generator("select_tokens", case)
        batch = rng.randint(1, 5)
        lengths = [rng.choice([0, 1, 2, 9, 33, 64]) for _ in range(batch)]
        width = max(lengths) + rng.randint(0, 5)
        if rng.random() < 0.5:  # ties: scores on a few levels, broken to the earlier token
            scores = torch.randint(0, 3, (batch, width), generator=gen).double()
        else:
            scores = torch.rand((batch, width), generator=gen, dtype=torch.float64)
        scores[:, max(lengths):] = float("nan")  # past every length: never read
        policy = _policy(rng, rng.choice(eviction.METHODS))
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        index, kept = eviction.select_tokens(scores, seqlens, policy)
        expected = reference.select_tokens_ref(scores, seqlens, policy)
        assert kept == [len(tokens) for tokens in expected], replay
        for b, tokens in enumerate(expected):
            assert index[b, : kept[b]].tolist() == tokens, replay
            assert kept[b] == (0 if lengths[b] == 0 else max(1, math.ceil(policy.keep * lengths[b] - 1e-9))), replay


def _per_head_selection(gen, lengths, heads, capacity, policy):
    """select_tokens run per KV head on random scores: (index (B, H_kv, max kept), kept counts, per request the
    tokens of each head)."""
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    index, kept = eviction.select_tokens(torch.rand((len(lengths) * heads, capacity), generator=gen),
                                         seqlens.repeat_interleave(heads), policy)
    index, kept = index.view(len(lengths), heads, -1), kept[::heads]
    return index, kept, [[index[b, j, : kept[b]].tolist() for j in range(heads)] for b in range(len(lengths))]


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per_head"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_compaction_matches_the_reference(paged, per_head):
    """Kept tokens move to the front, every other slot keeps what it held (NaN-poisoned); per KV head (index (B,
    H_kv, max kept)) each head's tokens move within its own columns. Float caches, contiguous and paged."""
    for case in cases(CASES):
        gen, rng, replay = case_generator(f"compact_kv_{paged}_{per_head}", case)
        dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        layout = random_layout(rng, max_kv_heads=4, max_group=1, max_dim=40)
        batch = rng.randint(1, 4)
        lengths = [rng.choice([0, 1, 6, 16, 45, 70]) for _ in range(batch)]
        capacity = max(lengths) + rng.randint(0, 7)
        k_cache, v_cache = nan_padded_caches(layout, lengths, capacity, dtype, gen)
        policy = _policy(rng, "snapkv")
        offsets, columns = None, {}
        if per_head:
            index, kept, selections = _per_head_selection(gen, lengths, layout.num_kv_heads, capacity, policy)
            offsets = (layout.qk_offsets, layout.v_offsets)
            columns = dict(qk_offsets=layout.qk_offsets, v_offsets=layout.v_offsets)
        else:
            index, kept = eviction.select_tokens(torch.rand((batch, capacity), generator=gen),
                                                 torch.tensor(lengths, dtype=torch.int32), policy)
            selections = [index[b, : kept[b]].tolist() for b in range(batch)]
        table = None
        if paged:
            page_size = rng.choice([1, 4, 16])
            table, num_pages = random_block_table(lengths, capacity, page_size, rng)
            k_cache = to_pages(k_cache, lengths, table, num_pages, page_size)
            v_cache = to_pages(v_cache, lengths, table, num_pages, page_size)
        expected_k, expected_v = reference.compact_kv_ref(k_cache, v_cache, selections, table, offsets)
        seqlens = torch.tensor(lengths, dtype=torch.int32)
        eviction.compact_kv(k_cache, v_cache, seqlens, index, kept, table, **columns)
        assert seqlens.tolist() == kept, replay
        torch.testing.assert_close(k_cache, expected_k, rtol=0, atol=0, equal_nan=True, msg=replay)
        torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0, equal_nan=True, msg=replay)


def test_decode_after_per_head_compaction_attends_each_heads_tokens():
    """Decode over a cache compacted per KV head equals attention in which each KV head sees its own kept tokens."""
    gen, rng, _ = case_generator("decode_after_per_head_compaction", 0)
    layout = random_layout(rng, max_kv_heads=3, max_group=3, max_dim=48)
    heads, lengths = layout.num_kv_heads, [37, 80, 5]
    k_cache = randn((3, 96, layout.qk_width), torch.float32, gen)
    v_cache = randn((3, 96, layout.v_width), torch.float32, gen)
    q = randn((3, layout.group * layout.qk_width), torch.float32, gen)
    policy = eviction.EvictionPolicy("snapkv", keep=0.4, window=4, per_head=True)
    index, kept, selections = _per_head_selection(gen, lengths, heads, 96, policy)
    expected = torch.zeros(3, layout.group * layout.v_width, dtype=torch.float64)
    for j in range(heads):  # each KV head alone, over its own kept rows
        k0, k1 = layout.qk_offsets[j : j + 2].tolist()
        v0, v1 = layout.v_offsets[j : j + 2].tolist()
        rows = [torch.tensor(selections[b][j]) for b in range(3)]
        alone_k = torch.nn.utils.rnn.pad_sequence([k_cache[b, rows[b], k0:k1] for b in range(3)], batch_first=True)
        alone_v = torch.nn.utils.rnn.pad_sequence([v_cache[b, rows[b], v0:v1] for b in range(3)], batch_first=True)
        one = torch.tensor([0, k1 - k0], dtype=torch.int32), torch.tensor([0, v1 - v0], dtype=torch.int32)
        head_q = q[:, layout.group * k0: layout.group * k1]
        expected[:, layout.group * v0: layout.group * v1] = reference.decode_attention_ref(
            head_q.double(), alone_k.double(), alone_v.double(), torch.tensor(kept, dtype=torch.int32), *one,
            layout.group, 0.2)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    eviction.compact_kv(k_cache, v_cache, seqlens, index, kept, qk_offsets=layout.qk_offsets,
                        v_offsets=layout.v_offsets)
    out = ops.decode_attention(q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, 0.2)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


def test_decode_after_compaction_attends_the_kept_tokens():
    """The compacted cache is a cache like any other: decode over it equals decode over the kept rows alone."""
    gen, rng, _ = case_generator("decode_after_compaction", 0)
    layout = random_layout(rng, max_kv_heads=3, max_group=3, max_dim=48)
    lengths = [37, 80, 5]
    k_cache = randn((3, 96, layout.qk_width), torch.float32, gen)
    v_cache = randn((3, 96, layout.v_width), torch.float32, gen)
    q = randn((3, layout.group * layout.qk_width), torch.float32, gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    policy = eviction.EvictionPolicy("snapkv", keep=0.4, window=4)
    index, kept = eviction.select_tokens(torch.rand((3, 96), generator=gen), seqlens, policy)
    kept_k = [k_cache[b, index[b, : kept[b]]] for b in range(3)]
    kept_v = [v_cache[b, index[b, : kept[b]]] for b in range(3)]
    eviction.compact_kv(k_cache, v_cache, seqlens, index, kept)
    out = ops.decode_attention(q, k_cache, v_cache, seqlens, layout.qk_offsets, layout.v_offsets, layout.group, 0.2)
    alone = torch.nn.utils.rnn.pad_sequence(kept_k, batch_first=True), torch.nn.utils.rnn.pad_sequence(kept_v,
                                                                                                       batch_first=True)
    expected = reference.decode_attention_ref(q.double(), alone[0].double(), alone[1].double(), seqlens,
                                              layout.qk_offsets, layout.v_offsets, layout.group, 0.2)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("keep", [0, 0.0, -0.5, 1.5, float("nan"), float("inf"), "half"])
def test_bad_budgets_are_refused(keep):
    with pytest.raises(ValueError, match=r"fdc_ops.eviction.EvictionPolicy: keep must be a share"):
        eviction.EvictionPolicy("keyformer", keep=keep)


@pytest.mark.parametrize("field, value, message", [
    ("method", "h2o", "method must be one of"), ("window", 0, "window must be a positive int"),
    ("kernel", 4, "kernel must be odd"), ("recent", -1, "recent must be an int"),
    ("temperature", 0.0, "temperature must be positive")])
def test_bad_policies_are_refused(field, value, message):
    settings = {"method": "snapkv", "keep": 0.5, field: value}
    with pytest.raises(ValueError, match=message):
        eviction.EvictionPolicy(**settings)


def test_a_refused_compaction_changes_nothing():
    k_cache, v_cache = torch.randn(2, 10, 8), torch.randn(2, 10, 16)
    seqlens = torch.tensor([6, 9], dtype=torch.int32)
    before = (k_cache.clone(), v_cache.clone(), seqlens.clone())
    decreasing, past_the_length = torch.tensor([[0, 2, 1], [0, 1, 2]]), torch.tensor([[0, 1, 6], [0, 1, 2]])
    for index in (decreasing, past_the_length):
        with pytest.raises(ValueError, match=r"fdc_ops.eviction.compact_kv: index\[0, :3\] must be increasing"):
            eviction.compact_kv(k_cache, v_cache, seqlens, index, [3, 3])
    with pytest.raises(ValueError, match="exceeds the cached tokens"):
        eviction.compact_kv(k_cache, v_cache, seqlens, torch.arange(7).repeat(2, 1), [7, 7])
    with pytest.raises(ValueError, match="index must be"):
        eviction.compact_kv(k_cache, v_cache, seqlens, torch.zeros(2, 3, dtype=torch.int32), [1, 1])
    per_head = torch.tensor([[[0, 1, 2], [0, 2, 1]], [[0, 1, 2], [0, 1, 2]]])
    halves = torch.tensor([0, 4, 8], dtype=torch.int32), torch.tensor([0, 8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"index\[0, 1, :3\] must be increasing"):
        eviction.compact_kv(k_cache, v_cache, seqlens, per_head, [3, 3], qk_offsets=halves[0], v_offsets=halves[1])
    with pytest.raises(ValueError, match="per-KV-head compaction needs qk_offsets of 3 prefix sums"):
        eviction.compact_kv(k_cache, v_cache, seqlens, per_head.sort(dim=2).values, [3, 3])
    with pytest.raises(ValueError, match=r"v_offsets \[0, 8, 12\] make 12 columns per token"):
        eviction.compact_kv(k_cache, v_cache, seqlens, per_head.sort(dim=2).values, [3, 3], qk_offsets=halves[0],
                            v_offsets=torch.tensor([0, 8, 12], dtype=torch.int32))
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table's entries"):
        eviction.compact_kv(torch.zeros(3, 8, 8), torch.zeros(3, 16, 8), seqlens, torch.zeros(2, 1,
                                                                                                dtype=torch.int64),
                            [1, 1], table)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]) and torch.equal(seqlens, before[2])
