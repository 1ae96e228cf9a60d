"""What checking a model's identity costs: the digests of every layer's attention weights (fdc_ops.identity), on a
layer stack of a 7B model's size (Llama-2-7B: 32 layers of 4096 x 4096 q, k, v and o projections, 2.1 billion
attention parameters) in random weights, on the CPU.

Three costs, per billion attention parameters: the artifact's record at calibration (weight_identity: digests in
float32, float16 and bfloat16), the check when a model is compressed or served (compared_digests in the served
dtype, the common case: the artifact's dtype or a wider one), and the cache key (fingerprint: the bfloat16 digests).
Target: the check under one second per billion parameters of the model (a 7B model's whole parameter count).

    python bench/bench_fingerprint.py [--quick] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import ROOT, git_commit, print_header, provenance, write_report  # noqa: E402
from fdc_ops import identity  # noqa: E402
from fdc_ops.apps.provenance import device_name  # noqa: E402

MODEL_PARAMETERS = 6.74e9  # Llama-2-7B, all parameters: the "per billion parameters" of the target
TARGET_SECONDS_PER_BILLION = 1.0


def layer_stack(layers: int, hidden: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """fdc_ops.hf.families.attention_tensors-style tensors of ``layers`` layers of ``hidden``-wide projections."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        for part in "qkvo":
            tensors[f"layers.{layer}.{part}_proj.weight"] = torch.randn(hidden, hidden, generator=generator,
                                                                         dtype=torch.float32).to(dtype)
    return tensors


def timed(function) -> tuple[float, object]:
    begin = time.perf_counter()
    result = function()
    return time.perf_counter() - begin, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 layers of 1024 (seconds)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                        help="the dtype the stack is held in (as the model is loaded)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "fingerprint"))
    args = parser.parse_args()
    layers, hidden = (4, 1024) if args.quick else (32, 4096)
    dtype = getattr(torch, args.dtype)
    tensors = layer_stack(layers, hidden, dtype)
    parameters = sum(t.numel() for t in tensors.values())
    scale = parameters / 4 / 4096**2 / 32 * MODEL_PARAMETERS if args.quick else MODEL_PARAMETERS
    name, (commit, dirty) = device_name(torch.device("cpu")), git_commit()

    record_seconds, record = timed(lambda: identity.tensor_digests(
        tensors, [str(d).removeprefix("torch.") for d in identity.DIGEST_DTYPES]))
    recorded = {"dtype": args.dtype, "weights": record}
    check_seconds, found = timed(lambda: identity.compared_digests(recorded, tensors))
    assert all(found[n][2] == record[n][found[n][1]] for n in tensors), "the check must find the recorded digests"
    key_seconds, _ = timed(lambda: identity.tensor_digests(tensors, ["bfloat16"]))
    rows = [("record (calibration: 3 dtypes)", record_seconds), (f"check (in {args.dtype})", check_seconds),
            ("cache key (bfloat16)", key_seconds)]
    print(f"device: {name}; torch {torch.__version__}; commit {commit[:12]}{' (dirty)' if dirty else ''}; "
          f"{identity.DIGEST_WORKERS} hashing threads")
    print(f"stack: {layers} layers x 4 projections of {hidden} x {hidden} in {args.dtype}: {parameters / 1e9:.2f} "
          f"billion attention parameters ({scale / 1e9:.2f} billion in the whole model)")
    header = f"{'what':<34} {'seconds':>8} {'s / billion attention':>22} {'s / billion model':>18}"
    print_header(header)
    for label, seconds in rows:
        print(f"{label:<34} {seconds:>8.2f} {seconds / parameters * 1e9:>22.2f} {seconds / scale * 1e9:>18.2f}")
    passed = check_seconds / scale * 1e9 < TARGET_SECONDS_PER_BILLION
    print(f"target: the check under {TARGET_SECONDS_PER_BILLION:.1f} s per billion model parameters: "
          f"{'PASS' if passed else 'MISS'}")
    report = {**provenance("fingerprint", name, torch.device("cpu"), args.quick),
              "hashing_threads": identity.DIGEST_WORKERS, "layers": layers, "hidden": hidden, "dtype": args.dtype,
              "attention_parameters": parameters, "model_parameters": scale,
              "seconds": {label: seconds for label, seconds in rows},
              "target": {"what": "check seconds per billion model parameters",
                         "value": check_seconds / scale * 1e9, "threshold": TARGET_SECONDS_PER_BILLION,
                         "passed": passed}}
    write_report(report, args.out, name, "fingerprint", args.quick)


if __name__ == "__main__":
    main()
