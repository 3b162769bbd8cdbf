"""canonicalize: no-ops, constant folding and dead nodes go; outputs stay the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from middleware import trace
from middleware.graph import Graph, Node, TensorType
from middleware.ops import infer_types
from middleware.passes.canonicalize import FOLD_GROWTH_LIMIT, canonicalize
from middleware.passes.verify import check_equivalent

TOL = 1e-6  # no arithmetic changes except folded constants (computed by the same reference)


def ops(g: Graph) -> list[str]:
    return [n.op for n in g.nodes()]


class NoOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.ident = nn.Identity()
        self.register_buffer("scale", torch.rand(1, 8, 1, 1) + 0.5)

    def forward(self, x):
        y = self.ident(self.drop(self.conv(x)))
        y = y.contiguous()
        y = y.reshape(y.shape)
        unused = torch.sigmoid(x)  # noqa: F841 - a dead node
        s = self.scale * 2.0 + 1.0  # constant subgraph
        return torch.relu(y * s)


def test_noops_constants_and_dead_nodes_go():
    torch.manual_seed(0)
    m = NoOps().eval()
    g = trace(m, (torch.randn(2, 3, 8, 8),))
    text_before = g.text()
    assert {"dropout", "identity", "contiguous", "reshape", "sigmoid"} <= set(ops(g))
    g2 = canonicalize(g)
    assert ops(g2) == ["conv2d", "mul", "relu"], g2.text()
    mul = next(n for n in g2.nodes() if n.op == "mul")
    folded = next(v for v in mul.inputs if v in g2.params)
    np.testing.assert_allclose(g2.params[folded], m.scale.numpy() * 2.0 + 1.0, rtol=1e-6)
    assert g.text() == text_before, "the input graph was modified"
    check_equivalent(g, g2, tol=TOL)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(g2.evaluate(x), m(x), rtol=1e-5, atol=1e-5)


class Shuffle(nn.Module):
    def forward(self, x):
        b, c, h, w = x.shape
        y = x.view(b, 2, c // 2, h, w).transpose(1, 2).contiguous()
        return y.view(b, c, h, w) + 1.0


def test_contiguous_after_permute_stays():
    g = trace(Shuffle(), (torch.randn(1, 8, 4, 4),))
    g2 = canonicalize(g)
    assert "contiguous" in ops(g2) and "permute" in ops(g2)
    check_equivalent(g, g2, tol=0.0)


class ReturnsNoOp(nn.Module):
    def forward(self, x):
        return nn.functional.dropout(x, 0.3, training=False), torch.flatten(x, 1)


def test_output_that_was_a_no_op_reads_the_input():
    g = trace(ReturnsNoOp(), (torch.randn(3, 5),))
    g2 = canonicalize(g)
    assert len(g2) == 0, g2.text()
    assert g2.output_tree == (g2.inputs[0], g2.inputs[0])
    check_equivalent(g, g2, tol=0.0)


def _graph_with_broadcast_constant(n: int) -> Graph:
    g = Graph()
    x = g.add_input("x", TensorType((n, n)))
    a = g.add_param("a", np.random.default_rng(0).random((n, 1), dtype=np.float32))
    b = g.add_param("b", np.random.default_rng(1).random((1, n), dtype=np.float32))
    node = Node("ab", "add", (a, b), ("ab",))
    g.add_node(node, infer_types(g.values, node))
    node = Node("y", "mul", (x, "ab"), ("y",))
    g.add_node(node, infer_types(g.values, node))
    g.set_outputs("y")
    return g


@pytest.mark.parametrize("n, folds", [(64, True), (1024, False)])
def test_folding_does_not_materialise_large_broadcasts(n, folds):
    g = _graph_with_broadcast_constant(n)
    assert (n * n * 4 <= 8 * n + FOLD_GROWTH_LIMIT) == folds
    g2 = canonicalize(g)
    assert ("add" not in ops(g2)) == folds
    check_equivalent(g, g2, tol=TOL)


class Fallbacks(nn.Module):
    def forward(self, x):
        unused = torch.cumsum(x, 1)  # noqa: F841 - unsupported: a fallback, unread
        used = torch.cumsum(x, 0)
        return used + 1


def test_unread_fallback_is_dropped_read_one_kept():
    g = trace(Fallbacks(), (torch.randn(4, 4),))
    assert ops(g).count("fallback") == 2
    g2 = canonicalize(g)
    assert ops(g2).count("fallback") == 1
    check_equivalent(g, g2, tol=0.0)
