"""``python -m fdc_ops eval``: accuracy against KV compression on the bundled SmolLM2-135M, side by side, through the
same modules (fdc_ops.hf.compress) and operators:

- ``FDC (paper)``: the paper's rule (one singular-value removal rate for every head, searched to the byte budget)
  with the V basis from the activations;
- ``FDC (defaults)``: this package's defaults (output-aware V factors from the attention outputs, widths from the
  measured sensitivities by an exact knapsack over the byte budget);
- ``uniform ranks``: one Q/K width and one V width for every head (the paper's /AC ablation), default artifact;
- ``Palu``: Palu as Palu builds it: low-rank K latent before RoPE and V from the whitened SVD (principal axes of the
  keys and values), widths by its Fisher-information rank search.

All are calibrated on the same text (``--text``: windows of documents spread over the bundled Wikipedia stream, the
held-out tail excluded). For each method and metric (perplexity on held-out Wikipedia, scored as ``exp(-NLL)``, so
99% of the score allows about 1% more perplexity; edit similarity of greedy HumanEval completions), the score
relative to the uncompressed model is measured on a grid of compressions from 0 to 0.5, then refined by bisection
around each accuracy level of ``--refine``. A score need not fall monotonically with compression (HumanEval edit
similarity visibly does not), so the compression reported for a level is the largest tried compression whose score,
and the score of every smaller tried compression, stay at or above it: never one that only bisection's monotonicity
assumption would give.

Eviction (``--metric long_perplexity``: the perplexity score of 256 held-out tokens after a 1536-token prompt of the
same article, the prompt's cache compressed and evicted before the continuation is scored, as the FDC paper scores
PG-19): ``Keyformer`` alone (every layer keeps a share of each prompt's tokens, chosen by Keyformer's scores; the
modules at full width, which compute what the original model computes), and the paper's combinations ``KF-F`` and
``KF-P``, eviction and FDC (or Palu) each contributing half of the total compression (both keep sqrt(1 - c) of what
they act on); ``SnapKV`` and ``SnapKV-F`` the same with SnapKV's scores; ``... per head``: each KV head keeping its own
tokens (EvictionPolicy.per_head; by default one choice serves a layer's heads), and ``... per KV head (simulated)`` the
same simulated on the uncompressed model's attention. A point's compression is the share of the prompt's KV bytes
removed. ``--metric retrieval`` asks for a number stated once early in a held-out text of 1400 tokens (what eviction
loses that perplexity hides); the same methods run on it. Quantized caches (``KVQ int8`` / ``KVQ e4m3`` / ``KVQ
int4`` alone at full widths, ``KVQ-F ...`` under FDC's widths, ``KVQ-P ...`` under Palu's, ``KF-KVQ-F int8`` /
``KF-KVQ-P int8`` all three stacked with Keyformer eviction, ``SnapKV-KVQ-F int8`` / ``SnapKV-KVQ-P int8`` with
SnapKV's) run on both long-context metrics too; their compression
counts the cache's bytes (a byte, or half of one for int4, per element, and its scales) against a 16-bit cache. Other
formats below 8 bits are simulated (``... (simulated)``, apps/quantization_simulation.py), to choose by measurement.

Every evaluation is appended to ``<out>/<model>-eval-<metric>-points.json`` as it finishes (keyed by the widths, so
an interrupted run resumes and equal allocations are measured once, and tagged with its artifact's calibration
settings, so a point of an artifact calibrated differently since is measured again); each run rewrites the curves,
JSON and PNG, from all points so far.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import time
from pathlib import Path

import torch

from .. import calibration, datasets, files, hf
from .. import eviction as evictions
from ..calibration import RankAllocation
from ..hf import families, loading
from . import metrics, provenance
from .eviction_simulation import simulate_eviction
from .metrics import best_compression
from .quantization_simulation import QuantizationScheme, simulate_quantization

METHODS = {
    "FDC (paper)": {"artifact": "activation", "rule": "singular_value"},
    "FDC (defaults)": {"artifact": "default"},
    "uniform ranks": {"artifact": "default", "uniform": True},
    "Palu": {"artifact": "default", "method": "palu"},
}
# The measurements behind the defaults (bench/results/eval/README.md): the other V factors (the values' principal
# axes, the output-aware pair from the values' covariance) against the default, each with the sensitivity allocation.
ABLATIONS = {
    "activation V, sensitivity": {"artifact": "activation"},
    "output V, sensitivity": {"artifact": "output"},
    "FDC, 1024-token calibration": {"artifact": "short windows"},  # the default before: positions past 1024 unseen
}
# Token eviction, alone (its whole compression from evicting) and with FDC or Palu (half from each): long_perplexity
EVICTION = {
    "Keyformer": {"artifact": "default", "eviction": "keyformer", "split": "eviction"},
    "KF-F": {"artifact": "default", "eviction": "keyformer", "split": "equal"},
    "KF-P": {"artifact": "default", "method": "palu", "eviction": "keyformer", "split": "equal"},
    "SnapKV": {"artifact": "default", "eviction": "snapkv", "split": "eviction"},
    "SnapKV-F": {"artifact": "default", "eviction": "snapkv", "split": "equal"},
    "KF-F, 1024-token calibration": {"artifact": "short windows", "eviction": "keyformer", "split": "equal"},
    # each KV head keeping its own tokens, which the packed cache cannot store: measured by simulation on the
    # uncompressed model (apps/eviction_simulation.py), against the shared choice of "Keyformer" and "SnapKV"
    "Keyformer per KV head (simulated)": {"artifact": "default", "eviction": "keyformer", "split": "eviction",
                                          "simulate": "per_head"},
    "SnapKV per KV head (simulated)": {"artifact": "default", "eviction": "snapkv", "split": "eviction",
                                       "simulate": "per_head"},
    # the same in the compressed cache (EvictionPolicy.per_head: each head's columns of a row hold its own tokens)
    "SnapKV per head": {"artifact": "default", "eviction": "snapkv", "split": "eviction", "per_head": True},
    "SnapKV-F per head": {"artifact": "default", "eviction": "snapkv", "split": "equal", "per_head": True},
    "Keyformer per head": {"artifact": "default", "eviction": "keyformer", "split": "eviction", "per_head": True},
    "KF-F per head": {"artifact": "default", "eviction": "keyformer", "split": "equal", "per_head": True},
    "KF-P per head": {"artifact": "default", "method": "palu", "eviction": "keyformer", "split": "equal",
                      "per_head": True},
}
# Quantized caches (fdc_ops.ops: a byte, or half a byte for int4, per element and a float32 scale per token and KV
# head), alone (full widths) and under FDC's widths (the paper's KVQ-F) or Palu's (KVQ-P: its key latent quantized),
# on the long-context metrics, where later tokens read the cache (the perplexity metric's one call never does). Their
# compression counts bytes against a 16-bit cache.
QUANTIZATION = {
    "KVQ int8": {"artifact": "default", "kv_dtype": "int8", "uniform": True, "fixed": True},
    "KVQ-F int8": {"artifact": "default", "kv_dtype": "int8"},
    "KVQ e4m3": {"artifact": "default", "kv_dtype": "float8_e4m3fn", "uniform": True, "fixed": True},
    "KVQ-F e4m3": {"artifact": "default", "kv_dtype": "float8_e4m3fn"},
    "KVQ-P int8": {"artifact": "default", "kv_dtype": "int8", "method": "palu"},
    "KVQ int4": {"artifact": "default", "kv_dtype": "int4", "uniform": True, "fixed": True},
    "KVQ-F int4": {"artifact": "default", "kv_dtype": "int4"},
    "KVQ-P int4": {"artifact": "default", "kv_dtype": "int4", "method": "palu"},
    # all three stacked: int8 takes its own share, then Keyformer's (SnapKV's) eviction and FDC's (Palu's) widths half
    # each of the rest (stacked_budgets)
    "KF-KVQ-F int8": {"artifact": "default", "kv_dtype": "int8", "eviction": "keyformer"},
    "KF-KVQ-P int8": {"artifact": "default", "kv_dtype": "int8", "eviction": "keyformer", "method": "palu"},
    "SnapKV-KVQ-F int8": {"artifact": "default", "kv_dtype": "int8", "eviction": "snapkv"},
    "SnapKV-KVQ-P int8": {"artifact": "default", "kv_dtype": "int8", "eviction": "snapkv", "method": "palu"},
}
# Candidate formats below 8 bits, simulated (apps/quantization_simulation.py: rows quantized and dequantized as they
# are cached, bytes counted as the format would store them) to choose the 4-bit format by measurement; "rotated":
# mixed as hf.compress mixes a quantized cache, so "KVQ int8 rotated (simulated)" checks the simulation against the
# real "KVQ int8", and "KVQ int8 (simulated)" is int8 without the mixing.
SIMULATED_QUANTIZATION = {
    "KVQ int8 (simulated)": {"artifact": "default", "scheme": QuantizationScheme(key_bits=8, value_bits=8),
                             "uniform": True, "fixed": True},
    "KVQ int4 (simulated)": {"artifact": "default", "scheme": QuantizationScheme(), "uniform": True, "fixed": True},
    "KVQ int4 keys equalised (simulated)": {"artifact": "default", "scheme": QuantizationScheme(equalise="keys"),
                                            "uniform": True, "fixed": True},
    "KVQ int4 equalised (simulated)": {"artifact": "default", "scheme": QuantizationScheme(equalise="both"),
                                       "uniform": True, "fixed": True},
    "KVQ int4 KIVI (simulated)": {"artifact": "default", "scheme": QuantizationScheme(keys="channel"),
                                  "uniform": True, "fixed": True},
    "KVQ int4 sinks (simulated)": {"artifact": "default", "scheme": QuantizationScheme(sinks=4), "uniform": True,
                                   "fixed": True},
    "KVQ K4 (simulated)": {"artifact": "default", "scheme": QuantizationScheme(value_bits=16), "uniform": True,
                           "fixed": True},
    "KVQ V4 (simulated)": {"artifact": "default", "scheme": QuantizationScheme(key_bits=16), "uniform": True,
                           "fixed": True},
    "KVQ K8 V4 (simulated)": {"artifact": "default", "scheme": QuantizationScheme(key_bits=8), "uniform": True,
                              "fixed": True},
    "KVQ K4 rotated (simulated)": {"artifact": "default", "scheme": QuantizationScheme(value_bits=16, rotate="keys"),
                                   "uniform": True, "fixed": True},
    "KVQ V4 rotated (simulated)": {"artifact": "default", "scheme": QuantizationScheme(key_bits=16, rotate="both"),
                                   "uniform": True, "fixed": True},
    "KVQ K4 KIVI V8 (simulated)": {"artifact": "default", "scheme": QuantizationScheme(keys="channel", value_bits=8),
                                   "uniform": True, "fixed": True},
    "KVQ int8 rotated (simulated)": {"artifact": "default",
                                     "scheme": QuantizationScheme(key_bits=8, value_bits=8, rotate="both"),
                                     "uniform": True, "fixed": True},
    "KVQ int4 rotated (simulated)": {"artifact": "default", "scheme": QuantizationScheme(rotate="both"),
                                     "uniform": True, "fixed": True},
    "KVQ-F int4 rotated (simulated)": {"artifact": "default", "scheme": QuantizationScheme(rotate="both")},
    "KVQ K4 rotated V8 (simulated)": {"artifact": "default",
                                      "scheme": QuantizationScheme(value_bits=8, rotate="keys"), "uniform": True,
                                      "fixed": True},
}
LONG_CONTEXT_METHODS = ("FDC (defaults)", "Palu", "Keyformer", "KF-F", "KF-P")  # the paper's combination table
LONG_PROMPT, LONG_SCORED = 1536, 256  # tokens of each window's prompt and of its scored continuation
RETRIEVAL_TOKENS = 1400  # held-out text around each retrieval probe's fact (about 1430 tokens with the question)
# load_or_calibrate's settings beyond the text, per artifact a method names
ARTIFACTS = {"default": {}, "activation": {"v_method": "activation"}, "output": {"v_method": "output"},
             "short windows": {"seq_len": 1024}}
GRID = (0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)  # dense where 99% is decided, to 0.5
LEVELS = tuple(round(0.90 + 0.01 * i, 2) for i in range(10))  # accuracy levels tabulated: 0.90 .. 0.99
LONG_GRID = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # eviction reaches far higher compressions
METRICS = ("perplexity", "edit_similarity", "long_perplexity", "retrieval")
LONG_CONTEXT_METRICS = ("long_perplexity", "retrieval")  # where a prompt is long enough to evict from


def quantized_compression(dimension_compression: float, head_dim: int, bits: int = 8) -> float:
    """The share of a 16-bit cache's bytes a quantized cache of ``bits`` per element (fdc_ops.ops: 8, or 4 for int4)
    removes at these widths: per token and KV head, (1 - c) 2D elements of bits / 8 bytes plus 4 scale bytes for K
    and for V, against 2D elements of two bytes: 1 - (1 - c) bits / 16 - 2 / D."""
    return 1.0 - (1.0 - dimension_compression) * bits / 16.0 - 2.0 / head_dim


def quantized_dimension_budget(compression: float, head_dim: int, bits: int = 8) -> float:
    """The dimension compression whose quantized cache of ``bits`` per element removes ``compression`` of the 16-bit
    bytes (the inverse of quantized_compression), 0 below what quantization alone removes."""
    return max(0.0, 1.0 - 16.0 / bits * (1.0 - compression - 2.0 / head_dim))


def stacked_budgets(compression: float, head_dim: int, bits: int = 8) -> tuple[float, float]:
    """(dimension compression, share of tokens eviction keeps) for all three compressions stacked to remove
    ``compression`` of the 16-bit bytes: quantization alone removes quantized_compression(0); eviction and the widths
    then keep the same share s of what is left each, s^2 = (1 - compression) / (1 - quantization alone), the widths'
    share counted in quantized bytes (scales included). Below quantization alone: full widths, every token."""
    alone = quantized_compression(0.0, head_dim, bits)
    share = math.sqrt(min(1.0, (1.0 - compression) / (1.0 - alone)))
    return quantized_dimension_budget(1.0 - share * (1.0 - alone), head_dim, bits), share


def scheme_dimension_budget(scheme: QuantizationScheme, compression: float, head_dim: int, tokens: int) -> float:
    """The dimension compression whose cache in the simulated format ``scheme`` removes ``compression`` of a
    ``tokens``-token request's 16-bit bytes (both halves at the same width), 0 below what the format alone removes."""
    def removed(dims: float) -> float:
        width = (1.0 - dims) * head_dim
        return scheme.compression(width, width, head_dim, tokens)

    low, high = 0.0, 1.0 - 1.0 / head_dim
    if removed(low) >= compression:
        return 0.0
    for _ in range(60):  # bisection on a monotone function, to well below one width quantum
        middle = (low + high) / 2
        low, high = (middle, high) if removed(middle) < compression else (low, middle)
    return high


def uniform_allocation(shape, compression: float, multiple: int = 8) -> RankAllocation:
    """One Q/K width and one V width for all heads, the widest pair within the byte budget; when the pair's total is
    an odd number of quanta, V (the more fragile half on this model) gets the extra quantum."""
    D = shape.head_dim
    pair = int((1.0 - compression) * 2 * D + 1e-9) // multiple * multiple
    v = min(D, -(-pair // (2 * multiple)) * multiple)
    qk = max(multiple, pair - v)
    dims = torch.full((shape.num_layers, shape.num_kv_heads), qk, dtype=torch.int64)
    return RankAllocation(dims, torch.full_like(dims, v), D, "uniform", None, {"compression_target": compression})


def calibration_tag(settings: dict) -> str:
    """What a measured point carries of its artifact: a hash of the artifact's calibration settings and fitted V-to-Q/K
    balance, not of the losses the fit measured (they differ in the last bits with the thread count; a point's widths
    are checked separately, by its key)."""
    settings = dict(settings)
    if isinstance(settings.get("balance"), dict):
        settings["balance"] = {k: v for k, v in settings["balance"].items() if k != "measured_nll"}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def _key(name: str, allocation: RankAllocation) -> str:
    widths = torch.cat([allocation.qk_dims.flatten(), allocation.v_dims.flatten()]).tolist()
    tag = f"{name}|{widths}"
    return hashlib.sha256(tag.encode()).hexdigest()[:16]


def run(out: str = "bench/results/eval", metric: str = "perplexity", text: str = "wikipedia",
        methods: tuple[str, ...] | None = None, refine: tuple[float, ...] = (0.99, 0.9), refine_steps: int = 3,
        eval_tokens: int = 4096, problems: int = 16, max_new_tokens: int = 64, budget_s: float | None = None,
        grid: tuple[float, ...] | None = None, windows: int = 16, scored_text: str = "wikipedia") -> dict:
    """Measures what is missing (see the module docstring), for at most ``budget_s`` seconds of evaluations, and
    writes the curves. ``grid``: the budgets measured before refinement (default GRID; LONG_GRID for
    the long-context metrics); ``windows``: held-out windows of the long-context metrics (retrieval: one probe
    each). ``scored_text``: the text long_perplexity scores, ``wikipedia`` (its held-out tail) or ``humaneval``
    (code, a domain the default calibration never reads: windows of its programs in a row, datasets.unseen_windows;
    results then go to files named with it). Returns the results dictionary."""
    if metric not in METRICS:
        raise ValueError(f"fdc_ops.apps.eval.run: metric must be one of {METRICS}, got {metric!r}")
    if scored_text not in datasets.DOCUMENTS:
        raise ValueError(f"fdc_ops.apps.eval.run: scored_text must be one of {list(datasets.DOCUMENTS)}, got "
                         f"{scored_text!r}")
    if scored_text != "wikipedia" and (metric != "long_perplexity" or scored_text == text):
        raise ValueError(f"fdc_ops.apps.eval.run: scored_text={scored_text!r} is for the long_perplexity metric of "
                         f"a model calibrated on another text (a domain calibration never read), got metric "
                         f"{metric!r} and calibration text {text!r}")
    long_context = metric in LONG_CONTEXT_METRICS
    grid = tuple(grid or (LONG_GRID if long_context else GRID))
    if not grid or any(not 0.0 < budget < 1.0 for budget in grid):
        raise ValueError(f"fdc_ops.apps.eval.run: grid must be budgets in (0, 1), got {grid}")
    table = {**METHODS, **ABLATIONS, **EVICTION, **QUANTIZATION, **SIMULATED_QUANTIZATION}
    methods = tuple(methods or (LONG_CONTEXT_METHODS if long_context else METHODS))
    unknown = [name for name in methods if name not in table]
    if unknown:
        raise ValueError(f"fdc_ops.apps.eval.run: unknown methods {unknown}; known: {list(table)}")
    evicting = [name for name in methods if "eviction" in table[name]]
    if evicting and not long_context:
        raise ValueError(f"fdc_ops.apps.eval.run: {evicting} evict after a prompt, which only the long-context "
                         f"metrics have; run them with metric in {LONG_CONTEXT_METRICS}")
    quantizing = [name for name in methods if "kv_dtype" in table[name] or "scheme" in table[name]]
    if quantizing and not long_context:
        raise ValueError(f"fdc_ops.apps.eval.run: {quantizing} quantize the cache, which the {metric} metric never "
                         f"reads (one call per window); run them with metric in {LONG_CONTEXT_METRICS}")
    begin = time.time()
    torch.manual_seed(0)
    model, tokenizer = loading.load_model()
    shape = families.attention_shape(model)
    artifacts = {name: calibration.load_or_calibrate(model, tokenizer, text=text, **ARTIFACTS[name])
                 for name in sorted({table[method]["artifact"] for method in methods})}
    calibrations = {name: calibration_tag(artifact.metadata["calibration"]) for name, artifact in artifacts.items()}
    wiki = datasets.text_tokens(tokenizer, "wikipedia")[-eval_tokens:]
    tasks = list(datasets.humaneval_problems()[:problems])
    long_windows = None
    if long_context:
        length = LONG_PROMPT + LONG_SCORED if metric == "long_perplexity" else RETRIEVAL_TOKENS
        take = datasets.held_out_windows if scored_text == "wikipedia" else datasets.unseen_windows
        long_windows = take(*datasets.text_documents(tokenizer, scored_text), windows, length)

    def measure() -> float:
        if metric == "perplexity":
            return 1.0 / metrics.perplexity(model, wiki, progress=False)  # exp(-mean NLL): higher is better
        if metric == "long_perplexity":
            return 1.0 / metrics.continuation_perplexity(model, long_windows, LONG_PROMPT, progress=False)
        if metric == "retrieval":
            return metrics.retrieval_accuracy(model, tokenizer, long_windows, progress=False)
        scores = metrics.humaneval_scores(model, tokenizer, tasks, max_new_tokens=max_new_tokens, progress=False)
        return scores["edit_similarity"]

    def calibration_texts() -> list[torch.Tensor]:  # what a simulated format's channel statistics are measured on
        return datasets.calibration_windows(*datasets.text_documents(tokenizer, text), 4, 1024)

    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    model_name = "smollm2"
    stem = f"{model_name}-eval-{metric}" + ("" if scored_text == "wikipedia" else f"-{scored_text}")
    points_path = directory / f"{stem}-points.json"
    settings_tag = {"metric": metric, "text": text, "eval_tokens": eval_tokens, "problems": problems,
                    "max_new_tokens": max_new_tokens, "fingerprint": families.fingerprint(model)}
    if long_context:  # what the other metrics' settings would be is irrelevant to it
        settings_tag = {"metric": metric, "text": text, "windows": windows, "fingerprint": families.fingerprint(model),
                        **({"prompt_tokens": LONG_PROMPT, "scored_tokens": LONG_SCORED}
                           if metric == "long_perplexity" else {"filler_tokens": RETRIEVAL_TOKENS}),
                        **({} if scored_text == "wikipedia" else {"scored_text": scored_text})}
    store = _read_points(points_path)
    if store.get("settings") != settings_tag:
        store = {"settings": settings_tag, "base": None, "points": {}}
    if store["base"] is None:
        store["base"] = measure()
        if store["base"] <= 0:
            raise RuntimeError(f"fdc_ops.apps.eval.run: the uncompressed model scores {store['base']} on {metric}; "
                               "nothing can be measured relative to it")
        files.write_json_atomically(points_path, store, indent=1)
    base = store["base"]

    def allocation_for(settings: dict, compression: float) -> RankAllocation:
        if settings.get("uniform") or compression == 0.0:
            return uniform_allocation(shape, compression)
        artifact = artifacts[settings["artifact"]]
        return artifact.allocate(compression=compression, rule=settings.get("rule"),
                                 method=settings.get("method", "fdc"))

    def plan(settings: dict, compression: float):
        """(allocation, eviction policy or None, total compression of the prompt's KV bytes) for a budget."""
        split = settings.get("split")
        if "kv_dtype" in settings:
            bits = 4 if settings["kv_dtype"] == "int4" else 8
            if "eviction" in settings:
                needed, share = stacked_budgets(compression, shape.head_dim, bits)
                allocation = allocation_for(settings, needed)
                policy = evictions.EvictionPolicy(settings["eviction"], keep=share,
                                                  per_head=settings.get("per_head", False))
                prompt = LONG_PROMPT if metric == "long_perplexity" else RETRIEVAL_TOKENS
                kept = policy.kept_tokens(prompt) / prompt
                return allocation, policy, 1.0 - kept * (1.0 - quantized_compression(allocation.compression_rate,
                                                                                     shape.head_dim, bits))
            needed = 0.0 if settings.get("fixed") else quantized_dimension_budget(compression, shape.head_dim, bits)
            allocation = allocation_for(settings, needed)
            return allocation, None, quantized_compression(allocation.compression_rate, shape.head_dim, bits)
        if "scheme" in settings:
            scheme, prompt = settings["scheme"], LONG_PROMPT if metric == "long_perplexity" else RETRIEVAL_TOKENS
            needed = 0.0 if settings.get("fixed") else scheme_dimension_budget(scheme, compression, shape.head_dim,
                                                                                prompt)
            allocation = allocation_for(settings, needed)
            widths = (float(allocation.qk_dims.double().mean()), float(allocation.v_dims.double().mean()))
            return allocation, None, scheme.compression(*widths, shape.head_dim, prompt)
        if split is None:
            allocation = allocation_for(settings, compression)
            return allocation, None, allocation.compression_rate
        share = 1.0 - compression if split == "eviction" else math.sqrt(1.0 - compression)  # kept by eviction
        allocation = allocation_for(settings, 0.0 if split == "eviction" else 1.0 - share)
        policy = evictions.EvictionPolicy(settings["eviction"], keep=share, per_head=settings.get("per_head", False))
        prompt = LONG_PROMPT if metric == "long_perplexity" else RETRIEVAL_TOKENS
        kept = policy.kept_tokens(prompt) / prompt
        return allocation, policy, 1.0 - (1.0 - allocation.compression_rate) * kept

    class OutOfTime(Exception):
        pass

    def relative(name: str, compression: float) -> tuple[float, float]:
        """(actual compression, relative score) of ``name`` at a byte budget, measured once per allocation."""
        settings = table[name]
        allocation, policy, total = plan(settings, compression)
        key = _key(name if policy is None else f"{name}|keep={policy.keep!r}", allocation)
        point = store["points"].get(key)
        if point is None or point.get("calibration") != calibrations[settings["artifact"]]:
            if budget_s is not None and time.time() - begin > budget_s:
                raise OutOfTime
            started = time.time()
            if settings.get("simulate"):
                with simulate_eviction(model, policy, per_head=True):
                    score = measure()
            elif "scheme" in settings:
                hf.compress(model, artifacts[settings["artifact"]], allocation=allocation)
                try:
                    with simulate_quantization(model, settings["scheme"], calibration_texts()):
                        score = measure()
                finally:
                    hf.restore(model)
            else:
                hf.compress(model, artifacts[settings["artifact"]], allocation=allocation,
                            method=settings.get("method", "fdc"), eviction=policy, kv_dtype=settings.get("kv_dtype"))
                try:
                    score = measure()
                finally:
                    hf.restore(model)
            store["points"][key] = {"method": name, "calibration": calibrations[settings["artifact"]],
                                    "requested": compression, "compression": total,
                                    "dimension_compression": allocation.compression_rate,
                                    "eviction_keep": None if policy is None else policy.keep,
                                    "relative_score": score / base,
                                    "mean_qk_dim": float(allocation.qk_dims.double().mean()),
                                    "mean_v_dim": float(allocation.v_dims.double().mean()),
                                    "seconds": time.time() - started}
            files.write_json_atomically(points_path, store, indent=1)
            print(f"{name:<28} budget {compression:.4f}  KV compression {total:.4f}  relative "
                  f"{metric} score {score / base:.4f}", flush=True)
        point = store["points"][key]
        return point["compression"], point["relative_score"]

    complete = True
    try:
        for name in methods:
            metrics.compression_curve(lambda c, name=name: relative(name, c)[1], grid, refine, refine_steps)
    except OutOfTime:
        complete = False
        print(f"stopping: the {budget_s:.0f} s budget is spent; run again to continue")
    current = {name: calibrations[table[name]["artifact"]] for name in methods}
    used = {name: artifact.metadata["calibration"] for name, artifact in artifacts.items()}
    return _write(directory, model_name, stem, metric, store, current, used, complete, begin)


def _write(directory: Path, model_name: str, stem: str, metric: str, store: dict, current: dict, used: dict,
           complete: bool, begin: float) -> dict:
    """current: {method: the calibration tag its points must carry}; used: the artifacts' calibration settings; the
    results go to ``<stem>.json`` and ``.png`` in ``directory``."""
    curves = {}
    for name, tag in current.items():
        points = sorted((p["compression"], p["relative_score"]) for p in store["points"].values()
                        if p["method"] == name and p.get("calibration") == tag)
        if not points:
            continue
        curves[name] = {"points": [{"compression": c, "relative_score": s} for c, s in points],
                        "compression_at": {f"{level:.2f}": best_compression(points, level) for level in LEVELS}}
    print(f"\nKV compression at each share of the uncompressed {metric} score (largest with every smaller tried "
          f"compression also at or above it)")
    print(f"{'method':<28}" + "".join(f"{level:>7.2f}" for level in LEVELS))
    for name, curve in curves.items():
        print(f"{name:<28}" + "".join(f"{curve['compression_at'][f'{level:.2f}']:>7.3f}" for level in LEVELS))
    for first, second, label in (("FDC (defaults)", "Palu", "defaults - Palu"), ("KF-F", "KF-P", "KF-F - KF-P")):
        if first in curves and second in curves:
            gaps = [curves[first]["compression_at"][level] - curves[second]["compression_at"][level]
                    for level in curves[second]["compression_at"]]
            print(f"{label:<28}" + "".join(f"{gap:>7.3f}" for gap in gaps))
    commit, dirty = provenance.git_commit()
    utc = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    results = {"model": model_name, "settings": store["settings"], "calibration": used, "base_score": store["base"],
               "complete": complete, "curves": curves,
               "run": {"device": provenance.device_name(torch.device("cpu")), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "commit": commit, "dirty": dirty, "utc": utc,
                       "seconds": time.time() - begin}}
    path = directory / f"{stem}.json"
    files.write_json_atomically(path, results, indent=1)
    _plot(directory / f"{stem}.png", curves, metric)
    print(f"\nwritten to {path} and its .png")
    return results


def _read_points(path: Path) -> dict:
    """The points file of an earlier run, or {} (none yet). Written whole or not at all (fdc_ops.files), so a file
    that does not parse was damaged outside this program: it is set aside, named, and the run starts afresh."""
    if not path.is_file():
        return {}
    try:
        store = json.loads(path.read_text())
        if isinstance(store, dict) and isinstance(store.get("points"), dict):
            return store
        problem = "it is not a points table"
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        problem = f"it is not valid JSON ({error})"
    kept = path.with_name(path.name + ".unreadable")
    path.replace(kept)
    print(f"eval: {path} could not be resumed from ({problem}); it was moved to {kept} and the points are measured "
          "again")
    return {}


def _plot(path: Path, curves: dict, metric: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for name, curve in curves.items():
        xs = [p["compression"] for p in curve["points"]]
        ys = [p["relative_score"] for p in curve["points"]]
        axis.plot(xs, ys, "o-", markersize=3, label=name)
    for level in (0.99, 0.9):
        axis.axhline(level, color="grey", linewidth=0.8, linestyle="--")
    axis.set_xlim(0, max([0.5] + [p["compression"] for curve in curves.values() for p in curve["points"]]))
    scores = [p["relative_score"] for curve in curves.values() for p in curve["points"]] or [1.0]
    # perplexity stays within 0.2 .. 1.01 to 0.5 compression; a noisy metric (edit similarity) can leave that range
    axis.set_ylim(min(0.2, min(scores) - 0.02), max(1.01, max(scores) + 0.01))
    axis.set_xlabel("KV cache compression (share of bytes removed)")
    axis.set_ylabel(f"{metric} score / uncompressed")
    axis.set_title(f"SmolLM2-135M: {metric} vs KV compression")
    axis.legend(fontsize=8)
    figure.tight_layout()
    files.write_atomically(path, lambda temporary: figure.savefig(temporary, dpi=120, format="png"))
    plt.close(figure)
