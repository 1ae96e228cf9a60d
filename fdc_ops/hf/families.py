"""What FDC needs to know about a Hugging Face causal LM: its attention shape, each layer's attention weights in one
form for every supported family, a fingerprint that ties an artifact to a model.

Supported families: Llama, Mistral, Qwen2, Qwen3 (separate q/k/v projections, optional biases, Qwen3's per-head
q/k norms before RoPE), Phi-3 (one fused ``qkv_proj``, optionally partial rotary), Gemma 2 and Gemma 3's text model
(q/k norms as Qwen3, a RoPE of its own for its local layers); sliding windows (Mistral, Qwen2's
``use_sliding_window``, Gemma 2's and 3's local layers) and logit soft-capping (Gemma 2) per layer.
Everything here reads the modules; nothing changes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from dataclasses import dataclass

import torch

from .. import identity, model_families
from ..identity import AttentionShape


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
    return identity.text_config(model.config)


def check_supported(model) -> None:
    config = text_config(model)
    why = model_families.unsupported_model_type(getattr(config, "model_type", None))
    if why is None and getattr(config, "use_bidirectional_attention", False):
        # Gemma 3 configs for embedding models (EmbeddingGemma) attend both ways, the attention ops causally.
        why = "use_bidirectional_attention (queries that see later keys) is not supported: the ops attend causally"
    if why is not None:
        raise ValueError(f"fdc_ops: {why}")


def layer_window(config, layer: int) -> int:
    """The ``window_left`` of the ops for decoder layer ``layer`` (-1: full attention): a sliding window of W
    positions (the query's own included) is W - 1. Layers are windowed as the family's own attention does it: by
    ``layer_types`` where the config has them (Qwen2 with ``use_sliding_window``, Gemma 2), otherwise every layer when
    ``sliding_window`` is set (Mistral)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return -1
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window - 1 if layer_types[layer] == "sliding_attention" else -1
    return window - 1 if getattr(config, "use_sliding_window", True) else -1


def logit_softcap(config) -> float:
    """The attention logits' soft-cap (Gemma 2's ``attn_logit_softcapping``), 0 for none."""
    return float(getattr(config, "attn_logit_softcapping", None) or 0.0)


def next_token_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The causal LM's logits from its decoder's final hidden states (..., hidden), as its own forward computes them:
    the output embedding, then the final soft-cap (Gemma 2's and 3's ``final_logit_softcapping``) where the config
    sets one. Lets a caller compute them a few tokens at a time (a vocabulary-wide row per token is the largest
    tensor of a pass)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(text_config(model), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def attention_shape(model) -> AttentionShape:
    return identity.attention_shape(model.config)


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


def attention_tensors(model) -> dict[str, torch.Tensor]:
    """Every layer's attention weights under the names of a Hugging Face checkpoint, without the ``model.`` prefix
    and ``self_attn.``: ``layers.3.k_proj.weight`` (Phi-3's fused qkv_proj is split into q, k and v), biases and
    Qwen3's ``q_norm.weight`` / ``k_norm.weight`` where the family has them."""
    shape = attention_shape(model)
    tensors = {}
    for index, module in enumerate(attention_modules(model)):
        weights = attention_weights(module, shape)
        for part in "qkvo":
            for kind in ("weight", "bias"):
                tensor = getattr(weights, f"{part}_{kind}")
                if tensor is not None:
                    tensors[f"layers.{index}.{part}_proj.{kind}"] = tensor
        for norm in ("q_norm", "k_norm"):
            weight = getattr(getattr(module, norm, None), "weight", None)
            if isinstance(weight, torch.Tensor):
                tensors[f"layers.{index}.{norm}.weight"] = weight
    return tensors


def weight_identity(model) -> dict:
    """What an artifact records of the model it was calibrated on: the config's attention fields, the dtype of its
    attention weights, and every attention tensor's digest in each of DIGEST_DTYPES (``weights``)."""
    tensors = attention_tensors(model)
    return {"config": identity.config_description(text_config(model)),
            "dtype": identity.dtype_name(identity.digest_dtype(next(iter(tensors.values())).dtype)),
            "weights": identity.tensor_digests(tensors, [identity.dtype_name(d) for d in identity.DIGEST_DTYPES])}


def fingerprint(model) -> str:
    """A key for the checkpoint a model was loaded from: sha256 of the attention config fields and every attention
    tensor's bfloat16 digest, so float32 and bfloat16 loads of a float32 or bfloat16 checkpoint share it. The
    artifact cache is keyed by it; an artifact records more (weight_identity) and is checked against a model by
    :func:`fdc_ops.identity.identity_mismatch`."""
    tensors = attention_tensors(model)
    described = {"config": identity.config_description(text_config(model)),
                 "weights": {name: identity.tensor_digest(tensor, torch.bfloat16) for name, tensor in tensors.items()}}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


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
