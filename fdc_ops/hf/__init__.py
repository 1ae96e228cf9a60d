"""Hugging Face integration: swap a model's attention for FDC (or the Palu baseline) in place, undo it, and measure
the KV cache a generation holds.

    model, tokenizer = fdc_ops.hf.loading.load_model()
    artifact = fdc_ops.calibration.calibrate(model, tokenizer)    # Wikipedia text; text="random" for the paper's
    allocation = fdc_ops.hf.compress(model, artifact, compression=0.1)   # or removal_rate=0.05 (the paper's rule)
    cache = transformers.DynamicCache()
    model.generate(**inputs, **{fdc_ops.hf.cache_keyword(model): cache})   # or let generate() create the cache
    fdc_ops.hf.kv_cache_nbytes(cache)

The per-family knowledge (which projections exist, Phi-3's fused qkv_proj, Qwen3's per-head norms, each family's
RoPE function with its partial rotary) lives in fdc_ops.hf.families and in the modules' use of the family's own
``apply_rotary_pos_emb``; everything else is shared. Importing this package refuses a transformers release outside
the tested range (fdc_ops.supported.TRANSFORMERS; fdc_ops.hf.compat).
"""

from __future__ import annotations

import torch

from . import compat

compat.check_transformers()

from .. import artifact as artifacts  # noqa: E402
from .. import eviction as evictions  # noqa: E402
from .. import ops  # noqa: E402
from ..artifact import resolve_allocation  # noqa: E402  (fdc_ops.hf.resolve_allocation, as before; vLLM's too)
from . import families  # noqa: E402
from .compat import cache_keyword, returned_cache  # noqa: E402,F401  (re-exported for step-by-step callers)
from .modules import CompressedKVLayer, FDCAttention, PaddingState, PaluAttention  # noqa: E402
from .saving import load_compressed, save_compressed  # noqa: E402,F401

METHODS = ("fdc", "palu")


def compress(model, artifact: artifacts.FDCArtifact | str, removal_rate: float | None = None, *,
             compression: float | None = None, allocation: artifacts.RankAllocation | None = None, qk_dims=None,
             v_dims=None, method: str = "fdc", weighting: str | None = None, rule: str | None = None,
             uniform: bool = False, eviction: str | evictions.EvictionPolicy | None = None,
             keep: float | None = None, kv_dtype: torch.dtype | str | None = None) -> artifacts.RankAllocation:
    """Replaces every attention module of ``model`` in place by FDCAttention (``method="fdc"``) or the Palu baseline
    (``method="palu"``; ``qk_dims`` are then the widths of the cached key latent). Widths: a KV byte budget
    (``compression=0.1`` removes at least 10% of the cache, widths by ``rule``, default the measured sensitivities:
    ``calibration.FDCArtifact.allocate(compression=...)``), one removal
    rate (the paper's rule on the artifact's singular values; ``weighting="explained_variance"`` uses s^2), an
    allocation, or explicit (L, H_kv) ``qk_dims`` and ``v_dims``; ``uniform=True`` gives every head the mean width
    (the /AC ablation). ``artifact``: an FDCArtifact, or ``"bundled"`` for the bundled SmolLM2's. ``eviction``:
    after each prompt, keep ``keep`` of its tokens in every layer's cache, chosen by ``"keyformer"`` or
    ``"snapkv"`` scores (or an fdc_ops.eviction.EvictionPolicy for its other settings; dynamic caches only, models
    without sliding windows). ``kv_dtype``: ``"int8"``, ``"float8_e4m3fn"`` or ``"int4"`` (or the dtypes
    fdc_ops.ops.kv_cache_dtype maps them to) stores the compressed cache quantized (a float32 scale per token and KV
    head, int4 two codes per byte, fdc_ops.ops; the CPU ops read it in place), each KV head's
    kept dims mixed by a fixed random rotation folded into the weights, so that no outlier dim sets a row's scale
    (artifacts.mix_kept_columns): the prompt's own attention uses its unquantized rows, later tokens read the
    quantized ones (on the CPU, so far; Palu's latent and values are dequantized
    whole at each call, as its keys are rebuilt whole: the paper's KVQ-P, for accuracy). Returns the allocation
    used. generate() and forward() work unchanged; fdc_ops.hf.restore undoes it."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"fdc_ops.hf.compress: method must be one of {METHODS}, got {method!r}")
    if not hasattr(model, "get_decoder") or not hasattr(model, "config"):
        raise TypeError(f"fdc_ops.hf.compress: model must be a Hugging Face causal LM (transformers "
                        f"PreTrainedModel), got {type(model).__name__}")
    if getattr(model, "_fdc_compression", None) is not None:
        raise ValueError("fdc_ops.hf.compress: the model is already compressed; call fdc_ops.hf.restore(model) first")
    if isinstance(artifact, str) and artifact == artifacts.BUNDLED:
        artifact = artifacts.FDCArtifact.load(artifacts.bundled_artifact())
    if not isinstance(artifact, artifacts.FDCArtifact):
        raise TypeError("fdc_ops.hf.compress: artifact must be an fdc_ops.calibration.FDCArtifact "
                        f"(FDCArtifact.load(directory), calibrate or load_or_calibrate) or \"{artifacts.BUNDLED}\" "
                        f"(the bundled SmolLM2's), got {type(artifact).__name__}")
    artifact.check_model(model)
    policy = _eviction_policy(eviction, keep)
    kv_dtype = _check_kv_dtype(model, kv_dtype)
    config = families.text_config(model)
    if policy is not None and any(families.layer_window(config, layer) >= 0
                                  for layer in range(len(families.attention_modules(model)))):
        raise NotImplementedError("fdc_ops.hf.compress: eviction on a model with sliding-window layers is not "
                                  "supported (a windowed layer already drops its rows by position)")
    allocation = resolve_allocation(artifact, method, removal_rate, compression, allocation, qk_dims, v_dims,
                                    weighting, rule, uniform)
    shape = families.attention_shape(model)
    H, Hkv, D, G = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.group
    decoder = model.get_decoder()
    padding = PaddingState()
    originals = families.attention_modules(model)
    v_encoder, v_decoder = artifact.v_factors(method)
    for layer, original in enumerate(originals):
        weights = families.attention_weights(original, shape)
        dtype, device = weights.q_weight.dtype, weights.q_weight.device
        qk_dims_l, v_dims_l = allocation.qk_dims[layer], allocation.v_dims[layer]
        qk_offsets, v_offsets = allocation.offsets(layer)
        qk_rotation, v_encoder_l, v_decoder_l = artifact.qk_rotation[layer], v_encoder[layer], v_decoder[layer]
        if kv_dtype is not None:  # a quantized cache's rows spread over their dims (artifacts.mix_kept_columns)
            if method == "fdc":
                qk_rotation = artifacts.mix_kept_columns(qk_rotation, qk_dims_l.tolist(), "qk", layer)
            v_encoder_l = artifacts.mix_kept_columns(v_encoder_l, v_dims_l.tolist(), "v", layer)
            v_decoder_l = artifacts.mix_kept_columns(v_decoder_l, v_dims_l.tolist(), "v", layer)
        folded = artifacts.fold_value_and_output(weights.v_weight.detach(), weights.o_weight.detach(),
                                                   v_encoder_l.to(device), v_decoder_l.to(device),
                                                   v_dims_l.tolist(), G, _detach(weights.v_bias),
                                                   _detach(weights.o_bias))
        common = dict(original=original, layer=layer, num_heads=H, num_kv_heads=Hkv, head_dim=D,
                      q_weight=weights.q_weight.detach(), q_bias=_detach(weights.q_bias),
                      value_weight=folded.value_weight, output_weight=folded.output_weight,
                      output_bias=folded.output_bias, v_offsets=v_offsets, padding=padding,
                      window_left=families.layer_window(config, layer), softcap=families.logit_softcap(config))
        if method == "fdc":
            rotation = qk_rotation[:, :, : int(qk_dims_l.max())].to(device, dtype)
            module = FDCAttention(**common, k_weight=weights.k_weight.detach(), k_bias=_detach(weights.k_bias),
                                  rotation=rotation, qk_offsets=qk_offsets)
        else:
            key_basis = artifact.key_basis[layer]
            if kv_dtype is not None:  # the cached latent mixed as FDC's rows are
                key_basis = artifacts.mix_kept_columns(key_basis, qk_dims_l.tolist(), "k latent", layer)
            keys = artifacts.fold_key_latent(weights.k_weight, key_basis, qk_dims_l.tolist(), weights.k_bias)
            latent_bias = None if keys.latent_bias is None else keys.latent_bias.to(dtype)
            module = PaluAttention(**common, latent_weight=keys.latent_weight.to(dtype), latent_bias=latent_bias,
                                   key_up=keys.key_up.to(dtype), latent_offsets=qk_offsets, rotary=decoder.rotary_emb)
        module.eviction = policy
        module.kv_dtype = kv_dtype
        decoder.layers[layer].self_attn = module.to(device)

    hook = decoder.register_forward_pre_hook(_MaskRecorder(padding), with_kwargs=True)
    model._fdc_compression = {"method": method, "allocation": allocation, "originals": originals, "hook": hook,
                              "artifact": artifact, "eviction": policy, "kv_dtype": kv_dtype}
    model.save_pretrained = _refuse_save_pretrained  # this instance only; restore() removes it
    return allocation


def _check_kv_dtype(model, kv_dtype) -> torch.dtype | None:
    """The cache dtype of ``kv_dtype`` (ops.kv_cache_dtype), after what a quantized cache needs, refused by name where
    it is not there yet."""
    if kv_dtype is None:
        return None
    where = "fdc_ops.hf.compress"
    try:
        kv_dtype = ops.kv_cache_dtype(kv_dtype)
    except ValueError as error:
        raise ValueError(f"{where}: kv_dtype must be None (the activations' dtype) or a quantized cache: "
                         f"{error}") from None
    weight = next(model.parameters())
    on_cuda_kernels = weight.device.type == "cuda" and kv_dtype in ops.CUDA_QUANTIZED_CACHE_DTYPES and \
        weight.dtype in (torch.float16, torch.bfloat16)
    if weight.device.type != "cpu" and not on_cuda_kernels:
        raise NotImplementedError(f"{where}: kv_dtype={kv_dtype} with {weight.dtype} weights on {weight.device.type} "
                                  "is not supported: on a GPU the ops take int8 and float8_e4m3fn caches with float16 "
                                  "or bfloat16 activations (the CPU takes every format and dtype)")
    return kv_dtype


def _eviction_policy(eviction, keep) -> evictions.EvictionPolicy | None:
    if isinstance(eviction, evictions.EvictionPolicy):
        if keep is not None:
            raise ValueError("fdc_ops.hf.compress: keep is part of the EvictionPolicy given as eviction; pass one "
                             "or the other")
        return eviction
    if eviction is None:
        if keep is not None:
            raise ValueError(f"fdc_ops.hf.compress: keep={keep!r} needs an eviction method "
                             f"(eviction= one of {evictions.METHODS})")
        return None
    if not isinstance(eviction, str) or eviction not in evictions.METHODS:
        raise ValueError(f"fdc_ops.hf.compress: eviction must be one of {evictions.METHODS}, an "
                         f"fdc_ops.eviction.EvictionPolicy or None, got {eviction!r}")
    if keep is None:
        raise ValueError(f"fdc_ops.hf.compress: eviction={eviction!r} needs keep, the share of each prompt's tokens "
                         "kept, in (0, 1]")
    return evictions.EvictionPolicy(eviction, keep)


class _MaskRecorder:
    """The decoder's forward pre-hook: hands each call's attention mask to the compressed modules. An object rather
    than a closure, so that copy.deepcopy(model) gives the copy a hook feeding the copy's modules (a function is
    shared by a deep copy, and would keep feeding the original's)."""

    def __init__(self, padding: PaddingState):
        self.padding = padding

    def __call__(self, _module, args, kwargs):
        self.padding.mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)


def _refuse_save_pretrained(*args, **kwargs):
    raise RuntimeError("fdc_ops.hf: this model's attention is compressed, and save_pretrained would write the folded, "
                       "narrower projections, which from_pretrained cannot load. Save it with "
                       "fdc_ops.hf.save_compressed(model, directory, tokenizer) and load it back with "
                       "fdc_ops.hf.load_compressed(directory); or fdc_ops.hf.restore(model) first to save the "
                       "uncompressed model")


def _detach(tensor):
    return tensor.detach() if tensor is not None else None


def restore(model) -> None:
    """Puts the original attention modules back (undoes compress)."""
    state = getattr(model, "_fdc_compression", None)
    if state is None:
        raise ValueError("fdc_ops.hf.restore: the model is not compressed")
    for layer, original in zip(model.get_decoder().layers, state["originals"]):
        layer.self_attn = original
    state["hook"].remove()
    model.__dict__.pop("save_pretrained", None)
    model._fdc_compression = None


def kv_cache_nbytes(cache, allocated: bool = False) -> int:
    """Bytes of keys and values a transformers cache holds: compressed layers count their cached rows (``allocated``:
    their whole buffers), ordinary layers their key and value tensors."""
    total = 0
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, CompressedKVLayer):
            total += layer.nbytes(allocated)
        else:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.nbytes
    return total
