"""The simulation of quantized cache formats (fdc_ops.apps.quantization_simulation), which chose the formats below 8
bits: it must reproduce the real int8 and int4 caches, leave a 16-bit half untouched, quantize exactly what each
scheme says, and count the bytes the format would store."""

from __future__ import annotations

import pytest
import torch

from conftest import case_generator
from fdc_ops import hf
from fdc_ops.apps import eval as eval_app
from fdc_ops.apps.quantization_simulation import QuantizationScheme, _Simulation, simulate_quantization
from test_hf import calibrated, left_padded
from test_hf_quantized import _steps

transformers = pytest.importorskip("transformers", reason="the model side needs transformers")


def _calibration(model, generator) -> list[torch.Tensor]:
    return [torch.randint(1, model.config.vocab_size, (1, 24), generator=generator) for _ in range(2)]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_simulated_formats_are_the_real_caches(family, bits):
    generator, rng, replay = case_generator(f"simulated int{bits}", ["llama", "qwen3"].index(family))
    model, artifact = calibrated(family, rng.randrange(1000))
    allocation = hf.compress(model, artifact, compression=rng.choice([0.2, 0.4]), kv_dtype=f"int{bits}")
    ids, mask = left_padded(generator, model.config.vocab_size, [rng.randrange(3, 20) for _ in range(3)])
    real, _ = _steps(model, ids, mask, steps=3, chunk=3)
    hf.restore(model)
    hf.compress(model, artifact, allocation=allocation)
    exact, _ = _steps(model, ids, mask, steps=3, chunk=3)
    with simulate_quantization(model, QuantizationScheme(key_bits=bits, value_bits=bits, rotate="both"), []):
        simulated, _ = _steps(model, ids, mask, steps=3, chunk=3)
    for step, (got, want, unquantized) in enumerate(zip(simulated[1:], real[1:], exact[1:])):
        # the same mixing, codes and scales: the real model's weights carry the mixing (x (W M) in float32), the
        # simulation mixes and unmixes the rows ((x W) M in float64), and the kernel scales the sums; only the
        # rounding differs. That rounding can put a value on the other side of a code's rounding boundary, and an
        # int8 code one step off moved these tiny models' logits by up to 1.6e-3 (about 1 seeded run in 12; over 16
        # runs the quantization's own effect was 5.2x the difference at the least), where int4's 7 levels kept it
        # below 2e-6.
        difference = float((got - want).abs().max() / want.abs().max())
        quantization = float((unquantized - want).abs().max() / want.abs().max())
        close = difference < 1e-4 if bits == 4 else difference < 2e-3 and quantization > 3 * difference
        assert close, (step, difference, quantization, replay)


def test_sixteen_bit_halves_are_untouched_and_rotations_undone():
    generator, rng, replay = case_generator("simulated 16 bits", 0)
    model, artifact = calibrated("llama", rng.randrange(1000))
    hf.compress(model, artifact, compression=0.3)
    ids, mask = left_padded(generator, model.config.vocab_size, [5, 11])
    exact, _ = _steps(model, ids, mask, steps=2, chunk=2)
    with simulate_quantization(model, QuantizationScheme(key_bits=16, value_bits=16, rotate="both"), []):
        rotated, _ = _steps(model, ids, mask, steps=2, chunk=2)
    with simulate_quantization(model, QuantizationScheme(key_bits=4, value_bits=4, equalise="both"),
                               _calibration(model, generator)):
        four_bits, _ = _steps(model, ids, mask, steps=2, chunk=2)
    for got, four, want in zip(rotated[1:], four_bits[1:], exact[1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=replay)
        assert float((four - want).abs().max()) > 1e-3, replay  # 4 bits are seen
    _steps(model, ids, mask, steps=1, chunk=2)  # the patches are gone: the plain compressed model runs


def test_rows_are_quantized_as_each_scheme_says():
    generator = torch.Generator().manual_seed(5)
    offsets = torch.tensor([0, 8, 24], dtype=torch.int32)
    rows = torch.randn(70, 24, generator=generator, dtype=torch.float64) * torch.linspace(0.1, 4, 24)
    layer = type("Module", (), {"layer_idx": 0})()

    per_token = _Simulation(QuantizationScheme(key_bits=4, value_bits=8, sinks=3))
    per_token.layer = layer
    positions = [range(0, 40), range(5, 35)]
    out = per_token.rows(rows, offsets, positions, "k")
    assert torch.equal(out[:3], rows[:3]) and not torch.equal(out[40:43], rows[40:43])  # request 0's sinks only
    for row in (5, 39, 45, 69):
        for start, stop in ((0, 8), (8, 24)):
            part, got = rows[row, start:stop], out[row, start:stop]
            scale = float(part.abs().max()) / 7
            codes = got / scale
            assert torch.allclose(codes, codes.round(), atol=1e-4) and float(codes.abs().max()) == pytest.approx(7)
            assert float((got - part).abs().max()) <= scale / 2 * (1 + 1e-5)

    kivi = _Simulation(QuantizationScheme(keys="channel", group=16))
    kivi.layer = layer
    out = kivi.rows(rows, offsets, positions, "k")
    # request 0 (positions 0..39): groups 0-15 and 16-31 complete, 32-39 left; request 1 (5..34): 16-31 only
    for first, last in ((0, 16), (16, 32), (40 + 11, 40 + 27)):
        block, got = rows[first:last], out[first:last]
        scale = block.abs().amax(dim=0) / 7
        assert torch.allclose(got / scale, (got / scale).round(), atol=1e-4)
    for first, last in ((32, 40), (40, 51), (67, 70)):
        assert torch.equal(out[first:last], rows[first:last])


def test_compression_counts_the_format_bytes():
    int8 = QuantizationScheme(key_bits=8, value_bits=8)
    for width in (64, 48, 40.5):
        expected = eval_app.quantized_compression(1 - width / 64, 64)
        assert int8.compression(width, width, 64, 1536) == pytest.approx(expected)
    assert QuantizationScheme().compression(64, 64, 64, 1000) == pytest.approx(1 - 1 / 4 - 2 / 64)
    # 10 of 1000 tokens at 16 bits
    sinks = QuantizationScheme(sinks=10).compression(64, 64, 64, 1000)
    assert sinks == pytest.approx(1 - (990 * (64 + 8) + 10 * 256) / (1000 * 256))
    kivi = QuantizationScheme(keys="channel", group=32).compression(64, 64, 64, 1000)  # 8 tokens left over
    assert kivi == pytest.approx(1 - (992 * (64 + 4 * 64 / 32 + 4) + 8 * 256) / (1000 * 256))
    half = QuantizationScheme(value_bits=16).compression(64, 64, 64, 100)
    assert half == pytest.approx(1 - (32 + 4 + 128) / 256)
    budget = eval_app.scheme_dimension_budget(QuantizationScheme(), 0.8, 64, 1536)
    assert QuantizationScheme().compression(64 * (1 - budget), 64 * (1 - budget), 64, 1536) == pytest.approx(0.8)


def test_scheme_refusals():
    with pytest.raises(ValueError, match="key_bits and value_bits must be"):
        QuantizationScheme(key_bits=7)
    with pytest.raises(ValueError, match="keys must be 'token' or 'channel'"):
        QuantizationScheme(keys="head")
    with pytest.raises(ValueError, match="per-channel key scales make key equalisation void"):
        QuantizationScheme(keys="channel", equalise="keys")
    with pytest.raises(ValueError, match="rotate must be"):
        QuantizationScheme(rotate="values")
    model, artifact = calibrated("llama", 3)
    hf.compress(model, artifact, compression=0.2, kv_dtype=torch.int8)
    ids = torch.randint(1, model.config.vocab_size, (1, 6))
    with simulate_quantization(model, QuantizationScheme(), []), torch.no_grad():
        with pytest.raises(ValueError, match="quantizes a float cache without eviction or a sliding window"):
            model(input_ids=ids)
