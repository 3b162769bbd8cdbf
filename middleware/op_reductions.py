"""Registry entries of the window and reduction ops: pooling (max, average, adaptive,
max-pool with a merged activation), mean, softmax and log_softmax."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import loops
from .enums import Bound
from .graph import Node, TensorType
from .loops import pair
from .op_registry import Kernel, OpDef, activation_fn, register, with_post_op


def pool_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    if "kernel_size" in node.attrs:
        kh, kw = pair(node.attrs["kernel_size"])
        return float(outs[0].numel * kh * kw)
    return float(ins[0].numel)  # adaptive: every input element read about once


def reduce_flops(node: Node, ins: Sequence[TensorType], outs: Sequence[TensorType]) -> float:
    return float(ins[0].numel)


def _softmax(node: Node) -> Kernel:
    dim = node.attrs["dim"]

    def softmax(x):
        return torch.softmax(x, dim)

    return softmax


def _log_softmax(node: Node) -> Kernel:
    dim = node.attrs["dim"]

    def log_softmax(x):
        return torch.log_softmax(x, dim)

    return log_softmax


register(OpDef("softmax", Bound.IO, _softmax, flops_per_elem=5.0, per_sample=True))


register(OpDef("log_softmax", Bound.IO, _log_softmax, flops_per_elem=5.0, per_sample=True))


def _max_pool2d(node: Node) -> Kernel:
    k, s, p, d, c = (
        node.attrs["kernel_size"],
        node.attrs["stride"],
        node.attrs["padding"],
        node.attrs["dilation"],
        node.attrs["ceil_mode"],
    )

    def max_pool2d(x):
        return F.max_pool2d(x, k, s, p, d, ceil_mode=c)

    return max_pool2d


register(
    OpDef(
        "max_pool2d",
        Bound.IO,
        _max_pool2d,
        flops_fn=pool_flops,
        loops=loops.max_pool_loops,
        per_sample=True,
        layout_preserving=True,
    )
)


def _avg_pool2d(node: Node) -> Kernel:
    k, s, p, c, cip, div = (
        node.attrs["kernel_size"],
        node.attrs["stride"],
        node.attrs["padding"],
        node.attrs["ceil_mode"],
        node.attrs["count_include_pad"],
        node.attrs["divisor_override"],
    )

    def avg_pool2d(x):
        return F.avg_pool2d(x, k, s, p, c, cip, div)

    return avg_pool2d


register(
    OpDef(
        "avg_pool2d",
        Bound.IO,
        _avg_pool2d,
        flops_fn=pool_flops,
        loops=loops.avg_pool_loops,
        per_sample=True,
        layout_preserving=True,
    )
)


def _adaptive_avg_pool2d(node: Node) -> Kernel:
    size = node.attrs["output_size"]

    def adaptive_avg_pool2d(x):
        return F.adaptive_avg_pool2d(x, size)

    return adaptive_avg_pool2d


def _adaptive_max_pool2d(node: Node) -> Kernel:
    size = node.attrs["output_size"]

    def adaptive_max_pool2d(x):
        return F.adaptive_max_pool2d(x, size)

    return adaptive_max_pool2d


for _name, _make in (
    ("adaptive_avg_pool2d", _adaptive_avg_pool2d),
    ("adaptive_max_pool2d", _adaptive_max_pool2d),
):
    register(
        OpDef(
            _name,
            Bound.IO,
            _make,
            flops_fn=pool_flops,
            loops=loops.adaptive_pool_loops,
            per_sample=True,
            layout_preserving=True,
        )
    )


def _maxpool_act(node: Node) -> Kernel:
    pool = _max_pool2d(node)
    act = activation_fn(node.attrs["activation"], dict(node.attrs["activation_attrs"]))

    def maxpool_act(x):
        return act(pool(x))

    return maxpool_act


# merged max-pool + monotone activation (the passes' merge_pool_relu); attrs of max_pool2d
# plus ``activation`` (an op name) and ``activation_attrs`` (a tuple of (key, value) pairs)
register(
    OpDef(
        "maxpool_relu",
        Bound.IO,
        _maxpool_act,
        flops_fn=pool_flops,
        loops=with_post_op(loops.max_pool_loops),
        per_sample=True,
        layout_preserving=True,
    )
)


def _mean(node: Node) -> Kernel:
    dims, keep = tuple(node.attrs["dims"]), bool(node.attrs["keepdim"])

    def mean(x):
        return torch.mean(x, dims, keep)

    return mean


def _over_space(attrs: Mapping[str, Any]) -> bool:
    """A mean over both spatial dims writes (N, C) or (N, C, 1, 1): the same in both orders."""
    return {int(d) % 4 for d in attrs["dims"]} >= {2, 3}


register(
    OpDef(
        "mean",
        Bound.IO,
        _mean,
        flops_fn=reduce_flops,
        loops=loops.mean_loops,
        per_sample=True,
        layout_preserving=True,
        layout_preserving_if=_over_space,
    )
)
