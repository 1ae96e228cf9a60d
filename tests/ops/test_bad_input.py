"""Bad input raises RuntimeError whose message begins `fdc::<op>:` and names the argument; nothing is written."""

from __future__ import annotations

import pytest
import torch

from conftest import cuda_skip_reason, offsets
from fdc_ops import ops
from fdc_ops.plans import PREFILL_HEADER

QK, V, G = offsets([8, 16]), offsets([16, 8]), 2  # widths 24 and 24, 4 query heads


def raises(op: str, argument: str):
    return pytest.raises(RuntimeError, match=rf"^fdc::{op}: (.|\n)*{argument}")


def prefill_args(**changes):
    args = dict(q=torch.randn(5, G * 24), k=torch.randn(5, 24), v=torch.randn(5, 24),
                cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 3, 5], dtype=torch.int32), qk_offsets=QK, v_offsets=V, group=G,
                scale=0.3, causal=True)
    args.update(changes)
    return args


def decode_args(**changes):
    args = dict(q=torch.randn(2, G * 24), k_cache=torch.randn(2, 6, 24), v_cache=torch.randn(2, 6, 24),
                cache_seqlens=torch.tensor([3, 6], dtype=torch.int32), qk_offsets=QK, v_offsets=V, group=G,
                scale=0.3)
    args.update(changes)
    return args


@pytest.mark.parametrize("bad_offsets, why", [
    (torch.tensor([0, 8, 8], dtype=torch.int32), "strictly increasing"),
    (torch.tensor([0, 16, 8], dtype=torch.int32), "strictly increasing"),
    (torch.tensor([0, 12, 24], dtype=torch.int32), "multiples of 8"),
    (torch.tensor([0, 264, 272], dtype=torch.int32), "at most 256"),
    (torch.tensor([8, 16, 24], dtype=torch.int32), "start at 0"),
    (torch.tensor([0, 8, 24], dtype=torch.int64), "int32"),
    (torch.tensor([[0, 8, 24]], dtype=torch.int32), "1-D"),
    (torch.tensor([0], dtype=torch.int32), "at least 2"),
])
def test_bad_offsets_rejected_by_every_op(bad_offsets, why):
    with raises("prefill_attention", f"qk_offsets.*{why}"):
        ops.prefill_attention(**prefill_args(qk_offsets=bad_offsets))
    with raises("decode_attention", f"v_offsets.*{why}"):
        ops.decode_attention(**decode_args(v_offsets=bad_offsets))
    with raises("rotate_compress", f"qk_offsets.*{why}"):
        ops.rotate_compress(torch.randn(3, 4, 32), torch.randn(2, 32, 16), bad_offsets, G)
    with raises("decode_plan", f"qk_offsets.*{why}"):
        ops.decode_plan(torch.tensor([1, 2], dtype=torch.int32), bad_offsets, V, G)
    with raises("prefill_plan", f"v_offsets.*{why}"):
        ops.prefill_plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), QK,
                         bad_offsets, G, False)


def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("fdc::decode_attention", "CUDA")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: mixing devices needs a second real device")
@pytest.mark.skipif(not _has_cuda_kernels(), reason="fdc_ops was built without CUDA kernels")
def test_wrong_device_is_rejected():
    """Mixed devices reach the CUDA kernels (the dispatcher picks CUDA), whose shared checks name the argument."""
    with raises("prefill_attention", "k must be on the device of q"):
        ops.prefill_attention(**prefill_args(q=torch.randn(5, G * 24, device="cuda"),
                                             v=torch.randn(5, 24, device="cuda")))
    with raises("decode_attention", "qk_offsets must be a CPU tensor"):
        args = decode_args(qk_offsets=QK.cuda())
        ops.decode_attention(**{name: t.cuda() if isinstance(t, torch.Tensor) else t for name, t in args.items()})


def test_offsets_of_different_lengths():
    with raises("decode_attention", "v_offsets must have the length of qk_offsets"):
        ops.decode_attention(**decode_args(v_offsets=offsets([16, 8, 8])))


@pytest.mark.parametrize("name, value, argument", [
    ("q", torch.randn(5, G * 24, dtype=torch.float64), "q must be float32, float16 or bfloat16"),
    ("k", torch.randn(5, 24).half(), "k must have the dtype of q"),
    ("v", torch.randn(5, 24, 1), "v must have 2 dimensions"),
    ("q", torch.randn(5, G * 24 + 8), r"q must have 48 columns \(group \* qk_offsets\[-1\]\)"),
    ("k", torch.randn(5, 16), r"k must have 24 columns"),
    ("v", torch.randn(4, 24), "v must have the 5 rows of k"),
    ("group", 0, "group must be at least 1"),
    ("group", 3, r"q must have 72 columns"),
    ("scale", float("nan"), "scale must be a positive finite number"),
    ("cu_seqlens_q", torch.tensor([0, 4, 3], dtype=torch.int32), "cu_seqlens_q must be non-decreasing"),
    ("cu_seqlens_q", torch.tensor([0, 3, 6], dtype=torch.int32), "cu_seqlens_q must end at most at the 5 rows"),
    ("cu_seqlens_k", torch.tensor([0, 3, 9], dtype=torch.int32), "cu_seqlens_k must end at most at the 5 rows"),
    ("cu_seqlens_k", torch.tensor([0, 3], dtype=torch.int32), "cu_seqlens_k must have length 3"),
    ("cu_seqlens_q", torch.tensor([-1, 3, 5], dtype=torch.int32), "cu_seqlens_q must start at a non-negative"),
    ("cu_seqlens_q", torch.tensor([0, 3, 5], dtype=torch.int64), "cu_seqlens_q must be int32"),
])
def test_prefill_attention_bad_input(name, value, argument):
    with raises("prefill_attention", argument):
        ops.prefill_attention(**prefill_args(**{name: value}))


@pytest.mark.parametrize("name, value, argument", [
    ("q", torch.randn(2, G * 24).to(torch.int32), "q must be float32, float16 or bfloat16"),
    ("k_cache", torch.randn(2, 6, 24).bfloat16(), "k_cache must have the dtype of q"),
    ("k_cache", torch.randn(3, 6, 24), r"k_cache must have shape \(B=2, S_max, 24\)"),
    ("v_cache", torch.randn(2, 7, 24), r"v_cache must have shape \(2, 6, 24\)"),
    ("k_cache", torch.randn(2, 6), "k_cache must have 3 dimensions"),
    ("cache_seqlens", torch.tensor([3, 7], dtype=torch.int32), "cache_seqlens must be at most the cache capacity 6"),
    ("cache_seqlens", torch.tensor([-1, 2], dtype=torch.int32), "cache_seqlens must be non-negative"),
    ("cache_seqlens", torch.tensor([3], dtype=torch.int32), "cache_seqlens must have length 2"),
    ("cache_seqlens", torch.tensor([3, 6], dtype=torch.float32), "cache_seqlens must be int32"),
])
def test_decode_attention_bad_input(name, value, argument):
    with raises("decode_attention", argument):
        ops.decode_attention(**decode_args(**{name: value}))


def test_decode_attention_bad_paged_cache():
    pages = torch.randn(3, 24, 4)
    seqlens = torch.tensor([3, 6], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)
    with raises("decode_attention", r"block_table\[1\]\[1\] = 5 is not a page index in \[0, 3\)"):
        ops.decode_attention(**decode_args(k_cache=pages, v_cache=pages, cache_seqlens=seqlens,
                                           block_table=torch.tensor([[0, 1], [2, 5]], dtype=torch.int32)))
    with raises("decode_attention", "cache_seqlens must be at most the cache capacity 8"):
        ops.decode_attention(**decode_args(k_cache=pages, v_cache=pages, block_table=table,
                                           cache_seqlens=torch.tensor([3, 9], dtype=torch.int32)))
    with raises("decode_attention", r"k_cache must have shape \(num_pages, 24, page_size\)"):
        ops.decode_attention(**decode_args(k_cache=torch.randn(3, 4, 24), v_cache=pages, block_table=table))
    with raises("decode_attention", "block_table must be int32"):
        ops.decode_attention(**decode_args(k_cache=pages, v_cache=pages, block_table=table.long()))
    with raises("decode_attention", "contiguous pages"):
        strided = torch.randn(3, 24, 8)[:, :, ::2]
        ops.decode_attention(**decode_args(k_cache=strided, v_cache=strided, block_table=table))


def test_plans_must_match_their_inputs():
    decode_plan = ops.decode_plan(torch.tensor([3, 6], dtype=torch.int32), QK, V, G, num_workers=2)
    prefill = prefill_args()
    prefill_plan = ops.prefill_plan(prefill["cu_seqlens_q"], prefill["cu_seqlens_k"], QK, V, G, True, num_workers=2)
    with raises("prefill_attention", "plan is not a prefill plan"):
        ops.prefill_attention(**prefill, plan=decode_plan)
    with raises("decode_attention", "plan is not a decode plan"):
        ops.decode_attention(**decode_args(), plan=prefill_plan)
    with raises("prefill_attention", "plan was made with causal=True but causal=False"):
        ops.prefill_attention(**prefill_args(causal=False), plan=prefill_plan)
    with raises("decode_attention", "plan was made for B=2, H_kv=2, group=2 but the inputs have B=2, H_kv=2, group=1"):
        ops.decode_attention(**decode_args(group=1, q=torch.randn(2, 24)), plan=decode_plan)
    stale = ops.decode_plan(torch.tensor([3, 5], dtype=torch.int32), QK, V, G, num_workers=2)
    with raises("decode_attention", "make the plan from the same cache_seqlens"):
        ops.decode_attention(**decode_args(), plan=stale)
    other_lengths = ops.prefill_plan(torch.tensor([0, 2, 5], dtype=torch.int32), prefill["cu_seqlens_k"], QK, V, G,
                                     True, num_workers=2)
    with raises("prefill_attention", "make the plan from the same cu_seqlens"):
        ops.prefill_attention(**prefill, plan=other_lengths)
    with raises("decode_attention", "plan must be int32"):
        ops.decode_attention(**decode_args(), plan=decode_plan.long())
    with raises("decode_plan", "num_workers must be in"):
        ops.decode_plan(torch.tensor([3, 6], dtype=torch.int32), QK, V, G, num_workers=0)
    with raises("prefill_plan", "row_block must be a positive multiple of 16"):
        ops.prefill_plan(prefill["cu_seqlens_q"], prefill["cu_seqlens_k"], QK, V, G, True, row_block=24)


def test_prefill_plan_records_must_split_each_head_exactly_once():
    """A caller's plan whose records overlap (rows computed twice, others never) is refused even where its row
    counts add up; records of one (sequence, head) may come in any order."""
    cu = torch.tensor([0, 32], dtype=torch.int32)
    args = prefill_args(q=torch.randn(32, G * 24), k=torch.randn(32, 24), v=torch.randn(32, 24), cu_seqlens_q=cu,
                        cu_seqlens_k=cu)
    workers = 3
    plan = ops.prefill_plan(cu, cu, QK, V, G, True, num_workers=workers, row_block=16)

    def records(p: torch.Tensor) -> torch.Tensor:  # (R, 4) view of (b, h, row_start, row_end)
        return p[PREFILL_HEADER + workers + 1:].view(-1, 4)

    head = 1
    first, second = (records(plan)[:, 1] == head).nonzero().flatten().tolist()
    assert sorted(records(plan)[[first, second], 2].tolist()) == [0, 16], "the planner splits 32 rows into 16 + 16"
    expected = ops.prefill_attention(**args, plan=plan)
    swapped = plan.clone()
    records(swapped)[[first, second], 2:] = records(plan)[[second, first], 2:]
    torch.testing.assert_close(ops.prefill_attention(**args, plan=swapped), expected, rtol=0, atol=0)
    overlapping = plan.clone()
    records(overlapping)[[first, second], 2:] = torch.tensor([0, 16], dtype=torch.int32)
    with raises("prefill_attention", f"plan computes rows 0..16 of sequence 0, head {head} in two records"):
        ops.prefill_attention(**args, plan=overlapping)
    gap = plan.clone()
    records(gap)[[first, second], 2:] = torch.tensor([16, 32], dtype=torch.int32)
    with raises("prefill_attention", f"plan leaves rows 0..16 of sequence 0, head {head} to no record"):
        ops.prefill_attention(**args, plan=gap)


def test_rotate_compress_bad_input():
    x, rot = torch.randn(3, 4, 32), torch.randn(2, 32, 16)
    with raises("rotate_compress", r"x must have group \* H_kv = 3 \* 2 = 6 heads"):
        ops.rotate_compress(x, rot, QK, 3)
    with raises("rotate_compress", r"rot must have shape \(H_kv=2, D=32, R_max>=16\)"):
        ops.rotate_compress(x, torch.randn(2, 32, 8), QK, G)
    with raises("rotate_compress", "rot must have the dtype of x"):
        ops.rotate_compress(x, rot.half(), QK, G)
    with raises("rotate_compress", "x must have 3 dimensions"):
        ops.rotate_compress(x[0], rot, QK, G)
    with raises("rotate_compress", r"out_width must be group \* qk_offsets\[-1\] = 2 \* 24 = 48 but got 24"):
        ops.rotate_compress(x, rot, QK, G, out_width=24)


@pytest.mark.parametrize("name, value, argument", [
    ("cos", torch.randn(4, 16), r"cos must have the T=3 rows of x"),
    ("cos", torch.randn(3, 15), r"cos must have an even number of columns \(rotary_dim\) in \[2, D=32\]"),
    ("cos", torch.randn(3, 40), r"cos must have an even number of columns"),
    ("cos", torch.randn(3, 16, 1), "cos must have 2 dimensions"),
    ("cos", torch.randn(3, 16).half(), "cos must have the dtype of x"),
    ("sin", torch.randn(3, 8), r"sin must have shape \[3, 16\]"),
    ("sin", torch.randn(3, 16).bfloat16(), "sin must have the dtype of x"),
    ("rot", torch.randn(2, 32, 8), r"rot must have shape \(H_kv=2, D=32, R_max>=16\)"),
    ("group", 3, r"x must have group \* H_kv = 3 \* 2 = 6 heads"),
    ("out_width", 49, r"out_width must be group \* qk_offsets\[-1\] = 2 \* 24 = 48 but got 49"),
])
def test_rope_rotate_compress_bad_input(name, value, argument):
    args = dict(x=torch.randn(3, 4, 32), cos=torch.randn(3, 16), sin=torch.randn(3, 16), rot=torch.randn(2, 32, 16),
                qk_offsets=QK, group=G)
    args[name] = value
    with raises("rope_rotate_compress", argument):
        ops.rope_rotate_compress(**args)


def test_append_kv_overflow_leaves_the_cache_untouched():
    k_cache, v_cache = torch.randn(2, 6, 24), torch.randn(2, 6, 24)
    before = (k_cache.clone(), v_cache.clone())
    new_rows = torch.randn(5, 24)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with raises("append_kv", r"request 1 would grow to 7 rows .* past the cache capacity 6; nothing was written"):
        ops.append_kv(k_cache, v_cache, new_rows, new_rows, cu, torch.tensor([1, 4], dtype=torch.int32), QK, V)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])

    pages = torch.randn(3, 24, 4)
    pages_before = pages.clone()
    table = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    with raises("append_kv", r"block_table\[1\]\[1\] = -1 is not a page index"):
        ops.append_kv(pages, pages, new_rows, new_rows, cu, torch.tensor([0, 2], dtype=torch.int32), QK, V, table)
    assert torch.equal(pages, pages_before)


@pytest.mark.parametrize("name, value, argument", [
    ("k", torch.randn(5, 24).half(), "k must have the dtype of k_cache"),
    ("k", torch.randn(5, 16), "k must have 24 columns"),
    ("cu_seqlens", torch.tensor([0, 3, 2], dtype=torch.int32), "cu_seqlens must be non-decreasing"),
    ("cu_seqlens", torch.tensor([0, 3, 6], dtype=torch.int32), "cu_seqlens must end at most at the 5 rows of k"),
    ("cache_seqlens", torch.tensor([0, -2], dtype=torch.int32), "cache_seqlens must be non-negative"),
    ("k_cache", torch.randn(2, 24, 6).transpose(1, 2), "k_cache must have unit stride in its last dimension"),
])
def test_append_kv_bad_input(name, value, argument):
    args = dict(k_cache=torch.randn(2, 6, 24), v_cache=torch.randn(2, 6, 24), k=torch.randn(5, 24),
                v=torch.randn(5, 24), cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32),
                cache_seqlens=torch.tensor([0, 1], dtype=torch.int32), qk_offsets=QK, v_offsets=V)
    args[name] = value
    with raises("append_kv", argument):
        ops.append_kv(**args)


def test_fakes_refuse_what_the_kernels_refuse_when_traced():
    """Under fake tensors (what torch.compile traces with) shapes that cannot agree are refused at trace time, with
    the message the kernels' own checks give."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake_raises(op: str, argument: str):
        return pytest.raises(RuntimeError, match=rf"fdc::{op}: (.|\n)*{argument}")

    with FakeTensorMode(allow_non_fake_inputs=True):
        with fake_raises("prefill_attention", "v must have the 5 rows of k"):
            torch.ops.fdc.prefill_attention(*prefill_args(v=torch.randn(4, 24)).values())
        with fake_raises("prefill_attention", "cu_seqlens_k must have length 3"):
            torch.ops.fdc.prefill_attention(
                *prefill_args(cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32)).values())
        with fake_raises("decode_attention", "cache_seqlens must have length 2"):
            torch.ops.fdc.decode_attention(*decode_args(cache_seqlens=torch.tensor([3], dtype=torch.int32)).values())
        with fake_raises("decode_attention", "k_cache and v_cache must have shapes"):
            torch.ops.fdc.decode_attention(*decode_args(v_cache=torch.randn(2, 5, 24)).values())
        with fake_raises("rotate_compress", "x must have group \\* H_kv = 2 \\* 2"):
            torch.ops.fdc.rotate_compress(torch.randn(3, 3, 32), torch.randn(2, 32, 16), QK, G)
        with fake_raises("rope_rotate_compress", "out_width must be group"):
            torch.ops.fdc.rope_rotate_compress(torch.randn(3, 4, 32), torch.randn(3, 32), torch.randn(3, 32),
                                               torch.randn(2, 32, 16), QK, G, -1)
        assert torch.ops.fdc.rotate_compress(torch.randn(3, 4, 32), torch.randn(2, 32, 16), QK, G, 48).shape == (3, 48)
        with fake_raises("rope_rotate_compress", "cos must have the T=3 rows"):
            torch.ops.fdc.rope_rotate_compress(torch.randn(3, 4, 32), torch.randn(2, 32), torch.randn(2, 32),
                                               torch.randn(2, 32, 16), QK, G)
        with fake_raises("append_kv", "cache_seqlens must have length 3"):
            torch.ops.fdc.append_kv(torch.randn(3, 6, 24), torch.randn(3, 6, 24), torch.randn(4, 24),
                                    torch.randn(4, 24), torch.tensor([0, 1, 2, 4], dtype=torch.int32),
                                    torch.zeros(2, dtype=torch.int32), QK, V)


# The attention variants (window_left, softcap, sinks): the same checks (checks.h check_attention_variant) in both
# attention ops and in their fakes; window_left also in both planners.
VARIANT_CASES = [
    (dict(window_left=-2), "window_left must be -1 \\(no window\\) or a key count"),
    (dict(window_left=2**31), "window_left must be -1 \\(no window\\) or a key count"),
    (dict(softcap=-1.0), "softcap must be 0 \\(no capping\\) or a positive finite number"),
    (dict(softcap=float("inf")), "softcap must be 0 \\(no capping\\) or a positive finite number"),
    (dict(softcap=float("nan")), "softcap must be 0 \\(no capping\\) or a positive finite number"),
    (dict(sinks=torch.zeros(3)), "sinks must have shape \\[4\\]"),
    (dict(sinks=torch.zeros(2 * G, dtype=torch.float64)), "sinks must be float32"),
    (dict(sinks=torch.zeros(2 * G, dtype=torch.bfloat16)), "sinks must be float32"),
    (dict(sinks=torch.zeros(1, 2 * G)), "sinks must have shape \\[4\\]"),
]


@pytest.mark.parametrize("change, argument", VARIANT_CASES)
def test_attention_variants_bad_input(change, argument):
    with raises("prefill_attention", argument):
        ops.prefill_attention(**prefill_args(**change))
    with raises("decode_attention", argument):
        ops.decode_attention(**decode_args(**change))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match=rf"fdc::prefill_attention: (.|\n)*{argument}"):
            ops.prefill_attention(**prefill_args(**change))
        with pytest.raises(RuntimeError, match=rf"fdc::decode_attention: (.|\n)*{argument}"):
            ops.decode_attention(**decode_args(**change))


@pytest.mark.parametrize("window_left", [-2, -100, 2**31])
def test_planners_bad_window(window_left):
    lengths = torch.tensor([1, 2], dtype=torch.int32)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with raises("decode_plan", "window_left must be -1"):
        ops.decode_plan(lengths, QK, V, G, window_left=window_left)
    with raises("prefill_plan", "window_left must be -1"):
        ops.prefill_plan(cu, cu, QK, V, G, True, window_left=window_left)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match="fdc::decode_plan: window_left must be -1"):
            ops.decode_plan(lengths, QK, V, G, window_left=window_left)
        with pytest.raises(RuntimeError, match="fdc::prefill_plan: window_left must be -1"):
            ops.prefill_plan(cu, cu, QK, V, G, True, num_workers=2, window_left=window_left)


def window_args(**changes):
    args = dict(q=torch.randn(5, G * 24), cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32),
                k_cache=torch.randn(2, 6, 24), cache_seqlens=torch.tensor([4, 3], dtype=torch.int32), qk_offsets=QK,
                group=G, scale=0.3, window=4, softcap=0.0, noise_state=torch.zeros(2, 4, dtype=torch.int64),
                temperature=1.0)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, argument", [
    (dict(k_cache=torch.zeros(2, 6, 24, dtype=torch.int8)), "k_cache must be float32, float16 or bfloat16"),
    (dict(q=torch.randn(5, 24)), "q must have 48 columns"),
    (dict(k_cache=torch.randn(2, 6, 16)), "k_cache must have 24 columns"),
    (dict(cache_seqlens=torch.tensor([2, 3], dtype=torch.int32)), "the queries of request 0 \\(3\\) must be its last"),
    (dict(cache_seqlens=torch.tensor([4, 7], dtype=torch.int32)), "cache_seqlens must be at most the cache capacity 6"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 6], dtype=torch.int32)), "cu_seqlens_q must end at most at the 5 rows"),
    (dict(window=0), "window must be in \\[1, 2\\*\\*20\\]"),
    (dict(temperature=0.0), "temperature must be a positive finite number"),
    (dict(temperature=float("nan")), "temperature must be a positive finite number"),
    (dict(softcap=-1.0), "softcap must be 0"),
    (dict(scale=float("inf")), "scale must be a positive finite number"),
    (dict(noise_state=torch.zeros(2, 3, dtype=torch.int64)), "noise_state must have shape"),
    (dict(noise_state=torch.zeros(2, 4, dtype=torch.int32)), "noise_state must be an int64 CPU tensor"),
])
def test_window_scores_rejects_bad_input(changes, argument):
    with raises("window_scores", argument):
        ops.window_scores(**window_args(**changes))


def test_window_scores_fake_checks_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake_raises(op: str, argument: str):
        return pytest.raises(RuntimeError, match=rf"fdc::{op}: (.|\n)*{argument}")

    with FakeTensorMode(allow_non_fake_inputs=True):
        assert torch.ops.fdc.window_scores(*window_args().values()).shape == (2, 2, 6)
        with fake_raises("window_scores", "noise_state must have shape \\[2, 4\\]"):
            torch.ops.fdc.window_scores(*window_args(noise_state=torch.zeros(3, 4, dtype=torch.int64)).values())
        with fake_raises("window_scores", "cu_seqlens_q and cache_seqlens must have lengths"):
            torch.ops.fdc.window_scores(*window_args(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)).values())
        with fake_raises("window_scores", "window must be in"):
            torch.ops.fdc.window_scores(*window_args(window=0).values())


@pytest.mark.skipif(cuda_skip_reason("window_scores") is not None,
                    reason=str(cuda_skip_reason("window_scores")))
def test_window_scores_refuses_cuda_naming_the_torch_path():
    cuda = {name: value.cuda() if isinstance(value, torch.Tensor) and name != "qk_offsets" else value
            for name, value in window_args(noise_state=None).items()}
    with raises("window_scores", "has no CUDA kernel yet; fdc_ops.eviction.window_scores"):
        ops.window_scores(**cuda)
