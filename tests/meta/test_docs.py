"""The runnable examples in the op docstrings (fdc_ops/ops.py) run and print what they show."""

import doctest

import pytest
import torch

import fdc_ops.ops

OPS = [name for name in fdc_ops.ops.__all__ if hasattr(torch.ops.fdc, name)]  # the wrappers of torch.ops.fdc


def test_every_op_is_covered():
    assert len(OPS) == 8, OPS


@pytest.mark.parametrize("name", OPS)
def test_op_docstring_example(name):
    function = getattr(fdc_ops.ops, name)
    examples = doctest.DocTestFinder().find(function, name, globs={})
    assert examples and examples[0].examples, f"fdc_ops.ops.{name} has no >>> example"
    torch.manual_seed(0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for example in examples:
        runner.run(example)
    assert runner.failures == 0, f"the example of fdc_ops.ops.{name} failed (its output is above)"
