"""FDC model classes for vLLM, by composition with vLLM's own: each class is vLLM's own model class for the family
(LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM), built by vLLM's own constructor, with
every decoder layer's self-attention module then replaced by :class:`VllmFDCAttention`, which is made of that module's
own parts (its fused QKV projection, output projection, RoPE and, for Qwen3, per-head q/k RMS norms) plus the FDC
attention layer. vLLM's embeddings, decoder layers, MLPs, weight loading and sampling run unchanged. After the
checkpoint is loaded, the V third of the fused QKV projection becomes A_V (the compressed values come out of the
projection), the output projection becomes W_O' (it takes the c-wide attention outputs), a V bias (Qwen2) moves into
the output bias, and attention runs on the FDC backend (Q/K rotated by R after RoPE, so Qwen3's norms, applied
before RoPE, are untouched; the paged cache holds the packed widths).

The module is replaced after the model is built because vLLM's Qwen2 and Qwen3 decoder layers construct their
attention class by name (no layer or attention type can be passed in, unlike Llama's); one mechanism then serves all
four families.

What is compressed, and how much, comes from the model config's ``fdc`` entry (see :func:`fdc_ops.vllm.hf_overrides`):
the artifact (calibration, fdc_ops.calibration) and the allocation (a KV byte budget ``compression``, the paper's
``removal_rate``, or explicit ``qk_dims``/``v_dims``), resolved exactly as fdc_ops.hf.compress resolves them, so the
same settings give the same widths and the same folded weights as the Hugging Face integration. With ``method``
``"palu"`` in that entry, the same classes serve the Palu baseline instead (:class:`VllmPaluAttention`, the
computation of fdc_ops.hf.compress(..., method="palu")): the K rows of the fused projection give each token's pre-RoPE
key latent, which the paged cache holds, and the keys are rebuilt from it at every step.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, tensor_model_parallel_all_reduce
from vllm.model_executor.models.gemma2 import Gemma2ForCausalLM
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.mistral import MistralForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionType

from .. import identity, ops, parallel
from ..artifact import (
    ArtifactError,
    FDCArtifact,
    RankAllocation,
    fold_key_latent,
    fold_value_and_output,
    key_up_projection,
    mix_kept_columns,
    resolve_allocation,
)
from ..model_families import BY_MODEL_TYPE, unsupported_model_type
from . import METHODS
from .layer import FDCPagedAttention, PaluPagedAttention

CONFIG_KEY = "fdc"
SETTINGS_KEYS = ("artifact", "method", "compression", "removal_rate", "rule", "qk_dims", "v_dims", "kv_dtype")
# The cache formats the fdc entry names (ops.kv_cache_dtype's names), for those vLLM's kv_cache_dtype cannot name:
# int4 codes, two per byte.
ENTRY_KV_DTYPES = ("int4",)


@dataclass(frozen=True)
class FDCSettings:
    artifact: FDCArtifact
    allocation: RankAllocation  # with method "palu", qk_dims are the cached key latent's widths
    method: str = "fdc"  # "fdc" or "palu" (the Palu baseline), as fdc_ops.hf.compress takes it
    # which KV heads each tensor-parallel rank holds (fdc_ops.parallel); None with one rank
    partition: parallel.HeadPartition | None = None
    # the ops' cache dtype the entry's kv_dtype names (ops.kv_cache_dtype); None: as vLLM's kv_cache_dtype says
    cache_dtype: torch.dtype | None = None


def settings(hf_config, ranks: int = 1) -> FDCSettings:
    """The artifact and allocation named by the config's ``fdc`` entry (validated; loaded once per process), and the
    partition of every layer's KV heads over ``ranks`` tensor-parallel ranks."""
    entry = getattr(hf_config, CONFIG_KEY, None)
    if not isinstance(entry, dict):
        raise ValueError(f"fdc_ops.vllm: an FDC model needs an '{CONFIG_KEY}' entry in its config (the artifact "
                         "and the allocation); pass hf_overrides=fdc_ops.vllm.hf_overrides(model, artifact, "
                         "compression=...) to vLLM, or --hf-overrides with its JSON to `vllm serve`")
    unknown = sorted(set(entry) - set(SETTINGS_KEYS))
    if unknown:
        raise ValueError(f"fdc_ops.vllm: unknown keys {unknown} in the config's '{CONFIG_KEY}' entry; known: "
                         f"{', '.join(SETTINGS_KEYS)}")
    if "artifact" not in entry:
        raise ValueError(f"fdc_ops.vllm: the config's '{CONFIG_KEY}' entry names no 'artifact' directory")
    if entry.get("method", "fdc") not in METHODS:
        raise ValueError(f"fdc_ops.vllm: the config's '{CONFIG_KEY}' entry has method {entry['method']!r}; known: "
                         f"{', '.join(METHODS)}")
    if entry.get("kv_dtype") not in (None, *ENTRY_KV_DTYPES):
        raise ValueError(f"fdc_ops.vllm: the config's '{CONFIG_KEY}' entry has kv_dtype {entry['kv_dtype']!r}; "
                         f"known: {', '.join(ENTRY_KV_DTYPES)} (int8 and fp8 are vLLM's kv_cache_dtype "
                         "'int8_per_token_head' and 'fp8_per_token_head')")
    if entry.get("kv_dtype") is not None and entry.get("method") == "palu":
        raise ValueError(f"fdc_ops.vllm: the config's '{CONFIG_KEY}' entry asks for kv_dtype {entry['kv_dtype']!r} "
                         "with the Palu baseline, whose backend rebuilds keys from float latents")
    return _settings(json.dumps(entry, sort_keys=True), ranks)


@functools.lru_cache(maxsize=4)
def _settings(entry_json: str, ranks: int) -> FDCSettings:
    entry = json.loads(entry_json)
    artifact = FDCArtifact.load(entry["artifact"])
    method = entry.get("method", "fdc")
    allocation = resolve_allocation(artifact, method, entry.get("removal_rate"), entry.get("compression"), None,
                                    entry.get("qk_dims"), entry.get("v_dims"), None, entry.get("rule"), False)
    partition = None
    if ranks > 1:
        partition = parallel.balance(allocation.qk_dims, allocation.v_dims, ranks, artifact.shape.num_heads)
    cache_dtype = None if entry.get("kv_dtype") is None else ops.kv_cache_dtype(entry["kv_dtype"])
    return FDCSettings(artifact, allocation, method, partition, cache_dtype)


def _check_shape(hf_config, artifact: FDCArtifact) -> None:
    """The artifact's attention shape against the checkpoint's config (the weights are checked after loading)."""
    shape = identity.attention_shape(hf_config)
    if shape != artifact.shape:
        raise ArtifactError(f"fdc_ops.vllm: the artifact is for attention shape {artifact.shape}, the "
                            f"model has {shape}")


def unsupported(original: nn.Module, model_type: str | None) -> str | None:
    """Why vLLM's attention module ``original`` (of a model of ``model_type``) cannot become a
    VllmCompressedAttention, or None when it can: the plugin computes exactly what the family's Hugging Face module
    computes, and only that."""
    why = unsupported_model_type(model_type)
    if why is not None:
        return why
    family = BY_MODEL_TYPE[model_type]
    if family.vllm_class is None:
        return f"model_type {model_type!r} is not served by the plugin: {family.vllm_refusal}"
    attn_type = getattr(original.attn, "attn_type", AttentionType.DECODER)
    if attn_type != AttentionType.DECODER:
        return f"attention type {getattr(attn_type, 'value', attn_type)!r} is not causal decoder attention"
    if hasattr(original, "q_norm") != family.qk_norm:
        return (f"a {model_type} attention module {'with' if hasattr(original, 'q_norm') else 'without'} per-head "
                "q/k norms is not what the family's Hugging Face module (and so the artifact's calibration) computes")
    if getattr(original, "do_llama_4_scaling", False):
        return "Llama 4 query scaling (config llama_4_scaling) is not supported"
    if getattr(original, "dual_chunk_attention_config", None):
        return "dual chunk attention is not supported"
    return None


class VllmCompressedAttention(nn.Module):
    """One decoder layer's self-attention over compressed heads, made of the parts of vLLM's own attention module for
    the layer (``qkv_proj``, ``o_proj``, ``rotary_emb``, and ``q_norm``/``k_norm`` where the family has them: same
    names, so vLLM's weight loading finds them) and a compressed attention layer in place of its ``attn``: what the
    FDC and Palu modules share (the widths, the V path, the folds of W_V, W_O and a V bias).

    With tensor parallelism, every size here is this rank's: vLLM's module holds the rank's contiguous shard of the
    heads, which (the checkpoint's KV heads being permuted while it loads: FDCModelMixin) are the original KV heads
    ``fdc.partition.heads(layer, rank)``, and this rank's widths, rotations or key bases, and V factors are theirs.

    After :meth:`fold`: ``qkv_proj`` (hidden) -> (H * D + key columns + v_width) = [W_Q | keys | A_V], ``o_proj``
    (G * v_width) -> (hidden) = W_O'."""

    def __init__(self, original: nn.Module, hf_config, fdc: FDCSettings, rank: int = 0):
        super().__init__()
        self.attn_prefix = original.attn.layer_name  # e.g. model.layers.3.self_attn.attn
        reason = unsupported(original, getattr(hf_config, "model_type", None))
        if reason is not None:
            raise NotImplementedError(f"fdc_ops.vllm: layer {self.attn_prefix}: {reason}")
        self.qkv_proj, self.o_proj, self.rotary_emb = original.qkv_proj, original.o_proj, original.rotary_emb
        self.has_qk_norm = hasattr(original, "q_norm")
        if self.has_qk_norm:
            self.q_norm, self.k_norm = original.q_norm, original.k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = original.num_heads, original.num_kv_heads, original.head_dim
        self.q_size, self.kv_size, self.scaling = original.q_size, original.kv_size, original.scaling
        self.sliding_window = original.attn.sliding_window
        # the family's attention logit soft-cap (Gemma 2), from the config as vLLM's own module takes it
        self.logits_soft_cap = getattr(hf_config, "attn_logit_softcapping", None)
        _check_shape(hf_config, fdc.artifact)
        self.layer_index = layer = extract_layer_index(self.attn_prefix)
        self.fdc = fdc
        partition = fdc.partition
        # (H_kv local,) int64: the artifact's indices of this rank's KV heads, in the order its shard holds them
        self.kv_heads = torch.arange(self.num_kv_heads) if partition is None else partition.heads(layer, rank)
        if self.kv_heads.numel() != self.num_kv_heads:
            raise ValueError(f"fdc_ops.vllm: layer {self.attn_prefix}: vLLM gives this rank {self.num_kv_heads} KV "
                             f"heads, the FDC partition {self.kv_heads.numel()}")
        self.v_dims = fdc.allocation.v_dims[layer, self.kv_heads]  # (H_kv local,)
        self.k_dims = fdc.allocation.qk_dims[layer, self.kv_heads]  # (H_kv local,): cached key widths
        # (H_kv local + 1,) int32 CPU prefix sums of the cached key and value widths, as the ops take them
        self.k_offsets, self.v_offsets = ops.prefix_sums(self.k_dims), ops.prefix_sums(self.v_dims)
        # Every rank's page of this layer has the widest rank's width (vLLM needs one spec per layer for all ranks).
        self.page = None if partition is None else (int(partition.page_key_widths[layer]),
                                                    int(partition.page_widths[layer]))
        # vLLM's own Attention layer registered itself under this name; the compressed layer takes its place.
        get_current_vllm_config().compilation_config.static_forward_context.pop(self.attn_prefix)
        # (hidden,): with several ranks and a V bias, this rank's share of the folded V bias (see fold)
        self.register_buffer("output_bias_share", None, persistent=False)
        self.folded = False

    def fold_keys(self, k_weight: torch.Tensor, k_bias: torch.Tensor | None):
        """The K rows of the fused QKV projection after the fold: (weight, bias or None) from the loaded W_K (H_kv * D,
        hidden) and its bias."""
        raise NotImplementedError

    def fold(self) -> None:
        """Replaces the loaded W_K by the method's key projection (:meth:`fold_keys`), W_V by A_V and W_O by W_O', and
        a V bias by the output bias it amounts to (fdc_ops.artifact.fold_value_and_output, float64: what
        fdc_ops.hf.compress does).

        With several ranks, each folds its own heads' shards. The folded V bias is then a sum over all heads, so each
        rank's share must enter the output projection's all-reduce, whereas vLLM's row-parallel output projection
        adds its bias on rank 0 only: the share is kept here and added before the all-reduce, which forward then does
        itself (the projection's own bias, replicated on every rank, stays with rank 0)."""
        layer, heads = self.layer_index, self.kv_heads
        v_encoder, v_decoder = self.fdc.artifact.v_factors(self.fdc.method)
        weight = self.qkv_proj.weight.data  # (q_size + 2 * kv_size, hidden)
        q_weight, k_weight, v_weight = weight.split([self.q_size, self.kv_size, self.kv_size])
        qkv_bias = self.qkv_proj.bias
        q_bias, k_bias, v_bias = (None,) * 3 if qkv_bias is None else qkv_bias.data.split(
            [self.q_size, self.kv_size, self.kv_size])
        key_weight, key_bias = self.fold_keys(k_weight, k_bias)
        sharded = self.fdc.partition is not None
        o_bias = None if self.o_proj.bias is None or sharded else self.o_proj.bias.data
        v_encoder, v_decoder = v_encoder[layer][heads], v_decoder[layer][heads]
        if self.attn.cache_dtype is not None:  # a quantized cache's rows mixed as fdc_ops.hf.compress mixes them
            v_encoder = mix_kept_columns(v_encoder, self.v_dims.tolist(), "v", layer, heads)
            v_decoder = mix_kept_columns(v_decoder, self.v_dims.tolist(), "v", layer, heads)
        folded = fold_value_and_output(v_weight, self.o_proj.weight.data, v_encoder, v_decoder, self.v_dims.tolist(),
                                       self.num_heads // self.num_kv_heads, v_bias, o_bias)
        self.qkv_proj.weight = nn.Parameter(torch.cat([q_weight, key_weight, folded.value_weight]),
                                            requires_grad=False)
        if qkv_bias is not None:
            # A_V carries no bias: the V bias passes through attention unchanged and is folded into o_proj's bias.
            self.qkv_proj.bias = nn.Parameter(torch.cat([q_bias, key_bias, v_bias.new_zeros(self.attn.v_width)]),
                                              requires_grad=False)
        self.o_proj.weight = nn.Parameter(folded.output_weight, requires_grad=False)
        if folded.output_bias is not None:
            if sharded:
                self.output_bias_share = folded.output_bias
                self.o_proj.reduce_results = False
            else:
                self.o_proj.bias = nn.Parameter(folded.output_bias, requires_grad=False)
        self.folded = True

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states: (T, hidden) -> queries (T, H * D) (per-head normalised where the family does), key
        columns (T, width the method's) and compressed values (T, v_width)."""
        if not self.folded:
            raise RuntimeError("fdc_ops.vllm: the compressed projections were not folded (load_weights did not run)")
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, qkv.shape[-1] - self.q_size - self.attn.v_width, self.attn.v_width], dim=-1)
        if self.has_qk_norm:  # Qwen3: RMS norm over each head's D dims, before RoPE
            q = self.q_norm(q.view(q.shape[0], self.num_heads, self.head_dim)).view(q.shape[0], self.q_size)
        return q, k, v

    def output(self, attention: torch.Tensor) -> torch.Tensor:
        """attention: (T, G * v_width) -> (T, hidden) through W_O' (and the rank's V bias share)."""
        output, _ = self.o_proj(attention)
        if self.output_bias_share is not None:  # several ranks and a V bias: o_proj left the all-reduce to this
            output = tensor_model_parallel_all_reduce(output + self.output_bias_share)
        return output


class VllmFDCAttention(VllmCompressedAttention):
    """FDC: keys projected by W_K as loaded, RoPE'd by vLLM, then rotated and truncated by R inside the backend's op
    (the FDC layer); the paged cache holds the packed qk and v widths."""

    def __init__(self, original: nn.Module, hf_config, cache_config, fdc: FDCSettings, rank: int = 0):
        super().__init__(original, hf_config, fdc, rank)
        # (H_kv local, D, max qk dim)
        rotation = fdc.artifact.qk_rotation[self.layer_index, self.kv_heads, :, :int(self.k_dims.max())]
        self.attn = FDCPagedAttention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads,
                                      rotation.to(torch.get_default_dtype()), self.k_offsets, self.v_offsets,
                                      cache_config, self.attn_prefix, self.page, sliding_window=self.sliding_window,
                                      logits_soft_cap=self.logits_soft_cap, cache_dtype=fdc.cache_dtype)
        if self.attn.cache_dtype is not None:  # a quantized cache's rows mixed as fdc_ops.hf.compress mixes them
            self.attn.rotation.copy_(mix_kept_columns(rotation, self.k_dims.tolist(), "qk", self.layer_index,
                                                      self.kv_heads))

    def fold_keys(self, k_weight: torch.Tensor, k_bias: torch.Tensor | None):
        return k_weight, k_bias

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, **unused) -> torch.Tensor:
        """positions: (T,); hidden_states: (T, hidden) (Gemma 3's decoder layer passes its keyword arguments on,
        which its own attention ignores too). Returns (T, hidden)."""
        q, k, v = self.project(hidden_states)  # k: (T, H_kv * D)
        if self.has_qk_norm:
            k = self.k_norm(k.view(k.shape[0], self.num_kv_heads, self.head_dim)).view(k.shape[0], self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.output(self.attn(q, k, v))  # attention: (T, G * v_width)


class VllmPaluAttention(VllmCompressedAttention):
    """The Palu baseline (fdc_ops.hf.modules.PaluAttention's computation): the K rows of the fused projection become
    the key latent's (fdc_ops.artifact.fold_key_latent), the paged cache holds latents and compressed values, and the
    backend rebuilds the keys its queries see every step (up-projection, the family's k norm, RoPE at their
    positions) and attends them at full width."""

    def __init__(self, original: nn.Module, hf_config, cache_config, fdc: FDCSettings, rank: int = 0):
        super().__init__(original, hf_config, fdc, rank)
        self.key_basis = fdc.artifact.key_basis[self.layer_index, self.kv_heads]  # (H_kv local, D, D)
        key_up = key_up_projection(self.key_basis, self.k_dims.tolist()).to(torch.get_default_dtype())
        self.attn = PaluPagedAttention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads, key_up,
                                       self.k_offsets, self.v_offsets, self.k_norm if self.has_qk_norm else None,
                                       self.rotary_emb, cache_config, self.attn_prefix, self.page,
                                       sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap)

    def fold_keys(self, k_weight: torch.Tensor, k_bias: torch.Tensor | None):
        latent = fold_key_latent(k_weight, self.key_basis, self.k_dims.tolist(), k_bias)
        bias = None if latent.latent_bias is None else latent.latent_bias.to(k_weight.dtype)
        return latent.latent_weight.to(k_weight.dtype), bias

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, **unused) -> torch.Tensor:
        """positions: (T,); hidden_states: (T, hidden) (and Gemma 3's keyword arguments, unused). Returns (T,
        hidden)."""
        q, latent, v = self.project(hidden_states)  # latent: (T, k_width)
        q, _ = self.rotary_emb(positions, q, None)
        return self.output(self.attn(q, latent, v))


def padded_pages_warning(page_bytes: list[int], windowed: list[bool], hybrid: bool) -> str | None:
    """What vLLM's hybrid KV cache manager costs a model whose layers are windowed and full (Gemma): it keeps the two
    kinds in separate groups, whose pages must all have one size, and pads every layer's page (``page_bytes``: each
    layer's own, per token) to the widest, so FDC's narrower layers stop saving memory. None where nothing is
    padded."""
    if not hybrid or all(windowed) or not any(windowed) or len(set(page_bytes)) <= 1:
        return None
    widest, needed = max(page_bytes), sum(page_bytes)
    unused = 1 - needed / (widest * len(page_bytes))
    return (f"fdc_ops.vllm: windowed and full layers are in separate KV cache groups, and vLLM pads every layer's page "
            f"to the widest ({widest} bytes a token; the layers need {needed / len(page_bytes):.0f} on average), so "
            f"{unused:.0%} of the KV cache holds padding. disable_hybrid_kv_cache_manager=True gives each layer its "
            "own page size, but keeps the pages behind the windows")


# A layer's attention tensors in a Hugging Face checkpoint, which the artifact's identity records (under the name
# group(1) + group(2): fdc_ops.hf.families.attention_tensors' names).
_IDENTITY_NAME = re.compile(r"^model\.(layers\.\d+\.)self_attn\.([qkvo]_proj\.(?:weight|bias)|[qk]_norm\.weight)$")
# The per-head tensors of a layer's attention in a Hugging Face checkpoint: their heads are permuted while vLLM loads
# them when there are several tensor-parallel ranks. group(3): weight or bias; o_proj's bias is not per head.
_HEAD_TENSOR_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)$")


class FDCModelMixin:
    """What turns one of vLLM's causal LM classes into its FDC class (put first among the bases): after vLLM's own
    constructor, every decoder layer's attention becomes a VllmFDCAttention (a VllmPaluAttention with method
    "palu"); after vLLM's own weight loading, the
    artifact is checked against the checkpoint's tensors and the projections are folded.

    Tensor parallelism: vLLM gives rank ``r`` the contiguous KV heads ``[r * n, (r + 1) * n)`` of every layer (with
    their query heads and W_O columns). FDC's heads differ in width, so the plugin permutes each layer's KV heads in
    the checkpoint's tensors as vLLM loads them (rows of W_Q, W_K, W_V and their biases, columns of W_O), by the
    per-layer balanced order of fdc_ops.parallel.balance; the contiguous shards are then the balanced sets, and each
    rank takes the artifact's rotations, V factors and widths of its own heads. The model computes what it computes
    on one rank (attention is per head; the output projection sums over heads). Every rank's KV cache page of a layer
    is as wide as that layer's widest rank share: vLLM requires the same KV cache spec for a layer on every rank."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        ranks = vllm_config.parallel_config.tensor_parallel_size
        shape = identity.attention_shape(vllm_config.model_config.hf_config)
        # Before vLLM's constructor, which would replicate KV heads over ranks when there are more ranks than heads.
        parallel.check_ranks(shape.num_heads, shape.num_kv_heads, ranks)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if vllm_config.quant_config is not None:
            raise NotImplementedError("fdc_ops.vllm: FDC folds A_V and W_O' into unquantized projections; quantized "
                                      "checkpoints are not supported")
        fdc = settings(self.config, ranks)
        rank = get_tensor_model_parallel_rank() if ranks > 1 else 0
        attention = VllmPaluAttention if fdc.method == "palu" else VllmFDCAttention
        for layer in self.model.layers:
            if hasattr(layer, "self_attn"):  # pipeline stages hold placeholders for other stages' layers
                layer.self_attn = attention(layer.self_attn, self.config, vllm_config.cache_config, fdc, rank)
        self.fdc_settings = fdc
        paged = [layer.self_attn.attn for layer in self.model.layers
                 if isinstance(getattr(layer, "self_attn", None), VllmCompressedAttention)]
        warning = padded_pages_warning([layer.page_bytes_per_token() for layer in paged],
                                       [layer.sliding_window is not None for layer in paged],
                                       not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)
        if warning is not None:
            warnings.warn(warning, RuntimeWarning, stacklevel=2)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's loading of the Hugging Face checkpoint (each layer's KV heads permuted by the balanced order when
        there are several ranks), then the folds; the artifact is checked against the checkpoint's own attention
        tensors as they stream in (their digests, as fdc_ops.artifact.FDCArtifact.check_model compares a Hugging
        Face model's)."""
        config = self.config
        artifact = self.fdc_settings.artifact
        recorded = artifact.metadata["identity"]
        found: dict[str, tuple[str, str, str]] = {}
        partition = self.fdc_settings.partition
        permuted: set[tuple[int, str]] = set()

        def recording(stream):
            for name, tensor in stream:
                match = _IDENTITY_NAME.match(name)
                if match:
                    canonical = match.group(1) + match.group(2)
                    found[canonical] = identity.compared_digest(recorded, canonical, tensor)
                match = _HEAD_TENSOR_NAME.match(name)
                if partition is not None and match and name != f"model.layers.{match.group(1)}.self_attn.o_proj.bias":
                    layer, part, kind = int(match.group(1)), match.group(2), match.group(3)
                    tensor = parallel.permute_heads(tensor, partition.order[layer], dim=1 if part == "o" else 0)
                    permuted.add((layer, f"{part}_proj.{kind}"))
                yield name, tensor

        loaded = super().load_weights(recording(weights))
        artifact.check_identity(identity.text_config(config), found, "this checkpoint")
        attention = [(index, layer.self_attn) for index, layer in enumerate(self.model.layers)
                     if isinstance(getattr(layer, "self_attn", None), VllmCompressedAttention)]
        if partition is not None:
            # Every tensor a shard is cut from must have been permuted, or a rank would hold other heads than its own.
            unpermuted = [(index, name) for index, module in attention
                          for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
                          + (("q_proj.bias", "k_proj.bias", "v_proj.bias") if module.qkv_proj.bias is not None else ())
                          if (index, name) not in permuted]
            if unpermuted:
                raise ArtifactError(
                    f"fdc_ops.vllm: with tensor_parallel_size={partition.ranks}, each layer's KV heads are permuted "
                    f"as the checkpoint loads, but these tensors were not found under their Hugging Face names "
                    f"(model.layers.N.self_attn.q_proj.weight, ...): {unpermuted[:6]}")
        for _, module in attention:
            module.fold()
        return loaded


class FDCLlamaForCausalLM(FDCModelMixin, LlamaForCausalLM):
    """vLLM's LlamaForCausalLM (Llama, and checkpoints vLLM maps to it, such as SmolLM2) with FDC attention."""


class FDCMistralForCausalLM(FDCModelMixin, MistralForCausalLM):
    """vLLM's MistralForCausalLM (Hugging Face Mistral checkpoints, with or without a sliding window) with FDC
    attention."""


class FDCQwen2ForCausalLM(FDCModelMixin, Qwen2ForCausalLM):
    """vLLM's Qwen2ForCausalLM (QKV bias: the V bias is folded into the output bias) with FDC attention."""


class FDCQwen3ForCausalLM(FDCModelMixin, Qwen3ForCausalLM):
    """vLLM's Qwen3ForCausalLM (per-head q/k norms before RoPE, kept as they are) with FDC attention."""


class FDCGemma2ForCausalLM(FDCModelMixin, Gemma2ForCausalLM):
    """vLLM's Gemma2ForCausalLM (windowed and full layers by turns, soft-capped attention logits, a query scale of
    its own) with FDC attention."""


class FDCGemma3ForCausalLM(FDCModelMixin, Gemma3ForCausalLM):
    """vLLM's Gemma3ForCausalLM, the text model (per-head q/k norms before RoPE, a RoPE of its own for the windowed
    layers, windowed and full layers by turns) with FDC attention."""
