"""The eval command's search and allocations (no model needed)."""

from __future__ import annotations

import pytest

from fdc_ops.apps import eval as eval_app
from fdc_ops.identity import AttentionShape

pytestmark = pytest.mark.model


def test_best_compression_stops_at_the_first_failure_of_a_non_monotone_score():
    points = [(0.1, 0.995), (0.05, 1.01), (0.2, 0.98), (0.3, 0.992), (0.4, 0.97)]
    assert eval_app.best_compression(points, 0.99) == 0.1  # 0.3 passes again, but 0.2 below it does not
    assert eval_app.best_compression(points, 0.97) == 0.4
    assert eval_app.best_compression(points, 1.0) == 0.05
    assert eval_app.best_compression([(0.05, 0.5)], 0.99) == 0.0


@pytest.mark.parametrize("compression", [0.0, 0.03, 0.0625, 0.1, 0.25, 0.5])
def test_uniform_allocation_is_the_widest_uniform_pair_within_the_budget(compression):
    shape = AttentionShape(num_layers=3, num_heads=6, num_kv_heads=2, head_dim=64, hidden_size=96)
    allocation = eval_app.uniform_allocation(shape, compression)
    assert allocation.compression_rate >= compression - 1e-12
    assert allocation.compression_rate < compression + 8 / (2 * 64)
    assert allocation.qk_dims.unique().numel() == 1 and allocation.v_dims.unique().numel() == 1
    assert 0 <= int(allocation.v_dims[0, 0]) - int(allocation.qk_dims[0, 0]) <= 8


@pytest.mark.parametrize("grid", [(0.0, 0.1), (0.1, 1.0), (-0.05,)])
def test_run_rejects_a_grid_outside_zero_to_one_before_loading_the_model(grid, tmp_path):
    with pytest.raises(ValueError, match="fdc_ops.apps.eval.run: grid must be budgets in"):
        eval_app.run(out=str(tmp_path), grid=grid)


def test_eviction_methods_need_the_long_context_metric(tmp_path):
    with pytest.raises(ValueError, match=r"\['KF-F'\] evict after a prompt, which only the long-context"):
        eval_app.run(out=str(tmp_path), methods=("FDC (defaults)", "KF-F"))


def test_a_scored_text_other_than_wikipedia_needs_long_perplexity_and_another_calibration_text(tmp_path):
    with pytest.raises(ValueError, match=r"scored_text='humaneval' is for the long_perplexity metric of a model "
                                         r"calibrated on another text .* got metric 'perplexity'"):
        eval_app.run(out=str(tmp_path), scored_text="humaneval")
    with pytest.raises(ValueError, match=r"got metric 'long_perplexity' and calibration text 'humaneval'"):
        eval_app.run(out=str(tmp_path), metric="long_perplexity", text="humaneval", scored_text="humaneval")
    with pytest.raises(ValueError, match=r"scored_text must be one of \['wikipedia', 'humaneval'\], got 'pg19'"):
        eval_app.run(out=str(tmp_path), metric="long_perplexity", scored_text="pg19")


def test_quantization_methods_need_the_long_context_metric(tmp_path):
    with pytest.raises(ValueError, match=r"\['KVQ-F int8'\] quantize the cache, which the perplexity metric never"):
        eval_app.run(out=str(tmp_path), methods=("FDC (defaults)", "KVQ-F int8"))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("compression", [0.3, 0.5, 0.6, 0.75, 0.8])
def test_quantized_compression_counts_the_cache_bytes(compression, bits):
    """The budget of a quantized method, turned into widths, removes what its cache's bytes say it removes: one byte
    (int8) or half of one (int4) per element and 4 per (token, KV head) scale in K and in V
    (fdc_ops.ops.cache_width), against 16-bit elements."""
    from fdc_ops import ops

    dtype = ops.kv_cache_dtype(f"int{bits}")
    shape = AttentionShape(num_layers=3, num_heads=6, num_kv_heads=2, head_dim=64, hidden_size=96)
    allocation = eval_app.uniform_allocation(shape, eval_app.quantized_dimension_budget(compression, 64, bits))
    stored = sum(ops.cache_width(k, dtype) + ops.cache_width(v, dtype)
                 for k, v in (allocation.offsets(layer) for layer in range(3)))
    full = 3 * 2 * 2 * 64 * 2  # layers x (K, V) x KV heads x D x 2 bytes
    total = eval_app.quantized_compression(allocation.compression_rate, 64, bits)
    assert total == pytest.approx(1 - stored / full)
    assert total >= compression - 1e-12 or allocation.compression_rate == 0.0


def test_held_out_windows_lie_inside_held_out_documents_and_do_not_overlap():
    import torch

    from fdc_ops import datasets

    tokens = torch.arange(1000)
    starts = torch.tensor([0, 850, 905, 930, 990])  # held out from 900: [900, 905), [905, 930), [930, 990), ...
    windows = datasets.held_out_windows(tokens, starts, 4, 12)
    assert windows.tolist() == [list(range(905, 917)), list(range(930, 942)), list(range(917, 929)),
                                list(range(942, 954))]  # a window from each document in turn, from its start
    with pytest.raises(ValueError, match="room for 7 windows of 12 tokens"):
        datasets.held_out_windows(tokens, starts, 8, 12)


class _CharacterTokenizer:
    """One token per character (ids are code points), enough for the retrieval probe's prompts and answers."""

    pad_token_id = 0
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        import torch

        class Encoded:
            input_ids = torch.tensor([[ord(c) for c in text]])

        return Encoded()

    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(int(i)) for i in row if int(i) != 0) for row in rows]


class _Reader:
    """A stand-in model whose generate() answers the number the prompt states (or a wrong one)."""

    def __init__(self, honest: bool):
        import torch

        self.honest = honest
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def parameters(self):
        return iter([self.weight])

    def generate(self, input_ids, attention_mask, max_new_tokens, **_):
        import re

        import torch

        answers = []
        for row, mask in zip(input_ids, attention_mask):
            text = "".join(chr(int(i)) for i in row[mask.bool()])
            stated = re.findall(r"The secret number is (\d{5})\. Remember it\.", text)
            assert len(stated) == 1 and text.endswith("The secret number is")
            answers.append(" " + (stated[0] if self.honest else "00000") + ".")
        width = max(len(a) for a in answers)
        new = torch.tensor([[ord(c) for c in a.ljust(width, chr(0))] for a in answers])
        return torch.cat([input_ids, new], dim=1)


def test_retrieval_probes_state_one_number_each_and_score_the_answers():
    import torch

    from fdc_ops.apps import metrics

    fillers = torch.randint(ord("a"), ord("z") + 1, (5, 200))
    for honest, expected in ((True, 1.0), (False, 0.0)):
        accuracy = metrics.retrieval_accuracy(_Reader(honest), _CharacterTokenizer(), fillers, batch_size=2,
                                              progress=False)
        assert accuracy == expected


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("compression", [0.3, 0.5, 0.6, 0.75, 0.9])
def test_stacked_budgets_split_what_quantization_leaves_evenly(compression, bits):
    """All three stacked: the widths' quantized bytes and the kept tokens each keep the same share of what
    quantization alone leaves, and together remove the budget (full widths and every token below quantization's
    own share)."""
    alone = eval_app.quantized_compression(0.0, 64, bits)
    dims, keep = eval_app.stacked_budgets(compression, 64, bits)
    widths_share = (1 - eval_app.quantized_compression(dims, 64, bits)) / (1 - alone)
    if compression <= alone:
        assert (dims, keep) == (0.0, 1.0)
    else:
        assert widths_share == pytest.approx(keep)
        assert 1 - keep * (1 - eval_app.quantized_compression(dims, 64, bits)) == pytest.approx(compression)
