"""Command line of the vLLM plugin.

  python -m fdc_ops.vllm overrides MODEL_DIR ARTIFACT_DIR (--compression C | --removal-rate R) [--method palu]
                                  [--kv-dtype int4]
  python -m fdc_ops.vllm overrides SAVED_DIR
      prints the JSON for `vllm serve MODEL_DIR --hf-overrides '...'` (fdc_ops.vllm.hf_overrides); SAVED_DIR: a
      directory written by fdc_ops.hf.save_compressed, served with its own artifact and widths
"""

import argparse
import json

from ..arguments import share
from . import METHODS, hf_overrides


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m fdc_ops.vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    overrides = commands.add_parser("overrides", help="vLLM's --hf-overrides JSON for an FDC-compressed model")
    overrides.add_argument("model", help="Hugging Face model directory")
    overrides.add_argument("artifact", nargs="?", default=None,
                           help="FDC artifact directory (FDCArtifact.save, `python -m fdc_ops calibrate`), or "
                                "'bundled' for the bundled SmolLM2's; left out for a directory written by "
                                "fdc_ops.hf.save_compressed")
    budget = overrides.add_mutually_exclusive_group()
    budget.add_argument("--compression", type=share(0.0, 1.0, False),
                        help="share of the KV cache to remove (a byte budget), in [0, 1)")
    budget.add_argument("--removal-rate", type=share(0.0, 1.0, True),
                        help="the paper's singular-value removal rate, in [0, 1]")
    overrides.add_argument("--rule", default=None, help="width rule with --compression (fdc_ops.calibration.RULES)")
    overrides.add_argument("--method", choices=METHODS, default="fdc",
                           help="fdc, or palu for the Palu baseline (with an artifact directory)")
    overrides.add_argument("--kv-dtype", choices=["int4"], default=None,
                           help="int4 pages (int8 and fp8 are vLLM's own --kv-cache-dtype int8_per_token_head and "
                                "fp8_per_token_head)")
    args = parser.parse_args()
    if args.artifact is not None and args.compression is None and args.removal_rate is None:
        parser.error("with an artifact directory, give --compression or --removal-rate")
    print(json.dumps(hf_overrides(args.model, args.artifact, compression=args.compression,
                                  removal_rate=args.removal_rate, rule=args.rule, method=args.method,
                                  kv_dtype=args.kv_dtype)))


if __name__ == "__main__":
    main()
