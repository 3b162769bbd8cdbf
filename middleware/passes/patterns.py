"""What the rewrite passes share: who reads a value, and one builder for the rewritten graph.

A pass reads the old graph, records its edits in a :class:`Rewrite` (replace a node by
other nodes at its position, drop a node, let readers of one value read another, add a
parameter) and builds the new graph once. The old graph is never touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..graph import Graph, Node, TensorType, flatten_tree, map_tree


class Readers:
    """Who reads each value of ``graph``, counted once per read (a node reading a value
    twice counts twice; each appearance in the graph outputs counts once)."""

    def __init__(self, graph: Graph) -> None:
        self.count: dict[str, int] = {}
        self.nodes: dict[str, list[Node]] = {}
        for n in graph.nodes():
            for v in n.inputs:
                self.count[v] = self.count.get(v, 0) + 1
                lst = self.nodes.setdefault(v, [])
                if not lst or lst[-1] is not n:
                    lst.append(n)
        self.outputs = set(flatten_tree(graph.output_tree))
        for v in flatten_tree(graph.output_tree):
            self.count[v] = self.count.get(v, 0) + 1

    def of(self, value: str) -> list[Node]:
        """The distinct nodes reading ``value``, in graph order."""
        return self.nodes.get(value, [])

    def sole(self, value: str) -> Node | None:
        """The one node reading ``value`` (once), when nothing else reads it and it is not a
        graph output; otherwise None."""
        if self.count.get(value, 0) != 1:
            return None
        readers = self.nodes.get(value, [])
        return readers[0] if len(readers) == 1 else None

    def only_by(self, value: str, node: Node) -> bool:
        """Every read of ``value`` is by ``node`` (any number of times), none by the outputs."""
        readers = self.nodes.get(value, [])
        return value not in self.outputs and len(readers) == 1 and readers[0] is node


def pairs(attrs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """Attributes as a sorted tuple of (key, value) pairs (hashable, printable)."""
    return tuple(sorted(attrs.items()))


class Rewrite:
    """The edits of one pass over ``graph``; :meth:`build` makes the new graph.

    Edits refer to nodes of the old graph by name. New nodes are given with their output
    types; inputs of every emitted node and the graph outputs are renamed through
    :meth:`alias` (transitively).
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self._at: dict[str, list[tuple[Node, Sequence[TensorType]]]] = {}
        self._alias: dict[str, str] = {}
        self._new_params: dict[str, tuple[np.ndarray, str]] = {}
        self._taken: set[str] = set()

    # -- names -----------------------------------------------------------------
    def fresh(self, base: str) -> str:
        """A value or node name unused in the old graph and by this rewrite so far."""
        name = base
        i = 0
        while name in self._taken or self.graph.fresh_name(name) != name:
            i += 1
            name = f"{base}_{i}"
        self._taken.add(name)
        return name

    # -- edits -----------------------------------------------------------------
    def replace(self, name: str, nodes: Sequence[tuple[Node, Sequence[TensorType]]]) -> None:
        """Emit ``nodes`` (in order) where old node ``name`` stood, instead of it."""
        self._at[name] = list(nodes)

    def drop(self, name: str) -> None:
        """Remove old node ``name`` (its outputs must be aliased or unread)."""
        self._at[name] = []

    def is_edited(self, name: str) -> bool:
        return name in self._at

    def alias(self, value: str, to: str) -> None:
        """Readers of ``value`` (nodes and graph outputs) read ``to`` instead."""
        self._alias[value] = to

    def resolve(self, value: str) -> str:
        seen = 0
        while value in self._alias:
            value = self._alias[value]
            seen += 1
            if seen > len(self._alias):
                raise ValueError(f"alias cycle at {value!r}")
        return value

    def add_param(self, base: str, array: np.ndarray, layout: str = "nchw") -> str:
        """A new parameter holding ``array``; returns its name."""
        name = self.fresh(base)
        self._new_params[name] = (np.ascontiguousarray(array), layout)
        return name

    def new_param_as(self, name: str, array: np.ndarray, layout: str = "nchw") -> None:
        """A new parameter named exactly ``name`` (a value of the old graph whose producer
        this rewrite drops, e.g. a folded constant)."""
        self._new_params[name] = (np.ascontiguousarray(array), layout)
        self._taken.add(name)

    # -- building --------------------------------------------------------------
    def build(self) -> Graph:
        """The rewritten graph: same inputs and output structure; params nobody reads are
        dropped; nodes in the old order with the edits applied at their positions."""
        old = self.graph
        emitted: list[tuple[Node, Sequence[TensorType]]] = []
        for n in old.nodes():
            items = self._at.get(n.name)
            if items is None:
                items = [(n, [old.values[v] for v in n.outputs])]
            for node, types in items:
                ins = tuple(self.resolve(v) for v in node.inputs)
                if ins != node.inputs:
                    node = node.replace(inputs=ins)
                emitted.append((node, types))
        out_tree = map_tree(old.output_tree, self.resolve)
        read = {v for n, _ in emitted for v in n.inputs} | set(flatten_tree(out_tree))
        g = Graph()
        g.meta = {k: v for k, v in old.meta.items() if not k.startswith("_")}
        for v in old.inputs:
            g.add_input(v, old.values[v])
        for p, arr in old.params.items():
            if p in read and p not in self._new_params:
                g.add_param(p, arr, old.values[p].layout)
        for p, (arr, layout) in self._new_params.items():
            if p in read:
                g.add_param(p, arr, layout)
        for node, types in emitted:
            g.add_node(node, types)
        g.set_outputs(out_tree)
        return g


class Definition:
    """The nodes that compute node ``n``'s output as its definition over registry ops (a
    decomposition: LayerNorm, softmax). Each :meth:`emit` adds one node named after ``n``
    and the op, carrying ``n``'s ``source``; :meth:`nodes` gives them with the last one
    writing ``n``'s own output value, ready for ``Rewrite.replace``."""

    def __init__(self, rw: Rewrite, n: Node) -> None:
        self.rw, self.n = rw, n
        self._nodes: list[tuple[Node, list[TensorType]]] = []

    def emit(self, op: str, inputs: tuple[str, ...], t: TensorType, **attrs: object) -> str:
        """A node ``op(inputs)`` of output type ``t``; returns its output value's name."""
        name = self.rw.fresh(f"{self.n.name}_{op}")
        self._nodes.append((Node(name, op, inputs, (name,), attrs, source=self.n.source), [t]))
        return name

    def nodes(self) -> list[tuple[Node, list[TensorType]]]:
        last, types = self._nodes[-1]
        return [*self._nodes[:-1], (last.replace(outputs=self.n.outputs), types)]
