"""The small 1x1 convolution as one GEMM (backends/vendor/calls.py, issue 13) against the
catalogue reference and against PyTorch: odd channel counts, both layouts, batch 1 and 5,
bias, residual (also accumulated into the residual), every activation with an in-place or
out-of-place ATen form; tolerance relative to the output's scale."""

from __future__ import annotations

import pytest
import torch
from fusion_helpers import conv_graph
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import middleware
from middleware.backends.vendor.calls import GEMM_1X1_MAX_ROWS, vendor_kernel
from middleware.ops import get_op

CL = torch.channels_last
ACTIVATIONS = [
    (None, ()),
    ("relu", ()),
    ("hardtanh", (("min_val", 0.0), ("max_val", 6.0))),
    ("hardswish", ()),
    ("hardsigmoid", ()),
    ("silu", ()),
    ("gelu", (("approximate", "none"),)),
]


def _close(y: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    scale = max(1e-12, float(ref.abs().max()))
    assert scale > 1e-3, "degenerate reference"
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol * scale)


@settings(max_examples=60, deadline=None)
@given(
    n=st.sampled_from([1, 5]),
    c=st.integers(1, 37),
    k=st.integers(1, 29),
    hw=st.sampled_from([(1, 1), (3, 5), (7, 7), (2, 9)]),
    layout=st.sampled_from(["nhwc", "nchw"]),
    bias=st.booleans(),
    residual=st.booleans(),
    act=st.integers(0, len(ACTIVATIONS) - 1),
    seed=st.integers(0, 1000),
)
def test_gemm_path_matches_reference(n, c, k, hw, layout, bias, residual, act, seed):
    h, w = hw
    name, attrs = ACTIVATIONS[act]
    g, node = conv_graph(
        (n, c, h, w), (k, c, 1, 1), layout, bias=bias, activation=name,
        activation_attrs=attrs, residual=residual, seed=seed,
    )  # fmt: skip
    fn = vendor_kernel(g, node, torch.device("cpu"))
    gemm = n * h * w <= GEMM_1X1_MAX_ROWS and (h * w == 1 or layout == "nhwc")
    assert (fn.__name__ == "conv1x1_gemm") == gemm
    torch.manual_seed(seed)
    fmt = CL if layout == "nhwc" else torch.contiguous_format
    args = [torch.randn(n, c, h, w).contiguous(memory_format=fmt), torch.from_numpy(g.params["w"])]
    if bias:
        args.append(torch.from_numpy(g.params["b"]))
    if residual:
        args.append(torch.randn(n, k, h, w).contiguous(memory_format=fmt))
    ref = get_op("conv2d").bind(node)(*args)
    assume(float(ref.abs().max()) > 1e-3)  # one channel, one pixel: values may all be tiny
    before = [a.clone() for a in args]
    y = fn(*args)
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b), "the kernel wrote into its input"
    _close(y, ref)
    assert y.is_contiguous(memory_format=fmt)
    if residual:  # the planner's form: accumulate into the residual
        r = args[-1].clone()
        y2 = fn.into_residual(*args[:-1], r)
        _close(y2, ref)
        if name != "gelu":  # gelu has no in-place form: a new tensor
            assert y2.data_ptr() == r.data_ptr()


def test_into_residual_of_another_memory_order_is_copied_in():
    g, node = conv_graph((1, 6, 3, 4), (5, 6, 1, 1), "nhwc", residual=True, activation="relu")
    fn = vendor_kernel(g, node, torch.device("cpu"))
    torch.manual_seed(0)
    x = torch.randn(1, 6, 3, 4).contiguous(memory_format=CL)
    r = torch.randn(1, 5, 3, 4)  # NCHW, not the declared layout
    args = [x, torch.from_numpy(g.params["w"]), torch.from_numpy(g.params["b"])]
    ref = get_op("conv2d").bind(node)(*args, r)
    _close(fn.into_residual(*args, r), ref)
    _close(r, ref)


class SqueezeExcite(torch.nn.Module):
    """A mobilenet_v3 block: expand, depthwise, SE (pool, two 1x1 convs), project."""

    def __init__(self, c: int = 13, e: int = 29, s: int = 7) -> None:
        super().__init__()
        self.expand = torch.nn.Sequential(
            torch.nn.Conv2d(c, e, 1), torch.nn.BatchNorm2d(e), torch.nn.Hardswish()
        )
        self.dw = torch.nn.Sequential(
            torch.nn.Conv2d(e, e, 3, padding=1, groups=e), torch.nn.BatchNorm2d(e), torch.nn.ReLU()
        )
        self.fc1, self.fc2 = torch.nn.Conv2d(e, s, 1), torch.nn.Conv2d(s, e, 1)
        self.project = torch.nn.Conv2d(e, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(self.expand(x))
        gate = torch.nn.functional.adaptive_avg_pool2d(y, 1)
        gate = torch.nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(gate))))
        return self.project(y * gate) + x


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("channels_last", [False, True])
def test_se_block_through_optimize(batch, channels_last, tmp_path):
    torch.manual_seed(0)
    model = SqueezeExcite().eval()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    x = torch.randn(batch, 13, 9, 11)
    if channels_last:
        x = x.contiguous(memory_format=CL)
    # the GEMM form is what runs the small 1x1 layers where oneDNN is called through
    # torch.ops.mkldnn (as oneDNN primitives created once, the primitive is faster)
    opt = middleware.optimize(
        model, example_inputs=(x,), cache_dir=tmp_path, onednn_primitives=False
    )
    with torch.no_grad():
        ref = model(x)
        y = opt(x)
    _close(y, ref, 1e-4)
    names = [getattr(s.fn, "__name__", "") for s in opt.plan.steps]
    assert "conv1x1_gemm" in names, names
