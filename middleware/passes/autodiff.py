"""Backward graphs of io groups, from the op registry's backward rules (training plans).

``differentiate(graph, nodes, inputs, output)`` takes a group of ``graph`` (the node names
of a generated io group, its input values and its one output value) and returns a
:class:`Backward`: for each group input, a small graph whose one output is that input's
gradient. Each such graph reads only the group's inputs and the output's gradient
(``grad_<output>``): it recomputes the forward nodes it needs (the same nodes, by name),
then the gradient nodes the registry's rules emit (``OpDef.grad``: forward ops such as
``add``, ``mul``, ``div`` and ``pointwise_grad``, whose loop semantics are the
activation's backward formula). So a backward graph is an io group like any other: the
code generators schedule it depth-first, recomputing the intermediates inside their tiles
instead of reading stored ones.

Broadcasting: where a node broadcast an operand (a per-channel gate times a map), the
operand's gradient is a sum over the broadcast dims; where a node reduced its input (a
spatial mean), the input's gradient is the same along the reduced dims. Both are put off
to the end: a gradient flowing back is kept in *broadcast form* (a tensor whose shape
broadcasts against the value's: broadcast to both and summed down to the value's shape,
it is the true gradient, :func:`fit`). Every elementwise rule passes that form on as it
is, because the local derivative of an elementwise op is constant along the dims its
operand was broadcast over (``sum(G) * f'(x) == sum(G * f'(x))``); a rule that needs the
exact gradient (a view, a reduction) refuses another form. Only the group inputs'
gradients are fitted, by the caller (``Gradient.fit_to``: an expand and a sum the
generators do not produce). Two gradients of one value that disagree along a dim it is
summed over cannot be added so.

Expects: ``nodes`` in topological order, each output of one of them read only inside the
group but ``output``. Guarantees: every gradient graph's output is the input's gradient,
or its broadcast form (``Gradient.fit_to``). Raises
:class:`~middleware.loops.NotFusable` with the reason where a node has no backward rule or
two gradients of one value have different broadcast shapes: such a group keeps a
recomputing backward through the framework.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..graph import Graph, Node, TensorType
from ..loops import NotFusable
from ..ops import CATALOGUE, infer_types


@dataclasses.dataclass(frozen=True)
class Gradient:
    """One group input's gradient: ``graph`` computes ``value`` (its one output) from
    ``graph.inputs`` (group inputs and the output gradient), in broadcast form where
    ``fit_to`` (the input's shape) is not None: broadcast against ``fit_to`` and summed
    down to it (:func:`fit`). ``nodes``: the graph's nodes in order; empty where ``value``
    is an input of it (the output's gradient itself, an add's operand)."""

    input: str
    value: str
    graph: Graph
    nodes: tuple[str, ...]
    fit_to: tuple[int, ...] | None


@dataclasses.dataclass(frozen=True)
class Backward:
    """The group's backward: ``grad_output`` names the output gradient's value; one
    :class:`Gradient` per group input, in the group's input order (None: no gradient
    reaches that input)."""

    grad_output: str
    gradients: tuple[Gradient | None, ...]


class _Emitter:
    """The registry rules' :class:`~middleware.op_registry.GradEmitter` over a graph."""

    def __init__(self, graph: Graph, prefix: str, group: int | None) -> None:
        self.graph = graph
        self.prefix = prefix
        self.group = group  # the forward group's id: kernel names say whose backward

    def type_of(self, value: str) -> TensorType:
        return self.graph.values[value]

    def emit(self, op: str, inputs: Sequence[str], attrs: Mapping[str, Any] | None = None) -> str:
        name = self.graph.fresh_name(f"{self.prefix}_{op}")
        out = self.graph.fresh_name(f"{name}_out")
        node = Node(name, op, tuple(inputs), (out,), dict(attrs or {}), group=self.group)
        (t,) = infer_types(self.graph.values, node)
        self.graph.add_node(node, [t])
        return out


def _accumulate(e: _Emitter, parts: list[str]) -> str:
    total = parts[0]
    for p in parts[1:]:
        total = e.emit("add", (total, p))
    return total


def differentiate(
    graph: Graph, nodes: Sequence[str], inputs: Sequence[str], output: str
) -> Backward:
    """The backward of the group ``nodes`` of ``graph`` (module docstring)."""
    full = Graph()
    for v in inputs:
        full.add_input(v, graph.values[v])
    grad_out = full.fresh_name(f"grad_{output}")
    full.add_input(grad_out, graph.values[output])
    for n in nodes:
        node = graph.node(n)
        for v in node.inputs:
            if v not in full.values:
                if v not in graph.params:
                    raise NotFusable(f"{n} reads {v}, neither a group input nor a constant")
                full.add_param(v, graph.params[v], graph.values[v].layout)
        full.add_node(
            Node(
                node.name,
                node.op,
                node.inputs,
                node.outputs,
                node.attrs,
                group=node.group,
                source=node.source,
            ),
            [graph.values[v] for v in node.outputs],
        )
    e = _Emitter(full, "d", graph.node(nodes[0]).group)
    parts: dict[str, list[str]] = {output: [grad_out]}
    for n in reversed(nodes):
        node = graph.node(n)
        (y,) = node.outputs
        if y not in parts:
            continue
        rule = CATALOGUE[node.op].grad
        if rule is None:
            raise NotFusable(f"op {node.op} has no backward rule")
        gy = _accumulate(e, _same_shape(full, y, parts.pop(y)))
        e.prefix = f"d_{n}"
        got = rule(e, node, gy)
        if len(got) != len(node.inputs):
            raise NotFusable(f"{node.op}'s backward rule gave {len(got)} gradients")
        for v, g in zip(node.inputs, got, strict=True):
            if g is None or v in graph.params and v not in inputs:
                continue
            parts.setdefault(v, []).append(_summed_extent(e, full, node, g, v))
    gradients: list[Gradient | None] = []
    for v in inputs:
        got = parts.get(v)
        if not got:
            gradients.append(None)
            continue
        e.prefix = f"d_{v}"
        g = _accumulate(e, _same_shape(full, v, got))
        shape = full.values[v].shape
        fit_to = None if full.values[g].shape == shape else tuple(shape)
        sub, names = _prune(full, g)
        gradients.append(Gradient(v, g, sub, names, fit_to))
    return Backward(grad_out, tuple(gradients))


def _summed_extent(e: _Emitter, full: Graph, node: Node, g: str, v: str) -> str:
    """Operand ``v``'s gradient ``g`` from a broadcasting elementwise ``node``, in broadcast
    form relative to ``v`` itself. A form of size 1 along a dim where the node's output is
    ``n`` long and ``v`` was broadcast (size 1) stands for ``n`` equal values of the
    output's gradient, all of which sum into ``v``: fitted to ``v``'s shape it would give
    one of them. Scaled by those lengths here (``x1`` of ``mean(x0 + x1)`` over the
    spatial dims, ``x1`` one value per channel: its gradient is ``gy``, not ``gy / HW``)."""
    shapes = [full.values[x].shape for x in node.inputs]
    (y,) = node.outputs
    out = tuple(full.values[y].shape)
    try:
        elementwise = tuple(torch.broadcast_shapes(*shapes)) == out
    except RuntimeError:
        elementwise = False
    if not elementwise:  # a view or a reduction: its rule gives the exact form
        return g
    rank = len(out)

    def padded(s: Sequence[int]) -> tuple[int, ...]:
        return (1,) * (rank - len(s)) + tuple(s)

    gs, vs = padded(full.values[g].shape), padded(full.values[v].shape)
    if len(gs) != rank:
        return g
    n = 1
    for d in range(rank):
        if gs[d] == 1 and vs[d] == 1 and out[d] > 1:
            n *= out[d]
    return g if n == 1 else e.emit("mul", (g,), {"scalar": float(n)})


def _same_shape(full: Graph, v: str, parts: list[str]) -> list[str]:
    """``parts`` (gradients of ``v`` in broadcast form) where adding them with broadcasting
    gives the broadcast form of their sum: along every dim where ``v`` has size 1 (a dim a
    part may have to be summed over) the parts agree in size; along ``v``'s other dims a
    part of size 1 is constant there, and broadcasting repeats it as it should."""
    shapes = [full.values[g].shape for g in parts]
    rank = max(len(s) for s in (*shapes, full.values[v].shape))

    def padded(s: tuple[int, ...]) -> tuple[int, ...]:
        return (1,) * (rank - len(s)) + tuple(s)

    own = padded(full.values[v].shape)
    for d in range(rank):
        if own[d] == 1 and len({padded(s)[d] for s in shapes}) > 1:
            raise NotFusable(
                f"the gradients reaching {v} have different broadcast shapes "
                f"({', '.join(map(str, shapes))}): adding them needs a reduction inside the group"
            )
    return parts


def fit(g: torch.Tensor, shape: Sequence[int] | None) -> torch.Tensor:
    """A gradient in broadcast form made the gradient of a value of ``shape``: broadcast to
    both shapes (a view), then summed down to ``shape``."""
    if shape is None or tuple(g.shape) == tuple(shape):
        return g
    full = torch.broadcast_shapes(g.shape, tuple(shape))
    if tuple(g.shape) != tuple(full):
        g = g.expand(full)
    return g if tuple(full) == tuple(shape) else g.sum_to_size(tuple(shape))


def _prune(full: Graph, value: str) -> tuple[Graph, tuple[str, ...]]:
    """The part of ``full`` that computes ``value``, as a graph whose output it is."""
    needed: set[str] = set()
    todo = [value]
    while todo:
        p = full.producer(todo.pop())
        if p is None or p.name in needed:
            continue
        needed.add(p.name)
        todo += list(p.inputs)
    kept = [n for n in full.nodes() if n.name in needed]
    read = {v for n in kept for v in n.inputs} | {value}
    sub = Graph()
    for v in full.inputs:
        if v in read:
            sub.add_input(v, full.values[v])
    for v, arr in full.params.items():
        if v in read:
            sub.add_param(v, arr, full.values[v].layout)
    for n in kept:
        sub.add_node(n, [full.values[v] for v in n.outputs])
    sub.set_outputs(value)
    return sub, tuple(n.name for n in kept)
