"""Depth-first schedules of I/O-bound groups (backend-neutral).

``schedule_group(graph, nodes, hardware)`` turns a group of io nodes (a chain or small
DAG with one output value) into a frozen :class:`Schedule`:

1. Every node's loop semantics come from ``middleware.loops``. Nodes are gathered into
   *stages*: a stage computes one value into a buffer. Pointwise nodes with a single
   reader are inlined into their reader's expression, also into a window's body when
   the window reads each element only a few times and the expression is cheap (recompute
   instead of a scratch round trip); a window op (pooling, depthwise conv) read at its own
   point by a pointwise node becomes that stage's reduction (its epilogue). Everything else
   (a value read through a wide window, or read twice) is materialised in a per-tile
   scratch buffer.
2. The final output is tiled (tile sizes and thread/SIMD mapping from ``Hardware``). The
   region of every scratch value and input a tile needs is the image of the tile under the
   access relations (islpy maps), pulled backwards stage by stage, halos included.
3. Loop bounds, window ranges, guards, scratch origins and extents, and the element
   counts of averaging windows are read off these isl sets (``middleware.isl_helpers``)
   as index trees (``middleware.index_expr``: isl's AST builder decides the ``min``,
   ``max``, ``floordiv`` and select structure); the loads' isl-syntax index text of
   ``middleware.loops`` becomes index trees too. Each backend prints or evaluates them.

The records and their conventions are in ``passes/schedule_ir.py``.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Sequence

import islpy as isl

from .. import index_expr as ix
from .. import isl_helpers as ih
from ..graph import Graph, TensorType
from ..hardware import Hardware
from ..loops import (
    DIMS,
    Acc,
    Call,
    Expr,
    Load,
    NotFusable,
    ParamVec,
    leaves,
    logical4,
    substitute,
)
from .schedule_ir import ORDER, Buffer, Loop, Reduction, Schedule, Stage, Tiling
from .stages import (
    StageDraft,
    group_io,
    plan_stages,
    stage_loads,
    valid_constraints,
    window_constraints,
)

_ISL_LOCK = threading.RLock()
# Outputs smaller than this many elements run their tiles on one thread.
PARALLEL_MIN_ELEMENTS = 1 << 15


# --------------------------------------------------------------------- helpers
def c_ident(name: str) -> str:
    """A C identifier from a layer or value name (``layer1.0.bn1`` -> ``layer1_0_bn1``)."""
    s = re.sub(r"[^0-9a-zA-Z_]", "_", name)
    if not s or s[0].isdigit():
        s = "v_" + s
    return s


def _unique_idents(values: Sequence[str]) -> dict[str, str]:
    """One distinct C identifier per value: ``c_ident`` maps ``a.b`` and ``a_b`` alike, and
    two buffers of one kernel must never share a name."""
    ids: dict[str, str] = {}
    taken: set[str] = set()
    for v in values:
        if v in ids:
            continue
        base = ident = c_ident(v)
        k = 1
        while ident in taken:
            ident, k = f"{base}_{k}", k + 1
        ids[v] = ident
        taken.add(ident)
    return ids


class _Builder:
    def __init__(self, graph: Graph, names: Sequence[str], hw: Hardware) -> None:
        self.graph = graph
        self.names = list(names)
        self.hw = hw
        ins, outs = group_io(graph, names)
        if len(outs) != 1:
            raise NotFusable(f"group has {len(outs)} values read outside it ({outs}); one needed")
        self.ins, self.out = ins, outs[0]
        self.drafts = plan_stages(graph, names, self.out)
        loaded = {x.value for d in self.drafts for x, _ in stage_loads(d)}
        self.ins = [v for v in ins if v in loaded]
        ins = self.ins
        out_t = graph.values[self.out]
        self.out4 = logical4(out_t)
        lay = out_t.layout if out_t.rank == 4 else None
        if lay is None:
            lay = next((graph.values[v].layout for v in ins if graph.values[v].rank == 4), "nchw")
        self.layout = lay
        self.inner_dim = ORDER[lay][-1]
        self.value_ids = _unique_idents(ins + [d.value for d in self.drafts])

    # ---------------------------------------------------------------- regions
    def regions(self, tiling: Tiling) -> dict[str, isl.Set]:
        """Region (isl set over the tile origins) of each stage's value, output first."""
        tile = ih.tile_set("T", DIMS, self.out4, tiling.sizes, tiling.params)
        regions: dict[str, isl.Set] = {self.out: tile}
        for d in reversed(self.drafts):
            reg = self.draft_region(regions[d.value], d).set_tuple_name("S")
            windows = d.red.windows if d.red is not None else ()
            for load, through in stage_loads(d):
                shape = logical4(self.graph.values[load.value])
                cons = window_constraints(windows) if through else []
                exists = [w.var for w in windows] if through else []
                cons += valid_constraints(load.index, shape)
                acc = ih.access_map("S", DIMS, "T", load.index, exists, cons)
                img = ih.name_dims(ih.image(reg, acc), DIMS)
                prev = regions.get(load.value)
                regions[load.value] = img if prev is None else prev.union(img).coalesce()
        return regions

    @staticmethod
    def draft_region(region: isl.Set, d: StageDraft) -> isl.Set:
        """The part of its value's region a stage computes (a cat slice: its channels)."""
        if d.channels is None:
            return region
        first, count = d.channels
        name = region.get_tuple_name()
        sl = isl.Set(f"{{ {name}[n, c, h, w] : {first} <= c < {first + count} }}")
        region, sl = ih.align_params(region, sl)
        return region.intersect(sl)

    # ------------------------------------------------------------------ tiling
    def tiling_for(self, rows: int) -> Tiling:
        n, c, h, w = self.out4
        if self.layout == "nhwc":
            params = ("t_n", "", "t_h" if rows < h else "", "")
            sizes = (1, c, min(rows, h), w)
        else:
            params = ("t_n", "t_c" if c > 1 else "", "t_h" if rows < h else "", "")
            sizes = (1, 1, min(rows, h), w)
        # small outputs run on one thread: waking the others costs more than they save
        threads = self.hw.cores if n * c * h * w >= PARALLEL_MIN_ELEMENTS else 1
        return Tiling(params, sizes, self.out4, threads, 0)  # type: ignore[arg-type]

    def scratch_bytes(self, regions: dict[str, isl.Set]) -> int:
        total = 0
        for d in self._values():
            if d.value == self.out:
                continue
            ext = 1
            for k in range(4):
                ext *= max(1, ih.max_extent(regions[d.value], k))
            total += ext * 4
        return total

    def _values(self) -> list[StageDraft]:
        """One draft per materialised value (the first slice of a cat)."""
        seen, out = set(), []
        for d in self.drafts:
            if d.value not in seen:
                seen.add(d.value)
                out.append(d)
        return out

    def choose_tiling(self, rows: int | None = None) -> tuple[Tiling, dict[str, isl.Set]]:
        """Tallest row block whose scratch fits half the L2 and that still gives every
        core several tiles (load balance); ``rows`` forces the block height."""
        n, c, h, w = self.out4
        if rows is not None:
            t = self.tiling_for(rows)
            regs = self.regions(t)
            return dataclasses.replace(t, scratch_bytes=self.scratch_bytes(regs)), regs
        budget = self.hw.l2_bytes // 2
        per_tile_cols = n * (1 if self.layout == "nhwc" else c)
        best = None
        for rows in (64, 32, 16, 8, 4, 2, 1):
            if rows > h and rows != 1 and best is not None:
                continue
            t = self.tiling_for(rows)
            tiles = per_tile_cols * -(-h // t.sizes[2])
            regs = self.regions(t)
            sb = self.scratch_bytes(regs)
            best = (dataclasses.replace(t, scratch_bytes=sb), regs)
            if sb <= budget and tiles >= 4 * self.hw.cores:
                break
        assert best is not None
        return best

    # ----------------------------------------------------------------- bounds
    def context(self, tiling: Tiling) -> str:
        ps = [p for p in tiling.params if p]
        cons = [f"0 <= {p} < {e}" for p, e in zip(tiling.params, tiling.extents, strict=True) if p]
        return f"[{', '.join(ps)}] -> {{ : {' and '.join(cons) or 'true'} }}"

    def stage_loops(self, region: isl.Set) -> tuple[tuple[Loop, ...], Loop]:
        order = ORDER[self.layout]
        b = ih.ix_bounds(region, order)
        loops = tuple(Loop(DIMS[d], lo, hi) for d, (lo, hi) in zip(order[:-1], b[:-1], strict=True))
        d = order[-1]
        return loops, Loop(DIMS[d], b[-1][0], b[-1][1], simd=True)

    def reduction(self, d: StageDraft, region: isl.Set, ctx: str) -> Reduction:
        red = d.red
        assert red is not None and red.body is not None
        windows = red.windows
        order = ORDER[self.layout]
        in_value = d.window_value or next(x.value for x, through in stage_loads(d) if through)
        in_shape = logical4(self.graph.values[in_value])
        out4 = logical4(self.graph.values[d.value])  # the stage's own value
        cons = window_constraints(windows)
        for win in windows:
            cons.append(f"0 <= {win.input_index()} < {in_shape[win.dim]}")
        kvars = [w.var for w in windows]
        dom = isl.Set(f"{{ S[{', '.join(DIMS)}, {', '.join(kvars)}] : {' and '.join(cons)} }}")
        ext = region.set_tuple_name("S").insert_dims(isl.dim_type.set, 4, len(kvars))
        for i, k in enumerate(kvars):
            ext = ext.set_dim_name(isl.dim_type.set, 4 + i, k)
        ext = ext.set_tuple_name("S")
        dom, ext = ih.align_params(dom, ext)
        full = ih.with_params(ext.intersect(dom), ctx)
        inner = order[-1]
        inner_win = [i for i, w in enumerate(windows) if w.dim == inner]
        other_win = [i for i, w in enumerate(windows) if w.dim != inner]
        scan = list(order[:-1]) + [4 + i for i in other_win] + [4 + i for i in inner_win] + [inner]
        bounds = ih.ix_bounds(full, scan)
        names = [DIMS[i] if i < 4 else kvars[i - 4] for i in scan]
        loops = tuple(
            Loop(nm, lo, hi) for nm, (lo, hi) in zip(names[3:-1], bounds[3:-1], strict=True)
        )
        inner_loop = Loop(names[-1], bounds[-1][0], bounds[-1][1], simd=True)
        divisor: ix.Ix | None = None
        if red.divisor.startswith("const:"):
            divisor = ix.Int(int(red.divisor.split(":", 1)[1]))
        elif red.divisor:
            counts: list[ix.Ix] = []
            for win in windows:
                o = DIMS[win.dim]
                c = re.sub(r"\bk\b", win.var, re.sub(r"\bo\b", o, win.constraint))
                at = win.input_index()
                if red.divisor == "include_pad":
                    valid = f"{win.padded_lo} <= {at} < {win.padded_hi}"
                else:
                    valid = f"0 <= {at} < {in_shape[win.dim]}"
                # over the output coordinate only (no tile origin): one-thread-per-output
                # backends use it as it is
                inside = f"0 <= {o} < {out4[win.dim]}"
                ks = isl.Set(f"[{o}] -> {{ [{win.var}] : {c} and {valid} and {inside} }}")
                lo, hi = ks.dim_min(0), ks.dim_max(0)
                span = ih.ix_of(hi.sub(lo))
                counts.append(
                    ix.Int(span.value + 1)
                    if isinstance(span, ix.Int)
                    else ix.op("add", span, ix.Int(1))
                )
            divisor = _product(counts)
        return Reduction(
            red.reduce,
            red.init,
            _structured(red.body),
            loops,
            inner_loop,
            divisor,
            self.point_loops(dom, kvars, out4),
        )

    @staticmethod
    def point_loops(dom: isl.Set, kvars: Sequence[str], out4: Sequence[int]) -> tuple[Loop, ...]:
        """The window loops of one output point: ``dom`` (output point and window
        variables, window and input constraints) inside the output, scanned with the
        output coordinates outermost, so the window bounds depend on them only."""
        inside = " and ".join(f"0 <= {d} < {e}" for d, e in zip(DIMS, out4, strict=True))
        box = isl.Set(f"{{ S[{', '.join(DIMS)}, {', '.join(kvars)}] : {inside} }}")
        full = dom.intersect(box)
        bounds = ih.ix_bounds(full, range(4 + len(kvars)))
        return tuple(Loop(k, lo, hi) for k, (lo, hi) in zip(kvars, bounds[4:], strict=True))

    # ------------------------------------------------------------------ build
    def build(self, name: str, rows: int | None = None) -> Schedule:
        tiling, regions = self.choose_tiling(rows)
        ctx = self.context(tiling)
        buffers: list[Buffer] = []
        g = self.graph
        for v in self.ins:
            t = g.values[v]
            s4 = logical4(t)
            buffers.append(
                Buffer(self.value_ids[v], v, "input", s4, t.shape, _mem_layout(t), _ZERO4, s4)  # type: ignore[arg-type]
            )
        for d in self._values():
            t = g.values[d.value]
            s4 = logical4(t)
            if d.value == self.out:
                buffers.append(
                    Buffer(
                        self.value_ids[d.value],
                        d.value,
                        "output",
                        s4,
                        t.shape,
                        _mem_layout(t),
                        _ZERO4,
                        s4,
                    )  # type: ignore[arg-type]
                )
                continue
            reg = ih.with_params(regions[d.value], ctx)
            origin = tuple(ih.ix_of(reg.dim_min(k), reg.params()) for k in range(4))
            extent = tuple(max(1, ih.max_extent(reg, k)) for k in range(4))
            buffers.append(
                Buffer(
                    self.value_ids[d.value],
                    d.value,
                    "scratch",
                    s4,
                    t.shape,
                    self.layout,
                    origin,
                    extent,
                )  # type: ignore[arg-type]
            )
        stages = []
        acc = 1
        for d in self.drafts:
            reg = ih.with_params(self.draft_region(regions[d.value], d), ctx)
            reg = reg.set_tuple_name("S")
            loops, inner = self.stage_loops(reg)
            red = self.reduction(d, reg, ctx) if d.red is not None else None
            if red is not None:
                acc = max(acc, ih.max_extent(reg, ORDER[self.layout][-1]))
            label = " + ".join(g.node(n).source or n for n in d.nodes)
            guard = ih.ix_guard(reg, isl.Set(ctx))
            stages.append(
                Stage(
                    label,
                    tuple(d.nodes),
                    self.value_ids[d.value],
                    loops,
                    inner,
                    _structured(d.expr),
                    red,
                    guard,
                    _channel_range(d.channels),
                )
            )
        params: dict[str, ParamVec] = {}
        for st in stages:
            exprs = [st.expr] + ([st.reduction.body] if st.reduction is not None else [])
            for e in exprs:
                for x in leaves(e):
                    if isinstance(x, ParamVec):
                        params.setdefault(x.name, x)
        layers = tuple(self.names)
        desc = describe(g, self.names, self.ins, self.out)
        return Schedule(
            name=name,
            layers=layers,
            ops=tuple(g.node(n).op for n in self.names),
            layout=self.layout,
            buffers=tuple(buffers),
            inputs=tuple(self.value_ids[v] for v in self.ins),
            outputs=(self.value_ids[self.out],),
            params=tuple(params.values()),
            stages=tuple(stages),
            tiling=tiling,
            acc_elems=acc,
            simd_floats=self.hw.simd_floats,
            description=desc,
        )


_ZERO4 = (ix.Int(0),) * 4


def _structured(expr: Expr) -> Expr:
    """``expr`` with the isl-syntax text of its load and parameter indices as index trees
    (what a :class:`Schedule` carries)."""

    def leaf(x: Expr) -> Expr | None:
        if isinstance(x, Load):
            return Load(x.value, tuple(ih.ix_index(i) for i in x.index))  # type: ignore[arg-type]
        if isinstance(x, ParamVec):
            return ParamVec(x.name, x.data, ih.ix_index(x.index))  # type: ignore[arg-type]
        return None

    return substitute(expr, leaf)


def _product(factors: Sequence[ix.Ix]) -> ix.Ix:
    """The product of ``factors`` with its constant factors multiplied out."""
    const = 1
    rest: list[ix.Ix] = []
    for f in factors:
        if isinstance(f, ix.Int):
            const *= f.value
        else:
            rest.append(f)
    if const != 1 or not rest:
        rest.insert(0, ix.Int(const))
    return rest[0] if len(rest) == 1 else ix.Op("mul", tuple(rest))


def _channel_range(channels: tuple[int, int] | None) -> ix.Ix | None:
    """``first <= c <= first + count - 1`` (None: all channels)."""
    if channels is None:
        return None
    first, count = channels
    c = ix.Var("c")
    upper = ix.op("le", c, ix.Int(first + count - 1))
    return upper if first == 0 else ix.op("and", ix.op("le", ix.Int(first), c), upper)


def _mem_layout(t: TensorType) -> str:
    return t.layout if t.rank == 4 else "nchw"


def describe(graph: Graph, names: Sequence[str], ins: Sequence[str], out: str) -> str:
    """Readable lines: every layer with its op and output type, the inputs and the output."""
    lines = [f"input  {v}: {graph.values[v]}" for v in ins]
    for n in names:
        node = graph.node(n)
        src = f" ({node.source})" if node.source and node.source != n else ""
        lines.append(
            f"{node.outputs[0]} = {node.op}({', '.join(node.inputs)}){src}: "
            f"{graph.values[node.outputs[0]]}"
        )
    lines.append(f"output {out}: {graph.values[out]}")
    return "\n".join(lines)


def group_name(graph: Graph, names: Sequence[str]) -> str:
    """A readable kernel name: ``g<group>_<op>_<op>...`` (ops of the group, shortened)."""
    first = graph.node(names[0])
    gid = f"g{first.group}" if first.group is not None else "g"
    ops = "_".join(graph.node(n).op for n in names)
    if len(ops) > 60:
        ops = ops[:60].rstrip("_")
    return c_ident(f"{gid}_{ops}")


def schedule_group(
    graph: Graph, names: Sequence[str], hardware: Hardware, tile_rows: int | None = None
) -> Schedule:
    """The depth-first schedule of the io group ``names`` (node names in topological order).

    Raises :class:`~middleware.loops.NotFusable` with the reason when the group cannot be
    generated (an op without loop semantics, several outputs, an unsupported layout).
    ``tile_rows`` forces the height of a tile in output rows (else chosen from the caches).
    """
    if not names:
        raise NotFusable("empty group")
    for n in names:
        node = graph.node(n)
        for v in node.inputs + node.outputs:
            if graph.values[v].dtype != "float32":
                raise NotFusable(f"value {v} is {graph.values[v].dtype}")
    with _ISL_LOCK:  # islpy's one shared context is not thread-safe
        b = _Builder(graph, names, hardware)
        return b.build(group_name(graph, names), tile_rows)


__all__ = [
    "Acc",
    "Buffer",
    "Call",
    "Loop",
    "Reduction",
    "Schedule",
    "Stage",
    "Tiling",
    "schedule_group",
]
