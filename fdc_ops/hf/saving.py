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

import os
from pathlib import Path

from ..artifact import save_compression, saved_compression


def save_compressed(model, directory: str | os.PathLike, tokenizer=None) -> Path:
    """Writes a model compressed by fdc_ops.hf.compress to ``directory`` (created; an existing saved model there is
    replaced): the original checkpoint (save_pretrained of the uncompressed attention), ``tokenizer`` when given,
    and ``fdc/``. Eviction is a run-time choice, not part of the model: load_compressed takes it again. Returns the
    directory."""
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
    save_compression(directory, state["artifact"], state["method"], state["allocation"])
    return directory


def load_compressed(directory: str | os.PathLike, *, eviction=None, keep: float | None = None, **from_pretrained):
    """The model saved by save_compressed in ``directory``, loaded by ``AutoModelForCausalLM.from_pretrained``
    (keyword arguments go to it, such as ``dtype=torch.bfloat16``; ``dtype`` defaults to the checkpoint's) and
    compressed as it was saved, with ``eviction`` and ``keep`` as fdc_ops.hf.compress takes them. Its tokenizer,
    when saved, loads with ``AutoTokenizer.from_pretrained(directory)``."""
    from transformers import AutoModelForCausalLM

    from . import compress

    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"fdc_ops.hf.load_compressed: directory must be a path, got {type(directory).__name__}")
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"fdc_ops.hf.load_compressed: {directory} is not a directory")
    artifact, method, allocation = saved_compression(directory)
    from_pretrained.setdefault("dtype", "auto")
    model = AutoModelForCausalLM.from_pretrained(directory, **from_pretrained).eval()
    compress(model, artifact, allocation=allocation, method=method, eviction=eviction, keep=keep)
    return model
