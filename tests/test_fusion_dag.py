"""Generated kernels of small io DAGs against PyTorch (Graph.evaluate), both layouts:
concat (each producer writes straight into its channel slice), concat feeding a pool,
channel shuffle (reshape -> permute -> reshape). Tolerance 1e-5."""

from __future__ import annotations

import pytest
from fusion_helpers import POOL, add, add_bn, check_group, hardware

from middleware.graph import Graph, TensorType
from middleware.passes.schedule import schedule_group


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("dag")


def _graph(shape, layout):
    g = Graph()
    x = g.add_input("x", TensorType(shape, "float32", layout))
    return g, x


def _pool(k, s, p):
    return dict(kernel_size=(k, k), stride=(s, s), padding=(p, p), **POOL)


def inception_like(layout):
    """x -> [bn+relu, maxpool 3x3/1 + relu, x itself] -> cat -> relu."""
    g, x = _graph((2, 5, 7, 6), layout)
    a = add(g, "relu", [add_bn(g, x)])
    b = add(g, "relu", [add(g, "max_pool2d", [x], **_pool(3, 1, 1))])
    c = add(g, "cat", [a, b, x], dim=1)
    g.set_outputs(add(g, "hardtanh", [c], min_val=-1.0, max_val=1.0))
    return g


def cat_then_pool(layout):
    g, x = _graph((1, 3, 9, 8), layout)
    y = g.add_input("y", TensorType((1, 4, 9, 8), "float32", layout))
    c = add(g, "cat", [add(g, "relu", [x]), add(g, "sigmoid", [y])], dim=1)
    g.set_outputs(add(g, "max_pool2d", [c], **_pool(3, 2, 1)))
    return g


def shuffle(layout):
    g, x = _graph((2, 6, 5, 4), layout)
    r = add(g, "reshape", [add(g, "relu", [x])], shape=(2, 2, 3, 5, 4))
    p = add(g, "permute", [r], dims=(0, 2, 1, 3, 4))
    s = add(g, "reshape", [p], shape=(2, 6, 5, 4))
    g.set_outputs(add(g, "add", [s], scalar=1.0))
    return g


def shuffle_cat(layout):
    """ShuffleNet's unit tail: cat(x1, branch(x2)) -> channel shuffle."""
    g, x = _graph((1, 4, 6, 5), layout)
    y = g.add_input("y", TensorType((1, 4, 6, 5), "float32", layout))
    c = add(g, "cat", [x, add(g, "relu", [add_bn(g, y)])], dim=1)
    r = add(g, "reshape", [c], shape=(1, 2, 4, 6, 5))
    p = add(g, "permute", [r], dims=(0, 2, 1, 3, 4))
    g.set_outputs(add(g, "reshape", [p], shape=(1, 8, 6, 5)))
    return g


CASES = {f.__name__: f for f in (inception_like, cat_then_pool, shuffle, shuffle_cat)}


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_dag_matches_pytorch(case, layout, cache):
    check_group(CASES[case](layout), cache, seed=4)


def test_cat_producers_write_into_slices():
    g = inception_like("nhwc")
    s = schedule_group(g, [n.name for n in g.nodes()], hardware())
    # no scratch copy of the concatenated value: each branch is a stage of the output
    assert not [
        b
        for b in s.buffers
        if b.role == "scratch" and b.value.startswith("v") and g.producer(b.value).op == "cat"
    ]
    out = s.outputs[0]
    assert sum(st.target == out for st in s.stages) == 3
