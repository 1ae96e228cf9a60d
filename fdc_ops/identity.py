"""Which model an artifact is for, without any model library (docs/design.md section 5, "Which model an artifact
is for"): the attention shape of a (text) config, the config fields an identity records, the digests of attention
tensors in each dtype and their comparison. The Hugging Face side (fdc_ops.hf.families) reads a model's config and
tensors and hands them here; the vLLM plugin hands the checkpoint's config and tensors as they stream in."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from dataclasses import dataclass

import torch


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


def text_config(config):
    """The text model's config of ``config`` (a multimodal config's decoder part; a text config itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_shape(config) -> AttentionShape:
    """The attention shape a (text) config describes."""
    config = text_config(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads:
        raise ValueError(f"fdc_ops: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    return AttentionShape(config.num_hidden_layers, heads, kv_heads, head_dim, config.hidden_size)


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def compared_digest(identity: dict, name: str, tensor: torch.Tensor) -> tuple[str, str, str]:
    """(the tensor's dtype, the dtype it is compared in, its digest in that dtype) for :func:`identity_mismatch`:
    compared in the least precise of its dtype and the dtype the artifact was calibrated in."""
    dtype = least_precise(tensor.dtype, getattr(torch, identity["dtype"]))
    return dtype_name(digest_dtype(tensor.dtype)), dtype_name(dtype), tensor_digest(tensor, dtype)


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
