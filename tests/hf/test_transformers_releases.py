"""The model side on every supported transformers release: compressed models decode from their cache exactly as they
recompute without one, whatever name the release passes the cache under, and a release outside the tested range is
refused. scripts/test_release_range.sh runs this file and tests/hf/test_hf.py on the oldest and the newest
supported releases; transformers 5.24.0 passes the cache to attention modules as ``cache=``, which the modules once
missed without an error (every decode step attended to its own token alone)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import case_generator
from fdc_ops import calibration, hf, supported
from fdc_ops.hf import compat
from tiny_models import FAMILIES, tiny_model

transformers = pytest.importorskip("transformers", reason="the model side needs transformers")
pytestmark = pytest.mark.model
METHODS = ("fdc", "palu")


def greedy_without_cache(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """(B, P) -> (B, P + new_tokens): each token the argmax of a full forward over everything before it, no cache;
    end-of-sequence tokens are excluded, as generate(min_new_tokens=new_tokens) excludes them."""
    end = model.generation_config.eos_token_id
    end = [] if end is None else [end] if isinstance(end, int) else list(end)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            logits[:, end] = -float("inf")
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids


def check_cache_against_recompute(model, ids: torch.Tensor, new_tokens: int, replay: str) -> None:
    """generate() (which decodes from the cache) equals the greedy recompute token for token, and a prompt call then
    a one-token call on the returned cache give the full forward's logits of that token."""
    with torch.no_grad():
        generated = model.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0)
        assert torch.equal(generated, greedy_without_cache(model, ids, new_tokens)), replay

        prompt = model(input_ids=ids, use_cache=True)
        cache = compat.returned_cache(prompt)
        token = prompt.logits[:, -1].argmax(-1, keepdim=True)
        step = model(input_ids=token, use_cache=True, **{compat.cache_keyword(model): cache}).logits[:, -1]
        full = model(input_ids=torch.cat([ids, token], 1), use_cache=False).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=0, atol=1e-3, msg=replay)
    assert hf.kv_cache_nbytes(cache) > 0, "the compressed modules filled the returned cache"
    assert cache.get_seq_length() == ids.shape[1] + 1


@pytest.mark.parametrize("drawn", ("any family", "qwen2_coder"))
@pytest.mark.parametrize("method", METHODS)
def test_compressed_tiny_models_decode_from_their_cache_as_they_recompute(method, drawn):
    generator, rng, replay = case_generator(f"cache_vs_recompute_{method}", 0 if drawn == "any family" else 1)
    family = rng.choice(FAMILIES) if drawn == "any family" else drawn
    model = tiny_model(family, seed=rng.randrange(1000))
    artifact = calibration.calibrate(model, text="random", num_tokens=128, seq_len=32, seed=rng.randrange(1000),
                                     sensitivity_tokens=64, progress=False)
    dims = [[rng.choice([8, 16]) for _ in range(2)] for _ in range(2)]
    hf.compress(model, artifact, qk_dims=dims, v_dims=dims[::-1], method=method)
    ids = torch.randint(1, model.config.vocab_size, (2, rng.randrange(3, 20)), generator=generator)
    check_cache_against_recompute(model, ids, rng.randrange(4, 12), f"{family}: {replay}")


@pytest.mark.parametrize("prompt", [(56, 63), (65, 127)])
def test_decoding_past_the_cache_buffers_keeps_every_row(prompt):
    """The compressed cache's buffers start at INITIAL_CAPACITY tokens per request (or the prompt's length) and grow
    when a call needs more: a decode that outgrows them, either way, still equals the recompute."""
    from fdc_ops.hf.modules import INITIAL_CAPACITY

    generator, rng, replay = case_generator(f"cache_growth_{prompt[0]}", 0)
    family = rng.choice(FAMILIES)
    model = tiny_model(family, seed=rng.randrange(1000))
    artifact = calibration.calibrate(model, text="random", num_tokens=128, seq_len=32, seed=rng.randrange(1000),
                                     sensitivity_tokens=64, progress=False)
    hf.compress(model, artifact, qk_dims=[[8, 16], [16, 8]], v_dims=[[16, 8], [8, 16]])
    length = rng.randint(*prompt)
    new_tokens = 12
    assert length < max(INITIAL_CAPACITY, length) + 1 <= length + new_tokens  # the decode outgrows the buffers
    ids = torch.randint(1, model.config.vocab_size, (2, length), generator=generator)
    check_cache_against_recompute(model, ids, new_tokens, f"{family}, prompt of {length}: {replay}")


def test_compressed_smollm2_decodes_from_its_cache_as_it_recomputes():
    """The bundled model with its shipped artifact at 10% KV compression, as a user runs it."""
    from fdc_ops.hf import loading

    model, tokenizer = loading.load_model()
    artifact = calibration.load_or_calibrate(model, tokenizer)
    hf.compress(model, artifact, compression=0.1)
    ids = tokenizer("The capital of Germany is", return_tensors="pt")["input_ids"]
    check_cache_against_recompute(model, ids, 12, "SmolLM2 at compression 0.1")


def test_the_cache_is_found_under_every_name_and_never_missed():
    cache = transformers.DynamicCache()
    for name in compat.CACHE_ARGUMENTS:
        assert compat.cache_argument({name: cache, "position_ids": None}, "test") is cache
    assert compat.cache_argument({"position_ids": None, "use_cache": True}, "test") is None
    with pytest.raises(ValueError, match="both cache and past_key_values"):
        compat.cache_argument({"cache": cache, "past_key_values": cache}, "test")
    with pytest.raises(RuntimeError, match="arrived as kv_store="):
        compat.cache_argument({"kv_store": cache}, "fdc_ops.hf.modules.FDCAttention")


def test_a_compressed_module_called_with_a_renamed_cache_fails_loudly():
    """What a future rename looks like to the modules: the decoder layer passes the cache under a name they do not
    know. They must raise, not attend without it."""
    model = tiny_model("llama", seed=3)
    artifact = calibration.calibrate(model, text="random", num_tokens=64, seq_len=16, sensitivity_tokens=0,
                                     progress=False)
    hf.compress(model, artifact, removal_rate=0.0)
    attention = model.get_decoder().layers[0].self_attn
    hidden = torch.randn(1, 3, model.config.hidden_size)
    rotary = model.get_decoder().rotary_emb(hidden, torch.arange(3)[None])
    with pytest.raises(RuntimeError, match="not supported"):
        attention(hidden, position_embeddings=rotary, attention_mask=None, kv_store=transformers.DynamicCache())


def test_model_forward_keyword_is_the_one_this_release_uses():
    model = tiny_model("qwen2", seed=0)
    major_minor = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    assert compat.cache_keyword(model) == ("cache" if major_minor >= (5, 24) else "past_key_values")


@pytest.mark.parametrize("version,inside", [("5.16.1", True), ("5.24.0", True), ("5.24.3", True), ("5.16.0", False),
                                            ("5.25.0", False), ("5.25.0.dev0", False), ("4.57.6", False),
                                            ("6.0.0", False)])
def test_transformers_releases_outside_the_tested_range_are_refused(monkeypatch, version, inside):
    # the module as imported now: transformers swaps the lazy module in sys.modules once models are built
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    monkeypatch.delenv(supported.ALLOW_UNTESTED, raising=False)
    if inside:
        compat.check_transformers()
        return
    with pytest.raises(RuntimeError) as refused:
        compat.check_transformers()
    message = str(refused.value)
    assert f"transformers {version}" in message and supported.TRANSFORMERS in message
    assert supported.ALLOW_UNTESTED in message
    monkeypatch.setenv(supported.ALLOW_UNTESTED, "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.check_transformers()
    assert any(f"transformers {version}" in str(warning.message) for warning in caught)


def test_importing_the_model_side_under_an_untested_release_is_refused(tmp_path):
    """The guard runs on import: a fresh interpreter whose transformers reports a release past the range."""
    code = ("import transformers\ntransformers.__version__ = '9.0.0'\n"
            "try:\n    import fdc_ops.hf\nexcept RuntimeError as error:\n    print('REFUSED', error)\n")
    env = {key: value for key, value in os.environ.items() if key != supported.ALLOW_UNTESTED}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                            cwd=tmp_path)
    assert result.stdout.startswith("REFUSED fdc_ops.hf: transformers 9.0.0 is outside"), result.stdout
