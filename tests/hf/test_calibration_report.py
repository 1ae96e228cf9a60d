"""The similarity measures of the calibration report, on rotations whose relation is known."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import case_generator
from fdc_ops import calibration
from fdc_ops.apps import calibration_report


def random_rotation(generator: torch.Generator, *batch: int, D: int = 16) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(*batch, D, D, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]


def test_delta_over_epsilon_ignores_column_signs():
    generator, _, _ = case_generator("delta_over_epsilon", 0)
    R = random_rotation(generator, 2, 3)
    flipped = R * torch.where(torch.rand(2, 3, 1, 16, generator=generator) < 0.5, -1.0, 1.0)
    assert calibration_report.delta_over_epsilon(flipped, R) == pytest.approx(0.0, abs=1e-12)
    other = random_rotation(generator, 2, 3)
    assert calibration_report.delta_over_epsilon(other, R) > 0.5  # unrelated rotations differ by about their magnitude


def test_subspace_overlap_sees_spans_not_columns():
    generator, _, _ = case_generator("subspace_overlap", 0)
    R = random_rotation(generator, 4)
    k = 6
    mixing = random_rotation(generator, 4, D=k)  # rotates the first k columns within their span
    mixed = R.clone()
    mixed[..., :k] = R[..., :k] @ mixing
    overlap, angle = calibration_report.subspace_overlap(mixed, R, k)
    assert overlap == pytest.approx(1.0, abs=1e-10) and angle == pytest.approx(0.0, abs=1e-4)
    # while the element-wise measure calls them different
    assert calibration_report.delta_over_epsilon(mixed, R, k) > 0.3
    swapped = torch.cat([R[..., k:2 * k], R[..., :k], R[..., 2 * k:]], dim=-1)  # an orthogonal span
    overlap, angle = calibration_report.subspace_overlap(swapped, R, k)
    assert overlap == pytest.approx(0.0, abs=1e-10) and angle == pytest.approx(90.0, abs=1e-6)


def test_energy_loss_ratio_is_one_for_the_data_own_axes():
    generator, _, _ = case_generator("energy_loss", 0)
    rows = torch.randn(2, 200, 16, generator=generator, dtype=torch.float64) * torch.linspace(3, 0.1, 16)
    gram = rows.transpose(-1, -2) @ rows
    _, own = calibration.principal_axes(gram)
    dims = torch.tensor([4, 9])
    assert calibration_report.energy_loss_ratio(own, gram, dims) == pytest.approx(1.0, abs=1e-12)
    assert calibration_report.energy_loss_ratio(random_rotation(generator, 2), gram, dims) > 1.0
    lost = calibration_report.lost_energy(own, gram, dims)
    values = torch.linalg.svdvals(rows) ** 2
    for head, d in enumerate(dims.tolist()):
        assert lost[head].item() == pytest.approx(float(values[head, d:].sum() / values[head].sum()), rel=1e-9)


def test_allocation_at_compression_does_not_exceed_the_target():
    generator, _, _ = case_generator("allocation_at_compression", 0)
    values = torch.rand(3, 2, 32, generator=generator, dtype=torch.float64).sort(-1, descending=True).values
    eye = torch.eye(32).expand(3, 2, 32, 32).contiguous()
    artifact = calibration.FDCArtifact(eye, values, eye.double(), eye.double(), values, eye, values, eye, values,
                                       {"shape": {"num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
                                                  "hidden_size": 64}})
    for target in (0.1, 0.3, 0.5):
        allocation = calibration_report.allocation_at_compression(artifact, target, "explained_variance")
        assert allocation.compression_rate <= target
        assert allocation.compression_rate >= target - 2 * 8 / (2 * 32)  # within one rounding step of a head pair
    assert math.isclose(calibration_report.coefficient_of_variation(torch.tensor([1.0, 3.0])), 0.5)
