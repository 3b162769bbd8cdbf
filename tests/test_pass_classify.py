"""classify: the roofline rule against the device's balance, and the neighbour rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from middleware import trace
from middleware.hardware import detect
from middleware.passes import DEFAULT_HARDWARE
from middleware.passes.classify import classify, roofline

# This machine kind measured ~200 GFLOP/s against 20-60 GB/s: a balance of about 3 to 10.
LOW = dataclasses.replace(DEFAULT_HARDWARE, peak_gflops=200.0, bandwidth_gbs=60.0)
HIGH = dataclasses.replace(DEFAULT_HARDWARE, peak_gflops=200.0, bandwidth_gbs=20.0)
ENDS = [LOW, HIGH, DEFAULT_HARDWARE]


def bounds(m: nn.Module, x: torch.Tensor, hw) -> dict[str, str]:
    g = classify(trace(m.eval(), (x,)), hw)
    return {n.op: n.bound for n in g.nodes()}


@pytest.mark.parametrize("hw", ENDS, ids=lambda h: f"balance{h.balance:.1f}")
@pytest.mark.parametrize(
    "c, hw_size, stride", [(32, 112, 1), (64, 56, 1), (144, 56, 2), (960, 7, 1)]
)
def test_depthwise_conv_is_io(hw, c, hw_size, stride):
    conv = nn.Conv2d(c, c, 3, stride=stride, padding=1, groups=c)
    assert bounds(conv, torch.randn(1, c, hw_size, hw_size), hw) == {"conv2d": "io"}


@pytest.mark.parametrize("hw", ENDS, ids=lambda h: f"balance{h.balance:.1f}")
@pytest.mark.parametrize("batch", [1, 16])
def test_dense_3x3_conv_is_compute(hw, batch):
    conv = nn.Conv2d(64, 64, 3, padding=1)
    assert bounds(conv, torch.randn(batch, 64, 56, 56), hw) == {"conv2d": "compute"}


@pytest.mark.parametrize("hw", ENDS, ids=lambda h: f"balance{h.balance:.1f}")
def test_linear_is_param_at_batch_1_and_compute_at_large_batch(hw):
    fc = nn.Linear(1024, 1000)
    assert bounds(fc, torch.randn(1, 1024), hw) == {"linear": "param"}
    assert bounds(fc, torch.randn(256, 1024), hw) == {"linear": "compute"}


def test_squeeze_excite_conv_on_1x1_is_param():
    conv = nn.Conv2d(96, 24, 1)
    assert bounds(conv, torch.randn(1, 96, 1, 1), DEFAULT_HARDWARE) == {"conv2d": "param"}


def test_roofline_counts_weights_and_activations():
    g = trace(nn.Conv2d(8, 16, 3, bias=False).eval(), (torch.randn(2, 8, 10, 10),))
    (n,) = list(g.nodes())
    r = roofline(g, n)
    assert r.weight_bytes == 16 * 8 * 9 * 4
    assert r.act_bytes == (2 * 8 * 10 * 10 + 2 * 16 * 8 * 8) * 4
    assert r.flops == 2 * (2 * 16 * 8 * 8) * 8 * 9


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(64, 64, 3, padding=1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        y = self.conv(x)
        z = torch.relu(y) * 2.0  # after a vendor call, not fused: stays io
        p = nn.functional.max_pool2d(z, 2)
        v = p.mean((2, 3)).reshape(1, 64)  # a view after an io node: io
        out = self.fc(v).reshape(1, 2, 5)  # a view after a param node: param
        return out, x.reshape(64, -1)  # a view of an input: io


def test_neighbour_rule():
    g = trace(Mixed().eval(), (torch.randn(1, 64, 16, 16),))
    text_before = g.text()
    g2 = classify(g, DEFAULT_HARDWARE)
    assert g.text() == text_before
    got = [(n.op, n.bound) for n in g2.nodes()]
    assert got == [
        ("conv2d", "compute"),
        ("relu", "io"),
        ("mul", "io"),
        ("max_pool2d", "io"),
        ("mean", "io"),
        ("reshape", "io"),
        ("linear", "param"),
        ("reshape", "param"),
        ("reshape", "io"),
    ]


def test_documented_defaults_put_depthwise_io_and_dense_compute(tmp_path):
    hw = detect("cpu", tmp_path, measure=False)
    assert 3 <= hw.balance <= 12
    assert bounds(nn.Conv2d(32, 32, 3, padding=1, groups=32), torch.randn(1, 32, 56, 56), hw) == {
        "conv2d": "io"
    }
    assert bounds(nn.Conv2d(64, 64, 3, padding=1), torch.randn(1, 64, 56, 56), hw) == {
        "conv2d": "compute"
    }
