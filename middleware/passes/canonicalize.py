"""canonicalize: drop inference no-ops, fold constant subgraphs, remove dead nodes."""

from __future__ import annotations

import numpy as np
import torch

from ..graph import PARAM_SOURCES, TRAINING, Graph, Node
from ..ops import get_op, torch_dtype
from .patterns import Rewrite

# Always the identity in inference.
NO_OPS = ("identity", "dropout")
# Ops that return (a view of) their input with the same data when the output type equals the
# input type. Not ``permute``: a transpose of a square tensor keeps the type and moves the
# data (see ``is_order_preserving_permute``).
SAME_TYPE_NO_OPS = ("reshape", "flatten")
# A folded constant may not grow the parameters by more than this (bytes) beyond the size of
# the constants it reads: folding must not materialise a large broadcast.
FOLD_GROWTH_LIMIT = 1 << 20


def canonicalize(graph: Graph) -> Graph:
    """Drop inference no-ops, fold constant subgraphs and remove dead nodes.

    Expects: any graph from the frontend or an earlier pass.
    Guarantees: the same outputs for every input (reference interpreter); no ``identity``
    or ``dropout`` node; no ``reshape``/``flatten`` whose output type equals its input type;
    no ``permute`` that keeps the order of the elements (it moves size-1 dims only); no
    single-input ``cat``; no ``contiguous`` on data that is already contiguous (kept after
    ``permute``/``split`` and on channels_last values); no node other than a fallback whose
    inputs are all parameters (it became a parameter, unless that would add more than
    ``FOLD_GROWTH_LIMIT`` bytes); every node's outputs are read by a node or are graph
    outputs. Fallback nodes are treated as pure (inference) and dropped when unread.
    """
    rw = Rewrite(graph)
    folded: dict[str, torch.Tensor] = {}  # value -> constant, for chains of constant nodes
    for n in graph.nodes():
        if _is_no_op(graph, n):
            rw.drop(n.name)
            rw.alias(n.outputs[0], rw.resolve(n.inputs[0]))
            continue
        ins = [rw.resolve(v) for v in n.inputs]
        if (
            n.op != "fallback"
            and ins
            and all(v in graph.params or v in folded for v in ins)
            and not _cuts_a_gradient(graph, ins)
        ):
            values = _fold(graph, n, ins, folded)
            if values is not None:
                rw.drop(n.name)
                for v, t in zip(n.outputs, values, strict=True):
                    folded[v] = t
                    rw.new_param_as(v, t.numpy(), graph.values[v].layout)
    return remove_dead(rw.build())


def _cuts_a_gradient(graph: Graph, ins: list[str]) -> bool:
    """In a training graph, folding a node that reads one of the model's own parameters or
    buffers could turn a parameter that needs a gradient into a constant that has none (the
    frontend keeps detached tensors, so every one of them is left unfolded)."""
    if not graph.meta.get(TRAINING):
        return False
    sources = graph.meta.get(PARAM_SOURCES, {})
    return any(v in sources for v in ins)


def _is_no_op(graph: Graph, n: Node) -> bool:
    if len(n.inputs) != 1 or len(n.outputs) != 1:
        return False
    src, dst = graph.values[n.inputs[0]], graph.values[n.outputs[0]]
    if n.op in NO_OPS:
        return True
    if n.op in SAME_TYPE_NO_OPS:
        return src == dst
    if n.op == "permute":
        return src == dst and is_order_preserving_permute(src.shape, n.attrs["dims"])
    if n.op == "cat":
        return src == dst
    if n.op == "contiguous":
        return src == dst and is_contiguous(graph, n.inputs[0])
    return False


def is_order_preserving_permute(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    """Whether permuting ``shape`` by ``dims`` leaves every element at its row-major position:
    the dims of size > 1 keep their relative order (only size-1 dims move). An equal output
    type is not enough: ``transpose(0, 1)`` of a square matrix keeps the type."""
    moved = [d for d in dims if shape[d] != 1]
    return moved == sorted(moved)


def is_contiguous(graph: Graph, value: str) -> bool:
    """Whether ``value`` is laid out contiguously (row-major) when the framework runs the
    graph: False after a permute or a split off dim 0 (views with strides), and for
    channels_last values; views of those inherit it; anything computed is contiguous."""
    if graph.values[value].layout != "nchw":
        return False
    p = graph.producer(value)
    while p is not None:
        if p.op == "permute" and tuple(p.attrs["dims"]) != tuple(range(len(p.attrs["dims"]))):
            return False
        if p.op == "split" and p.attrs["dim"] != 0:
            return False
        if p.op in ("reshape", "flatten", "identity", "dropout", "permute", "split"):
            p = graph.producer(p.inputs[0])
            continue
        return True
    return True


def _fold(
    graph: Graph, n: Node, ins: list[str], folded: dict[str, torch.Tensor]
) -> list[torch.Tensor] | None:
    """Evaluate ``n`` on its constant inputs with the reference implementation; None when
    the result cannot be a parameter (dtype numpy lacks, or too large)."""
    out_types = [graph.values[v] for v in n.outputs]
    if any(t.dtype == "bfloat16" for t in out_types):
        return None
    in_bytes = sum(graph.values[v].nbytes for v in ins)
    if sum(t.nbytes for t in out_types) > in_bytes + FOLD_GROWTH_LIMIT:
        return None
    args = [
        folded[v] if v in folded else torch.from_numpy(np.ascontiguousarray(graph.params[v]))
        for v in ins
    ]
    with torch.no_grad():
        out = get_op(n.op).bind(n)(*args)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [
        o.detach().to(torch_dtype(t.dtype)).contiguous().clone()
        for o, t in zip(outs, out_types, strict=True)
    ]


def remove_dead(graph: Graph) -> Graph:
    """``graph`` less every node none of whose outputs is read (by a live node or the graph
    outputs). Returns ``graph`` itself when nothing is dead."""
    live_values = set(graph.output_values())
    dead: list[str] = []
    for n in reversed(list(graph.nodes())):
        if any(v in live_values for v in n.outputs):
            live_values.update(n.inputs)
        else:
            dead.append(n.name)
    if not dead:
        return graph
    rw = Rewrite(graph)
    for name in dead:
        rw.drop(name)
    return rw.build()
