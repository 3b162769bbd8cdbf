"""Upsampling as a generated I/O op (issue 15's segmentation heads): nearest, nearest-exact
and bilinear ``F.interpolate`` have loop semantics (a sum window per axis over ATen's own
source indices, weighted by ATen's own weights), so they fuse with their neighbours. Outputs
equal PyTorch's, NaN and infinity reaching the same outputs (a zero-weight tap ATen reads
still passes a NaN on); where ATen's float index arithmetic departs from the exact rule, or
downsampling skips input rows, the op stays ATen's call with the reason in the report."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

import middleware


class Head(nn.Module):
    """A segmentation head's tail: scale, resample, shift (the resample fuses with both)."""

    def __init__(self, **kw) -> None:
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return F.interpolate(x * 1.5, **self.kw) - 0.25


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN at other outputs"
    ok = ~torch.isnan(want)
    assert torch.equal(torch.isinf(got[ok]), torch.isinf(want[ok]))
    fin = torch.isfinite(want)
    scale = float(want[fin].abs().max())
    assert scale > 1e-3
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-5 * scale)


# the refusals a plain bilinear upsampling may meet: ATen reads the last row twice, the
# second time with weight 0 (wherever a source lands exactly on the last row); ATen's float
# source index lands just below an exact row (align_corners=True, 8 -> 24 rows: 23 * 7/23
# is 6.99999..., so output 23 reads rows 6 and 7, the exact rule row 7 alone)
ZERO_WEIGHT = "multiplies an input by a zero weight"
NOT_THE_RULE = "not the rule's"


def _check(kw: dict, shape: tuple[int, ...], layout: str, seed: int, generated: bool | None) -> str:
    """Optimize, compare with and without a NaN or infinity; ``generated`` None: either, a
    refusal for one of the two reasons above only. Returns how the op ran."""
    model = Head(**kw).eval()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    opt = middleware.optimize(model, example_inputs=(x,), layout=layout)
    rows = [r for r in opt.report().rows if r.op == "interpolate"]
    ran = rows[0].runs_as.value
    if generated is None:
        why = rows[0].reason
        assert ran == "generated" or ZERO_WEIGHT in why or NOT_THE_RULE in why, rows
    else:
        assert ran == ("generated" if generated else "vendor"), rows
    assert ran == "generated" or rows[0].reason
    for special in (None, math.nan, math.inf, -math.inf):
        xx = torch.randn(shape, generator=g)
        if special is not None:
            n, c, h, w = (int(torch.randint(s, (1,), generator=g)) for s in shape)
            xx[n, c, h, w] = special
        with torch.no_grad():
            _same(opt(xx), model(xx))
    return ran


@settings(max_examples=25, deadline=None)
@example(h=8, w=1, up_h=3, up_w=1, extra=0, mode="bilinear", align=True, layout="nchw", seed=0)
@given(
    h=st.integers(1, 9),
    w=st.integers(1, 9),
    up_h=st.integers(1, 4),
    up_w=st.integers(1, 4),
    extra=st.integers(0, 5),
    mode=st.sampled_from(["bilinear", "nearest", "nearest-exact"]),
    align=st.booleans(),
    layout=st.sampled_from(["nchw", "nhwc"]),
    seed=st.integers(0, 999),
)
def test_upsampling_is_generated_and_equals_pytorch(
    h, w, up_h, up_w, extra, mode, align, layout, seed
):
    """Sizes from equal to several times larger, integer ratios or not."""
    kw = {"size": (h * up_h + extra, w * up_w), "mode": mode}
    if mode == "bilinear":
        kw["align_corners"] = align
    # bilinear may meet the zero-weight refusal: a source exactly at the last row (odd
    # ratios, equal sizes, align_corners=True, one row); a ratio of 2 never does (below)
    _check(kw, (2, 3, h, w), layout, seed, generated=True if mode != "bilinear" else None)


def test_a_segmentation_heads_upsampling_is_generated():
    """fcn's and deeplabv3's: 28x28 -> 224x224, bilinear, align_corners=False."""
    kw = {"size": (224, 224), "mode": "bilinear", "align_corners": False}
    assert _check(kw, (1, 5, 28, 28), "nchw", 4, generated=True) == "generated"


def test_align_corners_last_output_stays_atens():
    """align_corners=True reads the last row twice, the second time by 0: an infinity there
    is NaN in ATen, which one tap cannot give."""
    kw = {"size": (9, 11), "mode": "bilinear", "align_corners": True}
    _check(kw, (1, 2, 4, 5), "nchw", 5, generated=False)


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("factor", [2, 4.0, (2, 8)])
def test_a_scale_factor_is_generated_where_atens_index_is_the_exact_one(mode, factor):
    kw = {"scale_factor": factor, "mode": mode}
    _check(kw, (1, 4, 5, 7), "nchw", 1, generated=True)


def test_a_fractional_factor_that_atens_float_index_rounds_stays_atens():
    """scale_factor=2.5 on 7 rows: ATen indexes with 1/2.5 in float, which departs from the
    exact ratio at some rows; the op stays ATen's call."""
    kw = {"scale_factor": (2.5, 1.5), "mode": "bilinear", "align_corners": False}
    _check(kw, (2, 3, 7, 9), "nchw", 2, generated=False)


def test_downsampling_that_skips_rows_stays_atens():
    """7x9 -> 5x4: columns 4 of 9 is read by no output; the schedule would hand it to a
    neighbour (its NaN would leak in through a zero weight)."""
    _check({"size": (5, 4), "mode": "bilinear"}, (2, 3, 7, 9), "nchw", 3, generated=False)
