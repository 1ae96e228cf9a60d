"""What FDC needs to know about a Hugging Face causal LM: its attention shape, each layer's attention weights in one
form for every supported family, a fingerprint that ties an artifact to a model.

Supported families: Llama, Mistral, Qwen2, Qwen3 (separate q/k/v projections, optional biases, Qwen3's per-head
q/k norms before RoPE) and Phi-3 (one fused ``qkv_proj``, optionally partial rotary). Everything here reads the
modules; nothing changes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


@dataclass(frozen=True)
class AttentionShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass
class AttentionWeights:
    """One layer's projections in ``y = x @ weight.T + bias`` form (nn.Linear's), heads concatenated."""

    q_weight: torch.Tensor  # (H * D, hidden)
    k_weight: torch.Tensor  # (H_kv * D, hidden)
    v_weight: torch.Tensor  # (H_kv * D, hidden)
    o_weight: torch.Tensor  # (hidden, H * D)
    q_bias: torch.Tensor | None  # (H * D,)
    k_bias: torch.Tensor | None  # (H_kv * D,)
    v_bias: torch.Tensor | None  # (H_kv * D,)
    o_bias: torch.Tensor | None  # (hidden,)


def text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_supported(model) -> None:
    model_type = getattr(text_config(model), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"fdc_ops: model_type {model_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def attention_shape(model) -> AttentionShape:
    config = text_config(model)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"fdc_ops: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    return AttentionShape(config.num_hidden_layers, heads, kv_heads, head_dim, config.hidden_size)


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    check_supported(model)
    modules = [layer.self_attn for layer in model.get_decoder().layers]
    for index, module in enumerate(modules):
        if getattr(module, "layer_idx", index) != index:
            raise ValueError(f"fdc_ops: attention module {index} reports layer_idx {module.layer_idx}")
    return modules


def attention_weights(module: torch.nn.Module, shape: AttentionShape) -> AttentionWeights:
    q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    if hasattr(module, "qkv_proj"):
        weight, bias = module.qkv_proj.weight, module.qkv_proj.bias
        q_weight, k_weight, v_weight = weight.split([q_rows, kv_rows, kv_rows], dim=0)
        q_bias, k_bias, v_bias = bias.split([q_rows, kv_rows, kv_rows]) if bias is not None else (None,) * 3
    else:
        q_weight, k_weight, v_weight = module.q_proj.weight, module.k_proj.weight, module.v_proj.weight
        q_bias, k_bias, v_bias = module.q_proj.bias, module.k_proj.bias, module.v_proj.bias
    return AttentionWeights(q_weight, k_weight, v_weight, module.o_proj.weight, q_bias, k_bias, v_bias,
                            module.o_proj.bias)


def fingerprint(model) -> str:
    """sha256 over the attention-relevant config fields and the first and last layers' attention weights: two
    checkpoints that share a config (a base model and its fine-tune) still get different fingerprints."""
    config = text_config(model)
    fields = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")
    described = {name: getattr(config, name, None) for name in fields}
    digest = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode())
    shape = attention_shape(model)
    modules = attention_modules(model)
    for module in (modules[0], modules[-1]):
        weights = attention_weights(module, shape)
        for tensor in (weights.q_weight, weights.k_weight, weights.v_weight):
            digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def model_id(model) -> str:
    return str(getattr(model.config, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "unknown")


_override_counter = 0


@contextlib.contextmanager
def override_attention(model, function):
    """Routes every attention call of ``model`` through ``function(module, query, key, value, attention_mask,
    original, **kwargs)`` while the context is open, where query is post-RoPE ``(B, H, S, D)``, key and value are
    ``(B, H_kv, S, D)`` and ``original`` is the model's own attention function (same signature without
    ``original``). The masks are built exactly as for the model's own implementation, so a function that calls
    ``original`` leaves the model's outputs unchanged. Uses transformers' public AttentionInterface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    global _override_counter
    config = text_config(model)
    attention_modules(model)
    implementation = config._attn_implementation or "eager"
    if implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"fdc_ops: attention implementation {implementation!r} has no mask function to reuse")
    _override_counter += 1
    name = f"fdc_override_{_override_counter}"

    def route(module, query, key, value, attention_mask, **kwargs):
        if implementation in ALL_ATTENTION_FUNCTIONS:
            original = ALL_ATTENTION_FUNCTIONS[implementation]
        else:
            original = sys.modules[type(module).__module__].eager_attention_forward
        return function(module, query, key, value, attention_mask, original, **kwargs)

    AttentionInterface.register(name, route)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = implementation
        # register() only adds to the class-level mappings; drop this context's entries so none accumulate.
        for interface in (AttentionInterface, AttentionMaskInterface):
            interface._global_mapping.pop(name, None)
