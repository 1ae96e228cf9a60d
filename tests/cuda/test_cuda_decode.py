"""decode_plan, decode_attention and append_kv on a GPU, against the float64 reference (fdc_ops/reference.py) and the
CPU ops, over fresh random configurations each run: float32/float16/bfloat16, contiguous and paged caches with NaN in
every slot and page that must not be read, non-contiguous queries, sequences of 32K keys and more, one very long
request among many short ones, G from 1 to 8 and 16, explicit plans for 1, 3 and 132 workers, a decode step captured
in a CUDA graph and replayed over changed lengths and cache contents (one layer, and a whole SmolLM2-shaped model:
append_kv, decode_plan and decode_attention in 30 layers), a negative length (NaN output, status in the plan)
(opcheck on CUDA inputs: tests/ops/test_opcheck.py); and the attention variants (sliding windows, soft-capping, sinks):
split and unsplit requests, NaN keys and unmapped pages before the window, windowed plans equal to the host
planner's, a plan for another window (NaN), and a windowed step captured in a CUDA graph.

CUDA conventions of the ops: qk_offsets/v_offsets stay int32 CPU tensors; cache_seqlens, block_table, cu_seqlens and
plans live on the GPU; the default worker count is the number of SMs; plan entry [7] is the planner's status (0: ok).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import (
    DTYPES,
    Layout,
    assert_close_to_cpu,
    assert_close_to_reference,
    capture_graph,
    case_generator,
    nan_padded_caches,
    offsets,
    randn,
    random_block_table,
    random_layout,
    random_lengths,
    skip_without_cuda_kernels,
    strided_rows,
    to_pages,
)
from fdc_ops import ops, reference
from fdc_ops.plans import DecodePlan
from test_attention_variants import SOFT_CAPS, check_soft_cap

skip_without_cuda_kernels("decode_plan", "decode_attention")

DEVICE = torch.device("cuda")
NUM_SMS = torch.cuda.get_device_properties(DEVICE).multi_processor_count
CASES = int(os.environ.get("FDC_CUDA_CASES", 40))  # per cache kind and run; fewer under compute-sanitizer
HAS_APPEND_KV = torch._C._dispatch_has_kernel_for_dispatch_key("fdc::append_kv", "CUDA")
needs_append_kv = pytest.mark.skipif(not HAS_APPEND_KV, reason="this build has no CUDA kernel for fdc::append_kv")


class DecodeInputs:
    """One decode problem on the CPU (for the reference and the CPU op) and on the GPU."""

    def __init__(self, gen, rng, layout: Layout, dtype, lengths: list[int], paged: bool, page_size: int = 16,
                 extra_capacity: int = 0):
        self.layout, self.dtype, self.lengths = layout, dtype, lengths
        batch = len(lengths)
        capacity = max(max(lengths), 1) + extra_capacity
        self.seqlens = torch.tensor(lengths, dtype=torch.int32)
        k_cache, v_cache = nan_padded_caches(layout, lengths, capacity, dtype, gen)
        self.block_table = None
        if paged:
            self.block_table, num_pages = random_block_table(lengths, capacity, page_size, rng)
            k_cache = to_pages(k_cache, lengths, self.block_table, num_pages, page_size)
            v_cache = to_pages(v_cache, lengths, self.block_table, num_pages, page_size)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.q = randn((batch, layout.group * layout.qk_width), dtype, gen)
        self.scale = rng.uniform(0.05, 0.5)
        self.q_dev = strided_rows(self.q, rng, DEVICE)
        self.k_dev, self.v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
        self.seqlens_dev = self.seqlens.to(DEVICE)
        self.block_table_dev = None if self.block_table is None else self.block_table.to(DEVICE)

    def cpu_args(self):
        lo = self.layout
        return (self.q, self.k_cache, self.v_cache, self.seqlens, lo.qk_offsets, lo.v_offsets, lo.group, self.scale)

    def run_cuda(self, plan=None) -> torch.Tensor:
        lo = self.layout
        out = ops.decode_attention(self.q_dev, self.k_dev, self.v_dev, self.seqlens_dev, lo.qk_offsets, lo.v_offsets,
                                   lo.group, self.scale, plan, self.block_table_dev)
        assert out.device.type == "cuda" and out.dtype == self.dtype
        return out

    def check(self, out: torch.Tensor, what: str):
        """out (from the GPU) against the float64 reference and against the CPU op on the same inputs."""
        args = self.cpu_args()
        expected = reference.decode_attention_ref(*args, block_table=self.block_table)
        torch_lowp = reference.decode_attention_ref(*args, block_table=self.block_table, compute_dtype=self.dtype)
        out = out.cpu()
        assert_close_to_reference(out, expected, torch_lowp, f"{what} (cuda vs float64 reference)")
        cpu = ops.decode_attention(*args, block_table=self.block_table)
        assert_close_to_cpu(out, cpu, expected, torch_lowp, what)


def _plan_cuda(inputs: DecodeInputs, num_workers=None) -> torch.Tensor:
    lo = inputs.layout
    plan = ops.decode_plan(inputs.seqlens_dev, lo.qk_offsets, lo.v_offsets, lo.group, num_workers)
    assert plan.device.type == "cuda" and plan.dtype == torch.int32
    return plan


def _check_plan_matches_cpu(inputs: DecodeInputs, plan: torch.Tensor, num_workers: int, what: str):
    """The device planner and the host planner are the same code: identical plans, integer for integer."""
    lo = inputs.layout
    cpu_plan = ops.decode_plan(inputs.seqlens, lo.qk_offsets, lo.v_offsets, lo.group, num_workers)
    assert plan.shape == cpu_plan.shape, f"{what}: plan size {plan.shape} != cpu {cpu_plan.shape}"
    assert int(plan[7]) == 0, f"{what}: plan status {int(plan[7])} for valid lengths"
    assert torch.equal(plan.cpu(), cpu_plan), f"{what}: cuda plan differs from the cpu plan"


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", range(CASES))
def test_decode_attention_cuda(case, paged):
    gen, rng, replay = case_generator(f"cuda decode_attention paged={paged}", case)
    layout = random_layout(rng)
    dtype = rng.choice(DTYPES)
    lengths = random_lengths(rng, rng.randint(1, 6), choices=(0, 1, 5, 64, 65, 300, 700, 2049))
    if rng.random() < 0.2:
        lengths[0] = 5000  # split into chunks over many SMs
    inputs = DecodeInputs(gen, rng, layout, dtype, lengths, paged, rng.choice([1, 3, 16, 64, 100]),
                          extra_capacity=rng.randint(0, 20))
    what = f"cuda decode_attention paged={paged} G={layout.group} {dtype} lengths={lengths} {replay}"
    plan = None
    if rng.random() < 0.5:
        workers = rng.choice([None, 1, 3, 8, 40, NUM_SMS])
        plan = _plan_cuda(inputs, workers)
        _check_plan_matches_cpu(inputs, plan, workers or NUM_SMS, what)
    inputs.check(inputs.run_cuda(plan), what)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_group_sizes(group):
    """Every G up to 8, and 16: a group larger than one 8-row tile of query heads."""
    gen, rng, replay = case_generator(f"cuda decode group={group}", 0)
    base = random_layout(rng, max_kv_heads=4)
    layout = Layout(base.qk_dims, base.v_dims, group)
    for dtype in DTYPES:
        lengths = random_lengths(rng, 3, choices=(0, 1, 17, 300, 1500))
        paged = rng.random() < 0.5
        inputs = DecodeInputs(gen, rng, layout, dtype, lengths, paged, rng.choice([16, 64]))
        inputs.check(inputs.run_cuda(), f"cuda decode G={group} {dtype} paged={paged} lengths={lengths} {replay}")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_sequences(dtype, paged):
    """32K keys and more (many chunks of one (request, head), merged by log-sum-exp), odd lengths."""
    gen, rng, replay = case_generator(f"cuda decode long {dtype} paged={paged}", 0)
    layout = random_layout(rng, max_kv_heads=4, max_group=8)
    lengths = [32768 + rng.randint(0, 3000), rng.choice([1, 4097, 32768])]
    inputs = DecodeInputs(gen, rng, layout, dtype, lengths, paged, rng.choice([16, 64]))
    inputs.check(inputs.run_cuda(), f"cuda decode long lengths={lengths} {dtype} paged={paged} {replay}")


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_widest_heads(dtype, paged):
    """Heads up to 256 wide beside narrow ones, at G = 16: the shared-memory layouts of include/fdc/decode_tiles.h
    at their largest (one staging tile on a paged cache where two do not fit), on every device whose limit holds
    them; elsewhere the op must refuse with the bytes it needs."""
    gen, rng, replay = case_generator(f"cuda decode widest {dtype} paged={paged}", 0)
    limit = torch.cuda.get_device_properties(DEVICE).shared_memory_per_block_optin
    for qk_dims, v_dims in (([256, 8], [256, 128]), ([128, 64], [128, 8]), ([256, 16], [128, 8])):
        layout = Layout(qk_dims, v_dims, 16)
        inputs = DecodeInputs(gen, rng, layout, dtype, [1, 200, 1500], paged, 16)
        what = f"cuda decode widest qk={qk_dims} v={v_dims} {dtype} paged={paged} {replay}"
        if max(qk_dims) + max(v_dims) <= 336 or limit >= 166912:  # tests/cpp/test_planners.cpp: what must fit
            inputs.check(inputs.run_cuda(), what)
        else:
            try:
                inputs.check(inputs.run_cuda(), what)
            except RuntimeError as error:
                assert "bytes of shared memory per CTA but the device allows" in str(error), what


@pytest.mark.parametrize("paged", [False, True])
def test_one_long_request_among_many_short(paged):
    """One very long request and many short ones: the long one is split over SMs, the short ones are not."""
    gen, rng, replay = case_generator(f"cuda decode mixed paged={paged}", 0)
    layout = random_layout(rng, max_kv_heads=8, max_group=4)
    dtype = rng.choice(DTYPES)
    lengths = [40000 + rng.randint(0, 999)] + random_lengths(rng, 30, choices=(0, 1, 7, 64, 257, 1024))
    rng.shuffle(lengths)
    inputs = DecodeInputs(gen, rng, layout, dtype, lengths, paged, 64)
    what = f"cuda decode mixed G={layout.group} {dtype} paged={paged} {replay}"
    plan = _plan_cuda(inputs)
    _check_plan_matches_cpu(inputs, plan, NUM_SMS, what)
    inputs.check(inputs.run_cuda(plan), what)


@pytest.mark.parametrize("workers", [1, 3, 132])
def test_explicit_plans(workers):
    """Plans for 1, 3 and 132 workers (more or fewer than the SMs) give the reference's results and equal the CPU
    planner's plans; the plan made inside the op agrees with them."""
    gen, rng, replay = case_generator(f"cuda decode workers={workers}", 0)
    layout = random_layout(rng, max_kv_heads=6, max_group=8)
    for dtype in DTYPES:
        paged = rng.random() < 0.5
        lengths = [9000, 0, 1, 700, rng.randint(1, 3000)]
        inputs = DecodeInputs(gen, rng, layout, dtype, lengths, paged, 16)
        what = f"cuda decode workers={workers} {dtype} paged={paged} {replay}"
        plan = _plan_cuda(inputs, workers)
        assert int(plan[3]) == workers, f"{what}: plan has {int(plan[3])} workers"
        _check_plan_matches_cpu(inputs, plan, workers, what)
        with_plan = inputs.run_cuda(plan)
        inputs.check(with_plan, what)
        if dtype == torch.float32:
            torch.testing.assert_close(with_plan, inputs.run_cuda(), rtol=1e-4, atol=1e-5, msg=what)


def test_default_workers_are_the_sms():
    gen, rng, replay = case_generator("cuda decode default workers", 0)
    layout = random_layout(rng)
    inputs = DecodeInputs(gen, rng, layout, torch.float16, [100, 3000], False)
    plan = _plan_cuda(inputs)
    assert int(plan[3]) == NUM_SMS, f"default worker count {int(plan[3])}, SMs {NUM_SMS} {replay}"
    _check_plan_matches_cpu(inputs, plan, NUM_SMS, f"default workers {replay}")


@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_replay(paged):
    """decode_plan + decode_attention captured once; between replays the lengths, the cache rows, the queries (and
    the block table) change in place, and every replay matches the CPU op on the new contents."""
    gen, rng, replay = case_generator(f"cuda graph paged={paged}", 0)
    layout = random_layout(rng, max_kv_heads=6, max_group=8)
    dtype = rng.choice(DTYPES)
    batch, capacity, page_size = 5, 4096, 16
    first = [capacity, 0, 1, 300, 2000]
    inputs = DecodeInputs(gen, rng, layout, dtype, first, paged, page_size)
    if paged:  # every request owns pages for the full capacity, so any later length fits the captured table
        table, num_pages = random_block_table([capacity] * batch, capacity, page_size, rng)
        inputs.block_table, inputs.block_table_dev = table, table.to(DEVICE)
        inputs.k_cache = torch.full((num_pages, layout.qk_width, page_size), float("nan"), dtype=dtype)
        inputs.v_cache = torch.full((num_pages, layout.v_width, page_size), float("nan"), dtype=dtype)
        inputs.k_dev, inputs.v_dev = inputs.k_cache.to(DEVICE), inputs.v_cache.to(DEVICE)
    q_static = inputs.q_dev

    def step():
        plan = ops.decode_plan(inputs.seqlens_dev, layout.qk_offsets, layout.v_offsets, layout.group)
        return ops.decode_attention(q_static, inputs.k_dev, inputs.v_dev, inputs.seqlens_dev, layout.qk_offsets,
                                    layout.v_offsets, layout.group, inputs.scale, plan, inputs.block_table_dev)

    def refill(lengths):
        """New lengths and fresh cache contents (NaN outside them), written in place into the captured tensors."""
        contiguous_k = torch.full((batch, capacity, layout.qk_width), float("nan"), dtype=dtype)
        contiguous_v = torch.full((batch, capacity, layout.v_width), float("nan"), dtype=dtype)
        for b, length in enumerate(lengths):
            contiguous_k[b, :length] = randn((length, layout.qk_width), dtype, gen)
            contiguous_v[b, :length] = randn((length, layout.v_width), dtype, gen)
        if paged:
            contiguous_k = to_pages(contiguous_k, lengths, inputs.block_table, inputs.k_cache.shape[0], page_size)
            contiguous_v = to_pages(contiguous_v, lengths, inputs.block_table, inputs.v_cache.shape[0], page_size)
        inputs.k_cache, inputs.v_cache = contiguous_k, contiguous_v
        inputs.k_dev.copy_(contiguous_k)
        inputs.v_dev.copy_(contiguous_v)
        inputs.seqlens = torch.tensor(lengths, dtype=torch.int32)
        inputs.seqlens_dev.copy_(inputs.seqlens)
        inputs.q = randn((batch, layout.group * layout.qk_width), dtype, gen)
        q_static.copy_(inputs.q)

    refill(first)
    graph, out = capture_graph(step)

    for replay_index, lengths in enumerate([first, [1, 4096, 0, 17, 999], [0, 0, 0, 0, 0], [333, 2, 4000, 64, 1],
                                            [rng.randint(0, capacity) for _ in range(batch)]]):
        refill(lengths)
        graph.replay()
        torch.cuda.synchronize()
        inputs.check(out.clone(), f"cuda graph replay {replay_index} lengths={lengths} paged={paged} {dtype} {replay}")


@needs_append_kv
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", range(10))
def test_append_kv_then_decode_cuda(case, paged):
    """append_kv on the GPU writes exactly the reference's rows (others bit-identical), then decode over them."""
    gen, rng, replay = case_generator(f"cuda append_kv paged={paged}", case)
    layout = random_layout(rng, max_kv_heads=6, max_group=8)
    dtype = rng.choice(DTYPES)
    batch = rng.randint(1, 5)
    start = random_lengths(rng, batch, choices=(0, 1, 5, 20, 300))
    new = random_lengths(rng, batch, choices=(0, 1, 1, 3, 17, 70))
    capacity = max(s + n for s, n in zip(start, new)) + rng.randint(1, 4)
    page_size = rng.choice([1, 4, 16, 64])
    k_cache = randn((batch, capacity, layout.qk_width), dtype, gen)
    v_cache = randn((batch, capacity, layout.v_width), dtype, gen)
    block_table = None
    if paged:
        block_table, num_pages = random_block_table([capacity] * batch, capacity, page_size, rng)
        k_cache = to_pages(k_cache, [capacity] * batch, block_table, num_pages, page_size)
        v_cache = to_pages(v_cache, [capacity] * batch, block_table, num_pages, page_size)
    cu = offsets(new)
    k_new = randn((int(cu[-1]), layout.qk_width), dtype, gen)
    v_new = randn((int(cu[-1]), layout.v_width), dtype, gen)
    seqlens = torch.tensor(start, dtype=torch.int32)
    expected_k, expected_v = reference.append_kv_ref(k_cache, v_cache, k_new, v_new, cu, seqlens, block_table)

    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    table_dev = None if block_table is None else block_table.to(DEVICE)
    seqlens_dev = seqlens.to(DEVICE)
    ops.append_kv(k_dev, v_dev, strided_rows(k_new, rng, DEVICE), v_new.to(DEVICE), cu.to(DEVICE), seqlens_dev,
                  layout.qk_offsets, layout.v_offsets, table_dev)
    assert torch.equal(k_dev.cpu().nan_to_num(7.0), expected_k.nan_to_num(7.0)), f"cuda append_kv k {replay}"
    assert torch.equal(v_dev.cpu().nan_to_num(7.0), expected_v.nan_to_num(7.0)), f"cuda append_kv v {replay}"
    assert seqlens_dev.cpu().tolist() == start, "append_kv must not advance cache_seqlens"

    grown = seqlens + torch.tensor(new, dtype=torch.int32)
    q = randn((batch, layout.group * layout.qk_width), dtype, gen)
    out = ops.decode_attention(q.to(DEVICE), k_dev, v_dev, grown.to(DEVICE), layout.qk_offsets, layout.v_offsets,
                               layout.group, 0.2, None, table_dev).cpu()
    args = (q, expected_k, expected_v, grown, layout.qk_offsets, layout.v_offsets, layout.group, 0.2)
    expected = reference.decode_attention_ref(*args, block_table=block_table)
    torch_lowp = reference.decode_attention_ref(*args, block_table=block_table, compute_dtype=dtype)
    assert_close_to_reference(out, expected, torch_lowp, f"cuda decode after append_kv paged={paged} {replay}")


@pytest.mark.parametrize("with_plan", [False, True])
def test_negative_length_gives_nan(with_plan):
    """The device planner cannot raise without a host round trip: a negative cache_seqlens entry sets the plan's
    status (entry [7]) and the attention output is NaN, never a silent wrong answer."""
    gen, rng, _ = case_generator("cuda decode negative", 0)
    layout = random_layout(rng)
    inputs = DecodeInputs(gen, rng, layout, torch.float16, [10, 20, 30], False)
    inputs.seqlens_dev = torch.tensor([10, -1, 30], dtype=torch.int32, device=DEVICE)
    plan = None
    if with_plan:
        plan = _plan_cuda(inputs)
        assert int(plan[7]) != 0, "a negative length must set the plan's status"
    out = inputs.run_cuda(plan)
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "decode_attention over a failed plan must return NaN"


def test_stale_plan_gives_nan_for_the_requests_it_misses():
    """A plan made for shorter lengths of the same batch would silently drop keys: its chunks no longer end at the
    request's length, so the requests concerned come back NaN (the CPU op raises), the others stay correct."""
    gen, rng, replay = case_generator("cuda decode stale plan", 0)
    layout = random_layout(rng)
    inputs = DecodeInputs(gen, rng, layout, torch.float32, [300, 40, 0, 900], False, extra_capacity=5)
    stale_lengths = torch.tensor([100, 40, 7, 900], dtype=torch.int32, device=DEVICE)
    lo = layout
    stale = ops.decode_plan(stale_lengths, lo.qk_offsets, lo.v_offsets, lo.group)
    out = inputs.run_cuda(stale).cpu()
    assert torch.isnan(out[0]).all() and torch.isnan(out[2]).all(), f"stale requests must be NaN {replay}"
    expected = reference.decode_attention_ref(*inputs.cpu_args())
    torch.testing.assert_close(out[[1, 3]].double(), expected[[1, 3]], rtol=1e-4, atol=1e-5, msg=replay)


def test_strided_cache_seqlens():
    """cache_seqlens as a strided view: the planner and the attention kernel read the same lengths."""
    gen, rng, replay = case_generator("cuda decode strided lengths", 0)
    layout = random_layout(rng)
    inputs = DecodeInputs(gen, rng, layout, torch.bfloat16, [5, 700, 64], rng.random() < 0.5, 16)
    wide = torch.zeros(2 * len(inputs.seqlens), dtype=torch.int32, device=DEVICE)
    wide[::2] = inputs.seqlens_dev
    inputs.seqlens_dev = wide[::2]
    inputs.check(inputs.run_cuda(), f"cuda decode strided cache_seqlens {replay}")


@needs_append_kv
@pytest.mark.parametrize("paged", [False, True])
def test_smollm2_shaped_decode_step_in_a_graph(paged):
    """A whole decode step of a SmolLM2-shaped model (30 layers, 3 KV heads of 64 dims, 3 query heads each, every
    layer with its own widths, bfloat16), as a serving engine captures it: per layer append_kv of the new token, then
    decode_plan and decode_attention over the grown lengths. Captured once; replayed after the lengths and cache
    contents change, each replay is bit-identical to the same step run eagerly on copies of the caches (same kernels,
    no atomics), and the first layer's output matches the float64 reference."""
    gen, rng, replay = case_generator(f"cuda smollm2-shaped step paged={paged}", 0)
    num_layers, num_kv_heads, head_dim, group, dtype = 30, 3, 64, 3, torch.bfloat16
    batch, capacity, page_size, scale = 4, 1024, 16, head_dim ** -0.5
    layouts = [Layout([8 * rng.randint(1, head_dim // 8) for _ in range(num_kv_heads)],
                      [8 * rng.randint(1, head_dim // 8) for _ in range(num_kv_heads)], group)
               for _ in range(num_layers)]
    block_table, num_pages = random_block_table([capacity] * batch, capacity, page_size, rng) if paged else (None, 0)
    table_dev = None if block_table is None else block_table.to(DEVICE)

    def cache_for(lengths, width):
        """NaN past each request's length (as pages when paged)."""
        cache = torch.full((batch, capacity, width), float("nan"), dtype=dtype)
        for b, length in enumerate(lengths):
            cache[b, :length] = randn((length, width), dtype, gen)
        return to_pages(cache, [capacity] * batch, block_table, num_pages, page_size) if paged else cache

    lengths = [0, 1, 300, capacity - 1]
    k_caches = [cache_for(lengths, lo.qk_width).to(DEVICE) for lo in layouts]
    v_caches = [cache_for(lengths, lo.v_width).to(DEVICE) for lo in layouts]
    queries = [torch.empty(batch, group * lo.qk_width, dtype=dtype, device=DEVICE) for lo in layouts]
    new_k = [torch.empty(batch, lo.qk_width, dtype=dtype, device=DEVICE) for lo in layouts]
    new_v = [torch.empty(batch, lo.v_width, dtype=dtype, device=DEVICE) for lo in layouts]
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)  # one new token per request
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)

    def step(k_caches, v_caches):
        grown = seqlens + 1
        outs = []
        for lo, k_cache, v_cache, q, k, v in zip(layouts, k_caches, v_caches, queries, new_k, new_v):
            ops.append_kv(k_cache, v_cache, k, v, cu, seqlens, lo.qk_offsets, lo.v_offsets, table_dev)
            plan = ops.decode_plan(grown, lo.qk_offsets, lo.v_offsets, group)
            outs.append(ops.decode_attention(q, k_cache, v_cache, grown, lo.qk_offsets, lo.v_offsets, group, scale,
                                             plan, table_dev))
        return outs

    graph, graph_outs = capture_graph(lambda: step(k_caches, v_caches))
    for replay_index, replayed in enumerate([[5, 0, 1000, 64], [capacity - 1, 17, 0, 512], lengths]):
        seqlens.copy_(torch.tensor(replayed, dtype=torch.int32))
        for i, lo in enumerate(layouts):
            k_caches[i].copy_(cache_for(replayed, lo.qk_width))
            v_caches[i].copy_(cache_for(replayed, lo.v_width))
            for tensor in (queries[i], new_k[i], new_v[i]):
                tensor.copy_(randn(tuple(tensor.shape), dtype, gen))
        eager_k, eager_v = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
        graph.replay()
        eager_outs = step(eager_k, eager_v)
        torch.cuda.synchronize()
        what = f"replay {replay_index} lengths={replayed} paged={paged} {replay}"
        for i in range(num_layers):
            assert torch.equal(graph_outs[i], eager_outs[i]), f"layer {i} output: graph != eager, {what}"
            assert torch.equal(k_caches[i].nan_to_num(7.0), eager_k[i].nan_to_num(7.0)), f"layer {i} keys, {what}"
            assert torch.equal(v_caches[i].nan_to_num(7.0), eager_v[i].nan_to_num(7.0)), f"layer {i} values, {what}"
        lo, grown = layouts[0], torch.tensor(replayed, dtype=torch.int32) + 1
        args = (queries[0].cpu(), k_caches[0].cpu(), v_caches[0].cpu(), grown, lo.qk_offsets, lo.v_offsets, group,
                scale)
        expected = reference.decode_attention_ref(*args, block_table=block_table)
        torch_lowp = reference.decode_attention_ref(*args, block_table=block_table, compute_dtype=dtype)
        assert_close_to_reference(graph_outs[0].cpu(), expected, torch_lowp, f"layer 0 vs the reference, {what}")


# ------------------------------------------------------------------------------ sliding window, soft-capping, sinks


def _random_variant(rng, gen, layout: Layout, longest: int) -> dict:
    """window_left, softcap and sinks (a CPU tensor), each on or off: windows of 0 keys, whose start falls on, before
    and after a 16-key (kChunkAlign) boundary, shorter and longer than a chunk, past the longest request; caps small
    enough to matter; sinks from far below to far above the scores."""
    variant = {}
    if rng.random() < 0.75:
        variant["window_left"] = rng.choice([0, 1, 7, 15, 16, 17, 100, 255, 256, 1000, max(0, longest - 1),
                                             longest + 50, rng.randint(0, max(1, longest))])
    if rng.random() < 0.5:
        variant["softcap"] = rng.choice([0.5, 5.0, 30.0])
    if rng.random() < 0.5:
        variant["sinks"] = torch.randn(layout.num_kv_heads * layout.group, generator=gen) * rng.choice([1.0, 5.0, 20.0])
    return variant


def _on_device(variant: dict) -> dict:
    return {name: value.to(DEVICE) if name == "sinks" else value for name, value in variant.items()}


def _shown(variant: dict) -> dict:
    return {name: (value if name != "sinks" else "on") for name, value in variant.items()}


def _window_start(length: int, window_left: int) -> int:
    """The first key a decode query sees (include/fdc/attention_variant.h decode_window_start)."""
    return 0 if window_left < 0 or length == 0 else max(0, length - 1 - window_left)


def _poison_outside_window(inputs: DecodeInputs, window_left: int, page_size: int, drop_pages: bool):
    """Keys before each request's window become NaN (at most a packet of them is loaded on a paged cache, and masked),
    and with drop_pages the block-table entries of pages wholly before the window's first page become -1, as an
    engine that frees them would leave them: neither may change the output."""
    for b, length in enumerate(inputs.lengths):
        first = _window_start(length, window_left)
        if inputs.block_table is None:
            inputs.k_cache[b, :first] = float("nan")
            inputs.v_cache[b, :first] = float("nan")
            continue
        for logical in range(-(-first // page_size)):  # tokens [logical * page_size, ...) of page block_table[b, ...]
            page = int(inputs.block_table[b, logical])
            if page >= 0:  # not dropped by a wider window before
                slots = slice(0, min(page_size, first - logical * page_size))
                inputs.k_cache[page, :, slots] = float("nan")
                inputs.v_cache[page, :, slots] = float("nan")
        if drop_pages:
            inputs.block_table[b, :first // page_size] = -1
    inputs.k_dev, inputs.v_dev = inputs.k_cache.to(DEVICE), inputs.v_cache.to(DEVICE)
    if inputs.block_table is not None:
        inputs.block_table_dev = inputs.block_table.to(DEVICE)


def _run_variant(inputs: DecodeInputs, variant: dict, plan=None) -> torch.Tensor:
    lo = inputs.layout
    return ops.decode_attention(inputs.q_dev, inputs.k_dev, inputs.v_dev, inputs.seqlens_dev, lo.qk_offsets,
                                lo.v_offsets, lo.group, inputs.scale, plan, inputs.block_table_dev,
                                **_on_device(variant))


def _check_variant(inputs: DecodeInputs, out: torch.Tensor, variant: dict, what: str):
    """out (from the GPU) against the float64 reference of the variant (which reads only the window's keys)."""
    args = inputs.cpu_args()
    expected = reference.decode_attention_ref(*args, block_table=inputs.block_table, **variant)
    torch_lowp = reference.decode_attention_ref(*args, block_table=inputs.block_table, **variant,
                                                compute_dtype=inputs.dtype)
    assert_close_to_reference(out.cpu(), expected, torch_lowp, f"{what} (cuda vs float64 reference)")


def _windowed_plan(inputs: DecodeInputs, window_left: int, num_workers=None) -> torch.Tensor:
    """The device planner's plan with a window, checked against the host planner's (integer for integer) and
    against the windowed chunking the attention kernel validates (first chunk at the window's start, later ones on
    16-key boundaries, the last at the length)."""
    lo = inputs.layout
    plan = ops.decode_plan(inputs.seqlens_dev, lo.qk_offsets, lo.v_offsets, lo.group, num_workers,
                           window_left=window_left)
    cpu = ops.decode_plan(inputs.seqlens, lo.qk_offsets, lo.v_offsets, lo.group, num_workers or NUM_SMS,
                          window_left=window_left)
    assert torch.equal(plan.cpu(), cpu), f"window {window_left}: cuda plan differs from the cpu plan"
    decoded = DecodePlan.from_tensor(plan)
    for pair, chunk, start, end in decoded.records:
        length = inputs.lengths[pair // lo.num_kv_heads]
        chunks = decoded.split_offsets[pair + 1] - decoded.split_offsets[pair]
        assert (start == _window_start(length, window_left)) if chunk == 0 else (start % 16 == 0), (pair, chunk, start)
        assert chunk != chunks - 1 or end == length, (pair, chunk, end, length)
    return plan


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", range(CASES))
def test_decode_variants_cuda(case, paged):
    """Random layouts, dtypes, lengths and variants; keys outside the window NaN-poisoned (and on a paged cache, now
    and then, the pages wholly before the window unmapped); the plan made inside the op or given."""
    gen, rng, replay = case_generator(f"cuda decode variants paged={paged}", case)
    layout = random_layout(rng, max_group=16)
    dtype = rng.choice(DTYPES)
    lengths = random_lengths(rng, rng.randint(1, 6), choices=(0, 1, 5, 16, 17, 64, 65, 300, 700, 2049))
    if rng.random() < 0.3:
        lengths[0] = rng.choice([5000, 5003])  # split into chunks over many SMs, the window's edge in one of them
    page_size = rng.choice([1, 3, 4, 8, 16, 64, 100])
    inputs = DecodeInputs(gen, rng, layout, dtype, lengths, paged, page_size, extra_capacity=rng.randint(0, 20))
    variant = _random_variant(rng, gen, layout, max(lengths))
    window_left = variant.get("window_left", -1)
    _poison_outside_window(inputs, window_left, page_size, drop_pages=paged and rng.random() < 0.5)
    what = f"cuda decode variants paged={paged} G={layout.group} {dtype} lengths={lengths} {_shown(variant)} {replay}"
    plan = None
    if rng.random() < 0.5:
        plan = _windowed_plan(inputs, window_left, rng.choice([None, 1, 3, 8, 40, NUM_SMS]))
    _check_variant(inputs, _run_variant(inputs, variant, plan), variant, what)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_variants_split_and_unsplit(dtype, paged):
    """A window of thousands of keys that starts off a 16-key boundary, split into many chunks (sinks then join after
    the merge, with the merged log-sum-exp) beside requests of one chunk (sinks in the attention kernel), with a cap
    and sinks large enough to move every output; plans for 1 worker (nothing split) and 132 workers."""
    gen, rng, replay = case_generator(f"cuda decode variants split {dtype} paged={paged}", 0)
    layout = random_layout(rng, max_kv_heads=4, max_group=8)
    lengths = [20000 + rng.randint(0, 15), 1, 17, 300, 0, 4096]
    page_size = rng.choice([16, 64])
    inputs = DecodeInputs(gen, rng, layout, dtype, lengths, paged, page_size)
    sinks = torch.randn(layout.num_kv_heads * layout.group, generator=gen) * 3
    for window_left in (5000 + rng.randint(1, 15), 16 * 300, 300, 0):  # narrowing: each poisons more keys
        variant = dict(window_left=window_left, softcap=rng.choice([2.0, 20.0]), sinks=sinks)
        _poison_outside_window(inputs, window_left, page_size, drop_pages=paged)
        for workers in (1, 132):
            what = f"cuda decode split window={window_left} workers={workers} {dtype} paged={paged} {replay}"
            plan = _windowed_plan(inputs, window_left, workers)
            chunks = DecodePlan.from_tensor(plan).split_offsets
            assert workers == 1 or chunks[layout.num_kv_heads] > layout.num_kv_heads or window_left < 1000, what
            _check_variant(inputs, _run_variant(inputs, variant, plan), variant, what)
        _check_variant(inputs, _run_variant(inputs, variant), variant, f"{what} (plan made inside the op)")


def test_softcap_and_sinks_without_window():
    """Soft-capping alone and sinks alone on the unwindowed plan, on both cache kinds and every dtype; a cap so small
    that every score is near it, and sinks far above the scores (outputs near 0)."""
    gen, rng, replay = case_generator("cuda decode softcap sinks", 0)
    layout = random_layout(rng, max_kv_heads=4, max_group=8)
    for dtype in DTYPES:
        for paged in (False, True):
            inputs = DecodeInputs(gen, rng, layout, dtype, [1, 700, 5000, 33], paged, 16)
            heads = layout.num_kv_heads * layout.group
            for variant in (dict(softcap=0.5), dict(softcap=50.0), dict(sinks=torch.randn(heads, generator=gen)),
                            dict(sinks=torch.full((heads,), 30.0)), dict(sinks=torch.full((heads,), -30.0))):
                what = f"cuda decode {_shown(variant)} {dtype} paged={paged} {replay}"
                _check_variant(inputs, _run_variant(inputs, variant), variant, what)


def test_plan_for_another_window_gives_nan():
    """A plan covers the keys its window makes visible: with another window, the requests whose window starts
    elsewhere come back NaN (the CPU op refuses such a plan), the others are right."""
    gen, rng, replay = case_generator("cuda decode plan window", 0)
    layout = random_layout(rng)
    inputs = DecodeInputs(gen, rng, layout, torch.float32, [300, 40, 0, 900], False)
    lo = layout
    unwindowed = ops.decode_plan(inputs.seqlens_dev, lo.qk_offsets, lo.v_offsets, lo.group)
    out = _run_variant(inputs, dict(window_left=100), unwindowed).cpu()
    assert torch.isnan(out[0]).all() and torch.isnan(out[3]).all(), f"requests 0 and 3 must be NaN {replay}"
    expected = reference.decode_attention_ref(*inputs.cpu_args(), window_left=100)
    torch.testing.assert_close(out[[1, 2]].double(), expected[[1, 2]], rtol=1e-4, atol=1e-5, msg=replay)
    windowed = ops.decode_plan(inputs.seqlens_dev, lo.qk_offsets, lo.v_offsets, lo.group, window_left=100)
    out = _run_variant(inputs, {}, windowed).cpu()
    assert torch.isnan(out[0]).all() and torch.isnan(out[3]).all(), f"windowed plan, no window {replay}"


@pytest.mark.parametrize("paged", [False, True])
def test_cuda_graph_replay_windowed(paged):
    """decode_plan + decode_attention with a window, a cap and sinks captured once; between replays the lengths (so
    the window starts, aligned and not), cache contents and queries change in place, and every replay matches the
    float64 reference on the new contents."""
    gen, rng, replay = case_generator(f"cuda graph windowed paged={paged}", 0)
    layout = random_layout(rng, max_kv_heads=6, max_group=8)
    dtype = rng.choice(DTYPES)
    batch, capacity, page_size = 5, 6000, 16
    window_left = 1000 + rng.randint(0, 15)
    sinks = torch.randn(layout.num_kv_heads * layout.group, generator=gen) * 2
    variant = dict(window_left=window_left, softcap=10.0, sinks=sinks)
    first = [capacity, 0, 1, 300, 2000]
    inputs = DecodeInputs(gen, rng, layout, dtype, first, paged, page_size)
    if paged:  # every request owns pages for the full capacity, so any later length fits the captured table
        table, num_pages = random_block_table([capacity] * batch, capacity, page_size, rng)
        inputs.block_table, inputs.block_table_dev = table, table.to(DEVICE)
        inputs.k_dev = torch.full((num_pages, layout.qk_width, page_size), float("nan"), dtype=dtype, device=DEVICE)
        inputs.v_dev = torch.full((num_pages, layout.v_width, page_size), float("nan"), dtype=dtype, device=DEVICE)
    q_static = inputs.q_dev
    device_variant = _on_device(variant)

    def step():
        plan = ops.decode_plan(inputs.seqlens_dev, layout.qk_offsets, layout.v_offsets, layout.group,
                               window_left=window_left)
        return ops.decode_attention(q_static, inputs.k_dev, inputs.v_dev, inputs.seqlens_dev, layout.qk_offsets,
                                    layout.v_offsets, layout.group, inputs.scale, plan, inputs.block_table_dev,
                                    **device_variant)

    def refill(lengths):
        """New lengths and cache contents, NaN outside the window, written in place into the captured tensors."""
        k = torch.full((batch, capacity, layout.qk_width), float("nan"), dtype=dtype)
        v = torch.full((batch, capacity, layout.v_width), float("nan"), dtype=dtype)
        for b, length in enumerate(lengths):
            first_key = _window_start(length, window_left)
            k[b, first_key:length] = randn((length - first_key, layout.qk_width), dtype, gen)
            v[b, first_key:length] = randn((length - first_key, layout.v_width), dtype, gen)
        if paged:
            k = to_pages(k, lengths, inputs.block_table, inputs.k_dev.shape[0], page_size)
            v = to_pages(v, lengths, inputs.block_table, inputs.v_dev.shape[0], page_size)
        inputs.k_cache, inputs.v_cache = k, v
        inputs.k_dev.copy_(k)
        inputs.v_dev.copy_(v)
        inputs.lengths = lengths
        inputs.seqlens = torch.tensor(lengths, dtype=torch.int32)
        inputs.seqlens_dev.copy_(inputs.seqlens)
        inputs.q = randn((batch, layout.group * layout.qk_width), dtype, gen)
        q_static.copy_(inputs.q)

    refill(first)
    graph, out = capture_graph(step)
    for replay_index, lengths in enumerate([first, [1, 4096, 0, 17, 999], [window_left + 1, window_left + 2, 0, 16,
                                                                           capacity - 1],
                                            [rng.randint(0, capacity) for _ in range(batch)]]):
        refill(lengths)
        graph.replay()
        torch.cuda.synchronize()
        _check_variant(inputs, out.clone(), variant,
                       f"cuda graph windowed replay {replay_index} lengths={lengths} paged={paged} {dtype} {replay}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", SOFT_CAPS)
@pytest.mark.parametrize("op", ("decode", "decode_paged"))
def test_soft_cap_error_stays_torch_s_at_every_cap_cuda(op, softcap, dtype):
    """fdc::soft_cap on the GPU as on the CPU: within FlashAttention's rule at caps from 1 to 5000, scores from near
    zero on (test_attention_variants.check_soft_cap)."""
    for case in range(8):
        check_soft_cap(op, softcap, dtype, case, DEVICE)
