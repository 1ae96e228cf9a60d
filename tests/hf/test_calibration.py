"""Calibration on tiny random-weight models of every supported family: capture, rotations, V factors and their
folding, the rank allocation, and the artifact file format."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import subprocess
import sys

import pytest
import torch

from conftest import case_generator
from fdc_ops import artifact as artifacts
from fdc_ops import calibration, datasets, ops
from fdc_ops.calibration import ArtifactError, FDCArtifact
from fdc_ops.hf import families, loading
from tiny_models import FAMILIES, HEAD_DIM, hand_key_projection, hand_qkv, layer_inputs, tiny_model

pytest.importorskip("transformers", reason="calibration needs transformers (scripts/setup.sh installs it)")
pytestmark = pytest.mark.model


def random_ids(model, generator: torch.Generator, batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)


def gram(rows: torch.Tensor) -> torch.Tensor:  # (B, heads, S, D) -> (heads, D, D)
    return torch.einsum("bhsd,bhse->hde", rows, rows)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_hand_rope_and_leaves_outputs_unchanged(family):
    generator, rng, replay = case_generator("capture", FAMILIES.index(family))
    model = tiny_model(family, seed=rng.randrange(1000))
    ids = random_ids(model, generator, 2, rng.randrange(9, 40))
    with torch.no_grad():
        expected_logits = model(input_ids=ids, use_cache=False).logits
    stats = calibration.capture_statistics(model, [ids[:1], ids[1:]], progress=False)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, use_cache=False).logits, expected_logits), replay
    assert stats.num_tokens == ids.numel() and stats.positions == ids.shape[1]
    for layer, hidden in enumerate(layer_inputs(model, ids)):
        q, k, v = hand_qkv(model, layer, hidden)
        for name, captured, hand in (("q", stats.q_gram, q), ("k", stats.k_gram, k), ("v", stats.v_gram, v)):
            want = gram(hand)
            torch.testing.assert_close(captured[layer], want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                       msg=f"{family} layer {layer} {name}: {replay}")
        keys = hand_key_projection(model, layer, hidden)
        torch.testing.assert_close(stats.key_gram[layer], gram(keys), rtol=1e-5,
                                   atol=1e-5 * gram(keys).abs().max().item())
        # attention outputs of every query head (causal softmax), less the V bias, summed over each group
        shape = families.attention_shape(model)
        G, S = shape.group, ids.shape[1]
        scores = q @ k.repeat_interleave(G, 1).transpose(-1, -2) * families.attention_modules(model)[layer].scaling
        causal = torch.ones(S, S, dtype=torch.bool).triu(1)
        bias = families.attention_weights(families.attention_modules(model)[layer], shape).v_bias
        v_less_bias = v if bias is None else v - bias.detach().to(torch.float64).view(1, -1, 1, HEAD_DIM)
        z = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v_less_bias.repeat_interleave(G, 1)
        want = gram(z).view(shape.num_kv_heads, G, HEAD_DIM, HEAD_DIM).sum(1)
        torch.testing.assert_close(stats.z_gram[layer], want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                   msg=f"{family} layer {layer} z: {replay}")


@pytest.mark.parametrize("family", FAMILIES)
def test_rotations_are_the_svd_of_the_stacked_rows(family):
    generator, rng, replay = case_generator("rotations", FAMILIES.index(family))
    model = tiny_model(family, seed=rng.randrange(1000))
    ids = random_ids(model, generator, 3, rng.randrange(20, 50))
    artifact = calibration.calibrate(model, input_ids=ids, v_method="activation", progress=False)
    G = families.attention_shape(model).group
    eye = torch.eye(HEAD_DIM, dtype=torch.float64)
    for layer, hidden in enumerate(layer_inputs(model, ids)):
        q, k, v = hand_qkv(model, layer, hidden)
        for j in range(k.shape[1]):
            rows = torch.cat([k[:, j].flatten(0, 1)] + [q[:, j * G + i].flatten(0, 1) for i in range(G)])
            values = torch.linalg.svdvals(rows)
            torch.testing.assert_close(artifact.qk_singular_values[layer, j], values, rtol=1e-5,
                                       atol=1e-6 * values[0].item(), msg=replay)
            R = artifact.qk_rotation[layer, j].to(torch.float64)
            torch.testing.assert_close(R.T @ R, eye, atol=1e-5, rtol=0)
            # the rotation diagonalises the stacked rows: (rows R)^T (rows R) = diag(s^2)
            rotated = rows @ R
            off_diagonal = rotated.T @ rotated - torch.diag(values**2)
            assert off_diagonal.abs().max() <= 1e-4 * values[0] ** 2, replay
            torch.testing.assert_close(artifact.v_singular_values[layer, j],
                                       torch.linalg.svdvals(v[:, j].flatten(0, 1)), rtol=1e-5,
                                       atol=1e-6 * values[0].item())


def test_query_head_mode_pairs_each_query_head_with_its_key_head():
    generator, rng, replay = case_generator("query_head_mode", 0)
    model = tiny_model("llama", seed=rng.randrange(1000))
    stats = calibration.capture_statistics(model, [random_ids(model, generator, 2, 17)], progress=False)
    per_query = stats.qk_gram("query_head")
    assert per_query.shape == stats.q_gram.shape
    for h in range(per_query.shape[1]):
        torch.testing.assert_close(per_query[:, h], stats.q_gram[:, h] + stats.k_gram[:, h // 2])
    with pytest.raises(ValueError, match="qk mode"):
        stats.qk_gram("per_token")


def test_weight_value_axes_are_the_svd_of_w_v():
    model = tiny_model("qwen2", seed=3)
    values, basis = calibration.weight_value_axes(model)
    shape = families.attention_shape(model)
    for layer, module in enumerate(families.attention_modules(model)):
        weight = families.attention_weights(module, shape).v_weight.detach().to(torch.float64)
        for j in range(shape.num_kv_heads):
            block = weight[j * HEAD_DIM:(j + 1) * HEAD_DIM].T  # W_V(j): (hidden, D)
            torch.testing.assert_close(values[layer, j], torch.linalg.svdvals(block), rtol=1e-9, atol=1e-9)
            projected = block @ basis[layer, j]  # columns ordered by singular value, norms = singular values
            torch.testing.assert_close(projected.norm(dim=0), values[layer, j], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("v_method", calibration.V_METHODS)
def test_folded_projections_reproduce_attention_at_full_rank(family, v_method):
    """x -> q' = q_p R, k' = k_p R, v' = x A_V -> prefill_attention -> o' W_O'^T + folded biases equals the module's
    own output when every head keeps all D dims."""
    generator, rng, replay = case_generator(f"fold_{v_method}", FAMILIES.index(family))
    model = tiny_model(family, seed=rng.randrange(1000))
    lengths = [rng.randrange(5, 30) for _ in range(2)]
    ids = random_ids(model, generator, 2, max(lengths))
    artifact = calibration.calibrate(model, input_ids=ids, v_method=v_method, progress=False)
    allocation = artifact.allocate(0.0)
    assert allocation.compression_rate == 0.0
    shape = families.attention_shape(model)
    G, D = shape.group, shape.head_dim
    layer = rng.randrange(shape.num_layers)
    module = families.attention_modules(model)[layer]
    weights = families.attention_weights(module, shape)
    hidden = layer_inputs(model, ids)[layer]
    rotary = model.get_decoder().rotary_emb
    positions = torch.arange(ids.shape[1])[None].expand(2, -1)
    with torch.no_grad():
        expected = module(hidden_states=hidden, position_embeddings=rotary(hidden, positions),
                          attention_mask=None)[0]
    q_p, k_p, _ = hand_qkv(model, layer, hidden)
    qk_offsets, v_offsets = allocation.offsets(layer)
    R = artifact.qk_rotation[layer]
    tokens = hidden.shape[0] * hidden.shape[1]
    q = ops.rotate_compress(q_p.float().transpose(1, 2).reshape(tokens, -1, D), R, qk_offsets, G)
    k = ops.rotate_compress(k_p.float().transpose(1, 2).reshape(tokens, -1, D), R, qk_offsets, 1)
    folded = calibration.fold_value_and_output(weights.v_weight.detach(), weights.o_weight.detach(),
                                               artifact.v_encoder[layer], artifact.v_decoder[layer],
                                               allocation.v_dims[layer].tolist(), G,
                                               None if weights.v_bias is None else weights.v_bias.detach(),
                                               None if weights.o_bias is None else weights.o_bias.detach())
    assert (folded.output_bias is None) == (weights.v_bias is None and weights.o_bias is None)
    v = hidden.flatten(0, 1) @ folded.value_weight.T
    cu = torch.tensor([0, ids.shape[1], 2 * ids.shape[1]], dtype=torch.int32)
    out = ops.prefill_attention(q, k, v, cu, cu, qk_offsets, v_offsets, G, D**-0.5, True)
    result = out @ folded.output_weight.T
    if folded.output_bias is not None:
        result = result + folded.output_bias
    torch.testing.assert_close(result.view_as(expected), expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item(),
                               msg=f"{family} layer {layer}: {replay}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("covariance", ["v_gram", "z_gram"])  # v_method "output" and "attention_output"
def test_output_aware_v_factors_are_exact_at_full_rank_in_float64(family, covariance):
    """The output-aware pair folded into A_V and W_O' composes to W_O(h) W_V(kv(h)) for every query head, and the
    factors order directions by the output energy they carry: truncating to w dims loses exactly the tail of S^2
    in E||W (y - y_w)||^2 over rows y of the covariance it was built from, the values' or the attention outputs'
    (the best any rank-w pair can do for that objective)."""
    generator, rng, replay = case_generator(f"output_aware_{covariance}", FAMILIES.index(family))
    model = tiny_model(family, seed=rng.randrange(1000)).double()
    ids = random_ids(model, generator, 2, 40)
    stats = calibration.capture_statistics(model, [ids], progress=False)
    gram_of_rows = getattr(stats, covariance)
    values, encoder, decoder = calibration.output_aware_factors(model, gram_of_rows)
    shape = families.attention_shape(model)
    G, D, Hkv = shape.group, shape.head_dim, shape.num_kv_heads
    eye = torch.eye(D, dtype=torch.float64)
    for layer, module in enumerate(families.attention_modules(model)):
        weights = families.attention_weights(module, shape)
        full = [D] * Hkv
        A_V = calibration.fold_value_projection(weights.v_weight.detach(), encoder[layer], full)
        W_O = calibration.fold_output_projection(weights.o_weight.detach(), decoder[layer], full, G)
        assert A_V.dtype == torch.float64
        for h in range(shape.num_heads):
            j = h // G
            folded = W_O[:, h * D:(h + 1) * D] @ A_V[j * D:(j + 1) * D]
            original = weights.o_weight.detach()[:, h * D:(h + 1) * D] @ weights.v_weight.detach()[j * D:(j + 1) * D]
            torch.testing.assert_close(folded, original, rtol=0, atol=1e-12 * original.abs().max().item(),
                                       msg=f"{family} layer {layer} head {h}: {replay}")
        torch.testing.assert_close(decoder[layer].transpose(-1, -2) @ encoder[layer], eye.expand(Hkv, D, D),
                                   rtol=0, atol=1e-12)
        o_weight = weights.o_weight.detach().view(-1, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, -1, D)
        for j in range(Hkv):
            w = rng.randrange(1, D)
            projector = decoder[layer, j, :, :w] @ encoder[layer, j, :, :w].T  # v -> v_w
            residual = o_weight[j] @ (eye - projector)
            lost = torch.trace(residual @ gram_of_rows[layer, j] @ residual.T)
            floor = calibration.COVARIANCE_FLOOR * torch.linalg.eigvalsh(gram_of_rows[layer, j])[-1]
            assert lost <= (values[layer, j, w:] ** 2).sum() + 1e-9 * lost.abs(), replay
            assert lost >= (values[layer, j, w:] ** 2).sum() - floor * (o_weight[j] ** 2).sum(), replay


def test_knapsack_dims_is_optimal_and_fisher_dims_meets_the_budget():
    import itertools

    for case in range(30):
        generator, rng, replay = case_generator("knapsack", case)
        N, D, multiple = rng.randrange(1, 5), rng.choice([16, 24, 32]), 8
        damage = torch.rand(N, D + 1, generator=generator, dtype=torch.float64).sort(-1, descending=True).values
        damage[:, D] = 0.0
        budget = rng.randrange(N * multiple, N * D + 1)
        widths = list(range(multiple, D + 1, multiple))
        best = min((sum(damage[n, w].item() for n, w in enumerate(choice)), choice)
                   for choice in itertools.product(widths, repeat=N) if sum(choice) <= budget)
        got = calibration.knapsack_dims(damage, budget, multiple)
        assert int(got.sum()) <= budget, replay
        assert sum(damage[n, w].item() for n, w in enumerate(got.tolist())) == pytest.approx(best[0]), replay
        fisher = torch.rand(N, generator=generator, dtype=torch.float64)
        dims = calibration.fisher_dims(fisher, budget, D, multiple)
        assert int(dims.sum()) <= budget and budget - int(dims.sum()) < multiple or (dims == D).all(), replay
        assert ((dims % multiple == 0) & (dims >= multiple) & (dims <= D)).all(), replay
    with pytest.raises(ValueError, match="must divide head_dim"):
        calibration.knapsack_dims(torch.zeros(2, 21), 32, 8)  # D = 20


def test_sensitivity_is_a_non_negative_decreasing_tail_and_leaves_the_model_unchanged():
    model = tiny_model("phi3", seed=4)  # fused qkv_proj: the Fisher path splits its gradient
    requires = [p.requires_grad for p in model.parameters()]
    artifact = small_artifact(model=model)
    assert [p.requires_grad for p in model.parameters()] == requires
    assert all(p.grad is None for p in model.parameters())
    for damage in (artifact.qk_damage, artifact.v_damage):
        assert (damage >= 0).all() and (damage[..., -1] == 0).all() and (damage[..., 0] > 0).all()
    assert (artifact.palu_fisher > 0).all()
    balance = artifact.metadata["calibration"]["balance"]  # fitted on the random sequences after the calibration ones
    measured = balance["measured_nll"]
    assert measured[f"{balance['v_to_qk']:.4f}"] == min(measured.values()) and 3 <= len(measured) <= 4, measured
    assert balance["compression"] in [round(step * calibration.BALANCE_GRID, 6) for step in range(1, 21)]
    terms = torch.randn(3, 5, 8, dtype=torch.float64)
    brute = torch.stack([0.5 * (terms[..., w:].sum(-1) ** 2).sum(-1) for w in range(9)], dim=-1)
    torch.testing.assert_close(calibration._tail_damage(terms), brute)
    for rule in ("sensitivity", "fisher"):
        allocation = artifact.allocate(compression=0.25, rule=rule, method="fdc" if rule == "sensitivity" else "palu")
        assert 0.25 <= allocation.compression_rate < 0.25 + 8 / (2 * HEAD_DIM), rule


@pytest.mark.parametrize("family", [*FAMILIES, "gemma2", "gemma3"])
def test_next_token_logits_from_the_decoder_are_the_models(family):
    overrides = {"final_logit_softcapping": 0.2} if family.startswith("gemma") else {}  # a cap the logits reach
    model = tiny_model(family, seed=5, **overrides)
    ids = random_ids(model, torch.Generator().manual_seed(5), 2, 11)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        expected = model(input_ids=ids, use_cache=False).logits
        if overrides:  # the cap changed the logits
            assert (model.get_output_embeddings()(hidden) - expected).abs().max() > 0.05
        torch.testing.assert_close(families.next_token_logits(model, hidden), expected, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_chunked_loss_backward_is_the_whole_losss(monkeypatch, family):
    """The sensitivity pass's loss, its logits a few positions at a time, has the model's own summed next-token
    loss and sends the same gradient into the embeddings (a chunk size that divides nothing: 23 targets by 7)."""
    model = tiny_model(family, seed=6, **({"final_logit_softcapping": 0.2} if family == "gemma2" else {}))
    ids = random_ids(model, torch.Generator().manual_seed(6), 2, 24)
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeddings, use_cache=False).logits[:, :-1]
    whole = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
    whole.backward()
    expected = embeddings.grad.clone()
    embeddings.grad = None
    monkeypatch.setattr(calibration, "LOSS_CHUNK", 7)
    hidden = model.get_decoder()(inputs_embeds=embeddings, use_cache=False).last_hidden_state
    chunked = calibration.backward_next_token_loss(model, hidden, ids)
    assert chunked == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(embeddings.grad, expected, rtol=1e-5, atol=1e-6)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("native", [False, True])
def test_a_bfloat16_model_calibrates_in_float32_where_the_cpu_has_no_bfloat16_products(monkeypatch, native):
    """Where the CPU has no bfloat16 matrix instructions, calibration's forward passes compute in float32 (a bfloat16
    product there is several times slower): the statistics are a float32 copy's, the sensitivities and the
    balance fit run, and the model comes back bit for bit, in bfloat16, its tied weights still one tensor."""
    for check in calibration.NATIVE_16_BIT[torch.bfloat16]:
        monkeypatch.setattr(torch.cpu, check, lambda: native)
    model = tiny_model("qwen2_coder", seed=3, tie_word_embeddings=True).to(torch.bfloat16)
    assert calibration.pass_dtype(model) == (torch.bfloat16 if native else torch.float32)
    assert calibration.pass_dtype(copy.deepcopy(model).float()) == torch.float32
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    generator = torch.Generator().manual_seed(3)
    batches = [random_ids(model, generator, 1, 24) for _ in range(2)]
    stats = calibration.capture_statistics(model, batches, progress=False)
    computed = copy.deepcopy(model) if native else copy.deepcopy(model).float()
    expected = calibration.capture_statistics(computed, batches, progress=False)
    for name in ("q_gram", "k_gram", "v_gram", "key_gram", "z_gram"):
        assert torch.equal(getattr(stats, name), getattr(expected, name)), name
    artifact = calibration.calibrate(model, text="random", num_tokens=48, seq_len=24, sensitivity_tokens=48,
                                     progress=False)
    assert artifact.metadata["calibration"]["pass_dtype"] == ("bfloat16" if native else "float32")
    assert artifact.metadata["calibration"]["balance"]["v_to_qk"] > 0
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def paper_kept_dims(values: list[float], removal_rate: float) -> int:
    """Direct evaluation of the paper's condition: the j with sum_{i>j} s / total <= r < sum_{i>=j} s / total;
    j + 1 dims are kept."""
    total = sum(values)
    for j in range(len(values)):
        if sum(values[j + 1:]) / total <= removal_rate < sum(values[j:]) / total:
            return j + 1
    raise AssertionError("no j satisfies the condition")


def test_rank_allocation_matches_the_paper_condition():
    for case in range(200):
        generator, rng, replay = case_generator("allocation", case)
        D = rng.choice([16, 24, 64, 128])
        decay = rng.uniform(0.0, 0.3)
        values = (torch.rand(D, generator=generator, dtype=torch.float64) * torch.exp(-decay * torch.arange(D)))
        values = values.sort(descending=True).values
        if rng.random() < 0.2:
            values[rng.randrange(1, D):] = 0.0  # exactly low rank
        removal_rate = rng.choice([0.0, rng.uniform(0, 0.6), rng.uniform(0, 0.05)])
        multiple = rng.choice([1, 8, 16])
        kept = paper_kept_dims(values.tolist(), removal_rate)
        want = min(D, max(multiple, -(-kept // multiple) * multiple))
        got = calibration.kept_dims(values, removal_rate, multiple)
        assert got.item() == want, f"{replay}: D={D} r={removal_rate} multiple={multiple}"
        squared = calibration.kept_dims(values, removal_rate, multiple, power=2.0)
        kept_squared = paper_kept_dims((values**2).tolist(), removal_rate)
        assert squared.item() == min(D, max(multiple, -(-kept_squared // multiple) * multiple)), replay
    with pytest.raises(ValueError, match="removal_rate"):
        calibration.kept_dims(values, 1.0)


def small_artifact(seed: int = 0, model=None) -> FDCArtifact:
    model = model if model is not None else tiny_model("llama", seed=seed)
    return calibration.calibrate(model, text="random", num_tokens=96, seq_len=32, seed=seed, sensitivity_tokens=64,
                                 progress=False)


def test_the_balance_is_fitted_where_the_estimates_reach_one_percent():
    """balance_compression: the grid budget whose estimated loss increase is nearest BALANCE_NLL_INCREASE. With a
    damage table that charges every removed dim the same, the estimate is that charge times the dims removed, so
    the target (two 8-dim steps here) is met first by the smallest grid budget that removes 16 dims; twice the
    charge meets it at half the dims."""
    artifact = small_artifact()
    L, Hkv, D = artifact.shape.num_layers, artifact.shape.num_kv_heads, artifact.shape.head_dim
    total = 2 * L * Hkv * D
    grid = [round(step * calibration.BALANCE_GRID, 6) for step in range(1, int(0.5 / calibration.BALANCE_GRID) + 1)]

    def removed(compression: float) -> int:  # the dims a budget removes: whole 8-dim steps, at least the share
        return 8 * -int(-(compression * total - 1e-9) // 8)

    for dims, charge in ((16, calibration.BALANCE_NLL_INCREASE / 16), (8, calibration.BALANCE_NLL_INCREASE / 8)):
        table = (D - torch.arange(D + 1, dtype=torch.float64)).expand(L, Hkv, D + 1) * charge
        uniform = dataclasses.replace(artifact, qk_damage=table.clone(), v_damage=table.clone())
        expected = min(c for c in grid if removed(c) == dims)
        assert calibration.balance_compression(uniform) == expected, (dims, total)
        widths = uniform.allocate(compression=expected, rule="sensitivity")
        assert calibration.estimated_nll_increase(uniform, widths) == pytest.approx(calibration.BALANCE_NLL_INCREASE)


def test_allocation_compression_rate_offsets_and_uniform_ablation():
    artifact = small_artifact()
    allocation = artifact.allocate(0.3, multiple=8)
    L, Hkv = allocation.qk_dims.shape
    kept = int(allocation.qk_dims.sum() + allocation.v_dims.sum())
    assert allocation.compression_rate == pytest.approx(1 - kept / (2 * L * Hkv * HEAD_DIM))
    assert allocation.kv_bytes_per_token(2) == 2 * kept
    qk_offsets, v_offsets = allocation.offsets(1)
    assert qk_offsets.dtype == torch.int32 and qk_offsets.tolist() == [0] + allocation.qk_dims[1].cumsum(0).tolist()
    assert v_offsets.tolist() == [0] + allocation.v_dims[1].cumsum(0).tolist()
    uniform = allocation.uniform()
    assert uniform.qk_dims.unique().numel() == 1 and torch.equal(uniform.qk_dims, uniform.v_dims)
    assert abs(int(uniform.qk_dims.sum() + uniform.v_dims.sum()) - kept) <= 2 * L * Hkv * 8 / 2
    assert (artifact.allocate(0.0).qk_dims == HEAD_DIM).all()
    with pytest.raises(ValueError, match="weighting"):
        artifact.allocate(0.1, weighting="energy")


def test_allocate_by_compression_meets_the_byte_budget():
    artifact = small_artifact()
    L, Hkv = artifact.qk_singular_values.shape[:2]
    quantum = 8 / (2 * L * Hkv * HEAD_DIM)  # one head's width moving by the quantum
    for target in (0.0, 0.05, 0.1, 0.3, 0.5):
        allocation = artifact.allocate(compression=target)
        assert target <= allocation.compression_rate <= target + 2 * quantum, target
        assert allocation.notes["compression_target"] == target
        assert ((allocation.qk_dims % 8 == 0) & (allocation.v_dims % 8 == 0)).all()
    assert (artifact.allocate(compression=0.0).qk_dims == HEAD_DIM).all()
    with pytest.raises(ValueError, match="exactly one of removal_rate and compression"):
        artifact.allocate(0.1, compression=0.1)
    with pytest.raises(ValueError, match="exactly one of removal_rate and compression"):
        artifact.allocate()
    with pytest.raises(ValueError, match="compression must be in"):
        artifact.allocate(compression=1.0)
    with pytest.raises(ValueError, match="fewer than 8 dims"):
        artifact.allocate(compression=0.95)


def test_artifact_round_trip(tmp_path):
    model = tiny_model("qwen2", seed=5)
    artifact = small_artifact(model=model)
    artifact.save(tmp_path / "artifact")
    loaded = FDCArtifact.load(tmp_path / "artifact", model=model)
    for name in artifacts._tensor_specs(artifact.shape):
        assert torch.equal(getattr(loaded, name), getattr(artifact, name)), name
    assert loaded.metadata["calibration"] == artifact.metadata["calibration"]
    assert loaded.metadata["fingerprint"] == families.fingerprint(model)
    for rate in (0.0, 0.1, 0.4):
        assert torch.equal(loaded.allocate(rate).qk_dims, artifact.allocate(rate).qk_dims)
        assert torch.equal(loaded.allocate(rate).v_dims, artifact.allocate(rate).v_dims)
    assert torch.equal(loaded.allocate(compression=0.3).v_dims, artifact.allocate(compression=0.3).v_dims)
    assert loaded.metadata["calibration"]["sensitivity_tokens"] == 62  # two sequences of 32, first tokens unscored
    unmeasured = calibration.calibrate(model, text="random", num_tokens=64, seq_len=32, sensitivity_tokens=0,
                                       progress=False)
    unmeasured.save(tmp_path / "unmeasured")
    assert not FDCArtifact.load(tmp_path / "unmeasured").has_sensitivity


@pytest.fixture
def saved(tmp_path):
    model = tiny_model("llama", seed=11)
    directory = small_artifact(model=model).save(tmp_path / "artifact")
    return model, directory


def tensors_path(directory):
    """The tensor file an artifact's JSON names (save() picks a new name each time)."""
    return directory / json.loads((directory / artifacts.METADATA_FILE).read_text())["tensors_file"]


def rewrite_metadata(directory, metadata: dict) -> None:
    """Writes ``metadata`` with a matching checksum, as a damaged-but-consistent file (or a hand edit) would be."""
    metadata = {**metadata, "checksum": artifacts._metadata_checksum(metadata)}
    (directory / artifacts.METADATA_FILE).write_text(json.dumps(metadata))


def test_truncated_tensor_file_is_rejected(saved):
    model, directory = saved
    path = tensors_path(directory)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="checksum"):
        FDCArtifact.load(directory)


def test_modified_tensor_file_is_rejected(saved):
    model, directory = saved
    path = tensors_path(directory)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum"):
        FDCArtifact.load(directory)


def test_bad_metadata_is_rejected(saved):
    model, directory = saved
    path = directory / artifacts.METADATA_FILE
    metadata = json.loads(path.read_text())
    path.write_text(json.dumps({**metadata, "model_id": "edited by hand"}))  # the checksum covers the JSON too
    with pytest.raises(ArtifactError, match="does not match its own checksum"):
        FDCArtifact.load(directory)
    rewrite_metadata(directory, {**metadata, "format_version": 99})
    with pytest.raises(ArtifactError, match="format version 99"):
        FDCArtifact.load(directory)
    rewrite_metadata(directory, {**metadata, "format_version": 2})
    with pytest.raises(ArtifactError, match=r"format version 2; this fdc_ops reads version 3 .*: recalibrate: "
                                            r"fdc_ops.calibration.calibrate\(model, tokenizer\)"):
        FDCArtifact.load(directory)
    rewrite_metadata(directory, {**metadata, "format_version": "3"})
    with pytest.raises(ArtifactError, match="format version '3'; this fdc_ops reads version 3"):
        FDCArtifact.load(directory)
    for identity in (None, {**metadata["identity"], "dtype": "int8"}, {**metadata["identity"], "weights": {}},
                     {**metadata["identity"], "weights": {"layers.0.q_proj.weight": {"float32": "00"}}}):
        rewrite_metadata(directory, {**metadata, "identity": identity})
        with pytest.raises(ArtifactError, match="'identity' must be the model's config fields"):
            FDCArtifact.load(directory)
    without_fingerprint = {key: value for key, value in metadata.items() if key != "fingerprint"}
    rewrite_metadata(directory, without_fingerprint)
    with pytest.raises(ArtifactError, match="has no 'fingerprint'"):
        FDCArtifact.load(directory)
    for field, value, message in (("head_dim", "16", "'shape.head_dim' must be a positive integer, got '16'"),
                                  ("num_kv_heads", 3, "not a multiple of shape.num_kv_heads 3")):
        rewrite_metadata(directory, {**metadata, "shape": {**metadata["shape"], field: value}})
        with pytest.raises(ArtifactError, match=message):
            FDCArtifact.load(directory)
    for field, value in (("num_tokens", -5), ("v_method", "svd"), ("balance", {"v_to_qk": -1.0}),
                         ("pass_dtype", "int8")):
        rewrite_metadata(directory, {**metadata, "calibration": {**metadata["calibration"], field: value}})
        with pytest.raises(ArtifactError, match=f"'calibration.{field}' must be"):
            FDCArtifact.load(directory)
    rewrite_metadata(directory, {**metadata, "tensors_file": "../elsewhere.safetensors"})
    with pytest.raises(ArtifactError, match="'tensors_file' must be a file name"):
        FDCArtifact.load(directory)
    path.write_text(json.dumps(metadata)[:50])
    with pytest.raises(ArtifactError, match="not valid JSON"):
        FDCArtifact.load(directory)
    rewrite_metadata(directory, {**metadata, "shape": {**metadata["shape"], "head_dim": 32}})
    with pytest.raises(ArtifactError, match="qk_rotation must be"):
        FDCArtifact.load(directory)
    path.unlink()
    with pytest.raises(ArtifactError, match="does not exist"):
        FDCArtifact.load(directory)


def test_negative_sensitivities_are_rejected(tmp_path):
    artifact = small_artifact()
    artifact.v_damage = artifact.v_damage.clone()
    artifact.v_damage[0, 0, 3] = -1e-3
    artifact.save(tmp_path / "negative")
    with pytest.raises(ArtifactError, match="v_damage must be non-negative"):
        FDCArtifact.load(tmp_path / "negative")


def test_every_allocation_rule_takes_the_same_width_quantum():
    artifact = small_artifact()
    for kwargs in (dict(removal_rate=0.1), dict(compression=0.2), dict(compression=0.2, rule="explained_variance"),
                   dict(compression=0.2, rule="fisher")):
        with pytest.raises(ValueError, match="multiple must be a positive divisor of head_dim 16"):
            artifact.allocate(multiple=12, **kwargs)
        artifact.allocate(multiple=8, **kwargs)


def test_unreadable_tensors_with_matching_checksum_are_rejected(saved):
    model, directory = saved
    path = tensors_path(directory)
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    metadata = json.loads((directory / artifacts.METADATA_FILE).read_text())
    metadata["tensors_sha256"] = artifacts._sha256(path)
    rewrite_metadata(directory, metadata)
    with pytest.raises(ArtifactError, match="cannot be read"):
        FDCArtifact.load(directory)


def test_non_orthonormal_basis_is_rejected(tmp_path):
    artifact = small_artifact()
    artifact.qk_rotation = artifact.qk_rotation * 1.01
    artifact.save(tmp_path / "bad")
    with pytest.raises(ArtifactError, match="not orthonormal"):
        FDCArtifact.load(tmp_path / "bad")
    artifact = small_artifact()
    artifact.v_decoder = artifact.v_decoder * (1 + 1e-6)
    artifact.save(tmp_path / "bad_v")
    with pytest.raises(ArtifactError, match="not the identity"):
        FDCArtifact.load(tmp_path / "bad_v")


def test_artifact_of_another_model_is_rejected(saved):
    model, directory = saved
    FDCArtifact.load(directory, model=model)
    with pytest.raises(ArtifactError, match="fingerprint"):
        FDCArtifact.load(directory, model=tiny_model("llama", seed=12))  # same config, other weights
    with pytest.raises(ArtifactError, match="attention shape"):
        FDCArtifact.load(directory, model=tiny_model("llama", seed=11, num_hidden_layers=3))


def test_one_artifact_serves_every_dtype_of_its_checkpoint_and_catches_any_change():
    """The identity is every layer's attention weights, compared in the least precise of the model's dtype and the
    calibration's: float32, bfloat16 and float16 loads of the checkpoint pass (and share the cache key), a change to
    any tensor of any layer is named, down to one float32 ulp when both sides are float32."""
    model = tiny_model("qwen3", seed=21, num_hidden_layers=4)
    artifact = small_artifact(model=model)
    key = families.fingerprint(model)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        served = copy.deepcopy(model).to(dtype)
        artifact.check_model(served)
        if dtype != torch.float16:  # float16 rounds a float32 weight differently from bfloat16: another key
            assert families.fingerprint(served) == key
    in_bfloat16 = copy.deepcopy(model).to(torch.bfloat16)  # calibrated in bfloat16, served in float32: compared in bf16
    small_artifact(model=in_bfloat16).check_model(copy.deepcopy(in_bfloat16).to(torch.float32))
    for layer, name, change in ((2, "k_proj", lambda w: w.mul_(1.01)),  # a middle layer, as a fine-tune would
                                (3, "q_norm", lambda w: w.add_(1e-2)),
                                (1, "o_proj", lambda w: w.view(-1)[7].copy_(torch.nextafter(w.view(-1)[7],
                                                                                           torch.tensor(1.0))))):
        tuned = copy.deepcopy(model)
        with torch.no_grad():
            change(getattr(tuned.get_decoder().layers[layer].self_attn, name).weight)
        with pytest.raises(ArtifactError, match=rf"1 of its \d+ attention tensors differ, first "
                                                rf"layers\.{layer}\.{name}\.weight \(in float32\)"):
            artifact.check_model(tuned)
    with pytest.raises(ArtifactError, match="calibrated in float16, loaded in bfloat16"):
        small_artifact(model=copy.deepcopy(model).to(torch.float16)).check_model(copy.deepcopy(model).to(
            torch.bfloat16))


@pytest.mark.parametrize("case", range(4))
def test_calibration_windows_start_at_documents_spread_over_the_text(case):
    _, rng, replay = case_generator("calibration_windows", case)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(40, 120))]
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    ids = torch.arange(sum(lengths))
    seq_len, count = rng.randint(4, 40), rng.randint(1, 8)
    windows = datasets.calibration_windows(ids, starts, count, seq_len)
    limit = int(ids.numel() * datasets.CALIBRATION_SHARE)
    candidates = [start for start in starts.tolist() if start + seq_len <= limit]
    firsts = [int(window[0, 0]) for window in windows]
    assert [tuple(window.shape) for window in windows] == [(1, seq_len)] * count, replay
    assert all(torch.equal(window[0], ids[first: first + seq_len]) for window, first in zip(windows, firsts)), replay
    assert firsts == [candidates[k * len(candidates) // count] for k in range(count)], replay  # evenly spaced
    assert firsts == sorted(firsts) and all(b - a >= seq_len for a, b in zip(firsts, firsts[1:])), replay
    assert firsts[-1] + seq_len <= limit, replay  # the tail stays held out


def test_calibration_windows_name_what_does_not_fit():
    starts = torch.tensor([0, 100, 200, 300])
    with pytest.raises(ValueError, match=r"3 documents starting a 64-token window within its first 360 tokens, "
                                         r"fewer than the 4 windows"):
        datasets.calibration_windows(torch.arange(400), starts, 4, 64)
    with pytest.raises(ValueError, match="3 windows of 100 tokens do not fit apart"):
        datasets.calibration_windows(torch.arange(400), torch.arange(0, 400, 10), 3, 100)


@pytest.mark.parametrize("case", range(4))
def test_unseen_windows_read_documents_in_a_row(case):
    _, rng, replay = case_generator("unseen_windows", case)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(40, 120))]
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    ids = torch.arange(sum(lengths))
    seq_len = rng.randint(4, 400)
    expected, edge = [], 0  # each window at the first document starting at or past the previous one's end
    for start in starts.tolist():
        if start >= edge and start + seq_len <= ids.numel():
            expected.append(start)
            edge = start + seq_len
    count = rng.randint(1, len(expected))
    windows = datasets.unseen_windows(ids, starts, count, seq_len)
    assert tuple(windows.shape) == (count, seq_len), replay
    assert [int(window[0]) for window in windows] == expected[:count], replay
    assert all(torch.equal(window, ids[int(window[0]): int(window[0]) + seq_len]) for window in windows), replay
    with pytest.raises(ValueError, match=rf"room for {len(expected)} windows of {seq_len} tokens starting at "
                                         rf"documents, fewer than the {len(expected) + 1} asked for"):
        datasets.unseen_windows(ids, starts, len(expected) + 1, seq_len)


class CharacterTokenizer:
    """A stand-in tokenizer for a tiny model: one token per character, modulo its vocabulary."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(character) % self.vocab_size for character in text]}


def test_calibrating_on_a_text_reads_windows_of_its_documents():
    """The bundled text's path: the statistics come from calibration_windows' first windows, the V/QK balance from
    the two after them, and the artifact records how the text was sampled."""
    pytest.importorskip("gensim", reason="the bundled Wikipedia text ships with gensim (scripts/setup.sh)")
    model = tiny_model("llama", seed=5)
    tokenizer = CharacterTokenizer(model.config.vocab_size)
    artifact = calibration.calibrate(model, tokenizer, text="humaneval", num_tokens=64, seq_len=32,
                                     sensitivity_tokens=32, progress=False)
    windows = datasets.calibration_windows(*datasets.text_documents(tokenizer, "humaneval"), 4, 32)
    expected = calibration.calibrate(model, input_ids=torch.cat(windows[:2]), sensitivity_tokens=0, progress=False)
    torch.testing.assert_close(artifact.qk_rotation, expected.qk_rotation, rtol=0, atol=0)
    assert artifact.metadata["calibration"]["source"] == "humaneval"
    assert artifact.metadata["calibration"]["sampling"] == "documents"
    assert artifact.metadata["calibration"]["balance"] is not None


def test_calibrate_rejects_bad_arguments():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="v_method"):
        calibration.calibrate(model, text="random", num_tokens=32, seq_len=16, v_method="whitened", progress=False)
    with pytest.raises(ValueError, match="num_tokens"):
        calibration.calibrate(model, text="random", num_tokens=0, progress=False)
    with pytest.raises(ValueError, match=r"text='wikipedia' needs the model's tokenizer"):
        calibration.calibrate(model, progress=False)
    with pytest.raises(ValueError, match="fewer than"):
        calibration.calibrate(model, input_ids=torch.arange(10), seq_len=16, progress=False)


def test_random_tokens_are_seeded():
    first = calibration.random_token_batches(100, 50, 16, seed=4, batch_size=2)
    again = calibration.random_token_batches(100, 50, 16, seed=4, batch_size=2)
    other = calibration.random_token_batches(100, 50, 16, seed=5, batch_size=2)
    assert [b.shape for b in first] == [(2, 16), (2, 16)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])


def test_calibrate_command_line(tmp_path):
    model = tiny_model("mistral", seed=2)
    model.save_pretrained(tmp_path / "model")
    out = tmp_path / "artifact"
    result = subprocess.run([sys.executable, "-m", "fdc_ops", "calibrate", "--model", str(tmp_path / "model"),
                             "--out", str(out), "--num-tokens", "64", "--seq-len", "32", "--text", "random"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    artifact = FDCArtifact.load(out, model=model)
    assert artifact.metadata["calibration"]["num_tokens"] == 64
    assert "removal rate" in result.stdout


def test_bundled_artifact_is_current_and_valid():
    """The artifact shipped for the bundled SmolLM2 must be one load_or_calibrate would find: this format version,
    load_or_calibrate's default settings, and a model fingerprint that matches the key (and the model, when its
    converted copy is already cached here)."""
    bundled = [path for path in calibration.BUNDLED_ARTIFACTS.iterdir() if path.is_dir()]
    assert bundled, f"no artifact in {calibration.BUNDLED_ARTIFACTS}"
    for path in bundled:
        artifact = FDCArtifact.load(path)  # format, checksum, shapes, bases, factor pairs
        fingerprint = artifact.metadata["fingerprint"]
        settings = artifact.metadata["calibration"]
        assert path.name.startswith(f"v{calibration.FORMAT_VERSION}-{fingerprint[:16]}-{settings['source']}-"
                                    f"{settings['sampling']}-{settings['num_tokens']}-{settings['seq_len']}-0-"
                                    f"{settings['v_method']}-"), \
            path.name
        defaults = {name: parameter.default
                    for name, parameter in inspect.signature(calibration.load_or_calibrate).parameters.items()}
        assert path.name.endswith(f"-{defaults['sensitivity_tokens']}"), path.name
        assert (settings["source"], settings["num_tokens"], settings["seq_len"], settings["v_method"]) == \
            (defaults["text"], defaults["num_tokens"], defaults["seq_len"], defaults["v_method"]), \
            "the bundled artifact is not at load_or_calibrate's defaults: recalibrate it"
        if (loading.cache_dir() / "smollm2-135m-instruct" / "model.safetensors").is_file():
            model, _ = loading.load_model()
            assert families.fingerprint(model) == fingerprint, "recalibrate the bundled artifact for this model"


def test_fold_value_and_output_follows_the_weights_device():
    """Artifacts load on the CPU; the weights may live elsewhere (a GPU in vLLM): the folds compute on the weights'
    device. The meta device stands in for one here: a CPU factor times a meta weight would raise."""
    encoder = torch.eye(HEAD_DIM, dtype=torch.float64).expand(2, HEAD_DIM, HEAD_DIM)  # (H_kv, D, D), on the CPU
    v_weight = torch.zeros(2 * HEAD_DIM, 48, device="meta")  # (H_kv * D, hidden)
    o_weight = torch.zeros(48, 4 * HEAD_DIM, device="meta")  # (hidden, H * D), groups of 2
    folded = calibration.fold_value_and_output(v_weight, o_weight, encoder, encoder, [8, 16], 2,
                                               v_bias=torch.zeros(2 * HEAD_DIM, device="meta"))
    assert folded.value_weight.device.type == folded.output_weight.device.type == "meta"
    assert folded.value_weight.shape == (24, 48) and folded.output_weight.shape == (48, 48)


def test_fold_value_and_output_names_mismatched_shapes():
    encoder = torch.eye(HEAD_DIM, dtype=torch.float64).expand(2, HEAD_DIM, HEAD_DIM)  # (H_kv, D, D)
    v_weight, o_weight = torch.zeros(2 * HEAD_DIM, 48), torch.zeros(48, 3 * HEAD_DIM)  # 3 query heads: not G * H_kv
    with pytest.raises(ValueError, match=r"fold_value_and_output: v_weight \(32, 48\) and o_weight \(48, 48\) do not "
                                         r"match 2 KV heads of width 16 in groups of 2"):
        calibration.fold_value_and_output(v_weight, o_weight, encoder, encoder, [16, 16], 2)
