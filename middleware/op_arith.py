"""Registry entries of the elementwise arithmetic: batch_norm (inference) and the binary
ops add, sub, mul, div (two tensors, or a tensor and a scalar attr)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import loops
from .enums import Bound
from .graph import Graph, Node
from .op_registry import GradEmitter, GradRule, Kernel, OpDef, OutForm, OutVariant, register


def _batch_norm(node: Node) -> Kernel:
    eps = float(node.attrs["eps"])

    def batch_norm(x, mean, var, weight, bias):
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    return batch_norm


def _batch_norm_out(node: Node, graph: Graph) -> OutForm:
    eps = float(node.attrs["eps"])
    no_stats = torch.empty(0)  # inference computes no saved statistics

    def batch_norm_out(x, mean, var, w, b, o):
        if x.stride() != o.stride():
            # ATen's out kernel assumes the input's memory order for the output: handed a
            # destination strided otherwise (a permuted framework result into an arena view
            # of its declared layout) it writes garbage (torch 2.14, tests/test_out_forms.py)
            o.copy_(F.batch_norm(x, mean, var, w, b, False, 0.0, eps))
            return
        # ATen's own kernel (bit-identical to F.batch_norm for dense outputs, in place too)
        torch.ops.aten.native_batch_norm.out(
            x, w, b, mean, var, False, 0.0, eps, out=o, save_mean=no_stats, save_invstd=no_stats
        )

    return batch_norm_out, ()


register(
    OpDef(
        "batch_norm",
        Bound.IO,
        _batch_norm,
        elementwise=True,
        flops_per_elem=2.0,
        loops=loops.batch_norm_loops,
        out=OutVariant(_batch_norm_out, (0,)),
        image_op=True,
    )
)


def _binary(fn: Callable[..., Any], has_alpha: bool = False) -> Callable[[Node], Kernel]:
    """add/sub/mul/div of two tensors, or of a tensor and a scalar attr ``scalar``
    (``reverse``: the scalar is the left operand). ``alpha`` scales the right operand."""

    def make(node: Node) -> Kernel:
        scalar = node.attrs.get("scalar")
        reverse = bool(node.attrs.get("reverse", False))
        alpha = node.attrs.get("alpha", 1)
        if has_alpha and alpha != 1:

            def apply(a, b):
                return fn(a, b, alpha=alpha)
        else:
            apply = fn
        if scalar is None:
            return apply
        if reverse:

            def left_scalar(x):
                return apply(torch.full((), scalar, dtype=x.dtype, device=x.device), x)

            return left_scalar

        def right_scalar(x):
            return apply(x, scalar)

        return right_scalar

    return make


def _binary_out(fn: Callable[..., Any], has_alpha: bool) -> Callable[[Node, Graph], OutForm | None]:
    """The out= form of a binary op; none for a scalar left operand (``reverse``)."""

    def make(node: Node, graph: Graph) -> OutForm | None:
        scalar = node.attrs.get("scalar")
        if node.attrs.get("reverse", False):
            return None
        kw = {"alpha": node.attrs["alpha"]} if has_alpha and node.attrs.get("alpha", 1) != 1 else {}
        if scalar is not None:

            def scalar_out(x, o):
                fn(x, scalar, out=o, **kw)

            return scalar_out, ()

        def binary_out(a, b, o):
            fn(a, b, out=o, **kw)

        return binary_out, ()

    return make


# ------------------------------------------------------------------- backward rules
# PyTorch's formulas (tools/autograd/derivatives.yaml): add/sub ``gy`` and ``gy * alpha``
# (``-gy * alpha`` for sub's right operand), mul ``gy * other``, div ``gy / other`` and
# ``-gy * ((self / other) / other)``. A scalar operand (attr ``scalar``, ``reverse``: on
# the left) gets no gradient; a gradient of a broadcast operand has the output's shape
# (the caller sums it down).
def _operands(node: Node) -> tuple[str | float, str | float]:
    """(left, right): value names, or the scalar attr where it is an operand."""
    if node.attrs.get("scalar") is None:
        a, b = node.inputs
        return a, b
    (x,) = node.inputs
    scalar = float(node.attrs["scalar"])
    return (scalar, x) if node.attrs.get("reverse") else (x, scalar)


def _scaled(e: GradEmitter, gy: str, factor: float) -> str:
    return gy if factor == 1.0 else e.emit("mul", (gy,), {"scalar": factor})


def _times(e: GradEmitter, op: str, g: str, v: str | float) -> str:
    """``op(g, v)`` for a value ``v`` or a scalar."""
    if isinstance(v, str):
        return e.emit(op, (g, v))
    return e.emit(op, (g,), {"scalar": v})


def _per_input(node: Node, left: str | None, right: str | None) -> tuple[str | None, ...]:
    a, b = _operands(node)
    return tuple(g for v, g in ((a, left), (b, right)) if isinstance(v, str))


def _add_sub_grad(sign: float) -> GradRule:
    def add_sub_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
        alpha = float(node.attrs.get("alpha", 1))
        a, b = _operands(node)
        left = gy if isinstance(a, str) else None
        right = _scaled(e, gy, sign * alpha) if isinstance(b, str) else None
        return _per_input(node, left, right)

    return add_sub_grad


def _mul_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    a, b = _operands(node)
    left = _times(e, "mul", gy, b) if isinstance(a, str) else None
    right = _times(e, "mul", gy, a) if isinstance(b, str) else None
    return _per_input(node, left, right)


def _div_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    a, b = _operands(node)
    left = _times(e, "div", gy, b) if isinstance(a, str) else None
    right = None
    if isinstance(b, str):
        if isinstance(a, str):
            q = e.emit("div", (a, b))
        else:
            q = e.emit("div", (b,), {"scalar": a, "reverse": True})
        q = e.emit("div", (q, b))
        right = e.emit("mul", (e.emit("mul", (gy,), {"scalar": -1.0}), q))
    return _per_input(node, left, right)


# (name, ATen function, takes alpha, the inputs its result may overwrite: the commutative
# ops either operand, backward rule)
for _name, _fn, _alpha, _inplace, _grad in (
    ("add", torch.add, True, (0, 1), _add_sub_grad(1.0)),
    ("sub", torch.sub, True, (0,), _add_sub_grad(-1.0)),
    ("mul", torch.mul, False, (0, 1), _mul_grad),
    ("div", torch.div, False, (0,), _div_grad),
):
    register(
        OpDef(
            _name,
            Bound.IO,
            _binary(_fn, _alpha),
            elementwise=True,
            loops=loops.binary(_name),
            out=OutVariant(_binary_out(_fn, _alpha), _inplace),
            grad=_grad,
        )
    )
