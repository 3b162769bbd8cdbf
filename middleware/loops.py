"""Loop semantics of the I/O-bound ops: the vocabulary their registry entries use.

The op registry (``middleware.ops``) is the one place an op is described; an entry's
``loops`` field is one of the rules below (or ``unary(pointwise)`` for an activation).
Its rules know no op by name (but for the channel-shuffle pattern that ``shuffle_source``
recognises across reshape and permute nodes); they give code generation's view of an io
op:

* its iteration domain: the output value's elements, always seen as a logical 4-d index
  ``(n, c, h, w)`` (rank-2 values ``(N, C)`` are ``(N, C, 1, 1)``);
* which input elements each output element reads: a :class:`Load` per operand whose index
  is affine in the output coordinates ``n, c, h, w`` and the window variables ``k_h, k_w``
  (the schedule turns them into isl access relations);
* the scalar computation: a small backend-neutral expression tree (:class:`Expr`) over a
  closed vocabulary of functions (``FUNCTIONS``) that each backend spells in its own
  table, plus, for window ops, a reduction (``max`` or ``sum``) and an epilogue.

Nothing here knows about C, CUDA, tiles or threads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .graph import Graph, Node, TensorType

DIMS = ("n", "c", "h", "w")
# The closed vocabulary of scalar functions (arity) used by expressions, with PyTorch's
# float32 semantics (NaN propagates through max/min); a backend maps each one to its own
# spelling (backends/x86/cfuncs.py, backends/cuda/funcs.py, backends/reference).
FUNCTIONS: dict[str, int] = {
    "add": 2,
    "sub": 2,
    "mul": 2,
    "div": 2,
    "max": 2,
    "min": 2,
    "neg": 1,
    "abs": 1,
    "exp": 1,
    "expm1": 1,  # exp(a) - 1, accurate near 0
    "log": 1,
    "log1p": 1,  # log(1 + a), accurate near 0
    "tanh": 1,
    "erf": 1,
    "sigmoid": 1,
    "sqrt": 1,  # correctly rounded (IEEE), NaN below 0
    # conditions: 1 if true else 0 (false for a NaN operand, as in C)
    "gt": 2,  # a > b
    "ge": 2,  # a >= b
    "le": 2,  # a <= b
    "and": 2,  # both conditions true
    "select": 3,  # cond ? a : b
}
# The functions that cost far more than an add (transcendental ones, division): an
# expression with one is worth materialising rather than recomputing at every read.
EXPENSIVE_FUNCTIONS: frozenset[str] = frozenset(
    {"exp", "expm1", "log", "log1p", "tanh", "erf", "sigmoid", "div", "sqrt"}
)


def window_out_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """Output length of a pooling window along one axis (the framework's rule)."""
    eff = d * (k - 1) + 1
    if ceil_mode:
        out = math.ceil((size + 2 * p - eff) / s) + 1
        if (out - 1) * s >= size + p:
            out -= 1
    else:
        out = (size + 2 * p - eff) // s + 1
    return out


class NotFusable(Exception):
    """This node (or group) has no loop semantics the generator can use; says why."""


# ------------------------------------------------------------------- expressions
@dataclasses.dataclass(frozen=True)
class Const:
    value: float


@dataclasses.dataclass(frozen=True)
class Load:
    """One element of value ``value`` at a 4-d index of affine expressions in the output
    coordinates ``n, c, h, w`` and window variables ``k_h, k_w`` (isl/C syntax: ``2*h+k_h-1``)."""

    value: str
    index: tuple[str, str, str, str]


@dataclasses.dataclass(frozen=True)
class ParamVec:
    """Element ``index`` of a constant vector the generator computes from graph parameters
    (e.g. the per-channel scale of an inference batch-norm). ``data`` is float32."""

    name: str
    data: tuple[float, ...] = dataclasses.field(repr=False)
    index: str = "c"

    def array(self) -> np.ndarray:
        return np.asarray(self.data, dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class Acc:
    """The accumulator of the enclosing window reduction (in an epilogue)."""


@dataclasses.dataclass(frozen=True)
class Call:
    fn: str
    args: tuple[Expr, ...]

    def __post_init__(self) -> None:
        if FUNCTIONS.get(self.fn) != len(self.args):
            raise ValueError(f"{self.fn} takes {FUNCTIONS.get(self.fn)} arguments")


Expr = Const | Load | ParamVec | Acc | Call


def call(fn: str, *args: Expr) -> Call:
    return Call(fn, tuple(args))


def substitute(expr: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Rebuild ``expr`` bottom-up, replacing each leaf ``x`` by ``fn(x)`` when not None."""
    if isinstance(expr, Call):
        return Call(expr.fn, tuple(substitute(a, fn) for a in expr.args))
    r = fn(expr)
    return expr if r is None else r


def leaves(expr: Expr) -> list[Expr]:
    if isinstance(expr, Call):
        return [x for a in expr.args for x in leaves(a)]
    return [expr]


# ----------------------------------------------------------------------- records
@dataclasses.dataclass(frozen=True)
class Window:
    """One reduction axis along output dim ``dim`` (2: h, 3: w) with variable ``k_<dim>``.

    The input index read is ``scale*o + step*k + offset``; ``constraint`` (isl syntax over
    ``o`` and ``k``) bounds ``k`` beyond the input's extent (which the schedule adds).
    ``padded_lo``/``padded_hi`` are the padded input extent for divisor counting.
    ``taps`` is the number of ``k`` values (0 for adaptive windows, whose width varies).
    """

    dim: int
    scale: int
    step: int
    offset: int
    constraint: str
    padded_lo: int = 0
    padded_hi: int = 0
    taps: int = 0

    @property
    def var(self) -> str:
        return "k_" + DIMS[self.dim]

    @property
    def reads_per_input(self) -> float:
        """How many outputs read one input element along this axis (window overlap):
        ``taps / stride``; 1 for adaptive windows (which tile their input)."""
        if not self.taps or not self.scale:
            return 1.0
        return max(1.0, self.taps / self.scale)

    def input_index(self) -> str:
        o = DIMS[self.dim]
        terms = []
        if self.scale:
            terms.append(f"{self.scale}*{o}")
        terms.append(f"{self.step}*{self.var}")
        if self.offset:
            terms.append(str(self.offset))
        return " + ".join(terms)


@dataclasses.dataclass(frozen=True)
class OpLoops:
    """The loop semantics of one node.

    ``kind`` "pointwise": ``expr`` is the output element (its loads index the output point,
    broadcast). ``kind`` "reduce": ``body`` is reduced with ``reduce`` ("max"|"sum") over
    ``windows``, starting from ``init``; ``expr`` (with :class:`Acc`) is the stored value;
    ``divisor`` names an averaging rule ("" | "include_pad" | "valid" | "const:<d>").
    ``kind`` "cat": ``slices`` say which channels of the output each input fills.

    Index text uses isl syntax (``floor(c/2)``, ``c mod 2`` for channel shuffles); the
    scheduler turns it into index trees (``middleware.isl_helpers.ix_index``) that every
    backend prints or evaluates.
    """

    kind: str
    expr: Expr
    body: Expr | None = None
    reduce: str = ""
    init: float = 0.0
    windows: tuple[Window, ...] = ()
    divisor: str = ""
    # kind "cat": (input value, first channel, channels) per input; each input is computed
    # straight into its slice of the output (no copy of a materialised input).
    slices: tuple[tuple[str, int, int], ...] = ()


def logical_dims(rank: int) -> tuple[int, ...]:
    """Where each dim of a rank-``rank`` value sits in the logical ``(n, c, h, w)`` space:
    (C,) and (N, C) fill from the left, (C, H, W) from the right (a 4-d map without its
    batch dim), a 0-d value occupies no dim."""
    if rank == 3:
        return (1, 2, 3)
    if not 0 <= rank <= 4:
        raise NotFusable(f"rank {rank} value (at most 4 dims are generated)")
    return tuple(range(rank))


def logical4(t: TensorType) -> tuple[int, int, int, int]:
    """A value's own shape in the logical ``(n, c, h, w)`` space (1 in the dims it lacks).

    This is the only space a value is stored and loaded in: a :class:`Load` of value ``v``
    indexes ``logical4(v)``, whatever the rank of the node reading it (see
    :func:`broadcast_load`)."""
    shape = [1, 1, 1, 1]
    for size, d in zip(t.shape, logical_dims(t.rank), strict=True):
        shape[d] = size
    return tuple(shape)  # type: ignore[return-value]


def broadcast_load(value: str, t: TensorType, out: TensorType) -> Load:
    """The load of ``value`` (type ``t``) at an output point of a node whose output has type
    ``out``, with the framework's broadcasting: dims align from the right, a size-1 dim of
    ``t`` is read at 0.

    The index is in ``t``'s own logical space (where its buffer lives) and written in the
    output's logical coordinates: a rank-1 operand of a rank-2 output sits in logical dim
    ``n`` of its own space but broadcasts along the output's logical dim ``c``, so its
    index is ``(c, 0, 0, 0)``, not ``(0, c, 0, 0)``."""
    if t.rank > out.rank:
        raise NotFusable(f"cannot broadcast rank {t.rank} to rank {out.rank}")
    out_dims = logical_dims(out.rank)
    idx = ["0"] * 4
    for j, (size, d) in enumerate(zip(t.shape, logical_dims(t.rank), strict=True)):
        i = j + out.rank - t.rank  # the output dim this operand dim aligns with
        if size == out.shape[i]:
            idx[d] = DIMS[out_dims[i]]
        elif size != 1:
            raise NotFusable(f"cannot broadcast {tuple(t.shape)} to {tuple(out.shape)}")
    return Load(value, tuple(idx))  # type: ignore[arg-type]


# ------------------------------------------------------------------- the rules
# A rule: the loop semantics of one node (an op entry's ``loops`` field). A pointwise
# function: an elementwise op's output element from its input element ``x`` (an op entry's
# ``pointwise`` field, also used where the op is a fused post-op of another).
Rule = Callable[[Graph, Node], OpLoops]
Pointwise = Callable[[Mapping[str, Any], Expr], Expr]


def clamp(x: Expr, lo: float, hi: float) -> Expr:
    """``x`` clamped to ``[lo, hi]`` (``min(max(x, lo), hi)``)."""
    return call("min", call("max", x, Const(lo)), Const(hi))


def unary(pointwise: Pointwise) -> Rule:
    """The rule of an elementwise op of one input: ``out = pointwise(attrs, x)``."""

    def unary_loops(graph: Graph, node: Node) -> OpLoops:
        (x,) = node.inputs
        load = broadcast_load(x, graph.values[x], graph.values[node.outputs[0]])
        return OpLoops("pointwise", pointwise(node.attrs, load))

    return unary_loops


def _out4(graph: Graph, node: Node) -> tuple[int, int, int, int]:
    return logical4(graph.values[node.outputs[0]])


def _param(graph: Graph, v: str, what: str) -> np.ndarray:
    if v not in graph.params:
        raise NotFusable(f"{what} {v!r} is not a constant")
    return np.asarray(graph.params[v], dtype=np.float64).reshape(-1)


def batch_norm_loops(graph: Graph, node: Node) -> OpLoops:
    x, mean, var, weight, bias = node.inputs
    if graph.values[x].rank not in (2, 4):
        # the channel is dim 1 of (N, C) and (N, C, H, W); logical4 reads rank 3 as (C, H, W)
        raise NotFusable(f"batch_norm of a rank {graph.values[x].rank} value")
    eps = float(node.attrs["eps"])
    m, v = _param(graph, mean, "mean"), _param(graph, var, "var")
    w = _param(graph, weight, "weight") if weight in graph.params else np.ones_like(m)
    b = _param(graph, bias, "bias") if bias in graph.params else np.zeros_like(m)
    scale = w / np.sqrt(v + eps)
    shift = b - m * scale
    tag = node.name
    return OpLoops(
        "pointwise",
        call(
            "add",
            call(
                "mul",
                broadcast_load(x, graph.values[x], graph.values[node.outputs[0]]),
                ParamVec(f"{tag}_scale", tuple(np.float32(scale).tolist()), "c"),
            ),
            ParamVec(f"{tag}_shift", tuple(np.float32(shift).tolist()), "c"),
        ),
    )


def binary(fn: str) -> Rule:
    """The rule of a binary elementwise op computing function ``fn`` of two operands (two
    tensors with broadcasting, or a tensor and the scalar attr ``scalar``, ``reverse``: the
    scalar on the left; ``alpha`` scales the right operand)."""

    def binary_loops(graph: Graph, node: Node) -> OpLoops:
        return _binary(graph, node, fn)

    return binary_loops


def _binary(graph: Graph, node: Node, fn: str) -> OpLoops:
    out_t = graph.values[node.outputs[0]]
    operands: list[Expr] = [broadcast_load(v, graph.values[v], out_t) for v in node.inputs]
    scalar = node.attrs.get("scalar")
    if scalar is not None:
        if not isinstance(scalar, (int, float)):
            raise NotFusable(f"scalar operand {scalar!r}")
        operands.append(Const(float(scalar)))
        if node.attrs.get("reverse"):
            operands.reverse()
    if len(operands) != 2:
        raise NotFusable(f"{node.op} with {len(operands)} operands")
    a, b = operands
    alpha = node.attrs.get("alpha", 1)
    if alpha != 1:
        b = call("mul", b, Const(float(alpha)))
    return OpLoops("pointwise", call(fn, a, b))


def pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def _pool_windows(graph: Graph, node: Node, dilation: tuple[int, int]) -> tuple[Window, ...]:
    x = node.inputs[0]
    in4 = logical4(graph.values[x])
    k = pair(node.attrs["kernel_size"])
    s = pair(node.attrs["stride"] or node.attrs["kernel_size"])
    p = pair(node.attrs["padding"])
    out4 = _out4(graph, node)
    wins = []
    for i, dim in enumerate((2, 3)):
        expect = window_out_size(in4[dim], k[i], s[i], p[i], dilation[i], node.attrs["ceil_mode"])
        if expect != out4[dim]:
            raise NotFusable(f"pool output size {out4[dim]} != rule {expect}")
        wins.append(
            Window(
                dim,
                s[i],
                dilation[i],
                -p[i],
                f"0 <= k < {k[i]}",
                padded_lo=-p[i],
                padded_hi=in4[dim] + p[i],
                taps=k[i],
            )
        )
    return tuple(wins)


def window_load(x: str, windows: Sequence[Window]) -> Load:
    """The load of ``x`` at the output point with each window's input index in its dim."""
    idx = list(DIMS)
    for win in windows:
        idx[win.dim] = win.input_index()
    return Load(x, tuple(idx))  # type: ignore[arg-type]


def max_pool_loops(graph: Graph, node: Node) -> OpLoops:
    wins = _pool_windows(graph, node, pair(node.attrs.get("dilation", 1)))
    return OpLoops(
        "reduce",
        Acc(),
        body=window_load(node.inputs[0], wins),
        reduce="max",
        init=-math.inf,
        windows=wins,
    )


def avg_pool_loops(graph: Graph, node: Node) -> OpLoops:
    wins = _pool_windows(graph, node, (1, 1))
    div = node.attrs.get("divisor_override")
    if div:
        divisor = f"const:{int(div)}"
    else:
        divisor = "include_pad" if node.attrs["count_include_pad"] else "valid"
    return OpLoops(
        "reduce",
        Acc(),
        body=window_load(node.inputs[0], wins),
        reduce="sum",
        init=0.0,
        windows=wins,
        divisor=divisor,
    )


def _adaptive_windows(in4: Sequence[int], out4: Sequence[int]) -> tuple[Window, ...]:
    wins = []
    for dim in (2, 3):
        i, o = in4[dim], out4[dim]
        # input index k lies in [floor(o*I/O), ceil((o+1)*I/O))
        wins.append(Window(dim, 0, 1, 0, f"{o}*k + {o} > {i}*o and {o}*k < {i}*o + {i}"))
    return tuple(wins)


def adaptive_max_pool_loops(graph: Graph, node: Node) -> OpLoops:
    x = node.inputs[0]
    wins = _adaptive_windows(logical4(graph.values[x]), _out4(graph, node))
    return OpLoops(
        "reduce", Acc(), body=window_load(x, wins), reduce="max", init=-math.inf, windows=wins
    )


def adaptive_avg_pool_loops(graph: Graph, node: Node) -> OpLoops:
    x = node.inputs[0]
    wins = _adaptive_windows(logical4(graph.values[x]), _out4(graph, node))
    return OpLoops(
        "reduce", Acc(), body=window_load(x, wins), reduce="sum", windows=wins, divisor="valid"
    )


def _dims_reduction(graph: Graph, node: Node, what: str) -> tuple[str, tuple[Window, ...]]:
    """The input and the adaptive windows (to extent 1) of a reduction over ``dims`` that
    sit in the logical ``h``/``w`` (both spatial dims of a map, the last dim of a token
    sequence or of attention scores); NotFusable for any other dims."""
    x = node.inputs[0]
    xt = graph.values[x]
    dims = sorted({d % xt.rank for d in node.attrs["dims"]})
    places = logical_dims(xt.rank)
    reduced = {places[d] for d in dims}
    if not dims or not reduced <= {2, 3}:
        raise NotFusable(f"{what} over dims {dims} of a rank {xt.rank} value")
    in4 = logical4(xt)
    want = tuple(1 if d in reduced else s for d, s in enumerate(in4))
    if _out4(graph, node) != want:
        raise NotFusable(f"{what} over dims {dims} of a rank {xt.rank} value moves its output dims")
    return x, _adaptive_windows(in4, want)


def mean_loops(graph: Graph, node: Node) -> OpLoops:
    """A mean over dims that sit in the logical ``h``/``w`` (both spatial dims of a map, or
    the last dim of a rank-3 token sequence, LayerNorm's statistics): an adaptive sum window
    to extent 1 there, divided by the count."""
    x, wins = _dims_reduction(graph, node, "mean")
    return OpLoops(
        "reduce", Acc(), body=window_load(x, wins), reduce="sum", windows=wins, divisor="valid"
    )


def sum_loops(graph: Graph, node: Node) -> OpLoops:
    """A sum over dims in the logical ``h``/``w``, as :func:`mean_loops` without the division."""
    x, wins = _dims_reduction(graph, node, "sum")
    return OpLoops("reduce", Acc(), body=window_load(x, wins), reduce="sum", windows=wins)


def amax_loops(graph: Graph, node: Node) -> OpLoops:
    """A max over dims in the logical ``h``/``w`` (softmax's row max): NaN-propagating, as
    ``torch.amax`` is."""
    x, wins = _dims_reduction(graph, node, "amax")
    return OpLoops(
        "reduce", Acc(), body=window_load(x, wins), reduce="max", init=-math.inf, windows=wins
    )


def view_loops(graph: Graph, node: Node) -> OpLoops:
    x = node.inputs[0]
    in4, out4 = logical4(graph.values[x]), _out4(graph, node)
    if tuple(in4) != tuple(out4):
        raise NotFusable(f"{node.op} {in4} -> {out4} moves elements")
    return OpLoops("pointwise", Load(x, DIMS))


def depthwise_conv2d_loops(graph: Graph, node: Node) -> OpLoops:
    """Depthwise convolution (groups == in channels == out channels) as a sum window."""
    x, w = node.inputs[0], node.inputs[1]
    in4, out4 = logical4(graph.values[x]), _out4(graph, node)
    wt = graph.values[w]
    groups = int(node.attrs["groups"])
    if node.attrs.get("residual") or not (groups == in4[1] == out4[1] and wt.shape[1] == 1):
        raise NotFusable("only depthwise conv2d (groups == channels, no residual) is fusable")
    if w not in graph.params:
        raise NotFusable("conv weight is not a constant")
    s, p, d = (pair(node.attrs[a]) for a in ("stride", "padding", "dilation"))
    kh, kw = wt.shape[2], wt.shape[3]
    wins = tuple(
        Window(dim, s[i], d[i], -p[i], f"0 <= k < {(kh, kw)[i]}", taps=(kh, kw)[i])
        for i, dim in enumerate((2, 3))
    )
    weights = np.asarray(graph.params[w], dtype=np.float32).reshape(-1)
    body = call(
        "mul",
        window_load(x, wins),
        ParamVec(f"{node.name}_weight", tuple(weights.tolist()), f"c*{kh * kw} + k_h*{kw} + k_w"),
    )
    expr: Expr = Acc()
    if len(node.inputs) > 2:
        b = node.inputs[2]
        if b not in graph.params:
            raise NotFusable("conv bias is not a constant")
        bias = np.asarray(graph.params[b], dtype=np.float32).reshape(-1)
        expr = call("add", expr, ParamVec(f"{node.name}_bias", tuple(bias.tolist()), "c"))
    return OpLoops("reduce", expr, body=body, reduce="sum", windows=wins)


def cat_loops(graph: Graph, node: Node) -> OpLoops:
    out_t = graph.values[node.outputs[0]]
    dim = int(node.attrs["dim"]) % max(1, out_t.rank)
    if dim != 1 or out_t.rank not in (2, 4):
        raise NotFusable(f"cat along dim {dim} of a rank {out_t.rank} value (channels only)")
    slices, off = [], 0
    for v in node.inputs:
        ch = graph.values[v].shape[1]
        slices.append((v, off, ch))
        off += ch
    return OpLoops("cat", Const(0.0), slices=tuple(slices))


def shuffle_source(graph: Graph, node: Node) -> tuple[str, int] | None:
    """``(input, groups)`` when ``node`` ends a channel shuffle ``reshape(N,g,C/g,H,W) ->
    permute(0,2,1,3,4) -> reshape(N,C,H,W)``, else None."""
    if node.op not in ("reshape", "flatten"):
        return None
    perm = graph.producer(node.inputs[0])
    if perm is None or perm.op != "permute" or tuple(perm.attrs["dims"]) != (0, 2, 1, 3, 4):
        return None
    split = graph.producer(perm.inputs[0])
    if split is None or split.op != "reshape":
        return None
    src = split.inputs[0]
    s_in, s_mid = graph.values[src].shape, graph.values[split.outputs[0]].shape
    if (
        len(s_in) != 4
        or len(s_mid) != 5
        or tuple(graph.values[node.outputs[0]].shape) != tuple(s_in)
    ):
        return None
    g = s_mid[1]
    if s_mid != (s_in[0], g, s_in[1] // g, s_in[2], s_in[3]):
        return None
    return src, g


def reshape_loops(graph: Graph, node: Node) -> OpLoops:
    sh = shuffle_source(graph, node)
    if sh is None:
        return view_loops(graph, node)
    src, g = sh
    per = graph.values[src].shape[1] // g
    return OpLoops("pointwise", Load(src, ("n", f"(c mod {g})*{per} + floor(c/{g})", "h", "w")))
