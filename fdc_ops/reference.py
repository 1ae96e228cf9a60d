"""Pure-PyTorch references of every fdc op, written for clarity, computed in float64: the oracle of the tests.

Semantics are those documented in fdc_ops/ops.py. Loops over sequences and heads are deliberate: each output
segment is computed from exactly the rows it may read, so unused cache slots (NaN-poisoned in the tests) are never
touched, as the kernels promise. `compute_dtype` (float64 by default) lets the tests measure what PyTorch's own
arithmetic loses at a lower precision on the same inputs, which sets their tolerances.
"""

from __future__ import annotations

import torch

from .eviction import noise_stream, uniforms


def _dims(offsets: torch.Tensor) -> list[int]:
    values = offsets.tolist()
    return [values[j + 1] - values[j] for j in range(len(values) - 1)]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor | None,
            softcap: float = 0.0, sink: float | None = None):
    """softmax(cap(scale * q k^T), masked to `visible`, with a sink logit in the denominator) v in q's dtype; rows that
    see no key give zeros.

    q (s_q, d_qk), k (s_k, d_qk), v (s_k, d_v), visible (s_q, s_k) bool or None (all visible); cap(s) =
    softcap * tanh(s / softcap) when softcap > 0.
    """
    # A fresh copy of q: torch 2.14.1's bfloat16 matmul returned NaN rows on an AMX Xeon for a row slice of a wider
    # tensor whose data did not start on a 64-byte boundary (a float64 reference never takes that path).
    scores = scale * (q.contiguous() @ k.T)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    if scores.shape[1] == 0:
        return q.new_zeros((q.shape[0], v.shape[1]))
    if sink is not None:  # one more logit per row, with no value: the last column's weights are dropped
        scores = torch.cat([scores, scores.new_full((scores.shape[0], 1), sink)], dim=1)
    weights = torch.softmax(scores, dim=1)[:, : k.shape[0]]
    if visible is not None:
        weights = torch.where(visible.any(dim=1, keepdim=True), weights, torch.zeros_like(weights))
    return weights @ v


def _visible(s_q: int, s_k: int, causal: bool, window_left: int) -> torch.Tensor | None:
    """(s_q, s_k) bool: keys each query sees, positions bottom-right aligned (query i at i + s_k - s_q); None: all."""
    if not causal and window_left < 0:
        return None
    position = torch.arange(s_q)[:, None] + (s_k - s_q)
    keys = torch.arange(s_k)[None, :]
    visible = torch.ones((s_q, s_k), dtype=torch.bool)
    if causal:
        visible &= keys <= position
    if window_left >= 0:
        visible &= keys >= position - window_left
    return visible


def _sink(sinks: torch.Tensor | None, head: int) -> float | None:
    return None if sinks is None else float(sinks[head])


def rotate_compress_ref(x: torch.Tensor, rot: torch.Tensor, qk_offsets: torch.Tensor, group: int,
                        compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """x (T, G * H_kv, D), rot (H_kv, D, R_max) -> (T, G * qk_offsets[-1]) in compute_dtype."""
    x, rot = x.to(compute_dtype), rot.to(compute_dtype)
    segments = []
    for j, dim in enumerate(_dims(qk_offsets)):
        for i in range(group):
            segments.append(x[:, j * group + i, :] @ rot[j, :, :dim])
    return torch.cat(segments, dim=1)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rotate-half RoPE (Hugging Face's apply_rotary_pos_emb, partial rotary as in Phi-3) in compute_dtype.

    x (T, heads, D), cos and sin (T, rotary_dim): the first rotary_dim columns are rotated, the rest pass through.
    """
    x, cos, sin = x.to(compute_dtype), cos.to(compute_dtype)[:, None, :], sin.to(compute_dtype)[:, None, :]
    rotary_dim = cos.shape[-1]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotated[..., : rotary_dim // 2], rotated[..., rotary_dim // 2:]
    half_turned = torch.cat([-second, first], dim=-1)
    return torch.cat([rotated * cos + half_turned * sin, passed], dim=-1)


def rope_rotate_compress_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: torch.Tensor,
                             qk_offsets: torch.Tensor, group: int,
                             compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """rotate_compress_ref(rope_ref(x, cos, sin), ...): x (T, G * H_kv, D) pre-RoPE -> (T, G * qk_offsets[-1])."""
    return rotate_compress_ref(rope_ref(x, cos, sin, compute_dtype), rot, qk_offsets, group, compute_dtype)


def prefill_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, qk_offsets, v_offsets, group, scale, causal,
                          window_left: int = -1, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                          block_table: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float64):
    """q (T_q, G * W_qk), k (T_k, W_qk), v (T_k, W_v) -> (T_q, G * W_v) (see ops.prefill_attention); sinks (G * H_kv)
    or None; with block_table (B, max_pages), k and v are a paged cache read from each request's first visible key on
    (earlier pages are never read)."""
    if block_table is not None:
        return _prefill_from_pages(q, k, v, cu_seqlens_q, cu_seqlens_k, qk_offsets, v_offsets, group, scale, causal,
                                   window_left, softcap, sinks, block_table, compute_dtype)
    q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
    qk_dims, v_dims = _dims(qk_offsets), _dims(v_offsets)
    qk_off, v_off = qk_offsets.tolist(), v_offsets.tolist()
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = q.new_zeros((q.shape[0], group * v_off[-1]))
    for b in range(len(cu_q) - 1):
        s_q, s_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if s_q == 0:
            continue
        visible = _visible(s_q, s_k, causal, window_left)
        for j in range(len(qk_dims)):
            keys = k[cu_k[b]:cu_k[b + 1], qk_off[j]:qk_off[j + 1]]
            values = v[cu_k[b]:cu_k[b + 1], v_off[j]:v_off[j + 1]]
            for i in range(group):
                q_col = group * qk_off[j] + i * qk_dims[j]
                o_col = group * v_off[j] + i * v_dims[j]
                queries = q[cu_q[b]:cu_q[b + 1], q_col:q_col + qk_dims[j]]
                out[cu_q[b]:cu_q[b + 1], o_col:o_col + v_dims[j]] = _attend(
                    queries, keys, values, scale, visible, softcap, _sink(sinks, j * group + i))
    return out


def _cache_rows(cache: torch.Tensor, b: int, length: int, col: int, dim: int, block_table: torch.Tensor | None,
                first: int = 0):
    """Rows [first, length) of request b, columns [col, col + dim) of a contiguous or paged cache, as
    (length - first, dim); a paged cache's pages before the one holding row `first` are not read."""
    if block_table is None:
        return cache[b, first:length, col:col + dim]
    page_size = cache.shape[2]
    first_page = first // page_size
    pages = block_table[b, first_page: -(-length // page_size)].tolist() if length > first else []
    if not pages:
        return cache.new_zeros((0, dim))
    # Each page is (width, page_size): its columns [col, col + dim) are rows of the transposed token-major view.
    rows = torch.cat([cache[p, col:col + dim, :].T for p in pages], dim=0)
    return rows[first - first_page * page_size:length - first_page * page_size]


def _prefill_from_pages(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, qk_offsets, v_offsets, group, scale, causal,
                        window_left, softcap, sinks, block_table, compute_dtype):
    """prefill_attention_ref of each request alone, its visible keys gathered from the pages into rows."""
    out = q.new_zeros((q.shape[0], group * v_offsets[-1].item()), dtype=compute_dtype)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    qk_width, v_width = qk_offsets[-1].item(), v_offsets[-1].item()
    for b in range(len(cu_q) - 1):
        s_q, s_k = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if s_q == 0:
            continue
        # The keys before the first query's window are seen by no query: dropping them keeps every query's position
        # if the queries' key count drops with them.
        first = 0 if window_left < 0 else max(0, s_k - s_q - window_left)
        keys = _cache_rows(k_cache, b, s_k, 0, qk_width, block_table, first)
        values = _cache_rows(v_cache, b, s_k, 0, v_width, block_table, first)
        rows = torch.tensor([0, s_q], dtype=torch.int32)
        key_rows = torch.tensor([0, s_k - first], dtype=torch.int32)
        out[cu_q[b]:cu_q[b + 1]] = prefill_attention_ref(
            q[cu_q[b]:cu_q[b + 1]], keys, values, rows, key_rows, qk_offsets, v_offsets, group, scale, causal,
            window_left, softcap, sinks, compute_dtype=compute_dtype)
    return out


def decode_attention_ref(q, k_cache, v_cache, cache_seqlens, qk_offsets, v_offsets, group, scale, block_table=None,
                         window_left: int = -1, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                         compute_dtype: torch.dtype = torch.float64):
    """q (B, G * W_qk) -> (B, G * W_v) (see ops.decode_attention); contiguous or paged caches. Only the visible keys
    of each request (the last window_left + 1 when windowed) are read."""
    q = q.to(compute_dtype)
    qk_dims, v_dims = _dims(qk_offsets), _dims(v_offsets)
    qk_off, v_off = qk_offsets.tolist(), v_offsets.tolist()
    out = q.new_zeros((q.shape[0], group * v_off[-1]))
    for b, length in enumerate(cache_seqlens.tolist()):
        if length == 0:
            continue
        first = 0 if window_left < 0 else max(0, length - 1 - window_left)
        for j in range(len(qk_dims)):
            keys = _cache_rows(k_cache, b, length, qk_off[j], qk_dims[j], block_table)[first:].to(compute_dtype)
            values = _cache_rows(v_cache, b, length, v_off[j], v_dims[j], block_table)[first:].to(compute_dtype)
            for i in range(group):
                q_col = group * qk_off[j] + i * qk_dims[j]
                o_col = group * v_off[j] + i * v_dims[j]
                out[b:b + 1, o_col:o_col + v_dims[j]] = _attend(q[b:b + 1, q_col:q_col + qk_dims[j]], keys, values,
                                                               scale, None, softcap, _sink(sinks, j * group + i))
    return out


def append_kv_ref(k_cache, v_cache, k, v, cu_seqlens, cache_seqlens, block_table=None):
    """New (k_cache, v_cache) with request b's rows k[cu[b]:cu[b+1]] written from position cache_seqlens[b] on."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    cu = cu_seqlens.tolist()
    for b, start in enumerate(cache_seqlens.tolist()):
        for i in range(cu[b + 1] - cu[b]):
            t = start + i
            if block_table is None:
                k_cache[b, t] = k[cu[b] + i]
                v_cache[b, t] = v[cu[b] + i]
            else:
                page_size = k_cache.shape[2]
                page = int(block_table[b, t // page_size])
                k_cache[page, :, t % page_size] = k[cu[b] + i]
                v_cache[page, :, t % page_size] = v[cu[b] + i]
    return k_cache, v_cache


def quantize_kv_ref(x: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x (T, W) as a quantized cache of ``dtype`` stores them (ops.append_kv): (codes (T, W), scales (T, H_kv)),
    both float64. Per row and KV head the scale is the largest magnitude over the format's largest code, rounded to
    float32 as the cache stores it; codes are x / scale, the quotient taken in float32 as the kernels take it (so
    the codes are theirs exactly, ties included), rounded half to even (int8 within +-127, int4's uint8 within +-7)
    or to e4m3's nearest value (within +-448); a head holding a non-finite value gets a NaN scale and zero codes, an
    all-zero one scale 0. The codes are returned one per column, as values (unpacked, for int4)."""
    from .ops import QUANTIZED_CACHE_DTYPES

    code_max = QUANTIZED_CACHE_DTYPES[dtype]
    x = x.double()
    codes, scales = torch.zeros_like(x), x.new_zeros((x.shape[0], offsets.shape[0] - 1))
    bounds = offsets.tolist()
    for j in range(len(bounds) - 1):
        part = x[:, bounds[j]:bounds[j + 1]]
        finite = part.isfinite().all(dim=1)
        scale = (part.abs().amax(dim=1) / code_max).float().double()
        scale = torch.where(finite, scale, torch.nan)
        quotient = part.float() / scale.float()[:, None]
        if dtype in (torch.int8, torch.uint8):
            code = quotient.clamp(-code_max, code_max).round().double()  # torch.round rounds half to even
        else:
            code = quotient.clamp(-448, 448).to(dtype).double()
        codes[:, bounds[j]:bounds[j + 1]] = torch.where((finite & (scale > 0))[:, None], code, 0.0)
        scales[:, j] = scale
    return codes, scales


def unpack_int4_ref(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int4 codes stored two per byte (uint8) along ``dim`` (column 2m in byte m's low nibble, 2m + 1 in its high one,
    two's complement) as one float64 code per column: ``dim`` grows twice as long."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=dim + 1 if dim >= 0 else dim).double()
    codes = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return codes.flatten(dim, dim + 1) if dim >= 0 else codes.flatten(dim - 1, dim)


def dequantize_cache_ref(cache: torch.Tensor, offsets: torch.Tensor, paged: bool = False) -> torch.Tensor:
    """A quantized cache's elements, code * scale, in float64, in the layout of a float cache of the same kind:
    contiguous (B, S_max, W) or, when ``paged``, (num_pages, W, page_size); every slot is converted, written or not.
    An int4 cache (uint8) holds its codes two per byte (unpack_int4_ref)."""
    heads, width = offsets.shape[0] - 1, int(offsets[-1])
    bounds = offsets.tolist()
    int4 = cache.dtype == torch.uint8
    stored = width // 2 if int4 else width  # bytes of codes per row (or byte rows per page)
    if paged:
        num_pages, _, page_size = cache.shape
        codes = unpack_int4_ref(cache[:, :stored], 1) if int4 else cache[:, :width].double()
        scales = cache[:, stored:].reshape(num_pages, 4 * heads * page_size).view(torch.float32)
        scales = scales.reshape(num_pages, heads, page_size).double()
        per_column = torch.cat([scales[:, j:j + 1].expand(-1, bounds[j + 1] - bounds[j], -1) for j in range(heads)], 1)
        return codes * per_column
    codes = unpack_int4_ref(cache[..., :stored], -1) if int4 else cache[..., :width].double()
    scales = cache[..., stored:].contiguous().view(torch.float32).double()  # (B, S_max, H_kv)
    per_column = torch.cat([scales[..., j:j + 1].expand(-1, -1, bounds[j + 1] - bounds[j]) for j in range(heads)], -1)
    return codes * per_column


def window_scores_ref(q, cu_seqlens_q, k_cache, cache_seqlens, qk_offsets, group, scale, policy, softcap=0.0,
                      seed=None, compute_dtype: torch.dtype = torch.float64):
    """fdc_ops.eviction.window_scores, request by request and query head by query head, in compute_dtype. Keyformer's
    noise is drawn as the function draws it (per request, fdc_ops.eviction.noise_stream(seed) draws a (G, window,
    length) float32 uniform tensor u per KV head, in head order; Gumbel noise is -log(-log u)), then used in
    compute_dtype."""
    B, S = k_cache.shape[0], k_cache.shape[1]
    bounds, dims = qk_offsets.tolist(), _dims(qk_offsets)
    window = policy.window
    keyformer = policy.method == "keyformer"
    scores = torch.zeros(B, len(dims), S, dtype=compute_dtype)
    for b in range(B):
        end, length = int(cu_seqlens_q[b + 1]), int(cache_seqlens[b])
        stream = noise_stream(policy.seed if seed is None else seed)
        noise = [uniforms(stream, (group, window, length)) for _ in dims] if keyformer else None
        taken = min(window, end - int(cu_seqlens_q[b]))
        if taken == 0:
            continue
        positions = torch.arange(length - taken, length)
        visible = torch.arange(length)[None, :] <= positions[:, None]  # (taken, length)
        for j, dim in enumerate(dims):
            rows = q[end - taken: end, group * bounds[j]: group * bounds[j + 1]].to(compute_dtype)
            rows = rows.view(taken, group, dim)
            keys = k_cache[b, :length, bounds[j]: bounds[j + 1]].to(compute_dtype)
            total = torch.zeros(length, dtype=compute_dtype)
            for g in range(group):
                logits = scale * (rows[:, g] @ keys.T)
                if softcap > 0:
                    logits = softcap * torch.tanh(logits / softcap)
                logits = logits.masked_fill(~visible, float("-inf"))
                if keyformer:
                    uniform = noise[j][g, window - taken:].to(compute_dtype).clamp(1e-20, 1.0 - 1e-7)
                    logits = (logits - torch.log(-torch.log(uniform))) / policy.temperature
                total += torch.softmax(logits, dim=1).sum(0)
            if keyformer:
                scores[b, j, :length] = total
            else:
                mean, half = total / (taken * group), policy.kernel // 2
                scores[b, j, :length] = torch.stack([mean[max(0, i - half): i + half + 1].max()
                                                     for i in range(length)]) if length else mean
    return scores


def select_tokens_ref(scores, cache_seqlens, policy):
    """fdc_ops.eviction.select_tokens as lists: request b keeps its last min(recent, kept) tokens and the highest
    scores of the others (ties to the earlier token), in increasing order."""
    selections = []
    for b, length in enumerate(cache_seqlens.tolist()):
        kept = policy.kept_tokens(length)
        recent = min(policy.recent_tokens, kept)
        older = sorted(range(length - recent), key=lambda i: (-float(scores[b, i]), i))[: kept - recent]
        selections.append(sorted(older) + list(range(length - recent, length)))
    return selections


def compact_kv_ref(k_cache, v_cache, selections, block_table=None, offsets=None):
    """fdc_ops.eviction.compact_kv on copies of float caches: request b's kept tokens ``selections[b]`` become its
    first tokens; every other slot keeps what it held. Per KV head: ``selections[b][j]`` are head j's tokens, moved
    within its columns, ``offsets`` = (qk_offsets, v_offsets). Returns (k_cache, v_cache)."""
    out = []
    for c, cache in enumerate((k_cache, v_cache)):
        result = cache.clone()
        for b, kept in enumerate(selections):
            if offsets is None:
                heads = [(kept, slice(None))]
            else:
                bounds = offsets[c].tolist()
                heads = [(tokens, slice(bounds[j], bounds[j + 1])) for j, tokens in enumerate(kept)]
            for tokens, columns in heads:
                for i, token in enumerate(tokens):
                    if block_table is None:
                        result[b, i, columns] = cache[b, token, columns]
                    else:
                        page_size = cache.shape[2]
                        source = int(block_table[b, token // page_size])
                        target = int(block_table[b, i // page_size])
                        result[target, columns, i % page_size] = cache[source, columns, token % page_size]
        out.append(result)
    return out[0], out[1]
