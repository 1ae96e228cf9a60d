"""Offline calibration (paper sections 3-5.2, DESIGN.md section 1): from a Hugging Face causal LM, the per-KV-head
post-RoPE Q/K rotations, the V bases, their singular values, and the removal-rate rank allocation.

Statistics are accumulated as float64 Gram matrices (``X^T X``) rather than stacked rows: for rows ``X = U S R^T`` the
Gram matrix is ``R S^2 R^T``, so its eigenvectors are ``R`` and the square roots of its eigenvalues are the singular
values, from memory that does not grow with the token count, and sums over batches are exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

from . import models
from .models import AttentionShape
from .progress import bar as progress_bar


@dataclass
class CalibrationStatistics:
    """Sums over every calibration token (float64)."""

    shape: AttentionShape
    q_gram: torch.Tensor  # (L, H, D, D) post-RoPE queries, per query head
    k_gram: torch.Tensor  # (L, H_kv, D, D) post-RoPE keys, per KV head
    v_gram: torch.Tensor  # (L, H_kv, D, D) values, per KV head (bias included)
    key_gram: torch.Tensor  # (L, H_kv, D, D) pre-RoPE keys as the K projection outputs them (Palu's latent input)
    num_tokens: int = 0
    positions: int = 0  # sequence length of the calibration sequences (RoPE statistics depend on it)

    @classmethod
    def zeros(cls, shape: AttentionShape) -> "CalibrationStatistics":
        L, H, Hkv, D = shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim
        f64 = torch.float64
        return cls(shape, torch.zeros(L, H, D, D, dtype=f64), torch.zeros(L, Hkv, D, D, dtype=f64),
                   torch.zeros(L, Hkv, D, D, dtype=f64), torch.zeros(L, Hkv, D, D, dtype=f64))

    def __add__(self, other: "CalibrationStatistics") -> "CalibrationStatistics":
        if self.shape != other.shape:
            raise ValueError(f"fdc_ops: cannot add statistics of shapes {self.shape} and {other.shape}")
        return CalibrationStatistics(self.shape, self.q_gram + other.q_gram, self.k_gram + other.k_gram,
                                     self.v_gram + other.v_gram, self.key_gram + other.key_gram,
                                     self.num_tokens + other.num_tokens, max(self.positions, other.positions))

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
    shape = models.attention_shape(model)
    D, Hkv = shape.head_dim, shape.num_kv_heads
    grams = []
    for module in models.attention_modules(model):
        weight = models.attention_weights(module, shape).v_weight.detach().to("cpu", torch.float64)
        per_head = weight.view(Hkv, D, -1)  # (H_kv, D, hidden): row block j is W_V(j)^T
        grams.append(per_head @ per_head.transpose(1, 2))
    return principal_axes(torch.stack(grams))


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
    post-RoPE queries and keys and of the values of every head, as the model's own attention receives them, and of
    the pre-RoPE keys as the K projection outputs them. The model's outputs are not changed."""
    shape = models.attention_shape(model)
    stats = CalibrationStatistics.zeros(shape)

    def accumulate(gram: torch.Tensor, rows: torch.Tensor) -> None:  # rows (B, heads, S, D)
        rows = rows.detach().to("cpu", torch.float64)
        gram += torch.einsum("bhsd,bhse->hde", rows, rows)

    def capture(module, query, key, value, attention_mask, original, **kwargs):
        layer = module.layer_idx
        accumulate(stats.q_gram[layer], query)
        accumulate(stats.k_gram[layer], key)
        accumulate(stats.v_gram[layer], value)
        return original(module, query, key, value, attention_mask, **kwargs)

    def key_hook(layer: int):
        q_width, kv_width = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim

        def record(_projection, _args, output):  # output (B, S, [H * D +] H_kv * D [+ H_kv * D])
            keys = output[..., q_width: q_width + kv_width] if output.shape[-1] > kv_width else output
            accumulate(stats.key_gram[layer], keys.unflatten(-1, (shape.num_kv_heads, shape.head_dim)).transpose(1, 2))
        return record

    batches = list(batches)
    hooks = [getattr(module, "k_proj", None) or module.qkv_proj for module in models.attention_modules(model)]
    hooks = [projection.register_forward_hook(key_hook(layer)) for layer, projection in enumerate(hooks)]
    device = next(model.parameters()).device
    try:
        with models.override_attention(model, capture), torch.inference_mode():
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


# ----------------------------------------------------------------------------------------------------------------
# Rank allocation


def kept_dims(singular_values: torch.Tensor, removal_rate: float, multiple: int = 8,
              power: float = 1.0) -> torch.Tensor:
    """Per head (last axis = the head's D singular values, descending), the dims kept at singular-value removal rate
    ``r`` (paper section 5.2): drop the largest number of trailing dims whose values sum to at most ``r`` of the
    head's total, keep the rest (``j + 1`` dims where ``sum_{i>j} s_i <= r * sum_i s_i < sum_{i>=j} s_i``), then round
    up to a multiple of ``multiple`` (at most D, at least ``multiple``). ``power=2`` ranks by explained variance
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
        def prefix(dims: torch.Tensor) -> torch.Tensor:
            return torch.cat([dims.new_zeros(1), dims.cumsum(0)]).to(torch.int32)

        return prefix(self.qk_dims[layer]), prefix(self.v_dims[layer])

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


def fold_value_projection(v_weight: torch.Tensor, v_basis: torch.Tensor, v_dims: Sequence[int]) -> torch.Tensor:
    """A_V as a packed nn.Linear weight: KV head j's rows are ``V_k(j)^T W_V(j)^T``, so ``x @ result.T`` is the
    compressed values ``v'`` (T, sum v_dims). The V bias is not folded in here (see fold_value_bias).

    v_weight: (H_kv * D, hidden); v_basis: (H_kv, D, D) orthonormal columns; v_dims: H_kv widths."""
    Hkv, D = v_basis.shape[0], v_basis.shape[1]
    per_head = v_weight.to(torch.float64).view(Hkv, D, -1)
    rows = [v_basis[j, :, : int(v_dims[j])].to(torch.float64).T @ per_head[j] for j in range(Hkv)]
    return torch.cat(rows).to(v_weight.dtype)


def fold_output_projection(o_weight: torch.Tensor, v_basis: torch.Tensor, v_dims: Sequence[int],
                           group: int) -> torch.Tensor:
    """W_O' as a packed nn.Linear weight: query head h's columns are ``W_O(h) B_V(kv(h))^T``, so the c-wide attention
    outputs ``o'`` (T, sum_h v_dims[kv(h)]) map straight to the hidden size.

    o_weight: (hidden, H * D); v_basis: (H_kv, D, D); v_dims: H_kv widths. Returns (hidden, sum_h v_dims[kv(h)])."""
    Hkv, D = v_basis.shape[0], v_basis.shape[1]
    per_head = o_weight.to(torch.float64).view(o_weight.shape[0], Hkv * group, D)
    columns = [per_head[:, h] @ v_basis[h // group, :, : int(v_dims[h // group])].to(torch.float64)
               for h in range(Hkv * group)]
    return torch.cat(columns, dim=1).to(o_weight.dtype)


def fold_value_bias(v_bias: torch.Tensor, o_weight: torch.Tensor, num_kv_heads: int, group: int) -> torch.Tensor:
    """The output bias that replaces a V bias exactly at any rank: softmax rows sum to 1, so each head's output
    carries ``b_V(kv(h))`` unchanged, which the output projection maps to ``sum_h W_O(h) b_V(kv(h))``.

    v_bias: (H_kv * D,); o_weight: (hidden, H * D). Returns (hidden,)."""
    per_query_head = v_bias.to(torch.float64).view(num_kv_heads, -1).repeat_interleave(group, dim=0).flatten()
    return (o_weight.to(torch.float64) @ per_query_head).to(o_weight.dtype)


# ----------------------------------------------------------------------------------------------------------------
# The artifact

FORMAT = "fdc_ops.calibration"
FORMAT_VERSION = 1
METADATA_FILE = "fdc_artifact.json"
TENSORS_FILE = "fdc_artifact.safetensors"
ORTHONORMALITY_TOLERANCE = 1e-4  # bases are stored in float32: columns orthonormal to ~1e-6; this flags corruption
V_METHODS = ("activation", "weight")


class ArtifactError(ValueError):
    """A calibration artifact that cannot be used: unreadable, corrupt, of another format version or another model."""


@dataclass
class FDCArtifact:
    """Everything the online path needs from calibration, for one model."""

    qk_rotation: torch.Tensor  # (L, H_kv, D, D) float32: columns = rotation R per KV head, by singular value
    qk_singular_values: torch.Tensor  # (L, H_kv, D) float64, descending
    v_basis: torch.Tensor  # (L, H_kv, D, D) float32: orthonormal V_k columns of the chosen V factorization
    v_singular_values: torch.Tensor  # (L, H_kv, D) float64, descending
    key_basis: torch.Tensor  # (L, H_kv, D, D) float32: principal axes of the pre-RoPE keys (the Palu baseline)
    key_singular_values: torch.Tensor  # (L, H_kv, D) float64, descending
    metadata: dict

    @property
    def shape(self) -> AttentionShape:
        return AttentionShape(**self.metadata["shape"])

    def allocate(self, removal_rate: float | None = None, multiple: int = 8, weighting: str | None = None,
                 method: str = "fdc", *, compression: float | None = None) -> RankAllocation:
        """Per-layer, per-KV-head qk and v dims, by one of two budgets (give exactly one):

        ``removal_rate``: the paper's rule (section 5.2), one shared singular-value removal rate for every head
        (``weighting="singular_value"``, the default here); ``weighting="explained_variance"`` applies it to s^2.

        ``compression``: a KV byte budget, the share of the uncompressed K/V cache to remove (0.1 keeps 90% of the
        bytes). The widths are chosen so that ``compression_rate >= compression`` (the cache fits the budget), as
        close to it as the width quantum ``multiple`` allows; ``weighting`` defaults to ``explained_variance`` (the
        removal rate of the s^2 rule that meets the budget, found by bisection).

        ``method="palu"`` sizes the qk dims from the pre-RoPE key spectrum (the widths of the Palu baseline's key
        latent). ``multiple``: the width quantum; the kernels take widths that are multiples of 8 (16-byte rows in
        fp16/bf16), so it must be a positive multiple of 8 for the result to be served."""
        if (removal_rate is None) == (compression is None):
            raise ValueError("fdc_ops.calibration.allocate: give exactly one of removal_rate and compression, got "
                             f"removal_rate={removal_rate}, compression={compression}")
        if compression is not None:
            return self._allocate_compression(compression, multiple, weighting or "explained_variance", method)
        powers = {"singular_value": 1.0, "explained_variance": 2.0}
        weighting = weighting or "singular_value"
        if weighting not in powers:
            raise ValueError(f"fdc_ops: weighting must be one of {sorted(powers)}, got {weighting!r}")
        qk_values = {"fdc": self.qk_singular_values, "palu": self.key_singular_values}.get(method)
        if qk_values is None:
            raise ValueError(f"fdc_ops: method must be 'fdc' or 'palu', got {method!r}")
        power = powers[weighting]
        name = weighting if method == "fdc" else f"palu {weighting}"
        return RankAllocation(kept_dims(qk_values, removal_rate, multiple, power),
                              kept_dims(self.v_singular_values, removal_rate, multiple, power),
                              self.shape.head_dim, name, removal_rate)

    def _allocate_compression(self, compression: float, multiple: int, weighting: str,
                              method: str) -> RankAllocation:
        """The smallest removal rate of the ``weighting`` rule whose allocation removes at least ``compression`` of
        the cache (compression grows with the rate), by bisection."""
        if not 0.0 <= compression < 1.0:
            raise ValueError(f"fdc_ops.calibration.allocate: compression must be in [0, 1), got {compression}")

        def at(rate: float) -> RankAllocation:
            return self.allocate(rate, multiple, weighting, method)

        low, high = 0.0, 1.0 - 1e-9  # removal rate 1 - eps keeps the minimum width everywhere
        if at(low).compression_rate >= compression:
            return dataclasses.replace(at(low), notes={"compression_target": compression})
        if at(high).compression_rate < compression:
            raise ValueError(f"fdc_ops.calibration.allocate: compression {compression} needs fewer than {multiple} "
                             f"dims per head; the most this quantum allows is {at(high).compression_rate:.4f}")
        for _ in range(50):  # 2^-50 of the rate: far below the step at which any head changes width
            middle = (low + high) / 2
            if at(middle).compression_rate >= compression:
                high = middle
            else:
                low = middle
        return dataclasses.replace(at(high), notes={"compression_target": compression})

    def check_model(self, model) -> None:
        """Raises ArtifactError unless the artifact was calibrated on this model (same config and weights)."""
        shape = models.attention_shape(model)
        if shape != self.shape:
            raise ArtifactError(f"fdc_ops: the artifact is for attention shape {self.shape}, the model has {shape}")
        actual = models.fingerprint(model)
        if actual != self.metadata["fingerprint"]:
            raise ArtifactError(f"fdc_ops: the artifact was calibrated on model {self.metadata['model_id']!r} "
                                f"(fingerprint {self.metadata['fingerprint'][:12]}), this model's fingerprint is "
                                f"{actual[:12]}: recalibrate for this model")

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {"qk_rotation": self.qk_rotation, "qk_singular_values": self.qk_singular_values,
                "v_basis": self.v_basis, "v_singular_values": self.v_singular_values, "key_basis": self.key_basis,
                "key_singular_values": self.key_singular_values}

    def save(self, path) -> Path:
        """Writes ``path/fdc_artifact.safetensors`` and ``path/fdc_artifact.json`` (the JSON names the tensors'
        shapes and the sha256 of the tensor file, so a damaged file is caught on load)."""
        from safetensors.torch import save_file

        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        tensors_path = directory / TENSORS_FILE
        save_file({name: t.contiguous() for name, t in self._tensors().items()}, str(tensors_path))
        metadata = dict(self.metadata)
        metadata["tensors"] = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                               for name, t in self._tensors().items()}
        metadata["tensors_sha256"] = _sha256(tensors_path)
        (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
        return directory

    @classmethod
    def load(cls, path, model=None) -> "FDCArtifact":
        """Reads an artifact written by save() and validates it (format and version, checksum, tensor shapes and
        dtypes, finite values, orthonormal bases, sorted singular values); with ``model``, also that it was
        calibrated on that model. Any problem raises ArtifactError naming the file and what is wrong."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(path)
        metadata_path, tensors_path = directory / METADATA_FILE, directory / TENSORS_FILE
        for required in (metadata_path, tensors_path):
            if not required.is_file():
                raise ArtifactError(f"fdc_ops: {required} does not exist (is {directory} an artifact directory?)")
        try:
            metadata = json.loads(metadata_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ArtifactError(f"fdc_ops: {metadata_path} is not valid JSON ({error})") from None
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
            raise ArtifactError(f"fdc_ops: {metadata_path} is not an fdc_ops calibration artifact")
        version = metadata.get("format_version")
        if version != FORMAT_VERSION:
            raise ArtifactError(f"fdc_ops: {metadata_path} has format version {version}; this fdc_ops reads version "
                                f"{FORMAT_VERSION}: recalibrate")
        if _sha256(tensors_path) != metadata.get("tensors_sha256"):
            raise ArtifactError(f"fdc_ops: {tensors_path} does not match the checksum in {metadata_path} "
                                f"(truncated or modified)")
        try:
            tensors = load_file(str(tensors_path))
        except (SafetensorError, OSError, ValueError) as error:
            raise ArtifactError(f"fdc_ops: {tensors_path} cannot be read ({error})") from None
        try:
            shape = AttentionShape(**metadata["shape"])
        except (KeyError, TypeError) as error:
            raise ArtifactError(f"fdc_ops: {metadata_path} has no valid 'shape' ({error})") from None
        L, Hkv, D = shape.num_layers, shape.num_kv_heads, shape.head_dim
        expected = {"qk_rotation": ((L, Hkv, D, D), torch.float32), "qk_singular_values": ((L, Hkv, D), torch.float64),
                    "v_basis": ((L, Hkv, D, D), torch.float32), "v_singular_values": ((L, Hkv, D), torch.float64),
                    "key_basis": ((L, Hkv, D, D), torch.float32), "key_singular_values": ((L, Hkv, D), torch.float64)}
        for name, (want_shape, want_dtype) in expected.items():
            tensor = tensors.get(name)
            if tensor is None:
                raise ArtifactError(f"fdc_ops: {tensors_path} has no tensor {name!r}")
            if tuple(tensor.shape) != want_shape or tensor.dtype != want_dtype:
                raise ArtifactError(f"fdc_ops: {tensors_path}: {name} must be {want_dtype} of shape {want_shape}, got "
                                    f"{tensor.dtype} of shape {tuple(tensor.shape)}")
            if not torch.isfinite(tensor).all():
                raise ArtifactError(f"fdc_ops: {tensors_path}: {name} has non-finite values")
        for name in ("qk_rotation", "v_basis", "key_basis"):
            basis = tensors[name].to(torch.float64)
            error = (basis.transpose(-1, -2) @ basis - torch.eye(D, dtype=torch.float64)).abs().max().item()
            if error > ORTHONORMALITY_TOLERANCE:
                raise ArtifactError(f"fdc_ops: {tensors_path}: {name} columns are not orthonormal (error {error:.2e})")
        for name in ("qk_singular_values", "v_singular_values", "key_singular_values"):
            values = tensors[name]
            if (values < 0).any() or (values[..., 1:] > values[..., :-1]).any():
                raise ArtifactError(f"fdc_ops: {tensors_path}: {name} must be non-negative and descending")
        artifact = cls(**{name: tensors[name] for name in expected}, metadata=metadata)
        if model is not None:
            artifact.check_model(model)
        return artifact


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def artifact_from_statistics(model, stats: CalibrationStatistics, *, v_method: str = "activation",
                             source: dict | None = None) -> FDCArtifact:
    """Rotations and V bases from captured statistics (see calibrate)."""
    if v_method not in V_METHODS:
        raise ValueError(f"fdc_ops: v_method must be one of {V_METHODS}, got {v_method!r}")
    qk_values, qk_rotation = principal_axes(stats.qk_gram("kv_head"))
    if v_method == "activation":
        v_values, v_basis = principal_axes(stats.v_gram)
    else:
        v_values, v_basis = weight_value_axes(model)
    import transformers

    metadata = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "model_id": models.model_id(model),
        "fingerprint": models.fingerprint(model), "shape": dataclasses.asdict(stats.shape),
        "calibration": {**(source or {}), "num_tokens": stats.num_tokens, "seq_len": stats.positions,
                        "v_method": v_method, "qk_mode": "kv_head"},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    key_values, key_basis = principal_axes(stats.key_gram)
    return FDCArtifact(qk_rotation.to(torch.float32), qk_values, v_basis.to(torch.float32), v_values,
                       key_basis.to(torch.float32), key_values, metadata)


def calibrate(model, *, num_tokens: int = 8192, seq_len: int = 1024, seed: int = 0,
              input_ids: torch.Tensor | None = None, source_name: str | None = None, v_method: str = "activation",
              batch_size: int = 1, progress: bool = True) -> FDCArtifact:
    """Calibrates ``model`` (a Hugging Face causal LM of a supported family) and returns its FDCArtifact.

    By default the tokens are ``num_tokens`` uniformly random token ids (``seed``), in sequences of ``seq_len``
    (RoPE statistics depend on position: calibrate up to the positions you serve). ``input_ids``, a 1-D token stream
    or (N, S) sequences of real text (named by ``source_name``), replaces them. ``v_method``: ``activation`` (SVD of the
    captured value rows, Palu-style) or ``weight`` (the paper's SVD of W_V)."""
    if input_ids is None:
        vocab_size = models._text_config(model).vocab_size
        batches = random_token_batches(vocab_size, num_tokens, seq_len, seed, batch_size)
        source = {"source": "random_tokens", "seed": seed}
    else:
        if input_ids.dim() == 1:
            usable = max(seq_len, min(num_tokens, input_ids.numel() // seq_len * seq_len))
            batches = text_token_batches(input_ids, usable, seq_len, batch_size)
        elif input_ids.dim() == 2:
            batches = list(input_ids.split(batch_size))
        else:
            raise ValueError(f"fdc_ops: input_ids must be 1-D or (N, S), got shape {tuple(input_ids.shape)}")
        source = {"source": source_name or "text", "seed": None}
    stats = capture_statistics(model, batches, progress=progress)
    return artifact_from_statistics(model, stats, v_method=v_method, source=source)


def load_or_calibrate(model, tokenizer=None, *, text: str = "random", num_tokens: int = 8192, seq_len: int = 1024,
                      seed: int = 0, v_method: str = "activation", directory=None,
                      progress: bool = True) -> FDCArtifact:
    """The artifact for these settings from the cache (``$FDC_CACHE/artifacts``, keyed by the model's fingerprint and
    the settings), calibrating and saving it on first use. ``text``: ``random`` or a bundled text (needs the
    tokenizer). A cached artifact that fails validation is recalibrated."""
    from . import datasets

    fingerprint = models.fingerprint(model)
    path = Path(directory or models.cache_dir() / "artifacts") / \
        f"{fingerprint[:16]}-{text}-{num_tokens}-{seq_len}-{seed}-{v_method}"
    if path.is_dir():
        try:
            return FDCArtifact.load(path, model=model)
        except ArtifactError as error:
            print(f"recalibrating: the cached artifact is unusable ({error})")
    if text == "random":
        artifact = calibrate(model, num_tokens=num_tokens, seq_len=seq_len, seed=seed, v_method=v_method,
                             progress=progress)
    else:
        if tokenizer is None:
            raise ValueError(f"fdc_ops: calibrating on {text} needs the model's tokenizer")
        artifact = calibrate(model, num_tokens=num_tokens, seq_len=seq_len, input_ids=datasets.text_tokens(
            tokenizer, text), source_name=text, v_method=v_method, progress=progress)
    artifact.save(path)
    return artifact
