"""Registry entries of the activations: elementwise ops of one input, each with its
reference, its scalar semantics (``pointwise``), its in-place ATen form and its spelling
as a vendor post-op."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .enums import Bound
from .graph import Graph, Node
from .loops import Const, Expr, call, clamp
from .op_registry import Kernel, OpDef, OutForm, OutVariant, VendorPostOp, register


# --------------------------------------------------------------------- activations
def _unary(fn: Callable[..., Any]) -> Callable[[Node], Kernel]:
    def make(node: Node) -> Kernel:
        return fn

    return make


def _relu_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("max", x, Const(0.0))


def _relu_(attrs: Mapping[str, Any]) -> Kernel:
    return torch.relu_


def _relu_out(node: Node, graph: Graph) -> OutForm:
    def relu_out(x, o):
        torch.clamp_min(x, 0, out=o)

    return relu_out, ()


def _unary_out(fn: Callable[..., Any]) -> OutVariant:
    """The out= form ``fn(x, out=o)`` of an activation without attrs."""

    def make(node: Node, graph: Graph) -> OutForm:
        def out_form(x, o):
            fn(x, out=o)

        return out_form, ()

    return OutVariant(make, (0,))


register(
    OpDef(
        "relu",
        Bound.IO,
        _unary(torch.relu),
        elementwise=True,
        monotone=True,
        pointwise=_relu_expr,
        inplace=_relu_,
        out=OutVariant(_relu_out, (0,)),
        post_op=VendorPostOp("relu", after_binary=True, cublaslt=True),
    )
)


def _hardtanh(node: Node) -> Kernel:
    lo, hi = float(node.attrs["min_val"]), float(node.attrs["max_val"])

    def hardtanh(x):
        return F.hardtanh(x, lo, hi)

    return hardtanh


def _hardtanh_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return clamp(x, float(attrs["min_val"]), float(attrs["max_val"]))


def _hardtanh_(attrs: Mapping[str, Any]) -> Kernel:
    lo, hi = float(attrs["min_val"]), float(attrs["max_val"])

    def hardtanh_(x: torch.Tensor) -> torch.Tensor:
        return F.hardtanh(x, lo, hi, inplace=True)

    return hardtanh_


def _hardtanh_out(node: Node, graph: Graph) -> OutForm:
    lo, hi = float(node.attrs["min_val"]), float(node.attrs["max_val"])

    def hardtanh_out(x, o):
        torch._C._nn.hardtanh(x, lo, hi, out=o)

    return hardtanh_out, ()


# (relu6 is hardtanh(0, 6)); monotone unless min_val > max_val (a constant then)
register(
    OpDef(
        "hardtanh",
        Bound.IO,
        _hardtanh,
        elementwise=True,
        monotone=True,
        monotone_if=lambda a: float(a["min_val"]) <= float(a["max_val"]),
        pointwise=_hardtanh_expr,
        defaults={"min_val": -1.0, "max_val": 1.0},
        inplace=_hardtanh_,
        out=OutVariant(_hardtanh_out, (0,)),
        post_op=VendorPostOp("hardtanh", ("min_val", "max_val")),
    )
)


def _leaky_relu(node: Node) -> Kernel:
    slope = float(node.attrs["negative_slope"])

    def leaky_relu(x):
        return F.leaky_relu(x, slope)

    return leaky_relu


def _leaky_relu_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    s = float(attrs["negative_slope"])
    return call("select", call("gt", x, Const(0.0)), x, call("mul", x, Const(s)))


def _leaky_relu_(attrs: Mapping[str, Any]) -> Kernel:
    slope = float(attrs["negative_slope"])

    def leaky_relu_(x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, slope, inplace=True)

    return leaky_relu_


def _leaky_relu_out(node: Node, graph: Graph) -> OutForm:
    slope = float(node.attrs["negative_slope"])

    def leaky_relu_out(x, o):
        torch._C._nn.leaky_relu(x, slope, out=o)

    return leaky_relu_out, ()


# monotone only for a positive slope: a slope of 0 maps -inf to NaN (-inf * 0), which a max
# over the window's other elements would hide (merge_pool_relu)
register(
    OpDef(
        "leaky_relu",
        Bound.IO,
        _leaky_relu,
        elementwise=True,
        monotone=True,
        monotone_if=lambda a: float(a["negative_slope"]) > 0.0,
        pointwise=_leaky_relu_expr,
        defaults={"negative_slope": 0.01},
        inplace=_leaky_relu_,
        out=OutVariant(_leaky_relu_out, (0,)),
        post_op=VendorPostOp("leaky_relu", ("negative_slope",)),
    )
)


def _sigmoid_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("sigmoid", x)


def _tanh_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("tanh", x)


def _silu_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("mul", x, call("sigmoid", x))


def _hardsigmoid_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("div", clamp(call("add", x, Const(3.0)), 0.0, 6.0), Const(6.0))


def _hardswish_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("mul", x, _hardsigmoid_expr(attrs, x))


def _inplace_of(fn: Kernel) -> Callable[[Mapping[str, Any]], Kernel]:
    def make(attrs: Mapping[str, Any]) -> Kernel:
        return fn

    return make


def _sigmoid_(x: torch.Tensor) -> torch.Tensor:
    return x.sigmoid_()


def _tanh_(x: torch.Tensor) -> torch.Tensor:
    return x.tanh_()


def _silu_(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


def _hardswish_(x: torch.Tensor) -> torch.Tensor:
    return F.hardswish(x, inplace=True)


def _hardsigmoid_(x: torch.Tensor) -> torch.Tensor:
    return F.hardsigmoid(x, inplace=True)


# (name, reference, FLOPs per element, scalar semantics, in-place form, out= form,
#  oneDNN post-op)
for _name, _fn, _flops, _expr, _inplace, _out, _onednn in (
    ("sigmoid", torch.sigmoid, 4.0, _sigmoid_expr, _sigmoid_, torch.sigmoid, "sigmoid"),
    ("tanh", torch.tanh, 4.0, _tanh_expr, _tanh_, torch.tanh, "tanh"),
    ("silu", F.silu, 5.0, _silu_expr, _silu_, torch._C._nn.silu, "swish"),
    (
        "hardswish",
        F.hardswish,
        4.0,
        _hardswish_expr,
        _hardswish_,
        torch._C._nn.hardswish,
        "hardswish",
    ),
    (
        "hardsigmoid",
        F.hardsigmoid,
        3.0,
        _hardsigmoid_expr,
        _hardsigmoid_,
        torch._C._nn.hardsigmoid,
        "hardsigmoid",
    ),
):
    register(
        OpDef(
            _name,
            Bound.IO,
            _unary(_fn),
            elementwise=True,
            flops_per_elem=_flops,
            pointwise=_expr,
            inplace=_inplace_of(_inplace),
            out=_unary_out(_out),
            post_op=VendorPostOp(_onednn),
        )
    )


def _elu(node: Node) -> Kernel:
    alpha = float(node.attrs["alpha"])

    def elu(x):
        return F.elu(x, alpha)

    return elu


def _elu_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    # PyTorch's formula: x > 0 ? x : alpha * expm1(x) (NaN takes the second branch: NaN)
    alpha = float(attrs["alpha"])
    return call("select", call("gt", x, Const(0.0)), x, call("mul", Const(alpha), call("expm1", x)))


def _elu_(attrs: Mapping[str, Any]) -> Kernel:
    alpha = float(attrs["alpha"])

    def elu_(x: torch.Tensor) -> torch.Tensor:
        return F.elu(x, alpha, inplace=True)

    return elu_


def _elu_out(node: Node, graph: Graph) -> OutForm:
    alpha = float(node.attrs["alpha"])

    def elu_out(x, o):
        torch._C._nn.elu(x, alpha, 1.0, 1.0, out=o)

    return elu_out, ()


# increasing for alpha >= 0 (commutes with max-pooling); oneDNN's fused post-ops through
# the framework do not spell it, so a convolution before it runs with no post-op
register(
    OpDef(
        "elu",
        Bound.IO,
        _elu,
        elementwise=True,
        flops_per_elem=4.0,
        monotone=True,
        monotone_if=lambda a: float(a["alpha"]) >= 0.0,
        pointwise=_elu_expr,
        defaults={"alpha": 1.0},
        inplace=_elu_,
        out=OutVariant(_elu_out, (0,)),
    )
)


def _mish_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    # PyTorch's formula: x * tanh(softplus(x)), softplus(x) = log1p(exp(x))
    return call("mul", x, call("tanh", call("log1p", call("exp", x))))


def _mish_(x: torch.Tensor) -> torch.Tensor:
    return F.mish(x, inplace=True)


# not monotone (a minimum near x = -1.19): it never merges into a max-pool; oneDNN's fused
# post-ops through the framework do not spell it
register(
    OpDef(
        "mish",
        Bound.IO,
        _unary(F.mish),
        elementwise=True,
        flops_per_elem=6.0,
        pointwise=_mish_expr,
        inplace=_inplace_of(_mish_),
        out=_unary_out(torch._C._nn.mish),
    )
)


def _hardshrink(node: Node) -> Kernel:
    lambd = float(node.attrs["lambd"])

    def hardshrink(x):
        return F.hardshrink(x, lambd)

    return hardshrink


def _hardshrink_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    # PyTorch's formula: (x >= -lambd && x <= lambd) ? 0 : x (a NaN fails both: NaN)
    lambd = float(attrs["lambd"])
    inside = call("and", call("ge", x, Const(-lambd)), call("le", x, Const(lambd)))
    return call("select", inside, Const(0.0), x)


def _hardshrink_out(node: Node, graph: Graph) -> OutForm:
    lambd = float(node.attrs["lambd"])

    def hardshrink_out(x, o):
        torch.ops.aten.hardshrink.out(x, lambd, out=o)

    return hardshrink_out, ()


# non-decreasing for any lambd (x below -|lambd|, 0, x above |lambd|): commutes with
# max-pooling; ATen has no in-place form and oneDNN's fused post-ops do not spell it
register(
    OpDef(
        "hardshrink",
        Bound.IO,
        _hardshrink,
        elementwise=True,
        flops_per_elem=3.0,
        monotone=True,
        pointwise=_hardshrink_expr,
        defaults={"lambd": 0.5},
        out=OutVariant(_hardshrink_out, (0,)),
    )
)


def _gelu(node: Node) -> Kernel:
    approximate = node.attrs["approximate"]

    def gelu(x):
        return F.gelu(x, approximate=approximate)

    return gelu


def _gelu_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    if attrs.get("approximate", "none") == "tanh":
        inner = call(
            "mul",
            Const(math.sqrt(2.0 / math.pi)),
            call("add", x, call("mul", Const(0.044715), call("mul", x, call("mul", x, x)))),
        )
        return call("mul", call("mul", Const(0.5), x), call("add", Const(1.0), call("tanh", inner)))
    return call(
        "mul",
        call("mul", Const(0.5), x),
        call("add", Const(1.0), call("erf", call("mul", x, Const(1.0 / math.sqrt(2.0))))),
    )


def _gelu_out_of_place(attrs: Mapping[str, Any]) -> Kernel:
    approximate = str(attrs["approximate"])

    def gelu(x: torch.Tensor) -> torch.Tensor:  # ATen has no in-place gelu
        return F.gelu(x, approximate=approximate)

    return gelu


def _gelu_out(node: Node, graph: Graph) -> OutForm:
    approximate = node.attrs["approximate"]

    def gelu_out(x, o):
        if x.stride() != o.stride():
            # ATen's gelu out= leaves elements of a destination strided otherwise than its
            # input unwritten (torch 2.14, tests/test_out_forms.py): compute, then copy
            o.copy_(F.gelu(x, approximate=approximate))
            return
        torch._C._nn.gelu(x, approximate=approximate, out=o)

    return gelu_out, ()


register(
    OpDef(
        "gelu",
        Bound.IO,
        _gelu,
        elementwise=True,
        flops_per_elem=8.0,
        pointwise=_gelu_expr,
        defaults={"approximate": "none"},
        inplace=_gelu_out_of_place,
        out=OutVariant(_gelu_out, (0,)),
        post_op=VendorPostOp("gelu", (), "approximate", ("none", "tanh")),
    )
)
