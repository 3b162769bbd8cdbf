"""The op registry (middleware/ops.py): what the other stages read of an op comes from its
entry, and an elementwise op added as one entry runs as generated code in a fused group,
on the C backend and on the reference backend, with every function the scalar vocabulary
gained for such ops (expm1, log, log1p, abs, ge, le, and)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from fusion_helpers import build_chain, check_group

from middleware.graph import Node
from middleware.loops import Const, Expr, Load, NotFusable, call
from middleware.ops import CATALOGUE, Bound, OpDef, activation_expr, get_op, register

LAYOUTS = ["nchw", "nhwc"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


def _vocab_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    """``expm1(x)`` on [lo, hi], ``log1p(|x|)`` elsewhere, plus ``log(|x| + 2)``."""
    lo, hi = Const(float(attrs["lo"])), Const(float(attrs["hi"]))
    inside = call("and", call("ge", x, lo), call("le", x, hi))
    picked = call("select", inside, call("expm1", x), call("log1p", call("abs", x)))
    return call("add", picked, call("log", call("add", call("abs", x), Const(2.0))))


def _vocab_reference(node: Node) -> Any:
    lo, hi = float(node.attrs["lo"]), float(node.attrs["hi"])

    def vocab(x: torch.Tensor) -> torch.Tensor:
        picked = torch.where((x >= lo) & (x <= hi), torch.expm1(x), torch.log1p(x.abs()))
        return picked + torch.log(x.abs() + 2.0)

    return vocab


@pytest.fixture
def one_entry_op() -> Iterator[str]:
    """An elementwise op that exists only as one registry entry (no frontend rule, no
    other table), removed again afterwards."""
    name = "test_vocab"
    register(OpDef(name, Bound.IO, _vocab_reference, elementwise=True, pointwise=_vocab_expr))
    try:
        yield name
    finally:
        del CATALOGUE[name]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_op_added_as_one_entry_runs_generated(one_entry_op, layout, cache):
    """Inside a fused group between two catalogue ops, against its reference; the shape
    rule, the loop semantics, batch slicing and layout facts all come from the entry."""
    op = get_op(one_entry_op)
    assert op.per_sample and op.keeps_layout({}) and op.loops is not None
    attrs = dict(lo=-0.5, hi=0.5)
    g = build_chain((2, 5, 6, 7), layout, [("tanh", {}), (one_entry_op, attrs), ("relu", {})])
    check_group(g, cache, atol=1e-5, rtol=1e-5)


def test_activation_expr_reads_the_entry():
    x = Load("x", ("n", "c", "h", "w"))
    assert activation_expr("relu", {}, x) == call("max", x, Const(0.0))
    assert activation_expr("hardtanh", {"min_val": -1.0, "max_val": 2.0}, x) == call(
        "min", call("max", x, Const(-1.0)), Const(2.0)
    )
    with pytest.raises(NotFusable, match="softmax"):
        activation_expr("softmax", {"dim": 1}, x)
    with pytest.raises(NotFusable, match="no_such_op"):
        activation_expr("no_such_op", {}, x)


@pytest.mark.parametrize("name", sorted(n for n, op in CATALOGUE.items() if op.post_op))
def test_every_vendor_post_op_also_has_scalar_and_in_place_forms(name):
    """An activation a vendor call fuses is also generated (CUDA's epilogue renders its
    ``pointwise``) and applied in place where the vendor cannot fuse it."""
    op = get_op(name)
    assert op.pointwise is not None and op.inplace is not None and op.elementwise


@pytest.mark.parametrize("name", sorted(n for n, op in CATALOGUE.items() if op.out))
def test_in_place_inputs_only_for_elementwise_ops(name):
    """The buffer planner writes a result over an input only where output element i reads
    input element i."""
    op = get_op(name)
    assert not op.out.inplace_inputs or op.elementwise
