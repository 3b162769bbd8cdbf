"""Separable window reductions in AVX-512 (issue 18: pooling at memory speed).

A 2-D max/min/sum window over an elementwise producer of the group's inputs (BN -> ReLU ->
3x3/2 max-pool, the inception concat -> 3x3/1 max-pool, average pooling) is reduced in two
passes per output row ``h`` instead of one unrolled window per output:

1. **Rows** (vertical): for every input column ``x`` the output row needs, the producer
   evaluated on the window's input rows and reduced across them into a row buffer in L1
   (``wrow<k>_``): a flat, contiguous vector loop (NCHW: along ``x``; channels_last: along
   the channels of each pixel ``x``), every load a whole aligned vector, the producer
   evaluated once per input element and window row (1.5 times per input element for a
   3x3/2 window, the unrolled window took 2.25).
2. **Columns** (horizontal): each output chunk reduces the window's columns of the row
   buffer (NCHW: 16 outputs along ``w``, a stride-2 window deinterleaved with one
   ``vpermt2ps`` per tap from L1; channels_last: 16 channels of one output pixel), divides
   (average pooling), applies the stage's epilogue (the ReLU after a max-pool) and stores.

Four forms (measurements in ``bench/README.md``, issue 18's second pass):

* NCHW rows: the row pass of an output row, then its column pass; software prefetch of
  the rows ``PREFETCH_BYTES`` ahead; an output larger than the caches whose tiles are
  whole planes is staged in a plane buffer and streamed out non-temporally a row late
  (rows of 56 floats end mid-line: regular stores read every line first).
* NCHW flat planes (``SeparableWriter.flat``): a stride-1 window over rows as wide as the
  output (at least 16) runs each pass as one loop over the plane, the column taps masked
  per lane by the lane's column (28-float rows took two chunks a row in each pass).
* channels_last, register ring (``SeparableWriter.ring``, a window without dilation
  along ``w``): per block of up to four channel vectors, the input columns the output
  reads, reduced across the window rows, are kept in registers while ``w`` advances; each
  output reuses the columns it shares with the previous one. Max/min reduce without NaN
  blends and instead test every window row once for NaN (in the first output row that
  reads it) into a per-tile flag; a NaN sends the rest of the tile through the exact form
  below. Software prefetch of the rows ahead as in the NCHW rows. (Concat -> 3x3/1
  max-pool from DRAM, one core: 70% of the streaming kernel through the interleaved form,
  95% this way.)
* channels_last, interleaved (the exact form behind the ring, and dilated windows): each
  output column first runs the row pass up to the input columns it reads (loads and
  stores interleave; the two passes one after the other left the memory idle in turn).

The row buffer carries the reduction's identity (-inf, +inf, 0) in ``pad`` columns on
both sides, set once per tile, so no column tap has a bound or a mask; border rows (a
window row outside the input) run the row pass as a loop over the window rows that are
inside. Max/min keep PyTorch's NaN semantics (a NaN anywhere in the window gives NaN) in
two steps: every form is first written without NaN blends, testing each window input for
NaN once (the rows the output row before did not read; every row in the first output row
of the h loop and in border rows; every tap of a flat plane) into ``nb_``; a NaN seen
sends the row and the rest of the tile (a flat plane: the plane) through the exact form,
which blends NaN in at every pair of taps (BN -> ReLU -> 3x3/2 max-pool NCHW, one core:
81% of the streaming kernel with the blends everywhere, 88% this way).

Where the stage is not of this form (window bounds that are not "inside the window and
inside the input", loads that are not affine in the output and window variables with one
stride, dilation and offset per dim, an epilogue or producer without an AVX-512 spelling,
a row buffer over ``MAX_ROW_FLOATS``) :func:`plan` returns None and the caller writes the
unrolled or general window (``cstage.StageWriter``). The portable loops stay under
``#else``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from ...index_expr import Int, Ix, Op, Var, evaluate, to_c, variables
from ...loops import Call, Expr, Load, ParamVec, leaves
from ...passes.schedule_ir import Buffer, Loop, Schedule, Stage
from .vec512 import LANES, Unsupported, VecExpr, at, prefetch

# The largest row buffer (floats, on the stack of each thread): 64K floats, 256 KiB.
MAX_ROW_FLOATS = 65536
# All separable stages of one kernel together (floats on each thread's stack: 1 MiB, half
# of the smallest default thread stack, 2 MiB).
MAX_STACK_FLOATS = 262144
# The most window rows (and columns) unrolled in a pass.
MAX_TAPS = 16
# The largest table of per-output divisors (average pooling with a varying count).
MAX_DIVISOR_TABLE = 65536
# The largest output plane staged for non-temporal stores (floats, per thread).
MAX_STAGED_PLANE = 16384
# Software prefetch of the row pass: this many bytes of input rows ahead (at least one
# output row), into L2 (_MM_HINT_T1) by default; the backend picks the hint per CPU vendor
# (backend.prefetch_hint: _MM_HINT_T0 on AMD). Measured on one core, BN -> ReLU -> 3x3/2 max-pool
# NCHW 16x64x112x112 (rows of 448 bytes), the generated kernel against the streaming one,
# two runs on a host with load 2.5 (session 8): _MM_HINT_T0 4 output rows (3584 bytes)
# ahead 94% / 86%, 8 rows 94% / 88%; _MM_HINT_T1 4 rows 95% / 92%, 8 rows 96% / 93%,
# 12 rows 91% / 95%; no prefetch 69%. (Session 7, host load 10: T0 4 rows 85%, T1 82%.)
PREFETCH_BYTES = 7168
PREFETCH_HINT = "_MM_HINT_T1"
# The channels_last forms' prefetch distance along the input row. BN -> ReLU -> 3x3/2
# max-pool channels_last 16x64x112x112 (256-byte pixels), one core, the AMD host, against
# the streaming kernel in the same run (output on 2 MiB pages): the same rows one output
# row ahead 81%; in the rows being read 2 KiB ahead 83%, 3 KiB 92%, 4 KiB 90%, 5 KiB 87%,
# 6 KiB 84%, 8 KiB 80%; no prefetch 72%.
PREFETCH_NHWC_BYTES = 3072
# The flat form's prefetch distance: concat -> 3x3/1 max-pool NCHW, 28x28 planes, one
# core: none 79%, 1 KiB ahead 85%, 2 KiB 87%, 4 KiB 83%.
PREFETCH_FLAT_BYTES = 2048
# The flat form's middle loop is unrolled by its column masks' period, at most this many
# chunks (28- and 56-float rows: 7).
FLAT_UNROLL = 8
IDENTITY = {"max": float("-inf"), "min": float("inf"), "sum": 0.0}
# The channels_last register ring (``SeparableWriter.ring``): at most this many channel
# vectors per block, and window columns times vectors at most this many registers.
RING_VECTORS = 4
RING_REGISTERS = 24
# The fast forms' NaN test: the running sum ``nbv_`` of the window inputs tested is
# non-finite where one of them was NaN (or an inf, or the sum overflowed: then the exact
# form runs for nothing, and gives the same values).
NAN_FOLD = "nb_ |= _mm512_cmp_ps_mask(_mm512_sub_ps(nbv_, nbv_), _mm512_setzero_ps(), _CMP_NEQ_UQ);"
# the C name of the input column (the row pass's vector or pixel variable)
XVAR = "xw_"


@dataclasses.dataclass(frozen=True)
class Axis:
    """One window dim: output variable ``var`` (h or w), window variable ``kvar`` over
    ``k0..k1``; the input index read is ``stride*var + dilation*kvar + offset`` in
    ``0..size-1``; ``out`` output points."""

    var: str
    kvar: str
    k0: int
    k1: int
    stride: int
    dilation: int
    offset: int
    size: int
    out: int
    index: Ix  # the index tree (over var and kvar)

    @property
    def first(self) -> int:
        """Offset of the first tap from ``stride * var``."""
        return self.offset + self.dilation * self.k0

    @property
    def last(self) -> int:
        return self.offset + self.dilation * self.k1

    @property
    def pad(self) -> int:
        """Identity columns before input index 0 in the row buffer."""
        return max(0, -self.first)


@dataclasses.dataclass(frozen=True)
class Plan:
    op: str
    rows: Axis
    cols: Axis
    # None (no division), a float (the same count everywhere) or the table (out_h, out_w)
    divisor: float | np.ndarray | None


def _subst(x: Ix, env: dict[str, Ix]) -> Ix:
    if isinstance(x, Var):
        return env.get(x.name, x)
    if isinstance(x, Op):
        return Op(x.op, tuple(_subst(a, env) for a in x.args))
    return x


def subst_body(
    e: Expr, kvars: dict[str, Ix], col: tuple[Ix, Ix] | None, row: Ix | None = None
) -> Expr:
    """``e`` with the variables of ``kvars`` replaced and, with ``col = (old, new)``,
    every load's w index ``old`` replaced by ``new`` (the input column); with ``row``,
    every load's h index replaced by it."""
    if isinstance(e, Load):
        idx = [_subst(i, kvars) for i in e.index]  # type: ignore[arg-type]
        if col is not None:
            assert e.index[3] == col[0]
            idx[3] = col[1]
        if row is not None:
            idx[2] = row
        return Load(e.value, tuple(idx))  # type: ignore[arg-type]
    if isinstance(e, ParamVec):
        return ParamVec(e.name, e.data, _subst(e.index, kvars))  # type: ignore[arg-type]
    if isinstance(e, Call):
        return Call(e.fn, tuple(subst_body(a, kvars, col, row) for a in e.args))
    return e


def _fit(ix: Ix, var: str, kvar: str, out: int, k0: int, k1: int) -> tuple[int, int, int] | None:
    """(stride, dilation, offset) when ``ix == stride*var + dilation*kvar + offset`` for
    every ``var`` in ``0..out-1`` and ``kvar`` in ``k0..k1`` (checked on that grid)."""
    if not variables(ix) <= {var, kvar}:
        return None
    o = np.arange(out).reshape(-1, 1)
    k = np.arange(k0, k1 + 1).reshape(1, -1)
    vals = np.broadcast_to(evaluate(ix, {var: o, kvar: k}), (out, k1 - k0 + 1)).astype(np.int64)
    s = int(vals[1, 0] - vals[0, 0]) if out > 1 else 1
    dl = int(vals[0, 1] - vals[0, 0]) if k1 > k0 else 1
    off = int(vals[0, 0]) - dl * k0
    if s <= 0 or dl <= 0 or not np.array_equal(vals, s * o + dl * k + off):
        return None
    return s, dl, off


def _bounds(lp: Loop, var: str, out: int) -> tuple[np.ndarray, np.ndarray] | None:
    if not (variables(lp.lo) | variables(lp.hi)) <= {var}:
        return None
    o = np.arange(out)
    lo = np.broadcast_to(evaluate(lp.lo, {var: o}), (out,))
    hi = np.broadcast_to(evaluate(lp.hi, {var: o}), (out,))
    return lo, hi


def _whole_planes(b: Buffer) -> bool:
    """Whether ``b`` holds whole (h, w) planes at their global coordinates (an input, or
    scratch whose tiles span h and w): the window's bounds are then the value's shape."""
    if b.role == "input":
        return True
    return (
        b.role == "scratch"
        and b.origin[2] == Int(0)
        and b.origin[3] == Int(0)
        and tuple(b.extent[2:]) == tuple(b.shape[2:])
    )


def plan(st: Stage, s: Schedule) -> Plan | None:
    """The separable form of reduction stage ``st``, or None (see the module docstring)."""
    red = st.reduction
    if red is None or red.op not in IDENTITY or red.init != IDENTITY[red.op]:
        return None
    if len(red.point_loops) != 2:
        return None
    target = s.buffer(st.target)
    out_h, out_w = target.shape[2], target.shape[3]
    loads = [x for x in leaves(red.body) if isinstance(x, Load)]
    if not loads:
        return None
    bufs = {x.value: s.buffer_of(x.value) for x in loads}
    if not all(_whole_planes(b) for b in bufs.values()):
        return None
    kh, kw = red.point_loops
    bh, bw = _bounds(kh, "h", out_h), _bounds(kw, "w", out_w)
    if bh is None or bw is None:
        return None
    k0h, k1h = int(bh[0].min()), int(bh[1].max())
    k0w, k1w = int(bw[0].min()), int(bw[1].max())
    if not (0 <= k1h - k0h < MAX_TAPS and 0 <= k1w - k0w < MAX_TAPS):
        return None
    fits = set()
    for x in loads:
        i_n, i_c, i_h, i_w = x.index
        if (variables(i_n) | variables(i_c)) & {"h", "w", kh.var, kw.var}:  # type: ignore[arg-type]
            return None
        fh = _fit(i_h, "h", kh.var, out_h, k0h, k1h)  # type: ignore[arg-type]
        fw = _fit(i_w, "w", kw.var, out_w, k0w, k1w)  # type: ignore[arg-type]
        b = bufs[x.value]
        if fh is None or fw is None:
            return None
        fits.add((fh, fw, b.shape[2], b.shape[3], i_w))
    for p in leaves(red.body):
        if isinstance(p, ParamVec) and variables(p.index) & {"h", "w", kh.var, kw.var}:  # type: ignore[arg-type]
            return None
    if len(fits) != 1:
        return None
    (fh, fw, size_h, size_w, i_w) = fits.pop()
    i_h = loads[0].index[2]
    rows = Axis("h", kh.var, k0h, k1h, *fh, size_h, out_h, i_h)  # type: ignore[arg-type]
    cols = Axis("w", kw.var, k0w, k1w, *fw, size_w, out_w, i_w)  # type: ignore[arg-type]
    # the window loops must be exactly "inside the window and inside the input"
    for ax, (lo, hi) in ((rows, bh), (cols, bw)):
        o = np.arange(ax.out).reshape(-1, 1)
        k = np.arange(ax.k0, ax.k1 + 1).reshape(1, -1)
        pos = ax.stride * o + ax.dilation * k + ax.offset
        inside = (pos >= 0) & (pos < ax.size)
        want = (k >= lo.reshape(-1, 1)) & (k <= hi.reshape(-1, 1))
        if not np.array_equal(inside, want) or not inside.any(axis=1).all():
            return None
    divisor: float | np.ndarray | None = None
    if red.divisor is not None:
        if not variables(red.divisor) <= {"h", "w"}:
            return None
        g = {"h": np.arange(out_h).reshape(-1, 1), "w": np.arange(out_w).reshape(1, -1)}
        table = np.broadcast_to(evaluate(red.divisor, g), (out_h, out_w)).astype(np.float64)
        if table.min() == table.max():
            divisor = float(table.min())
        elif table.size <= MAX_DIVISOR_TABLE:
            divisor = table.astype(np.float32)
        else:
            return None
    return Plan(red.op, rows, cols, divisor)


class Writer(Protocol):
    """What the separable writer needs of ``cstage.StageWriter``."""

    s: Schedule
    nt_ok: bool
    decls: list[str]
    stream_min_bytes: float
    prefetch_hint: str

    def emit(self, depth: int, text: str) -> None: ...

    def vstore(self, st: Stage, v: VecExpr, value: str) -> str: ...

    def c_float(self, v: float) -> str: ...


def _reduce(op: str, names: list[str], out: list[str], result: str) -> None:
    """Appends to ``out`` the statements reducing the vectors ``names`` into ``result``
    (max/min: a NaN in any of them gives NaN, as PyTorch)."""
    if op == "sum":
        out.append(f"__m512 {result} = {names[0]};")
        out += [f"{result} = _mm512_add_ps({result}, {x});" for x in names[1:]]
        return
    tmp = f"{result}m_"
    out.append(f"__m512 {tmp} = {names[0]};")
    out += [f"{tmp} = _mm512_{op}_ps({tmp}, {x});" for x in names[1:]]
    pairs = [names[i : i + 2] for i in range(0, len(names), 2)]
    nan = " | ".join(f"_mm512_cmp_ps_mask({p[0]}, {p[-1]}, _CMP_UNORD_Q)" for p in pairs)
    out.append(f"const __m512 {result} = _mm512_mask_blend_ps({nan}, {tmp}, _mm512_set1_ps(NAN));")


def _combine(op: str, a: str, b: str) -> str:
    """``a op b`` for an accumulator ``a`` (NaN-propagating for max/min)."""
    return f"_mm512_add_ps({a}, {b})" if op == "sum" else f"mw_v{op}({a}, {b})"


class SeparableWriter:
    """Writes one reduction stage as the two passes of the module docstring. ``vec(var,
    start)`` makes the chunk printer of a loop; ``number`` names the row buffer."""

    def __init__(
        self,
        w: Writer,
        st: Stage,
        epilogue: Expr,
        p: Plan,
        inner_dim: int,
        vec: Callable[[str, str], VecExpr],
        number: int,
    ) -> None:
        self.w, self.st, self.epilogue, self.p = w, st, epilogue, p
        self.nhwc = inner_dim == 1
        self.vec = vec
        self.buf = f"wrow{number}_"
        self.div = f"wdiv{number}_"
        self.out_buf = f"wout{number}_"
        self.bad = f"wbad{number}_"  # the tile's NaN flag (see :meth:`write`)
        self.fast = False  # writing the fast form (max/min without NaN blends)
        self.flat_plane = self.is_flat()
        self.lines: list[tuple[int, str]] = []
        self.decls: list[str] = []
        self.stack_floats = 0  # the per-tile buffers declared (floats, on the stack)

    # ----------------------------------------------------------------- helpers
    def emit(self, depth: int, text: str) -> None:
        self.lines.append((depth, text))

    def reduce(
        self,
        names: list[str],
        out: list[str],
        result: str,
        check: list[str],
        first: Sequence[str] = (),
        by_sum: bool = True,
    ) -> None:
        """Appends the statements reducing ``names`` into ``result``: exactly (NaN blends,
        :func:`_reduce`), or while writing the fast form (``self.fast``) a plain chain
        with the values ``check`` added to the running sum ``nbv_`` (NaN or inf in any
        lane makes it non-finite: :data:`NAN_FOLD` tests it once, after the row or the
        plane; an inf or an overflow only sends the row to the exact form), and the values
        ``first`` tested by a compare per pair into ``nb_`` in the first output row of the
        h loop (``first_``). (A compare per pair, its mask or-ed into ``nb_`` at every
        chunk, left gcc spilling the masks: channels_last concat -> 3x3/1 max-pool, data
        in L2, 6% slower.) ``by_sum=False``: ``check`` compared too, for values whose
        masked-off lanes hold the reduction's identity (an infinity: every sum would be
        non-finite)."""
        if not self.fast or self.p.op == "sum":
            _reduce(self.p.op, names, out, result)
            return
        out.append(f"__m512 {result} = {names[0]};")
        out += [f"{result} = _mm512_{self.p.op}_ps({result}, {x});" for x in names[1:]]

        def tests(xs: list[str]) -> list[str]:
            pairs = [xs[i : i + 2] for i in range(0, len(xs), 2)]
            return [f"nb_ |= _mm512_cmp_ps_mask({a[0]}, {a[-1]}, _CMP_UNORD_Q);" for a in pairs]

        if by_sum:
            out += [f"nbv_ = _mm512_add_ps(nbv_, {x});" for x in check]
        else:
            out += tests(check)
        if first:
            out.append(f"if (first_) {{ {' '.join(tests(list(first)))} }}")

    def fresh(self, names: list[str]) -> list[str]:
        """Of the row taps ``names`` (window rows k0..k1), those that the output row
        before did not read (the rows to test for NaN when the row before tested its)."""
        rows = self.p.rows
        return [
            names[k - rows.k0]
            for k in range(rows.k0, rows.k1 + 1)
            if rows.stride % rows.dilation
            or not rows.k0 <= k + rows.stride // rows.dilation <= rows.k1
        ]

    def row_width(self) -> int:
        """Floats per input column in the row buffer (channels_last: the channel range)."""
        if not self.nhwc:
            return 1
        inner = self.st.inner
        if isinstance(inner.lo, Int) and isinstance(inner.hi, Int):
            return inner.hi.value - inner.lo.value + 1
        return self.w.s.buffer(self.st.target).extent[1]

    def columns(self) -> int:
        """Columns of the row buffer: the lead (identity), the input row, what the last
        chunk's taps reach past it (identity), and a chunk of slack for unmasked loads."""
        c = self.p.cols
        reach = c.stride * (c.out - 1 + (0 if self.nhwc else LANES)) + c.last + 1
        return self.lead() + max(c.size, reach) + 2 * LANES

    def aligned_taps(self) -> bool:
        """Whether the NCHW column pass reads its row buffer as aligned vectors and takes
        the taps apart in registers (:meth:`aligned_column`): stride 2, no dilation, taps
        at -1..2 columns from ``2 * w``. The unaligned loads of the other form each span
        two of the row pass's stores, which the store buffer cannot forward: they wait
        for both stores to reach L1 (BN -> ReLU -> 3x3/2 max-pool, NCHW, data in cache:
        0.088 ms per image that way, 0.053 aligned)."""
        c = self.p.cols
        return (
            not self.nhwc
            and c.stride == 2
            and c.dilation == 1
            and -1 <= c.first
            and c.last <= 2
            and c.pad <= LANES
        )

    def lead(self) -> int:
        """Identity floats before input column 0 in the row buffer: the window's pad, or
        one whole vector where the column pass reads aligned vectors (column 0 on a
        64-byte boundary; the vector before it holds column -1)."""
        return LANES if self.aligned_taps() else self.p.cols.pad

    def identity(self) -> str:
        return self.w.c_float(IDENTITY[self.p.op])

    def row_tap(self, v: VecExpr, k: Ix) -> str:
        """The producer at window row ``k`` and the input column of the row pass."""
        red = self.st.reduction
        assert red is not None
        body = subst_body(red.body, {self.p.rows.kvar: k}, (self.p.cols.index, Var(XVAR)))
        return v.expr(body)

    # ------------------------------------------------------------------ writing
    def is_flat(self) -> bool:
        """Whether an NCHW stage runs each (n, c) plane as two flat loops (``flat``): a
        stride-1 window over rows as wide as the output (the inception 3x3/1 max-pool
        over 28x28 planes: two chunks per row of 28 with the row form, 49 per plane
        flat), whole planes per tile, an epilogue without loads."""
        st, p = self.st, self.p
        if self.nhwc or p.rows.stride != 1 or p.cols.stride != 1:
            return False
        b = self.w.s.buffer(st.target)
        out_h, out_w = b.shape[2], b.shape[3]
        h, inner = st.loops[-1], st.inner
        full = all(
            isinstance(x, Int) and x.value == v
            for x, v in ((h.lo, 0), (h.hi, out_h - 1), (inner.lo, 0), (inner.hi, out_w - 1))
        )
        red = st.reduction
        assert red is not None
        ins = {x.value for x in leaves(red.body) if isinstance(x, Load)}
        rows_ok = all(
            self.w.s.buffer_of(v).strides[3] == 1
            and self.w.s.buffer_of(v).strides[2] == p.cols.size
            for v in ins
        )
        return (
            full
            and rows_ok
            and p.cols.size == out_w
            and out_w >= LANES
            and -p.cols.first <= LANES
            and p.cols.last <= LANES
            and b.strides[3] == 1
            and b.strides[2] == out_w
            and out_h * out_w + 2 * LANES <= MAX_ROW_FLOATS
            and not any(isinstance(x, Load) for x in leaves(self.epilogue))
        )

    def flat(self, d: int) -> None:
        """The flat plane (:meth:`flat_pass`); max/min first without NaN blends, the
        window inputs tested for NaN into ``nb_``, and the plane written again by the
        exact form where one was seen."""
        if self.p.op == "sum":
            self.flat_pass(d)
            return
        self.emit(d, "__mmask16 nb_ = 0;")
        self.emit(d, "__m512 nbv_ = _mm512_setzero_ps();")
        self.fast = True
        self.emit(d, "{")
        self.flat_pass(d + 1)
        self.emit(d, "}")
        self.fast = False
        self.emit(d, NAN_FOLD)
        self.emit(d, "if (nb_) {")
        self.flat_pass(d + 1)
        self.emit(d, "}")

    def flat_pass(self, d: int) -> None:
        """One (n, c) plane as one flat loop over its chunks of 16 output elements, both
        passes in registers: the row pass of chunk j + 1 (every window row at a constant
        offset of whole rows, each tap's loads masked to the lanes whose row is inside the
        input) is computed while the column pass of chunk j takes its taps from the row
        results of chunks j - 1, j and j + 1 (``valignd``: a tap q columns away is the
        concatenation shifted by q lanes), each masked to the lanes whose column it stays
        in. Stored non-temporally where the output is large. No plane buffer: each input
        and output element passes through memory once, and the row results never do.

        The loop runs in three parts. Where a chunk's row taps are inside the input and
        its output lanes all in the plane (every chunk but the first and last rows'),
        the loads are whole vectors, and the column masks, which repeat every
        ``lcm(W, 16) / 16`` chunks, are constants of a loop unrolled by that period
        (:data:`FLAT_UNROLL` at most); the chunks before and after take their masks from
        tables, one entry per chunk. (Concat -> 3x3/1 max-pool over 28x28 planes, data
        in L2, one core: 43 instructions a chunk with the tables everywhere.)"""
        p, st = self.p, self.st
        rows, cols = p.rows, p.cols
        red = st.reduction
        assert red is not None
        b = self.w.s.buffer(st.target)
        out_h, out_w = b.shape[2], b.shape[3]
        total = out_h * out_w
        chunks = -(-total // LANES)
        if isinstance(p.divisor, np.ndarray):
            vals = ", ".join(self.w.c_float(float(x)) for x in p.divisor.reshape(-1))
            self.decls.append(f"static const float {self.div}[{p.divisor.size}] = {{{vals}}};")

        def lane_masks(keep: Callable[[int], bool], entries: int) -> list[int]:
            """A lane mask per chunk (lanes past the plane never kept)."""
            return [
                sum(
                    1 << lane
                    for lane in range(LANES)
                    if (f := j * LANES + lane) < total and keep(f)
                )
                for j in range(entries)
            ]

        def table(name: str, masks: list[int]) -> str:
            ident = f"{self.buf}{name}_"
            decl = (
                f"static const unsigned short {ident}[{len(masks)}] = "
                f"{{{', '.join(str(x) for x in masks)}}};"
            )
            if decl not in self.decls:  # the fast and the exact plane share the tables
                self.decls.append(decl)
            return ident

        ident = f"_mm512_set1_ps({self.identity()})"
        fv = "f_"
        full = (1 << LANES) - 1
        # the row pass of the chunk at g_ (one more table entry: past the plane, no lanes)
        row_taps = []
        row_offsets = [rows.offset + rows.dilation * k for k in range(rows.k0, rows.k1 + 1)]
        for k in range(rows.k0, rows.k1 + 1):
            dr = rows.offset + rows.dilation * k
            masks = lane_masks(lambda f, dr=dr: 0 <= f // out_w + dr < rows.size, chunks + 1)
            body = subst_body(red.body, {rows.kvar: Int(k)}, (cols.index, Var(fv)), row=Int(dr))
            row_taps.append((table(f"r{k - rows.k0}", masks), masks, body))
        col_taps = []
        for k in range(cols.k0, cols.k1 + 1):
            q = cols.offset + cols.dilation * k
            masks = lane_masks(lambda f, q=q: 0 <= f % out_w + q < out_w, chunks)
            col_taps.append((q, table(f"c{k - cols.k0}", masks) if q else "", masks))

        def row_pass(start: str, result: str, whole: bool) -> list[str]:
            """``whole``: every tap's lanes inside the input (no masks)."""
            v = self.vec(fv, start)
            out: list[str] = []
            names = []
            for i, (tab, _, body) in enumerate(row_taps):
                m = f"(__mmask16){'0xFFFF' if whole else f'{tab}[{start} >> 4]'}"
                v.mask = m
                name = f"{result}{i}_"
                if whole:
                    value = v.expr(body)
                elif isinstance(body, Load):
                    value = f"_mm512_mask_loadu_ps({ident}, {m}, {v.load_address(body)})"
                else:  # the prologue of a masked-off lane must not reach the reduction
                    value = f"_mm512_mask_mov_ps({ident}, {m}, {v.expr(body)})"
                out.append(f"const __m512 {name} = {value};")
                names.append(name)
                if i == len(row_taps) - 1:
                    seen = set()
                    for x in leaves(body):
                        if isinstance(x, Load) and x.value not in seen:
                            seen.add(x.value)
                            buf, offset = v.load_offset(x)
                            out.insert(
                                0,
                                prefetch(
                                    buf, f"{offset} + {PREFETCH_FLAT_BYTES // 4}", "_MM_HINT_T0"
                                ),
                            )
            if v.stride2:
                raise Unsupported("a stride-2 load in the row pass")
            if whole:  # the NaN test of a whole chunk: the taps ``sampled`` summed
                self.reduce(names, out, result, check=[names[i] for i in sampled])
            else:  # (masked-off lanes hold the identity)
                self.reduce(names, out, result, check=names, by_sum=False)
            return out

        def chunk(j: int | None) -> list[str]:
            """The statements of output chunk ``f0_``: ``j``, its index where the chunk
            is whole (constant masks), else None (masks from the tables)."""
            out = [
                "const int g_ = f0_ + 16;",
                *row_pass("g_", "rn", whole=j is not None),
                "const __mmask16 mk = "
                + ("(__mmask16)0xFFFF;" if j is not None else f"mw_range(0, {total - 1} - f0_);"),
            ]
            names = []
            for i, (q, tab, masks) in enumerate(col_taps):
                name = f"z{i}_"
                names.append(name)
                if q == 0:
                    out.append(f"const __m512 {name} = rc_;")
                    continue
                # lanes q..q+15 of the row results (lo: the chunk before, hi: after)
                lo, hi, shift = ("rp_", "rc_", LANES + q) if q < 0 else ("rc_", "rn", q)
                shifted = (
                    lo
                    if shift == 0
                    else hi
                    if shift == LANES
                    else f"_mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512({hi}), "
                    f"_mm512_castps_si512({lo}), {shift}))"
                )
                if j is not None and masks[j] == full:
                    out.append(f"const __m512 {name} = {shifted};")
                    continue
                m = f"0x{masks[j]:04X}" if j is not None else f"{tab}[f0_ >> 4]"
                out.append(
                    f"const __m512 {name} = _mm512_mask_mov_ps({ident}, (__mmask16){m}, {shifted});"
                )
            self.reduce(names, out, "t_", check=[])
            v = self.vec("w", "w0_")
            total_v = "t_"
            if isinstance(p.divisor, float):
                total_v = f"_mm512_div_ps(t_, _mm512_set1_ps({self.w.c_float(p.divisor)}))"
            elif isinstance(p.divisor, np.ndarray):
                total_v = f"_mm512_div_ps(t_, _mm512_maskz_loadu_ps(mk, &{self.div}[f0_]))"
            out.append(f"const __m512 acc_v = {total_v};")
            out.append(f"const __m512 y_ = {v.expr(self.epilogue)};")
            if v.stride2:
                raise Unsupported("a stride-2 load in the epilogue")
            whole_store = "nt_" if j is not None else "nt_ && mk == (__mmask16)0xFFFF"
            out.append(
                f"if ({whole_store}) _mm512_stream_ps(o_ + f0_, y_); "
                "else _mm512_mask_storeu_ps(o_ + f0_, mk, y_);"
            )
            out.append("rp_ = rc_;")
            out.append("rc_ = rn;")
            return out

        plane = self.vec("w", "w0_").address(b, (Var("n"), Var("c"), Int(0), Int(0)))
        nt = b.role == "output" and b.elements * 4 >= self.w.stream_min_bytes
        self.emit(d, f"float *o_ = &{self.vec('w', 'w0_').ident(b)}[{plane}];")
        self.emit(d, f"const int nt_ = {'((uintptr_t)o_ & 63) == 0' if nt else '0'};")
        self.emit(d, f"__m512 rp_ = {ident}, rc_;")
        self.emit(d, "{")
        self.emit(d + 1, "const int g_ = 0;")
        for line in row_pass("g_", "r0_", whole=False):
            self.emit(d + 1, line)
        self.emit(d + 1, "rc_ = r0_;")
        self.emit(d, "}")
        first, stop, period = _whole_chunks(
            [m for _, m, _ in row_taps], [m for _, _, m in col_taps], total
        )
        sampled = _sampled_taps([m for _, m, _ in row_taps], row_offsets, out_w, first, stop)
        self.emit(d, "int f0_ = 0;")
        if stop > first:
            self.emit(d, f"for (; f0_ < {first * LANES}; f0_ += 16) {{")
            for line in chunk(None):
                self.emit(d + 1, line)
            self.emit(d, "}")
            self.emit(
                d, f"for (int F_ = {first * LANES}; F_ < {stop * LANES}; F_ += {period * LANES}) {{"
            )
            for u in range(period):
                self.emit(d + 1, "{")
                self.emit(d + 2, f"const int f0_ = F_ + {u * LANES};")
                for line in chunk(first + u):
                    self.emit(d + 2, line)
                self.emit(d + 1, "}")
            self.emit(d, "}")
            self.emit(d, f"f0_ = {stop * LANES};")
        self.emit(d, f"for (; f0_ < {total}; f0_ += 16) {{")
        for line in chunk(None):
            self.emit(d + 1, line)
        self.emit(d, "}")

    def write(self, d: int) -> None:
        """The statements for one output row (inside the stage's loops down to ``h``;
        channels_last: the ``w`` loop is written here). Raises Unsupported before the
        caller has emitted anything of it."""
        if self.flat_plane:
            self.flat(d)
            return
        p, st = self.p, self.st
        ring = self.ring_ok()
        checked = p.op != "sum"
        cw = self.row_width()
        size = self.columns() * cw + LANES
        init = f"for (int i_ = 0; i_ < {size}; ++i_) {self.buf}[i_] = {self.identity()};"
        if not ring or checked:  # the row buffer of the interleaved and NCHW rows
            if size > MAX_ROW_FLOATS:
                raise Unsupported("row buffer too large")
            self.decls.append(f"float {self.buf}[{size}] __attribute__((aligned(64)));")
            self.stack_floats += size
            if ring:  # only the exact form behind the ring uses it: set when it first runs
                self.decls.append(f"int {self.buf}ok_ = 0; (void){self.buf}ok_;")
            else:
                self.decls.append(init)
        if checked:  # (void): unused by the portable loops under #else
            self.decls.append(f"unsigned {self.bad} = 0; (void){self.bad};")
        if isinstance(p.divisor, np.ndarray):
            vals = ", ".join(self.w.c_float(float(x)) for x in p.divisor.reshape(-1))
            self.decls.append(f"static const float {self.div}[{p.divisor.size}] = {{{vals}}};")
        rows, cols = p.rows, p.cols
        if self.nhwc:
            wloop = st.loops[-1]
            lo, hi = to_c(st.inner.lo), to_c(st.inner.hi)
            self.emit(d, f"const int lo_c_ = {lo}, hi_c_ = {hi};")
            self.emit(d, f"const int lo_w_ = {to_c(wloop.lo)}, hi_w_ = {to_c(wloop.hi)};")
        else:
            lo, hi = to_c(st.inner.lo), to_c(st.inner.hi)
            self.emit(d, f"const int lo_w_ = {lo}, hi_w_ = {hi};")
        self.emit(
            d,
            f"const int xlo_ = max({cols.stride} * lo_w_ + {cols.first}, 0), "
            f"xhi_ = min({cols.stride} * hi_w_ + {cols.last}, {cols.size - 1});",
        )
        ra = to_c(_subst(rows.index, {rows.kvar: Int(rows.k0)}))
        rb = to_c(_subst(rows.index, {rows.kvar: Int(rows.k1)}))
        staged = self.staged()
        inside = f"({ra}) >= 0 && ({rb}) <= {rows.size - 1}"

        def rows_of(depth: int, exact: bool) -> None:
            """The row, by the fast form or the exact one (each unguarded where every
            window row is inside the input)."""
            self.fast = not exact
            self.emit(depth, f"if ({inside}) {{")
            for guarded in (False, True):
                if ring and not exact:
                    self.ring(depth + 1, guarded=guarded)
                else:
                    self.interleaved(depth + 1, cw, guarded=guarded, staged=staged)
                if not guarded:
                    self.emit(depth, "} else {")
            self.emit(depth, "}")
            self.fast = False

        if not checked:
            rows_of(d, exact=not ring)
        else:
            # Max/min: the fast form tests the window rows for NaN into the tile's sticky
            # flag (the first output row of the stage's h loop, ``first_``, and every
            # border row, all of them; each later row only those the row before did not
            # read); a NaN seen sends this row and the rest of the tile through the exact
            # form.
            first_row = to_c(next(lp for lp in st.loops if lp.var == "h").lo)
            self.emit(d, f"if (!{self.bad}) {{")
            self.emit(d + 1, "__mmask16 nb_ = 0;")
            self.emit(d + 1, "__m512 nbv_ = _mm512_setzero_ps();")
            self.emit(d + 1, f"const int first_ = h == ({first_row});")
            rows_of(d + 1, exact=False)
            self.emit(d + 1, NAN_FOLD)
            self.emit(d + 1, f"{self.bad} |= nb_;")
            self.emit(d, "}")
            self.emit(d, f"if ({self.bad}) {{")
            if ring:
                self.emit(d + 1, f"if (!{self.buf}ok_) {{ {init} {self.buf}ok_ = 1; }}")
            rows_of(d + 1, exact=True)
            self.emit(d, "}")
        if staged:
            b = self.w.s.buffer(st.target)
            size = b.shape[2] * b.shape[3] + LANES
            self.decls.append(f"float {self.out_buf}[{size}] __attribute__((aligned(64)));")
            self.stack_floats += size
            self.flush(d, self.vec("w", "w0_"))

    def ring_ok(self) -> bool:
        """Whether the channels_last row runs as a register ring (:meth:`ring`): a
        window without dilation along ``w``."""
        return self.nhwc and self.p.cols.dilation == 1

    def ring(self, d: int, guarded: bool) -> None:
        """channels_last, one output row: per block of up to ``RING_VECTORS`` channel
        vectors, the window's input columns reduced across the window rows are kept in
        registers (``q<i>_<j>``: column i of the window, vector j of the block) while
        ``w`` advances; each output reuses the columns it shares with the previous one
        (``S - stride`` of the window's ``S``) and computes the rest. Nothing passes
        through a row buffer: each input element is loaded once per window row, each
        output stored once.

        Max/min reduce without NaN blends; instead every window input is tested for NaN
        into the tile's flag ``wbad<k>_`` (one unordered compare per pair of taps), and
        a row with a NaN is written again by the exact form (see :meth:`write`)."""
        p, cols = self.p, self.p.cols
        span, s = cols.k1 - cols.k0 + 1, cols.stride
        keep = max(0, span - s)
        nvec = -(-self.row_width() // LANES)
        block = max(1, min(RING_VECTORS, RING_REGISTERS // span, nvec))
        ident = f"_mm512_set1_ps({self.identity()})"
        q = [[f"q{i}_{j}_" for j in range(block)] for i in range(span)]
        self.emit(d, f"for (int cb_ = lo_c_; cb_ <= hi_c_; cb_ += {LANES * block}) {{")
        dd = d + 1
        masks = [f"mk{j}_" for j in range(block)]
        self.emit(
            dd,
            "const __mmask16 "
            + ", ".join(
                f"{m} = mw_range(0, hi_c_ - cb_ - {LANES * j})" for j, m in enumerate(masks)
            )
            + ";",
        )
        self.emit(dd, "__m512 " + ", ".join(f"{x} = {ident}" for r in q for x in r) + ";")
        # rows inside the input: every load and store from a pointer set here (the border
        # rows' guarded loops address from the buffers: a pointer to window row k0 would
        # lie outside the input there)
        based = {} if guarded else self.row_pointers(dd)

        def column(i: int, x: str, depth: int) -> None:
            """Column ``i`` of the ring: input column ``x`` reduced across the rows."""
            self.emit(depth, "{")
            self.emit(depth + 1, f"const ptrdiff_t {XVAR} = {x};")
            self.emit(depth + 1, f"if ({XVAR} >= 0 && {XVAR} <= {cols.size - 1}) {{")
            for j in range(block):
                v = _rebased(self.vec("c", f"(cb_ + {LANES * j})"), based)
                v.mask = masks[j]
                lines = self.row_body(v, self.row_width(), guarded, f"{q[i][j]} = r_;")
                self.emit(depth + 2, "{")
                for line in lines:
                    self.emit(depth + 3, line)
                self.emit(depth + 2, "}")
            self.emit(depth + 1, "} else {")
            for j in range(block):
                self.emit(depth + 2, f"{q[i][j]} = {ident};")
            self.emit(depth + 1, "}")
            self.emit(depth, "}")

        first = cols.first
        for i in range(s, span):  # the columns the first output shares with the one before
            column(i, f"{s} * lo_w_ + {first + i - s}", dd)
        self.emit(dd, "for (int w = lo_w_; w <= hi_w_; ++w) {")
        for i in range(keep):
            for j in range(block):
                self.emit(dd + 1, f"{q[i][j]} = {q[i + s][j]};")
        for i in range(keep, span):
            column(i, f"{s} * w + {first + i}", dd + 1)
        for j in range(block):
            v = _rebased(self.vec("c", f"(cb_ + {LANES * j})"), based)
            self.emit(dd + 1, "{")
            self.emit(dd + 2, f"const __mmask16 mk = {masks[j]};")
            fn = "add" if p.op == "sum" else p.op  # no NaN blends: see ``write``
            out = [f"__m512 t_ = {q[0][j]};"]
            out += [f"t_ = _mm512_{fn}_ps(t_, {q[i][j]});" for i in range(1, span)]
            out += self.finish(v, staged=False)
            for line in out:
                self.emit(dd + 2, line)
            self.emit(dd + 1, "}")
        self.emit(dd, "}")
        self.emit(d, "}")

    def row_pointers(self, d: int) -> dict[str, tuple[str, tuple[Ix, ...]]]:
        """Declares the ring's pointers of one channel block: per buffer the row taps load
        (at window row ``k0``, input column 0, channel ``cb_``) and the output's (at
        ``w`` 0); returns buffer name -> (pointer, the index it points at), for
        :func:`_rebased`. With every load ``pointer[constant + xw_ * pixel]``, gcc keeps
        one induction variable: addressed from the buffers, each load's own 32-bit offset
        was recomputed, sign-extended, and spilled (channels_last concat -> 3x3/1
        max-pool, one core, data in cache: 130 instructions per four output vectors
        that way, 55 this way; ``llvm-mca`` 28 against 16 cycles). Scratch buffers
        (their indices less a tile origin) keep their addressing."""
        red = self.st.reduction
        assert red is not None
        rows, cols = self.p.rows, self.p.cols
        body = subst_body(red.body, {rows.kvar: Int(rows.k0)}, (cols.index, Var(XVAR)))
        v = self.vec("c", "cb_")
        based: dict[str, tuple[str, tuple[Ix, ...]]] = {}
        for x in leaves(body):
            if not isinstance(x, Load) or x.value in v.rows or x.value in v.scalars:
                continue
            b = v.buffer_of(x.value)
            if b.role == "scratch" or b.name in based:
                continue
            ref = tuple(_subst(at(i, "c", "cb_"), {XVAR: Int(0)}) for i in x.index)
            name = f"{self.buf}p{len(based)}_"
            self.emit(d, f"const float *restrict {name} = &{v.ident(b)}[{v.address(b, ref)}];")
            based[b.name] = (name, ref)
        target = self.w.s.buffer(self.st.target)
        if target.role != "scratch" and target.name not in based:
            ref = (Var("n"), Var("cb_"), Var("h"), Int(0))
            name = f"{self.buf}po_"
            self.emit(d, f"float *restrict {name} = &{v.ident(target)}[{v.address(target, ref)}];")
            based[target.name] = (name, ref)
        return based

    def finish(self, v: VecExpr, staged: bool) -> list[str]:
        """From the reduced chunk ``t_``: the division, the stage's epilogue, the store
        (``staged``: into the plane buffer)."""
        p, cols, st = self.p, self.p.cols, self.st
        out: list[str] = []
        total = "t_"
        if isinstance(p.divisor, float):
            total = f"_mm512_div_ps(t_, _mm512_set1_ps({self.w.c_float(p.divisor)}))"
        elif isinstance(p.divisor, np.ndarray):
            ow = cols.out
            if self.nhwc:
                div = f"_mm512_set1_ps({self.div}[h * {ow} + w])"
            else:
                div = f"_mm512_maskz_loadu_ps(mk, &{self.div}[h * {ow} + w0_])"
            total = f"_mm512_div_ps(t_, {div})"
        out.append(f"const __m512 acc_v = {total};")
        if staged:
            ow = self.w.s.buffer(st.target).shape[3]
            dst = f"&{self.out_buf}[h * {ow} + w0_]"
            out.append(f"_mm512_mask_storeu_ps({dst}, mk, {v.expr(self.epilogue)});")
        else:
            out.append(self.w.vstore(st, v, v.expr(self.epilogue)))
        if v.stride2:
            raise Unsupported("a stride-2 load in the epilogue")
        return out

    def interleaved(self, d: int, cw: int, guarded: bool, staged: bool) -> None:
        """The column pass over the output row, each step first running the row pass up
        to the last input column it reads: loads of the input and stores of the output
        interleave (one pass after the other left the memory idle in turn: channels_last
        concat -> 3x3/1 max-pool measured 79% of the streaming kernel that way)."""
        cols = self.p.cols
        s, last = cols.stride, cols.last
        if self.nhwc:
            self.emit(d, "int xd_ = xlo_;")
            self.emit(d, "for (int w = lo_w_; w <= hi_w_; ++w) {")
            self.emit(d + 1, f"const int xn_ = min({s} * w + {last}, xhi_);")
            self.emit(d + 1, "for (; xd_ <= xn_; ++xd_) {")
            self.emit(d + 2, f"const int {XVAR} = xd_;")
            self.emit(d + 2, "for (int c0_ = lo_c_; c0_ <= hi_c_; c0_ += 16) {")
            self.emit(d + 3, "const __mmask16 mk = mw_range(0, hi_c_ - c0_);")
            v = self.vec("c", "c0_")
            dst = f"&{self.buf}[({cols.pad} + {XVAR}) * {cw} + c0_ - lo_c_]"
            for line in self.row_body(v, cw, guarded, f"_mm512_mask_storeu_ps({dst}, mk, r_);"):
                self.emit(d + 3, line)
            self.close(d + 1, d + 3)
            self.emit(d + 1, "for (int c0_ = lo_c_; c0_ <= hi_c_; c0_ += 16) {")
            dd = d + 2
            self.emit(dd, "const __mmask16 mk = mw_range(0, hi_c_ - c0_);")
            self.emit(
                dd,
                f"const float *q_ = &{self.buf}[({cols.pad} + {s} * w + "
                f"{cols.offset}) * {cw} + c0_ - lo_c_];",
            )
            for line in self.column_body(self.vec("c", "c0_"), cw, staged):
                self.emit(dd, line)
            self.close(d, dd)
            return
        # NCHW: the row pass first (rows of a few chunks with constant bounds, which gcc
        # unrolls whole; interleaved chunk by chunk the BN -> ReLU -> 3x3/2 max-pool fell
        # from 86% to 73% of the streaming kernel)
        self.row_pass(d, cw, guarded)
        self.emit(d, "for (int w0_ = lo_w_; w0_ <= hi_w_; w0_ += 16) {")
        self.emit(d + 1, "const __mmask16 mk = mw_range(0, hi_w_ - w0_);")
        if self.aligned_taps():
            body = self.aligned_column(self.vec("w", "w0_"), staged)
        else:
            self.emit(
                d + 1, f"const float *q_ = &{self.buf}[{cols.pad} + {s} * w0_ + {cols.offset}];"
            )
            body = self.column_body(self.vec("w", "w0_"), cw, staged)
        for line in body:
            self.emit(d + 1, line)
        self.emit(d, "}")

    def row_loop(self, d: int, cw: int) -> tuple[VecExpr, str, int]:
        """Opens the chunk loop of the row pass; (printer, row-buffer address, depth)."""
        if self.nhwc:
            self.emit(d, f"for (int {XVAR} = xlo_; {XVAR} <= xhi_; ++{XVAR}) {{")
            self.emit(d + 1, "for (int c0_ = lo_c_; c0_ <= hi_c_; c0_ += 16) {")
            self.emit(d + 2, "const __mmask16 mk = mw_range(0, hi_c_ - c0_);")
            v = self.vec("c", "c0_")
            dst = f"&{self.buf}[({self.p.cols.pad} + {XVAR}) * {cw} + c0_ - lo_c_]"
            return v, dst, d + 2
        x0 = f"{XVAR}0_"
        self.emit(d, f"for (int {x0} = xlo_; {x0} <= xhi_; {x0} += 16) {{")
        self.emit(d + 1, f"const __mmask16 mk = mw_range(0, xhi_ - {x0});")
        v = self.vec(XVAR, x0)
        return v, f"&{self.buf}[{self.lead()} + {x0}]", d + 1

    def close(self, d: int, depth: int) -> None:
        for i in reversed(range(d, depth)):
            self.emit(i, "}")

    def row_pass(
        self, d: int, cw: int, guarded: bool, dst_row: str | None = None, pad: int = 0
    ) -> None:
        """The row pass over ``xlo_..xhi_`` (``dst_row``: into row ``dst_row`` of a
        plane buffer with ``pad`` leading floats, the flat form's border rows)."""
        v, dst, dd = self.row_loop(d, cw)
        if dst_row is not None:
            dst = f"&{self.buf}[{pad} + {dst_row} + {XVAR}0_]"
        for line in self.row_body(v, cw, guarded, f"_mm512_mask_storeu_ps({dst}, mk, r_);"):
            self.emit(dd, line)
        self.close(d, dd)

    def row_body(self, v: VecExpr, cw: int, guarded: bool, store: str) -> list[str]:
        """One chunk of the row pass: the producer on each window row (``guarded``: only
        the rows inside the input), reduced into ``r_`` (the fast form: each value the
        output row before did not read tested for NaN into ``nb_``), then ``store``."""
        p, rows = self.p, self.p.rows
        out: list[str] = []
        if not guarded:
            # the software prefetch of the rows ahead: without it the channels_last ring
            # waits on memory (concat -> 3x3/1 max-pool from DRAM, one core: 74% of the
            # streaming kernel, 96% with it)
            out += self.prefetches(v, cw)
            names = []
            for k in range(rows.k0, rows.k1 + 1):
                out.append(f"const __m512 y{k - rows.k0}_ = {self.row_tap(v, Int(k))};")
                names.append(f"y{k - rows.k0}_")
            # the rows the output row before read too: tested in the first output row of
            # the h loop only
            fresh = self.fresh(names)
            stale = [x for x in names if x not in fresh]
            self.reduce(names, out, "r_", check=fresh, first=stale)
        else:
            row = to_c(_subst(rows.index, {rows.kvar: Var("k_")}))
            out.append(f"__m512 r_ = _mm512_set1_ps({self.identity()});")
            out.append(f"for (int k_ = {rows.k0}; k_ <= {rows.k1}; ++k_) {{")
            out.append(f"  if (({row}) < 0 || ({row}) > {rows.size - 1}) continue;")
            if self.fast and p.op != "sum":
                out.append(f"  const __m512 y_ = {self.row_tap(v, Var('k_'))};")
                out.append(f"  r_ = _mm512_{p.op}_ps(r_, y_);")
                out.append("  nb_ |= _mm512_cmp_ps_mask(y_, y_, _CMP_UNORD_Q);")
            else:
                out.append(f"  r_ = {_combine(p.op, 'r_', self.row_tap(v, Var('k_')))};")
            out.append("}")
        if v.stride2:
            raise Unsupported("a stride-2 load in the row pass")
        out.append(store)
        return out

    def prefetches(self, v: VecExpr, cw: int) -> list[str]:
        """Prefetches of the input rows that this output row reads first (the last
        ``stride`` window rows). NCHW: those rows of the output row ``PREFETCH_BYTES``
        ahead, at this chunk's column (the hardware prefetcher follows short NCHW rows
        late). channels_last: the same rows of this output row, ``PREFETCH_NHWC_BYTES``
        ahead along the row (a row of pixels is tens of KiB: a line prefetched a whole
        output row ahead left L1 again before it was read)."""
        red = self.st.reduction
        assert red is not None
        rows = self.p.rows
        row_bytes = rows.stride * self.p.cols.size * cw * 4
        ahead = 0 if self.nhwc else max(1, -(-PREFETCH_BYTES // row_bytes))
        out: list[str] = []
        for k in range(max(rows.k0, rows.k1 - rows.stride + 1), rows.k1 + 1):
            body = subst_body(
                red.body,
                {rows.kvar: Int(k), "h": Op("add", (Var("h"), Int(ahead)))},
                (self.p.cols.index, Var(XVAR)),
            )
            seen = set()
            for x in leaves(body):
                if isinstance(x, Load) and x.value not in seen:
                    seen.add(x.value)
                    if self.nhwc:
                        pixel = v.buffer_of(x.value).strides[3] * 4
                        cols = max(1, -(-PREFETCH_NHWC_BYTES // pixel))
                        x = Load(x.value, (*x.index[:3], Op("add", (Var(XVAR), Int(cols)))))
                    out.append(prefetch(*v.load_offset(x), self.w.prefetch_hint))
        return out

    def staged(self) -> bool:
        """Whether the output is written through a plane buffer and non-temporal stores
        (NCHW, an output larger than the caches, whole planes per tile, a plane that fits):
        rows of 56 floats do not end on a 64-byte line, and a line written by regular
        stores is read first (read-for-ownership, a fifth more traffic for the 3x3/2
        chain)."""
        st = self.st
        b = self.w.s.buffer(st.target)
        h, inner = st.loops[-1], st.inner
        out_h, out_w = b.shape[2], b.shape[3]
        full = (
            isinstance(h.lo, Int)
            and h.lo.value == 0
            and isinstance(h.hi, Int)
            and h.hi.value == out_h - 1
            and isinstance(inner.lo, Int)
            and inner.lo.value == 0
            and isinstance(inner.hi, Int)
            and inner.hi.value == out_w - 1
        )
        return (
            not self.nhwc
            and full
            and b.role == "output"
            and b.elements * 4 >= self.w.stream_min_bytes
            and b.strides[3] == 1
            and b.strides[2] == out_w
            and out_h * out_w <= MAX_STAGED_PLANE
        )

    def flush(self, d: int, v: VecExpr) -> None:
        """Streams the staged plane's lines completed before this output row (all of the
        rest at the last row) to the output: one row late, so that the lines read back
        were stored a row earlier (no store-forwarding stall)."""
        b = self.w.s.buffer(self.st.target)
        out_h, out_w = b.shape[2], b.shape[3]
        total = out_h * out_w
        plane = v.address(b, (Var("n"), Var("c"), Int(0), Int(0)))
        self.emit(d, "{")
        self.emit(d + 1, f"float *o_ = &{v.ident(b)}[{plane}];")
        self.emit(
            d + 1,
            f"const int f0_ = h > 0 ? ((h - 1) * {out_w}) / 16 * 16 : 0, "
            f"f1_ = h == {out_h - 1} ? {total} : (h * {out_w}) / 16 * 16;",
        )
        self.emit(d + 1, "if (((uintptr_t)o_ & 63) == 0) {")
        self.emit(d + 2, "int i_ = f0_;")
        self.emit(
            d + 2,
            f"for (; i_ + 16 <= f1_; i_ += 16) _mm512_stream_ps(o_ + i_, _mm512_load_ps({self.out_buf} + i_));",
        )
        self.emit(
            d + 2,
            f"if (i_ < f1_) {{ const __mmask16 m_ = mw_range(0, f1_ - i_ - 1); "
            f"_mm512_mask_storeu_ps(o_ + i_, m_, _mm512_maskz_load_ps(m_, {self.out_buf} + i_)); }}",
        )
        self.emit(d + 1, "} else {")
        self.emit(
            d + 2,
            f"for (int i_ = f0_; i_ < f1_; i_ += 16) {{ const __mmask16 m_ = "
            f"mw_range(0, f1_ - i_ - 1); _mm512_mask_storeu_ps(o_ + i_, m_, "
            f"_mm512_maskz_load_ps(m_, {self.out_buf} + i_)); }}",
        )
        self.emit(d + 1, "}")
        self.emit(d, "}")

    def column_body(self, v: VecExpr, cw: int, staged: bool) -> list[str]:
        """One chunk of the column pass (``q_``: the row buffer at its first tap): the
        taps reduced, divided, the stage's epilogue, the store (``staged``: into the
        plane buffer)."""
        cols = self.p.cols
        out, names = [], []
        for k in range(cols.k0, cols.k1 + 1):
            off = cols.dilation * k * cw
            out.append(f"const __m512 z{k - cols.k0}_ = {self.column_tap(off)};")
            names.append(f"z{k - cols.k0}_")
        self.reduce(names, out, "t_", check=[])
        return out + self.finish(v, staged)

    def aligned_column(self, v: VecExpr, staged: bool) -> list[str]:
        """One chunk of the stride-2 column pass from vectors of the row buffer (aligned
        where the row starts on a chunk, ``lo_w_`` a multiple of 8; unaligned loads
        otherwise):
        ``a_``, ``b_`` (columns ``2 * w0_`` ..  ``+ 31``), ``e_``/``o_`` their even and odd
        columns (two permutes); a tap one column left is ``o_`` shifted in from the
        vector before (``valignd``), one column right of the even ones ``e_`` shifted in
        from the vector after."""
        cols = self.p.cols
        offsets = [cols.first + k for k in range(cols.k1 - cols.k0 + 1)]
        out = [
            f"const float *q_ = &{self.buf}[{self.lead()} + 2 * w0_];",
            "const __m512 a_ = _mm512_loadu_ps(q_), b_ = _mm512_loadu_ps(q_ + 16);",
            "const __m512 e_ = _mm512_permutex2var_ps(a_, _mm512_load_si512(mw_even), b_);",
            "const __m512 o_ = _mm512_permutex2var_ps(a_, _mm512_load_si512(mw_odd), b_);",
        ]
        taps = {
            0: "e_",
            1: "o_",
            -1: "_mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(o_), "
            "_mm512_castps_si512(_mm512_loadu_ps(q_ - 16)), 15))",
            2: "_mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512("
            "_mm512_loadu_ps(q_ + 32)), _mm512_castps_si512(e_), 1))",
        }
        names = []
        for i, o in enumerate(offsets):
            out.append(f"const __m512 z{i}_ = {taps[o]};")
            names.append(f"z{i}_")
        self.reduce(names, out, "t_", check=[])
        return out + self.finish(v, staged)

    def column_tap(self, off: int) -> str:
        """Tap at ``off`` floats from ``q_``: 16 consecutive outputs read columns
        ``stride`` apart (NCHW) or 16 channels of one column (channels_last)."""
        s = self.p.cols.stride
        if self.nhwc or s == 1:
            return f"_mm512_loadu_ps(q_ + {off})"
        if s == 2:
            return (
                f"_mm512_permutex2var_ps(_mm512_loadu_ps(q_ + {off}), "
                f"_mm512_load_si512(mw_even), _mm512_loadu_ps(q_ + {off + LANES}))"
            )
        return (
            f"_mm512_i32gather_ps(_mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, "
            f"10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32({s})), q_ + {off}, 4)"
        )


__all__ = ["MAX_STACK_FLOATS", "Plan", "SeparableWriter", "plan"]


def _rebased(v: VecExpr, based: dict[str, tuple[str, tuple[Ix, ...]]]) -> VecExpr:
    """``v`` addressing each buffer of ``based`` from its pointer (``row_pointers``): an
    element at ``index`` is ``pointer[address(index - the pointer's index)]``, each
    dimension's difference a number where it is one (``(h + 2 - 1) - (h + 0 - 1)`` is 2,
    :func:`_difference`), the constant parts summed into one."""
    if not based:
        return v
    ident, address = v.ident, v.address

    def ident_of(b: Buffer) -> str:
        return based[b.name][0] if b.name in based else ident(b)

    def address_of(b: Buffer, index: tuple[Ix, ...]) -> str:
        if b.name not in based:
            return address(b, index)
        const, terms = 0, []
        for d, (i, r) in enumerate(zip(index, based[b.name][1], strict=True)):
            if b.extent[d] == 1:
                continue
            diff = _difference(i, r)
            if isinstance(diff, Int):
                const += diff.value * b.strides[d]
                continue
            text = to_c(diff) if isinstance(diff, Var) else f"({to_c(diff)})"
            terms.append(text if b.strides[d] == 1 else f"{text} * {b.strides[d]}")
        return " + ".join(terms + [str(const)] if const or not terms else terms)

    v.ident, v.address = ident_of, address_of
    return v


_START = re.compile(r"^\((\w+) \+ (\d+)\)$")


def _difference(x: Ix, ref: Ix) -> Ix:
    """``x - ref``: ``x`` itself where ``ref`` is 0, a number where the difference is the
    same for any value of the variables (a chunk's start ``(cb_ + 16)``, as ``VecExpr``
    names it, read as the sum it is), else the difference for the C compiler to fold.
    Both sums (:func:`_affine`), the difference is ``d(0) + sum_v (d(e_v) - d(0)) * v``
    exactly: a number where every coefficient ``d(e_v) - d(0)`` is 0."""
    if ref == Int(0):
        return x
    a, b = _opened(x), _opened(ref)
    if not (_affine(a) and _affine(b)):
        return Op("sub", (x, ref))
    names = variables(a) | variables(b)

    def d(one: str | None) -> int:
        env = {nm: int(nm == one) for nm in names}
        return int(evaluate(a, env)) - int(evaluate(b, env))

    at_zero = d(None)
    if all(d(nm) == at_zero for nm in names):
        return Int(at_zero)
    return Op("sub", (x, ref))


def _affine(x: Ix) -> bool:
    """``x`` is built of sums, differences, negations and products by numbers only."""
    if isinstance(x, Op):
        if x.op == "mul" and sum(not isinstance(a, Int) for a in x.args) > 1:
            return False
        return x.op in ("add", "sub", "neg", "mul") and all(_affine(a) for a in x.args)
    return True


def _opened(x: Ix) -> Ix:
    """``x`` with each variable named like ``(cb_ + 16)`` (a chunk's start) as the sum."""
    if isinstance(x, Var):
        m = _START.match(x.name)
        return Op("add", (Var(m.group(1)), Int(int(m.group(2))))) if m else x
    if isinstance(x, Op):
        return Op(x.op, tuple(_opened(a) for a in x.args))
    return x


def _whole_chunks(
    row_masks: Sequence[list[int]], col_masks: Sequence[list[int]], total: int
) -> tuple[int, int, int]:
    """The flat plane's chunks ``first .. stop - 1`` whose row pass (of the chunk after:
    ``row_masks[i][j + 1]``) loads whole vectors and whose output lanes are all in the
    plane, as whole periods of the column masks (``col_masks[i][j]`` repeats every
    ``period`` chunks); ``stop == first`` where there are none or the period is longer
    than :data:`FLAT_UNROLL`."""
    full = (1 << LANES) - 1
    whole = [
        all(m[j + 1] == full for m in row_masks) and (j + 1) * LANES <= total
        for j in range(-(-total // LANES))
    ]
    if True not in whole:
        return 0, 0, 1
    first = whole.index(True)
    end = first
    while end < len(whole) and whole[end]:
        end += 1
    period = next(
        (
            t
            for t in range(1, FLAT_UNROLL + 1)
            if all(m[j] == m[j - t] for m in col_masks for j in range(first + t, end))
        ),
        None,
    )
    if period is None:
        return first, first, 1
    return first, first + (end - first) // period * period, period


def _sampled_taps(
    row_masks: Sequence[list[int]], offsets: Sequence[int], width: int, first: int, stop: int
) -> list[int]:
    """The row taps whose values the flat plane's whole chunks (``first .. stop - 1``)
    test for NaN: the tap furthest down alone (each input element is then tested once,
    the chunks before and after testing every tap) where that reaches every element the
    taps read, checked element by element; else every tap."""
    last = max(range(len(offsets)), key=lambda i: offsets[i])
    chunks = len(row_masks[0]) - 1
    read: set[int] = set()
    tested: set[int] = set()
    for g in range(chunks + 1):  # the row pass of chunk g (in iteration g - 1)
        whole = first + 1 <= g < stop + 1
        for i, (m, dr) in enumerate(zip(row_masks, offsets, strict=True)):
            got = {g * LANES + lane + dr * width for lane in range(LANES) if m[g] >> lane & 1}
            read |= got
            if not whole or i == last:
                tested |= got
    return [last] if read <= tested else list(range(len(offsets)))
