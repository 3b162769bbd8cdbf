"""The unit the CUDA renderer works on: one I/O-bound group of a graph, with its boundary.

A :class:`KernelGroup` names the group's nodes (in topological order), the values it reads
from outside (activations and parameters), and the values it must write to memory (read
outside the group, or outputs of the graph). Everything else stays inside the kernel:
intermediates are never materialised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from ...graph import Graph, Node, TensorType


@dataclasses.dataclass(frozen=True)
class KernelGroup:
    """One fused group: ``nodes`` in topological order, ``inputs`` read from memory,
    ``outputs`` written to memory, and the type of every value involved."""

    name: str
    nodes: tuple[Node, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    types: Mapping[str, TensorType]

    def producer(self, value: str) -> Node | None:
        for n in self.nodes:
            if value in n.outputs:
                return n
        return None

    def describe(self) -> str:
        """One line per layer: what the generated kernel computes (for its header comment)."""
        lines = []
        for n in self.nodes:
            outs = ", ".join(f"{v}: {self.types[v]}" for v in n.outputs)
            src = f"  ({n.source})" if n.source else ""
            lines.append(f"{outs} = {n.op}({', '.join(n.inputs)}){src}")
        return "\n".join(lines)


def group_from_nodes(graph: Graph, node_names: Iterable[str], name: str = "") -> KernelGroup:
    """The :class:`KernelGroup` of ``node_names`` in ``graph``.

    Expects the names of connected nodes of the graph; they are put in the graph's
    topological order. Outputs are the group's values that a node outside the group or the
    graph's output structure reads; inputs are the values its nodes read that no node of
    the group produces, in first-read order.
    """
    wanted = set(node_names)
    nodes = tuple(n for n in graph.nodes() if n.name in wanted)
    if len(nodes) != len(wanted):
        missing = wanted - {n.name for n in nodes}
        raise ValueError(f"nodes not in the graph: {sorted(missing)}")
    produced = {v for n in nodes for v in n.outputs}
    inputs: list[str] = []
    for n in nodes:
        for v in n.inputs:
            if v not in produced and v not in inputs:
                inputs.append(v)
    graph_outs = set(graph.output_values())
    outputs = []
    for n in nodes:
        for v in n.outputs:
            outside = any(c.name not in wanted for c in graph.consumers(v))
            if outside or v in graph_outs:
                outputs.append(v)
    types = {v: graph.values[v] for v in (*inputs, *produced)}
    label = name or "_".join(dict.fromkeys(n.op for n in nodes))
    return KernelGroup(label, nodes, tuple(inputs), tuple(outputs), types)
