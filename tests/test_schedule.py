"""Schedules of io groups: stage formation (inlining, materialisation), regions pulled
backwards through the access relations (halos), isl loop bounds, tiling from Hardware."""

from __future__ import annotations

import dataclasses

import islpy as isl
import pytest
from fusion_helpers import avgpool, bn, build_chain, hardware, maxpool
from middleware.passes.schedule import schedule_group

from middleware import isl_helpers as ih
from middleware.loops import Acc, NotFusable


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
    assert "t_h" in scratch.origin[2]


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
    # top row: k_h starts at 1 (row -1 is padding); the guard depends on the output row
    assert "h" in kh.lo or "t_h" in kh.lo


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
    assert red.divisor and ("h" in red.divisor or "t_h" in red.divisor)
