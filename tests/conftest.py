"""Shared helpers of the test suite: fresh random configurations each run, and the tolerance rule.

Seeds. Every run draws a new base seed (or takes FDC_TEST_SEED to replay one); it is printed in pytest's header and
each randomized test derives its own generator from it and its case index, so a failure names what replays it.

Tolerance: FlashAttention's rule. An op is compared with the float64 reference (fdc_ops/reference.py) on the same
inputs as the same computation in plain PyTorch at the input's dtype (the reference with compute_dtype=dtype: torch's
own matmul, tanh and softmax in float32, float16 or bfloat16). The op's largest error against float64 may be at most
twice PyTorch's, plus a floor at the output's magnitude (plus 0.3, as FlashAttention 3's fwd_atol `(out + 0.3 - 0.3 -
out)` takes it): the larger of three float32 ulps and one ulp of the output's dtype there.
- float32: FlashAttention 3's floor is two float32 roundings at that magnitude, for where PyTorch happens to be
  nearly exact; the op adds the same terms in other orders (blocked dot products, online-softmax rescaling, split-KV
  merges), and over about 5,000 random float32 cases of the CPU ops the largest excess over twice PyTorch's error was
  2.3 ulps (bench/results/ops/README.md, "Accuracy against torch"): three covers it.
- float16 and bfloat16: the op and PyTorch each round their own float32 result to the output dtype once, and two such
  roundings of nearly equal values land one ulp apart wherever the exact value sits near a rounding boundary, however
  accurate both are.
"""

from __future__ import annotations

import math
import os
import random
import sys
import zlib
from dataclasses import dataclass

import pytest
import torch

# The test layers: each test file lives in the folder of one (tests/meta/test_tiers.py checks), and its tests carry
# the layer's marker (pyproject.toml registers them), so `pytest -m "ops or hf"` selects by layer.
LAYERS = {"ops": "ops", "cuda": "cuda", "hf": "hf", "apps": "apps", "meta": "meta", "vllm_plugin": "vllm"}
TESTS = os.path.dirname(os.path.abspath(__file__))
# A test file may reuse the checks of another layer's (tests/cuda runs tests/ops' on the GPU), so the layers' folders
# are importable whichever pytest collects first; tests/vllm_plugin is a package, imported as one.
sys.path[:0] = [os.path.join(TESTS, folder) for folder in LAYERS if folder != "vllm_plugin"]

BASE_SEED = int(os.environ.get("FDC_TEST_SEED", random.randrange(2**31)))
# FDC_TEST_CASES: the share of each random sweep's cases a run draws (default 1: all of them). CI's leg on the newest
# torch release draws a quarter (scripts/test_torch_release.sh): the CPU kernels call no ATen math (only
# at::parallel_for), so their numerics do not change with torch's release, and what a release can break (the op
# registrations, opcheck, the references' torch ops, threading) shows in a few cases of each sweep.
CASE_SHARE = float(os.environ.get("FDC_TEST_CASES", "1"))
if not 0 < CASE_SHARE <= 1:
    raise ValueError(f"FDC_TEST_CASES must be a share in (0, 1], got {os.environ['FDC_TEST_CASES']!r}")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def pytest_report_header(config):
    share = "" if CASE_SHARE == 1 else f"; FDC_TEST_CASES={CASE_SHARE} of each random sweep's cases"
    return f"fdc_ops test seed: FDC_TEST_SEED={BASE_SEED}{share}"


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the real-model tier (tests marked slow: real checkpoints, minutes each)")


def pytest_collection_modifyitems(config, items):
    """Every test gets its layer's marker; tests marked slow (the real-model tier) run only with --slow (otherwise
    they are reported as skipped, saying how to run them)."""
    skip = None if config.getoption("--slow") else pytest.mark.skip(
        reason="real-model tier (marked slow): run with pytest --slow")
    for item in items:
        folder = os.path.relpath(str(item.path), TESTS).split(os.sep)[0]
        if folder not in LAYERS:
            raise pytest.UsageError(f"{item.path}: a test file outside the layer folders of tests/ "
                                    f"({', '.join(sorted(LAYERS))}); move it into the layer it tests")
        item.add_marker(LAYERS[folder])
        if skip is not None and "slow" in item.keywords:
            item.add_marker(skip)


def cases(count: int) -> range:
    """The cases of a random sweep of `count`: all of them, or FDC_TEST_CASES's share of them (at least one)."""
    return range(max(1, round(count * CASE_SHARE)))


def case_generator(test_name: str, case: int) -> tuple[torch.Generator, random.Random, str]:
    """A torch generator and a Python RNG for one randomized case, and the text that replays it."""
    seed = zlib.crc32(f"{BASE_SEED}:{test_name}:{case}".encode())
    return torch.Generator().manual_seed(seed), random.Random(seed), f"FDC_TEST_SEED={BASE_SEED} case {case}"


@dataclass
class Layout:
    """A random packed head layout: per-KV-head widths, their int32 prefix sums, and the group size."""

    qk_dims: list[int]
    v_dims: list[int]
    group: int

    @property
    def num_kv_heads(self) -> int:
        return len(self.qk_dims)

    @property
    def qk_offsets(self) -> torch.Tensor:
        return offsets(self.qk_dims)

    @property
    def v_offsets(self) -> torch.Tensor:
        return offsets(self.v_dims)

    @property
    def qk_width(self) -> int:
        return sum(self.qk_dims)

    @property
    def v_width(self) -> int:
        return sum(self.v_dims)


def offsets(sizes: list[int]) -> torch.Tensor:
    """int32 prefix sums [0, s0, s0 + s1, ...] (the library's, fdc_ops.ops.prefix_sums)."""
    from fdc_ops import ops

    return ops.prefix_sums(sizes)


def random_layout(rng: random.Random, max_kv_heads: int = 8, max_group: int = 8, max_dim: int = 256,
                  min_kv_heads: int = 1) -> Layout:
    """G in 1..max_group, H_kv in min_kv_heads..max_kv_heads, widths multiples of 8 up to max_dim (skewed towards
    small)."""
    num_kv_heads = rng.randint(min_kv_heads, max_kv_heads)

    def width() -> int:
        return 8 * (rng.randint(1, max_dim // 8) if rng.random() < 0.3 else rng.randint(1, min(12, max_dim // 8)))

    return Layout([width() for _ in range(num_kv_heads)], [width() for _ in range(num_kv_heads)],
                  rng.randint(1, max_group))


def random_lengths(rng: random.Random, batch: int, choices=(0, 1, 2, 7, 16, 33, 64, 100, 257)) -> list[int]:
    """Sequence lengths with empty and length-1 sequences among them."""
    return [rng.choice(choices) for _ in range(batch)]


def randn(shape, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Standard normal values drawn in float32 from generator (the same values whatever the dtype), then cast."""
    return torch.randn(shape, generator=generator).to(dtype)


def strided_rows(t: torch.Tensor, rng: random.Random, device: torch.device | str = "cpu") -> torch.Tensor:
    """The same values as t (2-D, CPU) on device in a non-contiguous tensor: rows padded inside a wider NaN buffer
    (as slices of a fused projection are), or, now and then, column-major storage. The layout is made on the device
    itself, since moving a view to another device would make it contiguous."""
    if rng.random() < 0.25:
        return t.T.contiguous().to(device).T
    pad = rng.randint(1, 24)
    wide = torch.full((t.shape[0], t.shape[1] + pad), float("nan"), dtype=t.dtype, device=device)
    start = rng.randint(0, pad)
    wide[:, start:start + t.shape[1]] = t.to(device)
    return wide[:, start:start + t.shape[1]]


def rope_tables(positions: torch.Tensor, rotary_dim: int, dtype: torch.dtype, base: float = 10000.0):
    """Hugging Face's cos/sin tables (T, rotary_dim) for these positions: frequencies repeated over both halves."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def random_rope_inputs(rng, gen, layout, dtype, group, device="cpu"):
    """Pre-RoPE x (T, G * H_kv, D) in one of several non-contiguous or misaligned layouts, cos/sin (T, rotary_dim)
    with full or partial rotary (Phi-3 style), and rot (H_kv, D, R_max). D is now and then not a multiple of 8, and
    rotary_dim / 2 not a multiple of 8 (neither allows 16-byte loads). x is laid out on `device` itself, since
    moving a view to another device would make it contiguous and aligned."""
    head_dim = max(max(layout.qk_dims), 8 * rng.randint(1, 32)) + rng.choice([0, 0, 0, 2, 5])
    full = head_dim - head_dim % 2  # rotary_dim is even
    rotary_dim = rng.choice([full, full, 2 * max(1, (3 * head_dim) // 8), 2 * rng.randint(1, head_dim // 2)])
    tokens = rng.choice([0, 1, 5, 37, 130])
    heads = layout.num_kv_heads * group
    kind = rng.choice(["transposed", "padded", "strided", "misaligned"])
    if kind == "transposed":  # (heads, T, D) storage, as after q.transpose(1, 2) of a (B, H, S, D) projection
        x = randn((heads, tokens, head_dim), dtype, gen).to(device).transpose(0, 1)
    elif kind == "padded":  # rows of a wider buffer: unit-stride rows, padded heads
        x = randn((tokens, heads, head_dim + 8 * rng.randint(1, 3)), dtype, gen).to(device)[:, :, :head_dim]
    elif kind == "strided":  # non-unit stride in the last dimension: the op must copy
        x = randn((tokens, heads, 2 * head_dim), dtype, gen).to(device)[:, :, ::2]
    else:  # contiguous, but one element past a 16-byte boundary
        x = randn((tokens * heads * head_dim + 1,), dtype, gen).to(device)[1:].view(tokens, heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    cos, sin = rope_tables(positions, rotary_dim, dtype)
    rot = randn((layout.num_kv_heads, head_dim, max(layout.qk_dims) + 8 * rng.randint(0, 2)), dtype, gen)
    return x, cos.to(device), sin.to(device), rot.to(device)


def nan_padded_caches(layout, lengths: list[int], capacity: int, dtype: torch.dtype, gen: torch.Generator):
    """Contiguous K and V caches (B, capacity, width) of the layout: each request's first lengths[b] rows random
    (keys then values, request by request), every other slot NaN, so that a kernel reading past a length poisons its
    output."""
    k_cache = torch.full((len(lengths), capacity, layout.qk_width), float("nan"), dtype=dtype)
    v_cache = torch.full((len(lengths), capacity, layout.v_width), float("nan"), dtype=dtype)
    for b, length in enumerate(lengths):
        k_cache[b, :length] = randn((length, layout.qk_width), dtype, gen)
        v_cache[b, :length] = randn((length, layout.v_width), dtype, gen)
    return k_cache, v_cache


def random_block_table(lengths: list[int], capacity: int, page_size: int, rng) -> tuple[torch.Tensor, int]:
    """A shuffled page assignment for requests of these lengths; unused entries are -1 (never read)."""
    pages_needed = [-(-length // page_size) for length in lengths]
    num_pages = sum(pages_needed) + rng.randint(0, 3)
    order = list(range(num_pages))
    rng.shuffle(order)
    table = torch.full((len(lengths), -(-capacity // page_size)), -1, dtype=torch.int32)
    taken = 0
    for b, count in enumerate(pages_needed):
        table[b, :count] = torch.tensor(order[taken:taken + count], dtype=torch.int32)
        taken += count
    return table, num_pages


def to_pages(cache: torch.Tensor, lengths: list[int], table: torch.Tensor, num_pages: int, page_size: int):
    """The contiguous cache (B, S, W) as NaN-poisoned dim-major pages (num_pages, W, page_size): each request's rows
    padded with NaN to whole pages, one scatter per request (GPU tests use sequences of tens of thousands of keys)."""
    width = cache.shape[2]
    paged = torch.full((num_pages, width, page_size), float("nan"), dtype=cache.dtype)
    for b, length in enumerate(lengths):
        count = -(-length // page_size)
        if count == 0:
            continue
        rows = torch.full((count * page_size, width), float("nan"), dtype=cache.dtype)
        rows[:length] = cache[b, :length]
        paged[table[b, :count].long()] = rows.view(count, page_size, width).transpose(1, 2)
    return paged


def _tolerance(expected64: torch.Tensor, torch_lowp: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """(allowed error against the float64 reference, torch's own error) for an output of dtype (see the module
    docstring)."""
    torch_error = float((torch_lowp.double() - expected64).abs().max())
    binade = 2.0 ** math.floor(math.log2(float(expected64.abs().max()) + 0.3))
    floor = binade * max(3 * torch.finfo(torch.float32).eps, torch.finfo(dtype).eps)
    return 2 * torch_error + floor, torch_error


def assert_close_to_reference(actual: torch.Tensor, expected64: torch.Tensor, torch_lowp: torch.Tensor, what: str):
    """Checks `actual` against the float64 reference within a small multiple of PyTorch's own error at actual's
    precision (see the module docstring)."""
    assert actual.shape == expected64.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected64.shape)}"
    if actual.numel() == 0:
        return
    assert not torch.isnan(actual).any(), f"{what}: NaN in output"
    tolerance, torch_error = _tolerance(expected64, torch_lowp, actual.dtype)
    error = float((actual.double() - expected64).abs().max())
    assert error <= tolerance, \
        f"{what}: max error {error:.3g} > tolerance {tolerance:.3g} (torch's own {torch_error:.3g})"


def assert_close_to_cpu(actual: torch.Tensor, cpu: torch.Tensor, expected64: torch.Tensor, torch_lowp: torch.Tensor,
                        what: str):
    """The GPU and CPU ops each lie within the tolerance of the float64 reference, so within twice that of each
    other."""
    if actual.numel() == 0:
        return
    tolerance = 2 * _tolerance(expected64, torch_lowp, actual.dtype)[0]
    error = float((actual.double() - cpu.double()).abs().max())
    assert error <= tolerance, f"{what}: cuda vs cpu op max difference {error:.3g} > {tolerance:.3g}"


def cuda_skip_reason(*op_names: str) -> str | None:
    """Why the named ops cannot run on a GPU here, or None when they can: no GPU visible, or fdc_ops._C without CUDA
    kernels for them (built on a machine without a visible GPU unless FDC_CUDA=1, without a CUDA toolkit, with
    FDC_CUDA=0, or for a CPU build of torch)."""
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible: these tests run {', '.join(op_names)} on a GPU"
    missing = [n for n in op_names if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fdc::{n}", "CUDA")]
    if missing:
        return (f"this build of fdc_ops._C has no CUDA kernels for {', '.join(missing)} (built without a visible "
                "GPU, a CUDA toolkit or a CUDA torch, or with FDC_CUDA=0): rebuild with scripts/setup.sh on this "
                "machine, or FDC_CUDA=1, to run these tests")
    return None


def skip_without_cuda_kernels(*op_names: str) -> None:
    """Skips the calling test module, saying why (cuda_skip_reason), unless the named ops can run on a GPU here."""
    reason = cuda_skip_reason(*op_names)
    if reason is not None:
        pytest.skip(reason, allow_module_level=True)


def capture_graph(step):
    """step() captured in a CUDA graph after one warm-up on a side stream, as torch.cuda.graphs asks. Returns
    (graph, what the captured step returned): replaying the graph refills that output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return graph, output


def sample_inputs(device: torch.device | str) -> dict[str, tuple[str, tuple]]:
    """Small inputs for torch.library.opcheck on device: {case name: (op name, args)}, every op in float32 and one
    or two low-precision dtypes, contiguous and paged caches, with and without an explicit plan, and the default
    worker count (the fakes must size a plan as the device's kernel does). Layouts stay int32 CPU tensors on every
    device (they travel in the kernels' launch parameters)."""
    qk_offsets, v_offsets, group = offsets([8, 16]), offsets([16, 8]), 2
    gen = torch.Generator().manual_seed(0)

    def sample(*shape, dtype=torch.float32):
        return randn(shape, dtype, gen).to(device)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    cu_q, cu_k = ints([0, 3, 5]), ints([0, 4, 9])
    seqlens, one_row_each = ints([3, 2]), ints([0, 1, 2])
    block_table = ints([[1, 0], [2, -1]])
    x, rot = sample(5, 4, 32), sample(2, 32, 16)
    cos, sin = (t.to(device) for t in rope_tables(torch.arange(5), 24, torch.float32))
    k_cache, v_cache = sample(2, 6, 24), sample(2, 6, 24)
    k_pages, v_pages = sample(3, 24, 4), sample(3, 24, 4)
    q_step, k_rows, v_rows = sample(2, group * 24), sample(2, 24), sample(2, 24)
    cases = {
        "rotate_compress": ("rotate_compress", (x, rot, qk_offsets, group)),
        "rotate_compress_float16": ("rotate_compress", (x.half(), rot.half(), qk_offsets, group)),
        "rope_rotate_compress": ("rope_rotate_compress", (x, cos, sin, rot, qk_offsets, group)),
        "rope_rotate_compress_bfloat16": ("rope_rotate_compress", (x.bfloat16(), cos.bfloat16(), sin.bfloat16(),
                                                                   rot.bfloat16(), qk_offsets, group)),
        "rope_rotate_compress_out_width": ("rope_rotate_compress", (x, cos, sin, rot, qk_offsets, group, group * 24)),
        "prefill_plan": ("prefill_plan", (cu_q, cu_k, qk_offsets, v_offsets, group, True, 3, 64)),
        "prefill_plan_default_workers": ("prefill_plan", (cu_q, cu_k, qk_offsets, v_offsets, group, False, None, 32)),
        "decode_plan": ("decode_plan", (seqlens, qk_offsets, v_offsets, group, 3)),
        "decode_plan_default_workers": ("decode_plan", (seqlens, qk_offsets, v_offsets, group, None)),
        "decode_plan_window": ("decode_plan", (seqlens, qk_offsets, v_offsets, group, 3, 1)),
        "decode_attention": ("decode_attention", (q_step, k_cache, v_cache, seqlens, qk_offsets, v_offsets, group,
                                                  0.25, None, None)),
        "decode_attention_paged": ("decode_attention", (q_step, k_pages, v_pages, seqlens, qk_offsets, v_offsets,
                                                        group, 0.25, None, block_table)),
        "decode_attention_plan": ("decode_attention", (q_step, k_cache, v_cache, seqlens, qk_offsets, v_offsets,
                                                       group, 0.25,
                                                       torch.ops.fdc.decode_plan(seqlens, qk_offsets, v_offsets,
                                                                                 group, 5), None)),
        # A window of 2 keys, soft-capping and sinks (one per query head: 2 KV heads x group 2), paged.
        "decode_attention_variants": ("decode_attention", (q_step, k_pages, v_pages, seqlens, qk_offsets, v_offsets,
                                                           group, 0.25, None, block_table, 1, 2.0, sample(4))),
        "append_kv": ("append_kv", (k_cache, v_cache, k_rows, v_rows, one_row_each, seqlens, qk_offsets, v_offsets,
                                    None)),
        "append_kv_paged": ("append_kv", (k_pages, v_pages, k_rows, v_rows, one_row_each, seqlens, qk_offsets,
                                          v_offsets, block_table)),
    }
    # Eviction's scores of the last 2 queries of each request (3 and 2 rows of q at cu_q) over 4 and 3 cached keys,
    # with Keyformer's noise (an SFC64 state, the same for both), and bf16 queries over float32 keys, capped.
    noise = torch.tensor([[7, 11, 13, 1]] * 2, dtype=torch.int64)
    window_q = sample(5, group * 24)
    cases["window_scores"] = ("window_scores", (window_q, cu_q, k_cache, ints([4, 3]), qk_offsets, group, 0.25, 2,
                                                0.0, noise, 1.5))
    cases["window_scores_bfloat16"] = ("window_scores", (window_q.bfloat16(), cu_q, k_cache, ints([4, 3]), qk_offsets,
                                                         group, 0.25, 2, 3.0, None))
    plan = torch.ops.fdc.prefill_plan(cu_q, cu_k, qk_offsets, v_offsets, group, False, 5, 16)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = sample(6, group * 24, dtype=dtype), sample(9, 24, dtype=dtype), sample(9, 24, dtype=dtype)
        name = str(dtype).removeprefix("torch.")
        cases[f"prefill_attention_{name}"] = ("prefill_attention", (q, k, v, cu_q, cu_k, qk_offsets, v_offsets,
                                                                    group, 0.25, True, None))
        cases[f"prefill_attention_plan_{name}"] = ("prefill_attention", (q, k, v, cu_q, cu_k, qk_offsets, v_offsets,
                                                                         group, 0.25, False, plan))
        cases[f"prefill_attention_variants_{name}"] = ("prefill_attention", (q, k, v, cu_q, cu_k, qk_offsets,
                                                                             v_offsets, group, 0.25, True, None, 2,
                                                                             3.0, sample(4)))
        # Keys and values read from pages (4 and 5 keys on 4-token pages), with a window and a sink.
        pages_k, pages_v = sample(3, 24, 4, dtype=dtype), sample(3, 24, 4, dtype=dtype)
        cases[f"prefill_attention_paged_{name}"] = ("prefill_attention", (q, pages_k, pages_v, cu_q, cu_k, qk_offsets,
                                                                          v_offsets, group, 0.25, True, None, 2, 0.0,
                                                                          sample(4), ints([[1, -1], [2, 0]])))
    return cases


SAMPLE_CASES = ("rotate_compress", "rotate_compress_float16", "rope_rotate_compress", "rope_rotate_compress_bfloat16",
                "rope_rotate_compress_out_width", "prefill_plan", "prefill_plan_default_workers", "decode_plan",
                "decode_plan_default_workers", "decode_plan_window", "decode_attention", "decode_attention_paged",
                "decode_attention_plan", "decode_attention_variants", "append_kv", "append_kv_paged",
                "prefill_attention_float32", "prefill_attention_plan_float32", "prefill_attention_variants_float32",
                "prefill_attention_paged_float32", "prefill_attention_bfloat16", "prefill_attention_plan_bfloat16",
                "prefill_attention_variants_bfloat16", "prefill_attention_paged_bfloat16", "window_scores",
                "window_scores_bfloat16")  # sample_inputs' keys, named
# before any device exists so that tests can be parametrised over them
