"""Serving benchmark: vLLM's OpenAI-compatible server with the FDC plugin against the same server uncompressed, under
Poisson arrivals.

For each model (uncompressed, then FDC at each --compression) a server is started on 127.0.0.1, and for each arrival
rate --requests streaming completions are sent with exponential gaps (one seeded schedule, the same for every model),
each a prompt of --prompt-tokens random tokens asking for exactly --output-tokens tokens. Per request: TTFT (send to
first token) and TBT (mean gap between later tokens); per rate: their medians and 90th percentiles and the request
throughput (requests / time from the first send to the last token). "Throughput at equal latency" is the highest
rate, per model, whose p90 TTFT and p90 TBT stay within --ttft-slo and --tbt-slo. The KV cache capacity each server
logs is recorded too: vLLM logs its maximum concurrency times max_model_len, where a request at max_model_len takes
whole blocks, so the servers' max_model_len is rounded up to whole blocks (BLOCK_MULTIPLE) and the logged figure is
the pool's token count. Results are printed and written as JSON (device, torch, vLLM and commit) under --out; the
servers' logs go to a temporary folder, which errors name.

Run it in the plugin's environment (scripts/setup_vllm.sh), with PYTHONSAFEPATH=1 so that it and the servers import
the installed fdc_ops, not the checkout's:

    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_serving.py           # CPU: the bundled SmolLM2-135M
    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_serving.py --quick   # a smoke run: 2 rates x 8, eager
    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_serving.py --compression 0.062 0.1 --lock /tmp/timing.lock

The same script runs unchanged where vLLM has a GPU (it passes no device options); the default compression, 0.062,
is what `python -m fdc_ops eval` finds keeps 99% of SmolLM2's perplexity score (bench/results/eval/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench_results sits beside this script; run with PYTHONSAFEPATH, Python puts no folder on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_results  # noqa: E402
from bench_results import exclusive, percentile  # noqa: E402

ROOT = bench_results.ROOT
DEFAULT_COMPRESSION = 0.062  # the FDC defaults' 99% point on SmolLM2 (bench/results/eval/README.md)
STARTUP_TIMEOUT_S = 900  # three processes, weights and torch.compile's warm-up on 2 CPU cores take minutes
# vLLM's block size is 128 tokens on the CPU and 16 on GPUs by default: a max_model_len that is a multiple of 128 is
# whole blocks on both, so the capacity vLLM logs (max concurrency x max_model_len) is the pool's token count.
BLOCK_MULTIPLE = 128


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face model directory (default: the bundled SmolLM2)")
    parser.add_argument("--artifact", default=None, help="FDC artifact directory (default: the bundled one)")
    parser.add_argument("--compression", type=float, nargs="+", default=[DEFAULT_COMPRESSION],
                        help="one FDC server per value (share of the KV cache removed)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0], help="requests per second")
    parser.add_argument("--requests", type=int, default=24, help="requests per rate")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--ttft-slo", type=float, default=5.0, help="p90 TTFT bound (s) for equal latency")
    parser.add_argument("--tbt-slo", type=float, default=0.5, help="p90 TBT bound (s) for equal latency")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB) on the CPU")
    parser.add_argument("--eager", action="store_true", help="vLLM's eager mode (no torch.compile warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 rates x 8 requests, 32 output tokens, eager")
    parser.add_argument("--lock", default=None,
                        help="a file to hold an exclusive flock on while each server runs (on a shared machine: "
                             "other jobs that take the lock wait, and no hold spans more than one server)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "serving"))
    args = parser.parse_args()
    if args.quick:
        args.rates, args.requests, args.output_tokens, args.eager = [0.5, 2.0], 8, 32, True
    return args


def max_model_len(args) -> int:
    """The prompt, the output and 16 tokens of slack (the chat-free completion adds none; a BOS may be added),
    rounded up to whole blocks (BLOCK_MULTIPLE)."""
    needed = args.prompt_tokens + args.output_tokens + 16
    return -(-needed // BLOCK_MULTIPLE) * BLOCK_MULTIPLE


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """vLLM's OpenAI-compatible server (the module `vllm serve` runs: vllm-cpu 0.32.0's `vllm` command fails on its
    own version lookup) in its own process group, its output in a log file."""

    def __init__(self, model: str, name: str, overrides: dict | None, args, log_path: Path):
        self.port, self.name, self.log_path = free_port(), name, log_path
        command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model,
                   "--host", "127.0.0.1", "--port", str(self.port), "--dtype", args.dtype, "--seed", str(args.seed),
                   "--served-model-name", name, "--max-model-len", str(max_model_len(args))]
        if overrides is not None:
            command += ["--hf-overrides", json.dumps(overrides)]
        if args.eager:
            command.append("--enforce-eager")
        env = dict(os.environ, PYTHONSAFEPATH="1")  # vLLM's subprocesses must not import the checkout's fdc_ops
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def wait_ready(self, client) -> float:
        import openai

        begin = time.monotonic()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"bench_serving: the {self.name} server exited with {self.process.returncode}; "
                                   f"log: {self.log_path}")
            try:
                client.models.list()
                return time.monotonic() - begin
            except openai.APIConnectionError:
                if time.monotonic() - begin > STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"bench_serving: the {self.name} server did not answer within "
                                       f"{STARTUP_TIMEOUT_S} s; log: {self.log_path}") from None
                time.sleep(2)

    def kv_cache_tokens(self) -> int | None:
        match = re.search(r"KV cache size: ([\d,]+) tokens", self.log_path.read_text())
        return int(match.group(1).replace(",", "")) if match else None

    def stop(self) -> None:
        if self.process.poll() is not None:  # exited by itself (a failed start): nothing to stop
            return
        os.killpg(self.process.pid, 15)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
            self.process.wait()


async def one_request(client, name: str, prompt: list[int], output_tokens: int, delay: float, origin: float) -> dict:
    """Waits until origin + delay, then streams one completion; times in seconds from origin."""
    await asyncio.sleep(max(0.0, origin + delay - time.perf_counter()))
    sent = time.perf_counter()
    token_times = []
    stream = await client.completions.create(model=name, prompt=prompt, max_tokens=output_tokens, temperature=0.0,
                                             stream=True, extra_body={"ignore_eos": True, "min_tokens": output_tokens})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            token_times.append(time.perf_counter())
    if not token_times:
        raise RuntimeError("bench_serving: a request streamed no tokens")
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    return {"sent": sent - origin, "ttft": token_times[0] - sent, "tbt": statistics.mean(gaps) if gaps else 0.0,
            "end": token_times[-1] - origin, "chunks": len(token_times)}


async def run_rate(port: int, name: str, prompts: list[list[int]], delays: list[float], output_tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600,
                                max_retries=0)
    origin = time.perf_counter()
    results = await asyncio.gather(*(one_request(client, name, prompt, output_tokens, delay, origin)
                                     for prompt, delay in zip(prompts, delays)))
    await client.close()
    ttft, tbt = [r["ttft"] for r in results], [r["tbt"] for r in results]
    makespan = max(r["end"] for r in results) - min(r["sent"] for r in results)
    return {"ttft_median_s": statistics.median(ttft), "ttft_p90_s": percentile(ttft, 0.9),
            "tbt_median_s": statistics.median(tbt), "tbt_p90_s": percentile(tbt, 0.9),
            "throughput_rps": len(results) / makespan, "makespan_s": makespan, "requests": results}


def serve_and_measure(model: str, label: str, overrides: dict | None, args, logs: Path,
                      prompts: list[list[int]], schedules: dict[float, list[float]]) -> dict:
    """Starts one server, runs a warm-up and then every rate's schedule against it, stops it; returns its run."""
    import openai

    server = Server(model, label, overrides, args, logs / f"{label}.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", timeout=60,
                               max_retries=0)
        startup = server.wait_ready(client)
        print(f"{label}: server ready in {startup:.0f} s, KV cache {server.kv_cache_tokens()} tokens", flush=True)
        asyncio.run(run_rate(server.port, label, prompts[:2], [0.0, 0.0], args.output_tokens))  # warm-up
        rates = {}
        for rate in args.rates:
            rates[str(rate)] = asyncio.run(run_rate(server.port, label, prompts, schedules[rate], args.output_tokens))
            row = rates[str(rate)]
            print(f"{label:>16} {rate:5.2f} req/s: TTFT median {row['ttft_median_s']:.3f} s p90 "
                  f"{row['ttft_p90_s']:.3f} s | TBT median {1000 * row['tbt_median_s']:.1f} ms p90 "
                  f"{1000 * row['tbt_p90_s']:.1f} ms | {row['throughput_rps']:.3f} req/s", flush=True)
        return {"startup_s": startup, "kv_cache_tokens": server.kv_cache_tokens(), "rates": rates}
    finally:
        server.stop()


def main() -> None:
    args = parse_args()
    import torch

    import fdc_ops.vllm
    from fdc_ops import calibration
    from fdc_ops.apps import provenance
    from fdc_ops.hf import loading

    model = args.model or str(loading.smollm2_path())
    if args.artifact is not None:
        artifact = args.artifact
    else:
        bundled = sorted(path for path in calibration.BUNDLED_ARTIFACTS.iterdir() if path.is_dir())
        if len(bundled) != 1 or args.model is not None:
            raise SystemExit("bench_serving: give --artifact (the bundled one is for the bundled model only)")
        artifact = str(bundled[0])
    loaded = calibration.FDCArtifact.load(artifact)
    allocations = {f"fdc-{compression}": loaded.allocate(compression=compression) for compression in args.compression}
    shape = loaded.shape
    rng = random.Random(args.seed)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
    schedules = {}
    for rate in args.rates:
        delays, clock = [], 0.0
        for _ in range(args.requests):
            delays.append(clock)
            clock += rng.expovariate(rate)
        schedules[rate] = delays

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    logs = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    runs = {}
    servers = [("uncompressed", None)] + [
        (f"fdc-{compression}", fdc_ops.vllm.hf_overrides(model, artifact, compression=compression))
        for compression in args.compression]
    for label, overrides in servers:
        with exclusive(args.lock):
            runs[label] = serve_and_measure(model, label, overrides, args, logs, prompts, schedules)

    print(f"\nthroughput at equal latency (p90 TTFT <= {args.ttft_slo} s, p90 TBT <= {args.tbt_slo} s):")
    for label, run in runs.items():
        within = [(float(rate), row) for rate, row in run["rates"].items()
                  if row["ttft_p90_s"] <= args.ttft_slo and row["tbt_p90_s"] <= args.tbt_slo]
        best = max(within, key=lambda item: item[1]["throughput_rps"], default=None)
        run["throughput_at_slo_rps"] = best[1]["throughput_rps"] if best else None
        run["rate_at_slo"] = best[0] if best else None
        print(f"  {label:>16}: " + (f"{best[1]['throughput_rps']:.3f} req/s (offered {best[0]} req/s)" if best
                                    else "no tested rate meets it"))
    name = provenance.device_name(device)
    report = bench_results.record(
        "serving", name, vllm=importlib.metadata.version("vllm-cpu" if _installed("vllm-cpu") else "vllm"),
        args=vars(args), model=model, artifact=artifact, max_model_len=max_model_len(args),
        compression_rate={label: allocation.compression_rate for label, allocation in allocations.items()},
        kv_elements_per_token={"uncompressed": 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim,
                               **{label: allocation.kv_bytes_per_token(1)
                                  for label, allocation in allocations.items()}},
        runs=runs)
    bench_results.write_report(report, args.out, name, "serving")


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
