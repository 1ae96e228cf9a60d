"""decode_plan, decode_attention and append_kv on a GPU, against the float64 reference (fdc_ops/reference.py) and the
CPU ops, over fresh random configurations each run: float32/float16/bfloat16, contiguous and paged caches with NaN in
every slot and page that must not be read, non-contiguous queries, sequences of 32K keys and more, one very long
request among many short ones, G from 1 to 8 and 16, explicit plans for 1, 3 and 132 workers, a decode step captured
in a CUDA graph and replayed over changed lengths and cache contents (one layer, and a whole SmolLM2-shaped model:
append_kv, decode_plan and decode_attention in 30 layers), a negative length (NaN output, status in the plan)
(opcheck on CUDA inputs: tests/test_opcheck.py).

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
        k_cache = torch.full((batch, capacity, layout.qk_width), float("nan"), dtype=dtype)
        v_cache = torch.full((batch, capacity, layout.v_width), float("nan"), dtype=dtype)
        for b, length in enumerate(lengths):
            k_cache[b, :length] = randn((length, layout.qk_width), dtype, gen)
            v_cache[b, :length] = randn((length, layout.v_width), dtype, gen)
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
