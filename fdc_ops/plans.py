"""The int32 schedules of ``torch.ops.fdc.decode_plan`` and ``prefill_plan`` as Python objects: one codec for every
caller that reads, builds or sizes a plan (the op wrappers, the ops demo, the tests, the benchmarks).

The formats are defined in include/fdc/decode_plan.h and include/fdc/prefill_plan.h (the source of truth; this module
mirrors them field for field, and tests/ops/test_plans.py decodes plans the ops produce):

- decode: ``[tag, B, H_kv, N, capacity, num_tasks, group, status]``, then ``split_offsets[B*H_kv + 1]``,
  ``worker_offsets[N + 1]`` and ``records[capacity][4]`` = ``(b*H_kv + j, chunk, kv_start, kv_end)``, entries past
  ``num_tasks`` all -1;
- prefill: ``[tag, B, H, N, R, causal, row_block, group]``, then ``worker_offsets[N + 1]`` and ``records[R][4]`` =
  ``(b, h, row_start, row_end)``.

Worker ``w`` runs records ``worker_offsets[w] .. worker_offsets[w+1] - 1`` in order. :meth:`DecodePlan.from_tensor`
and :meth:`PrefillPlan.from_tensor` reject a tensor that is not such a plan with a ``ValueError`` naming the codec and
the field; :meth:`to_tensor` checks a hand-built plan the same way before encoding it.

Pure Python over torch: importing this module loads neither the compiled extension nor any model-side package.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Status",
    "DecodePlan",
    "PrefillPlan",
    "DECODE_PLAN_TAG",
    "DECODE_HEADER",
    "DECODE_RECORD_FIELDS",
    "DECODE_CHUNKS_PER_WORKER",
    "PREFILL_PLAN_TAG",
    "PREFILL_HEADER",
    "PREFILL_RECORD_FIELDS",
    "ROW_STEP",
    "DEFAULT_ROW_BLOCK",
    "decode_plan_capacity",
    "decode_plan_size",
    "prefill_plan_capacity",
    "prefill_plan_size",
    "visible_keys",
    "d_sums",
    "concat_workers",
]

# include/fdc/decode_plan.h
DECODE_PLAN_TAG = 0x46444344  # kDecodePlanTag: "FDCD" in ASCII, so a prefill plan or stray integers are told apart
DECODE_HEADER = 8  # kDecodeHeader: tag, B, H_kv, N, capacity, num_tasks, group, status
DECODE_RECORD_FIELDS = 4  # kDecodeRecordFields: (b * H_kv + j, chunk, kv_start, kv_end)
# kChunksPerWorker: the planner aims at this many chunks per worker (LPT then stays within 4/3 of the ideal
# makespan); it also bounds the plan's capacity, which is all Python needs it for.
DECODE_CHUNKS_PER_WORKER = 3

# include/fdc/prefill_plan.h
PREFILL_PLAN_TAG = 0x46444350  # kPrefillPlanTag: "FDCP"
PREFILL_HEADER = 8  # kPrefillHeader: tag, B, H, N, R, causal, row_block, group
PREFILL_RECORD_FIELDS = 4  # kPrefillRecordFields: (b, h, row_start, row_end)
ROW_STEP = 16  # kRowStep: row blocks and pieces are whole multiples of the m16 tile of a tensor-core product
# kDefaultRowBlock: the paper's B_r for the widest head; 64 rows keep a fp32 accumulator tile of 64 x 256 within one
# CTA's registers.
DEFAULT_ROW_BLOCK = 64


class Status(enum.IntEnum):
    """fdc::Status (include/fdc/common.h): a decode plan's status entry; only OK plans can be executed."""

    OK = 0
    BAD_OFFSETS = 1  # offsets not starting at 0, not increasing by multiples of 8, or a width over 256
    BAD_SEQLENS = 2  # negative or decreasing sequence lengths (the device decode planner's only report)
    BAD_ARGUMENT = 3  # a non-positive worker count, row block or group
    CAPACITY_EXCEEDED = 4  # the plan would not fit its buffer (a planner bug: capacities are proven bounds)


def decode_plan_capacity(batch: int, num_kv_heads: int, num_workers: int) -> int:
    """Records a decode plan has room for: ``B * H_kv + 3 * N`` (decode_plan_capacity)."""
    return batch * num_kv_heads + DECODE_CHUNKS_PER_WORKER * num_workers


def decode_plan_size(batch: int, num_kv_heads: int, num_workers: int) -> int:
    """Length of the int32 decode plan for ``batch`` requests, ``num_kv_heads`` KV heads and ``num_workers``."""
    return (DECODE_HEADER + (batch * num_kv_heads + 1) + (num_workers + 1)
            + DECODE_RECORD_FIELDS * decode_plan_capacity(batch, num_kv_heads, num_workers))


def prefill_plan_capacity(total_q: int, batch: int, num_heads: int) -> int:
    """Most records a prefill plan of ``total_q`` query rows in ``batch`` sequences can have: every record but one
    per (sequence, head) holds a multiple of 16 rows (prefill_plan_capacity)."""
    return num_heads * (total_q // ROW_STEP + batch)


def prefill_plan_size(num_workers: int, num_records: int) -> int:
    """Length of the int32 prefill plan with ``num_workers`` workers and ``num_records`` records."""
    return PREFILL_HEADER + (num_workers + 1) + PREFILL_RECORD_FIELDS * num_records


def _clamped_row_sum(r0: int, r1: int, shift: int, s_k: int) -> int:
    """Sum of ``clamp(r + shift, 0, s_k)`` over rows ``[r0, r1)``, in closed form."""
    # Rows with r + shift <= 0 add nothing, rows with r + shift >= s_k add s_k, the rest add r + shift.
    lin_lo, lin_hi = max(r0, -shift + 1), min(r1, s_k - shift)
    total = (lin_lo + lin_hi - 1 + 2 * shift) * (lin_hi - lin_lo) // 2 if lin_hi > lin_lo else 0
    full_lo = max(r0, s_k - shift)
    return total + ((r1 - full_lo) * s_k if r1 > full_lo else 0)


def visible_keys(r0: int, r1: int, s_q: int, s_k: int, causal: bool, window_left: int = -1) -> int:
    """Keys seen by query rows ``[r0, r1)`` of a sequence with ``s_q`` queries and ``s_k`` keys, summed over the rows
    (include/fdc/prefill_plan.h, visible_keys): row ``r`` at position ``p = r + s_k - s_q`` sees keys up to
    ``min(p + 1, s_k)`` under causal masking (aligned bottom-right as in FlashAttention; every key otherwise) and from
    ``clamp(p - window_left, 0, s_k)`` with a sliding window (``window_left`` -1: none). Closed form, exact."""
    if r1 <= r0 or s_k <= 0:
        return 0
    shift = s_k - s_q
    seen_to = _clamped_row_sum(r0, r1, shift + 1, s_k) if causal else (r1 - r0) * s_k
    seen_from = 0 if window_left < 0 else _clamped_row_sum(r0, r1, shift - window_left, s_k)
    return seen_to - seen_from


def d_sums(qk_dims: Sequence[int], v_dims: Sequence[int]) -> list[int]:
    """Per KV head, the planners' cost per key and query row: ``d_qk + d_v + 1`` (scores, values, softmax)."""
    if len(qk_dims) != len(v_dims):
        raise ValueError(f"d_sums: qk_dims and v_dims must have one width per KV head each, but got {len(qk_dims)} "
                         f"and {len(v_dims)}")
    return [int(q) + int(v) + 1 for q, v in zip(qk_dims, v_dims)]


def _entries(codec: str, plan: torch.Tensor, header: int) -> list[int]:
    """The plan's integers, after checking it is a 1-D int32 tensor holding at least a header."""
    if not isinstance(plan, torch.Tensor):
        raise TypeError(f"{codec}.from_tensor: plan must be a torch.Tensor but got {type(plan).__name__}")
    if plan.dtype != torch.int32 or plan.dim() != 1:
        raise ValueError(f"{codec}.from_tensor: plan must be a 1-D int32 tensor but got {plan.dim()}-D {plan.dtype}")
    if plan.numel() < header:
        raise ValueError(f"{codec}.from_tensor: plan must hold at least its {header}-entry header but has "
                         f"{plan.numel()} entries")
    return plan.tolist()


def _require(ok: bool, where: str, field: str, requirement: str, value) -> None:
    if not ok:
        raise ValueError(f"{where}: {field} must be {requirement} but got {value}")


def _check_offsets(where: str, field: str, offsets: list[int], length: int, end: int, end_name: str) -> None:
    """offsets: (length,) non-decreasing from 0 to `end`."""
    _require(len(offsets) == length, where, f"the length of {field}", f"{length}", len(offsets))
    _require(offsets[0] == 0, where, f"{field}[0]", "0", offsets[0])
    for i in range(1, length):
        _require(offsets[i] >= offsets[i - 1], where, f"{field}[{i}]", f"at least {field}[{i - 1}] = {offsets[i - 1]}",
                 offsets[i])
    _require(offsets[-1] == end, where, f"{field}[{length - 1}]", f"{end_name} = {end}", offsets[-1])


def _check_dims(where: str, d_sum: list[int], num_kv_heads: int) -> None:
    _require(len(d_sum) == num_kv_heads, where, "qk_dims and v_dims", f"one width per KV head (H_kv = {num_kv_heads})",
             f"{len(d_sum)} widths")


def _split_by_worker(items: list, worker_offsets: list[int]) -> list[list]:
    return [items[worker_offsets[w]:worker_offsets[w + 1]] for w in range(len(worker_offsets) - 1)]


def concat_workers(per_worker: Sequence[Sequence[tuple[int, int, int, int]]]) -> tuple[list[int], list[tuple]]:
    """``(worker_offsets, records)`` of a plan whose worker ``w`` runs ``per_worker[w]`` in order: what a hand-built
    :class:`DecodePlan` or :class:`PrefillPlan` takes (the inverse of their ``records_by_worker``)."""
    worker_offsets = [0]
    for records in per_worker:
        worker_offsets.append(worker_offsets[-1] + len(records))
    return worker_offsets, [tuple(record) for records in per_worker for record in records]


@dataclass
class DecodePlan:
    """A decode schedule (include/fdc/decode_plan.h): tasks (request b, KV head j with its G query heads, KV chunk)
    dealt to ``num_workers`` workers by greedy LPT.

    ``split_offsets`` ``(B * H_kv + 1,)``: the chunks of pair ``p = b * H_kv + j`` are split slots
    ``split_offsets[p] .. split_offsets[p + 1] - 1``. ``worker_offsets`` ``(N + 1,)``: worker ``w`` runs
    ``records[worker_offsets[w]:worker_offsets[w + 1]]``. ``records`` ``(num_tasks,)`` of
    ``(p, chunk, kv_start, kv_end)``. A plan whose ``status`` is not OK (the device planner met a negative length)
    has no records and all offsets 0.
    """

    batch: int
    num_kv_heads: int
    num_workers: int
    group: int
    split_offsets: list[int]
    worker_offsets: list[int]
    records: list[tuple[int, int, int, int]]
    status: Status = Status.OK

    @property
    def capacity(self) -> int:
        return decode_plan_capacity(self.batch, self.num_kv_heads, self.num_workers)

    @property
    def num_tasks(self) -> int:
        return len(self.records)

    @classmethod
    def from_tensor(cls, plan: torch.Tensor) -> DecodePlan:
        """Decodes ``plan`` (int32, on any device; ``(decode_plan_size(B, H_kv, N),)``), checking every field."""
        where = "DecodePlan.from_tensor"
        p = _entries("DecodePlan", plan, DECODE_HEADER)
        tag, batch, hkv, workers, capacity, num_tasks, group, status = p[:DECODE_HEADER]
        _require(tag == DECODE_PLAN_TAG, where, "plan[0] (tag)", f"kDecodePlanTag = {DECODE_PLAN_TAG:#x} ('FDCD')",
                 f"{tag:#x}" + (" (a prefill plan)" if tag == PREFILL_PLAN_TAG else ""))
        _require(batch >= 0, where, "plan[1] (batch)", "non-negative", batch)
        _require(hkv >= 1, where, "plan[2] (num_kv_heads)", "at least 1", hkv)
        _require(workers >= 1, where, "plan[3] (num_workers)", "at least 1", workers)
        expected_capacity = decode_plan_capacity(batch, hkv, workers)
        _require(capacity == expected_capacity, where, "plan[4] (capacity)",
                 f"B * H_kv + {DECODE_CHUNKS_PER_WORKER} * N = {expected_capacity}", capacity)
        _require(0 <= num_tasks <= capacity, where, "plan[5] (num_tasks)", f"in [0, capacity = {capacity}]", num_tasks)
        _require(group >= 1, where, "plan[6] (group)", "at least 1", group)
        _require(status in {code.value for code in Status}, where, "plan[7] (status)",
                 f"a Status code in {[int(code) for code in Status]}", status)
        size = decode_plan_size(batch, hkv, workers)
        _require(len(p) == size, where, "the plan's length", f"decode_plan_size(B={batch}, H_kv={hkv}, N={workers}) "
                 f"= {size}", len(p))
        split_at = DECODE_HEADER
        worker_at = split_at + batch * hkv + 1
        records_at = worker_at + workers + 1
        fields = DECODE_RECORD_FIELDS
        records = [tuple(p[i:i + fields]) for i in range(records_at, records_at + fields * num_tasks, fields)]
        padding = p[records_at + fields * num_tasks:]
        _require(all(x == -1 for x in padding), where, f"every record entry past num_tasks = {num_tasks}", "-1",
                 sorted(set(padding) - {-1})[:4])
        decoded = cls(batch, hkv, workers, group, p[split_at:worker_at], p[worker_at:records_at], records,
                      Status(status))
        decoded._check(where)
        return decoded

    def to_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Encodes the plan, ``(decode_plan_size(B, H_kv, N),)`` int32 on ``device``, after checking it as
        :meth:`from_tensor` does."""
        self._check("DecodePlan.to_tensor")
        header = [DECODE_PLAN_TAG, self.batch, self.num_kv_heads, self.num_workers, self.capacity, self.num_tasks,
                  self.group, int(self.status)]
        body = [field for record in self.records for field in record]
        padding = [-1] * (DECODE_RECORD_FIELDS * (self.capacity - self.num_tasks))
        return torch.tensor(header + list(self.split_offsets) + list(self.worker_offsets) + body + padding,
                            dtype=torch.int32, device=device)

    def records_by_worker(self) -> list[list[tuple[int, int, int, int]]]:
        """Per worker, its records in the order it runs them."""
        return _split_by_worker(self.records, self.worker_offsets)

    def costs_by_worker(self, qk_dims: Sequence[int], v_dims: Sequence[int]) -> list[list[int]]:
        """Per worker, the planner's cost of each of its records: ``(kv_end - kv_start) * d_sum(j)``."""
        d_sum = d_sums(qk_dims, v_dims)
        _check_dims("DecodePlan.costs_by_worker", d_sum, self.num_kv_heads)
        costs = [(end - start) * d_sum[pair % self.num_kv_heads] for pair, _, start, end in self.records]
        return _split_by_worker(costs, self.worker_offsets)

    def worker_loads(self, qk_dims: Sequence[int], v_dims: Sequence[int]) -> list[int]:
        """Per worker, the summed cost of its records (the plan's makespan is the largest)."""
        return [sum(costs) for costs in self.costs_by_worker(qk_dims, v_dims)]

    def _check(self, where: str) -> None:
        """Everything the format says of the fields beyond the header: offsets, records and a failed plan's shape."""
        _require(self.batch >= 0, where, "batch", "non-negative", self.batch)
        _require(self.num_kv_heads >= 1, where, "num_kv_heads", "at least 1", self.num_kv_heads)
        _require(self.num_workers >= 1, where, "num_workers", "at least 1", self.num_workers)
        _require(self.group >= 1, where, "group", "at least 1", self.group)
        _require(self.status in {code.value for code in Status}, where, "status",
                 f"a Status code in {[int(code) for code in Status]}", self.status)
        _require(self.num_tasks <= self.capacity, where, "the number of records",
                 f"at most capacity = {self.capacity}", self.num_tasks)
        _require(self.status == Status.OK or self.num_tasks == 0, where, "records",
                 f"empty in a plan with status {Status(self.status).name}", f"{self.num_tasks} records")
        pairs = self.batch * self.num_kv_heads
        _check_offsets(where, "split_offsets", list(self.split_offsets), pairs + 1, self.num_tasks, "num_tasks")
        _check_offsets(where, "worker_offsets", list(self.worker_offsets), self.num_workers + 1, self.num_tasks,
                       "num_tasks")
        seen = set()
        for i, record in enumerate(self.records):
            _require(len(record) == DECODE_RECORD_FIELDS, where, f"records[{i}]",
                     "(b * H_kv + j, chunk, kv_start, kv_end)", record)
            pair, chunk, start, end = record
            _require(0 <= pair < pairs, where, f"records[{i}][0] (b * H_kv + j)", f"in [0, B * H_kv = {pairs})", pair)
            chunks = self.split_offsets[pair + 1] - self.split_offsets[pair]
            _require(0 <= chunk < chunks, where, f"records[{i}][1] (chunk)",
                     f"in [0, {chunks}) (the chunks split_offsets gives pair {pair})", chunk)
            _require(0 <= start < end, where, f"records[{i}][2:4] (kv_start, kv_end)", "0 <= kv_start < kv_end",
                     (start, end))
            _require((pair, chunk) not in seen, where, f"records[{i}]",
                     f"the only record of pair {pair}, chunk {chunk}", "a second one")
            seen.add((pair, chunk))


@dataclass
class PrefillPlan:
    """A prefill schedule (include/fdc/prefill_plan.h): row blocks of (sequence b, query head h) dealt to
    ``num_workers`` workers.

    ``worker_offsets`` ``(N + 1,)``: worker ``w`` runs ``records[worker_offsets[w]:worker_offsets[w + 1]]``.
    ``records`` ``(R,)`` of ``(b, h, row_start, row_end)``, rows counted from the sequence's first query.
    ``row_block`` is the widest head's row block the plan was made with (the attention ops do not read it).
    """

    batch: int
    num_heads: int
    num_workers: int
    causal: bool
    row_block: int
    group: int
    worker_offsets: list[int]
    records: list[tuple[int, int, int, int]]

    @property
    def num_records(self) -> int:
        return len(self.records)

    @classmethod
    def from_tensor(cls, plan: torch.Tensor) -> PrefillPlan:
        """Decodes ``plan`` (int32, on any device; ``(prefill_plan_size(N, R),)``), checking every field."""
        where = "PrefillPlan.from_tensor"
        p = _entries("PrefillPlan", plan, PREFILL_HEADER)
        tag, batch, heads, workers, num_records, causal, row_block, group = p[:PREFILL_HEADER]
        _require(tag == PREFILL_PLAN_TAG, where, "plan[0] (tag)", f"kPrefillPlanTag = {PREFILL_PLAN_TAG:#x} ('FDCP')",
                 f"{tag:#x}" + (" (a decode plan)" if tag == DECODE_PLAN_TAG else ""))
        _require(workers >= 1, where, "plan[3] (num_workers)", "at least 1", workers)
        _require(num_records >= 0, where, "plan[4] (num_records)", "non-negative", num_records)
        _require(causal in (0, 1), where, "plan[5] (causal)", "0 or 1", causal)
        size = prefill_plan_size(workers, num_records)
        _require(len(p) == size, where, "the plan's length",
                 f"prefill_plan_size(N={workers}, R={num_records}) = {size}", len(p))
        records_at = PREFILL_HEADER + workers + 1
        fields = PREFILL_RECORD_FIELDS
        records = [tuple(p[i:i + fields]) for i in range(records_at, len(p), fields)]
        decoded = cls(batch, heads, workers, bool(causal), row_block, group, p[PREFILL_HEADER:records_at], records)
        decoded._check(where)
        return decoded

    def to_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Encodes the plan, ``(prefill_plan_size(N, R),)`` int32 on ``device``, after checking it as
        :meth:`from_tensor` does."""
        self._check("PrefillPlan.to_tensor")
        header = [PREFILL_PLAN_TAG, self.batch, self.num_heads, self.num_workers, self.num_records, int(self.causal),
                  self.row_block, self.group]
        body = [field for record in self.records for field in record]
        return torch.tensor(header + list(self.worker_offsets) + body, dtype=torch.int32, device=device)

    def records_by_worker(self) -> list[list[tuple[int, int, int, int]]]:
        """Per worker, its records in the order it runs them."""
        return _split_by_worker(self.records, self.worker_offsets)

    def costs_by_worker(self, qk_dims: Sequence[int], v_dims: Sequence[int], lengths_q: Sequence[int],
                        lengths_k: Sequence[int], window_left: int = -1) -> list[list[int]]:
        """Per worker, the planner's cost of each of its records: ``d_sum(h // group) * visible keys`` of its rows,
        for sequences of ``lengths_q[b]`` queries and ``lengths_k[b]`` keys and the plan's sliding window (which the
        plan does not record: the ``window_left`` it was made with)."""
        where = "PrefillPlan.costs_by_worker"
        d_sum = d_sums(qk_dims, v_dims)
        _check_dims(where, d_sum, self.num_heads // self.group)
        _require(len(lengths_q) == self.batch and len(lengths_k) == self.batch, where, "lengths_q and lengths_k",
                 f"one length per sequence (B = {self.batch})", f"{len(lengths_q)} and {len(lengths_k)}")
        costs = [d_sum[h // self.group] * visible_keys(r0, r1, lengths_q[b], lengths_k[b], self.causal, window_left)
                 for b, h, r0, r1 in self.records]
        return _split_by_worker(costs, self.worker_offsets)

    def worker_loads(self, qk_dims: Sequence[int], v_dims: Sequence[int], lengths_q: Sequence[int],
                     lengths_k: Sequence[int], window_left: int = -1) -> list[int]:
        """Per worker, the summed cost of its records (the plan's makespan is the largest)."""
        return [sum(costs) for costs in self.costs_by_worker(qk_dims, v_dims, lengths_q, lengths_k, window_left)]

    def _check(self, where: str) -> None:
        """Everything the format says of the fields beyond the tag and length: header values, offsets, records."""
        _require(self.batch >= 0, where, "batch", "non-negative", self.batch)
        _require(self.group >= 1, where, "group", "at least 1", self.group)
        _require(self.num_heads >= self.group and self.num_heads % self.group == 0, where, "num_heads",
                 f"a positive multiple of group = {self.group} (H = H_kv * G)", self.num_heads)
        _require(self.num_workers >= 1, where, "num_workers", "at least 1", self.num_workers)
        _require(self.row_block >= ROW_STEP and self.row_block % ROW_STEP == 0, where, "row_block",
                 f"a positive multiple of {ROW_STEP}", self.row_block)
        _check_offsets(where, "worker_offsets", list(self.worker_offsets), self.num_workers + 1, self.num_records,
                       "num_records")
        for i, record in enumerate(self.records):
            _require(len(record) == PREFILL_RECORD_FIELDS, where, f"records[{i}]", "(b, h, row_start, row_end)",
                     record)
            b, h, start, end = record
            _require(0 <= b < self.batch, where, f"records[{i}][0] (b)", f"in [0, B = {self.batch})", b)
            _require(0 <= h < self.num_heads, where, f"records[{i}][1] (h)", f"in [0, H = {self.num_heads})", h)
            _require(0 <= start < end, where, f"records[{i}][2:4] (row_start, row_end)", "0 <= row_start < row_end",
                     (start, end))
