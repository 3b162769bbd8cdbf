"""Render a :class:`~middleware.passes.schedule.Schedule` to OpenMP C.

The structure lives in ``templates/group.c.j2`` (rendered with ``StrictUndefined``); the
index arithmetic and expression text come from the small helpers below: the schedule's
index trees (bounds, guards, origins, indices) are printed with ``index_expr.to_c``.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jinja2

from ...index_expr import Ix, Op, Var, to_c
from ...loops import DIMS, Expr, Load, ParamVec
from ...passes.schedule import Buffer, Loop, Schedule, Stage
from .cfuncs import C_FUNCS, ISPC_FUNCS, SCALAR_HELPERS, c_expr, c_float
from .cstage import StageWriter
from .transpose import layout_copy, render_transpose
from .vec512 import HELPERS as VEC_HELPERS
from .vec512 import VecExpr
from .window import PREFETCH_HINT

TEMPLATES = Path(__file__).parent / "templates"


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
        lstrip_blocks=False,
    )
    env.globals["scalar_helpers"] = SCALAR_HELPERS
    return env


# Every identifier taken from the user's graph (value and layer names) gets its own
# namespace: buffers ``v_<name>``, constant vectors ``p_<name>``, scratch origins
# ``o<dim>_v_<name>``. Everything else a kernel declares (loop variables n, c, h, w,
# k_h, k_w, tile origins t_*, acc, acc0, acc_v, the helpers min/max/floord/mw_*, C and
# ISPC keywords, libc and math functions) starts with none of these prefixes, so a module
# named ``c``, ``acc`` or ``expf`` can neither shadow a loop variable nor a function.
_NOT_IDENT = re.compile(r"[^0-9A-Za-z_]")


def buffer_ident(name: str) -> str:
    """The C identifier of the schedule's buffer ``name`` (a user-derived value name)."""
    return "v_" + _NOT_IDENT.sub("_", name)


def param_ident(name: str) -> str:
    """The C identifier of the constant vector ``name`` (derived from a layer name)."""
    return "p_" + _NOT_IDENT.sub("_", name)


def origin_ident(buf: Buffer, dim: int) -> str:
    """The C identifier of a scratch buffer's first index along logical dim ``dim``."""
    return f"o{DIMS[dim]}_{buffer_ident(buf.name)}"


def comment(text: str) -> str:
    """``text`` safe inside a C comment (user names may contain ``*/``)."""
    return text.replace("*/", "* /").replace("/*", "/ *")


_SIMPLE = re.compile(r"^\(?([A-Za-z_][A-Za-z_0-9]*|-?\d+)\)?$")


def _tidy(x: Ix) -> str:
    """C text of the index tree ``x``, parenthesised unless a name, a number, a call or a
    select (which ``to_c`` parenthesises itself)."""
    text = to_c(x)
    if _SIMPLE.match(text) or (isinstance(x, Op) and x.op in _ATOMIC):
        return text
    return f"({text})"


_ATOMIC = frozenset({"min", "max", "floordiv", "select"})


_DIM_VARS = tuple(Var(d) for d in DIMS)


def address(buf: Buffer, index: tuple[Ix, ...]) -> str:
    """Element offset of ``index`` (logical n, c, h, w index trees) in ``buf``."""
    terms = []
    strides = buf.strides
    for d in range(4):
        if buf.extent[d] == 1:
            continue
        ix = _tidy(index[d])
        if buf.role == "scratch":
            ix = f"({ix} - {origin_ident(buf, d)})"
        terms.append(ix if strides[d] == 1 else f"{ix} * {strides[d]}")
    return " + ".join(terms) or "0"


class _Ctx:
    def __init__(self, s: Schedule, table: dict[str, str] = C_FUNCS) -> None:
        self.s = s
        self.table = table
        self.by_value = {b.value: b for b in s.buffers}

    def load(self, x: Load) -> str:
        b = self.by_value[x.value]
        return f"{buffer_ident(b.name)}[{address(b, x.index)}]"

    def expr(self, e: Expr) -> str:
        return c_expr(e, self.load, table=self.table, param=self.param)

    @staticmethod
    def param(p: ParamVec) -> str:
        return f"{param_ident(p.name)}[{to_c(p.index)}]"  # type: ignore[arg-type]

    def store(self, st: Stage) -> str:
        b = self.s.buffer(st.target)
        return f"{buffer_ident(b.name)}[{address(b, _DIM_VARS)}] = {self.expr(st.expr)}"

    def accumulate(self, st: Stage) -> str:
        red = st.reduction
        assert red is not None
        a = f"acc[{red.inner.var} - acc0]"
        body = self.expr(red.body)
        if red.op == "max":
            return self.table["max"].format(a, body)
        return f"{a} + {body}"

    def acc_value(self, st: Stage) -> str:
        red = st.reduction
        assert red is not None
        a = f"acc[{st.inner.var} - acc0]"
        if red.divisor is not None:
            return f"{a} / (float)({to_c(red.divisor)})"
        return a


def open_loops(loops: tuple[Loop, ...], depth: int, int_type: str = "int") -> str:
    """One ``for`` line per loop (``int_type``: "uniform int" in ISPC), indented."""
    lines = []
    for i, lp in enumerate(loops):
        pad = "  " * (depth + i)
        lo, hi = _tidy(lp.lo), _tidy(lp.hi)
        lines.append(f"{pad}for ({int_type} {lp.var} = {lo}; {lp.var} <= {hi}; ++{lp.var}) {{")
    return "\n".join(lines)


def close_loops(loops: tuple[Loop, ...], depth: int) -> str:
    return "\n".join("  " * (depth + i) + "}" for i in reversed(range(len(loops))))


def param_text(p: ParamVec, per_line: int = 6) -> str:
    vals = [c_float(v) for v in p.data]
    rows = [", ".join(vals[i : i + per_line]) for i in range(0, len(vals), per_line)]
    return ",\n".join("  " + r for r in rows)


def signature(s: Schedule) -> str:
    args = [f"const float *restrict {buffer_ident(n)}" for n in s.inputs]
    args += [f"float *restrict {buffer_ident(n)}" for n in s.outputs]
    return ", ".join(args)


def _common(s: Schedule, ctx: _Ctx) -> dict:
    t = s.tiling
    tile_loops = [
        {"var": p, "extent": e, "step": z}
        for p, e, z in zip(t.params, t.extents, t.sizes, strict=True)
        if p
    ]
    scratch = [b for b in s.buffers if b.role == "scratch"]
    return dict(
        s=s,
        out=s.buffer(s.outputs[0]),
        dims=DIMS,
        scratch=scratch,
        tile_loops=tile_loops,
        tile_text=" x ".join(f"{DIMS[d]}:{t.sizes[d]}" for d in range(4)),
        simd_dim="c" if s.layout == "nhwc" else "w",
        open_loops=open_loops,
        close_loops=close_loops,
        param_text=param_text,
        extent_text=extent_text,
        c_float=c_float if ctx.table is C_FUNCS else ispc_float,
        tidy=_tidy,
        cx=to_c,
        store=ctx.store,
        accumulate=ctx.accumulate,
        acc_value=ctx.acc_value,
        ident=buffer_ident,
        param_ident=param_ident,
        origin_ident=origin_ident,
        comment=comment,
    )


def render_ispc(s: Schedule) -> tuple[str, str]:
    """(ISPC source of the per-tile function ``<name>_tile``, C glue ``<name>`` running
    the tiles with OpenMP). Raises ValueError for functions ISPC lacks (erf)."""
    ctx = _Ctx(s, ISPC_FUNCS)
    env = _common(s, ctx)
    scratch = env["scratch"]
    tparams = [p for p in s.tiling.params if p]
    ins = [buffer_ident(n) for n in s.inputs]
    outs = [buffer_ident(n) for n in s.outputs]
    scr = [buffer_ident(b.name) for b in scratch]
    ispc_args = [f"const uniform float {n}[]" for n in ins]
    ispc_args += [f"uniform float {n}[]" for n in outs]
    ispc_args += [f"uniform float {n}[]" for n in scr] + ["uniform float acc[]"]
    ispc_args += [f"uniform int {p}" for p in tparams]
    tile_c = [f"const float *{n}" for n in ins] + [f"float *{n}" for n in outs]
    tile_c += [f"float *{n}" for n in scr] + ["float *acc"] + [f"int {p}" for p in tparams]
    args = ins + outs + scr + ["acc"] + tparams
    ispc = environment().get_template("group.ispc.j2").render(signature=", ".join(ispc_args), **env)
    glue = (
        environment()
        .get_template("group_glue.c.j2")
        .render(
            c_signature=signature(s),
            c_tile_signature=", ".join(tile_c),
            tile_args=", ".join(args),
            **env,
        )
    )
    return ispc, glue


def stages_c(
    s: Schedule,
    ctx: _Ctx,
    stream_min_bytes: float = float("inf"),
    prefetch_hint: str = PREFETCH_HINT,
) -> tuple[list[str], str]:
    """(per-tile declarations, C text of every stage in order): ``cstage.StageWriter``."""

    def target(st: Stage) -> str:
        b = s.buffer(st.target)
        return f"{buffer_ident(b.name)}[{address(b, _DIM_VARS)}]"

    def vec(var: str, start: str, rows: dict[str, str], scalars: set[str]) -> VecExpr:
        return VecExpr(
            var,
            start,
            s.buffer_of,
            lambda b: buffer_ident(b.name),
            address,
            param_ident,
            c_float,
            rows,
            scalars,
        )

    w = StageWriter(
        s, ctx.load, ctx.param, target, ctx.table, c_float, vec, stream_min_bytes, prefetch_hint
    )
    for st in s.stages:
        w.emit(0, "")
        w.emit(3, f"/* {comment(st.name)} -> {buffer_ident(st.target)} */")
        w.write(st, 3)
    return w.decls, "\n".join(w.lines) + "\n"


def render_c(
    s: Schedule, stream_min_bytes: float = float("inf"), prefetch_hint: str = PREFETCH_HINT
) -> str:
    """The C source of ``s`` (one exported function named ``s.name``). An output of at
    least ``stream_min_bytes`` is written with non-temporal stores (the caller derives
    the threshold from ``Hardware``: the private caches of all cores); the pooling row
    passes prefetch with ``prefetch_hint`` (the caller's choice for the CPU's vendor)."""
    layouts = layout_copy(s)
    if layouts is not None:  # a to_layout alone: a blocked transposition
        ident = {b: buffer_ident(b) for b in (*s.inputs, *s.outputs)}
        return render_transpose(s, layouts, signature(s), ident)
    ctx = _Ctx(s)
    env = _common(s, ctx)
    decls, text = stages_c(s, ctx, stream_min_bytes, prefetch_hint)
    env.update(hoist_decls=decls, stages_text=text, vec_helpers=VEC_HELPERS)
    scratch_text = (
        ", ".join(f"{buffer_ident(b.name)} {extent_text(b)}" for b in env["scratch"]) or "none"
    ) + f" ({s.tiling.scratch_bytes} bytes)"
    return (
        environment()
        .get_template("group.c.j2")
        .render(scratch_text=scratch_text, signature=signature(s), **env)
    )


def ispc_float(v: float) -> str:
    """A float literal in ISPC (no INFINITY macro: the bit pattern)."""
    if v == float("inf"):
        return "floatbits(0x7f800000)"
    if v == float("-inf"):
        return "floatbits(0xff800000)"
    return c_float(v)


def extent_text(b: Buffer) -> str:
    return "x".join(str(e) for e in b.extent) + f" {b.layout}"
