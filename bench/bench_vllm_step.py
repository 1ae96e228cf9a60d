"""One vLLM engine step at a time, in this process: the time of the prefill step and of each decode step of a batch of
random prompts, for vLLM's own model and for the FDC model, in one run (so the two are compared on the same machine
state). Where bench_serving.py measures a server under load, this isolates the model step, which is what the
attention backend changes; ``--profile`` also records a torch.profiler table of a few decode steps.

Runs in .venv-vllm: ``PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_vllm_step.py``. The engine core runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and eager (no torch.compile warm-up, and Python's share of a step shows).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed after the prefill step")
    parser.add_argument("--compression", type=float, default=0.1)
    parser.add_argument("--full-rank", action="store_true",
                        help="FDC at full width (every head keeps all its dims): the FDC path at vLLM's own shapes")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per page (vLLM's default if not given)")
    parser.add_argument("--models", nargs="+", default=["uncompressed", "fdc"], choices=["uncompressed", "fdc"])
    parser.add_argument("--profile", type=int, default=0, help="profile this many decode steps (after the timed ones)")
    parser.add_argument("--profile-rows", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def measure(model: str, overrides: dict | None, prompts: list[list[int]], args) -> dict:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    options = {} if args.block_size is None else {"block_size": args.block_size}
    llm = LLM(model=model, dtype="float32", seed=0, enforce_eager=True, hf_overrides=overrides,
              max_model_len=args.prompt_tokens + args.steps + args.profile + 8, **options)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + args.profile + 1, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
    times = []
    for _ in range(1 + args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    table = None
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=activities, record_shapes=True) as profiler:
            for _ in range(args.profile):
                engine.step()
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
    block_size = engine.vllm_config.cache_config.block_size
    engine.engine_core.shutdown()
    del engine, llm
    gc.collect()
    cleanup_dist_env_and_memory()
    decode = times[1:]
    return {"prefill_s": times[0], "decode_ms_median": 1e3 * statistics.median(decode),
            "decode_ms_min": 1e3 * min(decode), "block_size": block_size, "profile": table}


def main() -> None:
    args = parse_args()
    import fdc_ops.vllm
    from fdc_ops import calibration
    from fdc_ops.hf import loading

    model = str(loading.smollm2_path())
    artifact = str(next(path for path in calibration.BUNDLED_ARTIFACTS.iterdir() if path.is_dir()))
    vocab_size = 49152  # SmolLM2's vocabulary
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    results = {}
    for name in args.models:
        if name == "uncompressed":
            overrides = None
        elif args.full_rank:
            shape = calibration.FDCArtifact.load(artifact).shape
            full = [[shape.head_dim] * shape.num_kv_heads] * shape.num_layers
            overrides = fdc_ops.vllm.hf_overrides(model, artifact, qk_dims=full, v_dims=full)
        else:
            overrides = fdc_ops.vllm.hf_overrides(model, artifact, compression=args.compression)
        results[name] = measure(model, overrides, prompts, args)
    for name, result in results.items():
        if result["profile"]:
            print(f"--- profile of {args.profile} decode steps, {name}\n{result['profile']}")
    print(f"{args.requests} requests x {args.prompt_tokens} prompt tokens, {args.steps} decode steps, float32, eager")
    for name, result in results.items():
        print(f"{name:>13} (block {result['block_size']:>3}): prefill {result['prefill_s']:.2f} s, decode step "
              f"median {result['decode_ms_median']:.1f} ms (min {result['decode_ms_min']:.1f})")


if __name__ == "__main__":
    main()
