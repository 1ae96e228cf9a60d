"""torch.library.opcheck on every op, on every device: the schema, the fake (meta) implementation, autograd
registration and the dispatcher agree with what the kernels do. One test parametrised over devices and the cases of
conftest.sample_inputs; the CUDA cases skip, saying why, where no GPU or no CUDA kernel is there."""

from __future__ import annotations

import pytest
import torch

import fdc_ops  # noqa: F401  (registers torch.ops.fdc)
from conftest import SAMPLE_CASES, cuda_skip_reason, sample_inputs

OPS = ("rotate_compress", "rope_rotate_compress", "prefill_plan", "prefill_attention", "decode_plan",
       "decode_attention", "append_kv", "window_scores")
# window_scores refuses CUDA tensors (tests/ops/test_bad_input.py): eviction scores them with torch ops
CUDA_OPS = OPS[:-1]


@pytest.mark.parametrize("name", SAMPLE_CASES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_opcheck(device, name):
    if device == "cuda" and name.startswith("window_scores"):
        pytest.skip("window_scores has no CUDA kernel: on CUDA it raises, which tests/ops/test_bad_input.py checks")
    if device == "cuda" and (reason := cuda_skip_reason(*CUDA_OPS)) is not None:
        pytest.skip(reason)  # the CUDA samples are built with the CUDA planners
    cases = sample_inputs(device)
    assert sorted(cases) == sorted(SAMPLE_CASES), "conftest.SAMPLE_CASES must name sample_inputs' cases"
    op_name, args = cases[name]
    assert op_name in OPS
    torch.library.opcheck(getattr(torch.ops.fdc, op_name).default, args)
