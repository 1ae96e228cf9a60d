"""The operator-level demo: one attention layer of SmolLM2-135M's shape (9 query / 3 KV heads, head_dim 64) taken
through the FDC online path with ``torch.ops.fdc``, on synthetic post-RoPE activations whose heads have decaying
spectra of different steepness (as real heads do: bench/results/calibration/README.md).

Steps: rotations from the SVD of each KV head's stacked queries and keys (the offline calibration in miniature),
per-head ranks from one singular-value removal rate, then rotate_compress -> prefill_attention -> append_kv ->
decode_attention for a few tokens. Each op is checked against the float64 reference and timed; the table also shows
the cache it saves and how well the decode plan balances its workers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import ops, reference
from ..plans import DecodePlan

HEAD_DIM = 64
NUM_KV_HEADS = 3
GROUP = 3
DIM_MULTIPLE = 8


@dataclass
class Row:
    step: str
    shape: str
    millis: float
    max_error: float


def _spectra(generator: torch.Generator) -> torch.Tensor:
    """(H_kv, D) singular values: each KV head decays at its own rate, so ranks differ across heads."""
    rates = torch.tensor([0.04, 0.09, 0.2])[:NUM_KV_HEADS]
    return torch.exp(-rates[:, None] * torch.arange(HEAD_DIM, dtype=torch.float32)[None, :])


def _activations(tokens: int, spectra: torch.Tensor, bases: torch.Tensor, heads_per_kv: int,
                 generator: torch.Generator) -> torch.Tensor:
    """(tokens, H_kv * heads_per_kv, D) rows whose per-KV-head covariance has the given spectra and bases."""
    z = torch.randn(tokens, NUM_KV_HEADS, heads_per_kv, HEAD_DIM, generator=generator)
    x = torch.einsum("tjgd,jd,jed->tjge", z, spectra, bases)
    return x.reshape(tokens, NUM_KV_HEADS * heads_per_kv, HEAD_DIM).contiguous()


def _ranks(singular_values: torch.Tensor, removal_rate: float) -> list[int]:
    """Per head, the smallest multiple of 8 that keeps all but at most `removal_rate` of the singular-value sum."""
    dims = []
    for s in singular_values:
        tail = torch.cumsum(s.flip(0), 0) / s.sum()  # tail[i]: share of the last i+1 values
        removable = int((tail <= removal_rate).sum())
        keep = HEAD_DIM - removable
        dims.append(min(HEAD_DIM, -(-keep // DIM_MULTIPLE) * DIM_MULTIPLE))
    return dims


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - start) * 1e3


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).abs().max()) if actual.numel() else 0.0


def run(removal_rate: float = 0.1, prompt_lengths: tuple[int, ...] = (301, 77, 1024, 1), decode_steps: int = 8,
        dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    spectra = _spectra(generator)
    bases = torch.linalg.qr(torch.randn(NUM_KV_HEADS, HEAD_DIM, HEAD_DIM, generator=generator))[0]
    batch = len(prompt_lengths)
    total = sum(prompt_lengths)
    q_full = _activations(total, spectra, bases, GROUP, generator)
    k_full = _activations(total, spectra, bases, 1, generator)

    # Offline: per KV head, R from the SVD of its keys stacked with its group's queries (docs/design.md section 1).
    stacked = torch.cat([k_full.view(total, NUM_KV_HEADS, 1, HEAD_DIM),
                         q_full.view(total, NUM_KV_HEADS, GROUP, HEAD_DIM)], dim=2)
    stacked = stacked.permute(1, 0, 2, 3).reshape(NUM_KV_HEADS, -1, HEAD_DIM).double()
    _, singular_values, vh = torch.linalg.svd(stacked, full_matrices=False)
    rotation = vh.transpose(1, 2).to(dtype)  # (H_kv, D, D), columns sorted by singular value
    qk_dims = _ranks(singular_values, removal_rate)
    v_dims = list(qk_dims)  # the V path (Palu-style factors) belongs to calibration; the demo mirrors the QK ranks
    qk_offsets, v_offsets = ops.prefix_sums(qk_dims), ops.prefix_sums(v_dims)
    scale = HEAD_DIM ** -0.5
    cu = ops.prefix_sums(list(prompt_lengths))
    rows: list[Row] = []

    q_c, ms = _timed(lambda: ops.rotate_compress(q_full.to(dtype), rotation, qk_offsets, GROUP))
    rows.append(Row("rotate_compress q", f"{tuple(q_full.shape)} -> {tuple(q_c.shape)}", ms,
                    _error(q_c, reference.rotate_compress_ref(q_full.to(dtype), rotation, qk_offsets, GROUP))))
    k_c, ms = _timed(lambda: ops.rotate_compress(k_full.to(dtype), rotation, qk_offsets, 1))
    rows.append(Row("rotate_compress k", f"{tuple(k_full.shape)} -> {tuple(k_c.shape)}", ms,
                    _error(k_c, reference.rotate_compress_ref(k_full.to(dtype), rotation, qk_offsets, 1))))
    v_c = torch.randn(total, int(v_offsets[-1]), generator=generator).to(dtype)

    out, ms = _timed(lambda: ops.prefill_attention(q_c, k_c, v_c, cu, cu, qk_offsets, v_offsets, GROUP, scale, True))
    expected = reference.prefill_attention_ref(q_c, k_c, v_c, cu, cu, qk_offsets, v_offsets, GROUP, scale, True)
    rows.append(Row("prefill_attention", f"{total} tokens, {batch} seqs, causal", ms, _error(out, expected)))

    capacity = max(prompt_lengths) + decode_steps
    k_cache = torch.full((batch, capacity, int(qk_offsets[-1])), float("nan"), dtype=dtype)
    v_cache = torch.full((batch, capacity, int(v_offsets[-1])), float("nan"), dtype=dtype)
    seqlens = torch.zeros(batch, dtype=torch.int32)
    _, ms = _timed(lambda: ops.append_kv(k_cache, v_cache, k_c, v_c, cu, seqlens, qk_offsets, v_offsets))
    rows.append(Row("append_kv (prompt)", f"{total} rows into {tuple(k_cache.shape)}", ms, 0.0))
    seqlens += torch.tensor(prompt_lengths, dtype=torch.int32)

    step_cu = torch.arange(batch + 1, dtype=torch.int32)
    decode_ms, decode_error = [], 0.0
    for _ in range(decode_steps):
        q_step = ops.rotate_compress(_activations(batch, spectra, bases, GROUP, generator).to(dtype), rotation,
                                     qk_offsets, GROUP)
        k_step = ops.rotate_compress(_activations(batch, spectra, bases, 1, generator).to(dtype), rotation,
                                     qk_offsets, 1)
        v_step = torch.randn(batch, int(v_offsets[-1]), generator=generator).to(dtype)
        ops.append_kv(k_cache, v_cache, k_step, v_step, step_cu, seqlens, qk_offsets, v_offsets)
        seqlens += 1
        plan = ops.decode_plan(seqlens, qk_offsets, v_offsets, GROUP)
        def decode(q_step=q_step, seqlens=seqlens, plan=plan):
            return ops.decode_attention(q_step, k_cache, v_cache, seqlens, qk_offsets, v_offsets, GROUP, scale, plan)

        out, ms = _timed(decode)
        decode_ms.append(ms)
        expected = reference.decode_attention_ref(q_step, k_cache, v_cache, seqlens, qk_offsets, v_offsets, GROUP,
                                                  scale)
        decode_error = max(decode_error, _error(out, expected))
    rows.append(Row(f"decode_attention x{decode_steps}", f"B={batch}, NaN in unused slots",
                    sorted(decode_ms)[len(decode_ms) // 2], decode_error))

    # How faithfully the compressed scores follow the full ones (q'k'^T ~ q_p k_p^T), per KV head.
    score_errors = []
    for j in range(NUM_KV_HEADS):
        keys = k_full[:, j].double()
        queries = q_full[:, j * GROUP].double()
        r = rotation[j, :, :qk_dims[j]].double()
        full_scores = queries @ keys.T
        score_errors.append(float((((queries @ r) @ (keys @ r).T) - full_scores).norm() / full_scores.norm()))

    print(f"fdc_ops demo: SmolLM2-135M attention shape (H={NUM_KV_HEADS * GROUP}, H_kv={NUM_KV_HEADS}, "
          f"D={HEAD_DIM}), {dtype}, removal rate {removal_rate}, {torch.get_num_threads()} threads")
    print(f"per-KV-head dims: qk {qk_dims}  v {v_dims}  (full {HEAD_DIM})")
    print("relative score error of q'k'^T vs q_p k_p^T per KV head: "
          + ", ".join(f"{e:.3f}" for e in score_errors))
    full_bytes = 2 * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    packed_bytes = (int(qk_offsets[-1]) + int(v_offsets[-1])) * dtype.itemsize
    print(f"KV cache per token per layer: {full_bytes} B full, {packed_bytes} B packed "
          f"({1 - packed_bytes / full_bytes:.1%} smaller)")
    print()
    header = f"{'step':<24} {'shape':<44} {'ms':>9} {'max |err| vs fp64':>18}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row.step:<24} {row.shape:<44} {row.millis:>9.2f} {row.max_error:>18.2e}")
    print()
    workers = 4
    plan = ops.decode_plan(seqlens, qk_offsets, v_offsets, GROUP, num_workers=workers)
    loads = DecodePlan.from_tensor(plan).worker_loads(qk_dims, v_dims)
    print(f"decode plan over {workers} workers: loads {loads}, makespan {max(loads)} vs ideal "
          f"{sum(loads) / workers:.0f} ({max(loads) / (sum(loads) / workers):.3f}x)")
