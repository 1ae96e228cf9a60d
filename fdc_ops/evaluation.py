"""Accuracy of a compressed model, measured through the fdc operators: attention runs on the compressed Q/K/V
(rotate_compress, packed values, prefill_attention) at the allocated widths of every head.

This path evaluates the calibration (perplexity on unpadded sequences, no KV cache): each head's c-wide output is
mapped back through ``B_V = V_k^T`` before the model's own output projection, which equals the folded ``W_O'`` of
the serving modules (fdc_ops.calibration.fold_output_projection) up to the order of the sums.
"""

from __future__ import annotations

import contextlib
import math

import torch

from . import models, ops
from .calibration import FDCArtifact, RankAllocation


@contextlib.contextmanager
def compressed_attention(model, artifact: FDCArtifact, allocation: RankAllocation,
                         qk_rotation: torch.Tensor | None = None, v_basis: torch.Tensor | None = None):
    """While open, every attention layer of ``model`` runs compressed: queries and keys rotated by the artifact's R
    and truncated to ``allocation.qk_dims``, values projected on the first ``allocation.v_dims`` columns of its V basis.
    ``qk_rotation`` / ``v_basis`` (L, H_kv, D, D) replace the artifact's (to compare calibrations at equal dims).
    Inputs must be unpadded full sequences (no attention mask), without a KV cache."""
    shape = models.attention_shape(model)
    rotations = (artifact.qk_rotation if qk_rotation is None else qk_rotation)
    bases = (artifact.v_basis if v_basis is None else v_basis)
    expected = (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.head_dim)
    for name, tensor in (("qk_rotation", rotations), ("v_basis", bases)):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"fdc_ops: {name} must have shape {expected}, got {tuple(tensor.shape)}")
    if tuple(allocation.qk_dims.shape) != expected[:2] or tuple(allocation.v_dims.shape) != expected[:2]:
        raise ValueError(f"fdc_ops: the allocation's dims must have shape {expected[:2]}")
    offsets = [allocation.offsets(layer) for layer in range(shape.num_layers)]

    def attend(module, query, key, value, attention_mask, original, **kwargs):
        layer = module.layer_idx
        B, H, S, D = query.shape
        Hkv, G = key.shape[1], H // key.shape[1]
        if key.shape[2] != S:
            raise ValueError("fdc_ops.evaluation: compressed_attention takes full sequences without a KV cache")
        window = kwargs.get("sliding_window")
        if window is not None and window < S:
            raise NotImplementedError("fdc_ops.evaluation: sliding-window attention is not supported")
        qk_offsets, v_offsets = offsets[layer]
        qk_dims, v_dims = allocation.qk_dims[layer].tolist(), allocation.v_dims[layer].tolist()
        rotation = rotations[layer, :, :, : max(qk_dims)].to(query.dtype).contiguous()  # (H_kv, D, max_r)
        basis = bases[layer].to(query.dtype)  # (H_kv, D, D)
        tokens = B * S
        q = ops.rotate_compress(query.transpose(1, 2).reshape(tokens, H, D), rotation, qk_offsets, G)
        k = ops.rotate_compress(key.transpose(1, 2).reshape(tokens, Hkv, D), rotation, qk_offsets, 1)
        v = torch.cat([value[:, j].reshape(tokens, D) @ basis[j, :, : v_dims[j]] for j in range(Hkv)], dim=1)
        cu_seqlens = torch.arange(0, B + 1, dtype=torch.int32, device=query.device) * S
        scale = kwargs.get("scaling") or module.scaling
        out = ops.prefill_attention(q, k, v, cu_seqlens, cu_seqlens, qk_offsets, v_offsets, G, scale, True)
        heads = []
        for h in range(H):
            j, i = divmod(h, G)
            start = G * int(v_offsets[j]) + i * v_dims[j]
            heads.append(out[:, start: start + v_dims[j]] @ basis[j, :, : v_dims[j]].T)
        return torch.stack(heads, dim=1).view(B, S, H, D), None

    with models.override_attention(model, attend):
        yield


def perplexity(model, token_ids: torch.Tensor, seq_len: int = 512, batch_size: int = 4, progress: bool = True,
               description: str = "perplexity") -> float:
    """exp(mean next-token negative log-likelihood) over consecutive ``seq_len`` windows of the 1-D token stream
    (the first token of each window is context only)."""
    from tqdm.auto import tqdm

    windows = token_ids.numel() // seq_len
    if token_ids.dim() != 1 or windows == 0:
        raise ValueError(f"fdc_ops: perplexity needs a 1-D token stream of at least {seq_len} tokens")
    sequences = token_ids[: windows * seq_len].view(windows, seq_len)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.inference_mode():
        for batch in tqdm(sequences.split(batch_size), desc=description, unit="batch", disable=not progress):
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total += nll.item()
            count += batch[:, 1:].numel()
    return math.exp(total / count)
