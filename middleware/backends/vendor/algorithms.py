"""The algorithms of each op that has alternatives, by name, in the order they are tried.

An :class:`Algorithm` offers a callable for one node (the catalogue reference's arguments
and result) or declines (None). :func:`vendor_call` takes the first offer of the node's
op's table; a per-layer algorithm choice (by the user, or measured) picks a name from the
same table instead of the order.

conv2d: "winograd" (F(4x4,3x3): generated transforms around the framework's batched
GEMM; CPU, where its measured rule picks the layer and ``Options(winograd=True)``), then
"direct" (the vendor's direct convolution: oneDNN with a prepacked weight and fused
post-ops on CPU, cuDNN on CUDA). linear: "direct" (oneDNN/MKL or cuBLAS).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ...graph import Graph, Node
from ...hardware import Hardware
from ...options import Options
from .calls import vendor_kernel
from .winograd import winograd_kernel

# (graph, node, device, options, hardware) -> (callable, what runs it) or None
Offer = Callable[
    [Graph, Node, torch.device, Options, Hardware], tuple[Callable[..., Any], str] | None
]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One way to compute an op: ``offer`` returns the call for a node, or None where this
    algorithm does not apply (shape, device, dtype, options, a measured rule)."""

    name: str
    offer: Offer


def _winograd(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> tuple[Callable[..., Any], str] | None:
    if not options.winograd or device.type != "cpu":
        return None
    fn = winograd_kernel(graph, node, options, hardware)
    return None if fn is None else (fn, fn.algorithm)


def _direct(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> tuple[Callable[..., Any], str] | None:
    fn = vendor_kernel(graph, node, device, hardware)
    return None if fn is None else (fn, "")


WINOGRAD = Algorithm("winograd", _winograd)
DIRECT = Algorithm("direct", _direct)

# Per op, its algorithms in the order they are tried.
ALGORITHMS: dict[str, tuple[Algorithm, ...]] = {
    "conv2d": (WINOGRAD, DIRECT),
    "linear": (DIRECT,),
}


def vendor_call(
    graph: Graph, node: Node, device: torch.device, options: Options, hardware: Hardware
) -> tuple[Callable[..., Any], str] | None:
    """The call of the first algorithm of ``node.op`` that offers one, with the reason the
    report shows ("" for the vendor's direct call), or None (the catalogue reference runs)."""
    for algorithm in ALGORITHMS.get(node.op, ()):
        offer = algorithm.offer(graph, node, device, options, hardware)
        if offer is not None:
            return offer
    return None
