"""Per-op element functions: how one element of a node's output is computed from elements of
its inputs (the loop semantics of each I/O-bound op, spelled in CUDA C).

Every value of a group gets one ``__device__`` function ``e_<value>(a, i0, ..., i{r-1})``
returning the element at logical coordinates (NCHW order whatever the memory layout). A
group input reads memory; a node output calls its inputs' functions at the coordinates its
op's access relation gives (the same coordinates for elementwise ops, a window for pooling,
a shifted range for concat and split, a re-linearised index for reshape). Inlining these
functions gives the depth-first kernel: one thread computes one output element and pulls
exactly the input elements it needs through every layer, in registers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from ...errors import UnsupportedError
from ...graph import Node, TensorType
from .group import KernelGroup
from .scalar import UNARY, binary, flt, unary


@dataclasses.dataclass(frozen=True)
class ElementFn:
    """One ``__device__`` function: C name, rank, body lines, and the value it computes."""

    value: str
    cname: str
    rank: int
    body: tuple[str, ...]
    comment: str = ""


def strides(t: TensorType) -> tuple[int, ...]:
    """Element strides of a value in memory for its logical (NCHW-order) coordinates."""
    shape = t.shape
    if t.rank == 4 and t.layout == "nhwc":
        n, c, h, w = shape
        return (h * w * c, 1, w * c, c)
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return tuple(out)


def memory_order(t: TensorType) -> tuple[int, ...]:
    """Logical dims from outermost to innermost in memory."""
    if t.rank == 4 and t.layout == "nhwc":
        return (0, 2, 3, 1)
    return tuple(range(t.rank))


def cident(name: str, taken: set[str]) -> str:
    """A C identifier for value ``name``, unique within ``taken`` (which it joins)."""
    base = "v_" + re.sub(r"[^0-9A-Za-z_]", "_", name)
    out, i = base, 1
    while out in taken:
        out, i = f"{base}_{i}", i + 1
    taken.add(out)
    return out


class _Ctx:
    """What an op's emitter needs: the C name and type of each value, and a call helper."""

    def __init__(self, group: KernelGroup, names: dict[str, str]) -> None:
        self.group = group
        self.names = names

    def t(self, value: str) -> TensorType:
        return self.group.types[value]

    def call(self, value: str, coords: Sequence[str]) -> str:
        if len(coords) != self.t(value).rank:
            raise UnsupportedError(f"rank mismatch reading {value}")
        args = ", ".join(["a", *coords])
        return f"e_{self.names[value]}({args})"


def _idx(rank: int) -> list[str]:
    return [f"i{k}" for k in range(rank)]


def load_fn(ctx: _Ctx, value: str) -> ElementFn:
    """The element function of a group input: a load at the layout's offset."""
    t = ctx.t(value)
    st = strides(t)
    cast = "" if t.numel < 2**31 else "(long long)"
    terms = [
        f"{cast}i{k}" + (f" * {s}" if s != 1 else "") for k, s in enumerate(st) if t.shape[k] != 1
    ]
    offset = " + ".join(terms) if terms else "0"
    name = ctx.names[value]
    # a plain load: const __restrict__ already gives the read-only path (LDG.CONSTANT), and
    # unlike __ldg it lets the compiler share loads between the taps of a window
    body = (f"return a.{name}[{offset}];",)
    return ElementFn(value, name, t.rank, body, f"load {value}: {t}")


# ----------------------------------------------------------------------------- emitters
Emitter = Callable[[_Ctx, Node, int], list[str]]


def _elementwise_unary(ctx: _Ctx, n: Node, k: int) -> list[str]:
    r = ctx.t(n.outputs[0]).rank
    return [
        f"const float x = {ctx.call(n.inputs[0], _idx(r))};",
        f"return {unary(n.op, 'x', n.attrs)};",
    ]


def _broadcast_coords(out_rank: int, t: TensorType) -> list[str]:
    """Coordinates into an operand of shape ``t`` broadcast to rank ``out_rank``."""
    lead = out_rank - t.rank
    return ["0" if s == 1 else f"i{lead + j}" for j, s in enumerate(t.shape)]


def _binary(ctx: _Ctx, n: Node, k: int) -> list[str]:
    r = ctx.t(n.outputs[0]).rank
    alpha = float(n.attrs.get("alpha", 1) or 1)
    if n.attrs.get("scalar") is not None:
        s = flt(n.attrs["scalar"])
        x = ctx.call(n.inputs[0], _broadcast_coords(r, ctx.t(n.inputs[0])))
        expr = (
            binary(n.op, s, "x", alpha) if n.attrs.get("reverse") else binary(n.op, "x", s, alpha)
        )
        return [f"const float x = {x};", f"return {expr};"]
    x = ctx.call(n.inputs[0], _broadcast_coords(r, ctx.t(n.inputs[0])))
    y = ctx.call(n.inputs[1], _broadcast_coords(r, ctx.t(n.inputs[1])))
    return [
        f"const float x = {x};",
        f"const float y = {y};",
        f"return {binary(n.op, 'x', 'y', alpha)};",
    ]


def _batch_norm(ctx: _Ctx, n: Node, k: int) -> list[str]:
    r = ctx.t(n.outputs[0]).rank
    eps = flt(float(n.attrs["eps"]))
    x = ctx.call(n.inputs[0], _idx(r))
    ch = ["i1"] if r >= 2 else ["0"]
    mean, var = ctx.call(n.inputs[1], ch), ctx.call(n.inputs[2], ch)
    w = ctx.call(n.inputs[3], ch) if len(n.inputs) > 3 else "1.0f"
    b = ctx.call(n.inputs[4], ch) if len(n.inputs) > 4 else "0.0f"
    # (x - mean) * (w / sqrt(var + eps)) + b: the per-channel factor is loop-invariant, so
    # the compiler hoists it out of pooling windows.
    return [
        f"const float scale = {w} / sqrtf({var} + {eps});",
        f"return ({x} - {mean}) * scale + {b};",
    ]


def _pair(v) -> tuple[int, int]:  # noqa: ANN001
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def _need_rank4(ctx: _Ctx, n: Node) -> None:
    if ctx.t(n.inputs[0]).rank != 4:
        raise UnsupportedError(f"{n.op} on a rank-{ctx.t(n.inputs[0]).rank} value")


def _max_pool(ctx: _Ctx, n: Node, k: int) -> list[str]:
    _need_rank4(ctx, n)
    _, _, H, W = ctx.t(n.inputs[0]).shape
    kh, kw = _pair(n.attrs["kernel_size"])
    stride = n.attrs.get("stride") or n.attrs["kernel_size"]
    sh, sw = _pair(stride)
    ph, pw = _pair(n.attrs.get("padding", 0))
    dh, dw = _pair(n.attrs.get("dilation", 1))
    x = ctx.call(n.inputs[0], ["i0", "i1", "hc", "wc"])
    # Branch-free window: out-of-range taps read a clamped (valid) element and are masked
    # out. Every tap then executes the same loads, so the compiler can share what the taps
    # have in common (a batch-norm's per-channel factors) instead of reloading it per tap.
    lines = [
        "float acc = -INFINITY;",
        f"const int h0 = i2 * {sh} - {ph}, w0 = i3 * {sw} - {pw};",
        "#pragma unroll",
        f"for (int kh = 0; kh < {kh}; ++kh) {{",
        f"  const int h = h0 + kh * {dh};",
        f"  const bool hin = h >= 0 && h < {H};",
        f"  const int hc = min(max(h, 0), {H - 1});",
        "  #pragma unroll",
        f"  for (int kw = 0; kw < {kw}; ++kw) {{",
        f"    const int w = w0 + kw * {dw};",
        f"    const int wc = min(max(w, 0), {W - 1});",
        f"    const float v = {x};",
        f"    const bool in = hin && w >= 0 && w < {W};",
        "    acc = (in && (v > acc || v != v)) ? v : acc;",
        "  }",
        "}",
    ]
    if n.op == "maxpool_relu":
        act = n.attrs["activation"]
        lines.append(f"return {unary(act, 'acc', dict(n.attrs.get('activation_attrs', ())))};")
    else:
        lines.append("return acc;")
    return lines


def _avg_pool(ctx: _Ctx, n: Node, k: int) -> list[str]:
    _need_rank4(ctx, n)
    _, _, H, W = ctx.t(n.inputs[0]).shape
    kh, kw = _pair(n.attrs["kernel_size"])
    stride = n.attrs.get("stride") or n.attrs["kernel_size"]
    sh, sw = _pair(stride)
    ph, pw = _pair(n.attrs.get("padding", 0))
    cip = bool(n.attrs.get("count_include_pad", True))
    div = n.attrs.get("divisor_override")
    x = ctx.call(n.inputs[0], ["i0", "i1", "hc", "wc"])
    # PyTorch's rule: the window is clipped to the padded input for the divisor when
    # count_include_pad, and to the input itself otherwise. Taps are branch-free (see
    # max-pooling).
    lines = [
        f"int hs = i2 * {sh} - {ph}, ws = i3 * {sw} - {pw};",
        f"int he = min(hs + {kh}, {H + ph}), we = min(ws + {kw}, {W + pw});",
        "const int pool = (he - hs) * (we - ws);",
        "float acc = 0.0f;",
        "#pragma unroll",
        f"for (int kh = 0; kh < {kh}; ++kh) {{",
        "  const int h = hs + kh;",
        f"  const bool hin = h >= 0 && h < {H};",
        f"  const int hc = min(max(h, 0), {H - 1});",
        "  #pragma unroll",
        f"  for (int kw = 0; kw < {kw}; ++kw) {{",
        "    const int w = ws + kw;",
        f"    const int wc = min(max(w, 0), {W - 1});",
        f"    const float v = {x};",
        f"    acc += (hin && w >= 0 && w < {W}) ? v : 0.0f;",
        "  }",
        "}",
        f"hs = max(hs, 0); ws = max(ws, 0); he = min(he, {H}); we = min(we, {W});",
    ]
    if div:
        lines.append(f"return acc / {flt(float(div))};")
    elif cip:
        lines.append("return acc / (float)pool;")
    else:
        lines.append("return acc / (float)((he - hs) * (we - ws));")
    return lines


def _adaptive(ctx: _Ctx, n: Node, k: int) -> list[str]:
    _need_rank4(ctx, n)
    _, _, H, W = ctx.t(n.inputs[0]).shape
    _, _, OH, OW = ctx.t(n.outputs[0]).shape
    x = ctx.call(n.inputs[0], ["i0", "i1", "h", "w"])
    is_max = n.op == "adaptive_max_pool2d"
    lines = [
        f"const int hs = (i2 * {H}) / {OH}, he = ((i2 + 1) * {H} + {OH - 1}) / {OH};",
        f"const int ws = (i3 * {W}) / {OW}, we = ((i3 + 1) * {W} + {OW - 1}) / {OW};",
        "float acc = " + ("-INFINITY;" if is_max else "0.0f;"),
        "for (int h = hs; h < he; ++h)",
        "  for (int w = ws; w < we; ++w) {",
        f"    const float v = {x};",
        ("    acc = (v > acc || v != v) ? v : acc;" if is_max else "    acc += v;"),
        "  }",
    ]
    lines.append("return acc;" if is_max else "return acc / (float)((he - hs) * (we - ws));")
    return lines


def _mean(ctx: _Ctx, n: Node, k: int) -> list[str]:
    tin = ctx.t(n.inputs[0])
    r_in = tin.rank
    dims = sorted(d % r_in for d in n.attrs["dims"])
    keep = bool(n.attrs.get("keepdim", False))
    coords, out_k, count = [], 0, 1
    for d in range(r_in):
        if d in dims:
            coords.append(f"r{d}")
            count *= tin.shape[d]
            if keep:
                out_k += 1
        else:
            coords.append(f"i{out_k}")
            out_k += 1
    lines = ["float acc = 0.0f;"]
    for depth, d in enumerate(dims):
        lines.append("  " * depth + f"for (int r{d} = 0; r{d} < {tin.shape[d]}; ++r{d})")
    lines.append("  " * len(dims) + f"acc += {ctx.call(n.inputs[0], coords)};")
    lines.append(f"return acc / {flt(float(count))};")
    return lines


def _softmax(ctx: _Ctx, n: Node, k: int) -> list[str]:
    t = ctx.t(n.inputs[0])
    d = int(n.attrs["dim"]) % t.rank
    coords = _idx(t.rank)
    at_j = list(coords)
    at_j[d] = "j"
    xj = ctx.call(n.inputs[0], at_j)
    lines = [
        "float m = -INFINITY;",
        f"for (int j = 0; j < {t.shape[d]}; ++j) m = fmaxf(m, {xj});",
        "float s = 0.0f;",
        f"for (int j = 0; j < {t.shape[d]}; ++j) s += expf({xj} - m);",
        f"const float x = {ctx.call(n.inputs[0], coords)};",
    ]
    if n.op == "log_softmax":
        lines.append("return x - m - logf(s);")
    else:
        lines.append("return expf(x - m) / s;")
    return lines


def _cat(ctx: _Ctx, n: Node, k: int) -> list[str]:
    r = ctx.t(n.outputs[0]).rank
    d = int(n.attrs["dim"]) % r
    lines, off = [], 0
    for v in n.inputs:
        size = ctx.t(v).shape[d]
        coords = _idx(r)
        coords[d] = f"i{d} - {off}" if off else f"i{d}"
        lines.append(f"if (i{d} < {off + size}) return {ctx.call(v, coords)};")
        off += size
    lines.append(f"return 0.0f;  // unreachable: i{d} < {off}")
    return lines


def _split(ctx: _Ctx, n: Node, k: int) -> list[str]:
    r = ctx.t(n.outputs[k]).rank
    d = int(n.attrs["dim"]) % r
    off = sum(ctx.t(v).shape[d] for v in n.outputs[:k])
    coords = _idx(r)
    coords[d] = f"i{d} + {off}" if off else f"i{d}"
    return [f"return {ctx.call(n.inputs[0], coords)};"]


def _reshape(ctx: _Ctx, n: Node, k: int) -> list[str]:
    tout, tin = ctx.t(n.outputs[0]), ctx.t(n.inputs[0])
    if tout.shape == tin.shape:
        return [f"return {ctx.call(n.inputs[0], _idx(tout.rank))};"]
    ty = "int" if tout.numel < 2**31 else "long long"
    terms, st = [], 1
    for j in range(tout.rank - 1, -1, -1):
        if tout.shape[j] != 1:
            terms.append(f"({ty})i{j} * {st}" if st != 1 else f"({ty})i{j}")
        st *= tout.shape[j]
    lines = [f"const {ty} lin = {' + '.join(reversed(terms)) or '0'};"]
    coords, st = [], 1
    for j in range(tin.rank - 1, -1, -1):
        s = tin.shape[j]
        if s == 1:
            coords.append("0")
        else:
            div = f"lin / {st}" if st != 1 else "lin"
            coords.append(f"(int)(({div}) % {s})")
        st *= s
    lines.append(f"return {ctx.call(n.inputs[0], list(reversed(coords)))};")
    return lines


def _permute(ctx: _Ctx, n: Node, k: int) -> list[str]:
    dims = [int(d) % ctx.t(n.inputs[0]).rank for d in n.attrs["dims"]]
    coords = ["0"] * len(dims)
    for j, d in enumerate(dims):
        coords[d] = f"i{j}"
    return [f"return {ctx.call(n.inputs[0], coords)};"]


def _conv2d(ctx: _Ctx, n: Node, k: int) -> list[str]:
    """Direct convolution (depthwise and other convolutions the classifier marks io)."""
    _need_rank4(ctx, n)
    _, _, H, W = ctx.t(n.inputs[0]).shape
    cout, cin_g, kh, kw = ctx.t(n.inputs[1]).shape
    groups = int(n.attrs.get("groups", 1))
    cout_g = cout // groups
    sh, sw = _pair(n.attrs.get("stride", 1))
    ph, pw = _pair(n.attrs.get("padding", 0))
    dh, dw = _pair(n.attrs.get("dilation", 1))
    if isinstance(n.attrs.get("padding"), str):
        raise UnsupportedError("conv2d with string padding")
    residual = bool(n.attrs.get("residual", False))
    has_bias = len(n.inputs) - int(residual) == 3
    x = ctx.call(n.inputs[0], ["i0", "ci", "h", "w"])
    wt = ctx.call(n.inputs[1], ["i1", "c", "kh", "kw"])
    lines = [
        f"float acc = {ctx.call(n.inputs[2], ['i1']) if has_bias else '0.0f'};",
        f"const int c0 = (i1 / {cout_g}) * {cin_g};",
        f"for (int c = 0; c < {cin_g}; ++c) {{",
        "  const int ci = c0 + c;",
        f"  for (int kh = 0; kh < {kh}; ++kh) {{",
        f"    const int h = i2 * {sh} - {ph} + kh * {dh};",
        f"    if (h < 0 || h >= {H}) continue;",
        f"    for (int kw = 0; kw < {kw}; ++kw) {{",
        f"      const int w = i3 * {sw} - {pw} + kw * {dw};",
        f"      if (w < 0 || w >= {W}) continue;",
        f"      acc += {x} * {wt};",
        "    }",
        "  }",
        "}",
    ]
    if residual:
        lines.append(f"acc += {ctx.call(n.inputs[-1], _idx(4))};")
    act = n.attrs.get("activation")
    if act:
        lines.append(f"return {unary(act, 'acc', dict(n.attrs.get('activation_attrs', ())))};")
    else:
        lines.append("return acc;")
    return lines


EMITTERS: dict[str, Emitter] = {
    **{op: _elementwise_unary for op in UNARY},
    "add": _binary,
    "sub": _binary,
    "mul": _binary,
    "div": _binary,
    "batch_norm": _batch_norm,
    "max_pool2d": _max_pool,
    "maxpool_relu": _max_pool,
    "avg_pool2d": _avg_pool,
    "adaptive_avg_pool2d": _adaptive,
    "adaptive_max_pool2d": _adaptive,
    "mean": _mean,
    "softmax": _softmax,
    "log_softmax": _softmax,
    "cat": _cat,
    "split": _split,
    "flatten": _reshape,
    "reshape": _reshape,
    "permute": _permute,
    "conv2d": _conv2d,
}


def supported_ops() -> tuple[str, ...]:
    """The ops the CUDA backend can put inside a generated kernel."""
    return tuple(sorted(EMITTERS))


# A thread recomputes the producers of a window for every tap; stacked overlapping windows
# multiply that work (3x3/1 pooling of 3x3/1 pooling recomputes the first 81 times). Past
# this factor a group is left to the framework rather than rendered.
MAX_RECOMPUTE = 64.0


def _overlap(n: Node, group: KernelGroup) -> float:
    """How many output elements of ``n`` read each input element (1 for pointwise ops)."""
    if n.op in ("max_pool2d", "maxpool_relu", "avg_pool2d") or (
        n.op == "conv2d" and group.types[n.inputs[0]].rank == 4
    ):
        if n.op == "conv2d":
            kh, kw = group.types[n.inputs[1]].shape[2:]
            stride = n.attrs.get("stride", 1)
        else:
            kh, kw = _pair(n.attrs.get("kernel_size", 1))
            stride = n.attrs.get("stride") or n.attrs.get("kernel_size", 1)
        sh, sw = _pair(stride)
        return max(1.0, kh / sh) * max(1.0, kw / sw)
    if n.op in ("softmax", "log_softmax"):
        return 3.0
    return 1.0


def recompute_factor(group: KernelGroup) -> float:
    """The most times any element of the group is computed, relative to once."""
    factor = {v: 1.0 for v in group.inputs}
    for n in group.nodes:
        reads = max((factor.get(v, 1.0) for v in n.inputs), default=1.0)
        for v in n.outputs:
            factor[v] = reads * _overlap(n, group)
    return max(factor.values(), default=1.0)


def why_unsupported(group: KernelGroup) -> str:
    """ "" when every node of ``group`` can be rendered, else the reason it cannot."""
    for n in group.nodes:
        if n.op not in EMITTERS:
            return f"op {n.op} has no CUDA element function"
        if n.op in ("max_pool2d", "maxpool_relu", "avg_pool2d") and "kernel_size" not in n.attrs:
            return f"{n.op} without kernel_size"
        if n.op in ("maxpool_relu", "conv2d") and n.attrs.get("activation"):
            if n.attrs["activation"] not in UNARY:
                return f"activation {n.attrs['activation']} has no CUDA spelling"
    for v, t in group.types.items():
        if t.dtype != "float32":
            return f"value {v} is {t.dtype}; generated CUDA kernels are float32 only"
    factor = recompute_factor(group)
    if factor > MAX_RECOMPUTE:
        return f"stacked windows would recompute elements {factor:.0f} times (limit {MAX_RECOMPUTE:.0f})"
    return ""


def element_functions(group: KernelGroup, names: dict[str, str]) -> list[ElementFn]:
    """Every value's element function, inputs first, then nodes in topological order."""
    ctx = _Ctx(group, names)
    fns = [load_fn(ctx, v) for v in group.inputs]
    for n in group.nodes:
        emit = EMITTERS.get(n.op)
        if emit is None:
            raise UnsupportedError(f"op {n.op} has no CUDA element function")
        for k, v in enumerate(n.outputs):
            t = ctx.t(v)
            body = tuple(emit(ctx, n, k))
            src = f" ({n.source})" if n.source else ""
            fns.append(ElementFn(v, names[v], t.rank, body, f"{n.op} {n.name}{src}: {t}"))
    return fns
