"""The FDC and Palu attention layers for vLLM: vLLM's own Attention layer (its registration with the engine, its
opaque ``unified_attention_with_output`` op that torch.compile leaves alone, its KV cache binding), told to use the
FDC (or Palu) backend and to ask for a KV cache of exactly the layer's packed widths."""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import CacheConfig, VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.attention.attention import unified_attention_with_output
from vllm.utils.torch_utils import _encode_layer_name
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

from .. import ops
from .backend import FDCAttentionBackend, PaluAttentionBackend, register_attention_backend


class CompressedPagedAttention(Attention):
    """Attention of one decoder layer whose paged KV cache holds compressed rows of per-KV-head widths: what the FDC
    and Palu layers share (vLLM's registration, the cache spec of exactly the layer's widths, the output width).

    k_offsets, v_offsets: ``(H_kv + 1,)`` int32 CPU prefix sums of the cached key and value widths (with tensor
    parallelism, of this rank's heads). page: ``(key columns, columns)`` per token of the layer's KV cache page as
    every rank declares it, at least ``(k_width, k_width + v_width)``; None for exactly this layer's widths (one
    rank). sliding_window: the layer's window W (each query sees its own key and the W - 1 before it, vLLM's and
    Hugging Face's meaning), or None; exactly what vLLM's own attention module of the layer has. logits_soft_cap:
    the cap of the scaled scores (Gemma 2's ``attn_logit_softcapping``), or None. backend: the attention backend
    class that runs the layer. cache_dtype: a quantized cache format vLLM's kv_cache_dtype cannot name (int4's
    uint8, from the fdc entry), or None for what kv_cache_dtype says."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, k_offsets: torch.Tensor,
                 v_offsets: torch.Tensor, cache_config: CacheConfig | None, prefix: str,
                 page: tuple[int, int] | None, sliding_window: int | None, backend: type,
                 logits_soft_cap: float | None = None, cache_dtype: torch.dtype | None = None):
        register_attention_backend()
        super().__init__(num_heads, head_size, scale, num_kv_heads=num_kv_heads, cache_config=cache_config,
                         prefix=prefix, attn_backend=backend, per_layer_sliding_window=sliding_window,
                         logits_soft_cap=logits_soft_cap)
        # vLLM's Attention falls back to the model-wide window when given none: the layer must have its module's.
        if self.sliding_window != sliding_window:
            raise ValueError(f"fdc_ops.vllm: layer {prefix} was built with sliding window {self.sliding_window} but "
                             f"its attention module has {sliding_window}")
        self.group = num_heads // num_kv_heads
        self.scaling = scale
        self.k_offsets, self.v_offsets = k_offsets, v_offsets  # CPU, as the ops take them: not buffers
        self.k_width, self.v_width = int(k_offsets[-1]), int(v_offsets[-1])
        # the ops' cache dtype when vLLM's kv_cache_dtype quantizes (backend.KV_CACHE_DTYPES; None: the model's)
        if cache_dtype is not None:
            if self.impl.cache_dtype is not None:
                raise ValueError(f"fdc_ops.vllm: layer {prefix}: the fdc entry's kv_dtype and vLLM's kv_cache_dtype "
                                 f"{self.impl.kv_cache_dtype!r} both quantize the cache; give one of them")
            self.impl.cache_dtype = cache_dtype
            self.kv_cache_torch_dtype = cache_dtype  # the pages' bytes, as vLLM allocates and counts them
        self.cache_dtype = self.impl.cache_dtype
        self.page_key_width, self.page_width = page or (self.k_width, self.k_width + self.v_width)
        if self.page_width < self.k_width + self.v_width or not 0 < self.page_key_width <= self.page_width:
            raise ValueError(f"fdc_ops.vllm: page must be (key columns, columns) with 0 < key columns <= columns and "
                             f"columns >= {self.k_width + self.v_width} (this layer's widths), but got {page}")

    def stored_width(self, columns: int) -> int:
        """Elements of the page's dtype that ``columns`` key or value columns of a token take: themselves for the
        model dtype; for a quantized cache a byte each (half a byte for int4) plus a float32 scale per KV head
        (fdc_ops.ops.cache_width)."""
        if self.cache_dtype is None:
            return columns
        offsets = torch.tensor([0] + [columns] * self.num_kv_heads, dtype=torch.int32)  # H_kv heads, these columns
        return ops.cache_width(offsets, self.cache_dtype)

    def page_bytes_per_token(self) -> int:
        """Bytes a token takes in this layer's pages (its K and V columns as declared, scales included)."""
        columns = self.stored_width(self.page_key_width) + self.stored_width(self.page_width - self.page_key_width)
        return columns * self.kv_cache_torch_dtype.itemsize

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        """One "head" of ``page_key_width`` key and ``page_width - page_key_width`` value columns: on one rank
        exactly the layer's ``k_width`` and ``v_width``, so a page is exactly ``block_size * (k_width + v_width)``
        elements; quantized, one byte each (int4: half) plus the K and V rows' float32 scales per KV head
        (:meth:`stored_width`), so vLLM's capacity counts the real bytes. Layers of different widths get
        pages of different sizes in one KV cache group (vLLM's UniformTypeKVCacheSpecs: one block table, each
        layer's pages its own size), so no layer is padded.

        With tensor parallelism vLLM requires a layer's spec to be the same on every rank (get_kv_cache_configs
        asserts it), so every rank declares the layer's widest rank share, and a rank with narrower heads leaves
        the last ``page_width - k_width - v_width`` columns of its pages unused (the backend reads the first
        ``k_width`` columns as K, the next ``v_width`` as V).

        A sliding-window layer's spec is vLLM's SlidingWindowSpec (same pages), so vLLM frees the pages that fall
        wholly behind the window of every request and admits requests by what their windows hold; the ops never
        read those pages or their block-table entries."""
        shape = dict(block_size=vllm_config.cache_config.block_size, num_kv_heads=1,
                     head_size=self.stored_width(self.page_key_width),
                     head_size_v=self.stored_width(self.page_width - self.page_key_width),
                     dtype=self.kv_cache_torch_dtype)
        if self.sliding_window is not None:
            return SlidingWindowSpec(**shape, sliding_window=self.sliding_window)
        return FullAttentionSpec(**shape)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output_shape=None,
                output_dtype=None) -> torch.Tensor:
        """query: (T, H * D) post-RoPE; key: (T, H_kv * D) post-RoPE (FDC) or (T, k_width) latent (Palu); value:
        (T, v_width). Returns (T, G * v_width)."""
        output = torch.empty((query.shape[0], self.group * self.v_width), dtype=query.dtype, device=query.device)
        if self.use_direct_call:
            unified_attention_with_output(query, key, value, output, self.layer_name)
        else:
            torch.ops.vllm.unified_attention_with_output(query, key, value, output,
                                                         _encode_layer_name(self.layer_name))
        return output


class FDCPagedAttention(CompressedPagedAttention):
    """Attention of one decoder layer over FDC-compressed heads.

    Takes post-RoPE queries ``(T, H * D)`` and keys ``(T, H_kv * D)`` (full width: the rotation runs inside the
    backend's op, so compiled graphs see only fixed widths) and compressed values ``(T, v_width)``; returns the
    compressed attention output ``(T, G * v_width)`` that the folded output projection W_O' consumes.

    rotation: ``(H_kv, D, max qk dim)`` truncated rotations R (a buffer, in the model dtype); qk_offsets: the
    layer's qk widths, which are also the cached key widths. The rest as CompressedPagedAttention."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, rotation: torch.Tensor,
                 qk_offsets: torch.Tensor, v_offsets: torch.Tensor, cache_config: CacheConfig | None, prefix: str,
                 page: tuple[int, int] | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, cache_dtype: torch.dtype | None = None):
        if rotation.shape[:2] != (num_kv_heads, head_size) or rotation.shape[2] < int((qk_offsets.diff()).max()):
            raise ValueError(f"fdc_ops.vllm: rotation must have shape ({num_kv_heads}, {head_size}, >= max qk dim) "
                             f"but got {tuple(rotation.shape)}")
        super().__init__(num_heads, head_size, scale, num_kv_heads, qk_offsets, v_offsets, cache_config, prefix,
                         page, sliding_window, FDCAttentionBackend, logits_soft_cap, cache_dtype)
        self.register_buffer("rotation", rotation.contiguous(), persistent=False)
        self.qk_offsets = qk_offsets  # the attention's key widths: the cached ones


class PaluPagedAttention(CompressedPagedAttention):
    """Attention of one decoder layer under the Palu baseline: the cache holds each token's pre-RoPE key latent
    (``k_offsets``: its per-KV-head widths) and its compressed values; every step the backend rebuilds the full keys
    of the tokens its queries see (:meth:`rebuild_keys`) and attends them at full width.

    Takes post-RoPE queries ``(T, H * D)``, key latents ``(T, k_width)`` and compressed values ``(T, v_width)``;
    returns ``(T, G * v_width)``. key_up: ``(k_width, H_kv * D)`` block-diagonal up-projection (a buffer, in the
    model dtype; fdc_ops.artifact.key_up_projection); k_norm: the family's per-head key norm (Qwen3) or None;
    rotary_emb: the layer's vLLM RoPE module. Both modules belong to the attention module that owns this layer, and
    are kept out of this layer's module tree (their weights load under the owner's names)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, key_up: torch.Tensor,
                 k_offsets: torch.Tensor, v_offsets: torch.Tensor, k_norm: nn.Module | None, rotary_emb: nn.Module,
                 cache_config: CacheConfig | None, prefix: str, page: tuple[int, int] | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        if tuple(key_up.shape) != (int(k_offsets[-1]), num_kv_heads * head_size):
            raise ValueError(f"fdc_ops.vllm: key_up must have shape ({int(k_offsets[-1])}, "
                             f"{num_kv_heads * head_size}) but got {tuple(key_up.shape)}")
        super().__init__(num_heads, head_size, scale, num_kv_heads, k_offsets, v_offsets, cache_config, prefix,
                         page, sliding_window, PaluAttentionBackend, logits_soft_cap)
        self.register_buffer("key_up", key_up.contiguous(), persistent=False)
        # the attention's key widths: full-width rebuilt keys
        self.qk_offsets = torch.arange(num_kv_heads + 1, dtype=torch.int32) * head_size
        self._key_modules = (k_norm, rotary_emb)  # a tuple: not submodules

    def rebuild_keys(self, latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """latent: (..., k_width) cached rows (any strides) at positions (...) int64 -> post-RoPE keys (..., H_kv * D),
        contiguous: up-projected, normalised per head (Qwen3), rotated by the family's RoPE at their positions."""
        k_norm, rotary_emb = self._key_modules
        keys = latent @ self.key_up  # (..., H_kv * D)
        rows = keys.view(-1, keys.shape[-1])
        if k_norm is not None:
            rows = k_norm(rows.view(rows.shape[0], self.num_kv_heads, self.head_size)).view(rows.shape)
        rows, _ = rotary_emb(positions.reshape(-1), rows, None)
        return rows.view(keys.shape)
