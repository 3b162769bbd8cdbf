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
from .loops import Const, Expr, NotFusable, OpLoops, broadcast_load, call, clamp
from .op_registry import (
    CATALOGUE,
    Kernel,
    OpDef,
    OutForm,
    OutVariant,
    PointwiseGrad,
    VendorPostOp,
    register,
)

_ATEN = torch.ops.aten


def _c(v: float) -> Const:
    return Const(float(v))


def _sel(cond: Expr, a: Expr, b: Expr) -> Expr:
    return call("select", cond, a, b)


def _mul(*xs: Expr) -> Expr:
    out = xs[0]
    for x in xs[1:]:
        out = call("mul", out, x)
    return out


# ------------------------------------------------------------ backward formulas
# Each is PyTorch's own backward formula (ATen's ``*_backward`` kernels, torch 2.x), NaN
# included: a comparison with NaN is false, so e.g. relu passes the gradient of a NaN
# input through (``threshold_backward``: ``y <= 0 ? 0 : gy``), hardsigmoid does not. For
# a NaN input ATen itself disagrees between its vectorised loop and the scalar loop that
# takes a tensor's last elements (hardtanh, hardswish, elu, hardshrink: which one an
# element gets depends on its position); the formulas follow the vectorised loop, which
# takes all but a tensor's last few elements.
def _relu_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    # threshold_backward(gy, relu(x), 0): relu(x) <= 0 exactly where x <= 0 (NaN: neither)
    return _sel(call("le", x, _c(0.0)), _c(0.0), gy)


def _relu_grad_ref(attrs: Mapping[str, Any]) -> Kernel:
    def relu_backward(x, gy):
        return _ATEN.threshold_backward(gy, torch.relu(x), 0)

    return relu_backward


def _hardtanh_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    # hardtanh_backward: x <= lo || x >= hi ? 0 : gy; a NaN x gives 0 (ATen's vectorised
    # path; its scalar path, which takes a tensor's last few elements, gives gy)
    lo, hi = float(attrs["min_val"]), float(attrs["max_val"])
    return _sel(call("and", call("gt", x, _c(lo)), call("gt", _c(hi), x)), gy, _c(0.0))


def _hardtanh_grad_ref(attrs: Mapping[str, Any]) -> Kernel:
    lo, hi = float(attrs["min_val"]), float(attrs["max_val"])

    def hardtanh_backward(x, gy):
        return _ATEN.hardtanh_backward(gy, x, lo, hi)

    return hardtanh_backward


def _leaky_relu_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    s = float(attrs["negative_slope"])
    return _sel(call("gt", x, _c(0.0)), gy, _mul(gy, _c(s)))


def _leaky_relu_grad_ref(attrs: Mapping[str, Any]) -> Kernel:
    s = float(attrs["negative_slope"])

    def leaky_relu_backward(x, gy):
        return _ATEN.leaky_relu_backward(gy, x, s, False)

    return leaky_relu_backward


def _sigmoid_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    y = call("sigmoid", x)  # sigmoid_backward(gy, y) = gy * (1 - y) * y
    return _mul(gy, call("sub", _c(1.0), y), y)


def _tanh_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    y = call("tanh", x)  # tanh_backward(gy, y) = gy * (1 - y * y)
    return _mul(gy, call("sub", _c(1.0), _mul(y, y)))


def _silu_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    s = call("sigmoid", x)  # silu_backward: gy * s * (1 + x * (1 - s))
    return _mul(gy, s, call("add", _c(1.0), _mul(x, call("sub", _c(1.0), s))))


def _hardswish_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    # hardswish_backward: x <= -3 ? 0 : x < 3 ? gy * (x / 3 + 0.5) : gy; a NaN x gives
    # NaN (ATen's vectorised path; its scalar path gives gy)
    mid = _mul(gy, call("add", call("div", x, _c(3.0)), _c(0.5)))
    return _sel(call("le", x, _c(-3.0)), _c(0.0), _sel(call("ge", x, _c(3.0)), gy, mid))


def _hardsigmoid_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    # hardsigmoid_backward: -3 < x < 3 ? gy / 6 : 0 (NaN: 0)
    inside = call("and", call("gt", x, _c(-3.0)), call("gt", _c(3.0), x))
    return _sel(inside, _mul(gy, _c(1.0 / 6.0)), _c(0.0))


def _of_output(forward: Callable[..., Any], backward: Callable[..., Any]) -> Callable[..., Any]:
    """A reference whose ATen backward reads the forward's output (sigmoid, tanh)."""

    def make(attrs: Mapping[str, Any]) -> Kernel:
        def of_output(x, gy):
            return backward(gy, forward(x))

        return of_output

    return make


def _of_input(backward: Callable[..., Any]) -> Callable[..., Any]:
    """A reference whose ATen backward reads the forward's input."""

    def make(attrs: Mapping[str, Any]) -> Kernel:
        def of_input(x, gy):
            return backward(gy, x)

        return of_input

    return make


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
        pointwise_grad=PointwiseGrad(_relu_grad, _relu_grad_ref, 1.0),
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
        pointwise_grad=PointwiseGrad(_hardtanh_grad, _hardtanh_grad_ref, 2.0),
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
        pointwise_grad=PointwiseGrad(_leaky_relu_grad, _leaky_relu_grad_ref, 2.0),
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


# exp (softmax's definition), sqrt and rsqrt (LayerNorm's statistics, ``F.normalize``-style
# code): elementwise, their backward from the output as in PyTorch's derivatives (exp:
# gy * y; sqrt: gy / (2 y); rsqrt: -0.5 gy y^3). rsqrt is 1 / sqrt(x), as ATen's
# vectorised kernel computes it.
def _sqrt_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("sqrt", x)


def _rsqrt_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("div", Const(1.0), call("sqrt", x))


def _sqrt_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    return call("div", gy, _mul(_c(2.0), call("sqrt", x)))


def _rsqrt_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    y = _rsqrt_expr(attrs, x)
    return _mul(_c(-0.5), gy, _mul(y, y, y))


def _exp_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("exp", x)


def _exp_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    return call("mul", gy, call("exp", x))


def _exp_backward(gy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return gy * y


def _sqrt_backward(gy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return gy / (2 * y)


def _rsqrt_backward(gy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -0.5 * gy * y.pow(3)


_SQRT_GRAD = PointwiseGrad(_sqrt_grad, _of_output(torch.sqrt, _sqrt_backward), 3.0)
_RSQRT_GRAD = PointwiseGrad(_rsqrt_grad, _of_output(torch.rsqrt, _rsqrt_backward), 5.0)
_EXP_GRAD = PointwiseGrad(_exp_grad, _of_output(torch.exp, _exp_backward), 2.0)


# (name, reference, FLOPs per element, scalar semantics, in-place form, out= form,
#  oneDNN post-op, backward)
_SIGMOID_GRAD = PointwiseGrad(_sigmoid_grad, _of_output(torch.sigmoid, _ATEN.sigmoid_backward), 7.0)
_TANH_GRAD = PointwiseGrad(_tanh_grad, _of_output(torch.tanh, _ATEN.tanh_backward), 7.0)
_SILU_GRAD = PointwiseGrad(_silu_grad, _of_input(_ATEN.silu_backward), 9.0)
_HARDSWISH_GRAD = PointwiseGrad(_hardswish_grad, _of_input(_ATEN.hardswish_backward), 4.0)
_HARDSIGMOID_GRAD = PointwiseGrad(_hardsigmoid_grad, _of_input(_ATEN.hardsigmoid_backward), 3.0)
for _name, _fn, _flops, _expr, _inplace, _out, _onednn, _grad in (
    (
        "sigmoid",
        torch.sigmoid,
        4.0,
        _sigmoid_expr,
        _sigmoid_,
        torch.sigmoid,
        "sigmoid",
        _SIGMOID_GRAD,
    ),
    ("tanh", torch.tanh, 4.0, _tanh_expr, _tanh_, torch.tanh, "tanh", _TANH_GRAD),
    ("silu", F.silu, 5.0, _silu_expr, _silu_, torch._C._nn.silu, "swish", _SILU_GRAD),
    (
        "hardswish",
        F.hardswish,
        4.0,
        _hardswish_expr,
        _hardswish_,
        torch._C._nn.hardswish,
        "hardswish",
        _HARDSWISH_GRAD,
    ),
    (
        "hardsigmoid",
        F.hardsigmoid,
        3.0,
        _hardsigmoid_expr,
        _hardsigmoid_,
        torch._C._nn.hardsigmoid,
        "hardsigmoid",
        _HARDSIGMOID_GRAD,
    ),
    ("sqrt", torch.sqrt, 2.0, _sqrt_expr, torch.sqrt_, torch.sqrt, None, _SQRT_GRAD),
    ("rsqrt", torch.rsqrt, 2.0, _rsqrt_expr, torch.rsqrt_, torch.rsqrt, None, _RSQRT_GRAD),
    ("exp", torch.exp, 1.0, _exp_expr, torch.exp_, torch.exp, None, _EXP_GRAD),
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
            post_op=VendorPostOp(_onednn) if _onednn else None,
            pointwise_grad=_grad,
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


def _elu_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    # elu_backward (is_result=False): x <= 0 ? gy * alpha * exp(x) : gy; a NaN x gives NaN
    # (ATen's vectorised path; its scalar path gives gy)
    alpha = float(attrs["alpha"])
    return _sel(call("gt", x, _c(0.0)), gy, _mul(gy, _c(alpha), call("exp", x)))


def _elu_grad_ref(attrs: Mapping[str, Any]) -> Kernel:
    alpha = float(attrs["alpha"])

    def elu_backward(x, gy):
        return _ATEN.elu_backward(gy, alpha, 1.0, 1.0, False, x)

    return elu_backward


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
        pointwise_grad=PointwiseGrad(_elu_grad, _elu_grad_ref, 5.0),
    )
)


def _mish_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    # PyTorch's formula: x * tanh(softplus(x)), softplus(x) = log1p(exp(x))
    return call("mul", x, call("tanh", call("log1p", call("exp", x))))


def _mish_(x: torch.Tensor) -> torch.Tensor:
    return F.mish(x, inplace=True)


def _mish_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    # mish_backward: gy * (t + x * sigmoid(x) * (1 - t * t)), t = tanh(softplus(x))
    t = call("tanh", call("log1p", call("exp", x)))
    return _mul(gy, call("add", t, _mul(x, call("sigmoid", x), call("sub", _c(1.0), _mul(t, t)))))


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
        pointwise_grad=PointwiseGrad(_mish_grad, _of_input(_ATEN.mish_backward), 12.0),
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


def _hardshrink_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    # hardshrink_backward: (x >= -lambd && x <= lambd) ? 0 : gy; a NaN x gives 0 (ATen's
    # vectorised path; its scalar path gives gy)
    lambd = float(attrs["lambd"])
    return _sel(call("gt", x, _c(lambd)), gy, _sel(call("gt", _c(-lambd), x), gy, _c(0.0)))


def _hardshrink_grad_ref(attrs: Mapping[str, Any]) -> Kernel:
    lambd = float(attrs["lambd"])

    def hardshrink_backward(x, gy):
        return _ATEN.hardshrink_backward(gy, x, lambd)

    return hardshrink_backward


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
        pointwise_grad=PointwiseGrad(_hardshrink_grad, _hardshrink_grad_ref, 2.0),
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


def _gelu_grad(attrs: Mapping[str, Any], x: Expr, gy: Expr) -> Expr:
    """gelu_backward's formulas (ATen's GeluKernel), both approximations."""
    if attrs.get("approximate", "none") == "tanh":
        beta = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
        kappa = 0.044715
        x_sq = _mul(x, x)
        inner = _mul(_c(beta), call("add", x, _mul(_c(kappa), x_sq, x)))
        t = call("tanh", inner)
        left_derivative = _mul(_c(0.5), call("add", _c(1.0), t))
        right_derivative = _mul(
            _c(0.5),
            x,
            call("sub", _c(1.0), _mul(t, t)),
            _mul(_c(beta), call("add", _c(1.0), _mul(_c(3.0 * kappa), x_sq))),
        )
        return _mul(gy, call("add", left_derivative, right_derivative))
    alpha = (2.0 / math.sqrt(math.pi)) * (1.0 / math.sqrt(2.0)) * 0.5
    cdf = _mul(_c(0.5), call("add", _c(1.0), call("erf", _mul(x, _c(1.0 / math.sqrt(2.0))))))
    pdf = _mul(_c(alpha), call("exp", _mul(x, x, _c(-0.5))))
    return _mul(gy, call("add", cdf, _mul(x, pdf)))


def _gelu_grad_ref(attrs: Mapping[str, Any]) -> Kernel:
    approximate = str(attrs.get("approximate", "none"))

    def gelu_backward(x, gy):
        return _ATEN.gelu_backward(gy, x, approximate=approximate)

    return gelu_backward


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
        pointwise_grad=PointwiseGrad(_gelu_grad, _gelu_grad_ref, 14.0),
    )
)


# ------------------------------------------------------------ backward of an activation
def _grad_of(node: Node) -> tuple[OpDef, dict[str, Any]]:
    """The forward entry and attrs a ``pointwise_grad`` node differentiates."""
    op = CATALOGUE.get(str(node.attrs["of"]))
    if op is None or op.pointwise_grad is None:
        raise NotFusable(f"op {node.attrs['of']!r} has no pointwise backward")
    return op, {**op.defaults, **dict(node.attrs["of_attrs"])}


def _pointwise_grad(node: Node) -> Kernel:
    op, attrs = _grad_of(node)
    assert op.pointwise_grad is not None
    return op.pointwise_grad.reference(attrs)


def _pointwise_grad_loops(graph: Graph, node: Node) -> OpLoops:
    op, attrs = _grad_of(node)
    assert op.pointwise_grad is not None
    x, gy = node.inputs
    out_t = graph.values[node.outputs[0]]
    loads = [broadcast_load(v, graph.values[v], out_t) for v in (x, gy)]
    return OpLoops("pointwise", op.pointwise_grad.expr(attrs, *loads))


def _pointwise_grad_flops(node: Node, ins: Any, outs: Any) -> float:
    op, _ = _grad_of(node)
    assert op.pointwise_grad is not None
    return op.pointwise_grad.flops_per_elem * sum(t.numel for t in outs)


# ``pointwise_grad(x, gy)``, attrs ``of`` (the activation) and ``of_attrs`` (its attrs):
# the gradient of the activation's input; emitted by the backward rules (``passes/
# autodiff.py``), never by a frontend. Its reference is PyTorch's own backward call and
# its loop semantics the activation entry's ``pointwise_grad.expr``.
register(
    OpDef(
        "pointwise_grad",
        Bound.IO,
        _pointwise_grad,
        elementwise=True,
        flops_fn=_pointwise_grad_flops,
        loops=_pointwise_grad_loops,
        # only backward graphs hold it, which no layout pass sees: not in the layout table
        layout_preserving=False,
    )
)
