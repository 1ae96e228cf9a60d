"""Sliding-window models compressed: Mistral (every layer windowed), Qwen2 with ``use_sliding_window``, Gemma 2 and
Gemma 3's text model (windowed and full layers mixed; Gemma 2's logits soft-capped, Gemma 3's local RoPE and q/k
norms), tiny random-weight checkpoints, FDC and Palu, against the original models with their own sliding-window masks
and caches; the compressed cache of a windowed layer staying bounded, dynamic and static."""

from __future__ import annotations

import pytest
import torch

from conftest import case_generator
from fdc_ops import calibration, hf
from fdc_ops.hf import families
from fdc_ops.hf.modules import INITIAL_CAPACITY, CompressedKVLayer, StaticWindowCompressedKVLayer
from tiny_models import tiny_model

transformers = pytest.importorskip("transformers", reason="the model side needs transformers")
pytestmark = pytest.mark.model
METHODS = ("fdc", "palu")
WINDOW = 6  # positions a query sees, its own included: far shorter than the prompts and generations below
WINDOWED = {
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 0 full, 1 windowed
    "gemma2": dict(sliding_window=WINDOW),  # layer 0 windowed, 1 full; soft-capped logits (tiny_models.py)
    "gemma3": dict(sliding_window=WINDOW),  # layer 0 windowed (its own RoPE base), 1 full; q/k norms
}


def windowed_model(family: str, seed: int):
    model = tiny_model(family, seed=seed, **WINDOWED[family])
    if family == "gemma2":  # transformers 5.16's sdpa path drops Gemma 2's soft-cap; its eager path is the model
        model.config._attn_implementation = "eager"
    artifact = calibration.calibrate(model, text="random", num_tokens=128, seq_len=32, seed=seed, sensitivity_tokens=64,
                                     progress=False)
    return model, artifact


def generate(model, ids, mask=None, **kwargs):
    settings = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    settings.update(kwargs)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **settings)


def test_layer_windows_follow_the_config():
    mistral = tiny_model("mistral", **WINDOWED["mistral"]).config
    qwen2 = tiny_model("qwen2", **WINDOWED["qwen2"]).config
    assert [families.layer_window(mistral, layer) for layer in range(2)] == [WINDOW - 1, WINDOW - 1]
    assert [families.layer_window(qwen2, layer) for layer in range(2)] == [-1, WINDOW - 1]
    assert families.layer_window(tiny_model("qwen2").config, 1) == -1  # use_sliding_window off
    assert families.layer_window(tiny_model("llama").config, 0) == -1
    gemma2 = tiny_model("gemma2", **WINDOWED["gemma2"]).config
    assert [families.layer_window(gemma2, layer) for layer in range(2)] == [WINDOW - 1, -1]
    assert families.logit_softcap(gemma2) == 2.0 and families.logit_softcap(mistral) == 0.0
    gemma3 = tiny_model("gemma3", **WINDOWED["gemma3"]).config
    assert [families.layer_window(gemma3, layer) for layer in range(2)] == [WINDOW - 1, -1]
    local, full = (gemma3.rope_parameters[kind]["rope_theta"] for kind in ("sliding_attention", "full_attention"))
    assert local != full  # two RoPEs: the compressed layers must take each layer's own


@pytest.mark.parametrize("family", sorted(WINDOWED))
@pytest.mark.parametrize("method", METHODS)
def test_full_rank_matches_the_windowed_original(family, method):
    """At full rank the compressed model computes what the original computes with its sliding-window mask: logits of
    prompts three to five windows long, greedy tokens generated far past the window (transformers' own
    sliding-window cache on the original's side), and a left-padded batch equal to each prompt alone."""
    generator, rng, replay = case_generator(f"windowed_{family}_{method}", 0)
    model, artifact = windowed_model(family, rng.randrange(1000))
    ids = torch.randint(1, model.config.vocab_size, (2, rng.randrange(3 * WINDOW, 5 * WINDOW)), generator=generator)
    with torch.no_grad():
        expected_logits = model(input_ids=ids, use_cache=False).logits
    expected_tokens = generate(model, ids)
    lengths = [rng.randrange(2, 4 * WINDOW) for _ in range(3)]
    width = max(lengths)
    padded, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        padded[row, width - length:] = torch.randint(1, model.config.vocab_size, (length,), generator=generator)
        mask[row, width - length:] = 1
    expected_padded = generate(model, padded, mask)

    hf.compress(model, artifact, removal_rate=0.0, method=method)
    with torch.no_grad():
        actual_logits = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(actual_logits, expected_logits, rtol=1e-4,
                               atol=1e-4 * expected_logits.abs().max().item(), msg=replay)
    assert torch.equal(generate(model, ids), expected_tokens), replay
    batched = generate(model, padded, mask)
    assert torch.equal(batched, expected_padded), replay
    for row, length in enumerate(lengths):
        alone = generate(model, padded[row:row + 1, width - length:])[0, length:]
        assert torch.equal(alone, batched[row, width: width + len(alone)]), f"row {row}: {replay}"


@pytest.mark.parametrize("method", METHODS)
def test_a_windowed_layer_keeps_a_bounded_cache(method):
    """Generating 24 windows' worth of tokens: a windowed layer's cache keeps its first buffers (it drops what its
    window no longer sees when they fill) while a full-attention layer's grows to every token, and the tokens are
    those of a cache that drops nothing."""
    generator, rng, replay = case_generator(f"windowed_cache_{method}", 0)
    model, artifact = windowed_model("qwen2", rng.randrange(1000))
    hf.compress(model, artifact, compression=0.3, method=method)
    ids = torch.randint(1, model.config.vocab_size, (2, 2 * WINDOW + 3), generator=generator)
    steps = 24 * WINDOW
    keyword = hf.cache_keyword(model)

    def run(cache):
        return generate(model, ids, max_new_tokens=steps, min_new_tokens=steps, **{keyword: cache})

    cache = transformers.DynamicCache()
    tokens = run(cache)
    full, windowed = cache.layers
    assert isinstance(full, CompressedKVLayer) and isinstance(windowed, CompressedKVLayer)
    total = ids.shape[1] + steps - 1  # the last token is generated, not cached
    assert full.host_lengths == [total, total]
    # Its buffers never grew past their first allocation (the prompt fits it), rows past the window were dropped.
    assert windowed.k_cache.shape[1] == INITIAL_CAPACITY < total, windowed.k_cache.shape
    assert min(windowed.host_first_positions) > 0 and max(windowed.host_lengths) <= INITIAL_CAPACITY
    ends = [first + length for first, length in zip(windowed.host_first_positions, windowed.host_lengths)]
    assert ends == [total, total]
    assert windowed.nbytes(allocated=True) < full.nbytes(allocated=True) / 2

    keeping = transformers.DynamicCache()  # layers that never drop a row; the ops still apply the window
    keeping.layers[:] = [CompressedKVLayer(*layer.self_attn.cache_offsets()) for layer in model.get_decoder().layers]
    assert torch.equal(run(keeping), tokens), replay
    assert keeping.layers[1].host_lengths == [total, total]


def left_padded(generator, vocab: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, max length) ids and 0/1 mask of random prompts of the given lengths, left-padded with 0."""
    width = max(lengths)
    ids, mask = torch.zeros(len(lengths), width, dtype=torch.long), torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(1, vocab, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_a_static_cache_of_a_windowed_model_is_the_dynamic_one(family):
    """A StaticCache's sliding-window layers (transformers sizes them at the window) become rings of the window's
    rows: generate() of a left-padded batch far past the window (the masks generate() builds for a static cache, sdpa
    and eager), beam search, and a prompt given in chunks that cross the window's edge (a chunk over a full ring
    included) give the dynamic cache's tokens and logits; a windowed layer holds the window, a full one every token;
    a static cache shorter than the window keeps its rows in order, with the same logits."""
    generator, rng, replay = case_generator(f"static_windowed_{family}", 0)
    model, artifact = windowed_model(family, rng.randrange(1000))
    hf.compress(model, artifact, compression=rng.choice([0.2, 0.4]))
    ids, mask = left_padded(generator, model.config.vocab_size, [rng.randrange(2, 3 * WINDOW) for _ in range(3)])
    for implementation in ("eager",) if family == "gemma2" else ("sdpa", "eager"):
        model.config._attn_implementation = implementation
        expected = generate(model, ids, mask, max_new_tokens=4 * WINDOW)
        assert torch.equal(generate(model, ids, mask, max_new_tokens=4 * WINDOW, cache_implementation="static"),
                           expected), f"{implementation}: {replay}"
    beams = generate(model, ids[1:2], num_beams=3, max_new_tokens=2 * WINDOW)
    assert torch.equal(generate(model, ids[1:2], num_beams=3, max_new_tokens=2 * WINDOW,
                                cache_implementation="static"), beams), replay

    keyword = hf.cache_keyword(model)
    long_ids, long_mask = left_padded(generator, model.config.vocab_size, [3 * WINDOW + 2, 2 * WINDOW - 1])
    cuts = sorted(rng.sample(range(1, long_ids.shape[1]), 3))  # chunks of random lengths, some past the window
    static = transformers.StaticCache(config=model.config, max_cache_len=long_ids.shape[1] + 2)
    dynamic = transformers.DynamicCache()
    with torch.no_grad():
        for start, stop in zip([0, *cuts], [*cuts, long_ids.shape[1]]):
            expected = model(input_ids=long_ids[:, start:stop], attention_mask=long_mask[:, :stop],
                             **{keyword: dynamic})
            actual = model(input_ids=long_ids[:, start:stop], attention_mask=long_mask[:, :stop], **{keyword: static})
            torch.testing.assert_close(actual.logits, expected.logits, rtol=1e-5, atol=1e-5, msg=replay)
    for layer, windowed in zip(static.layers, (families.layer_window(model.config, i) >= 0 for i in range(2))):
        assert isinstance(layer, StaticWindowCompressedKVLayer) == windowed, replay
        held = [min(WINDOW, length) if windowed else length for length in long_mask.sum(1).tolist()]
        assert layer.k_cache.shape[1] == (WINDOW if windowed else long_ids.shape[1] + 2), replay
        assert layer.nbytes() == sum(held) * (layer.k_cache.shape[2] + layer.v_cache.shape[2]) * \
            layer.k_cache.element_size(), replay

    short = transformers.StaticCache(config=model.config, max_cache_len=WINDOW - 1)
    dynamic = transformers.DynamicCache()
    with torch.no_grad():
        expected = model(input_ids=long_ids[:, -3:], **{keyword: dynamic})
        actual = model(input_ids=long_ids[:, -3:], **{keyword: short})
    torch.testing.assert_close(actual.logits, expected.logits, rtol=1e-5, atol=1e-5, msg=replay)
    assert not any(isinstance(layer, StaticWindowCompressedKVLayer) for layer in short.layers), replay


@pytest.mark.parametrize("family,kv_dtype", [("mistral", "int4"), ("qwen2", "float8_e4m3fn"), ("gemma3", "int8")])
def test_a_static_windowed_cache_quantizes_and_compiles(family, kv_dtype):
    """A quantized StaticCache of a windowed model gives the dynamic cache's tokens, eagerly and through generate()'s
    own compilation of the decode step (fullgraph, no graph break; two graphs: the first specialised on the
    positions seen, the second with them symbolic, as for transformers' own sliding layers)."""
    generator, rng, replay = case_generator(f"static_windowed_quantized_{family}", 0)
    model, artifact = windowed_model(family, rng.randrange(1000))
    hf.compress(model, artifact, compression=0.3, kv_dtype=kv_dtype)
    ids, mask = left_padded(generator, model.config.vocab_size, [rng.randrange(2, WINDOW), 2 * WINDOW + 1])
    expected = generate(model, ids, mask, max_new_tokens=3 * WINDOW)
    assert torch.equal(generate(model, ids, mask, max_new_tokens=3 * WINDOW, cache_implementation="static"),
                       expected), replay
    config = transformers.CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # generate() compiles on accelerators only unless told
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    assert torch.equal(generate(model, ids, mask, max_new_tokens=3 * WINDOW, cache_implementation="static",
                                compile_config=config), expected), replay
    assert counters["stats"]["unique_graphs"] - graphs <= 2, "a graph per step: the positions seen stay a guard"
    assert sum(counters["graph_break"].values()) == breaks, f"graph breaks: {dict(counters['graph_break'])}"
