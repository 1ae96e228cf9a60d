"""Compressed models: FDC and Palu attention swapped into tiny random models of every supported family, through
forward() and generate() (greedy, sampling, beam search, left-padded batches), and the packed cache's size."""

from __future__ import annotations

import pytest
import torch

from conftest import case_generator
from fdc_ops import calibration, hf
from fdc_ops.hf.modules import CompressedKVLayer, FDCAttention, PaluAttention
from tiny_models import FAMILIES, TINY_MODELS, tiny_model

transformers = pytest.importorskip("transformers", reason="the model side needs transformers")
pytestmark = pytest.mark.model
METHODS = ("fdc", "palu")
#: Tests that draw their family: a random one of FAMILIES, and always the Qwen2.5-Coder shape besides.
DRAWN = ("any family", "qwen2_coder")


def drawn_family(drawn: str, rng) -> str:
    return rng.choice(FAMILIES) if drawn == "any family" else drawn


def calibrated(family: str, seed: int, **overrides):
    model = tiny_model(family, seed=seed, **overrides)
    # 8 tokens a head dim: full-rank statistics of every head (128 tokens for head_dim 16)
    artifact = calibration.calibrate(model, text="random", num_tokens=8 * model.config.head_dim, seq_len=32, seed=seed,
                                     sensitivity_tokens=64, progress=False)
    return model, artifact


def logits_of(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def generate(model, ids, mask=None, **kwargs):
    settings = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    settings.update(kwargs)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **settings)


@pytest.mark.parametrize("family", TINY_MODELS)
@pytest.mark.parametrize("method", METHODS)
def test_full_rank_matches_the_original_model(family, method):
    generator, rng, replay = case_generator(f"full_rank_{method}", TINY_MODELS.index(family))
    model, artifact = calibrated(family, rng.randrange(1000))
    ids = torch.randint(1, model.config.vocab_size, (2, rng.randrange(5, 30)), generator=generator)
    expected_logits = logits_of(model, ids)
    expected_tokens = generate(model, ids)
    allocation = hf.compress(model, artifact, removal_rate=0.0, method=method)
    assert allocation.compression_rate == 0.0
    modules = [layer.self_attn for layer in model.get_decoder().layers]
    assert all(isinstance(m, FDCAttention if method == "fdc" else PaluAttention) for m in modules)
    actual = logits_of(model, ids)
    torch.testing.assert_close(actual, expected_logits, rtol=1e-4, atol=1e-4 * expected_logits.abs().max().item(),
                               msg=replay)
    assert torch.equal(generate(model, ids), expected_tokens), replay
    hf.restore(model)
    assert torch.equal(logits_of(model, ids), expected_logits)


@pytest.mark.parametrize("drawn", DRAWN)
@pytest.mark.parametrize("method", METHODS)
def test_left_padded_batch_generates_what_each_prompt_generates_alone(method, drawn):
    generator, rng, replay = case_generator(f"left_padding_{method}", DRAWN.index(drawn))
    family = drawn_family(drawn, rng)
    model, artifact = calibrated(family, rng.randrange(1000))
    lengths = [rng.randrange(3, 20) for _ in range(3)]
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=generator) for n in lengths]
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    expected = generate(model, ids, mask)
    hf.compress(model, artifact, removal_rate=0.0, method=method)
    batched = generate(model, ids, mask)
    assert torch.equal(batched, expected), f"{family}: {replay}"
    for row, prompt in enumerate(prompts):  # the compact cache makes padding invisible
        alone = generate(model, prompt[None])[0, len(prompt):]  # may stop early at an end-of-sequence token
        assert torch.equal(alone, batched[row, width: width + len(alone)]), f"{family} row {row}: {replay}"
        assert (batched[row, width + len(alone):] == 0).all(), "after its end a row is padding only"


@pytest.mark.parametrize("method", METHODS)
def test_sampling_and_beam_search_match_the_original(method):
    generator, rng, replay = case_generator(f"sampling_{method}", 0)
    family = rng.choice(FAMILIES)
    model, artifact = calibrated(family, rng.randrange(1000))
    ids = torch.randint(1, model.config.vocab_size, (2, rng.randrange(4, 16)), generator=generator)
    seed = rng.randrange(10**6)
    torch.manual_seed(seed)
    sampled = generate(model, ids, do_sample=True, top_k=0, temperature=1.0)
    beams = generate(model, ids, num_beams=3, max_new_tokens=6)
    hf.compress(model, artifact, removal_rate=0.0, method=method)
    torch.manual_seed(seed)
    assert torch.equal(generate(model, ids, do_sample=True, top_k=0, temperature=1.0), sampled), f"{family} {replay}"
    assert torch.equal(generate(model, ids, num_beams=3, max_new_tokens=6), beams), f"{family} {replay}"


def low_rank_model(seed: int, qk_dims: list[list[int]], v_dims: list[list[int]]):
    """A Llama whose post-RoPE Q/K of KV head j live in qk_dims[l][j] dims (whole RoPE pairs, so every position
    rotates them within the same span) and whose W_V(j) has rank v_dims[l][j]: compressing to exactly those widths
    loses nothing."""
    model = tiny_model("llama", seed=seed, head_dim=32, attention_bias=False)
    D, half = 32, 16
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer, attention in enumerate(layer.self_attn for layer in model.get_decoder().layers):
            q = attention.q_proj.weight.view(-1, D, attention.q_proj.weight.shape[1])  # (H, D, hidden)
            k = attention.k_proj.weight.view(-1, D, attention.k_proj.weight.shape[1])
            v = attention.v_proj.weight.view(-1, D, attention.v_proj.weight.shape[1])
            group = q.shape[0] // k.shape[0]
            for j in range(k.shape[0]):
                pairs = torch.randperm(half, generator=generator)[: qk_dims[layer][j] // 2]
                keep = torch.zeros(D, dtype=torch.bool)
                keep[pairs], keep[pairs + half] = True, True
                k[j, ~keep] = 0
                q[j * group:(j + 1) * group, ~keep] = 0
                rank = v_dims[layer][j]
                left = torch.randn(D, rank, generator=generator)
                v[j] = left @ torch.randn(rank, v.shape[2], generator=generator) / 8
    return model


def test_heads_of_different_widths_reproduce_an_exactly_low_rank_model():
    generator, rng, replay = case_generator("low_rank", 0)
    qk_dims = [[8, 24], [16, 8]]
    v_dims = [[16, 8], [24, 16]]
    model = low_rank_model(rng.randrange(1000), qk_dims, v_dims)
    artifact = calibration.calibrate(model, text="random", num_tokens=256, seq_len=64, seed=1, progress=False)
    ids = torch.randint(1, model.config.vocab_size, (2, 40), generator=generator)
    expected = logits_of(model, ids)
    expected_tokens = generate(model, ids)
    allocation = hf.compress(model, artifact, qk_dims=qk_dims, v_dims=v_dims)
    assert allocation.compression_rate == pytest.approx(1 - (8 + 24 + 16 + 8 + 16 + 8 + 24 + 16) / (2 * 2 * 2 * 32))
    torch.testing.assert_close(logits_of(model, ids), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item(),
                               msg=replay)
    assert torch.equal(generate(model, ids), expected_tokens), replay
    hf.restore(model)
    hf.compress(model, artifact, qk_dims=[[8, 16], [16, 8]], v_dims=v_dims)  # one head now misses dims it needs
    assert not torch.allclose(logits_of(model, ids), expected, atol=1e-3)


@pytest.mark.parametrize("method", METHODS)
def test_kv_cache_nbytes_is_the_allocated_widths_times_tokens(method):
    generator, rng, replay = case_generator(f"nbytes_{method}", 0)
    family = rng.choice(FAMILIES)
    model, artifact = calibrated(family, rng.randrange(1000))
    ids = torch.randint(1, model.config.vocab_size, (3, rng.randrange(4, 30)), generator=generator)
    new_tokens = rng.randrange(2, 80)  # past the initial capacity sometimes: the buffers grow
    full_cache = transformers.DynamicCache()
    generate(model, ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **{hf.cache_keyword(model): full_cache})
    full_bytes = hf.kv_cache_nbytes(full_cache)
    dims = [[rng.choice([8, 16]) for _ in range(2)] for _ in range(2)]
    dims[rng.randrange(2)][rng.randrange(2)] = 8  # at least one head narrower than head_dim 16
    allocation = hf.compress(model, artifact, qk_dims=dims, v_dims=dims[::-1], method=method)
    assert allocation.compression_rate > 0
    cache = transformers.DynamicCache()
    generate(model, ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **{hf.cache_keyword(model): cache})
    assert all(isinstance(layer, CompressedKVLayer) for layer in cache.layers)
    tokens = 3 * (ids.shape[1] + new_tokens - 1)  # the last generated token is never fed back
    width = int(allocation.qk_dims.sum() + allocation.v_dims.sum())
    assert hf.kv_cache_nbytes(cache) == tokens * width * 4, f"{family}: {replay}"
    assert hf.kv_cache_nbytes(cache) == pytest.approx(full_bytes * (1 - allocation.compression_rate))
    assert hf.kv_cache_nbytes(cache, allocated=True) >= hf.kv_cache_nbytes(cache)
    assert cache.get_seq_length() == ids.shape[1] + new_tokens - 1


def test_compress_rejects_bad_requests():
    model, artifact = calibrated("llama", 0)
    with pytest.raises(ValueError, match="exactly one of"):
        hf.compress(model, artifact)
    with pytest.raises(ValueError, match="multiple of 8"):
        hf.compress(model, artifact, qk_dims=[[8, 12], [8, 8]], v_dims=[[8, 8], [8, 8]])
    with pytest.raises(ValueError, match="shape"):
        hf.compress(model, artifact, qk_dims=[[8, 8]], v_dims=[[8, 8]])
    with pytest.raises(ValueError, match="method"):
        hf.compress(model, artifact, removal_rate=0.1, method="svd")
    with pytest.raises(calibration.ArtifactError):
        hf.compress(tiny_model("llama", seed=1), artifact, removal_rate=0.1)
    with pytest.raises(ValueError, match="not compressed"):
        hf.restore(model)
    with pytest.raises(ValueError, match="exactly one of"):
        hf.compress(model, artifact, removal_rate=0.1, compression=0.1)
    allocation = hf.compress(model, artifact, compression=0.1)
    assert allocation.compression_rate >= 0.1
    assert isinstance(model.get_decoder().layers[0].self_attn, FDCAttention)
    with pytest.raises(ValueError, match="already compressed"):
        hf.compress(model, artifact, removal_rate=0.1)


@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("qwen2.5-coder-1.5b", marks=pytest.mark.slow)])
def test_bundled_model_at_full_rank_matches_the_original(name):
    """A bundled real model in float32 (scripts/setup.sh installs SmolLM2, --qwen-coder Qwen2.5-Coder; each converted
    once to the cache: SmolLM2 about 30 s, Qwen2.5-Coder about 2 minutes)."""
    from fdc_ops.hf import loading

    model, tokenizer = loading.load_model(name, dtype=torch.float32)
    artifact = calibration.calibrate(model, tokenizer, num_tokens=1024, seq_len=256, sensitivity_tokens=0,
                                     progress=False)
    ids = tokenizer(["The history of the printing press", "def fibonacci(n):"], return_tensors="pt",
                    padding=True, padding_side="left")
    expected = logits_of(model, ids["input_ids"], ids["attention_mask"])
    expected_tokens = generate(model, ids["input_ids"], ids["attention_mask"], max_new_tokens=16,
                               pad_token_id=tokenizer.pad_token_id)
    for method in METHODS:
        hf.compress(model, artifact, removal_rate=0.0, method=method)
        actual = logits_of(model, ids["input_ids"], ids["attention_mask"])
        real = ids["attention_mask"].bool()  # padded positions' logits are not defined the same way by both
        torch.testing.assert_close(actual[real], expected[real], rtol=1e-4,
                                   atol=1e-4 * expected[real].abs().max().item(), msg=method)
        tokens = generate(model, ids["input_ids"], ids["attention_mask"], max_new_tokens=16,
                          pad_token_id=tokenizer.pad_token_id)
        assert torch.equal(tokens, expected_tokens), method
        hf.restore(model)


@pytest.mark.parametrize("drawn", DRAWN)
@pytest.mark.parametrize("method", METHODS)
def test_a_saved_compressed_model_loads_back_with_bit_identical_logits(method, drawn, tmp_path):
    generator, rng, replay = case_generator(f"save_load_{method}", DRAWN.index(drawn))
    family = drawn_family(drawn, rng)
    model, artifact = calibrated(family, rng.randrange(1000))
    dims = [[rng.choice([8, 16]) for _ in range(2)] for _ in range(2)]
    dtype = rng.choice([torch.float32, torch.bfloat16])
    model.save_pretrained(tmp_path / "original")  # loaded in dtype as a user loads it (model.to(dtype) would also
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "original", dtype=dtype).eval()  # round RoPE)
    allocation = hf.compress(model, artifact, qk_dims=dims, v_dims=dims[::-1], method=method)
    ids = torch.randint(1, model.config.vocab_size, (2, rng.randrange(4, 20)), generator=generator)
    with pytest.raises(RuntimeError, match=r"save_compressed\(model, directory, tokenizer\)"):
        model.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain").exists()
    hf.save_compressed(model, tmp_path / "saved")
    loaded = hf.load_compressed(tmp_path / "saved")
    assert next(loaded.parameters()).dtype == dtype
    assert torch.equal(logits_of(loaded, ids), logits_of(model, ids)), f"{family} {dtype}: {replay}"
    assert torch.equal(generate(loaded, ids), generate(model, ids)), f"{family} {dtype}: {replay}"
    state = loaded._fdc_compression
    assert state["method"] == method and torch.equal(state["allocation"].qk_dims, allocation.qk_dims)
    assert state["artifact"].metadata == artifact.metadata, "the artifact keeps its provenance"
    # The checkpoint itself is the original model: transformers loads it as it is.
    hf.restore(model)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=dtype)
    assert torch.equal(logits_of(plain, ids), logits_of(model, ids))
    model.save_pretrained(tmp_path / "restored")  # allowed again once restored


def test_load_compressed_names_what_is_wrong(tmp_path):
    model, artifact = calibrated("llama", 4)
    with pytest.raises(calibration.ArtifactError, match="was not written by fdc_ops.hf.save_compressed"):
        model.save_pretrained(tmp_path / "plain")
        hf.load_compressed(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        hf.load_compressed(tmp_path / "missing")
    with pytest.raises(TypeError, match="directory must be a path"):
        hf.load_compressed(3)
    with pytest.raises(ValueError, match="is not compressed"):
        hf.save_compressed(model, tmp_path / "x")
    hf.compress(model, artifact, removal_rate=0.0)
    saved = hf.save_compressed(model, tmp_path / "saved")
    description = saved / "fdc" / "compression.json"
    description.write_text(description.read_text().replace('"qk_dims"', '"qk_widths"'))
    with pytest.raises(calibration.ArtifactError, match="compression.json is incomplete"):
        hf.load_compressed(saved)


def test_entry_points_name_the_argument_and_the_type_they_expect():
    model, artifact = calibrated("qwen2", 5)
    for kwargs, message in ((dict(compression="0.1"), "compression must be a number, got str '0.1'"),
                            (dict(removal_rate=True), "removal_rate must be a number, got bool True"),
                            (dict(compression=float("nan")), "compression must be finite"),
                            (dict(qk_dims=[[8, 8.5], [8, 8]], v_dims=[[8] * 2] * 2), "qk_dims must be whole numbers"),
                            (dict(qk_dims=[[8, "8"], [8, 8]], v_dims=[[8] * 2] * 2), "qk_dims must be whole numbers"),
                            (dict(allocation={"qk_dims": 8}), "allocation must be an fdc_ops.calibration"),
                            (dict(compression=0.1, uniform="yes"), "uniform must be True or False")):
        with pytest.raises((TypeError, ValueError), match=message):
            hf.compress(model, artifact, **kwargs)
    with pytest.raises(TypeError, match="artifact must be an fdc_ops.calibration.FDCArtifact"):
        hf.compress(model, "artifact-directory", compression=0.1)
    with pytest.raises(TypeError, match="model must be a Hugging Face causal LM"):
        hf.compress(object(), artifact, compression=0.1)
    with pytest.raises(TypeError, match="fdc_ops.calibration.allocate: multiple must be an int"):
        artifact.allocate(compression=0.1, multiple=8.0)
    with pytest.raises(ValueError, match="removal_rate must be in"):
        artifact.allocate(1.5)
    assert not hasattr(model, "_fdc_compression") or model._fdc_compression is None, "nothing was changed"


def test_one_artifact_serves_smollm2_in_every_dtype_and_refuses_a_fine_tune():
    """The bundled artifact (calibrated in float32) for float32, bfloat16 and float16 loads of the bundled model: each
    finds it (load_or_calibrate), and at full rank generates the tokens the same-dtype model generates uncompressed.
    A stand-in for a fine-tune (layer 3's k_proj scaled by 1.01) is refused, naming the tensor."""
    from fdc_ops.hf import loading

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model, tokenizer = loading.load_model(dtype=dtype)
        artifact = calibration.load_or_calibrate(model, tokenizer, progress=False)  # calibrating would take minutes
        assert artifact.metadata["identity"]["dtype"] == "float32"
        ids = tokenizer("The capital of Germany is", return_tensors="pt")["input_ids"]
        expected = generate(model, ids, max_new_tokens=12)
        hf.compress(model, artifact, removal_rate=0.0)
        assert torch.equal(generate(model, ids, max_new_tokens=12), expected), dtype
        hf.restore(model)
    with torch.no_grad():
        model.get_decoder().layers[3].self_attn.k_proj.weight.mul_(1.01)
    with pytest.raises(calibration.ArtifactError, match=r"first layers\.3\.k_proj\.weight"):
        hf.compress(model, artifact, compression=0.1)


@pytest.mark.slow
def test_qwen_coder_compressed_in_bfloat16_chats_decodes_batches_and_reloads(tmp_path):
    """The bundled Qwen2.5-Coder-1.5B as a user loads it (bfloat16, its chat template), compressed by a quick
    calibration's rotations (the paper's removal-rate rule): decoding from the cache equals the recompute, a
    left-padded batch generates what each prompt generates alone, and a saved copy reloads with identical logits."""
    from fdc_ops.hf import loading
    from test_transformers_releases import check_cache_against_recompute

    model, tokenizer = loading.load_model("qwen2.5-coder-1.5b")
    assert next(model.parameters()).dtype == torch.bfloat16
    request = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    chat = tokenizer.apply_chat_template(request, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(chat["input_ids"][0]).endswith("<|im_start|>assistant\n")
    artifact = calibration.calibrate(model, tokenizer, num_tokens=1024, seq_len=256, sensitivity_tokens=0,
                                     progress=False)
    hf.compress(model, artifact, removal_rate=0.05)
    reply = generate(model, chat["input_ids"], chat["attention_mask"], max_new_tokens=12)
    assert "def" in tokenizer.decode(reply[0, chat["input_ids"].shape[1]:])
    check_cache_against_recompute(model, tokenizer("def fibonacci(n):", return_tensors="pt")["input_ids"], 8,
                                  "Qwen2.5-Coder at removal rate 0.05")
    prompts = ["The history of the printing press", "import numpy as np\n"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    batched = generate(model, batch["input_ids"], batch["attention_mask"], max_new_tokens=8,
                       pad_token_id=tokenizer.pad_token_id)
    for row, prompt in enumerate(prompts):
        alone = tokenizer(prompt, return_tensors="pt")["input_ids"]
        expected = generate(model, alone, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id)[0, alone.shape[1]:]
        assert torch.equal(batched[row, batch["input_ids"].shape[1]:][: len(expected)], expected), prompt
    hf.save_compressed(model, tmp_path / "saved", tokenizer)
    loaded = hf.load_compressed(tmp_path / "saved")
    ids = batch["input_ids"][1:]
    assert torch.equal(logits_of(loaded, ids), logits_of(model, ids))


@pytest.mark.parametrize("method", METHODS)
def test_a_deep_copy_of_a_compressed_model_computes_what_the_model_computes(method):
    """copy.deepcopy of a compressed model (how a user keeps a second copy, or moves one to another device) must feed
    its own modules each call's padding mask; a left-padded batch shows it."""
    import copy

    generator, rng, replay = case_generator(f"deepcopy_{method}", 0)
    model, artifact = calibrated("llama", rng.randrange(1000))
    hf.compress(model, artifact, removal_rate=0.5, method=method)
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    twin = copy.deepcopy(model)
    expected = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.detach()
    logits_of(model, ids[:1])  # the original's calls must not steer the copy
    actual = twin(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.detach()
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=replay)
    assert torch.equal(generate(twin, ids, mask), generate(model, ids, mask)), replay


def left_padded(generator, vocab: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, max length) ids and 0/1 mask of random prompts of the given lengths, left-padded with 0."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(1, vocab, (length,), generator=generator)
        mask[row, width - length:] = 1
    return ids, mask


@pytest.mark.parametrize("family", TINY_MODELS)
def test_a_static_cache_generates_the_dynamic_caches_tokens(family):
    """generate(cache_implementation="static"): the compressed layers take over the StaticCache's layers, and a
    left-padded batch (the 4-D masks generate() builds for a static cache, bool for sdpa and additive for eager),
    beam search and a chunked prompt give what the dynamic cache gives."""
    generator, rng, replay = case_generator("static_cache", TINY_MODELS.index(family))
    model, artifact = calibrated(family, rng.randrange(1000))
    hf.compress(model, artifact, compression=rng.choice([0.2, 0.4]))
    ids, mask = left_padded(generator, model.config.vocab_size, [rng.randrange(2, 14) for _ in range(3)])
    for implementation in ("sdpa", "eager"):
        model.config._attn_implementation = implementation
        expected = generate(model, ids, mask)
        assert torch.equal(generate(model, ids, mask, cache_implementation="static"), expected), replay
    beams = generate(model, ids[:1], num_beams=3, max_new_tokens=5)
    assert torch.equal(generate(model, ids[:1], num_beams=3, max_new_tokens=5, cache_implementation="static"),
                       beams), replay
    keyword = hf.cache_keyword(model)
    static = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)
    dynamic = transformers.DynamicCache()
    split = rng.randrange(1, ids.shape[1])
    with torch.no_grad():
        for chunk in (slice(0, split), slice(split, None)):
            expected = model(input_ids=ids[:, chunk], attention_mask=mask[:, : chunk.stop], **{keyword: dynamic})
            actual = model(input_ids=ids[:, chunk], attention_mask=mask[:, : chunk.stop], **{keyword: static})
            torch.testing.assert_close(actual.logits, expected.logits, rtol=1e-5, atol=1e-5, msg=replay)
    assert static.layers[0].nbytes() == dynamic.layers[0].nbytes(), replay


def test_a_compiled_decode_step_is_one_graph_reused_by_every_step_and_every_sequence():
    """torch.compile(fullgraph=True) of the compressed model's forward over a static cache: no graph break (fullgraph
    raises on one), one graph for the decode step, reused by every later step and by a new cache of the same shape
    (no recompile), with the eager model's logits; and the same through generate()'s own compilation (which passes
    4-D masks of the cache's fixed length)."""
    from torch._dynamo.testing import CompileCounter

    generator, rng, replay = case_generator("compiled_step", 0)
    model, artifact = calibrated("llama", rng.randrange(1000))
    hf.compress(model, artifact, compression=0.4)
    keyword = hf.cache_keyword(model)
    counter = CompileCounter()
    step = torch.compile(model.forward, backend=counter, fullgraph=True)
    ids, mask = left_padded(generator, model.config.vocab_size, [9, 5])
    torch._dynamo.reset()
    with torch.no_grad():
        for _ in range(2):  # a second sequence in a new cache reuses the graph
            static = transformers.StaticCache(config=model.config, max_cache_len=24)
            dynamic = transformers.DynamicCache()
            logits = model(input_ids=ids, attention_mask=mask, **{keyword: static}).logits[:, -1]  # eager prompt
            model(input_ids=ids, attention_mask=mask, **{keyword: dynamic})
            step_mask = mask
            for _ in range(8):
                token = logits.argmax(-1, keepdim=True)
                step_mask = torch.cat([step_mask, torch.ones_like(token)], 1)
                torch._dynamo.mark_dynamic(step_mask, 1)  # the 2-D mask grows by a column a step: say so
                logits = step(input_ids=token, attention_mask=step_mask, **{keyword: static}).logits[:, -1]
                expected = model(input_ids=token, attention_mask=step_mask, **{keyword: dynamic}).logits[:, -1]
                torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=replay)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled for one step shape"
    expected = generate(model, ids, mask)
    config = transformers.CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # generate() compiles on accelerators only unless told
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch.equal(generate(model, ids, mask, cache_implementation="static", compile_config=config), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before + 1, "generate() compiled no graph"


def test_generates_default_compilation_has_no_graph_break():
    """generate() over a static cache compiles the forward itself, on a GPU unasked and with fullgraph=False: a graph
    break there (an op whose output shape is data: seen on an H200, where CUDA graphs then failed over the pieces)
    must not happen, so every layer's ops are in the one graph."""
    generator, rng, replay = case_generator("default_compilation", 0)
    model, artifact = calibrated("llama", rng.randrange(1000))
    hf.compress(model, artifact, compression=0.4)
    ids, mask = left_padded(generator, model.config.vocab_size, [7, 4])
    expected = generate(model, ids, mask)
    config = transformers.CompileConfig(backend="eager")  # fullgraph=False, as generate() compiles by default
    assert not config.fullgraph
    config._compile_all_devices = True  # generate() compiles on accelerators only unless told
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    breaks = sum(counters["graph_break"].values())
    assert torch.equal(generate(model, ids, mask, cache_implementation="static", compile_config=config), expected), \
        replay
    assert sum(counters["graph_break"].values()) == breaks, f"graph breaks: {dict(counters['graph_break'])}"


def test_a_static_cache_refuses_what_it_cannot_hold():
    generator, rng, replay = case_generator("static_refusals", 0)
    model, artifact = calibrated("mistral", rng.randrange(1000))
    ids = torch.randint(1, model.config.vocab_size, (2, 6), generator=generator)
    hf.compress(model, artifact, compression=0.3)
    keyword = hf.cache_keyword(model)
    static = transformers.StaticCache(config=model.config, max_cache_len=7)
    with torch.no_grad():
        model(input_ids=ids, **{keyword: static})
        model(input_ids=ids[:, :1], **{keyword: static})
        lengths = static.layers[0].lengths.clone()
        with pytest.raises(RuntimeError, match=r"fdc::append_kv: .* past the cache capacity 7; nothing was written"):
            model(input_ids=ids[:, :1], **{keyword: static})
    assert torch.equal(static.layers[0].lengths, lengths), "a refused step must leave the cache as it was"
    hf.restore(model)
    hf.compress(model, artifact, compression=0.3, method="palu")
    with pytest.raises(NotImplementedError, match="Palu baseline runs with a dynamic cache only"):
        generate(model, ids, cache_implementation="static")
