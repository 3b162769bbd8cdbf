"""pool_before_concat: pooling of a channel concat becomes a concat of pooled parts."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.graph import Graph, Node, TensorType
from middleware.ops import infer_types
from middleware.passes.pool_before_concat import pool_before_concat
from middleware.passes.verify import check_equivalent

TOL = 1e-6  # per-channel arithmetic is unchanged


def add(g: Graph, name: str, op: str, inputs: tuple[str, ...], **attrs: Any) -> str:
    node = Node(name, op, inputs, (name,), attrs)
    g.add_node(node, infer_types(g.values, node))
    return name


def concat_graph(
    parts: list[int], hw: tuple[int, int], pools: list[tuple[str, dict]], extra_reader: bool = False
) -> Graph:
    g = Graph()
    xs = [g.add_input(f"x{i}", TensorType((2, c) + hw)) for i, c in enumerate(parts)]
    cat = add(g, "cat", "cat", tuple(xs), dim=1)
    outs = [add(g, f"pool{i}", op, (cat,), **attrs) for i, (op, attrs) in enumerate(pools)]
    if extra_reader:
        outs.append(add(g, "relu", "relu", (cat,)))
    g.set_outputs(tuple(outs))
    return g


def window(draw: Any, op: str) -> dict:
    if op.startswith("adaptive"):
        return {"output_size": (draw(st.integers(1, 4)), draw(st.integers(1, 5)))}
    k = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    attrs = {
        "kernel_size": k,
        "stride": (draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        "padding": (draw(st.integers(0, k[0] // 2)), draw(st.integers(0, k[1] // 2))),
        "ceil_mode": draw(st.booleans()),
    }
    if op == "max_pool2d":
        attrs["dilation"] = (draw(st.integers(1, 2)), 1)
    else:
        attrs["count_include_pad"] = draw(st.booleans())
        attrs["divisor_override"] = draw(st.sampled_from([None, 3]))
    return attrs


POOLS = ["max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d"]


@st.composite
def cases(draw: Any) -> tuple[list[int], tuple[int, int], list[tuple[str, dict]]]:
    parts = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    hw = (draw(st.integers(7, 12)), draw(st.integers(7, 12)))
    ops = draw(st.lists(st.sampled_from(POOLS), min_size=1, max_size=2))
    return parts, hw, [(op, window(draw, op)) for op in ops]


@settings(max_examples=60, deadline=None)
@given(cases())
def test_pooling_moves_in_front_of_the_concat(case):
    parts, hw, pools = case
    g = concat_graph(parts, hw, pools)
    g2 = pool_before_concat(g)
    # every pooling now reads a graph input (a part), and each output is a concat
    for n in g2.nodes():
        if n.op in POOLS:
            assert n.inputs[0] in g2.inputs
    assert sum(n.op == "cat" for n in g2.nodes()) == len(pools)
    assert sum(n.op in POOLS for n in g2.nodes()) == len(pools) * len(parts)
    check_equivalent(g, g2, seed=len(parts), tol=TOL)


def test_shared_concat_stays_unless_asked():
    pools = [
        (
            "max_pool2d",
            {
                "kernel_size": (3, 3),
                "stride": (1, 1),
                "padding": (1, 1),
                "dilation": (1, 1),
                "ceil_mode": True,
            },
        )
    ]
    g = concat_graph([2, 3], (6, 6), pools, extra_reader=True)
    g2 = pool_before_concat(g)
    assert [n.op for n in g2.nodes()] == [n.op for n in g.nodes()]
    assert g2 is not g
    g3 = pool_before_concat(g, shared=True)
    ops = [n.op for n in g3.nodes()]
    assert ops.count("cat") == 2 and ops.count("max_pool2d") == 2
    check_equivalent(g, g3, tol=TOL)


def test_nested_concats_move_to_a_fixed_point():
    g = Graph()
    a, b, c = (g.add_input(n, TensorType((1, 2, 8, 8))) for n in "abc")
    inner = add(g, "inner", "cat", (a, b), dim=1)
    outer = add(g, "outer", "cat", (inner, c), dim=1)
    p = add(
        g,
        "p",
        "avg_pool2d",
        (outer,),
        kernel_size=(2, 2),
        stride=(2, 2),
        padding=(0, 0),
        ceil_mode=False,
        count_include_pad=True,
        divisor_override=None,
    )
    g.set_outputs(p)
    g2 = pool_before_concat(g)
    pools = [n for n in g2.nodes() if n.op == "avg_pool2d"]
    assert sorted(n.inputs[0] for n in pools) == ["a", "b", "c"]
    check_equivalent(g, g2, tol=TOL)


def test_other_axes_and_ranks_stay():
    g = Graph()
    a, b = g.add_input("a", TensorType((1, 2, 8, 8))), g.add_input("b", TensorType((1, 2, 8, 8)))
    h = add(g, "h", "cat", (a, b), dim=2)  # along H: pooling mixes the parts
    p = add(
        g,
        "p",
        "max_pool2d",
        (h,),
        kernel_size=(2, 2),
        stride=(2, 2),
        padding=(0, 0),
        dilation=(1, 1),
        ceil_mode=False,
    )
    g.set_outputs(p)
    g2 = pool_before_concat(g)
    assert [n.op for n in g2.nodes()] == ["cat", "max_pool2d"]
    check_equivalent(g, g2, tol=0.0)
