"""Compressed attention modules and their packed KV cache (docs/design.md section 5), for Hugging Face decoder layers.

``FDCAttention`` (the method): queries and keys get the family's RoPE and are rotated and truncated per KV head in
one pass (``rope_rotate_compress``); values come out of the folded ``A_V`` already compressed; attention runs on the
packed widths (``prefill_attention`` for prompts, ``decode_attention`` for one new token per request); the c-wide
outputs feed the folded output projection ``W_O'``. ``PaluAttention`` (the baseline): keys are cached as a low-rank
latent before RoPE, reconstructed and rotated at every attention call, then attended at full width; values as in FDC.
Both keep their cache in ``CompressedKVLayer``: packed rows of exactly the allocated widths, real memory savings.

Padding. Each request's cache holds only its real tokens (compacted), so left-padded batches cost nothing for their
padding and the ops see per-request lengths. The padding mask comes from the decoder's ``attention_mask`` argument
(recorded by a hook that :func:`fdc_ops.hf.compress` installs); queries at padded positions output zeros.
"""

from __future__ import annotations

import inspect
import sys

import torch
from torch import nn

from .. import eviction as evictions
from .. import ops
from .compat import cache_argument

try:  # the layer class of transformers' DynamicCache; subclassing it keeps every Cache method generate() calls working
    from transformers.cache_utils import DynamicLayer, StaticLayer
except ImportError:  # pragma: no cover - transformers is a dependency of the model side
    DynamicLayer = StaticLayer = object

INITIAL_CAPACITY = 64  # tokens per request allocated on first use; capacity doubles from there (amortised O(1) appends)


class CallRows:
    """Where one decoder call's real tokens are, shared by all its layers. ``valid``: (B, S) bool, or None when every
    token is real (no padding: rows are then plain reshapes, no boolean gathers); ``counts``: (B,) int32 real tokens
    per request, on the device; ``host_counts``: the same as a list; ``cu``: (B + 1,) int32 prefix sums of counts."""

    def __init__(self, valid: torch.Tensor | None, counts: torch.Tensor, host_counts: list[int]):
        self.valid, self.counts, self.host_counts = valid, counts, host_counts
        self.cu = ops.prefix_sums(counts)
        self._rope: tuple | None = None  # (cos, sin, dtype, (cos rows, sin rows)) of the call seen last

    def rope_rows(self, position_embeddings, batch: int, length: int, dtype: torch.dtype):
        """The decoder's RoPE tables ((B or 1, S, rotary_dim) cos and sin) at the real tokens, as (T, rotary_dim)
        of ``dtype``: computed by the call's first layer and reused by the others, which get the same tensors (6 ops
        per layer, 4 us, before)."""
        cos, sin = position_embeddings
        seen = self._rope
        if seen is None or seen[0] is not cos or seen[1] is not sin or seen[2] != dtype:
            rows = tuple(self.take(t.expand(batch, length, -1)).to(dtype) for t in (cos, sin))
            seen = self._rope = (cos, sin, dtype, rows)
        return seen[3]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, ...) -> (T, ...): the real tokens' rows, request after request."""
        return x.reshape(-1, *x.shape[2:]) if self.valid is None else x[self.valid]

    def scatter(self, rows: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """(T, W) -> (B, S, W), zeros at padded positions."""
        if self.valid is None:
            return rows.view(batch, length, rows.shape[1])
        out = rows.new_zeros(batch, length, rows.shape[1])
        out[self.valid] = rows
        return out


class PaddingState:
    """The decoder call's 2-D attention mask (B, past + new) or None, shared by the compressed modules of a model."""

    def __init__(self):
        self.mask: torch.Tensor | None = None
        self._rows: tuple | None = None  # (mask, batch, new_tokens, device, CallRows) of the call seen last

    def valid(self, batch: int, new_tokens: int, device: torch.device) -> torch.Tensor:
        """(B, new_tokens) bool: which of the call's new tokens are real (not padding)."""
        if self.mask is None:
            return torch.ones(batch, new_tokens, dtype=torch.bool, device=device)
        if self.mask.dim() != 2:
            raise NotImplementedError("fdc_ops.hf.modules: compressed attention takes a 2-D attention_mask "
                                      f"(batch, length) of 0/1, got shape {tuple(self.mask.shape)}")
        return self.mask[:, -new_tokens:].to(device=device, dtype=torch.bool)

    def static_valid(self, batch: int, new_tokens: int, past: torch.Tensor, mask_offset: int) -> torch.Tensor | None:
        """(B, new_tokens) bool, which of the call's new tokens are real, or None when all are; for a static cache,
        read without any host synchronisation. past: () int64, positions before the call; mask_offset: the position
        of the first key column of the masks built for the layer (a sliding-window ring's, once it is full). Besides
        the 2-D mask, takes the 4-D one that generate() builds for a static cache ((B, 1 or heads, new_tokens, key
        columns), bool or additive float; per layer type in a dict for some families): a token is real where it may
        attend to itself."""
        mask = self.mask
        if isinstance(mask, dict):  # one mask per layer type (Qwen2, Gemma); the full-attention one starts at 0
            if "full_attention" in mask:
                mask, mask_offset = mask["full_attention"], 0
            else:
                mask = mask.get("sliding_attention")
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 4):
            raise NotImplementedError("fdc_ops.hf.modules: with a static cache, compressed attention takes a 2-D "
                                      "(batch, length) or 4-D (batch, heads, new tokens, cache length) attention "
                                      f"mask, got {type(mask).__name__} {tuple(getattr(mask, 'shape', ()))}")
        if mask.dim() == 2:
            return mask[:, -new_tokens:].to(device=past.device, dtype=torch.bool)
        queries = torch.arange(new_tokens, device=mask.device)
        own = mask[:, 0, queries, past.to(mask.device) - mask_offset + queries]  # (B, new_tokens): own keys
        return (own if own.dtype == torch.bool else own == 0).to(past.device)

    def rows(self, batch: int, new_tokens: int, device: torch.device) -> CallRows:
        """The call's CallRows, computed by its first layer (one host read of the mask per call, not per layer) and
        reused by the others: the hook sets a new mask object for every decoder call."""
        seen = self._rows
        if seen is not None and seen[0] is self.mask and seen[1:4] == (batch, new_tokens, device):
            return seen[4]
        valid = self.valid(batch, new_tokens, device)
        if self.mask is None or bool(valid.all()):
            host = [new_tokens] * batch
            rows = CallRows(None, torch.tensor(host, dtype=torch.int32, device=device), host)
        else:
            counts = valid.sum(1, dtype=torch.int32)
            rows = CallRows(valid, counts, counts.tolist())
        self._rows = (self.mask, batch, new_tokens, device, rows)
        return rows


class CompressedKVLayer(DynamicLayer):
    """One layer's cache: packed K rows ``(B, capacity, k_width)`` and V rows ``(B, capacity, v_width)``, each
    request's real tokens first (``lengths``), in the packed head layout of the ops. It stands in for a DynamicLayer
    inside a transformers cache: ``get_seq_length`` counts positions (padding included) as transformers expects,
    beam search reorders it, and ``update`` (full-width K/V) is refused.

    A sliding-window layer (``window_left`` >= 0) drops the rows no later query can see whenever its buffers are
    full, instead of growing them: its memory stops growing with the context (at most about twice the window plus
    the longest call's rows), and a request's row i then holds its token ``first_positions[b] + i``.

    Eviction (``evict``) keeps a chosen subset of each request's rows, compacted to the front (one choice for all KV
    heads, or each head its own, the same count); from then on the layer records the positions of the rows it kept
    (``kept_positions``, per KV head after a per-head eviction; rows appended later follow each request's last
    token), which Palu's key rebuild rotates by, and how many tokens each request has lost (``evicted``)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, k_offsets: torch.Tensor, v_offsets: torch.Tensor, window_left: int = -1,
                 kv_dtype: torch.dtype | None = None):
        super().__init__()
        self.k_offsets, self.v_offsets = k_offsets, v_offsets  # (H_kv + 1,) int32 CPU
        self.window_left = window_left
        self.kv_dtype = kv_dtype  # a quantized cache's dtype (ops.QUANTIZED_CACHE_DTYPES); None: the activations'
        self.k_cache: torch.Tensor | None = None  # (B, capacity, ops.cache_width(k_offsets, dtype))
        self.v_cache: torch.Tensor | None = None  # (B, capacity, ops.cache_width(v_offsets, dtype))
        self.lengths: torch.Tensor | None = None  # (B,) int32: real tokens cached per request
        self.host_lengths: list[int] = []  # the same on the host, so appends read nothing back from the device
        self.first_positions: torch.Tensor | None = None  # (B,) int64: the token in row 0 (rows dropped before it)
        self.host_first_positions: list[int] = []
        # (B, most kept) int64 once rows were evicted: their tokens ((B, H_kv, most kept) after a per-head eviction)
        self.kept_positions: torch.Tensor | None = None
        self.kept_rows: torch.Tensor | None = None  # (B,) int64: rows kept by the last eviction (the first ones)
        self.evicted: torch.Tensor | None = None  # (B,) int64: tokens evicted per request
        self.positions = 0  # positions seen, padding included (what transformers calls the sequence length)
        self.keys = self.values = None
        self.is_initialized = True

    def lazy_initialization(self, *args, **kwargs) -> None:
        raise RuntimeError("fdc_ops.hf.modules: a compressed cache layer is filled by the compressed attention module "
                           "only")

    def update(self, *args, **kwargs):
        raise RuntimeError("fdc_ops.hf.modules: this cache holds compressed K/V; full-width update() is not possible")

    def append(self, k_rows: torch.Tensor, v_rows: torch.Tensor, rows: CallRows, new_positions: int) -> None:
        """Writes each request's new rows after its cached ones. k_rows: (T, k_width), v_rows: (T, v_width), requests'
        rows back to back, as ``rows`` counts them; new_positions: the call's sequence length."""
        batch = len(rows.host_counts)
        if self.k_cache is None:
            self.lengths = torch.zeros(batch, dtype=torch.int32, device=k_rows.device)
            self.host_lengths = [0] * batch
            self.first_positions = torch.zeros(batch, dtype=torch.int64, device=k_rows.device)
            self.host_first_positions = [0] * batch
            self.evicted = torch.zeros(batch, dtype=torch.int64, device=k_rows.device)
            self._allocate(batch, max([INITIAL_CAPACITY, *rows.host_counts]), self.kv_dtype or k_rows.dtype,
                           k_rows.device)
        elif batch != self.k_cache.shape[0]:
            raise ValueError(f"fdc_ops.hf.modules: the cache holds {self.k_cache.shape[0]} requests, the call has "
                             f"{batch}")
        grown = [length + count for length, count in zip(self.host_lengths, rows.host_counts)]
        needed = max(grown, default=0)
        if needed > self.k_cache.shape[1] and self.window_left >= 0:
            self._drop_unseen_rows()
            grown = [length + count for length, count in zip(self.host_lengths, rows.host_counts)]
            needed = max(grown, default=0)
        if needed > self.k_cache.shape[1]:
            old_k, old_v = self.k_cache, self.v_cache
            self._allocate(batch, max(needed, 2 * old_k.shape[1]), old_k.dtype, old_k.device)
            self.k_cache[:, : old_k.shape[1]] = old_k
            self.v_cache[:, : old_v.shape[1]] = old_v
        ops.append_kv(self.k_cache, self.v_cache, k_rows, v_rows, rows.cu, self.lengths, self.k_offsets,
                      self.v_offsets)
        self.lengths += rows.counts
        self.host_lengths = grown
        self.positions += new_positions

    def _drop_unseen_rows(self) -> None:
        """Moves each request's rows that a later query can still see (the last ``window_left``: the next query
        comes at the request's current length) to the front of its buffers, dropping the older ones. A copy of at
        most the window per request, once per filling of the buffers."""
        dead = [max(0, length - self.window_left) for length in self.host_lengths]
        if not any(dead):
            return
        kept = [length - gone for length, gone in zip(self.host_lengths, dead)]
        device = self.k_cache.device
        first = torch.tensor(dead, dtype=torch.int64, device=device)
        index = (first[:, None] + torch.arange(max(kept), device=device)[None, :]).clamp_max(self.k_cache.shape[1] - 1)
        for name in ("k_cache", "v_cache"):
            buffer = getattr(self, name)
            if buffer.dtype in ops.QUANTIZED_CACHE_DTYPES:
                buffer = buffer.view(torch.uint8)  # rows moved as bytes (torch gathers no float8), scales with them
            moved = torch.gather(buffer, 1, index[:, :, None].expand(-1, -1, buffer.shape[2]))  # (B, max kept, W)
            buffer[:, : moved.shape[1]] = moved
        self.lengths -= first.to(torch.int32)
        self.host_lengths = kept
        self.first_positions += first
        self.host_first_positions = [position + gone for position, gone in zip(self.host_first_positions, dead)]

    def seen_tokens(self) -> torch.Tensor:
        """(B,) int64: each request's real tokens so far, dropped and evicted ones included (the next one's
        position)."""
        return self.first_positions + self.evicted + self.lengths

    def positions_of_rows(self, rows: int) -> torch.Tensor:
        """(B, rows) int64, or (B, H_kv, rows) after a per-head eviction: the token position each of the first
        ``rows`` rows holds (in each KV head's columns): consecutive from the request's first kept one, except the
        rows an eviction kept (recorded; the rows after them are consecutive again, since they were appended after
        it)."""
        consecutive = torch.arange(rows, device=self.first_positions.device)[None, :] + self.first_positions[:, None]
        if self.kept_positions is None:
            return consecutive
        recorded = self.kept_positions[..., :rows]
        if recorded.shape[-1] < rows:
            recorded = torch.nn.functional.pad(recorded, (0, rows - recorded.shape[-1]))
        kept = torch.arange(rows, device=recorded.device)[None, :] < self.kept_rows[:, None]  # (B, rows)
        later = consecutive + self.evicted[:, None]
        if recorded.dim() == 3:
            kept, later = kept[:, None], later[:, None]
        return torch.where(kept, recorded, later)

    def evict(self, index: torch.Tensor, kept: list[int]) -> None:
        """Keeps request b's rows index[b, :kept[b]] (increasing) as its first rows and drops the others
        (fdc_ops.eviction.compact_kv: checked whole before anything is written). index: (B, max kept) int64, or
        (B, H_kv, max kept) for each KV head's own rows (the same count per head)."""
        if self.window_left >= 0:
            raise NotImplementedError("fdc_ops.hf.modules: eviction on a sliding-window layer is not supported (its "
                                      "rows past the window are dropped by position)")
        positions = self.positions_of_rows(max(self.host_lengths))
        if index.dim() == 3 and positions.dim() == 2:
            positions = positions[:, None].expand(-1, index.shape[1], -1)
        elif index.dim() == 2 and positions.dim() == 3:
            index = index[:, None].expand(-1, positions.shape[1], -1)  # kept per head already: stays per head
        positions = positions.gather(-1, index)  # (B, [H_kv,] max kept), read first
        before = self.lengths.clone()
        columns = dict(qk_offsets=self.k_offsets, v_offsets=self.v_offsets) if index.dim() == 3 else {}
        evictions.compact_kv(self.k_cache, self.v_cache, self.lengths, index, kept, **columns)
        self.kept_positions, self.kept_rows = positions, self.lengths.to(torch.int64)
        self.evicted += (before - self.lengths).to(torch.int64)
        self.host_lengths = list(kept)

    def _allocate(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        # empty, not zeros: only rows below `lengths` are ever read, and zeroing would touch every page up front
        for name, offsets in (("k_cache", self.k_offsets), ("v_cache", self.v_offsets)):
            width = ops.cache_width(offsets, dtype)
            setattr(self, name, torch.empty(batch, capacity, width, dtype=dtype, device=device))

    def float_rows(self, cache: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows (..., stored width) of this layer's K (``offsets`` = k_offsets) or V cache as ``dtype`` (..., width):
        themselves for a float cache, code x scale per KV head for a quantized one (ops.dequantize_rows: what a
        prefill over cached rows reads, as prefill_attention takes float keys)."""
        if cache.dtype not in ops.QUANTIZED_CACHE_DTYPES:
            return cache
        return ops.dequantize_rows(cache, offsets, dtype)

    def nbytes(self, allocated: bool = False) -> int:
        """Bytes of the cached rows (``allocated``: of the buffers, spare capacity included)."""
        if self.k_cache is None:
            return 0
        if allocated:
            return self.k_cache.nbytes + self.v_cache.nbytes
        width = self.k_cache.shape[-1] + self.v_cache.shape[-1]  # a quantized cache's scales included
        return self.cached_tokens() * width * self.k_cache.element_size()

    def cached_tokens(self) -> int:
        """Real tokens cached, over all requests."""
        return sum(self.host_lengths)

    def get_seq_length(self, *args) -> int:
        return self.positions

    def get_max_cache_shape(self) -> int:
        return -1

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.k_cache = self.v_cache = self.lengths = self.first_positions = None
        self.kept_positions = self.kept_rows = self.evicted = None
        self.host_lengths = []
        self.host_first_positions = []
        self.positions = 0

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.k_cache is not None:
            indices = indices.to(self.k_cache.device)
            self.k_cache, self.v_cache = self.k_cache[indices], self.v_cache[indices]
            self.lengths, self.first_positions = self.lengths[indices], self.first_positions[indices]
            self.evicted = self.evicted[indices]
            if self.kept_positions is not None:
                self.kept_positions, self.kept_rows = self.kept_positions[indices], self.kept_rows[indices]
            chosen = indices.tolist()
            self.host_lengths = [self.host_lengths[i] for i in chosen]
            self.host_first_positions = [self.host_first_positions[i] for i in chosen]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.k_cache is not None:
            self.k_cache = self.k_cache.repeat_interleave(repeats, dim=0)
            self.v_cache = self.v_cache.repeat_interleave(repeats, dim=0)
            self.lengths = self.lengths.repeat_interleave(repeats, dim=0)
            self.first_positions = self.first_positions.repeat_interleave(repeats, dim=0)
            self.evicted = self.evicted.repeat_interleave(repeats, dim=0)
            if self.kept_positions is not None:
                self.kept_positions = self.kept_positions.repeat_interleave(repeats, dim=0)
                self.kept_rows = self.kept_rows.repeat_interleave(repeats, dim=0)
            self.host_lengths = [length for length in self.host_lengths for _ in range(repeats)]
            self.host_first_positions = [first for first in self.host_first_positions for _ in range(repeats)]

    def crop(self, *args, **kwargs) -> None:
        raise NotImplementedError("fdc_ops.hf.modules: cropping a compressed cache (assisted decoding) is not "
                                  "supported")


class StaticCompressedKVLayer(CompressedKVLayer):
    """A compressed layer of fixed capacity, standing in for an empty ``StaticLayer`` of transformers' ``StaticCache``
    (``generate(..., cache_implementation="static")``, or a StaticCache passed in). Its buffers are allocated once,
    ``max_cache_len`` rows per request, and only written in place; the real-token counts (``lengths``) and the
    positions seen (``cumulative_length``, padding included) are device tensors updated in place. So a decode step
    reads nothing back to the host and changes no Python state, and ``torch.compile`` captures the whole step as one
    graph that every later step reuses (docs/design.md section 5, "Compiling")."""

    is_compileable = True

    def __init__(self, k_offsets: torch.Tensor, v_offsets: torch.Tensor, max_cache_len: int,
                 kv_dtype: torch.dtype | None = None):
        super().__init__(k_offsets, v_offsets, kv_dtype=kv_dtype)
        self.max_cache_len = max_cache_len
        self.cumulative_length: torch.Tensor | None = None  # () int64: positions seen, padding included
        # Whether a call has written rows since allocation or reset: a host flag that changes at the first call
        # only, so the prompt's graph and the decode step's graph are each compiled once.
        self.filled = False

    def allocate(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        """Buffers for ``batch`` requests of ``max_cache_len`` rows, in the quantized kv_dtype when the layer has one,
        else in ``dtype`` (the activations')."""
        self._allocate(batch, self.max_cache_len, self.kv_dtype or dtype, device)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.cumulative_length = torch.zeros((), dtype=torch.int64, device=device)
        if not torch.compiler.is_compiling():  # fixed addresses: compiled graphs (and CUDA graphs) may keep them
            for buffer in (self.k_cache, self.v_cache, self.lengths, self.cumulative_length):
                torch._dynamo.mark_static_address(buffer)

    def _take_batch(self, batch: int, k_rows: torch.Tensor) -> None:
        """Allocates the buffers for ``batch`` requests at the first call (k_rows: the call's rows, whose dtype and
        device they take), and refuses a call of another batch size after."""
        if self.k_cache is None:
            self.allocate(batch, k_rows.dtype, k_rows.device)
        elif batch != self.k_cache.shape[0]:
            raise ValueError(f"fdc_ops.hf.modules: the static cache holds {self.k_cache.shape[0]} requests, the call "
                             f"has {batch}")

    def append_rows(self, k_rows: torch.Tensor, v_rows: torch.Tensor, cu_seqlens: torch.Tensor,
                    counts: torch.Tensor, new_positions: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Writes each request's new rows after its cached ones. k_rows: (T, k_width), v_rows: (T, v_width), with
        request b's real rows at ``cu_seqlens[b]:cu_seqlens[b+1]`` ((B + 1,) int32) and any rows after the last
        ignored; counts: (B,) int32 real rows per request; new_positions: the call's sequence length. Returns the
        rows the call's queries attend: K (B, rows, k width) and V (B, rows, v width) caches, request b's first
        ``seen[b]`` rows ((B,) int32), its cached ones and then the call's, in token order (one-token calls: in any
        order)."""
        self._take_batch(counts.shape[0], k_rows)
        if k_rows.device.type != "cpu":  # the CPU op checks the capacity itself (and writes nothing past it)
            torch._assert_async((self.lengths + counts <= self.max_cache_len).all(),
                                f"fdc_ops.hf.modules: a request outgrows the static cache's {self.max_cache_len} rows")
        ops.append_kv(self.k_cache, self.v_cache, k_rows, v_rows, cu_seqlens, self.lengths, self.k_offsets,
                      self.v_offsets)
        self.lengths.add_(counts)
        self.cumulative_length.add_(new_positions)
        self.filled = True
        return self.k_cache, self.v_cache, self.lengths

    def mask_offset(self) -> int:
        """The position of the first key column in the masks built for this layer (get_mask_sizes)."""
        return 0

    def append(self, *args, **kwargs) -> None:
        raise RuntimeError("fdc_ops.hf.modules: a static compressed cache layer is written by append_rows")

    def cached_tokens(self) -> int:
        return int(self.lengths.sum()) if self.lengths is not None else 0

    def get_seq_length(self, *args):
        return self.cumulative_length if self.k_cache is not None else 0

    def get_mask_sizes(self, *args) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.k_cache is not None:  # in place: compiled graphs keep the buffers' addresses
            self.lengths.zero_()
            self.cumulative_length.zero_()
        self.filled = False

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.k_cache is not None:
            if indices.shape[0] != self.k_cache.shape[0]:
                raise NotImplementedError("fdc_ops.hf.modules: a static compressed cache keeps its batch size")
            indices = indices.to(self.k_cache.device)
            for buffer in (self.k_cache, self.v_cache, self.lengths):
                buffer.copy_(buffer[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.k_cache is not None and repeats != 1:
            raise NotImplementedError("fdc_ops.hf.modules: a static compressed cache keeps its batch size")


class StaticWindowCompressedKVLayer(StaticCompressedKVLayer):
    """A static compressed layer for a sliding-window layer whose capacity is its window (standing in for
    transformers' ``StaticSlidingWindowLayer`` when the window is shorter than the cache): a ring of ``window`` rows
    per request, position p of a request in row ``p % window``, so its memory is the window's whatever the context.
    ``lengths`` counts each request's real tokens seen (it passes the window); the ring holds the last
    ``min(lengths, window)``.

    A one-token step writes its row over the one its window has just left and attends the whole ring in place
    (attention over a set of keys does not depend on their order, and every row of the ring is inside the window).
    A call of several tokens reads the ring out in token order followed by its own rows, where its queries attend
    with the window applied, and writes the last ``window`` rows of that back into the ring. Only fixed-shape tensor
    operations, like the layer it extends; the mask sizes (transformers' own formula, so generate() builds the masks
    it builds for its own sliding layers) come from the positions seen kept as a host integer too, as transformers'
    layer keeps them."""

    is_sliding = True

    def __init__(self, k_offsets: torch.Tensor, v_offsets: torch.Tensor, window: int,
                 kv_dtype: torch.dtype | None = None):
        super().__init__(k_offsets, v_offsets, window, kv_dtype)
        self.host_positions = 0  # positions seen, padding included: what the mask sizes are computed from

    def append_rows(self, k_rows: torch.Tensor, v_rows: torch.Tensor, cu_seqlens: torch.Tensor,
                    counts: torch.Tensor, new_positions: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, window = counts.shape[0], self.max_cache_len
        self._take_batch(batch, k_rows)
        self.host_positions += new_positions
        self.cumulative_length.add_(new_positions)
        self.filled = True
        if new_positions == 1:  # each request's row (if real) over the one its window has left
            ops.append_kv(self.k_cache, self.v_cache, k_rows, v_rows, cu_seqlens, self.lengths % window,
                          self.k_offsets, self.v_offsets)
            self.lengths.add_(counts)
            return self.k_cache, self.v_cache, self.lengths.clamp_max(window)
        # The call's rows in the cache's format (quantized as append_kv writes them), request b's at [b, :counts[b]].
        staged_k = torch.empty(batch, new_positions, self.k_cache.shape[2], dtype=self.k_cache.dtype,
                               device=self.k_cache.device)
        staged_v = torch.empty(batch, new_positions, self.v_cache.shape[2], dtype=self.v_cache.dtype,
                               device=self.v_cache.device)
        ops.append_kv(staged_k, staged_v, k_rows, v_rows, cu_seqlens, torch.zeros_like(self.lengths),
                      self.k_offsets, self.v_offsets)
        held = self.lengths.clamp_max(window).to(torch.int64)  # (B,) rows in the ring
        oldest = self.lengths.to(torch.int64) - held  # (B,) the position of the oldest
        column = torch.arange(window + new_positions, device=held.device)[None, :]  # rows in token order
        # Row j in token order: ring row (oldest + j) % window while j < held, then staged row j - held.
        source = torch.where(column < held[:, None], (oldest[:, None] + column) % window,
                             window + (column - held[:, None]).clamp(0, new_positions - 1))  # (B, window + S)
        seen_length = held + counts  # (B,) rows the call's queries may see, the call's own included
        # Ring row s next holds the newest position q = s (mod window) below `end`, row q - oldest in token order
        # (none yet where q < 0: such a row keeps whatever it held, and nothing reads it).
        end = self.lengths.to(torch.int64) + counts  # (B,) positions after the call
        ring_row = torch.arange(window, device=held.device)[None, :]
        newest = end[:, None] - 1 - (end[:, None] - 1 - ring_row) % window  # (B, window)
        outputs = []
        for name, staged in (("k_cache", staged_k), ("v_cache", staged_v)):
            ring = getattr(self, name)
            as_bytes = ring.dtype in ops.QUANTIZED_CACHE_DTYPES  # moved as bytes (torch gathers no float8)
            ring_data = ring.view(torch.uint8) if as_bytes else ring
            both = torch.cat((ring_data, staged.view(torch.uint8) if as_bytes else staged), 1)
            in_order = torch.gather(both, 1, source[:, :, None].expand(-1, -1, both.shape[2]))  # (B, window + S, W)
            kept = torch.gather(in_order, 1, (newest - oldest[:, None]).clamp_min(0)[:, :, None].expand(
                -1, -1, both.shape[2]))  # (B, window, W)
            ring_data.copy_(torch.where((newest >= 0)[:, :, None], kept, ring_data))
            outputs.append(in_order.view(ring.dtype) if as_bytes else in_order)
        self.lengths.add_(counts)
        return outputs[0], outputs[1], seen_length.to(torch.int32)

    def cached_tokens(self) -> int:
        return int(self.lengths.clamp_max(self.max_cache_len).sum()) if self.lengths is not None else 0

    def mask_offset(self) -> int:
        """The position of the first key column in the masks built for this layer's type (get_mask_sizes)."""
        return max(self.host_positions - self.max_cache_len + 1, 0)

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        window, seen = self.max_cache_len, self.host_positions
        if seen >= window:
            return window + query_length - 1, self.mask_offset()
        return max(window, seen + query_length), 0

    def reset(self) -> None:
        super().reset()
        self.host_positions = 0


def _cache_layer(cache, layer: int, k_offsets: torch.Tensor, v_offsets: torch.Tensor, window_left: int = -1,
                 kv_dtype: torch.dtype | None = None) -> CompressedKVLayer:
    """The compressed layer ``layer`` of a transformers cache, installed in place of an empty layer the first time
    (generate() creates a DynamicCache, or a StaticCache for ``cache_implementation="static"``; the compressed modules
    take over its layers: a StaticLayer becomes a StaticCompressedKVLayer of the same capacity, or a
    StaticWindowCompressedKVLayer for a sliding-window one as long as its window; any dynamic layer, sliding-window
    ones included, a CompressedKVLayer that drops what the layer's window no longer sees)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"fdc_ops.hf.modules: the cache must be a transformers Cache with layers, got {type(cache)}")
    while len(layers) <= layer:
        layers.append(CompressedKVLayer(k_offsets, v_offsets, window_left, kv_dtype))
    current = layers[layer]
    if isinstance(current, CompressedKVLayer):
        return current
    if current.get_seq_length() != 0:
        raise ValueError(f"fdc_ops.hf.modules: layer {layer} of the cache already holds uncompressed keys and values")
    if isinstance(current, StaticLayer):
        # transformers sizes a sliding layer at min(window, max_cache_len): a ring when that is the window, else
        # the whole sequence fits and its rows stay in order (the ops apply the window)
        ring = current.is_sliding and window_left >= 0 and current.max_cache_len == window_left + 1
        kind = StaticWindowCompressedKVLayer if ring else StaticCompressedKVLayer
        layers[layer] = kind(k_offsets, v_offsets, current.max_cache_len, kv_dtype)
    else:
        layers[layer] = CompressedKVLayer(k_offsets, v_offsets, window_left, kv_dtype)
    return layers[layer]


class _CompressedAttentionBase(nn.Module):
    """What FDC and Palu share: projections, per-head norms (Qwen3), RoPE, padding, the V path and the cache."""

    def __init__(self, original: nn.Module, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight, q_bias, k_weight, k_bias, value_weight, output_weight, output_bias,
                 v_offsets: torch.Tensor, padding: PaddingState, window_left: int = -1, softcap: float = 0.0):
        super().__init__()
        self.layer_idx = layer
        self.window_left, self.softcap = window_left, softcap  # the ops' attention variants for this layer
        self.eviction: evictions.EvictionPolicy | None = None  # what a prompt keeps of its cache (compress sets it)
        self.kv_dtype: torch.dtype | None = None  # a quantized cache's dtype (compress sets it); None: the activations'
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scaling = getattr(original, "scaling", head_dim**-0.5)
        self.q_proj = _linear(q_weight, q_bias)  # (hidden) -> (H * D)
        self.k_proj = _linear(k_weight, k_bias)  # (hidden) -> (H_kv * D)
        self.v_proj = _linear(value_weight, None)  # A_V: (hidden) -> (sum v_dims), packed
        self.o_proj = _linear(output_weight, output_bias)  # W_O': (sum_h v_dims[kv(h)]) -> (hidden)
        self.q_norm = getattr(original, "q_norm", None)
        self.k_norm = getattr(original, "k_norm", None)
        self.v_offsets = v_offsets  # (H_kv + 1,) int32, stays on the CPU as the ops require (not a buffer)
        self._apply_rope = sys.modules[type(original).__module__].apply_rotary_pos_emb
        self._padding = padding
        self.original = [original]  # kept out of the module tree: fdc_ops.hf.restore puts it back

    def _heads(self, projection: nn.Module, norm, x: torch.Tensor, heads: int) -> torch.Tensor:
        y = projection(x).view(*x.shape[:2], heads, self.head_dim)  # (B, S, heads, D)
        return norm(y) if norm is not None else y



def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype,
                      device=weight.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


class FDCAttention(_CompressedAttentionBase):
    """FDC attention for one decoder layer (see the module docstring)."""

    def __init__(self, original: nn.Module, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight, q_bias, k_weight, k_bias, value_weight, output_weight, output_bias,
                 rotation: torch.Tensor, qk_offsets: torch.Tensor, v_offsets: torch.Tensor, padding: PaddingState,
                 window_left: int = -1, softcap: float = 0.0):
        """rotation: (H_kv, D, max qk dim) truncated R; qk_offsets, v_offsets: (H_kv + 1,) int32 CPU; window_left,
        softcap: the layer's sliding window (-1: none) and logit soft-cap (0: none), as the ops take them."""
        super().__init__(original, layer, num_heads, num_kv_heads, head_dim, q_weight, q_bias, k_weight, k_bias,
                         value_weight, output_weight, output_bias, v_offsets, padding, window_left, softcap)
        self.register_buffer("rotation", rotation.contiguous(), persistent=False)
        self.qk_offsets = qk_offsets  # CPU, not a buffer

    def cache_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.qk_offsets, self.v_offsets

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        """hidden_states: (B, S, hidden); the cache comes in ``kwargs`` under the name the transformers release
        uses (fdc_ops.hf.compat.cache_argument). Returns ((B, S, hidden), None)."""
        cache = cache_argument(kwargs, "fdc_ops.hf.modules.FDCAttention")
        layer = None if cache is None else _cache_layer(cache, self.layer_idx, *self.cache_offsets(),
                                                         self.window_left, self.kv_dtype)
        if isinstance(layer, StaticCompressedKVLayer):
            return self._static_forward(hidden_states, position_embeddings, layer), None
        B, S, _ = hidden_states.shape
        H, Hkv, G = self.num_heads, self.num_kv_heads, self.group
        rows = self._padding.rows(B, S, hidden_states.device)
        q = self._heads(self.q_proj, self.q_norm, hidden_states, H)  # (B, S, H, D)
        k = self._heads(self.k_proj, self.k_norm, hidden_states, Hkv)  # (B, S, H_kv, D)
        # The family's RoPE tables (B or 1, S, rotary_dim), per real token; RoPE and the rotation in one pass.
        cos, sin = rows.rope_rows(position_embeddings, B, S, q.dtype)  # (T, rotary_dim)
        rotation = self.rotation if self.rotation.dtype == q.dtype else self.rotation.to(q.dtype)
        q_rows = ops.rope_rotate_compress(rows.take(q), cos, sin, rotation, self.qk_offsets, G)
        k_rows = ops.rope_rotate_compress(rows.take(k), cos, sin, rotation, self.qk_offsets, 1)
        v_rows = self.v_proj(rows.take(hidden_states))  # (T, v_width)
        out = _attend(self, q_rows, k_rows, v_rows, rows, S, layer)
        return self.o_proj(rows.scatter(out, B, S)), None

    def _static_forward(self, hidden_states: torch.Tensor, position_embeddings,
                        layer: StaticCompressedKVLayer) -> torch.Tensor:
        """forward() over a static cache layer: only tensor operations of fixed shapes, no host reads, no Python
        state but the layer's ``filled`` flag, so torch.compile captures it whole. Every row of the call is
        projected, rotated and attended (padded ones included, their outputs then zeroed) instead of gathering the
        real ones, whose count is data; what needs the real rows back to back (append_kv, prefill_attention) gets
        them first by a fixed-size stable reordering, with the padded rows after the last ``cu_seqlens`` entry,
        where the ops ignore them. hidden_states: (B, S, hidden). Returns (B, S, hidden)."""
        B, S, _ = hidden_states.shape
        H, Hkv, G = self.num_heads, self.num_kv_heads, self.group
        if self.eviction is not None:
            raise NotImplementedError("fdc_ops.hf.modules.FDCAttention: eviction runs with the dynamic cache only "
                                      "(it compacts each request's rows, whose counts a static cache's compiled "
                                      "graph cannot follow)")
        if layer.k_cache is None:
            layer.allocate(B, hidden_states.dtype, hidden_states.device)
        past = layer.cumulative_length
        valid = self._padding.static_valid(B, S, past, layer.mask_offset())  # (B, S) bool, or None: all real
        q = self._heads(self.q_proj, self.q_norm, hidden_states, H).reshape(B * S, H, self.head_dim)
        k = self._heads(self.k_proj, self.k_norm, hidden_states, Hkv).reshape(B * S, Hkv, self.head_dim)
        cos, sin = (t.expand(B, S, -1).reshape(B * S, -1).to(q.dtype) for t in position_embeddings)
        rotation = self.rotation if self.rotation.dtype == q.dtype else self.rotation.to(q.dtype)
        # The packed widths are the offsets' values, which compiled graphs do not see: the cache's shape states them
        # (a quantized cache's rows end in 4 bytes of scale per KV head, and int4 codes take half a byte each).
        k_width = ops.data_width(layer.k_cache.shape[2], self.qk_offsets, layer.k_cache.dtype)
        q_rows = ops.rope_rotate_compress(q, cos, sin, rotation, self.qk_offsets, G, out_width=G * k_width)
        k_rows = ops.rope_rotate_compress(k, cos, sin, rotation, self.qk_offsets, 1, out_width=k_width)
        # q_rows: (B * S, G * k_width), k_rows: (B * S, k_width)
        v_rows = self.v_proj(hidden_states.reshape(B * S, -1))  # (B * S, v_width)
        if valid is None:
            order, counts = None, torch.full((B,), S, dtype=torch.int32, device=q.device)
        else:  # the real rows first, request after request, in order; then the padded ones
            order = torch.argsort((~valid).reshape(-1).to(torch.int8), stable=True)
            counts = valid.sum(1, dtype=torch.int32)
        cu = ops.prefix_sums(counts)
        first_call = not layer.filled
        k_new, v_new = (k_rows, v_rows) if order is None else (k_rows[order], v_rows[order])
        k_seen, v_seen, seen = layer.append_rows(k_new, v_new, cu, counts, S)
        # decode: one query per request, in request order; a one-token prompt into an empty quantized cache takes the
        # prefill below, which attends the call's own unquantized rows (as the dynamic layer's prompts do)
        if S == 1 and not (first_call and layer.kv_dtype is not None):
            out = ops.decode_attention(q_rows, k_seen, v_seen, seen, self.qk_offsets,
                                       self.v_offsets, G, self.scaling, window_left=self.window_left,
                                       softcap=self.softcap)  # (B, G * v_width)
            if valid is not None:
                out = torch.where(valid.reshape(B, 1), out, out.new_zeros(()))
        else:
            q_real = q_rows if order is None else q_rows[order]
            if first_call:  # a prompt into an empty cache: its keys are the call's own rows
                k_all, v_all, cu_k = k_new, v_new, cu
            else:  # every request's rows seen back to back (fixed size: all B * k_seen.shape[1] of them)
                cached = torch.arange(k_seen.shape[1], device=q.device)[None, :] < seen[:, None]
                gather = torch.argsort((~cached).reshape(-1).to(torch.int8), stable=True)
                k_all = layer.float_rows(_rows_at(k_seen, gather), self.qk_offsets, q_rows.dtype)
                v_all = layer.float_rows(_rows_at(v_seen, gather), self.v_offsets, q_rows.dtype)
                cu_k = ops.prefix_sums(seen)
            out = ops.prefill_attention(q_real, k_all, v_all, cu, cu_k, self.qk_offsets, self.v_offsets, G,
                                        self.scaling, True, window_left=self.window_left,
                                        softcap=self.softcap)  # (B * S, G * v_width): zeros past cu[-1]
            if order is not None:
                out = out[torch.argsort(order)]
        return self.o_proj(out.view(B, S, -1))


def _attend(module, q_rows, k_rows, v_rows, rows: CallRows, new_positions, layer: CompressedKVLayer | None,
            k_offsets=None, keys_from_cache=None):
    """Attention of the call's real queries over (cached +) new keys: decode_attention when every request brings one
    token to a cache layer (the module's, from _cache_layer; None without a cache), prefill_attention otherwise.
    Returns (T, G * v_width)."""
    k_offsets = module.qk_offsets if k_offsets is None else k_offsets
    scale, G = module.scaling, module.group
    variant = dict(window_left=module.window_left, softcap=module.softcap)
    if layer is None:
        return ops.prefill_attention(q_rows, k_rows, v_rows, rows.cu, rows.cu, k_offsets, module.v_offsets, G, scale,
                                     True, **variant)
    was_empty = not any(layer.host_lengths)
    layer.append(k_rows, v_rows, rows, new_positions)
    if keys_from_cache is not None:  # Palu: full-width keys rebuilt from the cached latent
        k_cache, v_cache = keys_from_cache(layer)
    else:
        k_cache, v_cache = layer.k_cache, layer.v_cache
    # a one-token prompt into an empty quantized cache attends its own unquantized rows below, as every prompt does
    if new_positions == 1 and all(count == 1 for count in rows.host_counts) and not (
            was_empty and layer.kv_dtype is not None):
        return ops.decode_attention(q_rows, k_cache, v_cache, layer.lengths, k_offsets, module.v_offsets, G, scale,
                                    **variant)
    cu_k = ops.prefix_sums(layer.lengths)
    if keys_from_cache is None and was_empty:  # a prompt into an empty cache: its keys are the call's own rows
        k_rows_all, v_rows_all = k_rows, v_rows
    elif len(layer.host_lengths) == 1:  # one request: its cached rows are a view, no copy (of a float cache)
        k_rows_all, v_rows_all = k_cache[0, : layer.host_lengths[0]], v_cache[0, : layer.host_lengths[0]]
    else:  # requests' cached rows gathered back to back, as prefill_attention takes them
        mask = torch.arange(k_cache.shape[1], device=rows.counts.device)[None, :] < layer.lengths[:, None]
        k_rows_all, v_rows_all = _rows_at(k_cache, mask.reshape(-1)), _rows_at(v_cache, mask.reshape(-1))
    k_rows_all = layer.float_rows(k_rows_all, k_offsets, q_rows.dtype)
    v_rows_all = layer.float_rows(v_rows_all, module.v_offsets, q_rows.dtype)
    out = ops.prefill_attention(q_rows, k_rows_all, v_rows_all, rows.cu, cu_k, k_offsets, module.v_offsets, G,
                                scale, True, **variant)
    if module.eviction is not None and was_empty:  # the prompt is processed: keep what its last queries attend to
        if k_cache.dtype in ops.QUANTIZED_CACHE_DTYPES:  # scored on its own unquantized rows, as it attended them
            longest = max(layer.host_lengths)
            k_cache = k_rows.new_zeros(len(layer.host_lengths), longest, k_rows.shape[1])  # (B, longest, k width)
            k_cache[torch.arange(longest, device=k_rows.device)[None, :] < layer.lengths[:, None]] = k_rows
        _evict(module, layer, q_rows, rows, k_cache, k_offsets)
    return out


def _rows_at(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (positions, or a (B * capacity,) mask) of a (B, capacity, width) cache's B * capacity rows; a
    quantized cache's are taken as bytes (torch indexes no float8 on the CPU)."""
    rows = cache.reshape(-1, cache.shape[2])
    if cache.dtype in ops.QUANTIZED_CACHE_DTYPES:
        return rows.view(torch.uint8)[index].view(cache.dtype)
    return rows[index]


def _evict(module, layer: CompressedKVLayer, q_rows, rows: CallRows, k_cache, k_offsets) -> None:
    """Scores every cached key of the layer by the attention of the prompt's last queries (fdc_ops.eviction), one
    selection per request for all KV heads (or per KV head: policy.per_head), and compacts the layer's rows. k_cache:
    (B, >= longest, k width) keys as attended (Palu: rebuilt at full width)."""
    policy = module.eviction
    longest = max(layer.host_lengths)
    scores = evictions.window_scores(q_rows, rows.cu, k_cache[:, :longest], layer.lengths, k_offsets, module.group,
                                     module.scaling, policy, module.softcap,
                                     policy.layer_seed(module.layer_idx))  # (B, H_kv, longest)
    if policy.per_head:  # each KV head its own tokens, the same count: one selection per (request, head)
        heads = scores.shape[1]
        index, kept = evictions.select_tokens(scores.flatten(0, 1), layer.lengths.repeat_interleave(heads), policy,
                                              [length for length in layer.host_lengths for _ in range(heads)])
        index, kept = index.view(len(layer.host_lengths), heads, -1), kept[::heads]
    else:
        index, kept = evictions.select_tokens(scores.sum(1), layer.lengths, policy, layer.host_lengths)
    layer.evict(index, kept)


class PaluAttention(_CompressedAttentionBase):
    """The Palu-style baseline for one decoder layer: keys cached as a per-KV-head low-rank latent taken before RoPE
    (``k_latent = k B^T`` with B the top principal axes of the pre-RoPE keys, the optimum of Palu's whitened SVD),
    reconstructed (``k = k_latent B``), normalised (Qwen3) and rotated at their positions on every call, then
    attended at full width; values exactly as FDC does. Cached positions are each request's real tokens counted from
    0, as generate() numbers them under left padding; other position_ids are refused."""

    def __init__(self, original: nn.Module, layer: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 q_weight, q_bias, latent_weight, latent_bias, value_weight, output_weight, output_bias,
                 key_up: torch.Tensor, latent_offsets: torch.Tensor, v_offsets: torch.Tensor,
                 padding: PaddingState, rotary: nn.Module, window_left: int = -1, softcap: float = 0.0):
        """latent_weight: (sum k dims, hidden) = B W_K per KV head; key_up: (sum k dims, H_kv * D) block-diagonal
        up-projection of the latent to pre-RoPE keys (fdc_ops.artifact.fold_key_latent); latent_offsets: (H_kv + 1,)
        int32 CPU."""
        super().__init__(original, layer, num_heads, num_kv_heads, head_dim, q_weight, q_bias, latent_weight,
                         latent_bias, value_weight, output_weight, output_bias, v_offsets, padding, window_left,
                         softcap)
        self.latent_proj = self.k_proj  # (hidden) -> (sum k dims): the latent, not full keys
        del self.k_proj
        self.register_buffer("key_up", key_up, persistent=False)  # (sum k dims, H_kv * D)
        self.latent_offsets = latent_offsets  # CPU, not a buffer
        self.qk_offsets = torch.arange(num_kv_heads + 1, dtype=torch.int32) * head_dim  # full-width keys
        self._rotary = [rotary]
        # A rotary module with one table per layer type (Gemma 3: its windowed layers' RoPE has its own base) is asked
        # for this layer's.
        takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self._rotary_kwargs = {"layer_type": original.layer_type} if takes_type else {}

    def cache_offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.latent_offsets, self.v_offsets

    def _keys(self, latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """latent (B, S, sum k dims) at positions (B, S), or (B, H_kv, S) where each KV head's rows hold their own
        tokens (a per-head eviction) -> post-RoPE keys (B, S, H_kv * D)."""
        B, S, _ = latent.shape
        H_kv, D = self.num_kv_heads, self.head_dim
        keys = (latent @ self.key_up.to(latent.dtype)).view(B, S, H_kv, D)
        if self.k_norm is not None:
            keys = self.k_norm(keys)
        keys = keys.transpose(1, 2)  # (B, H_kv, S, D)
        if positions.dim() == 3:  # one rotation per (request, head): each head as a request of one head
            cos, sin = self._rotary[0](latent, positions.reshape(B * H_kv, S), **self._rotary_kwargs)
            flat = keys.reshape(B * H_kv, 1, S, D)
            _, flat = self._apply_rope(flat, flat, cos, sin)
            keys = flat.view(B, H_kv, S, D)
        else:
            cos, sin = self._rotary[0](latent, positions, **self._rotary_kwargs)
            _, keys = self._apply_rope(keys, keys, cos, sin)
        return keys.transpose(1, 2).reshape(B, S, -1)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, **kwargs):
        """hidden_states: (B, S, hidden); the cache as in FDCAttention.forward. Returns ((B, S, hidden), None)."""
        cache = cache_argument(kwargs, "fdc_ops.hf.modules.PaluAttention")
        B, S, _ = hidden_states.shape
        H, D = self.num_heads, self.head_dim
        q = self._heads(self.q_proj, self.q_norm, hidden_states, H).transpose(1, 2)  # (B, H, S, D)
        cos, sin = position_embeddings
        q, _ = self._apply_rope(q, q, cos, sin)
        rows = self._padding.rows(B, S, hidden_states.device)
        valid = rows.valid if rows.valid is not None else torch.ones(B, S, dtype=torch.bool, device=q.device)
        layer = None if cache is None else _cache_layer(cache, self.layer_idx, *self.cache_offsets(),
                                                         self.window_left, self.kv_dtype)
        if isinstance(layer, StaticCompressedKVLayer):
            raise NotImplementedError("fdc_ops.hf.modules.PaluAttention: the Palu baseline runs with a dynamic cache "
                                      "only (it rebuilds keys from a latent whose used length it reads on the host); "
                                      "FDC takes a static cache")
        past = torch.zeros_like(rows.counts, dtype=torch.int64)  # real tokens before the call, dropped rows included
        if layer is not None and layer.lengths is not None:
            past = layer.seen_tokens()
        compact = past[:, None] + valid.cumsum(1) - 1  # (B, S): each real token's position among its request's
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and not torch.equal(position_ids.expand(B, S)[valid], compact[valid]):
            raise NotImplementedError("fdc_ops.hf.modules.PaluAttention: position_ids must count each request's "
                                      "real tokens from 0 (as generate() does), since cached latents are rotated at "
                                      "those positions")
        q_rows = rows.take(q.transpose(1, 2)).reshape(-1, H * D)
        latent = self.latent_proj(hidden_states)
        latent_rows, v_rows = rows.take(latent), self.v_proj(rows.take(hidden_states))
        if cache is None:
            k_rows = rows.take(self._keys(latent, compact.clamp_min(0)))
            out = _attend(self, q_rows, k_rows, v_rows, rows, S, None)
        else:
            fresh = layer is not None and not any(layer.host_lengths)  # a prompt into an empty cache

            def keys_from_cache(layer):  # rebuilds the rows in use only, not the spare capacity
                used = max(layer.host_lengths)
                positions = layer.positions_of_rows(used)  # (B, used)
                if fresh and self.kv_dtype is not None:  # a prompt attends its own rows unquantized, as FDC's does
                    latent = latent_rows.new_zeros(B, used, latent_rows.shape[1])
                    values = v_rows.new_zeros(B, used, v_rows.shape[1])
                    bounds = rows.cu.tolist()
                    for b, (start, stop) in enumerate(zip(bounds, bounds[1:])):
                        latent[b, : stop - start] = latent_rows[start:stop]
                        values[b, : stop - start] = v_rows[start:stop]
                else:
                    latent = layer.float_rows(layer.k_cache[:, :used], self.latent_offsets, q_rows.dtype)
                    values = layer.float_rows(layer.v_cache[:, :used], self.v_offsets, q_rows.dtype)
                return self._keys(latent, positions).contiguous(), values.contiguous()

            out = _attend(self, q_rows, latent_rows, v_rows, rows, S, layer, keys_from_cache=keys_from_cache)
        return self.o_proj(rows.scatter(out, B, S)), None
