"""Graph lowerings the CUDA backend applies before grouping.

``affine_batch_norms``: an inference batch-norm whose statistics and affine parameters are
constants computes ``x * scale + shift`` with per-channel ``scale = w / sqrt(var + eps)`` and
``shift = b - mean * scale``. Spelled as the catalogue's ``mul`` and ``add`` of two new
(1, C, 1, ...) parameters, a generated kernel does one multiply-add per element instead of
an IEEE square root and division: on an H200 the BN -> ReLU kernel moved 51% of the copy
bandwidth with the division and square root per element (``bench/gpu_diag.py``), and the
BN -> ReLU -> max-pool chain took 31.5 us against 28.4 us with a multiply-add.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...graph import Graph, Node
from ...passes.patterns import Rewrite


def affine_batch_norms(graph: Graph) -> Graph:
    """``graph`` with every batch-norm over constant parameters as a ``mul`` then an ``add``
    of per-channel constants (same values up to float rounding; the add keeps the
    batch-norm's name, output and group). Expects: inference batch-norms (the catalogue's
    ``batch_norm``: x, mean, var, weight, bias, ``eps``). The input graph is not changed."""
    bns = [n for n in graph.nodes() if n.op == "batch_norm" and _constant_stats(graph, n)]
    if not bns:
        return graph
    rw = Rewrite(graph)
    for n in bns:
        mean, var, w, b = (graph.params[v].astype(np.float64) for v in n.inputs[1:5])
        scale = w / np.sqrt(var + float(n.attrs.get("eps", 1e-5)))
        shift = b - mean * scale
        t = graph.values[n.outputs[0]]
        shape = (1, t.shape[1]) + (1,) * (t.rank - 2)
        dtype = graph.params[n.inputs[1]].dtype
        s_name = rw.add_param(f"{n.name}.scale", scale.astype(dtype).reshape(shape))
        t_name = rw.add_param(f"{n.name}.shift", shift.astype(dtype).reshape(shape))
        scaled = rw.fresh(f"{n.outputs[0]}.scaled")
        mul = Node(
            rw.fresh(f"{n.name}_scale"),
            "mul",
            (n.inputs[0], s_name),
            (scaled,),
            {},
            bound=n.bound,
            group=n.group,
            source=n.source,
        )
        add = n.replace(op="add", inputs=(scaled, t_name), attrs={})
        rw.replace(n.name, [(mul, [t]), (add, [t])])
    return rw.build()


def _constant_stats(graph: Graph, n: Node) -> bool:
    t = graph.values[n.outputs[0]]
    return (
        len(n.inputs) == 5
        and t.rank >= 2
        and all(v in graph.params for v in n.inputs[1:5])
        and all(graph.params[v].size == t.shape[1] for v in n.inputs[1:5])
    )


def channels_last_weights(graph: Graph) -> Graph:
    """``graph`` with the constant weight of every convolution whose output is channels_last
    ("nhwc") marked channels_last too, so that the plan holds that one copy (the plan makes
    each constant once, in its value's layout) instead of a copy in each layout. The input
    graph is not changed."""
    marks = []
    for n in graph.nodes():
        if n.op != "conv2d" or len(n.inputs) < 2 or n.inputs[1] not in graph.params:
            continue
        w = graph.values[n.inputs[1]]
        if graph.values[n.outputs[0]].layout == "nhwc" and w.rank == 4 and w.layout != "nhwc":
            marks.append(n.inputs[1])
    if not marks:
        return graph
    out = graph.copy()
    for p in marks:
        out.values[p] = dataclasses.replace(out.values[p], layout="nhwc")
    return out
