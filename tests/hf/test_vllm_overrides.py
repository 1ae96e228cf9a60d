"""fdc_ops.vllm.hf_overrides and cpu_thread_binding, which need no vLLM: the settings an FDC model reads from
vLLM's config, and the CPU binding of tensor-parallel workers."""

import json
import os
import subprocess
import sys
import types

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
                         "fdc": {"artifact": str((tmp_path / "artifact").resolve()), "method": "fdc",
                                 "compression": 0.1, "rule": "sensitivity"}}
    palu = fdc_ops.vllm.hf_overrides(model, tmp_path / "artifact", compression=0.1, method="palu")
    assert palu["architectures"] == ["FDCLlamaForCausalLM"] and palu["fdc"]["method"] == "palu"
    dims = torch.tensor([[8, 16], [24, 32]])
    explicit = fdc_ops.vllm.hf_overrides(model, "artifact", qk_dims=dims, v_dims=dims.tolist())
    assert explicit["fdc"]["qk_dims"] == [[8, 16], [24, 32]] and explicit["fdc"]["v_dims"] == [[8, 16], [24, 32]]
    json.dumps(explicit)  # what --hf-overrides takes
    printed = subprocess.run([sys.executable, "-m", "fdc_ops.vllm", "overrides", str(model), str(tmp_path / "artifact"),
                              "--compression", "0.1", "--kv-dtype", "int4"], capture_output=True, text=True, check=True)
    assert json.loads(printed.stdout) == fdc_ops.vllm.hf_overrides(model, tmp_path / "artifact", compression=0.1,
                                                                    kv_dtype="int4")


def test_overrides_refuse_what_the_plugin_cannot_serve(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        fdc_ops.vllm.hf_overrides(tmp_path, tmp_path, compression=0.1)
    with pytest.raises(ValueError, match=r"architectures \['Phi3ForCausalLM'\]; the FDC plugin supports "
                                         r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                         r"Gemma2ForCausalLM, Gemma3ForCausalLM \(Phi3ForCausalLM: vLLM's Phi-3 is a "
                                         r"Llama with a fused"):
        fdc_ops.vllm.hf_overrides(model_dir(tmp_path / "phi3", ["Phi3ForCausalLM"]), tmp_path, compression=0.1)
    llama = model_dir(tmp_path / "llama", ["LlamaForCausalLM"])
    with pytest.raises(ValueError, match=r"kv_dtype must be None or 'int4' \(int8 and fp8 are vLLM's kv_cache_dtype "
                                         r"'int8_per_token_head' and 'fp8_per_token_head'\), got 'int8'"):
        fdc_ops.vllm.hf_overrides(llama, tmp_path, compression=0.1, kv_dtype="int8")
    with pytest.raises(ValueError, match=r"kv_dtype 'int4' is for FDC; the Palu baseline's backend rebuilds keys"):
        fdc_ops.vllm.hf_overrides(llama, tmp_path, compression=0.1, kv_dtype="int4", method="palu")
    entry = fdc_ops.vllm.hf_overrides(llama, tmp_path, compression=0.1, kv_dtype="int4")["fdc"]
    assert entry["kv_dtype"] == "int4" and "kv_dtype" not in fdc_ops.vllm.hf_overrides(llama, tmp_path,
                                                                                         compression=0.1)["fdc"]


@pytest.mark.parametrize("arguments,message", [
    (["--compression", "2"], "argument --compression: 2 is not in [0.0, 1.0)"),
    (["--removal-rate", "nan"], "argument --removal-rate: 'nan' is not a finite number"),
    (["--compression", "a"], "argument --compression: 'a' is not a number"),
])
def test_the_overrides_command_refuses_a_bad_number_in_one_line_before_writing_anything(tmp_path, arguments, message):
    model = model_dir(tmp_path / "model", ["LlamaForCausalLM"])
    result = subprocess.run([sys.executable, "-m", "fdc_ops.vllm", "overrides", str(model), str(tmp_path), *arguments],
                            capture_output=True, text=True)
    assert result.returncode == 2 and not result.stdout
    assert result.stderr.splitlines()[-1] == f"python -m fdc_ops.vllm overrides: error: {message}"


def test_one_family_table_serves_both_sides():
    """fdc_ops.model_families is what fdc_ops.hf accepts and what the plugin registers and serves."""
    import transformers

    from fdc_ops import model_families
    from fdc_ops.hf import families

    served = {f.architecture: f.vllm_class for f in model_families.FAMILIES if f.vllm_class}
    assert model_families.SERVED_ARCHITECTURES == served and "Phi3ForCausalLM" not in served
    assert all(f.vllm_refusal for f in model_families.FAMILIES if f.vllm_class is None)
    for family in model_families.FAMILIES:
        assert hasattr(transformers, family.architecture)
        families.check_supported(types.SimpleNamespace(config=types.SimpleNamespace(model_type=family.model_type)))
    with pytest.raises(ValueError, match=r"model_type 'gemma3' is not supported \(the multimodal Gemma 3 .* "
                                         r"gemma3_text .*\); supported: llama, mistral, qwen2, qwen3"):
        families.check_supported(types.SimpleNamespace(config=types.SimpleNamespace(model_type="gemma3")))


def test_overrides_name_the_argument_and_the_type_they_expect(tmp_path):
    model = model_dir(tmp_path / "model", ["LlamaForCausalLM"])
    for kwargs, message in ((dict(compression="0.1"), "compression must be a number, got str"),
                            (dict(qk_dims=[[8.5]], v_dims=[[8]]), "qk_dims must be whole numbers"),
                            (dict(compression=0.1, rule=3), "rule must be a string")):
        with pytest.raises(TypeError, match=message):
            fdc_ops.vllm.hf_overrides(model, tmp_path / "artifact", **kwargs)
    with pytest.raises(ValueError, match=r"method must be one of \('fdc', 'palu'\), got 'svd'"):
        fdc_ops.vllm.hf_overrides(model, tmp_path / "artifact", compression=0.1, method="svd")
    with pytest.raises(TypeError, match="artifact must be a directory path"):
        fdc_ops.vllm.hf_overrides(model, 0.1)
    with pytest.raises(ValueError, match="was not written by fdc_ops.hf.save_compressed"):
        fdc_ops.vllm.hf_overrides(model)  # no artifact: only a saved compressed model carries its own


def test_overrides_of_a_saved_compressed_model_take_its_artifact_and_widths(tmp_path):
    from fdc_ops import calibration, hf
    from tiny_models import tiny_model

    model = tiny_model("qwen2", seed=2)
    artifact = calibration.calibrate(model, text="random", num_tokens=64, seq_len=16, sensitivity_tokens=0,
                                     progress=False)
    dims = [[8, 16], [16, 8]]
    hf.compress(model, artifact, qk_dims=dims, v_dims=dims[::-1])
    saved = hf.save_compressed(model, tmp_path / "saved")
    overrides = fdc_ops.vllm.hf_overrides(saved)
    assert overrides["architectures"] == ["FDCQwen2ForCausalLM"]
    assert overrides["fdc"] == {"artifact": str((saved / "fdc" / "artifact").resolve()), "method": "fdc",
                                "qk_dims": dims, "v_dims": dims[::-1]}
    assert fdc_ops.vllm.hf_overrides(saved, compression=0.2)["fdc"]["compression"] == 0.2  # widths given: those
    hf.restore(model)
    hf.compress(model, artifact, qk_dims=dims, v_dims=dims, method="palu")  # served with its saved method
    palu = fdc_ops.vllm.hf_overrides(hf.save_compressed(model, tmp_path / "saved-palu"))
    assert palu["fdc"]["method"] == "palu" and palu["fdc"]["qk_dims"] == dims


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
