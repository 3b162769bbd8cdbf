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
class VendorPostOp:
    """How the vendor library spells an activation as a post-op fused into a convolution's
    or linear layer's call (oneDNN's eltwise post-ops through ``torch.ops.mkldnn``): its
    name, the activation attrs that become its scalars (in order), the attr that becomes its
    "algorithm" string (gelu's ``approximate``) with the values it takes, and whether oneDNN
    takes it after a binary (residual add) post-op (measured on torch 2.14: relu only;
    every other one raises "Unary Fusion behavior undefined")."""

    onednn: str
    scalar_keys: tuple[str, ...] = ()
    algorithm_key: str | None = None
    algorithms: tuple[str, ...] = ()
    after_binary: bool = False

    def takes(self, attrs: Mapping[str, Any]) -> bool:
        """The post-op can spell the activation with these attrs."""
        if self.algorithm_key is None:
            return True
        return attrs.get(self.algorithm_key, self.algorithms[0]) in self.algorithms


@dataclasses.dataclass(frozen=True)
class OpDef:
    name: str
    bound: Bound
    make: Callable[[Node], Kernel]
    # Elementwise over its (broadcast) inputs: output element i reads input element i.
    elementwise: bool = False
    # A monotone non-decreasing activation (commutes with max-pooling); ``monotone_if``:
    # only for attrs it accepts (see ``is_monotone``).
    monotone: bool = False
    monotone_if: Callable[[Mapping[str, Any]], bool] | None = None
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
    # Attr values the framework's spelling defaults (filled in where a pass or a vendor call
    # may meet the op's attrs without them, e.g. a fused activation's).
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # An activation's form that overwrites its one argument and returns it (ATen's in-place
    # call), given the attrs; it may return a new tensor where ATen has no in-place form.
    inplace: Callable[[Mapping[str, Any]], Kernel] | None = None
    # An activation's spelling as a vendor post-op (fuse_vendor_epilogue, vendor calls).
    post_op: VendorPostOp | None = None

    def __post_init__(self) -> None:
        if self.per_sample is None:
            object.__setattr__(self, "per_sample", self.elementwise)
        if self.loops is None and self.pointwise is not None:
            object.__setattr__(self, "loops", loops.unary(self.pointwise))

    def is_monotone(self, attrs: Mapping[str, Any]) -> bool:
        """Monotone non-decreasing for these attrs (commutes with a max)."""
        return self.monotone and (self.monotone_if is None or self.monotone_if(attrs))

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


def _relu_(attrs: Mapping[str, Any]) -> Kernel:
    return torch.relu_


register(
    OpDef(
        "relu",
        Bound.IO,
        _unary(torch.relu),
        elementwise=True,
        monotone=True,
        pointwise=_relu_expr,
        inplace=_relu_,
        post_op=VendorPostOp("relu", after_binary=True),
    )
)


def _hardtanh(node: Node) -> Kernel:
    lo, hi = float(_a(node, "min_val")), float(_a(node, "max_val"))

    def hardtanh(x):
        return F.hardtanh(x, lo, hi)

    return hardtanh


def _hardtanh_expr(attrs: Mapping[str, Any], x: Expr) -> Expr:
    return clamp(x, float(attrs["min_val"]), float(attrs["max_val"]))


def _hardtanh_(attrs: Mapping[str, Any]) -> Kernel:
    lo, hi = float(attrs["min_val"]), float(attrs["max_val"])

    def hardtanh_(x: torch.Tensor) -> torch.Tensor:
        return F.hardtanh(x, lo, hi, inplace=True)

    return hardtanh_


# (relu6 is hardtanh(0, 6)); monotone unless min_val > max_val (a constant then)
register(
    OpDef(
        "hardtanh",
        Bound.IO,
        _hardtanh,
        elementwise=True,
        monotone=True,
        monotone_if=lambda a: float(a["min_val"]) <= float(a["max_val"]),
        pointwise=_hardtanh_expr,
        defaults={"min_val": -1.0, "max_val": 1.0},
        inplace=_hardtanh_,
        post_op=VendorPostOp("hardtanh", ("min_val", "max_val")),
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


def _leaky_relu_(attrs: Mapping[str, Any]) -> Kernel:
    slope = float(attrs["negative_slope"])

    def leaky_relu_(x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, slope, inplace=True)

    return leaky_relu_


# monotone only for a positive slope: a slope of 0 maps -inf to NaN (-inf * 0), which a max
# over the window's other elements would hide (merge_pool_relu)
register(
    OpDef(
        "leaky_relu",
        Bound.IO,
        _leaky_relu,
        elementwise=True,
        monotone=True,
        monotone_if=lambda a: float(a["negative_slope"]) > 0.0,
        pointwise=_leaky_relu_expr,
        defaults={"negative_slope": 0.01},
        inplace=_leaky_relu_,
        post_op=VendorPostOp("leaky_relu", ("negative_slope",)),
    )
)


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


def _inplace_of(fn: Kernel) -> Callable[[Mapping[str, Any]], Kernel]:
    def make(attrs: Mapping[str, Any]) -> Kernel:
        return fn

    return make


def _sigmoid_(x: torch.Tensor) -> torch.Tensor:
    return x.sigmoid_()


def _tanh_(x: torch.Tensor) -> torch.Tensor:
    return x.tanh_()


def _silu_(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


def _hardswish_(x: torch.Tensor) -> torch.Tensor:
    return F.hardswish(x, inplace=True)


def _hardsigmoid_(x: torch.Tensor) -> torch.Tensor:
    return F.hardsigmoid(x, inplace=True)


# (name, reference, FLOPs per element, scalar semantics, in-place form, oneDNN post-op)
for _name, _fn, _flops, _expr, _inplace, _onednn in (
    ("sigmoid", torch.sigmoid, 4.0, _sigmoid_expr, _sigmoid_, "sigmoid"),
    ("tanh", torch.tanh, 4.0, _tanh_expr, _tanh_, "tanh"),
    ("silu", F.silu, 5.0, _silu_expr, _silu_, "swish"),
    ("hardswish", F.hardswish, 4.0, _hardswish_expr, _hardswish_, "hardswish"),
    ("hardsigmoid", F.hardsigmoid, 3.0, _hardsigmoid_expr, _hardsigmoid_, "hardsigmoid"),
):
    register(
        OpDef(
            _name,
            Bound.IO,
            _unary(_fn),
            elementwise=True,
            flops_per_elem=_flops,
            pointwise=_expr,
            inplace=_inplace_of(_inplace),
            post_op=VendorPostOp(_onednn),
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


def _gelu_out_of_place(attrs: Mapping[str, Any]) -> Kernel:
    approximate = str(attrs["approximate"])

    def gelu(x: torch.Tensor) -> torch.Tensor:  # ATen has no in-place gelu
        return F.gelu(x, approximate=approximate)

    return gelu


register(
    OpDef(
        "gelu",
        Bound.IO,
        _gelu,
        elementwise=True,
        flops_per_elem=8.0,
        pointwise=_gelu_expr,
        defaults={"approximate": "none"},
        inplace=_gelu_out_of_place,
        post_op=VendorPostOp("gelu", (), "approximate", ("none", "tanh")),
    )
)


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
