"""The calibration report (``python -m fdc_ops report``): the paper's offline analyses (sections 3-5.2), reproduced on
the bundled SmolLM2-135M with offline real text (Wikipedia, HumanEval).

Sections:
1. singular-value spectra of post-RoPE Q/K (per KV head, the group's queries stacked with the keys), pre-RoPE K, the
   value rows, and W_V: how many dims hold 90/95/99% of the singular-value sum;
2. R from random tokens vs R from Wikipedia and HumanEval text: the paper's delta/epsilon (column signs aligned
   first: SVD columns are defined up to sign), principal angles of the top-k subspaces (element-wise differences
   alone are ill-posed where singular values are close: columns may rotate within their span), and the share of the
   target data's energy the random-token R loses against that data's own R at the same dims; the same energy measure
   for the V bases (from values of random tokens, of the text itself, or from W_V);
3. the same as the number of random tokens grows, 1K..32K (the paper's "avg ratio diff" figure);
4. calibration at short positions (sequences of 128) vs use at long positions (sequences of 4096);
5. coefficient of variation of the largest singular values across heads (paper Tables 4-5);
6. rank allocation: KV compression at each removal rate, singular-value vs explained-variance weighting, uniform;
7. perplexity of the model compressed by fdc_ops.hf.compress (the serving modules, through the fdc operators) at
   equal compression: R and V from random tokens vs
   from real text, V from activations vs from W_V, adaptive vs uniform ranks, Q/K-only and V-only compression.

Prints tables, writes JSON and PNG plots to ``--out``.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path

import torch

from .. import calibration, datasets, files, hf
from ..calibration import CalibrationStatistics, principal_axes
from ..hf import families, loading
from . import metrics, provenance

RATES = (0.05, 0.1, 0.2)
SWEEP_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768)
SUBSPACE_DIMS = (8, 16, 32)
SEQ_LEN = 1024  # calibration sequences; SmolLM2 was trained to 8K positions
SHORT_SEQ_LEN, LONG_SEQ_LEN = 128, 4096
EVAL_TOKENS, EVAL_SEQ_LEN = 8192, 512
SHARES = (0.90, 0.95, 0.99)


# ----------------------------------------------------------------------------------------------------------------
# Measures


def sign_aligned(rotation: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``rotation`` (..., D, D) with each column's sign flipped to agree with the same column of ``reference``."""
    signs = torch.sign((rotation * reference).sum(-2, keepdim=True))
    return rotation * torch.where(signs == 0, 1.0, signs)


def delta_over_epsilon(random_rotation: torch.Tensor, data_rotation: torch.Tensor, columns: int | None = None) -> float:
    """The paper's mean |R_r - R_a| / mean |R_a| over all heads and layers, after aligning column signs; over the
    first ``columns`` columns only when given (the ones a compressed head keeps)."""
    aligned = sign_aligned(random_rotation.double(), data_rotation.double())[..., :columns]
    reference = data_rotation.double()[..., :columns]
    return float((aligned - reference).abs().mean() / reference.abs().mean())


def subspace_overlap(first: torch.Tensor, second: torch.Tensor, k: int) -> tuple[float, float]:
    """For the top-k column spans of two rotations (..., D, D): the mean squared cosine of their principal angles
    (1 = same subspace, k/D = unrelated random subspaces) and the mean principal angle, in degrees."""
    cosines = torch.linalg.svdvals(first[..., :k].double().transpose(-1, -2) @ second[..., :k].double())
    cosines = cosines.clamp(0, 1)
    return float((cosines**2).mean()), float(torch.rad2deg(torch.acos(cosines)).mean())


def lost_energy(rotation: torch.Tensor, gram: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """Per head, the share of the rows' energy (trace of their Gram matrix) outside the first ``dims`` columns."""
    D = rotation.shape[-1]
    energy = torch.einsum("...di,...de,...ei->...i", rotation.double(), gram.double(), rotation.double())
    mask = torch.arange(D) < dims[..., None]
    return 1.0 - (energy * mask).sum(-1) / torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1)


def energy_loss_ratio(rotation: torch.Tensor, gram: torch.Tensor, dims: torch.Tensor) -> float:
    """Energy lost by ``rotation`` on the data of ``gram`` over the energy lost by that data's own principal axes,
    at the same dims, summed over heads (1.0 = as good as calibrating on the data itself)."""
    _, own = principal_axes(gram)
    return float(lost_energy(rotation, gram, dims).sum() / lost_energy(own, gram, dims).sum())


def dims_for_share(singular_values: torch.Tensor, share: float) -> float:
    """Mean over heads of the dims that hold ``share`` of the singular-value sum."""
    return float(calibration.kept_dims(singular_values, 1.0 - share, multiple=1).double().mean())


def allocation_at_compression(artifact, target: float, weighting: str) -> calibration.RankAllocation:
    """The allocation of ``weighting`` whose compression is closest to ``target`` without exceeding it (bisection on
    the removal rate: compression grows with it)."""
    low, high = 0.0, 0.999
    for _ in range(40):
        middle = (low + high) / 2
        if artifact.allocate(middle, weighting=weighting).compression_rate <= target:
            low = middle
        else:
            high = middle
    return artifact.allocate(low, weighting=weighting)


def coefficient_of_variation(values: torch.Tensor) -> float:
    return float(values.double().std(unbiased=False) / values.double().mean())


# ----------------------------------------------------------------------------------------------------------------
# Printing


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


# ----------------------------------------------------------------------------------------------------------------
# The run


def run(out: str = "bench/results/calibration", quick: bool = False) -> dict:
    torch.manual_seed(0)
    started = time.time()
    model, tokenizer = loading.load_model()
    shape = families.attention_shape(model)
    rates = (0.1,) if quick else RATES
    sweep = SWEEP_TOKENS[:3] if quick else SWEEP_TOKENS
    tokens = 2048 if quick else 8192
    eval_tokens = 1024 if quick else EVAL_TOKENS
    results: dict = {"model": families.model_id(model), "shape": dataclasses.asdict(shape),
                     "quick": quick}

    wiki = datasets.token_stream(tokenizer, datasets.wikipedia_articles())
    code = datasets.token_stream(tokenizer, datasets.humaneval_programs())
    wiki_eval, code_eval = wiki[-eval_tokens:], code[-eval_tokens:]  # held out: calibration reads from the start
    results["data"] = {"wikipedia_tokens": wiki.numel(), "humaneval_tokens": code.numel(),
                       "eval_tokens": eval_tokens, "eval_seq_len": EVAL_SEQ_LEN}

    # The paper's calibration (random tokens, V from the activations), timed.
    begin = time.perf_counter()
    artifact = calibration.calibrate(model, text="random", num_tokens=tokens, seq_len=SEQ_LEN, seed=0,
                                     v_method="activation", sensitivity_tokens=0)
    calibration_seconds = time.perf_counter() - begin
    results["calibration_seconds"] = {"tokens": tokens, "seconds": calibration_seconds,
                                      "threads": torch.get_num_threads()}

    def capture(batches, description, **kwargs):
        return calibration.capture_statistics(model, batches, description=description, **kwargs)

    vocab = model.config.vocab_size
    # Cumulative random-token statistics: one pass over max(sweep) tokens, snapshots at each count (sums add up).
    sequences = calibration.random_token_batches(vocab, sweep[-1], SEQ_LEN, seed=0)
    snapshots: dict[int, CalibrationStatistics] = {}
    running, done = None, 0
    for count in sweep:
        part = capture(sequences[done // SEQ_LEN: count // SEQ_LEN], f"random tokens to {count}")
        running = part if running is None else running + part
        snapshots[count], done = running, count
    random_stats = snapshots[tokens] if tokens in snapshots else capture(
        calibration.random_token_batches(vocab, tokens, SEQ_LEN, seed=0), "random tokens")
    other_random = capture(calibration.random_token_batches(vocab, tokens, SEQ_LEN, seed=1), "random tokens (seed 1)")
    wiki_stats = capture(calibration.text_token_batches(wiki, tokens, SEQ_LEN), "wikipedia")
    code_stats = capture(calibration.text_token_batches(code, tokens, SEQ_LEN), "humaneval")
    short_stats = capture(calibration.random_token_batches(vocab, tokens, SHORT_SEQ_LEN, seed=2), "short positions")
    long_stats = capture(calibration.random_token_batches(vocab, tokens, LONG_SEQ_LEN, seed=3), "long positions")

    axes = {name: principal_axes(stats.qk_gram()) for name, stats in
            (("random", random_stats), ("random_seed1", other_random), ("wikipedia", wiki_stats),
             ("humaneval", code_stats), ("short", short_stats), ("long", long_stats))}
    v_axes = {name: principal_axes(stats.v_gram) for name, stats in
              (("random", random_stats), ("wikipedia", wiki_stats), ("humaneval", code_stats),
               ("short", short_stats), ("long", long_stats))}
    weight_values, weight_basis = calibration.weight_value_axes(model)
    reference_dims = artifact.allocate(0.1).qk_dims

    # 1. spectra
    spectra = {"post-RoPE Q/K": axes["random_seed1"][0], "pre-RoPE K": principal_axes(other_random.key_gram)[0],
               "V rows": principal_axes(other_random.v_gram)[0], "W_V": weight_values}
    rows = [[name] + [dims_for_share(values, share) for share in SHARES] +
            [float((values[..., 0] / values.sum(-1)).mean())] for name, values in spectra.items()]
    print_table(f"1. singular-value spectra (D = {shape.head_dim}; {tokens} random tokens, seed 1): mean dims for a "
                f"share of the singular-value sum", ["rows", *[f"{s:.0%}" for s in SHARES], "s_0 / sum"], rows)
    results["spectra"] = {name: {"dims_for_share": dict(zip(map(str, SHARES), row[1:4])),
                                 "mean_normalized": (values / values[..., :1]).flatten(0, -2).mean(0).tolist()}
                          for (name, values), row in zip(spectra.items(), rows)}

    # 2. R from random tokens vs from real text
    def compare(first: str, second: str, target: CalibrationStatistics) -> dict:
        R_a, R_b = axes[first][1], axes[second][1]
        entry = {"delta_over_epsilon": delta_over_epsilon(R_a, R_b),
                 "delta_over_epsilon_16": delta_over_epsilon(R_a, R_b, 16),
                 "energy_loss_ratio": energy_loss_ratio(R_a, target.qk_gram(), reference_dims)}
        for k in SUBSPACE_DIMS:
            entry[f"overlap_{k}"], entry[f"largest_angle_{k}"] = subspace_overlap(R_a, R_b, k)
        return entry

    similarity = {"random seed 1": compare("random", "random_seed1", other_random),
                  "wikipedia": compare("random", "wikipedia", wiki_stats),
                  "humaneval": compare("random", "humaneval", code_stats),
                  "wikipedia vs humaneval": compare("wikipedia", "humaneval", code_stats)}
    header = ["R_random vs", "delta/eps", "delta/eps@16"] + [f"overlap@{k}" for k in SUBSPACE_DIMS] + \
             [f"mean angle@{k}" for k in SUBSPACE_DIMS] + ["energy loss ratio"]
    print_table("2. R from random tokens vs R from text (overlap = mean cos^2 of principal angles; energy loss ratio = "
                "energy the first R loses on the second's data / what that data's own R loses, at r=0.1 dims)", header,
                [[name, e["delta_over_epsilon"], e["delta_over_epsilon_16"]]
                 + [e[f"overlap_{k}"] for k in SUBSPACE_DIMS] +
                 [e[f"largest_angle_{k}"] for k in SUBSPACE_DIMS] + [e["energy_loss_ratio"]]
                 for name, e in similarity.items()])
    results["similarity"] = similarity

    v_dims = artifact.allocate(0.1).v_dims
    v_rows = []
    for target_name, target in (("wikipedia", wiki_stats), ("humaneval", code_stats)):
        for basis_name, basis in (("values of random tokens", v_axes["random"][1]),
                                  (f"values of {target_name}", v_axes[target_name][1]), ("W_V (paper)", weight_basis)):
            lost = lost_energy(basis, target.v_gram, v_dims)
            v_rows.append([target_name, basis_name, float(lost.mean()), float(lost.max())])
    print_table("2b. V bases: share of the value rows' energy outside the kept dims (r = 0.1 dims), per head",
                ["value rows of", "basis from", "mean lost", "max lost"], v_rows)
    results["v_basis_energy"] = [dict(zip(["data", "basis", "mean_lost", "max_lost"], row)) for row in v_rows]

    # 3. the number of random tokens
    sweep_rows = []
    for count, stats in snapshots.items():
        _, R = principal_axes(stats.qk_gram())
        entry = {"tokens": count}
        for name in ("wikipedia", "humaneval"):
            entry[f"delta_over_epsilon_{name}"] = delta_over_epsilon(R, axes[name][1])
            entry[f"overlap_16_{name}"] = subspace_overlap(R, axes[name][1], 16)[0]
        entry["delta_over_epsilon_mean"] = (entry["delta_over_epsilon_wikipedia"] +
                                            entry["delta_over_epsilon_humaneval"]) / 2
        entry["overlap_16_largest_sample"] = subspace_overlap(R, principal_axes(snapshots[sweep[-1]].qk_gram())[1],
                                                              16)[0]
        sweep_rows.append(entry)
    print_table("3. random-token count: R_random vs text (paper: delta/eps averaged over datasets)",
                ["tokens", "delta/eps wiki", "delta/eps code", "mean", "overlap@16 wiki", "overlap@16 code",
                 f"overlap@16 vs {sweep[-1]}"],
                [[e["tokens"], e["delta_over_epsilon_wikipedia"], e["delta_over_epsilon_humaneval"],
                  e["delta_over_epsilon_mean"], e["overlap_16_wikipedia"], e["overlap_16_humaneval"],
                  e["overlap_16_largest_sample"]] for e in sweep_rows])
    results["token_sweep"] = sweep_rows

    # 4. positions
    positions = compare("short", "long", long_stats)
    positions["energy_loss_ratio_1024_on_long"] = energy_loss_ratio(axes["random"][1], long_stats.qk_gram(),
                                                                    reference_dims)
    print_table(f"4. calibrated on sequences of {SHORT_SEQ_LEN} vs used at positions up to {LONG_SEQ_LEN}",
                ["comparison", "delta/eps", "overlap@16", "energy loss ratio on long"],
                [[f"R({SHORT_SEQ_LEN}) vs R({LONG_SEQ_LEN})", positions["delta_over_epsilon"],
                  positions["overlap_16"], positions["energy_loss_ratio"]],
                 [f"R({SEQ_LEN}) vs R({LONG_SEQ_LEN})", delta_over_epsilon(axes["random"][1], axes["long"][1]),
                  subspace_overlap(axes["random"][1], axes["long"][1], 16)[0],
                  positions["energy_loss_ratio_1024_on_long"]]])
    results["positions"] = positions

    # 5. CV of the largest singular values across heads
    cv_rows = [[name, coefficient_of_variation(axes[name][0][..., 0]),
                coefficient_of_variation(v_axes[name][0][..., 0])] for name in ("random", "wikipedia", "humaneval")]
    print_table("5. CV of the largest singular value across heads (paper Tables 4-5: 40-50%)",
                ["data", "Q_p-K_p", "V"], cv_rows)
    results["cv_max_singular_value"] = {row[0]: {"qk": row[1], "v": row[2]} for row in cv_rows}

    # 6. allocation
    allocation_rows = []
    for rate in (0.02, 0.05, 0.1, 0.2, 0.3):
        adaptive = artifact.allocate(rate)
        variance = artifact.allocate(rate, weighting="explained_variance")
        allocation_rows.append([rate, adaptive.compression_rate, float(adaptive.qk_dims.double().mean()),
                                float(adaptive.v_dims.double().mean()), int(adaptive.qk_dims.min()),
                                int(adaptive.qk_dims.max()), adaptive.uniform().compression_rate,
                                variance.compression_rate])
    print_table("6. rank allocation (multiple of 8)", ["removal rate", "KV compression", "mean qk", "mean v", "min qk",
                                                      "max qk", "uniform at equal total", "explained-variance"],
                allocation_rows)
    results["allocation"] = [dict(zip(["removal_rate", "compression", "mean_qk", "mean_v", "min_qk", "max_qk",
                                       "uniform_compression", "explained_variance_compression"], row))
                             for row in allocation_rows]

    # 7. perplexity through the fdc operators
    def ppl(tokens_eval, allocation=None, rotation=None, basis=None, seq_len=EVAL_SEQ_LEN, label=""):
        if allocation is None:
            return metrics.perplexity(model, tokens_eval, seq_len=seq_len, description=label)
        variant = dataclasses.replace(artifact, **({} if rotation is None else {"qk_rotation": rotation.float()}),
                                      **({} if basis is None else {"v_encoder": basis.double(),
                                                                  "v_decoder": basis.double()}))
        hf.compress(model, variant, allocation=allocation)
        try:
            return metrics.perplexity(model, tokens_eval, seq_len=seq_len, description=label)
        finally:
            hf.restore(model)

    full = torch.full_like(reference_dims, shape.head_dim)
    base_wiki = ppl(wiki_eval, label="uncompressed")
    ppl_rows = [["uncompressed", "-", 0.0, base_wiki]]
    for rate in rates:
        adaptive = artifact.allocate(rate)
        qk_only = calibration.RankAllocation(adaptive.qk_dims, full, shape.head_dim, "qk only", rate)
        v_only = calibration.RankAllocation(full, adaptive.v_dims, shape.head_dim, "v only", rate)
        variants = [
            ("FDC: R, V from random tokens", adaptive, None, None),
            ("R, V from Wikipedia (same dims)", adaptive, axes["wikipedia"][1], v_axes["wikipedia"][1]),
            ("R from Wikipedia, V random", adaptive, axes["wikipedia"][1], None),
            ("R random, V from Wikipedia", adaptive, None, v_axes["wikipedia"][1]),
            ("R, V from HumanEval (same dims)", adaptive, axes["humaneval"][1], v_axes["humaneval"][1]),
            ("V basis from W_V (same dims)", adaptive, None, weight_basis),
            ("uniform ranks (/AC)", adaptive.uniform(), None, None),
            ("explained-variance ranks, equal compression",
             allocation_at_compression(artifact, adaptive.compression_rate, "explained_variance"), None, None),
            ("Q/K compressed only", qk_only, None, None),
            ("V compressed only", v_only, None, None),
        ]
        for label, allocation, rotation, basis in variants:
            ppl_rows.append([label, rate, allocation.compression_rate,
                             ppl(wiki_eval, allocation, rotation, basis, label=f"{label} r={rate}")])
    print_table(f"7a. Wikipedia perplexity (held-out {eval_tokens} tokens, windows of {EVAL_SEQ_LEN}) with fdc_ops.hf."
                f"compress", ["configuration", "removal rate", "KV compression", "perplexity"], ppl_rows)

    adaptive = artifact.allocate(0.1)
    code_rows = [["uncompressed", 0.0, ppl(code_eval, label="code uncompressed")],
                 ["R, V from random tokens", adaptive.compression_rate, ppl(code_eval, adaptive, label="code random")],
                 ["R, V from HumanEval (same dims)", adaptive.compression_rate,
                  ppl(code_eval, adaptive, axes["humaneval"][1], v_axes["humaneval"][1], label="code humaneval")],
                 ["R, V from Wikipedia (same dims)", adaptive.compression_rate,
                  ppl(code_eval, adaptive, axes["wikipedia"][1], v_axes["wikipedia"][1], label="code wikipedia")]]
    print_table(f"7b. HumanEval perplexity (held-out {eval_tokens} tokens), removal rate 0.1",
                ["configuration", "KV compression", "perplexity"], code_rows)

    long_eval = wiki[-max(eval_tokens, LONG_SEQ_LEN):]
    position_rows = [["uncompressed", ppl(long_eval, seq_len=LONG_SEQ_LEN, label="long uncompressed")]]
    for name, length in (("short", SHORT_SEQ_LEN), ("random", SEQ_LEN), ("long", LONG_SEQ_LEN)):
        position_rows.append([f"R, V calibrated on sequences of {length}",
                              ppl(long_eval, adaptive, axes[name][1], v_axes[name][1], seq_len=LONG_SEQ_LEN,
                                  label=f"long, calibrated at {length}")])
    print_table(f"7c. Wikipedia perplexity in windows of {LONG_SEQ_LEN}, removal rate 0.1 "
                f"(KV compression {adaptive.compression_rate:.3f})", ["configuration", "perplexity"], position_rows)
    results["perplexity"] = {
        "wikipedia": [dict(zip(["configuration", "removal_rate", "compression", "perplexity"], r)) for r in ppl_rows],
        "humaneval": [dict(zip(["configuration", "compression", "perplexity"], r)) for r in code_rows],
        "long_positions": [dict(zip(["configuration", "perplexity"], r)) for r in position_rows]}

    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    _plots(directory, results, shape.head_dim)
    commit, dirty = provenance.git_commit()
    results["run"] = {"device": provenance.device_name(torch.device("cpu")), "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "commit": commit, "dirty": dirty,
                      "seconds": time.time() - started,
                      "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")}
    path = directory / f"smollm2-calibration{'-quick' if quick else ''}-{results['run']['utc']}.json"
    files.write_json_atomically(path, results, indent=1, default=float)
    print(f"\ncalibration of {tokens} random tokens took {calibration_seconds:.1f} s on {torch.get_num_threads()} "
          f"threads; report written to {path} (+ PNG plots) in {time.time() - started:.0f} s")
    return results


def _plots(directory: Path, results: dict, head_dim: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for name, entry in results["spectra"].items():
        axis.plot(range(head_dim), entry["mean_normalized"], label=name)
    axis.set_xlabel("dimension (sorted)")
    axis.set_ylabel("singular value / largest (mean over heads)")
    axis.set_yscale("log")
    axis.set_title("SmolLM2-135M singular-value spectra")
    axis.legend()
    figure.tight_layout()
    files.write_atomically(directory / "spectra.png", lambda temporary: figure.savefig(temporary, dpi=120,
                                                                                       format="png"))
    plt.close(figure)

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    counts = [e["tokens"] for e in results["token_sweep"]]
    for name in ("wikipedia", "humaneval"):
        left.plot(counts, [100 * e[f"delta_over_epsilon_{name}"] for e in results["token_sweep"]], "o-", label=name)
        right.plot(counts, [e[f"overlap_16_{name}"] for e in results["token_sweep"]], "o-", label=name)
    for axis, label in ((left, "delta / epsilon (%)"), (right, "top-16 subspace overlap")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("random calibration tokens")
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle("R from random tokens vs R from text")
    figure.tight_layout()
    files.write_atomically(directory / "token_sweep.png", lambda temporary: figure.savefig(temporary, dpi=120,
                                                                                           format="png"))
    plt.close(figure)
