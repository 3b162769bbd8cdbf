"""What the lowering and its rules share: lowered values, the exception that turns a call
into a fallback, argument binding against a signature, and the attr conversions several
rules use (convolution and pooling geometry).

A rule gets (lowering, fx node, callable, lowered args, lowered kwargs) and returns
(op name, tensor inputs, attrs, in-place?) or raises :class:`Unsupported`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.fx as fx

from ..graph import Graph, TensorType


class LoweringContext(Protocol):
    """What a rule may use of the lowering: the graph so far and its parameters."""

    g: Graph

    def param(self, tensor: torch.Tensor, name: str) -> V: ...


class _V:
    """A lowered tensor value (its name in the middleware graph)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"%{self.name}"


# the class keeps its historic name: fallback reasons name it ("add of _V and bool")
V = _V


class Unsupported(Exception):
    """A call the catalogue cannot express; the node becomes a fallback."""


REQUIRED = object()


def bind(
    args: Sequence[Any], kwargs: dict[str, Any], spec: Sequence[tuple[str, Any]], what: str
) -> dict[str, Any]:
    """Bind positional and keyword arguments to a signature given as (name, default) pairs."""
    out: dict[str, Any] = {}
    if len(args) > len(spec):
        raise Unsupported(f"{what}: {len(args)} positional arguments, expected at most {len(spec)}")
    for (name, _), a in zip(spec, args, strict=False):
        out[name] = a
    for k, v in kwargs.items():
        if k not in {n for n, _ in spec}:
            raise Unsupported(f"{what}: unknown keyword argument {k!r}")
        out[k] = v
    for name, default in spec:
        if name not in out:
            if default is REQUIRED:
                raise Unsupported(f"{what}: missing argument {name!r}")
            out[name] = default
    return out


def pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    if len(v) == 1:
        return (int(v[0]), int(v[0]))
    return (int(v[0]), int(v[1]))


def norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def meta_of(fxn: fx.Node) -> TensorType:
    return fxn.meta["mw_value"]


def tensor_arg(a: Any, what: str) -> V:
    if not isinstance(a, V):
        raise Unsupported(f"{what} is not a tensor")
    return a


def rank_of(low: LoweringContext, v: V) -> int:
    return low.g.values[v.name].rank


def conv_attrs(
    stride: Any, padding: Any, dilation: Any, groups: int, ksize: Sequence[int]
) -> dict[str, Any]:
    """conv2d's attrs from the framework's arguments (``padding`` "valid"/"same" resolved
    against the kernel size ``ksize``)."""
    dilation = pair(dilation)
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0, 0)
        elif padding == "same":
            pads = []
            for k, d in zip(ksize, dilation, strict=True):
                total = d * (k - 1)
                if total % 2:
                    raise Unsupported("padding='same' with an even effective kernel")
                pads.append(total // 2)
            padding = tuple(pads)
        else:
            raise Unsupported(f"conv padding={padding!r}")
    return {
        "stride": pair(stride),
        "padding": pair(padding),
        "dilation": dilation,
        "groups": int(groups),
    }


def _pool_stride(k: tuple[int, int], stride: Any) -> tuple[int, int]:
    """A pooling stride; none given (None or empty) means the kernel size."""
    if stride is None or (isinstance(stride, (list, tuple)) and len(stride) == 0):
        return k
    return pair(stride)


def max_pool_attrs(
    kernel_size: Any, stride: Any, padding: Any, dilation: Any, ceil_mode: bool
) -> dict[str, Any]:
    """max_pool2d's attrs from the framework's arguments."""
    k = pair(kernel_size)
    return {
        "kernel_size": k,
        "stride": _pool_stride(k, stride),
        "padding": pair(padding),
        "dilation": pair(dilation),
        "ceil_mode": bool(ceil_mode),
    }


def avg_pool_attrs(
    kernel_size: Any,
    stride: Any,
    padding: Any,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> dict[str, Any]:
    """avg_pool2d's attrs from the framework's arguments."""
    k = pair(kernel_size)
    return {
        "kernel_size": k,
        "stride": _pool_stride(k, stride),
        "padding": pair(padding),
        "ceil_mode": bool(ceil_mode),
        "count_include_pad": bool(count_include_pad),
        "divisor_override": None if divisor_override is None else int(divisor_override),
    }


def adaptive_size(low: LoweringContext, x: V, size: Any) -> tuple[int, int]:
    """An adaptive pooling's output size (None in a dim: the input's size there)."""
    h, w = low.g.values[x.name].shape[-2:]
    if isinstance(size, int):
        return (size, size)
    size = tuple(size)
    if len(size) == 1:
        size = (size[0], size[0])
    return (h if size[0] is None else int(size[0]), w if size[1] is None else int(size[1]))


def layer_norm_node(low, x, normalized_shape, weight, bias, eps):
    """The ``layer_norm`` node of F.layer_norm's arguments (the module rule shares it):
    weight and bias as inputs where given, which of them in ``affine``."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not all(isinstance(d, int) for d in shape):
        raise Unsupported("layer_norm with a normalized_shape computed at run time")
    if len(shape) >= rank_of(low, x):
        raise Unsupported("layer_norm over every dim, the batch included")
    ins = [x]
    affine = []
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            ins.append(tensor_arg(t, f"layer_norm {name}"))
            affine.append(name)
    attrs = {"normalized_shape": shape, "eps": float(eps), "affine": "_".join(affine)}
    return "layer_norm", ins, attrs, False
