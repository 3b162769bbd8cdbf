"""The buffer planner: liveness of every value over a plan's units, and one reused arena.

Given the units of a plan (in execution order), :func:`plan_memory` decides where each
value lives:

- ``view``: a view-like op (flatten, reshape, split, identity, ...), a ``to_layout`` that
  may answer with its input (:func:`_shares_storage`) or a fallback shares the storage of
  its input; the two are one *storage class* whose lifetime is the union (an op planned as
  a copy is copied at run time should ATen alias after all: :func:`_fresh_result`);
- ``inplace``: an elementwise op whose input class is dead afterwards writes into it
  (relu, batch-norm, add of a dead residual, ...: ``OutVariant.inplace_inputs``);
- ``arena``: the output of a unit that can write into a given tensor (a destination-passing
  ``Unit.out_fn``, or the ATen ``out=`` form of its op's registry entry, ``OpDef.out``)
  lives at a byte offset of one arena; classes whose lifetimes do not overlap share bytes
  (greedy by size, first fit, 64-byte alignment);
- ``slice``: an input of a concat is written straight into its slice of the concat's
  destination (through ``out=`` or, for a producer without one, a copy right after it);
  a concat whose inputs already sit side by side in one destination is a free view;
- ``spilled``: an arena-capable class that would raise the peak if it sat in the arena
  (the arena holds its size for the whole call, framework allocations come and go): it is
  allocated through the framework when first written, on every call;
- ``vendor``: what ATen allocates itself (convolutions have no ``out=`` on CPU oneDNN;
  copying their result into the arena costs more than it saves); the plan frees it at its
  last use;
- ``fresh``: anything the user receives (graph outputs and everything aliased with them)
  gets a fresh framework allocation on every call, so a later call never overwrites a
  tensor the user holds. Graph inputs and parameters are never written;
- ``owned``: a graph input that the caller hands over to the plan (the cut values of a
  batch-chunked plan, runtime/chunked.py): it dies at its last read like a vendor value.

``Options(check_memory=True)`` (``MIDDLEWARE_CHECK_MEMORY=1``) checks after every step
that no output lands in arena bytes other than its own class's (:class:`MemoryCheckError`).

The arena is one ``torch.empty(nbytes, dtype=torch.uint8)`` on the plan's device, made
when the plan is built; the wrapped step functions hold views of it, so it lives exactly as
long as the plan (and is released when the ``OptimizedModule`` that caches the plan is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..graph import Graph, Node, TensorType
from ..ops import OutForm, get_op, torch_dtype
from ..options import check_memory_default

ALIGN = 64
# How far (a fraction of the least possible peak) keeping classes in the arena may raise the
# peak; 0 puts memory first. A class in the arena costs no allocation or page faults per call.
ARENA_PEAK_SLACK = 0.0


# ---------------------------------------------------------------------- the plan record
@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one value lives. ``kind``: input, param, fresh, vendor, arena, spilled, view (shares
    its storage class with another value), inplace (writes over an input), slice (a slice
    ``[start, start+length)`` along ``dim`` of value ``parent``)."""

    kind: str
    storage: str  # name of the storage class (its root value)
    parent: str | None = None
    dim: int = 0
    start: int = 0
    length: int = 0


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The buffer plan of one input signature.

    ``intervals[c]`` is the (first, last) unit index during which storage class ``c`` holds
    live data (both ends included; -1 means before the first unit); ``offsets[c]`` and
    ``sizes[c]`` place arena classes in the arena. Two arena classes whose intervals
    intersect never share a byte.
    """

    placements: dict[str, Placement]
    intervals: dict[str, tuple[int, int]]
    sizes: dict[str, int]
    offsets: dict[str, int]
    arena_bytes: int
    n_units: int
    input_bytes: int
    # transient framework allocations inside a unit (max-pool indices ATen makes and
    # drops, a result copied into its concat slice), by unit index
    temps: dict[int, int] = dataclasses.field(default_factory=dict)

    def arena_live_bytes(self) -> int:
        """The lower bound on the arena: the most arena bytes live at one unit."""
        return max((self._live_at(i, self.offsets) for i in range(self.n_units)), default=0)

    def vendor_peak_bytes(self) -> int:
        """The most bytes of framework-allocated values (vendor and fresh) live at one unit,
        as the plan predicts them."""
        own = {
            c
            for c, p in self.placements.items()
            if p.kind in ("vendor", "fresh", "spilled", "owned")
        }
        own = {c: 0 for c in own if c in self.intervals}
        return max(
            (self._live_at(i, own) + self.temps.get(i, 0) for i in range(self.n_units)),
            default=0,
        )

    def predicted_peak_io(self) -> int:
        """Inputs + arena + the vendor peak: what a live-storage tracker should measure."""
        return self.input_bytes + self.arena_bytes + self.vendor_peak_bytes()

    def _live_at(self, i: int, classes: dict[str, int]) -> int:
        total = 0
        for c in classes:
            a, b = self.intervals[c]
            if a <= i <= b:
                total += self.sizes[c]
        return total

    def check(self) -> None:
        """Raise if two arena classes with intersecting lifetimes share bytes."""
        items = sorted(self.offsets.items(), key=lambda kv: kv[1])
        for i, (c, off) in enumerate(items):
            if off % ALIGN or off + self.sizes[c] > self.arena_bytes:
                raise AssertionError(f"class {c} misplaced at {off}")
            a, b = self.intervals[c]
            for d, off2 in items[i + 1 :]:
                a2, b2 = self.intervals[d]
                if (
                    a <= b2
                    and a2 <= b
                    and off < off2 + self.sizes[d]
                    and off2 < off + self.sizes[c]
                ):
                    raise AssertionError(f"arena classes {c} and {d} overlap while both live")


# ------------------------------------------------------------------------- the planner
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


@dataclasses.dataclass
class PlannedUnits:
    """The planner's product: the memory plan, the arena and one step function per unit
    (same calling convention as ``Unit.fn``: input tensors in, output(s) returned)."""

    memory: MemoryPlan
    arena: torch.Tensor | None
    fns: list[Callable[..., Any]]


class _Planner:
    """One planning run over a graph's units (see :func:`plan_memory`)."""

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
                if of_permuted and nd.op in ("reshape", "flatten", "contiguous", "to_layout"):
                    self.copies.add(i)  # ATen copies it: a class of its own
                    continue
                if nd.op == "permute" and not _dense_permute(self.graph, nd):
                    permuted.update(u.outputs)
                elif of_permuted and get_op(nd.op).view_like:
                    permuted.update(u.outputs)
            if nd is not None and nd.op == "to_layout" and not _shares_storage(self.graph, nd):
                self.copies.add(i)  # a real conversion: a class of its own
            if u.runs_as == "fallback" or (nd is not None and _shares_storage(self.graph, nd)):
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
        if len(u.outputs) != 1 or u.runs_as == "fallback":
            return False
        if self.forms[j] is not None and self.single[j] is None:  # a generated kernel
            return _slice_contiguous(self.graph.values[dest], dim)
        if self.forms[j] is not None and _dense_only(self.single[j]):
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
            self.units[self.producer[m]].runs_as == "fallback"
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


def plan_memory(
    graph: Graph,
    units: Sequence[Any],
    device: torch.device,
    owned: Sequence[str] = (),
    check: bool | None = None,
) -> PlannedUnits:
    """Plan the buffers of ``units`` (``runtime.plan.Unit`` records, in execution order).

    Returns step functions with the units' calling convention that write into the arena,
    in place or into concat slices where the plan says so; they compute the same values.
    ``check`` (default: ``Options.check_memory``'s default, i.e. ``MIDDLEWARE_CHECK_MEMORY``)
    wraps every step with :func:`_checked`, which raises :class:`MemoryCheckError` when an
    output lands in arena bytes its value was not planned in.
    """
    pl = _Planner(graph, units, device)
    pl.share_views()
    pl.place_concats()
    pl.run_in_place()
    roots, where = pl.classes()
    for root, vs in roots.items():  # inputs handed over to the plan die at their last read
        if where[root] == "input" and all(v in owned for v in vs if v in graph.inputs):
            where[root] = "owned"
    n = pl.n

    placements: dict[str, Placement] = {}
    intervals: dict[str, tuple[int, int]] = {}
    sizes: dict[str, int] = {}
    for root, vs in roots.items():
        first = min(pl.producer.get(v, -1) for v in vs)
        last = max(pl.last_use.get(v, pl.producer.get(v, -1)) for v in vs)
        if where[root] in ("fresh", "input", "param"):
            last = n
        intervals[root] = (first, last)
        sizes[root] = graph.values[root].nbytes
    # scratch outputs of out-forms (max-pool indices) live for their unit only
    types = dict(graph.values)
    scratch: dict[int, list[str]] = {}
    for i, form in enumerate(pl.forms):
        if form is None or not form[1] or i in pl.inplace_of:
            continue
        if where.get(pl.cls.find(units[i].outputs[0])) != "arena":
            continue
        for j, t in enumerate(form[1]):
            name = f"%scratch{i}.{j}"
            scratch.setdefault(i, []).append(name)
            types[name] = t
            intervals[name], sizes[name] = (i, i), t.nbytes
            where[name] = "arena"
    # a producer without a destination form writes its concat slice by a copy: its own
    # result is a transient framework allocation during its unit
    copy_temps = {
        pl.producer[v]: graph.values[v].nbytes
        for v in pl.slice_of
        if pl.producer.get(v, -1) >= 0 and pl.forms[pl.producer[v]] is None
    }
    _spill(where, intervals, sizes, n, copy_temps, ARENA_PEAK_SLACK)
    for root, vs in roots.items():
        for v in vs:
            if v in pl.slice_of:
                p, dim, st, ln = pl.slice_of[v]
                placements[v] = Placement("slice", root, p, dim, st, ln)
            elif v == root:
                placements[v] = Placement(where[root], root)
            else:
                placements[v] = Placement(pl.kind.get(v, "view"), root)
    for items in scratch.values():
        for name in items:
            placements[name] = Placement(where[name], name)
    arena_classes = [r for r, w in where.items() if w == "arena"]
    offsets, arena_bytes = _assign_offsets(arena_classes, intervals, sizes)
    input_bytes = sum(graph.values[v].nbytes for v in graph.inputs if v not in owned)
    memory = MemoryPlan(placements, intervals, sizes, offsets, arena_bytes, n, input_bytes)

    arena = torch.empty(arena_bytes, dtype=torch.uint8, device=device) if arena_bytes else None
    getters: dict[str, Callable[[], torch.Tensor]] = {}
    holders: dict[str, list[Any]] = {}

    def getter(v: str) -> Callable[[], torch.Tensor]:
        """How a step gets the tensor of value ``v`` (arena view, slice, or the framework
        allocation of a spilled class made by the class's first writer)."""
        if v in getters:
            return getters[v]
        p = placements[v]
        if p.kind == "slice":
            parent, dim, start, length = getter(p.parent), p.dim, p.start, p.length
            static = getattr(parent, "static", None)
            if static is not None:
                g = _const(static.narrow(dim, start, length))
            else:

                def g() -> torch.Tensor:
                    return parent().narrow(dim, start, length)

        elif p.kind == "arena":
            g = _const(_arena_view(arena, offsets[v], types[v]))
        else:  # a spilled class: allocated by the framework when first written
            holder = holders.setdefault(v, [None])
            t = types[v]

            def g() -> torch.Tensor:
                if holder[0] is None:
                    holder[0] = _empty(t, device)
                return holder[0]

        getters[v] = g
        return g

    fns = [_step_fn(pl, i, u, where, scratch, getter, holders) for i, u in enumerate(units)]
    for i in pl.copies:  # planned as copies: never an alias at run time
        if fns[i] is units[i].fn:
            fns[i] = _fresh_result(fns[i])
    for i, (fn, u) in enumerate(zip(fns, units, strict=True)):
        nd = pl.single[i]
        temp = 0 if nd is None else get_op(nd.op).temp_bytes_per_elem
        if fn is u.fn and temp:  # ATen's max-pool indices
            memory.temps[i] = graph.values[u.outputs[0]].numel * temp
        elif getattr(fn, "__name__", "").startswith("copy_into"):
            memory.temps[i] = graph.values[u.outputs[0]].nbytes
        work = getattr(u.fn, "workspace_bytes", None)
        if work is not None:  # a Winograd convolution's transformed tiles
            memory.temps[i] = memory.temps.get(i, 0) + work(graph.values[u.outputs[0]].shape[0])
    if check is None:
        check = check_memory_default()
    if check and arena is not None:
        fns = [
            _checked(fn, i, u, memory, arena)
            for i, (fn, u) in enumerate(zip(fns, units, strict=True))
        ]
    return PlannedUnits(memory, arena, fns)


class MemoryCheckError(RuntimeError):
    """A step's output overlaps arena bytes that the buffer plan did not give its value
    (``Options(check_memory=True)``): a framework allocation aliasing the arena, or a value
    written over another one that is still live."""


def _checked(
    fn: Callable[..., Any], i: int, u: Any, memory: MemoryPlan, arena: torch.Tensor
) -> Callable[..., Any]:
    """``fn`` followed by the check that each output lies outside the arena, or inside the
    bytes of its own arena storage class (a view, an in-place write, a concat slice)."""
    base, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    own: list[tuple[int, int] | None] = []
    for v in u.outputs:
        root = memory.placements[v].storage
        off = memory.offsets.get(root)
        own.append(None if off is None else (base + off, base + off + memory.sizes[root]))
    multi = len(u.outputs) > 1

    def live_arena(lo: int, hi: int) -> list[str]:
        return [
            c
            for c, off in memory.offsets.items()
            if memory.intervals[c][0] <= i <= memory.intervals[c][1]
            and lo < base + off + memory.sizes[c]
            and base + off < hi
        ]

    def checked(*ins: Any) -> Any:
        r = fn(*ins)
        for v, t, mine in zip(u.outputs, r if multi else (r,), own, strict=True):
            if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device != arena.device:
                continue
            lo, hi = _byte_range(t)
            if hi <= base or lo >= end or (mine is not None and mine[0] <= lo and hi <= mine[1]):
                continue
            kind = memory.placements[v].kind
            raise MemoryCheckError(
                f"step {i} ({u.name}): output {v!r} (placed {kind!r}) overlaps arena bytes "
                f"[{lo - base}, {hi - base}) outside its own; live arena values there: "
                f"{live_arena(lo, hi) or 'none'}"
            )
        return r

    checked.__name__ = getattr(fn, "__name__", "step")  # the profiler names steps by it
    checked.checks_memory = True  # type: ignore[attr-defined]
    return checked


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` a strided tensor can touch."""
    lo = t.data_ptr()
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    return lo, lo + (span + 1) * t.element_size()


def _const(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    def g() -> torch.Tensor:
        return t

    g.static = t  # type: ignore[attr-defined]
    return g


def _empty(t: TensorType, device: torch.device) -> torch.Tensor:
    fmt = torch.channels_last if t.rank == 4 and t.layout == "nhwc" else torch.contiguous_format
    return torch.empty(t.shape, dtype=torch_dtype(t.dtype), device=device, memory_format=fmt)


def _spill(
    where: dict[str, str],
    intervals: dict[str, tuple[int, int]],
    sizes: dict[str, int],
    n: int,
    temps: dict[int, int],
    slack: float = 0.0,
) -> None:
    """Decide which arena-capable classes stay in the arena; the rest are "spilled" to
    framework allocations made when they are first written.

    The arena holds its size for the whole call while framework allocations come and go,
    so the peak is about ``max(arena live) + max(framework live)``, while allocating every
    class on demand reaches ``max(arena live + framework live)``, the least possible. A
    class in the arena is reused across calls (no allocation, no page faults), so: the
    biggest classes first, each goes into the arena unless that raises the peak above the
    on-demand one (e.g. a concat destination that lives far from the largest convolution
    output does; one beside it does not).
    """
    steps = n + 2

    def mask(c: str) -> np.ndarray:
        m = np.zeros(steps)
        a, b = intervals[c]
        m[a + 1 : b + 2] = sizes[c]
        return m

    candidates = [c for c, w in where.items() if w == "arena"]
    masks = {c: mask(c) for c in candidates}
    V = np.zeros(steps)
    for c, w in where.items():
        if c in intervals and w in ("vendor", "fresh", "owned", "arena"):
            V += masks[c] if c in masks else mask(c)
    for i, t in temps.items():
        V[i + 1] += t
    A = np.zeros(steps)
    best = (A + V).max() * (1.0 + slack)
    for c in sorted(candidates, key=lambda c: (-sizes[c], c)):
        A2, V2 = A + masks[c], V - masks[c]
        if A2.max() + V2.max() <= best:
            A, V = A2, V2
        else:
            where[c] = "spilled"


def _step_fn(
    pl: _Planner,
    i: int,
    u: Any,
    where: dict[str, str],
    scratch: dict[int, list[str]],
    getter: Callable[[str], Callable[[], torch.Tensor]],
    holders: dict[str, list[Any]],
) -> Callable[..., Any]:
    """The function the plan calls for unit ``i`` under the memory plan."""
    form = pl.forms[i]
    if i in pl.inplace_fn:
        return pl.inplace_fn[i]
    if i in pl.inplace_of:
        k, out_form = pl.inplace_of[i], form[0]

        def in_place(*ins):
            out_form(*ins, ins[k])
            return ins[k]

        return in_place
    if len(u.outputs) != 1:
        return u.fn
    y = u.outputs[0]
    root = pl.cls.find(y)
    if where[root] not in ("arena", "spilled") or pl.kind.get(y) == "view":
        return u.fn
    if y != root and y not in pl.slice_of:
        return u.fn
    writers = [v for v in pl.cls.members(root) if v == root or v in pl.slice_of]
    if where[root] == "spilled" and y == root and writers == [y]:
        if form is None or not scratch.get(i):
            return u.fn  # a spilled plain class: the unit allocates it itself
        # a destination form with scratch (the chunked max-pool): fresh result, small scratch
        out_form, t, device = form[0], pl.graph.values[y], pl.device
        extra = [
            (getter(nm) if where[nm] == "arena" else None, tt)
            for nm, tt in zip(scratch[i], form[1], strict=True)
        ]

        def alloc_into(*ins):
            o = _empty(t, device)
            out_form(*ins, o, *[e() if e is not None else _empty(tt, device) for e, tt in extra])
            return o

        return alloc_into
    get = getter(y)
    static = getattr(get, "static", None)
    # a spilled concat destination is released by its last writer (the outermost concat)
    last_writer = max(pl.producer[v] for v in writers)
    release = holders.get(root) if i == last_writer else None
    mode = pl.cat_mode.get(i)
    if mode == "view":
        if static is not None:

            def free_concat(*ins):
                return static

            return free_concat

        def free_concat_dyn(*ins):
            return get()

        return free_concat_dyn
    if mode == "dest":
        slices = []
        start, dim = 0, pl.single[i].attrs["dim"] % pl.graph.values[y].rank
        for j, x in enumerate(u.inputs):
            size = pl.graph.values[x].shape[dim]
            # copied unless it already lives in exactly this slice (an input that is also
            # a view of another slice of the destination, or repeated, is copied)
            if pl.slice_of.get(x) != (y, dim, start, size):
                slices.append((j, dim, start, size))
            start += size

        def concat_into(*ins):
            o = get()
            for j, d, st, ln in slices:
                o.narrow(d, st, ln).copy_(ins[j])
            if release is not None:
                release[0] = None
            return o

        return concat_into
    if form is not None:
        out_form = form[0]
        extra_get = [getter(nm) if where[nm] == "arena" else None for nm in scratch.get(i, ())]
        extra_types = form[1] if scratch.get(i) else ()
        if static is not None and all(e is not None for e in extra_get):
            extra = (static,) + tuple(e() for e in extra_get)

            def into(*ins):
                out_form(*ins, *extra)
                return static

            return into
        device = pl.device

        def into_dyn(*ins):
            o = get()
            tmp = [
                e() if e is not None else _empty(t, device)
                for e, t in zip(extra_get, extra_types, strict=True)
            ]
            out_form(*ins, o, *tmp)
            return o

        return into_dyn
    fn = u.fn  # no destination form, placed in a concat slice: copy right after it

    if static is not None:

        def copy_into(*ins):
            static.copy_(fn(*ins))
            return static

        return copy_into

    def copy_into_dyn(*ins):
        o = get()
        o.copy_(fn(*ins))
        return o

    return copy_into_dyn


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


def _fresh_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` whose result never shares its input's storage. The planner gives a class of
    its own to a ``to_layout`` that converts and to a reshape of a permuted view, from the
    value types; where the run-time strides allow ATen a view after all (a framework result
    strided otherwise than its type, a permutation of size-1 dims, a permutation undone) the
    result is copied, so that it never reads bytes the plan reuses."""

    def fresh(x: torch.Tensor) -> torch.Tensor:
        y = fn(x)
        if y.numel() and y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            y = y.clone(memory_format=torch.preserve_format)
        return y

    fresh.__name__ = getattr(fn, "__name__", "fresh")
    return fresh


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
    if len(u.nodes) != 1 or u.runs_as != "vendor":
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
    if getattr(u, "out_fn", None) is not None and u.runs_as == "generated":
        return u.out_fn, ()
    return None


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


def _assign_offsets(
    classes: Sequence[str], intervals: dict[str, tuple[int, int]], sizes: dict[str, int]
) -> tuple[dict[str, int], int]:
    """Greedy by size, first fit: the biggest class first, at the lowest aligned offset that
    overlaps no placed class whose lifetime intersects its own."""
    offsets: dict[str, int] = {}
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    total = 0
    for c in sorted(classes, key=lambda c: (-sizes[c], intervals[c], c)):
        a, b = intervals[c]
        size = _align(max(sizes[c], 1))
        off = 0
        for o, e in sorted((o, e) for o, e, a2, b2 in placed if a <= b2 and a2 <= b):
            if off + size <= o:
                break
            off = max(off, _align(e))
        offsets[c] = off
        placed.append((off, off + size, a, b))
        total = max(total, off + size)
    return offsets, total


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _arena_view(arena: torch.Tensor, offset: int, t: TensorType) -> torch.Tensor:
    """A typed view of ``t.nbytes`` arena bytes at ``offset``, strided in ``t``'s layout."""
    flat = arena[offset : offset + t.nbytes].view(torch_dtype(t.dtype))
    if t.rank == 4 and t.layout == "nhwc":
        n, c, h, w = t.shape
        return flat.as_strided(t.shape, (h * w * c, 1, w * c, c))
    return flat.view(t.shape)
