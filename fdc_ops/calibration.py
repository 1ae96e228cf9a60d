"""Offline calibration (docs/design.md sections 1 and 5): from a Hugging Face causal LM, the per-KV-head post-RoPE
Q/K rotations, the V factors (activation, output-aware or weight), their singular values, every head's measured
sensitivity, and the rank allocations: the paper's removal rate, or a KV byte budget spent where it hurts least.

Statistics are accumulated as float64 Gram matrices (``X^T X``) rather than stacked rows: for rows ``X = U S R^T`` the
Gram matrix is ``R S^2 R^T``, so its eigenvectors are ``R`` and the square roots of its eigenvalues are the singular
values, from memory that does not grow with the token count, and sums over batches are exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from . import files, ops
from .hf import families
from .hf.families import AttentionShape
from .hf.loading import cache_dir
from .progress import bar as progress_bar


@dataclass
class CalibrationStatistics:
    """Sums over every calibration token (float64)."""

    shape: AttentionShape
    q_gram: torch.Tensor  # (L, H, D, D) post-RoPE queries, per query head
    k_gram: torch.Tensor  # (L, H_kv, D, D) post-RoPE keys, per KV head
    v_gram: torch.Tensor  # (L, H_kv, D, D) values, per KV head (bias included)
    key_gram: torch.Tensor  # (L, H_kv, D, D) pre-RoPE keys as the K projection outputs them (Palu's latent input)
    z_gram: torch.Tensor  # (L, H_kv, D, D) attention outputs z_h = sum_i a_hi v_i less the V bias, summed over the
    # query heads h of each KV head's group: what the output projection receives (v_method="attention_output")
    num_tokens: int = 0
    positions: int = 0  # sequence length of the calibration sequences (RoPE statistics depend on it)

    @classmethod
    def zeros(cls, shape: AttentionShape) -> "CalibrationStatistics":
        L, H, Hkv, D = shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim
        f64 = torch.float64
        return cls(shape, torch.zeros(L, H, D, D, dtype=f64),
                   *(torch.zeros(L, Hkv, D, D, dtype=f64) for _ in range(4)))

    def __add__(self, other: "CalibrationStatistics") -> "CalibrationStatistics":
        if self.shape != other.shape:
            raise ValueError(f"fdc_ops: cannot add statistics of shapes {self.shape} and {other.shape}")
        return CalibrationStatistics(self.shape, self.q_gram + other.q_gram, self.k_gram + other.k_gram,
                                     self.v_gram + other.v_gram, self.key_gram + other.key_gram,
                                     self.z_gram + other.z_gram, self.num_tokens + other.num_tokens,
                                     max(self.positions, other.positions))

    def qk_gram(self, mode: str = "kv_head") -> torch.Tensor:
        """Gram matrix of the rows stacked for one rotation. ``kv_head`` (the serving layout): KV head j's keys and
        the queries of every head in its group, (L, H_kv, D, D). ``query_head`` (for study only: the cache would need
        a copy of each key per query head): query head h's queries and its KV head's keys, (L, H, D, D)."""
        G = self.shape.group
        if mode == "kv_head":
            L, H, D = self.q_gram.shape[:3]
            return self.k_gram + self.q_gram.view(L, H // G, G, D, D).sum(2)
        if mode == "query_head":
            return self.q_gram + self.k_gram.repeat_interleave(G, dim=1)
        raise ValueError(f"fdc_ops: qk mode must be 'kv_head' or 'query_head', got {mode!r}")


def principal_axes(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(singular values (..., D) descending, rotation (..., D, D) whose columns are the matching right singular
    vectors) of the rows summarised by ``gram`` (..., D, D). Each column's sign is fixed so that its entry of largest
    magnitude is positive, so the same statistics always give the same rotation."""
    eigenvalues, eigenvectors = torch.linalg.eigh(gram.to(torch.float64))
    singular_values = eigenvalues.flip(-1).clamp_min(0).sqrt()
    rotation = eigenvectors.flip(-1)
    largest = rotation.abs().argmax(dim=-2, keepdim=True)
    signs = torch.sign(torch.gather(rotation, -2, largest))
    return singular_values, rotation * torch.where(signs == 0, 1.0, signs)


def weight_value_axes(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's V factorization: per layer and KV head, the SVD of W_V(j) (hidden x D). Returns singular values
    (L, H_kv, D) and the right singular vectors (L, H_kv, D, D) as columns."""
    shape = families.attention_shape(model)
    D, Hkv = shape.head_dim, shape.num_kv_heads
    grams = []
    for module in families.attention_modules(model):
        weight = families.attention_weights(module, shape).v_weight.detach().to("cpu", torch.float64)
        per_head = weight.view(Hkv, D, -1)  # (H_kv, D, hidden): row block j is W_V(j)^T
        grams.append(per_head @ per_head.transpose(1, 2))
    return principal_axes(torch.stack(grams))


COVARIANCE_FLOOR = 1e-4  # output-aware V: value-covariance eigenvalues below this share of the largest are raised to
# it. Such directions carry < 1e-4 of the values' energy, so the basis barely changes, and the factor pair's condition
# number stays <= 1e2: folded into float32 weights, full rank reproduces the layer to ~1e-6 relative.
NULL_SPACE = 1e-10  # eigenvalues below this share of the largest are the values' null space (float64 round-off of
# exactly-zero variance): those directions go last, orthonormal, with singular value 0, so an exactly low-rank V is
# reproduced exactly at its rank.


def output_aware_factors(model, covariance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output-aware V factorization (docs/design.md section 1, "V compression"). What the model consumes is
    ``sum_h W_O(h) z_h``, not v: per layer and KV head j, with ``C = L L^T`` the covariance of what the truncation
    acts on and ``W = [W_O(h) for h in j's group]`` stacked (G * hidden, D), the SVD ``W L = P S Q^T`` orders the
    whitened value directions by the output energy they carry. Caching ``c = Q_r^T L^-1 v`` and folding ``L Q_r`` into
    W_O is the best rank-r pair for E||W (y - P_r y)||^2 (``P_r = L Q_r Q_r^T L^-1``) over rows y of covariance C;
    at full rank ``L Q Q^T L^-1 = I`` (exact, whatever C is). The pair is not orthonormal. L is taken on C's range;
    its null space (if any) comes last.

    Which C: the values' (v_gram, ``v_method="output"``) treats every head as if it passed the values on; the
    attention outputs' (z_gram, ``v_method="attention_output"``): a truncation of the cached values changes head
    h's output ``z_h = sum_i a_hi v_i`` by ``(I - P_r) z_h``, so E||W_O(h) (I - P_r) z_h||^2 summed over the group is
    the error the layer passes on (with the group's heads' statistics pooled). The attention outputs are averages
    over many keys, so their statistics follow the calibration text's topic more than the values' do: calibrated on
    one article, the attention-output pair fitted that article and lost to the activation basis elsewhere; on
    windows from many articles (calibrate's default text sampling) it kept more held-out perplexity than the
    activation basis at every budget measured, and is the default (bench/results/eval/README.md).

    covariance: (L, H_kv, D, D). Returns singular values S (L, H_kv, D) descending, encoder ``L^-T Q`` and decoder
    ``L Q`` (L, H_kv, D, D) float64, column i of each belonging to S_i: c_i = encoder[:, i] . v,
    v = sum_i decoder[:, i] c_i."""
    shape = families.attention_shape(model)
    D, Hkv, G = shape.head_dim, shape.num_kv_heads, shape.group
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance.to(torch.float64))  # ascending: (L, H_kv, D), (.., D, D)
    values = torch.zeros(covariance.shape[:-1], dtype=torch.float64)
    encoders, decoders = torch.zeros_like(eigenvectors), torch.zeros_like(eigenvectors)
    for layer, module in enumerate(families.attention_modules(model)):
        o_weight = families.attention_weights(module, shape).o_weight.detach().to("cpu", torch.float64)
        per_head = o_weight.view(o_weight.shape[0], Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, -1, D)
        for j in range(Hkv):
            e, U = eigenvalues[layer, j], eigenvectors[layer, j]
            largest = float(e[-1].clamp_min(0))
            null = int((e <= NULL_SPACE * largest).sum())
            root = e[null:].clamp_min(COVARIANCE_FLOOR * largest).sqrt()  # (r,)
            square_root = U[:, null:] * root  # L on the range: (D, r)
            _, singular, right_t = torch.linalg.svd(per_head[j] @ square_root, full_matrices=False)
            right = right_t.T  # Q: (r, r)
            pivot = right.abs().argmax(dim=0, keepdim=True)  # sign convention as in principal_axes
            right = right * torch.where(torch.gather(right, 0, pivot) < 0, -1.0, 1.0)
            rank = D - null
            values[layer, j, :rank] = singular
            encoders[layer, j, :, :rank] = (U[:, null:] / root) @ right  # L^-T Q
            decoders[layer, j, :, :rank] = square_root @ right  # L Q
            encoders[layer, j, :, rank:] = decoders[layer, j, :, rank:] = U[:, :null]
    return values, encoders, decoders


# ----------------------------------------------------------------------------------------------------------------
# Capture


def random_token_batches(vocab_size: int, num_tokens: int, seq_len: int, seed: int,
                         batch_size: int = 1) -> list[torch.Tensor]:
    """Uniformly random token ids, ``ceil(num_tokens / seq_len)`` sequences of ``seq_len``, in (batch, seq_len)
    batches. The same seed always gives the same tokens."""
    if num_tokens <= 0 or seq_len <= 0 or batch_size <= 0:
        raise ValueError(f"fdc_ops: num_tokens, seq_len and batch_size must be positive, got {num_tokens}, "
                         f"{seq_len}, {batch_size}")
    generator = torch.Generator().manual_seed(seed)
    sequences = -(-num_tokens // seq_len)
    ids = torch.randint(0, vocab_size, (sequences, seq_len), generator=generator)
    return list(ids.split(batch_size))


def text_token_batches(token_ids: torch.Tensor, num_tokens: int, seq_len: int,
                       batch_size: int = 1) -> list[torch.Tensor]:
    """Consecutive ``seq_len`` windows of a 1-D token stream, as many as ``num_tokens`` needs."""
    sequences = -(-num_tokens // seq_len)
    if token_ids.dim() != 1 or sequences <= 0 or token_ids.numel() < sequences * seq_len:
        raise ValueError(f"fdc_ops: the text has {token_ids.numel()} tokens, fewer than the {sequences} x {seq_len} "
                         f"asked for")
    return list(token_ids[: sequences * seq_len].view(sequences, seq_len).split(batch_size))


def capture_statistics(model, batches: Iterable[torch.Tensor], *, progress: bool = True,
                       description: str = "calibrating") -> CalibrationStatistics:
    """Runs ``model``'s decoder over each (batch, seq_len) batch of token ids and sums the Gram matrices of the
    post-RoPE queries and keys and of the values of every head, as the model's own attention receives them, of
    the pre-RoPE keys as the K projection outputs them, and of the attention outputs (less the V bias, which folds
    exactly) of each KV head's query heads, as the model's own attention returns them. The model's outputs are not
    changed."""
    shape = families.attention_shape(model)
    stats = CalibrationStatistics.zeros(shape)
    Hkv, G, D = shape.num_kv_heads, shape.group, shape.head_dim
    v_biases = [families.attention_weights(m, shape).v_bias for m in families.attention_modules(model)]

    def accumulate(gram: torch.Tensor, rows: torch.Tensor) -> None:  # rows (B, heads, S, D)
        rows = rows.detach().to("cpu", torch.float64)
        gram += torch.einsum("bhsd,bhse->hde", rows, rows)

    def capture(module, query, key, value, attention_mask, original, **kwargs):
        layer = module.layer_idx
        accumulate(stats.q_gram[layer], query)
        accumulate(stats.k_gram[layer], key)
        accumulate(stats.v_gram[layer], value)
        result = original(module, query, key, value, attention_mask, **kwargs)
        outputs = result[0]  # (B, S, H, D): every attention interface returns its output token-major
        expected = (query.shape[0], query.shape[2], query.shape[1], D)
        if tuple(outputs.shape) != expected:
            raise ValueError(f"fdc_ops: the attention function returned shape {tuple(outputs.shape)}, expected "
                             f"(batch, seq_len, heads, head_dim) = {expected}")
        outputs = outputs.detach().to("cpu", torch.float64)
        if v_biases[layer] is not None:  # softmax rows sum to 1: each output carries b_V whole
            outputs = outputs - v_biases[layer].detach().to("cpu", torch.float64).view(Hkv, D).repeat_interleave(G, 0)
        grouped = outputs.unflatten(2, (Hkv, G))  # (B, S, H_kv, G, D)
        stats.z_gram[layer] += torch.einsum("bsjgd,bsjge->jde", grouped, grouped)
        return result

    def key_hook(layer: int):
        q_width, kv_width = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim

        def record(_projection, _args, output):  # output (B, S, [H * D +] H_kv * D [+ H_kv * D])
            keys = output[..., q_width: q_width + kv_width] if output.shape[-1] > kv_width else output
            accumulate(stats.key_gram[layer], keys.unflatten(-1, (shape.num_kv_heads, shape.head_dim)).transpose(1, 2))
        return record

    batches = list(batches)
    hooks = [getattr(module, "k_proj", None) or module.qkv_proj for module in families.attention_modules(model)]
    hooks = [projection.register_forward_hook(key_hook(layer)) for layer, projection in enumerate(hooks)]
    device = next(model.parameters()).device
    try:
        with families.override_attention(model, capture), torch.inference_mode():
            for batch in progress_bar(batches, description, "seq", enabled=progress):
                if batch.dim() != 2:
                    raise ValueError(f"fdc_ops: calibration batches must be (batch, seq_len) token ids, got shape "
                                     f"{tuple(batch.shape)}")
                model.get_decoder()(input_ids=batch.to(device), use_cache=False)
                stats.num_tokens += batch.numel()
                stats.positions = max(stats.positions, batch.shape[1])
    finally:
        for hook in hooks:
            hook.remove()
    return stats


@dataclass
class Sensitivity:
    """Measured cost of narrowing each head, per layer and KV head (float64). ``qk_damage[l, j, w]`` and
    ``v_damage[l, j, w]`` estimate the increase of the mean next-token loss (nats per token) when KV head j of layer
    l keeps its first w Q/K (resp. V) dims, w = 0..D (0 at w = D). ``palu_fisher[l, j, 0 / 1]`` is Palu's rank-search
    score of the K / V projection rows of that head (mean over entries of sqrt(mean over sequences of grad^2))."""

    qk_damage: torch.Tensor  # (L, H_kv, D + 1)
    v_damage: torch.Tensor  # (L, H_kv, D + 1)
    palu_fisher: torch.Tensor  # (L, H_kv, 2)
    num_tokens: int


def _tail_damage(terms: torch.Tensor) -> torch.Tensor:
    """terms (..., T, D): per token t, the first-order loss change ``a[t, i]`` from component i of one head. Dropping
    components w.. changes token t's contribution by ``sum_{i >= w} a[t, i]``; the second-order (empirical Fisher)
    estimate of the loss increase is half its square, summed over tokens. Returns (..., D + 1), w = 0..D."""
    tail = terms.flip(-1).cumsum(-1).flip(-1)
    tail = torch.cat([tail, torch.zeros_like(tail[..., :1])], dim=-1)
    return 0.5 * tail.square().sum(-2)


def measure_sensitivity(model, qk_rotation: torch.Tensor, v_encoder: torch.Tensor, v_decoder: torch.Tensor,
                        batches: Iterable[torch.Tensor], *, progress: bool = True) -> Sensitivity:
    """One forward and backward pass of the next-token loss per (batch, seq_len) batch of token ids, recording for
    every head how much each basis direction of its cached keys, queries and values moves the loss (the gradients
    at the post-RoPE queries and keys and at the values, projected on the rotation and the V factors): a
    second-order Taylor (empirical Fisher) estimate of the loss increase of every width, without evaluating any
    compressed model. The same backward pass gives Palu's Fisher information of the K and V projections.

    qk_rotation: (L, H_kv, D, D); v_encoder, v_decoder: (L, H_kv, D, D). The model is not changed."""
    shape = families.attention_shape(model)
    L, Hkv, D, G = shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.group
    qk_damage = torch.zeros(L, Hkv, D + 1, dtype=torch.float64)
    v_damage = torch.zeros_like(qk_damage)
    rotation, encoder, decoder = (t.to(torch.float64) for t in (qk_rotation, v_encoder, v_decoder))
    modules = families.attention_modules(model)
    v_biases = [families.attention_weights(m, shape).v_bias for m in modules]

    def projected_terms(rows: torch.Tensor, grad: torch.Tensor, first: torch.Tensor, second: torch.Tensor):
        """rows, grad (B, heads, S, D); first, second (heads, D, D) -> (heads, B * S, D): (rows first) * (grad
        second), the per-token, per-direction first-order terms."""
        a = torch.einsum("bhsd,hde->hbse", rows.to(torch.float64), first)
        b = torch.einsum("bhsd,hde->hbse", grad.to(torch.float64), second)
        return (a * b).flatten(1, 2)

    def record(module, query, key, value, attention_mask, original, **kwargs):
        layer = module.layer_idx
        if torch.is_grad_enabled() and query.requires_grad:
            q_rows, k_rows = query.detach(), key.detach()
            v_rows = value.detach()
            if v_biases[layer] is not None:  # the V bias is folded exactly; only x W_V is compressed
                v_rows = v_rows - v_biases[layer].detach().view(1, Hkv, 1, D)
            per_query = rotation[layer].repeat_interleave(G, dim=0)  # (H, D, D)

            def on_query(grad):
                damage = _tail_damage(projected_terms(q_rows, grad, per_query, per_query))  # (H, D + 1)
                qk_damage[layer] += damage.view(Hkv, G, D + 1).sum(1)

            def on_key(grad):
                qk_damage[layer] += _tail_damage(projected_terms(k_rows, grad, rotation[layer], rotation[layer]))

            def on_value(grad):
                v_damage[layer] += _tail_damage(projected_terms(v_rows, grad, encoder[layer], decoder[layer]))

            query.register_hook(on_query)
            key.register_hook(on_key)
            value.register_hook(on_value)
        return original(module, query, key, value, attention_mask, **kwargs)

    def kv_weights(module) -> tuple[torch.nn.Parameter, ...]:
        return (module.qkv_proj.weight,) if hasattr(module, "qkv_proj") else (module.k_proj.weight,
                                                                               module.v_proj.weight)

    def kv_gradients(module) -> tuple[torch.Tensor, torch.Tensor]:  # (H_kv * D, hidden) each
        if hasattr(module, "qkv_proj"):
            grad = module.qkv_proj.weight.grad
            return grad[shape.num_heads * D: (shape.num_heads + Hkv) * D], grad[(shape.num_heads + Hkv) * D:]
        return module.k_proj.weight.grad, module.v_proj.weight.grad

    squared = [torch.zeros(2, Hkv * D, shape.hidden_size, dtype=torch.float64) for _ in range(L)]
    trainable = {parameter: parameter.requires_grad for parameter in model.parameters()}
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    for module in modules:
        for weight in kv_weights(module):
            weight.requires_grad_(True)
            weight.grad = None
    device = next(model.parameters()).device
    embed = model.get_input_embeddings()
    num_tokens, sequences = 0, 0
    try:
        with families.override_attention(model, record), torch.enable_grad():
            for batch in progress_bar(list(batches), "measuring sensitivity", "seq", enabled=progress):
                batch = batch.to(device)
                embeddings = embed(batch).detach().requires_grad_(True)  # gradients reach layer 0's queries too
                logits = model(inputs_embeds=embeddings, use_cache=False).logits[:, :-1].float()
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(),
                                                         reduction="sum")
                loss.backward()
                for layer, module in enumerate(modules):
                    for index, grad in enumerate(kv_gradients(module)):
                        squared[layer][index] += grad.detach().to("cpu", torch.float64).square()
                    for weight in kv_weights(module):
                        weight.grad = None
                num_tokens += batch[:, 1:].numel()
                sequences += batch.shape[0]
    finally:
        for parameter, flag in trainable.items():
            parameter.requires_grad_(flag)
            parameter.grad = None
    if num_tokens == 0:
        raise ValueError("fdc_ops.calibration.measure_sensitivity: no tokens to measure on")
    fisher = torch.stack([(s / sequences).sqrt().view(2, Hkv, -1).mean(-1).T for s in squared])  # (L, H_kv, 2)
    return Sensitivity(qk_damage / num_tokens, v_damage / num_tokens, fisher, num_tokens)


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


# ----------------------------------------------------------------------------------------------------------------
# The artifact

FORMAT = "fdc_ops.calibration"
# 2: V encoder/decoder pair (output-aware V), Palu's value basis, measured sensitivity; 3: the model's identity
# (every layer's attention weights, digests in each dtype: families.weight_identity)
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
        calibration's (families.identity_mismatch), so one artifact serves float32, bfloat16 and float16 loads."""
        shape = families.attention_shape(model)
        if shape != self.shape:
            raise ArtifactError(f"fdc_ops: the artifact is for attention shape {self.shape}, the model has {shape}")
        found = families.compared_digests(self.metadata["identity"], families.attention_tensors(model))
        self.check_identity(families.text_config(model), found, "this model")

    def check_identity(self, config, found: dict[str, tuple[str, str, str]], what: str) -> None:
        """check_model's comparison, for a model known by its text config and the families.compared_digest of each
        of its attention tensors (the vLLM plugin computes them as the checkpoint streams in); ``what`` names it."""
        why = families.identity_mismatch(self.metadata["identity"], config, found)
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
    }
    optional = {"calibration.balance"}  # calibrations without the sensitivity pass have none
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
    """Whether ``identity`` has the form families.weight_identity gives."""
    dtypes = {str(dtype).removeprefix("torch.") for dtype in families.DIGEST_DTYPES}
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


def v_factors_from_statistics(model, stats: CalibrationStatistics, v_method: str):
    """(singular values, encoder, decoder) of one V factorization (see V_METHODS and calibrate)."""
    if v_method not in V_METHODS:
        raise ValueError(f"fdc_ops.calibration: v_method must be one of {V_METHODS}, got {v_method!r}")
    if v_method in ("output", "attention_output"):
        return output_aware_factors(model, stats.v_gram if v_method == "output" else stats.z_gram)
    values, basis = principal_axes(stats.v_gram) if v_method == "activation" else weight_value_axes(model)
    return values, basis, basis


def artifact_from_statistics(model, stats: CalibrationStatistics, *, v_method: str = "attention_output",
                             source: dict | None = None, sensitivity_batches: Sequence[torch.Tensor] = (),
                             balance_batches: Sequence[torch.Tensor] = (), progress: bool = True) -> FDCArtifact:
    """Rotations and V factors from captured statistics, and the sensitivities measured on ``sensitivity_batches``
    (none: the artifact has none, and allocate(compression=...) uses the explained-variance rule), their V-to-Q/K
    balance fitted on ``balance_batches`` (tokens the statistics have not seen: on the bases' own tokens every
    compression looks nearly free; none: ratio 1). See calibrate."""
    v_values, v_encoder, v_decoder = v_factors_from_statistics(model, stats, v_method)
    qk_values, qk_rotation = principal_axes(stats.qk_gram("kv_head"))
    key_values, key_basis = principal_axes(stats.key_gram)
    value_values, value_basis = principal_axes(stats.v_gram)
    sensitivity = None
    if len(sensitivity_batches):
        sensitivity = measure_sensitivity(model, qk_rotation, v_encoder, v_decoder, sensitivity_batches,
                                          progress=progress)
    import transformers

    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model_id": families.model_id(model),
        "fingerprint": families.fingerprint(model), "identity": families.weight_identity(model),
        "shape": dataclasses.asdict(stats.shape),
        "calibration": {**(source or {}), "num_tokens": stats.num_tokens, "seq_len": stats.positions,
                        "v_method": v_method, "qk_mode": "kv_head",
                        "sensitivity_tokens": sensitivity.num_tokens if sensitivity is not None else 0},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    extra = {} if sensitivity is None else {"qk_damage": sensitivity.qk_damage, "v_damage": sensitivity.v_damage,
                                            "palu_fisher": sensitivity.palu_fisher}
    artifact = FDCArtifact(qk_rotation.to(torch.float32), qk_values, v_encoder.to(torch.float64),
                           v_decoder.to(torch.float64), v_values, key_basis.to(torch.float32), key_values,
                           value_basis.to(torch.float32), value_values, metadata, **extra)
    if sensitivity is not None:
        metadata["calibration"]["balance"] = balance_sensitivity(model, artifact, balance_batches) \
            if len(balance_batches) else None
    return artifact


BALANCE_COMPRESSION = 0.075  # the budget at which the V-to-Q/K weight of the estimates is fitted to measured losses:
# between where SmolLM2 keeps 99% and 90% of its perplexity score (bench/results/eval/README.md)
BALANCE_RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0)  # V-to-Q/K weights tried first (then the best one's sqrt(2) neighbours):
# the raw estimates misjudged the halves' costs by up to 5x in either direction on SmolLM2
BALANCE_SEQUENCES = 2  # sequences after the calibration tokens the fit measures on: two of 1024 tokens resolve loss
# differences of ~1e-3 nats (paired: the same tokens with and without compression) in ~3 s each on 2 cores. They must
# be unseen: on the bases' own tokens the best fit lost 0.0003 nats where held-out text lost 0.035


def _mean_nll(model, batches: Sequence[torch.Tensor]) -> float:
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.inference_mode():
        for batch in batches:
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(),
                                                       reduction="sum").item()
            count += batch[:, 1:].numel()
    return total / count


def balance_sensitivity(model, artifact: "FDCArtifact", batches: Sequence[torch.Tensor]) -> dict:
    """Fits the one thing the Taylor estimates get worst, the cost of V against Q/K (they rank heads within a half
    well, but over-predict shallow cuts against deep ones, differently for the two halves): the V damage table is
    weighted by the ratio, among BALANCE_RATIOS and the best one's sqrt(2) neighbours, whose knapsack allocation at
    the BALANCE_COMPRESSION budget loses the least measured loss on ``batches``. Only the ratio matters to the
    allocation; artifact.v_damage is multiplied by it in place. Returns the ratio and the measured losses."""
    from . import hf

    base = _mean_nll(model, batches)
    v_raw = artifact.v_damage.clone()
    measured: dict[float, float] = {}

    def loss(ratio: float) -> float:
        if ratio not in measured:
            artifact.v_damage = v_raw * ratio
            hf.compress(model, artifact, compression=BALANCE_COMPRESSION, rule="sensitivity")
            try:
                measured[ratio] = _mean_nll(model, batches) - base
            finally:
                hf.restore(model)
        return measured[ratio]

    for ratio in BALANCE_RATIOS:
        loss(ratio)
    best = min(measured, key=measured.get)
    for ratio in (best / 2**0.5, best * 2**0.5):
        loss(ratio)
    best = min(measured, key=measured.get)
    artifact.v_damage = v_raw * best
    return {"compression": BALANCE_COMPRESSION, "v_to_qk": best,
            "measured_nll_increase": {f"{ratio:.4f}": value for ratio, value in sorted(measured.items())}}


def calibrate(model, tokenizer=None, *, text: str = "wikipedia", num_tokens: int = 8192, seq_len: int = 1024,
              seed: int = 0, input_ids: torch.Tensor | None = None, source_name: str | None = None,
              v_method: str = "attention_output", sensitivity_tokens: int = 8192, batch_size: int = 1,
              progress: bool = True) -> FDCArtifact:
    """Calibrates ``model`` (a Hugging Face causal LM of a supported family) and returns its FDCArtifact.

    Tokens: ``num_tokens`` of the bundled ``text`` (``wikipedia`` by default; needs the model's ``tokenizer``),
    as windows that start at documents spread over the text (datasets.calibration_windows), or ``text="random"``:
    uniformly random token ids (``seed``, the paper's setting), or ``input_ids``, a 1-D token stream (read as
    consecutive windows from its start) or (N, S) sequences of your own text (named by ``source_name``). Sequences
    are ``seq_len`` long (RoPE statistics depend on position: calibrate up to the positions you serve). With
    sensitivities, BALANCE_SEQUENCES more sequences the statistics do not see (two more documents' windows of the
    text, the continuation of a 1-D stream or of the random stream) fit their V-to-Q/K balance; (N, S)
    ``input_ids`` give no such sequences, and the balance is left at 1.

    ``v_method``: ``attention_output`` (the default: output-aware factors from the second moment of the attention
    outputs, what a truncation of the values actually changes, see output_aware_factors; with the sensitivity
    allocation on SmolLM2 it kept as much perplexity score as the activation basis or more, on the mean of three
    splits from articles calibration does not read, at every budget measured, and 99% of the held-out score up to
    0.062 compression instead of 0.053: bench/results/eval/README.md), ``activation`` (principal axes of the
    captured values, Palu-style), ``output`` (output-aware factors from the values' covariance) or ``weight`` (the
    paper's SVD of W_V). ``sensitivity_tokens``: how many of the calibration
    tokens (whole sequences) measure every head's sensitivity for allocate(compression=...) (a forward and backward
    pass, about 3x a calibration pass; all 8192 by default, bench/results/eval/README.md); 0 skips it."""
    if v_method not in V_METHODS:
        raise ValueError(f"fdc_ops.calibration.calibrate: v_method must be one of {V_METHODS}, got {v_method!r}")
    if sensitivity_tokens < 0:
        raise ValueError(f"fdc_ops.calibration.calibrate: sensitivity_tokens must be >= 0, got {sensitivity_tokens}")
    held_out: list[torch.Tensor] = []  # sequences after the calibration tokens: what the V/QK balance is fitted on
    balance = BALANCE_SEQUENCES if sensitivity_tokens else 0
    if input_ids is None and text == "random":
        vocab_size = families.text_config(model).vocab_size
        batches = random_token_batches(vocab_size, num_tokens, seq_len, seed, batch_size)
        if balance:
            extra = random_token_batches(vocab_size, num_tokens + balance * seq_len, seq_len, seed, 1)
            held_out = extra[-balance:]
        source = {"source": "random_tokens", "sampling": text_sampling(text), "seed": seed}
    elif input_ids is None:
        from . import datasets

        if tokenizer is None:
            raise ValueError(f"fdc_ops.calibration.calibrate: calibrating on text={text!r} needs the model's "
                             "tokenizer (pass tokenizer=), or pass text='random' for uniformly random tokens")
        if num_tokens <= 0:
            raise ValueError(f"fdc_ops.calibration.calibrate: num_tokens must be positive, got {num_tokens}")
        count = -(-num_tokens // seq_len)
        windows = datasets.calibration_windows(*datasets.text_documents(tokenizer, text), count + balance, seq_len)
        batches = list(torch.cat(windows[:count]).split(batch_size))
        held_out = windows[count:]
        source = {"source": text, "sampling": text_sampling(text), "seed": None}
    else:
        if input_ids.dim() == 1:
            usable = max(seq_len, min(num_tokens, input_ids.numel() // seq_len * seq_len))
            batches = text_token_batches(input_ids, usable, seq_len, batch_size)
            used = sum(batch.shape[0] for batch in batches) * seq_len
            if balance and input_ids.numel() >= used + balance * seq_len:
                held_out = list(input_ids[used: used + balance * seq_len].view(balance, 1, seq_len))
        elif input_ids.dim() == 2:
            batches = list(input_ids.split(batch_size))
        else:
            raise ValueError(f"fdc_ops.calibration.calibrate: input_ids must be 1-D or (N, S), got shape "
                             f"{tuple(input_ids.shape)}")
        source = {"source": source_name or "text", "sampling": "consecutive", "seed": None}
    stats = capture_statistics(model, batches, progress=progress)
    sequences = [row[None] for batch in batches for row in batch]
    wanted = -(-sensitivity_tokens // sequences[0].shape[1]) if sensitivity_tokens else 0
    return artifact_from_statistics(model, stats, v_method=v_method, source=source,
                                    sensitivity_batches=sequences[:wanted], balance_batches=held_out,
                                    progress=progress)


# Artifacts shipped with the package, for the bundled SmolLM2 at load_or_calibrate's defaults: calibrating it takes
# 80 s on 2 cores (bench/results/eval/README.md), a large share of the newcomer's first run (README). The key carries
# the format version and the model's fingerprint, so a stale one is never used; tests/test_calibration.py checks it is
# current.
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


def text_sampling(text: str) -> str:
    """How calibrate samples ``text`` (recorded in the artifact, and part of load_or_calibrate's key): ``uniform``
    random token ids, or ``documents``: a bundled text's windows (datasets.calibration_windows)."""
    return "uniform" if text == "random" else "documents"


def load_or_calibrate(model, tokenizer=None, *, text: str = "wikipedia", num_tokens: int = 8192,
                      seq_len: int = 1024, seed: int = 0, v_method: str = "attention_output",
                      sensitivity_tokens: int = 8192,
                      directory=None, progress: bool = True) -> FDCArtifact:
    """The artifact for these settings from the cache (``$FDC_CACHE/artifacts``, keyed by the format version, the
    model's fingerprint and the settings), else from the artifacts shipped with the package (BUNDLED_ARTIFACTS,
    same keys), else any artifact of these settings there whose identity matches the model (a float16 load of a
    float32 checkpoint has another key), calibrating and saving it on first use. ``text``: a bundled text (needs the
    tokenizer) or ``random``. An artifact that fails validation is recalibrated."""
    fingerprint = families.fingerprint(model)
    settings = f"{text}-{text_sampling(text)}-{num_tokens}-{seq_len}-{seed}-{v_method}-{sensitivity_tokens}"
    key = f"v{FORMAT_VERSION}-{fingerprint[:16]}-{settings}"
    root = Path(directory or cache_dir() / "artifacts")
    path = root / key
    for candidate in (path, BUNDLED_ARTIFACTS / key):
        if candidate.is_dir():
            try:
                return FDCArtifact.load(candidate, model=model)
            except ArtifactError as error:
                print(f"recalibrating: the artifact in {candidate} is unusable ({error})")
    # The key is the bfloat16 rounding of the weights, which a float16 load of a float32 checkpoint does not share:
    # any artifact of these settings whose identity matches the model serves it too.
    pattern = f"v{FORMAT_VERSION}-*-{settings}"
    for candidate in sorted(root.glob(pattern)) + sorted(BUNDLED_ARTIFACTS.glob(pattern)):
        if candidate.is_dir() and candidate.name != key:
            try:
                return FDCArtifact.load(candidate, model=model)
            except ArtifactError:
                continue  # another model's, or unusable
    artifact = calibrate(model, tokenizer, text=text, num_tokens=num_tokens, seq_len=seq_len, seed=seed,
                         v_method=v_method, sensitivity_tokens=sensitivity_tokens, progress=progress)
    save_or_keep(artifact, path, "fdc_ops.calibration.load_or_calibrate")
    return artifact


def save_or_keep(artifact: FDCArtifact, path, who: str) -> Path | None:
    """Saves a finished calibration to ``path``; where that fails (read-only, a file in the way), to a fallback
    directory under the system's temporary directory, with a warning naming both; where that fails too, warns and
    returns None: the caller still holds the artifact (``artifact.save(directory)`` saves it later). A calibration
    is never thrown away for want of a place to write it. Returns where it was saved."""
    import tempfile
    import warnings

    try:
        return artifact.save(path)
    except OSError as error:
        first = error
    fallback = Path(tempfile.gettempdir()) / "fdc_ops-artifacts" / Path(path).name
    try:
        saved = artifact.save(fallback)
    except OSError as error:
        warnings.warn(f"{who}: the artifact could not be saved to {path} ({first}) nor to {fallback} ({error}); it "
                      "is kept in memory only: save it with artifact.save(directory)", RuntimeWarning, stacklevel=3)
        return None
    warnings.warn(f"{who}: the artifact could not be saved to {path} ({first}); it was saved to {saved} instead "
                  "(make the first writable, or set FDC_CACHE to a writable directory, and move it there)",
                  RuntimeWarning, stacklevel=3)
    return saved
