"""The generated direct convolution (conv2d's ``direct`` algorithm, backends/vendor/direct.py)
against ``F.conv2d`` plus the epilogue.

Random geometries (hypothesis): odd spatial sizes, strides, padding, dilation, groups
(depthwise, grouped, dense), channel counts on and off the nests' blocks (16 lanes, 32
output channels, 6 pixels; 16 channels and 8 pixels below 17 channels), bias, residual
and activations, both layouts, batch 1 and 5; a stem's NCHW input read in place, with
and without non-temporal stores; and NaN/infinity in the input, which must spread exactly as in PyTorch's convolution.
The direct sums are the convolution's own, so the tolerance is float rounding (2e-5 of the
output's scale).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn as nn
from fusion_helpers import conv_graph, hardware
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import middleware
from middleware.backends.vendor import algorithms as alg
from middleware.backends.vendor import direct
from middleware.graph import TensorType
from middleware.ops import get_op
from middleware.options import Options

CPU = torch.device("cpu")
CL = torch.channels_last
ACTIVATIONS = [
    dict(),
    dict(activation="relu"),
    dict(activation="hardtanh", activation_attrs=(("min_val", 0.0), ("max_val", 6.0))),
    dict(activation="hardswish"),
    dict(activation="silu"),
]


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    scale = max(1e-12, float(ref.abs().max()))
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * scale)


@st.composite
def geometries(draw):
    groups_kind = draw(st.sampled_from(["dense", "depthwise", "grouped"]))
    k_h, k_w = draw(st.sampled_from([(1, 1), (3, 3), (5, 5), (3, 1), (1, 7), (7, 7)]))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, k_h // 2 * dilation[0])), draw(st.integers(0, k_w)))
    if groups_kind == "depthwise":
        c = draw(st.sampled_from([1, 5, 16, 17, 40]))
        groups, k = c, c
    elif groups_kind == "grouped":
        groups = draw(st.sampled_from([2, 3]))
        c, k = groups * draw(st.integers(1, 6)), groups * draw(st.integers(1, 40))
    else:
        groups, c, k = 1, draw(st.integers(1, 20)), draw(st.sampled_from([1, 7, 32, 33, 70]))
    min_h = (k_h - 1) * dilation[0] + 1 - 2 * padding[0]
    min_w = (k_w - 1) * dilation[1] + 1 - 2 * padding[1]
    h = draw(st.integers(max(1, min_h), max(1, min_h) + 12))
    w = draw(st.integers(max(1, min_w), max(1, min_w) + 19))
    n = draw(st.sampled_from([1, 5]))
    return (
        (n, c, h, w),
        (k, c // groups, k_h, k_w),
        dict(stride=stride, padding=padding, dilation=dilation, groups=groups),
    )


def _run(xs, ws, kw, layout, epilogue, x=None):
    g, node = conv_graph(xs, ws, layout, **kw, **epilogue)
    assert alg.DIRECT.applies(g, node, CPU, Options()) is None
    fn = alg.DIRECT.build(g, node, CPU, Options(), hardware())
    assert fn is not None
    fmt = CL if layout == "nhwc" else torch.contiguous_format
    args = [(torch.randn(xs) if x is None else x).contiguous(memory_format=fmt)]
    args.append(torch.from_numpy(g.params["w"]))
    if "b" in g.params:
        args.append(torch.from_numpy(g.params["b"]))
    if "r" in g.values:
        args.append(torch.randn(g.values["r"].shape).contiguous(memory_format=fmt))
    before = [a.clone() for a in args]
    y = fn(*args)
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b) or (a.isnan() == b.isnan()).all(), "direct wrote an input"
    assert y.is_contiguous(memory_format=fmt)
    return y, get_op("conv2d").bind(node)(*args)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    geo=geometries(),
    layout=st.sampled_from(["nhwc", "nchw"]),
    act=st.sampled_from(range(len(ACTIVATIONS))),
    bias=st.booleans(),
    residual=st.booleans(),
)
def test_direct_matches_pytorch(geo, layout, act, bias, residual):
    xs, ws, kw = geo
    epilogue = dict(ACTIVATIONS[act], bias=bias, residual=residual)
    y, ref = _run(xs, ws, kw, layout, epilogue)
    _close(y, ref)


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize(
    "xs,ws,kw",
    [
        ((2, 24, 13, 11), (24, 1, 3, 3), dict(padding=1, groups=24)),
        ((1, 8, 10, 12), (37, 8, 3, 3), dict(padding=1)),
        ((2, 6, 9, 9), (10, 3, 3, 3), dict(padding=2, dilation=2, groups=2, stride=2)),
    ],
)
def test_nan_and_infinity_spread_as_in_pytorch(layout, xs, ws, kw):
    torch.manual_seed(3)
    x = torch.randn(xs)
    x[0, 0, 2, 3] = math.nan
    x[-1, -1, -1, 0] = math.inf
    x[0, -1, 0, -1] = -math.inf
    y, ref = _run(xs, ws, kw, layout, dict(activation="relu"), x=x)
    assert torch.equal(y.isnan(), ref.isnan())
    assert torch.equal(y.isinf(), ref.isinf())
    finite = ref.isfinite()
    _close(y[finite], ref[finite])


def test_records_and_packing():
    g, node = conv_graph((1, 40, 8, 8), (40, 1, 3, 3), "nhwc", padding=1, groups=40)
    assert alg.DIRECT.exact and "direct" in alg.algorithm_names("conv2d")
    assert alg.DIRECT.extra_bytes(g, node) == 4 * 48 * (9 + 1)  # K padded to 3 x 16 lanes
    g2, node2 = conv_graph((1, 3, 8, 8), (40, 3, 3, 3), "nhwc", padding=1)
    assert alg.DIRECT.extra_bytes(g2, node2) == 4 * 9 * 3 * 64 + 4 * 40  # KG padded to 64
    assert "x86 only" in alg.DIRECT.applies(g, node, torch.device("cuda"), Options())
    name, src = direct.render(g, node, 2)
    assert "Depthwise" in src and name.startswith("conv_direct_dw")


class _Mobile(nn.Module):
    """An inverted residual block: 1x1 expand -> depthwise 3x3 -> 1x1 project + residual."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(16, 48, 1), nn.BatchNorm2d(48), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(48, 48, 3, padding=1, groups=48), nn.BatchNorm2d(48))
        self.project = nn.Conv2d(48, 16, 1)

    def forward(self, x):
        return x + self.project(torch.relu(self.dw(self.expand(x))))


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("batch", [1, 5])
def test_direct_through_optimize(layout, batch, tree_close, tmp_path):
    torch.manual_seed(0)
    model = _Mobile().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    fmt = CL if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(batch, 16, 15, 13).contiguous(memory_format=fmt)
    opt = middleware.optimize(
        model, example_inputs=[x], cache_dir=tmp_path, algorithms={"conv2d": "direct"}
    )
    with torch.no_grad():
        tree_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
    rows = [r for r in opt.report().rows if r.op == "conv2d"]
    assert [r.algorithm for r in rows] == ["direct"] * 3, rows


def _stem_graph(xs, ws, kw, epilogue):
    """A conv2d on an NCHW input whose output is channels_last (as the layout pass leaves
    a network's stem)."""
    g, node = conv_graph(xs, ws, "nchw", **kw, **epilogue)
    y = g.values[node.outputs[0]]
    g.values[node.outputs[0]] = TensorType(y.shape, y.dtype, "nhwc")
    if "r" in g.values:
        r = g.values["r"]
        g.values["r"] = TensorType(r.shape, r.dtype, "nhwc")
    return g, node


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    c=st.integers(1, direct.NCHW_MAX_CG),
    k=st.sampled_from([1, 7, 16, 17, 24, 32, 33, 64]),
    kernel=st.sampled_from([(3, 3), (7, 7), (1, 1), (5, 3)]),
    stride=st.integers(1, 4),
    pad=st.integers(0, 3),
    dilation=st.integers(1, 2),
    hw=st.tuples(st.integers(13, 30), st.integers(13, 40)),
    n=st.sampled_from([1, 3]),
    act=st.sampled_from(range(len(ACTIVATIONS))),
    residual=st.booleans(),
    stream=st.booleans(),
)
def test_stem_reads_nchw_in_place_and_writes_channels_last(
    c, k, kernel, stride, pad, dilation, hw, n, act, residual, stream
):
    """A dense layer of few input channels reads its NCHW input in place (the user's image;
    no conversion) and writes its channels_last output, through its plain call, its
    destination form and, with ``stream``, non-temporal stores: equal to F.conv2d."""
    assume(c > 1 or k > 1)  # one channel to one: the depthwise nest
    kh, kw_ = kernel
    pad = min(pad, kh // 2 * dilation)
    kw = dict(stride=stride, padding=pad, dilation=dilation)
    xs, ws = (n, c, *hw), (k, c, kh, kw_)
    g, node = _stem_graph(xs, ws, kw, dict(ACTIVATIONS[act], residual=residual))
    assert direct.reads_nchw(g, node)
    hw_ = hardware()
    if stream:  # every output large enough to stream
        hw_ = dataclasses.replace(hw_, l2_bytes=64, cores=1)
    _, src = direct.render(g, node, 2, direct.stream_min_bytes(hw_))
    assert ("_mm512_stream_ps" in src) == stream and "NCHW, read in place" in src
    fn = alg.DIRECT.build(g, node, CPU, Options(), hw_)
    torch.manual_seed(c * 100 + k)
    x = torch.randn(xs)
    args = [x, torch.from_numpy(g.params["w"]), torch.from_numpy(g.params["b"])]
    if residual:
        args.append(torch.randn(g.values["r"].shape).contiguous(memory_format=CL))
    ref = get_op("conv2d").bind(node)(*args)
    y = fn(*args)
    assert y.is_contiguous(memory_format=CL)
    _close(y, ref)
    out = torch.full_like(y, math.nan)
    fn.out(*args, out)
    _close(out, ref)
    assert fn.out.native(*args, out) is not None  # the native runner may call it
    # the same call on a channels_last input converts it first: the same values
    _close(fn(x.contiguous(memory_format=CL), *args[1:]), ref)


def test_the_default_runs_a_stem_of_few_channels_direct(tmp_path):
    """The measured stem rule: a dense convolution of at most 32 output channels on an
    NCHW image too large for the L2 caches (read in place, not converted) runs the direct
    kernel, a natively run one at batch 1 too; one of 64 output channels stays oneDNN's,
    and so does a stem whose input the layout pass converts first."""
    small_l2 = {"l2_bytes": 64, "cores": 1}
    for k, hw_, want in ((16, small_l2, "direct"), (64, small_l2, "vendor"), (16, None, "vendor")):
        torch.manual_seed(k)
        model = nn.Sequential(
            nn.Conv2d(3, k, 3, stride=2, padding=1), nn.Hardswish(), nn.Conv2d(k, 8, 1)
        ).eval()
        x = torch.randn(1, 3, 33, 31)
        opt = middleware.optimize(model, example_inputs=(x,), cache_dir=tmp_path, hardware=hw_)
        with torch.no_grad():
            y, ref = opt(x), model(x)
            y2 = opt(x)  # the native runner's call, after the recording
        _close(y, ref)
        _close(y2, ref)
        rows = [r for r in opt.report().rows if r.op == "conv2d"]
        assert rows[0].algorithm == want, rows
        if want == "direct":
            assert "stem" in rows[0].reason
            assert opt.plan.native is not None, opt.plan.notes
