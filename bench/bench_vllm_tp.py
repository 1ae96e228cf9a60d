"""KV cache capacity of FDC models under vLLM's tensor parallelism, as vLLM reports it, and the greedy tokens.

For vLLM's own model and each FDC compression, one eager engine per rank count: vLLM's capacity (its blocks times the
block size; on the CPU each rank has its own VLLM_CPU_KVCACHE_SPACE GiB, so N ranks hold N times one rank's heads'
cache for the same per-rank space) next to what the widths predict (one rank: the packed widths; N ranks: the pages
of every layer's widest rank share, fdc_ops.parallel), the share of the ranks' pages in use, and whether the greedy
tokens of a few prompts are one rank's. Runs in .venv-vllm:

    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_vllm_tp.py --ranks 3 --compression 0.1 0.2

The defaults are the bundled SmolLM2-135M (9 query / 3 KV heads: 3 ranks, one KV head each) and its artifact.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process; workers are spawned per rank
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# bench_results sits beside this script; run with PYTHONSAFEPATH, Python puts no folder on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_results  # noqa: E402

ROOT = bench_results.ROOT
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Hugging Face model directory (default: the bundled SmolLM2)")
    parser.add_argument("--artifact", default=None, help="its FDC artifact (default: the bundled one)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[3], help="tensor_parallel_size values besides 1")
    parser.add_argument("--compression", type=float, nargs="+", default=[0.1, 0.2])
    parser.add_argument("--max-model-len", type=int, default=512,
                        help="a multiple of the block size, so that vLLM's logged capacity is its pool")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm"))
    return parser.parse_args()


def run_engine(model: str, overrides: dict | None, ranks: int, args) -> dict:
    import gc

    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    import fdc_ops.vllm

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = fdc_ops.vllm.cpu_thread_binding(ranks)
    start = time.perf_counter()
    llm = LLM(model=model, dtype="float32", seed=0, enforce_eager=True, hf_overrides=overrides,
              tensor_parallel_size=ranks, max_model_len=args.max_model_len)
    started = time.perf_counter() - start
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=args.new_tokens), use_tqdm=False)
        cache = llm.llm_engine.vllm_config.cache_config
        return {"capacity_tokens": cache.num_gpu_blocks * cache.block_size, "block_size": cache.block_size,
                "tokens": [list(output.outputs[0].token_ids) for output in outputs], "startup_s": started}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def main() -> None:
    args = parse_args()
    import torch

    import fdc_ops.vllm
    from fdc_ops import calibration, parallel
    from fdc_ops.apps import provenance
    from fdc_ops.hf import loading

    model = args.model or str(loading.smollm2_path())
    if args.artifact is None and args.model is not None:
        raise SystemExit("bench_vllm_tp: give --artifact (the bundled one is for the bundled model only)")
    artifact_dir = args.artifact or str(calibration.bundled_artifact())
    artifact = calibration.FDCArtifact.load(artifact_dir)
    shape = artifact.shape
    space = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) << 30
    rows = []
    for compression in [None] + args.compression:
        if compression is None:
            label, overrides = "uncompressed", None
            full = torch.full((shape.num_layers, shape.num_kv_heads), shape.head_dim)
            allocation = calibration.RankAllocation(full, full.clone(), shape.head_dim, "uncompressed")
        else:
            label = f"fdc-{compression}"
            overrides = fdc_ops.vllm.hf_overrides(model, artifact_dir, compression=compression)
            allocation = artifact.allocate(compression=compression)
        one_rank = None
        for ranks in [1] + args.ranks:
            if ranks == 1:
                columns, efficiency = int((allocation.qk_dims + allocation.v_dims).sum()), 1.0
            else:
                partition = parallel.balance(allocation.qk_dims, allocation.v_dims, ranks, shape.num_heads)
                columns, efficiency = int(partition.page_widths.sum()), partition.efficiency
            result = run_engine(model, overrides, ranks, args)
            block = result["block_size"]
            row = {"model": label, "ranks": ranks, "compression_rate": allocation.compression_rate,
                   "columns_per_token_per_rank": columns, "pages_in_use": efficiency,
                   "predicted_tokens": space // (block * columns * 4) * block, **result}
            if ranks == 1:
                one_rank = row
            row["tokens_match_one_rank"] = row["tokens"] == one_rank["tokens"]
            row["capacity_vs_one_rank"] = row["capacity_tokens"] / one_rank["capacity_tokens"]
            rows.append(row)
            print(f"{label:>13} ranks {ranks}: capacity {row['capacity_tokens']:>9,} tokens (predicted "
                  f"{row['predicted_tokens']:,}; x{row['capacity_vs_one_rank']:.3f} of one rank), pages in use "
                  f"{efficiency:.3f}, tokens as one rank's: {row['tokens_match_one_rank']}, start-up "
                  f"{row['startup_s']:.0f} s", flush=True)
    device = provenance.device_name(torch.device("cpu"))
    report = bench_results.record("vllm-tp", device, vllm=importlib.metadata.version("vllm-cpu"), args=vars(args),
                                  model=model, artifact=artifact_dir, kv_cache_space_bytes_per_rank=space,
                                  dtype="float32", rows=rows)
    bench_results.write_report(report, args.out, device, "vllm-tp")


if __name__ == "__main__":
    main()
