"""fuse_depthwise: a 1x1 convolution and the depthwise 3x3 convolution that alone reads it
become one ``conv2d_dw`` layer (the expand -> depthwise pair of MobileNet and ShuffleNet
blocks), which the CPU's vendor call runs as one oneDNN primitive with the depthwise layer
fused as a post-op: the expanded tensor between them is computed a few rows at a time in
cache instead of being written whole and read back (issue 13: "depthwise-separable blocks
computed tile by tile so the expanded tensor never leaves the cache").

Measured on the 2-core AVX-512 host (one process, oneDNN's fused primitive against the 1x1
primitive plus the depthwise convolution, batch 16, channels_last): 24->144 at 56x56,
stride 1, 2.6 against 3.9 ms; stride 2, 1.1 against 2.1 ms; 16->96 at 112x112, stride 2,
2.9 against 5.9 ms (the fused call costs what the 1x1 alone did); batch 1, 24->144 at
56x56, 0.10 against 0.15 ms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..graph import Graph, Node
from ..hardware import Hardware
from ..loops import pair as _pair
from ..ops import get_op
from .patterns import Readers, Rewrite


def _param_conv(graph: Graph, node: Node) -> bool:
    """A conv2d of a float32 image with parameter weight (and bias), no residual, no string
    padding, channels_last output."""
    if node.op != "conv2d" or node.attrs.get("residual") or isinstance(node.attrs["padding"], str):
        return False
    if len(node.inputs) not in (2, 3) or not all(v in graph.params for v in node.inputs[1:]):
        return False
    x, y = graph.values[node.inputs[0]], graph.values[node.outputs[0]]
    return (
        x.rank == 4
        and x.dtype == "float32"
        and y.layout == "nhwc"
        and node.attrs.get("output_layout") in (None, "nhwc")
    )


def _plain_conv(graph: Graph, node: Node) -> bool:
    """:func:`_param_conv` of a channels_last image."""
    return _param_conv(graph, node) and graph.values[node.inputs[0]].layout == "nhwc"


def _pointwise(graph: Graph, node: Node) -> bool:
    """A 1x1, stride-1, unpadded, ungrouped convolution."""
    if not _plain_conv(graph, node):
        return False
    w = graph.params[node.inputs[1]].shape
    a = node.attrs
    return (
        len(w) == 4
        and w[2:] == (1, 1)
        and int(a["groups"]) == 1
        and _pair(a["stride"]) == (1, 1)
        and _pair(a["padding"]) == (0, 0)
        and _pair(a["dilation"]) == (1, 1)
    )


def _depthwise3x3(graph: Graph, node: Node, channels: int) -> int | None:
    """The stride (1 or 2) of a depthwise 3x3 convolution over ``channels`` channels with
    padding 1 and no dilation; None for anything else."""
    if not _plain_conv(graph, node):
        return None
    w = graph.params[node.inputs[1]].shape
    a = node.attrs
    s = _pair(a["stride"])
    if (
        w != (channels, 1, 3, 3)
        or int(a["groups"]) != channels
        or _pair(a["padding"]) != (1, 1)
        or _pair(a["dilation"]) != (1, 1)
        or s not in ((1, 1), (2, 2))
    ):
        return None
    return s[0]


def _bias(rw: Rewrite, layer: Node, zeros: np.ndarray) -> str:
    """The layer's bias, or a new zero parameter where it has none."""
    if len(layer.inputs) == 3:
        return layer.inputs[2]
    return rw.add_param(f"{layer.name}.zero_bias", zeros)


def _pairs(
    graph: Graph, hardware: Hardware, rw: Rewrite, first: Callable[[Graph, Node], bool]
) -> Iterator[tuple[Node, Node, int]]:
    """(a, b, the depthwise stride) for each convolution ``a`` that ``first`` accepts whose
    output only a depthwise 3x3 conv2d ``b`` reads (:func:`_depthwise3x3`), neither edited
    yet, where that output outgrows the cores' L2 caches (else it stays in cache between
    the two layers anyway)."""
    readers = Readers(graph)
    for a in graph.nodes():
        if not first(graph, a):
            continue
        b = readers.sole(a.outputs[0])
        k = graph.params[a.inputs[1]].shape[0]
        stride = None if b is None else _depthwise3x3(graph, b, k)
        if b is None or stride is None or rw.is_edited(b.name) or rw.is_edited(a.name):
            continue
        if graph.values[a.outputs[0]].nbytes > hardware.l2_bytes * max(1, hardware.cores):
            yield a, b, stride


def _merge(graph: Graph, rw: Rewrite, a: Node, b: Node, attrs: dict[str, Any]) -> None:
    """Replace convolution ``a`` and the depthwise layer ``b`` that alone reads it by one
    ``conv2d_dw`` node (inputs x, w1, b1, wdw, bdw: a zero bias where a layer had none;
    ``attrs`` plus each layer's activation), named as ``a``, at ``b``'s position, writing
    ``b``'s output."""
    zeros = np.zeros(graph.params[a.inputs[1]].shape[0], dtype=graph.params[a.inputs[1]].dtype)
    attrs = dict(attrs)
    for key, layer in (("activation", a), ("dw_activation", b)):
        if layer.attrs.get("activation"):
            attrs[key] = layer.attrs["activation"]
            attrs[f"{key}_attrs"] = layer.attrs.get("activation_attrs", ())
    fused = Node(
        a.name,
        "conv2d_dw",
        (a.inputs[0], a.inputs[1], _bias(rw, a, zeros), b.inputs[1], _bias(rw, b, zeros)),
        b.outputs,
        attrs,
        source="+".join(dict.fromkeys(s for s in (a.source, b.source) if s)),
    )
    rw.drop(a.name)
    rw.replace(b.name, [(fused, [graph.values[b.outputs[0]]])])


def fuse_depthwise(graph: Graph, hardware: Hardware) -> Graph:
    """Replace each 1x1 conv2d whose output only a depthwise 3x3 conv2d reads (padding 1,
    stride 1 or 2, both channels_last, weights and biases parameters, activations already
    fused by ``fuse_vendor_epilogue``) with one ``conv2d_dw`` node: inputs (x, w1, b1,
    wdw, bdw), a zero bias where a layer had none; attrs ``stride``, ``activation`` /
    ``activation_attrs`` (the 1x1's) and ``dw_activation`` / ``dw_activation_attrs``.
    CPU only (the fused primitive is oneDNN's).

    Expects: layouts assigned (the ``layout`` pass), post-ops fused. Guarantees: the same
    outputs (the catalogue's reference of ``conv2d_dw`` is the two convolutions in turn);
    the fused node keeps the 1x1's name, writes the depthwise layer's output value and
    stands at its position."""
    if hardware.kind != "cpu":
        return graph
    rw = Rewrite(graph)
    for a, b, stride in _pairs(graph, hardware, rw, _pointwise):
        src = graph.producer(a.inputs[0])
        if src is not None and get_op(src.op).strided_view:
            continue  # a channel slice (ShuffleNet's split): the primitive reads dense sources
        attrs: dict[str, Any] = {"stride": stride}
        _merge(graph, rw, a, b, attrs)
    return rw.build()


# The stem convolutions fuse_stem takes: few input channels (the image's) and at most this
# many output channels (backends/vendor/direct.py runs them: its stem rule's bounds).
STEM_MAX_IN_CHANNELS = 4
STEM_MAX_OUT_CHANNELS = 32


def _stem_conv(graph: Graph, node: Node) -> bool:
    """A dense convolution of at most ``STEM_MAX_IN_CHANNELS`` input and
    ``STEM_MAX_OUT_CHANNELS`` output channels on a float32 image (either layout), numeric
    padding, no dilation or residual, parameter weight (and bias), channels_last output."""
    if not _param_conv(graph, node):
        return False
    w = graph.params[node.inputs[1]].shape
    a = node.attrs
    return (
        int(a["groups"]) == 1
        and _pair(a["dilation"]) == (1, 1)
        and len(w) == 4
        and w[1] <= STEM_MAX_IN_CHANNELS
        and w[0] <= STEM_MAX_OUT_CHANNELS
    )


def fuse_stem(graph: Graph, hardware: Hardware) -> Graph:
    """Replace each stem convolution (:func:`_stem_conv`: MobileNet's 3 -> 16 or 32
    channels, stride 2) whose output only a depthwise 3x3 conv2d reads (padding 1, stride
    1 or 2, channels_last) with one ``conv2d_dw`` node, as :func:`fuse_depthwise` does for
    a 1x1 layer, with the stem's geometry in ``stride1`` and ``padding1``. The direct
    kernel (backends/vendor/direct.py) computes the stem a few rows at a time into a ring
    in cache and the depthwise layer from there: the stem's output, the largest
    activation of those networks (16 x 112 x 112 floats an image), is never written out.
    CPU with AVX-512 only; where the stem's output fits the cores' L2 caches it is left
    alone (it stays in cache between the two layers anyway).

    Expects: layouts assigned, post-ops fused. Guarantees: the same outputs (the
    catalogue's reference of ``conv2d_dw`` runs the two convolutions in turn); the fused
    node keeps the stem's name, writes the depthwise layer's output value and stands at
    its position."""
    if hardware.kind != "cpu" or hardware.simd_bytes < 64:
        return graph  # (the fused kernel's blocking was measured with AVX-512's registers)
    rw = Rewrite(graph)
    for a, b, stride in _pairs(graph, hardware, rw, _stem_conv):
        attrs: dict[str, Any] = {
            "stride": stride,
            "stride1": _pair(a.attrs["stride"]),
            "padding1": _pair(a.attrs["padding"]),
        }
        if a.attrs.get("output_layout"):  # the stem read an NCHW image: its result is NHWC
            attrs["output_layout"] = a.attrs["output_layout"]
        _merge(graph, rw, a, b, attrs)
    return rw.build()
