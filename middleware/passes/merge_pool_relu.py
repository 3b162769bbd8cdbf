"""merge_pool_relu: a monotone activation next to a max-pooling becomes one ``maxpool_relu``.

For a monotone non-decreasing ``act`` and any non-empty window ``S``,
``act(max(S)) == max(act(S))``. Max-pooling pads with -inf, and the framework never lets a
window consist of padding only, so the identity holds for every window, stride, padding,
dilation and ceil_mode: ``act(maxpool(x)) == maxpool(act(x))`` exactly. With NaN too:
max-pooling and every merged activation propagate a NaN (PyTorch's semantics). Not for a
leaky_relu of slope 0: it maps -inf to NaN (-inf * 0), which a max over the window's other
elements would hide.
"""

from __future__ import annotations

from collections.abc import Callable

from ..graph import Graph, Node
from ..ops import get_op
from .patterns import Readers, Rewrite, pairs


def is_monotone(node: Node) -> bool:
    """Whether ``node`` is a monotone non-decreasing activation that commutes with a max
    (the registry's ``OpDef.is_monotone`` for its attrs: a leaky_relu only with a positive
    slope, see the module docstring; a hardtanh only with min_val <= max_val)."""
    return len(node.inputs) == 1 and get_op(node.op).is_monotone(node.attrs)


def _act_before(graph: Graph, readers: Readers, pool: Node) -> tuple[Node, str] | None:
    """``maxpool(act(x))`` where only the pool reads act's output: (act, x)."""
    act = graph.producer(pool.inputs[0])
    if act is None or not is_monotone(act) or readers.sole(act.outputs[0]) is not pool:
        return None
    return act, act.inputs[0]


def _act_after(graph: Graph, readers: Readers, pool: Node) -> tuple[Node, str] | None:
    """``act(maxpool(x))`` where only act reads the pool's output: (act, x)."""
    act = readers.sole(pool.outputs[0])
    if act is None or not is_monotone(act):
        return None
    return act, pool.inputs[0]


# The patterns, tried in order for each max_pool2d: (name, matcher). A matcher returns the
# activation node and the value the merged node reads.
Matcher = Callable[[Graph, Readers, Node], "tuple[Node, str] | None"]
PATTERNS: list[tuple[str, Matcher]] = [
    ("activation_then_maxpool", _act_before),
    ("maxpool_then_activation", _act_after),
]


def merge_pool_relu(graph: Graph) -> Graph:
    """Merge a monotone activation directly before or after a ``max_pool2d`` into one
    ``maxpool_relu`` node (the max_pool2d attrs plus ``activation``, the activation's op
    name, and ``activation_attrs``, its attrs as sorted (key, value) pairs).

    Expects: ``max_pool2d`` nodes with the catalogue's attrs.
    Guarantees: the same outputs (exactly, see the module docstring); a merge happens only
    when the intermediate value (between activation and pooling) has no other reader and is
    no graph output; each activation is merged at most once. The merged node writes the
    value of the later of the two nodes, at its position.
    """
    readers = Readers(graph)
    rw = Rewrite(graph)
    taken: set[str] = set()
    for pool in graph.nodes():
        if pool.op != "max_pool2d" or pool.name in taken:
            continue
        for _, match in PATTERNS:
            found = match(graph, readers, pool)
            if found is None or found[0].name in taken:
                continue
            act, x = found
            later = pool if act is graph.producer(pool.inputs[0]) else act
            attrs = dict(pool.attrs)
            attrs["activation"] = act.op
            attrs["activation_attrs"] = pairs(dict(act.attrs))
            merged = pool.replace(
                op="maxpool_relu",
                inputs=(x,),
                outputs=later.outputs,
                attrs=attrs,
                source=_join(pool.source, act.source),
            )
            earlier = act if later is pool else pool
            rw.drop(earlier.name)
            rw.replace(later.name, [(merged, [graph.values[later.outputs[0]]])])
            taken.update((pool.name, act.name))
            break
    return rw.build()


def _join(a: str, b: str) -> str:
    return a if not b or b == a else f"{a}+{b}"
