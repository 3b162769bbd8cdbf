"""The op registry: :class:`OpDef` (everything about one op) and the lookups over it.

The entries themselves are made in the ``op_*`` modules (one family each) and the
registry is complete once ``middleware.ops`` is imported, which is where callers get it.
See ``middleware/ops.py`` for how to add an op.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from . import loops
from .enums import Bound
from .errors import UnsupportedError
from .graph import Graph, Node, TensorType, install_reference
from .loops import Expr, NotFusable, OpLoops, Pointwise, Rule

# A bound implementation: takes the node's input tensors, returns a tensor (one output) or a
# tuple of tensors (several outputs).
Kernel = Callable[..., Any]


# A destination-passing form of a node: ``fn(*inputs, *outputs, *scratch)`` writes the
# outputs (ATen's ``out=`` variants accept strided outputs, e.g. a slice of a concat
# destination), with the types of the scratch tensors it needs.
OutForm = tuple[Callable[..., Any], tuple[TensorType, ...]]


@dataclasses.dataclass(frozen=True)
class OutVariant:
    """An op's ATen ``out=`` form, for the buffer planner (runtime/memory.py).

    ``make(node, graph)`` gives the node's :data:`OutForm`, or None where its attrs have
    none. ``inplace_inputs``: the inputs the result may overwrite (elementwise, output shape
    = that input's shape; the form is then called with that input as output).
    ``dense_only``: the ATen kernel assumes a dense output (handed a strided view, a concat
    slice, it restrides it or writes as if it were dense), so it writes into a concat slice
    only where that slice is dense."""

    make: Callable[[Node, Graph], OutForm | None]
    inplace_inputs: tuple[int, ...] = ()
    dense_only: bool = False


@dataclasses.dataclass(frozen=True)
class VendorPostOp:
    """How the vendor library spells an activation as a post-op fused into a convolution's
    or linear layer's call (oneDNN's eltwise post-ops through ``torch.ops.mkldnn``): its
    name, the activation attrs that become its scalars (in order), the attr that becomes its
    "algorithm" string (gelu's ``approximate``) with the values it takes, and whether oneDNN
    takes it after a binary (residual add) post-op (measured on torch 2.14: relu only;
    every other one raises "Unary Fusion behavior undefined"). ``cublaslt``: cuBLASLt's
    linear epilogue fuses it too (``torch._addmm_activation``: relu; its gelu is the tanh
    approximation only, so gelu is not marked)."""

    onednn: str
    scalar_keys: tuple[str, ...] = ()
    algorithm_key: str | None = None
    algorithms: tuple[str, ...] = ()
    after_binary: bool = False
    cublaslt: bool = False

    def takes(self, attrs: Mapping[str, Any]) -> bool:
        """The post-op can spell the activation with these attrs."""
        if self.algorithm_key is None:
            return True
        return attrs.get(self.algorithm_key, self.algorithms[0]) in self.algorithms


class GradEmitter(Protocol):
    """What a backward rule (an entry's ``grad``) emits into: ``emit(op, inputs, attrs)``
    adds a node of registry op ``op`` over the named values and returns its output's name;
    ``type_of(value)`` is a value's :class:`TensorType`."""

    def emit(
        self, op: str, inputs: Sequence[str], attrs: Mapping[str, Any] | None = None
    ) -> str: ...

    def type_of(self, value: str) -> TensorType: ...


# A backward rule: ``rule(emitter, node, gy)`` emits the gradients of ``node``'s inputs as
# nodes of registry ops (forward ops: add, mul, div, ``pointwise_grad``, ...) over the
# node's own input and output values (recomputed by the backward graph) and ``gy``, the
# gradient of its output; it returns one value name per input (None: no gradient flows
# to that input, a scalar operand say). A gradient may have the node's output shape where
# the input was broadcast: the caller sums it down (``passes/autodiff.py``).
GradRule = Callable[[GradEmitter, Node, str], tuple[str | None, ...]]


@dataclasses.dataclass(frozen=True)
class PointwiseGrad:
    """The backward of an elementwise op of one input (an activation): ``expr(attrs, x,
    gy)`` is the input's gradient element from the input element ``x`` and the output
    gradient element ``gy`` (over ``loops.FUNCTIONS``, with PyTorch's subgradients and NaN
    behaviour: its backward formula, not the textbook's), ``reference(attrs)`` is PyTorch's
    own backward call as ``fn(x, gy) -> dx`` (ATen's ``*_backward``), the golden model."""

    expr: Callable[[Mapping[str, Any], Expr, Expr], Expr]
    reference: Callable[[Mapping[str, Any]], Kernel]
    flops_per_elem: float = 3.0


def pointwise_grad_rule(emitter: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    """The backward rule of an op with a :class:`PointwiseGrad`: one ``pointwise_grad``
    node over the forward input and ``gy``."""
    attrs = {"of": node.op, "of_attrs": tuple(sorted(node.attrs.items()))}
    return (emitter.emit("pointwise_grad", (node.inputs[0], gy), attrs),)


@dataclasses.dataclass(frozen=True, eq=False)  # one entry per op: compared and hashed by identity
class OpDef:
    """Everything the compiler knows about one op (see ``middleware/ops.py``): its name,
    default bound class and reference implementation (``make``: node -> callable over
    tensors), then the facts each stage reads, grouped by stage in the fields below."""

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
    # slicing may run it on a slice of the batch). None: the same as ``elementwise``
    # (resolved when the entry is made: a registered entry always holds a bool).
    per_sample: bool | None = None
    # Attr values the framework's spelling defaults (filled in where a pass or a vendor call
    # may meet the op's attrs without them, e.g. a fused activation's).
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # An activation's form that overwrites its one argument and returns it (ATen's in-place
    # call), given the attrs; it may return a new tensor where ATen has no in-place form.
    inplace: Callable[[Mapping[str, Any]], Kernel] | None = None
    # An activation's spelling as a vendor post-op (fuse_vendor_epilogue, vendor calls).
    post_op: VendorPostOp | None = None
    # The ATen ``out=`` form of the reference (the buffer planner writes its result into
    # the arena, over a dead input or into a concat slice); None: the reference allocates.
    out: OutVariant | None = None
    # Bytes per output element the reference allocates and drops while it runs (ATen's CPU
    # max-pools: an int64 index beside the result), for the planner's peak estimate.
    temp_bytes_per_elem: int = 0
    # Layout (passes/layout.py): the reference keeps the memory order of its 4-d inputs in
    # its 4-d outputs, in both layouts (None: the same as ``elementwise``), where
    # ``layout_preserving_if`` accepts the attrs; every other op reads and writes "nchw"
    # and the pass converts around it (checked op by op in tests/test_layout.py).
    layout_preserving: bool | None = None
    layout_preserving_if: Callable[[Mapping[str, Any]], bool] | None = None
    # Its inputs must carry the declared strides even where the two orders coincide.
    stride_strict: bool = False
    # The network layout (passes/layout.LAYOUT_RULES) was measured on this op (convolution,
    # pooling, batch norm): under layout="auto" a graph with none of them keeps its 4-d
    # inputs' memory order (its 4-d values may not be images: attention's b x h x l x d).
    image_op: bool = False
    # The reference may return a strided view of its input, dense in neither order.
    strided_view: bool = False
    # Input positions holding weights, which keep their layout (the vendor path prepacks).
    weight_inputs: frozenset[int] = frozenset()
    # A view-like op whose reference copies an input that is a permuted view (ATen cannot
    # view it so: reshape/flatten of a transposed value, contiguous, to_layout); the buffer
    # planner then gives the result a storage class of its own.
    copies_permuted: bool = False
    # Backward (training plans' generated backward kernels, ``passes/autodiff.py``): the
    # rule emitting the inputs' gradients as graph nodes (:data:`GradRule`); an activation
    # gives ``pointwise_grad`` instead (its rule is then :func:`pointwise_grad_rule`). None:
    # the op has no generated backward (its group's backward recomputes through PyTorch).
    grad: GradRule | None = None
    pointwise_grad: PointwiseGrad | None = None

    def __post_init__(self) -> None:
        if self.grad is None and self.pointwise_grad is not None:
            object.__setattr__(self, "grad", pointwise_grad_rule)
        if self.per_sample is None:
            object.__setattr__(self, "per_sample", self.elementwise)
        if self.layout_preserving is None:
            object.__setattr__(self, "layout_preserving", self.elementwise)
        if self.loops is None and self.pointwise is not None:
            object.__setattr__(self, "loops", loops.unary(self.pointwise))

    def is_monotone(self, attrs: Mapping[str, Any]) -> bool:
        """Monotone non-decreasing for these attrs (commutes with a max)."""
        return self.monotone and (self.monotone_if is None or self.monotone_if(attrs))

    def keeps_layout(self, attrs: Mapping[str, Any]) -> bool:
        """The reference keeps its input's memory order for these attrs."""
        return bool(self.layout_preserving) and (
            self.layout_preserving_if is None or self.layout_preserving_if(attrs)
        )

    def bind(self, node: Node) -> Kernel:
        """The reference implementation specialised to ``node``'s attributes."""
        return self.make(node)

    def flops(self, node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
        if self.flops_fn is not None:
            return float(self.flops_fn(node, ins, outs))
        return float(self.flops_per_elem * sum(t.numel for t in outs))


CATALOGUE: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    """Add ``op`` to the registry (``CATALOGUE``); an op name is registered once."""
    if op.name in CATALOGUE:
        raise ValueError(f"op {op.name!r} registered twice")
    CATALOGUE[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    """The entry of op ``name``; :class:`UnsupportedError` naming the known ops if none."""
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
    if 0 in out_t.shape or any(0 in graph.values[v].shape for v in node.inputs):
        # nothing to compute, and isl has no expression for an empty range's bounds
        raise NotFusable(f"{node.op} of an empty value (zero elements)")
    return op.loops(graph, node)


def has_loops(name: str) -> bool:
    """Op ``name`` has loop semantics (for some attributes and shapes: see ``loops_of``)."""
    op = CATALOGUE.get(name)
    return op is not None and op.loops is not None


def with_post_op(rule: Rule) -> Rule:
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


def activation_fn(name: str, attrs: dict[str, Any]) -> Callable[[Any], Any]:
    """The reference of a monotone activation named ``name`` with ``attrs``."""
    node = Node("_act", name, ("x",), ("y",), attrs)
    return get_op(name).bind(node)
