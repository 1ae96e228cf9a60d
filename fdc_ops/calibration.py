"""Offline calibration (docs/design.md sections 1 and 5), the procedure: from a Hugging Face causal LM, the
per-KV-head post-RoPE Q/K rotations, the V factors (activation, output-aware or weight), their singular values and
every head's measured sensitivity, made into an FDCArtifact (fdc_ops.artifact: the format, the width allocations and
the folds, whose names are re-exported here), and the cache of artifacts (load_or_calibrate).

Statistics are accumulated as float64 Gram matrices (``X^T X``) rather than stacked rows: for rows ``X = U S R^T`` the
Gram matrix is ``R S^2 R^T``, so its eigenvectors are ``R`` and the square roots of its eigenvalues are the singular
values, from memory that does not grow with the token count, and sums over batches are exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from .artifact import (  # noqa: F401  (the artifact's names, re-exported: fdc_ops.calibration.FDCArtifact and others)
    BUNDLED,
    BUNDLED_ARTIFACTS,
    FORMAT,
    FORMAT_VERSION,
    RULES,
    V_METHODS,
    ArtifactError,
    FDCArtifact,
    RankAllocation,
    bundled_artifact,
    fisher_dims,
    fold_key_latent,
    fold_output_projection,
    fold_value_and_output,
    fold_value_bias,
    fold_value_projection,
    kept_dims,
    key_up_projection,
    knapsack_dims,
    require_number,
    require_widths,
)
from .defaults import DEFAULT_SEQ_LEN
from .hf import families
from .hf.loading import cache_dir
from .identity import AttentionShape
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
# The passes' arithmetic

NATIVE_16_BIT = {torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
                 torch.float16: ("_is_amx_fp16_supported",)}  # torch.cpu's checks for a CPU's 16-bit matrix products


def pass_dtype(model) -> torch.dtype:
    """The dtype calibration's passes over ``model`` (the statistics, the sensitivities, the balance fit) compute
    in: the model's own, except for a bfloat16 or float16 model on a CPU without matrix instructions of that type
    (AVX512-BF16 or AMX for bfloat16, AMX-FP16 for float16), which is computed in float32: there torch's 16-bit
    matrix products convert every operand, and on a 2-core AMD EPYC (AVX2) a bfloat16 product ran at 19 GFLOPS
    against float32's 130, and a 2048-token pass of Qwen2.5-Coder-1.5B took 314 s against 47 s. Its weights are
    exact in float32, and the statistics are float64 sums either way."""
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype not in NATIVE_16_BIT:
        return parameter.dtype
    native = any(getattr(torch.cpu, check, lambda: False)() for check in NATIVE_16_BIT[parameter.dtype])
    return parameter.dtype if native else torch.float32


@contextlib.contextmanager
def computed_in(model, dtype: torch.dtype):
    """Within the context, ``model``'s 16-bit parameters and buffers are held in ``dtype`` (float32 or the model's
    own: pass_dtype); after it, in their own dtype again, bit for bit (16-bit values are exact in float32). Tied
    parameters stay tied: each is converted once, in place of its data."""
    converted = [(tensor, tensor.dtype) for tensor in (*model.parameters(), *model.buffers())
                 if tensor.dtype in NATIVE_16_BIT and tensor.dtype != dtype]
    try:
        for tensor, _ in converted:
            tensor.data = tensor.data.to(dtype)
        yield model
    finally:
        for tensor, original in converted:
            tensor.data = tensor.data.to(original)


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
        with computed_in(model, pass_dtype(model)), families.override_attention(model, capture), \
                torch.inference_mode():
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


LOSS_CHUNK = 256  # positions whose logits a backward pass of the loss holds at once: a 2048-token window's logits
# over Qwen2.5-Coder's 151,936-token vocabulary are 1.2 GB in float32, and the loss's backward held several such


def backward_next_token_loss(model, hidden: torch.Tensor, batch: torch.Tensor) -> float:
    """Backpropagates the summed next-token cross-entropy of the decoder's outputs ``hidden`` (B, S, hidden) on token
    ids ``batch`` (B, S) through the graph that made ``hidden``, the logits LOSS_CHUNK positions at a time: the loss
    is a sum over positions, so the gradient reaching ``hidden`` is the whole loss's. Returns the loss."""
    outputs = hidden[:, :-1].detach().requires_grad_(True)
    targets = batch[:, 1:]
    total = 0.0
    for start in range(0, targets.shape[1], LOSS_CHUNK):
        logits = families.next_token_logits(model, outputs[:, start: start + LOSS_CHUNK]).float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 targets[:, start: start + LOSS_CHUNK].flatten(), reduction="sum")
        loss.backward()
        total += loss.item()
    hidden[:, :-1].backward(outputs.grad)
    return total


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
        with computed_in(model, pass_dtype(model)), families.override_attention(model, record), \
                torch.enable_grad():
            for batch in progress_bar(list(batches), "measuring sensitivity", "seq", enabled=progress):
                batch = batch.to(device)
                embeddings = embed(batch).detach().requires_grad_(True)  # gradients reach layer 0's queries too
                hidden = model.get_decoder()(inputs_embeds=embeddings, use_cache=False).last_hidden_state
                backward_next_token_loss(model, hidden, batch)
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
    import transformers

    metadata = {  # before the passes, which hold a 16-bit model's weights in float32 (pass_dtype)
        "format": FORMAT, "format_version": FORMAT_VERSION, "model_id": families.model_id(model),
        "fingerprint": families.fingerprint(model), "identity": families.weight_identity(model),
        "shape": dataclasses.asdict(stats.shape),
        "calibration": {**(source or {}), "num_tokens": stats.num_tokens, "seq_len": stats.positions,
                        "v_method": v_method, "qk_mode": "kv_head",
                        "pass_dtype": str(pass_dtype(model)).removeprefix("torch."), "sensitivity_tokens": 0},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }

    def assemble(sensitivity: Sensitivity | None) -> FDCArtifact:
        extra = {} if sensitivity is None else {"qk_damage": sensitivity.qk_damage, "v_damage": sensitivity.v_damage,
                                                "palu_fisher": sensitivity.palu_fisher}
        return FDCArtifact(qk_rotation.to(torch.float32), qk_values, v_encoder.to(torch.float64),
                           v_decoder.to(torch.float64), v_values, key_basis.to(torch.float32), key_values,
                           value_basis.to(torch.float32), value_values, metadata, **extra)

    if not len(sensitivity_batches):
        return assemble(None)
    with computed_in(model, pass_dtype(model)):  # one conversion for both passes (10 s for Qwen2.5-Coder's 6 GB)
        sensitivity = measure_sensitivity(model, qk_rotation, v_encoder, v_decoder, sensitivity_batches,
                                          progress=progress)
        metadata["calibration"]["sensitivity_tokens"] = sensitivity.num_tokens
        artifact = assemble(sensitivity)
        metadata["calibration"]["balance"] = balance_sensitivity(model, artifact, balance_batches, progress=progress) \
            if len(balance_batches) else None
    return artifact


BALANCE_NLL_INCREASE = 0.01  # the balance is fitted at the budget where the unweighted estimates put this loss
# increase (nats per token: 1% of the perplexity score, where the 99% points are decided). Measured: SmolLM2's
# estimates reach it at 0.075 (0.0098 nats), where the fitted allocation measured 0.0125 (bench/results/eval/README.md)
BALANCE_GRID = 0.025  # the budgets the fit may take: steps of the eval tables' grid, from one step to half the cache
BALANCE_MAX_STEPS = 2  # the V-to-Q/K weight walks from 1 by factors of 2, at most this many: 1/4 .. 4. The raw
# estimates misjudged the halves' costs by up to 5x in either direction on SmolLM2

BALANCE_SEQUENCES = 2  # sequences after the calibration tokens the fit measures on. Paired (the same tokens at each
# weight), yet one 2048-token window does not decide: on SmolLM2's two, the weights 2.83 to 8 differed by up to 0.005
# nats with opposite signs (best 8 on one, 4 on the other). They must be unseen: on the bases' own tokens the best fit
# lost 0.0003 nats where held-out text lost 0.035


def estimated_nll_increase(artifact: "FDCArtifact", allocation: RankAllocation) -> float:
    """The loss increase (nats per token) the artifact's sensitivity tables estimate for ``allocation``'s widths."""
    qk = artifact.qk_damage.gather(-1, allocation.qk_dims.unsqueeze(-1)).sum()
    v = artifact.v_damage.gather(-1, allocation.v_dims.unsqueeze(-1)).sum()
    return float(qk + v)


def balance_compression(artifact: "FDCArtifact") -> float:
    """The budget the V-to-Q/K balance is fitted at: among multiples of BALANCE_GRID up to half the cache (and what
    the width quantum allows), the one whose sensitivity allocation the estimates put nearest (as a ratio) to
    BALANCE_NLL_INCREASE: a budget of the model's own, where compression begins to cost, not one constant for all."""
    head_dim = artifact.shape.head_dim
    steps = int(min(0.5, 1.0 - 8 / head_dim) / BALANCE_GRID + 1e-9)
    candidates = [round(step * BALANCE_GRID, 6) for step in range(1, steps + 1)]
    if not candidates:
        raise ValueError(f"fdc_ops.calibration: head_dim {head_dim} leaves no budget to fit the V-to-Q/K balance at")

    def distance(compression: float) -> float:
        estimate = estimated_nll_increase(artifact, artifact.allocate(compression=compression, rule="sensitivity"))
        return abs(math.log(estimate / BALANCE_NLL_INCREASE)) if estimate > 0 else math.inf

    return min(candidates, key=distance)


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


def balance_sensitivity(model, artifact: "FDCArtifact", batches: Sequence[torch.Tensor], *,
                        progress: bool = True) -> dict:
    """Fits the one thing the Taylor estimates get worst, the cost of V against Q/K (they rank heads within a half
    well, but over-predict shallow cuts against deep ones, differently for the two halves): the V damage table is
    weighted by the ratio whose knapsack allocation at the balance_compression budget loses the least measured loss
    on ``batches``. The ratio walks from 1 by factors of 2 (up first, down if 2 is no better), at most
    BALANCE_MAX_STEPS, and stops at the first that is no better: 3 or 4 measured compressions. Only the ratio
    matters to the allocation; artifact.v_damage is multiplied by it in place. Returns the budget, the ratio and the
    measured mean losses."""
    from . import hf

    v_raw = artifact.v_damage.clone()
    compression = balance_compression(artifact)
    measured: dict[float, float] = {}

    def walk() -> Iterator[float]:
        best = 1.0
        yield best
        for factor in (2.0, 0.5):
            ratio = best * factor
            while abs(math.log2(ratio)) <= BALANCE_MAX_STEPS:
                yield ratio
                if measured[ratio] >= measured[best]:
                    break
                best, ratio = ratio, ratio * factor
            if best != 1.0:
                return

    with computed_in(model, pass_dtype(model)):
        for ratio in progress_bar(walk(), f"fitting the V-to-Q/K balance at {compression} compression", "weight",
                                  enabled=progress):
            artifact.v_damage = v_raw * ratio
            hf.compress(model, artifact, compression=compression, rule="sensitivity")
            try:
                measured[ratio] = _mean_nll(model, batches)
            finally:
                hf.restore(model)
    best = min(measured, key=measured.get)
    artifact.v_damage = v_raw * best
    return {"compression": compression, "v_to_qk": best,
            "measured_nll": {f"{ratio:.4f}": value for ratio, value in sorted(measured.items())}}


def calibrate(model, tokenizer=None, *, text: str = "wikipedia", num_tokens: int = 8192, seq_len: int = DEFAULT_SEQ_LEN,
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


def text_sampling(text: str) -> str:
    """How calibrate samples ``text`` (recorded in the artifact, and part of load_or_calibrate's key): ``uniform``
    random token ids, or ``documents``: a bundled text's windows (datasets.calibration_windows)."""
    return "uniform" if text == "random" else "documents"


def load_or_calibrate(model, tokenizer=None, *, text: str = "wikipedia", num_tokens: int = 8192,
                      seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0, v_method: str = "attention_output",
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
