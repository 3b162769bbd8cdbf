"""Registry entries of the window and reduction ops: pooling (max, average, adaptive,
max-pool with a merged activation), mean, softmax, log_softmax, layer_norm, group_norm and
normalize (x / max(||x||_p, eps) along a dim),
and the resampling ``interpolate`` (nearest and bilinear)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import loops
from .enums import Bound
from .graph import Graph, Node, TensorType
from .loops import (
    DIMS,
    Acc,
    Const,
    Expr,
    Load,
    NotFusable,
    OpLoops,
    ParamVec,
    Window,
    call,
    logical4,
    pair,
    window_load,
    window_out_size,
)
from .op_registry import (
    GradEmitter,
    Kernel,
    OpDef,
    OutForm,
    OutVariant,
    activation_fn,
    get_op,
    register,
    with_post_op,
)


def pool_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    if "kernel_size" in node.attrs:
        kh, kw = pair(node.attrs["kernel_size"])
        return float(outs[0].numel * kh * kw)
    return float(ins[0].numel)  # adaptive: every input element read about once


def reduce_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    return float(ins[0].numel)


def _softmax(node: Node) -> Kernel:
    dim = node.attrs["dim"]

    def softmax(x):
        return torch.softmax(x, dim)

    return softmax


def _log_softmax(node: Node) -> Kernel:
    dim = node.attrs["dim"]

    def log_softmax(x):
        return torch.log_softmax(x, dim)

    return log_softmax


def _softmax_out(log: bool) -> OutVariant:
    op = torch.ops.aten._log_softmax.out if log else torch.ops.aten._softmax.out
    ref = torch.log_softmax if log else torch.softmax

    def make(node: Node, graph: Graph) -> OutForm:
        dim = node.attrs["dim"]

        def softmax_out(x, o):
            if not o.is_contiguous():
                # ATen's kernel writes a channels_last destination as if it were contiguous
                # (torch 2.14, tests/test_out_forms.py): compute, then copy
                o.copy_(ref(x, dim))
                return
            op(x, dim, False, out=o)

        return softmax_out, ()

    # ATen's kernel writes a strided output as if it were dense
    return OutVariant(make, dense_only=True)


for _name, _make, _log in (("softmax", _softmax, False), ("log_softmax", _log_softmax, True)):
    register(
        OpDef(_name, Bound.IO, _make, flops_per_elem=5.0, per_sample=True, out=_softmax_out(_log))
    )


def _layer_norm(node: Node) -> Kernel:
    """F.layer_norm over the trailing ``normalized_shape`` dims; the inputs after the value
    are the weight and then the bias, where the node has them (``affine``: "weight",
    "bias", "weight_bias" or "")."""
    shape, eps, affine = node.attrs["normalized_shape"], node.attrs["eps"], node.attrs["affine"]

    def layer_norm(x, *wb):
        it = iter(wb)
        w = next(it) if "weight" in affine else None
        b = next(it) if "bias" in affine else None
        return F.layer_norm(x, shape, w, b, eps)

    return layer_norm


# LayerNorm runs through the framework (ATen's fused kernel; no loop semantics yet): as a
# graph node, not a fallback, so that its neighbours are optimized around it. Each sample
# is normalized on its own (normalized_shape never reaches dim 0: checked by the frontend).
register(
    OpDef(
        "layer_norm",
        Bound.IO,
        _layer_norm,
        flops_per_elem=8.0,
        per_sample=True,
        weight_inputs=frozenset({1, 2}),
    )
)


def _group_norm(node: Node) -> Kernel:
    """F.group_norm over ``num_groups`` groups of channels (dim 1); weight and bias as
    inputs after the value where the node has them (``affine`` as for layer_norm)."""
    groups, eps, affine = node.attrs["num_groups"], node.attrs["eps"], node.attrs["affine"]

    def group_norm(x, *wb):
        it = iter(wb)
        w = next(it) if "weight" in affine else None
        b = next(it) if "bias" in affine else None
        return F.group_norm(x, groups, w, b, eps)

    return group_norm


# ATen's kernel, a graph node like layer_norm; each sample is normalized on its own
register(
    OpDef(
        "group_norm",
        Bound.IO,
        _group_norm,
        flops_per_elem=8.0,
        per_sample=True,
        weight_inputs=frozenset({1, 2}),
    )
)


def _normalize(node: Node) -> Kernel:
    p, dim, eps = node.attrs["p"], node.attrs["dim"], node.attrs["eps"]

    def normalize(x):
        return F.normalize(x, p, dim, eps)

    return normalize


# F.normalize (Swin V2's cosine attention): ATen's norm and division, a graph node
register(OpDef("normalize", Bound.IO, _normalize, flops_fn=reduce_flops))


def _interpolate(node: Node) -> Kernel:
    """F.interpolate with the call's own arguments (``size`` or ``scale_factor`` as given:
    nearest with a scale factor maps coordinates by the factor, not by the sizes)."""
    a = node.attrs
    size, scale, mode = a["size"], a["scale_factor"], a["mode"]
    align, recompute = a["align_corners"], a["recompute_scale_factor"]

    def interpolate(x):
        return F.interpolate(
            x,
            size=size,
            scale_factor=scale,
            mode=mode,
            align_corners=align,
            recompute_scale_factor=recompute,
        )

    return interpolate


def _axis_weights(node: Node, axis: int, size_in: int, size_out: int, one: float = 1.0) -> Any:
    """``W[o, k]``: the weight of input index ``k`` in output index ``o`` along ``axis``
    (2: h, 3: w), as ATen itself computes it: the node's own call on one-hot inputs (the hot
    value ``one``; NumPy float32 array). The probe is an NCHW tensor (two channels, so no
    kernel for channels_last is picked) whose other axis is 2 -> 4: the hot element sits at
    index 0 there, which output 0 reads with weight exactly 1 and nothing reads by 0."""
    a = node.attrs
    shape = [size_in, 2, 2, 2]
    shape[axis] = size_in
    basis = torch.zeros(shape)
    for k in range(size_in):
        if axis == 2:
            basis[k, 0, k, 0] = one
        else:
            basis[k, 0, 0, k] = one
    size = scale = None
    if a["size"] is not None:
        size = (size_out, 4) if axis == 2 else (4, size_out)
    else:
        sf = a["scale_factor"]
        sh, sw = (sf, sf) if isinstance(sf, (int, float)) else pair(sf)
        scale = (float(sh), 2.0) if axis == 2 else (2.0, float(sw))
    out = F.interpolate(
        basis,
        size=size,
        scale_factor=scale,
        mode=a["mode"],
        align_corners=a["align_corners"],
        recompute_scale_factor=a["recompute_scale_factor"],
    )
    if out.shape[axis] != size_out:
        raise NotFusable(f"interpolate: axis {axis} resampled to {out.shape[axis]}, not {size_out}")
    got = out[:, 0, :, 0] if axis == 2 else out[:, 0, 0, :]  # (k, o)
    return got.T.contiguous().numpy()


# The weight tables are C constants of n_in x n_out floats per axis: 512 -> 512 at most
INTERPOLATE_TABLE_MAX = 1 << 18


# (a, b, B): the first source index of output o is floor((a*o + b) / B), clamped at 0
def _source_rule(mode: str, align: bool | None, n_in: int, n_out: int) -> tuple[int, int, int]:
    if mode == "nearest":
        return n_in, 0, n_out
    if mode == "nearest-exact":
        return 2 * n_in, n_in, 2 * n_out
    if align:
        return (n_in - 1, 0, n_out - 1) if n_out > 1 else (0, 0, 1)
    return 2 * n_in, n_in - n_out, 2 * n_out


def _interpolate_window(node: Node, dim: int, n_in: int, n_out: int) -> tuple[Window, Any]:
    """The window of one axis and its weight table ``W[o, k]`` (module doc of
    ``interpolate_loops``); NotFusable where ATen's float index arithmetic departs from the
    exact rule (a scale factor that is not the sizes' ratio, a size past float precision)."""
    mode = node.attrs["mode"]
    if n_in * n_out > INTERPOLATE_TABLE_MAX:
        raise NotFusable(
            f"interpolate {n_in} -> {n_out}: a weight table over {INTERPOLATE_TABLE_MAX}"
        )
    w = _axis_weights(node, dim, n_in, n_out)
    taps = 1 if mode.startswith("nearest") else 2
    a, b, den = _source_rule(mode, node.attrs["align_corners"], n_in, n_out)
    # an infinity ATen multiplies by a zero weight is NaN: it must meet a zero weight here
    # at the same outputs (ATen reads the last index twice at the border, the second time
    # with weight 0 where the source is exactly that index: align_corners=True, one row)
    nan_aten = np.isnan(_axis_weights(node, dim, n_in, n_out, math.inf))
    nan_here = np.zeros_like(nan_aten)
    read: set[int] = set()
    for o in range(n_out):
        first = max((a * o + b) // den, 0)
        nz = [int(k) for k in w[o].nonzero()[0]]
        want = list(range(first, min(first + taps, n_in)))
        if not nz or nz[0] != first or not set(nz) <= set(want):
            raise NotFusable(
                f"interpolate ({mode}): output {o} of {n_out} reads {nz}, not the rule's {want}"
            )
        read.update(want)
        nan_here[o, want] = w[o, want] == 0
    if not np.array_equal(nan_aten, nan_here):
        raise NotFusable(
            f"interpolate ({mode}) {n_in} -> {n_out}: ATen multiplies an input by a zero "
            "weight where this window does not (an infinity there is NaN in ATen)"
        )
    if len(read) < n_in:
        # the schedule scans each input index's outputs as one range: an index no output
        # reads (downsampling past the taps) would be given its neighbour's
        raise NotFusable(f"interpolate ({mode}) {n_in} -> {n_out} skips input indices")
    # k in [f, f + taps) for f = floor((a*o + b) / B); below 0 ATen clamps the source to 0
    # and still reads taps 0 and 1 (a NaN there reaches the output through a zero weight)
    cons = f"{den}*k <= {a}*o + {b} + {den * (taps - 1)} and {den}*k + {den} > {a}*o + {b}"
    if taps > 1:
        cons = f"(({cons}) or ({a}*o + {b} < 0 and k <= {taps - 1}))"
    return Window(dim, 0, 1, 0, cons), w


def interpolate_loops(graph: Graph, node: Node) -> OpLoops:
    """nearest, nearest-exact and bilinear resampling as a sum window per axis: output
    ``(h, w)`` reads input rows ``k_h`` and columns ``k_w`` of ATen's own source indices
    (one tap, or two: the row and the next, clamped at the borders), each weighted by the
    weight ATen gives it (tables ``W[o, k]`` from the node's own call on one-hot inputs).
    Nearest sums from -0.0, so a copied -0.0 keeps its sign."""
    x = node.inputs[0]
    mode = node.attrs["mode"]
    if mode not in ("nearest", "nearest-exact", "bilinear"):
        raise NotFusable(f"interpolate mode {mode!r} has no loop semantics")
    in4, out4 = logical4(graph.values[x]), logical4(graph.values[node.outputs[0]])
    wins, weights = [], []
    for dim in (2, 3):
        win, w = _interpolate_window(node, dim, in4[dim], out4[dim])
        wins.append(win)
        weights.append(w)
    body: Expr = window_load(x, wins)
    if not mode.startswith("nearest"):
        for win, w in zip(wins, weights, strict=True):
            o = loops.DIMS[win.dim]
            # stored W[k, o]: the output loop, innermost, reads the table contiguously
            table = ParamVec(
                f"{node.name}_w{o}",
                tuple(w.T.reshape(-1).tolist()),
                f"{win.var}*{w.shape[0]} + {o}",
            )
            body = call("mul", body, table)
    return OpLoops(
        "reduce",
        Acc(),
        body=body,
        reduce="sum",
        init=-0.0 if mode.startswith("nearest") else 0.0,
        windows=tuple(wins),
    )


# nearest, nearest-exact, bilinear, bicubic (antialias off) on 4-d values: each output
# element reads a few input elements of its own sample and channel. Generated (loop
# semantics) for nearest, nearest-exact and bilinear where ATen's index arithmetic is exact.
register(
    OpDef(
        "interpolate",
        Bound.IO,
        _interpolate,
        flops_per_elem=4.0,
        loops=interpolate_loops,
        per_sample=True,
    )
)


# ------------------------------------------------------------------ pooling backward
# Training's generated backward kernels (``passes/autodiff.py``) differentiate pooling with
# three ops that only backward rules emit (like ``narrow``), each with loop semantics:
#
# - ``pool_argmax(x, y)``: per output element of a max-pool ``y = max_pool2d(x)``, the tap
#   (``k_h * kW + k_w``, as a float) PyTorch routes the gradient to: the first element of
#   the window equal to the maximum in row-major order, or, where the window holds a NaN,
#   the last NaN (ATen's ``val > max || isnan(val)``); a window of -inf only: its first
#   element inside the input. A max reduction over an encoding of each tap: ``-t`` where
#   the element equals ``y``, ``t + 1`` where it is NaN, -inf elsewhere.
# - ``max_pool2d_backward(gy, a)``: the input gradient, a sum over the output windows that
#   contain each input element (a window over ``gy`` transposed: scale-0 windows whose
#   isl constraint says which outputs read the element) of ``gy`` where the window's
#   chosen tap ``a`` is this element.
# - ``avg_pool2d_backward(gy)``, ``adaptive_avg_pool2d_backward(gy)``: the same sum of
#   ``gy`` divided by each window's divisor (ATen's rule: ``count_include_pad``,
#   ``ceil_mode``, ``divisor_override``; adaptive windows divide by the window's height,
#   then its width), from per-row and per-column tables of divisors.
#
# Their references are ATen's own calls (the argmax from ``max_pool2d``'s indices), so a
# test of their loop semantics against the reference checks the rule against PyTorch.


def _pool_geometry(
    attrs: Mapping[str, Any],
) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(kernel, stride, padding, dilation) of a pooling node's attrs, each an (h, w) pair."""
    k = pair(attrs["kernel_size"])
    s = pair(attrs["stride"] or attrs["kernel_size"])
    return k, s, pair(attrs["padding"]), pair(attrs.get("dilation", 1))


def _pool_attrs(node: Node, keys: Sequence[str]) -> dict[str, Any]:
    return {key: node.attrs[key] for key in keys if key in node.attrs}


_MAX_KEYS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
_AVG_KEYS = (
    "kernel_size",
    "stride",
    "padding",
    "ceil_mode",
    "count_include_pad",
    "divisor_override",
)


def _pool_argmax(node: Node) -> Kernel:
    k, s, p, d = _pool_geometry(node.attrs)
    c = bool(node.attrs["ceil_mode"])

    def pool_argmax(x, y):
        if x.is_meta:
            return torch.empty(y.shape, dtype=torch.float32, device="meta")
        _, idx = F.max_pool2d(x, k, s, p, d, ceil_mode=c, return_indices=True)
        oh = torch.arange(idx.shape[2]).view(-1, 1)
        ow = torch.arange(idx.shape[3]).view(1, -1)
        tap_h = (idx // x.shape[3] - (oh * s[0] - p[0])) // d[0]
        tap_w = (idx % x.shape[3] - (ow * s[1] - p[1])) // d[1]
        return (tap_h * k[1] + tap_w).to(torch.float32)

    return pool_argmax


def _windows_over(x4: Sequence[int], y4: Sequence[int], attrs: Mapping[str, Any]) -> list[Window]:
    """The forward windows of a pooling node from input ``x4`` to output ``y4`` (logical
    shapes), checked against the framework's output size rule."""
    k, s, p, d = _pool_geometry(attrs)
    wins = []
    for i, dim in enumerate((2, 3)):
        expect = window_out_size(x4[dim], k[i], s[i], p[i], d[i], bool(attrs["ceil_mode"]))
        if expect != y4[dim]:
            raise NotFusable(f"pool output size {y4[dim]} != rule {expect}")
        wins.append(Window(dim, s[i], d[i], -p[i], f"0 <= k < {k[i]}", taps=k[i]))
    return wins


def _load_through(value: str, windows: Sequence[Window]) -> Load:
    idx = list(DIMS)
    for win in windows:
        idx[win.dim] = win.input_index()
    return Load(value, tuple(idx))  # type: ignore[arg-type]


def _eq(a: Expr, b: Expr) -> Expr:
    """1 where ``a == b`` (0 where either is NaN)."""
    return call("and", call("ge", a, b), call("le", a, b))


def _pool_argmax_loops(graph: Graph, node: Node) -> OpLoops:
    x, y = node.inputs
    x4, y4 = loops.logical4(graph.values[x]), loops.logical4(graph.values[y])
    if graph.values[x].rank != 4:
        raise NotFusable("pool_argmax of a value that is not 4-d")
    wins = _windows_over(x4, y4, node.attrs)
    kh, kw = wins[0].taps, wins[1].taps
    xt = _load_through(x, wins)
    tap = ParamVec(f"{node.name}_tap", tuple(float(t) for t in range(kh * kw)), f"k_h*{kw} + k_w")
    body = call(
        "select",
        call("ge", xt, xt),  # not NaN
        call("select", _eq(xt, Load(y, DIMS)), call("neg", tap), Const(-float("inf"))),
        call("add", tap, Const(1.0)),
    )
    expr = call(
        "select", call("gt", Acc(), Const(0.0)), call("sub", Acc(), Const(1.0)), call("neg", Acc())
    )
    return OpLoops("reduce", expr, body=body, reduce="max", init=-float("inf"), windows=tuple(wins))


def _transposed(
    gy4: Sequence[int], x4: Sequence[int], attrs: Mapping[str, Any], node: str
) -> tuple[list[Window], ParamVec]:
    """The windows of a pooling's backward and its tap table. For input element ``o``
    along a dim the window runs over the outputs ``k`` with ``r = o + p - s*k`` (the
    element's offset in output ``k``'s window) in ``[-(s - 1), d*(K - 1) + tail]``: a
    superset of the windows covering ``o`` that is never empty. The schedule's loop
    bounds are those of a window that holds at least one element for every output point
    (as every forward window does): the exact set ``[0, d*(K - 1)]`` is empty where the
    stride is longer than the window, and ``tail`` reaches the last output from the input
    rows below the last window (``ceil_mode`` off). The table, at ``(r_h + s_h - 1) * L_w
    + r_w + s_w - 1``, says which tap of output ``k``'s window element ``o`` is (``t_h *
    K_w + t_w``), or -1 where it is none (outside the window, between two dilated
    taps)."""
    k, s, p, d = _pool_geometry(attrs)
    wins, lengths = [], []
    for i, dim in enumerate((2, 3)):
        span = d[i] * (k[i] - 1)
        if window_out_size(x4[dim], k[i], s[i], p[i], d[i], bool(attrs["ceil_mode"])) != gy4[dim]:
            raise NotFusable("pool gradient's size does not match the input's")
        tail = max(0, x4[dim] - 1 + p[i] - s[i] * (gy4[dim] - 1) - span)
        cons = f"{s[i]}*k <= o + {p[i] + s[i] - 1} and o + {p[i]} <= {s[i]}*k + {span + tail}"
        wins.append(Window(dim, 0, 1, 0, cons))
        lengths.append(span + tail + s[i])

    def tap(r: int, i: int) -> int:
        r -= s[i] - 1
        return r // d[i] if 0 <= r <= d[i] * (k[i] - 1) and r % d[i] == 0 else -1

    table = []
    for rh in range(lengths[0]):
        for rw in range(lengths[1]):
            th, tw = tap(rh, 0), tap(rw, 1)
            table.append(float(th * k[1] + tw) if th >= 0 and tw >= 0 else -1.0)
    at = f"(h + {p[0] + s[0] - 1} - {s[0]}*k_h)*{lengths[1]} + w + {p[1] + s[1] - 1} - {s[1]}*k_w"
    return wins, ParamVec(f"{node}_tap", tuple(table), at)


def _max_pool2d_backward(node: Node) -> Kernel:
    k, s, p, d = _pool_geometry(node.attrs)
    c = bool(node.attrs["ceil_mode"])
    h, w = node.attrs["input_size"]

    def max_pool2d_backward(gy, a):
        n, ch = gy.shape[:2]
        x = torch.empty((n, ch, h, w), dtype=gy.dtype, device=gy.device, memory_format=_fmt(gy))
        if gy.is_meta:
            return x
        t = a.to(torch.int64)
        oh = torch.arange(gy.shape[2]).view(-1, 1)
        ow = torch.arange(gy.shape[3]).view(1, -1)
        ih = oh * s[0] - p[0] + (t // k[1]) * d[0]
        iw = ow * s[1] - p[1] + (t % k[1]) * d[1]
        idx = ih * w + iw
        return torch.ops.aten.max_pool2d_with_indices_backward(gy, x, k, s, p, d, c, idx)

    return max_pool2d_backward


def _max_pool2d_backward_loops(graph: Graph, node: Node) -> OpLoops:
    gy, a = node.inputs
    gy4, x4 = loops.logical4(graph.values[gy]), loops.logical4(graph.values[node.outputs[0]])
    wins, tap = _transposed(gy4, x4, node.attrs, node.name)
    body = call("select", _eq(_load_through(a, wins), tap), _load_through(gy, wins), Const(0.0))
    return OpLoops("reduce", Acc(), body=body, reduce="sum", init=0.0, windows=tuple(wins))


def _fmt(t: torch.Tensor) -> torch.memory_format:
    """The memory format of a gradient's input: ``t``'s (channels_last where it is so and
    not also contiguous)."""
    if not t.is_meta and t.is_contiguous(memory_format=torch.channels_last):
        return torch.contiguous_format if t.is_contiguous() else torch.channels_last
    return torch.contiguous_format


def _avg_divisors(attrs: Mapping[str, Any], size: int, out: int, i: int) -> list[int]:
    """ATen's divisor factor along one dim per output position (the product of both dims'
    is the window's divisor): the window's length inside the padded input, or inside the
    input without ``count_include_pad``."""
    k, s, p, _ = _pool_geometry(attrs)
    got = []
    for o in range(out):
        lo = o * s[i] - p[i]
        hi = min(lo + k[i], size + p[i])
        got.append(hi - lo if attrs["count_include_pad"] else min(hi, size) - max(lo, 0))
    return got


def _avg_pool2d_backward(node: Node) -> Kernel:
    a = node.attrs
    k, s, p, _ = _pool_geometry(a)
    h, w = a["input_size"]
    args = (k, s, p, bool(a["ceil_mode"]), bool(a["count_include_pad"]), a["divisor_override"])

    def avg_pool2d_backward(gy):
        shape = (*gy.shape[:2], h, w)
        x = torch.empty(shape, dtype=gy.dtype, device=gy.device, memory_format=_fmt(gy))
        if gy.is_meta:
            return x
        return torch.ops.aten.avg_pool2d_backward(gy, x, *args)

    return avg_pool2d_backward


def _avg_pool2d_backward_loops(graph: Graph, node: Node) -> OpLoops:
    (gy,) = node.inputs
    gy4, x4 = loops.logical4(graph.values[gy]), loops.logical4(graph.values[node.outputs[0]])
    attrs = {**node.attrs, "dilation": 1}
    wins, tap = _transposed(gy4, x4, attrs, node.name)
    g: Expr = _load_through(gy, wins)
    div = node.attrs.get("divisor_override")
    if div:
        share: Expr = call("div", g, Const(float(div)))
    else:
        dh, dw = (
            ParamVec(
                f"{node.name}_div{DIMS[dim]}",
                tuple(float(v) for v in _avg_divisors(attrs, x4[dim], gy4[dim], i)),
                f"k_{DIMS[dim]}",
            )
            for i, dim in enumerate((2, 3))
        )
        share = call("div", g, call("mul", dh, dw))  # ATen: gy / divide_factor
    body = call("select", call("ge", tap, Const(0.0)), share, Const(0.0))
    return OpLoops("reduce", Acc(), body=body, reduce="sum", windows=tuple(wins))


def _adaptive_bounds(size: int, out: int) -> list[tuple[int, int]]:
    """ATen's adaptive window of each output position: [floor(o*I/O), ceil((o+1)*I/O))."""
    return [((o * size) // out, -(-((o + 1) * size) // out)) for o in range(out)]


def _adaptive_avg_pool2d_backward(node: Node) -> Kernel:
    h, w = node.attrs["input_size"]

    def adaptive_avg_pool2d_backward(gy):
        shape = (*gy.shape[:2], h, w)
        x = torch.empty(shape, dtype=gy.dtype, device=gy.device, memory_format=_fmt(gy))
        if gy.is_meta:
            return x
        return torch.ops.aten._adaptive_avg_pool2d_backward(gy, x)

    return adaptive_avg_pool2d_backward


def _adaptive_avg_pool2d_backward_loops(graph: Graph, node: Node) -> OpLoops:
    (gy,) = node.inputs
    gy4, x4 = loops.logical4(graph.values[gy]), loops.logical4(graph.values[node.outputs[0]])
    wins, divs = [], []
    for dim in (2, 3):
        size, out = x4[dim], gy4[dim]
        # input element o lies in output k's window: k*I < O*(o + 1) and O*o < (k + 1)*I
        cons = f"{size}*k < {out}*o + {out} and {out}*o < {size}*k + {size}"
        wins.append(Window(dim, 0, 1, 0, cons))
        lengths = tuple(float(hi - lo) for lo, hi in _adaptive_bounds(size, out))
        divs.append(ParamVec(f"{node.name}_div{DIMS[dim]}", lengths, f"k_{DIMS[dim]}"))
    # ATen: gy / kh / kw
    body = call("div", call("div", _load_through(gy, wins), divs[0]), divs[1])
    return OpLoops("reduce", Acc(), body=body, reduce="sum", windows=tuple(wins))


def _exact(e: GradEmitter, node: Node, gy: str) -> None:
    """Refuses an output gradient in broadcast form, a value that is not 4-d, and a
    window with no element inside the input (a dilated window over padding only: ATen's
    index then points past the input)."""
    if e.type_of(gy).shape != e.type_of(node.outputs[0]).shape:
        raise NotFusable(f"{node.op}'s output gradient reaches it in broadcast form")
    xt, yt = e.type_of(node.inputs[0]), e.type_of(node.outputs[0])
    if xt.rank != 4 or yt.rank != 4:
        raise NotFusable(f"{node.op} of a value that is not 4-d")
    if "kernel_size" not in node.attrs:
        return
    k, s, p, d = _pool_geometry(node.attrs)
    for i, dim in enumerate((2, 3)):
        for o in range(yt.shape[dim]):
            if not any(0 <= o * s[i] - p[i] + t * d[i] < xt.shape[dim] for t in range(k[i])):
                raise NotFusable(f"a window of {node.op} holds no element of its input")


def _max_pool_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    """max_pool2d's gradient: ``gy`` routed to the tap PyTorch's forward picks, recomputed
    (``pool_argmax``) from the input and the recomputed output."""
    _exact(e, node, gy)
    (x,) = node.inputs
    attrs = _pool_attrs(node, _MAX_KEYS)
    a = e.emit("pool_argmax", (x, node.outputs[0]), attrs)
    size = tuple(e.type_of(x).shape[2:])
    return (e.emit("max_pool2d_backward", (gy, a), {**attrs, "input_size": size}),)


# The activations merged into a max-pool whose backward does not depend on which of the
# two came first (merge_pool_relu does not record it): where their outputs tie and their
# inputs do not (relu's 0 below 0, hardtanh's bounds), their derivative is 0 at both
# taps, so routing through the pooled input's maximum gives the same gradient as through
# the activated values' maximum. A strictly increasing activation whose float outputs can
# tie (leaky_relu's slope * x, elu's saturation) would route to another element.
_ORDER_FREE = {"relu", "hardtanh"}


def _maxpool_act_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    """maxpool_relu's gradient: the activation's derivative at the pooled maximum, then
    max_pool2d's routing."""
    _exact(e, node, gy)
    act = node.attrs["activation"]
    if act not in _ORDER_FREE:
        raise NotFusable(
            f"max-pool merged with {act}: which came first is not recorded, and {act}'s "
            "ties would route the gradient differently"
        )
    (x,) = node.inputs
    attrs = _pool_attrs(node, _MAX_KEYS)
    m = e.emit("max_pool2d", (x,), attrs)
    gm = e.emit(
        "pointwise_grad", (m, gy), {"of": act, "of_attrs": tuple(node.attrs["activation_attrs"])}
    )
    a = e.emit("pool_argmax", (x, m), attrs)
    size = tuple(e.type_of(x).shape[2:])
    return (e.emit("max_pool2d_backward", (gm, a), {**attrs, "input_size": size}),)


def _avg_pool_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    """avg_pool2d's gradient: each window's ``gy`` over its divisor, summed per input."""
    _exact(e, node, gy)
    (x,) = node.inputs
    attrs = {**_pool_attrs(node, _AVG_KEYS), "input_size": tuple(e.type_of(x).shape[2:])}
    return (e.emit("avg_pool2d_backward", (gy,), attrs),)


# (not layout-preserving for the layout pass, which never meets them: they are made in
# backward graphs; their references write their first input's memory order)
register(
    OpDef(
        "pool_argmax",
        Bound.IO,
        _pool_argmax,
        flops_fn=pool_flops,
        loops=_pool_argmax_loops,
        per_sample=True,
    )
)
register(
    OpDef(
        "max_pool2d_backward",
        Bound.IO,
        _max_pool2d_backward,
        loops=_max_pool2d_backward_loops,
        per_sample=True,
    )
)
register(
    OpDef(
        "avg_pool2d_backward",
        Bound.IO,
        _avg_pool2d_backward,
        loops=_avg_pool2d_backward_loops,
        per_sample=True,
    )
)
register(
    OpDef(
        "adaptive_avg_pool2d_backward",
        Bound.IO,
        _adaptive_avg_pool2d_backward,
        loops=_adaptive_avg_pool2d_backward_loops,
        per_sample=True,
    )
)


def _max_pool2d(node: Node) -> Kernel:
    k, s, p, d, c = (
        node.attrs["kernel_size"],
        node.attrs["stride"],
        node.attrs["padding"],
        node.attrs["dilation"],
        node.attrs["ceil_mode"],
    )

    def max_pool2d(x):
        return F.max_pool2d(x, k, s, p, d, ceil_mode=c)

    return max_pool2d


# ATen's CPU max-pool always writes an int64 index tensor beside its result (twice the
# result's bytes for float32). For NCHW values the out-form pools the batch in up to this
# many chunks, so that the index scratch is one chunk's worth (measured: 4 chunks cost
# about 5% of the pool's time in NCHW; in channels_last every call costs the whole
# tensor's time, so channels_last pools run in one piece).
MAXPOOL_CHUNKS = 4
INDEX_BYTES = 8  # the int64 index ATen's CPU max-pools make per output element


def _max_pool2d_out(node: Node, graph: Graph) -> OutForm | None:
    """The out= form of max_pool2d, and of maxpool_relu with its activation's out= form
    applied in place after it."""
    a = node.attrs
    k, s, p, d, c = a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"]
    s = s or k
    act = None
    if node.op == "maxpool_relu":
        spec = get_op(a["activation"]).out
        form = None
        if spec is not None:
            act_node = Node("_act", a["activation"], ("x",), ("y",), dict(a["activation_attrs"]))
            form = spec.make(act_node, graph)
        if form is None or form[1]:
            return None
        act = form[0]
    t = graph.values[node.outputs[0]]
    n = t.shape[0]
    chunks = min(MAXPOOL_CHUNKS, n) if t.rank == 4 and t.layout == "nchw" else 1
    step = -(-n // chunks)
    indices = TensorType((step, *t.shape[1:]), "int64", t.layout)
    bounds = [(b, min(step, n - b)) for b in range(0, n, step)]
    pool = torch.ops.aten.max_pool2d_with_indices.out

    def max_pool2d_out(x, o, idx):
        for b, m in bounds:
            pool(
                x.narrow(0, b, m), k, s, p, d, c, out=o.narrow(0, b, m), indices=idx.narrow(0, 0, m)
            )
        if act is not None:
            act(o, o)

    return max_pool2d_out, (indices,)


register(
    OpDef(
        "max_pool2d",
        Bound.IO,
        _max_pool2d,
        flops_fn=pool_flops,
        loops=loops.max_pool_loops,
        per_sample=True,
        layout_preserving=True,
        out=OutVariant(_max_pool2d_out),
        temp_bytes_per_elem=INDEX_BYTES,
        grad=_max_pool_grad,
        image_op=True,
    )
)


def _avg_pool2d(node: Node) -> Kernel:
    k, s, p, c, cip, div = (
        node.attrs["kernel_size"],
        node.attrs["stride"],
        node.attrs["padding"],
        node.attrs["ceil_mode"],
        node.attrs["count_include_pad"],
        node.attrs["divisor_override"],
    )

    def avg_pool2d(x):
        return F.avg_pool2d(x, k, s, p, c, cip, div)

    return avg_pool2d


def _avg_pool2d_out(node: Node, graph: Graph) -> OutForm:
    a = node.attrs
    args = (
        a["kernel_size"],
        a["stride"] or a["kernel_size"],
        a["padding"],
        a["ceil_mode"],
        a["count_include_pad"],
        a["divisor_override"],
    )

    def avg_pool2d_out(x, o):
        torch._C._nn.avg_pool2d(x, *args, out=o)

    return avg_pool2d_out, ()


register(
    OpDef(
        "avg_pool2d",
        Bound.IO,
        _avg_pool2d,
        flops_fn=pool_flops,
        loops=loops.avg_pool_loops,
        per_sample=True,
        layout_preserving=True,
        out=OutVariant(_avg_pool2d_out),
        grad=_avg_pool_grad,
        image_op=True,
    )
)


def _adaptive_avg_pool2d(node: Node) -> Kernel:
    size = node.attrs["output_size"]

    def adaptive_avg_pool2d(x):
        return F.adaptive_avg_pool2d(x, size)

    return adaptive_avg_pool2d


def _adaptive_max_pool2d(node: Node) -> Kernel:
    size = node.attrs["output_size"]

    def adaptive_max_pool2d(x):
        return F.adaptive_max_pool2d(x, size)

    return adaptive_max_pool2d


def _adaptive_avg_pool2d_out(node: Node, graph: Graph) -> OutForm:
    size = node.attrs["output_size"]

    def adaptive_avg_pool2d_out(x, o):
        torch._C._nn.adaptive_avg_pool2d(x, size, out=o)

    return adaptive_avg_pool2d_out, ()


def _spatial_mean_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    """The gradient of a mean over both spatial dims of a 4-d value (``mean`` over (2, 3),
    ``adaptive_avg_pool2d`` to 1x1): ``gy / (H * W)`` at the output's (N, C, 1, 1) shape,
    the input's gradient in broadcast form (``passes/autodiff.py``: the same at every
    pixel). PyTorch's ``mean`` backward: ``grad.expand(sizes) / numel``. An adaptive pool
    to a larger map: ``adaptive_avg_pool2d_backward``. Any other mean has no rule (its
    group's backward recomputes through PyTorch)."""
    x, y = node.inputs[0], node.outputs[0]
    xt, yt = e.type_of(x), e.type_of(y)
    n, c, h, w = xt.shape if xt.rank == 4 else (0, 0, 0, 0)
    if node.op == "adaptive_avg_pool2d" and xt.rank == 4 and yt.shape[2:] != (1, 1):
        _exact(e, node, gy)  # windows of several outputs: each input's share of its windows
        return (e.emit("adaptive_avg_pool2d_backward", (gy,), {"input_size": (h, w)}),)
    spatial = xt.rank == 4 and (
        (node.op == "mean" and {int(d) % 4 for d in node.attrs["dims"]} == {2, 3})
        or (node.op == "adaptive_avg_pool2d" and yt.shape == (n, c, 1, 1))
    )
    if not spatial:
        raise NotFusable(f"{node.op} over these dims has no backward rule")
    if e.type_of(gy).shape != yt.shape:
        raise NotFusable(f"{node.op}'s output gradient reaches it in broadcast form")
    if yt.shape != (n, c, 1, 1):  # mean without keepdim: (N, C)
        gy = e.emit("reshape", (gy,), {"shape": (n, c, 1, 1)})
    return (e.emit("div", (gy,), {"scalar": float(h * w)}),)


register(
    OpDef(
        "adaptive_avg_pool2d",
        Bound.IO,
        _adaptive_avg_pool2d,
        flops_fn=pool_flops,
        loops=loops.adaptive_avg_pool_loops,
        per_sample=True,
        layout_preserving=True,
        # ATen's kernel restrides a strided (concat slice) output
        out=OutVariant(_adaptive_avg_pool2d_out, dense_only=True),
        grad=_spatial_mean_grad,
        image_op=True,
    )
)
register(
    OpDef(
        "adaptive_max_pool2d",
        Bound.IO,
        _adaptive_max_pool2d,
        flops_fn=pool_flops,
        loops=loops.adaptive_max_pool_loops,
        per_sample=True,
        layout_preserving=True,
        temp_bytes_per_elem=INDEX_BYTES,
        image_op=True,
    )
)


def _maxpool_act(node: Node) -> Kernel:
    pool = _max_pool2d(node)
    act = activation_fn(node.attrs["activation"], dict(node.attrs["activation_attrs"]))

    def maxpool_act(x):
        return act(pool(x))

    return maxpool_act


# merged max-pool + monotone activation (the passes' merge_pool_relu); attrs of max_pool2d
# plus ``activation`` (an op name) and ``activation_attrs`` (a tuple of (key, value) pairs)
register(
    OpDef(
        "maxpool_relu",
        Bound.IO,
        _maxpool_act,
        flops_fn=pool_flops,
        loops=with_post_op(loops.max_pool_loops),
        per_sample=True,
        layout_preserving=True,
        out=OutVariant(_max_pool2d_out),
        temp_bytes_per_elem=INDEX_BYTES,
        grad=_maxpool_act_grad,
        image_op=True,
    )
)


def _dims_kernel(fn: Any) -> Callable[[Node], Kernel]:
    """``fn(x, dims, keepdim)`` (torch.mean, torch.sum, torch.amax) with the node's dims."""

    def make(node: Node) -> Kernel:
        dims, keep = tuple(node.attrs["dims"]), bool(node.attrs["keepdim"])

        def reduce(x):
            return fn(x, dims, keep)

        return reduce

    return make


def _dims_out(fn: Any) -> OutVariant:
    def make(node: Node, graph: Graph) -> OutForm:
        dims, keep = tuple(node.attrs["dims"]), bool(node.attrs["keepdim"])

        def reduce_out(x, o):
            fn(x, dims, keep, out=o)

        return reduce_out, ()

    return OutVariant(make)


def _over_space(attrs: Mapping[str, Any]) -> bool:
    """A mean over both spatial dims writes (N, C) or (N, C, 1, 1): the same in both orders."""
    return {int(d) % 4 for d in attrs["dims"]} >= {2, 3}


register(
    OpDef(
        "mean",
        Bound.IO,
        _dims_kernel(torch.mean),
        flops_fn=reduce_flops,
        loops=loops.mean_loops,
        per_sample=True,
        layout_preserving=True,
        layout_preserving_if=_over_space,
        out=_dims_out(torch.mean),
        grad=_spatial_mean_grad,
    )
)


# sum and amax over ``dims`` (attrs as for mean): softmax's definition (the decomposition
# in passes/decompose_softmax.py) and user code. No backward rule: in training, a group
# holding one recomputes its backward through PyTorch.
for _name, _fn, _loops in (
    ("sum", torch.sum, loops.sum_loops),
    ("amax", torch.amax, loops.amax_loops),
):
    register(
        OpDef(
            _name,
            Bound.IO,
            _dims_kernel(_fn),
            flops_fn=reduce_flops,
            loops=_loops,
            per_sample=True,
            layout_preserving=True,
            layout_preserving_if=_over_space,
            out=_dims_out(_fn),
        )
    )
