"""Serving benchmark: vLLM's OpenAI-compatible server with the FDC plugin against the same server uncompressed and
with the Palu baseline, under Poisson arrivals.

For each model (uncompressed, then FDC at each --compression, then Palu at each --palu-compression) a server is
started on 127.0.0.1, and for each arrival rate --requests streaming completions are sent with exponential gaps (one
seeded schedule, the same for every model), each a prompt of --prompt-tokens random tokens asking for exactly
--output-tokens tokens. Per request: TTFT (send to first token), TBT (mean gap between later tokens) and JCT (job
completion time: send to last token); per rate: their medians and 90th percentiles, the request throughput (requests
/ time from the first send to the last token), and from the server's /metrics, sampled every METRICS_PERIOD_S, the
preemptions and the requests it ran at once (the most, and the mean while others waited).

--kv-budget-tokens gives every server the same KV memory: the bytes of that many uncompressed tokens, as whole blocks
of --block-size tokens of the server's own bytes per token (vLLM's num_gpu_blocks_override), so a compressed cache
holds more tokens in the same memory. Long prompts and a rate that queues then make the budget bind, the regime of
the FDC paper's serving figures. "Throughput at equal latency" is the highest
rate, per model, whose p90 TTFT and p90 TBT stay within --ttft-slo and --tbt-slo. The KV cache capacity each server
logs is recorded too: vLLM logs its maximum concurrency times max_model_len, where a request at max_model_len takes
whole blocks, so the servers' max_model_len is rounded up to whole blocks (BLOCK_MULTIPLE) and the logged figure is
the pool's token count. Results are printed and written as JSON (device, torch, vLLM and commit) and a plot under
--out; the servers' logs go to a temporary folder, which errors name.

Run it in the plugin's environment (scripts/setup_vllm.sh), with PYTHONSAFEPATH=1 so that it and the servers import
the installed fdc_ops, not the checkout's:

    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_serving.py           # CPU: the bundled SmolLM2-135M
    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_serving.py --quick   # a smoke run: 2 rates x 8, eager
    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_serving.py --compression 0.062 0.1 --lock /tmp/timing.lock
    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_serving.py --kv-budget-tokens 9216 --prompt-tokens 2048 \
        --output-tokens 128 --requests 10 --rates 4 --compression 0.062 0.2 0.5 --palu-compression 0.013 0.2 0.5 --eager
    .venv-vllm/bin/python bench/bench_serving.py --plot RUN1.json RUN2.json   # redraws; later runs' servers win

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
METRICS_PERIOD_S = 0.25  # how often /metrics is read during a rate's run: a few reads per decode step on 2 CPU cores


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Hugging Face model directory (default: the bundled SmolLM2)")
    parser.add_argument("--artifact", default=None, help="FDC artifact directory (default: the bundled one)")
    parser.add_argument("--compression", type=float, nargs="*", default=[DEFAULT_COMPRESSION],
                        help="one FDC server per value (share of the KV cache removed)")
    parser.add_argument("--palu-compression", type=float, nargs="*", default=[],
                        help="one Palu-baseline server per value (its 99%% point on SmolLM2 is 0.013)")
    parser.add_argument("--kv-budget-tokens", type=int, default=None,
                        help="every server's KV memory: the bytes of this many uncompressed tokens (default: "
                             "--kv-cache-gib each)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per KV block (vLLM's CPU default)")
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


def budget_blocks(budget_tokens: int, bytes_per_token: dict[str, int], block_size: int) -> dict[str, int]:
    """Every server's KV blocks within the same memory, the bytes of ``budget_tokens`` uncompressed tokens: whole
    blocks of ``block_size`` tokens of its own ``bytes_per_token`` (which has an "uncompressed" entry)."""
    budget_bytes = budget_tokens * bytes_per_token["uncompressed"]
    return {label: budget_bytes // (block_size * size) for label, size in bytes_per_token.items()}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """vLLM's OpenAI-compatible server (the module `vllm serve` runs: vllm-cpu 0.32.0's `vllm` command fails on its
    own version lookup) in its own process group, its output in a log file."""

    def __init__(self, model: str, name: str, overrides: dict | None, args, log_path: Path,
                 num_blocks: int | None = None):
        self.port, self.name, self.log_path = free_port(), name, log_path
        command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", model,
                   "--host", "127.0.0.1", "--port", str(self.port), "--dtype", args.dtype, "--seed", str(args.seed),
                   "--served-model-name", name, "--max-model-len", str(max_model_len(args)),
                   "--block-size", str(args.block_size)]
        if num_blocks is not None:
            command += ["--num-gpu-blocks-override", str(num_blocks)]
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


def read_metrics(text: str) -> dict[str, float]:
    """The scheduler's gauges and counters in a /metrics page (Prometheus text; summed over label sets)."""
    values = {"running": 0.0, "waiting": 0.0, "preemptions": 0.0}
    names = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "vllm:num_preemptions_total": "preemptions"}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            values[names[name]] += float(line.rsplit(" ", 1)[1])
    return values


async def sample_metrics(http, samples: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(read_metrics((await http.get("/metrics")).text))
        try:
            await asyncio.wait_for(stop.wait(), METRICS_PERIOD_S)
        except asyncio.TimeoutError:
            pass


async def run_rate(port: int, name: str, prompts: list[list[int]], delays: list[float], output_tokens: int) -> dict:
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=1800,
                                max_retries=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        before = read_metrics((await http.get("/metrics")).text)
        samples: list[dict] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_metrics(http, samples, stop))
        origin = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, name, prompt, output_tokens, delay, origin)
                                         for prompt, delay in zip(prompts, delays)))
        stop.set()
        await sampler
        after = read_metrics((await http.get("/metrics")).text)
    await client.close()
    ttft, tbt = [r["ttft"] for r in results], [r["tbt"] for r in results]
    jct = [r["end"] - r["sent"] for r in results]
    makespan = max(r["end"] for r in results) - min(r["sent"] for r in results)
    queued = [sample["running"] for sample in samples if sample["waiting"] > 0]
    return {"ttft_median_s": statistics.median(ttft), "ttft_p90_s": percentile(ttft, 0.9),
            "tbt_median_s": statistics.median(tbt), "tbt_p90_s": percentile(tbt, 0.9),
            "jct_median_s": statistics.median(jct), "jct_p90_s": percentile(jct, 0.9),
            "throughput_rps": len(results) / makespan, "makespan_s": makespan,
            "preemptions": int(after["preemptions"] - before["preemptions"]),
            "running_max": int(max((sample["running"] for sample in samples), default=0)),
            "running_mean_while_queued": statistics.mean(queued) if queued else None,
            "requests": results}


def serve_and_measure(model: str, label: str, overrides: dict | None, args, logs: Path,
                      prompts: list[list[int]], schedules: dict[float, list[float]],
                      num_blocks: int | None = None) -> dict:
    """Starts one server, runs a warm-up and then every rate's schedule against it, stops it; returns its run."""
    import openai

    server = Server(model, label, overrides, args, logs / f"{label}.log", num_blocks)
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
                  f"{1000 * row['tbt_p90_s']:.1f} ms | JCT median {row['jct_median_s']:.2f} s p90 "
                  f"{row['jct_p90_s']:.2f} s | {row['throughput_rps']:.3f} req/s | running at most "
                  f"{row['running_max']}, {row['preemptions']} preemptions", flush=True)
        return {"startup_s": startup, "kv_cache_tokens": server.kv_cache_tokens(), "rates": rates}
    finally:
        server.stop()


def plot(reports: list[dict], path: Path) -> None:
    """JCT (median, with the p90 above it), TBT and throughput of every server at the reports' first rate, one group
    of bars per compression; a later report's server replaces an earlier one's of the same name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fdc_ops import files

    runs = {label: run for report in reports for label, run in report["runs"].items()}
    rate = next(iter(reports[-1]["runs"].values()))["rates"]
    rate = next(iter(rate))
    methods = ["uncompressed", "fdc", "palu"]
    compressions = {label: "0" if label == "uncompressed" else label.split("-", 1)[1] for label in runs}
    groups = sorted(set(compressions.values()), key=float)
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / len(methods)
    for index, method in enumerate(methods):
        labels = [label for label in runs if label.split("-", 1)[0] == method and rate in runs[label]["rates"]]
        positions = [groups.index(compressions[label]) + (index - 1) * width for label in labels]
        rows = [runs[label]["rates"][rate] for label in labels]
        medians = [row["jct_median_s"] for row in rows]
        spread = [[0] * len(rows), [row["jct_p90_s"] - row["jct_median_s"] for row in rows]]
        axes[0].bar(positions, medians, width, yerr=spread, capsize=3, label=method)
        axes[1].bar(positions, [1000 * row["tbt_median_s"] for row in rows], width, label=method)
        axes[2].bar(positions, [row["throughput_rps"] for row in rows], width, label=method)
    for axis, title in zip(axes, ("JCT (s): median, p90 above", "time between tokens, median (ms)",
                                  "throughput (req/s)")):
        axis.set_xticks(range(len(groups)), [f"{float(group):.3g}" for group in groups])
        axis.set_xlabel("KV compression")
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
        axis.legend(fontsize=8)
    last = reports[-1]
    figure.suptitle(f"{last['device']}, {rate} req/s, {last['args']['requests']} requests of "
                    f"{last['args']['prompt_tokens']} + {last['args']['output_tokens']} tokens, KV budget "
                    f"{last['args']['kv_budget_tokens']} uncompressed tokens", fontsize=10)
    figure.tight_layout()
    files.write_atomically(str(path), lambda temporary: figure.savefig(temporary, dpi=100, format="png"))
    print(f"wrote {path}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--plot":  # python bench_serving.py --plot REPORT.json [REPORT.json ...]
        paths = [Path(name) for name in sys.argv[2:]]
        plot([json.loads(path.read_text()) for path in paths], paths[-1].with_suffix(".png"))
        return
    args = parse_args()
    import torch

    import fdc_ops.vllm
    from fdc_ops import calibration
    from fdc_ops.apps import provenance
    from fdc_ops.hf import loading

    model = args.model or str(loading.smollm2_path())
    if args.artifact is not None:
        artifact = args.artifact
    elif args.model is not None:
        raise SystemExit("bench_serving: give --artifact (the bundled one is for the bundled model only)")
    else:
        artifact = str(calibration.bundled_artifact())
    loaded = calibration.FDCArtifact.load(artifact)
    allocations = {f"fdc-{compression}": loaded.allocate(compression=compression) for compression in args.compression}
    allocations.update({f"palu-{compression}": loaded.allocate(compression=compression, method="palu")
                        for compression in args.palu_compression})
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
        (f"{method}-{compression}", fdc_ops.vllm.hf_overrides(model, artifact, compression=compression, method=method))
        for method, values in (("fdc", args.compression), ("palu", args.palu_compression)) for compression in values]
    element_bytes = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    bytes_per_token = {"uncompressed": 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * element_bytes,
                       **{label: allocation.kv_bytes_per_token(element_bytes)
                          for label, allocation in allocations.items()}}
    num_blocks = {label: None for label, _ in servers}
    if args.kv_budget_tokens is not None:
        num_blocks = budget_blocks(args.kv_budget_tokens, bytes_per_token, args.block_size)
        print(f"KV budget {args.kv_budget_tokens * bytes_per_token['uncompressed'] / 2**20:.1f} MiB: blocks of "
              f"{args.block_size} tokens per server {num_blocks}")
    for label, overrides in servers:
        with exclusive(args.lock):
            runs[label] = serve_and_measure(model, label, overrides, args, logs, prompts, schedules,
                                            num_blocks[label])

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
        kv_bytes_per_token=bytes_per_token, kv_blocks=num_blocks, runs=runs)
    path = bench_results.write_report(report, args.out, name, "serving")
    plot([report], path.with_suffix(".png"))


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
