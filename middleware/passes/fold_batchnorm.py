"""fold_batchnorm: an inference batch-norm after a convolution or linear layer becomes part
of that layer's weight and bias."""

from __future__ import annotations

import numpy as np

from ..graph import Graph, Node
from .patterns import Readers, Rewrite

# Post-op attributes: a layer carrying one of them computes act(... + residual), and the
# batch-norm cannot move inside it.
POST_OP_ATTRS = ("activation", "residual")


def fold_batchnorm(graph: Graph) -> Graph:
    """Fold ``batch_norm(conv2d(x, w, b))`` into ``conv2d(x, w', b')`` (and the same for
    ``linear`` with a 2-d output).

    Expects: batch-norm inputs (x, running mean, running var, weight, bias) with the four
    statistics as parameters; ``eps`` attr.
    Guarantees: the same outputs (within float rounding: the new weight and bias are
    computed in float64 from the old ones and cast back to the weight's dtype); every
    batch-norm whose input is produced by a conv2d (or a linear with a 2-d output) without
    post-ops, read by nothing else and not a graph output, is gone, the layer now writes
    the batch-norm's output value. Other batch-norms (pre-activation ones, e.g. after a
    concat) stay. Original parameters are never modified (they may be shared); the folded
    layer reads new parameters.
    """
    readers = Readers(graph)
    rw = Rewrite(graph)
    for bn in graph.nodes():
        if bn.op != "batch_norm":
            continue
        layer = graph.producer(bn.inputs[0])
        if layer is None or not _foldable(graph, readers, layer, bn):
            continue
        w, b = _folded_weights(graph, layer, bn)
        wname = rw.add_param(f"{layer.name}.weight_bn", w, graph.values[layer.inputs[1]].layout)
        bname = rw.add_param(f"{layer.name}.bias_bn", b)
        fused = layer.replace(
            inputs=(layer.inputs[0], wname, bname),
            outputs=bn.outputs,
            source=f"{layer.source}+{bn.source}" if bn.source else layer.source,
        )
        rw.drop(layer.name)
        rw.replace(bn.name, [(fused, [graph.values[bn.outputs[0]]])])
    return rw.build()


def _foldable(graph: Graph, readers: Readers, layer: Node, bn: Node) -> bool:
    if layer.op not in ("conv2d", "linear") or any(k in layer.attrs for k in POST_OP_ATTRS):
        return False
    if readers.sole(layer.outputs[0]) is not bn or len(layer.outputs) != 1:
        return False
    if not all(v in graph.params for v in layer.inputs[1:]):
        return False
    if not all(v in graph.params for v in bn.inputs[1:]):
        return False
    if layer.op == "linear" and graph.values[layer.outputs[0]].rank != 2:
        return False  # batch-norm normalises dim 1, which is then not the feature dim
    out = graph.values[layer.outputs[0]]
    return graph.params[bn.inputs[1]].shape == (out.shape[1],)


def _folded_weights(graph: Graph, layer: Node, bn: Node) -> tuple[np.ndarray, np.ndarray]:
    """w' = w * s (per output channel), b' = (b - mean) * s + beta, s = gamma / sqrt(var + eps)."""
    w = graph.params[layer.inputs[1]]
    cout = w.shape[0]
    b = graph.params[layer.inputs[2]] if len(layer.inputs) > 2 else np.zeros(cout, w.dtype)
    mean, var, gamma, beta = (graph.params[v].astype(np.float64) for v in bn.inputs[1:])
    scale = gamma / np.sqrt(var + float(bn.attrs["eps"]))
    w2 = w.astype(np.float64) * scale.reshape((cout,) + (1,) * (w.ndim - 1))
    b2 = (b.astype(np.float64) - mean) * scale + beta
    return w2.astype(w.dtype), b2.astype(b.dtype if len(layer.inputs) > 2 else w.dtype)
