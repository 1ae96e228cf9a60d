"""The FDC model classes of the other families (Mistral and Qwen2, with and without windows, Qwen3, Gemma 2, Gemma 3's
text model) in vLLM's CPU engine, on tiny random-weight Hugging Face checkpoints written here (with the bundled
SmolLM2's tokenizer), calibrated with fast settings.

Per family, four eager engines: vLLM's own class, FDC at full rank (the same tokens), FDC at a real compression with
heads of different widths (the tokens of the project's Hugging Face FDC model, fdc_ops.hf.compress, on the same
checkpoint), and the Palu baseline at that compression (the Hugging Face Palu module's tokens); for Mistral, FDC with
int4 pages (the Hugging Face FDC model's int4 tokens), for Gemma 3 with int8 pages; for the families of windowed and
full layers, vLLM's own and FDC again with every layer in one KV cache group. Llama is covered on the real SmolLM2 by
test_vllm_plugin.py.
"""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from .vllm_engines import Engine, hf_fdc_tokens

# Prompts batched together in vLLM (one batched prefill, then batched decodes), one at a time in Hugging Face.
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 16
MAX_MODEL_LEN = 128
COMPRESSION = 0.3  # a real compression: on 4 KV heads of 32 or 64 dims, widths of 8..64 that differ between heads
COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=True)
# The vLLM CPU backend of the uncompressed engines takes head sizes of 32 and up (CPUAttentionBackend).
FAMILIES = {
    "mistral": ("MistralConfig", dict(head_dim=32, sliding_window=None)),
    # Every layer windowed (Mistral 7B v0.1's kind), a window shorter than the prompts plus their new tokens: the
    # engines then attend, and the FDC engine keeps and frees, pages by the window (vLLM's SlidingWindowSpec).
    "mistral_window": ("MistralConfig", dict(head_dim=32, sliding_window=6)),
    "qwen2": ("Qwen2Config", dict(head_dim=32)),  # QKV bias; vLLM's Qwen2 takes head_dim = hidden / heads
    "qwen3": ("Qwen3Config", dict(head_dim=64)),  # per-head q/k norms; head_dim != hidden / heads, as in Qwen3 models
    # Windowed and full layers by turns (vLLM keeps them in two KV cache groups), windows shorter than the prompts
    # plus their new tokens. Gemma 2: soft-capped attention logits, a query scale that is not 1/sqrt(D).
    "gemma2": ("Gemma2Config", dict(head_dim=32, sliding_window=6, query_pre_attn_scalar=48,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=None,
                                    layer_types=["sliding_attention", "full_attention"])),
    # Gemma 3's text model: per-head q/k norms, a RoPE of its own (another base) for the windowed layers.
    "gemma3": ("Gemma3TextConfig", dict(head_dim=32, sliding_window=6, query_pre_attn_scalar=48,
                                        layer_types=["sliding_attention", "full_attention"])),
    # use_sliding_window on every layer (max_window_layers=0): vLLM's own Qwen2 refuses windows on some layers only
    "qwen2_window": ("Qwen2Config", dict(head_dim=32, use_sliding_window=True, sliding_window=6, max_window_layers=0)),
}
# Windowed and full layers mixed: vLLM keeps the two kinds in separate KV cache groups (its hybrid KV cache manager)
MIXED_WINDOWS = {"gemma2", "gemma3"}
# Projection weights (and biases) drawn with this std instead of the configs' 0.02, and embeddings with EMBED_STD:
# far-from-uniform attention, and logits whose top two differ by far more than float32 rounding between
# implementations, so greedy decoding is a sharp test.
PROJECTION_STD = 0.15
EMBED_STD = 0.5


def write_checkpoint(family: str, directory: Path, **overrides):
    """A tiny random-weight checkpoint of ``family`` (float32 safetensors, the SmolLM2 tokenizer; ``overrides``
    replace config fields); returns the Hugging Face (model, tokenizer) loaded back from it."""
    import transformers

    from fdc_ops.hf import loading

    tokenizer = transformers.AutoTokenizer.from_pretrained(loading.smollm2_path())
    config_name, specific = FAMILIES[family]
    config = getattr(transformers, config_name)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                                eos_token_id=tokenizer.eos_token_id,
                                                **{**COMMON, **specific, **overrides})
    torch.manual_seed(list(FAMILIES).index(family))
    # Gemma scales its input embeddings by sqrt(hidden): drawn that much smaller, they weigh in the residual stream
    # what the others' do (at EMBED_STD every random Gemma here repeated one token).
    embed_std = EMBED_STD / config.hidden_size**0.5 if config.model_type.startswith("gemma") else EMBED_STD
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "proj" in name:
                parameter.normal_(0, PROJECTION_STD)
            elif "embed_tokens" in name:
                parameter.normal_(0, embed_std)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return loading.load_model(directory)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_in_vllm_generates_what_hf_fdc_and_vllm_generate(family, tmp_path):
    import fdc_ops.vllm
    from fdc_ops import calibration, ops

    model_dir = tmp_path / "model"
    model, tokenizer = write_checkpoint(family, model_dir)
    if family.startswith("qwen2"):
        assert model.model.layers[0].self_attn.v_proj.bias.abs().min() > 0  # a V bias that must fold exactly
    artifact = calibration.calibrate(model, text="random", num_tokens=512, seq_len=64, sensitivity_tokens=256,
                                     progress=False)
    artifact_dir = artifact.save(tmp_path / "artifact")
    allocation = artifact.allocate(compression=COMPRESSION)
    assert len(set(allocation.qk_dims.flatten().tolist())) > 1 and len(set(allocation.v_dims.flatten().tolist())) > 1
    expected = hf_fdc_tokens(model, tokenizer, artifact_dir, PROMPTS, NEW_TOKENS, compression=COMPRESSION)
    expected_palu = hf_fdc_tokens(model, tokenizer, artifact_dir, PROMPTS, NEW_TOKENS, compression=COMPRESSION,
                                  method="palu")
    shape = artifact.shape
    full = [[shape.head_dim] * shape.num_kv_heads] * shape.num_layers

    compressed = fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, compression=COMPRESSION)
    engines = [("vllm", None, {}),
               ("full", fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, qk_dims=full, v_dims=full), {}),
               ("fdc", compressed, {}),
               ("palu", fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, compression=COMPRESSION, method="palu"),
                {})]
    if family == "mistral":  # int4 pages, named by the fdc entry (vLLM's kv_cache_dtype has no int4)
        expected_int4 = hf_fdc_tokens(model, tokenizer, artifact_dir, PROMPTS, NEW_TOKENS, compression=COMPRESSION,
                                      kv_dtype="int4")
        engines.append(("fdc int4", fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, compression=COMPRESSION,
                                                              kv_dtype="int4"), {}))
    if family == "gemma3":  # int8 pages in vLLM's separate groups of windowed and full layers
        expected_int8 = hf_fdc_tokens(model, tokenizer, artifact_dir, PROMPTS, NEW_TOKENS, compression=COMPRESSION,
                                      kv_dtype=torch.int8)
        engines.append(("fdc int8", compressed, dict(kv_cache_dtype="int8_per_token_head")))
    if family in MIXED_WINDOWS:  # every layer in one KV cache group, each with pages of its own widths
        one_group = dict(disable_hybrid_kv_cache_manager=True)
        engines += [("vllm one group", None, one_group), ("fdc one group", compressed, one_group)]
    results = {}
    for name, overrides, options in engines:
        engine = Engine(model_dir, overrides, max_model_len=MAX_MODEL_LEN, **options)
        try:
            results[name] = engine.tokens(PROMPTS, NEW_TOKENS), engine.kv_cache_tokens
        finally:
            engine.close()
    reference, reference_capacity = results["vllm"]
    assert [len(row) for row in reference] == [NEW_TOKENS] * len(PROMPTS)
    assert results["full"] == (reference, reference_capacity)
    assert results["fdc"][0] == expected
    assert results["fdc"][0] != reference  # the compression is real: it changes the text of this random model
    if family in MIXED_WINDOWS:
        # vLLM's windowed and full groups take pages of one size, the widest layer's: no smaller than vLLM's own,
        # larger than they need for narrower layers; in one group, each layer's pages are its own widths
        assert results["fdc"][1] >= reference_capacity
        assert results["fdc one group"][0] == expected
        assert results["fdc one group"][1] > results["vllm one group"][1]
    else:
        assert results["fdc"][1] > reference_capacity
    if family == "mistral":
        # SmolLM2's int4 picks flip on last-bit differences between vLLM's and Hugging Face's rows (a code moved on
        # int4's coarse grid moved a pick 0.31 apart), so int4 is compared here, where the logits are far apart
        assert results["fdc int4"][0] == expected_int4
        allocation = artifact.allocate(compression=COMPRESSION)
        stored = sum(ops.cache_width(offsets, torch.uint8) for layer in range(shape.num_layers)
                     for offsets in allocation.offsets(layer))
        float_bytes = 4 * int(allocation.qk_dims.sum() + allocation.v_dims.sum())  # float32 pages of the same widths
        assert results["fdc int4"][1] >= results["fdc"][1] * float_bytes // stored * 0.99, (results, stored)
    if family == "gemma3":
        assert results["fdc int8"][0] == expected_int8
        assert results["fdc int8"][1] > 3 * results["fdc"][1]  # a byte per element against float32's four, less scales
    assert results["palu"][0] == expected_palu
    assert results["palu"][0] != results["fdc"][0]  # another method: other keys, other text
    assert results["palu"][1] >= reference_capacity if family in MIXED_WINDOWS else \
        results["palu"][1] > reference_capacity


def test_unsupported_attention_modules_are_refused_with_the_reason():
    from fdc_ops.vllm.models import unsupported

    def module(**attributes):
        attn = SimpleNamespace(attn_type="decoder", sliding_window=attributes.pop("sliding_window", None))
        return SimpleNamespace(attn=attn, **attributes)

    assert unsupported(module(), "llama") is None
    assert unsupported(module(q_norm=object()), "qwen3") is None
    assert "model_type 'phi3' is not served by the plugin: vLLM's Phi-3 is a Llama" in unsupported(module(), "phi3")
    assert unsupported(module(), "gemma2") is None
    assert unsupported(module(q_norm=object()), "gemma3_text") is None
    assert "model_type 'gemma3' is not supported (the multimodal Gemma 3" in unsupported(module(), "gemma3")
    assert unsupported(module(sliding_window=4096), "mistral") is None
    assert "qwen3 attention module without per-head q/k norms" in unsupported(module(), "qwen3")
    assert "qwen2 attention module with per-head q/k norms" in unsupported(module(q_norm=object()), "qwen2")
    assert "Llama 4 query scaling" in unsupported(module(do_llama_4_scaling=True), "mistral")
    assert "dual chunk attention" in unsupported(module(dual_chunk_attention_config={"chunk_size": 8}), "qwen2")
    encoder = module()
    encoder.attn.attn_type = "encoder_only"
    assert "'encoder_only' is not causal decoder attention" in unsupported(encoder, "qwen2")


def test_the_fdc_entry_kv_dtype_is_checked():
    from fdc_ops.vllm.models import settings

    def config(**entry):
        return SimpleNamespace(fdc={"artifact": "/nonexistent", **entry})

    with pytest.raises(ValueError, match=r"entry has kv_dtype 'int8'; known: int4 \(int8 and fp8 are vLLM's "
                                         r"kv_cache_dtype 'int8_per_token_head' and 'fp8_per_token_head'\)"):
        settings(config(kv_dtype="int8"))
    with pytest.raises(ValueError, match=r"kv_dtype 'int4' with the Palu baseline, whose backend rebuilds keys"):
        settings(config(kv_dtype="int4", method="palu"))



def test_padded_pages_are_reported_where_windowed_and_full_layers_mix():
    from fdc_ops.vllm.models import padded_pages_warning

    assert re.search(r"pads every layer's page to the widest \(100 bytes a token; the layers need 75 on average\), "
                     r"so 25% of the KV cache holds padding. disable_hybrid_kv_cache_manager=True",
                     padded_pages_warning([100, 50], [True, False], hybrid=True))
    assert padded_pages_warning([100, 50], [True, False], hybrid=False) is None  # one group: each its own pages
    assert padded_pages_warning([100, 50], [True, True], hybrid=True) is None  # one kind of layer
    assert padded_pages_warning([100, 100], [True, False], hybrid=True) is None  # nothing to pad
