"""Tiny random-weight Hugging Face models of every supported family (2 layers, 4 query / 2 KV heads, head_dim 16),
one of the bundled Qwen2.5-Coder-1.5B's shape (TINY_MODELS' "qwen2_coder"), and a hand computation of their post-RoPE
queries and keys, for the calibration and model tests."""

from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
HEAD_DIM = 16
#: The families, and "qwen2_coder": a Qwen2 of Qwen2.5-Coder-1.5B's attention shape (12 query / 2 KV heads, 6:1 GQA,
#: head_dim 128, q/k/v biases, RoPE base 1e6), 2 layers, random weights; hidden width and vocabulary large enough
#: that a calibration sees full-rank values (the first layer's inputs are as many as the distinct tokens). The model
#: tests' guarantees run on each.
TINY_MODELS = FAMILIES + ("qwen2_coder",)


def tiny_model(family: str, seed: int = 0, **overrides):
    import transformers

    common = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=512, tie_word_embeddings=False)
    specific = {
        "llama": (transformers.LlamaConfig, {"attention_bias": True}),
        "mistral": (transformers.MistralConfig, {"sliding_window": None}),
        "qwen2": (transformers.Qwen2Config, {}),
        "qwen2_coder": (transformers.Qwen2Config, {"hidden_size": 128, "vocab_size": 512, "num_attention_heads": 12,
                                                   "num_key_value_heads": 2, "head_dim": 128,
                                                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
        "qwen3": (transformers.Qwen3Config, {}),
        # Phi-3: fused qkv_proj, and rotary on the first half of each head only
        "phi3": (transformers.Phi3Config, {"partial_rotary_factor": 0.5, "pad_token_id": 0, "bos_token_id": 1,
                                           "eos_token_id": 2}),
        # Gemma 2 (tests/hf/test_hf_windows.py): windowed and full layers by turns, logits soft-capped at a value the
        # tiny model's scores reach, a query scale that is not 1 / sqrt(head_dim)
        "gemma2": (transformers.Gemma2Config, {"attn_logit_softcapping": 2.0, "query_pre_attn_scalar": 24,
                                               "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
        # Gemma 3's text model (tests/hf/test_hf_windows.py): a windowed layer then a full one, per-head q/k norms, the
        # windowed layers' RoPE on a base of its own, a query scale that is not 1 / sqrt(head_dim)
        "gemma3": (transformers.Gemma3TextConfig, {"query_pre_attn_scalar": 24, "pad_token_id": 0, "bos_token_id": 1,
                                                   "eos_token_id": 2,
                                                   "layer_types": ["sliding_attention", "full_attention"]}),
    }
    config_class, extra = specific[family]
    config = config_class(**{**common, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger-than-default weights make the attention patterns far from uniform
        for name, parameter in model.named_parameters():
            if "proj" in name:
                parameter.normal_(0, 0.15)
    return model


def rope_settings(config) -> tuple[float, float]:
    """(theta, partial rotary factor), wherever this transformers version keeps them."""
    parameters = getattr(config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta", getattr(config, "rope_theta", None))
    partial = parameters.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return float(theta), float(partial)


def hand_rope(x: torch.Tensor, positions: torch.Tensor, theta: float, partial: float) -> torch.Tensor:
    """Rotates (..., S, D) by the rotate-half RoPE on its first ``partial * D`` dims, in float64."""
    D = x.shape[-1]
    rotary = int(D * partial)
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    head, tail = x[..., :rotary].to(torch.float64), x[..., rotary:].to(torch.float64)
    rotated_half = torch.cat([-head[..., rotary // 2:], head[..., : rotary // 2]], -1)
    return torch.cat([head * cos + rotated_half * sin, tail], -1)


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight.detach().to(torch.float64)


def hand_qkv(model, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-RoPE q (B, H, S, D), k and v (B, H_kv, S, D) of one layer from its input hidden states (B, S, hidden),
    computed from the weights, float64."""
    from fdc_ops.hf import families

    shape = families.attention_shape(model)
    module = families.attention_modules(model)[layer]
    weights = families.attention_weights(module, shape)
    x = hidden.to(torch.float64)
    B, S, _ = x.shape

    def project(weight, bias, heads):
        y = x @ weight.detach().to(torch.float64).T
        if bias is not None:
            y = y + bias.detach().to(torch.float64)
        return y.view(B, S, heads, shape.head_dim).transpose(1, 2)

    q = project(weights.q_weight, weights.q_bias, shape.num_heads)
    k = project(weights.k_weight, weights.k_bias, shape.num_kv_heads)
    v = project(weights.v_weight, weights.v_bias, shape.num_kv_heads)
    if hasattr(module, "q_norm"):  # Qwen3 normalises each head before RoPE
        q, k = rms_norm(q, module.q_norm), rms_norm(k, module.k_norm)
    theta, partial = rope_settings(model.config)
    positions = torch.arange(S)
    return hand_rope(q, positions, theta, partial), hand_rope(k, positions, theta, partial), v


def hand_key_projection(model, layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE keys (B, H_kv, S, D) as the K projection outputs them (bias included, before any norm), float64."""
    from fdc_ops.hf import families

    shape = families.attention_shape(model)
    weights = families.attention_weights(families.attention_modules(model)[layer], shape)
    keys = hidden.to(torch.float64) @ weights.k_weight.detach().to(torch.float64).T
    if weights.k_bias is not None:
        keys = keys + weights.k_bias.detach().to(torch.float64)
    return keys.unflatten(-1, (shape.num_kv_heads, shape.head_dim)).transpose(1, 2)


def layer_inputs(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The hidden states each attention layer receives (B, S, hidden), from a plain forward pass."""
    from fdc_ops.hf import families

    captured = []
    hooks = [module.register_forward_pre_hook(
        lambda module, args, kwargs: captured.append(
            (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach().clone()),
        with_kwargs=True) for module in families.attention_modules(model)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return captured
