"""FDC model classes for vLLM, by composition with vLLM's own: vLLM's Llama model, decoder layers, fused projections,
RoPE and weight loading run unchanged; only each layer's attention is subclassed, so that after the checkpoint is
loaded the V third of the fused QKV projection becomes A_V (the compressed values come out of the projection), the
output projection becomes W_O' (it takes the c-wide attention outputs), and attention runs on the FDC backend (Q/K
rotated by R after RoPE, the paged cache in the packed widths).

What is compressed, and how much, comes from the model config's ``fdc`` entry (see :func:`fdc_ops.vllm.hf_overrides`):
the artifact (calibration, fdc_ops.calibration) and the allocation (a KV byte budget ``compression``, the paper's
``removal_rate``, or explicit ``qk_dims``/``v_dims``), resolved exactly as fdc_ops.hf.compress resolves them, so the
same settings give the same widths and the same folded weights as the Hugging Face integration.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from vllm.model_executor.models.utils import extract_layer_index

from .. import calibration, hf
from ..calibration import FDCArtifact, RankAllocation
from ..hf import families
from .layer import FDCPagedAttention

CONFIG_KEY = "fdc"
SETTINGS_KEYS = ("artifact", "compression", "removal_rate", "rule", "qk_dims", "v_dims")


@dataclass(frozen=True)
class FDCSettings:
    artifact: FDCArtifact
    allocation: RankAllocation


def settings(hf_config) -> FDCSettings:
    """The artifact and allocation named by the config's ``fdc`` entry (validated; loaded once per process)."""
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
    return _settings(json.dumps(entry, sort_keys=True))


@functools.lru_cache(maxsize=4)
def _settings(entry_json: str) -> FDCSettings:
    entry = json.loads(entry_json)
    artifact = FDCArtifact.load(entry["artifact"])
    allocation = hf.resolve_allocation(artifact, "fdc", entry.get("removal_rate"), entry.get("compression"), None,
                                       entry.get("qk_dims"), entry.get("v_dims"), None, entry.get("rule"), False)
    return FDCSettings(artifact, allocation)


def _check_shape(hf_config, artifact: FDCArtifact) -> None:
    """The artifact's attention shape against the checkpoint's config (the weights are checked after loading)."""
    shape = families.attention_shape(SimpleNamespace(config=hf_config))
    if shape != artifact.shape:
        raise calibration.ArtifactError(f"fdc_ops.vllm: the artifact is for attention shape {artifact.shape}, the "
                                        f"model has {shape}")


class FDCLlamaAttention(LlamaAttention):
    """vLLM's LlamaAttention with the FDC attention layer in place of its own, and (after load_weights) the folded
    projections: ``qkv_proj`` (hidden) -> (H * D + H_kv * D + v_width) = [W_Q | W_K | A_V], ``o_proj``
    (G * v_width) -> (hidden) = W_O'."""

    def __init__(self, *args, prefix: str = "", cache_config=None, **kwargs):
        super().__init__(*args, prefix=prefix, cache_config=cache_config, **kwargs)
        if get_tensor_model_parallel_world_size() != 1:
            raise NotImplementedError("fdc_ops.vllm: FDC models run with tensor_parallel_size=1 (heads of different "
                                      "widths need equal per-rank widths first: README, 'Serving with vLLM')")
        if kwargs.get("quant_config") is not None:
            raise NotImplementedError("fdc_ops.vllm: FDC folds A_V and W_O' into unquantized projections; quantized "
                                      "checkpoints are not supported")
        if self.attn.sliding_window is not None:
            raise NotImplementedError(f"fdc_ops.vllm: layer {prefix} uses sliding-window attention "
                                      f"({self.attn.sliding_window} tokens), which the FDC backend does not support")
        config = kwargs.get("config", args[0] if args else None)
        fdc = settings(config)
        _check_shape(config, fdc.artifact)
        self.layer_index = extract_layer_index(prefix)
        self.fdc = fdc
        qk_offsets, v_offsets = fdc.allocation.offsets(self.layer_index)
        max_qk = int(fdc.allocation.qk_dims[self.layer_index].max())
        rotation = fdc.artifact.qk_rotation[self.layer_index, :, :, :max_qk].to(torch.get_default_dtype())
        # vLLM's own Attention layer registered itself under this name; the FDC layer takes its place.
        attn_prefix = f"{prefix}.attn"
        get_current_vllm_config().compilation_config.static_forward_context.pop(attn_prefix)
        self.attn = FDCPagedAttention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads, rotation,
                                      qk_offsets, v_offsets, cache_config, attn_prefix)
        self.folded = False

    def fold(self) -> None:
        """Replaces the loaded W_V by A_V and W_O by W_O' (fdc_ops.calibration's folds, float64, as the Hugging Face
        integration does), and a V bias by the output bias it amounts to."""
        layer, G, Hkv = self.layer_index, self.num_heads // self.num_kv_heads, self.num_kv_heads
        v_dims = self.fdc.allocation.v_dims[layer].tolist()
        v_encoder, v_decoder = self.fdc.artifact.v_factors("fdc")
        weight = self.qkv_proj.weight.data  # (q_size + 2 * kv_size, hidden)
        q_weight, k_weight, v_weight = weight.split([self.q_size, self.kv_size, self.kv_size])
        value_weight = calibration.fold_value_projection(v_weight, v_encoder[layer], v_dims)
        self.qkv_proj.weight = nn.Parameter(torch.cat([q_weight, k_weight, value_weight]), requires_grad=False)
        o_weight = self.o_proj.weight.data  # (hidden, H * D)
        self.o_proj.weight = nn.Parameter(calibration.fold_output_projection(o_weight, v_decoder[layer], v_dims, G),
                                          requires_grad=False)
        if self.qkv_proj.bias is not None:
            q_bias, k_bias, v_bias = self.qkv_proj.bias.data.split([self.q_size, self.kv_size, self.kv_size])
            # A_V carries no bias: the V bias passes through attention unchanged and is folded into o_proj's bias.
            self.qkv_proj.bias = nn.Parameter(torch.cat([q_bias, k_bias, v_bias.new_zeros(self.attn.v_width)]),
                                              requires_grad=False)
            folded = calibration.fold_value_bias(v_bias, o_weight, Hkv, G)
            o_bias = self.o_proj.bias
            self.o_proj.bias = nn.Parameter(folded if o_bias is None else o_bias.data + folded, requires_grad=False)
        self.folded = True

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """positions: (T,); hidden_states: (T, hidden). Returns (T, hidden)."""
        if not self.folded:
            raise RuntimeError("fdc_ops.vllm: the FDC projections were not folded (load_weights did not run)")
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.attn.v_width], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class FDCLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, vllm_config, prefix: str = "", config=None):
        super().__init__(vllm_config, prefix=prefix, config=config, attn_layer_type=FDCLlamaAttention)


_FINGERPRINT_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.weight$")


class FDCLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's LlamaForCausalLM (Llama, and checkpoints vLLM maps to it, such as SmolLM2) with FDC attention."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=FDCLlamaDecoderLayer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's loading of the Hugging Face checkpoint, then the folds; the artifact is checked against the
        checkpoint's own tensors (the fingerprint fdc_ops.hf.families computes for the Hugging Face model)."""
        config = self.config
        last = config.num_hidden_layers - 1
        seen: dict[tuple[int, str], torch.Tensor] = {}

        def recording(stream):
            for name, tensor in stream:
                match = _FINGERPRINT_NAME.match(name)
                if match and int(match.group(1)) in (0, last):
                    seen[(int(match.group(1)), match.group(2))] = tensor.detach().to("cpu", torch.float32).clone()
                yield name, tensor

        loaded = super().load_weights(recording(weights))
        artifact = settings(config).artifact
        missing = [(layer, part) for layer in (0, last) for part in "qkv" if (layer, part) not in seen]
        if missing:
            raise calibration.ArtifactError(f"fdc_ops.vllm: the checkpoint has no separate q/k/v projection weights "
                                            f"for layers {sorted({m[0] for m in missing})}, which the artifact's "
                                            "fingerprint is computed from")
        actual = families.fingerprint(_FingerprintView(config, seen, last))
        if actual != artifact.metadata["fingerprint"]:
            raise calibration.ArtifactError(
                f"fdc_ops.vllm: the artifact was calibrated on model {artifact.metadata['model_id']!r} (fingerprint "
                f"{artifact.metadata['fingerprint'][:12]}), this checkpoint's fingerprint is {actual[:12]}: "
                "recalibrate for this model")
        for layer in self.model.layers:
            if isinstance(getattr(layer, "self_attn", None), FDCLlamaAttention):
                layer.self_attn.fold()
        return loaded


class _FingerprintView:
    """What fdc_ops.hf.families.fingerprint reads of a Hugging Face model (its config, and the q/k/v projection
    weights of the first and last layers), made of the checkpoint tensors seen while vLLM loaded them."""

    def __init__(self, config, weights: dict[tuple[int, str], torch.Tensor], last: int):
        self.config = config

        def attention(layer: int):
            projections = {f"{part}_proj": SimpleNamespace(weight=weights[(layer, part)], bias=None)
                           for part in "qkv"}
            return SimpleNamespace(**projections, o_proj=SimpleNamespace(weight=None, bias=None))

        unread = SimpleNamespace()  # the middle layers: fingerprint reads only the first and the last
        self._layers = [SimpleNamespace(self_attn=attention(index) if index in (0, last) else unread)
                        for index in range(last + 1)]

    def get_decoder(self):
        return SimpleNamespace(layers=self._layers)
