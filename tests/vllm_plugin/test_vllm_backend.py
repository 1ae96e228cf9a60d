"""The FDC attention backend without an engine: how a step's batch is split into decodes (decode_attention) and
prefills (prefill_attention), and one layer's step over such a batch against the float64 reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

BLOCK = 16  # tokens per page: small, so that the requests below span several pages
# Two KV heads of different widths, two query heads each, head dim 32 (widths are multiples of 8, as the ops take).
QK_DIMS, V_DIMS, GROUP, HEAD_DIM = (8, 16), (16, 8), 2, 32
NUM_PAGES = 16

# Batches as vLLM's model runner orders them for a builder with reorder_batch_threshold 1 (decodes, then requests
# with a cached prefix, then new prompts), and one it did not reorder. Each: (query lens, seq lens).
BATCHES = {
    # two decodes (9 and 39 cached tokens), a prompt with a 32-token cached prefix, a new prompt
    "mixed": ([1, 1, 5, 6], [10, 40, 37, 6]),
    # what a server's steps mostly are: decodes and new prompts (whose keys are the step's own rows)
    "decodes and a prompt": ([1, 1, 6], [10, 40, 6]),
    "decodes": ([1, 1, 1], [10, 40, 3]),
    "prompts": ([3, 4], [3, 4]),
    # a prefill before a decode: the decode goes to prefill_attention with the rest (correct, only slower)
    "unordered": ([4, 1], [4, 20]),
}


def offsets(dims: tuple[int, ...]) -> torch.Tensor:
    from fdc_ops import ops

    return ops.prefix_sums(list(dims))


def common_metadata(query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor):
    """vLLM's CommonAttentionMetadata of a batch on the CPU. block_table: (B, max_blocks) int32."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_start_loc = offsets(tuple(query_lens))
    tokens = int(query_start_loc[-1])
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(seq_lens), num_actual_tokens=tokens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_table_tensor=block_table,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64))


def builder():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from fdc_ops.vllm.backend import FDCAttentionMetadataBuilder

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=sum(QK_DIMS), head_size_v=sum(V_DIMS),
                             dtype=torch.float32)
    config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                             speculative_config=None)
    return FDCAttentionMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))


def random_block_table(num_reqs: int, seed: int) -> torch.Tensor:
    """(num_reqs, 3) int32: distinct pages in a shuffled order (3 pages hold the longest request, 40 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_PAGES, generator=generator)[: 3 * num_reqs].view(num_reqs, 3).to(torch.int32)


def test_the_builder_asks_vllm_to_put_decodes_first():
    assert builder().reorder_batch_threshold == 1


@pytest.mark.parametrize("batch", BATCHES)
def test_a_step_is_split_into_decodes_and_prefills(batch):
    query_lens, seq_lens = BATCHES[batch]
    block_table = random_block_table(len(seq_lens), seed=1)
    meta = builder().build(0, common_metadata(query_lens, seq_lens, block_table))

    leading_decodes = next((i for i, length in enumerate(query_lens) if length != 1), len(query_lens))
    expected_decodes = {"mixed": 2, "decodes and a prompt": 2, "decodes": 3, "prompts": 0, "unordered": 0}[batch]
    assert meta.num_decodes == leading_decodes == expected_decodes
    assert meta.decode_seq_lens.tolist() == seq_lens[:expected_decodes]
    assert torch.equal(meta.decode_block_table, block_table[:expected_decodes])
    if expected_decodes == len(seq_lens):
        assert meta.is_decode_only and meta.prefill is None
        return
    prefill = meta.prefill
    assert not meta.is_decode_only
    rest_q, rest_k = query_lens[expected_decodes:], seq_lens[expected_decodes:]
    # the prefill requests' rows among the step's rows, after the decodes' (the step's rows are handed over whole)
    assert prefill.query_rows.tolist() == (offsets(tuple(rest_q)) + expected_decodes).tolist()
    assert prefill.cu_seqlens_k.tolist() == offsets(tuple(rest_k)).tolist()
    contexts = [s - q for q, s in zip(rest_q, rest_k)]
    assert prefill.has_context == any(contexts)
    # prefill_attention reads the requests' pages through their rows of the block table.
    assert torch.equal(prefill.block_table, block_table[expected_decodes:])


def layer_and_impl(seed: int, sliding_window: int | None = None):
    """A layer's layout as fdc_ops.vllm.layer.FDCPagedAttention carries it, and the backend's impl for it."""
    from fdc_ops.vllm.backend import FDCAttentionImpl

    generator = torch.Generator().manual_seed(seed)
    kv_heads = len(QK_DIMS)
    heads = GROUP * kv_heads
    rotation = torch.linalg.qr(torch.randn(kv_heads, HEAD_DIM, HEAD_DIM, generator=generator,
                                           dtype=torch.float64))[0][:, :, : max(QK_DIMS)].float()
    scale = HEAD_DIM ** -0.5
    layer = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_size=HEAD_DIM, group=GROUP,
                            qk_offsets=offsets(QK_DIMS), v_offsets=offsets(V_DIMS), rotation=rotation,
                            scaling=scale, k_width=sum(QK_DIMS), v_width=sum(V_DIMS))
    impl = FDCAttentionImpl(heads, HEAD_DIM, scale, kv_heads, alibi_slopes=None, sliding_window=sliding_window,
                            kv_cache_dtype="auto")
    return layer, impl


@pytest.mark.parametrize("sliding_window", [None, 1, 5, 17])
@pytest.mark.parametrize("batch", BATCHES)
def test_a_split_step_attends_like_the_reference(batch, sliding_window):
    """One layer's step over a batch whose earlier tokens are already in the pages: its output is causal attention
    of each request's new queries over the request's whole context, or the last `sliding_window` keys of it (float64
    reference). The pages' unused slots hold NaN, so a read of anything not written shows, and so do the pages wholly
    behind every new query's window (vLLM frees those); two padding rows past the step's tokens must come out zero."""
    from fdc_ops import ops, reference
    from fdc_ops.vllm.backend import paged_caches

    query_lens, seq_lens = BATCHES[batch]
    layer, impl = layer_and_impl(seed=2, sliding_window=sliding_window)
    window_left = -1 if sliding_window is None else sliding_window - 1
    generator = torch.Generator().manual_seed(3)
    k_width, v_width = layer.k_width, layer.v_width
    block_table = random_block_table(len(seq_lens), seed=4)
    kv_cache = torch.full((NUM_PAGES, 1, BLOCK, k_width + v_width), float("nan"))  # (num_blocks, 1, block, width)
    k_pages, v_pages = paged_caches(kv_cache, k_width, v_width)

    contexts = [s - q for q, s in zip(query_lens, seq_lens)]
    k_context = torch.randn(sum(contexts), k_width, generator=generator)  # (sum contexts, k_width) compressed
    v_context = torch.randn(sum(contexts), v_width, generator=generator)  # (sum contexts, v_width)
    cu_context = offsets(tuple(contexts))
    ops.append_kv(k_pages, v_pages, k_context, v_context, cu_context, torch.zeros(len(seq_lens), dtype=torch.int32),
                  layer.qk_offsets, layer.v_offsets, block_table)
    if sliding_window is not None:  # request b's first new query, at position contexts[b], sees no earlier key
        for b, context in enumerate(contexts):
            behind = max(0, context - window_left) // BLOCK
            kv_cache[block_table[b, :behind].long()] = float("nan")

    tokens, padding = sum(query_lens), 2
    query = torch.randn(tokens + padding, layer.num_heads * HEAD_DIM, generator=generator)  # (N, H * D) post-RoPE
    key = torch.randn(tokens + padding, layer.num_kv_heads * HEAD_DIM, generator=generator)  # (N, H_kv * D)
    value = torch.randn(tokens + padding, v_width, generator=generator)  # (N, v_width) compressed
    output = torch.full((tokens + padding, GROUP * v_width), float("nan"))  # (N, G * v_width)
    meta = builder().build(0, common_metadata(query_lens, seq_lens, block_table))
    impl.forward(layer, query, key, value, kv_cache, meta, output)

    q = reference.rotate_compress_ref(query[:tokens].view(tokens, -1, HEAD_DIM), layer.rotation, layer.qk_offsets,
                                      GROUP)
    k = reference.rotate_compress_ref(key[:tokens].view(tokens, -1, HEAD_DIM), layer.rotation, layer.qk_offsets, 1)
    cu_q = offsets(tuple(query_lens))
    k_all, v_all = [], []  # each request's context, then its new rows
    for b in range(len(seq_lens)):
        k_all += [k_context[cu_context[b]:cu_context[b + 1]].double(), k[cu_q[b]:cu_q[b + 1]]]
        v_all += [v_context[cu_context[b]:cu_context[b + 1]].double(), value[cu_q[b]:cu_q[b + 1]].double()]
    expected = reference.prefill_attention_ref(q, torch.cat(k_all), torch.cat(v_all), cu_q, offsets(tuple(seq_lens)),
                                               layer.qk_offsets, layer.v_offsets, GROUP, layer.scaling, True,
                                               window_left=window_left)
    # float32 against float64: the compressed products and the softmax over at most 40 keys
    torch.testing.assert_close(output[:tokens].double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(output[tokens:], torch.zeros(padding, GROUP * v_width))


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("batch", BATCHES)
def test_a_palu_step_rebuilds_the_visible_keys_and_attends_like_the_reference(batch, sliding_window):
    """The Palu baseline's step: the pages hold key latents (QK_DIMS wide per KV head) and values; the step appends
    the new ones, rebuilds the keys each query sees at their positions and attends them at full width. The layer's
    rebuild here is a position-dependent stand-in for up-projection and RoPE, so a key rebuilt at a wrong position,
    or from a wrong slot, shows. NaN in unused slots and in the pages behind every window, as in the FDC test."""
    from fdc_ops import ops, reference
    from fdc_ops.vllm.backend import PaluAttentionImpl, paged_caches

    query_lens, seq_lens = BATCHES[batch]
    window_left = -1 if sliding_window is None else sliding_window - 1
    generator = torch.Generator().manual_seed(5)
    kv_heads = len(QK_DIMS)
    heads, k_width, v_width = GROUP * kv_heads, sum(QK_DIMS), sum(V_DIMS)
    key_up = torch.randn(k_width, kv_heads * HEAD_DIM, generator=generator, dtype=torch.float64) / k_width ** 0.5

    def rebuild_keys(latent, positions):  # (..., k_width), (...) -> (..., H_kv * D)
        return (latent.double() @ key_up * (1 + positions[..., None] / 64)).to(latent.dtype)

    full = offsets((HEAD_DIM,) * kv_heads)
    layer = SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_size=HEAD_DIM, group=GROUP,
                            k_offsets=offsets(QK_DIMS), qk_offsets=full, v_offsets=offsets(V_DIMS),
                            scaling=HEAD_DIM ** -0.5, k_width=k_width, v_width=v_width, rebuild_keys=rebuild_keys)
    impl = PaluAttentionImpl(heads, HEAD_DIM, layer.scaling, kv_heads, alibi_slopes=None,
                             sliding_window=sliding_window, kv_cache_dtype="auto")
    block_table = random_block_table(len(seq_lens), seed=6)
    kv_cache = torch.full((NUM_PAGES, 1, BLOCK, k_width + v_width), float("nan"))
    k_pages, v_pages = paged_caches(kv_cache, k_width, v_width)
    contexts = [s - q for q, s in zip(query_lens, seq_lens)]
    latent_context = torch.randn(sum(contexts), k_width, generator=generator)
    v_context = torch.randn(sum(contexts), v_width, generator=generator)
    ops.append_kv(k_pages, v_pages, latent_context, v_context, offsets(tuple(contexts)),
                  torch.zeros(len(seq_lens), dtype=torch.int32), layer.k_offsets, layer.v_offsets, block_table)
    if sliding_window is not None:
        for b, context in enumerate(contexts):
            kv_cache[block_table[b, : max(0, context - window_left) // BLOCK].long()] = float("nan")

    tokens, padding = sum(query_lens), 2
    query = torch.randn(tokens + padding, heads * HEAD_DIM, generator=generator)  # (N, H * D) post-RoPE
    latent = torch.randn(tokens + padding, k_width, generator=generator)  # (N, k_width) pre-RoPE key latents
    value = torch.randn(tokens + padding, v_width, generator=generator)
    output = torch.full((tokens + padding, GROUP * v_width), float("nan"))
    meta = builder().build(0, common_metadata(query_lens, seq_lens, block_table))
    impl.forward(layer, query, latent, value, kv_cache, meta, output)

    cu_context, cu_q = offsets(tuple(contexts)), offsets(tuple(query_lens))
    k_all, v_all = [], []
    for b in range(len(seq_lens)):
        latents = torch.cat([latent_context[cu_context[b]:cu_context[b + 1]], latent[cu_q[b]:cu_q[b + 1]]]).double()
        k_all.append(latents @ key_up * (1 + torch.arange(seq_lens[b], dtype=torch.float64)[:, None] / 64))
        v_all += [v_context[cu_context[b]:cu_context[b + 1]].double(), value[cu_q[b]:cu_q[b + 1]].double()]
    expected = reference.prefill_attention_ref(query[:tokens].double(), torch.cat(k_all), torch.cat(v_all), cu_q,
                                               offsets(tuple(seq_lens)), full, layer.v_offsets, GROUP, layer.scaling,
                                               True, window_left=window_left)
    torch.testing.assert_close(output[:tokens].double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(output[tokens:], torch.zeros(padding, GROUP * v_width))
