"""Registry entries of the window and reduction ops: pooling (max, average, adaptive,
max-pool with a merged activation), mean, softmax, log_softmax, layer_norm, group_norm and
normalize (x / max(||x||_p, eps) along a dim),
and the resampling ``interpolate`` (nearest and bilinear)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import loops
from .enums import Bound
from .graph import Graph, Node, TensorType
from .loops import NotFusable, pair
from .op_registry import (
    GradEmitter,
    Kernel,
    OpDef,
    OutForm,
    OutVariant,
    activation_fn,
    get_op,
    register,
    with_post_op,
)


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


def _softmax_out(log: bool) -> OutVariant:
    op = torch.ops.aten._log_softmax.out if log else torch.ops.aten._softmax.out
    ref = torch.log_softmax if log else torch.softmax

    def make(node: Node, graph: Graph) -> OutForm:
        dim = node.attrs["dim"]

        def softmax_out(x, o):
            if not o.is_contiguous():
                # ATen's kernel writes a channels_last destination as if it were contiguous
                # (torch 2.14, tests/test_out_forms.py): compute, then copy
                o.copy_(ref(x, dim))
                return
            op(x, dim, False, out=o)

        return softmax_out, ()

    # ATen's kernel writes a strided output as if it were dense
    return OutVariant(make, dense_only=True)


for _name, _make, _log in (("softmax", _softmax, False), ("log_softmax", _log_softmax, True)):
    register(
        OpDef(_name, Bound.IO, _make, flops_per_elem=5.0, per_sample=True, out=_softmax_out(_log))
    )


def _layer_norm(node: Node) -> Kernel:
    """F.layer_norm over the trailing ``normalized_shape`` dims; the inputs after the value
    are the weight and then the bias, where the node has them (``affine``: "weight",
    "bias", "weight_bias" or "")."""
    shape, eps, affine = node.attrs["normalized_shape"], node.attrs["eps"], node.attrs["affine"]

    def layer_norm(x, *wb):
        it = iter(wb)
        w = next(it) if "weight" in affine else None
        b = next(it) if "bias" in affine else None
        return F.layer_norm(x, shape, w, b, eps)

    return layer_norm


# LayerNorm runs through the framework (ATen's fused kernel; no loop semantics yet): as a
# graph node, not a fallback, so that its neighbours are optimized around it. Each sample
# is normalized on its own (normalized_shape never reaches dim 0: checked by the frontend).
register(
    OpDef(
        "layer_norm",
        Bound.IO,
        _layer_norm,
        flops_per_elem=8.0,
        per_sample=True,
        weight_inputs=frozenset({1, 2}),
    )
)


def _group_norm(node: Node) -> Kernel:
    """F.group_norm over ``num_groups`` groups of channels (dim 1); weight and bias as
    inputs after the value where the node has them (``affine`` as for layer_norm)."""
    groups, eps, affine = node.attrs["num_groups"], node.attrs["eps"], node.attrs["affine"]

    def group_norm(x, *wb):
        it = iter(wb)
        w = next(it) if "weight" in affine else None
        b = next(it) if "bias" in affine else None
        return F.group_norm(x, groups, w, b, eps)

    return group_norm


# ATen's kernel, a graph node like layer_norm; each sample is normalized on its own
register(
    OpDef(
        "group_norm",
        Bound.IO,
        _group_norm,
        flops_per_elem=8.0,
        per_sample=True,
        weight_inputs=frozenset({1, 2}),
    )
)


def _normalize(node: Node) -> Kernel:
    p, dim, eps = node.attrs["p"], node.attrs["dim"], node.attrs["eps"]

    def normalize(x):
        return F.normalize(x, p, dim, eps)

    return normalize


# F.normalize (Swin V2's cosine attention): ATen's norm and division, a graph node
register(OpDef("normalize", Bound.IO, _normalize, flops_fn=reduce_flops))


def _interpolate(node: Node) -> Kernel:
    """F.interpolate with the call's own arguments (``size`` or ``scale_factor`` as given:
    nearest with a scale factor maps coordinates by the factor, not by the sizes)."""
    a = node.attrs
    size, scale, mode = a["size"], a["scale_factor"], a["mode"]
    align, recompute = a["align_corners"], a["recompute_scale_factor"]

    def interpolate(x):
        return F.interpolate(
            x,
            size=size,
            scale_factor=scale,
            mode=mode,
            align_corners=align,
            recompute_scale_factor=recompute,
        )

    return interpolate


# nearest, nearest-exact, bilinear, bicubic (antialias off) on 4-d values: each output
# element reads a few input elements of its own sample and channel
register(
    OpDef(
        "interpolate",
        Bound.IO,
        _interpolate,
        flops_per_elem=4.0,
        per_sample=True,
    )
)


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


# ATen's CPU max-pool always writes an int64 index tensor beside its result (twice the
# result's bytes for float32). For NCHW values the out-form pools the batch in up to this
# many chunks, so that the index scratch is one chunk's worth (measured: 4 chunks cost
# about 5% of the pool's time in NCHW; in channels_last every call costs the whole
# tensor's time, so channels_last pools run in one piece).
MAXPOOL_CHUNKS = 4
INDEX_BYTES = 8  # the int64 index ATen's CPU max-pools make per output element


def _max_pool2d_out(node: Node, graph: Graph) -> OutForm | None:
    """The out= form of max_pool2d, and of maxpool_relu with its activation's out= form
    applied in place after it."""
    a = node.attrs
    k, s, p, d, c = a["kernel_size"], a["stride"], a["padding"], a["dilation"], a["ceil_mode"]
    s = s or k
    act = None
    if node.op == "maxpool_relu":
        spec = get_op(a["activation"]).out
        form = None
        if spec is not None:
            act_node = Node("_act", a["activation"], ("x",), ("y",), dict(a["activation_attrs"]))
            form = spec.make(act_node, graph)
        if form is None or form[1]:
            return None
        act = form[0]
    t = graph.values[node.outputs[0]]
    n = t.shape[0]
    chunks = min(MAXPOOL_CHUNKS, n) if t.rank == 4 and t.layout == "nchw" else 1
    step = -(-n // chunks)
    indices = TensorType((step, *t.shape[1:]), "int64", t.layout)
    bounds = [(b, min(step, n - b)) for b in range(0, n, step)]
    pool = torch.ops.aten.max_pool2d_with_indices.out

    def max_pool2d_out(x, o, idx):
        for b, m in bounds:
            pool(
                x.narrow(0, b, m), k, s, p, d, c, out=o.narrow(0, b, m), indices=idx.narrow(0, 0, m)
            )
        if act is not None:
            act(o, o)

    return max_pool2d_out, (indices,)


register(
    OpDef(
        "max_pool2d",
        Bound.IO,
        _max_pool2d,
        flops_fn=pool_flops,
        loops=loops.max_pool_loops,
        per_sample=True,
        layout_preserving=True,
        out=OutVariant(_max_pool2d_out),
        temp_bytes_per_elem=INDEX_BYTES,
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


def _avg_pool2d_out(node: Node, graph: Graph) -> OutForm:
    a = node.attrs
    args = (
        a["kernel_size"],
        a["stride"] or a["kernel_size"],
        a["padding"],
        a["ceil_mode"],
        a["count_include_pad"],
        a["divisor_override"],
    )

    def avg_pool2d_out(x, o):
        torch._C._nn.avg_pool2d(x, *args, out=o)

    return avg_pool2d_out, ()


register(
    OpDef(
        "avg_pool2d",
        Bound.IO,
        _avg_pool2d,
        flops_fn=pool_flops,
        loops=loops.avg_pool_loops,
        per_sample=True,
        layout_preserving=True,
        out=OutVariant(_avg_pool2d_out),
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


def _adaptive_avg_pool2d_out(node: Node, graph: Graph) -> OutForm:
    size = node.attrs["output_size"]

    def adaptive_avg_pool2d_out(x, o):
        torch._C._nn.adaptive_avg_pool2d(x, size, out=o)

    return adaptive_avg_pool2d_out, ()


def _spatial_mean_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    """The gradient of a mean over both spatial dims of a 4-d value (``mean`` over (2, 3),
    ``adaptive_avg_pool2d`` to 1x1): ``gy / (H * W)`` at the output's (N, C, 1, 1) shape,
    the input's gradient in broadcast form (``passes/autodiff.py``: the same at every
    pixel). PyTorch's ``mean`` backward: ``grad.expand(sizes) / numel``. Any other mean or
    pooling has no rule (its group's backward recomputes through PyTorch)."""
    x, y = node.inputs[0], node.outputs[0]
    xt, yt = e.type_of(x), e.type_of(y)
    n, c, h, w = xt.shape if xt.rank == 4 else (0, 0, 0, 0)
    spatial = xt.rank == 4 and (
        (node.op == "mean" and {int(d) % 4 for d in node.attrs["dims"]} == {2, 3})
        or (node.op == "adaptive_avg_pool2d" and yt.shape == (n, c, 1, 1))
    )
    if not spatial:
        raise NotFusable(f"{node.op} over these dims has no backward rule")
    if e.type_of(gy).shape != yt.shape:
        raise NotFusable(f"{node.op}'s output gradient reaches it in broadcast form")
    if yt.shape != (n, c, 1, 1):  # mean without keepdim: (N, C)
        gy = e.emit("reshape", (gy,), {"shape": (n, c, 1, 1)})
    return (e.emit("div", (gy,), {"scalar": float(h * w)}),)


register(
    OpDef(
        "adaptive_avg_pool2d",
        Bound.IO,
        _adaptive_avg_pool2d,
        flops_fn=pool_flops,
        loops=loops.adaptive_avg_pool_loops,
        per_sample=True,
        layout_preserving=True,
        # ATen's kernel restrides a strided (concat slice) output
        out=OutVariant(_adaptive_avg_pool2d_out, dense_only=True),
        grad=_spatial_mean_grad,
    )
)
register(
    OpDef(
        "adaptive_max_pool2d",
        Bound.IO,
        _adaptive_max_pool2d,
        flops_fn=pool_flops,
        loops=loops.adaptive_max_pool_loops,
        per_sample=True,
        layout_preserving=True,
        temp_bytes_per_elem=INDEX_BYTES,
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
        out=OutVariant(_max_pool2d_out),
        temp_bytes_per_elem=INDEX_BYTES,
    )
)


def _mean(node: Node) -> Kernel:
    dims, keep = tuple(node.attrs["dims"]), bool(node.attrs["keepdim"])

    def mean(x):
        return torch.mean(x, dims, keep)

    return mean


def _mean_out(node: Node, graph: Graph) -> OutForm:
    dims, keep = tuple(node.attrs["dims"]), bool(node.attrs["keepdim"])

    def mean_out(x, o):
        torch.mean(x, dims, keep, out=o)

    return mean_out, ()


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
        out=OutVariant(_mean_out),
        grad=_spatial_mean_grad,
    )
)
