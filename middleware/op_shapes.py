"""Registry entries that select, repeat or move elements: ``slice`` (basic indexing: ints,
slices with steps, new axes, on any dim; ``narrow``/``select``/``getitem``), ``expand``,
``repeat``, ``roll``, ``pad`` and ``take`` (``x[index]`` with an integer tensor).

They run as framework calls (graph nodes, not fallbacks: their neighbours are optimized
around them; no loop semantics yet). ``slice`` and ``expand`` return strided views of their
input (``view_like``/``strided_view``: the buffer planner keeps the input's storage alive);
the others copy. None of them is marked per-sample: batch slicing stops at them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .enums import Bound
from .graph import Node
from .op_registry import Kernel, OpDef, register

# One item of a ``slice`` node's ``index`` attr: ("slice", start, stop, step) with start and
# stop resolved against the dim's size (0 <= start <= stop <= size, step >= 1), ("int", i)
# with 0 <= i < size (the dim is dropped), or ("new",) (a new axis of size 1, ``None``).
IndexItem = tuple[Any, ...]


def index_of(items: Sequence[IndexItem]) -> tuple[Any, ...]:
    """The Python index ``x[...]`` a ``slice`` node's ``index`` attr spells."""
    out: list[Any] = []
    for it in items:
        if it[0] == "slice":
            out.append(slice(it[1], it[2], it[3]))
        elif it[0] == "int":
            out.append(int(it[1]))
        elif it[0] == "new":
            out.append(None)
        else:
            raise ValueError(f"bad index item {it!r}")
    return tuple(out)


def _slice(node: Node) -> Kernel:
    index = index_of(node.attrs["index"])

    def slice_(x):
        return x[index]

    return slice_


register(
    OpDef(
        "slice",
        Bound.IO,
        _slice,
        view_like=True,
        strided_view=True,
        flops_per_elem=0.0,
    )
)


def _expand(node: Node) -> Kernel:
    shape = tuple(node.attrs["shape"])

    def expand(x):
        return x.expand(shape)

    return expand


# a view whose broadcast dims have stride 0
register(OpDef("expand", Bound.IO, _expand, view_like=True, strided_view=True, flops_per_elem=0.0))


def _repeat(node: Node) -> Kernel:
    repeats = tuple(node.attrs["repeats"])

    def repeat(x):
        return x.repeat(repeats)

    return repeat


register(OpDef("repeat", Bound.IO, _repeat, flops_per_elem=0.0))


def _roll(node: Node) -> Kernel:
    shifts, dims = tuple(node.attrs["shifts"]), tuple(node.attrs["dims"])

    def roll(x):
        return torch.roll(x, shifts, dims)

    return roll


register(OpDef("roll", Bound.IO, _roll, flops_per_elem=0.0))


def _pad(node: Node) -> Kernel:
    pad, mode, value = tuple(node.attrs["pad"]), node.attrs["mode"], node.attrs["value"]

    def pad_(x):
        if mode == "constant":
            return F.pad(x, pad, mode, value)
        return F.pad(x, pad, mode)

    return pad_


# F.pad: "constant" (any value; negative pads crop), "reflect", "replicate", "circular"
register(OpDef("pad", Bound.IO, _pad, flops_per_elem=0.0))


def _take(node: Node) -> Kernel:
    def take(x, index):
        return x[index]

    return take


# ``x[index]``: rows of ``x`` (dim 0) picked by an integer tensor ``index`` (a gather; a
# relative-position table read through its index buffer)
register(OpDef("take", Bound.IO, _take, flops_per_elem=0.0))
