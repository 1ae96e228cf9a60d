"""One attention layer's step in each vLLM backend, without the engine: what the backend's own Python costs per layer
and step. For fdc's backend (``FDCAttentionImpl.forward``, which writes the step's rows itself) and vLLM's CPU backend
(``CPUAttentionBackendImpl.do_kv_cache_update`` then ``forward``, as vLLM's layer calls them), on a SmolLM2-shaped
layer (9 query heads, 3 KV heads of 64; fdc's widths a fixed layout near its 99% point), the time of the backend's
calls (step), the op calls they make, made directly through the ops' OpOverloads with the same tensors (ops; vLLM:
its cache write and attention; fdc: the two rotate_compress calls, append_kv, decode_attention and, for a step with a
prompt, prefill_attention), and the backend's calls with those ops replaced by functions that return their results,
made beforehand (own: the backend's own per-layer work, its Python, views and slices, and fdc's copy of the op
results into vLLM's output, without the kernels' time and its noise). What each backend does once per step for all
its layers is timed apart (per step: fdc's metadata build and decode plan; vLLM's scheduler metadata op, its
builder's Python not included).

Runs in vLLM's environment, where fdc_ops is the installed copy (scripts/setup_vllm.sh):

    PYTHONSAFEPATH=1 .venv-vllm/bin/python bench/bench_vllm_layer.py

Each measurement is the mean of ``--calls`` calls in a row; the methods take turns, ``--repeats`` rounds, medians
reported. Target (issue 41, item 4): fdc's own work per layer at most vLLM's. Prints a table and writes JSON to
bench/results/vllm/ (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

# bench_results sits beside this script; run with PYTHONSAFEPATH, Python puts no folder on sys.path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402

import bench_results  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention
GROUP = NUM_HEADS // NUM_KV_HEADS
SCALE = HEAD_DIM ** -0.5
# A layer's widths near SmolLM2's 99% point (multiples of 8, uneven over the heads); the backends' own work does not
# depend on them, the ops' time does a little.
QK_DIMS, V_DIMS = [40, 56, 24], [48, 32, 56]
BLOCK = 128  # vLLM's CPU block size
# (name, query tokens per request, cached tokens per request before the step): the steps a server runs
STEPS = {
    "decode 8 x 256": ([1] * 8, [255] * 8),
    "decode 32 x 1024": ([1] * 32, [1023] * 32),
    "8 decodes + a 256-token prompt": ([1] * 8 + [256], [255] * 8 + [0]),
}
QUICK_STEPS = {"decode 2 x 64": ([1] * 2, [63] * 2), "2 decodes + a 16-token prompt": ([1, 1, 16], [63, 63, 0])}


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny steps and few calls, seconds")
    parser.add_argument("--calls", type=int, default=None, help="calls in a row per measurement (default 200)")
    parser.add_argument("--repeats", type=int, default=None, help="rounds of every method in turn (default 15)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--out", default=str(bench_results.ROOT / "bench" / "results" / "vllm"),
                        help="folder of the JSON report")
    return parser.parse_args(argv)


def block_table(num_reqs: int, blocks: int, seed: int) -> torch.Tensor:
    """(num_reqs, blocks) int32: distinct pages, shuffled over a pool of num_reqs * blocks."""
    order = torch.randperm(num_reqs * blocks, generator=torch.Generator().manual_seed(seed))
    return order.view(num_reqs, blocks).to(torch.int32)


def common_metadata(query_lens: list[int], seq_lens: list[int], table: torch.Tensor):
    """vLLM's CommonAttentionMetadata of the step, on the CPU."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from fdc_ops import ops

    query_start_loc = ops.prefix_sums(query_lens)
    tokens = sum(query_lens)
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(seq_lens), num_actual_tokens=tokens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_table_tensor=table,
        slot_mapping=slot_mapping(query_lens, seq_lens, table))


def slot_mapping(query_lens: list[int], seq_lens: list[int], table: torch.Tensor) -> torch.Tensor:
    """(T,) int64: the cache slot of each new token (page * BLOCK + offset), as vLLM's model runner makes it."""
    slots = []
    for b, (q, s) in enumerate(zip(query_lens, seq_lens)):
        positions = torch.arange(s - q, s)
        slots.append(table[b, positions // BLOCK].long() * BLOCK + positions % BLOCK)
    return torch.cat(slots)


class FdcLayer:
    """fdc's backend on one layer: the layer's layout as fdc_ops.vllm.layer.FDCPagedAttention carries it, the impl,
    the step's metadata from the backend's builder, and the step's inputs."""

    def __init__(self, common, dtype: torch.dtype, blocks: int):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        from fdc_ops import ops
        from fdc_ops.vllm.backend import FDCAttentionImpl, FDCAttentionMetadataBuilder

        k_width, v_width = sum(QK_DIMS), sum(V_DIMS)
        rotation = torch.linalg.qr(torch.randn(NUM_KV_HEADS, HEAD_DIM, HEAD_DIM, dtype=torch.float64))[0]
        self.layer = SimpleNamespace(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, group=GROUP,
                                     qk_offsets=ops.prefix_sums(QK_DIMS), v_offsets=ops.prefix_sums(V_DIMS),
                                     rotation=rotation[:, :, :max(QK_DIMS)].to(dtype).contiguous(), scaling=SCALE,
                                     k_width=k_width, v_width=v_width)
        self.impl = FDCAttentionImpl(NUM_HEADS, HEAD_DIM, SCALE, NUM_KV_HEADS, alibi_slopes=None, sliding_window=None,
                                     kv_cache_dtype="auto")
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=k_width, head_size_v=v_width,
                                 dtype=dtype)
        config = SimpleNamespace(parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                                 speculative_config=None)
        self.builder = FDCAttentionMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))
        self.common = common
        self.meta = self.builder.build(0, common)
        tokens = common.num_actual_tokens
        self.kv_cache = torch.randn(blocks, 1, BLOCK, k_width + v_width, dtype=dtype)
        self.query = torch.randn(tokens, NUM_HEADS * HEAD_DIM, dtype=dtype)
        self.key = torch.randn(tokens, NUM_KV_HEADS * HEAD_DIM, dtype=dtype)
        self.value = torch.randn(tokens, v_width, dtype=dtype)
        self.output = torch.empty(tokens, GROUP * v_width, dtype=dtype)
        self.step()  # makes the step's decode plan, which every later layer of the step takes from the metadata
        self.plan = self.meta.decode_plans.get((NUM_KV_HEADS, GROUP, -1))
        self.k_pages, self.v_pages = self.impl.paged_caches(self.kv_cache, self.layer)
        self.make_stubs()

    def step(self) -> torch.Tensor:
        return self.impl.forward(self.layer, self.query, self.key, self.value, self.kv_cache, self.meta, self.output)

    def bare(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The op calls of step(), through their OpOverloads, with what the backend keeps between layers; returns
        the decode and prefill results (None where the step has none)."""
        fdc, layer, meta = torch.ops.fdc, self.layer, self.meta
        tokens, decodes = self.query.shape[0], meta.num_decodes
        q = fdc.rotate_compress.default(self.query.view(tokens, NUM_HEADS, HEAD_DIM), layer.rotation,
                                        layer.qk_offsets, GROUP)
        k = fdc.rotate_compress.default(self.key.view(tokens, NUM_KV_HEADS, HEAD_DIM), layer.rotation,
                                        layer.qk_offsets, 1)
        fdc.append_kv.default(self.k_pages, self.v_pages, k, self.value, meta.query_start_loc, meta.context_lens,
                              layer.qk_offsets, layer.v_offsets, meta.block_table)
        decoded = prefilled = None
        if meta.prefill is not None:  # the steps here have no cached prefix: prompts attend their own rows
            rows = meta.prefill.query_rows
            prefilled = fdc.prefill_attention.default(q, k, self.value, rows, rows, layer.qk_offsets,
                                                      layer.v_offsets, GROUP, SCALE, True)
        if decodes:
            decoded = fdc.decode_attention.default(q if decodes == tokens else q[:decodes], self.k_pages,
                                                   self.v_pages, meta.decode_seq_lens, layer.qk_offsets,
                                                   layer.v_offsets, GROUP, SCALE, self.plan, meta.decode_block_table)
        return decoded, prefilled

    def own(self) -> torch.Tensor:
        """step() with the backend's ops replaced by functions returning the results bare() made."""
        from fdc_ops.vllm import backend

        with mock.patch.object(backend, "ops", self.stubs):
            return self.step()

    def make_stubs(self) -> None:
        from fdc_ops import ops

        layer = self.layer
        tokens = self.query.shape[0]
        q = ops.rotate_compress(self.query.view(tokens, NUM_HEADS, HEAD_DIM), layer.rotation, layer.qk_offsets, GROUP)
        k = ops.rotate_compress(self.key.view(tokens, NUM_KV_HEADS, HEAD_DIM), layer.rotation, layer.qk_offsets, 1)
        decode_out, prefill_out = self.bare()
        self.stubs = SimpleNamespace(
            rotate_compress=lambda x, rot, qk_offsets, group, out_width=None: q if group == GROUP else k,
            append_kv=lambda *args, **kwargs: None, decode_attention=lambda *args, **kwargs: decode_out,
            prefill_attention=lambda *args, **kwargs: prefill_out, decode_plan=lambda *args, **kwargs: self.plan)

    def per_step(self) -> None:
        """What fdc's backend does once per step for all its layers: the metadata and the decode plan."""
        meta = self.builder._build(self.common)
        self.impl.decode_plan(meta, self.layer)


class VllmLayer:
    """vLLM's CPU backend on one layer at full head size: its impl (built under a stand-in config that names the
    model dtype, all its constructor reads of it), its metadata with the scheduler metadata its builder makes, its
    paged cache, and the step's inputs."""

    def __init__(self, query_lens: list[int], seq_lens: list[int], table: torch.Tensor, dtype: torch.dtype,
                 blocks: int):
        from vllm import envs
        from vllm.v1.attention.backends import cpu_attn

        from fdc_ops import ops

        config = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))
        with mock.patch.object(cpu_attn, "get_current_vllm_config", lambda: config):
            self.impl = cpu_attn.CPUAttentionBackendImpl(NUM_HEADS, HEAD_DIM, SCALE, NUM_KV_HEADS, None, None, "auto")
        isa = cpu_attn._get_attn_isa(dtype, BLOCK, HEAD_DIM)
        self.layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
        tokens = sum(query_lens)
        self.query_start_loc = ops.prefix_sums(query_lens)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.scheduler_args = (len(seq_lens), NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, self.seq_lens, dtype,
                               self.query_start_loc, True, -1, isa, envs.VLLM_CPU_ATTN_SPLIT_KV, None, "auto")
        self.meta = cpu_attn.CPUAttentionMetadata(
            num_actual_tokens=tokens, max_query_len=max(query_lens), query_start_loc=self.query_start_loc,
            max_seq_len=max(seq_lens), seq_lens=self.seq_lens, block_table=table,
            slot_mapping=slot_mapping(query_lens, seq_lens, table), scheduler_metadata=self.per_step())
        self.kv_cache = torch.randn(blocks, NUM_KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=dtype)
        self.key_cache, self.value_cache = self.kv_cache.view(blocks, NUM_KV_HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, 2)
        self.query = torch.randn(tokens, NUM_HEADS, HEAD_DIM, dtype=dtype)
        self.key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        self.value = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        self.output = torch.empty(tokens, NUM_HEADS, HEAD_DIM, dtype=dtype)
        self.bare_output = torch.empty_like(self.output)

    def step(self) -> torch.Tensor:
        self.impl.do_kv_cache_update(self.layer, self.key, self.value, self.kv_cache, self.meta.slot_mapping)
        return self.impl.forward(self.layer, self.query, self.key, self.value, self.kv_cache, self.meta, self.output)

    def bare(self) -> torch.Tensor:
        """The op calls of step(), through their OpOverloads, with the cache's K and V views made once."""
        meta = self.meta
        torch.ops._C.cpu_attn_reshape_and_cache.default(self.key, self.value, self.key_cache, self.value_cache,
                                                         meta.slot_mapping, self.layer.isa, 1.0, 1.0, "auto")
        torch.ops._C.cpu_attention_with_kv_cache.default(
            self.query, self.key_cache, self.value_cache, self.bare_output, meta.query_start_loc, meta.seq_lens,
            SCALE, True, None, -1, meta.block_table, 0.0, meta.scheduler_metadata, None, None, 1.0, 1.0, "auto")
        return self.bare_output

    def own(self) -> torch.Tensor:
        """step() with the backend's two ops replaced by functions that do nothing (both write in place)."""
        from vllm.v1.attention.backends import cpu_attn

        with mock.patch.object(cpu_attn, "ops", self.stubs):
            return self.step()

    stubs = SimpleNamespace(cpu_attention_with_kv_cache=lambda *args, **kwargs: None,
                            cpu_attn_reshape_and_cache=lambda *args, **kwargs: None)

    def per_step(self) -> torch.Tensor:
        """What vLLM's CPU backend does once per step for all its layers beyond its builder's Python: the scheduler
        metadata."""
        return torch.ops._C.get_scheduler_metadata(*self.scheduler_args)


def check(fdc: FdcLayer, vllm: VllmLayer) -> None:
    """Each backend's step returns what its bare op calls return (the bare calls are the work the step does), and
    fdc's step with its ops stubbed writes the same output (the stubs stand for the step's ops)."""
    stepped = fdc.step().clone()
    decoded, prefilled = fdc.bare()
    expected = prefilled.clone() if prefilled is not None else torch.empty_like(stepped)
    if decoded is not None:
        expected[:decoded.shape[0]] = decoded
    if not torch.equal(stepped, expected):
        raise RuntimeError("bench_vllm_layer: fdc's step and its bare op calls differ: the bare calls are not the "
                           "step's work")
    if not torch.equal(stepped, fdc.own()):
        raise RuntimeError("bench_vllm_layer: fdc's step with its ops stubbed does not write the step's output")
    if not torch.equal(vllm.step(), vllm.bare()):
        raise RuntimeError("bench_vllm_layer: vLLM's step and its bare op calls differ")


def interleaved(fns: list, calls: int, repeats: int) -> list[float]:
    """Median over `repeats` rounds of each callable's mean time (seconds) over `calls` calls in a row, the callables
    taking turns in every round."""
    for fn in fns:
        for _ in range(max(3, calls // 10)):
            fn()
    rounds = []
    for _ in range(repeats):
        row = []
        for fn in fns:
            begin = time.perf_counter()
            for _ in range(calls):
                fn()
            row.append((time.perf_counter() - begin) / calls)
        rounds.append(row)
    return [statistics.median(times) for times in zip(*rounds)]


def measure(name: str, query_lens: list[int], cached: list[int], dtype: torch.dtype, calls: int,
            repeats: int) -> dict:
    seq_lens = [q + c for q, c in zip(query_lens, cached)]
    blocks_per_request = -(-max(seq_lens) // BLOCK)
    blocks = len(seq_lens) * blocks_per_request
    table = block_table(len(seq_lens), blocks_per_request, seed=0)
    fdc = FdcLayer(common_metadata(query_lens, seq_lens, table), dtype, blocks)
    vllm = VllmLayer(query_lens, seq_lens, table, dtype, blocks)
    check(fdc, vllm)
    times = interleaved([fdc.step, fdc.bare, fdc.own, vllm.step, vllm.bare, vllm.own, fdc.per_step, vllm.per_step],
                        calls, repeats)
    fdc_step, fdc_bare, fdc_own, vllm_step, vllm_bare, vllm_own, fdc_per_step, vllm_per_step = (t * 1e6 for t in times)
    return {"step": name, "dtype": str(dtype).removeprefix("torch."), "query_lens": query_lens, "cached": cached,
            "fdc_step_us": fdc_step, "fdc_ops_us": fdc_bare, "fdc_own_us": fdc_own,
            "vllm_step_us": vllm_step, "vllm_ops_us": vllm_bare, "vllm_own_us": vllm_own,
            "fdc_per_step_us": fdc_per_step, "vllm_scheduler_metadata_us": vllm_per_step,
            "target": "fdc's own work per layer <= vLLM's", "verdict": "PASS" if fdc_own <= vllm_own else "MISS"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import vllm

    torch.manual_seed(0)
    calls = args.calls or (20 if args.quick else 200)
    repeats = args.repeats or (3 if args.quick else 15)
    steps = QUICK_STEPS if args.quick else STEPS
    rows = [measure(name, *steps[name], getattr(torch, dtype), calls, repeats)
            for dtype in args.dtypes for name in steps]
    from fdc_ops.apps.provenance import device_name

    name = device_name(torch.device("cpu"))
    commit, dirty = bench_results.git_commit()
    print(f"{name}; torch {torch.__version__}; vllm {vllm.__version__}; commit {commit}{' (dirty)' if dirty else ''}; "
          f"{torch.get_num_threads()} threads; us per layer (mean of {calls} calls, median of {repeats} rounds)")
    print(f"{'step':32} {'dtype':9} {'fdc step':>9} {'fdc ops':>8} {'fdc own':>8} {'vllm step':>10} "
          f"{'vllm ops':>9} {'vllm own':>9} {'per step: fdc':>14} {'vllm':>6}  verdict")
    for r in rows:
        print(f"{r['step']:32} {r['dtype']:9} {r['fdc_step_us']:9.1f} {r['fdc_ops_us']:8.1f} {r['fdc_own_us']:8.1f} "
              f"{r['vllm_step_us']:10.1f} {r['vllm_ops_us']:9.1f} {r['vllm_own_us']:9.1f} "
              f"{r['fdc_per_step_us']:14.1f} {r['vllm_scheduler_metadata_us']:6.1f}  {r['verdict']}")
    report = {**bench_results.record("vllm_layer", name, quick=args.quick, threads=torch.get_num_threads()),
              "vllm": vllm.__version__, "calls": calls, "repeats": repeats, "block_size": BLOCK,
              "layout": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                         "qk_dims": QK_DIMS, "v_dims": V_DIMS}, "rows": rows}
    bench_results.write_report(report, args.out, name, "vllm-layer", args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
