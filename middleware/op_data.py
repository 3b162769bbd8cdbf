"""Registry entries that move data or none: cat, the views (flatten, reshape, permute,
contiguous, split, identity, dropout), to_layout, and the fallback to the framework."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import loops
from .enums import Bound
from .graph import Graph, Node
from .loops import Load, NotFusable, OpLoops
from .op_registry import GradEmitter, Kernel, OpDef, OutForm, OutVariant, register


def _cat(node: Node) -> Kernel:
    dim = node.attrs["dim"]

    def cat(*xs):
        return torch.cat(xs, dim)

    return cat


def _cat_out(node: Node, graph: Graph) -> OutForm:
    dim = node.attrs["dim"]

    def cat_out(*xs):
        torch.cat(xs[:-1], dim, out=xs[-1])

    return cat_out, ()


def _cat_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    """A channel concat's gradient: each input's channels of the output gradient
    (``narrow`` nodes; only from the output gradient's exact form)."""
    out_t = e.type_of(node.outputs[0])
    dim = int(node.attrs["dim"]) % max(1, out_t.rank)
    if dim != 1 or out_t.rank not in (2, 4):
        raise NotFusable(f"cat along dim {dim} of a rank {out_t.rank} value has no backward rule")
    if e.type_of(gy).shape != out_t.shape:
        raise NotFusable("cat's output gradient reaches it in broadcast form")
    grads, off = [], 0
    for v in node.inputs:
        ch = e.type_of(v).shape[1]
        grads.append(e.emit("narrow", (gy,), {"dim": 1, "start": off, "length": ch}))
        off += ch
    return tuple(grads)


# torch.cat writes a contiguous result when its inputs' strides disagree: stride-strict
register(
    OpDef(
        "cat",
        Bound.IO,
        _cat,
        flops_per_elem=0.0,
        loops=loops.cat_loops,
        per_sample=True,
        layout_preserving=True,
        stride_strict=True,
        out=OutVariant(_cat_out),
        grad=_cat_grad,
    )
)


def _narrow(node: Node) -> Kernel:
    dim, start, length = (int(node.attrs[k]) for k in ("dim", "start", "length"))

    def narrow(x):
        return x.narrow(dim, start, length)

    return narrow


def _narrow_loops(graph: Graph, node: Node) -> OpLoops:
    (x,) = node.inputs
    rank = graph.values[x].rank
    if int(node.attrs["dim"]) != 1 or rank not in (2, 4):
        raise NotFusable(f"narrow along dim {node.attrs['dim']} of a rank {rank} value")
    return OpLoops("pointwise", Load(x, ("n", f"c + {int(node.attrs['start'])}", "h", "w")))


# ``narrow(x)``, attrs ``dim`` (1), ``start``, ``length``: channels start.. of x, the
# gradient of one input of a concat (emitted by ``cat``'s backward rule, never by a
# frontend; its reference is a view, its generated kernel a copy)
register(
    OpDef(
        "narrow",
        Bound.IO,
        _narrow,
        flops_per_elem=0.0,
        loops=_narrow_loops,
        per_sample=True,
    )
)


def _channel_shuffle(node: Node) -> Kernel:
    groups = int(node.attrs["groups"])

    def channel_shuffle(x):
        return torch.channel_shuffle(x, groups)

    return channel_shuffle


def _channel_shuffle_loops(graph: Graph, node: Node) -> OpLoops:
    (x,) = node.inputs
    xt = graph.values[x]
    g = int(node.attrs["groups"])
    if xt.rank != 4 or xt.shape[1] % g:
        raise NotFusable(f"channel shuffle of a rank {xt.rank} value in {g} groups")
    per = xt.shape[1] // g
    return OpLoops("pointwise", Load(x, ("n", f"(c mod {g})*{per} + floor(c/{g})", "h", "w")))


# ``channel_shuffle(x)``, attr ``groups``: channel ``c`` of the output is channel
# ``(c mod g) * (C/g) + c // g`` of x (ShuffleNet's reshape -> transpose -> reshape, which
# the layout pass writes as this one op for a channels_last value: a gather over channels
# that fuses with the concat before it instead of a copy through a rank-5 view). ATen's
# channel_shuffle keeps the input's memory format.
register(
    OpDef(
        "channel_shuffle",
        Bound.IO,
        _channel_shuffle,
        flops_per_elem=0.0,
        loops=_channel_shuffle_loops,
        per_sample=True,
        layout_preserving=True,
    )
)


def _flatten(node: Node) -> Kernel:
    s, e = node.attrs["start_dim"], node.attrs["end_dim"]

    def flatten(x):
        return torch.flatten(x, s, e)

    return flatten


def _view_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    """A reshape's gradient: the output gradient reshaped to the input's shape (only
    from the output gradient's exact form: a broadcast form does not reshape)."""
    (x,) = node.inputs[:1]
    if e.type_of(gy).shape != e.type_of(node.outputs[0]).shape:
        raise NotFusable(f"{node.op}'s output gradient reaches it in broadcast form")
    return (e.emit("reshape", (gy,), {"shape": tuple(e.type_of(x).shape)}),)


register(
    OpDef(
        "flatten",
        Bound.IO,
        _flatten,
        view_like=True,
        flops_per_elem=0.0,
        loops=loops.reshape_loops,
        per_sample=True,
        copies_permuted=True,
        strided_view=True,
        grad=_view_grad,
    )
)


def _reshape(node: Node) -> Kernel:
    shape = tuple(node.attrs["shape"])

    def reshape(x):
        return torch.reshape(x, shape)

    return reshape


register(
    OpDef(
        "reshape",
        Bound.IO,
        _reshape,
        view_like=True,
        flops_per_elem=0.0,
        loops=loops.reshape_loops,
        per_sample=True,
        copies_permuted=True,
        strided_view=True,
        grad=_view_grad,
    )
)


def _permute(node: Node) -> Kernel:
    dims = tuple(node.attrs["dims"])

    def permute(x):
        return x.permute(dims)

    return permute


register(
    OpDef(
        "permute",
        Bound.IO,
        _permute,
        view_like=True,
        flops_per_elem=0.0,
        per_sample=True,
        strided_view=True,
    )
)


def _contiguous(node: Node) -> Kernel:
    def contiguous(x):
        return x.contiguous()

    return contiguous


register(
    OpDef(
        "contiguous",
        Bound.IO,
        _contiguous,
        view_like=True,
        flops_per_elem=0.0,
        loops=loops.view_loops,
        per_sample=True,
        copies_permuted=True,
    )
)


def _split(node: Node) -> Kernel:
    sizes, dim = tuple(node.attrs["split_sizes"]), node.attrs["dim"]

    def split(x):
        # one piece is one output: a tensor, as every single-output kernel returns (the
        # runtime would otherwise hand the caller a 1-tuple where it expects a tensor)
        pieces = tuple(torch.split(x, sizes, dim))
        return pieces if len(pieces) > 1 else pieces[0]

    return split


# views of its input, in the input's memory order
register(
    OpDef(
        "split",
        Bound.IO,
        _split,
        view_like=True,
        flops_per_elem=0.0,
        per_sample=True,
        layout_preserving=True,
        strided_view=True,
    )
)


def _identity(node: Node) -> Kernel:
    def identity(x):
        return x

    return identity


# dropout and stochastic depth (torchvision.ops.stochastic_depth) in inference are the
# identity; kept as ops of their own so reports name them
for _name in ("identity", "dropout", "stochastic_depth"):
    register(
        OpDef(
            _name,
            Bound.IO,
            _identity,
            view_like=True,
            flops_per_elem=0.0,
            loops=loops.view_loops,
            per_sample=True,
            layout_preserving=True,
        )
    )


def _to_layout(node: Node) -> Kernel:
    """The value unchanged, stored in memory order ``layout`` ("nchw": contiguous, "nhwc":
    channels_last; ranks other than 4 are made contiguous). Returns the input itself when it
    is already stored so, and an ``as_strided`` alias of it where both orders are one
    (C == 1 or H*W == 1): the buffer planner keeps such a result in its input's storage
    class (``runtime.storage_classes._shares_storage`` mirrors this rule). Inserted by the layout
    pass at the graph's inputs and outputs and around ops that need one memory order."""
    nhwc = node.attrs["layout"] == "nhwc"

    def to_layout(x):
        if x.dim() != 4:
            return x.contiguous()
        n, c, h, w = x.shape
        if nhwc:
            y, strides = x.contiguous(memory_format=torch.channels_last), (h * w * c, 1, w * c, c)
        else:
            y, strides = x.contiguous(), (c * h * w, h * w, w, 1)
        if y.stride() != strides:  # C == 1 or H*W == 1: the same memory, restrided
            y = y.as_strided(y.shape, strides, y.storage_offset())
        return y

    return to_layout


def _to_layout_grad(e: GradEmitter, node: Node, gy: str) -> tuple[str | None, ...]:
    """The output gradient in the input's memory order (training's backward rules)."""
    return (e.emit("to_layout", (gy,), {"layout": e.type_of(node.inputs[0]).layout}),)


# a change of memory order only: output element i is input element i; on logical
# (n, c, h, w) indices the identity (each value's loads and stores follow its own layout)
register(
    OpDef(
        "to_layout",
        Bound.IO,
        _to_layout,
        elementwise=True,
        flops_per_elem=0.0,
        loops=loops.view_loops,
        copies_permuted=True,
        layout_preserving=False,  # sets its own order
        grad=_to_layout_grad,
    )
)


class ValueRef:
    """Marks where the ``i``-th input tensor goes in a fallback call's argument template."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"${self.index}"


def _fill(template: Any, values: Sequence[Any]) -> Any:
    if isinstance(template, ValueRef):
        return values[template.index]
    if isinstance(template, tuple):
        return tuple(_fill(t, values) for t in template)
    if isinstance(template, list):
        return [_fill(t, values) for t in template]
    if isinstance(template, dict):
        return {k: _fill(v, values) for k, v in template.items()}
    if isinstance(template, slice):
        return slice(
            _fill(template.start, values),
            _fill(template.stop, values),
            _fill(template.step, values),
        )
    return template


def _fallback(node: Node) -> Kernel:
    fn = node.payload
    args_t, kwargs_t = node.attrs["args"], node.attrs["kwargs"]
    multi = len(node.outputs) > 1

    def fallback(*values):
        out = fn(*_fill(args_t, values), **_fill(kwargs_t, values))
        if multi:
            return tuple(out)
        # a call returning a 1-tuple (split/chunk/unbind into one piece) has one output
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out

    return fallback


# runs the original framework callable (module, function or method) unchanged
register(OpDef("fallback", Bound.IO, _fallback, flops_fn=lambda n, i, o: 0.0))
