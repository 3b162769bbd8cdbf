"""The trace's shortcut for eval-mode batch norms (the result's type is the input's, no
fake-tensor dispatch): traced types and optimized outputs still match PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import middleware


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.bn2 = nn.BatchNorm2d(6)
        self.bn1 = nn.BatchNorm1d(6)
        self.bn1_flat = nn.BatchNorm1d(6 * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn2(self.conv(x)))
        z = self.bn1(y.flatten(2))  # (N, C, L)
        w = self.bn1_flat(nn.functional.adaptive_avg_pool2d(y, 2).flatten(1))  # (N, C*4)
        return z.mean(2) + w.view(-1, 6, 4).sum(2)


@pytest.mark.parametrize("channels_last", [False, True])
def test_traced_types_and_outputs_match_torch(tmp_path, channels_last):
    torch.manual_seed(0)
    m = _Net().eval()
    with torch.no_grad():
        for bn in (m.bn2, m.bn1, m.bn1_flat):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
    x = torch.randn(2, 3, 10, 9)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    g = middleware.trace(m, (x,))
    bns = [n for n in g.nodes() if n.op == "batch_norm"]
    assert len(bns) == 3
    for n in bns:  # a batch norm keeps its input's type
        assert g.values[n.outputs[0]].shape == g.values[n.inputs[0]].shape
    opt = middleware.optimize(m, "cpu", example_inputs=(x,), cache_dir=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x), atol=1e-5, rtol=1e-5)


def test_malformed_batch_norm_call_still_raises():
    m = nn.Sequential(nn.Conv2d(3, 5, 1), nn.BatchNorm2d(4)).eval()  # 5 channels into a BN(4)
    with pytest.raises(Exception):  # noqa: B017, PT011 - whatever torch raises, tracing fails
        middleware.trace(m, (torch.randn(1, 3, 4, 4),))
