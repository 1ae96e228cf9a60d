"""Tensor parallelism over FDC heads: which KV heads each rank holds, and the head permutation that gives them to it.

A tensor-parallel engine (vLLM) shards attention by heads: rank ``r`` of ``ranks`` holds the contiguous KV heads
``[r * n, (r + 1) * n)`` of every layer, ``n = H_kv / ranks``, with their query heads, and the matching columns of
the output projection. Under FDC the heads of a layer have different widths (``qk_dims[l, j] + v_dims[l, j]``
columns of KV cache per token), so contiguous sharding can give one rank a far wider share of a layer than another.
Two costs follow, both per layer:

- memory: vLLM requires a layer's KV cache spec (its page size) to be the same on every rank, so each layer's page is
  as wide as its widest rank's share, and the narrower ranks leave the rest of theirs unused;
- time: every layer ends in an all-reduce of the output projection, so each layer waits for its slowest rank, and
  attention's cost per token is proportional to the same widths.

Both are set per layer, so heads are balanced per layer, not across layers (a rank light in one layer and heavy in the
next gains nothing). :func:`balance` picks, for every layer, a partition of its KV heads into ``ranks`` sets of ``n``
heads whose widest set is as narrow as possible, and turns it into a permutation ``order[l]`` of the layer's KV heads:
rank ``r`` takes ``order[l, r * n:(r + 1) * n]``. Permuting a checkpoint's heads by ``order`` (rows of W_Q, W_K, W_V
and their biases, columns of W_O, all per-head tensors of the artifact: :func:`permute_heads`,
:func:`permute_artifact`) changes nothing the model computes, since attention is per head and the output projection
sums over heads; the engine's contiguous sharding then hands each rank its balanced set. The allocation's widths are
left as they are: the same model as at one rank, token for token.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from .artifact import FDCArtifact, RankAllocation

# Nodes of the exact search per layer after the greedy start, before the best partition found is kept: layers of up
# to 8 KV heads (at most 105 equal-count partitions) are always searched to the end. Measured on random widths
# (multiples of 8 up to 128, 8 layers): 32 or 64 heads over 8 ranks take about 15 ms a layer and fill 0.970 and 0.991
# of the pages; 200,000 nodes took ten times longer and gained at most 0.002 (16 heads over 4 ranks).
SEARCH_NODES = 20_000


def check_ranks(num_heads: int, num_kv_heads: int, ranks: int) -> None:
    """Raises unless ``ranks`` (the engine's tensor_parallel_size) gives every rank whole KV heads with their query
    heads: FDC's widths are per KV head, and a KV head replicated on several ranks (vLLM's way when ranks > H_kv)
    would make those ranks' caches hold the same widths twice."""
    if ranks < 1:
        raise ValueError(f"fdc_ops.parallel: tensor_parallel_size must be positive, got {ranks}")
    if num_kv_heads % ranks or num_heads % ranks:
        raise ValueError(f"fdc_ops.parallel: tensor_parallel_size={ranks} must divide num_key_value_heads "
                         f"({num_kv_heads}) and num_attention_heads ({num_heads}): each rank holds whole KV heads of "
                         "FDC's per-head widths (replicated KV heads are not supported)")


def _balanced_partition(widths: list[int], ranks: int) -> list[list[int]]:
    """``ranks`` sets of ``len(widths) / ranks`` head indices each whose largest sum of ``widths`` is the smallest
    found: greedy LPT (widest head first, to the narrowest set with room), then a branch-and-bound search that stops
    at a lower bound (the mean, rounded up to the widths' common divisor; the widest head with the narrowest others)
    or after SEARCH_NODES nodes."""
    size = len(widths) // ranks
    heads = sorted(range(len(widths)), key=lambda j: (-widths[j], j))
    sets: list[list[int]] = [[] for _ in range(ranks)]
    sums = [0] * ranks
    for j in heads:
        r = min((r for r in range(ranks) if len(sets[r]) < size), key=lambda r: (sums[r], r))
        sets[r].append(j)
        sums[r] += widths[j]
    best, best_max = [list(s) for s in sets], max(sums)
    # Every set's sum is a multiple of the widths' common divisor (8 for servable widths); some set holds at least the
    # mean, and the widest head's set holds it and size - 1 others, at least the narrowest ones.
    quantum = functools.reduce(math.gcd, widths)
    narrowest = sorted(widths)
    bound = max(-(-sum(widths) // (ranks * quantum)) * quantum, narrowest[-1] + sum(narrowest[:size - 1]))
    if best_max == bound:
        return best

    sets = [[] for _ in range(ranks)]
    sums = [0] * ranks
    nodes = 0

    def search(position: int) -> bool:  # True: stop (the bound is reached or the budget spent)
        nonlocal best, best_max, nodes
        nodes += 1
        if position == len(heads):
            best, best_max = [list(s) for s in sets], max(sums)
            return best_max == bound
        if nodes > SEARCH_NODES:
            return True
        j = heads[position]
        tried = set()
        for r in range(ranks):
            state = (len(sets[r]), sums[r])  # sets in the same state are interchangeable: try one of them
            if len(sets[r]) == size or sums[r] + widths[j] >= best_max or state in tried:
                continue
            tried.add(state)
            sets[r].append(j)
            sums[r] += widths[j]
            stop = search(position + 1)
            sets[r].pop()
            sums[r] -= widths[j]
            if stop:
                return True
        return False

    search(0)
    return best


@dataclass(frozen=True)
class HeadPartition:
    """Which KV heads each of ``ranks`` tensor-parallel ranks holds in every layer, and the KV cache page that vLLM
    needs per layer for it. Widths are those of ``allocation`` (original head order)."""

    order: torch.Tensor  # (L, H_kv) int64: layer l's KV heads as the permuted checkpoint holds them
    ranks: int
    qk_dims: torch.Tensor  # (L, H_kv) int64, original head order
    v_dims: torch.Tensor  # (L, H_kv) int64, original head order

    @property
    def heads_per_rank(self) -> int:
        return self.order.shape[1] // self.ranks

    def heads(self, layer: int, rank: int) -> torch.Tensor:
        """(H_kv / ranks,) int64: the original indices of the KV heads rank ``rank`` holds in layer ``layer``, in the
        order it holds them."""
        n = self.heads_per_rank
        return self.order[layer, rank * n:(rank + 1) * n]

    def _rank_sums(self, dims: torch.Tensor) -> torch.Tensor:  # (L, ranks)
        return dims.gather(1, self.order).view(dims.shape[0], self.ranks, -1).sum(-1)

    @property
    def key_widths(self) -> torch.Tensor:
        """(L, ranks) int64: each rank's sum of qk dims per layer (its K columns per token)."""
        return self._rank_sums(self.qk_dims)

    @property
    def cache_widths(self) -> torch.Tensor:
        """(L, ranks) int64: each rank's sum of qk and v dims per layer (its KV cache columns per token)."""
        return self._rank_sums(self.qk_dims + self.v_dims)

    @property
    def page_widths(self) -> torch.Tensor:
        """(L,) int64: the columns per token of each layer's page on every rank, the widest rank's share (vLLM
        requires one spec per layer for all ranks)."""
        return self.cache_widths.max(1).values

    @property
    def page_key_widths(self) -> torch.Tensor:
        """(L,) int64: the K columns the page spec declares per layer, the most any rank's heads need (the rest of
        the page is declared as V columns)."""
        return self.key_widths.max(1).values

    def bytes_per_token(self, element_size: int) -> int:
        """KV cache bytes per token on each rank: the pages of every layer."""
        return int(self.page_widths.sum()) * element_size

    @property
    def efficiency(self) -> float:
        """Share of the ranks' pages that holds cache, the total width over ranks times the pages' width: 1 when every
        layer splits evenly."""
        return float((self.qk_dims + self.v_dims).sum()) / (self.ranks * float(self.page_widths.sum()))


def balance(qk_dims: torch.Tensor, v_dims: torch.Tensor, ranks: int, num_heads: int | None = None) -> HeadPartition:
    """The per-layer balanced partition of KV heads over ``ranks`` ranks (see the module docstring).

    qk_dims, v_dims: (L, H_kv) widths; num_heads: H, checked for divisibility too when given. Within a rank the heads
    keep their original order, and ranks are ordered by their first head, so a layer whose contiguous split is
    already as balanced as the search finds keeps the identity order."""
    if qk_dims.shape != v_dims.shape or qk_dims.dim() != 2:
        raise ValueError(f"fdc_ops.parallel.balance: qk_dims and v_dims must be (L, H_kv) of one shape, got "
                         f"{tuple(qk_dims.shape)} and {tuple(v_dims.shape)}")
    num_layers, num_kv_heads = qk_dims.shape
    check_ranks(num_kv_heads if num_heads is None else num_heads, num_kv_heads, ranks)
    qk_dims, v_dims = qk_dims.to(torch.int64), v_dims.to(torch.int64)
    widths = (qk_dims + v_dims).tolist()
    n = num_kv_heads // ranks
    order = torch.empty(num_layers, num_kv_heads, dtype=torch.int64)
    for layer in range(num_layers):
        contiguous = max(sum(widths[layer][r * n:(r + 1) * n]) for r in range(ranks))
        sets = _balanced_partition(widths[layer], ranks)
        if max(sum(widths[layer][j] for j in s) for s in sets) >= contiguous:  # no better than the checkpoint's own
            sets = [list(range(r * n, (r + 1) * n)) for r in range(ranks)]
        sets = sorted((sorted(s) for s in sets), key=lambda s: s[0])
        order[layer] = torch.tensor([j for s in sets for j in s])
    return HeadPartition(order, ranks, qk_dims, v_dims)


def permute_heads(tensor: torch.Tensor, order: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``tensor`` with its ``dim`` split into ``len(order)`` equal per-KV-head blocks, the blocks taken in ``order``.

    For one layer: W_Q (H * D, hidden) and its bias (rows of a KV head's G query heads are contiguous), W_K and W_V
    (H_kv * D, hidden) and their biases, with dim=0; W_O (hidden, H * D) with dim=1. order: (H_kv,) int64."""
    blocks = tensor.unflatten(dim, (order.numel(), -1))
    return blocks.index_select(dim, order.to(tensor.device)).flatten(dim, dim + 1)


def permute_allocation(allocation: RankAllocation, order: torch.Tensor) -> RankAllocation:
    """The allocation of the permuted heads: ``order`` (L, H_kv) int64."""
    return dataclasses.replace(allocation, qk_dims=allocation.qk_dims.gather(1, order),
                               v_dims=allocation.v_dims.gather(1, order))


def permute_artifact(artifact: FDCArtifact, order: torch.Tensor) -> FDCArtifact:
    """The artifact of the checkpoint whose KV heads are permuted by ``order`` (L, H_kv) int64: every per-head tensor
    taken in that order. Its fingerprint and identity are still the original checkpoint's (the caller knows the permuted
    one)."""
    layers = torch.arange(order.shape[0]).unsqueeze(1)
    per_head = {field.name: getattr(artifact, field.name)[layers, order] for field in dataclasses.fields(artifact)
                if isinstance(getattr(artifact, field.name), torch.Tensor)}
    return dataclasses.replace(artifact, metadata=dict(artifact.metadata), **per_head)
