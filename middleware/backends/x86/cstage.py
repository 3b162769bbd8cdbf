"""The C text of one schedule stage (issue 18: I/O kernels at memory speed).

These things on top of the schedule's loop nest (which every backend shares):

* **Hoisting.** A subexpression with an expensive function (``loops.EXPENSIVE_FUNCTIONS``:
  sigmoid, exp, division, ...) whose loads do not depend on some of the enclosing loops is
  computed where it stops varying: a scalar when it does not depend on the inner (SIMD)
  loop either, else a row over the inner loop's range (``float hoist<k>[extent]``). The
  SE gate ``x * sigmoid(s)`` (``s`` of shape N,C,1,1) computes N*C sigmoids, not one per
  element (gcc hoisted no libm ``expf``: it may set ``errno``; exp is now the inline
  ``mw_expf``, hoisted all the same).
* **Row reductions to one value** (a softmax's max and sum, LayerNorm's statistics, a
  global pool in NCHW): an AVX-512 loop over the window's innermost loop, the last chunk
  masked, a sum in double, a max/min with a NaN mask (``vector_row``); gcc's ``omp simd``
  reduction under ``#else``.
* **Guard-free interior of windows.** For a reduction stage (pooling, depthwise conv) the
  output points whose window lies wholly inside the input (the *interior*, a box found by
  evaluating ``Reduction.point_loops`` on the stage's index space at render time) run a
  point form: one SIMD loop over the inner dim whose body is the window's taps unrolled
  (constant window offsets, no bounds, the accumulator in a register; neighbouring taps
  load neighbouring vectors, which the compiler shares between them). Where the inner dim
  carries a window (NCHW) its border columns are peeled off (a short loop of the point
  form with the window's own bounds on each side). Border rows and columns of the other
  dims run the schedule's general nest (accumulator row, window loops with bounds).
* **Separable windows** (``window.py``, tried first): a 2-D pooling window over an
  elementwise producer runs as a row pass into an L1 row buffer and a column pass, under
  ``#ifdef __AVX512F__``; the forms below stay as its ``#else`` and for what it refuses.
* **NaN-propagating max without a select per tap.** In the unrolled interior a max
  reduction is ``x > y ? x : y`` (one ``vmaxps``) over the taps plus one unordered compare
  per pair of taps (``__builtin_isunordered``); a NaN anywhere in the window gives NaN, as
  PyTorch's max-pooling does. min likewise.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import numpy as np

from ...index_expr import Int, Ix, Op, Var, evaluate, to_c, variables
from ...loops import DIMS, EXPENSIVE_FUNCTIONS, Acc, Call, Const, Expr, Load, ParamVec, leaves
from ...passes.schedule_ir import ORDER, Loop, Reduction, Schedule, Stage
from . import window
from .cfuncs import C_FUNCS, c_expr
from .vec512 import LANES, Unsupported, VecExpr, prefetch, stride_of

# Unroll a window's taps in the interior only up to this many taps (7x7 = 49).
MAX_UNROLLED_TAPS = 49
HOIST_PREFIX = "hoist"
# The longest row of a hoisted subexpression (floats, on the stack).
MAX_HOIST_ROW = 16384


def subst_ix(x: Ix, env: dict[str, int]) -> Ix:
    """``x`` with the variables of ``env`` replaced by constants."""
    if isinstance(x, Var):
        return Int(env[x.name]) if x.name in env else x
    if isinstance(x, Op):
        return Op(x.op, tuple(subst_ix(a, env) for a in x.args))
    return x


def subst_expr(e: Expr, env: dict[str, int]) -> Expr:
    """``e`` with the window variables of ``env`` fixed in every load and parameter index."""
    if isinstance(e, Load):
        return Load(e.value, tuple(subst_ix(i, env) for i in e.index))  # type: ignore[arg-type]
    if isinstance(e, ParamVec):
        return ParamVec(e.name, e.data, subst_ix(e.index, env))  # type: ignore[arg-type]
    if isinstance(e, Call):
        return Call(e.fn, tuple(subst_expr(a, env) for a in e.args))
    return e


def expr_vars(e: Expr) -> set[str] | None:
    """The index variables ``e`` reads (None when it reads the accumulator)."""
    if isinstance(e, Acc):
        return None
    if isinstance(e, Load):
        out: set[str] = set()
        for i in e.index:
            out |= variables(i)  # type: ignore[arg-type]
        return out
    if isinstance(e, ParamVec):
        return set(variables(e.index))  # type: ignore[arg-type]
    if isinstance(e, Call):
        out = set()
        for a in e.args:
            v = expr_vars(a)
            if v is None:
                return None
            out |= v
        return out
    return set()


def _expensive(e: Expr) -> bool:
    return isinstance(e, Call) and (
        e.fn in EXPENSIVE_FUNCTIONS or any(_expensive(a) for a in e.args)
    )


@dataclasses.dataclass(frozen=True)
class Hoist:
    """A subexpression computed once per iteration of ``loops[:level + 1]`` (level -1:
    once per stage), into a scalar or, when ``row``, a row over the inner loop."""

    ident: str
    expr: Expr
    level: int
    row: bool


def find_hoists(
    expr: Expr, loops: tuple[Loop, ...], inner: Loop, first: int, row_extent: int
) -> tuple[Expr, list[Hoist]]:
    """``expr`` with its hoistable expensive subexpressions replaced by loads of
    ``__hoist<k>`` (k from ``first``), and the hoists."""
    outer = [lp.var for lp in loops]
    hoists: list[Hoist] = []

    def visit(e: Expr) -> Expr:
        if not isinstance(e, Call):
            return e
        vs = expr_vars(e)
        if vs is not None and _expensive(e):
            deepest = max((outer.index(v) for v in vs if v in outer), default=-1)
            row = inner.var in vs
            bound_vars = variables(inner.lo) | variables(inner.hi)
            ok_row = not row or (
                row_extent <= MAX_HOIST_ROW and not (bound_vars & set(outer[deepest + 1 :]))
            )
            if deepest < len(outer) - 1 and ok_row and vs <= set(outer) | {inner.var}:
                h = Hoist(f"{HOIST_PREFIX}{first + len(hoists)}", e, deepest, row)
                hoists.append(h)
                return Load(h.ident, (Var(inner.var),) * 4)  # type: ignore[arg-type]
        return Call(e.fn, tuple(visit(a) for a in e.args))

    return visit(expr), hoists


# ------------------------------------------------------------------- the interior
@dataclasses.dataclass(frozen=True)
class Interior:
    """The box of output points whose whole window is inside the input: per logical dim
    ``(lo, hi)`` (None: the whole dim), the window offsets of every tap, and the divisor
    there (an int, or None for the schedule's tree)."""

    box: tuple[tuple[int, int] | None, ...]
    taps: tuple[dict[str, int], ...]
    divisor: int | None
    # window variables whose bounds depend on the inner (SIMD) variable only: per value,
    # the inner indices (lo, hi) where that value is inside the input (lo > hi: nowhere)
    lanes: dict[str, dict[int, tuple[int, int]]] = dataclasses.field(default_factory=dict)


def find_interior(
    st: Stage, shape: tuple[int, int, int, int], inner_dim: int | None = None
) -> Interior | None:
    """The interior of reduction stage ``st`` over its value of logical ``shape``, or None
    (no window, window bounds that depend on each other, too many taps, no interior)."""
    red = st.reduction
    if red is None or not red.point_loops:
        return None
    kvars = [lp.var for lp in red.point_loops]
    grid = {
        d: np.arange(s).reshape([-1 if i == k else 1 for i in range(4)])
        for k, (d, s) in enumerate(zip(DIMS, shape, strict=True))
    }
    lows, highs = [], []
    for lp in red.point_loops:
        if (variables(lp.lo) | variables(lp.hi)) & set(kvars):
            return None
        lo = np.broadcast_to(evaluate(lp.lo, grid), shape)
        hi = np.broadcast_to(evaluate(lp.hi, grid), shape)
        lows.append(lo)
        highs.append(hi)
    full = [(int(lo.min()), int(hi.max())) for lo, hi in zip(lows, highs, strict=True)]
    ntaps = int(np.prod([b - a + 1 for a, b in full]))
    if ntaps > MAX_UNROLLED_TAPS or ntaps <= 0:
        return None
    mask = np.ones(shape, dtype=bool)
    for (a, b), lo, hi in zip(full, lows, highs, strict=True):
        mask &= (lo == a) & (hi == b)
    box: list[tuple[int, int] | None] = []
    sl = []
    for d in range(4):
        axes = tuple(i for i in range(4) if i != d)
        idx = np.nonzero(mask.any(axis=axes))[0]
        if idx.size == 0:
            return None
        a, b = int(idx[0]), int(idx[-1])
        box.append(None if (a, b) == (0, shape[d] - 1) else (a, b))
        sl.append(slice(a, b + 1))
    inside = mask[tuple(sl)]
    if not inside.all():
        return None
    divisor: int | None = None
    if red.divisor is not None:
        dv = np.broadcast_to(evaluate(red.divisor, grid), shape)[tuple(sl)]
        if dv.min() == dv.max():
            divisor = int(dv.min())
    taps = tuple(
        dict(zip(kvars, ks, strict=True))
        for ks in itertools.product(*[range(a, b + 1) for a, b in full])
    )
    lanes: dict[str, dict[int, tuple[int, int]]] = {}
    if inner_dim is not None:
        iv = DIMS[inner_dim]
        for lp, lo, hi, (a, b) in zip(red.point_loops, lows, highs, full, strict=True):
            if iv not in variables(lp.lo) | variables(lp.hi):
                continue
            at = [0, 0, 0, 0]
            at[inner_dim] = slice(None)
            lo1, hi1 = lo[tuple(at)], hi[tuple(at)]
            ranges = {}
            for k in range(a, b + 1):
                ok = np.nonzero((lo1 <= k) & (k <= hi1))[0]
                if ok.size and ok[-1] - ok[0] + 1 != ok.size:
                    return None
                ranges[k] = (int(ok[0]), int(ok[-1])) if ok.size else (1, 0)
            lanes[lp.var] = ranges
    return Interior(tuple(box), taps, divisor, lanes)


# --------------------------------------------------------------------- rendering
_IDENTITY = {"max": float("-inf"), "min": float("inf"), "sum": 0.0}


class StageWriter:
    """The C text of the stages of one schedule (``write(st)`` per stage, then ``decls``:
    the per-tile declarations the hoisted rows need, and ``text``)."""

    def __init__(
        self,
        s: Schedule,
        load: Callable[[Load], str],
        param: Callable[[ParamVec], str],
        address: Callable[[Stage], str],
        table: dict[str, str],
        c_float: Callable[[float], str],
        vec: Callable[[str, str, dict[str, str], set[str]], VecExpr] | None = None,
        stream_min_bytes: float = float("inf"),
        prefetch_hint: str = window.PREFETCH_HINT,
    ) -> None:
        self.s = s
        self.prefetch_hint = prefetch_hint  # of the pooling row passes (window.prefetches)
        # outputs at least this large are written with non-temporal stores (the vector
        # loops' full aligned chunks): they do not fit the caches, and a store that
        # bypasses them saves the read of every line it writes
        self.stream_min_bytes = stream_min_bytes
        # whether the loop being written covers whole lines of its target with whole
        # chunks: non-temporal stores only then (a line written partly by a regular
        # store, a peeled border column, costs more than the stream saves: NCHW rows of
        # 56 floats measured 56% of the streaming kernel with them, 62% without)
        self.nt_ok = False
        # makes the AVX-512 printer of a loop (var, chunk start, rows, scalars); None: only
        # the portable loops
        self.vec = vec
        self._load = load
        self.param = param
        self.address = address
        self.table = table
        self.c_float = c_float
        self.lines: list[str] = []
        self.decls: list[str] = []
        self.rows: dict[str, str] = {}  # hoisted row -> its first inner index's name
        self.scalars: set[str] = set()
        self.nhoist = 0
        self.nseparable = 0  # row buffers of separable windows written so far
        self.separable_floats = 0  # their per-tile buffers on the stack (floats)
        self.inner_dim = ORDER[s.layout][-1]

    # ------------------------------------------------------------ text helpers
    def emit(self, depth: int, text: str) -> None:
        for line in text.splitlines():
            self.lines.append("  " * depth + line)

    @staticmethod
    def tidy(x: Ix) -> str:
        t = to_c(x)
        return t if isinstance(x, Var | Int) else f"({t})"

    def load(self, x: Load) -> str:
        if x.value in self.rows:
            v = x.index[0].name  # type: ignore[union-attr]
            return f"{x.value}[{v} - {self.rows[x.value]}]"
        if x.value in self.scalars:
            return x.value
        return self._load(x)

    def expr(self, e: Expr) -> str:
        """C text of ``e``; ``max``/``min`` against a constant (ReLU, clamp) is
        ``K > x ? K : x``: one ``vmaxps`` (x86's max returns its second operand when
        either is NaN, so a NaN ``x`` comes through as PyTorch's ReLU gives it), and a
        ``vmaxss`` rather than a branch in scalar code."""
        if isinstance(e, Call) and e.fn in ("max", "min") and self.table is C_FUNCS:
            a, b = e.args
            if isinstance(a, Const) and not isinstance(b, Const):
                a, b = b, a
            if isinstance(b, Const) and not math.isnan(b.value):
                k, x = self.c_float(b.value), self.expr(a)
                cmp = ">" if e.fn == "max" else "<"
                return f"({k} {cmp} {x} ? {k} : {x})"
        if isinstance(e, Call):
            return self.table[e.fn].format(*(self.expr(a) for a in e.args))
        return c_expr(e, self.load, table=self.table, param=self.param)

    def open_loops(self, loops: tuple[Loop, ...], depth: int) -> None:
        for i, lp in enumerate(loops):
            self.emit(
                depth + i,
                f"for (int {lp.var} = {self.tidy(lp.lo)}; {lp.var} <= {self.tidy(lp.hi)}; "
                f"++{lp.var}) {{",
            )

    def close_loops(self, n: int, depth: int) -> None:
        for i in reversed(range(n)):
            self.emit(depth + i, "}")

    def store(self, st: Stage, value: str) -> str:
        return f"{self.address(st)} = {value};"

    # ------------------------------------------------------------------ stages
    def write(self, st: Stage, depth: int) -> None:
        target = self.s.buffer(st.target)
        expr, hoists = find_hoists(
            st.expr, st.loops, st.inner, self.nhoist, target.extent[self.inner_dim]
        )
        self.nhoist += len(hoists)
        if st.guard is not None:
            self.emit(depth, f"if ({to_c(st.guard)}) {{")
            depth += 1
        for h in hoists:
            if h.level < 0:
                self.write_hoist(h, st.inner, depth, target.extent[self.inner_dim])
        self.scalars.update(h.ident for h in hoists if not h.row)
        if st.reduction is not None and not hoists and self.separable(st, expr, depth):
            if st.guard is not None:
                self.emit(depth - 1, "}")
            return
        flat = self.flat_rows(st, expr, hoists) if st.reduction is None else None
        loops = st.loops[:-1] if flat else st.loops
        for i, lp in enumerate(loops):
            self.open_loops((lp,), depth + i)
            for h in hoists:
                if h.level == i:
                    self.write_hoist(h, st.inner, depth + i + 1, target.extent[self.inner_dim])
        d = depth + len(loops)
        whole_rows = target.shape[self.inner_dim] % LANES == 0
        self.nt_ok = whole_rows
        if flat:
            self.write_flat(st, expr, d, *flat)
        elif st.reduction is None:
            self.simd_loop(
                d,
                st.inner.var,
                self.tidy(st.inner.lo),
                self.tidy(st.inner.hi),
                [self.store(st, self.expr(expr))],
                lambda v: [self.vstore(st, v, v.expr(expr))],
            )
        else:
            self.reduction(st, expr, d)
        self.close_loops(len(loops), depth)
        if st.guard is not None:
            self.emit(depth - 1, "}")

    def reduction(self, st: Stage, expr: Expr, d: int) -> None:
        """The window of a reduction stage inside its loops: the unrolled interior with
        vector border chunks where it has one, else the general nest."""
        target = self.s.buffer(st.target)
        interior = find_interior(st, target.shape, self.inner_dim)
        if interior is None:
            self.general(st, expr, d)
            return
        outer = [
            (DIMS[k], b)
            for k, b in enumerate(interior.box)
            if b is not None and k != self.inner_dim
        ]
        cond = " && ".join(f"{v} >= {a} && {v} <= {b}" for v, (a, b) in outer)
        if self.vector_reduction(st, expr, interior, cond, d):
            pass
        elif cond:
            self.emit(d, f"if ({cond}) {{")
            self.fast(st, expr, interior, d + 1)
            self.emit(d, "} else {")
            self.general(st, expr, d + 1)
            self.emit(d, "}")
        else:
            self.fast(st, expr, interior, d)

    def separable(self, st: Stage, expr: Expr, depth: int) -> bool:
        """A pooling stage as row and column passes (``window.py``) under
        ``#ifdef __AVX512F__``, the portable window under ``#else``; False (nothing
        written) where ``window.plan`` or the AVX-512 printer refuses it."""
        if self.vec is None or self.s.simd_floats != LANES:
            return False
        p = window.plan(st, self.s)
        if p is None:
            return False
        nhwc = self.inner_dim == 1
        names = [lp.var for lp in st.loops]
        if nhwc:
            bound_vars = variables(st.inner.lo) | variables(st.inner.hi)
            if names[-2:] != ["h", "w"] or st.inner.var != "c" or "w" in bound_vars:
                return False
        elif names[-1:] != ["h"] or st.inner.var != "w":
            return False
        target = self.s.buffer(st.target)
        self.nt_ok = target.shape[self.inner_dim] % LANES == 0
        writer = window.SeparableWriter(
            self,
            st,
            expr,
            p,
            self.inner_dim,
            lambda var, start: self.vec(var, start, self.rows, self.scalars),  # type: ignore[misc]
            self.nseparable,
        )
        # the loops the writer writes itself: channels_last's w, a flat plane's h
        own = st.loops[-1:] if nhwc or writer.flat_plane else ()
        outer = st.loops[: len(st.loops) - len(own)]
        d = depth + len(outer)
        try:
            writer.write(d + 1)
        except Unsupported:
            return False
        if self.separable_floats + writer.stack_floats > window.MAX_STACK_FLOATS:
            return False
        self.separable_floats += writer.stack_floats
        self.nseparable += 1
        self.decls += writer.decls
        self.open_loops(outer, depth)
        self.emit(d, "{")
        self.emit(0, "#ifdef __AVX512F__")
        for dd, line in writer.lines:
            self.emit(dd, line)
        self.emit(0, "#else")
        vec, self.vec = self.vec, None
        try:
            self.open_loops(own, d + 1)
            self.reduction(st, expr, d + 1 + len(own))
            self.close_loops(len(own), d + 1)
        finally:
            self.vec = vec
        self.emit(0, "#endif")
        self.emit(d, "}")
        self.close_loops(len(outer), depth)
        return True

    def flat_rows(
        self, st: Stage, expr: Expr, hoists: list[Hoist]
    ) -> tuple[VecExpr, list[str]] | None:
        """Whether an elementwise stage can run its last outer loop and the inner loop as
        one flat vector loop: the inner loop covers whole rows of the output, and every
        load advances by a whole row per step of the outer loop (contiguous rows, NCHW's
        h and w), so the flat index is linear in every address. Rows of 56 floats then
        cost 3.5 chunks, not 4, and the output lines are written whole (non-temporal)."""
        if self.vec is None or self.s.simd_floats != LANES or not st.loops:
            return None
        target = self.s.buffer(st.target)
        width = target.shape[self.inner_dim]
        inner, outer = st.inner, st.loops[-1]
        if target.role != "output" or width % LANES == 0:
            return None
        if not (isinstance(inner.lo, Int) and inner.lo.value == 0):
            return None
        if not (isinstance(inner.hi, Int) and inner.hi.value == width - 1):
            return None
        if any(h.level >= len(st.loops) - 1 or h.row for h in hoists):
            return None
        loads = [x for x in leaves(expr) if isinstance(x, Load) and x.value not in self.scalars]
        idx = tuple(Var(x) for x in DIMS)
        checks = [(idx, target)] + [
            (x.index, self.s.buffer_of(x.value))
            for x in loads
            if not x.value.startswith(HOIST_PREFIX)
        ]
        if any(isinstance(x, ParamVec) for x in leaves(expr)):
            return None
        try:
            for index, b in checks:
                si = stride_of(index, inner.var, b.strides, b.extent)
                so = stride_of(index, outer.var, b.strides, b.extent)
                if (si, so) not in ((1, width), (0, 0)):
                    return None
            v = self.vec(inner.var, f"{inner.var}0_", self.rows, self.scalars)
            saved, self.nt_ok = self.nt_ok, True
            try:
                lines = [self.vstore(st, v, v.expr(expr))]
            finally:
                self.nt_ok = saved
        except Unsupported:
            return None
        return v, lines

    def write_flat(self, st: Stage, expr: Expr, d: int, v: VecExpr, lines: list[str]) -> None:
        """The flat vector loop of ``flat_rows`` (``#else``: the two loops as they are)."""
        inner, outer = st.inner, st.loops[-1]
        width = self.s.buffer(st.target).shape[self.inner_dim]
        h, w = outer.var, inner.var
        f0 = "f0_"
        self.emit(d, "{")
        self.emit(
            d + 1,
            f"const int flo_ = {self.tidy(outer.lo)} * {width}, "
            f"fhi_ = {self.tidy(outer.hi)} * {width} + {width - 1};",
        )
        self.emit(0, "#ifdef __AVX512F__")
        skew = "0"
        if v.nt_target is not None:
            skew = (
                f"({{ const int {h} = flo_ / {width}, {w}0_ = flo_ % {width}; "
                f"(int)(({v.nt_offset_at(f'{w}0_')}) & {LANES - 1}); }})"
            )
        self.emit(d + 1, f"for (int {f0} = flo_ - {skew}; {f0} <= fhi_; {f0} += {LANES}) {{")
        self.emit(
            d + 2,
            f"const int s_ = flo_ > {f0} ? flo_ - {f0} : 0, "
            f"e_ = fhi_ - {f0} < {LANES - 1} ? fhi_ - {f0} : {LANES - 1};",
        )
        self.emit(d + 2, "const __mmask16 mk = mw_range(s_, e_);")
        self.emit(d + 2, f"const int {h} = floord({f0}, {width}), {w}0_ = {f0} - {h} * {width};")
        for line in lines:
            self.emit(d + 2, line)
        self.emit(d + 1, "}")
        self.emit(0, "#else")
        self.open_loops((outer,), d + 1)
        self.emit(d + 2, "#pragma omp simd")
        self.emit(d + 2, self.for_line(w, self.tidy(inner.lo), self.tidy(inner.hi)) + " {")
        self.emit(d + 3, self.store(st, self.expr(expr)))
        self.emit(d + 2, "}")
        self.emit(d + 1, "}")
        self.emit(0, "#endif")
        self.emit(d, "}")

    @staticmethod
    def for_line(var: str, lo: str, hi: str) -> str:
        return f"for (int {var} = {lo}; {var} <= {hi}; ++{var})"

    def simd_loop(
        self,
        d: int,
        var: str,
        lo: str,
        hi: str,
        body: list[str],
        vector: Callable[[VecExpr], list[str]] | None = None,
    ) -> None:
        """A SIMD loop ``var = lo..hi`` over ``body`` (statements, one per line); with
        ``vector`` (statements over ``__m512`` values of a chunk, ending in its masked
        store) also the AVX-512 loop in chunks of 16 lanes (``vec512``), chosen by
        ``#ifdef __AVX512F__``. A loop ``vector`` cannot write stays portable only."""
        lines = None
        if vector is not None and self.vec is not None and self.s.simd_floats == LANES:
            v = self.vec(var, f"{var}0_", self.rows, self.scalars)
            try:
                lines = vector(v)
            except Unsupported:
                lines = None
        if lines is not None:
            lo_, hi_ = f"lo_{var}_", f"hi_{var}_"
            self.emit(d, "{")
            self.emit(d + 1, f"const int {lo_} = {lo}, {hi_} = {hi};")
            self.emit(0, "#ifdef __AVX512F__")
            self.chunk_loop(d + 1, v, lo_, hi_)
            for line in lines:
                self.emit(d + 2, line)
            self.emit(d + 1, "}")
            self.emit(0, "#else")
            lo, hi = lo_, hi_
        self.emit(d + 1 if lines is not None else d, "#pragma omp simd")
        dd = d + 1 if lines is not None else d
        self.emit(dd, self.for_line(var, lo, hi) + " {")
        for line in body:
            self.emit(dd + 1, line)
        self.emit(dd, "}")
        if lines is not None:
            self.emit(0, "#endif")
            self.emit(d, "}")

    def chunk_loop(self, d: int, v: VecExpr, lo_: str, hi_: str) -> None:
        """Opens the loop over chunks of ``LANES`` lanes of ``lo_..hi_`` (their first
        lane ``<var>0_``, live lanes ``s_..e_``, masks ``mk`` and, for stride-2 loads,
        ``mk2a``/``mk2b``); the caller closes it."""
        v0 = v.start
        # chunks start on the target's 64-byte boundaries when it is stored
        # non-temporally (the first chunk's leading lanes masked off)
        skew = f"(({v.nt_offset_at(lo_)}) & {LANES - 1})" if v.nt_target else "0"
        self.emit(d, f"for (int {v0} = {lo_} - {skew}; {v0} <= {hi_}; {v0} += {LANES}) {{")
        self.emit(
            d + 1,
            f"const int s_ = {lo_} > {v0} ? {lo_} - {v0} : 0, "
            f"e_ = {hi_} - {v0} < {LANES - 1} ? {hi_} - {v0} : {LANES - 1};",
        )
        self.emit(d + 1, "const __mmask16 mk = mw_range(s_, e_);")
        if v.stride2:
            self.emit(
                d + 1,
                "const __mmask16 mk2a = mw_range(2 * s_, 2 * e_), "
                "mk2b = mw_range(2 * s_ - 16, 2 * e_ - 16);",
            )

    def vector_reduction(
        self, st: Stage, expr: Expr, interior: Interior, cond: str, d: int
    ) -> bool:
        """A reduction stage with an interior, written as one AVX-512 loop over the whole
        inner range: a chunk inside the interior takes the unrolled taps; any other (a
        border row or column) the same taps, each masked to the lanes where it lies inside
        the input (its loads masked too, so nothing outside is read) and replaced by the
        reduction's identity elsewhere, with the divisor of each lane. The portable loops
        stay under ``#else``. False (nothing written) when it cannot be vectorised."""
        red = st.reduction
        assert red is not None
        if self.vec is None or self.s.simd_floats != LANES or red.op not in _IDENTITY:
            return False
        inner = st.inner
        var = inner.var
        v = self.vec(var, f"{var}0_", self.rows, self.scalars)
        box = interior.box[self.inner_dim]
        try:
            fast = self.vector_taps(st, expr, interior, v, guarded=False)
            slow = self.vector_taps(st, expr, interior, v, guarded=True)
        except Unsupported:
            return False
        lo_, hi_ = f"lo_{var}_", f"hi_{var}_"
        self.emit(d, "{")
        self.emit(d + 1, f"const int {lo_} = {self.tidy(inner.lo)}, {hi_} = {self.tidy(inner.hi)};")
        self.emit(0, "#ifdef __AVX512F__")
        self.emit(d + 1, f"const int outer_in_ = {cond or 1};")
        self.chunk_loop(d + 1, v, lo_, hi_)
        inside = "outer_in_"
        if box is not None:
            inside += f" && {v.start} + s_ >= {box[0]} && {v.start} + e_ <= {box[1]}"
        self.emit(d + 2, f"if ({inside}) {{")
        for line in fast:
            self.emit(d + 3, line)
        self.emit(d + 2, "} else {")
        for line in slow:
            self.emit(d + 3, line)
        self.emit(d + 2, "}")
        self.emit(d + 1, "}")
        self.emit(0, "#else")
        if cond:
            self.emit(d + 1, f"if ({cond}) {{")
            self.fast(st, expr, interior, d + 2)
            self.emit(d + 1, "} else {")
            self.general(st, expr, d + 2)
            self.emit(d + 1, "}")
        else:
            self.fast(st, expr, interior, d + 1)
        self.emit(0, "#endif")
        self.emit(d, "}")
        return True

    def vector_taps(
        self, st: Stage, expr: Expr, interior: Interior, v: VecExpr, guarded: bool
    ) -> list[str]:
        """The statements of one chunk: every tap, the reduction, the epilogue, the store.
        ``guarded``: each tap only where inside the input (see ``vector_reduction``)."""
        red = st.reduction
        assert red is not None
        ident = f"_mm512_set1_ps({self.c_float(_IDENTITY[red.op])})"
        out, names = [], []
        if not guarded:
            out += self.prefetches(st, interior, v)
        for i, env in enumerate(interior.taps):
            body = subst_expr(red.body, env)
            if not guarded:
                out.append(f"const __m512 x{i} = {v.expr(body)};")
            else:
                lanes, conds = "mk", []
                for lp in red.point_loops:
                    k = env[lp.var]
                    if lp.var in interior.lanes:
                        a, b = interior.lanes[lp.var][k]
                        lanes = f"{lanes} & mw_range({a} - {v.start}, {b} - {v.start})"
                    elif v.var in variables(lp.lo) | variables(lp.hi):
                        raise Unsupported("window bounds depend on the inner variable")
                    else:
                        conds.append(f"{self.tidy(lp.lo)} <= {k} && {k} <= {self.tidy(lp.hi)}")
                out.append(f"const __mmask16 vk{i} = {lanes};")
                v.mask = f"vk{i}"
                value = f"_mm512_mask_blend_ps(vk{i}, {ident}, {v.expr(body)})"
                v.mask = "mk"
                if conds:
                    value = f"({' && '.join(conds)}) ? {value} : {ident}"
                out.append(f"const __m512 x{i} = {value};")
            names.append(f"x{i}")
        if red.init != _IDENTITY[red.op]:
            out.append(f"const __m512 x{len(names)} = {v.expr(Const(red.init))};")
            names.append(f"x{len(names)}")
        if red.op == "sum":
            out.append(f"__m512 sum_ = {names[0]};")
            out += [f"sum_ = _mm512_add_ps(sum_, {x});" for x in names[1:]]
            total = "sum_"
        else:
            out.append(f"__m512 m_ = {names[0]};")
            out += [f"m_ = _mm512_{red.op}_ps(m_, {x});" for x in names[1:]]
            pairs = [names[i : i + 2] for i in range(0, len(names), 2)]
            nan = " | ".join(f"_mm512_cmp_ps_mask({p[0]}, {p[-1]}, _CMP_UNORD_Q)" for p in pairs)
            out.append(f"const __mmask16 nan_ = {nan};")
            total = "_mm512_mask_blend_ps(nan_, m_, _mm512_set1_ps(NAN))"
        if red.divisor is not None:
            if not guarded and interior.divisor is not None:
                div = f"_mm512_set1_ps({self.c_float(float(interior.divisor))})"
            elif v.var not in variables(red.divisor):
                div = f"_mm512_set1_ps((float)({to_c(red.divisor)}))"
            else:
                out.append("float dv_[16];")
                out.append(
                    f"for (int l_ = 0; l_ < 16; ++l_) {{ const int {v.var} = {v.start} + l_; "
                    f"dv_[l_] = (float)({to_c(red.divisor)}); }}"
                )
                div = "_mm512_loadu_ps(dv_)"
            total = f"_mm512_div_ps({total}, {div})"
        out.append(f"const __m512 acc_v = {total};")
        out.append(self.vstore(st, v, v.expr(expr)))
        return out

    def prefetches(self, st: Stage, interior: Interior, v: VecExpr) -> list[str]:
        """Software prefetches of the lines the next iteration of the innermost outer loop
        reads, when the window also runs along the inner dim (NCHW pooling: short rows,
        three of them per output row, which the hardware prefetcher follows late;
        measured on one core, BN->ReLU->3x3/2 max-pool: 62% -> 69% of the streaming
        kernel). One prefetch per line of the chunk's span, for the taps at the first
        offset of the inner dim's window."""
        red = st.reduction
        assert red is not None
        if not st.loops or not interior.lanes:
            return []
        outer = st.loops[-1].var
        first = {k: min(r) for k, r in interior.lanes.items()}
        out: list[str] = []
        seen: set[str] = set()
        for env in interior.taps:
            if any(env[k] != first[k] for k in first):
                continue
            for x in leaves(subst_expr(red.body, env)):
                if not isinstance(x, Load) or x.value in v.rows or x.value in v.scalars:
                    continue
                b = self.s.buffer_of(x.value)
                try:
                    step = stride_of(x.index, outer, b.strides, b.extent)
                    span = stride_of(x.index, v.var, b.strides, b.extent) * LANES
                except Unsupported:
                    continue
                if step == 0 or span <= 0:
                    continue
                ident, offset = v.load_offset(x)
                for off in range(0, span, LANES):
                    text = prefetch(ident, f"({offset}) + {step + off}", "_MM_HINT_T0")
                    if text not in seen:
                        seen.add(text)
                        out.append(text)
        return out

    def vstore(self, st: Stage, v: VecExpr, value: str) -> str:
        """The masked store of the chunk's ``value`` into the stage's target."""
        b = self.s.buffer(st.target)
        from ...index_expr import Var as _Var

        idx = tuple(_Var(x) for x in DIMS)
        if stride_of(idx, v.var, b.strides, b.extent) != 1:
            raise Unsupported("target not contiguous in the inner variable")
        if self.nt_ok and b.role == "output" and b.elements * 4 >= self.stream_min_bytes:
            v.nt_target = b
            return (
                f"{{ float *p_ = {v.target_address(b)}; const __m512 y_ = {value}; "
                "if (mk == (__mmask16)0xFFFF && ((uintptr_t)p_ & 63) == 0) "
                "_mm512_stream_ps(p_, y_); else _mm512_mask_storeu_ps(p_, mk, y_); }"
            )
        return f"_mm512_mask_storeu_ps({v.target_address(b)}, mk, {value});"

    def write_hoist(self, h: Hoist, inner: Loop, depth: int, extent: int) -> None:
        if not h.row:
            self.emit(depth, f"const float {h.ident} = {self.expr(h.expr)};")
            self.scalars.add(h.ident)
            return
        self.decls.append(f"float {h.ident}[{extent}] __attribute__((aligned(64)));")
        lo = f"{h.ident}_lo"
        self.emit(depth, f"const int {lo} = {self.tidy(inner.lo)};")
        self.emit(depth, "#pragma omp simd")
        self.emit(depth, self.for_line(inner.var, lo, self.tidy(inner.hi)))
        self.emit(depth + 1, f"{h.ident}[{inner.var} - {lo}] = {self.expr(h.expr)};")
        self.rows[h.ident] = lo

    def _accumulate(self, op: str, a: str, body: str) -> str:
        if op == "sum":
            return f"{a} + {body}"
        return self.table[op].format(a, body)

    def _divide(self, st: Stage, value: str, divisor: int | None) -> str:
        red = st.reduction
        assert red is not None
        if red.divisor is None:
            return value
        if divisor is not None:
            return f"{value} / {self.c_float(float(divisor))}"
        return f"{value} / (float)({to_c(red.divisor)})"

    def general(self, st: Stage, expr: Expr, d: int) -> None:
        """The schedule's nest: an accumulator row over the inner loop, the window loops
        with their bounds, then the epilogue over the row. A sum whose inner loop is one
        output point (a row or plane reduced to one value: LayerNorm's statistics, a global
        average pool in NCHW) sums its innermost window loop as a SIMD reduction instead
        (a serial chain of adds otherwise, one per tap)."""
        red = st.reduction
        assert red is not None
        inner = st.inner
        if red.point_loops and self.tidy(inner.lo) == self.tidy(inner.hi):
            self.border(st, expr, d, self.tidy(inner.lo), self.tidy(inner.hi), simd=True)
            return
        self.emit(d, f"const int acc0 = {self.tidy(inner.lo)};")
        self.emit(d, "#pragma omp simd")
        self.emit(d, self.for_line(inner.var, "acc0", self.tidy(inner.hi)))
        self.emit(d + 1, f"acc[{inner.var} - acc0] = {self.c_float(red.init)};")
        self.open_loops(red.loops, d)
        d2 = d + len(red.loops)
        ri = red.inner
        a = f"acc[{ri.var} - acc0]"
        self.emit(d2, "#pragma omp simd")
        self.emit(d2, self.for_line(ri.var, self.tidy(ri.lo), self.tidy(ri.hi)))
        self.emit(d2 + 1, f"{a} = {self._accumulate(red.op, a, self.expr(red.body))};")
        self.close_loops(len(red.loops), d)
        value = self._divide(st, f"acc[{inner.var} - acc0]", None)
        self.emit(d, "#pragma omp simd")
        self.emit(d, self.for_line(inner.var, "acc0", self.tidy(inner.hi)) + " {")
        self.emit(d + 1, f"const float acc_v = {value};")
        self.emit(d + 1, self.store(st, self.expr(expr)))
        self.emit(d, "}")

    def fast(self, st: Stage, expr: Expr, interior: Interior, d: int) -> None:
        """The interior: the inner loop split into its border columns (point form with
        window bounds) and the middle (taps unrolled, no bounds)."""
        inner = st.inner
        v = inner.var
        self.emit(d, "{")
        self.emit(
            d + 1, f"const int lo_{v} = {self.tidy(inner.lo)}, hi_{v} = {self.tidy(inner.hi)};"
        )
        box = interior.box[self.inner_dim]
        self.nt_ok = self.nt_ok and box is None
        if box is None:
            self.middle(st, expr, interior, d + 1, f"lo_{v}", f"hi_{v}")
        else:
            a, b = box
            self.border(st, expr, d + 1, f"lo_{v}", f"min(hi_{v}, {a - 1})")
            self.middle(st, expr, interior, d + 1, f"max(lo_{v}, {a})", f"min(hi_{v}, {b})")
            self.border(st, expr, d + 1, f"max(lo_{v}, {b + 1})", f"hi_{v}")
        self.emit(d, "}")

    def border(self, st: Stage, expr: Expr, d: int, lo: str, hi: str, simd: bool = False) -> None:
        """Each output point of ``lo..hi`` on its own: its window's taps, then the epilogue.
        ``simd``: the innermost window loop is a SIMD reduction. A sum is reassociated, as
        ATen's vectorised sums are, into a double: the row sums of a LayerNorm over two
        dims add up rows of large partial sums, which in float drifted to 5x ATen's
        (cascade-summed) error from the float64 result on rows of a large mean. A max or
        min is x86's max per lane plus a flag of any NaN seen (the result is then NaN, as
        ``torch.amax`` gives): softmax's row max, a global max-pool in NCHW."""
        red = st.reduction
        assert red is not None
        self.emit(d, self.for_line(st.inner.var, lo, hi) + " {")
        acc_type = "double" if simd and red.op == "sum" else "float"
        self.emit(d + 1, f"{acc_type} a = {self.c_float(red.init)};")
        minmax = simd and red.op in ("max", "min")
        if minmax:
            self.emit(d + 1, "int any_nan = 0;")
        vector = self.vector_row(red, d + 1) if simd else False
        self.open_loops(red.point_loops[:-1], d + 1)
        d2 = d + 1 + len(red.point_loops)
        body = self.expr(red.body)
        if minmax:
            self.emit(d2 - 1, f"#pragma omp simd reduction({red.op}:a) reduction(|:any_nan)")
            self.open_loops(red.point_loops[-1:], d2 - 1)
            cmp = ">" if red.op == "max" else "<"
            self.emit(d2, "{")
            self.emit(d2 + 1, f"const float x_ = {body};")
            self.emit(d2 + 1, f"a = a {cmp} x_ ? a : x_;")
            self.emit(d2 + 1, "any_nan |= x_ != x_;")
            self.emit(d2, "}")
        else:
            if simd:
                self.emit(d2 - 1, "#pragma omp simd reduction(+:a)")
            self.open_loops(red.point_loops[-1:], d2 - 1)
            self.emit(d2, f"a = {self._accumulate(red.op, 'a', body)};")
        self.close_loops(len(red.point_loops), d + 1)
        if vector:
            self.emit(0, "#endif")
        value = "(any_nan ? NAN : a)" if minmax else "a"
        self.emit(d + 1, f"const float acc_v = {self._divide(st, value, None)};")
        self.emit(d + 1, self.store(st, self.expr(expr)))
        self.emit(d, "}")

    def vector_row(self, red: Reduction, d: int) -> bool:
        """The AVX-512 form of a row reduction to one value (``border``'s ``simd``): chunks
        of 16 lanes of the innermost window loop, the last one masked (gcc's loop leaves
        up to 15 scalar iterations per row: a 197-long row of attention scores spent as
        long in them as in its 12 vector ones). A sum adds the lanes in double, in two
        vectors of 8; a max/min keeps a vector of lane maxima and a mask of the lanes that
        saw a NaN. Writes the ``#ifdef __AVX512F__`` branch and the ``#else`` (the caller
        writes the portable loops and the ``#endif``); False, writing nothing, when the
        body has no AVX-512 spelling."""
        if self.vec is None or self.s.simd_floats != LANES or red.op not in _IDENTITY:
            return False
        lp = red.point_loops[-1]
        v = self.vec(lp.var, f"{lp.var}0_", self.rows, self.scalars)
        try:
            x = v.expr(red.body)
        except Unsupported:
            return False
        self.emit(0, "#ifdef __AVX512F__")
        if red.op == "sum":
            self.emit(d, "__m512d s0_ = _mm512_setzero_pd(), s1_ = _mm512_setzero_pd();")
        else:
            self.emit(d, f"__m512 m_ = _mm512_set1_ps({self.c_float(red.init)});")
            self.emit(d, "__mmask16 nan_ = 0;")
        self.open_loops(red.point_loops[:-1], d)
        dd = d + len(red.point_loops) - 1
        self.emit(dd, "{")
        self.emit(
            dd + 1,
            f"const int lo_{lp.var}_ = {self.tidy(lp.lo)}, hi_{lp.var}_ = {self.tidy(lp.hi)};",
        )
        self.chunk_loop(dd + 1, v, f"lo_{lp.var}_", f"hi_{lp.var}_")
        if red.op == "sum":
            self.emit(dd + 2, f"const __m512 x_ = _mm512_maskz_mov_ps(mk, {x});")
            self.emit(
                dd + 2, "s0_ = _mm512_add_pd(s0_, _mm512_cvtps_pd(_mm512_castps512_ps256(x_)));"
            )
            self.emit(
                dd + 2,
                "s1_ = _mm512_add_pd(s1_, _mm512_cvtps_pd(_mm256_castpd_ps("
                "_mm512_extractf64x4_pd(_mm512_castps_pd(x_), 1))));",
            )
        else:
            self.emit(dd + 2, f"const __m512 x_ = {x};")
            self.emit(dd + 2, "nan_ |= _mm512_mask_cmp_ps_mask(mk, x_, x_, _CMP_UNORD_Q);")
            self.emit(dd + 2, f"m_ = _mm512_mask_{red.op}_ps(m_, mk, m_, x_);")
        self.emit(dd + 1, "}")
        self.emit(dd, "}")
        self.close_loops(len(red.point_loops) - 1, d)
        if red.op == "sum":
            self.emit(d, "a += _mm512_reduce_add_pd(_mm512_add_pd(s0_, s1_));")
        else:
            self.emit(d, f"a = _mm512_reduce_{red.op}_ps(m_);")
            self.emit(d, "any_nan = nan_ != 0;")
        self.emit(0, "#else")
        return True

    def middle(self, st: Stage, expr: Expr, interior: Interior, d: int, lo: str, hi: str) -> None:
        red = st.reduction
        assert red is not None
        body, names = [], []
        for i, env in enumerate(interior.taps):
            body.append(f"const float x{i} = {self.expr(subst_expr(red.body, env))};")
            names.append(f"x{i}")
        if red.init != _IDENTITY.get(red.op):
            body.append(f"const float x{len(names)} = {self.c_float(red.init)};")
            names.append(f"x{len(names)}")
        if red.op == "sum":
            value = " + ".join(names)
        elif red.op in ("max", "min"):
            cmp = ">" if red.op == "max" else "<"
            body.append(f"float m = {names[0]};")
            body += [f"m = m {cmp} {x} ? m : {x};" for x in names[1:]]
            pairs = [names[i : i + 2] for i in range(0, len(names), 2)]
            nan = " | ".join(f"__builtin_isunordered({p[0]}, {p[-1]})" for p in pairs)
            body.append(f"const int any_nan = {nan};")
            value = "any_nan ? NAN : m"
        else:
            raise ValueError(f"unknown reduction {red.op!r}")
        body.append(f"const float acc_v = {self._divide(st, f'({value})', interior.divisor)};")
        body.append(self.store(st, self.expr(expr)))

        def vector(v: VecExpr) -> list[str]:
            out, names = [], []
            for i, env in enumerate(interior.taps):
                out.append(f"const __m512 x{i} = {v.expr(subst_expr(red.body, env))};")
                names.append(f"x{i}")
            if red.init != _IDENTITY.get(red.op):
                out.append(f"const __m512 x{len(names)} = {v.expr(Const(red.init))};")
                names.append(f"x{len(names)}")
            if red.op == "sum":
                out.append(f"__m512 sum_ = {names[0]};")
                out += [f"sum_ = _mm512_add_ps(sum_, {x});" for x in names[1:]]
                total = "sum_"
            else:
                out.append(f"__m512 m_ = {names[0]};")
                out += [f"m_ = _mm512_{red.op}_ps(m_, {x});" for x in names[1:]]
                pairs = [names[i : i + 2] for i in range(0, len(names), 2)]
                nan = " | ".join(
                    f"_mm512_cmp_ps_mask({p[0]}, {p[-1]}, _CMP_UNORD_Q)" for p in pairs
                )
                out.append(f"const __mmask16 nan_ = {nan};")
                total = "_mm512_mask_blend_ps(nan_, m_, _mm512_set1_ps(NAN))"
            if red.divisor is not None:
                if interior.divisor is not None:
                    div = f"_mm512_set1_ps({self.c_float(float(interior.divisor))})"
                elif st.inner.var not in variables(red.divisor):
                    div = f"_mm512_set1_ps((float)({to_c(red.divisor)}))"
                else:
                    raise Unsupported("divisor varies along the inner variable")
                total = f"_mm512_div_ps({total}, {div})"
            out.append(f"const __m512 acc_v = {total};")
            out.append(self.vstore(st, v, v.expr(expr)))
            return out

        self.simd_loop(d, st.inner.var, lo, hi, body, vector)
