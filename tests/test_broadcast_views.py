"""Broadcasting and views through ``middleware.optimize`` against eager PyTorch.

Regressions first (issue 11): an operand with fewer dims than the output was loaded in the
wrong logical dims (``(5, 1) + (5,)`` gave ``x[i] + y[0]``), and a ``transpose`` of a
square tensor was dropped as a no-op because its output type equals its input type, and a
split into one piece returned ``((t,),)``. Then derandomized property tests over every elementwise binary op, rank 0-5, every broadcast
pattern, both layouts, and over the view ops with square and non-square shapes.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from conftest import OPT_ATOL, OPT_RTOL, assert_tree_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import middleware
from middleware.runtime.module import OptimizedModule

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
    a fallback is a correct answer; an exception from the compiler is not. The model must
    have been traced and its plan must have run (else the test would only run PyTorch)."""
    model = model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = middleware.optimize(model, device="cpu", example_inputs=list(inputs))
        with torch.no_grad():
            got = opt(*inputs)
    with torch.no_grad():
        expected = model(*inputs)
    assert opt.graph is not None, str(opt.report())
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


@pytest.mark.parametrize(
    "fn",
    [lambda x: torch.split(x, 5, 1), lambda x: x.chunk(1, 0), lambda x: torch.split(x, [5], 1)],
    ids=["split", "chunk", "split_sizes"],
)
def test_split_into_one_piece_returns_a_one_tuple(fn: Callable[[torch.Tensor], Any]) -> None:
    """A split with one piece is a node with one output: its kernel returned a 1-tuple
    where the runtime expects a tensor, and the model returned ``((t,),)``."""
    run_optimized(Unary(fn), torch.randn(3, 5))


def test_permute_of_size1_dims_still_drops() -> None:
    """A permute that only moves size-1 dims keeps every element where it is (canonicalize
    may drop it); the result is still right."""
    run_optimized(Unary(lambda x: x.permute(0, 2, 1, 3) + 1.0), torch.randn(3, 1, 1, 5))


# ------------------------------------------------------------- property tests
# Each example compiles a kernel or two: the counts keep the file well under a minute.
PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def maybe_channels_last(x: torch.Tensor, cl: bool) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if cl and x.dim() == 4 else x


@st.composite
def broadcast_shapes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two shapes that broadcast: from an output shape of rank 0-5, each operand drops
    some leading dims (a lower rank) and turns some dims into 1s."""
    rank = draw(st.integers(0, 5))
    out = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))

    def operand() -> tuple[int, ...]:
        drop = draw(st.integers(0, rank))
        ones = draw(st.lists(st.booleans(), min_size=rank - drop, max_size=rank - drop))
        return tuple(1 if one else s for s, one in zip(out[drop:], ones, strict=True))

    return operand(), operand()


# binary forms: (name, fn(x, y) or fn(x) for scalar forms, takes y, y is a divisor)
BINARY_FORMS: list[tuple[str, Callable[..., torch.Tensor], bool, bool]] = [
    ("add", torch.add, True, False),
    ("sub", torch.sub, True, False),
    ("mul", torch.mul, True, False),
    ("div", torch.div, True, True),
    ("add_alpha", lambda x, y: torch.add(x, y, alpha=0.5), True, False),
    ("sub_alpha", lambda x, y: torch.sub(x, y, alpha=2), True, False),
    ("add_scalar", lambda x: x + 2.5, False, False),
    ("sub_scalar", lambda x: x - 1.5, False, False),
    ("rsub_scalar", lambda x: 3.0 - x, False, False),
    ("mul_scalar", lambda x: x * -2.0, False, False),
    ("div_scalar", lambda x: x / 4.0, False, False),
    ("rdiv_scalar", lambda x: 2.0 / x, False, True),
]
# what reads the binary op's result (in the same generated group when it can be)
TAILS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda z: z,
    "relu": torch.relu,
    "scale": lambda z: z * 0.5 + 1.0,
}


class BinaryTail(nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor], two: bool, tail: str) -> None:
        super().__init__()
        self.fn, self.two, self.tail = fn, two, TAILS[tail]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.tail(self.fn(x, y) if self.two else self.fn(x))


@PROPERTY
@given(
    shapes=broadcast_shapes(),
    form=st.sampled_from(BINARY_FORMS),
    tail=st.sampled_from(sorted(TAILS)),
    channels_last=st.tuples(st.booleans(), st.booleans()),
)
def test_binary_broadcasting(
    shapes: tuple[tuple[int, ...], tuple[int, ...]],
    form: tuple[str, Callable[..., torch.Tensor], bool, bool],
    tail: str,
    channels_last: tuple[bool, bool],
) -> None:
    """Every elementwise binary op (tensor-tensor both ways round, tensor-scalar both ways
    round, alpha), every rank 0-5 and broadcast pattern, 4-d operands also channels_last."""
    _, fn, two, divides = form
    xs, ys = shapes
    x = divisor_like(xs) if divides and not two else torch.randn(xs)
    y = divisor_like(ys) if divides else torch.randn(ys)
    x, y = maybe_channels_last(x, channels_last[0]), maybe_channels_last(y, channels_last[1])
    # a scalar form ignores y (a second input keeps the module's signature)
    run_optimized(BinaryTail(fn, two, tail), x, y)


# (view kind, input shape, the view, how many tensors it returns in a tuple or 0)
ViewCase = tuple[str, tuple[int, ...], Callable[[torch.Tensor], Any], int]


@st.composite
def view_cases(draw: st.DrawFn) -> ViewCase:
    """A view op with its arguments on a shape of rank 1-5 whose sizes repeat often (square
    cases, where a transpose keeps the shape) and sometimes differ; with the number of
    tensors it returns when it returns a tuple (split, chunk), else 0."""
    rank = draw(st.integers(1, 5))
    sizes = st.sampled_from([1, 2, 3, 3, 4])
    if draw(st.booleans()):
        shape = (draw(sizes),) * rank  # square / cubic
    else:
        shape = tuple(draw(st.lists(sizes, min_size=rank, max_size=rank)))
    dim = draw(st.integers(0, rank - 1))
    other = draw(st.integers(0, rank - 1))
    kind = draw(
        st.sampled_from(
            ["transpose", "permute", "reshape", "flatten", "split", "chunk", "narrow", "expand"]
        )
    )
    if kind == "transpose":
        return kind, shape, lambda x: torch.transpose(x, dim, other), 0
    if kind == "permute":
        perm = tuple(draw(st.permutations(range(rank))))
        return kind, shape, lambda x: x.permute(perm), 0
    if kind == "reshape":
        total = math.prod(shape)
        first = draw(st.sampled_from([d for d in range(1, total + 1) if total % d == 0]))
        return kind, shape, lambda x: x.reshape(first, -1), 0
    if kind == "flatten":
        end = draw(st.integers(dim, rank - 1))
        return kind, shape, lambda x: torch.flatten(x, dim, end), 0
    if kind == "split":
        size = draw(st.integers(1, shape[dim]))
        return kind, shape, lambda x: torch.split(x, size, dim), -(-shape[dim] // size)
    if kind == "chunk":
        n = draw(st.integers(1, 3))
        per = -(-shape[dim] // n)  # torch.chunk's piece size; the last piece may be short
        return kind, shape, lambda x: torch.chunk(x, n, dim), -(-shape[dim] // per)
    if kind == "narrow":
        start = draw(st.integers(0, shape[dim] - 1))
        length = draw(st.integers(1, shape[dim] - start))
        return kind, shape, lambda x: x.narrow(dim, start, length), 0
    # expand: size-1 dims of the input grow, a leading dim may be added
    small = tuple(1 if draw(st.booleans()) else s for s in shape)
    lead = (2,) if rank < 5 and draw(st.booleans()) else ()
    return kind, small, lambda x: x.expand(*lead, *shape), 0


def _then(
    fn: Callable[[torch.Tensor], Any], pieces: int, tail: str
) -> Callable[[torch.Tensor], Any]:
    """``fn`` followed by an elementwise ``tail`` on each of its ``pieces`` outputs (0: one
    tensor) so that the view feeds generated code, or returned as is. (Traced by torch.fx,
    where a tuple result is one proxy: indexed, not iterated.)"""
    if tail == "none":
        return fn

    def run(x: torch.Tensor) -> Any:
        out = fn(x)
        if pieces:
            return tuple(TAILS[tail](out[i]) for i in range(pieces))
        return TAILS[tail](out)

    return run


@PROPERTY
@given(case=view_cases(), tail=st.sampled_from(sorted(TAILS)), channels_last=st.booleans())
def test_views(
    case: ViewCase,
    tail: str,
    channels_last: bool,
) -> None:
    """transpose/permute/reshape/flatten/split/chunk/narrow/expand, square and non-square,
    4-d inputs also channels_last, returned directly or read by an elementwise op."""
    _, shape, fn, pieces = case
    x = maybe_channels_last(torch.randn(shape), channels_last)
    run_optimized(Unary(_then(fn, pieces, tail)), x)


def test_elementwise_op_on_an_expand_of_a_1x1x1x1_input() -> None:
    """Found by test_views: the buffer planner ran the ReLU in place into the output of the
    expand (a fallback reading the layout pass's to_layout of the input), 'more than one
    element of the written-to tensor refers to a single memory location' at run time, and
    the signature fell back to PyTorch. Fixed in runtime/memory.py (to_layout aliases)."""
    run_optimized(Unary(lambda x: torch.relu(x.expand(2, 3, 3, 3, 3))), torch.randn(1, 1, 1, 1))
