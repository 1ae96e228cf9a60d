"""``python -m fdc_ops eval``: FDC, FDC with uniform ranks (the paper's /AC) and the Palu baseline on the bundled
SmolLM2-135M, through the same modules (fdc_ops.hf.compress) and operators.

For each method and metric (perplexity on held-out Wikipedia; edit similarity of greedy HumanEval completions
against the canonical solutions), the removal rate that keeps ``target`` (default 99%) of the uncompressed score is
found by bisection, and the KV compression rate it gives is tabulated (the paper's Tables 7-11, in this setting).
Then each method at its perplexity-target rate side by side: perplexity, edit similarity, ROUGE-1 against the
canonical solutions, time to first token and time between tokens. Writes JSON to ``--out``.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from . import calibration, datasets, evaluation, hf, models, provenance

METHODS = {"FDC": {"method": "fdc"}, "FDC, uniform ranks (/AC)": {"method": "fdc", "uniform": True},
           "Palu": {"method": "palu"}}


def run(out: str = "bench/results/eval", target: float = 0.99, text: str = "wikipedia", problems: int = 32,
        max_new_tokens: int = 96, eval_tokens: int = 4096, quick: bool = False) -> dict:
    begin = time.time()
    torch.manual_seed(0)
    if quick:
        problems, max_new_tokens, eval_tokens = 4, 24, 1024
    model, tokenizer = models.load_model()
    artifact = calibration.load_or_calibrate(model, tokenizer, text=text)
    wiki = datasets.text_tokens(tokenizer, "wikipedia")[-eval_tokens:]
    tasks = list(datasets.humaneval_problems()[:problems])

    def perplexity_score() -> dict:
        value = evaluation.perplexity(model, wiki, progress=False)
        return {"perplexity": value, "score": 1.0 / value}  # exp(-mean NLL): higher is better

    def humaneval_score() -> dict:
        scores = evaluation.humaneval_scores(model, tokenizer, tasks, max_new_tokens=max_new_tokens, progress=False)
        return {**scores, "score": scores["edit_similarity"]}

    metrics = {"perplexity": perplexity_score, "edit similarity": humaneval_score}
    base = {name: measure() for name, measure in metrics.items()}
    base_speed = evaluation.latency(model)
    print(f"uncompressed: perplexity {base['perplexity']['perplexity']:.3f}, HumanEval edit similarity "
          f"{base['edit similarity']['edit_similarity']:.4f} ({problems} problems), ROUGE-1 "
          f"{base['edit similarity']['rouge1']:.4f}")

    def compressed(settings: dict, rate: float, measure):
        allocation = hf.compress(model, artifact, removal_rate=rate, **settings)
        try:
            return allocation, measure()
        finally:
            hf.restore(model)

    searches = []
    for method, settings in METHODS.items():
        for metric, measure in metrics.items():
            started = time.time()
            rate, relative, tried = evaluation.search_removal_rate(
                lambda r: compressed(settings, r, measure)[1]["score"] / base[metric]["score"], target)
            allocation = hf.compress(model, artifact, removal_rate=rate, **settings)
            hf.restore(model)
            searches.append({"method": method, "metric": metric, "removal_rate": rate,
                             "compression": allocation.compression_rate, "relative_score": relative, "tried": tried,
                             "seconds": time.time() - started})
            print(f"{method:<26} {metric:<16} removal rate {rate:.4f}  KV compression {allocation.compression_rate:.3f}"
                  f"  relative score {relative:.4f}")

    side_by_side = [{"method": "uncompressed", "compression": 0.0, "perplexity": base["perplexity"]["perplexity"],
                     "edit_similarity": base["edit similarity"]["edit_similarity"],
                     "rouge1": base["edit similarity"]["rouge1"], **base_speed}]
    for method, settings in METHODS.items():
        rate = next(s["removal_rate"] for s in searches if s["method"] == method and s["metric"] == "perplexity")
        allocation = hf.compress(model, artifact, removal_rate=rate, **settings)
        try:
            row = {"method": method, "removal_rate": rate, "compression": allocation.compression_rate,
                   **perplexity_score(), **humaneval_score(), **evaluation.latency(model)}
        finally:
            hf.restore(model)
        row.pop("completions")
        side_by_side.append(row)

    print(f"\nKV compression rate at {target:.0%} of the uncompressed score (SmolLM2-135M, calibrated on {text})")
    print(f"{'method':<26}{'perplexity':>12}{'edit similarity':>17}")
    for method in METHODS:
        cells = [next(s["compression"] for s in searches if s["method"] == method and s["metric"] == metric)
                 for metric in metrics]
        print(f"{method:<26}{cells[0]:>12.3f}{cells[1]:>17.3f}")
    print(f"\neach method at its {target:.0%}-perplexity rate")
    print(f"{'method':<26}{'KV compr.':>10}{'ppl':>9}{'edit sim':>10}{'ROUGE-1':>9}{'TTFT ms':>9}{'TBT ms':>8}")
    for row in side_by_side:
        print(f"{row['method']:<26}{row['compression']:>10.3f}{row['perplexity']:>9.3f}{row['edit_similarity']:>10.4f}"
              f"{row['rouge1']:>9.4f}{row['ttft_ms']:>9.1f}{row['tbt_ms']:>8.2f}")

    commit, dirty = provenance.git_commit()
    utc = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    results = {"model": models.model_id(model), "calibration_text": text, "target": target, "problems": problems,
               "max_new_tokens": max_new_tokens, "eval_tokens": eval_tokens, "quick": quick, "searches": searches,
               "side_by_side": side_by_side,
               "run": {"device": provenance.device_name(torch.device("cpu")), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "commit": commit, "dirty": dirty, "utc": utc,
                       "seconds": time.time() - begin}}
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"smollm2-eval{'-quick' if quick else ''}-{utc}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwritten to {path} in {time.time() - begin:.0f} s")
    return results
