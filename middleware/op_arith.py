"""Registry entries of the elementwise arithmetic: batch_norm (inference) and the binary
ops add, sub, mul, div (two tensors, or a tensor and a scalar attr)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import loops
from .enums import Bound
from .graph import Node
from .op_registry import Kernel, OpDef, register


def _batch_norm(node: Node) -> Kernel:
    eps = float(node.attrs["eps"])

    def batch_norm(x, mean, var, weight, bias):
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    return batch_norm


register(
    OpDef(
        "batch_norm",
        Bound.IO,
        _batch_norm,
        elementwise=True,
        flops_per_elem=2.0,
        loops=loops.batch_norm_loops,
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


for _name, _fn, _alpha in (
    ("add", torch.add, True),
    ("sub", torch.sub, True),
    ("mul", torch.mul, False),
    ("div", torch.div, False),
):
    register(
        OpDef(_name, Bound.IO, _binary(_fn, _alpha), elementwise=True, loops=loops.binary_loops)
    )
