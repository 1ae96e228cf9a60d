"""Typed Python entry points of the ``torch.ops.fdc`` operators, with their shapes, and their fake implementations.

Packed head layout (docs/design.md section 3). A layer has ``H_kv`` KV heads; KV head ``j`` has a query/key width
``qk_dim[j]`` and a value width ``v_dim[j]`` (positive multiples of 8, at most 256), given as int32 prefix sums
``qk_offsets`` and ``v_offsets`` of length ``H_kv + 1`` that live on the CPU (they are static metadata of the layer;
:func:`prefix_sums` makes them from the widths). ``group`` (G) query heads share each KV head; query head ``h`` uses
KV head ``h // G``. Tensors put heads side by side along their last dimension:

- keys ``(T, qk_offsets[-1])`` and values ``(T, v_offsets[-1])``: KV head ``j`` at ``[offsets[j], offsets[j+1])``;
- queries ``(T, G * qk_offsets[-1])`` and outputs ``(T, G * v_offsets[-1])``: query head ``h = j*G + i`` at
  ``G * offsets[j] + i * dim[j] + [0, dim[j])``.

Floating-point tensors are float32, float16 or bfloat16 (accumulation is float32); rows may be strided, anything else
non-contiguous is copied, except KV caches, which are read and written in place and so must have unit-stride rows
(contiguous pages when paged). Sequence boundaries (``cu_seqlens``) and cache lengths are int32 on the device of the
data.

KV caches are either contiguous, ``(B, S_max, width)`` with ``cache_seqlens`` (B), or paged: ``(num_pages, width,
page_size)`` with ``block_table`` int32 ``(B, max_pages)``; token ``t`` of request ``b`` lives in page
``block_table[b, t // page_size]`` at position ``t % page_size`` of the last dimension. A page stores each column's
``page_size`` tokens contiguously, so KV head ``j`` owns one contiguous ``(dim[j], page_size)`` block (rows
``offsets[j] .. offsets[j+1]``): a decode task reading one head streams contiguous memory, and a score or value loop
runs along contiguous tokens.

Quantized caches (:data:`QUANTIZED_CACHE_DTYPES`: int8, float8_e4m3fn, and uint8 holding int4 codes): one byte per
element (int4: two per byte, column ``2m`` in byte ``m``'s low nibble and ``2m + 1`` in its high one, two's complement
codes in [-7, 7]) and, per token and KV head, a float32 scale (the head's largest magnitude in the row over 127, 448 or
7), element = code * scale. The scales follow the data columns: a contiguous row is the codes (``width`` bytes, or
``width / 2`` for int4) then ``H_kv`` float32 scales (``4 * H_kv`` bytes); a page is the codes' byte rows then the
scales as ``H_kv`` runs of ``page_size`` float32 (``4 * H_kv`` byte rows), so one block table addresses both.
:func:`kv_cache_dtype` maps the names ``"int8"``, ``"float8_e4m3fn"`` and ``"int4"`` to these dtypes.
:func:`cache_width` gives a cache's last (contiguous) or middle (paged) size.
:func:`append_kv` quantizes as it writes, :func:`decode_attention` reads the codes in place and
:func:`prefill_attention` reads quantized pages, on the CPU; on CUDA, all three take int8 and float8_e4m3fn caches
with float16 or bfloat16 activations (int4 caches, and float32 activations over codes, raise).

Schedules are int32 tensors whose format is documented in include/fdc/prefill_plan.h and decode_plan.h;
:mod:`fdc_ops.plans` decodes and builds them (``DecodePlan`` / ``PrefillPlan``).
"""

from __future__ import annotations

import math

import torch

from . import _extension  # noqa: F401  (loads torch.ops.fdc, or raises an ImportError saying why not and what to do)
from .plans import DEFAULT_ROW_BLOCK, PREFILL_HEADER, decode_plan_size

__all__ = [
    "prefix_sums",
    "cache_width",
    "QUANTIZED_CACHE_DTYPES",
    "CUDA_QUANTIZED_CACHE_DTYPES",
    "kv_cache_dtype",
    "dequantize_rows",
    "data_width",
    "rotate_compress",
    "rope_rotate_compress",
    "prefill_plan",
    "prefill_attention",
    "decode_plan",
    "decode_attention",
    "append_kv",
    "window_scores",
    "DEFAULT_ROW_BLOCK",
    "decode_plan_size",
]


# Cache dtypes stored as codes and per-(token, KV head) float32 scales (include/fdc/kv_format.h), with each one's
# largest code magnitude; uint8 is the storage of int4 codes, two per byte.
QUANTIZED_CACHE_DTYPES = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.uint8: 7.0}
# The quantized caches the CUDA append_kv, decode_attention and prefill_attention (pages) take (with float16 or
# bfloat16 activations).
CUDA_QUANTIZED_CACHE_DTYPES = (torch.int8, torch.float8_e4m3fn)
_SCALE_BYTES = 4
_KV_CACHE_DTYPE_NAMES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "int4": torch.uint8}


def kv_cache_dtype(kind: str | torch.dtype) -> torch.dtype:
    """The dtype of a quantized cache of ``kind``: a name (``"int8"``, ``"float8_e4m3fn"``, ``"int4"``), one of
    :data:`QUANTIZED_CACHE_DTYPES`, or ``torch.int4`` (stored as uint8, two codes per byte).

    >>> import torch, fdc_ops
    >>> fdc_ops.ops.kv_cache_dtype("int4"), fdc_ops.ops.kv_cache_dtype(torch.int8)
    (torch.uint8, torch.int8)
    """
    if isinstance(kind, str) and kind in _KV_CACHE_DTYPE_NAMES:
        return _KV_CACHE_DTYPE_NAMES[kind]
    if kind == getattr(torch, "int4", None):
        return torch.uint8
    if isinstance(kind, torch.dtype) and kind in QUANTIZED_CACHE_DTYPES:
        return kind
    raise ValueError(f"fdc_ops.ops.kv_cache_dtype: a quantized cache is one of {list(_KV_CACHE_DTYPE_NAMES)} (or "
                     f"{list(QUANTIZED_CACHE_DTYPES)}, or torch.int4), got {kind!r}")


def cache_width(offsets: torch.Tensor, dtype: torch.dtype) -> int:
    """Columns of a cache row (contiguous ``(B, S_max, width)``) or rows of a page (paged ``(num_pages, width,
    page_size)``) for the layout ``offsets`` (``qk_offsets`` for K, ``v_offsets`` for V) stored as ``dtype``: the
    layout's width (half of it for int4's uint8, two codes per byte), plus 4 bytes of scale per KV head for a
    quantized dtype.

    >>> import torch, fdc_ops
    >>> offsets = fdc_ops.ops.prefix_sums([32, 16])
    >>> [fdc_ops.ops.cache_width(offsets, dtype) for dtype in (torch.bfloat16, torch.int8, torch.uint8)]
    [48, 56, 32]
    """
    width = int(offsets[-1])
    if dtype not in QUANTIZED_CACHE_DTYPES:
        return width
    return width // _codes_per_element(dtype) + _SCALE_BYTES * (offsets.shape[0] - 1)


def dequantize_rows(rows: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Token-major cache rows ``(..., cache_width(offsets, rows.dtype))`` (a contiguous cache, or rows taken from one)
    as ``(..., offsets[-1])`` elements of ``dtype``: code x its (token, KV head) scale for a quantized cache (int4's
    nibbles unpacked), the rows themselves, converted, for a float one. A copy: what reads a quantized cache in place
    is the ops; this is for the Python paths that need float keys (eviction scores, a prefill over cached rows).

    >>> import torch, fdc_ops
    >>> offsets = fdc_ops.ops.prefix_sums([8])
    >>> cache = torch.zeros(1, 2, fdc_ops.ops.cache_width(offsets, torch.uint8), dtype=torch.uint8)
    >>> fdc_ops.ops.append_kv(cache, cache.clone(), torch.arange(8.0)[None], torch.zeros(1, 8),
    ...                       torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), offsets,
    ...                       offsets)
    >>> fdc_ops.ops.dequantize_rows(cache[0, :1], offsets)
    tensor([[0., 1., 2., 3., 4., 5., 6., 7.]])
    """
    if rows.dtype not in QUANTIZED_CACHE_DTYPES:
        return rows.to(dtype)
    bounds = offsets.tolist()
    heads = len(bounds) - 1
    stored = cache_width(offsets, rows.dtype) - _SCALE_BYTES * heads  # bytes of codes per row
    if rows.shape[-1] != stored + _SCALE_BYTES * heads:
        raise ValueError(f"fdc_ops.ops.dequantize_rows: rows must have {stored + _SCALE_BYTES * heads} columns "
                         f"(cache_width) for these offsets, got shape {tuple(rows.shape)}")
    scales = rows[..., stored:].contiguous().view(torch.float32)  # (..., H_kv)
    dims = torch.tensor([bounds[j + 1] - bounds[j] for j in range(heads)], device=rows.device)
    if rows.dtype == torch.uint8:  # int4: column 2m in byte m's low nibble, 2m + 1 in its high one
        packed = rows[..., :stored].view(torch.int8)
        nibbles = torch.stack([torch.bitwise_left_shift(packed, 4), packed], dim=-1)
        codes = torch.bitwise_right_shift(nibbles, 4).flatten(-2)  # arithmetic shifts: two's complement codes
    else:
        codes = rows[..., :stored]
    return (codes.to(torch.float32) * scales.repeat_interleave(dims, dim=-1)).to(dtype)


def _codes_per_element(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.uint8 else 1


def data_width(stored: int, offsets: torch.Tensor, dtype: torch.dtype) -> int:
    """The layout width (``offsets[-1]``) of a cache whose rows (or pages' rows) are ``stored`` elements of
    ``dtype``: cache_width's inverse, reading only the number of KV heads from ``offsets`` (so a compiled graph, which
    does not see the offsets' values, can take the width from a cache's shape).

    >>> import torch, fdc_ops
    >>> offsets = fdc_ops.ops.prefix_sums([32, 16])
    >>> fdc_ops.ops.data_width(fdc_ops.ops.cache_width(offsets, torch.uint8), offsets, torch.uint8)
    48
    """
    if dtype not in QUANTIZED_CACHE_DTYPES:
        return stored
    return (stored - _SCALE_BYTES * (offsets.shape[0] - 1)) * _codes_per_element(dtype)


def prefix_sums(sizes) -> torch.Tensor:
    """``[0, s0, s0 + s1, ...]`` as int32: the ``qk_offsets`` / ``v_offsets`` the ops take, from per-KV-head widths
    (a list of ints: a CPU tensor), and the ``cu_seqlens`` they take, from per-request counts (a 1-D integer tensor:
    the result stays on its device).

    >>> import fdc_ops
    >>> fdc_ops.ops.prefix_sums([32, 16, 64])
    tensor([  0,  32,  48, 112], dtype=torch.int32)
    """
    given = sizes
    sizes = torch.as_tensor(sizes)
    if not isinstance(given, torch.Tensor) and sizes.numel() == 0:
        sizes = sizes.long()  # an empty list (no heads, no requests) comes as float32 from torch
    if sizes.dim() != 1 or sizes.is_floating_point() or sizes.is_complex() or sizes.dtype == torch.bool:
        raise ValueError(f"fdc_ops.ops.prefix_sums: sizes must be a 1-D sequence of integers, got {sizes.dim()}-D "
                         f"{sizes.dtype}")
    return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]).to(torch.int32)


def rotate_compress(x: torch.Tensor, rot: torch.Tensor, qk_offsets: torch.Tensor, group: int,
                    out_width: int | None = None) -> torch.Tensor:
    """Rotates post-RoPE queries or keys per head and keeps each head's leading ``qk_dim`` columns, packed.

    Args:
        x: ``(T, G * H_kv, D)`` post-RoPE queries (``group=G``) or keys (``group=1``).
        rot: ``(H_kv, D, R_max)`` truncated rotations, ``R_max >= max(qk_dim)``, dtype of ``x``.
        qk_offsets: ``(H_kv + 1,)`` int32 CPU prefix sums of the per-KV-head widths.
        group: query heads per KV head in ``x`` (1 for keys).
        out_width: ``group * qk_offsets[-1]``, checked, when the caller knows it. Optional; it is what lets
            ``torch.compile`` see the output's shape (from the offsets alone it is data, a dynamic size, and an op
            whose output shape is data breaks a graph that is not compiled with ``fullgraph=True``).

    Returns:
        ``(T, group * qk_offsets[-1])``: head ``h``'s segment is ``x[:, h, :] @ rot[h // group, :, :qk_dim]``.

    Example (two KV heads kept 8 and 16 wide out of D = 32, two query heads each)::

        >>> import torch, fdc_ops
        >>> qk_offsets = torch.tensor([0, 8, 24], dtype=torch.int32)
        >>> rot = torch.linalg.qr(torch.randn(2, 32, 32)).Q[:, :, :16]  # (H_kv, D, R_max) orthonormal columns
        >>> q = torch.randn(5, 4, 32)                                     # (T, G * H_kv, D) post-RoPE queries
        >>> packed = fdc_ops.rotate_compress(q, rot, qk_offsets, group=2)
        >>> packed.shape                                                  # (T, G * qk_offsets[-1])
        torch.Size([5, 48])
        >>> torch.allclose(packed[:, 8:16], q[:, 1] @ rot[0, :, :8], atol=1e-5)  # query head 1, of KV head 0
        True
    """
    return torch.ops.fdc.rotate_compress(x, rot, qk_offsets, group, out_width)


def rope_rotate_compress(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: torch.Tensor,
                         qk_offsets: torch.Tensor, group: int, out_width: int | None = None) -> torch.Tensor:
    """RoPE and :func:`rotate_compress` in one pass: ``rotate_compress(rope(x), rot, qk_offsets, group)``.

    RoPE is Hugging Face's rotate-half form (``apply_rotary_pos_emb``), partial when ``rotary_dim < D`` (Phi-3):
    with ``half = rotary_dim // 2``, column ``d`` of each head becomes ``x[d] * cos[d] - x[d + half] * sin[d]`` for
    ``d < half``, ``x[d] * cos[d] + x[d - half] * sin[d]`` for ``half <= d < rotary_dim``, and stays ``x[d]`` for
    ``d >= rotary_dim``. The rotated values are not rounded to ``x``'s dtype before the product (float32 throughout),
    so the result is slightly more accurate than RoPE in low precision followed by :func:`rotate_compress`.

    Args:
        x: ``(T, G * H_kv, D)`` pre-RoPE queries (``group=G``) or keys (``group=1``).
        cos, sin: ``(T, rotary_dim)`` per-token tables, dtype and device of ``x``; ``rotary_dim`` even, in ``[2, D]``.
            Hugging Face's ``(B, S, rotary_dim)`` tables become these by selecting the same tokens as ``x``.
        rot: ``(H_kv, D, R_max)`` truncated rotations, ``R_max >= max(qk_dim)``, dtype of ``x``.
        qk_offsets: ``(H_kv + 1,)`` int32 CPU prefix sums of the per-KV-head widths.
        group: query heads per KV head in ``x`` (1 for keys).
        out_width: ``group * qk_offsets[-1]``, checked, when the caller knows it (as :func:`rotate_compress`).

    Returns:
        ``(T, group * qk_offsets[-1])``, dtype of ``x``, packed as :func:`rotate_compress`'s output.

    Example (at position 0, RoPE is the identity)::

        >>> import torch, fdc_ops
        >>> qk_offsets = torch.tensor([0, 8, 24], dtype=torch.int32)
        >>> rot = torch.linalg.qr(torch.randn(2, 32, 32)).Q[:, :, :16]
        >>> k = torch.randn(3, 2, 32)                     # (T, H_kv, D) pre-RoPE keys: group 1
        >>> cos, sin = torch.ones(3, 32), torch.zeros(3, 32)
        >>> fused = fdc_ops.ops.rope_rotate_compress(k, cos, sin, rot, qk_offsets, group=1)
        >>> torch.allclose(fused, fdc_ops.rotate_compress(k, rot, qk_offsets, group=1), atol=1e-5)
        True
    """
    return torch.ops.fdc.rope_rotate_compress(x, cos, sin, rot, qk_offsets, group, out_width)


def prefill_plan(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    qk_offsets: torch.Tensor,
    v_offsets: torch.Tensor,
    group: int,
    causal: bool,
    num_workers: int | None = None,
    row_block: int = DEFAULT_ROW_BLOCK,
    window_left: int = -1,
) -> torch.Tensor:
    """The prefill schedule: row blocks rescaled per head, full rounds by least load, the last round split evenly.

    Args:
        cu_seqlens_q: ``(B + 1,)`` int32 query sequence boundaries.
        cu_seqlens_k: ``(B + 1,)`` int32 key sequence boundaries.
        qk_offsets, v_offsets: ``(H_kv + 1,)`` int32 CPU prefix sums of the head widths.
        group: query heads per KV head.
        causal: whether the attention is causal (bottom-right aligned); changes the cost of each row block.
        num_workers: workers to balance over; default the backend's (CPU: intra-op threads).
        row_block: rows per task of the widest head, a multiple of 16.
        window_left: the sliding window of :func:`prefill_attention` (-1: none); a row block costs the keys its rows
            see, so windowed sequences are balanced by their real work.

    Returns:
        int32 ``(8 + num_workers + 1 + 4 * records,)``: see include/fdc/prefill_plan.h.

    Example::

        >>> import torch, fdc_ops
        >>> cu = torch.tensor([0, 3, 40], dtype=torch.int32)    # two prompts of 3 and 37 tokens
        >>> qk_offsets = torch.tensor([0, 8, 24], dtype=torch.int32)
        >>> v_offsets = torch.tensor([0, 16, 24], dtype=torch.int32)
        >>> plan = fdc_ops.prefill_plan(cu, cu, qk_offsets, v_offsets, group=2, causal=True, num_workers=3)
        >>> decoded = fdc_ops.plans.PrefillPlan.from_tensor(plan)  # the int32 format, read
        >>> decoded.batch, decoded.num_heads, decoded.num_workers   # H: query heads
        (2, 4, 3)
    """
    return torch.ops.fdc.prefill_plan(
        cu_seqlens_q, cu_seqlens_k, qk_offsets, v_offsets, group, causal, num_workers, row_block, window_left
    )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    qk_offsets: torch.Tensor,
    v_offsets: torch.Tensor,
    group: int,
    scale: float,
    causal: bool,
    plan: torch.Tensor | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen attention over packed heads of different widths, GQA; sliding windows, soft-capping and sinks; keys
    and values packed or read in place from a paged cache.

    Args:
        q: ``(T_q, G * qk_offsets[-1])`` compressed queries.
        k: ``(T_k, qk_offsets[-1])`` compressed keys, or with ``block_table`` a paged key cache
            ``(num_pages, cache_width(qk_offsets, dtype), page_size)`` (the layout of :func:`decode_attention` and
            :func:`append_kv`), of ``q``'s dtype or quantized (int8, float8_e4m3fn or int4's uint8; on CUDA int8
            and float8_e4m3fn with float16 or bfloat16 ``q``), dequantized as its key tiles are loaded.
        v: ``(T_k, v_offsets[-1])`` compressed values, or with ``block_table`` a paged value cache
            ``(num_pages, cache_width(v_offsets, dtype), page_size)``, the dtype of ``k``.
        cu_seqlens_q, cu_seqlens_k: ``(B + 1,)`` int32 sequence boundaries in ``q`` and in ``k``/``v``; with
            ``block_table``, ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` is request ``b``'s key count ``s_k``, its keys
            being positions ``0 .. s_k - 1`` of its pages (a cached prefix and this call's new rows, appended first).
        qk_offsets, v_offsets: ``(H_kv + 1,)`` int32 CPU prefix sums of the head widths.
        group: query heads per KV head.
        scale: softmax scale, ``1 / sqrt(original head dim)`` for FDC (not of the compressed width).
        causal: causal mask aligned bottom-right: query ``i`` of a sequence with ``s_q`` queries and ``s_k`` keys
            sees keys ``0 .. i + s_k - s_q``; a row that sees no key returns zeros.
        plan: a schedule from :func:`prefill_plan` for the same boundaries, layout and ``causal`` (and, for balance,
            ``window_left``); computed when None.
        window_left: sliding window: a query at position ``p`` sees no key before ``p - window_left``
            (``p = i + s_k - s_q`` for query ``i``, as for ``causal``); -1 for none. A model's ``sliding_window`` W
            is ``W - 1``.
        softcap: logit soft-capping, each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``; 0 for none.
        sinks: ``(H_kv * G,)`` float32 sink logits, one per query head ``h = j * G + i``, on ``q``'s device: each joins
            its head's softmax denominator (in the units of the scaled, capped scores) and adds nothing to the output;
            None for none.
        block_table: ``(B, max_pages)`` int32 on ``k``'s device: position ``t`` of request ``b`` is slot
            ``t % page_size`` of page ``block_table[b, t // page_size]``. Only the pages holding keys some query sees
            are read (with a window, none before the first query's window), and only their entries must be pages of
            the pool. None: ``k`` and ``v`` are packed rows.

    Returns:
        ``(T_q, G * v_offsets[-1])``, dtype of ``q``. Rows of ``q`` outside every sequence are zero.

    Example (two causal prompts; the float64 reference in fdc_ops.reference computes the same)::

        >>> import torch, fdc_ops
        >>> from fdc_ops import reference
        >>> cu = torch.tensor([0, 3, 40], dtype=torch.int32)
        >>> qk_offsets = torch.tensor([0, 8, 24], dtype=torch.int32)
        >>> v_offsets = torch.tensor([0, 16, 24], dtype=torch.int32)
        >>> q, k, v = torch.randn(40, 2 * 24), torch.randn(40, 24), torch.randn(40, 24)
        >>> args = (q, k, v, cu, cu, qk_offsets, v_offsets, 2, 32 ** -0.5, True)
        >>> out = fdc_ops.prefill_attention(*args)
        >>> out.shape                                       # (T_q, G * v_offsets[-1])
        torch.Size([40, 48])
        >>> torch.allclose(out.double(), reference.prefill_attention_ref(*args), atol=1e-5)
        True
    """
    return torch.ops.fdc.prefill_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, qk_offsets, v_offsets, group, scale, causal, plan, window_left, softcap,
        sinks, block_table,
    )


def decode_plan(
    cache_seqlens: torch.Tensor,
    qk_offsets: torch.Tensor,
    v_offsets: torch.Tensor,
    group: int,
    num_workers: int | None = None,
    window_left: int = -1,
) -> torch.Tensor:
    """The decode schedule: (request, KV head, KV chunk) tasks, long sequences split, greedy LPT over workers.

    On CUDA the plan is built on the device by one kernel launch on the current stream, with no host
    synchronisation and no host read of ``cache_seqlens``, so it can be captured in a CUDA graph and replayed after
    the lengths change in place; it equals the CPU plan integer for integer. Since the lengths are not checked on
    the host there, a negative length gives a plan whose status entry (``plan[7]``) is ``Status::kBadSeqlens``
    (2) with no tasks, which the attention op turns into NaN outputs; the CPU op raises instead and always writes
    status 0. The CUDA planner takes at most 1024 KV heads, 1024 workers and ``B * H_kv + 3 * num_workers``
    up to 2**23.

    What ``decode_attention`` does with a plan: the CUDA kernel runs exactly its tasks, one persistent block per
    worker. On the CPU the portable kernels also run its tasks (one thread per worker), but the AVX-512 kernels only
    check it: they cut requests into pieces of keys read for every KV head at once (whole rows or pages, in order),
    which a plan's per-KV-head tasks cannot express (docs/design.md section 7; csrc/cpu/decode_attention.cpp).

    Args:
        cache_seqlens: ``(B,)`` int32 cache lengths, on the device whose plan is wanted.
        qk_offsets, v_offsets: ``(H_kv + 1,)`` int32 CPU prefix sums of the head widths.
        group: query heads per KV head.
        num_workers: workers to balance over; default the backend's (CPU: intra-op threads, CUDA: SMs).
        window_left: the sliding window of :func:`decode_attention` (-1: none): the tasks then cover each request's
            visible keys only, ``[max(0, cache_seqlens[b] - 1 - window_left), cache_seqlens[b])``.

    Returns:
        int32 ``(decode_plan_size(B, H_kv, num_workers),)`` on ``cache_seqlens``' device: see
        include/fdc/decode_plan.h. Its size depends on shapes only, so a decode step with its plan can be captured
        in a CUDA graph.

    Example (one long request is split into chunks so that four workers share it)::

        >>> import torch, fdc_ops
        >>> qk_offsets = torch.tensor([0, 8, 24], dtype=torch.int32)
        >>> v_offsets = torch.tensor([0, 16, 24], dtype=torch.int32)
        >>> plan = fdc_ops.decode_plan(torch.tensor([8192, 5], dtype=torch.int32), qk_offsets, v_offsets, group=2,
        ...                            num_workers=4)
        >>> decoded = fdc_ops.plans.DecodePlan.from_tensor(plan)
        >>> decoded.num_tasks > 2 * 2, decoded.status.name  # more tasks than (request, KV head) pairs
        (True, 'OK')
    """
    return torch.ops.fdc.decode_plan(cache_seqlens, qk_offsets, v_offsets, group, num_workers, window_left)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    qk_offsets: torch.Tensor,
    v_offsets: torch.Tensor,
    group: int,
    scale: float,
    plan: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request against its compressed KV cache, GQA, split-KV with a log-sum-exp merge;
    sliding windows, soft-capping and sinks.

    Args:
        q: ``(B, G * qk_offsets[-1])`` compressed queries.
        k_cache: ``(B, S_max, W)``, or paged ``(num_pages, W, page_size)``, ``W = cache_width(qk_offsets, dtype)``:
            of ``q``'s dtype, or quantized (int8, float8_e4m3fn or int4's uint8; on CUDA int8 and float8_e4m3fn with
            float16 or bfloat16 ``q``; see the module docstring).
        v_cache: ``(B, S_max, W)``, or paged ``(num_pages, W, page_size)``, ``W = cache_width(v_offsets, dtype)``,
            the dtype of ``k_cache``.
        cache_seqlens: ``(B,)`` int32; slots at or past ``cache_seqlens[b]`` are never read, and a request of
            length 0 returns zeros.
        qk_offsets, v_offsets: ``(H_kv + 1,)`` int32 CPU prefix sums of the head widths.
        group: query heads per KV head.
        scale: softmax scale.
        plan: a schedule from :func:`decode_plan` for the same lengths, layout and ``window_left``; computed when None.
        block_table: ``(B, max_pages)`` int32 page indices for a paged cache, None for a contiguous one.
        window_left: sliding window: a query at position ``p`` sees no key before ``p - window_left`` (the query is
            the cache's newest key, ``p = cache_seqlens[b] - 1``; older slots are never read); -1 for none. A
            model's ``sliding_window`` W is ``W - 1``.
        softcap: logit soft-capping, each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``; 0 for none.
        sinks: ``(H_kv * G,)`` float32 sink logits, one per query head ``h = j * G + i``, on ``q``'s device: each joins
            its head's softmax denominator (in the units of the scaled, capped scores) and adds nothing to the output;
            None for none.

    Returns:
        ``(B, G * v_offsets[-1])``, dtype of ``q``.

    On CUDA, ``cache_seqlens``, ``plan`` and ``block_table`` live on the GPU and are never read on the host, so a
    decode step (plan + attention) can be captured in a CUDA graph; the plan is built on the GPU when None. The
    host checks what shapes, dtypes and devices tell (including 16-byte alignment of the caches); what only the
    values tell is checked by the kernels, which never read out of bounds and return NaN: for the whole output when
    the plan's planner met a negative length (status entry ``plan[7]``) or the plan was made for other shapes; for
    the (request, KV head) concerned when a plan record runs past its request's length or the cache capacity, its
    chunks do not start at key 0 and end at the request's length (a plan made for other lengths), or a block-table
    entry lies outside ``[0, num_pages)``. The CPU op raises for all of these instead.

    Example (a cache holding 3 and 0 tokens; slots past each length hold NaN and are never read)::

        >>> import torch, fdc_ops
        >>> qk_offsets = torch.tensor([0, 8, 24], dtype=torch.int32)
        >>> v_offsets = torch.tensor([0, 16, 24], dtype=torch.int32)
        >>> k_cache = torch.full((2, 16, 24), float("nan"))   # (B, S_max, qk_offsets[-1])
        >>> v_cache = torch.full((2, 16, 24), float("nan"))
        >>> k_cache[0, :3], v_cache[0, :3] = torch.randn(3, 24), torch.randn(3, 24)
        >>> lengths = torch.tensor([3, 0], dtype=torch.int32)
        >>> out = fdc_ops.decode_attention(torch.randn(2, 2 * 24), k_cache, v_cache, lengths, qk_offsets, v_offsets,
        ...                                group=2, scale=32 ** -0.5)
        >>> out.shape, bool(out.isnan().any()), bool((out[1] == 0).all())   # an empty request gives zeros
        (torch.Size([2, 48]), False, True)
    """
    return torch.ops.fdc.decode_attention(
        q, k_cache, v_cache, cache_seqlens, qk_offsets, v_offsets, group, scale, plan, block_table, window_left,
        softcap, sinks,
    )


def append_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cache_seqlens: torch.Tensor,
    qk_offsets: torch.Tensor,
    v_offsets: torch.Tensor,
    block_table: torch.Tensor | None = None,
) -> None:
    """Writes new compressed K/V rows into a cache, in place, after each request's current rows.

    Rows ``cu_seqlens[b] .. cu_seqlens[b+1]`` of ``k``/``v`` go to positions ``cache_seqlens[b] ...`` of request
    ``b``. ``cache_seqlens`` is not changed (the caller advances it).

    Checks differ by device, because on CUDA the values of ``cu_seqlens``, ``cache_seqlens`` and ``block_table`` are
    never read on the host (that would synchronise the stream and make a decode step impossible to capture in a
    CUDA graph):

    - CPU: every write is checked before any is made; bad ``cu_seqlens`` (decreasing, negative, past ``T``),
      ``cache_seqlens`` (negative, past the capacity), a request that would overflow its cache, or a block-table
      entry it needs outside ``[0, num_pages)`` raises ``RuntimeError`` and leaves the caches untouched.
    - CUDA: the host checks everything shapes, dtypes and devices tell (the layout, widths, row counts, dtypes,
      ``cu_seqlens`` and ``cache_seqlens`` int32 of length ``B + 1`` and ``B`` and on the cache's device, the cache
      and block-table shapes); values are checked on the device, where a bad one never raises but is skipped: a
      request ``b`` writes nothing unless ``0 <= cu_seqlens[b] <= cu_seqlens[b+1] <= T``, ``cache_seqlens[b] >= 0``
      and ``cache_seqlens[b] + new rows <= capacity``; a row whose block-table entry is outside ``[0, num_pages)`` is
      not written (the request's other rows are); rows outside ``[cu_seqlens[0], cu_seqlens[B])`` are not written.
      If ``cu_seqlens`` is not non-decreasing, which rows are written is unspecified, but no write leaves the
      caches. Nothing reports a skipped row: validate on the host beforehand when inputs are untrusted.

    Args:
        k_cache, v_cache: contiguous ``(B, S_max, width)`` caches with unit-stride rows, or paged
            ``(num_pages, width, page_size)`` caches with contiguous pages, ``width`` being :func:`cache_width`;
            written in place. Of ``k``'s dtype, or quantized (int8, float8_e4m3fn or int4's uint8; on CUDA int8 and
            float8_e4m3fn with float16 or bfloat16 ``k``): each
            new row's KV heads are written as codes, ``round(x / scale)`` (ties to even; e4m3: its nearest value)
            with ``scale`` the head's largest magnitude in the row over 127 (int8), 448 (e4m3) or 7 (int4), and the
            scale (int4: two codes per byte, see the module docstring); a head with a non-finite value is stored as
            a NaN scale, so whatever reads it gives NaN.
        k: ``(T, qk_offsets[-1])`` new compressed keys.
        v: ``(T, v_offsets[-1])`` new compressed values, dtype of ``k``.
        cu_seqlens: ``(B + 1,)`` int32 boundaries of each request's new rows in ``k``/``v`` (on CUDA: on the
            cache's device).
        cache_seqlens: ``(B,)`` int32 current cache lengths (on CUDA: on the cache's device).
        qk_offsets, v_offsets: ``(H_kv + 1,)`` int32 CPU prefix sums of the head widths.
        block_table: ``(B, max_pages)`` int32 for a paged cache, None for a contiguous one.

    Example (a prompt of 3 tokens for request 0 and of 1 token for request 1, into empty caches)::

        >>> import torch, fdc_ops
        >>> qk_offsets = torch.tensor([0, 8, 24], dtype=torch.int32)
        >>> v_offsets = torch.tensor([0, 16, 24], dtype=torch.int32)
        >>> k_cache, v_cache = torch.zeros(2, 16, 24), torch.zeros(2, 16, 24)
        >>> k, v = torch.randn(4, 24), torch.randn(4, 24)
        >>> cu_seqlens = torch.tensor([0, 3, 4], dtype=torch.int32)
        >>> lengths = torch.tensor([0, 0], dtype=torch.int32)
        >>> fdc_ops.append_kv(k_cache, v_cache, k, v, cu_seqlens, lengths, qk_offsets, v_offsets)
        >>> torch.equal(k_cache[0, :3], k[:3]), torch.equal(v_cache[1, 0], v[3])
        (True, True)
        >>> lengths += torch.tensor([3, 1], dtype=torch.int32)   # the caller advances the lengths
    """
    torch.ops.fdc.append_kv(k_cache, v_cache, k, v, cu_seqlens, cache_seqlens, qk_offsets, v_offsets, block_table)


def window_scores(
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    k_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    qk_offsets: torch.Tensor,
    group: int,
    scale: float,
    window: int,
    softcap: float = 0.0,
    noise_state: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """The attention each cached key receives from the last ``window`` queries of a call, summed per KV head: token
    eviction's scores (:mod:`fdc_ops.eviction` turns them into SnapKV's or Keyformer's), in one pass over the keys.

    Request ``b``'s queries are rows ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]`` of ``q``, its cache's last tokens (the
    call appended them). Its last ``taken = min(window, count)`` queries score: query ``i`` of them, at position
    ``p = cache_seqlens[b] - taken + i``, takes each of its KV head's ``G`` query heads' softmax over keys ``0 .. p``
    of ``softcap``-capped logits ``scale * q . k``, or, with ``noise_state``, Keyformer's ``softmax((logits + g) /
    temperature)`` with Gumbel noise ``g = -log(-log u)``; ``scores[b, j, s]`` sums those probabilities over the
    ``G * taken`` rows of KV head ``j``. Request ``b``'s uniforms continue the SFC64 generator from
    ``noise_state[b]``: for each KV head in order, ``G * window * cache_seqlens[b]`` of them in ``(g, step, key)``
    order (all ``window`` steps, scoring or not), each from 32 bits of the 64-bit words (the low half first) as
    ``(bits >> 8) * 2**-24``, clamped to ``[1e-20, 1 - 1e-7]``: the draws of
    ``fdc_ops.eviction.uniforms(numpy.random.SFC64(seed), (G, window, length))`` per head, when ``noise_state[b]``
    is that generator's ``state["state"]["state"]`` (``eviction.noise_state`` builds the tensor).

    CPU only (float32 throughout; logs and exps to about 2 ulp): on CUDA it raises, and ``fdc_ops.eviction``
    scores with torch operations there. Scratch while it runs: the keys in float32, and with noise its 32-bit draws,
    ``4 * G * window * H_kv`` bytes per cached token (the torch path holds twice that in float32 buffers).

    Args:
        q: ``(T, G * qk_offsets[-1])`` packed queries, float32, float16 or bfloat16.
        cu_seqlens_q: ``(B + 1,)`` int32 boundaries of each request's queries in ``q``.
        k_cache: ``(B, S, qk_offsets[-1])`` packed keys (a float cache; dequantize a quantized one first), request
            ``b``'s valid in rows ``[0, cache_seqlens[b])``; nothing past them is read.
        cache_seqlens: ``(B,)`` int32 cached tokens, each at least its request's query count.
        qk_offsets: ``(H_kv + 1,)`` int32 CPU prefix sums of the head widths.
        group: query heads per KV head.
        scale: the softmax scale.
        window: the scoring queries per request (at most the last ``window``).
        softcap: logit soft-capping as in :func:`prefill_attention` (0: none).
        noise_state: ``(B, 4)`` int64 SFC64 states ``(a, b, c, counter)`` for Keyformer's noise, or None for none.
        temperature: the softmax temperature.

    Returns:
        ``(B, H_kv, S)`` float32, zero past each request's length (and for a request with no queries).

    Example (the window's one query sees both keys equally, with group 2 its heads' rows sum to 2)::

        >>> import torch, fdc_ops
        >>> qk_offsets = torch.tensor([0, 8], dtype=torch.int32)
        >>> keys = torch.ones(1, 4, 8)
        >>> fdc_ops.ops.window_scores(torch.ones(1, 16), torch.tensor([0, 1], dtype=torch.int32), keys,
        ...                           torch.tensor([2], dtype=torch.int32), qk_offsets, 2, 0.1, 32)
        tensor([[[1., 1., 0., 0.]]])
    """
    return torch.ops.fdc.window_scores(q, cu_seqlens_q, k_cache, cache_seqlens, qk_offsets, group, scale, window,
                                       softcap, noise_state, temperature)


# The fakes check what the kernels' checks (csrc/checks.h) check without reading values: the shapes that must agree,
# so a compiled graph is refused where it is traced, with the op's own message, instead of when it first runs.


def _check(condition, op: str, message: str) -> None:
    torch._check(condition, lambda: f"fdc::{op}: {message}")


def _check_dims(op: str, **tensors) -> None:
    for name, (tensor, ndim) in tensors.items():
        _check(tensor.dim() == ndim, op, f"{name} must have {ndim} dimensions but got shape {tuple(tensor.shape)}")


def _check_window(op: str, window_left: int) -> None:
    _check(-1 <= window_left < 2**31, op,
           f"window_left must be -1 (no window) or a key count in [0, 2**31) but got {window_left}")


def _check_variant(op: str, q, qk_offsets, group: int, window_left: int, softcap: float, sinks) -> None:
    """The attention variants (checks.h check_attention_variant): window, soft-cap, sinks."""
    _check_window(op, window_left)
    _check(math.isfinite(softcap) and softcap >= 0, op,
           f"softcap must be 0 (no capping) or a positive finite number but got {softcap}")
    if sinks is not None:
        heads = group * (qk_offsets.shape[0] - 1)
        _check(sinks.dtype == torch.float32, op, f"sinks must be float32 but got {sinks.dtype}")
        _check(sinks.device == q.device, op, f"sinks must be on the device of q ({q.device}) but is on {sinks.device}")
        _check(tuple(sinks.shape) == (heads,), op, f"sinks must have shape [{heads}] but got {list(sinks.shape)}")


def _check_rotation_inputs(op: str, x, rot, qk_offsets, group: int) -> None:
    _check_dims(op, x=(x, 3), rot=(rot, 3))
    heads = qk_offsets.shape[0] - 1
    _check(x.shape[1] == group * heads, op, f"x must have group * H_kv = {group} * {heads} heads but got shape "
                                            f"{tuple(x.shape)}")
    _check(rot.shape[0] == heads and rot.shape[1] == x.shape[2], op,
           f"rot must have shape (H_kv={heads}, D={x.shape[2]}, >= max qk dim) but got {tuple(rot.shape)}")


def _packed_rows(op: str, x, out_width):
    """The (T, out_width) output of the rotation ops under fake tensors. The packed width is the data
    group * qk_offsets[-1], which fake tensors do not carry: without out_width it is a dynamic size."""
    if out_width is None:
        return x.new_empty((x.shape[0], torch.library.get_ctx().new_dynamic_size()))
    _check(out_width >= 0, op, f"out_width must be group * qk_offsets[-1] >= 0 but got {out_width}")
    return x.new_empty((x.shape[0], out_width))


@torch.library.register_fake("fdc::rotate_compress")
def _rotate_compress_fake(x, rot, qk_offsets, group, out_width=None):
    _check_rotation_inputs("rotate_compress", x, rot, qk_offsets, group)
    return _packed_rows("rotate_compress", x, out_width)


@torch.library.register_fake("fdc::rope_rotate_compress")
def _rope_rotate_compress_fake(x, cos, sin, rot, qk_offsets, group, out_width=None):
    _check_rotation_inputs("rope_rotate_compress", x, rot, qk_offsets, group)
    _check_dims("rope_rotate_compress", cos=(cos, 2), sin=(sin, 2))
    _check(cos.shape[0] == x.shape[0], "rope_rotate_compress",
           f"cos must have the T={x.shape[0]} rows of x but got shape {tuple(cos.shape)}")
    _check(sin.shape == cos.shape, "rope_rotate_compress",
           f"sin must have the shape of cos {tuple(cos.shape)} but got {tuple(sin.shape)}")
    return _packed_rows("rope_rotate_compress", x, out_width)


@torch.library.register_fake("fdc::prefill_plan")
def _prefill_plan_fake(cu_seqlens_q, cu_seqlens_k, qk_offsets, v_offsets, group, causal, num_workers=None,
                       row_block=DEFAULT_ROW_BLOCK, window_left=-1):
    _check_window("prefill_plan", window_left)
    # The record count depends on the sequence lengths (data), so the whole length is one dynamic size.
    workers = num_workers if num_workers is not None else torch.get_num_threads()
    size = torch.library.get_ctx().new_dynamic_size(min=PREFILL_HEADER + workers + 1)
    return cu_seqlens_q.new_empty((size,), dtype=torch.int32)


@torch.library.register_fake("fdc::prefill_attention")
def _prefill_attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, qk_offsets, v_offsets, group, scale, causal,
                            plan=None, window_left=-1, softcap=0.0, sinks=None, block_table=None):
    op = "prefill_attention"
    _check_variant(op, q, qk_offsets, group, window_left, softcap, sinks)
    rank = 2 if block_table is None else 3
    _check_dims(op, q=(q, 2), k=(k, rank), v=(v, rank), cu_seqlens_q=(cu_seqlens_q, 1),
                cu_seqlens_k=(cu_seqlens_k, 1))
    _check(v.shape[0] == k.shape[0], op, f"v must have the {k.shape[0]} rows of k but got shape {tuple(v.shape)}")
    _check(cu_seqlens_k.shape[0] == cu_seqlens_q.shape[0], op,
           f"cu_seqlens_k must have length {cu_seqlens_q.shape[0]} but got {cu_seqlens_k.shape[0]}")
    if block_table is not None:
        batch = cu_seqlens_q.shape[0] - 1
        _check(block_table.dim() == 2 and block_table.shape[0] == batch, op,
               f"block_table must have shape (B={batch}, max_pages) but got {tuple(block_table.shape)}")
    v_width = data_width(v.shape[1], v_offsets, v.dtype) if block_table is not None else v.shape[-1]
    return q.new_empty((q.shape[0], group * v_width))


def _default_decode_workers(device: torch.device) -> int:
    """The backends' default decode worker count: one per streaming multiprocessor on CUDA, intra-op threads on CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return torch.get_num_threads()


@torch.library.register_fake("fdc::decode_plan")
def _decode_plan_fake(cache_seqlens, qk_offsets, v_offsets, group, num_workers=None, window_left=-1):
    _check_window("decode_plan", window_left)
    workers = num_workers if num_workers is not None else _default_decode_workers(cache_seqlens.device)
    size = decode_plan_size(cache_seqlens.shape[0], qk_offsets.shape[0] - 1, workers)
    return cache_seqlens.new_empty((size,), dtype=torch.int32)


@torch.library.register_fake("fdc::decode_attention")
def _decode_attention_fake(q, k_cache, v_cache, cache_seqlens, qk_offsets, v_offsets, group, scale, plan=None,
                           block_table=None, window_left=-1, softcap=0.0, sinks=None):
    _check_variant("decode_attention", q, qk_offsets, group, window_left, softcap, sinks)
    _check_cache("decode_attention", q.shape[0], k_cache, v_cache, cache_seqlens, block_table)
    _check_dims("decode_attention", q=(q, 2))
    v_width = data_width(v_cache.shape[1] if block_table is not None else v_cache.shape[2], v_offsets, v_cache.dtype)
    return q.new_empty((q.shape[0], group * v_width))


@torch.library.register_fake("fdc::append_kv")
def _append_kv_fake(k_cache, v_cache, k, v, cu_seqlens, cache_seqlens, qk_offsets, v_offsets, block_table=None):
    op = "append_kv"
    _check_dims(op, k=(k, 2), v=(v, 2), cu_seqlens=(cu_seqlens, 1))
    _check(v.shape[0] == k.shape[0], op, f"v must have the {k.shape[0]} rows of k but got shape {tuple(v.shape)}")
    _check_cache(op, cu_seqlens.shape[0] - 1, k_cache, v_cache, cache_seqlens, block_table)
    return None


@torch.library.register_fake("fdc::window_scores")
def _window_scores_fake(q, cu_seqlens_q, k_cache, cache_seqlens, qk_offsets, group, scale, window, softcap=0.0,
                        noise_state=None, temperature=1.0):
    op = "window_scores"
    _check_dims(op, q=(q, 2), k_cache=(k_cache, 3), cu_seqlens_q=(cu_seqlens_q, 1), cache_seqlens=(cache_seqlens, 1))
    batch = k_cache.shape[0]
    _check(cu_seqlens_q.shape[0] == batch + 1 and cache_seqlens.shape[0] == batch, op,
           f"cu_seqlens_q and cache_seqlens must have lengths B + 1 = {batch + 1} and B = {batch} but got "
           f"{cu_seqlens_q.shape[0]} and {cache_seqlens.shape[0]}")
    _check(1 <= window <= 2**20, op, f"window must be in [1, 2**20] queries but got {window}")
    _check(math.isfinite(softcap) and softcap >= 0, op,
           f"softcap must be 0 (no capping) or a positive finite number but got {softcap}")
    _check(math.isfinite(temperature) and temperature > 0, op,
           f"temperature must be a positive finite number but got {temperature}")
    if noise_state is not None:
        _check(tuple(noise_state.shape) == (batch, 4), op,
               f"noise_state must have shape [{batch}, 4] but got {list(noise_state.shape)}")
    return k_cache.new_empty((batch, qk_offsets.shape[0] - 1, k_cache.shape[1]), dtype=torch.float32)


def _check_cache(op: str, batch, k_cache, v_cache, cache_seqlens, block_table) -> None:
    """A contiguous (B, S_max, width) or paged (num_pages, width, page_size) cache of ``batch`` requests."""
    _check_dims(op, k_cache=(k_cache, 3), v_cache=(v_cache, 3), cache_seqlens=(cache_seqlens, 1))
    _check(cache_seqlens.shape[0] == batch, op, f"cache_seqlens must have length {batch} but got "
                                                f"{cache_seqlens.shape[0]}")
    if block_table is None:
        _check(k_cache.shape[0] == batch and v_cache.shape[0] == batch and v_cache.shape[1] == k_cache.shape[1], op,
               f"k_cache and v_cache must have shapes (B={batch}, S_max, width) but got {tuple(k_cache.shape)} and "
               f"{tuple(v_cache.shape)}")
    else:
        _check(block_table.dim() == 2 and block_table.shape[0] == batch, op,
               f"block_table must have shape (B={batch}, max_pages) but got {tuple(block_table.shape)}")
