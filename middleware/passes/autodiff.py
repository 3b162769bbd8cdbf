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
operand's gradient is a sum over the broadcast dims. The sum is put off to the end: a
gradient flowing back is kept *expanded* (a tensor of a broadcast shape whose sum down to
the value's shape is the true gradient), which every elementwise rule passes on as it is,
because the local derivative of an elementwise op of a broadcast operand is constant along
the broadcast dims (``sum(G) * f'(x) == sum(G * f'(x))``). Only the group inputs' gradients
are summed, by the caller (``Gradient.sum_to``; a reduction the generators do not
produce). Two gradients of one value in different broadcast shapes cannot be added so.

Expects: ``nodes`` in topological order, each output of one of them read only inside the
group but ``output``. Guarantees: every gradient graph's output is the input's gradient,
or has a broadcast shape whose sum down to ``Gradient.sum_to`` is. Raises
:class:`~middleware.loops.NotFusable` with the reason where a node has no backward rule or
two gradients of one value have different broadcast shapes: such a group keeps a
recomputing backward through the framework.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..graph import Graph, Node, TensorType
from ..loops import NotFusable
from ..ops import CATALOGUE, infer_types


@dataclasses.dataclass(frozen=True)
class Gradient:
    """One group input's gradient: ``graph`` computes ``value`` (its one output) from
    ``graph.inputs`` (group inputs and the output gradient), summed to ``sum_to`` where
    not None. ``nodes``: the graph's nodes in order; empty where ``value`` is an input of
    it (the output's gradient itself, an add's operand)."""

    input: str
    value: str
    graph: Graph
    nodes: tuple[str, ...]
    sum_to: tuple[int, ...] | None


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
            parts.setdefault(v, []).append(g)
    gradients: list[Gradient | None] = []
    for v in inputs:
        got = parts.get(v)
        if not got:
            gradients.append(None)
            continue
        e.prefix = f"d_{v}"
        g = _accumulate(e, _same_shape(full, v, got))
        shape = full.values[v].shape
        sum_to = None if full.values[g].shape == shape else tuple(shape)
        sub, names = _prune(full, g)
        gradients.append(Gradient(v, g, sub, names, sum_to))
    return Backward(grad_out, tuple(gradients))


def _same_shape(full: Graph, v: str, parts: list[str]) -> list[str]:
    """``parts`` (gradients of ``v``, each summed down to ``v``'s shape in exact terms)
    where they can be added as they are: all of one shape."""
    if len({full.values[g].shape for g in parts}) > 1:
        shapes = ", ".join(str(full.values[g].shape) for g in parts)
        raise NotFusable(
            f"the gradients reaching {v} have different broadcast shapes ({shapes}): "
            "adding them needs a reduction inside the group"
        )
    return parts


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
