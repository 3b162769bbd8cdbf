"""merge_pool_relu: a monotone activation next to a max-pooling becomes one node."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.graph import Graph, Node, TensorType
from middleware.ops import infer_types
from middleware.passes.merge_pool_relu import merge_pool_relu
from middleware.passes.verify import check_equivalent

POOL = {
    "kernel_size": (3, 3),
    "stride": (2, 2),
    "padding": (1, 1),
    "dilation": (1, 1),
    "ceil_mode": True,
}
ACTS = [
    ("relu", {}),
    ("hardtanh", {"min_val": 0.0, "max_val": 6.0}),
    ("hardtanh", {"min_val": -1.0, "max_val": 1.0}),
    ("leaky_relu", {"negative_slope": 0.1}),
]
NOT_MONOTONE = [
    ("leaky_relu", {"negative_slope": -0.5}),
    # monotone, but maps -inf to NaN (-inf * 0), which a max over the window would hide
    ("leaky_relu", {"negative_slope": 0.0}),
    ("sigmoid", {}),  # monotone, but the catalogue does not say so: not merged
]


def add(g: Graph, name: str, op: str, inputs: tuple[str, ...], attrs: dict) -> str:
    node = Node(name, op, inputs, (name,), attrs)
    g.add_node(node, infer_types(g.values, node))
    return name


def chain(first: tuple[str, dict], second: tuple[str, dict], hw=(9, 10), extra=False) -> Graph:
    g = Graph()
    x = g.add_input("x", TensorType((2, 3) + hw))
    a = add(g, "a", first[0], (x,), first[1])
    b = add(g, "b", second[0], (a,), second[1])
    g.set_outputs((b, add(g, "side", "mul", (a,), {"scalar": 2.0})) if extra else b)
    return g


@pytest.mark.parametrize("act", ACTS, ids=lambda a: f"{a[0]}{sorted(a[1].values())}")
@pytest.mark.parametrize("before", [True, False], ids=["act_first", "pool_first"])
def test_monotone_activation_merges(act, before):
    g = chain(act, ("max_pool2d", POOL)) if before else chain(("max_pool2d", POOL), act)
    g2 = merge_pool_relu(g)
    (node,) = list(g2.nodes())
    assert node.op == "maxpool_relu" and node.inputs == ("x",) and node.outputs == ("b",)
    assert node.attrs["activation"] == act[0]
    assert dict(node.attrs["activation_attrs"]) == act[1]
    assert {k: node.attrs[k] for k in POOL} == POOL
    check_equivalent(g, g2, tol=0.0)  # exact: act(max(S)) == max(act(S))


@pytest.mark.parametrize("act", NOT_MONOTONE, ids=lambda a: f"{a[0]}{sorted(a[1].values())}")
def test_other_activations_stay(act):
    for g in (chain(act, ("max_pool2d", POOL)), chain(("max_pool2d", POOL), act)):
        g2 = merge_pool_relu(g)
        assert [n.op for n in g2.nodes()] == [n.op for n in g.nodes()]


@pytest.mark.parametrize("before", [True, False])
def test_intermediate_with_another_reader_stays(before):
    first, second = (("relu", {}), ("max_pool2d", POOL))
    if not before:
        first, second = second, first
    g = chain(first, second, extra=True)
    g2 = merge_pool_relu(g)
    assert "maxpool_relu" not in [n.op for n in g2.nodes()]


def test_relu_between_two_pools_merges_once():
    g = Graph()
    x = g.add_input("x", TensorType((1, 2, 16, 16)))
    p1 = add(g, "p1", "max_pool2d", (x,), POOL)
    r = add(g, "r", "relu", (p1,), {})
    p2 = add(g, "p2", "max_pool2d", (r,), POOL)
    g.set_outputs(p2)
    g2 = merge_pool_relu(g)
    assert [n.op for n in g2.nodes()] == ["maxpool_relu", "max_pool2d"]
    check_equivalent(g, g2, tol=0.0)


@st.composite
def pools(draw: Any) -> dict:
    k = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    return {
        "kernel_size": k,
        "stride": (draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        "padding": (draw(st.integers(0, k[0] // 2)), draw(st.integers(0, k[1] // 2))),
        "dilation": (draw(st.integers(1, 2)), draw(st.integers(1, 2))),
        "ceil_mode": draw(st.booleans()),
    }


@settings(max_examples=40, deadline=None)
@given(pools(), st.sampled_from(ACTS), st.booleans())
def test_any_window_is_exact(pool, act, before):
    g = chain(act, ("max_pool2d", pool)) if before else chain(("max_pool2d", pool), act)
    g2 = merge_pool_relu(g)
    assert [n.op for n in g2.nodes()] == ["maxpool_relu"]
    check_equivalent(g, g2, tol=0.0)
