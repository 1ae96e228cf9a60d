"""Eviction in compressed Hugging Face models (fdc_ops.hf.compress(..., eviction=..., keep=...)): after a prompt
each layer keeps the tokens its scores choose, and the continuation equals the original model attending, layer by
layer, to exactly those tokens; keeping everything changes nothing; left-padded batches generate what each prompt
generates alone."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import case_generator
from fdc_ops import eviction, hf, reference
from fdc_ops.apps.eviction_simulation import simulate_eviction
from fdc_ops.hf.modules import CompressedKVLayer
from test_hf import calibrated, generate, left_padded
from tiny_models import FAMILIES

transformers = pytest.importorskip("transformers", reason="the model side needs transformers")
pytestmark = pytest.mark.model
METHODS = ("fdc", "palu")


def _run(model, ids, mask, continuation):
    """Prompt then continuation through one dynamic cache: (continuation logits, cache)."""
    cache = transformers.DynamicCache()
    keyword = hf.cache_keyword(model)
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    full_mask = torch.cat([mask, torch.ones_like(continuation)], dim=1)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{keyword: cache})
        later = positions[:, -1:] + 1 + torch.arange(continuation.shape[1])[None, :]
        logits = model(input_ids=continuation, attention_mask=full_mask, position_ids=later, use_cache=True,
                       **{keyword: cache}).logits
    return logits, cache


def _kept(cache) -> list[list[list[int]]]:
    """Per layer, per request: the positions (real tokens counted from 0) its rows hold."""
    kept = []
    for layer in cache.layers:
        assert isinstance(layer, CompressedKVLayer)
        rows = layer.positions_of_rows(max(layer.host_lengths))
        kept.append([rows[b, :length].tolist() for b, length in enumerate(layer.host_lengths)])
    return kept


def _original_attending(model, ids, mask, continuation, kept):
    """The original model's logits of the continuation when, in each layer, the continuation's queries see only
    that layer's kept prompt tokens (eager attention, one 4-D mask per layer put in by a pre-hook). kept[layer][b]:
    one list of kept positions per KV head (query heads see their KV head's)."""
    B, P = ids.shape
    C = continuation.shape[1]
    H, H_kv = model.config.num_attention_heads, model.config.num_key_value_heads
    sequence = torch.cat([ids, continuation], dim=1)
    real = torch.cat([mask, torch.ones_like(continuation)], dim=1).bool()
    positions = (real.cumsum(1) - 1).clamp_min(0)
    causal = torch.ones(P + C, P + C, dtype=torch.bool).tril()
    masks = []
    for layer_kept in kept:
        visible = (causal[None] & real[:, None, :])[:, None].repeat(1, H, 1, 1)  # (B, H, P + C, P + C)
        for b, heads in enumerate(layer_kept):
            padding = P - int(mask[b].sum())
            for head, tokens in enumerate(heads):
                allowed = torch.zeros(P, dtype=torch.bool)
                allowed[[padding + token for token in tokens]] = True
                group = slice(head * H // H_kv, (head + 1) * H // H_kv)
                visible[b, group, P:, :P] &= allowed[None, None, :]
        masks.append(torch.zeros(B, H, P + C, P + C).masked_fill(~visible, torch.finfo(torch.float32).min))
    hooks = []
    for layer, additive in zip(model.get_decoder().layers, masks):
        def put_mask(_module, args, kwargs, additive=additive):
            kwargs["attention_mask"] = additive
            return args, kwargs

        hooks.append(layer.self_attn.register_forward_pre_hook(put_mask, with_kwargs=True))
    model.config._attn_implementation = "eager"
    try:
        with torch.no_grad():
            logits = model(input_ids=sequence, attention_mask=real.long(), position_ids=positions,
                           use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    return logits[:, P:]


def _case(generator, rng):
    """A random tiny model of a random family, calibrated, and three left-padded prompts with a continuation:
    (family, model, artifact, lengths, ids, mask, continuation)."""
    family = rng.choice(FAMILIES)
    model, artifact = calibrated(family, rng.randrange(1000))
    lengths = [rng.randrange(12, 40) for _ in range(3)]
    ids, mask = left_padded(generator, model.config.vocab_size, lengths)
    continuation = torch.randint(1, model.config.vocab_size, (3, 5), generator=generator)
    return family, model, artifact, lengths, ids, mask, continuation


def _snapkv_scores(model, ids, mask, lengths, policy) -> list[list[torch.Tensor]]:
    """SnapKV's rule on the original model's eager attention weights, in float64: per layer, per request, (H_kv,
    length) scores of its real tokens (probabilities averaged over the window's queries and each KV head's query
    heads, max-pooled over policy.kernel keys)."""
    model.config._attn_implementation = "eager"
    real = mask.bool()
    with torch.no_grad():
        attentions = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0),
                           output_attentions=True, use_cache=False).attentions
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    half = policy.kernel // 2
    scores = []
    for weights in attentions:  # (B, H, P, P)
        scores.append([])
        for b, length in enumerate(lengths):
            w = weights[b][:, real[b]][:, :, real[b]].double()  # (H, length, length), real tokens only
            taken = min(policy.window, length)
            mean = w[:, length - taken:].sum(1).view(-1, group, length).sum(1) / (taken * group)  # (H_kv, L)
            scores[-1].append(torch.stack([torch.stack([row[max(0, i - half): i + half + 1].max()
                                                        for i in range(length)]) for row in mean]))
    return scores


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("policy_name", eviction.METHODS)
def test_continuation_equals_the_original_model_attending_the_kept_tokens(method, policy_name):
    generator, rng, replay = case_generator(f"hf_eviction_{method}_{policy_name}", 0)
    family, model, artifact, lengths, ids, mask, continuation = _case(generator, rng)
    policy = eviction.EvictionPolicy(policy_name, keep=rng.choice([0.3, 0.5]), window=rng.choice([2, 4, 8]),
                                     recent=rng.choice([None, 1]), kernel=3, seed=rng.randrange(100))
    hf.compress(model, artifact, removal_rate=0.0, method=method, eviction=policy)
    logits, cache = _run(model, ids, mask, continuation)
    kept = _kept(cache)
    for layer_kept in kept:
        for tokens, length in zip(layer_kept, lengths):
            budget = policy.kept_tokens(length)
            assert len(tokens) == budget + 5, replay  # the prompt's kept tokens, then the continuation's
            recent = min(policy.recent_tokens, budget)
            assert tokens[budget - recent: budget] == list(range(length - recent, length)), replay
            assert tokens == sorted(set(tokens)), replay
    assert hf.kv_cache_nbytes(cache) < sum(lengths) * len(kept) * 2 * 2 * 16 * 4
    hf.restore(model)
    H_kv = model.config.num_key_value_heads
    expected = _original_attending(model, ids, mask, continuation, [[[tokens[: policy.kept_tokens(length)]] * H_kv
                                                                     for tokens, length in zip(layer, lengths)]
                                                                    for layer in kept])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item(),
                               msg=f"{family}: {replay}")
    if policy_name == "snapkv":  # the choice itself: SnapKV's rule on the original model's eager attention
        for layer, requests in enumerate(_snapkv_scores(model, ids, mask, lengths, policy)):
            for b, (pooled, length) in enumerate(zip(requests, lengths)):
                choice = reference.select_tokens_ref(pooled.sum(0)[None], torch.tensor([length]), policy)[0]
                assert kept[layer][b][: len(choice)] == choice, f"layer {layer} request {b}: {replay}"


@pytest.mark.parametrize("method", METHODS)
def test_keeping_every_token_changes_nothing(method):
    generator, rng, replay = case_generator(f"hf_eviction_keep_all_{method}", 0)
    family = rng.choice(FAMILIES)
    model, artifact = calibrated(family, rng.randrange(1000))
    ids, mask = left_padded(generator, model.config.vocab_size, [rng.randrange(4, 30) for _ in range(3)])
    hf.compress(model, artifact, compression=0.3, method=method)
    expected = generate(model, ids, mask)
    hf.restore(model)
    hf.compress(model, artifact, compression=0.3, method=method, eviction="keyformer", keep=1.0)
    assert torch.equal(generate(model, ids, mask), expected), f"{family}: {replay}"


@pytest.mark.parametrize("method", METHODS)
def test_left_padded_batch_with_eviction_generates_what_each_prompt_generates_alone(method):
    generator, rng, replay = case_generator(f"hf_eviction_padding_{method}", 0)
    family = rng.choice(FAMILIES)
    model, artifact = calibrated(family, rng.randrange(1000))
    lengths = [rng.randrange(10, 30) for _ in range(3)]
    ids, mask = left_padded(generator, model.config.vocab_size, lengths)
    hf.compress(model, artifact, compression=0.2, method=method, eviction="keyformer", keep=0.5)
    batched = generate(model, ids, mask)
    width = ids.shape[1]
    for row, length in enumerate(lengths):
        prompt = ids[row, width - length:]
        alone = generate(model, prompt[None])[0, length:]
        assert torch.equal(alone, batched[row, width: width + len(alone)]), f"{family} row {row}: {replay}"


def test_eviction_shrinks_the_cache_by_the_kept_share():
    generator, rng, _ = case_generator("hf_eviction_bytes", 0)
    model, artifact = calibrated("llama", rng.randrange(1000))
    ids = torch.randint(1, model.config.vocab_size, (2, 60), generator=generator)
    hf.compress(model, artifact, compression=0.25)
    sizes = {}
    for keep in (None, 0.25):
        hf.restore(model)
        hf.compress(model, artifact, compression=0.25, **({} if keep is None else {"eviction": "snapkv",
                                                                                  "keep": keep}))
        cache = transformers.DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{hf.cache_keyword(model): cache})
        sizes[keep] = hf.kv_cache_nbytes(cache)
        assert cache.get_seq_length() == 60  # positions seen, not rows kept: the next token's position
    assert sizes[0.25] * 60 == sizes[None] * math.ceil(0.25 * 60)


def test_eviction_refuses_what_it_cannot_do():
    model, artifact = calibrated("llama", 3)
    with pytest.raises(ValueError, match="keep must be a share"):
        hf.compress(model, artifact, compression=0.2, eviction="keyformer", keep=0.0)
    with pytest.raises(ValueError, match="needs keep"):
        hf.compress(model, artifact, compression=0.2, eviction="snapkv")
    with pytest.raises(ValueError, match="needs an eviction method"):
        hf.compress(model, artifact, compression=0.2, keep=0.5)
    with pytest.raises(ValueError, match="eviction must be one of"):
        hf.compress(model, artifact, compression=0.2, eviction="h2o", keep=0.5)
    assert getattr(model, "_fdc_compression", None) is None  # nothing was swapped in
    hf.compress(model, artifact, compression=0.2, eviction="snapkv", keep=0.5)
    ids = torch.randint(1, model.config.vocab_size, (1, 12))
    with pytest.raises(NotImplementedError, match="eviction runs with the dynamic cache only"):
        generate(model, ids, cache_implementation="static")
    windowed, windowed_artifact = calibrated("mistral", 3, sliding_window=8)
    with pytest.raises(NotImplementedError, match="sliding-window layers"):
        hf.compress(windowed, windowed_artifact, compression=0.2, eviction="snapkv", keep=0.5)


def test_continuation_perplexity_scores_the_tokens_after_the_prompt():
    from fdc_ops.apps import metrics

    generator, rng, _ = case_generator("continuation_perplexity", 0)
    model, _ = calibrated("qwen2", rng.randrange(1000))
    windows = torch.randint(1, model.config.vocab_size, (3, 40), generator=generator)
    with torch.no_grad():
        logits = model(input_ids=windows, use_cache=False).logits[:, 29:-1]
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 30:].flatten())
    actual = metrics.continuation_perplexity(model, windows, 30, batch_size=2, progress=False)
    assert actual == pytest.approx(math.exp(nll.item()), rel=1e-5)


def test_a_saved_model_loads_back_with_the_eviction_asked_for(tmp_path):
    generator, rng, _ = case_generator("hf_eviction_saved", 0)
    model, artifact = calibrated("llama", rng.randrange(1000))
    ids = torch.randint(1, model.config.vocab_size, (1, 40), generator=generator)
    hf.compress(model, artifact, compression=0.2, eviction="keyformer", keep=0.5)
    expected = generate(model, ids)
    hf.save_compressed(model, tmp_path / "saved")
    loaded = hf.load_compressed(tmp_path / "saved", eviction="keyformer", keep=0.5)
    assert loaded._fdc_compression["eviction"] == eviction.EvictionPolicy("keyformer", 0.5)
    assert torch.equal(generate(loaded, ids), expected)


def _simulated(model, ids, mask, continuation, policy, per_head):
    """Continuation logits and per-layer kept positions (per request, per KV head) of the eviction simulation."""
    with simulate_eviction(model, policy, per_head) as selection:
        logits, _ = _run(model, ids, mask, continuation)
    P = ids.shape[1]
    kept = [[[(torch.nonzero(heads[head]).flatten() - (P - int(mask[b].sum()))).tolist()
              for head in range(heads.shape[0])] for b, heads in enumerate(selection.kept[layer])]
            for layer in sorted(selection.kept)]
    return logits, kept


@pytest.mark.parametrize("policy_name", eviction.METHODS)
def test_simulated_shared_eviction_is_what_the_compressed_cache_keeps(policy_name):
    """The simulation choosing once per layer (as the packed cache must) keeps the tokens the compressed modules
    keep and gives their continuation, which validates it for the per-head choice it exists to measure."""
    generator, rng, replay = case_generator(f"simulated_eviction_{policy_name}", 0)
    family, model, artifact, lengths, ids, mask, continuation = _case(generator, rng)
    policy = eviction.EvictionPolicy(policy_name, keep=rng.choice([0.3, 0.5]), window=rng.choice([2, 4, 8]),
                                     kernel=3, seed=rng.randrange(100))
    simulated, kept = _simulated(model, ids, mask, continuation, policy, per_head=False)
    hf.compress(model, artifact, removal_rate=0.0, eviction=policy)
    logits, cache = _run(model, ids, mask, continuation)
    hf.restore(model)
    for layer, (real_layer, simulated_layer) in enumerate(zip(_kept(cache), kept)):
        for b, (tokens, heads) in enumerate(zip(real_layer, simulated_layer)):
            assert all(head == tokens[: policy.kept_tokens(lengths[b])] for head in heads), \
                f"{family} layer {layer} request {b}: {replay}"
    torch.testing.assert_close(simulated, logits, rtol=1e-4, atol=1e-4 * logits.abs().max().item(),
                               msg=f"{family}: {replay}")


def test_simulated_per_head_eviction_keeps_each_heads_own_choice():
    """Per KV head: each head keeps SnapKV's choice on its own attention (checked on the original model's eager
    attention weights, in float64), and the continuation equals the original model attending per head to exactly
    those tokens. Keeping everything is the original model. A case whose heads all happen to choose alike (about 3%
    of draws on these 2-head models) tests nothing per head, so cases are drawn until one differs."""
    for case in range(4):
        generator, rng, replay = case_generator("simulated_eviction_per_head", case)
        family, model, _, lengths, ids, mask, continuation = _case(generator, rng)
        policy = eviction.EvictionPolicy("snapkv", keep=rng.choice([0.3, 0.5]), window=rng.choice([2, 4, 8]),
                                         kernel=3)
        logits, kept = _simulated(model, ids, mask, continuation, policy, per_head=True)
        expected = _original_attending(model, ids, mask, continuation, kept)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item(),
                                   msg=f"{family}: {replay}")
        H_kv = model.config.num_key_value_heads
        differs = False
        for layer, requests in enumerate(_snapkv_scores(model, ids, mask, lengths, policy)):
            for b, (pooled, length) in enumerate(zip(requests, lengths)):
                choices = reference.select_tokens_ref(pooled, torch.tensor([length] * H_kv), policy)
                assert kept[layer][b] == choices, f"layer {layer} request {b}: {replay}"
                differs |= any(choice != choices[0] for choice in choices)
        everything = eviction.EvictionPolicy("keyformer", keep=1.0)
        unchanged, _ = _simulated(model, ids, mask, continuation, everything, per_head=True)
        torch.testing.assert_close(unchanged, _run(model, ids, mask, continuation)[0], rtol=1e-4, atol=1e-5)
        if differs:
            break
    assert differs, f"every head chose alike in 4 cases, so per-head choice went untested: {replay}"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("policy_name", eviction.METHODS)
def test_per_head_eviction_keeps_each_heads_own_tokens(method, policy_name):
    """EvictionPolicy(per_head=True) in the compressed cache: each KV head's columns of the rows hold the tokens that
    head chose (the simulation's per-head choice, the same count per head), Palu's keys are rebuilt at each head's
    own positions, and the continuation equals the original model attending per head to exactly those tokens. Cases
    are drawn until one whose heads chose differently (on these 2-head models most do)."""
    for case in range(4):
        generator, rng, replay = case_generator(f"hf_eviction_per_head_{method}_{policy_name}", case)
        family, model, artifact, lengths, ids, mask, continuation = _case(generator, rng)
        policy = eviction.EvictionPolicy(policy_name, keep=rng.choice([0.3, 0.5]), window=rng.choice([2, 4, 8]),
                                         recent=rng.choice([None, 1]), kernel=3, seed=rng.randrange(100),
                                         per_head=True)
        _, simulated = _simulated(model, ids, mask, continuation, policy, per_head=True)
        hf.compress(model, artifact, removal_rate=0.0, method=method, eviction=policy)
        logits, cache = _run(model, ids, mask, continuation)
        hf.restore(model)
        differs = False
        kept = []
        for layer, (layer_cache, layer_simulated) in enumerate(zip(cache.layers, simulated)):
            rows = layer_cache.positions_of_rows(max(layer_cache.host_lengths))  # (B, H_kv, rows)
            assert rows.dim() == 3, replay
            kept.append([])
            for b, (length, heads) in enumerate(zip(lengths, layer_simulated)):
                budget = policy.kept_tokens(length)
                assert layer_cache.host_lengths[b] == budget + continuation.shape[1], replay
                ours = [rows[b, j, :budget].tolist() for j in range(rows.shape[1])]
                assert ours == heads, f"layer {layer} request {b}: {replay}"
                for j in range(rows.shape[1]):  # the continuation's rows follow in every head
                    later = rows[b, j, budget: layer_cache.host_lengths[b]].tolist()
                    assert later == list(range(length, length + continuation.shape[1])), replay
                differs |= any(head != ours[0] for head in ours)
                kept[-1].append(ours)
        expected = _original_attending(model, ids, mask, continuation, kept)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item(),
                                   msg=f"{family} {method}: {replay}")
        if differs:
            return
    pytest.fail("no case had KV heads choosing differently")
