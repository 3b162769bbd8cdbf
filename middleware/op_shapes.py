"""Registry entries that select, repeat or move elements: ``slice`` (basic indexing: ints,
slices with steps, new axes, on any dim; ``narrow``/``select``/``getitem``), ``expand``,
``repeat``, ``roll``, ``pad`` and ``take`` (``x[index]`` with an integer tensor).

``slice``, ``expand``, ``repeat`` and ``roll`` have loop semantics on values of up to four
dims (an index remap of the input: an offset and a step, a broadcast, ``mod`` the input's
size), so they join generated groups; alone they run as framework calls (``slice`` and
``expand`` return strided views of their input, ``view_like``/``strided_view``: the buffer
planner keeps the input's storage alive; the others copy). ``pad`` and ``take`` have none
yet. None of them is marked per-sample: batch slicing stops at them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .enums import Bound
from .graph import Graph, Node
from .loops import DIMS, Load, NotFusable, OpLoops, broadcast_load, logical_dims
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


def _dims(graph: Graph, node: Node) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The logical dims of the input's and the output's axes (NotFusable past four dims)."""
    x = graph.values[node.inputs[0]]
    y = graph.values[node.outputs[0]]
    return logical_dims(x.rank), logical_dims(y.rank)


def _slice_loops(graph: Graph, node: Node) -> OpLoops:
    """``x[index]``: each kept input axis read at ``start + step * o`` of its output axis,
    an int index at its constant, a new axis read nowhere."""
    x = node.inputs[0]
    in_dims, out_dims = _dims(graph, node)
    idx = ["0"] * 4
    i = j = 0
    for it in node.attrs["index"]:
        if it[0] == "new":
            j += 1
            continue
        if it[0] == "int":
            idx[in_dims[i]] = str(int(it[1]))
        else:
            start, step = int(it[1]), int(it[3])
            o = DIMS[out_dims[j]]
            term = o if step == 1 else f"{step}*{o}"
            idx[in_dims[i]] = term if start == 0 else f"{start} + {term}"
            j += 1
        i += 1
    for k in range(i, len(in_dims)):  # the axes the index leaves whole
        idx[in_dims[k]] = DIMS[out_dims[j + k - i]]
    return OpLoops("pointwise", Load(x, tuple(idx)))


register(
    OpDef(
        "slice",
        Bound.IO,
        _slice,
        view_like=True,
        strided_view=True,
        flops_per_elem=0.0,
        loops=_slice_loops,
    )
)


def _expand(node: Node) -> Kernel:
    shape = tuple(node.attrs["shape"])

    def expand(x):
        return x.expand(shape)

    return expand


def _expand_loops(graph: Graph, node: Node) -> OpLoops:
    """A broadcast: the input's size-1 axes read at 0 (the framework's alignment from the
    right)."""
    _dims(graph, node)
    x = node.inputs[0]
    return OpLoops("pointwise", broadcast_load(x, graph.values[x], graph.values[node.outputs[0]]))


# a view whose broadcast dims have stride 0
register(
    OpDef(
        "expand",
        Bound.IO,
        _expand,
        view_like=True,
        strided_view=True,
        flops_per_elem=0.0,
        loops=_expand_loops,
    )
)


def _repeat(node: Node) -> Kernel:
    repeats = tuple(node.attrs["repeats"])

    def repeat(x):
        return x.repeat(repeats)

    return repeat


def _repeat_loops(graph: Graph, node: Node) -> OpLoops:
    """Tiles of the input: each input axis (aligned from the right with ``repeats``) read at
    its output coordinate ``mod`` its size."""
    in_dims, out_dims = _dims(graph, node)
    x = node.inputs[0]
    shape = graph.values[x].shape
    lead = len(out_dims) - len(in_dims)
    idx = ["0"] * 4
    for i, d in enumerate(in_dims):
        o = DIMS[out_dims[i + lead]]
        if shape[i] == 1:
            idx[d] = "0"
        elif int(node.attrs["repeats"][i + lead]) == 1:
            idx[d] = o
        else:
            idx[d] = f"{o} mod {shape[i]}"
    return OpLoops("pointwise", Load(x, tuple(idx)))


register(OpDef("repeat", Bound.IO, _repeat, flops_per_elem=0.0, loops=_repeat_loops))


def _roll(node: Node) -> Kernel:
    shifts, dims = tuple(node.attrs["shifts"]), tuple(node.attrs["dims"])

    def roll(x):
        return torch.roll(x, shifts, dims)

    return roll


def _roll_loops(graph: Graph, node: Node) -> OpLoops:
    """Each rolled axis read at ``(o + size - shift) mod size`` (shifts of any sign, summed
    per axis as ``torch.roll`` does); a roll of the flattened tensor (no dims) has none."""
    in_dims, _ = _dims(graph, node)
    x = node.inputs[0]
    shape = graph.values[x].shape
    dims = tuple(node.attrs["dims"])
    if not dims:
        raise NotFusable("roll of the flattened tensor (no dims)")
    shift = [0] * len(shape)
    for s, d in zip(node.attrs["shifts"], dims, strict=True):
        shift[d % len(shape)] += int(s)
    idx = ["0"] * 4
    for i, d in enumerate(in_dims):
        o, size = DIMS[d], shape[i]
        s = shift[i] % size if size else 0
        idx[d] = "0" if size == 1 else (o if s == 0 else f"({o} + {size - s}) mod {size}")
    return OpLoops("pointwise", Load(x, tuple(idx)))


register(OpDef("roll", Bound.IO, _roll, flops_per_elem=0.0, loops=_roll_loops))


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
