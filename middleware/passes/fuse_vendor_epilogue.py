"""fuse_vendor_epilogue: a convolution's (or linear layer's) bias add, residual add and
activation become post-ops of the one vendor call, where the vendor library offers them.

What the vendor offers is data (``POST_OPS``), per device kind and layer op, derived from
the activations' registry entries (``OpDef.post_op``, ``OpDef.pointwise``):

- cpu (oneDNN through ``torch.ops.mkldnn._convolution_pointwise`` / ``_linear_pointwise``;
  checked on torch 2.14 by calling each): the unary eltwise post-ops relu, sigmoid, tanh,
  hardswish, hardsigmoid, swish (silu), leaky_relu, hardtanh (relu6), gelu (both
  approximations); the binary ``add`` post-op on a convolution (a residual of the output's
  shape), alone or followed by relu only (``_convolution_pointwise.binary`` refuses any
  other unary op after the add).
- cuda: a convolution runs through cuDNN without its bias, then ONE generated in-place
  epilogue kernel adds the bias and the residual and applies the activation
  (``backends/cuda/epilogue.py``), so every activation with scalar semantics
  (``OpDef.pointwise``) can follow, with or without a residual add. Linear: relu (cuBLASLt's epilogue through
  ``torch._addmm_activation``; its ``use_gelu=True`` is gelu with the tanh approximation,
  not listed since the table keys activations by name only).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..graph import Graph, Node
from ..hardware import Hardware
from ..ops import CATALOGUE, get_op
from .patterns import Readers, Rewrite, pairs


@dataclasses.dataclass(frozen=True)
class PostOps:
    """What one vendor call can fuse after a layer: activations on their own, and the
    activations allowed after a residual add (None: the add with no activation)."""

    activations: frozenset[str]
    after_residual: frozenset[str | None] = frozenset()


# the activations oneDNN fuses as eltwise post-ops, and those it takes after a binary
# (residual add) post-op: the registry entries' ``post_op``
_ONEDNN_ELTWISE = frozenset(name for name, op in CATALOGUE.items() if op.post_op is not None)
_ONEDNN_AFTER_ADD = frozenset(
    name for name, op in CATALOGUE.items() if op.post_op is not None and op.post_op.after_binary
)
# the activations a generated epilogue computes (their scalar semantics, OpDef.pointwise)
_GENERATED = frozenset(name for name, op in CATALOGUE.items() if op.pointwise is not None)
# the activations cuBLASLt's linear epilogue fuses
_CUBLASLT_EPILOGUE = frozenset(
    name for name, op in CATALOGUE.items() if op.post_op is not None and op.post_op.cublaslt
)

# (device kind, layer op) -> what its vendor call fuses.
POST_OPS: dict[tuple[str, str], PostOps] = {
    ("cpu", "conv2d"): PostOps(_ONEDNN_ELTWISE, frozenset({None}) | _ONEDNN_AFTER_ADD),
    ("cpu", "linear"): PostOps(_ONEDNN_ELTWISE),
    ("cuda", "conv2d"): PostOps(_GENERATED, frozenset({None}) | _GENERATED),
    ("cuda", "linear"): PostOps(_CUBLASLT_EPILOGUE),
}


def fuse_vendor_epilogue(graph: Graph, hardware: Hardware) -> Graph:
    """Fold the epilogue of each conv2d / linear into it: a per-channel bias add (a
    parameter of shape (C,), (C,1,1) or (1,C,1,1)), then a residual add (conv2d only; the
    residual becomes the conv's last input and ``residual=True``), then an activation
    (``activation``, ``activation_attrs`` attrs), each only where ``POST_OPS`` for
    ``hardware.kind`` offers it.

    Expects: layers without post-op attrs (this pass adds them); batch-norms already folded.
    Guarantees: the same outputs (``y = act(layer(x, w) + b + residual)``, the catalogue's
    reference semantics); a step is fused only when the value it reads has no reader but
    that step and is no graph output, and the residual is an activation of exactly the
    output's type (no broadcast); the fused node keeps the layer's name, writes the last
    fused node's output value and stands at its position (so the residual is computed
    before it). Activations the vendor does not fuse stay separate I/O-bound nodes.
    """
    readers = Readers(graph)
    rw = Rewrite(graph)
    taken: set[str] = set()  # nodes already absorbed into an earlier layer
    for layer in graph.nodes():
        table = POST_OPS.get((hardware.kind, layer.op))
        if table is None or any(k in layer.attrs for k in ("activation", "residual")):
            continue
        fused, last, absorbed = _epilogue(graph, readers, rw, layer, table, taken)
        if not absorbed:
            continue
        taken.update(n.name for n in absorbed)
        rw.drop(layer.name)
        for n in absorbed[:-1]:
            rw.drop(n.name)
        rw.replace(last.name, [(fused, [graph.values[last.outputs[0]]])])
    return rw.build()


def _epilogue(
    graph: Graph, readers: Readers, rw: Rewrite, layer: Node, table: PostOps, taken: set[str]
) -> tuple[Node, Node, list[Node]]:
    """The fused node, the last absorbed node and every absorbed node (in order)."""
    fused, absorbed = layer, []
    out = layer.outputs[0]
    if len(layer.outputs) != 1:
        return fused, layer, absorbed

    def sole(value: str) -> Node | None:
        n = readers.sole(value)
        return None if n is None or n.name in taken else n

    nxt = sole(out)
    # bias: add of a per-channel parameter
    if nxt is not None and _is_bias_add(graph, nxt, out, fused):
        fused = _with_bias(graph, rw, fused, nxt, out)
        absorbed.append(nxt)
        out = nxt.outputs[0]
        nxt = sole(out)
    # residual add, then only an activation the vendor allows after it
    if nxt is not None and layer.op == "conv2d" and table.after_residual:
        other = _residual_operand(graph, nxt, out)
        if other is not None:
            act = sole(nxt.outputs[0])
            act_name = None if act is None else _activation_name(act)
            with_act = act_name is not None and act_name in table.after_residual
            if not with_act and None not in table.after_residual:
                return _finish(fused, absorbed)  # the add stays, and so what follows it
            attrs = dict(fused.attrs, residual=True)
            fused = fused.replace(inputs=fused.inputs + (other,), attrs=attrs)
            absorbed.append(nxt)
            if not with_act:
                return _finish(fused, absorbed)
            nxt = act
    # activation
    allowed = table.after_residual if fused.attrs.get("residual") else table.activations
    name = None if nxt is None else _activation_name(nxt)
    if nxt is not None and name is not None and name in allowed:
        attrs = dict(fused.attrs, activation=nxt.op, activation_attrs=pairs(dict(nxt.attrs)))
        fused = fused.replace(attrs=attrs)
        absorbed.append(nxt)
    return _finish(fused, absorbed)


def _finish(fused: Node, absorbed: list[Node]) -> tuple[Node, Node, list[Node]]:
    if not absorbed:
        return fused, fused, absorbed
    last = absorbed[-1]
    sources = [fused.source] + [n.source for n in absorbed if n.source]
    return (
        fused.replace(outputs=last.outputs, source="+".join(dict.fromkeys(sources))),
        last,
        absorbed,
    )


def _activation_name(node: Node) -> str | None:
    """The op name when ``node`` is a one-input activation the tables may name."""
    if len(node.inputs) != 1:
        return None
    op = get_op(node.op)
    if op.pointwise is None and op.post_op is None:
        return None
    return node.op if op.post_op is None or op.post_op.takes(node.attrs) else None


def _plain_add(node: Node) -> bool:
    return (
        node.op == "add"
        and len(node.inputs) == 2
        and node.attrs.get("scalar") is None
        and node.attrs.get("alpha", 1) == 1
    )


def _is_bias_add(graph: Graph, node: Node, value: str, layer: Node) -> bool:
    if not _plain_add(node) or node.inputs[0] == node.inputs[1]:
        return False
    other = node.inputs[1] if node.inputs[0] == value else node.inputs[0]
    if other not in graph.params or not all(v in graph.params for v in layer.inputs[2:]):
        return False
    out_t, res_t = graph.values[value], graph.values[node.outputs[0]]
    if out_t != res_t:  # the add must not broadcast the layer's output
        return False
    c = out_t.shape[1] if layer.op == "conv2d" else out_t.shape[-1]
    shape = graph.params[other].shape
    if layer.op == "conv2d":
        return shape in ((c, 1, 1), (1, c, 1, 1))
    return shape in ((c,), (1, c))


def _with_bias(graph: Graph, rw: Rewrite, layer: Node, add: Node, value: str) -> Node:
    other = add.inputs[1] if add.inputs[0] == value else add.inputs[0]
    extra = graph.params[other].reshape(-1).astype(np.float64)
    dtype = graph.values[layer.inputs[1]].dtype
    old = graph.params[layer.inputs[2]] if len(layer.inputs) > 2 else np.zeros(len(extra))
    b = (old.astype(np.float64) + extra).astype(dtype)
    name = rw.add_param(f"{layer.name}.bias_add", b)
    return layer.replace(inputs=(layer.inputs[0], layer.inputs[1], name))


def _residual_operand(graph: Graph, add: Node, value: str) -> str | None:
    """The other operand of ``add(value, other)`` when it can be a residual post-op."""
    if not _plain_add(add) or add.inputs[0] == add.inputs[1]:
        return None
    other = add.inputs[1] if add.inputs[0] == value else add.inputs[0]
    if graph.values[other] != graph.values[value]:
        return None
    if graph.values[add.outputs[0]] != graph.values[value]:
        return None
    return other
