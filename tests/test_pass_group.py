"""group: consecutive nodes of one class form convex groups, run back to back."""

from __future__ import annotations

import networkx as nx
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from middleware.passes import DEFAULT_HARDWARE
from middleware.passes.classify import classify
from middleware.passes.group import group
from middleware.passes.verify import check_equivalent

from middleware import trace
from middleware.graph import Graph, Node, TensorType
from middleware.ops import infer_types


def check_groups(g: Graph) -> dict[int, list[Node]]:
    """The invariants group() guarantees; returns the groups."""
    nodes = list(g.nodes())
    members: dict[int, list[Node]] = {}
    order: list[int] = []
    for n in nodes:
        assert n.group is not None
        if not order or order[-1] != n.group:
            assert n.group not in members, f"group {n.group} is not contiguous"
            order.append(n.group)
        members.setdefault(n.group, []).append(n)
    assert order == list(range(len(order)))
    for gid, ms in members.items():
        assert len({m.bound for m in ms}) == 1, f"group {gid} mixes classes"
        if any(m.op == "fallback" for m in ms):
            assert len(ms) == 1
        inside = {m.name for m in ms}
        outside_desc = {d for m in inside for d in nx.descendants(g.nx, m)} - inside
        for d in outside_desc:
            assert not (nx.descendants(g.nx, d) & inside), f"group {gid} is not convex"
    return members


def build(spec: list[tuple[str, tuple[int, ...], str]]) -> Graph:
    """Nodes named n0, n1, ... (op, producer indices (-1: the input), bound)."""
    g = Graph()
    g.add_input("x", TensorType((1, 2, 4, 4)))
    for i, (op, ins, bound) in enumerate(spec):
        names = tuple("x" if j < 0 else f"n{j}" for j in ins)
        node = Node(f"n{i}", op, names, (f"n{i}",), {}, bound=bound)
        g.add_node(node, infer_types(g.values, node))
    g.set_outputs(f"n{len(spec) - 1}")
    return g


def test_io_chain_is_one_group_vendor_nodes_alone():
    g = build(
        [
            ("relu", (-1,), "io"),
            ("relu", (0,), "io"),
            ("relu", (1,), "compute"),
            ("relu", (2,), "compute"),
            ("relu", (3,), "io"),
            ("add", (4, 3), "io"),
        ]
    )
    g2 = group(g)
    assert [n.group for n in g2.nodes()] == [0, 0, 1, 2, 3, 3]
    check_groups(g2)
    check_equivalent(g, g2, tol=0.0)


def test_path_through_another_class_splits_the_group():
    # n0 (io) -> n1 (compute) -> n2 (io) reads n0 and n1: n2 joining n0 would not be convex
    g = build([("relu", (-1,), "io"), ("relu", (0,), "compute"), ("add", (0, 1), "io")])
    g2 = group(g)
    assert len({n.group for n in g2.nodes()}) == 3
    check_groups(g2)


def test_concat_of_io_parts_is_one_dag_group():
    g = build(
        [
            ("relu", (-1,), "io"),
            ("relu", (-1,), "compute"),
            ("relu", (1,), "io"),
            ("add", (0, 2), "io"),
        ]
    )
    g2 = group(g)
    by = {n.name: n.group for n in g2.nodes()}
    assert by["n0"] == by["n2"] == by["n3"] != by["n1"]
    check_groups(g2)


class WithFallback(nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        z = torch.cumsum(y, 1)  # not in the catalogue: a fallback node
        return torch.relu(z) + y


def test_fallback_is_its_own_group():
    g = trace(WithFallback(), (torch.randn(2, 3),))
    g2 = group(classify(g, DEFAULT_HARDWARE))
    members = check_groups(g2)
    assert len(members) == 3
    check_equivalent(g, g2, tol=0.0)


@st.composite
def dags(draw) -> list[tuple[str, tuple[int, ...], str]]:
    n = draw(st.integers(2, 14))
    spec = []
    for i in range(n):
        k = draw(st.integers(1, 2))
        ins = tuple(draw(st.integers(-1, i - 1)) for _ in range(k))
        bound = draw(st.sampled_from(["io", "io", "compute", "param"]))
        spec.append(("relu" if k == 1 else "add", ins, bound))
    return spec


@settings(max_examples=150, deadline=None)
@given(dags())
def test_random_dags_give_convex_contiguous_groups(spec):
    g = build(spec)
    g2 = group(g)
    members = check_groups(g2)
    for ms in members.values():
        if ms[0].bound != "io":
            assert len(ms) == 1  # vendor calls: one node each
    check_equivalent(g, g2, tol=0.0)


def test_without_bounds_the_catalogue_class_is_used():
    g = build([("relu", (-1,), None), ("relu", (0,), None), ("add", (0, 1), None)])
    g2 = group(g)
    assert [(n.bound, n.group) for n in g2.nodes()] == [("io", 0)] * 3
