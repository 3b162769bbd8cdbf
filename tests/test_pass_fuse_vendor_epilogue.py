"""fuse_vendor_epilogue: bias, residual add and activation become post-ops of the layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from middleware import trace
from middleware.graph import Graph, Node
from middleware.ops import get_op
from middleware.passes import DEFAULT_HARDWARE
from middleware.passes.fuse_vendor_epilogue import POST_OPS, fuse_vendor_epilogue
from middleware.passes.verify import check_equivalent

CPU = DEFAULT_HARDWARE
CUDA = dataclasses.replace(DEFAULT_HARDWARE, kind="cuda")
TOL = 1e-6


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.nodes()]


class Block(nn.Module):
    """A resnet basic block with a downsample: conv-bn... here without bn (already folded)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.down = nn.Conv2d(4, 8, 1, stride=2)
        self.act = act

    def forward(self, x):
        y = self.act(self.c1(x))
        y = self.c2(y)
        return self.act(y + self.down(x))


def fused(g: Graph) -> list[Node]:
    return [n for n in g.nodes() if n.op in ("conv2d", "linear")]


def test_resnet_block_on_cpu():
    g = trace(Block(nn.ReLU()).eval(), (torch.randn(1, 4, 8, 8),))
    g2 = fuse_vendor_epilogue(g, CPU)
    assert ops(g2) == ["conv2d", "conv2d", "conv2d"], g2.text()
    c1, down, c2 = fused(g2)  # c2 now stands where the add/relu stood, after down
    assert c1.attrs["activation"] == "relu" and "residual" not in c1.attrs
    assert c2.attrs["residual"] is True and c2.attrs["activation"] == "relu"
    assert c2.inputs[-1] == down.outputs[0]  # the residual is the last input
    assert "activation" not in down.attrs
    check_equivalent(g, g2, tol=TOL)


def test_residual_then_other_activation_on_cpu():
    """oneDNN's binary add takes only relu after it: sigmoid stays a separate node."""
    g = trace(Block(nn.Sigmoid()).eval(), (torch.randn(1, 4, 8, 8),))
    g2 = fuse_vendor_epilogue(g, CPU)
    assert ops(g2) == ["conv2d", "conv2d", "conv2d", "sigmoid"], g2.text()
    c1, _, c2 = fused(g2)
    assert c1.attrs["activation"] == "sigmoid"
    assert c2.attrs["residual"] is True and "activation" not in c2.attrs
    check_equivalent(g, g2, tol=TOL)


@pytest.mark.parametrize("act", [nn.ReLU(), nn.Sigmoid(), nn.Hardswish()], ids=repr)
def test_cuda_fuses_any_activation_after_a_residual(act):
    """On CUDA the epilogue is a generated kernel: bias, residual and any activation."""
    g = trace(Block(act).eval(), (torch.randn(1, 4, 8, 8),))
    g2 = fuse_vendor_epilogue(g, CUDA)
    assert ops(g2) == ["conv2d", "conv2d", "conv2d"], g2.text()
    c1, _, c2 = fused(g2)
    assert c2.attrs["residual"] is True and c2.attrs["activation"] == ops(g)[1]
    check_equivalent(g, g2, tol=TOL)


ACTS = [
    nn.ReLU(),
    nn.ReLU6(),
    nn.Hardtanh(-2.0, 3.0),
    nn.LeakyReLU(0.2),
    nn.SiLU(),
    nn.Hardswish(),
    nn.Hardsigmoid(),
    nn.Sigmoid(),
    nn.Tanh(),
    nn.GELU(),
    nn.GELU("tanh"),
]


@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_conv_and_linear_take_every_onednn_activation(act):
    m = nn.Sequential(nn.Conv2d(3, 4, 3), act, nn.Flatten(), nn.Linear(4 * 4 * 4, 5), act).eval()
    g = trace(m, (torch.randn(2, 3, 6, 6),))
    g2 = fuse_vendor_epilogue(g, CPU)
    assert ops(g2) == ["conv2d", "flatten", "linear"], g2.text()
    conv, lin = fused(g2)
    assert conv.attrs["activation"] == lin.attrs["activation"] == ops(g)[1]
    check_equivalent(g, g2, tol=TOL)
    with torch.no_grad():
        x = torch.randn(2, 3, 6, 6)
        torch.testing.assert_close(g2.evaluate(x), m(x), rtol=1e-5, atol=1e-5)


class BiasAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.b = nn.Parameter(torch.randn(1, 4, 1, 1))

    def forward(self, x):
        return torch.relu(self.conv(x) + self.b)


def test_bias_add_becomes_the_conv_bias():
    g = trace(BiasAdd().eval(), (torch.randn(1, 3, 6, 6),))
    g2 = fuse_vendor_epilogue(g, CPU)
    (conv,) = list(g2.nodes())
    assert len(conv.inputs) == 3 and conv.attrs["activation"] == "relu"
    check_equivalent(g, g2, tol=TOL)


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        z = y + x.sum(1, keepdim=True)  # a broadcast add: not a residual
        return torch.relu(y), z


def test_intermediate_with_other_reader_or_broadcast_stays():
    g = trace(Shared().eval(), (torch.randn(1, 3, 6, 6),))
    g2 = fuse_vendor_epilogue(g, CPU)
    assert ops(g2) == ops(g)
    check_equivalent(g, g2, tol=0.0)


# -- the table is honest: what it lists for cpu, oneDNN (through PyTorch) computes ----------
ONEDNN_NAME = {"silu": "swish"}


def _onednn_args(node: Node) -> tuple[str, list[float], str]:
    act = node.attrs.get("activation")
    attrs = dict(node.attrs.get("activation_attrs", ()))
    if act == "leaky_relu":
        return act, [attrs["negative_slope"]], ""
    if act == "hardtanh":
        return act, [attrs["min_val"], attrs["max_val"]], ""
    if act == "gelu":
        return act, [], attrs["approximate"]
    return ONEDNN_NAME.get(act, act), [], ""


def _layer(act: nn.Module) -> Node:
    g = trace(nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), act).eval(), (torch.randn(1, 4, 5, 5),))
    return next(iter(fuse_vendor_epilogue(g, CPU).nodes()))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
@pytest.mark.parametrize("act", ACTS, ids=repr)
def test_cpu_table_matches_onednn(act):
    node = _layer(act)
    assert node.attrs["activation"] in POST_OPS[("cpu", "conv2d")].activations
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((1, 4, 5, 5), (6, 4, 3, 3), (6,)))
    r = torch.randn(1, 6, 5, 5, generator=gen)
    name, scalars, algo = _onednn_args(node)
    pw = torch.ops.mkldnn._convolution_pointwise
    y = pw(x, w, b, [1, 1], [1, 1], [1, 1], 1, name, scalars, algo)
    ref = get_op("conv2d").bind(node)(x, w, b)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    allowed = POST_OPS[("cpu", "conv2d")].after_residual
    try:
        y = pw.binary(x, r, w, b, [1, 1], [1, 1], [1, 1], 1, "add", 1.0, name, scalars, algo)
        supported = True
    except RuntimeError:
        supported = False
    assert supported == (node.attrs["activation"] in allowed)
    if supported:
        res = Node(
            node.name, "conv2d", node.inputs + ("r",), node.outputs, dict(node.attrs, residual=True)
        )
        torch.testing.assert_close(y, get_op("conv2d").bind(res)(x, w, b, r), rtol=1e-4, atol=1e-4)
    y = pw.binary(x, r, w, b, [1, 1], [1, 1], [1, 1], 1, "add", 1.0, None, [], None)
    torch.testing.assert_close(y, F.conv2d(x, w, b, 1, 1) + r, rtol=1e-4, atol=1e-4)
    assert None in allowed


class ResidualThenMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x, r):
        return (self.conv(x) + r) * 3.0, torch.relu(torch.add(self.conv(r), x, alpha=2.0))


def test_residual_before_a_non_activation_and_scaled_add():
    xs = (torch.randn(1, 4, 5, 5), torch.randn(1, 4, 5, 5))
    g = trace(ResidualThenMul().eval(), xs)
    g2 = fuse_vendor_epilogue(g, CPU)
    assert ops(g2) == ["conv2d", "mul", "conv2d", "add", "relu"], g2.text()
    first = fused(g2)[0]
    assert first.attrs["residual"] is True and "activation" not in first.attrs
    assert "residual" not in fused(g2)[1].attrs  # alpha=2: not a plain residual add
    check_equivalent(g, g2, tol=TOL)
    assert ops(fuse_vendor_epilogue(g, CUDA)) == ops(g2)  # the epilogue kernel: same rule
