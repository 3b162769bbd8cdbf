"""A stem convolution and the depthwise 3x3 layer that reads it as one layer
(passes/fuse_depthwise.fuse_stem, ``conv2d_dw`` with ``stride1``/``padding1``), run by the
generated direct kernel (backends/vendor/direct.stem_dw_kernel): the stem's rows computed
into a ring in cache, the depthwise layer from there. PyTorch's values over random
geometries, activations, layouts, batch sizes and non-temporal stores; NaN and infinity;
the stems it must leave alone."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from fusion_helpers import hardware, reinit
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import middleware
from middleware.backends.vendor import algorithms as alg
from middleware.backends.vendor import direct
from middleware.graph import Graph, Node, TensorType
from middleware.ops import get_op
from middleware.options import Options

CPU = torch.device("cpu")
CL = torch.channels_last
SMALL_L2 = {"l2_bytes": 64, "cores": 1}  # the pass fuses where the stem's output outgrows L2
ACTS = {
    "none": (None, ()),
    "relu": ("relu", ()),
    "relu6": ("hardtanh", (("min_val", 0.0), ("max_val", 6.0))),
    "hardswish": ("hardswish", ()),
    "silu": ("silu", ()),
}
MODULES = {"none": nn.Identity, "relu": nn.ReLU, "relu6": nn.ReLU6, "hardswish": nn.Hardswish}


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 2e-5) -> None:
    scale = max(1e-12, float(ref[ref.isfinite()].abs().max()))
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * scale, equal_nan=True)


def _graph(xs, k, kernel, stride1, padding1, ds, act1, act2, layout, seed=0):
    """One fused stem ``conv2d_dw`` node over an input of shape ``xs``."""
    rng = np.random.default_rng(seed)
    n, c, h, w = xs
    kh, kw = kernel
    g = Graph()
    g.add_input("x", TensorType(tuple(xs), layout=layout))
    g.add_param(
        "w1", (rng.standard_normal((k, c, kh, kw)) / math.sqrt(c * kh * kw)).astype(np.float32)
    )
    g.add_param("b1", (rng.standard_normal(k) * 0.1).astype(np.float32))
    g.add_param("wdw", (rng.standard_normal((k, 1, 3, 3)) / 3).astype(np.float32))
    g.add_param("bdw", (rng.standard_normal(k) * 0.1).astype(np.float32))
    oh = (h + 2 * padding1[0] - kh) // stride1[0] + 1
    ow = (w + 2 * padding1[1] - kw) // stride1[1] + 1
    attrs: dict = dict(stride=ds, stride1=stride1, padding1=padding1)
    for key, a in (("activation", act1), ("dw_activation", act2)):
        name, extra = ACTS[a]
        if name:
            attrs[key], attrs[f"{key}_attrs"] = name, extra
    node = Node("s", "conv2d_dw", ("x", "w1", "b1", "wdw", "bdw"), ("y",), attrs)
    g.add_node(node, [TensorType((n, k, (oh - 1) // ds + 1, (ow - 1) // ds + 1), layout="nhwc")])
    g.set_outputs("y")
    return g, node


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    c=st.integers(1, 4),
    k=st.sampled_from([1, 7, 16, 17, 24, 32]),
    kernel=st.sampled_from([(3, 3), (5, 5), (7, 7), (3, 1), (1, 1)]),
    stride1=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    pad=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    ds=st.sampled_from([1, 2]),
    hw=st.tuples(st.integers(1, 40), st.integers(1, 45)),
    n=st.sampled_from([1, 3]),
    act1=st.sampled_from(sorted(ACTS)),
    act2=st.sampled_from(sorted(ACTS)),
    layout=st.sampled_from(["nchw", "nhwc"]),
    stream=st.booleans(),
)
def test_stem_dw_kernel_matches_pytorch(
    c, k, kernel, stride1, pad, ds, hw, n, act1, act2, layout, stream
):
    """The fused kernel's plain call, destination form and native call's operands against
    the reference's two convolutions, either input layout, with and without non-temporal
    stores of the output."""
    padding1 = pad  # (wider than the kernel's half too: rows and columns of padding only)
    assume(all(h + 2 * p >= k_ for h, p, k_ in zip(hw, pad, kernel, strict=True)))
    xs = (n, c, *hw)
    g, node = _graph(xs, k, kernel, stride1, padding1, ds, act1, act2, layout, seed=c + k)
    assert direct.stem_dw_why_not(g, node, CPU) is None
    hw_ = hardware()
    if stream:
        hw_ = dataclasses.replace(hw_, l2_bytes=1, cores=1)  # every output streams
    _, src = direct.render_stem_dw(g, node, 2, direct.stream_min_bytes(hw_))
    assert ("_mm512_stream_ps" in src) == stream
    fn = alg.STEM_DW_DIRECT.build(g, node, CPU, Options(), hw_)
    assert fn is not None
    torch.manual_seed(sum(hw))
    x = torch.randn(xs)
    if layout == "nhwc":
        x = x.contiguous(memory_format=CL)
    params = [torch.from_numpy(g.params[v]) for v in ("w1", "b1", "wdw", "bdw")]
    ref = get_op("conv2d_dw").bind(node)(x, *params)
    y = fn(x, *params)
    assert y.is_contiguous(memory_format=CL) and y.shape == ref.shape
    _close(y, ref)
    out = torch.full_like(y, math.nan)
    fn.out(x, *params, out)
    _close(out, ref)
    assert fn.out.native(x, *params, out) is not None


def test_the_kernel_declines_what_it_does_not_compute():
    """Another depthwise kernel size or stride, or a stem of more input channels than it
    reads in place: the direct kernel says why (the reference then runs)."""
    g, node = _graph((1, 3, 16, 16), 16, (3, 3), (2, 2), (1, 1), 2, "relu", "relu", "nchw")
    assert direct.stem_dw_why_not(g, node, CPU) is None
    for change in ("dw5x5", "stride3", "wide"):
        g2, node2 = _graph((1, 8 if change == "wide" else 3, 16, 16), 16, (3, 3), (2, 2),
                           (1, 1), 3 if change == "stride3" else 2, "relu", "relu", "nchw")  # fmt: skip
        if change == "dw5x5":
            g2.values["wdw"] = TensorType((16, 1, 5, 5))
        assert direct.stem_dw_why_not(g2, node2, CPU) is not None, change


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_nan_and_infinity_spread_as_in_pytorch(layout):
    """A NaN, an infinity and a minus infinity in the image reach exactly the outputs
    they reach in PyTorch (padding taps are skipped, never multiplied)."""
    g, node = _graph((2, 3, 21, 19), 16, (3, 3), (2, 2), (1, 1), 2, "relu", "hardswish", layout)
    fn = alg.STEM_DW_DIRECT.build(g, node, CPU, Options(), hardware())
    torch.manual_seed(5)
    x = torch.randn(2, 3, 21, 19)
    x[0, 1, 4, 6] = math.nan
    x[1, 0, 0, 0] = math.inf
    x[1, 2, 20, 18] = -math.inf
    if layout == "nhwc":
        x = x.contiguous(memory_format=CL)
    params = [torch.from_numpy(g.params[v]) for v in ("w1", "b1", "wdw", "bdw")]
    ref = get_op("conv2d_dw").bind(node)(x, *params)
    y = fn(x, *params)
    assert torch.equal(y.isnan(), ref.isnan()) and ref.isnan().any()
    assert torch.equal(y.isinf(), ref.isinf())
    finite = ref.isfinite()
    _close(y[finite], ref[finite])


class _Stem(nn.Module):
    """A MobileNet-like stem: conv -> BN -> act, depthwise 3x3 -> BN -> act, 1x1."""

    def __init__(self, c=3, k=16, kernel=3, stride=2, dw_stride=2, dw_kernel=3, act1="hardswish",
                 act2="relu", read_twice=False) -> None:  # fmt: skip
        super().__init__()
        self.read_twice = read_twice
        self.stem = nn.Sequential(
            nn.Conv2d(c, k, kernel, stride, kernel // 2), nn.BatchNorm2d(k), MODULES[act1]()
        )
        self.dw = nn.Sequential(
            nn.Conv2d(k, k, dw_kernel, dw_stride, dw_kernel // 2, groups=k),
            nn.BatchNorm2d(k),
            MODULES[act2](),
        )
        self.pw = nn.Conv2d(k, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        y = self.pw(self.dw(s))
        return y + s.mean() if self.read_twice else y


def _optimize(m, x, tmp_path, **options):
    opt = middleware.optimize(
        m, example_inputs=[x], cache_dir=tmp_path, measure_hardware=False, **options
    )
    with torch.inference_mode():
        ref, got = m(x), opt(x)
        got2 = opt(x)  # the native runner's call, after the recording
    for y in (got, got2):
        _close(y, ref, 1e-5)
    assert float(ref.abs().max()) > 1e-3
    return opt


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(
    "k,dw_stride,act1,act2", [(16, 2, "hardswish", "relu"), (32, 1, "relu6", "relu6")]
)
def test_a_stem_runs_fused_through_optimize(
    batch, channels_last, k, dw_stride, act1, act2, tmp_path
):
    """MobileNet v3's (16 channels, depthwise stride 2) and v2's (32, stride 1) stems on
    small caches: one ``conv2d_dw`` layer run by the direct kernel, with its own label, in
    the native runner's program, PyTorch's values."""
    m = reinit(_Stem(k=k, dw_stride=dw_stride, act1=act1, act2=act2), k).eval()
    x = torch.randn(batch, 3, 37, 33, generator=torch.Generator().manual_seed(batch))
    if channels_last:
        x = x.contiguous(memory_format=CL)
    opt = _optimize(m, x, tmp_path, hardware=SMALL_L2)
    rows = [r for r in opt.report().rows if r.op == "conv2d_dw"]
    assert len(rows) == 1 and rows[0].algorithm == "direct", opt.report()
    assert "fuse_stem" in rows[0].reason
    assert rows[0].source == "stem.0+stem.1+stem.2+dw.0+dw.1+dw.2", rows[0].source
    assert opt.plan.native is not None, opt.plan.notes


@pytest.mark.parametrize(
    "case",
    ["control", "small", "wide", "many_inputs", "dw5x5", "read_twice", "disabled",
     "named_algorithm", "capped", "auto", "training"],
)  # fmt: skip
def test_stems_left_alone(case, tmp_path):
    """What the fused kernel does not compute stays two layers, with PyTorch's values: a
    stem's output that fits the caches, 64 output or 8 input channels, a 5x5 depthwise
    layer, a stem's output read by another layer too, the pass switched off, conv2d
    algorithms the user named, a cap on extra parameter bytes, training. (Controls: unchanged, or ``algorithms="auto"``.)"""
    options: dict = {"hardware": SMALL_L2}
    kw: dict = {}
    if case == "small":
        options = {}
    elif case == "wide":
        kw["k"] = 64
    elif case == "many_inputs":
        kw["c"] = 8
    elif case == "dw5x5":
        kw["dw_kernel"] = 5
    elif case == "read_twice":
        kw["read_twice"] = True
    elif case == "disabled":
        options["disable_passes"] = ("fuse_stem",)
    elif case == "named_algorithm":
        options["algorithms"] = {"conv2d": "vendor"}
    elif case == "capped":  # the fused kernel's packed weights could pass the cap
        options["max_extra_param_bytes"] = 0
    elif case == "auto":
        options["algorithms"] = {"conv2d": "auto"}
    m = reinit(_Stem(**kw), 3).eval()
    x = torch.randn(2, kw.get("c", 3), 29, 31, generator=torch.Generator().manual_seed(1))
    if case == "training":
        m.train()
        opt = middleware.optimize(m, cache_dir=tmp_path, measure_hardware=False, **options)
        torch.testing.assert_close(opt(x), m(x), rtol=1e-5, atol=1e-5)
        assert not any(r.op == "conv2d_dw" for r in opt.report().rows)
        return
    opt = _optimize(m, x, tmp_path, **options)
    fused = [r for r in opt.report().rows if r.op == "conv2d_dw"]
    assert bool(fused) == (case in ("control", "auto")), opt.report()
