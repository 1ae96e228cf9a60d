"""Token eviction on the packed, compressed KV cache (docs/design.md section 5, "Eviction"): after a prompt is
processed, each request keeps a share of its tokens, chosen by a score, and its cache is compacted in place.

Scores come from the attention of the last ``window`` prompt queries (the observation window) over every key of
the request, which the prompt's forward has at hand: no second pass over the prompt, and ``window x length`` work
per head against the prompt's ``length x length``.

- ``"snapkv"`` (SnapKV): each key's attention probability averaged over the window's queries and the KV head's
  query heads, max-pooled over neighbouring keys (``kernel``), so that a kept token keeps its neighbours.
- ``"keyformer"`` (Keyformer, the FDC paper's eviction): Gumbel noise added to the scaled logits before the softmax
  at temperature ``temperature`` (Keyformer's regularisation of the scores of the tokens that remain), the
  probabilities summed over the window's queries and the group's query heads.

Either way the last ``recent`` tokens are always kept, and the rest of the budget goes to the highest scores. By
default one selection serves all KV heads of a layer (the heads' scores summed; each head's probabilities sum to one
per query, so every head weighs the same), and a token is kept or evicted whole. With ``per_head`` each KV head keeps
its own highest-scoring tokens, the same count for every head: a packed row then holds, in each head's columns, that
head's i-th kept token. Decode and later prompts read the rows as before (attention does not ask which token a row
holds: the keys carry their positions' rotation), so the layout and the ops are unchanged; only what needs a row's
token, sliding windows and Palu's key rebuild, must know the positions per head.

Functions here are device-neutral tensor code; they validate their inputs before writing anything, so a refused
call leaves the cache as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy
import torch

METHODS = ("snapkv", "keyformer")


@dataclass(frozen=True)
class EvictionPolicy:
    """What to keep of each request's prompt. ``keep``: share of its tokens kept, in (0, 1] (at least one token);
    ``window``: queries that score (the observation window); ``recent``: last tokens always kept (default: the
    window); ``kernel``: SnapKV's pooling width (odd); ``temperature``: Keyformer's softmax temperature at the
    prompt; ``seed``: Keyformer's noise (fixed, so a run is reproducible); ``per_head``: each KV head keeps its own
    tokens (the same count per head) instead of one choice per layer."""

    method: str
    keep: float
    window: int = 32  # SnapKV's observation window; Keyformer's scores are taken over the same queries
    recent: int | None = None
    kernel: int = 7  # SnapKV's pooling kernel
    temperature: float = 1.0  # Keyformer's tau at the prompt (its schedule starts at 1)
    seed: int = 0
    per_head: bool = False

    def __post_init__(self):
        where = "fdc_ops.eviction.EvictionPolicy"
        if self.method not in METHODS:
            raise ValueError(f"{where}: method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.keep, (int, float)) or not math.isfinite(self.keep) or not 0.0 < self.keep <= 1.0:
            raise ValueError(f"{where}: keep must be a share of the tokens in (0, 1], got {self.keep!r}")
        for name in ("window", "kernel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
        if self.kernel % 2 == 0:
            raise ValueError(f"{where}: kernel must be odd (centred pooling), got {self.kernel}")
        if self.recent is not None and (not isinstance(self.recent, int) or isinstance(self.recent, bool)
                                        or self.recent < 0):
            raise ValueError(f"{where}: recent must be an int >= 0 or None (the window), got {self.recent!r}")
        if not isinstance(self.per_head, bool):
            raise ValueError(f"{where}: per_head must be a bool, got {self.per_head!r}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature <= 0:
            raise ValueError(f"{where}: temperature must be positive, got {self.temperature!r}")

    @property
    def recent_tokens(self) -> int:
        return self.window if self.recent is None else self.recent

    def layer_seed(self, layer: int) -> int:
        """Keyformer's noise seed for decoder layer ``layer``: differs by layer, and repeats run to run."""
        return self.seed * 65537 + layer

    def kept_tokens(self, length: int) -> int:
        """Tokens a request of ``length`` keeps: ceil(keep * length), at least one (none of none)."""
        return min(length, max(1, math.ceil(self.keep * length - 1e-9))) if length > 0 else 0


def window_scores(q: torch.Tensor, cu_seqlens_q: torch.Tensor, k_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                  qk_offsets: torch.Tensor, group: int, scale: float, policy: EvictionPolicy, softcap: float = 0.0,
                  seed: int | None = None) -> torch.Tensor:
    """Per-KV-head scores of every cached key: (B, H_kv, S) float32, zero past each request's length.

    q: (T, G * qk_offsets[-1]) packed queries of the call, request b's at rows [cu_seqlens_q[b], cu_seqlens_q[b+1]),
    which are the last tokens of its cache (the call appended them); k_cache: (B, S, qk_offsets[-1]) packed keys, or
    a quantized cache (B, S, ops.cache_width(qk_offsets, dtype)), scored from its dequantized keys;
    cache_seqlens: (B,) int32 cached tokens; qk_offsets: (H_kv + 1,) int32 CPU; softcap as in prefill_attention;
    seed: Keyformer's noise (default policy.seed). Request b's noise depends on nothing but the seed and its own
    length: uniforms(noise_stream(seed), (G, window, length)) draws its u for each KV head in order, so a request
    scores the same alone and in any batch (and on any device); -log(-log u) is Gumbel(0, 1) noise. On the CPU the
    probabilities are summed by one op (ops.window_scores), elsewhere by torch operations."""
    from . import ops

    where = "fdc_ops.eviction.window_scores"
    _check_rows(where, q, cu_seqlens_q, k_cache, cache_seqlens, qk_offsets, group)
    B, S = k_cache.shape[0], k_cache.shape[1]
    device = q.device
    H_kv = qk_offsets.numel() - 1
    if S == 0:
        return torch.zeros(B, H_kv, S, dtype=torch.float32, device=device)
    if k_cache.dtype in ops.QUANTIZED_CACHE_DTYPES:  # float keys, once for all heads (a prompt's cost, not a step's)
        k_cache = ops.dequantize_rows(k_cache, qk_offsets)
    keyformer = policy.method == "keyformer"
    seed = policy.seed if seed is None else seed
    if device.type == "cpu":
        summed = ops.window_scores(q, cu_seqlens_q, k_cache, cache_seqlens, qk_offsets, group, scale, policy.window,
                                   softcap, *((noise_state(seed, B), policy.temperature) if keyformer else (None, 1.0)))
    else:
        summed = _summed_probabilities(q, cu_seqlens_q, k_cache, cache_seqlens, qk_offsets, group, scale, policy,
                                       softcap, seed)
    lengths = cache_seqlens.to(device=device, dtype=torch.int64)
    if not keyformer:  # SnapKV: the probabilities averaged over the rows that score, then max-pooled over neighbours
        counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(device=device, dtype=torch.int64)
        taken = counts.clamp(1, policy.window).to(torch.float32) * group  # (B,)
        summed = torch.nn.functional.max_pool1d(summed / taken[:, None, None], policy.kernel, stride=1,
                                                padding=policy.kernel // 2)
    keys = torch.arange(S, device=device)
    return torch.where(keys[None, None, :] < lengths[:, None, None], summed, summed.new_zeros(()))


def _summed_probabilities(q: torch.Tensor, cu_seqlens_q: torch.Tensor, k_cache: torch.Tensor,
                          cache_seqlens: torch.Tensor, qk_offsets: torch.Tensor, group: int, scale: float,
                          policy: EvictionPolicy, softcap: float, seed: int) -> torch.Tensor:
    """ops.window_scores composed of torch operations, for the devices it has no kernel on (its arguments, a float
    k_cache, Keyformer's noise when policy.method is "keyformer"): (B, H_kv, S) float32."""
    B, S = k_cache.shape[0], k_cache.shape[1]
    device = q.device
    window = policy.window
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(device=device, dtype=torch.int64)  # (B,)
    steps = torch.arange(window, device=device)
    rows = cu_seqlens_q[1:].to(device=device, dtype=torch.int64)[:, None] - window + steps  # (B, window)
    scoring = steps[None, :] >= window - counts.clamp_max(window)[:, None]  # (B, window): a query of the window
    lengths = cache_seqlens.to(device=device, dtype=torch.int64)
    positions = lengths[:, None] - window + steps  # (B, window): each window query's position among the keys
    keys = torch.arange(S, device=device)
    # Only keys from `first` on can be invisible to a query of the window (causality inside the window, lengths
    # below S): the mask is applied to those columns alone.
    host_lengths = cache_seqlens.tolist()
    first = max(0, min(host_lengths, default=0) - window)
    hidden = (keys[None, None, first:] > positions[:, :, None]) | ~scoring[:, :, None]  # (B, window, S - first)
    queries = q[rows.clamp_min(0).clamp_max(max(q.shape[0] - 1, 0))] if q.shape[0] else q.new_zeros(B, window,
                                                                                                     q.shape[1])
    bounds = qk_offsets.tolist()
    H_kv = len(bounds) - 1
    # Every head's logits in one buffer, so that what follows the products runs once for all heads: (H_kv, B, G *
    # window, S), each head's block contiguous for bmm's out=. The scale goes on the window's queries, a tensor S /
    # dim times smaller than the logits.
    logits = torch.empty(H_kv, B, group * window, S, dtype=torch.float32, device=device)
    for j in range(H_kv):
        dim = bounds[j + 1] - bounds[j]
        q_head = (scale * queries[:, :, group * bounds[j]: group * bounds[j + 1]].float()).view(B, window, group, dim)
        k_head = k_cache[:, :, bounds[j]: bounds[j + 1]].float()  # (B, S, dim)
        torch.bmm(q_head.transpose(1, 2).reshape(B, group * window, dim), k_head.transpose(1, 2), out=logits[j])
    logits = logits.view(H_kv, B, group, window, S)
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    logits[..., first:].masked_fill_(hidden[None, :, None], float("-inf"))
    if policy.method == "keyformer":
        weights, totals = _gumbel_weights(logits, [noise_stream(seed) for _ in host_lengths], host_lengths,
                                          policy.temperature)
    else:
        top = logits.amax(dim=-1, keepdim=True).nan_to_num_(0.0, 0.0, 0.0)
        weights = logits.sub_(top).exp_()
        totals = weights.sum(dim=-1)
    # normalising each row and summing the rows of the queries that score is one product: (H_kv B, 1, G window) x
    # (H_kv B, G window, S)
    row_weight = scoring.to(torch.float32)[:, None, :].expand(B, group, window).reshape(1, B, group * window)
    factors = (row_weight / totals.view(H_kv, B, group * window).clamp_min(1e-30)).view(H_kv * B, 1, group * window)
    summed = torch.bmm(factors, weights.view(H_kv * B, group * window, S))  # (H_kv B, 1, S)
    return summed.view(H_kv, B, S).transpose(0, 1)


def noise_state(seed: int, batch: int) -> torch.Tensor:
    """The SFC64 state of noise_stream(seed), for each of ``batch`` requests: (batch, 4) int64, the form
    ops.window_scores takes (every request's noise starts from the seed)."""
    words = numpy.asarray(noise_stream(seed).state["state"]["state"], dtype=numpy.uint64).view(numpy.int64)
    return torch.from_numpy(words.copy()).expand(batch, 4).contiguous()


def noise_stream(seed: int) -> numpy.random.SFC64:
    """Keyformer's noise for one request: numpy's SFC64 bit generator seeded with ``seed``. On the host whatever
    the device, so a request's noise is the same everywhere."""
    return numpy.random.SFC64(seed)


def uniforms(stream: numpy.random.SFC64, shape: tuple[int, ...]) -> torch.Tensor:
    """The stream's next uniform float32 draws in [0, 1), 24 random bits each (two per 64-bit word), as a CPU tensor
    of ``shape``. A SmolLM2 head's 196K draws took 0.30 ms this way, 0.49 ms through numpy's Generator and 0.70 ms
    from torch's CPU generator (Mersenne Twister), which was 40% of the scoring's time at 2K tokens (2-core Xeon)."""
    count = math.prod(shape)
    words = stream.random_raw((count + 1) // 2).view(numpy.uint32)[:count]
    return torch.from_numpy(((words >> numpy.uint32(8)).astype(numpy.float32) * numpy.float32(2.0 ** -24))
                            .reshape(shape))


def _gumbel_weights(logits: torch.Tensor, generators: list, lengths: list[int],
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised softmax((logits + g) / temperature) over the last dim and its row sums, g = -log(-log u) Gumbel
    noise, computed as exp((logits - max) / temperature) * (-log u)^(-1 / temperature): one log per score where the
    additive form takes two and an exp. logits: (H_kv, B, G, window, S) float32 with -inf where invisible,
    overwritten; u from generators[b] as window_scores says (heads in order). Returns (weights of logits' shape,
    sums (H_kv, B, G, window))."""
    H_kv, B, G, window, S = logits.shape
    uniform = torch.full(logits.shape, 0.5, device=logits.device)  # past a length: never visible
    for b, length in enumerate(lengths):
        for j in range(H_kv):  # a head at a time: one large draw took 2.5x as long, in fresh pages
            uniform[j, b, :, :, :length] = uniforms(generators[b], (G, window, length)).to(logits.device)
    factor = uniform.clamp_(1e-20, 1.0 - 1e-7).log_().neg_()  # -log u in (1e-7, 46): no overflow below
    top = logits.amax(dim=-1, keepdim=True).nan_to_num_(0.0, 0.0, 0.0)  # a row that sees no key: weights 0
    if temperature == 1.0:
        weights = logits.sub_(top).exp_().div_(factor)
    else:
        weights = logits.sub_(top).div_(temperature).exp_().mul_(factor.pow_(-1.0 / temperature))
    return weights, weights.sum(dim=-1)


def select_tokens(scores: torch.Tensor, cache_seqlens: torch.Tensor, policy: EvictionPolicy,
                  host_lengths: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Which tokens each request keeps. scores: (B, S) float (one selection per request: a layer's heads summed);
    cache_seqlens: (B,) int32. Returns (index (B, max kept) int64, kept counts): request b keeps tokens
    index[b, :kept[b]], in increasing order (the rest of its row repeats its last kept token): its last
    ``recent`` tokens, then the highest scores of the others (ties to the earlier token)."""
    where = "fdc_ops.eviction.select_tokens"
    if scores.dim() != 2 or scores.shape[0] != cache_seqlens.numel():
        raise ValueError(f"{where}: scores must be (B, S) with B = cache_seqlens' {cache_seqlens.numel()}, got "
                         f"{tuple(scores.shape)}")
    lengths = cache_seqlens.tolist() if host_lengths is None else list(host_lengths)
    if any(length > scores.shape[1] or length < 0 for length in lengths):
        raise ValueError(f"{where}: cache_seqlens {lengths} exceed the scores' {scores.shape[1]} keys")
    B, S = scores.shape
    device = scores.device
    kept = [policy.kept_tokens(length) for length in lengths]
    recent = torch.tensor([min(policy.recent_tokens, count) for count in kept], device=device)
    length = torch.tensor(lengths, dtype=torch.int64, device=device)
    keys = torch.arange(S, device=device)
    ranked = scores.double().masked_fill(keys[None, :] >= (length - recent)[:, None], float("inf"))
    ranked = ranked.masked_fill(keys[None, :] >= length[:, None], float("-inf"))
    ranked = ranked.masked_fill(torch.isnan(ranked), float("-inf"))
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices  # (B, S)
    width = max(kept, default=0)
    if width == 0:
        return torch.zeros(B, 0, dtype=torch.int64, device=device), kept
    counts = torch.tensor(kept, dtype=torch.int64, device=device)
    taken = torch.arange(width, device=device)[None, :] < counts[:, None]  # (B, width)
    chosen = torch.sort(torch.where(taken, order[:, :width], order.new_full((), S)), dim=1).values
    last = chosen.gather(1, (counts - 1).clamp_min(0)[:, None])  # padding of a row: its last kept token
    return torch.where(taken, chosen, last).clamp_(0, max(S - 1, 0)), kept


def compact_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, index: torch.Tensor,
               kept: list[int], block_table: torch.Tensor | None = None, num_kv_heads: int | None = None,
               qk_offsets: torch.Tensor | None = None, v_offsets: torch.Tensor | None = None) -> None:
    """Keeps request b's tokens index[b, :kept[b]] (increasing) as its first kept[b] tokens, in place, and sets
    cache_seqlens to kept. Contiguous caches (B, S, width), or paged ones (num_pages, width, page_size) with
    block_table (B, max pages) int32, laid out as the ops read them; later appends and attention read the compacted
    cache as any other. Quantized caches (fdc_ops.ops) move each token's codes with its scales: a contiguous row holds
    both; a page keeps its scales apart, in its last 4 * num_kv_heads byte rows, so paged quantized caches need
    ``num_kv_heads``. Everything is checked before anything is written, and the kept rows are read out before any is
    written: a refused call changes nothing, and no kept row is overwritten before it is read.

    Per KV head: index (B, H_kv, max kept), each head's tokens index[b, j, :kept[b]] (the same count for every head)
    moved within that head's columns (and scales), which qk_offsets and v_offsets ((H_kv + 1,) int32 CPU prefix sums,
    as the ops take them) locate."""
    from . import ops

    where = "fdc_ops.eviction.compact_kv"
    B = cache_seqlens.numel()
    if cache_seqlens.dim() != 1 or cache_seqlens.dtype != torch.int32:
        raise ValueError(f"{where}: cache_seqlens must be (B,) int32, got {cache_seqlens.dtype} "
                         f"{tuple(cache_seqlens.shape)}")
    if index.dim() not in (2, 3) or index.shape[0] != B or index.dtype != torch.int64:
        raise ValueError(f"{where}: index must be (B={B}, max kept) or, per KV head, (B, H_kv, max kept) int64, got "
                         f"{index.dtype} {tuple(index.shape)}")
    per_head = index.dim() == 3
    width = index.shape[-1]
    if len(kept) != B or any(count < 0 or count > width for count in kept):
        raise ValueError(f"{where}: kept must be {B} counts within index's {width} columns, got {kept}")
    lengths = cache_seqlens.tolist()
    if any(count > length for count, length in zip(kept, lengths)):
        raise ValueError(f"{where}: kept {kept} exceeds the cached tokens {lengths}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or cache.device != index.device:
            raise ValueError(f"{where}: {name} must be a 3-D cache on index's device, got {tuple(cache.shape)} on "
                             f"{cache.device}")
    quantized = k_cache.dtype in ops.QUANTIZED_CACHE_DTYPES
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{where}: v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    spans = None  # per KV head: for each cache, the head's (first, last) columns of the tensor as moved
    if per_head:
        heads = index.shape[1]
        if num_kv_heads is not None and num_kv_heads != heads:
            raise ValueError(f"{where}: num_kv_heads {num_kv_heads} differs from index's {heads} KV heads")
        num_kv_heads = heads
        spans = [_head_spans(where, name, offsets, heads, cache, block_table is not None)
                 for name, offsets, cache in (("qk_offsets", qk_offsets, k_cache), ("v_offsets", v_offsets, v_cache))]
    scale_rows = 0  # a quantized page's byte rows of scales (none in a contiguous row's layout: they follow the codes)
    if quantized and block_table is not None:
        if num_kv_heads is None or num_kv_heads < 1:
            raise ValueError(f"{where}: paged quantized caches ({k_cache.dtype}) keep each page's scales in its last "
                             f"4 * num_kv_heads byte rows: pass num_kv_heads, got {num_kv_heads}")
        scale_rows = 4 * num_kv_heads  # a float32 per KV head and slot
        if min(k_cache.shape[1], v_cache.shape[1]) <= scale_rows:
            raise ValueError(f"{where}: quantized pages of {num_kv_heads} KV heads need more than {scale_rows} byte "
                             f"rows, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if quantized:  # moved as bytes (torch indexes no float8 on the CPU); views, so written through
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    counts = torch.tensor(kept, device=index.device)
    taken = torch.arange(width, device=index.device)[None, :] < counts[:, None]  # (B, max kept)
    if bool(taken.any()):
        rows_of = index if per_head else index[:, None]  # (B, heads, max kept)
        bound = torch.tensor(lengths, device=index.device)[:, None, None]
        rising = torch.ones_like(rows_of, dtype=torch.bool)
        rising[..., 1:] = rows_of[..., 1:] > rows_of[..., :-1]
        bad = taken[:, None] & ((rows_of < 0) | (rows_of >= bound) | ~rising)
        if bool(bad.any()):
            b, j = (int(x) for x in bad.any(dim=2).nonzero()[0])
            head = f", {j}" if per_head else ""
            raise ValueError(f"{where}: index[{b}{head}, :{kept[b]}] must be increasing token positions below its "
                             f"length {lengths[b]}, got {rows_of[b, j, : kept[b]].tolist()}")
    if block_table is None:
        if k_cache.shape[0] != B or v_cache.shape[0] != B or k_cache.shape[1] != v_cache.shape[1]:
            raise ValueError(f"{where}: contiguous caches must be (B={B}, S, width) with one S, got "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        if width > k_cache.shape[1]:
            raise ValueError(f"{where}: index has {width} columns, the cache {k_cache.shape[1]} rows")
        source = index.clamp(0, max(k_cache.shape[1] - 1, 0))
        # (part of a cache, its kept rows (B, max kept, columns)), every part read whole before any write
        if per_head:
            parts = [cache[:, :, first:last] for cache, head_spans in zip((k_cache, v_cache), spans)
                     for j, columns in enumerate(head_spans) for first, last in columns]
            sources = [source[:, j] for head_spans in spans for j, columns in enumerate(head_spans) for _ in columns]
        else:
            parts, sources = [k_cache, v_cache], [source, source]
        moved = [torch.gather(part, 1, rows[:, :, None].expand(-1, -1, part.shape[2]))
                 for part, rows in zip(parts, sources)]
        for part, rows in zip(parts, moved):
            part[:, :width] = torch.where(taken[:, :, None], rows, part[:, :width])
    else:
        page_size = k_cache.shape[2]
        if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32:
            raise ValueError(f"{where}: block_table must be (B={B}, max pages) int32, got {block_table.dtype} "
                             f"{tuple(block_table.shape)}")
        if v_cache.shape[0] != k_cache.shape[0] or v_cache.shape[2] != page_size:
            raise ValueError(f"{where}: paged caches must be (num_pages, width, page_size) with one page count and "
                             f"size, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        pages_used = [-(-length // page_size) for length in lengths]
        if max(pages_used, default=0) > block_table.shape[1]:
            raise ValueError(f"{where}: block_table has {block_table.shape[1]} pages per request, the lengths "
                             f"{lengths} need {max(pages_used)}")
        table = block_table.to(index.device, torch.int64)
        used = torch.arange(table.shape[1], device=index.device)[None, :] < torch.tensor(pages_used,
                                                                                          device=index.device)[:, None]
        if bool((used & ((table < 0) | (table >= k_cache.shape[0]))).any()):
            raise ValueError(f"{where}: block_table's entries for the cached tokens must be pages in "
                             f"[0, {k_cache.shape[0]})")
        b_rows, i_cols = taken.nonzero(as_tuple=True)
        target_page, target_slot = table[b_rows, i_cols // page_size], i_cols % page_size
        # Per KV head j (one for all heads when shared): the source page and slot of each kept token.
        heads = index.shape[1] if per_head else 1
        sources = [index[b_rows, j, i_cols] if per_head else index[b_rows, i_cols] for j in range(heads)]
        source_at = [(table[b_rows, source // page_size], source % page_size) for source in sources]
        writes = []  # (a view of a cache's columns or scales, its kept tokens' values), all read before any write
        for c, cache in enumerate((k_cache, v_cache)):
            data_rows = cache.shape[1] - scale_rows
            by_slot = cache[:, :data_rows].transpose(1, 2)  # (num_pages, page_size, width): a view, written through
            columns = spans[c] if per_head else [[(0, data_rows)]]
            for j, head_columns in enumerate(columns):
                page, slot = source_at[j]
                for first, last in head_columns:
                    part = by_slot[:, :, first:last]
                    writes.append((part, part[page, slot]))  # (kept tokens, columns)
            if scale_rows:  # (num_pages, H_kv, page_size) float32: a view of the pages' scale rows
                scales = cache[:, data_rows:].reshape(cache.shape[0], scale_rows * page_size).view(torch.float32)
                scales = scales.view(cache.shape[0], num_kv_heads, page_size)
                for j in range(num_kv_heads):
                    page, slot = source_at[j if per_head else 0]
                    part = scales[:, j]
                    writes.append((part, part[page, slot]))  # (kept tokens,)
        for part, rows in writes:
            part[target_page, target_slot] = rows
    cache_seqlens.copy_(torch.tensor(kept, dtype=torch.int32, device=cache_seqlens.device))


def _head_spans(where: str, name: str, offsets, heads: int, cache: torch.Tensor, paged: bool) -> list:
    """For each of ``heads`` KV heads, the (first, last) ranges of a cache's columns (contiguous: the last dim;
    paged: the element rows; bytes for a quantized cache) that hold it: its codes or elements (int4: half the dims),
    and in a contiguous quantized row its float32 scale's 4 bytes after the codes."""
    from . import ops

    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() != heads + 1:
        raise ValueError(f"{where}: per-KV-head compaction needs {name} of {heads + 1} prefix sums, got "
                         f"{None if offsets is None else tuple(offsets.shape)}")
    stored = ops.cache_width(offsets, cache.dtype)
    if cache.shape[1 if paged else 2] != stored:
        raise ValueError(f"{where}: {name} {offsets.tolist()} make {stored} columns per token, the cache has "
                         f"{tuple(cache.shape)}")
    bounds = offsets.tolist()
    per_element = 2 if cache.dtype == torch.uint8 else 1  # int4: two dims per byte
    codes = bounds[-1] // per_element
    spans = []
    for j in range(heads):
        columns = [(bounds[j] // per_element, bounds[j + 1] // per_element)]
        if cache.dtype in ops.QUANTIZED_CACHE_DTYPES and not paged:
            columns.append((codes + 4 * j, codes + 4 * j + 4))
        spans.append(columns)
    return spans


def _check_rows(where: str, q, cu_seqlens_q, k_cache, cache_seqlens, qk_offsets, group) -> None:
    from . import ops

    if qk_offsets.dim() != 1 or qk_offsets.device.type != "cpu":
        raise ValueError(f"{where}: qk_offsets must be a 1-D CPU tensor of prefix sums")
    width = int(qk_offsets[-1])
    stored = ops.cache_width(qk_offsets, k_cache.dtype)  # the width, or a quantized row's codes and scales
    B = cache_seqlens.numel()
    if k_cache.dim() != 3 or k_cache.shape[0] != B or k_cache.shape[2] != stored:
        raise ValueError(f"{where}: k_cache must be (B={B}, S, {stored}), got {tuple(k_cache.shape)}")
    if q.dim() != 2 or q.shape[1] != group * width:
        raise ValueError(f"{where}: q must be (T, group * {width} = {group * width}), got {tuple(q.shape)}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.numel() != B + 1:
        raise ValueError(f"{where}: cu_seqlens_q must be (B + 1 = {B + 1},), got {tuple(cu_seqlens_q.shape)}")
    if int(cu_seqlens_q[-1]) > q.shape[0]:
        raise ValueError(f"{where}: cu_seqlens_q ends at {int(cu_seqlens_q[-1])}, past q's {q.shape[0]} rows")
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).cpu()
    if bool((counts < 0).any()) or bool((counts > cache_seqlens.cpu()).any()):
        raise ValueError(f"{where}: each request's queries must be its last cached tokens: query counts "
                         f"{counts.tolist()}, cached {cache_seqlens.tolist()}")
    if cache_seqlens.numel() and int(cache_seqlens.max()) > k_cache.shape[1]:
        raise ValueError(f"{where}: cache_seqlens exceed k_cache's {k_cache.shape[1]} rows")


