"""Saving a compressed model and loading it back: a directory that is the original Hugging Face checkpoint (what
``AutoModelForCausalLM.from_pretrained`` and vLLM read), its tokenizer when given, and ``fdc/``: the artifact the
model was compressed with (whole, with its provenance) and the compression (method and every head's widths).

    hf.compress(model, artifact, compression=0.1)
    hf.save_compressed(model, "smollm2-fdc", tokenizer)
    model = hf.load_compressed("smollm2-fdc", dtype=torch.bfloat16)   # compressed again, the same widths

The checkpoint keeps the original projections rather than the folded, narrower ones: the folds are cheap to redo,
and a checkpoint of the original shapes is one that transformers and vLLM load as they are (the vLLM plugin takes the
directory with ``fdc_ops.vllm.hf_overrides(directory)``). Loading redoes exactly what compress did, so the reloaded
model's logits are bit-identical to the saved model's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .. import calibration, files

FDC_DIRECTORY = "fdc"  # inside a saved model's directory
ARTIFACT_DIRECTORY = "artifact"  # inside FDC_DIRECTORY
COMPRESSION_FILE = "compression.json"  # inside FDC_DIRECTORY
FORMAT = "fdc_ops.compressed_model"
FORMAT_VERSION = 1


def save_compressed(model, directory: str | os.PathLike, tokenizer=None) -> Path:
    """Writes a model compressed by fdc_ops.hf.compress to ``directory`` (created; an existing saved model there is
    replaced): the original checkpoint (save_pretrained of the uncompressed attention), ``tokenizer`` when given,
    and ``fdc/``. Returns the directory."""
    from transformers import PreTrainedModel

    state = getattr(model, "_fdc_compression", None)
    if state is None:
        raise ValueError("fdc_ops.hf.save_compressed: the model is not compressed (fdc_ops.hf.compress first; an "
                         "uncompressed model is saved with model.save_pretrained)")
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"fdc_ops.hf.save_compressed: directory must be a path, got {type(directory).__name__}")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"fdc_ops.hf.save_compressed: {directory} exists and is not a directory")
    layers = model.get_decoder().layers
    compressed = [layer.self_attn for layer in layers]
    for layer, original in zip(layers, state["originals"]):  # the original attention, for its weights only
        layer.self_attn = original
    try:
        PreTrainedModel.save_pretrained(model, directory)  # the class's: the instance's refuses (compress)
    finally:
        for layer, module in zip(layers, compressed):
            layer.self_attn = module
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    fdc = directory / FDC_DIRECTORY  # an earlier save's is replaced file by file, each whole (FDCArtifact.save)
    state["artifact"].save(fdc / ARTIFACT_DIRECTORY)
    allocation = state["allocation"]
    description = {"format": FORMAT, "format_version": FORMAT_VERSION, "method": state["method"],
                   "qk_dims": allocation.qk_dims.tolist(), "v_dims": allocation.v_dims.tolist(),
                   "allocation": {"method": allocation.method, "removal_rate": allocation.removal_rate,
                                  "notes": allocation.notes, "compression_rate": allocation.compression_rate}}
    files.write_json_atomically(fdc / COMPRESSION_FILE, description, indent=2, sort_keys=True)
    return directory


def saved_compression(directory: str | os.PathLike) -> tuple[calibration.FDCArtifact, str, calibration.RankAllocation]:
    """(artifact, method, allocation) of a directory written by save_compressed, validated; ArtifactError (a
    ValueError) naming the file otherwise."""
    fdc = Path(directory) / FDC_DIRECTORY
    path = fdc / COMPRESSION_FILE
    if not path.is_file():
        raise calibration.ArtifactError(f"fdc_ops.hf.load_compressed: {path} does not exist ({directory} was not "
                                        "written by fdc_ops.hf.save_compressed)")
    try:
        description = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise calibration.ArtifactError(f"fdc_ops.hf.load_compressed: {path} is not valid JSON ({error})") from None
    if not isinstance(description, dict) or description.get("format") != FORMAT or \
            description.get("format_version") != FORMAT_VERSION:
        raise calibration.ArtifactError(f"fdc_ops.hf.load_compressed: {path} is not a compressed model description of "
                                        f"format version {FORMAT_VERSION}")
    artifact = calibration.FDCArtifact.load(fdc / ARTIFACT_DIRECTORY)
    shape = artifact.shape
    try:
        qk_dims = torch.tensor(description["qk_dims"], dtype=torch.int64)
        v_dims = torch.tensor(description["v_dims"], dtype=torch.int64)
        recorded = description["allocation"]
        allocation = calibration.RankAllocation(qk_dims, v_dims, shape.head_dim, str(recorded["method"]),
                                                recorded["removal_rate"], dict(recorded["notes"]))
        method = description["method"]
    except (KeyError, TypeError, ValueError) as error:
        raise calibration.ArtifactError(f"fdc_ops.hf.load_compressed: {path} is incomplete ({error!r})") from None
    if tuple(qk_dims.shape) != (shape.num_layers, shape.num_kv_heads) or qk_dims.shape != v_dims.shape:
        raise calibration.ArtifactError(f"fdc_ops.hf.load_compressed: {path}: the widths must be (layers, KV heads) = "
                                        f"{(shape.num_layers, shape.num_kv_heads)}, as the artifact's")
    return artifact, method, allocation


def load_compressed(directory: str | os.PathLike, **from_pretrained):
    """The model saved by save_compressed in ``directory``, loaded by ``AutoModelForCausalLM.from_pretrained``
    (keyword arguments go to it, such as ``dtype=torch.bfloat16``; ``dtype`` defaults to the checkpoint's) and
    compressed as it was saved. Its tokenizer, when saved, loads with ``AutoTokenizer.from_pretrained(directory)``."""
    from transformers import AutoModelForCausalLM

    from . import compress

    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"fdc_ops.hf.load_compressed: directory must be a path, got {type(directory).__name__}")
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"fdc_ops.hf.load_compressed: {directory} is not a directory")
    artifact, method, allocation = saved_compression(directory)
    from_pretrained.setdefault("dtype", "auto")
    model = AutoModelForCausalLM.from_pretrained(directory, **from_pretrained).eval()
    compress(model, artifact, allocation=allocation, method=method)
    return model
