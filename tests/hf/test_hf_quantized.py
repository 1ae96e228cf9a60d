"""hf.compress(..., kv_dtype="int8" / "float8_e4m3fn" / "int4"): the compressed cache stored quantized (fdc_ops.ops,
quantized caches), its kept dims mixed by a rotation folded into the weights. The prompt's own call sees no
quantization (it attends its own rows); later calls read the quantized rows, one token at a time (decode_attention)
or several (the cached rows dequantized for prefill_attention), close to the float cache; the cache holds the bytes
it should; what is not supported yet is refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import case_generator
from fdc_ops import hf, ops
from fdc_ops.artifact import mix_kept_columns
from fdc_ops.hf.compat import cache_keyword
from fdc_ops.hf.modules import CompressedKVLayer
from test_hf import calibrated, left_padded

transformers = pytest.importorskip("transformers", reason="the model side needs transformers")
pytestmark = pytest.mark.model

FORMATS = (torch.int8, torch.float8_e4m3fn, torch.uint8)  # uint8: int4 codes, two per byte
# Largest logit error of a quantized cache against the float cache, as a share of the logits' largest magnitude:
# measured 0.3-3.2% (int8), 1.8-9.8% (e4m3) and 10-59% (int4: 15 levels) over 8 draws of the tiny random models (llama,
# qwen3; every call after the prompt); the bounds are twice those.
LOGIT_ERROR = {torch.int8: 0.065, torch.float8_e4m3fn: 0.2, torch.uint8: 1.2}


def _steps(model, ids, mask, steps: int, chunk: int):
    """Logits of a prompt call, then of `chunk` tokens in one call (a prefill over the cache), then of `steps` single
    tokens (decode), teacher-forced on fixed tokens drawn on the CPU (the same on every device); and the cache."""
    generator = torch.Generator().manual_seed(1)
    cache = transformers.DynamicCache()
    passed = {cache_keyword(model): cache}  # cache= from transformers 5.24, past_key_values= before
    logits = []
    with torch.no_grad():  # positions count each request's real tokens, as generate() numbers them (Palu needs it)
        out = model(input_ids=ids, attention_mask=mask, **passed, use_cache=True,
                    position_ids=(mask.cumsum(1) - 1).clamp_min(0))
        logits.append(out.logits[:, -1])
        for count in [chunk] + [1] * steps:
            new = torch.randint(1, model.config.vocab_size, (ids.shape[0], count), generator=generator).to(ids.device)
            mask = torch.cat([mask, torch.ones_like(new)], dim=1)
            out = model(input_ids=new, attention_mask=mask, **passed, use_cache=True,
                        position_ids=mask.cumsum(1)[:, -count:] - 1)
            logits.append(out.logits[:, -1])
    return logits, cache


@pytest.mark.parametrize("method", ["fdc", "palu"])  # FDC's rows; Palu's key latent and values (the paper's KVQ-P)
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_quantized_cache_stays_near_the_float_cache(family, kv_dtype, method):
    generator, rng, replay = case_generator(f"hf quantized cache {kv_dtype} {method}",
                                            ["llama", "qwen3"].index(family))
    model, artifact = calibrated(family, rng.randrange(1000))
    allocation = hf.compress(model, artifact, compression=rng.choice([0.2, 0.4]), method=method)
    ids, mask = left_padded(generator, model.config.vocab_size, [rng.randrange(3, 20) for _ in range(3)])
    expected, float_cache = _steps(model, ids, mask, steps=4, chunk=3)
    hf.restore(model)
    name = {torch.int8: "int8", torch.float8_e4m3fn: "float8_e4m3fn", torch.uint8: "int4"}[kv_dtype]
    hf.compress(model, artifact, allocation=allocation, kv_dtype=name, method=method)
    actual, cache = _steps(model, ids, mask, steps=4, chunk=3)

    # the prompt's own call does not see the quantization, only the mixing's rounding (artifact.mix_kept_columns)
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-5, msg=replay)
    for step, (got, want) in enumerate(zip(actual[1:], expected[1:])):
        error = float((got - want).abs().max() / want.abs().max())
        assert 0 < error < LOGIT_ERROR[kv_dtype], f"call {step + 1}: logit error {error:.4f} {kv_dtype} {replay}"

    layers = [layer for layer in cache.layers if isinstance(layer, CompressedKVLayer)]
    assert layers and all(layer.k_cache.dtype == kv_dtype and layer.v_cache.dtype == kv_dtype for layer in layers)
    tokens = [layer.cached_tokens() for layer in layers]
    widths = [ops.cache_width(layer.k_offsets, kv_dtype) + ops.cache_width(layer.v_offsets, kv_dtype)
              for layer in layers]
    assert hf.kv_cache_nbytes(cache) == sum(t * w for t, w in zip(tokens, widths))  # codes + scales
    float_bytes = hf.kv_cache_nbytes(float_cache)
    heads = layers[0].k_offsets.shape[0] - 1
    floats = sum(t * int(layer.k_offsets[-1] + layer.v_offsets[-1]) for t, layer in zip(tokens, layers))
    assert float_bytes == floats * 4  # the tiny models run in float32
    code_bytes = floats // 2 if kv_dtype == torch.uint8 else floats  # int4: two codes per byte
    assert hf.kv_cache_nbytes(cache) == code_bytes + sum(t * 8 * heads for t in tokens)


def test_mixing_keeps_every_product_and_spreads_the_kept_dims():
    generator = torch.Generator().manual_seed(11)
    dims = [8, 24, 16]
    query_side, key_side = (torch.randn(3, 32, 24, dtype=torch.float64, generator=generator) for _ in range(2))
    mixed_q, mixed_k = (mix_kept_columns(basis, dims, "qk", 4) for basis in (query_side, key_side))
    for head, width in enumerate(dims):
        kept = slice(0, width)
        torch.testing.assert_close(mixed_q[head, :, kept] @ mixed_k[head, :, kept].T,
                                   query_side[head, :, kept] @ key_side[head, :, kept].T)
        assert torch.equal(mixed_q[head, :, width:], query_side[head, :, width:])  # past the width: untouched
        assert not torch.allclose(mixed_q[head, :, kept], query_side[head, :, kept])
    assert torch.equal(mix_kept_columns(query_side, dims, "qk", 4), mixed_q)  # fixed: every integration mixes alike
    assert not torch.allclose(mix_kept_columns(query_side, dims, "qk", 5), mixed_q)
    # an outlier dim is spread: a row that is one spike has its largest value cut from 1 to about 1/sqrt(width)
    spike = torch.zeros(1, 32, 24, dtype=torch.float64)
    spike[0, 0, 0] = 1.0
    assert float(mix_kept_columns(spike, [24], "v", 0)[0, 0].abs().max()) < 0.7


def test_kv_dtype_refusals():
    model, artifact = calibrated("llama", 3)
    with pytest.raises(ValueError, match=r"fdc_ops.hf.compress: kv_dtype must be None .* got torch.int16"):
        hf.compress(model, artifact, compression=0.2, kv_dtype=torch.int16)
    with pytest.raises(ValueError, match=r"fdc_ops.hf.compress: kv_dtype must be None .* got 'int3'"):
        hf.compress(model, artifact, compression=0.2, kv_dtype="int3")
    hf.compress(model, artifact, compression=0.2, kv_dtype=torch.int8, method="palu")
    ids = torch.randint(1, model.config.vocab_size, (1, 6))
    with pytest.raises(NotImplementedError, match="the Palu baseline runs with a dynamic cache only"), \
            torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, cache_implementation="static",
                       pad_token_id=0)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_a_static_quantized_cache_is_the_dynamic_one(kv_dtype):
    """A StaticCache's compressed layers quantize as the dynamic ones do: a left-padded batch's chunked prompt (the
    second chunk a prefill over the cached, dequantized rows) and decode steps give the dynamic cache's logits, both
    eagerly and through one compiled decode step (fullgraph: the quantized cache's shape states its widths); generate()
    over it gives the dynamic cache's tokens."""
    generator, rng, replay = case_generator(f"static quantized {kv_dtype}", FORMATS.index(kv_dtype))
    model, artifact = calibrated("llama", rng.randrange(1000))
    hf.compress(model, artifact, compression=0.4, kv_dtype=kv_dtype)
    keyword = hf.cache_keyword(model)
    ids, mask = left_padded(generator, model.config.vocab_size, [9, 5])
    static = transformers.StaticCache(config=model.config, max_cache_len=24)
    dynamic = transformers.DynamicCache()
    step = torch.compile(model.forward, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad():
        split = rng.randrange(1, ids.shape[1])
        for chunk in (slice(0, split), slice(split, None)):
            expected = model(input_ids=ids[:, chunk], attention_mask=mask[:, : chunk.stop], **{keyword: dynamic})
            actual = model(input_ids=ids[:, chunk], attention_mask=mask[:, : chunk.stop], **{keyword: static})
            torch.testing.assert_close(actual.logits, expected.logits, rtol=1e-5, atol=1e-5, msg=replay)
        logits = expected.logits[:, -1]
        for index in range(4):
            token = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            torch._dynamo.mark_dynamic(mask, 1)
            forward = step if index % 2 else model
            actual = forward(input_ids=token, attention_mask=mask, **{keyword: static}).logits[:, -1]
            logits = model(input_ids=token, attention_mask=mask, **{keyword: dynamic}).logits[:, -1]
            torch.testing.assert_close(actual, logits, rtol=1e-5, atol=1e-5, msg=replay)
    layers = [layer for layer in static.layers if isinstance(layer, CompressedKVLayer)]
    assert layers and all(layer.k_cache.dtype == kv_dtype for layer in layers), replay
    prompt_ids, prompt_mask = left_padded(generator, model.config.vocab_size, [7, 4])
    expected = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=5, do_sample=False,
                              pad_token_id=0)
    actual = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=5, do_sample=False,
                            pad_token_id=0, cache_implementation="static")
    assert torch.equal(actual, expected), replay


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
def test_a_one_token_prompt_attends_its_own_unquantized_rows(cache_kind):
    """A prompt of one token per request into an empty quantized cache (which a decode step's shape would read back
    quantized) sees no quantization, as longer prompts do: its logits are the float cache's."""
    generator, rng, replay = case_generator(f"one-token prompt {cache_kind}", 0)
    model, artifact = calibrated("llama", rng.randrange(1000))
    allocation = hf.compress(model, artifact, compression=0.4)
    ids = torch.randint(1, model.config.vocab_size, (2, 1), generator=generator)
    keyword = hf.cache_keyword(model)

    def prompt_logits() -> torch.Tensor:
        cache = transformers.DynamicCache() if cache_kind == "dynamic" else \
            transformers.StaticCache(config=model.config, max_cache_len=8)
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=torch.ones_like(ids), **{keyword: cache}).logits

    expected = prompt_logits()
    hf.restore(model)
    hf.compress(model, artifact, allocation=allocation, kv_dtype="int4")
    torch.testing.assert_close(prompt_logits(), expected, rtol=1e-5, atol=1e-5, msg=replay)


@pytest.mark.parametrize("method", ["fdc", "palu"])
def test_eviction_keeps_the_same_tokens_of_a_quantized_cache(method):
    """Eviction and a quantized cache stacked (the paper's three compressions at once): the prompt's scores come from
    its own unquantized keys, as it attended them (Palu: its rebuilt keys), so the selection is the float cache's;
    the kept rows move with their scales, later steps read them, the cache holds what it keeps, and the logits stay
    within the int8 bound of the float cache with the same eviction."""
    generator, rng, replay = case_generator(f"quantized eviction {method}", 0)
    model, artifact = calibrated("llama", rng.randrange(1000))
    settings = dict(eviction="snapkv", keep=0.5, method=method)
    allocation = hf.compress(model, artifact, compression=0.2, **settings)
    ids, mask = left_padded(generator, model.config.vocab_size, [rng.randrange(40, 60) for _ in range(2)])
    expected, float_cache = _steps(model, ids, mask, steps=3, chunk=2)
    hf.restore(model)
    hf.compress(model, artifact, allocation=allocation, kv_dtype="int8", **settings)
    actual, cache = _steps(model, ids, mask, steps=3, chunk=2)
    for float_layer, layer in zip(float_cache.layers, cache.layers):
        assert torch.equal(layer.kept_positions, float_layer.kept_positions), replay
        assert layer.host_lengths == float_layer.host_lengths and layer.k_cache.dtype == torch.int8, replay
    for step, (got, want) in enumerate(zip(actual[1:], expected[1:])):
        error = float((got - want).abs().max() / want.abs().max())
        assert error < LOGIT_ERROR[torch.int8], f"call {step + 1}: logit error {error:.4f} {replay}"
