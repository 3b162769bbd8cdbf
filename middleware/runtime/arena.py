"""The arena: lifetimes of the storage classes, which of them share one arena, and where.

The buffer planner's second stage (runtime/memory.py tells the whole story): each class
lives from its first write to its last read; arena-capable classes whose lifetimes do not
overlap share bytes (greedy by size, first fit, 64-byte alignment); a class that would
raise the peak in the arena is "spilled" to framework allocations. The product is the
:class:`MemoryPlan` record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..graph import Graph, TensorType
from .storage_classes import StorageClasses

ALIGN = 64


# How far (a fraction of the least possible peak) keeping classes in the arena may raise the
# peak; 0 puts memory first. A class in the arena costs no allocation or page faults per call.
ARENA_PEAK_SLACK = 0.0


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


@dataclasses.dataclass
class BufferPlan:
    """Where every value lives (``memory``) and what step construction needs besides: the
    storage classes, where each class lives (``where``), the scratch values of each unit's
    out= form (``scratch``, by unit index) and the types of all values, scratch included."""

    classes: StorageClasses
    memory: MemoryPlan
    where: dict[str, str]
    scratch: dict[int, list[str]]
    types: dict[str, TensorType]


def plan_buffers(
    graph: Graph,
    units: Sequence[Any],
    device: torch.device,
    owned: Sequence[str] = (),
    spill: bool = True,
) -> BufferPlan:
    """The buffer plan of ``units`` (``Unit`` records, in execution order); ``owned``: graph
    inputs handed over to the plan, which die at their last read."""
    pl = StorageClasses(graph, units, device)
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
    if spill:  # (without: every arena-capable class stays in the arena, the native runner's
        # condition: no intermediate allocated during a call)
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
    return BufferPlan(pl, memory, where, scratch, types)


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
