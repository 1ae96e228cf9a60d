"""What the plugin's tests share: a vLLM engine in this process, and the greedy tokens of the project's Hugging Face
FDC model to compare it with. Imported only in .venv-vllm (the tests elsewhere skip before they run)."""

from __future__ import annotations

import atexit
import gc
import os
import signal
import subprocess
from pathlib import Path

import torch

KV_CACHE_GIB = 1  # vLLM's CPU KV cache space, in GiB (its VLLM_CPU_KVCACHE_SPACE takes whole GiB)
MAX_MODEL_LEN = 512
NEW_TOKENS = 32


_SERVERS: set[subprocess.Popen] = set()  # started by start_server and not yet stopped


def start_server(command: list[str], log, env: dict) -> subprocess.Popen:
    """A server process (and the engine processes it starts) in a session of its own, stopped by stop_server, or at
    the latest when the test run exits in any way: atexit here, and the conftest turns SIGTERM and SIGHUP into a
    normal exit (by default they would end pytest without running finally blocks or atexit)."""
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _SERVERS.add(server)
    return server


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group, SIGKILL after 60 s."""
    _SERVERS.discard(server)
    if server.poll() is not None:
        return
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    except ProcessLookupError:
        pass


@atexit.register
def _stop_servers() -> None:
    for server in list(_SERVERS):
        stop_server(server)


class Engine:
    """A vLLM engine in this process (float32, eager), and what it generates greedily."""

    def __init__(self, model_dir: Path, hf_overrides: dict | None = None, **options):
        from vllm import LLM

        options.setdefault("max_model_len", MAX_MODEL_LEN)
        self.llm = LLM(model=str(model_dir), dtype="float32", seed=0, enforce_eager=True, hf_overrides=hf_overrides,
                       **options)

    def tokens(self, prompts: list[str], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
        from vllm import SamplingParams

        outputs = self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens), use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]

    @property
    def kv_cache_tokens(self) -> int:
        cache = self.llm.llm_engine.vllm_config.cache_config
        return cache.num_gpu_blocks * cache.block_size

    def close(self) -> None:
        from vllm.distributed import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        cleanup_dist_env_and_memory()


def hf_fdc_tokens(model, tokenizer, artifact_dir: Path, prompts: list[str], new_tokens: int = NEW_TOKENS,
                  **allocation) -> list[list[int]]:
    """Greedy tokens of the project's Hugging Face FDC model (fdc_ops.hf.compress of ``model`` with the artifact in
    ``artifact_dir`` and ``allocation``, its keyword arguments: method="palu" for the Palu baseline), one prompt at a
    time; the model is restored after."""
    from fdc_ops import calibration, hf

    artifact = calibration.FDCArtifact.load(artifact_dir, model=model)
    hf.compress(model, artifact, **allocation)
    try:
        tokens = []
        for prompt in prompts:
            inputs = tokenizer(prompt, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
            tokens.append(out[0, inputs["input_ids"].shape[1]:].tolist())
        return tokens
    finally:
        hf.restore(model)
