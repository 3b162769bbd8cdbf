"""group: consecutive nodes of one class form convex groups, run back to back."""

from __future__ import annotations

import dataclasses

import networkx as nx
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from middleware import trace
from middleware.graph import Graph, Node, TensorType
from middleware.ops import infer_types
from middleware.passes import DEFAULT_HARDWARE
from middleware.passes.classify import classify
from middleware.passes.group import group
from middleware.passes.verify import check_equivalent


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


# ------------------------------------------------ one thread per output element (CUDA)
GPU = dataclasses.replace(DEFAULT_HARDWARE, kind="cuda", warp_size=32)


def _chain(ops: list[tuple[str, dict]], shape=(1, 2, 9, 9)) -> Graph:  # noqa: ANN001
    """A chain of io nodes n0, n1, ... from input x."""
    g = Graph()
    x = g.add_input("x", TensorType(shape))
    for i, (op, attrs) in enumerate(ops):
        node = Node(f"n{i}", op, (x,), (f"n{i}",), attrs, bound="io")
        g.add_node(node, infer_types(g.values, node))
        x = f"n{i}"
    g.set_outputs(x)
    return g


POOL3 = dict(kernel_size=3, stride=1, padding=1, dilation=1, ceil_mode=False)


def test_stacked_windows_split_past_the_recompute_limit_on_a_gpu():
    """3x3/1 pooling thrice: one thread per output would compute the first pool's input
    729 times (9 per pooling); on a GPU a pooling that would make it more than 64 starts a
    group (the relu is pulled into the first: 9 times), on a CPU (tiles in scratch) the
    chain stays one group."""
    g = _chain([("relu", {})] + [("max_pool2d", POOL3)] * 3)
    assert [n.group for n in group(g, GPU).nodes()] == [0, 0, 1, 2]
    assert [n.group for n in group(g, DEFAULT_HARDWARE).nodes()] == [0] * 4
    check_groups(group(g, GPU))


def test_long_reductions_start_or_leave_the_group_on_a_gpu():
    """A global pool over 6x6 = 36 elements per output reads its input from memory (starts
    a group); over 9x9 = 81 it is a group of its own (the framework reduces in parallel);
    over 2x2 it is pulled into the group."""
    pool = ("adaptive_avg_pool2d", {"output_size": (1, 1)})
    for shape, groups in (
        ((1, 2, 6, 6), [0, 1, 1]),
        ((1, 2, 9, 9), [0, 1, 2]),
        ((1, 2, 2, 2), [0, 0, 0]),
    ):
        g = _chain([("relu", {}), pool, ("sigmoid", {})], shape)
        assert [n.group for n in group(g, GPU).nodes()] == groups, shape
        assert [n.group for n in group(g, DEFAULT_HARDWARE).nodes()] == [0, 0, 0]


def test_io_node_without_loop_semantics_is_alone_on_a_gpu():
    g = _chain([("relu", {}), ("softmax", {"dim": 1}), ("relu", {})])
    assert [n.group for n in group(g, GPU).nodes()] == [0, 1, 2]
    assert [n.group for n in group(g, DEFAULT_HARDWARE).nodes()] == [0, 0, 0]


def test_groups_are_cut_into_one_output_pieces_on_a_gpu():
    """relu -> sigmoid -> tanh where the relu is also a graph output: two pieces on a GPU
    (a schedule computes one output), one group on a CPU."""
    g = _chain([("relu", {}), ("sigmoid", {}), ("tanh", {})])
    g.set_outputs(("n0", "n2"))
    assert [n.group for n in group(g, GPU).nodes()] == [0, 1, 1]
    assert [n.group for n in group(g, DEFAULT_HARDWARE).nodes()] == [0, 0, 0]
    # a value read by a later piece is cut too: n2 reads n0 and n1, n1 escapes
    g = build([("relu", (-1,), "io"), ("relu", (0,), "io"), ("add", (0, 1), "io")])
    g.set_outputs(("n1", "n2"))
    assert [n.group for n in group(g, GPU).nodes()] == [0, 1, 2]


@settings(max_examples=60, deadline=None)
@given(dags())
def test_random_dags_give_convex_contiguous_one_output_groups_on_a_gpu(spec):
    g = build(spec)
    g2 = group(g, GPU)
    members = check_groups(g2)
    outs = set(g2.output_values())
    for ms in members.values():
        inside = {m.name for m in ms}
        escaping = [
            m.name
            for m in ms
            if m.name in outs or any(c.name not in inside for c in g2.consumers(m.outputs[0]))
        ]
        assert len(escaping) <= 1 and (not escaping or escaping[0] == ms[-1].name)
    check_equivalent(g, g2, tol=0.0)


def test_channel_shuffle_views_join_the_group_on_a_gpu():
    """relu -> reshape(N, g, C/g, H, W) -> permute -> reshape(N, C, H, W): the 5-d views
    have no loop semantics, but the final reshape's semantics read the relu's output
    through them (a channel shuffle), so all four are one group; a permute read by no
    such node stays alone."""
    g = _chain(
        [
            ("relu", {}),
            ("reshape", {"shape": (1, 2, 2, 9, 9)}),
            ("permute", {"dims": (0, 2, 1, 3, 4)}),
            ("reshape", {"shape": (1, 4, 9, 9)}),
        ],
        (1, 4, 9, 9),
    )
    assert [n.group for n in group(g, GPU).nodes()] == [0, 0, 0, 0]
    g = _chain([("relu", {}), ("permute", {"dims": (0, 2, 3, 1)}), ("relu", {})], (1, 4, 9, 9))
    assert [n.group for n in group(g, GPU).nodes()] == [0, 1, 2]
