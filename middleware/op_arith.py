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
from .op_registry import Kernel, OpDef, OutForm, OutVariant, register


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


# (name, ATen function, takes alpha, the inputs its result may overwrite: the commutative
# ops either operand)
for _name, _fn, _alpha, _inplace in (
    ("add", torch.add, True, (0, 1)),
    ("sub", torch.sub, True, (0,)),
    ("mul", torch.mul, False, (0, 1)),
    ("div", torch.div, False, (0,)),
):
    register(
        OpDef(
            _name,
            Bound.IO,
            _binary(_fn, _alpha),
            elementwise=True,
            loops=loops.binary(_name),
            out=OutVariant(_binary_out(_fn, _alpha), _inplace),
        )
    )
