"""fdc_ops.vllm.hf_overrides and cpu_thread_binding, which need no vLLM: the settings an FDC model reads from
vLLM's config, and the CPU binding of tensor-parallel workers."""

import json
import os

import pytest
import torch

import fdc_ops.vllm


def model_dir(path, architectures):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": architectures}))
    return path


def test_overrides_name_the_fdc_class_and_carry_the_settings(tmp_path):
    model = model_dir(tmp_path / "model", ["LlamaForCausalLM"])
    overrides = fdc_ops.vllm.hf_overrides(model, tmp_path / "artifact", compression=0.1, rule="sensitivity")
    assert overrides == {"architectures": ["FDCLlamaForCausalLM"],
                         "fdc": {"artifact": str((tmp_path / "artifact").resolve()), "compression": 0.1,
                                 "rule": "sensitivity"}}
    dims = torch.tensor([[8, 16], [24, 32]])
    explicit = fdc_ops.vllm.hf_overrides(model, "artifact", qk_dims=dims, v_dims=dims.tolist())
    assert explicit["fdc"]["qk_dims"] == [[8, 16], [24, 32]] and explicit["fdc"]["v_dims"] == [[8, 16], [24, 32]]
    json.dumps(explicit)  # what --hf-overrides takes


def test_overrides_refuse_what_the_plugin_cannot_serve(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        fdc_ops.vllm.hf_overrides(tmp_path, tmp_path, compression=0.1)
    with pytest.raises(ValueError, match=r"architectures \['Phi3ForCausalLM'\]; the FDC plugin supports "
                                         "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        fdc_ops.vllm.hf_overrides(model_dir(tmp_path / "phi3", ["Phi3ForCausalLM"]), tmp_path, compression=0.1)


@pytest.mark.parametrize("family", ["Llama", "Mistral", "Qwen2", "Qwen3"])
def test_overrides_map_every_supported_family_to_its_fdc_class(tmp_path, family):
    overrides = fdc_ops.vllm.hf_overrides(model_dir(tmp_path / "model", [f"{family}ForCausalLM"]), tmp_path,
                                          removal_rate=0.05)
    assert overrides["architectures"] == [f"FDC{family}ForCausalLM"]


def test_cpu_thread_binding_splits_this_process_cpus_between_ranks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 8})
    assert fdc_ops.vllm.cpu_thread_binding(2) == "4,5|6,7"
    assert fdc_ops.vllm.cpu_thread_binding(1) == "4,5,6,7,8"
    assert fdc_ops.vllm.cpu_thread_binding(6) == "nobind"
    with pytest.raises(ValueError, match="ranks must be positive"):
        fdc_ops.vllm.cpu_thread_binding(0)
