"""Tensor parallelism over FDC heads (fdc_ops.parallel): the per-layer balanced partition of KV heads over ranks, and
the head permutation that hands it to an engine's contiguous sharding, which must leave the model's outputs as they
are."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import case_generator
from fdc_ops import calibration, hf, parallel
from fdc_ops.hf import families
from tiny_models import tiny_model

pytest.importorskip("transformers", reason="the model side needs transformers")


def best_max_width(widths: list[int], ranks: int) -> int:
    """The narrowest widest set over every partition of ``widths`` into ``ranks`` sets of equal count (brute force)."""
    size = len(widths) // ranks
    best = None
    for assignment in itertools.product(range(ranks), repeat=len(widths)):
        if all(assignment.count(r) == size for r in range(ranks)):
            widest = max(sum(w for w, a in zip(widths, assignment) if a == r) for r in range(ranks))
            best = widest if best is None else min(best, widest)
    return best


@pytest.mark.parametrize("case", range(12))
def test_balance_finds_the_narrowest_widest_rank_of_every_layer(case):
    generator, rng, replay = case_generator("balance", case)
    num_kv_heads, ranks = rng.choice([(2, 2), (4, 2), (6, 2), (6, 3), (8, 2), (8, 4)])
    num_layers = rng.randrange(1, 4)
    qk_dims = torch.randint(1, 9, (num_layers, num_kv_heads), generator=generator) * 8
    v_dims = torch.randint(1, 9, (num_layers, num_kv_heads), generator=generator) * 8
    partition = parallel.balance(qk_dims, v_dims, ranks)
    n = num_kv_heads // ranks
    for layer in range(num_layers):
        assert sorted(partition.order[layer].tolist()) == list(range(num_kv_heads)), replay
        sets = [partition.heads(layer, rank).tolist() for rank in range(ranks)]
        assert all(len(s) == n and s == sorted(s) for s in sets), replay
        widths = (qk_dims[layer] + v_dims[layer]).tolist()
        assert int(partition.page_widths[layer]) == best_max_width(widths, ranks), replay
        contiguous = max(sum(widths[r * n:(r + 1) * n]) for r in range(ranks))
        if int(partition.page_widths[layer]) == contiguous:  # nothing to gain: the checkpoint's own order is kept
            assert partition.order[layer].tolist() == list(range(num_kv_heads)), replay
    ranks_widths = partition.cache_widths
    assert torch.equal(ranks_widths.sum(1), (qk_dims + v_dims).sum(1)), replay
    assert torch.equal(partition.page_widths, ranks_widths.max(1).values), replay
    assert partition.bytes_per_token(2) == 2 * int(partition.page_widths.sum())
    assert 0 < partition.efficiency <= 1


def test_balance_of_a_known_layout():
    # Layer 0: heads of 64, 56, 16, 16 columns; contiguous halves hold 120 and 32, the balanced sets {0, 3} and {1, 2}
    # ({0, 2} and {1, 3} tie) 80 and 72. Layer 1: equal widths, kept in order.
    qk_dims = torch.tensor([[32, 32, 8, 8], [16, 16, 16, 16]])
    v_dims = torch.tensor([[32, 24, 8, 8], [16, 16, 16, 16]])
    partition = parallel.balance(qk_dims, v_dims, 2)
    assert partition.order.tolist() == [[0, 3, 1, 2], [0, 1, 2, 3]]
    assert partition.cache_widths.tolist() == [[80, 72], [64, 64]]
    assert partition.key_widths.tolist() == [[40, 40], [32, 32]]
    assert partition.page_widths.tolist() == [80, 64]
    assert partition.page_key_widths.tolist() == [40, 32]
    assert partition.efficiency == pytest.approx((152 + 128) / (2 * (80 + 64)))
    single = parallel.balance(qk_dims, v_dims, 1)
    assert single.order.tolist() == [[0, 1, 2, 3]] * 2 and single.efficiency == 1.0


def test_ranks_that_split_kv_heads_are_refused_naming_the_argument():
    dims = torch.full((2, 4), 8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_key_value_heads \(4\)"):
        parallel.balance(dims, dims, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 must divide num_key_value_heads \(4\).*replicated"):
        parallel.check_ranks(8, 4, 8)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\)"):
        parallel.check_ranks(6, 2, 4)
    with pytest.raises(ValueError, match="must be positive"):
        parallel.check_ranks(8, 4, 0)
    with pytest.raises(ValueError, match=r"\(L, H_kv\) of one shape"):
        parallel.balance(dims, dims[:1], 2)


def permute_model(model, order: torch.Tensor) -> None:
    """Permutes the KV heads of a Hugging Face model in place, layer l by ``order[l]`` (what the vLLM plugin does to
    the checkpoint's tensors while vLLM loads them)."""
    with torch.no_grad():
        for layer, module in enumerate(families.attention_modules(model)):
            for name in ("q_proj", "k_proj", "v_proj"):
                projection = getattr(module, name)
                projection.weight.copy_(parallel.permute_heads(projection.weight, order[layer]))
                if projection.bias is not None:
                    projection.bias.copy_(parallel.permute_heads(projection.bias, order[layer]))
            module.o_proj.weight.copy_(parallel.permute_heads(module.o_proj.weight, order[layer], dim=1))


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # llama's tiny model has q/k/v/o biases, qwen2 q/k/v biases
def test_permuted_heads_compute_what_the_original_heads_compute(family):
    generator, rng, replay = case_generator(f"permuted_heads_{family}", 0)
    seed = rng.randrange(1000)
    model = tiny_model(family, seed=seed, num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    artifact = calibration.calibrate(model, text="random", num_tokens=128, seq_len=32, seed=seed, sensitivity_tokens=0,
                                     progress=False)
    # Heads of very different widths, so that the balanced order is not the checkpoint's.
    qk_dims = torch.tensor([[32, 24, 8, 8], [8, 16, 32, 24]])
    v_dims = torch.tensor([[32, 16, 8, 16], [8, 8, 24, 32]])
    partition = parallel.balance(qk_dims, v_dims, 2)
    assert partition.order.tolist() == [[0, 2, 1, 3], [0, 3, 1, 2]]
    ids = torch.randint(1, model.config.vocab_size, (2, rng.randrange(8, 24)), generator=generator)

    def outputs(model, artifact, qk_dims, v_dims):
        hf.compress(model, artifact, qk_dims=qk_dims, v_dims=v_dims)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
            tokens = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        hf.restore(model)
        return logits, tokens

    expected_logits, expected_tokens = outputs(model, artifact, qk_dims, v_dims)
    permute_model(model, partition.order)
    permuted = parallel.permute_artifact(artifact, partition.order)
    permuted.metadata.update(fingerprint=families.fingerprint(model), identity=families.weight_identity(model))
    allocation = parallel.permute_allocation(calibration.RankAllocation(qk_dims, v_dims, 32, "given"), partition.order)
    assert allocation.qk_dims.tolist() == [[32, 8, 24, 8], [8, 24, 16, 32]]
    logits, tokens = outputs(model, permuted, allocation.qk_dims, allocation.v_dims)
    # The same sums in another order of heads: equal up to float32 rounding.
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5 * expected_logits.abs().max().item(),
                               msg=replay)
    assert torch.equal(tokens, expected_tokens), replay
    # The permutation is real: the unpermuted artifact on the permuted model computes something else.
    with pytest.raises(calibration.ArtifactError, match="attention tensors differ"):
        hf.compress(model, artifact, qk_dims=qk_dims, v_dims=v_dims)
    assert not torch.equal(permuted.qk_rotation, artifact.qk_rotation)
