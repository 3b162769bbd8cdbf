"""classify: tag every node io / param / compute by a roofline rule.

A node's arithmetic intensity is its FLOPs (``OpDef.flops``) over the bytes it moves: its
inputs, its outputs and its weights (parameter inputs), from the value types. Against the
device's balance (``Hardware.balance`` = peak FLOP/s / memory bandwidth, FLOP per byte),
with a margin of :data:`MARGIN` either side of it:

- intensity >= balance * MARGIN: **compute** (arithmetic limits it);
- within the margin (balance / MARGIN <= intensity < balance * MARGIN), the measured balance
  cannot tell (it moves by more than that between runs and machines, and 1x1 convolutions
  sit right at it), so the op kind decides, the same way every time: a dense op
  (:func:`is_dense`: convolution with groups == 1, linear, matmul) is **compute**, as the
  vendor library's GEMM is never worse near the ridge; any other op takes the rule below;
- below, and weight bytes are more than half of its traffic: **param** (weight traffic
  limits it: fully connected layers and 1x1-spatial convolutions at small batch);
- otherwise: **io** (activation traffic limits it: depthwise convolution, pooling, ...).

Elementwise and view-like nodes do not use the rule for themselves (their intensity is
near zero, so it would make them io anyway) but join a neighbour:

- a view-like node (reshape, flatten, ...) takes its producer's class: a view of a
  vendor call's output costs nothing and stays with that call; a view inside an I/O chain
  stays in the chain;
- an elementwise node (activation, add, mul, batch-norm, ...) is io. If its producer is
  io it joins that group; if its producer is a vendor call (compute/param) that did not
  take it as a post-op (fuse_vendor_epilogue runs first), it stays io so that it fuses
  forward, depth-first, with the io nodes after it rather than being a separate step.
- fallback nodes are io (the framework runs them; they are their own group).

The rule is data: depthwise convolution (about 2 FLOP per byte for a 3x3 window) is io on
a machine whose balance is 3-10, a 3x3 64->64 convolution (over 100 FLOP per byte) is
compute, and the same node can change class with batch size or device.
"""

from __future__ import annotations

import dataclasses

from ..enums import Bound
from ..graph import Graph, Node
from ..hardware import Hardware
from ..ops import get_op

# How far (a factor) the balance is uncertain: measurements of one machine differ by up to
# ~2x under load, and between runs the median still moves by 10-20%.
MARGIN = 1.25
# Ops that are one dense GEMM-like vendor call (conv2d also needs groups == 1).
DENSE_OPS = frozenset({"linear", "matmul"})


def is_dense(node: Node) -> bool:
    """A dense convolution, linear or matmul: the kinds that go to the vendor in the band
    around the balance."""
    if node.op == "conv2d":
        return int(node.attrs.get("groups", 1)) == 1
    return node.op in DENSE_OPS


@dataclasses.dataclass(frozen=True)
class Roofline:
    """One node's place on the roofline: FLOPs, bytes of activations and of weights."""

    flops: float
    act_bytes: int
    weight_bytes: int

    @property
    def bytes(self) -> int:
        return self.act_bytes + self.weight_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    def bound(self, balance: float, dense: bool = False) -> Bound:
        """The class against ``balance`` (see the module docstring; ``dense``: the op kind
        that is compute within the margin)."""
        if self.intensity >= balance * MARGIN:
            return Bound.COMPUTE
        if dense and self.intensity >= balance / MARGIN:
            return Bound.COMPUTE
        if self.weight_bytes * 2 > self.bytes:
            return Bound.PARAM
        return Bound.IO


def roofline(graph: Graph, node: Node) -> Roofline:
    """FLOPs and bytes moved of ``node`` (each distinct input value counted once)."""
    ins = [graph.values[v] for v in node.inputs]
    outs = [graph.values[v] for v in node.outputs]
    flops = get_op(node.op).flops(node, ins, outs)
    act = weight = 0
    for v in dict.fromkeys(node.inputs):
        if v in graph.params:
            weight += graph.values[v].nbytes
        else:
            act += graph.values[v].nbytes
    act += sum(t.nbytes for t in outs)
    return Roofline(flops, act, weight)


def node_bound(graph: Graph, node: Node, balance: float) -> Bound:
    """The class of ``node`` by the roofline rule alone (no neighbour rule)."""
    return roofline(graph, node).bound(balance, is_dense(node))


def classify(graph: Graph, hardware: Hardware) -> Graph:
    """Set ``bound`` ("io" / "param" / "compute") on every node (see the module docstring).

    Expects: any graph; ``hardware.balance`` > 0.
    Guarantees: a new graph with the same nodes, values and order; every node's ``bound``
    is set; nothing else changes.
    """
    out = graph.copy()
    bound_of: dict[str, Bound] = {}
    for n in graph.nodes():
        op = get_op(n.op)
        if n.op == "fallback":
            b = Bound.IO
        elif op.view_like:
            b = _producer_bound(graph, n, bound_of)
        elif op.elementwise:
            b = Bound.IO
        else:
            b = node_bound(graph, n, hardware.balance)
        bound_of[n.name] = b
        out.replace_node(n.name, n.replace(bound=b))
    return out


def _producer_bound(graph: Graph, node: Node, bound_of: dict[str, Bound]) -> Bound:
    """The class of the producer of ``node``'s first input; io for graph inputs/params."""
    p = graph.producer(node.inputs[0]) if node.inputs else None
    if p is None or p.op == "fallback":
        return Bound.IO
    return bound_of[p.name]
