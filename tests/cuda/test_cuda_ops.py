"""The CUDA kernels of rotate_compress, rope_rotate_compress and append_kv against the float64 reference and
against the CPU kernels, on freshly drawn random configurations each run (conftest's seeds and tolerance rule);
append_kv into NaN-poisoned caches, where every slot not written must stay bit-identical; device-side handling of
bad lengths and page indices; CUDA-graph capture (opcheck on CUDA inputs: tests/ops/test_opcheck.py).

The whole module is skipped without a GPU, or when fdc_ops was built without its CUDA kernels."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import (
    DTYPES,
    assert_close_to_reference,
    capture_graph,
    case_generator,
    offsets,
    randn,
    random_block_table,
    random_layout,
    random_lengths,
    random_rope_inputs,
    rope_tables,
    skip_without_cuda_kernels,
    to_pages,
)
from fdc_ops import ops, reference

skip_without_cuda_kernels("rotate_compress", "rope_rotate_compress", "append_kv")

CASES = int(os.environ.get("FDC_CUDA_CASES", 60))  # per op and run, as on the CPU; fewer under compute-sanitizer
CUDA = "cuda"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so NaN payloads compare equal only when untouched."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_matches_cpu(actual: torch.Tensor, cpu: torch.Tensor, what: str):
    """CUDA and CPU kernels sum in different orders: in float16/bfloat16 their float32 sums may round to neighbouring
    values (allowed: 2 units of the dtype's epsilon times the output's magnitude); in float32 they differ by the
    rounding of dot products of at most 261 terms (allowed: 3e-5 of the magnitude, some 250 float32 epsilons)."""
    assert actual.device.type == CUDA and actual.dtype == cpu.dtype and actual.shape == cpu.shape, what
    if cpu.numel() == 0:
        return
    scale = max(1.0, float(cpu.double().abs().max()))
    tolerance = (3e-5 if cpu.dtype == torch.float32 else 2 * torch.finfo(cpu.dtype).eps) * scale
    error = float((actual.cpu().double() - cpu.double()).abs().max())
    assert error <= tolerance, f"{what}: CUDA vs CPU max difference {error:.3g} > {tolerance:.3g}"


@pytest.mark.parametrize("case", range(CASES))
def test_rotate_compress_cuda(case):
    gen, rng, replay = case_generator("rotate_compress cuda", case)
    layout = random_layout(rng)
    dtype = rng.choice(DTYPES)
    group = rng.choice([1, layout.group])
    x_dev, _, _, rot_dev = random_rope_inputs(rng, gen, layout, dtype, group, CUDA)  # x is post-RoPE here
    out = ops.rotate_compress(x_dev, rot_dev, layout.qk_offsets, group)
    x, rot = x_dev.cpu(), rot_dev.cpu()
    expected = reference.rotate_compress_ref(x, rot, layout.qk_offsets, group)
    torch_lowp = reference.rotate_compress_ref(x, rot, layout.qk_offsets, group, compute_dtype=dtype)
    assert out.dtype == dtype and out.is_contiguous()
    assert_close_to_reference(out.cpu(), expected, torch_lowp, f"rotate_compress cuda {replay}")
    _assert_matches_cpu(out, ops.rotate_compress(x, rot, layout.qk_offsets, group), f"rotate_compress {replay}")


@pytest.mark.parametrize("case", range(CASES))
def test_rope_rotate_compress_cuda(case):
    gen, rng, replay = case_generator("rope_rotate_compress cuda", case)
    layout = random_layout(rng)
    dtype = rng.choice(DTYPES)
    group = rng.choice([1, layout.group])
    on_device = random_rope_inputs(rng, gen, layout, dtype, group, CUDA)  # x, cos, sin, rot
    out = ops.rope_rotate_compress(*on_device, layout.qk_offsets, group)
    x, cos, sin, rot = (t.cpu() for t in on_device)
    args = (x, cos, sin, rot, layout.qk_offsets, group)
    what = f"rope_rotate_compress cuda rotary_dim={cos.shape[1]} D={x.shape[2]} {replay}"
    assert_close_to_reference(out.cpu(), reference.rope_rotate_compress_ref(*args),
                              reference.rope_rotate_compress_ref(*args, compute_dtype=dtype), what)
    _assert_matches_cpu(out, ops.rope_rotate_compress(*args), what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_compress_cuda_many_heads_and_tokens(dtype):
    """More KV heads than one launch takes (128), several row tiles, heads of every width up to 256."""
    gen = torch.Generator().manual_seed(1)
    qk_dims = [8 * (1 + j % 32) for j in range(133)]
    qk_offsets, group, tokens = offsets(qk_dims), 2, 67
    x = randn((tokens, len(qk_dims) * group, 256), dtype, gen)
    rot = randn((len(qk_dims), 256, 256), dtype, gen) / 16
    cos, sin = rope_tables(torch.arange(tokens) * 5, 192, dtype)
    out = ops.rotate_compress(x.to(CUDA), rot.to(CUDA), qk_offsets, group)
    assert_close_to_reference(out.cpu(), reference.rotate_compress_ref(x, rot, qk_offsets, group),
                              reference.rotate_compress_ref(x, rot, qk_offsets, group, compute_dtype=dtype),
                              "rotate_compress 133 heads")
    fused = ops.rope_rotate_compress(x.to(CUDA), cos.to(CUDA), sin.to(CUDA), rot.to(CUDA), qk_offsets, group)
    args = (x, cos, sin, rot, qk_offsets, group)
    assert_close_to_reference(fused.cpu(), reference.rope_rotate_compress_ref(*args),
                              reference.rope_rotate_compress_ref(*args, compute_dtype=dtype),
                              "rope_rotate_compress 133 heads")


def _append_inputs(rng, gen, layout, dtype, paged):
    """NaN-poisoned CPU caches (contiguous or paged), new rows, boundaries and lengths for one random case."""
    batch = rng.randint(1, 5)
    start = random_lengths(rng, batch, choices=(0, 1, 5, 20, 63))
    new = random_lengths(rng, batch, choices=(0, 1, 3, 17, 40))
    capacity = max(s + n for s, n in zip(start, new)) + rng.randint(0, 4)
    k_cache = torch.full((batch, capacity, layout.qk_width), float("nan"), dtype=dtype)
    v_cache = torch.full((batch, capacity, layout.v_width), float("nan"), dtype=dtype)
    block_table = None
    if paged:
        page_size = rng.choice([1, 4, 16, 33])
        block_table, num_pages = random_block_table([capacity] * batch, capacity, page_size, rng)
        k_cache = to_pages(k_cache, [capacity] * batch, block_table, num_pages, page_size)
        v_cache = to_pages(v_cache, [capacity] * batch, block_table, num_pages, page_size)
    cu = offsets(new)
    extra = rng.choice([0, 0, 2])  # rows after the last request are not written
    k = randn((int(cu[-1]) + extra, layout.qk_width), dtype, gen)
    v = randn((int(cu[-1]) + extra, layout.v_width), dtype, gen)
    return k_cache, v_cache, k, v, cu, torch.tensor(start, dtype=torch.int32), block_table


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("case", range(CASES // 2))
def test_append_kv_cuda(case, paged):
    """CUDA append_kv writes exactly the reference's rows, bit for bit, and the CPU kernel's result; every other slot
    keeps its NaN bits; cache_seqlens is not changed."""
    gen, rng, replay = case_generator(f"append_kv cuda paged={paged}", case)
    layout = random_layout(rng, max_kv_heads=6, max_group=1)
    dtype = rng.choice(DTYPES)
    k_cache, v_cache, k, v, cu, seqlens, block_table = _append_inputs(rng, gen, layout, dtype, paged)
    expected_k, expected_v = reference.append_kv_ref(k_cache, v_cache, k, v, cu, seqlens, block_table)
    cpu_k, cpu_v = k_cache.clone(), v_cache.clone()
    ops.append_kv(cpu_k, cpu_v, k, v, cu, seqlens, layout.qk_offsets, layout.v_offsets, block_table)

    dev_k, dev_v, dev_seqlens = k_cache.to(CUDA), v_cache.to(CUDA), seqlens.to(CUDA)
    new_k = k.to(CUDA)
    if rng.random() < 0.4:  # rows inside a wider buffer, 16-byte aligned or not (pad 8 or 3 elements)
        pad = rng.choice([3, 8])
        new_k = torch.cat([new_k, torch.zeros(k.shape[0], pad, dtype=dtype, device=CUDA)], dim=1)[:, :k.shape[1]]
    ops.append_kv(dev_k, dev_v, new_k, v.to(CUDA), cu.to(CUDA), dev_seqlens, layout.qk_offsets,
                  layout.v_offsets, None if block_table is None else block_table.to(CUDA))
    for name, actual, expected, cpu in (("k", dev_k, expected_k, cpu_k), ("v", dev_v, expected_v, cpu_v)):
        assert torch.equal(_bits(actual.cpu()), _bits(expected)), f"append_kv cuda {name} vs reference {replay}"
        assert torch.equal(_bits(actual.cpu()), _bits(cpu)), f"append_kv cuda {name} vs CPU {replay}"
    assert dev_seqlens.cpu().tolist() == seqlens.tolist(), "append_kv must not advance cache_seqlens"


def test_append_kv_cuda_skips_what_it_cannot_place():
    """Bad device-side values are not validated on the host (no synchronisation): the kernel writes nothing for a
    request that would overflow or has a negative length, skips rows whose page index is out of range, writes the
    valid requests, and raises nothing."""
    qk_offsets, v_offsets = offsets([8, 16]), offsets([8, 8])
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(12, 24, generator=gen)
    v = torch.randn(12, 16, generator=gen)
    cu = torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32)

    k_cache = torch.full((4, 8, 24), float("nan"))
    v_cache = torch.full((4, 8, 16), float("nan"))
    seqlens = torch.tensor([0, 6, -1, 5], dtype=torch.int32)  # request 1 would grow to 9 > 8, request 2 is negative
    dev_k, dev_v = k_cache.to(CUDA), v_cache.to(CUDA)
    ops.append_kv(dev_k, dev_v, k.to(CUDA), v.to(CUDA), cu.to(CUDA), seqlens.to(CUDA), qk_offsets, v_offsets)
    keep = [0, 3]
    expected_k, expected_v = reference.append_kv_ref(k_cache[keep], v_cache[keep], torch.cat([k[0:3], k[9:12]]),
                                                     torch.cat([v[0:3], v[9:12]]), offsets([3, 3]), seqlens[keep])
    torch.cuda.synchronize()
    assert torch.equal(_bits(dev_k.cpu()[keep]), _bits(expected_k))
    assert torch.equal(_bits(dev_v.cpu()[keep]), _bits(expected_v))
    assert torch.isnan(dev_k.cpu()[[1, 2]]).all() and torch.isnan(dev_v.cpu()[[1, 2]]).all()

    pages_k = torch.full((5, 24, 2), float("nan"))
    pages_v = torch.full((5, 16, 2), float("nan"))
    # Page size 2. Request 0: positions 0..2 on pages 4, 4, 1. Request 1: positions 2..4 on pages 0, 0 and 7 (out of
    # range: its last row is skipped). Request 2: positions 1..3 on pages -3 (out of range: its first row is
    # skipped), 2, 2. Request 3: no rows. Rows 9..11 of k and v are past cu_seqlens[B] = 9.
    table = torch.tensor([[4, 1, -1], [3, 0, 7], [-3, 2, -1], [-1, -1, -1]], dtype=torch.int32)
    seqlens = torch.tensor([0, 2, 1, 0], dtype=torch.int32)
    cu = torch.tensor([0, 3, 6, 9, 9], dtype=torch.int32)
    dev_k, dev_v = pages_k.to(CUDA), pages_v.to(CUDA)
    ops.append_kv(dev_k, dev_v, k.to(CUDA), v.to(CUDA), cu.to(CUDA), seqlens.to(CUDA), qk_offsets, v_offsets,
                  table.to(CUDA))
    expected_k, expected_v = pages_k.clone(), pages_v.clone()
    for row, page, slot in ((0, 4, 0), (1, 4, 1), (2, 1, 0), (3, 0, 0), (4, 0, 1), (7, 2, 0), (8, 2, 1)):
        expected_k[page, :, slot] = k[row]
        expected_v[page, :, slot] = v[row]
    assert torch.equal(_bits(dev_k.cpu()), _bits(expected_k))
    assert torch.equal(_bits(dev_v.cpu()), _bits(expected_v))


def test_append_kv_cuda_metadata_must_be_on_the_cache_device():
    k_cache, v_cache = torch.zeros(2, 4, 8, device=CUDA), torch.zeros(2, 4, 8, device=CUDA)
    rows = torch.zeros(2, 8, device=CUDA)
    cu, seqlens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"^fdc::append_kv: cu_seqlens must be on the device of k_cache"):
        ops.append_kv(k_cache, v_cache, rows, rows, cu, seqlens.to(CUDA), offsets([8]), offsets([8]))
    with pytest.raises(RuntimeError, match=r"^fdc::append_kv: cache_seqlens must be on the device of k_cache"):
        ops.append_kv(k_cache, v_cache, rows, rows, cu.to(CUDA), seqlens, offsets([8]), offsets([8]))


def test_decode_step_captures_in_a_cuda_graph():
    """rope_rotate_compress and append_kv read no device value on the host, so a decode step captures into a CUDA
    graph; replays with new lengths and new rows write where the new lengths say."""
    qk_offsets, v_offsets, group = offsets([16, 8]), offsets([8, 24]), 1
    gen = torch.Generator().manual_seed(4)
    batch, capacity = 3, 6
    k_cache = torch.full((batch, capacity, 24), float("nan"), device=CUDA)
    v_cache = torch.full((batch, capacity, 32), float("nan"), device=CUDA)
    x = torch.randn(batch, 2, 32, generator=gen).to(CUDA)
    cos, sin = (t.to(CUDA) for t in rope_tables(torch.tensor([1, 2, 3]), 32, torch.float32))
    rot = torch.randn(2, 32, 16, generator=gen).to(CUDA)
    v = torch.randn(batch, 32, generator=gen).to(CUDA)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=CUDA)
    seqlens = torch.zeros(batch, dtype=torch.int32, device=CUDA)

    def step():
        keys = ops.rope_rotate_compress(x, cos, sin, rot, qk_offsets, group)
        ops.append_kv(k_cache, v_cache, keys, v, cu, seqlens, qk_offsets, v_offsets)
        return keys

    graph, keys = capture_graph(step)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    for lengths in ([0, 1, 2], [5, 3, 0]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        x.copy_(torch.randn(batch, 2, 32, generator=gen))
        graph.replay()
        expected = ops.rope_rotate_compress(x.cpu(), cos.cpu(), sin.cpu(), rot.cpu(), qk_offsets, group)
        torch.testing.assert_close(keys.cpu(), expected, rtol=1e-5, atol=1e-5)
        for b, position in enumerate(lengths):
            torch.testing.assert_close(k_cache[b, position].cpu(), keys[b].cpu(), rtol=0, atol=0)
            torch.testing.assert_close(v_cache[b, position].cpu(), v[b].cpu(), rtol=0, atol=0)
    assert int(torch.isnan(k_cache).any(dim=2).logical_not().sum()) == 2 * batch
