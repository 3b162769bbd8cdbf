"""Schedules of io groups: stage formation (inlining, materialisation), regions pulled
backwards through the access relations (halos), isl loop bounds, tiling from Hardware."""

from __future__ import annotations

import dataclasses

import islpy as isl
import pytest
from fusion_helpers import add, avgpool, bn, build_chain, hardware, maxpool

from middleware import index_expr as ix
from middleware import isl_helpers as ih
from middleware.graph import Graph, TensorType
from middleware.loops import Acc, Load, NotFusable, ParamVec, leaves
from middleware.passes.schedule import schedule_group


def _names(g):
    return [n.name for n in g.nodes()]


def test_pointwise_chain_is_one_stage():
    g = build_chain((2, 5, 6, 7), "nhwc", [bn(), ("relu", {}), ("add", dict(scalar=1.0))])
    s = schedule_group(g, _names(g), hardware())
    assert len(s.stages) == 1
    assert s.stages[0].nodes == tuple(_names(g))
    assert not [b for b in s.buffers if b.role == "scratch"]
    # BN statistics are folded: the kernel reads only x
    assert [s.buffer(n).value for n in s.inputs] == ["x"]


def test_pool_reads_materialised_scratch_with_halo():
    # a 3x3/1 window reads each element 9 times: its producer is materialised, not recomputed
    g = build_chain((2, 8, 32, 16), "nhwc", [bn(), ("relu", {}), maxpool(3, 1, 1)])
    s = schedule_group(g, _names(g), hardware(), tile_rows=4)
    assert [st.nodes for st in s.stages] == [tuple(_names(g)[:2]), (_names(g)[2],)]
    (scratch,) = [b for b in s.buffers if b.role == "scratch"]
    # 4 pooled rows of a 3x3/1 window need 4+2 = 6 input rows; full width, all channels
    assert scratch.extent == (1, 8, 6, 16)
    assert s.tiling.sizes[2] == 4 and s.tiling.params[2] == "t_h"
    # the first row of the region is clipped at the top border (from isl, not by hand)
    assert ix.evaluate(scratch.origin[2], {"t_h": 0}) == 0
    assert ix.evaluate(scratch.origin[2], {"t_h": 8}) == 7
    assert scratch.origin[1] == ix.Int(0)


def test_cheap_producer_is_recomputed_through_a_sparse_window():
    # 3x3/2 reads each element 2.25 times: batch-norm + ReLU go into the window's body
    g = build_chain((2, 8, 32, 16), "nhwc", [bn(), ("relu", {}), maxpool(3, 2, 1)])
    s = schedule_group(g, _names(g), hardware(), tile_rows=4)
    (st,) = s.stages
    assert st.nodes == tuple(_names(g))
    assert not [b for b in s.buffers if b.role == "scratch"]
    assert [s.buffer(n).value for n in s.inputs] == ["x"]
    assert st.reduction is not None and "x" in repr(st.reduction.body)


def test_expensive_producer_is_not_recomputed():
    g = build_chain((2, 8, 32, 16), "nhwc", [("sigmoid", {}), maxpool(3, 2, 1)])
    s = schedule_group(g, _names(g), hardware(), tile_rows=4)
    assert len(s.stages) == 2
    assert len([b for b in s.buffers if b.role == "scratch"]) == 1


def test_epilogue_absorbs_pool():
    g = build_chain((1, 4, 8, 8), "nchw", [maxpool(2, 2), ("relu", {})])
    s = schedule_group(g, _names(g), hardware())
    (st,) = s.stages
    assert st.reduction is not None and st.reduction.op == "max"
    assert st.expr != Acc()  # relu applied to the accumulator at the store


def test_window_bounds_come_from_isl():
    g = build_chain((1, 2, 7, 7), "nhwc", [maxpool(3, 2, 1)])
    s = schedule_group(g, _names(g), hardware())
    red = s.stages[0].reduction
    kh = next(lp for lp in red.loops if lp.var == "k_h")
    # top row: k_h starts at 1 (row -1 is padding); the bound depends on the output row
    assert ix.variables(kh.lo) & {"h", "t_h"}
    assert [ix.evaluate(kh.lo, {"h": h, "t_h": h}) for h in range(4)] == [1, 0, 0, 0]
    # bottom row 3 reads rows 5, 6 (row 7 is padding)
    assert [ix.evaluate(kh.hi, {"h": h, "t_h": h}) for h in range(4)] == [2, 2, 2, 1]


def test_tile_rows_follow_l2_size():
    g = build_chain((2, 64, 64, 64), "nhwc", [bn(), ("relu", {}), maxpool(3, 1, 1)])
    small = dataclasses.replace(hardware(), l2_bytes=256 * 1024)
    big = dataclasses.replace(hardware(), l2_bytes=8 * 1024 * 1024)
    s_small = schedule_group(g, _names(g), small)
    s_big = schedule_group(g, _names(g), big)
    assert s_small.tiling.scratch_bytes <= 128 * 1024
    assert s_small.tiling.sizes[2] < s_big.tiling.sizes[2]
    assert s_small.tiling.threads == small.cores


def test_small_outputs_run_on_one_thread():
    g = build_chain((1, 3, 4, 4), "nchw", [("relu", {})])
    assert schedule_group(g, _names(g), hardware()).tiling.threads == 1


def test_regions_by_isl_image():
    tile = ih.tile_set("T", "nchw", (1, 1, 4, 5), (1, 1, 2, 5), ("", "", "t_h", ""))
    acc = ih.access_map(
        "T",
        "nchw",
        "X",
        ("n", "c", "2*h + k - 1", "w"),
        ["k"],
        ["0 <= k < 3", "0 <= 2*h + k - 1 < 8"],
    )
    img = ih.name_dims(ih.image(tile, acc), "nchw")
    fixed = img.intersect_params(isl.Set("[t_h] -> { : t_h = 2 }"))
    assert fixed.dim_min_val(2).to_python() == 3 and fixed.dim_max_val(2).to_python() == 7
    assert ih.max_extent(ih.with_params(img, "[t_h] -> { : 0 <= t_h < 4 }"), 2) == 5


@pytest.mark.parametrize(
    "steps,why",
    [
        ([("softmax", dict(dim=1))], "no loop semantics"),
        ([("reshape", dict(shape=(2, 30)))], "moves elements"),
    ],
)
def test_not_fusable_says_why(steps, why):
    g = build_chain((2, 5, 3, 2), "nchw", steps)
    with pytest.raises(NotFusable, match=why):
        schedule_group(g, _names(g), hardware())


def test_avgpool_divisor_is_per_window():
    g = build_chain((1, 3, 5, 5), "nhwc", [avgpool(3, 2, 1, cip=False)])
    red = schedule_group(g, _names(g), hardware()).stages[0].reduction
    # 3x3/2 window, padding 1, on 5x5, padding not counted: 2x2 at a corner, 3x3 inside
    assert ix.variables(red.divisor) <= {"h", "w"}
    assert ix.evaluate(red.divisor, {"h": 0, "w": 0}) == 4
    assert ix.evaluate(red.divisor, {"h": 1, "w": 0}) == 6
    assert ix.evaluate(red.divisor, {"h": 1, "w": 1}) == 9


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_point_loops_visit_the_taps_of_one_output(layout):
    # 3x3/2 window, padding 1, on 7x6: output 4x3; the taps inside the input only
    g = build_chain((1, 2, 7, 6), layout, [maxpool(3, 2, 1)])
    red = schedule_group(g, _names(g), hardware(), tile_rows=2).stages[0].reduction
    assert [lp.var for lp in red.point_loops] == ["k_h", "k_w"]
    for lp in red.point_loops:
        assert ix.variables(lp.lo) | ix.variables(lp.hi) <= {"n", "c", "h", "w", "k_h"}
    kh, kw = red.point_loops
    for h in range(4):
        for w in range(3):
            env = {"n": 0, "c": 1, "h": h, "w": w}
            taps = {
                (a, b)
                for a in range(ix.evaluate(kh.lo, env), ix.evaluate(kh.hi, env) + 1)
                for b in range(
                    ix.evaluate(kw.lo, {**env, "k_h": a}), ix.evaluate(kw.hi, {**env, "k_h": a}) + 1
                )
            }
            want = {
                (a, b)
                for a in range(3)
                for b in range(3)
                if 0 <= 2 * h + a - 1 < 7 and 0 <= 2 * w + b - 1 < 6
            }
            assert taps == want, (h, w)


def test_loads_and_params_are_index_trees():
    g = build_chain((1, 4, 6, 6), "nchw", [bn(), maxpool(3, 2, 1)])
    s = schedule_group(g, _names(g), hardware())
    (st,) = s.stages
    loads = [x for x in leaves(st.reduction.body) if isinstance(x, Load)]
    params = [x for x in leaves(st.reduction.body) if isinstance(x, ParamVec)]
    assert loads and params
    for x in loads:
        assert all(isinstance(i, (ix.Var, ix.Int, ix.Op)) for i in x.index)
    assert ix.evaluate(loads[0].index[2], {"h": 2, "k_h": 0}) == 3
    assert all(p.index == ix.Var("c") for p in params)
    for b in s.buffers:
        assert all(isinstance(o, (ix.Var, ix.Int, ix.Op)) for o in b.origin)


def test_concat_slices_say_which_channels_they_cover():
    g = Graph()
    x = g.add_input("x", TensorType((1, 3, 5, 4), "float32", "nchw"))
    y = g.add_input("y", TensorType((1, 4, 5, 4), "float32", "nchw"))
    g.set_outputs(add(g, "cat", [add(g, "relu", [x]), add(g, "sigmoid", [y])], dim=1))
    s = schedule_group(g, _names(g), hardware())
    covers = [st.covers for st in s.stages]
    assert len(covers) == 2
    assert [[c for c in range(7) if ix.evaluate(cv, {"c": c})] for cv in covers] == [
        [0, 1, 2],
        [3, 4, 5, 6],
    ]
