"""Command line: `python -m fdc_ops demo` runs the operator-level demo (fdc_ops/demo.py)."""

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m fdc_ops", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the FDC ops on one SmolLM2-shaped layer and print a table")
    demo.add_argument("--removal-rate", type=float, default=0.1,
                      help="share of each head's singular-value sum that may be dropped (default 0.1)")
    demo.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "demo":
        from . import demo as demo_module

        demo_module.run(removal_rate=args.removal_rate, dtype=getattr(torch, args.dtype), seed=args.seed)


if __name__ == "__main__":
    main()
