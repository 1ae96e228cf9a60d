"""What the torch benchmarks share: the attention shape and adaptive layout, the timer, the copy-bandwidth probe,
useful FLOPs, the SDPA backend sweep, the one table of targets (TARGETS), PASS/MISS records, table cells and the
command line; the report's provenance, file and percentiles come from bench_results, the layer every benchmark (the
vLLM ones too) writes through, and are re-exported here.

Each script imports this module first: `python bench/bench_X.py` puts bench/ on sys.path, and importing this module
puts the repository root there for fdc_ops, so the scripts run from any directory with only torch, numpy, the
standard library and fdc_ops.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from bench_results import ROOT, percentile
from bench_results import git_commit as git_commit  # re-exported for the scripts, as are record and write_report
from bench_results import record as record
from bench_results import write_report as write_report

# The scripts import fdc_ops from the checkout they are in, unless run with PYTHONSAFEPATH: then, as everywhere in
# vLLM's environment (README), the caller wants the installed copy (the checkout's extension is built for .venv).
if not sys.flags.safe_path and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fdc_ops.plans import visible_keys  # noqa: E402  (needs ROOT on sys.path)

# Llama-3-8B-like attention: 32 query heads, 8 KV heads of 128.
NUM_KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128
SCALE = HEAD_DIM ** -0.5  # FDC keeps the original head dim's scale
# Adaptive widths: multiples of 8 in 16..128, skewed towards small (most heads compress well, a few barely), drawn
# once from a fixed seed so runs compare; each script sets the mean it studies (its DIM_MEAN).
DIM_LOW, DIM_HIGH, LAYOUT_SEED = 16, 128, 0
# Written before each timed call on a GPU: larger than any L2 (H100 50 MiB, H200 60 MiB) many times over.
FLUSH_BYTES = 256 * 2**20
BACKEND_NAMES = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
CPU_BACKEND_NAMES = ("FLASH_ATTENTION", "MATH")  # efficient and cudnn attention do not exist on the CPU
# What an SDPA backend raises when it refuses the inputs (shape, dtype, GQA): the sweep records it and moves on.
SDPA_REFUSALS = (RuntimeError, NotImplementedError, ValueError)


# ----------------------------------------------------------------------------------------------------------- timing


class Timer:
    """Per-call timings of a callable: CUDA events (L2 flushed before each call) or perf_counter. With a `budget`
    (seconds), the number of timed calls adapts to the call's length: about `budget` seconds in all, at least 3 and at
    most `repeats`; without one, always `repeats`."""

    def __init__(self, device: torch.device, repeats: int, warmup: int, budget: float | None = None):
        self.device, self.repeats, self.warmup, self.budget = device, repeats, warmup, budget
        self.flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.float32, device=device) \
            if device.type == "cuda" else None

    def _one(self, fn) -> float:
        """Wall-clock seconds of one call of fn(), synchronised on a GPU."""
        if self.device.type != "cuda":
            begin = time.perf_counter()
            fn()
            return time.perf_counter() - begin
        torch.cuda.synchronize(self.device)
        begin = time.perf_counter()
        fn()
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - begin

    def __call__(self, fn, repeats: int | None = None, flush: bool = True) -> list[float]:
        """Seconds of each timed call of fn(), after warm-up."""
        for _ in range(self.warmup):
            fn()
        if repeats is None:
            if self.budget is None:
                repeats = self.repeats
            else:
                probe = self._one(fn)
                repeats = int(min(self.repeats, max(3, self.budget / max(probe, 1e-6))))
        return self._timed(fn, repeats, flush)

    def interleaved(self, fns: list, flush: bool = True) -> list[list[float]]:
        """Seconds of each timed call of each of fns, `repeats` rounds that call them in turn after all are warm: a
        slow spell of a shared machine (the 2-core CPU machines' timings drift by 10-20% from one second to the next)
        then falls on every callable alike, so ratios between them hold better than from back-to-back runs."""
        for fn in fns:
            for _ in range(self.warmup):
                fn()
        rounds = [[self._timed(fn, 1, flush)[0] for fn in fns] for _ in range(self.repeats)]
        return [list(times) for times in zip(*rounds)]

    def _timed(self, fn, repeats: int, flush: bool) -> list[float]:
        if self.device.type != "cuda":
            return [self._one(fn) for _ in range(repeats)]
        torch.cuda.synchronize(self.device)
        events = []
        for _ in range(repeats):
            if flush:
                self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) / 1e3 for s, e in events]


def copy_bandwidth(device: torch.device, megabytes: int, timer: Timer) -> float:
    """GB/s of one large copy_ on the device, counting bytes read and written: the memory bandwidth a streaming kernel
    can reach (1 GiB by default, far larger than any cache)."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median(timer(lambda: dst.copy_(src), flush=False))
    src = dst = None  # released: the timed closures above hold them
    return 2 * megabytes * 2**20 / seconds / 1e9


def median(times: list[float]) -> float:
    return statistics.median(times)


def p99(times: list[float]) -> float:
    return percentile(times, 0.99)


def release(device: torch.device) -> None:
    """Hands cached device memory back between cases, so one case's tensors do not crowd the next."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------- layout


def adaptive_dims(mean: int, seed: int = LAYOUT_SEED) -> tuple[list[int], list[int]]:
    """Per-KV-head qk and v widths: multiples of 8 in [DIM_LOW, DIM_HIGH], skewed (Beta(1, 2.2): many narrow heads, a
    tail of wide ones), then nudged 8 at a time (seeded) until they average `mean`."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        x = rng.beta(1.0, 2.2, size=NUM_KV_HEADS)
        dims = DIM_LOW + np.round(x * (DIM_HIGH - DIM_LOW) / 8).astype(int) * 8
        target = int(round(mean * NUM_KV_HEADS / 8)) * 8
        while int(dims.sum()) != target:
            j = int(rng.integers(NUM_KV_HEADS))
            if dims.sum() < target and dims[j] < DIM_HIGH:
                dims[j] += 8
            elif dims.sum() > target and dims[j] > DIM_LOW:
                dims[j] -= 8
        out.append([int(d) for d in dims])
    return out[0], out[1]


def width_ratio(qk_dims: list[int], v_dims: list[int]) -> float:
    """Compressed K + V width over the full width (2 * H_kv * D)."""
    return (sum(qk_dims) + sum(v_dims)) / (2 * NUM_KV_HEADS * HEAD_DIM)


def useful_flops(lengths: list[int], causal: bool, qk_dims: list[int], v_dims: list[int]) -> float:
    """Prefill FLOPs that attention must do: 2 * (d_qk + d_v) per visible key and query head, summed over the
    sequences (s_q = s_k each), visible keys counted exactly (fdc_ops.plans.visible_keys: causal rows see s(s+1)/2)."""
    keys = sum(visible_keys(0, s, s, s, causal) for s in lengths)
    return float(2 * GROUP * sum(dq + dv for dq, dv in zip(qk_dims, v_dims)) * keys)


def ablation_dims() -> tuple[list[int], list[int]]:
    """qk and v widths of the balance ablations: half the KV heads 16 wide, half 128, so tasks' costs differ ~8x and
    a plan that ignores cost shows it."""
    qk_dims = [16] * (NUM_KV_HEADS // 2) + [128] * (NUM_KV_HEADS - NUM_KV_HEADS // 2)
    return qk_dims, list(qk_dims)


def head_buckets(qk_dims: list[int], v_dims: list[int]) -> list[tuple[int, int, int]]:
    """(number of KV heads, d_qk, d_v) for each distinct (d_qk, d_v), in order of first appearance."""
    buckets: dict[tuple[int, int], int] = {}
    for dq, dv in zip(qk_dims, v_dims):
        buckets[(dq, dv)] = buckets.get((dq, dv), 0) + 1
    return [(n, dq, dv) for (dq, dv), n in buckets.items()]



def num_workers_for(device: torch.device) -> int:
    """The backend's default worker count: SMs on a GPU, intra-op threads on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return torch.get_num_threads()


def randn(shape, dtype, device) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=device)


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------------------- SDPA


def has_enable_gqa(device: torch.device) -> bool:
    """Whether this torch's SDPA takes enable_gqa (grouped K/V heads without repeating them)."""
    q = torch.zeros(1, 2, 1, 8, device=device)
    kv = torch.zeros(1, 1, 4, 8, device=device)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
        return True
    except (TypeError, RuntimeError):
        return False


def sdpa_backends(device: torch.device) -> list:
    from torch.nn.attention import SDPBackend
    names = BACKEND_NAMES if device.type == "cuda" else CPU_BACKEND_NAMES
    return [getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)]


class SdpaSweep:
    """The fastest of one baseline's variants, each timed under one SDPA backend; remembers every variant's median
    (us) or why it did not run."""

    def __init__(self, timer: Timer, refusals: tuple[type[Exception], ...] = SDPA_REFUSALS):
        self.timer, self.refusals = timer, refusals
        self.best: list[float] | None = None
        self.best_name = ""
        self.tried: dict[str, float | str] = {}

    def time(self, name: str, backend, run) -> bool:
        """Times run() under `backend`; False (the reason recorded under `name`) where the backend refuses it."""
        from torch.nn.attention import sdpa_kernel
        try:
            with sdpa_kernel([backend]), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                times = self.timer(run)
        except self.refusals as error:
            self.tried[name] = f"unavailable: {first_line(error, 120)}"
            return False
        self.tried[name] = round(median(times) * 1e6, 2)
        if self.best is None or median(times) < median(self.best):
            self.best, self.best_name = times, name
        return True

    def skip(self, name: str, reason: str) -> None:
        """Records a variant not tried, and why."""
        self.tried[name] = f"skipped: {reason}"

    def result(self) -> tuple[list[float], str, dict]:
        """(times of the best, its name, {name: median us or the reason it did not run})."""
        if self.best is None:
            raise RuntimeError(f"no SDPA backend ran: {self.tried}")
        return self.best, self.best_name, self.tried


# --------------------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Targets:
    """What fdc must reach in one phase on one kind of device (a row of TARGETS)."""

    full_ratio_slack: float  # time <= slack x (compressed/full bytes, or useful-FLOP ratio) x full-width SDPA time
    copy_share: float | None  # decode: compressed K/V read at >= this share of the measured copy bandwidth
    scheduler_share: float | None  # decode: decode_plan at most this share of a decode step (plan + attention)
    faster_than: tuple[str, ...]  # baselines (bench_decode / bench_prefill method names) every fdc row must beat


# The one table of targets: every benchmark reads its PASS/MISS thresholds here, by phase and device type. Why each
# number:
# - decode, time slack: a decode step streams the cache once, so reading a w/W share of the bytes should take that
#   share of the time. On a GPU 10% covers what does not shrink with width (launch, query load, split-KV merge). On a
#   CPU 25%: the kernel walks each head's rows separately, and narrow rows (16-64 values, a few vector registers) pay
#   per-row loop and softmax overhead that SDPA's 128-wide rows spread over more bytes.
# - decode, share of copy bandwidth: the measured copy is the ceiling of any streaming kernel. A GPU decode kernel
#   keeps enough loads in flight to get within 15% of it (the rest: the last wave's tail and the merge). A 2-core CPU
#   decode converts bf16 to fp32 and computes a softmax exp per key on the same cores that issue the loads, so 60%.
# - decode, scheduler share: the paper's fused LPT scheduler costs up to 4.13% of a step. On a GPU the plan is one
#   short kernel inside the captured step, so 2%; on a CPU the host planner runs per step, and 4% is the paper's bar.
# - prefill, time slack (GPU and CPU alike): prefill is compute-bound, and narrow heads fill a tensor-core or SIMD
#   tile less well than 128-wide ones (a 16-wide product uses one k-step of a 64-deep tile) while causal row blocks
#   of uneven heads waste part of their last tile; 25% over the useful-FLOP ratio allows for that.
# - faster than: the alternatives a user has for uneven head widths (pad every head to the widest, one SDPA call per
#   bucket of equal widths, Palu-style decompression for decode) must all lose, on every device.
DECODE_BASELINES = ("sdpa_padded", "sdpa_bucketed", "palu_sdpa")
PREFILL_BASELINES = ("sdpa_padded", "sdpa_bucketed")
TARGETS = {
    ("decode", "cuda"): Targets(full_ratio_slack=1.10, copy_share=0.85, scheduler_share=0.02,
                                faster_than=DECODE_BASELINES),
    ("decode", "cpu"): Targets(full_ratio_slack=1.25, copy_share=0.60, scheduler_share=0.04,
                               faster_than=DECODE_BASELINES),
    ("prefill", "cuda"): Targets(full_ratio_slack=1.25, copy_share=None, scheduler_share=None,
                                 faster_than=PREFILL_BASELINES),
    ("prefill", "cpu"): Targets(full_ratio_slack=1.25, copy_share=None, scheduler_share=None,
                                faster_than=PREFILL_BASELINES),
}


# Against the peer a CPU user would pick, vLLM's own CPU attention (bench_vllm_attention.py): fdc's time at most this
# slack x (its compressed/full bytes for decode, useful-FLOP ratio for prefill) x vLLM's full-width time. Decode
# streams the cache once, so its time should follow the bytes within 10%; prefill is compute-bound and narrow heads
# fill SIMD tiles less well, as against SDPA above, so 25%. fdc must also beat vLLM padded to the widest head.
VLLM_PEER_TARGETS = {"decode": 1.10, "prefill": 1.25}


def phase_targets(phase: str, device: torch.device) -> Targets:
    """TARGETS' row for `phase` ("decode" or "prefill") on `device`'s type."""
    key = (phase, device.type)
    if key not in TARGETS:
        raise ValueError(f"phase_targets: no targets for phase {phase!r} on device type {device.type!r}; TARGETS has "
                         f"{sorted(TARGETS)}")
    return TARGETS[key]


# ------------------------------------------------------------------------------------------------------- reporting


def first_line(error: BaseException, width: int = 200) -> str:
    """The first line of an error's message, at most `width` characters: what a row or table records of it."""
    return str(error).splitlines()[0][:width]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def target(where, what, value, threshold, ok) -> dict:
    return dict(where=where, target=what, value=value, threshold=threshold, verdict=verdict(ok))


def faster_than(where: str, micros: float, baselines: dict, methods: tuple[str, ...]) -> list[dict]:
    """A "faster than <method>" target per method: micros over that baseline row's micros, below 1 to pass."""
    out = []
    for method in methods:
        ratio = micros / baselines[method].micros
        out.append(target(where, f"faster than {method}", ratio, 1.0, ratio < 1.0))
    return out


def cell(value: float | None, spec: str, scale: float = 1) -> str:
    """scale * value formatted by `spec` ("{:.1f}"), or "-" where value is missing or not finite."""
    return spec.format(scale * value) if value is not None and math.isfinite(value) else "-"


def detail(row) -> str:
    """A row's label, the SDPA variant that won in brackets, and its error if it has one."""
    text = row.label + (f" [{row.backend}]" if row.backend else "")
    if "error" in row.extra:
        text += f" ERROR {row.extra['error']}"
    return text


@dataclass
class OpRow:
    """One method on one shape in the CPU operator benchmarks (bench_ops.py, bench_vllm_attention.py)."""

    phase: str
    config: str
    dtype: str
    method: str
    millis: float
    metric: float  # GB/s for decode, useful TFLOP/s for prefill
    metric_unit: str
    vs_full: float  # time / the shape's full-width baseline (SDPA in bench_ops, vLLM's attention in its peer bench)
    target: str = ""
    verdict: str = ""
    extra: dict = field(default_factory=dict)


def print_op_rows(rows: list[OpRow], config_width: int, dtype_width: int, method_width: int) -> None:
    header = (f"{'phase':<8} {'config':<{config_width}} {'dtype':<{dtype_width}} {'method':<{method_width}} "
              f"{'ms':>9} {'rate':>15} {'vs full':>8}  target")
    print_header(header)
    for r in rows:
        rate = f"{r.metric:.2f} {r.metric_unit}" if r.metric_unit == "GB/s" else f"{r.metric:.4f} {r.metric_unit}"
        print(f"{r.phase:<8} {r.config:<{config_width}} {r.dtype:<{dtype_width}} {r.method:<{method_width}} "
              f"{r.millis:>9.2f} {rate:>15} {r.vs_full:>7.3f}x  {r.target} {r.verdict}")


def progress(message: str) -> None:
    """One line on stderr as a benchmark goes, flushed: a run stopped at a time limit still shows how far it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def print_header(header: str) -> None:
    print(header)
    print("-" * len(header))


def finite(value):
    """value with every NaN/inf float replaced by None, so the JSON is standard."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def device_line(name: str, commit: str, dirty: bool, device: torch.device) -> str:
    """The start of a benchmark's first printed line: device, torch, commit, workers."""
    vectors = f" ({torch.backends.cpu.get_cpu_capability()})" if device.type == "cpu" else ""
    return (f"device: {name}{vectors}; torch {torch.__version__}; commit {commit[:12]}{' (dirty)' if dirty else ''}; "
            f"workers {num_workers_for(device)}")


def layout_line(qk_dims: list[int], v_dims: list[int]) -> str:
    """The start of a benchmark's second printed line: heads, widths and the share of full width."""
    return (f"layout: {NUM_KV_HEADS * GROUP} query / {NUM_KV_HEADS} KV heads, D={HEAD_DIM}; qk dims {qk_dims}, "
            f"v dims {v_dims} ({width_ratio(qk_dims, v_dims):.3f} of full width)")


def provenance(benchmark: str, name: str, device: torch.device, quick: bool) -> dict:
    """The first keys of an attention benchmark's JSON: what ran, where, on which commit, with how many workers."""
    return record(benchmark, name, device_type=device.type, quick=quick, threads=torch.get_num_threads(),
                  num_workers=num_workers_for(device))


def layout_record(qk_dims: list[int], v_dims: list[int]) -> dict:
    return {"num_heads": NUM_KV_HEADS * GROUP, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
            "qk_dims": qk_dims, "v_dims": v_dims, "width_ratio": width_ratio(qk_dims, v_dims), "seed": LAYOUT_SEED}


# ---------------------------------------------------------------------------------------------------- command line


def bench_parser(description: str, repeats_help: str, topic: str, budget: bool = False) -> argparse.ArgumentParser:
    """The options of an attention benchmark, whose JSON goes to bench/results/<topic>/ by default; with `budget`,
    --budget for a Timer whose timed calls adapt."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, seconds; runs on the CPU too")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / topic), help="folder for the JSON")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=None, help=repeats_help)
    if budget:
        parser.add_argument("--budget", type=float, default=None, help="seconds of timed calls per measurement")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    return parser


def setup(args: argparse.Namespace) -> tuple[torch.device, int]:
    """Applies --threads and --device, seeds torch; returns (device, timed calls per measurement: --repeats, else 3
    with --quick, else 50 on a GPU and 5 on the CPU)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # torch 2.11's set_device refuses a device without an index (seen on an H200)
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    return device, args.repeats or (3 if args.quick else (50 if device.type == "cuda" else 5))
