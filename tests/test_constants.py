"""Plan constants: the user's own tensor where the passes left a weight as the frontend
stored it (one copy of unchanged weights on a GPU), a copy otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import middleware
from middleware.backends.interface import constant_tensor
from middleware.graph import PARAM_SOURCES

CPU = torch.device("cpu")


def _source(t: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    return t.detach().cpu().numpy(), t.detach()


def test_an_unchanged_weight_is_the_users_tensor():
    t = torch.randn(5, 7)
    arr, src = _source(t)
    assert constant_tensor(arr, (arr, src), CPU) is src


@pytest.mark.parametrize(
    "case", ["transformed", "other_dtype", "needs_channels_last", "no_source", "reshaped"]
)
def test_anything_else_is_a_copy_in_the_asked_layout(case):
    t = torch.randn(4, 3, 5, 5)
    arr, src = _source(t)
    layout = "nchw"
    given = arr
    if case == "transformed":  # a pass's new array (folded batch-norm, say)
        given = arr * 2.0
    elif case == "other_dtype":
        src = src.double()
    elif case == "needs_channels_last":
        layout = "nhwc"
    elif case == "reshaped":
        src = src.reshape(12, 25)
    out = constant_tensor(given, None if case == "no_source" else (arr, src), CPU, layout)
    assert out is not src
    torch.testing.assert_close(out, torch.from_numpy(np.asarray(given)), rtol=0, atol=0)
    if layout == "nhwc":
        assert out.is_contiguous(memory_format=torch.channels_last)


def test_a_plan_shares_unchanged_weights_and_copies_folded_ones():
    """resnet-like block: the linear layer's weight is the user's tensor in the plan; the
    convolution's weight, with the batch-norm folded into it, is the plan's own."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 36, 5),
    ).eval()
    with torch.no_grad():
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].running_mean.normal_()
    x = torch.randn(2, 3, 6, 6)
    opt = middleware.optimize(model, example_inputs=(x,))
    sources = opt.graph.meta.get(PARAM_SOURCES, {})
    assert sources, "the frontend records each weight's own tensor"
    ptrs = {t.data_ptr() for t in opt.plan.param_tensors()}
    assert model[4].weight.data_ptr() in ptrs
    assert model[0].weight.data_ptr() not in ptrs  # folded: a new array
    with torch.no_grad():
        y = model(x)
        torch.testing.assert_close(opt(x), y, rtol=1e-4, atol=1e-4 * y.abs().max().item())
        model[4].weight.mul_(2.0)  # an in-place write: the plan is rebuilt and still right
        y2 = model(x)
        torch.testing.assert_close(opt(x), y2, rtol=1e-4, atol=1e-4 * y2.abs().max().item())
