"""The artifact (docs/design.md sections 1 and 5): what calibration produces and every integration reads. Its
format (FDCArtifact: safetensors tensors and validated JSON metadata, written whole or not at all), the width
allocations it gives (RankAllocation: the paper's removal rate, a KV byte budget spent where the measured
sensitivities say it hurts least, Palu's Fisher rule), the folds of its V factors into the projections, its errors,
and the one resolution of a user's width settings that fdc_ops.hf.compress and the vLLM plugin share. Model-neutral:
it reads no model library (a model's identity is fdc_ops.identity's); the procedure that makes an artifact from a
Hugging Face model is fdc_ops.calibration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
import os
import re
import secrets
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from . import files, ops
from . import identity as model_identity
from .identity import AttentionShape

# ----------------------------------------------------------------------------------------------------------------
# Rank allocation


def kept_dims(singular_values: torch.Tensor, removal_rate: float, multiple: int = 8,
              power: float = 1.0) -> torch.Tensor:
    """Per head (last axis = the head's D singular values, descending), the dims kept at singular-value removal rate
    ``r`` (the paper's rule, docs/design.md section 1): drop the largest number of trailing dims whose values sum to
    at most ``r`` of the head's total, keep the rest (``j + 1`` dims where
    ``sum_{i>j} s_i <= r * sum_i s_i < sum_{i>=j} s_i``), then round up to a multiple of ``multiple`` (at most D, at
    least ``multiple``). ``power=2`` ranks by explained variance
    (``s^2``) instead. Returns int64 of the leading shape."""
    if not 0.0 <= removal_rate < 1.0:
        raise ValueError(f"fdc_ops: removal_rate must be in [0, 1), got {removal_rate}")
    if multiple <= 0:
        raise ValueError(f"fdc_ops: multiple must be positive, got {multiple}")
    D = singular_values.shape[-1]
    weights = singular_values.to(torch.float64).clamp_min(0) ** power
    total = weights.sum(-1, keepdim=True)
    # tail[..., k] = sum_{i >= k} w_i for k = 0..D (tail[..., D] = 0)
    tail = torch.cat([weights.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(total)], dim=-1)
    removable = tail <= removal_rate * total  # true from some k on: the dims k.. may all go
    keep = (D + 1) - removable.sum(-1)
    keep = torch.where(total.squeeze(-1) > 0, keep, torch.zeros_like(keep))
    rounded = (keep + multiple - 1) // multiple * multiple
    return rounded.clamp(min=min(multiple, D), max=D).to(torch.int64)


def knapsack_dims(damage: torch.Tensor, budget: int, multiple: int = 8) -> torch.Tensor:
    """The widths that minimise the summed damage under a width budget, exactly (multiple-choice knapsack by dynamic
    programming over the budget in quanta). damage: (N, D + 1), item n's cost of keeping w dims (w = 0..D, only
    multiples of ``multiple`` from ``multiple`` to D are offered; a width never costs more than a narrower one,
    which the estimate may violate by noise, so it is made non-increasing first). budget: the most total width.
    Returns (N,) int64."""
    N, D = damage.shape[0], damage.shape[1] - 1
    widths = torch.arange(multiple, D + 1, multiple)  # (K,)
    if widths.numel() == 0 or widths[-1] != D:
        raise ValueError(f"fdc_ops.calibration: the width quantum {multiple} must divide head_dim {D}")
    costs = damage.to(torch.float64).cummin(-1).values[:, widths]  # (N, K): best cost of keeping at most w dims
    steps = budget // multiple  # budget in quanta
    if steps < N:
        raise ValueError(f"fdc_ops.calibration: a budget of {budget} dims cannot give each of {N} heads {multiple}")
    K = widths.numel()
    best = torch.full((steps + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0
    choices = torch.zeros(N, steps + 1, dtype=torch.int64)
    for n in range(N):
        candidates = torch.full((K, steps + 1), float("inf"), dtype=torch.float64)
        for k in range(min(K, steps)):
            candidates[k, k + 1:] = best[: steps - k] + costs[n, k]  # choice k uses k + 1 quanta
        best, choices[n] = candidates.min(0)
    used = int(best.argmin())
    chosen = torch.empty(N, dtype=torch.int64)
    for n in range(N - 1, -1, -1):
        chosen[n] = choices[n, used]
        used -= int(chosen[n]) + 1
    return widths[chosen]


def fisher_dims(fisher: torch.Tensor, budget: int, head_dim: int, multiple: int = 8) -> torch.Tensor:
    """Palu's rank search, with its widths kept within the budget: each item (a layer's K or V projection rows of
    one KV head) gets a width proportional to its Fisher information, at most head_dim, what the cap frees going to
    the others in proportion again; widths are rounded down to the quantum (at least one quantum) and the quanta left
    go to the items that lost most in the rounding. fisher: (N,); budget >= N * multiple. Returns (N,) int64."""
    N = fisher.numel()
    weights = fisher.to(torch.float64).clamp_min(0) + 1e-30  # a zero score still gets its proportional nothing
    share = torch.zeros(N, dtype=torch.float64)
    capped = torch.zeros(N, dtype=torch.bool)
    for _ in range(N):  # water-filling: at most N items can reach the cap
        free = budget - head_dim * int(capped.sum())
        share = torch.where(capped, float(head_dim), free * weights / weights[~capped].sum())
        over = (share > head_dim) & ~capped
        if not over.any():
            break
        capped |= over
    dims = (share // multiple * multiple).clamp(min=multiple, max=head_dim).to(torch.int64)
    while int(dims.sum()) > budget:  # the one-quantum floor overspent: take back where it gave most beyond the share
        excess = torch.where(dims > multiple, dims - share, -float("inf"))
        dims[int(excess.argmax())] -= multiple
    left = (budget - int(dims.sum())) // multiple
    for n in torch.argsort(share - dims, descending=True).tolist():
        if left <= 0:
            break
        if dims[n] < head_dim:
            dims[n] += multiple
            left -= 1
    return dims


@dataclass
class RankAllocation:
    """Per layer and KV head, the widths kept for Q/K (``qk_dims``) and for V (``v_dims``)."""

    qk_dims: torch.Tensor  # (L, H_kv) int64
    v_dims: torch.Tensor  # (L, H_kv) int64
    head_dim: int
    method: str
    removal_rate: float | None = None
    notes: dict = field(default_factory=dict)

    @property
    def compression_rate(self) -> float:
        """Share of the KV cache removed: 1 - sum(qk_dims + v_dims) / (2 * L * H_kv * D)."""
        full = 2 * self.qk_dims.numel() * self.head_dim
        return 1.0 - float(self.qk_dims.sum() + self.v_dims.sum()) / full

    def offsets(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(qk_offsets, v_offsets) of one layer: (H_kv + 1,) int32 CPU prefix sums, as the ops take them."""
        return ops.prefix_sums(self.qk_dims[layer]), ops.prefix_sums(self.v_dims[layer])

    def kv_bytes_per_token(self, element_size: int) -> int:
        return int(self.qk_dims.sum() + self.v_dims.sum()) * element_size

    def uniform(self, multiple: int = 8) -> "RankAllocation":
        """The paper's /AC ablation: one width for every head's Q/K and V at (about) the same total, the mean width
        rounded to the nearest multiple of ``multiple``."""
        heads = 2 * self.qk_dims.numel()
        mean = float(self.qk_dims.sum() + self.v_dims.sum()) / heads
        width = int(min(self.head_dim, max(multiple, round(mean / multiple) * multiple)))
        dims = torch.full_like(self.qk_dims, width)
        return RankAllocation(dims, dims.clone(), self.head_dim, "uniform", self.removal_rate,
                              {"matched": self.method})


# ----------------------------------------------------------------------------------------------------------------
# Folding the V factors into the projections


def fold_value_projection(v_weight: torch.Tensor, v_encoder: torch.Tensor, v_dims: Sequence[int]) -> torch.Tensor:
    """A_V as a packed nn.Linear weight: KV head j's rows are ``E(j)[:, :c]^T W_V(j)^T`` (E the V encoder: an
    orthonormal basis, or the output-aware ``L^-T Q``), so ``x @ result.T`` is the compressed values ``v'``
    (T, sum v_dims). The V bias is not folded in here (see fold_value_bias).

    v_weight: (H_kv * D, hidden); v_encoder: (H_kv, D, D); v_dims: H_kv widths."""
    Hkv, D = v_encoder.shape[0], v_encoder.shape[1]
    per_head = v_weight.to(torch.float64).view(Hkv, D, -1)
    rows = [v_encoder[j, :, : int(v_dims[j])].to(per_head.device, torch.float64).T @ per_head[j] for j in range(Hkv)]
    return torch.cat(rows).to(v_weight.dtype)


def fold_output_projection(o_weight: torch.Tensor, v_decoder: torch.Tensor, v_dims: Sequence[int],
                           group: int) -> torch.Tensor:
    """W_O' as a packed nn.Linear weight: query head h's columns are ``W_O(h) B(kv(h))[:, :c]`` (B the V decoder:
    the orthonormal basis itself, or the output-aware ``L Q``), so the c-wide attention outputs ``o'``
    (T, sum_h v_dims[kv(h)]) map straight to the hidden size.

    o_weight: (hidden, H * D); v_decoder: (H_kv, D, D); v_dims: H_kv widths. Returns (hidden, sum_h v_dims[kv(h)])."""
    Hkv, D = v_decoder.shape[0], v_decoder.shape[1]
    per_head = o_weight.to(torch.float64).view(o_weight.shape[0], Hkv * group, D)
    columns = [per_head[:, h] @ v_decoder[h // group, :, : int(v_dims[h // group])].to(per_head.device, torch.float64)
               for h in range(Hkv * group)]
    return torch.cat(columns, dim=1).to(o_weight.dtype)


def fold_value_bias(v_bias: torch.Tensor, o_weight: torch.Tensor, num_kv_heads: int, group: int) -> torch.Tensor:
    """The output bias that replaces a V bias exactly at any rank: softmax rows sum to 1, so each head's output
    carries ``b_V(kv(h))`` unchanged, which the output projection maps to ``sum_h W_O(h) b_V(kv(h))``.

    v_bias: (H_kv * D,); o_weight: (hidden, H * D). Returns (hidden,)."""
    per_query_head = v_bias.to(torch.float64).view(num_kv_heads, -1).repeat_interleave(group, dim=0).flatten()
    return (o_weight.to(torch.float64) @ per_query_head).to(o_weight.dtype)


@dataclass(frozen=True)
class FoldedValueOutput:
    """One layer's V and output projections with the V factors folded in (nn.Linear's ``x @ weight.T + bias``)."""

    value_weight: torch.Tensor  # (sum v_dims, hidden): A_V, no bias
    output_weight: torch.Tensor  # (hidden, G * sum v_dims): W_O'
    output_bias: torch.Tensor | None  # (hidden,): the output bias plus the folded V bias; None when neither exists


# The cached halves whose kept dims a quantized cache mixes (mix_kept_columns): FDC's rotated queries and keys, Palu's
# key latent, the compressed values.
MIXED_HALVES = ("qk", "k latent", "v")


def mix_kept_columns(basis: torch.Tensor, dims: Sequence[int], half: str, layer: int,
                     heads: Sequence[int] | None = None) -> torch.Tensor:
    """``basis`` with KV head j's first ``dims[j]`` columns multiplied by a fixed random orthogonal matrix, float64.
    The matrix is seeded by the cached ``half`` (MIXED_HALVES), the ``layer``, the head's index in the model,
    ``heads[j]`` (default j: all of a layer's heads, in order), and the width, so every integration (fdc_ops.hf, the
    vLLM plugin, the quantization simulation) and every tensor-parallel rank mixes alike. Applied to both sides of a
    product the cache carries (the query and key rotations; the V encoder and decoder), it leaves every score and
    output as they were, while each cached row's values are spread over its dims: a quantized cache's per-row scale
    is then set by a typical value instead of one outlier dim (as QuaRot does), so quantization loses less
    (bench/results/eval/README.md, on SmolLM2: int8 from 0.9975 to 0.9995 of the score, e4m3 from 0.9917 to 0.9970,
    a simulated int4 from 0.69 to 0.93).

    basis: (H_kv, D, R) with R >= max(dims); dims: H_kv widths. Returns (H_kv, D, R) float64."""
    if half not in MIXED_HALVES:
        raise ValueError(f"fdc_ops.artifact.mix_kept_columns: half must be one of {MIXED_HALVES}, got {half!r}")
    mixed = basis.to(torch.float64).clone()
    heads = range(len(dims)) if heads is None else [int(h) for h in heads]
    for index, (head, width) in enumerate(zip(heads, (int(d) for d in dims))):
        seed = zlib.crc32(f"fdc kv mixing|{half} {layer}|{head}|{width}".encode())
        gaussian = torch.randn(width, width, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        q, r = torch.linalg.qr(gaussian)
        mixing = (q * r.diagonal().sign()).to(mixed.device)  # Haar-distributed: the sign fix makes QR unique
        mixed[index, :, :width] = mixed[index, :, :width] @ mixing
    return mixed


def fold_value_and_output(v_weight: torch.Tensor, o_weight: torch.Tensor, v_encoder: torch.Tensor,
                          v_decoder: torch.Tensor, v_dims: Sequence[int], group: int,
                          v_bias: torch.Tensor | None = None, o_bias: torch.Tensor | None = None) -> FoldedValueOutput:
    """Every fold of one layer's value path, as each integration (fdc_ops.hf.compress, the vLLM plugin) applies it:
    A_V (fold_value_projection), W_O' (fold_output_projection), and a V bias moved into the output bias
    (fold_value_bias, exact at any rank), added to the layer's own output bias if it has one. The results are on
    the weights' device, wherever the factors are (an artifact loads on the CPU).

    v_weight: (H_kv * D, hidden); o_weight: (hidden, H * D); v_encoder, v_decoder: (H_kv, D, D); v_dims: H_kv widths;
    group: G = H / H_kv; v_bias: (H_kv * D,) or None; o_bias: (hidden,) or None."""
    num_kv_heads = v_encoder.shape[0]
    if v_weight.shape[0] != num_kv_heads * v_encoder.shape[1] or o_weight.shape[1] != v_weight.shape[0] * group:
        raise ValueError(f"fdc_ops.calibration.fold_value_and_output: v_weight {tuple(v_weight.shape)} and o_weight "
                         f"{tuple(o_weight.shape)} do not match {num_kv_heads} KV heads of width "
                         f"{v_encoder.shape[1]} in groups of {group}")
    value_weight = fold_value_projection(v_weight, v_encoder, v_dims)
    output_weight = fold_output_projection(o_weight, v_decoder, v_dims, group)
    output_bias = o_bias
    if v_bias is not None:
        folded = fold_value_bias(v_bias, o_weight, num_kv_heads, group)
        output_bias = folded if o_bias is None else o_bias + folded
    return FoldedValueOutput(value_weight, output_weight, output_bias)



@dataclass(frozen=True)
class FoldedKeyLatent:
    """The Palu baseline's key path of one layer (fold_key_latent), in float64 on the weights' device."""

    latent_weight: torch.Tensor  # (sum k_dims, hidden): B_j^T W_K_j per KV head j, the cached latent's projection
    latent_bias: torch.Tensor | None  # (sum k_dims,): B_j^T b_K_j, or None without a K bias
    key_up: torch.Tensor  # (sum k_dims, H_kv * D): block-diagonal B_j^T, latent rows -> pre-RoPE keys


def fold_key_latent(k_weight: torch.Tensor, key_basis: torch.Tensor, k_dims: Sequence[int],
                    k_bias: torch.Tensor | None = None) -> FoldedKeyLatent:
    """The Palu baseline's key factors of one layer, as each integration (fdc_ops.hf.compress, the vLLM plugin)
    applies them: the latent projection that replaces W_K (its k_dims[j] rows of KV head j are the first k_dims[j]
    principal axes of that head's pre-RoPE keys, applied to W_K), and the up-projection that rebuilds the keys
    (``keys = latent @ key_up``, then per-head norms and RoPE).

    k_weight: (H_kv * D, hidden); key_basis: (H_kv, D, D), principal axes in columns; k_dims: H_kv widths; k_bias:
    (H_kv * D,) or None."""
    num_kv_heads, head_dim = key_basis.shape[0], key_basis.shape[1]
    if k_weight.shape[0] != num_kv_heads * head_dim or len(k_dims) != num_kv_heads:
        raise ValueError(f"fdc_ops.calibration.fold_key_latent: k_weight {tuple(k_weight.shape)} and {len(k_dims)} "
                         f"widths do not match {num_kv_heads} KV heads of width {head_dim}")
    device = k_weight.device
    basis = [key_basis[j, :, : int(k_dims[j])].to(device, torch.float64) for j in range(num_kv_heads)]  # (D, r_j)
    heads = k_weight.detach().to(torch.float64).view(num_kv_heads, head_dim, -1)
    latent_weight = torch.cat([basis[j].T @ heads[j] for j in range(num_kv_heads)])
    latent_bias = None
    if k_bias is not None:
        bias = k_bias.detach().to(torch.float64).view(num_kv_heads, head_dim)
        latent_bias = torch.cat([basis[j].T @ bias[j] for j in range(num_kv_heads)])
    return FoldedKeyLatent(latent_weight, latent_bias, key_up_projection(key_basis, k_dims).to(device))


def key_up_projection(key_basis: torch.Tensor, k_dims: Sequence[int]) -> torch.Tensor:
    """(sum k_dims, H_kv * D) float64: the Palu baseline's block-diagonal up-projection of one layer's cached key
    latent to its pre-RoPE keys (KV head j's k_dims[j] latent columns times the transpose of its first k_dims[j]
    principal axes). key_basis: (H_kv, D, D), principal axes in columns; k_dims: H_kv widths."""
    num_kv_heads, head_dim = key_basis.shape[0], key_basis.shape[1]
    key_up = torch.zeros(sum(int(d) for d in k_dims), num_kv_heads * head_dim, dtype=torch.float64)
    start = 0
    for j, dim in enumerate(int(d) for d in k_dims):
        key_up[start: start + dim, j * head_dim: (j + 1) * head_dim] = key_basis[j, :, :dim].T.to(torch.float64)
        start += dim
    return key_up


# ----------------------------------------------------------------------------------------------------------------
# The artifact

FORMAT = "fdc_ops.calibration"
# 2: V encoder/decoder pair (output-aware V), Palu's value basis, measured sensitivity; 3: the model's identity
# (every layer's attention weights, digests in each dtype: fdc_ops.hf.families.weight_identity)
FORMAT_VERSION = 3
METADATA_FILE = "fdc_artifact.json"
# The tensor file's name is chosen at each save (fdc_artifact-<token>.safetensors) and recorded in the JSON, so a new
# save never overwrites the file the current JSON names (FDCArtifact.save).
TENSORS_FILE_NAME = re.compile(r"^fdc_artifact(-[0-9a-f]+)?\.safetensors$")
FILE_KEYS = ("tensors", "tensors_file", "tensors_sha256", "checksum")  # what save() records of the files it wrote
ORTHONORMALITY_TOLERANCE = 1e-4  # bases are stored in float32: columns orthonormal to ~1e-6; this flags corruption
INVERSE_TOLERANCE = 1e-8  # V factor pairs are stored in float64: decoder^T encoder = I to ~1e-13; this flags corruption
V_METHODS = ("output", "activation", "weight", "attention_output")
RULES = ("sensitivity", "explained_variance", "singular_value", "fisher")
RECALIBRATE = ("recalibrate: fdc_ops.calibration.calibrate(model, tokenizer) or `python -m fdc_ops calibrate --out "
               "DIR` (load_or_calibrate recalibrates its cache entries by itself)")


class ArtifactError(ValueError):
    """A calibration artifact that cannot be used: unreadable, corrupt, of another format version or another model."""


def require_number(value, name: str, who: str) -> float:
    """``value`` as a float when it is a finite real number (not a bool, not a string), else TypeError or
    ValueError naming ``who`` (the entry point) and the argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: {name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{who}: {name} must be finite, got {value!r}")
    return float(value)


def require_widths(value, name: str, who: str) -> torch.Tensor:
    """``value`` (nested lists or a tensor of whole numbers) as an int64 tensor, else TypeError naming ``who`` and
    ``name``: 8.5 or "8" is refused instead of being truncated or parsed."""
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"{who}: {name} must be whole numbers (nested lists or a tensor), got {value!r} "
                        f"({error})") from None
    if tensor.dtype == torch.bool or tensor.dtype.is_complex:
        raise TypeError(f"{who}: {name} must be whole numbers, got {tensor.dtype}")
    if tensor.dtype.is_floating_point and not bool((tensor == tensor.round()).all()):
        raise TypeError(f"{who}: {name} must be whole numbers, got {tensor.tolist()}")
    return tensor.to(torch.int64)


def _tensor_specs(shape: AttentionShape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    L, Hkv, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
    square, spectrum = (L, Hkv, D, D), (L, Hkv, D)
    return {"qk_rotation": (square, torch.float32), "qk_singular_values": (spectrum, torch.float64),
            "v_encoder": (square, torch.float64), "v_decoder": (square, torch.float64),
            "v_singular_values": (spectrum, torch.float64),
            "key_basis": (square, torch.float32), "key_singular_values": (spectrum, torch.float64),
            "value_basis": (square, torch.float32), "value_singular_values": (spectrum, torch.float64),
            "qk_damage": ((L, Hkv, D + 1), torch.float64), "v_damage": ((L, Hkv, D + 1), torch.float64),
            "palu_fisher": ((L, Hkv, 2), torch.float64)}


SENSITIVITY_TENSORS = ("qk_damage", "v_damage", "palu_fisher")  # absent when calibrated without measuring them


@dataclass
class FDCArtifact:
    """Everything the online path needs from calibration, for one model. Columns of every basis are ordered by
    their singular value, descending; a head keeping w dims uses the first w columns."""

    qk_rotation: torch.Tensor  # (L, H_kv, D, D) float32: columns = rotation R per KV head, by singular value
    qk_singular_values: torch.Tensor  # (L, H_kv, D) float64, descending
    v_encoder: torch.Tensor  # (L, H_kv, D, D) float64: the cache holds c = v_encoder[:, :w]^T v
    v_decoder: torch.Tensor  # (L, H_kv, D, D) float64: v ~ v_decoder[:, :w] c, folded into W_O; decoder^T enc = I
    v_singular_values: torch.Tensor  # (L, H_kv, D) float64, descending
    key_basis: torch.Tensor  # (L, H_kv, D, D) float32: principal axes of the pre-RoPE keys (the Palu baseline)
    key_singular_values: torch.Tensor  # (L, H_kv, D) float64, descending
    value_basis: torch.Tensor  # (L, H_kv, D, D) float32: principal axes of the values (Palu's whitened SVD of W_V)
    value_singular_values: torch.Tensor  # (L, H_kv, D) float64, descending
    metadata: dict
    qk_damage: torch.Tensor | None = None  # (L, H_kv, D + 1) float64: see Sensitivity
    v_damage: torch.Tensor | None = None  # (L, H_kv, D + 1) float64, weighted by metadata calibration.balance
    palu_fisher: torch.Tensor | None = None  # (L, H_kv, 2) float64

    @property
    def shape(self) -> AttentionShape:
        return AttentionShape(**self.metadata["shape"])

    @property
    def has_sensitivity(self) -> bool:
        return self.qk_damage is not None

    def allocate(self, removal_rate: float | None = None, multiple: int = 8, weighting: str | None = None,
                 method: str = "fdc", *, compression: float | None = None, rule: str | None = None) -> RankAllocation:
        """Per-layer, per-KV-head qk and v dims, by one of two budgets (give exactly one):

        ``removal_rate``: the paper's rule (section 5.2), one shared singular-value removal rate for every head
        (``weighting="singular_value"``, the default); ``weighting="explained_variance"`` applies it to s^2.

        ``compression``: a KV byte budget, the share of the uncompressed K/V cache to remove (0.1 keeps 90% of the
        bytes): ``compression_rate >= compression``, as close to it as the width quantum allows. ``rule``:
        ``sensitivity`` (the default when the artifact holds measured sensitivities): the widths of every head's Q/K
        and V that minimise the summed measured loss increase within the budget (exact knapsack);
        ``explained_variance`` / ``singular_value``: the removal-rate rule on s^2 / s whose smallest rate meets the
        budget (``weighting`` is taken as this rule when ``rule`` is not given); ``fisher``: Palu's rank search
        (widths proportional to the K/V projections' Fisher information), the default for ``method="palu"``.

        ``method="palu"`` sizes the qk dims from the pre-RoPE key spectrum and the v dims from the values' (the
        widths of the Palu baseline's latents). ``multiple``: the width quantum; the kernels take widths that are
        multiples of 8 (16-byte rows in fp16/bf16, docs/design.md section 3), so it must be a positive multiple of 8
        that divides head_dim for the result to be served."""
        if (removal_rate is None) == (compression is None):
            raise ValueError("fdc_ops.calibration.allocate: give exactly one of removal_rate and compression, got "
                             f"removal_rate={removal_rate}, compression={compression}")
        who = "fdc_ops.calibration.allocate"
        if removal_rate is not None:
            removal_rate = require_number(removal_rate, "removal_rate", who)
            if not 0.0 <= removal_rate <= 1.0:
                raise ValueError(f"{who}: removal_rate must be in [0, 1], got {removal_rate}")
        if compression is not None:
            compression = require_number(compression, "compression", who)
        if isinstance(multiple, bool) or not isinstance(multiple, numbers.Integral):
            raise TypeError(f"{who}: multiple must be an int, got {type(multiple).__name__} {multiple!r}")
        for name, value in (("weighting", weighting), ("rule", rule)):
            if value is not None and not isinstance(value, str):
                raise TypeError(f"{who}: {name} must be a string, got {type(value).__name__} {value!r}")
        if method not in ("fdc", "palu"):
            raise ValueError(f"fdc_ops.calibration.allocate: method must be 'fdc' or 'palu', got {method!r}")
        if multiple <= 0 or self.shape.head_dim % multiple:
            raise ValueError(f"fdc_ops.calibration.allocate: multiple must be a positive divisor of head_dim "
                             f"{self.shape.head_dim} (every rule gives widths in steps of it, up to head_dim), got "
                             f"{multiple}")
        if compression is not None:
            rule = rule or weighting or ("fisher" if method == "palu" else
                                         "sensitivity" if self.has_sensitivity else "explained_variance")
            return self._allocate_compression(compression, multiple, rule, method)
        powers = {"singular_value": 1.0, "explained_variance": 2.0}
        weighting = weighting or "singular_value"
        if weighting not in powers:
            raise ValueError(f"fdc_ops: weighting must be one of {sorted(powers)}, got {weighting!r}")
        qk_values = self.qk_singular_values if method == "fdc" else self.key_singular_values
        v_values = self.v_singular_values if method == "fdc" else self.value_singular_values
        power = powers[weighting]
        name = weighting if method == "fdc" else f"palu {weighting}"
        return RankAllocation(kept_dims(qk_values, removal_rate, multiple, power),
                              kept_dims(v_values, removal_rate, multiple, power),
                              self.shape.head_dim, name, removal_rate)

    def _allocate_compression(self, compression: float, multiple: int, rule: str, method: str) -> RankAllocation:
        if not 0.0 <= compression < 1.0:
            raise ValueError(f"fdc_ops.calibration.allocate: compression must be in [0, 1), got {compression}")
        if rule not in RULES:
            raise ValueError(f"fdc_ops.calibration.allocate: rule must be one of {RULES}, got {rule!r}")
        shape = self.shape
        L, Hkv, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
        budget = int((1.0 - compression) * 2 * L * Hkv * D + 1e-9)  # the most dims all heads may keep together
        notes = {"compression_target": compression, "rule": rule}
        if rule in ("sensitivity", "fisher"):
            if not self.has_sensitivity:
                raise ValueError(f"fdc_ops.calibration.allocate: rule {rule!r} needs the sensitivities measured at "
                                 "calibration (calibrate(..., sensitivity_tokens > 0))")
            if budget < 2 * L * Hkv * multiple:
                raise ValueError(f"fdc_ops.calibration.allocate: compression {compression} needs fewer than "
                                 f"{multiple} dims per head")
            if rule == "sensitivity":
                if method != "fdc":
                    raise ValueError("fdc_ops.calibration.allocate: the sensitivities are measured on FDC's bases; "
                                     "method='palu' takes rule 'fisher' or a removal-rate rule")
                dims = knapsack_dims(torch.cat([self.qk_damage.flatten(0, 1), self.v_damage.flatten(0, 1)]),
                                     budget, multiple)
            else:
                dims = fisher_dims(self.palu_fisher.permute(2, 0, 1).flatten(), budget, D, multiple)
            return RankAllocation(dims[: L * Hkv].view(L, Hkv), dims[L * Hkv:].view(L, Hkv), D,
                                  rule if method == "fdc" else f"palu {rule}", None, notes)

        def at(rate: float) -> RankAllocation:
            return self.allocate(rate, multiple, rule, method)

        low, high = 0.0, 1.0 - 1e-9  # removal rate 1 - eps keeps the minimum width everywhere
        if at(low).compression_rate >= compression:
            return dataclasses.replace(at(low), notes=notes)
        if at(high).compression_rate < compression:
            raise ValueError(f"fdc_ops.calibration.allocate: compression {compression} needs fewer than {multiple} "
                             f"dims per head; the most this quantum allows is {at(high).compression_rate:.4f}")
        for _ in range(50):  # 2^-50 of the rate: far below the step at which any head changes width
            middle = (low + high) / 2
            if at(middle).compression_rate >= compression:
                high = middle
            else:
                low = middle
        return dataclasses.replace(at(high), notes=notes)

    def v_factors(self, method: str = "fdc") -> tuple[torch.Tensor, torch.Tensor]:
        """(encoder, decoder) (L, H_kv, D, D) of the V path: the artifact's V factorization for FDC, the values'
        principal axes (orthonormal: encoder = decoder) for the Palu baseline."""
        if method == "palu":
            return self.value_basis, self.value_basis
        return self.v_encoder, self.v_decoder

    def check_model(self, model) -> None:
        """Raises ArtifactError unless the artifact was calibrated on this model's checkpoint: the same attention
        config and every layer's attention weights, compared in the least precise of the model's dtype and the
        calibration's (fdc_ops.identity.identity_mismatch), so one artifact serves float32, bfloat16 and float16
        loads. ``model``: a Hugging Face model (read through fdc_ops.hf.families)."""
        from .hf import families  # only where a Hugging Face model is given: the artifact itself reads no model library

        shape = families.attention_shape(model)
        if shape != self.shape:
            raise ArtifactError(f"fdc_ops: the artifact is for attention shape {self.shape}, the model has {shape}")
        found = model_identity.compared_digests(self.metadata["identity"], families.attention_tensors(model))
        self.check_identity(families.text_config(model), found, "this model")

    def check_identity(self, config, found: dict[str, tuple[str, str, str]], what: str) -> None:
        """check_model's comparison, for a model known by its text config and the identity.compared_digest of each
        of its attention tensors (the vLLM plugin computes them as the checkpoint streams in); ``what`` names it."""
        why = model_identity.identity_mismatch(self.metadata["identity"], config, found)
        if why is not None:
            raise ArtifactError(f"fdc_ops: the artifact was calibrated on model {self.metadata['model_id']!r} "
                                f"(fingerprint {self.metadata['fingerprint'][:12]}), and {what} is another: {why}; "
                                "recalibrate for this model")

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = [name for name in _tensor_specs(self.shape)]
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def save(self, path) -> Path:
        """Writes the artifact to the directory ``path``: its tensors to ``fdc_artifact-<token>.safetensors`` and
        ``fdc_artifact.json``, which names that file, its sha256 and its tensors' shapes, and carries a checksum of
        its own content. Nothing is lost at any byte: the tensors go to a file of a new name first, and the JSON
        that names them replaces the old one in one rename, so the directory holds the old artifact or the new one,
        whole; the old tensor file is removed last. Where it cannot be written (read-only, a file in the way),
        OSError is raised before the old artifact is touched."""
        from safetensors.torch import save_file

        directory = Path(path)
        if directory.exists() and not directory.is_dir():
            raise NotADirectoryError(f"fdc_ops.calibration: cannot save an artifact to {directory}: it is a file")
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.contiguous() for name, t in self._tensors().items()}
        tensors_name = f"fdc_artifact-{secrets.token_hex(8)}.safetensors"
        files.write_atomically(directory / tensors_name, lambda temporary: save_file(tensors, str(temporary)))
        metadata = {key: value for key, value in self.metadata.items() if key not in FILE_KEYS}
        metadata.update(tensors={name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                                 for name, t in tensors.items()},
                        tensors_file=tensors_name, tensors_sha256=_sha256(directory / tensors_name))
        metadata["checksum"] = _metadata_checksum(metadata)
        files.write_json_atomically(directory / METADATA_FILE, metadata, indent=2, sort_keys=True)
        for stale in directory.glob("fdc_artifact*.safetensors"):  # the replaced artifact's tensors
            if stale.name != tensors_name:
                stale.unlink(missing_ok=True)
        return directory

    @classmethod
    def load(cls, path, model=None) -> "FDCArtifact":
        """Reads an artifact written by save() and validates it (format and version, the checksums of the JSON and
        of the tensor file, every metadata field's type and range, tensor shapes and dtypes, finite values,
        orthonormal bases, V factor pairs that invert each other, sorted singular values, non-negative
        sensitivities); with ``model``, also that it was calibrated on that model. Any problem raises ArtifactError
        naming the file and what is wrong; an artifact of another format version says how to recalibrate."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(path)
        metadata_path = directory / METADATA_FILE
        if not metadata_path.is_file():
            raise ArtifactError(f"fdc_ops: {metadata_path} does not exist (is {directory} an artifact directory?)")
        try:
            metadata = json.loads(metadata_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ArtifactError(f"fdc_ops: {metadata_path} is not valid JSON ({error})") from None
        except OSError as error:
            raise ArtifactError(f"fdc_ops: {metadata_path} cannot be read ({error})") from None
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
            raise ArtifactError(f"fdc_ops: {metadata_path} is not an fdc_ops calibration artifact")
        version = metadata.get("format_version")
        if version != FORMAT_VERSION or not isinstance(version, int):
            raise ArtifactError(f"fdc_ops: {metadata_path} has format version {version!r}; this fdc_ops reads version "
                                f"{FORMAT_VERSION} (version 3 records every layer's attention weights, so a "
                                f"fine-tune is told from its base model and one artifact serves every dtype): "
                                f"{RECALIBRATE}")
        if metadata.get("checksum") != _metadata_checksum(metadata):
            raise ArtifactError(f"fdc_ops: {metadata_path} does not match its own checksum (modified or damaged)")
        _validate_metadata(metadata, metadata_path)
        tensors_path = directory / metadata["tensors_file"]
        if not tensors_path.is_file():
            raise ArtifactError(f"fdc_ops: {tensors_path}, which {metadata_path} names, does not exist")
        if _sha256(tensors_path) != metadata["tensors_sha256"]:
            raise ArtifactError(f"fdc_ops: {tensors_path} does not match the checksum in {metadata_path} "
                                f"(truncated or modified)")
        try:
            tensors = load_file(str(tensors_path))
        except (SafetensorError, OSError, ValueError) as error:
            raise ArtifactError(f"fdc_ops: {tensors_path} cannot be read ({error})") from None
        shape = AttentionShape(**metadata["shape"])
        D = shape.head_dim
        expected = _tensor_specs(shape)
        present = [name in tensors for name in SENSITIVITY_TENSORS]
        if any(present) and not all(present):
            raise ArtifactError(f"fdc_ops: {tensors_path} has only some of {SENSITIVITY_TENSORS}")
        for name, (want_shape, want_dtype) in expected.items():
            tensor = tensors.get(name)
            if tensor is None:
                if name in SENSITIVITY_TENSORS:
                    continue
                raise ArtifactError(f"fdc_ops: {tensors_path} has no tensor {name!r}")
            if tuple(tensor.shape) != want_shape or tensor.dtype != want_dtype:
                raise ArtifactError(f"fdc_ops: {tensors_path}: {name} must be {want_dtype} of shape {want_shape}, got "
                                    f"{tensor.dtype} of shape {tuple(tensor.shape)}")
            if not torch.isfinite(tensor).all():
                raise ArtifactError(f"fdc_ops: {tensors_path}: {name} has non-finite values")
        eye = torch.eye(D, dtype=torch.float64)
        for name in ("qk_rotation", "key_basis", "value_basis"):
            basis = tensors[name].to(torch.float64)
            error = (basis.transpose(-1, -2) @ basis - eye).abs().max().item()
            if error > ORTHONORMALITY_TOLERANCE:
                raise ArtifactError(f"fdc_ops: {tensors_path}: {name} columns are not orthonormal (error {error:.2e})")
        error = (tensors["v_decoder"].transpose(-1, -2) @ tensors["v_encoder"] - eye).abs().max().item()
        if error > INVERSE_TOLERANCE:
            raise ArtifactError(f"fdc_ops: {tensors_path}: v_decoder^T v_encoder is not the identity (error "
                                f"{error:.2e})")
        for name in ("qk_singular_values", "v_singular_values", "key_singular_values", "value_singular_values"):
            values = tensors[name]
            if (values < 0).any() or (values[..., 1:] > values[..., :-1]).any():
                raise ArtifactError(f"fdc_ops: {tensors_path}: {name} must be non-negative and descending")
        for name in ("qk_damage", "v_damage", "palu_fisher"):
            if name in tensors and bool((tensors[name] < 0).any()):
                raise ArtifactError(f"fdc_ops: {tensors_path}: {name} must be non-negative (losses and Fisher "
                                    "scores)")
        described = {key: value for key, value in metadata.items() if key not in FILE_KEYS}
        artifact = cls(**{name: tensors[name] for name in expected if name in tensors}, metadata=described)
        if model is not None:
            artifact.check_model(model)
        return artifact


def _metadata_checksum(metadata: dict) -> str:
    """sha256 of the metadata without its checksum, in one canonical JSON form."""
    body = {key: value for key, value in metadata.items() if key != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _validate_metadata(metadata: dict, path: Path) -> None:
    """Every field of an artifact's metadata has the type and range calibrate writes, or ArtifactError names the
    first that does not (so a damaged cache entry is recalibrated by load_or_calibrate, never a KeyError or
    TypeError deeper in)."""
    def whole(low: int):
        return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= low

    def text(value) -> bool:
        return isinstance(value, str)

    def sha256(value) -> bool:
        return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None

    def balance(value) -> bool:
        return value is None or (isinstance(value, dict) and isinstance(value.get("v_to_qk"), (int, float))
                                 and not isinstance(value.get("v_to_qk"), bool) and value["v_to_qk"] > 0)

    shape_fields = {name: (whole(1), "a positive integer") for name in
                    ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size")}
    fields = {
        "model_id": (text, "a string"),
        "fingerprint": (sha256, "64 hexadecimal digits"),
        "tensors_file": (lambda v: isinstance(v, str) and TENSORS_FILE_NAME.match(v) is not None,
                         "a file name fdc_artifact[-<token>].safetensors"),
        "tensors_sha256": (sha256, "64 hexadecimal digits"),
        "tensors": (lambda v: isinstance(v, dict), "a table of tensors"),
        "shape": (lambda v: isinstance(v, dict) and set(v) == set(shape_fields), f"a table of {sorted(shape_fields)}"),
        "identity": (_valid_identity, "the model's config fields, dtype and attention weight digests"),
        "calibration": (lambda v: isinstance(v, dict), "a table"),
        "versions": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()),
                     "a table of version strings"),
    }
    calibration_fields = {
        "num_tokens": (whole(1), "a positive integer"), "seq_len": (whole(1), "a positive integer"),
        "sensitivity_tokens": (whole(0), "a non-negative integer"), "v_method": (lambda v: v in V_METHODS,
                                                                                 f"one of {V_METHODS}"),
        "qk_mode": (lambda v: v == "kv_head", "'kv_head'"), "source": (text, "a string"),
        "sampling": (text, "a string"), "seed": (lambda v: v is None or whole(0)(v), "a non-negative integer or null"),
        "balance": (balance, "null or a table with a positive v_to_qk"),
        "pass_dtype": (lambda v: v in ("float32", "float16", "bfloat16", "float64"), "a float dtype's name"),
    }
    # Calibrations without the sensitivity pass have no balance; artifacts of format 3 made before the passes' dtype
    # was recorded (fdc_ops.calibration.pass_dtype) have no pass_dtype: they computed in the model's dtype.
    optional = {"calibration.balance", "calibration.pass_dtype"}
    for prefix, checks in (("", fields), ("shape.", shape_fields), ("calibration.", calibration_fields)):
        table = metadata if not prefix else metadata[prefix[:-1]]  # a table: the top level was checked first
        for name, (valid, expected) in checks.items():
            if name not in table:
                if prefix + name in optional:
                    continue
                raise ArtifactError(f"fdc_ops: {path} has no '{prefix}{name}'")
            if not valid(table[name]):
                raise ArtifactError(f"fdc_ops: {path}: '{prefix}{name}' must be {expected}, got "
                                    f"{repr(table[name])[:80]}")
    shape = metadata["shape"]
    if shape["num_heads"] % shape["num_kv_heads"]:
        raise ArtifactError(f"fdc_ops: {path}: shape.num_heads {shape['num_heads']} is not a multiple of "
                            f"shape.num_kv_heads {shape['num_kv_heads']}")


def _valid_identity(identity) -> bool:
    """Whether ``identity`` has the form fdc_ops.hf.families.weight_identity gives."""
    dtypes = {model_identity.dtype_name(dtype) for dtype in model_identity.DIGEST_DTYPES}
    return (isinstance(identity, dict) and isinstance(identity.get("config"), dict)
            and identity.get("dtype") in dtypes and isinstance(identity.get("weights"), dict)
            and bool(identity["weights"])
            and all(isinstance(digests, dict) and set(digests) == dtypes
                    and all(isinstance(digest, str) for digest in digests.values())
                    for digests in identity["weights"].values()))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# Artifacts shipped with the package, for the bundled SmolLM2 at load_or_calibrate's defaults: calibrating it takes
# 80 s on 2 cores (bench/results/eval/README.md), a large share of the newcomer's first run (README). The key carries
# the format version and the model's fingerprint, so a stale one is never used; tests/hf/test_calibration.py checks it
# is current.
BUNDLED_ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
#: The name that stands for the bundled SmolLM2's artifact where a directory is asked for (fdc_ops.hf.compress,
#: fdc_ops.vllm.hf_overrides and its command line), so nobody has to dig it out of site-packages.
BUNDLED = "bundled"


def bundled_artifact() -> Path:
    """The directory of the artifact shipped for the bundled SmolLM2 (at load_or_calibrate's defaults)."""
    found = sorted(path for path in BUNDLED_ARTIFACTS.iterdir() if path.is_dir()) if BUNDLED_ARTIFACTS.is_dir() else []
    if len(found) != 1:
        raise ArtifactError(f"fdc_ops: the package should ship one artifact in {BUNDLED_ARTIFACTS}, found {len(found)}")
    return found[0]


def resolve_allocation(artifact: FDCArtifact, method: str, removal_rate, compression, allocation, qk_dims,
                       v_dims, weighting: str | None, rule: str | None, uniform: bool) -> RankAllocation:
    """The widths :func:`compress` would use for these arguments (exactly one of ``removal_rate``, ``compression``,
    ``allocation``, or ``qk_dims`` with ``v_dims``), validated: also the vLLM plugin's, so both integrations give
    the same widths for the same settings."""
    who = "fdc_ops.hf.compress"
    shape = artifact.shape
    given = [removal_rate is not None, compression is not None, allocation is not None,
             qk_dims is not None or v_dims is not None]
    if sum(given) != 1:
        raise ValueError("fdc_ops.hf.compress: give exactly one of removal_rate, compression, allocation, or qk_dims "
                         "and v_dims")
    for name, value in (("removal_rate", removal_rate), ("compression", compression)):
        if value is not None:
            require_number(value, name, who)
    if allocation is not None and not isinstance(allocation, RankAllocation):
        raise TypeError(f"{who}: allocation must be an fdc_ops.calibration.RankAllocation, got "
                        f"{type(allocation).__name__}")
    if not isinstance(uniform, bool):
        raise TypeError(f"{who}: uniform must be True or False, got {uniform!r}")
    if removal_rate is not None or compression is not None:
        allocation = artifact.allocate(removal_rate, weighting=weighting, method=method, compression=compression,
                                       rule=rule)
        return allocation.uniform() if uniform else allocation
    if allocation is None:
        if qk_dims is None or v_dims is None:
            raise ValueError("fdc_ops.hf.compress: qk_dims and v_dims go together")
        allocation = RankAllocation(require_widths(qk_dims, "qk_dims", who),
                                                require_widths(v_dims, "v_dims", who), shape.head_dim,
                                                "given")
    expected = (shape.num_layers, shape.num_kv_heads)
    for name in ("qk_dims", "v_dims"):
        dims = getattr(allocation, name)
        if tuple(dims.shape) != expected:
            raise ValueError(f"fdc_ops.hf.compress: {name} must have shape {expected}, got {tuple(dims.shape)}")
        if bool(((dims <= 0) | (dims % 8 != 0) | (dims > shape.head_dim)).any()):
            raise ValueError(f"fdc_ops.hf.compress: every entry of {name} must be a positive multiple of 8 of at "
                             f"most head_dim {shape.head_dim}, got {dims.tolist()}")
    return allocation.uniform() if uniform else allocation


# A compressed model saved by fdc_ops.hf.save_compressed: beside its checkpoint, FDC_DIRECTORY holds the artifact
# (ARTIFACT_DIRECTORY) and the compression (COMPRESSION_FILE: the method and every head's widths), which
# fdc_ops.hf.load_compressed and the vLLM plugin read back.
FDC_DIRECTORY = "fdc"  # inside a saved model's directory
ARTIFACT_DIRECTORY = "artifact"  # inside FDC_DIRECTORY
COMPRESSION_FILE = "compression.json"  # inside FDC_DIRECTORY
COMPRESSION_FORMAT = "fdc_ops.compressed_model"
COMPRESSION_FORMAT_VERSION = 1


def save_compression(directory: str | os.PathLike, artifact: FDCArtifact, method: str,
                     allocation: RankAllocation) -> None:
    """Writes ``directory``/FDC_DIRECTORY: the artifact and the compression description (an earlier save's files are
    replaced one by one, each whole)."""
    fdc = Path(directory) / FDC_DIRECTORY
    artifact.save(fdc / ARTIFACT_DIRECTORY)
    description = {"format": COMPRESSION_FORMAT, "format_version": COMPRESSION_FORMAT_VERSION, "method": method,
                   "qk_dims": allocation.qk_dims.tolist(), "v_dims": allocation.v_dims.tolist(),
                   "allocation": {"method": allocation.method, "removal_rate": allocation.removal_rate,
                                  "notes": allocation.notes, "compression_rate": allocation.compression_rate}}
    files.write_json_atomically(fdc / COMPRESSION_FILE, description, indent=2, sort_keys=True)


def saved_compression(directory: str | os.PathLike) -> tuple[FDCArtifact, str, RankAllocation]:
    """(artifact, method, allocation) of a directory written by save_compressed, validated; ArtifactError (a
    ValueError) naming the file otherwise."""
    fdc = Path(directory) / FDC_DIRECTORY
    path = fdc / COMPRESSION_FILE
    if not path.is_file():
        raise ArtifactError(f"fdc_ops.hf.load_compressed: {path} does not exist ({directory} was not "
                            "written by fdc_ops.hf.save_compressed)")
    try:
        description = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(f"fdc_ops.hf.load_compressed: {path} is not valid JSON ({error})") from None
    if not isinstance(description, dict) or description.get("format") != COMPRESSION_FORMAT or \
            description.get("format_version") != COMPRESSION_FORMAT_VERSION:
        raise ArtifactError(f"fdc_ops.hf.load_compressed: {path} is not a compressed model description of "
                            f"format version {COMPRESSION_FORMAT_VERSION}")
    artifact = FDCArtifact.load(fdc / ARTIFACT_DIRECTORY)
    shape = artifact.shape
    try:
        qk_dims = torch.tensor(description["qk_dims"], dtype=torch.int64)
        v_dims = torch.tensor(description["v_dims"], dtype=torch.int64)
        recorded = description["allocation"]
        allocation = RankAllocation(qk_dims, v_dims, shape.head_dim, str(recorded["method"]),
                                    recorded["removal_rate"], dict(recorded["notes"]))
        method = description["method"]
    except (KeyError, TypeError, ValueError) as error:
        raise ArtifactError(f"fdc_ops.hf.load_compressed: {path} is incomplete ({error!r})") from None
    if tuple(qk_dims.shape) != (shape.num_layers, shape.num_kv_heads) or qk_dims.shape != v_dims.shape:
        raise ArtifactError(f"fdc_ops.hf.load_compressed: {path}: the widths must be (layers, KV heads) = "
                            f"{(shape.num_layers, shape.num_kv_heads)}, as the artifact's")
    return artifact, method, allocation
