"""What FDC needs to know about a Hugging Face causal LM: its attention shape, each layer's attention weights in one
form for every supported family, a fingerprint that ties an artifact to a model.

Supported families: Llama, Mistral, Qwen2, Qwen3 (separate q/k/v projections, optional biases, Qwen3's per-head
q/k norms before RoPE) and Phi-3 (one fused ``qkv_proj``, optionally partial rotary). Everything here reads the
modules; nothing changes them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
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


#: The dtypes an artifact records digests of the attention weights in (docs/design.md section 5, "Which model an
#: artifact is for"), most precise first: a model is compared in the least precise of its own dtype and the dtype the
#: artifact was calibrated in, which both reach by one rounding of the same checkpoint.
DIGEST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DIGEST_HEX = 32  # 128 bits of sha256 per tensor: collisions are out of reach, the artifact's JSON stays small
DIGEST_WORKERS = max(1, min(8, os.cpu_count() or 1))  # sha256 releases the GIL: tensors hash in parallel


def config_description(config) -> dict:
    """The attention-relevant fields of a (text) config, as a model's identity records them."""
    fields = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")
    return json.loads(json.dumps({name: getattr(config, name, None) for name in fields}, sort_keys=True,
                                 default=str))


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


def digest_dtype(dtype: torch.dtype) -> torch.dtype:
    """The digest dtype that holds ``dtype``'s values (float64 weights are compared as float32)."""
    if dtype in DIGEST_DTYPES:
        return dtype
    if dtype == torch.float64:
        return torch.float32
    raise ValueError(f"fdc_ops: attention weights of dtype {dtype} cannot be fingerprinted (float32, float16, "
                     "bfloat16 or float64)")


def least_precise(first: torch.dtype, second: torch.dtype) -> torch.dtype:
    """Of two digest dtypes, the one with fewer significand bits (float32 > float16 > bfloat16)."""
    return max(digest_dtype(first), digest_dtype(second), key=DIGEST_DTYPES.index)


def tensor_digest(tensor: torch.Tensor, dtype: torch.dtype) -> str:
    """sha256 (first 128 bits, hex) of ``tensor``'s values rounded to ``dtype``, row-major, as raw bytes."""
    values = tensor.detach().to("cpu", dtype).contiguous()
    return hashlib.sha256(values.view(torch.uint8).numpy() if values.numel() else b"").hexdigest()[:_DIGEST_HEX]


def tensor_digests(tensors: dict[str, torch.Tensor], dtypes) -> dict[str, dict[str, str]]:
    """{name: {"float32": hex, ...}} for every tensor in each of ``dtypes`` (names of torch dtypes)."""
    jobs = [(name, dtype) for name in tensors for dtype in dtypes]
    with concurrent.futures.ThreadPoolExecutor(DIGEST_WORKERS) as pool:
        results = pool.map(lambda job: tensor_digest(tensors[job[0]], getattr(torch, job[1])), jobs)
        digests: dict[str, dict[str, str]] = {name: {} for name in tensors}
        for (name, dtype), digest in zip(jobs, results):
            digests[name][dtype] = digest
    return digests


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_identity(model) -> dict:
    """What an artifact records of the model it was calibrated on: the config's attention fields, the dtype of its
    attention weights, and every attention tensor's digest in each of DIGEST_DTYPES (``weights``)."""
    tensors = attention_tensors(model)
    return {"config": config_description(text_config(model)),
            "dtype": _dtype_name(digest_dtype(next(iter(tensors.values())).dtype)),
            "weights": tensor_digests(tensors, [_dtype_name(dtype) for dtype in DIGEST_DTYPES])}


def fingerprint(model) -> str:
    """A key for the checkpoint a model was loaded from: sha256 of the attention config fields and every attention
    tensor's bfloat16 digest, so float32 and bfloat16 loads of a float32 or bfloat16 checkpoint share it. The
    artifact cache is keyed by it; an artifact records more (weight_identity) and is checked against a model by
    :func:`identity_mismatch`."""
    tensors = attention_tensors(model)
    described = {"config": config_description(text_config(model)),
                 "weights": {name: digest for name, digest in
                             ((name, tensor_digest(tensor, torch.bfloat16)) for name, tensor in tensors.items())}}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def compared_digest(identity: dict, name: str, tensor: torch.Tensor) -> tuple[str, str, str]:
    """(the tensor's dtype, the dtype it is compared in, its digest in that dtype) for :func:`identity_mismatch`:
    compared in the least precise of its dtype and the dtype the artifact was calibrated in."""
    dtype = least_precise(tensor.dtype, getattr(torch, identity["dtype"]))
    return _dtype_name(digest_dtype(tensor.dtype)), _dtype_name(dtype), tensor_digest(tensor, dtype)


def compared_digests(identity: dict, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, str, str]]:
    """compared_digest of every tensor, in parallel."""
    with concurrent.futures.ThreadPoolExecutor(DIGEST_WORKERS) as pool:
        return dict(zip(tensors, pool.map(lambda name: compared_digest(identity, name, tensors[name]), tensors)))


def identity_mismatch(identity: dict, config, found: dict[str, tuple[str, str, str]]) -> str | None:
    """Why a model (its text ``config``, and compared_digest of each of its attention_tensors) is not the one
    ``identity`` (weight_identity) describes, or None when it is: the config fields and every tensor, so one artifact
    serves float32, bfloat16 and float16 loads of its checkpoint and any change to any layer's attention weights is
    caught."""
    if config_description(config) != identity["config"]:
        return "its config's attention fields differ"
    recorded = identity["weights"]
    if sorted(found) != sorted(recorded):
        missing, extra = sorted(set(recorded) - set(found)), sorted(set(found) - set(recorded))
        return f"its attention tensors differ in name (missing {missing[:3]}, unexpected {extra[:3]})"
    changed = [name for name in sorted(found, key=_layer_order) if found[name][2] != recorded[name][found[name][1]]]
    if not changed:
        return None
    served, compared, _ = found[changed[0]]
    hint = (f" (calibrated in {identity['dtype']}, loaded in {served}: the two roundings of a float32 checkpoint "
            "differ; calibrate in float32 or in the dtype served)"
            if {served, identity["dtype"]} == {"float16", "bfloat16"} else "")
    return f"{len(changed)} of its {len(found)} attention tensors differ, first {changed[0]} (in {compared}){hint}"


def _layer_order(name: str) -> tuple[int, str]:
    _, layer, rest = name.split(".", 2)
    return int(layer), rest


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
