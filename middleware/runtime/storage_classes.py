"""Storage classes: which values of a plan share one buffer.

The buffer planner's first stage (runtime/memory.py tells the whole story). Over the
units of a plan, in execution order, :class:`StorageClasses` joins values into classes
(union-find) whose members live in the same storage: views and fallbacks with their input,
concat inputs with their slice of the destination, an elementwise result with the dead
input it overwrites. What an op allows (its ``out=`` form, the inputs it may overwrite,
whether it writes dense outputs only) comes from its registry entry (``OpDef.out``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..backends.interface import NativeCall
from ..backends.x86.runner import strided_copy
from ..enums import RunsAs
from ..graph import Graph, Node, TensorType
from ..ops import OutForm, get_op


class _Classes:
    """Union-find over value names; ``join(keep, other)`` keeps ``keep``'s root. Each root
    keeps the list of its members."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.groups: dict[str, list[str]] = {}

    def find(self, v: str) -> str:
        p = self.parent.get(v)
        if p is None:
            self.parent[v] = v
            self.groups[v] = [v]
            return v
        if p != v:
            p = self.parent[v] = self.find(p)
        return p

    def join(self, keep: str, other: str) -> None:
        a, b = self.find(keep), self.find(other)
        if a != b:
            self.parent[b] = a
            self.groups[a].extend(self.groups.pop(b))

    def members(self, root: str) -> list[str]:
        return list(self.groups[self.find(root)])


class StorageClasses:
    """One planning run over a graph's units: its stages (``share_views``,
    ``place_concats``, ``run_in_place``) join values into storage classes, ``classes``
    says where each class lives (see ``runtime.memory.plan_memory``)."""

    def __init__(self, graph: Graph, units: Sequence[Any], device: torch.device) -> None:
        self.graph = graph
        self.device = device
        self.units = units
        self.n = len(units)
        self.single = [_single_node(graph, u) for u in units]
        self.forms = [_out_form(graph, u, nd) for u, nd in zip(units, self.single, strict=True)]
        self.outputs = set(graph.output_values())
        self.producer: dict[str, int] = {}
        self.last_use: dict[str, int] = {}
        for i, u in enumerate(units):
            for v in u.outputs:
                self.producer[v] = i
            for v in u.inputs:
                self.last_use[v] = i
        self.cls = _Classes()
        for v in graph.values:
            self.cls.find(v)
        self.kind: dict[str, str] = {v: "input" for v in graph.inputs}
        self.kind.update({p: "param" for p in graph.params})
        self.inplace_of: dict[int, int] = {}  # unit -> index of the input it overwrites
        self.inplace_fn: dict[int, Callable[..., Any]] = {}  # unit -> its own in-place call
        self.slice_of: dict[str, tuple[str, int, int, int]] = {}  # root -> (dest, dim, start, len)
        self.cat_mode: dict[int, str] = {}  # unit -> "view" | "dest"
        # units of view-like ops (and to_layout) planned as copies, whose result must then
        # never alias their input at run time (see _fresh_result)
        self.copies: set[int] = set()

    # -------------------------------------------------------------- class queries
    def pinned(self, root: str) -> bool:
        """The class holds a graph input, a parameter or a graph output."""
        return any(
            v in self.outputs or self.kind.get(v) in ("input", "param")
            for v in self.cls.members(root)
        )

    def class_last(self, root: str) -> int:
        return max(
            (self.last_use.get(v, self.producer.get(v, -1)) for v in self.cls.members(root)),
            default=-1,
        )

    # ------------------------------------------------------------------- stages
    def share_views(self) -> None:
        """View-like ops, fallbacks and the conversions ``to_layout`` may answer with its
        input (:func:`_shares_storage`) share the storage of their (non-parameter) inputs.

        A reshape of a permuted value (a channel shuffle's merge) cannot be a view: ATen
        copies it into a new tensor, which is then a class of its own."""
        permuted: set[str] = set()  # views whose strides are permuted
        for i, u in enumerate(self.units):
            nd = self.single[i]
            if nd is not None and nd.op != "fallback":
                of_permuted = bool(set(nd.inputs) & permuted)
                if of_permuted and get_op(nd.op).copies_permuted:
                    self.copies.add(i)  # ATen copies it: a class of its own
                    if self.forms[i] is None and len(u.outputs) == 1:
                        self.forms[i] = (_reshape_copy_form(), ())  # (into the arena)
                    continue
                if nd.op == "permute" and not _dense_permute(self.graph, nd):
                    permuted.update(u.outputs)
                elif of_permuted and get_op(nd.op).view_like:
                    permuted.update(u.outputs)
            if nd is not None and nd.op == "to_layout" and not _shares_storage(self.graph, nd):
                self.copies.add(i)  # a real conversion: a class of its own
            if u.runs_as == RunsAs.FALLBACK or (nd is not None and _shares_storage(self.graph, nd)):
                for v in u.outputs:
                    self.kind[v] = "view"
                    for x in u.inputs:
                        if x not in self.graph.params:
                            self.cls.join(x, v)

    def place_concats(self) -> None:
        """Concat inputs live in their slices of the destination. The latest concat goes
        first, so that an earlier concat over inputs already side by side in one
        destination (densenet's growing concats) becomes a free view of it."""
        g = self.graph
        for i in reversed(range(self.n)):
            nd = self.single[i]
            if nd is None or nd.op != "cat" or self.forms[i] is None:
                continue
            d = nd.outputs[0]
            if self.pinned(self.cls.find(d)):
                continue
            dim = nd.attrs["dim"] % g.values[d].rank
            sizes = [g.values[x].shape[dim] for x in nd.inputs]
            run = self._side_by_side(nd.inputs, dim)
            if run is not None and d not in self.slice_of and self._alone(d):
                parent, start = run
                self.slice_of[d] = (parent, dim, start, sum(sizes))
                self.cls.join(parent, d)
                self.cat_mode[i] = "view"
                continue
            start = 0
            for x, size in zip(nd.inputs, sizes, strict=True):
                if nd.inputs.count(x) == 1 and self._can_place(x, dim, d):
                    self.slice_of[x] = (d, dim, start, size)
                    self.cls.join(d, x)
                    self.cat_mode[i] = "dest"
                start += size

    def _alone(self, v: str) -> bool:
        """``v``'s storage class holds only ``v`` and views of it."""
        return all(m == v or self.kind.get(m) == "view" for m in self.cls.members(self.cls.find(v)))

    def _structured(self, root: str) -> bool:
        """The class holds concat slices (or is a concat destination)."""
        parents = {p for p, _, _, _ in self.slice_of.values()}
        return any(m in self.slice_of or m in parents for m in self.cls.members(root))

    def _side_by_side(self, inputs: Sequence[str], dim: int) -> tuple[str, int] | None:
        if not inputs or any(x not in self.slice_of for x in inputs):
            return None
        parent, _, start, _ = self.slice_of[inputs[0]]
        pos = start
        for x in inputs:
            p, d, s, ln = self.slice_of[x]
            if p != parent or d != dim or s != pos:
                return None
            pos += ln
        return parent, start

    def _can_place(self, x: str, dim: int, dest: str) -> bool:
        """May concat input ``x`` be written straight into its slice of ``dest``? It must be
        the single output of a unit (not a view, an input or a parameter) and own its class."""
        if x in self.slice_of or self.kind.get(x) is not None or self.producer.get(x, -1) < 0:
            return False
        if self.cls.find(x) != x or self.cls.members(x) != [x] or x in self.outputs:
            return False
        j = self.producer[x]
        u = self.units[j]
        if len(u.outputs) != 1 or u.runs_as == RunsAs.FALLBACK:
            return False
        if self.forms[j] is not None and self.single[j] is None:  # a generated kernel
            return _slice_contiguous(self.graph.values[dest], dim)
        if self.forms[j] is not None and (
            _dense_only(self.single[j]) or getattr(self.forms[j][0], "dense_only", False)
        ):
            return _slice_contiguous(self.graph.values[dest], dim)
        return True

    def run_in_place(self) -> None:
        """An elementwise op writes over an input whose whole storage class (concat
        destinations and their slices included) dies at this unit."""
        for i, u in enumerate(self.units):
            nd, form = self.single[i], self.forms[i]
            # a convolution with a fused residual add can accumulate into the residual
            into = getattr(u.fn, "into_residual", None) if nd is not None else None
            if into is not None and nd.op == "conv2d" and nd.attrs.get("residual", False):
                ks: tuple[int, ...] = (len(u.inputs) - 1,)
            elif nd is None or form is None or form[1] or not _inplace_inputs(nd):
                continue
            else:
                ks, into = _inplace_inputs(nd), None
            y = u.outputs[0]
            if not self._alone(y) or y in self.slice_of or self.cls.find(y) != y:
                continue
            for k in ks:
                if k >= len(u.inputs):
                    continue
                x = u.inputs[k]
                if self.graph.values[x] != self.graph.values[y] or u.inputs.count(x) > 1:
                    continue
                root = self.cls.find(x)
                if self.pinned(root) or self.class_last(root) > i or not self._writable(root, x):
                    continue
                if any(self.cls.find(v) == root for j, v in enumerate(u.inputs) if j != k):
                    # another input shares the storage (a slice of it, a view): writing the
                    # result over x would overwrite what that input still has to read
                    continue
                if y in self.outputs and self._structured(root):
                    continue  # keep the concat slices in the arena; the output is fresh
                self.cls.join(x, y)
                self.kind[y] = "inplace"
                self.inplace_of[i] = k
                if into is not None:
                    self.inplace_fn[i] = into
                break

    def _writable(self, root: str, x: str) -> bool:
        """May an elementwise result be written over ``x`` (of class ``root``)? Not where a
        fallback made a member of the class: its strides are unknown (``expand`` gives a
        view whose elements share memory, which ATen refuses to write), and not where ``x``
        has more bytes than the class's root (a broadcast view of a smaller value)."""
        if self.graph.values[x].nbytes > self.graph.values[root].nbytes:
            return False
        return not any(
            self.units[self.producer[m]].runs_as == RunsAs.FALLBACK
            for m in self.cls.members(root)
            if self.producer.get(m, -1) >= 0
        )

    def classes(self) -> tuple[dict[str, list[str]], dict[str, str]]:
        """Storage classes (root -> members) and where each lives."""
        roots: dict[str, list[str]] = {}
        for v in self.graph.values:
            roots.setdefault(self.cls.find(v), []).append(v)
        where: dict[str, str] = {}
        for root, vs in roots.items():
            if any(self.kind.get(v) == "input" for v in vs):
                where[root] = "input"
            elif any(self.kind.get(v) == "param" for v in vs):
                where[root] = "param"
            elif any(v in self.outputs for v in vs):
                where[root] = "fresh"
            elif self._arena_capable(root):
                where[root] = "arena"
            else:
                where[root] = "vendor"
        return roots, where

    def _arena_capable(self, root: str) -> bool:
        j = self.producer.get(root, -1)
        if j < 0 or len(self.units[j].outputs) != 1 or self.kind.get(root) == "view":
            return False
        return self.forms[j] is not None or j in self.cat_mode


def _shares_storage(graph: Graph, nd: Node) -> bool:
    """The node's result may be (a view of) its input's memory: a view-like op, or a
    ``to_layout`` whose input is already stored in the target order (same layout, a rank
    other than 4, or C == 1 or H*W == 1 where both orders are one; ``ops.to_layout`` then
    returns the input or an ``as_strided`` alias of it). Such a result must keep its input's
    bytes alive, so it joins the input's storage class."""
    if get_op(nd.op).view_like:
        return True
    if nd.op != "to_layout":
        return False
    t, out = graph.values[nd.inputs[0]], graph.values[nd.outputs[0]]
    if t.rank != 4 or t.layout == out.layout or t.numel == 0:
        return True
    _, c, h, w = t.shape
    return c == 1 or h * w == 1


def _dense_permute(graph: Graph, nd: Node) -> bool:
    """A permute that reads a dense value and keeps it dense: a channels_last value viewed
    as its row-major (N,H,W,C) or back."""
    t = graph.values[nd.inputs[0]]
    dims = tuple(nd.attrs["dims"])
    if t.rank == 4 and t.layout == "nhwc":
        return dims == (0, 2, 3, 1)
    out = graph.values[nd.outputs[0]]
    return out.rank == 4 and out.layout == "nhwc" and dims == (0, 3, 1, 2)


def _single_node(graph: Graph, u: Any) -> Node | None:
    """The node of a one-node vendor unit that reads and writes exactly its node's values."""
    if len(u.nodes) != 1 or u.runs_as != RunsAs.VENDOR:
        return None
    nd = graph.node(u.nodes[0])
    if tuple(nd.inputs) != tuple(u.inputs) or tuple(nd.outputs) != tuple(u.outputs):
        return None
    return nd


def _out_form(graph: Graph, u: Any, nd: Node | None) -> OutForm | None:
    """How a unit writes into given tensors: the op's ATen ``out=`` form (``OpDef.out``) for
    a one-node vendor unit, else the unit's own destination-passing form (generated
    kernels)."""
    spec = None if nd is None else get_op(nd.op).out
    if spec is not None and len(nd.outputs) == 1:
        return spec.make(nd, graph)
    out_fn = getattr(u, "out_fn", None)
    if out_fn is None:
        return None
    if u.runs_as == RunsAs.GENERATED or (u.runs_as == RunsAs.VENDOR and len(u.outputs) == 1):
        return out_fn, ()  # (a vendor call's own: the direct oneDNN convolution's, the GEMV's)
    return None


def _reshape_copy_form() -> Callable[..., Any]:
    """The destination form of a reshape that copies (its input permuted): the input's
    elements in row-major order into the dense output, as ``reshape`` orders them. Its
    native call is the runner's strided copy."""

    def reshape_into(x: torch.Tensor, *rest: Any) -> None:
        out = rest[-1]
        if out.is_contiguous():
            out.view(x.shape).copy_(x)
        else:
            out.copy_(x.reshape(out.shape))

    def native(x: torch.Tensor, *rest: Any) -> NativeCall | None:
        out = rest[-1]
        if not out.is_contiguous() or out.dtype != torch.float32 or x.numel() != out.numel():
            return None
        return strided_copy(x, out)

    reshape_into.native = native  # type: ignore[attr-defined]
    return reshape_into


def _inplace_inputs(nd: Node) -> tuple[int, ...]:
    """The inputs whose storage the node's out= form may write its result over."""
    spec = get_op(nd.op).out
    return () if spec is None else spec.inplace_inputs


def _dense_only(nd: Node) -> bool:
    """The node's out= form writes dense outputs only (never into a strided concat slice)."""
    spec = get_op(nd.op).out
    return spec is not None and spec.dense_only


def _slice_contiguous(t: TensorType, dim: int) -> bool:
    """A slice along ``dim`` is dense in ``t``'s layout (generated kernels write dense
    outputs only)."""
    order = (0, 2, 3, 1) if t.layout == "nhwc" and t.rank == 4 else tuple(range(t.rank))
    return all(t.shape[a] == 1 for a in order[: order.index(dim)])
