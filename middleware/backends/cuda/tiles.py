"""Shared-memory tiles for window schedules (issue 17): a block loads its input tile plus
halo once, computes the window's pointwise prologue once per loaded element into shared
memory, and every thread then reduces its outputs' windows from shared memory.

The one-thread-per-output kernel (``render.py``'s flat form) reads each input element of a
3x3/2 max-pool once per window that covers it (2.25 times) and recomputes the batch-norm +
ReLU before the pool each time; the tiled form reads the tile's region from global memory
once, coalesced along the contiguous dimension, and computes the prologue once per element.

A schedule takes this form (:func:`tile_plan`) when:

- it has one stage, writing the output, a max or sum reduction over point loops whose tap
  ranges are short (``taps.tap_range``: unrolled loops);
- the reduction's body holds a *staged* subexpression: the largest one that reads one group
  input at one index, constants and per-channel (or per-sample) parameters only (batch-norm
  + ReLU before a pool; the input itself where nothing comes before; the prologue of a
  depthwise convolution, whose tap-dependent weights stay outside it);
- that index keeps n and c (``Var("n")``, ``Var("c")``) and is affine in the output's h/w and
  one tap each, with non-negative coefficients (every pooling window, dilated or strided),
  so the input region a tile of outputs reads is a box;
- the input and the output share one layout, and the box fits the shared-memory budget.

Everything else (concats, adaptive windows whose taps move with the point, elementwise
groups, windows over a stage's value rather than an input) keeps the flat form. Tile shapes:
the output's contiguous dimension whole (or 64 wide), the others chosen to read the fewest
halo elements per output within the budget (:func:`choose_tile`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from ...hardware import Hardware
from ...index_expr import Ix, Var, evaluate, variables
from ...loops import DIMS, Acc, Call, Expr, Load, ParamVec, leaves, substitute
from ...passes.schedule_ir import ORDER, Schedule, Stage
from .taps import tap_range

# The name of the shared tile in the staged body (a Load of this value reads shared memory).
TILE = "__mw_tile__"
# Shared memory per block: at most this many bytes (8 blocks of 256 threads stay resident on
# an SM with 228 KiB; the static limit of a block is 48 KiB).
SMEM_BUDGET = 24 * 1024
# Outputs per tile: at least one per thread of a 256-thread block where the output allows,
# at most this many (more only lengthens the tail of the last wave).
MAX_TILE_OUTPUTS = 2048
# The contiguous dimension's tile, where the output is wider (NCHW rows; NHWC channels).
INNER_TILE = {"nchw": 128, "nhwc": 64}


@dataclasses.dataclass(frozen=True)
class DimMap:
    """How one dim of the staged input's index follows the output: ``lo + a * o + b * k``
    for output coordinate ``o`` and tap ``k`` in ``[kmin, kmax]`` (``b`` 0 without a tap)."""

    lo: int
    a: int
    b: int
    kmin: int
    kmax: int

    def span(self, t: int) -> int:
        """Input elements a tile of ``t`` outputs reads along this dim."""
        return self.a * (t - 1) + self.b * (self.kmax - self.kmin) + 1

    def first(self, o0: str) -> str:
        """C text of the first input coordinate a tile starting at output ``o0`` reads."""
        base = self.lo + self.b * self.kmin
        return f"({self.a} * {o0} + {base})" if self.a != 1 else f"({o0} + {base})"


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """A window schedule's tiled form: ``staged`` (the prologue over ``source``'s element
    (n, c, h, w)) fills a shared box of ``region`` elements per tile of ``tile`` outputs;
    ``stage`` is the output stage whose body reads the box through ``Load(TILE, index)``."""

    source: str  # the group input's value name
    staged: Expr  # over Load(source, (n, c, h, w)) and per-channel params
    stage: Stage  # the output stage, its staged subexpression replaced by the tile load
    index: tuple[Ix, Ix, Ix, Ix]  # the staged input's index in the output's terms
    maps: tuple[DimMap | None, DimMap | None, DimMap | None, DimMap | None]  # None: identity
    tile: tuple[int, int, int, int]
    region: tuple[int, int, int, int]
    order: tuple[int, ...]  # memory order of both the box and the output tile

    @property
    def smem_floats(self) -> int:
        return math.prod(self.region)

    @property
    def tile_outputs(self) -> int:
        return math.prod(self.tile)


def _per_channel(ix: tuple) -> bool:
    """An index that reads the same element at every h, w and tap (a per-channel or
    per-sample constant: the lowered batch-norm's scale and shift, shape (1, C, 1, 1))."""
    return all(variables(i) <= {"n", "c"} for i in ix)


def _staged_index(e: Expr, inputs: set[str]) -> tuple[str, tuple] | None:
    """(input, index) when ``e`` can be staged: it reads one group input at one windowed
    index, and otherwise constants and per-channel parameters or inputs; else None."""
    loads = []
    for x in leaves(e):
        if isinstance(x, Acc):
            return None
        if isinstance(x, ParamVec) and not variables(x.index) <= {"n", "c"}:
            return None
        if isinstance(x, Load):
            if x.value not in inputs:
                return None
            if not _per_channel(tuple(x.index)):
                loads.append(x)
    if not loads:
        return None
    first = loads[0]
    if any(ld.value != first.value or ld.index != first.index for ld in loads[1:]):
        return None
    return first.value, tuple(first.index)


def _largest_staged(e: Expr, inputs: set[str]) -> list[Expr]:
    """The largest stageable subexpressions of ``e`` (outermost first)."""
    if _staged_index(e, inputs) is not None:
        return [e]
    if isinstance(e, Call):
        return [s for a in e.args for s in _largest_staged(a, inputs)]
    return []


def _replace(e: Expr, old: Expr, new: Expr) -> Expr:
    if e == old:
        return new
    if isinstance(e, Call):
        return Call(e.fn, tuple(_replace(a, old, new) for a in e.args))
    return e


def _dim_map(
    ix: Ix, d: int, taps: dict[str, tuple[int, int]], out_size: int
) -> DimMap | None | bool:
    """``ix`` (the staged index along dim ``d``) as a :class:`DimMap`; None for the identity
    (``Var(d)``); False when it is neither (not affine, a tap of another dim, a negative
    coefficient)."""
    name = DIMS[d]
    if ix == Var(name):
        return None
    names = variables(ix)
    ks = [v for v in names if v in taps]
    if names - {name} - set(ks) or len(ks) > 1:
        return False
    k = ks[0] if ks else None
    kmin, kmax = taps[k] if k else (0, 0)

    def at(o: int, kv: int) -> int:
        env = {name: o}
        if k:
            env[k] = kv
        return int(evaluate(ix, env))

    lo = at(0, 0)
    a = at(1, 0) - lo
    b = at(0, 1) - lo if k else 0
    if a < 0 or b < 0:
        return False
    for o, kv in itertools.product({0, 1, 2, 3, out_size - 1}, {kmin, kmax, (kmin + kmax) // 2}):
        if at(o, kv) != lo + a * o + b * kv:
            return False
    return DimMap(lo, a, b, kmin, kmax)


def choose_tile(
    out_shape: tuple[int, int, int, int],
    layout: str,
    maps: tuple,
    budget_floats: int,
) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]] | None:
    """(tile, region): the output tile (n always 1) with the fewest input elements read per
    output whose region fits ``budget_floats``; None when no tile fits."""
    order = ORDER[layout]
    inner = order[-1]

    def sizes(extent: int) -> list[int]:
        out = {extent} | {2**i for i in range(12) if 2**i < extent}
        return sorted(out)

    # the contiguous dim whole (or INNER_TILE wide), narrower only where nothing else fits
    inner_opts = [min(out_shape[inner], INNER_TILE[layout])]
    while inner_opts[-1] > 1:
        inner_opts.append(inner_opts[-1] // 2)
    best = None
    others = [d for d in (1, 2, 3) if d != inner]
    for ti in inner_opts:
        for t_a in sizes(out_shape[others[0]]):
            for t_b in sizes(out_shape[others[1]]):
                tile = [1, 1, 1, 1]
                tile[inner], tile[others[0]], tile[others[1]] = ti, t_a, t_b
                if math.prod(tile) > MAX_TILE_OUTPUTS:
                    continue
                region = tuple(
                    tile[d] if maps[d] is None else maps[d].span(tile[d]) for d in range(4)
                )
                if math.prod(region) > budget_floats:
                    continue
                # input elements loaded per output (halo overhead), then bigger tiles
                key = (
                    round(math.prod(region) / math.prod(tile), 3),
                    -min(math.prod(tile), 256),
                    -math.prod(tile),
                )
                if best is None or key < best[0]:
                    best = (key, tuple(tile), region)
        if best is not None:
            break  # the widest contiguous tile that fits
    return None if best is None else (best[1], best[2])


def tile_plan(s: Schedule, hardware: Hardware) -> TilePlan | None:
    """The tiled form of ``s``, or None when it keeps the flat form (see the module's
    docstring for when)."""
    if len(s.outputs) != 1:
        return None
    out = s.buffer(s.outputs[0])
    finals = [st for st in s.stages if st.target == out.name]
    if len(finals) != 1 or finals[0] is not s.stages[-1]:
        return None
    st = finals[0]
    red = st.reduction
    if st.target != out.name or st.covers is not None or red is None or not red.point_loops:
        return None
    if red.op not in ("max", "sum"):
        return None
    ranges = {d: (0, size - 1) for d, size in zip(DIMS, out.shape, strict=True)}
    taps: dict[str, tuple[int, int]] = {}
    for lp in red.point_loops:
        r = tap_range(lp, {**ranges, **taps})
        if r is None:
            return None
        taps[lp.var] = r
    inputs = {s.buffer(n).value for n in s.inputs}
    body = _inline_pointwise(s, red.body)
    # the epilogue after the reduction too (a residual around a stride-1 pool reads the
    # prologue's buffer at the output point: the tiled kernel computes no such buffer)
    epilogue = _inline_pointwise(s, st.expr)
    if body is None or epilogue is None:
        return None
    candidates = _largest_staged(body, inputs)
    if not candidates or any(c != candidates[0] for c in candidates[1:]):
        return None
    staged = candidates[0]
    found = _staged_index(staged, inputs)
    assert found is not None
    source, index = found
    src = next(b for b in s.buffers if b.value == source and b.role == "input")
    if src.layout != out.layout or len(index) != 4:
        return None
    maps = []
    for d in range(4):
        m = _dim_map(index[d], d, taps, out.shape[d])
        if m is False:
            return None
        if m is None and src.shape[d] != out.shape[d]:
            return None
        maps.append(m)
    if maps[0] is not None or maps[1] is not None or all(m is None for m in maps):
        return None  # windows over h/w only; an identity copy needs no tile
    budget = min(SMEM_BUDGET, hardware.shared_mem_bytes or SMEM_BUDGET) // 4
    chosen = choose_tile(out.shape, out.layout, tuple(maps), budget)
    if chosen is None:
        return None
    tile, region = chosen
    here = Load(source, tuple(Var(d) for d in DIMS))
    staged_here = _replace(staged, Load(source, index), here)
    stage = dataclasses.replace(
        st,
        expr=epilogue,
        reduction=dataclasses.replace(red, body=_replace(body, staged, Load(TILE, index))),
    )
    return TilePlan(source, staged_here, stage, index, tuple(maps), tile, region, ORDER[out.layout])


def _inline_pointwise(s: Schedule, body: Expr) -> Expr | None:
    """``body`` with every load of an earlier stage's value replaced by that stage's
    expression at the load's index (the stages before a stride-1 window, which the schedule
    keeps in a buffer of their own: the tile is that buffer); None when an earlier stage is
    not pointwise over group inputs at its own element (a reduction, a concat's slice, a
    window)."""
    by_value = {s.buffer(st.target).value: st for st in s.stages[:-1]}
    identity = tuple(Var(d) for d in DIMS)
    failed = False

    def inline(x: Expr) -> Expr | None:
        nonlocal failed
        if not isinstance(x, Load) or x.value not in by_value:
            return None
        st = by_value[x.value]
        if st.reduction is not None or st.covers is not None or st.guard is not None:
            failed = True
            return None
        expr = substitute(st.expr, inline)
        for leaf in leaves(expr):
            if isinstance(leaf, Acc):
                failed = True
            if isinstance(leaf, Load) and leaf.index != identity:
                failed |= not _per_channel(tuple(leaf.index))
            if isinstance(leaf, ParamVec) and not variables(leaf.index) <= {"n", "c"}:
                failed = True
        # the stage's element loads follow the window; its per-channel loads stay
        return substitute(
            expr,
            lambda y: (
                Load(y.value, tuple(x.index))
                if isinstance(y, Load) and y.index == identity
                else None
            ),
        )

    out = substitute(body, inline)
    return None if failed else out
