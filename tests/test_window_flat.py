"""Stride-1 pooling over NCHW planes as two flat loops (``x86/window.py``, ``flat``): the
column pass masks each tap to the lanes whose column stays in its row, from a table of
masks per chunk. Plane widths that do and do not divide the 16 lanes, windows of 3 and 5,
NaN and infinities at random places (borders included), against PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import middleware

DEFAULT = [
    (17, 20, 3, 1, "max"),
    (28, 28, 3, 1, "max"),
    (20, 20, 5, 2, "max"),
    (31, 17, 3, 1, "avg"),
]
SLOW = [
    (16, 19, 3, 1, "max"),
    (16, 16, 3, 1, "avg"),
    (33, 33, 3, 1, "max"),
    (33, 17, 5, 2, "max"),
    (28, 31, 3, 1, "avg"),
    (56, 56, 3, 1, "max"),
]


def _model(k: int, pad: int, kind: str, include_pad: bool) -> nn.Module:
    if kind == "max":
        return nn.Sequential(nn.MaxPool2d(k, 1, pad)).eval()
    return nn.Sequential(nn.ReLU(), nn.AvgPool2d(k, 1, pad, count_include_pad=include_pad)).eval()


def _check(w: int, h: int, k: int, pad: int, kind: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    m = _model(k, pad, kind, include_pad=bool(seed % 2))
    x = torch.randn(2, 5, h, w, generator=g) * 3
    flat = x.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[:24]
    flat[idx[:8]] = float("nan")
    flat[idx[8:16]] = float("inf")
    flat[idx[16:]] = -float("inf")
    # the first and last column of a few rows: the lanes the column masks exclude
    x[0, 1, :, 0] = float("nan")
    x[1, 3, 2, w - 1] = float("inf")
    opt = middleware.optimize(m, example_inputs=[x])
    rows = opt.report().rows
    assert any(r.runs_as == "generated" for r in rows), opt.report()
    y, ref = opt(x), m(x)
    scale = ref[torch.isfinite(ref)].abs().max().item()
    torch.testing.assert_close(y, ref, equal_nan=True, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("w,h,k,pad,kind", DEFAULT)
def test_flat_pooling(w: int, h: int, k: int, pad: int, kind: str) -> None:
    _check(w, h, k, pad, kind, seed=w * 7 + k)


@pytest.mark.slow
@pytest.mark.parametrize("w,h,k,pad,kind", SLOW)
def test_flat_pooling_more_widths(w: int, h: int, k: int, pad: int, kind: str) -> None:
    _check(w, h, k, pad, kind, seed=w * 7 + k)
