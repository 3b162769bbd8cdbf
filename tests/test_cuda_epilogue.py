"""The CUDA convolution epilogue (cuDNN convolution without bias, then one generated
in-place kernel: bias + residual + activation), run through the CPU emulation against
PyTorch, in both layouts, vectorised (float4) and scalar, for every fusable activation."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn as nn
from cuda_cases import FAKE_GPU

import middleware
from middleware.backends.cuda.build import build, emulation_request
from middleware.backends.cuda.emulate import EmulatedLauncher
from middleware.backends.cuda.epilogue import conv_epilogue, make_conv, render_epilogue
from middleware.backends.cuda.units import cuda_units
from middleware.options import Options
from middleware.passes.fuse_vendor_epilogue import fuse_vendor_epilogue
from middleware.runtime.plan import build_plan

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulation")

ACTS = [None, "relu", "hardtanh", "leaky_relu", "silu", "hardswish", "sigmoid", "gelu"]


class Residual(nn.Module):
    def __init__(self, c: int, act: str | None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.act = {
            None: nn.Identity(),
            "relu": nn.ReLU(),
            "hardtanh": nn.ReLU6(),
            "leaky_relu": nn.LeakyReLU(0.1),
            "silu": nn.SiLU(),
            "hardswish": nn.Hardswish(),
            "sigmoid": nn.Sigmoid(),
            "gelu": nn.GELU(),
        }[act]

    def forward(self, x):
        return self.act(self.conv(x) + x)


def _cuda_graph(model: nn.Module, x: torch.Tensor, layout: str):
    from test_cuda_units import _as_channels_last

    graph = middleware.trace(model, x)
    graph = fuse_vendor_epilogue(graph, FAKE_GPU)
    return _as_channels_last(graph) if layout == "nhwc" else graph


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("c,hw", [(8, 6), (5, 7)])  # float4 / scalar in both layouts
def test_conv_epilogue_matches_pytorch(layout, act, c, hw, tmp_path):
    torch.manual_seed(0)
    model = Residual(c, act).eval()
    x = torch.randn(2, c, hw, hw)
    graph = _cuda_graph(model, x, layout)
    (conv,) = [n for n in graph.nodes() if n.op == "conv2d"]
    ep = conv_epilogue(graph, conv)
    assert (
        ep is not None
        and ep.has_bias
        and ep.has_residual
        and ep.activation == (None if act is None else conv.attrs["activation"])
    )
    assert ep.vec == (4 if (c if layout == "nhwc" else hw * hw) % 4 == 0 else 1)
    req = emulation_request(ep.name(), render_epilogue(ep, FAKE_GPU))
    fn = make_conv(conv, ep, EmulatedLauncher(build(req, tmp_path), ep.name()), FAKE_GPU, None)
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    xin = x.contiguous(memory_format=fmt)
    args = [xin, model.conv.weight.detach(), model.conv.bias.detach(), xin]
    with torch.no_grad():
        y = fn(*args)
        ref = model(x)
    assert y.is_contiguous(memory_format=fmt)
    scale = ref.abs().max().item()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * scale)


def test_plan_runs_convs_with_the_epilogue_kernel(tmp_path):
    """A whole plan for CUDA (kernels emulated): every conv with a bias runs as cuDNN +
    the generated epilogue, and the result matches PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.Hardswish(), Residual(8, "relu"), Residual(8, "silu")
    ).eval()
    x = torch.randn(2, 3, 9, 9)
    graph = middleware.trace(model, x)
    graph = fuse_vendor_epilogue(graph, FAKE_GPU)
    options = Options(device="cuda", cache_dir=tmp_path, measure_hardware=False)
    units = cuda_units(graph, options, FAKE_GPU, torch.device("cpu"), emulate=True)
    convs = [u for u in units if graph.node(u.nodes[0]).op == "conv2d"]
    assert len(convs) == 3 and all("epilogue" in u.reason for u in convs)
    plan = build_plan(graph, torch.device("cpu"), units)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(plan.run([x]), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
