"""pool_before_concat: pooling of a channel concat becomes a concat of pooled parts."""

from __future__ import annotations

from ..graph import Graph, Node
from ..ops import infer_types
from .patterns import Readers, Rewrite

# Pooling ops that work on each channel on its own (so they commute with a channel concat):
# any window, stride, padding, dilation, ceil_mode, count_include_pad, divisor_override.
CHANNEL_WISE_POOLS = (
    "max_pool2d",
    "avg_pool2d",
    "adaptive_avg_pool2d",
    "adaptive_max_pool2d",
    "maxpool_relu",
)


def pool_before_concat(graph: Graph, shared: bool = False) -> Graph:
    """Rewrite ``pool(cat([a, b, ...], dim=1))`` as ``cat([pool(a), pool(b), ...], dim=1)``.

    Expects: 4-d (N, C, H, W) values; pooling ops of ``CHANNEL_WISE_POOLS``.
    Guarantees: the same outputs (each output channel is computed from the same input
    channel by the same arithmetic). By default it applies where every reader of the
    concat is one of these pooling ops and the concat is no graph output, so the concat
    disappears and a smaller one (of pooled parts) takes the place of each pooling. A
    concat that other ops read as well (googlenet's and inception_v3's branch poolings of a
    block input) is left alone: the concat stays for its other readers, so moving the
    pooling would add a concat and a second read of the parts, where a depth-first group
    of {concat, pooling} already reads the parts once. ``shared=True`` moves those too.
    Runs to a fixed point (a moved pooling moves again through an inner concat).
    """
    current = graph
    while True:
        new = _one_round(current, shared)
        if new is current:
            return current if current is not graph else graph.copy()
        current = new


def _channel_cat(graph: Graph, cat: Node | None) -> bool:
    return (
        cat is not None
        and cat.op == "cat"
        and cat.attrs["dim"] == 1
        and graph.values[cat.outputs[0]].rank == 4
    )


def _one_round(graph: Graph, shared: bool) -> Graph:
    readers = Readers(graph)
    rw = Rewrite(graph)
    types = dict(graph.values)
    changed = False
    for pool in graph.nodes():
        if pool.op not in CHANNEL_WISE_POOLS:
            continue
        cat = graph.producer(pool.inputs[0])
        if cat is None or not _channel_cat(graph, cat):
            continue
        out = cat.outputs[0]
        only_pools = out not in readers.outputs and all(
            r.op in CHANNEL_WISE_POOLS for r in readers.of(out)
        )
        if not (only_pools or shared):
            continue
        new_nodes = []
        pooled = []
        for i, part in enumerate(cat.inputs):
            name = rw.fresh(f"{pool.name}.{i}")
            node = pool.replace(name=name, inputs=(part,), outputs=(name,))
            (t,) = infer_types(types, node)
            types[name] = t
            new_nodes.append((node, [t]))
            pooled.append(name)
        new_cat = cat.replace(
            name=rw.fresh(f"{cat.name}.{pool.name}"),
            inputs=tuple(pooled),
            outputs=pool.outputs,
        )
        new_nodes.append((new_cat, [graph.values[pool.outputs[0]]]))
        if only_pools:
            rw.drop(cat.name)
        rw.replace(pool.name, new_nodes)
        changed = True
    return rw.build() if changed else graph
