"""Registry entries of the layers with weights: conv2d, linear, matmul, einsum (compute- or
param-bound; run by the vendor calls, a depthwise conv2d also generated)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import loops
from .enums import Bound
from .graph import Node, TensorType
from .op_registry import Kernel, OpDef, activation_fn, register, with_post_op


def conv_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    w = ins[1].shape  # (Cout, Cin/groups, kh, kw)
    return 2.0 * outs[0].numel * w[1] * w[2] * w[3]


def linear_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    return 2.0 * outs[0].numel * ins[1].shape[1]


def post_op_fn(node: Node) -> Callable[[Any], Any] | None:
    """The fused activation of a vendor call (``activation``/``activation_attrs`` attrs)."""
    name = node.attrs.get("activation")
    if not name:
        return None
    return activation_fn(name, dict(node.attrs.get("activation_attrs", ())))


def _conv2d(node: Node) -> Kernel:
    """Convolution, optionally with fused post-ops (the fuse_vendor_epilogue pass):
    ``residual=True`` adds the last input after the bias, then ``activation`` applies:
    ``y = act(conv(x, w) + b + residual)``, the order of oneDNN's sum and eltwise post-ops."""
    stride, padding, dilation, groups = (
        node.attrs["stride"],
        node.attrs["padding"],
        node.attrs["dilation"],
        node.attrs["groups"],
    )
    residual = bool(node.attrs.get("residual", False))
    has_bias = len(node.inputs) - int(residual) == 3
    act = post_op_fn(node)
    # ``output_layout="nhwc"``: the result is stored channels_last whatever the input's
    # layout (the layout pass lets a network's first convolution read an NCHW input
    # directly, as oneDNN does with a prepacked weight, instead of converting the input)
    out_cl = node.attrs.get("output_layout") == "nhwc"

    def conv2d(x, w, *rest):
        b = rest[0] if has_bias else None
        y = torch.conv2d(x, w, b, stride, padding, dilation, groups)
        if residual:
            y = y + rest[-1]
        y = act(y) if act is not None else y
        return y.contiguous(memory_format=torch.channels_last) if out_cl else y

    return conv2d


# generated only when depthwise (a sum window), with its fused activation
register(
    OpDef(
        "conv2d",
        Bound.COMPUTE,
        _conv2d,
        flops_fn=conv_flops,
        loops=with_post_op(loops.depthwise_conv2d_loops),
        per_sample=True,
        layout_preserving=True,
        weight_inputs=frozenset({1}),
        image_op=True,
    )
)


def _conv2d_dw(node: Node) -> Kernel:
    """A convolution and the depthwise 3x3 convolution (padding 1, ``stride``) that reads
    it, as one layer: ``y = act2(dw(act1(conv(x, w1) + b1), wdw) + bdw)``, each activation
    optional (``activation`` / ``dw_activation``). The first is a 1x1 convolution (the
    fuse_depthwise pass) or, with ``stride1`` and ``padding1``, a dense convolution of any
    kernel size (the fuse_stem pass: a network's stem)."""
    stride = int(node.attrs["stride"])
    stride1, padding1 = node.attrs.get("stride1", 1), node.attrs.get("padding1", 0)
    act1 = post_op_fn(node)
    name2 = node.attrs.get("dw_activation")
    act2 = activation_fn(name2, dict(node.attrs.get("dw_activation_attrs", ()))) if name2 else None

    # ``output_layout="nhwc"``: a stem that read an NCHW image (as conv2d's)
    out_cl = node.attrs.get("output_layout") == "nhwc"

    def conv2d_dw(x, w1, b1, wdw, bdw):
        y = torch.conv2d(x, w1, b1, stride1, padding1)
        y = act1(y) if act1 is not None else y
        y = torch.conv2d(y, wdw, bdw, stride, 1, 1, wdw.shape[0])
        y = act2(y) if act2 is not None else y
        return y.contiguous(memory_format=torch.channels_last) if out_cl else y

    return conv2d_dw


def conv2d_dw_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    n, c, h, w = ins[0].shape
    k, _, kh, kw = ins[1].shape
    s1, p1 = node.attrs.get("stride1", 1), node.attrs.get("padding1", 0)
    (sh, sw), (ph, pw) = loops.pair(s1), loops.pair(p1)
    mid = ((h + 2 * ph - kh) // sh + 1) * ((w + 2 * pw - kw) // sw + 1)
    return 2.0 * n * mid * k * c * kh * kw + 2.0 * outs[0].numel * 9


register(
    OpDef(
        "conv2d_dw",
        Bound.COMPUTE,
        _conv2d_dw,
        flops_fn=conv2d_dw_flops,
        per_sample=True,
        layout_preserving=True,
        weight_inputs=frozenset({1, 3}),
        image_op=True,
    )
)


def _linear(node: Node) -> Kernel:
    """Fully connected layer, optionally with a fused ``activation`` (see ``_conv2d``)."""
    act = post_op_fn(node)

    def linear(x, w, b=None):
        y = F.linear(x, w, b)
        return act(y) if act is not None else y

    return linear


register(OpDef("linear", Bound.PARAM, _linear, flops_fn=linear_flops, weight_inputs=frozenset({1})))


def _matmul(node: Node) -> Kernel:
    return torch.matmul


def matmul_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    return 2.0 * outs[0].numel * ins[0].shape[-1]


register(OpDef("matmul", Bound.COMPUTE, _matmul, flops_fn=matmul_flops))


def _einsum(node: Node) -> Kernel:
    equation = node.attrs["equation"]

    def einsum(*xs):
        return torch.einsum(equation, *xs)

    return einsum


def einsum_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    """Two FLOPs per term of the sum: every index of the equation iterated once."""
    sizes: dict[str, int] = {}
    lhs = node.attrs["equation"].replace(" ", "").split("->")[0]
    for letters, t in zip(lhs.split(","), ins, strict=False):
        if "..." in letters:
            return 2.0 * outs[0].numel
        for ch, n in zip(letters, t.shape, strict=False):
            sizes[ch] = n
    total = 1
    for n in sizes.values():
        total *= n
    return 2.0 * total


# torch.einsum (MaxViT's attention: batched matrix products); ATen lowers it to bmm
register(OpDef("einsum", Bound.COMPUTE, _einsum, flops_fn=einsum_flops))
