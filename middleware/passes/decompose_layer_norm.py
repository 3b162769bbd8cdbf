"""decompose_layer_norm: a LayerNorm becomes the ops of its definition, so that it fuses.

ATen's ``layer_norm`` is one opaque call: the residual add before it and the ops after it
each read and write the whole activation again. Written as its definition over registry
ops that have loop semantics (``mean`` over the normalized dims, ``sub``, ``mul``,
``add``, ``rsqrt``), it joins a depth-first group with its neighbours: a tile of rows is
reduced, normalized and written once, and the two statistics never leave the tile.
"""

from __future__ import annotations

from ..graph import Graph, Node, TensorType
from ..loops import logical_dims
from .patterns import Definition, Rewrite


def normalized_dims(graph: Graph, node: Node) -> tuple[int, ...] | None:
    """The dims a ``layer_norm`` node of a token sequence ``(N, T, C)`` or a token map
    ``(N, H, W, C)`` (Swin's, ConvNeXt's, MaxViT's) normalizes over, when they sit in the
    logical ``h``/``w`` dims a generated reduction runs over; None for any other node.

    Rank-4 maps were measured 3-4% slower decomposed (convnext_tiny, session 15) while a
    row's sum was gcc's vector loop with a scalar remainder; with the AVX-512 row sum,
    against ATen's norm in the same plan: convnext_tiny 0.99-1.01x, swin_t 1.01x (batch
    1) and 0.99x / 1.04x (batch 8), maxvit_t 0.99x."""
    xt = graph.values[node.inputs[0]]
    k = len(tuple(node.attrs["normalized_shape"]))
    if xt.dtype != "float32" or xt.rank not in (3, 4) or not 0 < k < xt.rank:
        return None
    places = logical_dims(xt.rank)
    dims = tuple(range(xt.rank - k, xt.rank))
    return dims if {places[d] for d in dims} <= {2, 3} else None


def decompose_layer_norm(graph: Graph) -> Graph:
    """Write every ``layer_norm`` over dims a generated reduction covers as
    ``d = x - mean(x)``, ``y = d * rsqrt(mean(d * d) + eps)``, then ``* weight`` and
    ``+ bias`` where the node has them.

    Expects: ``layer_norm`` nodes with ``normalized_shape``, ``eps`` and ``affine``
    ("weight", "bias", "weight_bias" or "") attrs, the weight and bias as the inputs after
    the value.
    Guarantees: the same outputs within float rounding (the biased variance of the centred
    values, as ATen's kernel computes it, in two passes); a ``layer_norm`` of a rank other
    than 3 or 4, or a dtype other than float32, stays as it is. Every new node carries
    the LayerNorm's ``source``.
    """
    rw = Rewrite(graph)
    for n in graph.nodes():
        if n.op == "layer_norm":
            dims = normalized_dims(graph, n)
            if dims is not None:
                rw.replace(n.name, _definition(graph, rw, n, dims))
    return rw.build()


def _definition(
    graph: Graph, rw: Rewrite, n: Node, dims: tuple[int, ...]
) -> list[tuple[Node, list[TensorType]]]:
    """The nodes computing ``layer_norm`` node ``n`` over ``dims``, the last writing its
    output value."""
    x = n.inputs[0]
    xt = graph.values[x]
    stat = TensorType(
        tuple(1 if i in dims else s for i, s in enumerate(xt.shape)), xt.dtype, xt.layout
    )
    affine = str(n.attrs["affine"])
    rest = iter(n.inputs[1:])
    weight = next(rest) if "weight" in affine else None
    bias = next(rest) if "bias" in affine else None
    df = Definition(rw, n)
    mean = df.emit("mean", (x,), stat, dims=dims, keepdim=True)
    d = df.emit("sub", (x, mean), xt)
    var = df.emit("mean", (df.emit("mul", (d, d), xt),), stat, dims=dims, keepdim=True)
    rstd = df.emit("rsqrt", (df.emit("add", (var,), stat, scalar=float(n.attrs["eps"])),), stat)
    y = df.emit("mul", (d, rstd), xt)
    if weight is not None:
        y = df.emit("mul", (y, weight), xt)
    if bias is not None:
        y = df.emit("add", (y, bias), xt)
    return df.nodes()
