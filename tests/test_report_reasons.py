"""report() carries a reason for every node that does not run as the pipeline intended:
io nodes left to the framework (vendor faster, no loop semantics, a split group, views
only, a generator failure) say why (issue 11 item 8)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import middleware


class Block(nn.Module):
    """A channel shuffle (reshape/permute), a depthwise convolution and a fused chain."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        n, c, h, w = x.shape
        y = x.reshape(n, 2, c // 2, h, w).permute(0, 2, 1, 3, 4).reshape(n, c, h, w)
        y = torch.relu(self.bn(self.dw(y)))
        return nn.functional.max_pool2d(y, 3, 2, 1)


def _rows(model: nn.Module, x: torch.Tensor, tmp_path, **kw):
    opt = middleware.optimize(model.eval(), example_inputs=(x,), cache_dir=tmp_path, **kw)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-5, atol=1e-5)
    return opt.report().rows


def test_every_io_node_outside_a_kernel_says_why(tmp_path):
    rows = _rows(Block(), torch.randn(2, 8, 9, 9), tmp_path)
    left = [r for r in rows if r.bound == "io" and r.runs_as != "generated"]
    assert left and any(r.runs_as == "generated" for r in rows)
    assert all(r.reason for r in left), [(r.node, r.op) for r in left if not r.reason]


def test_a_generator_failure_is_reported(tmp_path, monkeypatch):
    from middleware.backends.x86 import backend

    def broken(self, graph, names, options, hardware):  # noqa: ANN001, ANN202
        raise RuntimeError("planted generator bug")

    monkeypatch.setattr(backend.X86Backend, "build", broken)
    model = nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
    with pytest.warns(RuntimeWarning, match="planted generator bug"):
        rows = _rows(model, torch.randn(1, 4, 8, 8), tmp_path, measure_hardware=False)
    assert not any(r.runs_as == "generated" for r in rows)
    assert all("planted generator bug" in r.reason for r in rows if r.bound == "io")
