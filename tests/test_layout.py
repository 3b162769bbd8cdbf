"""The layout pass (passes/layout.py) and the ``to_layout`` op.

Three kinds of checks: the graph before and after the pass evaluate to the same outputs
(exactly: the reference ops compute the same sums in either memory order up to float
rounding, so rtol/atol 1e-5 relative to scale); every value's tensor is stored in its
declared layout (``layout_mismatches``); and the structure (where conversions go).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn as nn
import torchvision.models as tvm

import middleware
from middleware.graph import Graph, Node, TensorType
from middleware.hardware import Hardware
from middleware.ops import CATALOGUE, get_op, infer_types
from middleware.passes.layout import (
    LAYOUT_RULES,
    assign_layout,
    layout_mismatches,
    network_layout,
)

CL = torch.channels_last


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    scale = max(1e-12, float(b.abs().max()))
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * scale)


def _ops(g: Graph) -> list[str]:
    return [n.op for n in g.nodes()]


def _add(g: Graph, name: str, op: str, ins, **attrs) -> str:
    node = Node(name, op, tuple(ins), (name + "_out",), attrs)
    g.add_node(node, infer_types(g.values, node))
    return name + "_out"


def _small_net() -> Graph:
    """conv -> relu -> maxpool -> (reshape to 5-d and back) -> conv (+ residual) -> flatten."""
    rng = np.random.default_rng(0)
    g = Graph()
    g.add_input("x", TensorType((2, 3, 12, 12)))
    g.add_param("w1", (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32))
    g.add_param("w2", (rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32))
    g.add_param("b2", rng.standard_normal(8).astype(np.float32))
    c = _add(g, "c1", "conv2d", ["x", "w1"], stride=1, padding=1, dilation=1, groups=1)
    r = _add(g, "r1", "relu", [c])
    p = _add(g, "p1", "max_pool2d", [r], kernel_size=2, stride=2, padding=0, dilation=1,
             ceil_mode=False)  # fmt: skip
    v = _add(g, "v1", "reshape", [p], shape=(2, 2, 4, 6, 6))
    t = _add(g, "t1", "permute", [v], dims=(0, 1, 2, 4, 3))  # not a channel shuffle
    u = _add(g, "u1", "reshape", [t], shape=(2, 8, 6, 6))
    c2 = _add(g, "c2", "conv2d", [u, "w2", "b2", p], stride=1, padding=1, dilation=1, groups=1,
              activation="relu", activation_attrs=(), residual=True)  # fmt: skip
    f = _add(g, "f1", "flatten", [c2], start_dim=1, end_dim=-1)
    g.set_outputs((f, c2))
    return g


def test_network_layout_rule_is_data():
    assert network_layout("cpu") == LAYOUT_RULES["cpu"] == "nhwc"
    assert network_layout("cpu", "nchw") == "nchw"
    assert network_layout("cuda", "nhwc") == "nhwc"
    with pytest.raises(ValueError, match="layout option"):
        network_layout("cpu", "NHWC")


@pytest.mark.parametrize("mode", ["nhwc", "nchw"])
def test_small_net_same_outputs_and_contract(mode):
    g = _small_net()
    h = assign_layout(g, layout=mode)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    for a, b in zip(h.evaluate(x), g.evaluate(x), strict=True):
        _close(a, b)
    assert layout_mismatches(h, x) == []
    # either memory format from the user gives the same result
    for a, b in zip(h.evaluate(x.contiguous(memory_format=CL)), g.evaluate(x), strict=True):
        _close(a, b)


def test_input_within_l2_is_converted_before_the_conv():
    """With a CPU's description, an input that fits its cores' L2 caches is converted to
    channels_last first (the copy is still cached when the convolution reads it); a larger
    one is read as NCHW by the convolution (no copy of the input)."""
    from middleware.passes import DEFAULT_HARDWARE

    g = _small_net()  # the input: 2x3x12x12 floats, 3456 bytes
    small = assign_layout(g, DEFAULT_HARDWARE, layout="nhwc")
    first = next(iter(small.nodes()))
    assert first.op == "to_layout" and first.inputs[0] == "x"
    assert "output_layout" not in small.node("c1").attrs
    tiny_l2 = dataclasses.replace(DEFAULT_HARDWARE, l2_bytes=1024)
    large = assign_layout(g, tiny_l2, layout="nhwc")
    assert large.node("c1").inputs[0] == "x"
    assert large.node("c1").attrs["output_layout"] == "nhwc"
    torch.manual_seed(0)
    x = torch.randn(2, 3, 12, 12)
    for h in (small, large):
        for a, b in zip(h.evaluate(x), g.evaluate(x), strict=True):
            _close(a, b)


def test_small_net_structure_nhwc():
    h = assign_layout(_small_net(), layout="nhwc")
    vals = h.values
    # the input, read only by the first conv, is not converted: the conv reads it as NCHW
    # and writes channels_last (output_layout); the convs, relu, pool run in nhwc
    first = next(iter(h.nodes()))
    assert first.op == "conv2d" and first.inputs[0] == "x"
    assert first.attrs["output_layout"] == "nhwc" and vals["x"].layout == "nchw"
    for name in ("c1_out", "r1_out", "p1_out", "c2_out"):
        assert vals[name].layout == "nhwc", name
    # the reshape reads an nchw copy of the pool output; the 4-d reshape result is nchw
    reshape = h.node("v1")
    assert vals[reshape.inputs[0]].layout == "nchw"
    assert h.producer(reshape.inputs[0]).op == "to_layout"
    assert vals["u1_out"].layout == "nchw"
    # the conv reads it converted back to nhwc; its residual (the pool output) is unconverted
    conv2 = h.node("c2")
    assert vals[conv2.inputs[0]].layout == "nhwc" and conv2.inputs[3] == "p1_out"
    assert conv2.inputs[1] == "w2" and vals["w2"].layout == "nchw"  # params stay as they are
    # the 4-d graph output comes back nchw; the nchw copy of c2 is shared by flatten
    out_flat, out_4d = h.output_tree
    assert vals[out_4d].layout == "nchw" and h.producer(out_4d).op == "to_layout"
    assert h.node("f1").inputs == (out_4d,)
    # one conversion per value and layout
    conv_ins = [n.inputs[0] for n in h.nodes() if n.op == "to_layout"]
    assert len(conv_ins) == len(set(conv_ins)) == 3


def _shuffle_net(contiguous: bool) -> Graph:
    """relu -> channel shuffle (groups 3) -> sigmoid, as torchvision's ShuffleNet writes it."""
    g = Graph()
    g.add_input("x", TensorType((2, 12, 5, 7)))
    r = _add(g, "r", "relu", ["x"])
    v = _add(g, "v", "reshape", [r], shape=(2, 3, 4, 5, 7))
    t = _add(g, "t", "permute", [v], dims=(0, 2, 1, 3, 4))
    if contiguous:
        t = _add(g, "c", "contiguous", [t])
    u = _add(g, "u", "reshape", [t], shape=(2, 12, 5, 7))
    s = _add(g, "s", "sigmoid", [u])
    g.set_outputs(s)
    return g


@pytest.mark.parametrize("contiguous", [True, False])
def test_channel_shuffle_runs_in_nhwc_without_conversions(contiguous):
    g = _shuffle_net(contiguous)
    h = assign_layout(g, layout="nhwc")  # alone, a shuffle keeps its input order ("auto")
    conversions = [n for n in h.nodes() if n.op == "to_layout"]
    assert [h.values[n.outputs[0]].layout for n in conversions] == ["nhwc", "nchw"]
    assert h.values["u_out"].layout == "nhwc" and h.values["s_out"].layout == "nhwc"
    # one channel_shuffle node (a gather over channels with loop semantics), no rank-5 views
    assert _ops(h).count("channel_shuffle") == 1
    assert not {"reshape", "permute", "contiguous"} & set(_ops(h))
    torch.manual_seed(0)
    x = torch.randn(2, 12, 5, 7)
    assert layout_mismatches(h, x) == []
    torch.testing.assert_close(h.evaluate(x), g.evaluate(x), rtol=0, atol=0)


def test_nchw_mode_leaves_an_nchw_graph_alone():
    g = _small_net()
    h = assign_layout(g, layout="nchw")
    assert _ops(h) == _ops(g)
    assert all(t.layout == "nchw" for t in h.values.values())


def test_pass_is_idempotent_and_leaves_input_untouched():
    g = _small_net()
    before = g.text()
    h = assign_layout(g)
    assert g.text() == before
    assert assign_layout(h).text() == h.text()


def test_cuda_auto_follows_tf32(monkeypatch):
    hw = Hardware("cuda", "gpu", 100, 128, 0, 0, 0, 1.0, 1.0)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    h = assign_layout(_small_net(), hw)
    assert all(t.layout == "nchw" for t in h.values.values())
    assert network_layout("cuda", tf32=True) == "nhwc"


def test_flatten_after_global_pool_needs_no_conversion():
    g = Graph()
    g.add_input("x", TensorType((3, 5, 4, 4)))
    p = _add(g, "gap", "adaptive_avg_pool2d", ["x"], output_size=(1, 1))
    f = _add(g, "fl", "flatten", [p], start_dim=1, end_dim=-1)
    g.set_outputs(f)
    h = assign_layout(g)
    assert _ops(h) == ["to_layout", "adaptive_avg_pool2d", "flatten"]
    x = torch.randn(3, 5, 4, 4)
    _close(h.evaluate(x), g.evaluate(x))
    assert h.evaluate(x).is_contiguous()


def test_cat_of_a_one_channel_branch_keeps_channels_last():
    """torch.cat writes a contiguous result when one input has C == 1 with nchw strides."""
    g = Graph()
    g.add_input("a", TensorType((2, 1, 5, 7)))
    g.add_input("b", TensorType((2, 6, 5, 7)))
    r = _add(g, "ra", "relu", ["b"])
    c = _add(g, "cat", "cat", ["a", r], dim=1)
    s = _add(g, "s", "sigmoid", [c])
    g.set_outputs(s)
    h = assign_layout(g)
    a, b = torch.randn(2, 1, 5, 7), torch.randn(2, 6, 5, 7)
    assert layout_mismatches(h, a, b) == []
    _close(h.evaluate(a, b), g.evaluate(a, b))


# the ops the registry calls layout-preserving whatever their attrs
LAYOUT_PRESERVING = frozenset(
    name
    for name, op in CATALOGUE.items()
    if op.layout_preserving and op.layout_preserving_if is None
)


# (conv2d and conv2d_dw: tests/test_fuse_depthwise.py runs conv2d_dw on both layouts)
@pytest.mark.parametrize("op", sorted(LAYOUT_PRESERVING - {"conv2d", "conv2d_dw", "split", "cat"}))
def test_layout_preserving_table(op):
    """Each op the registry calls layout-preserving keeps channels_last in its reference."""
    attrs = {
        "batch_norm": dict(eps=1e-5),
        "hardtanh": dict(min_val=-0.5, max_val=0.5),
        "leaky_relu": dict(negative_slope=0.2),
        "gelu": dict(approximate="none"),
        "max_pool2d": dict(kernel_size=3, stride=2, padding=1, dilation=1, ceil_mode=True),
        "maxpool_relu": dict(
            kernel_size=3,
            stride=2,
            padding=1,
            dilation=1,
            ceil_mode=False,
            activation="relu",
            activation_attrs=(),
        ),  # fmt: skip
        "avg_pool2d": dict(
            kernel_size=3,
            stride=2,
            padding=1,
            ceil_mode=True,
            count_include_pad=False,
            divisor_override=None,
        ),  # fmt: skip
        "adaptive_avg_pool2d": dict(output_size=(3, 2)),
        "adaptive_max_pool2d": dict(output_size=(3, 2)),
        "channel_shuffle": dict(groups=3),
    }.get(op, {})
    attrs = {**get_op(op).defaults, **attrs}  # an op added with defaults needs no line here
    torch.manual_seed(0)
    x = torch.randn(2, 6, 7, 9).contiguous(memory_format=CL)
    ins = [x]
    if op == "batch_norm":
        ins += [torch.randn(6), torch.rand(6) + 0.5, torch.randn(6), torch.randn(6)]
    if op in ("add", "sub", "mul", "div"):
        ins.append(torch.rand(2, 6, 1, 1) + 0.5)  # a per-channel scale, as in SE blocks
    y = get_op(op).bind(Node("n", op, ("x",) * len(ins), ("y",), attrs))(*ins)
    assert y.is_contiguous(memory_format=CL)
    if op in ("add", "sub", "mul", "div"):  # the broadcast operand first, too
        y = get_op(op).bind(Node("n", op, ("x", "x"), ("y",), attrs))(ins[1], x)
        assert y.is_contiguous(memory_format=CL)


# ---------------------------------------------------------------- whole networks
NETS = {
    "alexnet": (tvm.alexnet, 64),
    "vgg16": (tvm.vgg16, 32),
    "resnet18": (tvm.resnet18, 64),
    "resnet50": (tvm.resnet50, 64),
    "densenet121": (tvm.densenet121, 64),
    "squeezenet1_1": (tvm.squeezenet1_1, 64),
    "mobilenet_v2": (tvm.mobilenet_v2, 64),
    "mobilenet_v3_small": (tvm.mobilenet_v3_small, 64),
    "googlenet": (lambda: tvm.googlenet(aux_logits=False, init_weights=True), 64),
    "inception_v3": (lambda: tvm.inception_v3(aux_logits=False, init_weights=True), 80),
    "shufflenet_v2_x1_0": (tvm.shufflenet_v2_x1_0, 64),
}


def _net(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    make, size = NETS[name]
    model = make().eval()
    for m in model.modules():  # non-trivial batch-norm statistics
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    return model, torch.randn(2, 3, size, size)


@pytest.mark.parametrize("name", sorted(NETS))
def test_network_contract_after_layout(name):
    """The passed graph of every network computes the same outputs in the reference
    interpreter and every value is stored in its declared layout."""
    model, x = _net(name)
    g = middleware.trace(model, x)
    h = assign_layout(g)
    assert layout_mismatches(h, x) == []
    _close(h.evaluate(x), g.evaluate(x), 1e-4)
    # nothing is converted: every network reads its input with convolutions only (which
    # read NCHW and write channels_last) and ends in a 2-d output; alexnet and vgg16 flatten
    # a 6x6 / 7x7 map in nchw order, which needs one conversion there
    conversions = sum(n.op == "to_layout" for n in h.nodes())
    assert conversions == (1 if name in ("alexnet", "vgg16") else 0)


@pytest.mark.parametrize(
    "name",
    [
        "resnet18",
        "mobilenet_v3_small",
        "squeezenet1_1",
        "shufflenet_v2_x1_0",
        # the default run's slowest network case (16 s); googlenet end to end stays in the
        # default run through test_networks (batch 1)
        pytest.param("googlenet", marks=pytest.mark.slow),
    ],
)
def test_network_end_to_end_vendor_nhwc(name, tmp_path):
    """optimize(): the layout pass plus the prepacked oneDNN calls against eager PyTorch."""
    model, x = _net(name)
    opt = middleware.optimize(model, cache_dir=tmp_path, example_inputs=(x,),
                              measure_hardware=False)  # fmt: skip
    with torch.no_grad():
        ref = model(x)
    y = opt(x)
    _close(y, ref, 1e-4)
    assert y.is_contiguous()
    assert opt.graph.meta.get("layout") == "nhwc"
    assert not opt.report().fallbacks


def test_auto_keeps_the_input_order_without_image_ops():
    """A graph of 4-d values but no convolution, pooling or batch norm (attention over
    batch x heads x tokens x dims) gets no conversions under "auto"; one convolution and the
    network layout applies."""
    import torch.nn as nn
    import torch.nn.functional as F

    import middleware

    class Attn(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v) * 2.0

    q = torch.randn(1, 2, 9, 16)
    g = assign_layout(middleware.trace(Attn().eval(), (q, q, q)))
    assert "to_layout" not in _ops(g) and all(t.layout == "nchw" for t in g.values.values())
    h = assign_layout(_small_net())
    assert "to_layout" in _ops(h)


class TokenMapBlock(nn.Module):
    """ConvNeXt's block: depthwise conv, permute to (N, H, W, C), LayerNorm, two linear
    layers with GELU, a layer scale, permute back, residual add."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.scale = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(y)))) * self.scale
        return torch.relu(x + y.permute(0, 3, 1, 2))


def test_a_token_map_between_permutes_stays_row_major_without_conversions():
    """A channels_last map permuted to (N, H, W, C) is its row-major storage: the permute
    is a free view declared "nchw", what reads it (the norm, elementwise ops) keeps that
    order, and the permute back is channels_last again. No conversion anywhere; before,
    the map was converted to NCHW ahead of the permute and the permuted result back to
    channels_last after it (two copies per block)."""
    torch.manual_seed(0)
    model = TokenMapBlock().eval()
    # channels_last in, channels_last out: no conversion at the graph's boundary either
    x = torch.randn(2, 8, 9, 11).contiguous(memory_format=torch.channels_last)
    g = middleware.trace(model, x)
    h = assign_layout(g, layout="nhwc")
    assert [n for n in h.nodes() if n.op == "to_layout"] == []
    first, back = (n for n in h.nodes() if n.op == "permute")
    assert h.values[first.outputs[0]].layout == "nchw"
    assert h.values[back.outputs[0]].layout == "nhwc"
    assert layout_mismatches(h, x) == []
    _close(h.evaluate(x), g.evaluate(x), 1e-5)
    opt = middleware.optimize(model, example_inputs=(x,))
    with torch.no_grad():
        _close(opt(x), model(x), 1e-4)
