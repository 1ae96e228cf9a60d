"""Token eviction simulated on a model's own attention, for selections the packed cache cannot store: each KV head
keeping its own tokens (docs/design.md section 5, "Eviction"). The compressed cache packs every KV head of a token
into one row, so fdc_ops evicts a token from all heads of a layer at once; whether a per-head choice would keep more
accuracy at the same budget is a question this answers without a per-head cache layout.

While ``simulate_eviction(model, policy, per_head)`` is open, a prompt into an empty cache is attended as usual, and
each layer's keys are scored exactly as the compressed modules score them (fdc_ops.eviction.window_scores on the
prompt's last queries, the same Keyformer noise for the same layer), then chosen either once per request for the
whole layer (``per_head=False``: what the compressed cache does, so the simulation can be checked against it) or per
KV head. Later calls attend only to the chosen prompt tokens (plus everything after the prompt) through a per-head
mask; nothing is removed from the cache, so the simulation saves no memory: it measures accuracy only.
"""

from __future__ import annotations

import contextlib

import torch

from .. import eviction as evictions
from ..hf import families


class _Selection:
    """Per layer: (B, H_kv, prompt length) bool of the prompt's keys each KV head still sees."""

    def __init__(self, policy: evictions.EvictionPolicy, per_head: bool):
        self.policy = policy
        self.per_head = per_head
        self.kept: dict[int, torch.Tensor] = {}

    def choose(self, module, query: torch.Tensor, key: torch.Tensor, visible: torch.Tensor, softcap: float,
               scaling: float) -> torch.Tensor:
        """query (B, H, S, D), key (B, H_kv, S, D) of a prompt; visible (B, S, S) bool, left padding allowed.
        Returns (B, H_kv, S) bool: the prompt keys kept."""
        B, H, S, D = query.shape
        H_kv = key.shape[1]
        offsets = torch.arange(H_kv + 1, dtype=torch.int32) * D
        kept = torch.zeros(B, H_kv, S, dtype=torch.bool, device=query.device)
        policy = self.policy
        for b in range(B):
            real = visible[b, -1]  # the last query sees every real token: left padding is a prefix
            length = int(real.sum())
            start = S - length
            if not bool(real[start:].all()):
                raise ValueError("fdc_ops.apps.eviction_simulation: a prompt's padding must be on the left")
            taken = min(policy.window, length)
            rows = query[b, :, S - taken:].transpose(0, 1).reshape(taken, H * D)
            keys = key[b, :, start:].transpose(0, 1).reshape(1, length, H_kv * D)
            lengths = torch.tensor([length], dtype=torch.int32)
            cu = torch.tensor([0, taken], dtype=torch.int32)
            scores = evictions.window_scores(rows, cu, keys, lengths, offsets, H // H_kv, scaling, policy, softcap,
                                             policy.layer_seed(module.layer_idx))[0]  # (H_kv, length)
            if self.per_head:
                index, counts = evictions.select_tokens(scores, lengths.repeat(H_kv), policy, [length] * H_kv)
                for head in range(H_kv):
                    kept[b, head, start + index[head, : counts[head]]] = True
            else:
                index, counts = evictions.select_tokens(scores.sum(0, keepdim=True), lengths, policy, [length])
                kept[b, :, start + index[0, : counts[0]]] = True
        return kept


def _visible(attention_mask: torch.Tensor | None, B: int, T: int, S: int, device) -> torch.Tensor:
    """(B, T, S) bool of the keys each query sees, from the mask transformers built (sdpa or eager style, or None
    for plain causal attention over a cache of S - T earlier tokens)."""
    if attention_mask is None:
        return (torch.arange(S, device=device)[None, :] <= torch.arange(T, device=device)[:, None] + S - T).expand(
            B, T, S)
    mask = attention_mask[:, 0, :, :S]
    return mask if mask.dtype == torch.bool else mask == 0


@contextlib.contextmanager
def simulate_eviction(model, policy: evictions.EvictionPolicy, per_head: bool):
    """Routes ``model``'s attention (a Hugging Face model of a supported family, uncompressed) through the
    simulation while open. Each prompt into an empty cache starts a new selection; the calls after it (a
    continuation, generate()'s steps) see the kept tokens of that prompt."""
    selection = _Selection(policy, per_head)

    def attend(module, query, key, value, attention_mask, original, scaling=None, dropout=0.0, softcap=None,
               **kwargs):
        B, H, T, D = query.shape
        S, H_kv = key.shape[2], key.shape[1]
        scale = scaling if scaling is not None else D ** -0.5
        visible = _visible(attention_mask, B, T, S, query.device)  # (B, T, S)
        if T == S:  # a prompt: it sees all of itself, then its layer's choice is made
            selection.kept[module.layer_idx] = selection.choose(module, query, key, visible, softcap or 0.0, scale)
            allowed = visible[:, None]
        else:
            kept = selection.kept[module.layer_idx]  # (B, H_kv, prompt length)
            seen = torch.ones(B, H_kv, S, dtype=torch.bool, device=query.device)
            seen[:, :, : kept.shape[2]] = kept
            allowed = visible[:, None] & seen.repeat_interleave(H // H_kv, dim=1)[:, :, None]  # (B, H, T, S)
        group = H // H_kv
        keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        logits = torch.matmul(query, keys.transpose(-1, -2)).float() * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(logits, dim=-1).nan_to_num(0.0).to(values.dtype)  # a padded query sees nothing
        return torch.matmul(weights, values).transpose(1, 2).contiguous(), None

    with families.override_attention(model, attend):
        yield selection
