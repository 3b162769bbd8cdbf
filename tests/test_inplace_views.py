"""In-place writes through views: in PyTorch a write into a view (or into a tensor views
were taken of) reaches every alias; the graph gives each value its own storage. Every
combination of a view, an in-place op and a later reader of an alias equals PyTorch: where
the graph cannot follow the write, the model is captured otherwise or runs as the original,
never with the write lost (it was lost before: ``y[:, :2].relu_(); return y * 1.5`` dropped
the relu)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware

VIEWS = {
    "slice": lambda y: y[:, :2],
    "view": lambda y: y.view(y.shape[0], -1),
    "reshape": lambda y: y.reshape(y.shape[0], -1),
    "permute": lambda y: y.permute(0, 2, 3, 1),
    "transpose": lambda y: y.transpose(2, 3),
    "flatten": lambda y: torch.flatten(y, 1),
    "identity": lambda y: y,
}
WRITES = {
    "relu_": lambda v: v.relu_(),
    "F.relu(inplace)": lambda v: F.relu(v, inplace=True),
    "mul_": lambda v: v.mul_(-2.0),
    "add_": lambda v: v.add_(1.5),
    "zero_": lambda v: v.zero_(),
    "iadd": lambda v: v.__iadd__(0.75),
}
READS = ("base", "view", "both")


class Net(nn.Module):
    def __init__(self, view: str, write: str, read: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.view, self.write, self.read = VIEWS[view], WRITES[write], read

    def forward(self, x):
        y = self.conv(x) * 1.0  # an intermediate, not the caller's input
        v = self.view(y)
        self.write(v)
        if self.read == "base":
            return y * 1.5
        if self.read == "view":
            return v * 1.5
        return y.sum(1, keepdim=True) + v.mean()


@pytest.mark.parametrize("read", READS)
@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_inplace_write_through_a_view_equals_pytorch(view, write, read):
    torch.manual_seed(len(view) * 7 + len(write) + len(read))
    model = Net(view, write, read).eval()
    x = torch.randn(2, 3, 5, 6)
    with torch.no_grad():
        want = model(x.clone())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = middleware.optimize(model, example_inputs=(x,))
        with torch.no_grad():
            got = opt(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * (1 + want.abs().max().item()))


def test_a_write_no_alias_reads_afterwards_stays_optimized():
    """relu_ through an identity with nothing else reading the base later: still one
    optimized graph (no fallback), and the caller's input is not written."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Identity(), nn.ReLU(inplace=True))
    model.eval()
    x = torch.randn(2, 3, 5, 6)
    opt = middleware.optimize(model, example_inputs=(x,))
    assert not [r for r in opt.report().rows if r.runs_as == "fallback"]
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
