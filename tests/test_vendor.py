"""The vendor calls (backends/vendor/calls.py) against the catalogue reference.

Every case builds a one-node graph, asks ``vendor_kernel`` for a callable and compares it
with ``get_op(op).bind(node)`` on seeded random inputs, in both layouts. Tolerance: the
vendor calls use other (blocked, reordered) summation orders than ATen, so outputs agree
to float32 rounding of a dot product: atol = rtol = 1e-4 relative to the output scale.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from fusion_helpers import CONV_ACTIVATIONS as ACTIVATIONS
from fusion_helpers import close_to_scale as _close
from fusion_helpers import conv_graph

from middleware.backends.vendor.calls import (
    LINEAR_RULES,
    inplace_activation,
    linear_impl,
    onednn_post_op,
    vendor_kernel,
)
from middleware.graph import Graph, Node, TensorType
from middleware.ops import get_op, infer_types

CL = torch.channels_last


def _run_conv_case(g: Graph, node: Node, layout: str, device: str = "cpu", seed: int = 1):
    torch.manual_seed(seed)
    x = torch.randn(g.values["x"].shape)
    args = [x, torch.from_numpy(g.params["w"])]
    if "b" in g.params:
        args.append(torch.from_numpy(g.params["b"]))
    if "r" in g.values:
        args.append(torch.randn(g.values["r"].shape))
    if layout == "nhwc":
        args = [a.contiguous(memory_format=CL) if a.dim() == 4 and i != 1 else a
                for i, a in enumerate(args)]  # fmt: skip
    args = [a.to(device) for a in args]
    ref = get_op("conv2d").bind(node)(*args)
    fn = vendor_kernel(g, node, torch.device(device))
    assert fn is not None
    before = [a.clone() for a in args]
    y = fn(*args)
    for a, b in zip(args, before, strict=True):
        assert torch.equal(a, b), "a vendor kernel wrote into its input"
    _close(y, ref)
    want = CL if layout == "nhwc" else torch.contiguous_format
    assert y.is_contiguous(memory_format=want), f"output not in declared layout {layout}"
    return y


# (x shape, w shape, stride, padding, dilation, groups)
CONV_SHAPES = [
    ((2, 8, 9, 9), (16, 8, 3, 3), 1, 1, 1, 1),
    ((1, 3, 17, 13), (5, 3, 7, 7), 2, 3, 1, 1),
    ((2, 16, 8, 8), (32, 16, 1, 1), 1, 0, 1, 1),
    ((3, 12, 10, 10), (12, 1, 3, 3), 1, 1, 1, 12),  # depthwise
    ((2, 12, 11, 11), (12, 1, 5, 5), 2, 2, 1, 12),  # depthwise, stride 2
    ((2, 12, 9, 9), (18, 4, 3, 3), 1, 1, 1, 3),  # grouped
    ((1, 8, 12, 12), (8, 8, 3, 3), 1, 2, 2, 1),  # dilated
    ((2, 7, 6, 5), (9, 7, 1, 3), (1, 2), (0, 1), 1, 1),  # rectangular
    ((2, 5, 2, 2), (6, 5, 2, 2), 1, 0, 1, 1),  # 2x2 spatial, window = input
    ((2, 16, 1, 1), (10, 16, 1, 1), 1, 0, 1, 1),  # 1x1 spatial (a classifier conv)
]


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", range(len(CONV_SHAPES)))
@pytest.mark.parametrize("bias", [True, False])
def test_conv_shapes(layout, case, bias):
    xs, ws, s, p, d, grp = CONV_SHAPES[case]
    g, node = conv_graph(xs, ws, layout, stride=s, padding=p, dilation=d, groups=grp, bias=bias)
    _run_conv_case(g, node, layout)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("act", range(len(ACTIVATIONS)))
@pytest.mark.parametrize("residual", [False, True])
def test_conv_post_ops(layout, act, residual):
    name, attrs = ACTIVATIONS[act]
    g, node = conv_graph(
        (2, 8, 7, 7), (12, 8, 3, 3), layout, padding=1, activation=name,
        activation_attrs=attrs, residual=residual,
    )  # fmt: skip
    _run_conv_case(g, node, layout)


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_conv_depthwise_residual_relu6(layout):
    g, node = conv_graph(
        (2, 24, 14, 14), (24, 1, 3, 3), layout, padding=1, groups=24, activation="hardtanh",
        activation_attrs=(("min_val", 0.0), ("max_val", 6.0)), residual=True, bias=False,
    )  # fmt: skip
    _run_conv_case(g, node, layout)


def test_weight_packed_once_not_per_call():
    """The callable carries a oneDNN (opaque, blocked) weight made at build time."""
    g, node = conv_graph((2, 8, 9, 9), (16, 8, 3, 3), "nhwc", padding=1)
    fn = vendor_kernel(g, node, torch.device("cpu"))
    cells = [c.cell_contents for c in fn.__closure__ if isinstance(c.cell_contents, torch.Tensor)]
    assert any(t.layout == torch._mkldnn for t in cells)


def test_no_vendor_kernel_for_float64_and_other_ops():
    g, node = conv_graph((1, 2, 5, 5), (3, 2, 3, 3), "nchw")
    g.values["x"] = TensorType((1, 2, 5, 5), "float64")
    assert vendor_kernel(g, node, torch.device("cpu")) is None
    relu = Node("r", "relu", ("y",), ("z",))
    assert vendor_kernel(g, relu, torch.device("cpu")) is None


def test_every_catalogue_activation_has_a_onednn_post_op():
    for name in ("relu", "hardtanh", "leaky_relu", "silu", "hardswish", "sigmoid", "tanh", "gelu"):
        assert get_op(name).post_op is not None
    assert onednn_post_op("hardtanh", {"min_val": 0.0, "max_val": 6.0}).scalars == (0.0, 6.0)
    assert onednn_post_op("silu", {}).attr == "swish"
    assert onednn_post_op("gelu", {"approximate": "tanh"}).algorithm == "tanh"
    assert onednn_post_op("softmax", {}) is None


@pytest.mark.parametrize("act", range(1, len(ACTIVATIONS)))
def test_inplace_activations_match_reference(act):
    name, attrs = ACTIVATIONS[act]
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, 4) * 4
    ref = get_op(name).bind(Node("a", name, ("x",), ("y",), dict(attrs)))(x)
    y = inplace_activation(name, dict(attrs))(x.clone())
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def _linear_graph(x_shape, in_f, out_f, bias=True, activation=None, activation_attrs=()):
    rng = np.random.default_rng(3)
    g = Graph()
    g.add_input("x", TensorType(tuple(x_shape)))
    g.add_param("w", (rng.standard_normal((out_f, in_f)) * 0.1).astype(np.float32))
    ins = ["x", "w"]
    if bias:
        g.add_param("b", rng.standard_normal(out_f).astype(np.float32))
        ins.append("b")
    attrs = {}
    if activation:
        attrs = dict(activation=activation, activation_attrs=tuple(activation_attrs))
    node = Node("l", "linear", tuple(ins), ("y",), attrs)
    g.add_node(node, infer_types(g.values, node))
    g.set_outputs("y")
    return g, node


@pytest.mark.parametrize("rows", [1, 2, 16])
@pytest.mark.parametrize("act", [0, 1, 2, 4, 6, 10])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(rows, act, bias):
    name, attrs = ACTIVATIONS[act]
    g, node = _linear_graph((rows, 37), 37, 23, bias, name, attrs)
    torch.manual_seed(0)
    args = [torch.randn(rows, 37), torch.from_numpy(g.params["w"])]
    if bias:
        args.append(torch.from_numpy(g.params["b"]))
    ref = get_op("linear").bind(node)(*args)
    y = vendor_kernel(g, node, torch.device("cpu"))(*args)
    _close(y, ref)


def test_linear_three_d_input():
    g, node = _linear_graph((2, 3, 19), 19, 7, True, "relu")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 19)
    w, b = torch.from_numpy(g.params["w"]), torch.from_numpy(g.params["b"])
    _close(vendor_kernel(g, node, torch.device("cpu"))(x, w, b), torch.relu(x @ w.T + b))


def test_linear_rule_is_data():
    assert linear_impl(16) == "onednn"  # the plain weight: no packed copy
    assert linear_impl(4) == "onednn_packed"
    assert linear_impl(1) == [impl for rows, impl in LINEAR_RULES if rows <= 1][0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("act, residual", list(itertools.product([0, 1, 2, 5, 10], [False, True])))
def test_cuda_conv(act, residual):
    name, attrs = ACTIVATIONS[act]
    g, node = conv_graph(
        (2, 8, 9, 9), (16, 8, 3, 3), "nchw", padding=1, activation=name,
        activation_attrs=attrs, residual=residual,
    )  # fmt: skip
    torch.backends.cudnn.allow_tf32 = False
    _run_conv_case(g, node, "nchw", device="cuda")


def test_compiler_runs_conv_and_linear_through_vendor_kernels(tmp_path):
    """optimize() hands conv2d/linear nodes the prepacked vendor callables (hook in
    backends/cpu/units.py ``cpu_units``) and still matches eager PyTorch."""
    import middleware

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2, groups=8),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 5),
    ).eval()
    x = torch.randn(4, 3, 16, 16)
    opt = middleware.optimize(model, cache_dir=tmp_path, measure_hardware=False)
    _close(opt(x), model(x).detach())
    names = {st.fn.__name__ for st in opt.plan.steps}
    assert {"conv_onednn", "linear_onednn"} <= names  # a oneDNN primitive created once
    opt = middleware.optimize(
        model, cache_dir=tmp_path, measure_hardware=False, onednn_primitives=False
    )
    _close(opt(x), model(x).detach())
    names = {st.fn.__name__ for st in opt.plan.steps}
    assert {"conv_post", "linear_onednn"} <= names  # through torch.ops.mkldnn
