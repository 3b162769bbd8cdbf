"""The backend-neutral schedule records (frozen dataclasses) of depth-first fused groups.

Built by ``passes/schedule.py``; rendered by backends/x86 (C, ISPC), backends/cuda and
executed by backends/reference (numpy).

Record conventions (for every renderer):
* Logical index space of every value: ``(n, c, h, w)``; loop variables carry those names,
  window variables are ``k_h``/``k_w``, tile origins ``t_n``/``t_c``/``t_h``.
* Every bound, guard, divisor, origin and index is an index tree (``Ix`` of
  ``middleware.index_expr``: ``Var``, ``Int``, ``Op``), never target text: a backend
  prints it (``index_expr.to_c`` for C, ISPC and CUDA, which need the ``min``/``max``/
  ``floord`` helpers) or evaluates it (``index_expr.evaluate`` on ints or numpy arrays).
* All bounds are inclusive. ``Loop.lo``/``Loop.hi`` may refer to the tile origins and to
  the variables of enclosing loops only (``Reduction.point_loops``: to ``n, c, h, w`` and
  the window loops outside them only).
* A scratch buffer element ``(n, c, h, w)`` lives at ``sum((x_d - origin_d) * stride_d)``
  with ``origin_d`` (a tree over the tile origins) and strides from ``extent`` in the
  schedule's ``layout`` order; a global buffer uses its own shape and layout
  (``Buffer.strides``, origins ``Int(0)``). Dims of extent 1 are always index 0 (broadcast
  or a 1-sized dim).
* Load indices: in a Schedule, ``middleware.loops.Load.index`` is a tuple of four index
  trees and ``ParamVec.index`` one tree, over ``n, c, h, w, k_h, k_w`` (affine, possibly
  with ``floordiv``/``div``/``mod`` for channel shuffles, on non-negative operands). The
  ``loops`` layer itself writes them as isl-syntax text (``2*h + k_h - 1``,
  ``(c mod 2)*4 + floor(c/2)``); the scheduler converts every one
  (``isl_helpers.ix_index``), so no renderer parses text.
* Expressions use the closed function vocabulary ``middleware.loops.FUNCTIONS``; a
  renderer needs one table from those names to its spelling (backends/x86/cfuncs.py,
  backends/cuda/funcs.py, backends/reference/functions.py).
* How to run a stage (every backend does the same): for each tile (the ``Tiling`` origins,
  ``t_d = 0, sizes[d], 2*sizes[d], ... < extents[d]`` on the dims with a parameter,
  parallel), for each stage in order, if ``guard`` holds (None: always): scan ``loops``;
  without a reduction, store ``expr`` over ``inner``; with one: ``acc[i - inner.lo] =
  init`` over ``inner``, then scan ``reduction.loops`` and over ``reduction.inner``
  ``acc = op(acc, body)`` ("max" or "sum"), then store ``expr`` over ``inner`` with
  ``Acc`` = ``acc[i - inner.lo] / divisor`` (no division when ``divisor`` is None).
  ``acc`` holds ``Schedule.acc_elems`` floats per thread; scratch buffers are per thread.
* One thread per output element (CUDA; ``backends/reference/points.py``): the element
  ``(n, c, h, w)`` of a value is given by the first of the stages writing its buffer
  whose ``covers`` holds there (None: always): ``expr`` with ``Acc`` = ``op`` of ``body``
  over the ``point_loops`` taps (from ``init``), divided by ``divisor``; a load of a
  scratch value is that value's element at the load's index (recomputed). Tiles, loops,
  guards, scratch origins and extents play no part.

These records are stable: renderers (x86 C, ISPC, CUDA, reference) depend on them; the
field names below are the interface.
"""

from __future__ import annotations

import dataclasses

from ..index_expr import Ix
from ..loops import Expr, ParamVec

ORDER = {"nchw": (0, 1, 2, 3), "nhwc": (0, 2, 3, 1)}


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A tensor the kernel touches. ``role``: "input" | "output" | "scratch".

    ``shape`` is the logical ``(n, c, h, w)`` shape; ``torch_shape`` the value's real shape.
    For scratch buffers ``origin`` gives, per dim, the first index a tile holds (an index
    tree over the tile origins) and ``extent`` the most elements any tile holds (the allocation);
    for global buffers ``origin`` is all ``Int(0)`` and ``extent`` is ``shape``.
    """

    name: str
    value: str
    role: str
    shape: tuple[int, int, int, int]
    torch_shape: tuple[int, ...]
    layout: str
    origin: tuple[Ix, Ix, Ix, Ix]
    extent: tuple[int, int, int, int]

    @property
    def strides(self) -> tuple[int, int, int, int]:
        """Element strides of the logical dims in memory."""
        e = self.extent
        s = [0, 0, 0, 0]
        acc = 1
        for d in reversed(ORDER[self.layout]):
            s[d] = acc
            acc *= e[d]
        return tuple(s)  # type: ignore[return-value]

    @property
    def elements(self) -> int:
        return self.extent[0] * self.extent[1] * self.extent[2] * self.extent[3]


@dataclasses.dataclass(frozen=True)
class Loop:
    """``for var in lo..hi`` (inclusive bounds, index trees). ``simd``: the contiguous
    innermost loop."""

    var: str
    lo: Ix
    hi: Ix
    simd: bool = False


@dataclasses.dataclass(frozen=True)
class Reduction:
    """``acc = init; for window loops: for inner: acc = op(acc, body)``.

    ``loops`` are the window loops (and, when the innermost dim has a window, its window
    loop last), scanned inside the stage's outer loops; ``inner`` is the innermost data
    loop for the accumulation, its bounds depending on the window variables.
    ``divisor`` is None or an index tree over the output coordinates ``n, c, h, w`` only
    (averaging pools: the window's element count). ``point_loops``: see below.
    """

    op: str  # "max" | "sum"
    init: float
    body: Expr
    loops: tuple[Loop, ...]
    inner: Loop
    divisor: Ix | None = None
    # The window loops of ONE output point (outermost first, e.g. ``k_h`` then ``k_w``),
    # their bounds over the output coordinates ``n, c, h, w`` only (and the window loops
    # outside them): exactly the taps the loop nest above visits for that point (inside
    # the window and inside the input). For one-thread-per-output backends (CUDA).
    point_loops: tuple[Loop, ...] = ()


@dataclasses.dataclass(frozen=True)
class Stage:
    """Computes ``target`` over its tile region: outer ``loops`` then the SIMD ``inner``
    loop storing ``expr`` (where :class:`~middleware.loops.Acc` is the reduction result)."""

    name: str
    nodes: tuple[str, ...]
    target: str  # buffer name
    loops: tuple[Loop, ...]
    inner: Loop
    expr: Expr
    reduction: Reduction | None = None
    # A condition (index tree) over the tile origins; the stage runs only in tiles where it
    # holds (None = always), e.g. a concat slice in an NCHW tile of another channel.
    guard: Ix | None = None
    # The condition over the output coordinates ``n, c, h, w`` under which this stage
    # computes an element of its target (an index expression, ``middleware.index_expr``);
    # None: every element of the target (a concat slice: its channel range). For
    # one-thread-per-output backends (CUDA).
    covers: Ix | None = None


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Tiles of the final output: ``params[d]`` is the origin variable of dim ``d`` (""
    when untiled), ``sizes[d]`` the tile size; tiles are distributed over ``threads``."""

    params: tuple[str, str, str, str]
    sizes: tuple[int, int, int, int]
    extents: tuple[int, int, int, int]
    threads: int
    scratch_bytes: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One depth-first fused group, ready to render.

    ``inputs``/``outputs`` list buffer names in the kernel's argument order (graph value
    names are in ``Buffer.value``); ``params`` are the constant vectors the expressions
    use; ``stages`` run in order inside each tile; ``acc_elems`` is the size of the
    per-thread accumulator row.
    """

    name: str
    layers: tuple[str, ...]
    ops: tuple[str, ...]
    layout: str  # loop order of the tile: "nchw" (w innermost) or "nhwc" (c innermost)
    buffers: tuple[Buffer, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: tuple[ParamVec, ...]
    stages: tuple[Stage, ...]
    tiling: Tiling
    acc_elems: int
    simd_floats: int
    description: str

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def buffer_of(self, value: str) -> Buffer:
        for b in self.buffers:
            if b.value == value:
                return b
        raise KeyError(value)
