"""The FDC attention layer for vLLM: vLLM's own Attention layer (its registration with the engine, its opaque
``unified_attention_with_output`` op that torch.compile leaves alone, its KV cache binding), told to use the FDC
backend and to ask for a KV cache of exactly the layer's packed widths."""

from __future__ import annotations

import torch
from vllm.config import CacheConfig, VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import unified_attention_with_output
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

from .backend import FDCAttentionBackend, register_attention_backend


class FDCPagedAttention(Attention):
    """Attention of one decoder layer over FDC-compressed heads.

    Takes post-RoPE queries ``(T, H * D)`` and keys ``(T, H_kv * D)`` (full width: the rotation runs inside the
    backend's op, so compiled graphs see only fixed widths) and compressed values ``(T, v_width)``; returns the
    compressed attention output ``(T, G * v_width)`` that the folded output projection W_O' consumes.

    rotation: ``(H_kv, D, max qk dim)`` truncated rotations R (a buffer, in the model dtype); qk_offsets, v_offsets:
    ``(H_kv + 1,)`` int32 CPU prefix sums of this layer's widths (with tensor parallelism, all of these are this
    rank's heads'). page: ``(key columns, columns)`` per token of the layer's KV cache page as every rank declares
    it, at least ``(k_width, k_width + v_width)``; None for exactly this layer's widths (one rank). sliding_window:
    the layer's window W (each query sees its own key and the W - 1 before it, vLLM's and Hugging Face's meaning), or
    None; exactly what vLLM's own attention module of the layer has."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, rotation: torch.Tensor,
                 qk_offsets: torch.Tensor, v_offsets: torch.Tensor, cache_config: CacheConfig | None, prefix: str,
                 page: tuple[int, int] | None = None, sliding_window: int | None = None):
        register_attention_backend()
        super().__init__(num_heads, head_size, scale, num_kv_heads=num_kv_heads, cache_config=cache_config,
                         prefix=prefix, attn_backend=FDCAttentionBackend, per_layer_sliding_window=sliding_window)
        # vLLM's Attention falls back to the model-wide window when given none: the layer must have its module's.
        if self.sliding_window != sliding_window:
            raise ValueError(f"fdc_ops.vllm: layer {prefix} was built with sliding window {self.sliding_window} but "
                             f"its attention module has {sliding_window}")
        if rotation.shape[:2] != (num_kv_heads, head_size) or rotation.shape[2] < int((qk_offsets.diff()).max()):
            raise ValueError(f"fdc_ops.vllm: rotation must have shape ({num_kv_heads}, {head_size}, >= max qk dim) "
                             f"but got {tuple(rotation.shape)}")
        self.group = num_heads // num_kv_heads
        self.scaling = scale
        self.register_buffer("rotation", rotation.contiguous(), persistent=False)
        self.qk_offsets, self.v_offsets = qk_offsets, v_offsets  # CPU, as the ops take them: not buffers
        self.k_width, self.v_width = int(qk_offsets[-1]), int(v_offsets[-1])
        self.page_key_width, self.page_width = page or (self.k_width, self.k_width + self.v_width)
        if self.page_width < self.k_width + self.v_width or not 0 < self.page_key_width <= self.page_width:
            raise ValueError(f"fdc_ops.vllm: page must be (key columns, columns) with 0 < key columns <= columns and "
                             f"columns >= {self.k_width + self.v_width} (this layer's widths), but got {page}")

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        """One "head" of ``page_key_width`` key and ``page_width - page_key_width`` value columns: on one rank
        exactly the layer's ``k_width`` and ``v_width``, so a page is exactly ``block_size * (k_width + v_width)``
        elements. Layers of different widths get pages of different sizes in one KV cache group (vLLM's
        UniformTypeKVCacheSpecs: one block table, each layer's pages its own size), so no layer is padded.

        With tensor parallelism vLLM requires a layer's spec to be the same on every rank (get_kv_cache_configs
        asserts it), so every rank declares the layer's widest rank share, and a rank with narrower heads leaves
        the last ``page_width - k_width - v_width`` columns of its pages unused (the backend reads the first
        ``k_width`` columns as K, the next ``v_width`` as V).

        A sliding-window layer's spec is vLLM's SlidingWindowSpec (same pages), so vLLM frees the pages that fall
        wholly behind the window of every request and admits requests by what their windows hold; the ops never
        read those pages or their block-table entries."""
        shape = dict(block_size=vllm_config.cache_config.block_size, num_kv_heads=1, head_size=self.page_key_width,
                     head_size_v=self.page_width - self.page_key_width, dtype=self.kv_cache_torch_dtype)
        if self.sliding_window is not None:
            return SlidingWindowSpec(**shape, sliding_window=self.sliding_window)
        return FullAttentionSpec(**shape)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output_shape=None,
                output_dtype=None) -> torch.Tensor:
        """query: (T, H * D), key: (T, H_kv * D) post-RoPE; value: (T, v_width). Returns (T, G * v_width)."""
        output = torch.empty((query.shape[0], self.group * self.v_width), dtype=query.dtype, device=query.device)
        if self.use_direct_call:
            unified_attention_with_output(query, key, value, output, self.layer_name)
        else:
            torch.ops.vllm.unified_attention_with_output(query, key, value, output,
                                                         _encode_layer_name(self.layer_name))
        return output
