"""The op catalogue: the single place an op is described.

Each :class:`OpDef` gives an op's default bound class, its reference implementation (the
framework function used for fallback, for the reference interpreter and for tests), its
shape rule, its FLOP count (for the roofline classification) and what the passes need to
know about it (elementwise, monotone activation, ...). Loop semantics of I/O-bound ops for
depth-first code generation live in ``middleware.loops``, keyed by the same op names.

Adding an op means adding one entry to ``CATALOGUE`` (and a frontend mapping that lowers
the framework's spellings of it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import loops
from .enums import Bound
from .errors import UnsupportedError
from .graph import Graph, Node, TensorType, install_reference
from .loops import Const, Expr, NotFusable, OpLoops, Pointwise, Rule, call, clamp

# A bound implementation: takes the node's input tensors, returns a tensor (one output) or a
# tuple of tensors (several outputs).
Kernel = Callable[..., Any]


@dataclasses.dataclass(frozen=True)
class OpDef:
    name: str
    bound: Bound
    make: Callable[[Node], Kernel]
    # Elementwise over its (broadcast) inputs: output element i reads input element i.
    elementwise: bool = False
    # A monotone non-decreasing activation (commutes with max-pooling).
    monotone: bool = False
    # Does not compute anything (reshape-like, identity); may alias its input.
    view_like: bool = False
    # FLOPs per output element for simple ops; ``flops_fn`` overrides.
    flops_per_elem: float = 1.0
    flops_fn: Callable[[Node, Sequence[TensorType], Sequence[TensorType]], float] | None = None
    # The scalar semantics of an elementwise op of one input (an activation): its output
    # element from its input element, over ``middleware.loops.FUNCTIONS``. Used for the op
    # itself (``loops`` defaults to ``loops.unary(pointwise)``) and where it is fused as a
    # post-op of another op (``activation_expr``).
    pointwise: Pointwise | None = None
    # The loop semantics for depth-first code generation (``loops_of``); None: the op is
    # never generated.
    loops: Rule | None = None
    # Computes each sample of the batch (dimension 0) from that sample alone (batch
    # slicing may run it on a slice of the batch); default: ``elementwise``.
    # (None: the same as ``elementwise``; a registered entry always holds a bool)
    per_sample: bool | None = None

    def __post_init__(self) -> None:
        if self.per_sample is None:
            object.__setattr__(self, "per_sample", self.elementwise)
        if self.loops is None and self.pointwise is not None:
            object.__setattr__(self, "loops", loops.unary(self.pointwise))

    def bind(self, node: Node) -> Kernel:
        """The reference implementation specialised to ``node``'s attributes."""
        return self.make(node)

    def flops(self, node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
        if self.flops_fn is not None:
            return float(self.flops_fn(node, ins, outs))
        return float(self.flops_per_elem * sum(t.numel for t in outs))


CATALOGUE: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in CATALOGUE:
        raise ValueError(f"op {op.name!r} registered twice")
    CATALOGUE[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise UnsupportedError(
            f"op {name!r} is not in the catalogue; known ops: {', '.join(sorted(CATALOGUE))}"
        ) from None


install_reference(lambda node: get_op(node.op).bind(node))  # Graph.evaluate's interpreter


def activation_expr(name: str, attrs: Mapping[str, Any], x: Expr) -> Expr:
    """The expression of activation ``name`` (an op of the registry) applied to ``x``;
    raises :class:`~middleware.loops.NotFusable` when the op has no scalar semantics."""
    op = CATALOGUE.get(name)
    if op is None or op.pointwise is None:
        raise NotFusable(f"activation {name!r} has no loop semantics")
    return op.pointwise(attrs, x)


def loops_of(graph: Graph, node: Node) -> OpLoops:
    """The loop semantics of ``node`` in ``graph`` (its op's ``loops`` rule); raises
    :class:`~middleware.loops.NotFusable` (with the reason) for ops or attribute
    combinations the generator does not handle."""
    op = CATALOGUE.get(node.op)
    if op is None or op.loops is None:
        raise NotFusable(f"op {node.op!r} has no loop semantics")
    if len(node.outputs) != 1:
        raise NotFusable(f"{node.op} has {len(node.outputs)} outputs")
    out_t = graph.values[node.outputs[0]]
    if out_t.dtype != "float32":
        raise NotFusable(f"{out_t.dtype} values are not generated (float32 only)")
    return op.loops(graph, node)


def has_loops(name: str) -> bool:
    """Op ``name`` has loop semantics (for some attributes and shapes: see ``loops_of``)."""
    op = CATALOGUE.get(name)
    return op is not None and op.loops is not None


def _with_post_op(rule: Rule) -> Rule:
    """``rule`` followed by the node's fused ``activation`` (``activation_attrs``), if any."""

    def with_post_op(graph: Graph, node: Node) -> OpLoops:
        sem = rule(graph, node)
        name = node.attrs.get("activation")
        if not name:
            return sem
        attrs = dict(node.attrs.get("activation_attrs", ()))
        return dataclasses.replace(sem, expr=activation_expr(name, attrs, sem.expr))

    return with_post_op


_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def infer_types(graph_values: dict[str, TensorType], node: Node) -> list[TensorType]:
    """The shape rule: output types of ``node``, by running its reference on meta tensors.

    Running the framework's own implementation on shape-only tensors gives exactly the
    framework's shape semantics (ceil_mode, broadcasting, ...) with no data. The layout of
    4-d outputs follows the first 4-d input.
    """
    ins = [graph_values[v] for v in node.inputs]
    metas = [torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for t in ins]
    op = get_op(node.op)
    if node.op == "fallback":
        raise UnsupportedError("fallback nodes carry their own output types")
    out = op.bind(node)(*metas)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    layout = next((t.layout for t in ins if t.rank == 4), "nchw")
    if node.op == "to_layout":
        layout = node.attrs["layout"]
    return [
        TensorType(tuple(o.shape), dtype_name(o.dtype), layout if o.dim() == 4 else "nchw")
        for o in outs
    ]


# --------------------------------------------------------------------------- helpers
def _a(node: Node, key: str) -> Any:
    return node.attrs[key]


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return (v[0], v[0]) if len(v) == 1 else (v[0], v[1])


def conv_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    w = ins[1].shape  # (Cout, Cin/groups, kh, kw)
    return 2.0 * outs[0].numel * w[1] * w[2] * w[3]


def linear_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    return 2.0 * outs[0].numel * ins[1].shape[1]


def pool_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    if "kernel_size" in node.attrs:
        kh, kw = _pair(node.attrs["kernel_size"])
        return float(outs[0].numel * kh * kw)
    return float(ins[0].numel)  # adaptive: every input element read about once


def reduce_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    return float(ins[0].numel)


# ----------------------------------------------------------------- compute / param ops
def post_op_fn(node: Node) -> Callable[[Any], Any] | None:
    """The fused activation of a vendor call (``activation``/``activation_attrs`` attrs)."""
    name = node.attrs.get("activation")
    if not name:
        return None
    return activation_fn(name, dict(node.attrs.get("activation_attrs", ())))


def _conv2d(node: Node) -> Kernel:
    """Convolution, optionally with fused post-ops (the fuse_vendor_epilogue pass):
    ``residual=True`` adds the last input after the bias, then ``activation`` applies:
    ``y = act(conv(x, w) + b + residual)``, the order of oneDNN's sum and eltwise post-ops."""
    stride, padding, dilation, groups = (
        _a(node, "stride"),
        _a(node, "padding"),
        _a(node, "dilation"),
        _a(node, "groups"),
    )
    residual = bool(node.attrs.get("residual", False))
    has_bias = len(node.inputs) - int(residual) == 3
    act = post_op_fn(node)
    # ``output_layout="nhwc"``: the result is stored channels_last whatever the input's
    # layout (the layout pass lets a network's first convolution read an NCHW input
    # directly, as oneDNN does with a prepacked weight, instead of converting the input)
    out_cl = node.attrs.get("output_layout") == "nhwc"

    def conv2d(x, w, *rest):
        b = rest[0] if has_bias else None
        y = torch.conv2d(x, w, b, stride, padding, dilation, groups)
        if residual:
            y = y + rest[-1]
        y = act(y) if act is not None else y
        return y.contiguous(memory_format=torch.channels_last) if out_cl else y

    return conv2d


# generated only when depthwise (a sum window), with its fused activation
register(
    OpDef(
        "conv2d",
        Bound.COMPUTE,
        _conv2d,
        flops_fn=conv_flops,
        loops=_with_post_op(loops.depthwise_conv2d_loops),
        per_sample=True,
    )
)


def _linear(node: Node) -> Kernel:
    """Fully connected layer, optionally with a fused ``activation`` (see ``_conv2d``)."""
    act = post_op_fn(node)

    def linear(x, w, b=None):
        y = F.linear(x, w, b)
        return act(y) if act is not None else y

    return linear


register(OpDef("linear", Bound.PARAM, _linear, flops_fn=linear_flops))


def _matmul(node: Node) -> Kernel:
    return torch.matmul


def matmul_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    return 2.0 * outs[0].numel * ins[0].shape[-1]


register(OpDef("matmul", Bound.COMPUTE, _matmul, flops_fn=matmul_flops))


# ------------------------------------------------------------------- normalisation
def _batch_norm(node: Node) -> Kernel:
    eps = float(_a(node, "eps"))

    def batch_norm(x, mean, var, weight, bias):
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    return batch_norm


register(
    OpDef(
        "batch_norm",
        Bound.IO,
        _batch_norm,
        elementwise=True,
        flops_per_elem=2.0,
        loops=loops.batch_norm_loops,
    )
)


# --------------------------------------------------------------------- activations
def _unary(fn: Callable[..., Any]) -> Callable[[Node], Kernel]:
    def make(node: Node) -> Kernel:
        return fn

    return make


def _relu_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("max", x, Const(0.0))


register(
    OpDef(
        "relu", Bound.IO, _unary(torch.relu), elementwise=True, monotone=True, pointwise=_relu_expr
    )
)


def _hardtanh(node: Node) -> Kernel:
    lo, hi = float(_a(node, "min_val")), float(_a(node, "max_val"))

    def hardtanh(x):
        return F.hardtanh(x, lo, hi)

    return hardtanh


def _hardtanh_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return clamp(x, float(attrs["min_val"]), float(attrs["max_val"]))


register(
    OpDef(
        "hardtanh",
        Bound.IO,
        _hardtanh,
        elementwise=True,
        monotone=True,
        pointwise=_hardtanh_expr,
    )
)


def _leaky_relu(node: Node) -> Kernel:
    slope = float(_a(node, "negative_slope"))

    def leaky_relu(x):
        return F.leaky_relu(x, slope)

    return leaky_relu


def _leaky_relu_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    s = float(attrs["negative_slope"])
    return call("select", call("gt", x, Const(0.0)), x, call("mul", x, Const(s)))


# monotone only for a non-negative slope; merge_pool_relu checks the slope
register(OpDef("leaky_relu", Bound.IO, _leaky_relu, elementwise=True, pointwise=_leaky_relu_expr))


def _sigmoid_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("sigmoid", x)


def _tanh_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("tanh", x)


def _silu_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("mul", x, call("sigmoid", x))


def _hardsigmoid_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("div", clamp(call("add", x, Const(3.0)), 0.0, 6.0), Const(6.0))


def _hardswish_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return call("mul", x, _hardsigmoid_expr(attrs, x))


for _name, _fn, _flops, _expr in (
    ("sigmoid", torch.sigmoid, 4.0, _sigmoid_expr),
    ("tanh", torch.tanh, 4.0, _tanh_expr),
    ("silu", F.silu, 5.0, _silu_expr),
    ("hardswish", F.hardswish, 4.0, _hardswish_expr),
    ("hardsigmoid", F.hardsigmoid, 3.0, _hardsigmoid_expr),
):
    register(
        OpDef(
            _name,
            Bound.IO,
            _unary(_fn),
            elementwise=True,
            flops_per_elem=_flops,
            pointwise=_expr,
        )
    )


def _gelu(node: Node) -> Kernel:
    approximate = _a(node, "approximate")

    def gelu(x):
        return F.gelu(x, approximate=approximate)

    return gelu


def _gelu_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    if attrs.get("approximate", "none") == "tanh":
        inner = call(
            "mul",
            Const(math.sqrt(2.0 / math.pi)),
            call("add", x, call("mul", Const(0.044715), call("mul", x, call("mul", x, x)))),
        )
        return call("mul", call("mul", Const(0.5), x), call("add", Const(1.0), call("tanh", inner)))
    return call(
        "mul",
        call("mul", Const(0.5), x),
        call("add", Const(1.0), call("erf", call("mul", x, Const(1.0 / math.sqrt(2.0))))),
    )


register(OpDef("gelu", Bound.IO, _gelu, elementwise=True, flops_per_elem=8.0, pointwise=_gelu_expr))


def _softmax(node: Node) -> Kernel:
    dim = _a(node, "dim")

    def softmax(x):
        return torch.softmax(x, dim)

    return softmax


def _log_softmax(node: Node) -> Kernel:
    dim = _a(node, "dim")

    def log_softmax(x):
        return torch.log_softmax(x, dim)

    return log_softmax


register(OpDef("softmax", Bound.IO, _softmax, flops_per_elem=5.0, per_sample=True))
register(OpDef("log_softmax", Bound.IO, _log_softmax, flops_per_elem=5.0, per_sample=True))


# ------------------------------------------------------------------------- pooling
def _max_pool2d(node: Node) -> Kernel:
    k, s, p, d, c = (
        _a(node, "kernel_size"),
        _a(node, "stride"),
        _a(node, "padding"),
        _a(node, "dilation"),
        _a(node, "ceil_mode"),
    )

    def max_pool2d(x):
        return F.max_pool2d(x, k, s, p, d, ceil_mode=c)

    return max_pool2d


register(
    OpDef(
        "max_pool2d",
        Bound.IO,
        _max_pool2d,
        flops_fn=pool_flops,
        loops=loops.max_pool_loops,
        per_sample=True,
    )
)


def _avg_pool2d(node: Node) -> Kernel:
    k, s, p, c, cip, div = (
        _a(node, "kernel_size"),
        _a(node, "stride"),
        _a(node, "padding"),
        _a(node, "ceil_mode"),
        _a(node, "count_include_pad"),
        _a(node, "divisor_override"),
    )

    def avg_pool2d(x):
        return F.avg_pool2d(x, k, s, p, c, cip, div)

    return avg_pool2d


register(
    OpDef(
        "avg_pool2d",
        Bound.IO,
        _avg_pool2d,
        flops_fn=pool_flops,
        loops=loops.avg_pool_loops,
        per_sample=True,
    )
)


def _adaptive_avg_pool2d(node: Node) -> Kernel:
    size = _a(node, "output_size")

    def adaptive_avg_pool2d(x):
        return F.adaptive_avg_pool2d(x, size)

    return adaptive_avg_pool2d


def _adaptive_max_pool2d(node: Node) -> Kernel:
    size = _a(node, "output_size")

    def adaptive_max_pool2d(x):
        return F.adaptive_max_pool2d(x, size)

    return adaptive_max_pool2d


for _name, _make in (
    ("adaptive_avg_pool2d", _adaptive_avg_pool2d),
    ("adaptive_max_pool2d", _adaptive_max_pool2d),
):
    register(
        OpDef(
            _name,
            Bound.IO,
            _make,
            flops_fn=pool_flops,
            loops=loops.adaptive_pool_loops,
            per_sample=True,
        )
    )


def activation_fn(name: str, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    """The reference of a monotone activation named ``name`` with ``attrs``."""
    node = Node("_act", name, ("x",), ("y",), attrs)
    return get_op(name).bind(node)


def _maxpool_act(node: Node) -> Kernel:
    pool = _max_pool2d(node)
    act = activation_fn(_a(node, "activation"), dict(_a(node, "activation_attrs")))

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
        loops=_with_post_op(loops.max_pool_loops),
        per_sample=True,
    )
)


def _mean(node: Node) -> Kernel:
    dims, keep = tuple(_a(node, "dims")), bool(_a(node, "keepdim"))

    def mean(x):
        return torch.mean(x, dims, keep)

    return mean


register(
    OpDef("mean", Bound.IO, _mean, flops_fn=reduce_flops, loops=loops.mean_loops, per_sample=True)
)


# ---------------------------------------------------------------------- arithmetic
def _binary(fn: Callable[..., Any], has_alpha: bool = False) -> Callable[[Node], Kernel]:
    """add/sub/mul/div of two tensors, or of a tensor and a scalar attr ``scalar``
    (``reverse``: the scalar is the left operand). ``alpha`` scales the right operand."""

    def make(node: Node) -> Kernel:
        scalar = node.attrs.get("scalar")
        reverse = bool(node.attrs.get("reverse", False))
        alpha = node.attrs.get("alpha", 1)
        if has_alpha and alpha != 1:

            def apply(a, b):
                return fn(a, b, alpha=alpha)
        else:
            apply = fn
        if scalar is None:
            return apply
        if reverse:

            def left_scalar(x):
                return apply(torch.full((), scalar, dtype=x.dtype, device=x.device), x)

            return left_scalar

        def right_scalar(x):
            return apply(x, scalar)

        return right_scalar

    return make


for _name, _fn, _alpha in (
    ("add", torch.add, True),
    ("sub", torch.sub, True),
    ("mul", torch.mul, False),
    ("div", torch.div, False),
):
    register(
        OpDef(_name, Bound.IO, _binary(_fn, _alpha), elementwise=True, loops=loops.binary_loops)
    )


# -------------------------------------------------------------- data movement / views
def _cat(node: Node) -> Kernel:
    dim = _a(node, "dim")

    def cat(*xs):
        return torch.cat(xs, dim)

    return cat


register(OpDef("cat", Bound.IO, _cat, flops_per_elem=0.0, loops=loops.cat_loops, per_sample=True))


def _flatten(node: Node) -> Kernel:
    s, e = _a(node, "start_dim"), _a(node, "end_dim")

    def flatten(x):
        return torch.flatten(x, s, e)

    return flatten


register(
    OpDef(
        "flatten",
        Bound.IO,
        _flatten,
        view_like=True,
        flops_per_elem=0.0,
        loops=loops.reshape_loops,
        per_sample=True,
    )
)


def _reshape(node: Node) -> Kernel:
    shape = tuple(_a(node, "shape"))

    def reshape(x):
        return torch.reshape(x, shape)

    return reshape


register(
    OpDef(
        "reshape",
        Bound.IO,
        _reshape,
        view_like=True,
        flops_per_elem=0.0,
        loops=loops.reshape_loops,
        per_sample=True,
    )
)


def _permute(node: Node) -> Kernel:
    dims = tuple(_a(node, "dims"))

    def permute(x):
        return x.permute(dims)

    return permute


register(OpDef("permute", Bound.IO, _permute, view_like=True, flops_per_elem=0.0, per_sample=True))


def _contiguous(node: Node) -> Kernel:
    def contiguous(x):
        return x.contiguous()

    return contiguous


register(
    OpDef(
        "contiguous",
        Bound.IO,
        _contiguous,
        view_like=True,
        flops_per_elem=0.0,
        loops=loops.view_loops,
        per_sample=True,
    )
)


def _split(node: Node) -> Kernel:
    sizes, dim = tuple(_a(node, "split_sizes")), _a(node, "dim")

    def split(x):
        # one piece is one output: a tensor, as every single-output kernel returns (the
        # runtime would otherwise hand the caller a 1-tuple where it expects a tensor)
        pieces = tuple(torch.split(x, sizes, dim))
        return pieces if len(pieces) > 1 else pieces[0]

    return split


register(OpDef("split", Bound.IO, _split, view_like=True, flops_per_elem=0.0, per_sample=True))


def _identity(node: Node) -> Kernel:
    def identity(x):
        return x

    return identity


# dropout in inference is the identity; kept as its own op so reports name it
for _name in ("identity", "dropout"):
    register(
        OpDef(
            _name,
            Bound.IO,
            _identity,
            view_like=True,
            flops_per_elem=0.0,
            loops=loops.view_loops,
            per_sample=True,
        )
    )


def _to_layout(node: Node) -> Kernel:
    """The value unchanged, stored in memory order ``layout`` ("nchw": contiguous, "nhwc":
    channels_last; ranks other than 4 are made contiguous). Returns the input itself when it
    is already stored so, and an ``as_strided`` alias of it where both orders are one
    (C == 1 or H*W == 1): the buffer planner keeps such a result in its input's storage
    class (``runtime.memory._shares_storage`` mirrors this rule). Inserted by the layout
    pass at the graph's inputs and outputs and around ops that need one memory order."""
    nhwc = _a(node, "layout") == "nhwc"

    def to_layout(x):
        if x.dim() != 4:
            return x.contiguous()
        n, c, h, w = x.shape
        if nhwc:
            y, strides = x.contiguous(memory_format=torch.channels_last), (h * w * c, 1, w * c, c)
        else:
            y, strides = x.contiguous(), (c * h * w, h * w, w, 1)
        if y.stride() != strides:  # C == 1 or H*W == 1: the same memory, restrided
            y = y.as_strided(y.shape, strides, y.storage_offset())
        return y

    return to_layout


# a change of memory order only: output element i is input element i; on logical
# (n, c, h, w) indices the identity (each value's loads and stores follow its own layout)
register(
    OpDef(
        "to_layout",
        Bound.IO,
        _to_layout,
        elementwise=True,
        flops_per_elem=0.0,
        loops=loops.view_loops,
    )
)


# ----------------------------------------------------------------------- fallback
class ValueRef:
    """Marks where the ``i``-th input tensor goes in a fallback call's argument template."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"${self.index}"


def _fill(template: Any, values: Sequence[Any]) -> Any:
    if isinstance(template, ValueRef):
        return values[template.index]
    if isinstance(template, tuple):
        return tuple(_fill(t, values) for t in template)
    if isinstance(template, list):
        return [_fill(t, values) for t in template]
    if isinstance(template, dict):
        return {k: _fill(v, values) for k, v in template.items()}
    if isinstance(template, slice):
        return slice(
            _fill(template.start, values),
            _fill(template.stop, values),
            _fill(template.step, values),
        )
    return template


def _fallback(node: Node) -> Kernel:
    fn = node.payload
    args_t, kwargs_t = node.attrs["args"], node.attrs["kwargs"]
    multi = len(node.outputs) > 1

    def fallback(*values):
        out = fn(*_fill(args_t, values), **_fill(kwargs_t, values))
        if multi:
            return tuple(out)
        # a call returning a 1-tuple (split/chunk/unbind into one piece) has one output
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out

    return fallback


# runs the original framework callable (module, function or method) unchanged
register(OpDef("fallback", Bound.IO, _fallback, flops_fn=lambda n, i, o: 0.0))
