"""Accuracy and speed measures of a (compressed) model: perplexity, edit similarity and ROUGE-1 of generations,
time to first token and time between tokens. Compression itself is fdc_ops.hf.compress; these only measure."""

from __future__ import annotations

import math
import re
import statistics
import time
from collections import Counter
from typing import Callable

import torch

from .progress import bar as progress_bar

# Where a HumanEval completion ends: the next top-level statement (the canonical solutions are one function body).
STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\n```")


def perplexity(model, token_ids: torch.Tensor, seq_len: int = 512, batch_size: int = 4, progress: bool = True,
               description: str = "perplexity") -> float:
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

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, prompt_tokens), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(next(model.parameters()).device)
    first, between = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = DynamicCache()
            begin = time.perf_counter()
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            first.append(time.perf_counter() - begin)
            token = logits[:, -1].argmax(-1, keepdim=True)
            steps = []
            for _ in range(new_tokens):
                begin = time.perf_counter()
                logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
                token = logits[:, -1].argmax(-1, keepdim=True)
                steps.append(time.perf_counter() - begin)
            between.append(statistics.median(steps))
    return {"ttft_ms": 1e3 * min(first), "tbt_ms": 1e3 * min(between), "prompt_tokens": prompt_tokens,
            "batch": batch, "new_tokens": new_tokens}


def search_removal_rate(relative_score: Callable[[float], float], target: float = 0.99, high: float = 0.5,
                        steps: int = 7) -> tuple[float, float, list[tuple[float, float]]]:
    """The largest removal rate whose score, relative to the uncompressed model's (1.0 = no loss), stays at or above
    ``target``, by bisection on [0, high] (the score falls as the rate grows). Returns (rate, its relative score,
    every (rate, score) tried). Rate 0 (no compression) always qualifies."""
    tried = []

    def score(rate: float) -> float:
        value = relative_score(rate)
        tried.append((rate, value))
        return value

    best, best_score = 0.0, 1.0
    high_score = score(high)
    if high_score >= target:
        return high, high_score, tried
    low = 0.0
    for _ in range(steps):
        middle = (low + high) / 2
        value = score(middle)
        if value >= target:
            low, best, best_score = middle, middle, value
        else:
            high = middle
    return best, best_score, tried
