"""The command line, ``python -m fdc_ops <command>``.

  python -m fdc_ops demo [--quiet]                        the main job: FDC on the bundled SmolLM2 (apps/demo.py)
  python -m fdc_ops ops-demo                              the operator-level demo (apps/ops_demo.py)
  python -m fdc_ops eval [--metric M]                     accuracy vs KV compression, FDC vs uniform vs Palu
                                                          (apps/eval.py)
  python -m fdc_ops calibrate [--model PATH] --out DIR    calibrate a model (default: the bundled SmolLM2-135M)
  python -m fdc_ops report [--out DIR]                    the calibration analyses on SmolLM2
                                                          (apps/calibration_report.py)
"""

import argparse
import importlib.util
import math
import sys

from ..arguments import BUNDLED_MODELS, model_source, output_directory, share, whole
from ..defaults import DEFAULT_SEQ_LEN, PERPLEXITY_WINDOW

# Nothing here imports torch at module level: the arguments are parsed and checked first (--help and a mistake answer
# in well under a second), and each command imports what it uses.

PLOTTING_COMMANDS = ("demo", "eval", "report")  # they draw PNGs with matplotlib


def _calibrate(args) -> None:
    import torch

    from .. import calibration
    from ..hf import loading

    torch.manual_seed(args.seed)
    if args.model is None or args.model in loading.MODELS:
        model, tokenizer = loading.load_model(args.model)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        tokenizer = None
    if args.text != "random" and tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    artifact = calibration.calibrate(model, tokenizer, text=args.text, num_tokens=args.num_tokens,
                                     seq_len=args.seq_len, seed=args.seed, v_method=args.v_method,
                                     sensitivity_tokens=args.sensitivity_tokens)
    directory = calibration.save_or_keep(artifact, args.out, "python -m fdc_ops calibrate")
    if directory is None:
        print("the calibration could not be saved anywhere (see the warning above)", file=sys.stderr)
        sys.exit(1)
    print(f"artifact: {directory} ({artifact.metadata['calibration']['num_tokens']} tokens of {args.text})")
    print(f"{'removal rate':>12} {'KV compression':>15} {'mean qk dim':>12} {'mean v dim':>11}")
    for rate in (0.02, 0.05, 0.1, 0.2, 0.3):
        allocation = artifact.allocate(rate)
        print(f"{rate:>12.2f} {allocation.compression_rate:>15.3f} {allocation.qk_dims.double().mean():>12.1f} "
              f"{allocation.v_dims.double().mean():>11.1f}")
    rule = "sensitivity" if artifact.has_sensitivity else "explained_variance"
    print(f"\n{'KV budget':>12} {'KV compression':>15} {'mean qk dim':>12} {'mean v dim':>11}   (rule: {rule})")
    for compression in (0.05, 0.1, 0.2, 0.3):
        allocation = artifact.allocate(compression=compression)
        print(f"{compression:>12.2f} {allocation.compression_rate:>15.3f} {allocation.qk_dims.double().mean():>12.1f} "
              f"{allocation.v_dims.double().mean():>11.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m fdc_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    main_job = commands.add_parser("demo", help="accuracy-vs-compression curve, long-context speed and a sample, "
                                    "FDC against Palu and the uncompressed SmolLM2")
    main_job.add_argument("--target", type=share(0.0, 1.0, True), default=0.99,
                          help="share of the perplexity score to keep")
    main_job.add_argument("--text", choices=["random", "wikipedia", "humaneval"], default="wikipedia",
                          help="calibration tokens (default wikipedia: see bench/results/calibration/README.md)")
    main_job.add_argument("--context", type=whole(1), default=4096, help="prompt tokens of the speed table")
    main_job.add_argument("--decode-steps", type=whole(1), default=8, help="decode steps timed after the prompt")
    main_job.add_argument("--out", type=output_directory, default=None,
                          help="directory for demo.json and the curve's PNG (default: demo in $FDC_CACHE, else in "
                               "~/.cache/fdc_ops; --out bench/results/demo regenerates the committed figures)")
    main_job.add_argument("--quiet", action="store_true", help="print the results only, no progress")

    evaluate = commands.add_parser("eval", help="accuracy vs KV compression: FDC (paper, defaults), uniform, Palu")
    evaluate.add_argument("--out", type=output_directory, default="bench/results/eval",
                          help="directory for the JSON and PNG")
    evaluate.add_argument("--metric", choices=["perplexity", "edit_similarity", "long_perplexity", "retrieval"],
                          default="perplexity", help="long_perplexity: 256 tokens after a 1536-token prompt whose "
                          "cache is compressed (and evicted); retrieval: a number stated early in a 1400-token "
                          "text, asked at its end; both take the eviction methods")
    evaluate.add_argument("--text", choices=["random", "wikipedia", "humaneval"], default="wikipedia",
                          help="calibration text of every method")
    evaluate.add_argument("--scored-text", choices=["wikipedia", "humaneval"], default="wikipedia",
                          help="text long_perplexity scores: Wikipedia's held-out tail, or HumanEval's programs "
                               "(code: a domain the calibration text did not cover)")
    evaluate.add_argument("--methods", nargs="+", default=None,
                          help="methods to measure (default: the four compared, or FDC, Palu, Keyformer, KF-F and "
                               "KF-P for long_perplexity; fdc_ops/apps/eval.py lists ablations)")
    evaluate.add_argument("--refine", type=share(0.0, 1.0, True), nargs="+", default=[0.99, 0.9],
                          help="accuracy levels to refine the grid around by bisection")
    evaluate.add_argument("--refine-steps", type=whole(0), default=3,
                          help="bisection steps per refined level (0: none)")
    evaluate.add_argument("--grid", type=share(0.0, 1.0, False), nargs="+", default=None,
                          help="budgets measured before refinement (default: fdc_ops/apps/eval.py GRID, 0.025 to "
                               "0.5); a coarser grid for slow metrics")
    evaluate.add_argument("--eval-tokens", type=whole(PERPLEXITY_WINDOW), default=4096,
                          help=f"held-out Wikipedia tokens (perplexity; at least one window of {PERPLEXITY_WINDOW})")
    evaluate.add_argument("--windows", type=whole(1), default=16,
                          help="held-out windows: of 1792 tokens for long_perplexity, probes for retrieval")
    evaluate.add_argument("--problems", type=whole(1), default=16, help="HumanEval problems (the first N)")
    evaluate.add_argument("--max-new-tokens", type=whole(1), default=64)
    evaluate.add_argument("--budget-s", type=share(0.0, math.inf, False), default=None,
                          help="stop starting evaluations after this many seconds (a later run resumes)")

    demo = commands.add_parser("ops-demo", help="run the FDC ops on one SmolLM2-shaped layer and print a table")
    demo.add_argument("--removal-rate", type=share(0.0, 1.0, True), default=0.1,
                      help="share of each head's singular-value sum that may be dropped (default 0.1)")
    demo.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    demo.add_argument("--seed", type=int, default=0)

    calibrate = commands.add_parser("calibrate", help="calibrate a model and save its artifact")
    calibrate.add_argument("--model", type=model_source, default=None,
                           help=f"a bundled model ({', '.join(BUNDLED_MODELS)}; in its own dtype), or a Hugging "
                                "Face model directory or hub id (in float32); default: the bundled SmolLM2-135M")
    calibrate.add_argument("--out", type=output_directory, required=True, help="directory to write the artifact to")
    calibrate.add_argument("--text", choices=["random", "wikipedia", "humaneval"], default="wikipedia",
                           help="calibration tokens: bundled real text (default wikipedia), or uniformly random")
    calibrate.add_argument("--num-tokens", type=whole(1), default=8192)
    calibrate.add_argument("--seq-len", type=whole(2), default=DEFAULT_SEQ_LEN,
                           help="length of each calibration sequence (RoPE statistics depend on position)")
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument("--v-method", choices=["output", "activation", "weight", "attention_output"],
                           default="attention_output",
                           help="V factors: output-aware from the attention outputs' covariance (default) or from "
                                "the values', SVD of the captured values, or SVD of W_V")
    calibrate.add_argument("--sensitivity-tokens", type=whole(0), default=8192,
                           help="calibration tokens that measure each head's sensitivity (0: skip)")

    report = commands.add_parser("report", help="reproduce the paper's calibration analyses on SmolLM2")
    report.add_argument("--out", type=output_directory, default="bench/results/calibration",
                        help="directory for the JSON and plots")
    report.add_argument("--quick", action="store_true", help="fewer tokens and rates (a smoke run)")
    args = parser.parse_args()
    if args.command in PLOTTING_COMMANDS and importlib.util.find_spec("matplotlib") is None:
        parser.error(f"{args.command} draws its plots with matplotlib, which is not installed: pip install "
                     "matplotlib (or the model side whole: pip install \"fdc_ops[hf]\")")
    try:
        _run(args)
    except KeyboardInterrupt:
        print(f"\npython -m fdc_ops {args.command}: interrupted; {RESUMABLE.get(args.command, 'nothing was kept')}",
              file=sys.stderr)
        sys.exit(130)


#: What a command interrupted by Ctrl-C keeps (its files are written whole or not at all: fdc_ops.files).
RESUMABLE = {"eval": "the points measured so far are kept, and the next run resumes from them",
             "calibrate": "no artifact was written", "demo": "the cached model conversion and artifacts are kept",
             "report": "the cached model conversion and artifacts are kept"}


def _run(args) -> None:
    from .. import progress

    progress.configure(quiet=getattr(args, "quiet", False))
    if args.command == "demo":
        from . import demo

        demo.run(target=args.target, text=args.text, context=args.context, decode_steps=args.decode_steps,
                 out=args.out, quiet=args.quiet)
    elif args.command == "ops-demo":
        import torch

        from . import ops_demo

        ops_demo.run(removal_rate=args.removal_rate, dtype=getattr(torch, args.dtype), seed=args.seed)
    elif args.command == "eval":
        from . import eval as eval_app

        eval_app.run(out=args.out, metric=args.metric, text=args.text, methods=args.methods, refine=tuple(args.refine),
                     refine_steps=args.refine_steps, grid=tuple(args.grid) if args.grid else None,
                    eval_tokens=args.eval_tokens, problems=args.problems, max_new_tokens=args.max_new_tokens,
                    budget_s=args.budget_s, windows=args.windows, scored_text=args.scored_text)
    elif args.command == "calibrate":
        _calibrate(args)
    elif args.command == "report":
        from . import calibration_report

        calibration_report.run(out=args.out, quick=args.quick)

