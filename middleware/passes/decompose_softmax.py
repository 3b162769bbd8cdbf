"""decompose_softmax: a softmax over a row becomes the ops of its definition, so that it fuses.

ATen's ``softmax`` is one opaque call: the bias or mask added to attention scores before it
(Swin's relative-position bias, a shifted window's mask) is a separate pass over the whole
score tensor. Written as its definition over registry ops with loop semantics (``amax``,
``sub``, ``exp``, ``sum``, ``div``), it joins a depth-first group with the add before it:
a tile of rows is read once, its max, exponentials and sum stay in the tile, and the
probabilities are written once. The row reductions run as AVX-512 loops (a vector of lane
maxima with a NaN mask, a sum in double) and ``exp`` as a vectorised polynomial
(``backends/x86/cfuncs.py``: ``mw_expf``), within 1 ulp of the exact result.
"""

from __future__ import annotations

import math

from ..graph import Graph, Node, TensorType
from ..loops import logical_dims
from .patterns import Definition, Rewrite


def softmax_dim(graph: Graph, node: Node) -> int | None:
    """The dim a ``softmax`` node of a float32 value of rank 3 or more normalizes over, when
    a generated row reduction covers it: a dim in the logical ``h``/``w`` of a rank-3/4
    value (the last dims: attention scores, token features), or the last dim of a higher
    rank (MaxViT's (B, windows, heads, T, T) scores, computed as a rank-4 view); None for
    any other node."""
    xt = graph.values[node.inputs[0]]
    if node.op != "softmax" or xt.dtype != "float32" or xt.rank < 3:
        return None
    dim = int(node.attrs["dim"]) % xt.rank
    if xt.rank > 4:
        return dim if dim == xt.rank - 1 else None
    return dim if logical_dims(xt.rank)[dim] in (2, 3) else None


def _bias_add(graph: Graph, x: str) -> tuple[Node, str, str] | None:
    """``(add node, full operand, bias)`` when ``x`` (of rank 5 or more) is a plain
    ``add`` read only by the softmax, of an operand of ``x``'s own shape and a bias of rank
    at most 4 whose sizes in the leading dims the rank-4 view merges are all 1 (MaxViT's
    relative-position bias, ``(1, heads, T, T)``): then ``full`` viewed as rank 4 plus the
    bias broadcasts the same way. None otherwise."""
    add = graph.producer(x)
    if add is None or add.op != "add" or len(add.inputs) != 2 or add.attrs:
        return None
    if graph.uses(x) != 1 or x in graph.output_values():
        return None
    xt = graph.values[x]
    for full, other in (add.inputs, add.inputs[::-1]):
        ft, ot = graph.values[full], graph.values[other]
        if ft.shape != xt.shape or ot.rank > 4 or full == other:
            continue
        aligned = (1,) * (xt.rank - ot.rank) + tuple(ot.shape)
        if all(d == 1 for d in aligned[: xt.rank - 3]):
            return add, full, other
    return None


def decompose_softmax(graph: Graph) -> Graph:
    """Write every ``softmax`` over a dim a generated reduction covers as
    ``e = exp(x - amax(x))``, ``y = e / sum(e)`` (over that dim, kept). A value of rank 5
    or more is viewed as rank 4 first (its leading dims merged; a reshape that moves no
    element) and the result viewed back; a bias add before it that only the softmax reads
    (MaxViT's relative-position bias) comes onto the view, so that it fuses.

    Expects: ``softmax`` nodes with a ``dim`` attr.
    Guarantees: the same outputs within float rounding (ATen's kernel computes the same
    steps, with a multiply by the sum's reciprocal where this divides); NaN and infinity as
    ATen gives them (a NaN in a row makes the row NaN; so does a +inf, through
    ``inf - inf``, while a -inf element gives 0; a row of -inf is NaN); a softmax over any
    other dim, rank or dtype stays as it is. Every new node carries the softmax's ``source``.
    """
    rw = Rewrite(graph)
    for n in graph.nodes():
        dim = softmax_dim(graph, n)
        if dim is None:
            continue
        df = Definition(rw, n)
        x = n.inputs[0]
        xt = graph.values[x]
        if xt.rank > 4:
            lead = math.prod(xt.shape[: xt.rank - 3])
            t4 = TensorType((lead, *xt.shape[-3:]), xt.dtype, xt.layout)
            bias = _bias_add(graph, x)
            if bias is not None:  # the add comes along onto the view, and fuses
                add, full, other = bias
                v = df.emit("reshape", (full,), t4, shape=t4.shape)
                x = df.emit("add", (v, other) if add.inputs[0] == full else (other, v), t4)
                rw.drop(add.name)
            else:
                x = df.emit("reshape", (x,), t4, shape=t4.shape)
            xt, dim = t4, 3
        row = TensorType(
            tuple(1 if i == dim else s for i, s in enumerate(xt.shape)), xt.dtype, xt.layout
        )
        m = df.emit("amax", (x,), row, dims=(dim,), keepdim=True)
        e = df.emit("exp", (df.emit("sub", (x, m), xt),), xt)
        y = df.emit("div", (e, df.emit("sum", (e,), row, dims=(dim,), keepdim=True)), xt)
        out = graph.values[n.outputs[0]]
        if out.rank > 4:
            df.emit("reshape", (y,), out, shape=out.shape)
        rw.replace(n.name, df.nodes())
    return rw.build()
