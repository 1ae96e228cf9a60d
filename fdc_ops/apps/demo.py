"""The main job (README's first command): what FDC is worth on the bundled SmolLM2-135M-Instruct, on this machine.

1. load the model (its GGUF is converted to safetensors once and cached);
2. calibrate it on Wikipedia text (cached after the first run);
3. the accuracy-vs-compression curve: the perplexity score (exp(-NLL), relative to the uncompressed model's; 0.99
   allows about 1% more perplexity) on held-out Wikipedia tokens at KV compressions from 0.05 to 0.5, FDC against
   the Palu baseline, through the same compressed modules (fdc_ops.hf.compress); then the largest compression that
   keeps ``target`` of the score, from the grid refined by bisection, counting a compression only when it and every
   smaller one tried also keep the target (the score need not fall monotonically);
4. speed where compression pays: a long prompt, then single-token decode steps, uncompressed (transformers' SDPA
   attention) against FDC at the compression found and at a higher one: time to first token, time between tokens and
   the bytes of the KV cache;
5. a greedy sample at the compression found, beside the uncompressed model's.

Every figure printed names what it was measured on. A table goes to stdout; ``demo.json`` and
``accuracy_curve.png`` to ``--out`` (default: ``demo`` in the cache, see run). Calibration text: Wikipedia, because
on this model the V bases from random tokens lose far more accuracy than those from real text
(bench/results/calibration/README.md).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import calibration, datasets, files, hf, progress
from ..hf import families, loading
from . import metrics, provenance

# KV compressions of the curve, up to 0.5, the span of `python -m fdc_ops eval`'s curves. Each point costs one
# perplexity evaluation, the demo's largest expense: five points and two refinement steps per method keep the curve
# stage near a minute.
CURVE_GRID = (0.05, 0.1, 0.2, 0.3, 0.5)
REFINE_STEPS = 2  # bisection steps between the last grid point that keeps the target and the next: 1/4 of the gap
# Held-out Wikipedia tokens per perplexity (4 windows of 512; about 5 s each on 2 cores, mostly the MLPs and the
# vocabulary projection). Scores are ratios on the same tokens, so the noise of so few tokens mostly cancels;
# `python -m fdc_ops eval` measures on more.
CURVE_TOKENS = 2048
SPEED_COMPRESSION = 0.5  # the "higher compression" of the speed table: the curve shows what it costs in accuracy
PROMPT = "Explain in two sentences why the sky is blue."
METHODS = {"FDC": "fdc", "Palu": "palu"}


@dataclass
class Curve:
    """One method's (compression, relative score) points, and the largest compression that keeps the target."""

    method: str
    points: list[tuple[float, float]] = field(default_factory=list)
    best: float = 0.0
    best_score: float = 1.0


def accuracy_curve(method: str, relative_score, target: float) -> Curve:
    """The grid, then bisection between the last grid point whose prefix keeps ``target`` and the next one."""
    tried = metrics.compression_curve(relative_score, CURVE_GRID, (target,), REFINE_STEPS)
    best = metrics.best_compression(tried.items(), target)
    return Curve(method, sorted(tried.items()), best, tried.get(best, 1.0))


def _sample(model, tokenizer, max_new_tokens: int = 48) -> str:
    """A greedy chat completion of PROMPT."""
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        output = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(output[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def _plot(curves: list[Curve], target: float, path: Path, eval_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    axes.axhline(1.0, color="0.5", linewidth=1, label="uncompressed")
    axes.axhline(target, color="0.5", linewidth=1, linestyle=":", label=f"{target:.0%} of uncompressed")
    for curve, color in zip(curves, ("tab:blue", "tab:orange")):
        xs, ys = zip(*([(0.0, 1.0)] + curve.points))
        axes.plot(xs, ys, marker="o", markersize=3, color=color, label=curve.method)
        axes.plot([curve.best], [curve.best_score], marker="*", markersize=12, color=color, linestyle="none")
    axes.set_xlabel("KV cache compression (share of bytes removed)")
    axes.set_ylabel("perplexity score / uncompressed")
    axes.set_title(f"SmolLM2-135M, {eval_tokens} held-out Wikipedia tokens (star: largest compression at {target:.0%})",
                   fontsize=9)
    axes.set_ylim(max(0.0, min(y for curve in curves for _, y in curve.points) - 0.05), 1.02)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    files.write_atomically(path, lambda temporary: figure.savefig(temporary, dpi=120, format="png"))
    plt.close(figure)


def run(target: float = 0.99, text: str = "wikipedia", context: int = 4096, decode_steps: int = 8,
        out: str | None = None, quiet: bool = False) -> dict:
    """Runs the demo; ``out``: the directory for demo.json and the curve's PNG, by default ``demo`` in the cache
    ($FDC_CACHE, else ~/.cache/fdc_ops), so that a run in a checkout leaves the committed bench/results/demo alone
    (``--out bench/results/demo`` regenerates those on purpose)."""
    begin = time.time()
    torch.manual_seed(0)
    stages = progress.Stages(5, quiet)

    with stages("model") as stage:
        model, tokenizer = loading.load_model()
        shape = families.attention_shape(model)
        stage.note = (f"{families.model_id(model)}: {shape.num_layers} layers, {shape.num_heads} query / "
                      f"{shape.num_kv_heads} KV heads of {shape.head_dim}; "
                      f"{provenance.device_name(torch.device('cpu'))}, "
                      f"{torch.get_num_threads()} threads")
    with stages("calibration") as stage:
        artifact = calibration.load_or_calibrate(model, tokenizer, text=text, progress=not quiet)
        settings = artifact.metadata["calibration"]
        stage.note = (f"{settings['num_tokens']} tokens of {settings['source']}, sensitivity on "
                      f"{settings.get('sensitivity_tokens', 0)} (from {loading.cache_dir()} or the artifact shipped in "
                      "fdc_ops/artifacts; calibrated and cached there when neither has it)")

    held_out = datasets.text_tokens(tokenizer, "wikipedia")[-CURVE_TOKENS:]
    with stages(f"accuracy curve: perplexity on {CURVE_TOKENS} held-out Wikipedia tokens") as stage:
        base = metrics.perplexity(model, held_out, progress=False)

        def relative_score(method: str):
            def score(compression: float) -> float:
                hf.compress(model, artifact, compression=compression, method=method)
                try:
                    return base / metrics.perplexity(model, held_out, progress=False)
                finally:
                    hf.restore(model)
            return score

        curves = [accuracy_curve(label, relative_score(method), target) for label, method in METHODS.items()]
        stage.note = ", ".join(f"{c.method} keeps {target:.0%} up to {c.best:.3f}" for c in curves)
    fdc_curve = curves[0]

    speed_rows = {}
    with stages(f"speed: a {context}-token prompt, then {decode_steps} decode steps, batch 1") as stage:
        for label, compression in (("uncompressed", None), (f"FDC at the {target:.0%} point", fdc_curve.best),
                                   (f"FDC at {SPEED_COMPRESSION:.0%}", SPEED_COMPRESSION)):
            allocation = None
            if compression is not None:
                allocation = hf.compress(model, artifact, compression=compression)
            timing = metrics.latency(model, prompt_tokens=context, new_tokens=decode_steps, repeats=1)
            full_bytes = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
            per_token = allocation.kv_bytes_per_token(4) if allocation is not None else full_bytes
            speed_rows[label] = {"compression": allocation.compression_rate if allocation else 0.0,
                                 "kv_bytes_per_token": per_token, **timing}
            if allocation is not None:
                hf.restore(model)
        stage.note = ", ".join(f"{label} {row['tbt_ms']:.0f} ms/token" for label, row in speed_rows.items())

    with stages("greedy samples") as stage:
        samples = {"uncompressed": _sample(model, tokenizer)}
        hf.compress(model, artifact, compression=fdc_curve.best)
        samples[f"FDC at {fdc_curve.best:.3f} KV compression"] = _sample(model, tokenizer)
        hf.restore(model)
        stage.note = f"{PROMPT!r}, 48 new tokens"

    directory = Path(out) if out is not None else loading.cache_dir() / "demo"
    directory.mkdir(parents=True, exist_ok=True)
    _plot(curves, target, directory / "accuracy_curve.png", CURVE_TOKENS)
    commit, dirty = provenance.git_commit()
    result = {
        "model": families.model_id(model), "device": provenance.device_name(torch.device("cpu")),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "commit": commit, "dirty": dirty,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "calibration": settings, "target": target, "eval_tokens": CURVE_TOKENS, "base_perplexity": base,
        "curves": [{"method": c.method, "points": c.points, "best_compression": c.best, "best_score": c.best_score}
                   for c in curves],
        "speed": {"prompt_tokens": context, "decode_steps": decode_steps, "batch": 1, "dtype": "float32",
                  "rows": speed_rows},
        "samples": samples, "seconds": time.time() - begin,
    }
    files.write_json_atomically(directory / "demo.json", result, indent=1)

    print(f"\nAccuracy: perplexity score relative to the uncompressed model ({base:.2f} perplexity) on "
          f"{CURVE_TOKENS} held-out Wikipedia tokens")
    print(f"{'KV compression':>15}" + "".join(f"{c.method:>10}" for c in curves))
    scores = [dict(c.points) for c in curves]
    for compression in sorted({c for curve in curves for c, _ in curve.points}):
        cells = "".join(f"{s[compression]:>10.4f}" if compression in s else f"{'':>10}" for s in scores)
        print(f"{compression:>15.3f}{cells}")
    for curve in curves:
        print(f"{curve.method}: largest KV compression keeping {target:.0%} of the score: {curve.best:.3f} "
              f"(score {curve.best_score:.4f})")

    print(f"\nSpeed: SmolLM2 in float32 on {result['device']}, {result['threads']} threads; a {context}-token prompt "
          f"(batch 1), then the median of {decode_steps} single-token decode steps")
    print(f"{'':<24}{'KV compression':>15}{'KV bytes/token':>15}{'prefill (s)':>12}{'decode (ms/token)':>18}"
          f"{'decode speed-up':>16}")
    reference = speed_rows["uncompressed"]["tbt_ms"]
    for label, row in speed_rows.items():
        print(f"{label:<24}{row['compression']:>15.3f}{row['kv_bytes_per_token']:>15,}{row['ttft_ms'] / 1e3:>12.2f}"
              f"{row['tbt_ms']:>18.1f}{reference / row['tbt_ms']:>15.2f}x")

    for label, sample in samples.items():
        print(f"\n{label} ({PROMPT!r}, greedy):\n  {sample}")
    print(f"\ndone in {time.time() - begin:.0f} s; written: {directory / 'demo.json'}, "
          f"{directory / 'accuracy_curve.png'}; the converted model and the calibration are cached in "
          f"{loading.cache_dir()}")
    return result
