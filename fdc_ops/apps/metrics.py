"""Accuracy and speed measures of a (compressed) model: perplexity, edit similarity and ROUGE-1 of generations,
time to first token and time between tokens. Compression itself is fdc_ops.hf.compress; these only measure."""

from __future__ import annotations

import math
import random
import re
import statistics
import time
from collections import Counter
from typing import Callable

import torch

from ..defaults import PERPLEXITY_WINDOW
from ..progress import bar as progress_bar

# Where a HumanEval completion ends: the next top-level statement (the canonical solutions are one function body).
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```")




def perplexity(model, token_ids: torch.Tensor, seq_len: int = PERPLEXITY_WINDOW, batch_size: int = 4,
               progress: bool = True, description: str = "perplexity") -> float:
    """exp(mean next-token negative log-likelihood) over consecutive ``seq_len`` windows of the 1-D token stream
    (the first token of each window is context only)."""
    windows = token_ids.numel() // seq_len
    if token_ids.dim() != 1 or windows == 0:
        raise ValueError(f"fdc_ops: perplexity needs a 1-D token stream of at least {seq_len} tokens")
    sequences = token_ids[: windows * seq_len].view(windows, seq_len)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.inference_mode():
        for batch in progress_bar(sequences.split(batch_size), description, "batch", enabled=progress):
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
            total += nll.item()
            count += batch[:, 1:].numel()
    return math.exp(total / count)


def continuation_perplexity(model, windows: torch.Tensor, prompt_tokens: int, batch_size: int = 4,
                            progress: bool = True, description: str = "long-context perplexity") -> float:
    """exp(mean next-token negative log-likelihood) of each window's tokens after its first ``prompt_tokens``, the
    prompt given first, in one call into a fresh cache (where compressed modules evict, when asked to), then the
    rest in one call over that cache: what a request's continuation sees after its prompt was compressed, as the
    FDC paper scores PG-19. windows: (N, prompt_tokens + scored tokens) int64."""
    from transformers import DynamicCache

    from ..hf.compat import cache_keyword

    if windows.dim() != 2 or not 0 < prompt_tokens < windows.shape[1]:
        raise ValueError(f"fdc_ops: continuation_perplexity needs (N, length) windows longer than the "
                         f"{prompt_tokens}-token prompt, got {tuple(windows.shape)}")
    keyword = cache_keyword(model)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.inference_mode():
        for batch in progress_bar(windows.split(batch_size), description, "batch", enabled=progress):
            batch = batch.to(device)
            prompt, scored = batch[:, :prompt_tokens], batch[:, prompt_tokens:]
            cache = DynamicCache()
            first = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{keyword: cache}).logits
            logits = first[:, -1:]  # predicts scored[:, 0]
            if scored.shape[1] > 1:
                later = model(input_ids=scored[:, :-1], use_cache=True, **{keyword: cache}).logits
                logits = torch.cat([logits, later], dim=1)
            nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), scored.flatten(), reduction="sum")
            total += nll.item()
            count += scored.numel()
    return math.exp(total / count)


def retrieval_accuracy(model, tokenizer, fillers: torch.Tensor, seed: int = 0, batch_size: int = 8,
                       progress: bool = True, description: str = "retrieval") -> float:
    """Share of probes answered: in each filler text a sentence stating a random five-digit secret number is put at
    10%, 30% or 50% of its depth, the text ends with the question, and the probe is answered when the greedy
    continuation (left-padded batches through generate(), so compressed modules evict after the prompt as they
    would) starts with the number. What eviction loses that perplexity hides: one fact, seen once, far back.
    fillers: (N, L) token ids, one probe each."""
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    question = tokenizer("\n\nWhat is the secret number? The secret number is", add_special_tokens=False,
                         return_tensors="pt").input_ids[0]
    probes = []
    for filler in fillers:
        number = rng.randrange(10000, 100000)
        fact = tokenizer(f" The secret number is {number}. Remember it.", add_special_tokens=False,
                         return_tensors="pt").input_ids[0]
        depth = int(filler.numel() * rng.choice((0.1, 0.3, 0.5)))
        probes.append((torch.cat([filler[:depth], fact, filler[depth:], question]), str(number)))
    device = next(model.parameters()).device
    answered = 0
    for start in progress_bar(range(0, len(probes), batch_size), description, "batch", enabled=progress):
        batch = probes[start: start + batch_size]
        width = max(ids.numel() for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - prompt.numel():] = prompt
            mask[row, width - prompt.numel():] = 1
        with torch.inference_mode():
            output = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=7,
                                    do_sample=False, pad_token_id=pad)
        answers = tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
        answered += sum(answer.strip().startswith(number) for answer, (_, number) in zip(answers, batch))
    return answered / len(probes)


def edit_similarity(first: str, second: str) -> float:
    """1 - Levenshtein distance / length of the longer string (1.0 for two empty strings)."""
    if not first and not second:
        return 1.0
    previous = list(range(len(second) + 1))
    for i, a in enumerate(first, 1):
        current = [i]
        for j, b in enumerate(second, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a != b)))
        previous = current
    return 1.0 - previous[-1] / max(len(first), len(second))


def rouge1(candidate: str, reference: str) -> float:
    """ROUGE-1 F1: clipped unigram overlap of lower-cased word tokens."""
    words = [Counter(re.findall(r"\w+", text.lower())) for text in (candidate, reference)]
    overlap = sum((words[0] & words[1]).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / sum(words[0].values()), overlap / sum(words[1].values())
    return 2 * precision * recall / (precision + recall)


def truncate_completion(text: str) -> str:
    cut = min((index for index in (text.find(stop) for stop in STOP_SEQUENCES) if index >= 0), default=len(text))
    return text[:cut]


def humaneval_scores(model, tokenizer, problems, max_new_tokens: int = 96, batch_size: int = 8,
                     progress: bool = True, description: str = "HumanEval") -> dict:
    """Greedy completions of HumanEval prompts (left-padded batches through generate()), cut at the next top-level
    statement, against the canonical solutions: mean edit similarity and ROUGE-1, and the completions."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device
    completions = []
    for start in progress_bar(range(0, len(problems), batch_size), description, "batch", enabled=progress):
        prompts = [problem["prompt"] for problem in problems[start: start + batch_size]]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
        new = output[:, inputs["input_ids"].shape[1]:]
        completions.extend(truncate_completion(text) for text in tokenizer.batch_decode(new, skip_special_tokens=True))
    references = [problem["canonical_solution"] for problem in problems]
    return {"edit_similarity": statistics.fmean(map(edit_similarity, completions, references)),
            "rouge1": statistics.fmean(map(rouge1, completions, references)), "completions": completions}


def latency(model, prompt_tokens: int = 512, new_tokens: int = 32, batch: int = 1, repeats: int = 3,
            seed: int = 0) -> dict:
    """Time to first token (one prefill of ``batch`` prompts of ``prompt_tokens``, logits of the last position) and
    time between tokens (median single-token decode step with the cache), in milliseconds, best of ``repeats``."""
    from transformers import DynamicCache

    from ..hf.compat import cache_keyword

    keyword = cache_keyword(model)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_tokens), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(next(model.parameters()).device)
    first, between = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = DynamicCache()
            begin = time.perf_counter()
            logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{keyword: cache}).logits
            first.append(time.perf_counter() - begin)
            token = logits[:, -1].argmax(-1, keepdim=True)
            steps = []
            for _ in range(new_tokens):
                begin = time.perf_counter()
                logits = model(input_ids=token, use_cache=True, **{keyword: cache}).logits
                token = logits[:, -1].argmax(-1, keepdim=True)
                steps.append(time.perf_counter() - begin)
            between.append(statistics.median(steps))
    return {"ttft_ms": 1e3 * min(first), "tbt_ms": 1e3 * min(between), "prompt_tokens": prompt_tokens,
            "batch": batch, "new_tokens": new_tokens}


def best_compression(points, level: float) -> float:
    """The largest compression whose relative score and that of every smaller tried compression are >= level (0 when
    the smallest tried one already falls short): right for a score that is not monotone in the compression.
    points: (compression, relative score) pairs, any order."""
    best = 0.0
    for compression, score in sorted(points):
        if score < level:
            break
        best = compression
    return best


def compression_curve(relative_score: Callable[[float], float], grid, levels=(0.99,), steps: int = 2) -> dict:
    """{compression: relative score} on ``grid``, then for each level ``steps`` bisections between the last
    compression that keeps it (best_compression) and the next one tried."""
    tried = {compression: relative_score(compression) for compression in grid}
    for level in levels:
        for _ in range(steps):
            low = best_compression(tried.items(), level)
            higher = [compression for compression in sorted(tried) if compression > low]
            if not higher:
                break
            middle = (low + higher[0]) / 2
            tried[middle] = relative_score(middle)
    return tried
