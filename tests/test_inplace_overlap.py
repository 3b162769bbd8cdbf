"""A result written in place over one input must not overwrite another input that shares
its storage (review finding, session 7: a 1x1 convolution accumulating into its residual
``c[:, 4:12]`` while reading ``c`` itself, at one pixel, gave wrong answers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import middleware


class _SliceResidual(nn.Module):
    def __init__(self, cin: int = 16) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, cin, 3, padding=1)
        self.p = nn.Conv2d(cin, 8, 1)

    def forward(self, x):
        c = F.relu(self.a(x))
        return self.p(c) + c[:, 4:12]


class _CatSliceResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 8, 3, padding=1)
        self.p = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        c = torch.cat([F.relu(self.a(x)), torch.sigmoid(self.b(x))], 1)
        return self.p(c) + c[:, 8:]


class _SliceAdd(nn.Module):
    """An elementwise add of two overlapping slices of one value."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)

    def forward(self, x):
        c = F.relu(self.a(x))
        return (c[:, 4:12] + c[:, 0:8]) * 2


@pytest.mark.parametrize("cls", [_SliceResidual, _CatSliceResidual, _SliceAdd])
@pytest.mark.parametrize("hw", [1, 2, 5])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("batch", [1, 3])
def test_in_place_results_never_overwrite_an_overlapping_input(
    cls, hw, layout, batch, tmp_path, tree_close
):
    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(batch, 3, hw, hw)
    opt = middleware.optimize(model, example_inputs=[x], cache_dir=tmp_path, layout=layout)
    with torch.no_grad():
        tree_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
