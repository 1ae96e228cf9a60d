"""FDC models under vLLM's tensor parallelism on the CPU (vLLM's multiprocessing executor, one worker process per
rank), on a tiny random-weight Qwen2 checkpoint (QKV biases: the V bias folds into an output bias that is a sum over
every rank's heads) with 8 query and 4 KV heads, so that 2 ranks each hold 2 KV heads of different widths.

SmolLM2 (9 query / 3 KV heads) divides only over 3 ranks; this model is cheaper and splits over 2.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .test_vllm_families import MAX_MODEL_LEN, NEW_TOKENS, PROMPTS, write_checkpoint
from .vllm_engines import KV_CACHE_GIB, Engine, hf_fdc_tokens

RANKS = 2
SHAPE = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=32, hidden_size=256)  # Qwen2: hidden = H * D
# Heads of very different widths, whose contiguous halves are far apart (layer 0: KV heads of 64, 40, 16 and 24
# columns, halves of 104 and 40, balanced {0, 2} and {1, 3} of 80 and 64; layer 1: 16, 24, 56, 56, halves of 40 and
# 112, balanced 72 and 80): both the permutation and pages with unused columns are exercised.
QK_DIMS = [[32, 24, 8, 8], [8, 16, 32, 24]]
V_DIMS = [[32, 16, 8, 16], [8, 8, 24, 32]]


def expected_kv_tokens(bytes_per_token: int, block_size: int = 128) -> int:
    """What vLLM fits in each rank's KV cache space (whole blocks; vLLM's CPU block is 128 tokens)."""
    return (KV_CACHE_GIB << 30) // (block_size * bytes_per_token) * block_size


@pytest.mark.parametrize("method", ["fdc", "palu"])
def test_two_ranks_generate_what_one_rank_generates(method, tmp_path, monkeypatch):
    """FDC on 1 and 2 ranks, and the Palu baseline (QK_DIMS then the key latent's widths) on 2 ranks, generate the
    Hugging Face module's tokens."""
    import fdc_ops.vllm
    from fdc_ops import calibration, parallel

    model_dir = tmp_path / "model"
    model, tokenizer = write_checkpoint("qwen2", model_dir, **SHAPE)
    assert model.model.layers[0].self_attn.v_proj.bias.abs().min() > 0  # a V bias, shared out over the ranks
    artifact = calibration.calibrate(model, text="random", num_tokens=512, seq_len=64, sensitivity_tokens=0,
                                     progress=False)
    artifact_dir = artifact.save(tmp_path / "artifact")
    allocation = calibration.RankAllocation(torch.tensor(QK_DIMS), torch.tensor(V_DIMS), 32, "given")
    partition = parallel.balance(allocation.qk_dims, allocation.v_dims, RANKS)
    assert partition.order.tolist() == [[0, 2, 1, 3], [0, 3, 1, 2]]  # the checkpoint's heads, permuted as they load
    assert partition.page_widths.tolist() == [80, 80]  # 296 of the ranks' 2 * 160 columns in use
    expected = hf_fdc_tokens(model, tokenizer, artifact_dir, PROMPTS, NEW_TOKENS, qk_dims=QK_DIMS, v_dims=V_DIMS,
                             method=method)
    overrides = fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, qk_dims=QK_DIMS, v_dims=V_DIMS, method=method)

    results = {}
    # vLLM's automatic binding wants a NUMA node per rank, which this machine may not have.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", fdc_ops.vllm.cpu_thread_binding(RANKS))
    for ranks in (1, RANKS) if method == "fdc" else (RANKS,):
        engine = Engine(model_dir, overrides, max_model_len=MAX_MODEL_LEN, tensor_parallel_size=ranks)
        try:
            results[ranks] = engine.tokens(PROMPTS, NEW_TOKENS), engine.kv_cache_tokens
        finally:
            engine.close()
    assert results[RANKS][0] == expected
    # Each rank has its own KV cache space; one rank's bytes per token are the packed widths, each of 2 ranks' the
    # pages of its layers' widest rank share.
    assert results[RANKS][1] == expected_kv_tokens(partition.bytes_per_token(4))
    if method == "fdc":
        assert results[1] == (expected, expected_kv_tokens(allocation.kv_bytes_per_token(4)))


def test_two_ranks_with_an_int8_cache_generate_what_the_hf_int8_model_generates(tmp_path, monkeypatch):
    """kv_cache_dtype="int8_per_token_head" over 2 ranks: each rank mixes its heads as the Hugging Face model mixes
    the same heads (seeded by the model's head index, not the rank's), so the tokens are the HF int8 model's up to
    its first near tie, and each rank's pages hold its codes plus a float32 scale per token and KV head for K and V."""
    import fdc_ops.vllm
    from fdc_ops import calibration, parallel

    from .test_vllm_plugin import agreed_steps, hf_greedy_with_margins

    model_dir = tmp_path / "model"
    model, tokenizer = write_checkpoint("qwen2", model_dir, **SHAPE)
    artifact = calibration.calibrate(model, text="random", num_tokens=512, seq_len=64, sensitivity_tokens=0,
                                     progress=False)
    artifact_dir = artifact.save(tmp_path / "artifact")
    allocation = calibration.RankAllocation(torch.tensor(QK_DIMS), torch.tensor(V_DIMS), 32, "given")
    partition = parallel.balance(allocation.qk_dims, allocation.v_dims, RANKS)
    expected = [hf_greedy_with_margins((model, tokenizer), artifact_dir, prompt, new_tokens=NEW_TOKENS,
                                       qk_dims=QK_DIMS, v_dims=V_DIMS, kv_dtype=torch.int8) for prompt in PROMPTS]
    overrides = fdc_ops.vllm.hf_overrides(model_dir, artifact_dir, qk_dims=QK_DIMS, v_dims=V_DIMS)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", fdc_ops.vllm.cpu_thread_binding(RANKS))
    engine = Engine(model_dir, overrides, max_model_len=MAX_MODEL_LEN, tensor_parallel_size=RANKS,
                    kv_cache_dtype="int8_per_token_head")
    try:
        tokens, capacity = engine.tokens(PROMPTS, NEW_TOKENS), engine.kv_cache_tokens
    finally:
        engine.close()
    checked = [agreed_steps(got, *want, 0.02) for got, want in zip(tokens, expected)]
    assert sum(checked) >= NEW_TOKENS, checked
    kv_heads_per_rank = SHAPE["num_key_value_heads"] // RANKS
    scales = 2 * 4 * kv_heads_per_rank * len(QK_DIMS)  # K and V, a float32 per KV head, every layer
    assert capacity == expected_kv_tokens(partition.bytes_per_token(1) + scales)


def test_ranks_that_split_kv_heads_are_refused_before_vllm_builds_the_model():
    from fdc_ops.vllm.models import FDCQwen2ForCausalLM

    hf_config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                                hidden_size=256)
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=4),
                                  model_config=SimpleNamespace(hf_config=hf_config))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide num_key_value_heads \(2\)"):
        FDCQwen2ForCausalLM(vllm_config=vllm_config)
