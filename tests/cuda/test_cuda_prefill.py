"""prefill_plan and prefill_attention on a GPU, against the float64 reference (fdc_ops/reference.py) and the CPU ops,
over fresh random configurations each run: float32/float16/bfloat16, causal and not, varlen batches with empty and
length-1 sequences, odd lengths, key lengths other than the query lengths, NaN in every q/k/v row outside the
sequences (and rows of q outside them must come back zero), non-contiguous q/k/v, G from 1 to 8, widths multiples of
8 up to 256 (layouts mixing 8- and 256-wide heads), one 16K causal sequence per dtype, explicit plans for 1, 5 and 132
workers and row blocks of 16, 64 and 128 (equal integer for integer to the CPU planner's), hand-built unbalanced
plans (no row-block rescaling, no last-round split, everything on one worker, one record per head) giving the same
result (opcheck on CUDA inputs: tests/ops/test_opcheck.py), bad input on CUDA raising errors that name the op and
argument, and the attention variants (sliding windows, soft-capping, sinks) over random configurations, extreme
widths, a windowed 16K sequence, and windowed plans equal to the CPU planner's. Keys and values read from a paged
cache (block_table) against the reference reading the same pages, and bit for bit equal to the same keys given as
packed rows: page sizes that are and are not powers of two, shuffled pages, NaN in every slot and page no query
sees, block-table entries before a sliding window that are -1 or name a page of NaN, cached prefixes.

CUDA conventions of the ops: q/k/v, cu_seqlens_q/k and plans live on the GPU; qk_offsets/v_offsets stay int32 CPU
tensors; the CUDA prefill_plan runs the host planner on the boundaries copied to the host, so its plan equals the CPU
planner's for the same num_workers, and its default num_workers is the number of SMs. FDC_CUDA_CASES overrides the
number of random cases (fewer under compute-sanitizer).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from conftest import (
    DTYPES,
    Layout,
    assert_close_to_cpu,
    assert_close_to_reference,
    case_generator,
    offsets,
    randn,
    random_layout,
    random_lengths,
    skip_without_cuda_kernels,
    strided_rows,
)
from fdc_ops import ops, reference
from fdc_ops.plans import PrefillPlan, concat_workers, visible_keys
from test_attention_variants import SOFT_CAPS, check_soft_cap

skip_without_cuda_kernels("prefill_plan", "prefill_attention")

DEVICE = torch.device("cuda")
NUM_SMS = torch.cuda.get_device_properties(DEVICE).multi_processor_count
CASES = int(os.environ.get("FDC_CUDA_CASES", 40))  # per run; fewer under compute-sanitizer
# Lengths of the random cases: empty, length 1, odd, one 16-row tile and a bit, several row blocks of every width.
LENGTHS = (0, 1, 2, 7, 16, 33, 64, 100, 257, 511, 1000)
# Score entries (heads x sum of s_q * s_k) a random case may have: keeps the CPU float64 reference, the bfloat16 one
# and the CPU op to about a second per case.
REFERENCE_BUDGET = 8_000_000


def _rows(lengths: list[int], lead: int, tail: int, width: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cu_seqlens): random rows for each sequence, preceded by `lead` and followed by `tail` NaN rows that
    belong to no sequence and must never be read."""
    cu = offsets(lengths) + lead
    rows = torch.full((lead + sum(lengths) + tail, width), float("nan"), dtype=dtype)
    rows[lead:lead + sum(lengths)] = randn((sum(lengths), width), dtype, gen)
    return rows, cu


class PrefillInputs:
    """One prefill problem on the CPU (for the reference and the CPU op) and on the GPU; `variant` holds the
    attention variants the op and the reference are given (window_left, softcap, sinks as a CPU tensor)."""

    def __init__(self, gen, rng, layout: Layout, dtype, lengths_q: list[int], lengths_k: list[int], causal: bool,
                 strided: bool = True, poison: bool = True, variant: dict | None = None):
        self.layout, self.dtype, self.causal = layout, dtype, causal
        self.variant = variant or {}
        self.lengths_q, self.lengths_k = lengths_q, lengths_k
        lead_q, tail_q = (rng.choice([0, 0, 1, 5]), rng.choice([0, 0, 3, 17])) if poison else (0, 0)
        lead_k, tail_k = (rng.choice([0, 0, 2]), rng.choice([0, 0, 4])) if poison else (0, 0)
        self.q, self.cu_q = _rows(lengths_q, lead_q, tail_q, layout.group * layout.qk_width, dtype, gen)
        k, self.cu_k = _rows(lengths_k, lead_k, tail_k, layout.qk_width, dtype, gen)
        v, cu_v = _rows(lengths_k, lead_k, tail_k, layout.v_width, dtype, gen)
        assert torch.equal(cu_v, self.cu_k)
        self.k, self.v = k, v
        self.scale = rng.uniform(0.05, 0.5)
        self.q_dev = strided_rows(self.q, rng, DEVICE) if strided and rng.random() < 0.7 else self.q.to(DEVICE)
        self.k_dev = strided_rows(self.k, rng, DEVICE) if strided and rng.random() < 0.7 else self.k.to(DEVICE)
        self.v_dev = strided_rows(self.v, rng, DEVICE) if strided and rng.random() < 0.7 else self.v.to(DEVICE)
        self.cu_q_dev, self.cu_k_dev = self.cu_q.to(DEVICE), self.cu_k.to(DEVICE)
        self._references = None

    def describe(self) -> str:
        lo = self.layout
        shown = {name: (value if name != "sinks" else "on") for name, value in self.variant.items()}
        return (f"G={lo.group} qk={lo.qk_dims} v={lo.v_dims} {self.dtype} causal={self.causal} "
                f"q lengths={self.lengths_q} k lengths={self.lengths_k}" + (f" {shown}" if shown else ""))

    def cpu_args(self):
        lo = self.layout
        return (self.q, self.k, self.v, self.cu_q, self.cu_k, lo.qk_offsets, lo.v_offsets, lo.group, self.scale,
                self.causal)

    def plan_cuda(self, num_workers=None, row_block=ops.DEFAULT_ROW_BLOCK) -> torch.Tensor:
        lo = self.layout
        plan = ops.prefill_plan(self.cu_q_dev, self.cu_k_dev, lo.qk_offsets, lo.v_offsets, lo.group, self.causal,
                                num_workers, row_block, window_left=self.variant.get("window_left", -1))
        assert plan.device.type == "cuda" and plan.dtype == torch.int32, f"plan on {plan.device}, {plan.dtype}"
        return plan

    def plan_cpu(self, num_workers, row_block=ops.DEFAULT_ROW_BLOCK) -> torch.Tensor:
        lo = self.layout
        return ops.prefill_plan(self.cu_q, self.cu_k, lo.qk_offsets, lo.v_offsets, lo.group, self.causal,
                                num_workers, row_block, window_left=self.variant.get("window_left", -1))

    def run_cuda(self, plan=None) -> torch.Tensor:
        lo = self.layout
        variant = {name: value.to(DEVICE) if name == "sinks" else value for name, value in self.variant.items()}
        out = ops.prefill_attention(self.q_dev, self.k_dev, self.v_dev, self.cu_q_dev, self.cu_k_dev, lo.qk_offsets,
                                    lo.v_offsets, lo.group, self.scale, self.causal, plan, **variant)
        assert out.device.type == "cuda" and out.dtype == self.dtype, f"output on {out.device}, {out.dtype}"
        assert out.shape == (self.q.shape[0], lo.group * lo.v_width), f"output shape {tuple(out.shape)}"
        return out

    def check_outside_rows(self, out: torch.Tensor, what: str):
        """Rows of q before the first and after the last sequence come back exactly zero."""
        first, last = int(self.cu_q[0]), int(self.cu_q[-1])
        outside = torch.cat([out[:first], out[last:]])
        assert torch.equal(outside, torch.zeros_like(outside)), f"{what}: rows outside every sequence are not zero"

    def references(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64 reference, torch's own result at the input precision), computed once per problem."""
        if self._references is None:
            args = self.cpu_args()
            self._references = (reference.prefill_attention_ref(*args, **self.variant),
                                reference.prefill_attention_ref(*args, **self.variant, compute_dtype=self.dtype))
        return self._references

    def check(self, out: torch.Tensor, what: str, against_cpu: bool = True):
        """out (from the GPU) against the float64 reference and against the CPU op on the same inputs."""
        out = out.cpu()
        self.check_outside_rows(out, what)
        expected, torch_lowp = self.references()
        assert_close_to_reference(out, expected, torch_lowp, f"{what} (cuda vs float64 reference)")
        if against_cpu:
            cpu = ops.prefill_attention(*self.cpu_args(), **self.variant)
            assert_close_to_cpu(out, cpu, expected, torch_lowp, what)


def assert_same_plan(cpu: torch.Tensor, cuda: torch.Tensor, what: str):
    """The CUDA planner is the host planner: the same plan, integer for integer."""
    cuda = cuda.cpu()
    assert cpu.shape == cuda.shape, f"{what}: plan sizes {cpu.numel()} (cpu) vs {cuda.numel()} (cuda)"
    differ = (cpu != cuda).nonzero()
    assert differ.numel() == 0, (f"{what}: {differ.numel()} plan entries differ, first at {int(differ[0])}: "
                                 f"cpu {int(cpu[differ[0]])} vs cuda {int(cuda[differ[0]])}")


def _random_problem(gen, rng, layout: Layout, dtype, causal: bool, batch: int | None = None) -> PrefillInputs:
    """Varlen lengths as in tests/ops/test_ops.py, longer: keys equal to, more than, or fewer than the queries."""
    lengths_q = random_lengths(rng, batch or rng.randint(1, 5), choices=LENGTHS)
    lengths_k = [s + rng.choice([0, 0, 1, 9, 40, 300]) if rng.random() < 0.5 else s for s in lengths_q]
    if rng.random() < 0.3:  # queries that see fewer keys than there are queries (causal rows that see nothing)
        lengths_k = [max(0, s - rng.randint(0, 40)) for s in lengths_q]
    heads = layout.num_kv_heads * layout.group
    while heads * sum(a * b for a, b in zip(lengths_q, lengths_k)) > REFERENCE_BUDGET:
        b = max(range(len(lengths_q)), key=lambda i: lengths_q[i] * lengths_k[i])
        lengths_q[b], lengths_k[b] = (lengths_q[b] + 1) // 3, (lengths_k[b] + 1) // 3
    return PrefillInputs(gen, rng, layout, dtype, lengths_q, lengths_k, causal)


# ------------------------------------------------------------------------------------------------- random configs


@pytest.mark.parametrize("case", range(CASES))
def test_prefill_attention_cuda(case):
    gen, rng, replay = case_generator("cuda prefill_attention", case)
    layout = random_layout(rng)
    dtype = rng.choice(DTYPES)
    inputs = _random_problem(gen, rng, layout, dtype, causal=rng.random() < 0.5)
    what = f"cuda prefill_attention {inputs.describe()} {replay}"
    plan = None
    if rng.random() < 0.5:
        workers, row_block = rng.choice([None, 1, 5, 40, NUM_SMS, 2 * NUM_SMS]), rng.choice([16, 32, 64, 128])
        plan = inputs.plan_cuda(workers, row_block)
        assert_same_plan(inputs.plan_cpu(workers or NUM_SMS, row_block), plan, what)
    inputs.check(inputs.run_cuda(plan), what)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_group_sizes(group):
    gen, rng, replay = case_generator(f"cuda prefill group={group}", 0)
    base = random_layout(rng, max_kv_heads=4)
    layout = Layout(base.qk_dims, base.v_dims, group)
    for dtype in DTYPES:
        causal = rng.random() < 0.5
        inputs = _random_problem(gen, rng, layout, dtype, causal, batch=3)
        inputs.check(inputs.run_cuda(), f"cuda prefill {inputs.describe()} {replay}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extreme_widths(dtype, causal):
    """8-wide and 256-wide heads side by side (the smallest and largest tiles, row blocks rescaled 32x apart), and a
    head 8 wide for queries/keys but 256 for values and the other way round."""
    gen, rng, replay = case_generator(f"cuda prefill widths {dtype} causal={causal}", 0)
    layout = Layout([8, 256, 8, 256, 128], [256, 8, 8, 256, 64], rng.choice([1, 2, 4]))
    lengths_q = [257, 0, 1, 600, 33]
    lengths_k = [257, 5, 1, 600, 90]
    inputs = PrefillInputs(gen, rng, layout, dtype, lengths_q, lengths_k, causal)
    what = f"cuda prefill {inputs.describe()} {replay}"
    inputs.check(inputs.run_cuda(), what)
    plan = inputs.plan_cuda(NUM_SMS, 64)
    assert_same_plan(inputs.plan_cpu(NUM_SMS, 64), plan, what)
    inputs.check(inputs.run_cuda(plan), f"{what} (explicit plan)", against_cpu=False)


def test_contiguous_and_single_rows():
    """Contiguous inputs without poisoned rows, and batches of length-1 and empty sequences only."""
    gen, rng, replay = case_generator("cuda prefill single rows", 0)
    for dtype in DTYPES:
        layout = random_layout(rng, max_kv_heads=4, max_group=4)
        for lengths_q, lengths_k in (([1] * 9, [1] * 9), ([0, 0, 0], [0, 3, 0]), ([1, 0, 1], [40, 0, 1]),
                                     ([3, 0], [0, 0])):
            for causal in (False, True):
                inputs = PrefillInputs(gen, rng, layout, dtype, lengths_q, lengths_k, causal, strided=False,
                                       poison=False)
                inputs.check(inputs.run_cuda(), f"cuda prefill {inputs.describe()} {replay}")


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values on the GPU in a contiguous tensor that starts one element past an allocation's (16-byte aligned)
    start, as buf[1:].view(...) does: contiguous, so .contiguous() would return it unchanged."""
    buffer = torch.full((t.numel() + 1,), float("nan"), dtype=t.dtype, device=DEVICE)
    view = buffer[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


def test_misaligned_contiguous_inputs():
    """K and V that are contiguous but start off a 16-byte boundary (and a single-row column slice) must be read
    through an aligned copy, not faulted on by the 16-byte cp.async loads: same results as aligned inputs."""
    gen, rng, replay = case_generator("cuda prefill misaligned", 0)
    for dtype in DTYPES:
        layout = random_layout(rng, max_kv_heads=3, max_group=3)
        for lengths in ([37, 5], [1]):
            inputs = PrefillInputs(gen, rng, layout, dtype, lengths, lengths, True, strided=False, poison=False)
            expected = inputs.run_cuda()
            inputs.k_dev, inputs.v_dev = _misaligned(inputs.k), _misaligned(inputs.v)
            if lengths == [1]:  # one row inside a wider row, at an odd column
                wide = torch.full((1, layout.qk_width + 1), float("nan"), dtype=dtype, device=DEVICE)
                wide[:, 1:] = inputs.k.to(DEVICE)
                inputs.k_dev = wide[:, 1:]
            torch.testing.assert_close(inputs.run_cuda(), expected, rtol=0, atol=0,
                                       msg=f"misaligned k/v, {inputs.describe()} {replay}")


def test_empty_batch_and_no_rows():
    """No sequence at all (cu_seqlens [0]) and only rows outside the sequences: zeros of the right shape."""
    gen, rng, replay = case_generator("cuda prefill empty", 0)
    layout = random_layout(rng, max_kv_heads=3, max_group=3)
    for lengths, tail in (([], 0), ([], 5), ([0, 0], 4)):
        q = torch.full((tail, layout.group * layout.qk_width), float("nan"), dtype=torch.float16, device=DEVICE)
        k = torch.full((2, layout.qk_width), float("nan"), dtype=torch.float16, device=DEVICE)
        v = torch.full((2, layout.v_width), float("nan"), dtype=torch.float16, device=DEVICE)
        cu = offsets(lengths).to(DEVICE)
        for causal in (False, True):
            out = ops.prefill_attention(q, k, v, cu, cu, layout.qk_offsets, layout.v_offsets, layout.group, 0.3,
                                        causal)
            assert out.shape == (tail, layout.group * layout.v_width) and out.device.type == "cuda", replay
            assert torch.equal(out, torch.zeros_like(out)), f"lengths {lengths}: rows outside sequences {replay}"


# ------------------------------------------------------------------------------ sliding window, soft-capping, sinks


def _random_variant(rng, gen, layout: Layout, longest: int) -> dict:
    """window_left, softcap and sinks (a CPU tensor), each on or off: windows of 0 keys, shorter than, equal to and
    just around a key tile (32 or 64 keys) and a row tile (64 rows), near and past the longest sequence; caps small
    enough to matter; sinks from far below to far above the scores."""
    variant = {}
    if rng.random() < 0.75:
        variant["window_left"] = rng.choice([0, 1, 7, 31, 32, 33, 63, 64, 65, 200, max(0, longest - 1), longest + 50])
    if rng.random() < 0.5:
        variant["softcap"] = rng.choice([0.5, 5.0, 30.0])
    if rng.random() < 0.5:
        variant["sinks"] = torch.randn(layout.num_kv_heads * layout.group, generator=gen) * rng.choice([1.0, 5.0, 20.0])
    return variant


@pytest.mark.parametrize("case", range(CASES))
def test_prefill_variants_cuda(case):
    """Random layouts, dtypes, lengths and variants, causal or not; the plan made inside the op, or given: made for
    the same window (equal to the CPU planner's) or for none (it only balances the work: same result)."""
    gen, rng, replay = case_generator("cuda prefill variants", case)
    layout = random_layout(rng)
    dtype = rng.choice(DTYPES)
    inputs = _random_problem(gen, rng, layout, dtype, causal=rng.random() < 0.7)
    inputs.variant = _random_variant(rng, gen, layout, max(inputs.lengths_k))
    what = f"cuda prefill variants {inputs.describe()} {replay}"
    plan = None
    if rng.random() < 0.5:
        workers, row_block = rng.choice([1, 5, 40, NUM_SMS]), rng.choice([16, 64, 128])
        if rng.random() < 0.7:
            plan = inputs.plan_cuda(workers, row_block)
            assert_same_plan(inputs.plan_cpu(workers, row_block), plan, what)
        else:
            lo = inputs.layout
            plan = ops.prefill_plan(inputs.cu_q_dev, inputs.cu_k_dev, lo.qk_offsets, lo.v_offsets, lo.group,
                                    inputs.causal, workers, row_block)
    inputs.check(inputs.run_cuda(plan), what, against_cpu=False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_variants_extreme_widths(dtype, causal):
    """Windows whose edges cut key tiles of the 64, 128 and 256 buckets (8- and 256-wide heads side by side), with a
    cap and sinks, over sequences with more keys than queries (a prefix of cached keys) and fewer."""
    gen, rng, replay = case_generator(f"cuda prefill variant widths {dtype} causal={causal}", 0)
    layout = Layout([8, 256, 8, 128], [256, 8, 8, 64], rng.choice([1, 2, 4]))
    heads = layout.num_kv_heads * layout.group
    for window_left in (0, 37, 64, 300):
        variant = dict(window_left=window_left, softcap=rng.choice([1.0, 20.0]),
                       sinks=torch.randn(heads, generator=gen) * 4)
        inputs = PrefillInputs(gen, rng, layout, dtype, [257, 0, 1, 600, 33], [257, 5, 1, 900, 20], causal,
                               variant=variant)
        inputs.check(inputs.run_cuda(), f"cuda prefill {inputs.describe()} {replay}", against_cpu=False)


def test_softcap_and_sinks_alone():
    """Soft-capping alone and sinks alone, causal or not, every dtype: a cap so small that every score is near it,
    sinks far above the scores (outputs near 0) and far below (outputs as without)."""
    gen, rng, replay = case_generator("cuda prefill softcap sinks", 0)
    layout = random_layout(rng, max_kv_heads=3, max_group=4)
    heads = layout.num_kv_heads * layout.group
    for dtype in DTYPES:
        for causal in (False, True):
            for variant in (dict(softcap=0.5), dict(softcap=50.0), dict(sinks=torch.randn(heads, generator=gen)),
                            dict(sinks=torch.full((heads,), 30.0)), dict(sinks=torch.full((heads,), -30.0))):
                inputs = PrefillInputs(gen, rng, layout, dtype, [100, 1, 0, 300], [140, 1, 3, 300], causal,
                                       variant=variant)
                inputs.check(inputs.run_cuda(), f"cuda prefill {inputs.describe()} {replay}", against_cpu=False)


def test_windowed_plans_follow_the_window():
    """The CUDA planner caches plans per window too: the same boundaries planned with alternating windows give the
    CPU planner's plan for each window every time."""
    gen, rng, replay = case_generator("cuda prefill plan windows", 0)
    layout = random_layout(rng, max_kv_heads=4, max_group=4)
    cu = offsets([2000, 1, 700])
    for step, window_left in enumerate([-1, 100, 100, -1, 0, 1999, 100]):
        for causal in (False, True):
            plan = ops.prefill_plan(cu.to(DEVICE), cu.to(DEVICE), layout.qk_offsets, layout.v_offsets, layout.group,
                                    causal, 7, window_left=window_left)
            cpu = ops.prefill_plan(cu, cu, layout.qk_offsets, layout.v_offsets, layout.group, causal, 7,
                                   window_left=window_left)
            assert_same_plan(cpu, plan, f"step {step} window {window_left} causal={causal} {replay}")


# -------------------------------------------------------------------------------------------------- long sequences


def _reference_on_device(inputs: PrefillInputs, compute_dtype: torch.dtype, chunk: int = 2048) -> torch.Tensor:
    """prefill_attention_ref's semantics (with inputs.variant) computed on the GPU in row chunks (a 16K x 16K float64
    score matrix per head would not fit the CPU reference's time budget): float64 for the oracle, or the input dtype
    for torch's own error at that precision. Checked against fdc_ops.reference by
    test_device_reference_matches_reference."""
    lo = inputs.layout
    window_left = inputs.variant.get("window_left", -1)
    softcap = inputs.variant.get("softcap", 0.0)
    sinks = inputs.variant.get("sinks")
    q, k, v = (t.to(DEVICE, compute_dtype) for t in (inputs.q, inputs.k, inputs.v))
    qk_off, v_off = lo.qk_offsets.tolist(), lo.v_offsets.tolist()
    cu_q, cu_k = inputs.cu_q.tolist(), inputs.cu_k.tolist()
    out = torch.zeros((q.shape[0], lo.group * v_off[-1]), dtype=compute_dtype, device=DEVICE)
    for b in range(len(cu_q) - 1):
        s_q, s_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if s_q == 0 or s_k == 0:
            continue
        for j in range(lo.num_kv_heads):
            dq, dv = lo.qk_dims[j], lo.v_dims[j]
            keys = k[cu_k[b]:cu_k[b + 1], qk_off[j]:qk_off[j + 1]]
            values = v[cu_k[b]:cu_k[b + 1], v_off[j]:v_off[j + 1]]
            for r0 in range(0, s_q, chunk):
                r1 = min(s_q, r0 + chunk)
                cols = slice(lo.group * qk_off[j], lo.group * qk_off[j] + lo.group * dq)
                queries = q[cu_q[b] + r0:cu_q[b] + r1, cols].reshape(r1 - r0, lo.group, dq).transpose(0, 1)
                scores = inputs.scale * (queries @ keys.T)  # (G, rows, s_k)
                if softcap > 0:
                    scores = softcap * torch.tanh(scores / softcap)
                visible = None
                if inputs.causal or window_left >= 0:
                    positions = torch.arange(r0, r1, device=DEVICE)[:, None] + (s_k - s_q)
                    key_index = torch.arange(s_k, device=DEVICE)[None, :]
                    visible = torch.ones((r1 - r0, s_k), dtype=torch.bool, device=DEVICE)
                    if inputs.causal:
                        visible &= key_index <= positions
                    if window_left >= 0:
                        visible &= key_index >= positions - window_left
                    scores = scores.masked_fill(~visible, float("-inf"))
                if sinks is not None:  # one more logit per row, with no value: its weights are dropped
                    head_sinks = sinks[j * lo.group:(j + 1) * lo.group].to(DEVICE, compute_dtype)
                    scores = torch.cat([scores, head_sinks[:, None, None].expand(-1, r1 - r0, 1)], dim=-1)
                weights = torch.softmax(scores, dim=-1)[..., :s_k]
                if visible is not None:
                    weights = torch.where(visible.any(dim=1)[None, :, None], weights, torch.zeros_like(weights))
                result = (weights @ values).transpose(0, 1).reshape(r1 - r0, lo.group * dv)
                out[cu_q[b] + r0:cu_q[b] + r1, lo.group * v_off[j]:lo.group * v_off[j] + lo.group * dv] = result
    return out


def test_device_reference_matches_reference():
    """The chunked device reference of the long-sequence tests computes what fdc_ops.reference does, with and
    without the attention variants."""
    gen, rng, replay = case_generator("cuda prefill device reference", 0)
    for causal, with_variant in ((False, False), (True, False), (False, True), (True, True)):
        layout = random_layout(rng, max_kv_heads=3, max_group=4)
        inputs = _random_problem(gen, rng, layout, torch.float32, causal, batch=4)
        if with_variant:
            heads = layout.num_kv_heads * layout.group
            inputs.variant = dict(window_left=rng.choice([0, 5, 40]), softcap=2.0,
                                  sinks=torch.randn(heads, generator=gen) * 3)
        expected = reference.prefill_attention_ref(*inputs.cpu_args(), **inputs.variant)
        ours = _reference_on_device(inputs, torch.float64, chunk=48).cpu()
        torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12, msg=f"{inputs.describe()} {replay}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_sequence(dtype):
    """16K causal queries (odd length, keys a few more than queries, a short sequence beside it): thousands of row
    blocks of one (sequence, head) spread over all SMs, causal costs 1000x apart, the last round split."""
    gen, rng, replay = case_generator(f"cuda prefill long {dtype}", 0)
    layout = random_layout(rng, max_kv_heads=3, max_group=4)
    s = 16384 + rng.randint(1, 15)
    inputs = PrefillInputs(gen, rng, layout, dtype, [s, 37], [s + rng.randint(0, 40), 37], causal=True)
    what = f"cuda prefill long {inputs.describe()} {replay}"
    plan = inputs.plan_cuda()
    assert_same_plan(inputs.plan_cpu(NUM_SMS), plan, what)
    out = inputs.run_cuda(plan).cpu()
    inputs.check_outside_rows(out, what)
    expected = _reference_on_device(inputs, torch.float64).cpu()
    torch_lowp = _reference_on_device(inputs, dtype).cpu()
    assert_close_to_reference(out, expected, torch_lowp, f"{what} (cuda vs float64 reference)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_sequence_windowed(dtype):
    """16K causal queries under a window of about a thousand keys (Mistral's and Gemma's local layers), with a cap and
    sinks: each row tile reads only the key tiles its rows' windows reach, the planner balances by the keys seen."""
    gen, rng, replay = case_generator(f"cuda prefill long windowed {dtype}", 0)
    layout = random_layout(rng, max_kv_heads=3, max_group=4)
    s = 16384 + rng.randint(1, 15)
    variant = dict(window_left=1000 + rng.randint(0, 63), softcap=30.0,
                   sinks=torch.randn(layout.num_kv_heads * layout.group, generator=gen) * 2)
    inputs = PrefillInputs(gen, rng, layout, dtype, [s, 37], [s + rng.randint(0, 40), 37], causal=True,
                           variant=variant)
    what = f"cuda prefill long windowed {inputs.describe()} {replay}"
    plan = inputs.plan_cuda()
    assert_same_plan(inputs.plan_cpu(NUM_SMS), plan, what)
    out = inputs.run_cuda(plan).cpu()
    inputs.check_outside_rows(out, what)
    expected = _reference_on_device(inputs, torch.float64).cpu()
    torch_lowp = _reference_on_device(inputs, dtype).cpu()
    assert_close_to_reference(out, expected, torch_lowp, f"{what} (cuda vs float64 reference)")


# ---------------------------------------------------------------------------------------------------------- plans


@pytest.mark.parametrize("row_block", [16, 64, 128])
@pytest.mark.parametrize("workers", [1, 5, 132])
def test_explicit_plans(workers, row_block):
    """Plans for 1, 5 and 132 workers and row blocks of 16, 64 and 128 equal the CPU planner's, give the reference's
    results, and the plan made inside the op gives the same."""
    gen, rng, replay = case_generator(f"cuda prefill workers={workers} row_block={row_block}", 0)
    layout = random_layout(rng, max_kv_heads=3, max_group=4)
    for dtype in DTYPES:
        causal = rng.random() < 0.5
        inputs = PrefillInputs(gen, rng, layout, dtype, [1100, 0, 1, 313, rng.randint(1, 500)],
                               [1100, 0, 7, 313, rng.randint(1, 500)], causal)
        what = f"cuda prefill workers={workers} row_block={row_block} {inputs.describe()} {replay}"
        plan = inputs.plan_cuda(workers, row_block)
        decoded = PrefillPlan.from_tensor(plan)
        assert decoded.num_workers == workers and decoded.row_block == row_block, \
            f"{what}: plan for {decoded.num_workers} workers, row block {decoded.row_block}"
        assert_same_plan(inputs.plan_cpu(workers, row_block), plan, what)
        with_plan = inputs.run_cuda(plan)
        inputs.check(with_plan, what)
        if dtype == torch.float32:
            torch.testing.assert_close(with_plan, inputs.run_cuda(), rtol=1e-4, atol=1e-5, msg=what)


def test_default_workers_are_the_sms():
    gen, rng, replay = case_generator("cuda prefill default workers", 0)
    inputs = _random_problem(gen, rng, random_layout(rng), torch.float16, causal=True, batch=3)
    plan = inputs.plan_cuda()
    assert int(plan[3]) == NUM_SMS, f"default worker count {int(plan[3])}, SMs {NUM_SMS} {replay}"
    assert_same_plan(inputs.plan_cpu(NUM_SMS), plan, f"default workers {replay}")


def test_plans_follow_the_lengths():
    """The CUDA planner caches per shape but plans from the current boundaries: the same batch size with other
    lengths, and boundaries changed in place, give the CPU planner's plan of the new lengths every time."""
    gen, rng, replay = case_generator("cuda prefill plan cache", 0)
    layout = random_layout(rng, max_kv_heads=4, max_group=4)
    cu_q_dev = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    cu_k_dev = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    for step, lengths in enumerate([[100, 0, 700], [700, 100, 0], [1, 1, 1], [333, 2048, 65], [0, 0, 0]]):
        for causal in (False, True):
            cu = offsets(lengths)
            cu_q_dev.copy_(cu)
            cu_k_dev.copy_(cu)
            for workers in (None, 7):
                plan = ops.prefill_plan(cu_q_dev, cu_k_dev, layout.qk_offsets, layout.v_offsets, layout.group,
                                        causal, workers)
                cpu = ops.prefill_plan(cu, cu, layout.qk_offsets, layout.v_offsets, layout.group, causal,
                                       workers or NUM_SMS)
                assert_same_plan(cpu, plan, f"step {step} lengths={lengths} causal={causal} workers={workers} "
                                            f"{replay}")
            fresh = ops.prefill_plan(cu.to(DEVICE), cu.to(DEVICE), layout.qk_offsets, layout.v_offsets, layout.group,
                                     causal, 7)
            assert_same_plan(ops.prefill_plan(cu, cu, layout.qk_offsets, layout.v_offsets, layout.group, causal, 7),
                             fresh, f"fresh tensors step {step} {replay}")


def _hand_plan(inputs: PrefillInputs, num_workers: int, rows: int, policy: str, rng) -> torch.Tensor:
    """A plan in the documented format (include/fdc/prefill_plan.h), built here without the planner: every head's
    rows cut into records of `rows` rows (no row-block rescaling; "whole" makes one record per (sequence, head)),
    records starting on 16-row boundaries, given to workers by `policy`:
      round_robin   in enumeration order (b, h, block), no last-round split;
      one_worker    all records on worker 0, the others idle;
      last_worker   all on the last worker, in reverse order;
      random        each record to a random worker (some idle);
      causal_heavy  records sorted by causal cost, descending, dealt in contiguous blocks (heaviest together)."""
    lo = inputs.layout
    heads = lo.num_kv_heads * lo.group
    lengths_q, lengths_k = inputs.lengths_q, inputs.lengths_k
    records = []
    for b, s_q in enumerate(lengths_q):
        for h in range(heads):
            step = max(s_q, 1) if policy == "whole" else rows
            for r0 in range(0, s_q, step):
                records.append((b, h, r0, min(s_q, r0 + step)))
    owner: list[int]
    if policy in ("round_robin", "whole"):
        owner = [i % num_workers for i in range(len(records))]
    elif policy == "one_worker":
        owner = [0] * len(records)
    elif policy == "last_worker":
        records.reverse()
        owner = [num_workers - 1] * len(records)
    elif policy == "random":
        owner = [rng.randrange(num_workers) for _ in records]
    elif policy == "causal_heavy":
        d_sum = [lo.qk_dims[h // lo.group] + lo.v_dims[h // lo.group] + 1 for h in range(heads)]
        records.sort(key=lambda r: -d_sum[r[1]] * visible_keys(r[2], r[3], lengths_q[r[0]], lengths_k[r[0]],
                                                                inputs.causal))
        owner = [min(num_workers - 1, i * num_workers // max(len(records), 1)) for i in range(len(records))]
    else:
        raise ValueError(f"_hand_plan: unknown policy {policy!r}")
    per_worker: list[list[tuple]] = [[] for _ in range(num_workers)]
    for record, w in zip(records, owner):
        per_worker[w].append(record)
    return PrefillPlan(len(lengths_q), heads, num_workers, inputs.causal, rows, lo.group,
                       *concat_workers(per_worker)).to_tensor(DEVICE)


@pytest.mark.parametrize("policy", ["round_robin", "whole", "one_worker", "last_worker", "random", "causal_heavy"])
def test_hand_built_unbalanced_plans(policy):
    """The schedule only distributes work: plans made here without rescaling or the last-round split, or badly
    unbalanced, give the reference's results, and in float32 the planner's plan's results."""
    gen, rng, replay = case_generator(f"cuda prefill hand plan {policy}", 0)
    layout = Layout([16, 128, 16, 128], [16, 128, 16, 128], rng.choice([1, 2, 4]))
    for dtype in DTYPES:
        for causal in (False, True):
            inputs = PrefillInputs(gen, rng, layout, dtype, [600, 0, 1, 77, 250], [600, 3, 1, 77, 260], causal)
            what = f"cuda prefill hand plan {policy} {inputs.describe()} {replay}"
            for workers, rows in ((rng.choice([1, 5, 132]), rng.choice([16, 64, 128])), (NUM_SMS, 64)):
                out = inputs.run_cuda(_hand_plan(inputs, workers, rows, policy, rng))
                inputs.check(out, f"{what} workers={workers} rows={rows}", against_cpu=False)
                if dtype == torch.float32:
                    torch.testing.assert_close(out, inputs.run_cuda(), rtol=1e-4, atol=1e-5, msg=what)


# ------------------------------------------------------------------------------------------------ paged keys, values


class PagedInputs:
    """The keys and values of a PrefillInputs problem also held in a paged cache (decode_attention's and append_kv's
    layout: (num_pages, W, page_size), key t of request b at slot t % page_size of page block_table[b][t // page_size]),
    pages in shuffled order. NaN fills every slot past a request's last key and the spare pages; the block-table
    entries of pages no query sees (before the first query's window; all of a request without queries) are -1 or name
    a page of NaN, and the table has unused columns of -1, so reading such an entry or page would show. The pools are
    laid out on the device contiguous, as views of wider pages (a page stride other than W * page_size), or one
    element past an aligned start (the paged loads need no alignment)."""

    def __init__(self, inputs: PrefillInputs, page_size: int, rng):
        self.inputs, self.page_size = inputs, page_size
        window_left = inputs.variant.get("window_left", -1)
        cu_q, cu_k = inputs.cu_q.tolist(), inputs.cu_k.tolist()
        batch = len(cu_q) - 1
        counts, firsts = [], []  # pages of request b's keys, and its first page some query sees
        for b in range(batch):
            s_q, s_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
            counts.append(-(-s_k // page_size))
            first_key = 0 if window_left < 0 else max(0, s_k - s_q - window_left)
            firsts.append(counts[-1] if s_q == 0 else first_key // page_size)
        num_pages = sum(c - f for c, f in zip(counts, firsts)) + 2  # a page of NaN, and one no entry names
        order = list(range(num_pages))
        rng.shuffle(order)
        nan_page = order.pop()
        self.table = torch.full((batch, max(counts + [1]) + rng.randint(0, 2)), -1, dtype=torch.int32)
        self.live = []  # (b, position in the table) of every page some query sees
        for b in range(batch):
            for p in range(counts[b]):
                if p < firsts[b]:
                    self.table[b, p] = rng.choice([-1, nan_page])
                else:
                    self.table[b, p] = order.pop()
                    self.live.append((b, p))
        self.num_pages = num_pages
        self.k_pages, self.v_pages = self._fill(inputs.k), self._fill(inputs.v)
        self.k_pages_dev, self.v_pages_dev = self._on_device(self.k_pages, rng), self._on_device(self.v_pages, rng)
        self.table_dev = self.table.to(DEVICE)

    def _fill(self, rows: torch.Tensor) -> torch.Tensor:
        """The packed rows (T_k, W) of every live page, NaN elsewhere."""
        cu_k, size = self.inputs.cu_k.tolist(), self.page_size
        pages = torch.full((self.num_pages, rows.shape[1], size), float("nan"), dtype=rows.dtype)
        for b, p in self.live:
            start = cu_k[b] + p * size
            stop = min(cu_k[b + 1], start + size)
            pages[int(self.table[b, p]), :, :stop - start] = rows[start:stop].T
        return pages

    @staticmethod
    def _on_device(pages: torch.Tensor, rng) -> torch.Tensor:
        kind = rng.choice(["contiguous", "wider", "misaligned"])
        if kind == "contiguous":
            return pages.to(DEVICE)
        num_pages, width, size = pages.shape
        if kind == "wider":  # each page inside a taller one: contiguous pages, page stride (width + extra) * size
            extra = rng.randint(1, 5)
            buffer = torch.full((num_pages, width + extra, size), float("nan"), dtype=pages.dtype, device=DEVICE)
            view = buffer[:, extra:]
        else:
            buffer = torch.full((pages.numel() + 1,), float("nan"), dtype=pages.dtype, device=DEVICE)
            view = buffer[1:].view(pages.shape)
        view.copy_(pages)
        return view

    def describe(self) -> str:
        return f"{self.inputs.describe()} page_size={self.page_size} pages={self.num_pages}"

    def run_cuda(self, plan=None) -> torch.Tensor:
        inputs, lo = self.inputs, self.inputs.layout
        variant = {name: value.to(DEVICE) if name == "sinks" else value for name, value in inputs.variant.items()}
        out = ops.prefill_attention(inputs.q_dev, self.k_pages_dev, self.v_pages_dev, inputs.cu_q_dev,
                                    inputs.cu_k_dev, lo.qk_offsets, lo.v_offsets, lo.group, inputs.scale,
                                    inputs.causal, plan, block_table=self.table_dev, **variant)
        assert out.device.type == "cuda" and out.dtype == inputs.dtype, f"output on {out.device}, {out.dtype}"
        assert out.shape == (inputs.q.shape[0], lo.group * lo.v_width), f"output shape {tuple(out.shape)}"
        return out

    def check(self, out: torch.Tensor, what: str, plan=None):
        """out (the paged op on the GPU) against the float64 reference reading the same pages, and bit for bit equal
        to the op on the packed rows with the same plan: the kernels load the same values into the same tiles."""
        inputs, lo = self.inputs, self.inputs.layout
        out = out.cpu()
        inputs.check_outside_rows(out, what)
        args = (inputs.q, self.k_pages, self.v_pages, inputs.cu_q, inputs.cu_k, lo.qk_offsets, lo.v_offsets,
                lo.group, inputs.scale, inputs.causal)
        expected = reference.prefill_attention_ref(*args, block_table=self.table, **inputs.variant)
        torch_lowp = reference.prefill_attention_ref(*args, block_table=self.table, **inputs.variant,
                                                     compute_dtype=inputs.dtype)
        assert_close_to_reference(out, expected, torch_lowp, f"{what} (cuda paged vs float64 reference)")
        packed = inputs.run_cuda(plan).cpu()
        differ = (out != packed).sum()
        assert differ == 0, f"{what}: {int(differ)} outputs differ from the packed-rows result"


def _paged_problem(gen, rng, layout: Layout, dtype, causal: bool, lengths_q: list[int], prefixes: list[int],
                   page_size: int, variant: dict | None = None) -> PagedInputs:
    """Requests of lengths_q queries after prefixes[b] cached keys (s_k = prefix + s_q), NaN-poisoned packed rows
    around them (cu_seqlens_k need not start at 0), and their paged copy."""
    lengths_k = [s + prefix for s, prefix in zip(lengths_q, prefixes)]
    inputs = PrefillInputs(gen, rng, layout, dtype, lengths_q, lengths_k, causal, variant=variant)
    return PagedInputs(inputs, page_size, rng)


@pytest.mark.parametrize("page_size", [5, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_prefill(dtype, page_size):
    """Cached prefixes (more keys than queries) read from pages, causal and not, without and with a window (its
    earlier pages' entries -1 or a page of NaN), with a cap and sinks; keys starting at non-zero cu_seqlens_k."""
    gen, rng, replay = case_generator(f"cuda prefill paged {dtype} page_size={page_size}", 0)
    layout = random_layout(rng, max_kv_heads=3, max_group=3)
    heads = layout.num_kv_heads * layout.group
    lengths_q, prefixes = [33, 0, 1, 100, 7, 64], [300, 20, 64, 3, 0, 129]
    for causal, variant in ((True, {}), (False, {}), (True, dict(window_left=7)), (True, dict(window_left=40)),
                            (False, dict(window_left=70)),
                            (True, dict(window_left=33, softcap=5.0, sinks=torch.randn(heads, generator=gen)))):
        paged = _paged_problem(gen, rng, layout, dtype, causal, lengths_q, prefixes, page_size, variant)
        what = f"cuda prefill paged {paged.describe()} {replay}"
        paged.check(paged.run_cuda(), what)


@pytest.mark.parametrize("case", range(max(1, CASES // 2)))
def test_paged_prefill_random(case):
    """Random layouts, dtypes, page sizes (1, odd, powers of two, above a key tile), prefixes and variants; the plan
    made inside the op or given."""
    gen, rng, replay = case_generator("cuda prefill paged random", case)
    layout = random_layout(rng)
    dtype = rng.choice(DTYPES)
    batch = rng.randint(1, 5)
    lengths_q = random_lengths(rng, batch, choices=(0, 1, 2, 7, 16, 33, 64, 100, 257))
    prefixes = [rng.choice([0, 0, 1, 9, 63, 64, 65, 300, 1000]) for _ in range(batch)]
    heads = layout.num_kv_heads * layout.group
    while heads * sum(s * (s + p) for s, p in zip(lengths_q, prefixes)) > REFERENCE_BUDGET:
        b = max(range(batch), key=lambda i: lengths_q[i] * (lengths_q[i] + prefixes[i]))
        lengths_q[b], prefixes[b] = (lengths_q[b] + 1) // 3, (prefixes[b] + 1) // 3
    page_size = rng.choice([1, 3, 5, 16, 32, 100])
    variant = _random_variant(rng, gen, layout, max(s + p for s, p in zip(lengths_q, prefixes)))
    paged = _paged_problem(gen, rng, layout, dtype, rng.random() < 0.7, lengths_q, prefixes, page_size, variant)
    plan = paged.inputs.plan_cuda(rng.choice([1, 5, NUM_SMS]), rng.choice([16, 64, 128])) if rng.random() < 0.4 \
        else None
    what = f"cuda prefill paged {paged.describe()} {replay}"
    paged.check(paged.run_cuda(plan), what, plan)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_extreme_widths(dtype):
    """8- and 256-wide heads side by side (key tiles of 64 and 32 keys, qk widths padded to 16) read from pages of 5
    and 16 keys, with windows cutting key tiles and pages."""
    gen, rng, replay = case_generator(f"cuda prefill paged widths {dtype}", 0)
    layout = Layout([8, 256, 24], [256, 8, 16], rng.choice([1, 2]))
    for page_size in (5, 16):
        for causal, variant in ((True, {}), (True, dict(window_left=37)), (False, dict(window_left=100))):
            paged = _paged_problem(gen, rng, layout, dtype, causal, [257, 1, 90], [40, 500, 0], page_size, variant)
            paged.check(paged.run_cuda(), f"cuda prefill paged {paged.describe()} {replay}")


# ------------------------------------------------------------------------------------------------------- bad input


def _raises(op: str, argument: str):
    return pytest.raises(RuntimeError, match=rf"^fdc::{op}: (.|\n)*{argument}")


def _small_problem(causal: bool = True) -> PrefillInputs:
    gen, rng, _ = case_generator("cuda prefill bad input", 0)
    return PrefillInputs(gen, rng, Layout([8, 16], [16, 8], 2), torch.float16, [3, 5], [3, 6], causal)


def _attention(inputs: PrefillInputs, plan, **changes):
    lo = inputs.layout
    args = dict(q=inputs.q_dev, k=inputs.k_dev, v=inputs.v_dev, cu_seqlens_q=inputs.cu_q_dev,
                cu_seqlens_k=inputs.cu_k_dev, qk_offsets=lo.qk_offsets, v_offsets=lo.v_offsets, group=lo.group,
                scale=inputs.scale, causal=inputs.causal, plan=plan)
    args.update(changes)
    return ops.prefill_attention(**args)


def test_plan_of_the_wrong_kind():
    """A decode plan (on the GPU) is not a prefill plan."""
    inputs = _small_problem()
    lo = inputs.layout
    decode_plan = ops.decode_plan(torch.tensor([3, 6], dtype=torch.int32), lo.qk_offsets, lo.v_offsets, lo.group,
                                  num_workers=3).to(DEVICE)
    with _raises("prefill_attention", "plan is not a prefill plan"):
        _attention(inputs, decode_plan)
    garbage = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    with _raises("prefill_attention", "plan is not a prefill plan"):
        _attention(inputs, garbage)


def test_cpu_plan_with_cuda_tensors():
    inputs = _small_problem()
    with _raises("prefill_attention", "plan must be (on the device of|a CUDA tensor)"):
        _attention(inputs, inputs.plan_cpu(4))


def test_plan_for_other_inputs():
    """Plans whose header disagrees with the inputs (causal flag, batch, group), or of the wrong dtype."""
    inputs = _small_problem(causal=True)
    with _raises("prefill_attention", "plan was made with causal=True but causal=False"):
        _attention(inputs, inputs.plan_cuda(4), causal=False)
    lo = inputs.layout
    other_batch = ops.prefill_plan(torch.tensor([0, 3, 5, 8], dtype=torch.int32, device=DEVICE),
                                   torch.tensor([0, 3, 5, 9], dtype=torch.int32, device=DEVICE), lo.qk_offsets,
                                   lo.v_offsets, lo.group, True, 4)
    with _raises("prefill_attention", "plan was made for B=3"):
        _attention(inputs, other_batch)
    with _raises("prefill_attention", "plan must be int32"):
        _attention(inputs, inputs.plan_cuda(4).to(torch.int64))


def test_bad_tensors_on_cuda():
    inputs = _small_problem()
    with _raises("prefill_attention", "k must have the dtype of q"):
        _attention(inputs, None, k=inputs.k_dev.to(torch.bfloat16))
    with _raises("prefill_attention", "v must have"):
        _attention(inputs, None, v=inputs.v_dev[:, :8])
    with _raises("prefill_attention", "cu_seqlens_q must be int32"):
        _attention(inputs, None, cu_seqlens_q=inputs.cu_q_dev.to(torch.int64))
    with _raises("prefill_attention", "scale must be a positive finite number"):
        _attention(inputs, None, scale=math.inf)
    lo = inputs.layout
    with _raises("prefill_plan", "row_block"):
        ops.prefill_plan(inputs.cu_q_dev, inputs.cu_k_dev, lo.qk_offsets, lo.v_offsets, lo.group, True, 4, 24)


def test_paged_bad_input_on_cuda():
    """A block table on the CPU for pages on the GPU, an entry a query needs that is not a page, and packed k with a
    block table."""
    inputs = _small_problem()
    pages = torch.randn(3, inputs.layout.qk_width, 4, dtype=torch.float16, device=DEVICE)
    v_pages = torch.randn(3, inputs.layout.v_width, 4, dtype=torch.float16, device=DEVICE)
    table = torch.tensor([[0, -1], [1, 2]], dtype=torch.int32)
    with _raises("prefill_attention", "block_table must be on the device of k"):
        _attention(inputs, None, k=pages, v=v_pages, block_table=table)
    with _raises("prefill_attention", r"block_table\[0\]\[0\] = 3 is not a page index"):
        _attention(inputs, None, k=pages, v=v_pages, block_table=torch.tensor([[3, -1], [1, 2]], dtype=torch.int32,
                                                                              device=DEVICE))
    with _raises("prefill_attention", "k must have 3 dimensions"):
        _attention(inputs, None, block_table=table.to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", SOFT_CAPS)
@pytest.mark.parametrize("op", ("prefill", "prefill_paged"))
def test_soft_cap_error_stays_torch_s_at_every_cap_cuda(op, softcap, dtype):
    """fdc::soft_cap on the GPU as on the CPU: within FlashAttention's rule at caps from 1 to 5000, scores from near
    zero on (test_attention_variants.check_soft_cap)."""
    for case in range(8):
        check_soft_cap(op, softcap, dtype, case, DEVICE)
