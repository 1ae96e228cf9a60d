"""Compiled decoding: the bundled SmolLM2-135M, uncompressed and FDC-compressed (uniform widths, as bench_e2e.py),
one decode step's forward pass timed three ways, after the same prompt:
- eager, dynamic cache: what generate() uses by default;
- eager, static cache: transformers' StaticCache, whose layers the compressed modules take over;
- compiled: torch.compile(model.forward, fullgraph=True) with inductor over the static cache, the prompt run eagerly
  (as generate() does when it compiles).
Per configuration it also counts the graphs inductor compiled for the compiled model's decode steps (one is the
target: no graph break, no recompile from step to step) and the seconds of the first compiled step.

Time between tokens (TBT) is the median over the steps; the three modes of a model take their steps in turn (step i
of each, then step i + 1), so a slow moment of a shared machine lands on all of them. Prints a table; writes JSON to
bench/results/e2e/ (or --out) with device, torch version and commit.
"""

from __future__ import annotations

import statistics
import time

import torch

# bench_common first: it puts the repository root on sys.path for fdc_ops.
from bench_common import Timer, bench_parser, git_commit, record, setup, verdict, write_report
from bench_e2e import floats, ints, uniform_widths
from fdc_ops import calibration, hf
from fdc_ops.apps.provenance import device_name
from fdc_ops.hf.compat import cache_keyword
from fdc_ops.hf.loading import load_model

MODES = ("eager, dynamic cache", "eager, static cache", "compiled, static cache")


class CountingInductor:
    """A torch.compile backend: inductor, counting the graphs it is handed."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph_module, example_inputs)


class Decoder:
    """One model's greedy decoding of one prompt in one mode, a step at a time."""

    def __init__(self, model, mode: str, max_cache_len: int, backend: CountingInductor | None):
        import transformers

        self.model, self.logits, self.steps = model, None, []
        static = mode != MODES[0]
        cache = (transformers.StaticCache(config=model.config, max_cache_len=max_cache_len) if static
                 else transformers.DynamicCache())
        self.cache = {cache_keyword(model): cache}
        self.forward = (torch.compile(model.forward, backend=backend, fullgraph=True) if mode == MODES[2]
                        else model.forward)

    def prefill(self, prompt: torch.Tensor) -> None:
        self.logits = self.model(input_ids=prompt, use_cache=True, **self.cache).logits[:, -1]

    def step(self, timer: Timer) -> float:
        """Seconds of one decode step: the greedy token of each request in, its logits out."""

        def call():
            token = self.logits.argmax(-1, keepdim=True)  # (B, 1)
            self.logits = self.forward(input_ids=token, use_cache=True, **self.cache).logits[:, -1]

        seconds = timer(call, repeats=1)[0]
        self.steps.append(seconds)
        return seconds


def first_layers(model, layers: int) -> None:
    """Cuts the model to its first `layers` decoder layers, in place."""
    total = len(model.model.layers)
    if not 1 <= layers <= total:
        raise SystemExit(f"bench_compile.py: --layers must be in 1..{total} for this model, got {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = model.config.layer_types[:layers]


def main() -> None:
    parser = bench_parser(__doc__, "unused: every decode step is timed once", topic="e2e")
    parser.add_argument("--prompts", type=ints, default=[512, 2048], help="prompt lengths, comma-separated")
    parser.add_argument("--batches", type=ints, default=[1, 4], help="batch sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (the compile included)")
    parser.add_argument("--compression", type=floats, default=[0.5],
                        help="FDC compressions, comma-separated (besides the uncompressed model)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep only the model's first N decoder layers (--quick: 2, since inductor's compile time "
                             "grows with the layers; its figures are then not the model's)")
    args = parser.parse_args()
    device, _ = setup(args)
    if args.quick:
        args.prompts, args.batches, args.steps, args.warmup = [32], [1], 4, 2
        args.layers = args.layers or 2
    dtype = getattr(torch, args.dtype)
    timer = Timer(device, repeats=1, warmup=0)
    gen = torch.Generator().manual_seed(0)

    models, artifact = [], None
    for rate in [None, *args.compression]:
        model, tokenizer = load_model(dtype=dtype)
        model.to(device)
        name = "uncompressed (sdpa)"
        if rate is not None:
            if artifact is None:
                artifact = calibration.load_or_calibrate(model, tokenizer, text="wikipedia", progress=False)
            dims, width = uniform_widths(model, rate)
            hf.compress(model, artifact, qk_dims=dims, v_dims=dims)
            name = f"fdc {rate:.0%} compressed (width {width})"
        if args.layers is not None:
            first_layers(model, args.layers)
        models.append((name, rate, model))
    vocab = models[0][2].config.vocab_size

    rows = []
    with torch.inference_mode():
        for prompt_len in args.prompts:
            for batch in args.batches:
                prompt = torch.randint(vocab, (batch, prompt_len), generator=gen).to(device)
                capacity = prompt_len + args.warmup + args.steps + 1
                for name, rate, model in models:
                    backend = CountingInductor()
                    torch._dynamo.reset()
                    decoders = [Decoder(model, mode, capacity, backend) for mode in MODES]
                    for decoder in decoders:
                        decoder.prefill(prompt)
                    first_compiled = None
                    for step in range(args.warmup + args.steps):
                        for decoder in decoders:
                            seconds = decoder.step(timer)
                            if decoder is decoders[2] and step == 0:
                                first_compiled = seconds
                    graphs_after_warmup = backend.graphs
                    for mode, decoder in zip(MODES, decoders):
                        timed = decoder.steps[args.warmup:]
                        rows.append({"model": name, "compression": rate, "mode": mode, "prompt": prompt_len,
                                     "batch": batch, "steps": len(timed), "tbt_ms": statistics.median(timed) * 1e3,
                                     "tbt_p90_ms": sorted(timed)[int(0.9 * (len(timed) - 1))] * 1e3})
                    rows[-1].update(graphs=backend.graphs, graphs_after_warmup=graphs_after_warmup,
                                    first_step_s=first_compiled)
                    eager = rows[-3]["tbt_ms"]
                    for row in rows[-3:]:
                        row["tbt_vs_eager_dynamic"] = row["tbt_ms"] / eager
                        print(f"{name:<34} P={prompt_len:<5} B={batch}  {row['mode']:<23} TBT {row['tbt_ms']:8.2f} ms"
                              f"  {row['tbt_vs_eager_dynamic']:.3f}x eager", flush=True)
                    del decoders

    targets = []
    for row in rows:
        if row["mode"] == MODES[2]:
            ok = row["graphs"] == 1
            targets.append({"where": f"{row['model']} P={row['prompt']} B={row['batch']}",
                            "what": "one graph for every decode step", "value": row["graphs"],
                            "verdict": verdict(ok)})
    name = device_name(device)
    commit, dirty = git_commit()
    print(f"\ndevice: {name}; torch {torch.__version__}; threads {torch.get_num_threads()}; commit {commit[:12]}"
          f"{' (dirty)' if dirty else ''}; SmolLM2-135M {args.dtype}"
          f"{f', its first {args.layers} layers' if args.layers else ''}; {args.steps} timed steps after {args.warmup}")
    print(f"{'model':<34} {'P':>5} {'B':>2} {'mode':<23} {'TBT ms':>8} {'x eager':>8} {'graphs':>6} {'1st s':>6}")
    for r in rows:
        graphs = str(r["graphs"]) if "graphs" in r else ""
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") is not None else ""
        print(f"{r['model']:<34} {r['prompt']:>5} {r['batch']:>2} {r['mode']:<23} {r['tbt_ms']:>8.2f} "
              f"{r['tbt_vs_eager_dynamic']:>8.3f} {graphs:>6} {first:>6}")
    for t in targets:
        print(f"target {t['where']}: {t['what']}: {t['value']} {t['verdict']}")
    report = record("compile", name, device_type=device.type, quick=args.quick, threads=torch.get_num_threads(),
                    dtype=args.dtype, layers=args.layers, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    rows=rows, targets=targets)
    write_report(report, args.out, name, "compile", args.quick)


if __name__ == "__main__":
    main()
