"""The FDC attention backend for vLLM: attention over packed heads of per-KV-head widths on torch.ops.fdc, with
vLLM's paged KV cache holding exactly the compressed rows.

Page layout. vLLM gives each attention layer one page per block (``block_size`` tokens) of
``block_size * (k_width + v_width)`` elements (the layer's FullAttentionSpec has one "head" of ``head_size =
k_width``, ``head_size_v = v_width``; see :func:`fdc_ops.vllm.layer.FDCPagedAttention.get_kv_cache_spec`). This
backend lays that page out as the ops' paged cache wants it (fdc_ops/ops.py): the K part first, ``(k_width,
block_size)`` column-major (each column's tokens contiguous, so KV head ``j`` owns one contiguous ``(qk_dim[j],
block_size)`` block), then the V part ``(v_width, block_size)``. The K and V caches handed to the ops are strided
views of vLLM's buffer: page stride ``block_size * (k_width + v_width)``, contiguous pages. With tensor parallelism,
each rank's K and V parts are its own heads' widths, and its pages are as wide as the layer's widest rank share
(vLLM requires one spec per layer on every rank), so a narrower rank's pages end in unused columns.

One step of a layer (:meth:`FDCAttentionImpl.forward`):

1. post-RoPE queries and keys are rotated and truncated per KV head (``rotate_compress``); values arrive already
   compressed (A_V is folded into the V projection);
2. the step's new K/V rows are written after each request's cached rows (``append_kv`` with vLLM's block table);
3. the step is split in two: vLLM puts the requests with one new token (decodes) first in the batch (the builder
   asks for it with ``reorder_batch_threshold = 1``), and those run ``decode_attention`` on the paged cache with the
   step's ``decode_plan`` (greedy LPT over (request, KV head, chunk) tasks; the CPU's AVX-512 kernels check it and
   read the pages by their own pieces, docs/design.md); the rest (prompts, chunks of a chunked
   prefill, prompts with a cached prefix) run one causal ``prefill_attention``, whose keys are each such request's
   whole context, read from the pages through the block table (or the step's own rows when none of them has a
   cached prefix). So no request's context is ever copied out of the pages: a decoding request costs the same in a
   step that also takes a prompt as in a decode-only step, and a prefix hit or a later chunk reads its cached keys
   in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from .. import ops

BACKEND_NAME = "FDC"
PALU_BACKEND_NAME = "FDC_PALU"
# vLLM's kv_cache_dtype -> the ops' cache dtype: the model's own ("auto"), or a quantized cache of fdc_ops.ops, whose
# scales are per (token, KV head), computed as rows are written and kept in the page: vLLM's "per_token_head" modes.
KV_CACHE_DTYPES = {"auto": None, "int8_per_token_head": torch.int8, "fp8_per_token_head": torch.float8_e4m3fn}


def register_attention_backend() -> None:
    """Makes ``FDC`` and ``FDC_PALU`` names of vLLM's attention backend registry (its Attention layer looks its
    backend up by name). Idempotent: vLLM loads plugins once per process, tests may call it again."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, backend in ((BACKEND_NAME, "FDCAttentionBackend"), (PALU_BACKEND_NAME, "PaluAttentionBackend")):
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, f"{__name__}.{backend}")


class FDCAttentionBackend(AttentionBackend):
    """Registered under the name ``FDC`` (fdc_ops.vllm.register); the FDC attention layers name it themselves, so no
    --attention-backend flag is needed (vLLM's CPU platform would pick CPU_ATTN for every other layer)."""

    # The KV write (append_kv) happens inside forward, in the same opaque op as the attention.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["FDCAttentionImpl"]:
        return FDCAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["FDCAttentionMetadataBuilder"]:
        return FDCAttentionMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Each page must be one dense run of memory, which this backend lays out itself (see the module docstring).
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class FDCPrefillMetadata:
    """The prefill part of a step: its requests (every request after the step's decodes, P of them) and what
    ``prefill_attention`` takes for them."""

    # (P + 1,) int32: each request's new tokens among the step's tokens (from num_decodes on), so the step's query,
    # key and value rows are handed to prefill_attention whole, unsliced
    query_rows: torch.Tensor
    cu_seqlens_k: torch.Tensor  # (P + 1,) int32 prefix sums of the requests' seq_lens (their keys in the pages)
    has_context: bool  # whether some of these requests attends cached tokens from earlier steps
    block_table: torch.Tensor  # (P, max_blocks) int32: their block table rows, which prefill_attention reads


@dataclass
class FDCAttentionMetadata:
    """One step's batch, shared by every FDC layer of a KV cache group (the layers differ in widths, not in tokens).

    The first ``num_decodes`` requests have one new token each and run ``decode_attention``; the others, if any, run
    ``prefill_attention`` (``prefill``)."""

    num_actual_tokens: int  # tokens of the step, padding excluded
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor  # (B + 1,) int32: each request's new tokens in the step
    seq_lens: torch.Tensor  # (B,) int32: each request's tokens once this step is cached
    context_lens: torch.Tensor  # (B,) int32: tokens cached before this step (seq_lens - new tokens)
    block_table: torch.Tensor  # (B, max_blocks) int32 page indices
    num_decodes: int  # the leading requests with one new token each (so also their tokens)
    decode_seq_lens: torch.Tensor  # (num_decodes,) int32: seq_lens of the decodes
    decode_block_table: torch.Tensor  # (num_decodes, max_blocks) int32: their block table rows
    prefill: FDCPrefillMetadata | None  # the other requests; None when every request is a decode
    block_size: int  # tokens per page of the block table
    # the step's decode plans by (H_kv, G, window_left): one for every layer of that shape and window, whatever its
    # widths (see FDCAttentionImpl.decode_plan)
    decode_plans: dict = field(default_factory=dict)
    # the Palu baseline's visible keys of the step by window_left (see PaluAttentionImpl.attention_inputs)
    visible_keys: dict = field(default_factory=dict)

    @property
    def is_decode_only(self) -> bool:
        return self.prefill is None


class FDCAttentionMetadataBuilder(AttentionMetadataBuilder[FDCAttentionMetadata]):
    """vLLM makes one builder per distinct page size of a KV cache group (20 for SmolLM2 at compression 0.1), and
    calls each once per step with the group's one CommonAttentionMetadata. What this backend's metadata holds depends
    on that object only (the block table is the group's), so the step's first builder builds it and the others take
    the same object, decode plans included: one build and one plan per step instead of one per builder."""

    # (the step's CommonAttentionMetadata, what was built from it, ids of the builders that took it): a builder that
    # meets an entry it took already is in a later step, even if vLLM passed the same object again.
    _step: ClassVar[tuple[CommonAttentionMetadata, FDCAttentionMetadata, set[int]] | None] = None

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        # vLLM's model runner then puts the requests with at most one new token first in every batch, which the
        # split of a step into decodes and prefills (_build) needs to give every decode to decode_attention.
        self._init_reorder_batch_threshold(1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FDCAttentionMetadata:
        step = FDCAttentionMetadataBuilder._step
        if step is not None and step[0] is common_attn_metadata and id(self) not in step[2] \
                and step[1].block_size == self.block_size:
            step[2].add(id(self))
            return step[1]
        meta = self._build(common_attn_metadata)
        FDCAttentionMetadataBuilder._step = (common_attn_metadata, meta, {id(self)})
        return meta

    def _build(self, common: CommonAttentionMetadata) -> FDCAttentionMetadata:
        num_reqs = common.num_reqs
        query_start_loc = common.query_start_loc[: num_reqs + 1].to(torch.int32)
        seq_lens = common.seq_lens[:num_reqs].to(torch.int32)
        context_lens = seq_lens - (query_start_loc[1:] - query_start_loc[:-1])
        block_table = common.block_table_tensor[:num_reqs].to(torch.int32)
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(common, decode_threshold=1)
        if num_decode_tokens != num_decodes:
            # A request of no new token among the leading ones (vLLM pads batches so for full CUDA graphs, which
            # this backend does not declare it supports): decode_attention takes exactly one query row per request,
            # so the whole step goes to prefill_attention, which takes any query lengths.
            num_decodes = 0
        prefill = None
        if num_decodes < num_reqs:
            prefill = self._build_prefill(query_start_loc[num_decodes:], seq_lens[num_decodes:],
                                          context_lens[num_decodes:], block_table[num_decodes:])
        return FDCAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens, num_reqs=num_reqs, max_query_len=common.max_query_len,
            query_start_loc=query_start_loc, seq_lens=seq_lens, context_lens=context_lens, block_table=block_table,
            num_decodes=num_decodes, decode_seq_lens=seq_lens[:num_decodes],
            decode_block_table=block_table[:num_decodes], prefill=prefill, block_size=self.block_size)

    def _build_prefill(self, query_rows: torch.Tensor, seq_lens: torch.Tensor, context_lens: torch.Tensor,
                       block_table: torch.Tensor) -> FDCPrefillMetadata:
        """query_rows: (P + 1,) int32, from num_decodes; seq_lens, context_lens: (P,) int32; block_table: (P,
        max_blocks) int32: the prefill requests' parts of the step's metadata."""
        return FDCPrefillMetadata(query_rows=query_rows, cu_seqlens_k=ops.prefix_sums(seq_lens),
                                  has_context=bool((context_lens > 0).any()), block_table=block_table)


def paged_caches(kv_cache: torch.Tensor, k_width: int, v_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ops' paged K and V caches inside vLLM's per-layer cache view.

    kv_cache: ``(num_blocks, 1, block_size, page width)``, vLLM's view of the layer's pages (each page dense); the
    page width is ``k_width + v_width``, or more with tensor parallelism on a rank whose heads are narrower than the
    layer's widest rank share (the columns past ``k_width + v_width`` are unused). Returns ``(num_blocks, k_width,
    block_size)`` and ``(num_blocks, v_width, block_size)`` views of the same memory (see the module docstring for the
    in-page layout)."""
    if kv_cache.dim() != 4 or kv_cache.shape[1] != 1 or kv_cache.shape[3] < k_width + v_width:
        raise ValueError(f"fdc_ops.vllm: the KV cache view must have shape (num_blocks, 1, block_size, >= "
                         f"{k_width + v_width}) but got {tuple(kv_cache.shape)}")
    num_blocks, _, block_size, width = kv_cache.shape
    if kv_cache.stride(3) != 1 or kv_cache.stride(2) != width or kv_cache.stride(0) < block_size * width:
        raise ValueError(f"fdc_ops.vllm: each page of the KV cache must be dense, but the view has strides "
                         f"{kv_cache.stride()} for shape {tuple(kv_cache.shape)} (a KV cache layout other than "
                         f"LBHNC?)")
    page_stride = kv_cache.stride(0)
    base = kv_cache.storage_offset()
    k_pages = kv_cache.as_strided((num_blocks, k_width, block_size), (page_stride, block_size, 1), base)
    v_pages = kv_cache.as_strided((num_blocks, v_width, block_size), (page_stride, block_size, 1),
                                  base + k_width * block_size)
    return k_pages, v_pages


class FDCAttentionImpl(AttentionImpl):
    """Runs one FDC layer's step. The layer (fdc_ops.vllm.layer.FDCPagedAttention) carries the layout: ``rotation``
    (H_kv, D, max qk dim), ``qk_offsets`` and ``v_offsets`` (H_kv + 1,) int32 CPU, ``group``, ``scaling``."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **unsupported) -> None:
        refused = {"alibi_slopes": alibi_slopes, "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
                   **{name: value for name, value in unsupported.items() if value is not None}}
        for name, value in refused.items():
            if value is not None:
                raise NotImplementedError(f"fdc_ops.vllm: the FDC attention backend does not support {name} "
                                          f"(got {value!r})")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"fdc_ops.vllm: the FDC attention backend runs decoder attention only, got "
                                      f"attn_type {attn_type!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise NotImplementedError(f"fdc_ops.vllm: the FDC KV cache holds the model dtype or a per-(token, head) "
                                      f"quantized format (kv_cache_dtype in {list(KV_CACHE_DTYPES)}), got "
                                      f"{kv_cache_dtype!r}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"fdc_ops.vllm: sliding_window must be at least 1 token but got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap >= 0:
            raise ValueError(f"fdc_ops.vllm: logits_soft_cap must be None or >= 0 but got {logits_soft_cap}")
        self.num_heads, self.head_size, self.num_kv_heads, self.scale = num_heads, head_size, num_kv_heads, scale
        # vLLM's window W covers the query's own key and the W - 1 before it: the ops' window_left is W - 1.
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.softcap = logits_soft_cap or 0.0  # cap * tanh(scores / cap) (Gemma 2); 0: none, as the ops take it
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype]  # the ops' quantized cache dtype; None: the model's
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None
        self._cache_source: torch.Tensor | None = None  # the cache tensor _cache_views were made of
        self._cache_views: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: FDCAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query: (N, H * D) and key: (N, H_kv * D) post-RoPE, uncompressed; value: (N, v_width) compressed (A_V
        folded); output: (N, G * v_width), written in place (rows past the step's tokens are zeroed). N may include
        padding past ``attn_metadata.num_actual_tokens``."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fdc_ops.vllm: fused output quantization is not supported by the FDC backend")
        if attn_metadata is None:  # vLLM's warm-up and profiling runs, with no cache bound yet
            return output.zero_()
        meta = attn_metadata
        tokens = meta.num_actual_tokens
        padded = tokens < query.shape[0]
        if padded:
            query, key, value = query[:tokens], key[:tokens], value[:tokens]
        q, k_cache, v_cache, (decode_table, prefill_table), own_rows = self.attention_inputs(layer, query, key, value,
                                                                                             kv_cache, meta)
        G, qk_offsets, v_offsets = layer.group, layer.qk_offsets, layer.v_offsets
        decodes, prefill = meta.num_decodes, meta.prefill
        # Each op's result is copied into vLLM's output whole where it covers it, so a step slices as little as it
        # can: a slice or a partial copy costs 1.5-2.5 us of dispatch each, per layer (bench/bench_vllm_layer.py).
        if prefill is not None:  # the requests after the decodes, whose rows prefill_attention finds by query_rows
            if own_rows is None:  # each one's whole context, read in place from the pages
                keys, values, cu_seqlens_k = k_cache, v_cache, prefill.cu_seqlens_k
            else:  # prompts from scratch: their keys are the step's own rows, beside their queries
                keys, values, cu_seqlens_k, prefill_table = own_rows[0], own_rows[1], prefill.query_rows, None
            result = ops.prefill_attention(q, keys, values, prefill.query_rows, cu_seqlens_k, qk_offsets, v_offsets,
                                           G, layer.scaling, True, window_left=self.window_left, softcap=self.softcap,
                                           block_table=prefill_table)  # (tokens, G * v_width), decode rows zero
            if padded:
                output[:tokens] = result
            else:
                output.copy_(result)
        if decodes:  # the leading requests, one row each: (num_decodes, G * v_width)
            result = ops.decode_attention(q if decodes == tokens else q[:decodes], k_cache, v_cache,
                                          meta.decode_seq_lens, qk_offsets, v_offsets, G, layer.scaling,
                                          self.decode_plan(meta, layer, self.window_left), decode_table,
                                          window_left=self.window_left, softcap=self.softcap)
            if decodes == output.shape[0]:
                output.copy_(result)
            else:
                output[:decodes] = result
        if padded:
            output[tokens:] = 0
        return output

    def attention_inputs(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: torch.Tensor, meta: FDCAttentionMetadata):
        """Writes the step's rows to the pages and returns what the step attends with: queries (T, G * k_width),
        the paged K and V caches, the block tables of the decodes and of the other requests (their rows of the
        step's (B, max_blocks) table; None where the step has none), and the step's own (K, V) rows, which the
        prefill part attends instead of the pages when none of its requests has cached context (else None).
        query: (T, H * D), key: (T, H_kv * D) post-RoPE; value: (T, v_width)."""
        tokens = query.shape[0]
        H, Hkv, D, G = layer.num_heads, layer.num_kv_heads, layer.head_size, layer.group
        q = ops.rotate_compress(query.view(tokens, H, D), layer.rotation, layer.qk_offsets, G)  # (T, G * k_width)
        k = ops.rotate_compress(key.view(tokens, Hkv, D), layer.rotation, layer.qk_offsets, 1)  # (T, k_width)
        k_pages, v_pages = self.paged_caches(kv_cache, layer)
        ops.append_kv(k_pages, v_pages, k, value, meta.query_start_loc, meta.context_lens, layer.qk_offsets,
                      layer.v_offsets, meta.block_table)
        prefill = meta.prefill
        own_rows = None if prefill is None or prefill.has_context else (k, value)
        return q, k_pages, v_pages, (meta.decode_block_table, None if prefill is None else prefill.block_table), \
            own_rows

    @staticmethod
    def decode_plan(meta: FDCAttentionMetadata, layer, window_left: int = -1) -> torch.Tensor:
        """The plan of the step's decodes for layers of the layer's (H_kv, G) and sliding window, made once per step by
        the first such layer (a windowed plan's records cover only the window's keys, so windows do not share).

        A plan is a valid schedule for any widths of that shape: decode_attention takes a plan made for the same
        lengths, batch, H_kv and G, and the widths only weigh the greedy LPT's task costs (``s_kv * d_sum``). So
        the layers share the first layer's plan instead of planning once per distinct width layout (26 plans per
        step of SmolLM2 at compression 0.1, 7 us each with dispatch, on the 2-core Intel Xeon). The price: another
        layer's tasks are balanced by the first layer's head widths, so a worker may get up to about one task
        more than its share where the layers' widths differ much from head to head."""
        key = (layer.num_kv_heads, layer.group, window_left)
        plan = meta.decode_plans.get(key)
        if plan is None:
            plan = ops.decode_plan(meta.decode_seq_lens, layer.qk_offsets, layer.v_offsets, layer.group,
                                   window_left=window_left)
            meta.decode_plans[key] = plan
        return plan

    def paged_caches(self, kv_cache: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`paged_caches` of the layer's cache, made once per cache tensor: vLLM hands every step the same
        tensor, and checking and viewing it again cost 3.5 us per layer and step (measured on the 2-core Intel
        Xeon, torch 2.13 CPU)."""
        if kv_cache is not self._cache_source:
            if self.cache_dtype is None:
                k_pages, v_pages = paged_caches(kv_cache, layer.k_width, layer.v_width)
            else:  # each row's scales after its codes (ops.cache_width); vLLM allocates fp8 pages as uint8
                k_pages, v_pages = paged_caches(kv_cache, ops.cache_width(layer.k_offsets, self.cache_dtype),
                                                ops.cache_width(layer.v_offsets, self.cache_dtype))
                k_pages, v_pages = k_pages.view(self.cache_dtype), v_pages.view(self.cache_dtype)
            self._cache_views = (k_pages, v_pages)
            self._cache_source = kv_cache
        return self._cache_views


class PaluAttentionBackend(FDCAttentionBackend):
    """The Palu baseline's backend, registered under the name ``FDC_PALU``: the same metadata and page layout as
    FDC's (the K columns of a page hold each token's key latent), the step run by :class:`PaluAttentionImpl`."""

    @staticmethod
    def get_name() -> str:
        return PALU_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["PaluAttentionImpl"]:
        return PaluAttentionImpl


@dataclass
class VisibleKeys:
    """The pages that hold the keys one step's queries see (for the layers of one sliding window): the Palu baseline
    rebuilds the keys of these pages, into P scratch pages that mirror them."""

    pages: torch.Tensor  # (P,) int64: the pages holding some visible key, request after request (vLLM's indices)
    block_table: torch.Tensor  # (B, max_blocks) int32: each request's pages among the P (0 for pages it does not see)
    decode_block_table: torch.Tensor  # (num_decodes, max_blocks) int32: its rows of the step's decodes
    prefill_block_table: torch.Tensor  # (B - num_decodes, max_blocks) int32: its rows of the other requests
    # (P, block_size) int64: the position of each slot's key in its request; slots past the request's last key (not
    # written yet: never read) take that key's position, so every position has a RoPE entry
    positions: torch.Tensor

    @classmethod
    def of_step(cls, meta: FDCAttentionMetadata, window_left: int) -> "VisibleKeys":
        """Request b's queries see keys [first_b, seq_len_b), first_b = max(0, context_len_b - window_left) with a
        window and 0 without; pages wholly before first_b may have been freed by vLLM and are not touched."""
        block_size = meta.block_size
        seq_lens, context_lens = meta.seq_lens.long(), meta.context_lens.long()
        first = (context_lens - window_left).clamp_min(0) if window_left >= 0 else torch.zeros_like(seq_lens)
        first_page = first // block_size
        page_counts = (seq_lens + block_size - 1) // block_size - first_page
        requests = torch.repeat_interleave(torch.arange(seq_lens.shape[0]), page_counts)  # (P,)
        page_starts = torch.cumsum(page_counts, 0) - page_counts
        columns = first_page[requests] + torch.arange(requests.shape[0]) - page_starts[requests]
        block_table = torch.zeros_like(meta.block_table)
        block_table[requests, columns] = torch.arange(requests.shape[0], dtype=block_table.dtype)
        positions = columns[:, None] * block_size + torch.arange(block_size)
        positions = torch.minimum(positions, (seq_lens[requests] - 1)[:, None])
        return cls(pages=meta.block_table[requests, columns].long(), block_table=block_table,
                   decode_block_table=block_table[:meta.num_decodes],
                   prefill_block_table=block_table[meta.num_decodes:], positions=positions)


class PaluAttentionImpl(FDCAttentionImpl):
    """Runs one Palu-baseline layer's step (fdc_ops.vllm.layer.PaluPagedAttention carries ``k_offsets`` (the cached
    latent's widths), ``qk_offsets`` (full width), ``v_offsets``, ``key_up`` and ``rebuild_keys``).

    What Palu costs: every step rebuilds the keys of the pages its queries see from the cached latents (the pages'
    latent columns copied out whole, up-projected, normalised, rotated at their positions) into scratch pages,
    copies the values' pages beside them, and attends at full key width, with the same ops as FDC (decode_attention
    with the step's plan for the decodes, prefill_attention through a block table for the rest). Whole pages are
    rebuilt (at most one partly used page per request, and the part of a windowed request's first page before its
    window, are extra work) because page-sized copies and one batched product cost less than gathering and
    scattering single rows."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.cache_dtype is not None:
            raise NotImplementedError(f"fdc_ops.vllm: the Palu baseline's backend rebuilds keys from float latents; "
                                      f"its kv_cache_dtype must be 'auto', got {self.kv_cache_dtype!r}")

    def attention_inputs(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         kv_cache: torch.Tensor, meta: FDCAttentionMetadata):
        """As FDCAttentionImpl's, for query: (T, H * D) post-RoPE, key: (T, k_width) pre-RoPE key latents, value:
        (T, v_width): the queries as they are, the scratch pages of rebuilt keys and copied values with their block
        table, and no own rows (the step's keys too are rebuilt from the pages)."""
        k_pages, v_pages = self.paged_caches(kv_cache, layer)
        ops.append_kv(k_pages, v_pages, key, value, meta.query_start_loc, meta.context_lens, layer.k_offsets,
                      layer.v_offsets, meta.block_table)
        visible = meta.visible_keys.get(self.window_left)
        if visible is None:
            visible = meta.visible_keys[self.window_left] = VisibleKeys.of_step(meta, self.window_left)
        latents = k_pages.index_select(0, visible.pages).transpose(1, 2)  # (P, block, k_width)
        key_pages = layer.rebuild_keys(latents, visible.positions).transpose(1, 2).contiguous()  # (P, H_kv*D, block)
        value_pages = v_pages.index_select(0, visible.pages)  # (P, v_width, block)
        return query, key_pages, value_pages, (visible.decode_block_table, visible.prefill_block_table), None
