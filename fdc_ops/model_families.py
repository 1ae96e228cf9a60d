"""The model families fdc_ops compresses, in one table that the Hugging Face side (fdc_ops.hf) and the vLLM plugin
(fdc_ops.vllm) both read: the Hugging Face model type and causal-LM architecture, whether the family's attention
applies per-head q/k RMS norms before RoPE, the FDC class the plugin serves it with (or why it does not), and why
the families people ask for most are refused. Torch-free, so any side imports it without the others."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str  # config.model_type
    architecture: str  # the Hugging Face causal-LM class (config.architectures)
    qk_norm: bool  # per-head q/k RMS norms before RoPE (Qwen3): what calibration and both sides' modules compute
    vllm_class: str | None  # the class fdc_ops.vllm registers with vLLM for the architecture; None: not served
    vllm_refusal: str | None = None  # why the plugin does not serve it, where it does not


FAMILIES = (
    Family("llama", "LlamaForCausalLM", False, "FDCLlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM", False, "FDCMistralForCausalLM"),
    Family("qwen2", "Qwen2ForCausalLM", False, "FDCQwen2ForCausalLM"),
    Family("qwen3", "Qwen3ForCausalLM", True, "FDCQwen3ForCausalLM"),
    Family("phi3", "Phi3ForCausalLM", False, None,
           "vLLM's Phi-3 is a Llama with a fused checkpoint projection, which the plugin's identity check would have "
           "to split"),
    Family("gemma2", "Gemma2ForCausalLM", False, "FDCGemma2ForCausalLM"),
    # Gemma 3's text model: per-head q/k norms before RoPE (Qwen3's place), a RoPE of its own for the sliding-window
    # layers (the decoder hands each layer its tables), windowed and full layers by turns.
    Family("gemma3_text", "Gemma3ForCausalLM", True, "FDCGemma3ForCausalLM"),
)
BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES}
BY_ARCHITECTURE = {family.architecture: family for family in FAMILIES}
#: Hugging Face architecture -> the FDC class vLLM runs for it (vLLM's own class with FDC attention).
SERVED_ARCHITECTURES = {family.architecture: family.vllm_class for family in FAMILIES if family.vllm_class}

#: Model types asked for and refused, with the reason (what they need that the ops do not have yet).
REFUSED = {
    "gemma3": "the multimodal Gemma 3 with its vision tower; its text model, model_type gemma3_text "
              "(Gemma3ForCausalLM), is supported",
    "mixtral": "a mixture-of-experts family that no test covers",
}


def unsupported_model_type(model_type) -> str | None:
    """Why ``model_type`` cannot be compressed (a sentence naming the supported types), or None when it can."""
    if model_type in BY_MODEL_TYPE:
        return None
    reason = f" ({REFUSED[model_type]})" if model_type in REFUSED else ""
    return f"model_type {model_type!r} is not supported{reason}; supported: {', '.join(BY_MODEL_TYPE)}"
