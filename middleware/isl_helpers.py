"""Small pure helpers over islpy objects: a set or map in, a set, map or string out.

Used by the depth-first scheduler (passes/schedule.py). Sets here are named-tuple spaces
with named dims (e.g. ``[t_h] -> { relu1[n, c, h, w] : ... }``); loop bounds are read off
them with ``dim_min``/``dim_max`` and turned into index trees (``middleware.index_expr``)
by isl's own AST builder (``ix_of``, ``ix_bounds``, ``ix_guard``), so no bound is computed
by hand and no backend parses text.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import islpy as isl

from . import index_expr as ix


def tile_set(
    name: str,
    dims: Sequence[str],
    extents: Sequence[int],
    tile: Sequence[int],
    params: Sequence[str],
) -> isl.Set:
    """The elements of a rectangular tile of ``name`` whose origin is the parameters:
    ``t_d <= d < t_d + tile_d`` on each tiled dim (``tile_d < extent_d``), clipped to the
    domain. ``params[i]`` names the origin of dim ``i`` ("" for an untiled dim)."""
    cons = []
    for d, e, t, p in zip(dims, extents, tile, params, strict=True):
        cons.append(f"0 <= {d} < {e}")
        if p:
            cons.append(f"{p} <= {d} < {p} + {t}")
    used = [p for p in params if p]
    return isl.Set(f"[{', '.join(used)}] -> {{ {name}[{', '.join(dims)}] : {' and '.join(cons)} }}")


def access_map(
    src: str,
    src_dims: Sequence[str],
    dst: str,
    index: Sequence[str],
    exists: Sequence[str] = (),
    constraints: Sequence[str] = (),
) -> isl.Map:
    """``{ src[src_dims] -> dst[i0..] : exists(exists): i_d = index_d and constraints }``:
    the elements of ``dst`` that one element of ``src`` reads."""
    outs = [f"i{d}" for d in range(len(index))]
    eqs = [f"{o} = {ix}" for o, ix in zip(outs, index, strict=True)] + list(constraints)
    body = " and ".join(eqs) if eqs else "true"
    if exists:
        body = f"exists {', '.join(exists)}: {body}"
    return isl.Map(f"{{ {src}[{', '.join(src_dims)}] -> {dst}[{', '.join(outs)}] : {body} }}")


def align_params(a: isl.Set | isl.Map, b: isl.Set | isl.Map) -> tuple:
    """``a`` and ``b`` over the same parameter space."""
    a = a.align_params(b.get_space())
    b = b.align_params(a.get_space())
    return a, b


def image(region: isl.Set, access: isl.Map) -> isl.Set:
    """The elements ``access`` reaches from ``region`` (the backwards pull of a tile)."""
    access, region = align_params(access, region)
    return region.apply(access.intersect_domain(region))


def name_dims(s: isl.Set, names: Sequence[str]) -> isl.Set:
    """``s`` with its set dims named ``names``."""
    for i, nm in enumerate(names):
        s = s.set_dim_name(isl.dim_type.set, i, nm)
    return s


def as_params(s: isl.Set, first: int, count: int) -> isl.Set:
    """Set dims ``first .. first+count-1`` of ``s`` become parameters (keeping their names)."""
    nparam = s.dim(isl.dim_type.param)
    return s.move_dims(isl.dim_type.param, nparam, isl.dim_type.set, first, count)


def _loop_bound_affs(s: isl.Set, order: Sequence[int]) -> list[tuple[tuple, tuple]]:
    """Per dim of ``s`` scanned in ``order``: ((lower pw_aff, context), (upper, context))."""
    n = s.dim(isl.dim_type.set)
    # permute dims into loop order by naming them and rebuilding through a map
    names = [s.get_dim_name(isl.dim_type.set, i) for i in range(n)]
    ordered = [names[i] for i in order]
    perm = isl.Map(
        f"{{ {s.get_tuple_name() or ''}[{', '.join(names)}] -> L[{', '.join(ordered)}] }}"
    )
    perm = perm.align_params(s.get_space())
    t = s.apply(perm)
    for i, nm in enumerate(ordered):
        t = t.set_dim_name(isl.dim_type.set, i, nm)
    out = []
    for i in range(n):
        inner = t.project_out(isl.dim_type.set, i + 1, n - i - 1)
        p = as_params(inner, 0, i)
        ctx = p.params()
        out.append(((p.dim_min(0), ctx), (p.dim_max(0), ctx)))
    return out


def max_extent(s: isl.Set, dim: int) -> int:
    """The largest ``max - min + 1`` of dim ``dim`` over all parameter values (0 if empty)."""
    if s.is_empty():
        return 0
    lo, hi = s.dim_min(dim), s.dim_max(dim)
    v = hi.sub(lo).max_val()
    if v.is_infty() or v.is_neginfty() or v.is_nan():
        raise ValueError(f"unbounded extent of dim {dim} in {s}")
    return int(v.to_python()) + 1


def with_params(s: isl.Set, context: str) -> isl.Set:
    """``s`` intersected with a parameter context like ``[t_h] -> { : 0 <= t_h < 56 }``."""
    ctx = isl.Set(context)
    s, ctx = align_params(s, ctx)
    return s.intersect_params(ctx)


def key(obj: isl.Set | isl.Map) -> str:
    """A stable text form for cache keys."""
    return str(obj)


_VARS = ("n", "c", "h", "w", "k_h", "k_w")


# ------------------------------------------------------- structured expressions (Ix)
_AST_OPS = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "minus": "neg",
    "fdiv_q": "floordiv",
    "pdiv_q": "div",
    "div": "div",
    "pdiv_r": "mod",
    "zdiv_r": "mod",
    "min": "min",
    "max": "max",
    "cond": "select",
    "select": "select",
    "eq": "eq",
    "le": "le",
    "lt": "lt",
    "ge": "ge",
    "gt": "gt",
    "and_": "and",
    "and_then": "and",
    "or_": "or",
    "or_else": "or",
}


def ix_from_ast(e: isl.AstExpr) -> ix.Ix:
    """The structured form of an isl AST expression (see ``middleware.index_expr``)."""
    kind = e.get_type()
    if kind == isl.ast_expr_type.int:
        return ix.Int(int(e.get_val().to_python()))
    if kind == isl.ast_expr_type.id:
        return ix.Var(e.get_id().get_name())
    name = str(e.get_op_type()).rsplit(".", 1)[-1]
    try:
        op = _AST_OPS[name]
    except KeyError:
        raise ValueError(f"isl AST operation {name!r} has no index form") from None
    args = tuple(ix_from_ast(e.get_op_arg(i)) for i in range(e.get_op_n_arg()))
    return ix.Op(op, args)


def ix_of(pa: isl.PwAff, context: isl.Set | None = None) -> ix.Ix:
    """A piecewise affine expression as an index tree (isl's AST builder decides the
    ``min``/``max``/``floordiv``/select structure)."""
    if context is None:
        context = pa.domain().params() if pa.dim(isl.dim_type.in_) else pa.domain()
    build = isl.AstBuild.from_context(context.params())
    return ix_from_ast(build.expr_from_pw_aff(pa))


def ix_bounds(s: isl.Set, order: Sequence[int]) -> list[tuple[ix.Ix, ix.Ix]]:
    """Inclusive (lower, upper) bounds of each dim of ``s`` scanned in ``order`` (dim
    positions, outermost first) as index trees: the bound of a loop depends on the
    parameters and on the loops outside it only (the inner dims are projected out). An
    empty ``s`` (a pooling window entirely in the padding: every tap outside the input)
    scans nothing: each loop runs from 0 to -1 (isl has no expression for its bounds)."""
    if s.is_empty():
        return [(ix.Int(0), ix.Int(-1))] * len(order)
    return [(ix_of(*lo), ix_of(*hi)) for lo, hi in _loop_bound_affs(s, order)]


@functools.cache
def ix_index(text: str) -> ix.Ix:
    """An index expression in isl syntax over ``n, c, h, w, k_h, k_w`` (as
    ``middleware.loops`` writes them: ``2*h + k_h - 1``, ``(c mod 2)*4 + floor(c/2)``) as
    a tree, simplified for non-negative ``n, c, h, w``."""
    pa = isl.PwAff(f"[{', '.join(_VARS)}] -> {{ [({text})] }}")
    ctx = isl.Set(f"[{', '.join(_VARS)}] -> {{ : {' and '.join(f'{v} >= 0' for v in _VARS[:4])} }}")
    return ix_of(pa.intersect_params(ctx), ctx)


def ix_guard(s: isl.Set, context: isl.Set) -> ix.Ix | None:
    """The condition on the parameters under which ``s`` is not empty, as a tree (None
    when it never is empty in ``context``)."""
    dom = s.params()
    dom, context = align_params(dom, context)
    if context.is_subset(dom):
        return None
    build = isl.AstBuild.from_context(context)
    return ix_from_ast(build.expr_from_set(dom.intersect(context)))
