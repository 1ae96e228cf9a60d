"""End-to-end benchmark: the bundled SmolLM2-135M on the CPU with FDC-compressed attention (fdc_ops.hf.compress) at
several KV compression rates against the uncompressed model with SDPA, in one process. Speed only: the widths are
uniform and explicit (every head keeps round8(D * (1 - rate)) of its D = 64 dims for QK and for V; 0% keeps all 64,
so its rows measure the compressed modules' own overhead), accuracy is left to fdc_ops.evaluate.

What is measured, for each prompt length P, batch B and model (greedy decoding of random prompt tokens, no padding):
- time to first token (TTFT): the prompt's forward pass into an empty cache, logits of the last position included;
  the median of --ttft-rounds passes per model, the models taking turns in an order that rotates from round to round
  (round r starts with the r-th model), so no model always runs first or last: timed once each in a fixed order, an
  8K prompt's TTFT depended on the model's place in that order by up to 1.4x;
- time between tokens (TBT): the median over the new tokens of one decode step's forward pass (B tokens);
- attention share of a step: time inside the decoder layers' self-attention modules (forward pre/post hooks, Q/K/V
  and output projections included) over the step's time, summed over the decode steps;
- cache reads per step ("read ms"): the median over the steps of the time inside fdc_ops.ops.decode_attention, the
  op that reads the compressed cache (0 for the uncompressed model).
Targets, each printed PASS or MISS: at 0% compression TBT <= 1.03 x uncompressed; at 50% compression and the longest
prompt (8K by default), TBT <= 0.75 x uncompressed. With --evict K (shares kept, fdc_ops.eviction, Keyformer scores),
each compression rate also runs with eviction after the prompt, and against the same widths without eviction: the
prompt's TTFT (scoring included) <= 1.05 x, the eviction itself (timed inside the prompt's pass) <= 5% of it, and, at
the longest prompt, attention time per decode step and cache reads per step each <= (K + 0.1) x (the step reads K of
the prompt's rows; what does not scale with the rows is the projections and the rotation, which the first includes
and the second does not). With --kv-dtypes (int8, float8_e4m3fn, int4: the compressed cache quantized,
hf.compress(kv_dtype=...)), each compression rate also runs with each quantized cache, its TBT reported against the
same widths' float cache (the paper's KVQ-F against FDC).

--profile: torch.profiler tables of one decode step of each model (self CPU time by op), printed and kept in the
JSON. Timing: every model is loaded at once; for each prompt they prefill in turn (TTFT above; the last round's
caches are decoded from), then their decode steps interleave, after one untimed warm-up generation of a short prompt
each.
Prints a table; writes JSON and a plot (PNG, same name) to bench/results/e2e/ (or --out) with device, torch version and
commit. Run long grids in parts (--prompts), each under the machine's time limits.
"""

from __future__ import annotations

import statistics
import time

import torch

# bench_common first: it puts the repository root on sys.path for fdc_ops.
from bench_common import Timer, bench_parser, git_commit, record, setup, verdict, write_report
from fdc_ops import calibration, files, hf, ops
from fdc_ops.apps.provenance import device_name
from fdc_ops.hf import modules
from fdc_ops.hf.loading import load_model


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def uniform_widths(model, rate: float) -> tuple[list[list[int]], int]:
    """(L, H_kv) widths keeping round8(D (1 - rate)) dims of every head, and that width."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = max(8, int(round(head_dim * (1 - rate) / 8)) * 8)
    return [[width] * config.num_key_value_heads for _ in range(config.num_hidden_layers)], width


class AttentionClock:
    """Seconds spent inside the decoder layers' self-attention modules, from forward pre/post hooks."""

    def __init__(self, model):
        self.seconds, self._start = 0.0, 0.0
        self.handles = []
        for layer in model.model.layers:
            self.handles.append(layer.self_attn.register_forward_pre_hook(self._enter))
            self.handles.append(layer.self_attn.register_forward_hook(self._leave))

    def _enter(self, *_):
        self._start = time.perf_counter()

    def _leave(self, *_):
        self.seconds += time.perf_counter() - self._start

    def remove(self):
        for handle in self.handles:
            handle.remove()


class FunctionClock:
    """Seconds inside one module-level function, by replacing it with a timed wrapper while the benchmark runs (its
    callers look it up at every call): the compressed modules' eviction after a prompt (fdc_ops.hf.modules._evict:
    scoring, selection and compaction) and the op that reads the compressed cache in a decode step
    (fdc_ops.ops.decode_attention)."""

    def __init__(self, module, name: str):
        self.seconds = 0.0
        self._module, self._name, self._original = module, name, getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(module, name, timed)

    def remove(self):
        setattr(self._module, self._name, self._original)


class Run:
    """One model's greedy decoding of one prompt, a step at a time, so several models' steps can interleave."""

    def __init__(self, model, clock: AttentionClock):
        from transformers import DynamicCache

        from fdc_ops.hf.compat import cache_keyword

        self.model, self.clock, self.logits = model, clock, None
        self.cache = {cache_keyword(model): DynamicCache()}  # under the name this transformers release uses
        self.steps: list[float] = []
        self.cache_reads: list[float] = []  # seconds of each step inside decode_attention

    def prefill(self, prompt: torch.Tensor, timer: Timer, eviction: FunctionClock) -> tuple[float, float]:
        """Seconds of the prompt's (B, P) forward pass, logits of the last position included, and of its eviction
        (within the pass)."""

        def call():
            self.logits = self.model(input_ids=prompt, use_cache=True, **self.cache).logits[:, -1]

        eviction.seconds = 0.0
        seconds = timer(call, repeats=1)[0]
        self.clock.seconds = 0.0
        return seconds, eviction.seconds

    def step(self, timer: Timer, reads: FunctionClock) -> None:
        """Times one decode step: the greedy token of each request in, its logits out, and its cache reads."""

        def call():
            token = self.logits.argmax(-1, keepdim=True)  # (B, 1)
            self.logits = self.model(input_ids=token, use_cache=True, **self.cache).logits[:, -1]

        before = reads.seconds
        self.steps.append(timer(call, repeats=1)[0])
        self.cache_reads.append(reads.seconds - before)


def profile_step(model, prompt: torch.Tensor) -> str:
    """torch.profiler table (self CPU time by op) of one decode step after prompt (B, P)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    from fdc_ops.hf.compat import cache_keyword

    cache = {cache_keyword(model): DynamicCache()}
    logits = model(input_ids=prompt, use_cache=True, **cache).logits[:, -1]
    token = logits.argmax(-1, keepdim=True)
    logits = model(input_ids=token, use_cache=True, **cache).logits[:, -1]  # warm the step path
    token = logits.argmax(-1, keepdim=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(input_ids=token, use_cache=True, **cache)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(2, len(batches), figsize=(5.5 * len(batches), 8), squeeze=False)
    for col, batch in enumerate(batches):
        for model in dict.fromkeys(r["model"] for r in rows):
            mine = sorted((r for r in rows if r["batch"] == batch and r["model"] == model), key=lambda r: r["prompt"])
            prompts = [r["prompt"] for r in mine]
            axes[0][col].plot(prompts, [r["tbt_ms"] for r in mine], marker="o", label=model)
            axes[1][col].plot(prompts, [r["ttft_ms"] / 1e3 for r in mine], marker="o", label=model)
        for row, label in ((0, "time between tokens (ms)"), (1, "time to first token (s)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(label)
            ax.set_title(f"batch {batch}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    files.write_atomically(path, lambda temporary: fig.savefig(temporary, dpi=110, format="png"))
    print(f"wrote {path}")


def main() -> None:
    parser = bench_parser(__doc__, "unused: every configuration is timed once, its decode steps one by one",
                          topic="e2e")
    parser.add_argument("--prompts", type=ints, default=[512, 2048, 8192], help="prompt lengths, comma-separated")
    parser.add_argument("--batches", type=ints, default=[1, 4], help="batch sizes, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--compressions", type=floats, default=[0.0, 0.25, 0.5],
                        help="KV compression rates (share of each head's dims removed), comma-separated")
    parser.add_argument("--evict", type=floats, default=[],
                        help="shares of each prompt kept by Keyformer eviction, comma-separated (each compression "
                             "rate also runs with each)")
    parser.add_argument("--kv-dtypes", type=lambda text: [x for x in text.split(",") if x], default=[],
                        help="quantized caches (int8, float8_e4m3fn, int4), comma-separated (each compression rate "
                             "also runs with each)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--profile", action="store_true", help="profile one decode step of each model")
    parser.add_argument("--ttft-rounds", type=int, default=3,
                        help="prefills per model and prompt, the models in rotating order; TTFT is their median")
    args = parser.parse_args()
    device, _ = setup(args)
    if args.quick:
        args.prompts, args.batches, args.new_tokens = [64], [1], 8
    dtype = getattr(torch, args.dtype)
    timer = Timer(device, repeats=1, warmup=0)
    gen = torch.Generator().manual_seed(0)

    # (name, compression rate, eviction keep, quantized cache dtype name)
    specs: list[tuple[str, float | None, float | None, str | None]] = [("uncompressed (sdpa)", None, None, None)]
    for rate in args.compressions:
        specs.append((f"fdc {rate:.0%} compressed", rate, None, None))
        specs += [(f"fdc {rate:.0%}, keep {keep:.0%}", rate, keep, None) for keep in args.evict]
        specs += [(f"fdc {rate:.0%}, {kind} cache", rate, None, kind) for kind in args.kv_dtypes]
    models, artifact = [], None
    for name, rate, keep, kind in specs:
        model, tokenizer = load_model(dtype=dtype)
        model.to(device)
        width = None
        if rate is not None:
            if artifact is None:
                artifact = calibration.load_or_calibrate(model, tokenizer, text="wikipedia", progress=False)
            dims, width = uniform_widths(model, rate)
            eviction = {} if keep is None else {"eviction": "keyformer", "keep": keep}
            hf.compress(model, artifact, qk_dims=dims, v_dims=dims, kv_dtype=kind, **eviction)
        models.append((name, rate, width, model, AttentionClock(model)))
    keeps = {name: keep for name, _, keep, _ in specs}
    kinds = {name: kind for name, _, _, kind in specs}
    vocab = models[0][3].config.vocab_size

    # The models' decode steps interleave (step i of every model, then step i + 1), so a slow moment of a shared
    # machine lands on all of them rather than on one model's whole run; prompts are prefilled in turn.
    rows, profiles = [], {}
    eviction_clock, read_clock = FunctionClock(modules, "_evict"), FunctionClock(ops, "decode_attention")
    with torch.inference_mode():
        for _, _, _, model, clock in models:  # warm-up: a short prompt and a few steps, untimed
            run = Run(model, clock)
            run.prefill(torch.randint(vocab, (1, 32), generator=gen).to(device), timer, eviction_clock)
            for _ in range(3):
                run.step(timer, read_clock)
        for prompt_len in args.prompts:
            for batch in args.batches:
                prompt = torch.randint(vocab, (batch, prompt_len), generator=gen).to(device)
                ttft_samples: list[list[float]] = [[] for _ in models]
                eviction_samples: list[list[float]] = [[] for _ in models]
                for round_index in range(max(1, args.ttft_rounds)):
                    runs = [None] * len(models)  # the previous round's caches are released here
                    for k in range(len(models)):
                        i = (round_index + k) % len(models)
                        runs[i] = Run(models[i][3], models[i][4])
                        seconds, evicting = runs[i].prefill(prompt, timer, eviction_clock)
                        ttft_samples[i].append(seconds)
                        eviction_samples[i].append(evicting)
                ttfts = [statistics.median(samples) for samples in ttft_samples]
                for _ in range(args.new_tokens - 1):
                    for run in runs:
                        run.step(timer, read_clock)
                for (name, rate, width, model, clock), run, ttft, samples, evicting in zip(models, runs, ttfts,
                                                                                           ttft_samples,
                                                                                           eviction_samples):
                    steps = run.steps
                    rows.append({"model": name, "compression": rate, "width": width, "eviction_keep": keeps[name],
                                 "kv_dtype": kinds[name],
                                 "attn_implementation": model.config._attn_implementation, "prompt": prompt_len,
                                 "batch": batch, "new_tokens": args.new_tokens, "ttft_ms": ttft * 1e3,
                                 "ttft_samples_ms": [t * 1e3 for t in samples],
                                 "eviction_share_of_ttft": statistics.median(e / t for e, t in zip(evicting, samples)),
                                 "tbt_ms": statistics.median(steps) * 1e3,
                                 "tbt_p90_ms": sorted(steps)[int(0.9 * (len(steps) - 1))] * 1e3,
                                 "attention_share": clock.seconds / sum(steps),
                                 "cache_read_ms": statistics.median(run.cache_reads) * 1e3})
                    r = rows[-1]
                    print(f"{name:<24} P={prompt_len:<5} B={batch}  TTFT {r['ttft_ms']:9.1f} ms  TBT "
                          f"{r['tbt_ms']:7.2f} ms  attention {r['attention_share']:.0%} of a step", flush=True)
                del runs
        eviction_clock.remove()
        read_clock.remove()
        for name, _, _, model, clock in models:
            clock.remove()
            if args.profile:
                profiles[name] = profile_step(model, torch.randint(vocab, (args.batches[0], args.prompts[0]),
                                                                   generator=gen).to(device))
                print(f"\none decode step of {name}, P={args.prompts[0]}, B={args.batches[0]}:\n{profiles[name]}")

    base = {(r["prompt"], r["batch"]): r for r in rows if r["compression"] is None}
    whole = {(r["compression"], r["prompt"], r["batch"]): r for r in rows
             if r["eviction_keep"] is None and r["kv_dtype"] is None}
    targets = []
    for r in rows:
        if r["compression"] is None:
            continue
        ref = base[(r["prompt"], r["batch"])]
        r["tbt_vs_uncompressed"] = r["tbt_ms"] / ref["tbt_ms"]
        r["ttft_vs_uncompressed"] = r["ttft_ms"] / ref["ttft_ms"]
        if r["kv_dtype"] is not None:  # against the same widths' float cache
            r["tbt_vs_float_cache"] = r["tbt_ms"] / whole[(r["compression"], r["prompt"], r["batch"])]["tbt_ms"]
            continue
        if r["eviction_keep"] is not None:  # against the same widths keeping every token
            same = whole[(r["compression"], r["prompt"], r["batch"])]
            r["ttft_vs_all_tokens"] = r["ttft_ms"] / same["ttft_ms"]
            r["attention_step_vs_all_tokens"] = (r["attention_share"] * r["tbt_ms"]) / (same["attention_share"]
                                                                                         * same["tbt_ms"])
            where = f"{r['compression']:.0%} keep {r['eviction_keep']:.0%} P={r['prompt']} B={r['batch']}"
            targets.append({"where": where, "what": "TTFT <= 1.05x without eviction",
                            "value": r["ttft_vs_all_tokens"], "verdict": verdict(r["ttft_vs_all_tokens"] <= 1.05)})
            share = r["eviction_share_of_ttft"]
            targets.append({"where": where, "what": "eviction (scoring, selection, compaction) <= 5% of TTFT",
                            "value": share, "verdict": verdict(share <= 0.05)})
            if r["prompt"] == max(args.prompts):
                bound = r["eviction_keep"] + 0.1
                targets.append({"where": where, "what": f"attention per step <= {bound:.2f}x without eviction",
                                "value": r["attention_step_vs_all_tokens"],
                                "verdict": verdict(r["attention_step_vs_all_tokens"] <= bound)})
                r["cache_read_vs_all_tokens"] = r["cache_read_ms"] / same["cache_read_ms"]
                targets.append({"where": where, "what": f"decode_attention per step <= {bound:.2f}x without eviction",
                                "value": r["cache_read_vs_all_tokens"],
                                "verdict": verdict(r["cache_read_vs_all_tokens"] <= bound)})
            continue
        if r["compression"] == 0.0:
            ok = r["tbt_vs_uncompressed"] <= 1.03
            targets.append({"where": f"0% P={r['prompt']} B={r['batch']}", "what": "TBT <= 1.03x uncompressed",
                            "value": r["tbt_vs_uncompressed"], "verdict": verdict(ok)})
        if r["compression"] == 0.5 and r["prompt"] == max(args.prompts):
            ok = r["tbt_vs_uncompressed"] <= 0.75
            targets.append({"where": f"50% P={r['prompt']} B={r['batch']}", "what": "TBT <= 0.75x uncompressed",
                            "value": r["tbt_vs_uncompressed"], "verdict": verdict(ok)})

    name = device_name(device)
    commit, dirty = git_commit()
    print(f"\ndevice: {name}; torch {torch.__version__}; threads {torch.get_num_threads()}; commit {commit[:12]}"
          f"{' (dirty)' if dirty else ''}; SmolLM2-135M {args.dtype}, {args.new_tokens} new tokens")
    print(f"{'model':<28} {'P':>5} {'B':>2} {'TTFT ms':>9} {'x':>6} {'TBT ms':>8} {'x':>6} {'attn':>5} {'read ms':>8}"
          f"{'  TBT x float cache' if args.kv_dtypes else ''}")
    for r in rows:
        quantized = f"  {r['tbt_vs_float_cache']:.3f}" if "tbt_vs_float_cache" in r else ""
        print(f"{r['model']:<28} {r['prompt']:>5} {r['batch']:>2} {r['ttft_ms']:>9.1f} "
              f"{r.get('ttft_vs_uncompressed', 1.0):>6.3f} {r['tbt_ms']:>8.2f} "
              f"{r.get('tbt_vs_uncompressed', 1.0):>6.3f} "
              f"{r['attention_share']:>5.0%} {r['cache_read_ms']:>8.2f}{quantized}")
    for t in targets:
        print(f"target {t['where']}: {t['what']}: {t['value']:.3f} {t['verdict']}")
    report = record("e2e", name, device_type=device.type, threads=torch.get_num_threads(), quick=args.quick,
                    model="SmolLM2-135M", dtype=args.dtype, rows=rows, targets=targets, profiles=profiles)
    path = write_report(report, args.out, name, "e2e", args.quick)
    plot(rows, str(path.with_suffix(".png")),
         f"SmolLM2-135M {args.dtype} on {name}, {args.new_tokens} new tokens, commit {commit[:12]}")


if __name__ == "__main__":
    main()
