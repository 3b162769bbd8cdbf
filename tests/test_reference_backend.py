"""The reference backend (backends/reference/): a schedule interpreted in numpy, in its
tiled reading and one output element at a time, against PyTorch on seeded inputs; its
function spellings against PyTorch's (NaN and infinities included); and schedules with a
planted bug (a bound, an origin, a guard, a divisor, the accumulator size) are caught,
not silently computed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from fusion_helpers import (
    add,
    add_bn,
    avgpool,
    bn,
    build_chain,
    check_reference,
    hardware,
    maxpool,
    random_inputs,
)

from middleware import index_expr as ix
from middleware.backends import get_backend
from middleware.backends.reference import (
    FUNCTIONS,
    MissingFunction,
    ReferenceBackend,
    ScheduleError,
)
from middleware.backends.reference import functions as ref_functions
from middleware.graph import Graph, TensorType
from middleware.loops import FUNCTIONS as VOCABULARY
from middleware.options import Options
from middleware.passes.schedule import schedule_group


def _names(g: Graph) -> list[str]:
    return [n.name for n in g.nodes()]


def _by_name(g: Graph, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    xs = random_inputs(g, seed)
    by_name = dict(zip(g.inputs, xs, strict=True))
    by_name.update({p: torch.from_numpy(a) for p, a in g.params.items()})
    return by_name, g.evaluate(*xs)


def _run(s, by_name: dict[str, torch.Tensor], per_point: bool = False) -> torch.Tensor:
    k = ReferenceBackend().kernel(s, per_point=per_point)
    return k.fn(*[by_name[v] for v in k.inputs])


def _inception(layout: str) -> Graph:
    """x -> [bn+relu, maxpool 3x3/1 + relu, x] -> cat -> hardtanh (concat slices)."""
    g = Graph()
    x = g.add_input("x", TensorType((2, 5, 7, 6), "float32", layout))
    a = add(g, "relu", [add_bn(g, x)])
    pool = dict(kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1))
    b = add(g, "relu", [add(g, "max_pool2d", [x], **pool, ceil_mode=False)])
    c = add(g, "cat", [a, b, x], dim=1)
    g.set_outputs(add(g, "hardtanh", [c], min_val=-1.0, max_val=1.0))
    return g


# Graphs that exercise each part of a schedule: scratch with halos over many tiles, a
# recomputed window body, averaging divisors, concat slices with guards (nchw tiles one
# channel), a channel shuffle (floordiv/mod indices), a depthwise window with its weight
# vector, a rank-2 output, broadcast operands.
CASES = {
    "scratch_halo": lambda lay: build_chain(
        (2, 5, 11, 9), lay, [bn(), ("relu", {}), maxpool(3, 1, 1)]
    ),
    "recomputed_body": lambda lay: build_chain(
        (1, 4, 9, 8), lay, [bn(), ("relu", {}), maxpool(3, 2, 1)]
    ),
    "avg_exclude_pad_then_pool": lambda lay: build_chain(
        (1, 3, 12, 11), lay, [avgpool(3, 1, 1, cip=False), maxpool(3, 2, 1)]
    ),
    "avg_ceil_include_pad": lambda lay: build_chain(
        (1, 4, 7, 7), lay, [avgpool(3, 2, 1, ceil=True)]
    ),
    "adaptive_max": lambda lay: build_chain(
        (1, 5, 9, 11), lay, [("adaptive_max_pool2d", dict(output_size=(4, 3)))]
    ),
    "mean_flatten": lambda lay: build_chain(
        (2, 9, 3, 3), lay, [("relu", {}), ("mean", dict(dims=(-1, -2), keepdim=False))]
    ),
    "depthwise": lambda lay: build_chain(
        (2, 6, 9, 8),
        lay,
        [
            bn(),
            ("relu", {}),
            (
                "conv2d",
                dict(stride=(2, 2), padding=(1, 1), dilation=(1, 1), groups=6),
                [("param", (6, 1, 3, 3)), ("param", (6,))],
            ),
        ],
    ),
    "broadcast_operands": lambda lay: build_chain(
        (2, 7, 6, 5),
        lay,
        [("mul", {}, [("input", (2, 7, 1, 1))]), ("add", {}, [("param", (7, 1, 1))])],
    ),
    "inception_cat": _inception,
}


@pytest.mark.parametrize("per_point", [False, True], ids=["tiled", "per_point"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_matches_pytorch(case, layout, per_point):
    g = CASES[case](layout)
    # short tiles: many tiles, halos clipped at both borders
    s = schedule_group(g, _names(g), hardware(), tile_rows=2)
    by_name, ref = _by_name(g, seed=7)
    got = _run(s, by_name, per_point)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_shuffle_indices():
    g = Graph()
    x = g.add_input("x", TensorType((2, 6, 5, 4), "float32", "nchw"))
    r = add(g, "reshape", [add(g, "relu", [x])], shape=(2, 2, 3, 5, 4))
    p = add(g, "permute", [r], dims=(0, 2, 1, 3, 4))
    g.set_outputs(add(g, "reshape", [p], shape=(2, 6, 5, 4)))
    s = schedule_group(g, _names(g), hardware())
    by_name, ref = _by_name(g)
    check_reference(s, by_name, ref, atol=0, rtol=0)


def test_build_has_the_generated_kernels_calling_convention():
    g = build_chain((2, 5, 6, 7), "nhwc", [bn(), ("relu", {}), maxpool(2, 2)])
    k = get_backend("reference").build(g, _names(g), Options(), hardware())
    by_name, ref = _by_name(g)
    args = [by_name[v] for v in k.inputs]
    got = k.fn(*args)
    assert got.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    out = torch.empty_like(ref).contiguous(memory_format=torch.channels_last)
    k.out_fn(*args, out)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_units_run_a_plan():
    from middleware.runtime.plan import build_plan

    g = build_chain(
        (2, 5, 9, 7), "nchw", [bn(), ("relu", {}), maxpool(3, 1, 1), ("softmax", dict(dim=1))]
    )
    units = ReferenceBackend().units(g, Options(), hardware(), torch.device("cpu"))
    # the softmax (no loop semantics) splits the group: the rest runs in the reference
    assert [str(u.runs_as) for u in units] == ["generated", "vendor"]
    x = random_inputs(g)
    plan = build_plan(g, torch.device("cpu"), units, plan_memory=True)
    torch.testing.assert_close(plan.run(x), g.evaluate(*x), atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------- the functions
def test_every_function_of_the_vocabulary_is_spelled():
    assert set(VOCABULARY) <= set(FUNCTIONS), set(VOCABULARY) - set(FUNCTIONS)


SPECIAL = [
    np.nan,
    np.inf,
    -np.inf,
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    2.5,
    -3.75,
    1e-8,
    30.0,
    -30.0,
    100.0,
    -100.0,
]

TORCH = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "max": torch.maximum,
    "min": torch.minimum,
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "expm1": torch.expm1,
    "log": torch.log,
    "log1p": torch.log1p,
    "tanh": torch.tanh,
    "erf": torch.erf,
    "sigmoid": torch.sigmoid,
    "sqrt": torch.sqrt,
    "gt": lambda a, b: (a > b).float(),
    "ge": lambda a, b: (a >= b).float(),
    "le": lambda a, b: (a <= b).float(),
    "and": lambda a, b: ((a != 0) & (b != 0)).float(),
    "select": lambda c, a, b: torch.where(c != 0, a, b),
}


@pytest.mark.parametrize("fn", sorted(FUNCTIONS))
def test_function_matches_pytorch(fn):
    arity = {"select": 3}.get(
        fn, 2 if fn in ("add", "sub", "mul", "div", "max", "min", "gt", "ge", "le", "and") else 1
    )
    grids = np.meshgrid(*([np.array(SPECIAL, dtype=np.float32)] * arity), indexing="ij")
    args = [a.reshape(-1) for a in grids]
    got = torch.from_numpy(np.asarray(ref_functions.apply(fn, args)))
    want = TORCH[fn](*[torch.from_numpy(a) for a in args])
    assert got.dtype == torch.float32
    # float32 transcendental functions differ in the last bits; NaN where PyTorch has NaN
    torch.testing.assert_close(got, want, atol=1e-6, rtol=2e-6, equal_nan=True)


@pytest.mark.parametrize("fn", ["max", "min"])
def test_max_min_propagate_nan_in_either_order(fn):
    nan, one = np.float32(np.nan), np.float32(1.0)
    assert np.isnan(ref_functions.apply(fn, [nan, one]))
    assert np.isnan(ref_functions.apply(fn, [one, nan]))


def test_a_missing_function_fails_naming_it(monkeypatch):
    g = build_chain((1, 3, 4, 4), "nchw", [("sigmoid", {})])
    s = schedule_group(g, _names(g), hardware())
    monkeypatch.delitem(ref_functions.FUNCTIONS, "sigmoid")
    by_name, _ = _by_name(g)
    with pytest.raises(MissingFunction, match="'sigmoid'"):
        _run(s, by_name)


# ------------------------------------------------------------ planted schedule bugs
def _pool_schedule(layout: str = "nhwc"):
    g = build_chain((2, 5, 11, 9), layout, [bn(), ("relu", {}), maxpool(3, 1, 1)])
    return g, schedule_group(g, _names(g), hardware(), tile_rows=2)


def _replace_stage(s, i, **changes):
    stages = list(s.stages)
    stages[i] = dataclasses.replace(stages[i], **changes)
    return dataclasses.replace(s, stages=tuple(stages))


def test_the_unplanted_schedules_run():
    g, s = _pool_schedule()
    by_name, ref = _by_name(g)
    torch.testing.assert_close(_run(s, by_name), ref, atol=1e-6, rtol=1e-6)


def test_a_stage_that_stops_one_short_leaves_output_unwritten():
    g, s = _pool_schedule()
    last = s.stages[-1]
    short = dataclasses.replace(last.inner, hi=ix.op("sub", last.inner.hi, ix.Int(1)))
    bad = _replace_stage(s, len(s.stages) - 1, inner=short)
    by_name, _ = _by_name(g)
    with pytest.raises(ScheduleError, match="no stage wrote"):
        _run(bad, by_name)


def test_a_scratch_stage_that_stops_one_short_is_read_unwritten():
    g, s = _pool_schedule("nchw")
    first = s.stages[0]
    (h,) = [lp for lp in first.loops if lp.var == "h"]
    loops = tuple(
        dataclasses.replace(lp, hi=ix.op("sub", lp.hi, ix.Int(1))) if lp is h else lp
        for lp in first.loops
    )
    bad = _replace_stage(s, 0, loops=loops)
    by_name, _ = _by_name(g)
    with pytest.raises(ScheduleError, match="no\\s+earlier stage of this tile wrote"):
        _run(bad, by_name)


def test_a_shifted_scratch_origin_is_caught():
    g, s = _pool_schedule()
    (b,) = [b for b in s.buffers if b.role == "scratch"]
    origin = list(b.origin)
    origin[2] = ix.op("add", origin[2], ix.Int(1))
    buffers = tuple(
        dataclasses.replace(x, origin=tuple(origin)) if x is b else x for x in s.buffers
    )
    by_name, _ = _by_name(g)
    with pytest.raises(ScheduleError, match="outside"):
        _run(dataclasses.replace(s, buffers=buffers), by_name)


def test_a_window_bound_into_the_padding_is_caught():
    g = build_chain((1, 3, 7, 7), "nhwc", [maxpool(3, 2, 1)])
    s = schedule_group(g, _names(g), hardware())
    red = s.stages[0].reduction
    loops = tuple(
        dataclasses.replace(lp, lo=ix.Int(0)) if lp.var == "k_h" else lp for lp in red.loops
    )
    bad = _replace_stage(s, 0, reduction=dataclasses.replace(red, loops=loops))
    by_name, _ = _by_name(g)
    with pytest.raises(ScheduleError, match="reads input buffer"):
        _run(bad, by_name)
    # the same bug in the point loops is caught by the per-point reading
    points = tuple(
        dataclasses.replace(lp, lo=ix.Int(0)) if lp.var == "k_h" else lp for lp in red.point_loops
    )
    bad = _replace_stage(s, 0, reduction=dataclasses.replace(red, point_loops=points))
    with pytest.raises(ScheduleError, match="outside"):
        _run(bad, by_name, per_point=True)


def test_a_point_loop_one_tap_short_gives_a_wrong_result():
    g = build_chain((1, 3, 7, 7), "nchw", [avgpool(3, 2, 1, cip=False)])
    s = schedule_group(g, _names(g), hardware())
    red = s.stages[0].reduction
    points = tuple(
        dataclasses.replace(lp, hi=ix.op("sub", lp.hi, ix.Int(1))) if lp.var == "k_w" else lp
        for lp in red.point_loops
    )
    bad = _replace_stage(s, 0, reduction=dataclasses.replace(red, point_loops=points))
    by_name, ref = _by_name(g)
    torch.testing.assert_close(_run(s, by_name, per_point=True), ref, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(_run(bad, by_name, per_point=True), ref, atol=1e-3)


def test_a_wrong_divisor_gives_a_wrong_result():
    g = build_chain((1, 3, 7, 7), "nchw", [avgpool(3, 2, 1, cip=False)])
    s = schedule_group(g, _names(g), hardware())
    red = s.stages[0].reduction
    bad = _replace_stage(s, 0, reduction=dataclasses.replace(red, divisor=ix.Int(9)))
    by_name, ref = _by_name(g)
    for per_point in (False, True):
        assert not torch.allclose(_run(bad, by_name, per_point), ref, atol=1e-3)


def test_a_dropped_guard_or_cover_is_caught():
    g = _inception("nchw")  # nchw tiles hold one channel: the concat slices are guarded
    s = schedule_group(g, _names(g), hardware())
    guarded = [i for i, st in enumerate(s.stages) if st.guard is not None]
    assert guarded
    by_name, _ = _by_name(g)
    with pytest.raises(ScheduleError):
        _run(_replace_stage(s, guarded[-1], guard=None), by_name)
    # per point: a slice that claims every channel computes channels of another slice
    covered = [i for i, st in enumerate(s.stages) if st.covers is not None]
    with pytest.raises(ScheduleError, match="outside"):
        _run(_replace_stage(s, covered[0], covers=None), by_name, per_point=True)


def test_an_accumulator_too_small_is_caught():
    g = build_chain((1, 3, 7, 9), "nchw", [maxpool(3, 1, 1)])
    s = schedule_group(g, _names(g), hardware())
    by_name, _ = _by_name(g)
    with pytest.raises(ScheduleError, match="acc"):
        _run(dataclasses.replace(s, acc_elems=s.acc_elems - 1), by_name)
