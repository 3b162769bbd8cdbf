"""A subclass of nn.BatchNorm2d in training mode (fx traces through a user subclass) is one
call of the user's module: its num_batches_tracked and running statistics advance as in
eager, momentum=None's cumulative average included. Traced through, the increment was
dropped and the average factor frozen at trace time (running statistics 0.04 off after
three steps)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import middleware


class MyBN(nn.BatchNorm2d):
    pass


class Net(nn.Module):
    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = MyBN(8, momentum=momentum)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


@pytest.mark.parametrize("momentum", [None, 0.1])
def test_batch_norm_subclass_trains_its_statistics_as_eager(momentum, tmp_path):
    torch.manual_seed(0)
    model = Net(momentum).train()
    eager = copy.deepcopy(model)
    opt = middleware.optimize(model, cache_dir=tmp_path)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8)
        y, ref = opt(x), eager(x)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        y.sum().backward()
        ref.sum().backward()
    assert model.bn.num_batches_tracked.item() == eager.bn.num_batches_tracked.item() == 3
    torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.bn.running_var, eager.bn.running_var, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.conv.weight.grad, eager.conv.weight.grad, rtol=1e-4, atol=1e-6)


def test_batch_norm_subclass_in_eval_is_still_fused(tmp_path):
    torch.manual_seed(0)
    model = Net(0.1).eval()
    with torch.no_grad():
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
    opt = middleware.optimize(model, cache_dir=tmp_path)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    assert not [r for r in opt.report().rows if r.runs_as == "fallback"]
