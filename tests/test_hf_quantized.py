"""hf.compress(..., kv_dtype=torch.int8 / torch.float8_e4m3fn): the compressed cache stored quantized (fdc_ops.ops,
quantized caches). The prompt's own call is untouched (it attends its own rows); later calls read the quantized rows,
one token at a time (decode_attention) or several (the cached rows dequantized for prefill_attention), close to the
float cache; the cache holds the bytes it should; what is not supported yet is refused by name."""

from __future__ import annotations

import pytest
import torch

from conftest import case_generator
from fdc_ops import hf, ops
from fdc_ops.hf.modules import CompressedKVLayer
from test_hf import calibrated, left_padded

transformers = pytest.importorskip("transformers", reason="the model side needs transformers")

FORMATS = (torch.int8, torch.float8_e4m3fn)
# Largest logit error of a quantized cache against the float cache, as a share of the logits' largest magnitude:
# measured 0.3-3.2% (int8) and 1.8-9.8% (e4m3) over 8 draws of the tiny random models (llama, qwen3; every call after
# the prompt); the bounds are twice those.
LOGIT_ERROR = {torch.int8: 0.065, torch.float8_e4m3fn: 0.2}


def _steps(model, ids, mask, steps: int, chunk: int):
    """Logits of a prompt call, then of `chunk` tokens in one call (a prefill over the cache), then of `steps` single
    tokens (decode), teacher-forced on fixed tokens; and the cache."""
    generator = torch.Generator().manual_seed(1)
    cache = transformers.DynamicCache()
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        for count in [chunk] + [1] * steps:
            new = torch.randint(1, model.config.vocab_size, (ids.shape[0], count), generator=generator)
            mask = torch.cat([mask, torch.ones_like(new)], dim=1)
            out = model(input_ids=new, attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    return logits, cache


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_quantized_cache_stays_near_the_float_cache(family, kv_dtype):
    generator, rng, replay = case_generator(f"hf quantized cache {kv_dtype}", ["llama", "qwen3"].index(family))
    model, artifact = calibrated(family, rng.randrange(1000))
    allocation = hf.compress(model, artifact, compression=rng.choice([0.2, 0.4]))
    ids, mask = left_padded(generator, model.config.vocab_size, [rng.randrange(3, 20) for _ in range(3)])
    expected, float_cache = _steps(model, ids, mask, steps=4, chunk=3)
    hf.restore(model)
    hf.compress(model, artifact, allocation=allocation, kv_dtype=kv_dtype)
    actual, cache = _steps(model, ids, mask, steps=4, chunk=3)

    assert torch.equal(actual[0], expected[0]), f"the prompt's own call must not see the quantization {replay}"
    for step, (got, want) in enumerate(zip(actual[1:], expected[1:])):
        error = float((got - want).abs().max() / want.abs().max())
        assert 0 < error < LOGIT_ERROR[kv_dtype], f"call {step + 1}: logit error {error:.4f} {kv_dtype} {replay}"

    layers = [layer for layer in cache.layers if isinstance(layer, CompressedKVLayer)]
    assert layers and all(layer.k_cache.dtype == kv_dtype and layer.v_cache.dtype == kv_dtype for layer in layers)
    tokens = [layer.cached_tokens() for layer in layers]
    widths = [ops.cache_width(layer.k_offsets, kv_dtype) + ops.cache_width(layer.v_offsets, kv_dtype)
              for layer in layers]
    assert hf.kv_cache_nbytes(cache) == sum(t * w for t, w in zip(tokens, widths))  # one byte per element + scales
    float_bytes = hf.kv_cache_nbytes(float_cache)
    heads = layers[0].k_offsets.shape[0] - 1
    floats = sum(t * int(layer.k_offsets[-1] + layer.v_offsets[-1]) for t, layer in zip(tokens, layers))
    assert float_bytes == floats * 4  # the tiny models run in float32
    assert hf.kv_cache_nbytes(cache) == floats + sum(t * 8 * heads for t in tokens)


def test_kv_dtype_refusals():
    model, artifact = calibrated("llama", 3)
    with pytest.raises(ValueError, match=r"fdc_ops.hf.compress: kv_dtype must be None .* got torch.uint8"):
        hf.compress(model, artifact, compression=0.2, kv_dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="fdc_ops.hf.compress: kv_dtype with method='palu'"):
        hf.compress(model, artifact, compression=0.2, method="palu", kv_dtype=torch.int8)
    with pytest.raises(NotImplementedError, match="fdc_ops.hf.compress: kv_dtype with eviction"):
        hf.compress(model, artifact, compression=0.2, kv_dtype=torch.int8, eviction="snapkv", keep=0.5)
    hf.compress(model, artifact, compression=0.2, kv_dtype=torch.int8)
    ids = torch.randint(1, model.config.vocab_size, (1, 6))
    with pytest.raises(NotImplementedError, match="a static cache with a quantized kv_dtype"), torch.no_grad():
        model.generate(input_ids=ids, max_new_tokens=2, do_sample=False, cache_implementation="static",
                       pad_token_id=0)
