"""group: consecutive nodes of one class form a group that runs as one step.

Rule, over the nodes in topological order: a node joins the group of a producer when

- both are io (I/O-bound groups are chains or small DAGs fused depth-first), or the node
  is view-like and has its producer's class (a view stays with the vendor call it views);
- neither is a fallback node (each fallback node is a group of its own);
- the groups stay schedulable: the graph of groups (an edge where a value crosses from
  one group to another) stays acyclic, which also makes every group convex (no path
  leaves a group and re-enters it), so each group's nodes can run back to back.

A node with several io producers first tries to merge all their groups with itself (a DAG
group, e.g. the parts of a concat), then each one alone (the latest producer first).
Compute and param nodes (vendor calls) start a group each.

On a device that computes a group one thread per output element (a GPU: threads in
warps, :func:`per_output_thread`; every thread pulls its inputs through the whole group,
recomputing what it needs),
io groups also follow what that costs, so that the backend takes every group as it is:

- an io node without loop semantics (no generated code: a dense convolution, softmax,
  split, permute) or reducing more than ``MAX_SERIAL_REDUCTION`` elements per output (one
  thread would reduce them serially; the framework's parallel reduction is faster) is a
  group of its own, which the backend leaves to the framework; except a view that a later
  node's loop semantics read through (a channel shuffle's reshape and permute,
  :func:`bypassed`);
- a reduction over more than ``MAX_PULLED_REDUCTION`` elements per output starts a group
  (it reads its input from memory instead of recomputing the producers for every element);
- a window that would recompute some element of its group more than ``MAX_RECOMPUTE``
  times (stacked overlapping windows) starts a group;
- a group with several values read outside it is cut into consecutive pieces with one
  each (a schedule computes one output).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ..enums import Bound
from ..graph import Graph, Node
from ..hardware import Hardware
from ..loops import Load, NotFusable, OpLoops, leaves, logical4
from ..ops import get_op, loops_of

# One thread sums a reduction's whole extent serially: mobilenet_v3_small's SE global
# pools (56x56 maps, 3136 elements per output, pulling a depthwise convolution through)
# took 4.7 ms of its 7.9 ms of kernel time on an H200 this way, ATen's parallel reduction
# 7 us each. Past this extent a reduction runs through the framework.
MAX_SERIAL_REDUCTION = 64
# A reduction over more than this many elements per output reads its input from memory
# instead of pulling the producers through: mobilenet_v3_small's 7x7 SE pools recomputed
# a 5x5 depthwise convolution 49 times per thread (64 us for one such group on an H200),
# while the convolution's output is written to memory for the SE multiply anyway.
MAX_PULLED_REDUCTION = 8
# A thread recomputes the producers of a window for every tap; stacked overlapping windows
# multiply that work (3x3/1 pooling of 3x3/1 pooling recomputes the first 81 times).
MAX_RECOMPUTE = 64.0


def per_output_thread(hardware: Hardware | None) -> bool:
    """Whether ``hardware`` runs a group one thread per output element: a SIMT device,
    whose threads run in warps (``Hardware.warp_size`` > 1: a GPU), where a group's
    kernel gives each thread one output element and no scratch to share."""
    return hardware is not None and hardware.warp_size > 1


def _semantics(graph: Graph, n: Node) -> OpLoops | None:
    try:
        return loops_of(graph, n)
    except NotFusable:
        return None


def reduction_extent(graph: Graph, n: Node) -> int:
    """How many input elements one output element of ``n`` reduces along its adaptive
    windows (global pools, means); 1 for pointwise ops, fixed windows and ops without loop
    semantics."""
    sem = _semantics(graph, n)
    if sem is None or not sem.windows:
        return 1
    in4 = logical4(graph.values[n.inputs[0]])
    out4 = logical4(graph.values[n.outputs[0]])
    extent = 1
    for win in sem.windows:
        if not win.taps:  # adaptive: the widest window along this dim
            extent *= -(-in4[win.dim] // max(out4[win.dim], 1))
    return extent


def overlap(graph: Graph, n: Node) -> float:
    """How many output elements of ``n`` read each input element (1 for pointwise ops)."""
    sem = _semantics(graph, n)
    if sem is None:
        return 1.0
    return math.prod(win.reads_per_input for win in sem.windows)


def io_groups(graph: Graph) -> list[list[str]]:
    """The node names of every group whose nodes are all io, in the graph's order (the
    groups set by :func:`group`)."""
    groups: dict[int, list[str]] = {}
    bad: set[int] = set()
    for n in graph.nodes():
        if n.group is None:
            continue
        groups.setdefault(n.group, []).append(n.name)
        if n.bound != Bound.IO:
            bad.add(n.group)
    return [names for gid, names in groups.items() if gid not in bad]


def generated_groups(graph: Graph, hardware: Hardware | None = None) -> list[list[str]]:
    """The io groups a backend generates kernels for, in execution order: the passes'
    groups, or, for a graph the passes did not group (tests, a backend called directly),
    the groups :func:`group` draws for ``hardware`` (one grouping rule for every backend)."""
    if not any(n.group is not None for n in graph.nodes()):
        graph = group(graph, hardware)
    return io_groups(graph)


def group(graph: Graph, hardware: Hardware | None = None) -> Graph:
    """Set ``group`` (an int id) on every node and order the nodes group by group.

    Expects: ``bound`` set on every node by the classify pass (a node without one, when
    classify is switched off, gets its op's default class from the catalogue).
    Guarantees: every node has a group; the nodes of a group share one class, and form
    one contiguous run in the new graph's node order, which is still topological; the
    groups are numbered 0, 1, ... in that order; each group is convex; a fallback node is
    alone in its group. The values, params and outputs are unchanged. ``hardware``: the
    device's description (one thread per output element on CUDA: see the module's doc).
    """
    nodes = [
        n if n.bound is not None else n.replace(bound=get_op(n.op).bound) for n in graph.nodes()
    ]
    by_name = {n.name: n for n in nodes}
    position = {n.name: i for i, n in enumerate(nodes)}
    state = _Groups()
    per_point = _PerPoint(graph) if per_output_thread(hardware) else None
    for n in nodes:
        producers = _producers(graph, n, by_name, position)
        candidates = [
            p.name
            for p in producers
            if _joins(n, p) and (per_point is None or per_point.joins(n, p))
        ]
        gid = state.place(n.name, [p.name for p in producers], candidates)
        if per_point is not None:
            per_point.placed(n, [p for p in producers if state.of[p.name] == gid])
    order = state.order(nodes)
    runs: list[list[Node]] = []
    for n in order:  # the groups' nodes are contiguous in ``order``
        if not runs or state.of[runs[-1][0].name] != state.of[n.name]:
            runs.append([])
        runs[-1].append(n)
    if per_point is not None:
        runs = [piece for run in runs for piece in _one_output_pieces(graph, run)]
    records = [
        (n.replace(group=i), [graph.values[v] for v in n.outputs])
        for i, run in enumerate(runs)
        for n in run
    ]
    return graph.rebuild(records)


def _reads(sem: OpLoops) -> set[str]:
    """The values a node's loop semantics load."""
    exprs = [sem.expr] + ([sem.body] if sem.body is not None else [])
    out = {x.value for e in exprs for x in leaves(e) if isinstance(x, Load)}
    return out | {v for v, _, _ in sem.slices}


def bypassed(graph: Graph) -> set[str]:
    """Views without loop semantics that a later node's loop semantics read through: a
    channel shuffle's ``reshape(N, g, C/g, H, W) -> permute`` before the final reshape,
    whose semantics load the shuffled value itself. Such a view never needs its own
    element, so it may sit inside a group."""
    out: set[str] = set()
    for m in graph.nodes():
        sem = _semantics(graph, m)
        if sem is None:
            continue
        read = _reads(sem)
        for v in m.inputs:
            path: list[str] = []
            p = graph.producer(v)
            while (
                v not in read
                and p is not None
                and get_op(p.op).view_like
                and len(p.outputs) == 1
                and len(p.inputs) == 1
                and len(graph.consumers(p.outputs[0])) == 1
                and _semantics(graph, p) is None
            ):
                path.append(p.name)
                v = p.inputs[0]
                if v in read:
                    out.update(path)
                    break
                p = graph.producer(v)
    return out


class _PerPoint:
    """The grouping rules of one-thread-per-output devices (see the module's doc)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.factor: dict[str, float] = {}  # node -> times its elements are computed
        self.bypassed = bypassed(graph)

    def alone(self, n: Node) -> bool:
        if n.bound != Bound.IO or n.name in self.bypassed:
            return False
        return (
            _semantics(self.graph, n) is None
            or reduction_extent(self.graph, n) > MAX_SERIAL_REDUCTION
        )

    def joins(self, n: Node, p: Node) -> bool:
        if n.bound != Bound.IO:
            return True
        if self.alone(n) or self.alone(p):
            return False
        if reduction_extent(self.graph, n) > MAX_PULLED_REDUCTION:
            return False
        return self.factor.get(p.name, 1.0) * overlap(self.graph, n) <= MAX_RECOMPUTE

    def placed(self, n: Node, same_group: list[Node]) -> None:
        before = max((self.factor.get(p.name, 1.0) for p in same_group), default=1.0)
        self.factor[n.name] = before * overlap(self.graph, n)


def one_output_pieces(graph: Graph, names: Sequence[str]) -> list[list[str]]:
    """Group ``names`` (in order) cut into consecutive pieces with one value read outside
    each (a schedule computes one output): the CPU backend's way with a group of several
    outputs, which CUDA's grouping cuts already."""
    pieces = _one_output_pieces(graph, [graph.node(n) for n in names])
    return [[n.name for n in piece] for piece in pieces]


def _one_output_pieces(graph: Graph, run: list[Node]) -> list[list[Node]]:
    """``run`` (one group's nodes in order) cut into consecutive pieces whose only value
    read outside the piece is the output of its last node (io groups only). Consecutive
    pieces of a convex group stay convex and in topological order."""
    if not run or run[0].bound != Bound.IO:
        return [run]
    outs = set(graph.output_values())
    cuts: set[int] = set()
    while True:
        pieces: list[list[Node]] = [[]]
        for i, n in enumerate(run):
            pieces[-1].append(n)
            if i in cuts:
                pieces.append([])
        pieces = [p for p in pieces if p]
        new = set()
        at = 0
        for piece in pieces:
            inside = {m.name for m in piece}
            for k, m in enumerate(piece[:-1]):
                read_out = any(
                    v in outs or any(c.name not in inside for c in graph.consumers(v))
                    for v in m.outputs
                )
                if read_out:
                    new.add(at + k)
            at += len(piece)
        if not new - cuts:
            return pieces
        cuts |= new


def _producers(
    graph: Graph, n: Node, by_name: dict[str, Node], position: dict[str, int]
) -> list[Node]:
    """The distinct producer nodes of ``n``'s inputs (records from ``by_name``), latest
    (in graph order) first."""
    names = {graph.producer(v).name for v in n.inputs if graph.producer(v) is not None}
    return sorted((by_name[p] for p in names), key=lambda p: -position[p.name])


def _joins(n: Node, p: Node) -> bool:
    if n.op == "fallback" or p.op == "fallback" or n.bound != p.bound:
        return False
    return n.bound == "io" or get_op(n.op).view_like


class _Groups:
    """Groups under construction and the graph between them (kept acyclic)."""

    def __init__(self) -> None:
        self.of: dict[str, int] = {}  # node -> group id
        self.members: dict[int, list[str]] = {}
        self.succ: dict[int, set[int]] = {}  # group -> groups reading its values
        self.pred: dict[int, set[int]] = {}
        self.first: dict[int, int] = {}  # group -> position of its first node
        self._next = 0
        self._pos = 0

    def place(self, name: str, producers: list[str], candidates: list[str]) -> int:
        """Put node ``name`` (reading the outputs of nodes ``producers``) into the group of
        some of ``candidates`` (its producers it may join) or a new group; returns its id."""
        pos = self._pos
        self._pos += 1
        cand_groups = list(dict.fromkeys(self.of[p] for p in candidates))
        tries: list[list[int]] = []
        if len(cand_groups) > 1:
            tries.append(cand_groups)
        tries.extend([g] for g in cand_groups)
        for merge in tries:
            if self._acyclic_after(merge, {self.of[p] for p in producers}):
                gid = self._merge(merge)
                self._add(name, gid, producers)
                return gid
        gid = self._next
        self._next += 1
        self.members[gid] = []
        self.succ[gid], self.pred[gid] = set(), set()
        self.first[gid] = pos
        self._add(name, gid, producers)
        return gid

    def _acyclic_after(self, merge: list[int], preds: set[int]) -> bool:
        """Whether merging groups ``merge`` and a new node reading groups ``preds`` keeps
        the group graph acyclic: no path leaves the merged set and comes back to it (or to
        a group the new node reads)."""
        inside = set(merge)
        targets = inside | preds
        stack = [s for g in merge for s in self.succ[g] if s not in inside]
        seen: set[int] = set()
        while stack:
            g = stack.pop()
            if g in seen:
                continue
            seen.add(g)
            if g in targets:
                return False
            stack.extend(s for s in self.succ[g] if s not in seen)
        return True

    def _merge(self, merge: list[int]) -> int:
        keep = min(merge, key=self.first.__getitem__)
        for g in merge:
            if g == keep:
                continue
            for name in self.members.pop(g):
                self.of[name] = keep
                self.members[keep].append(name)
            for s in self.succ.pop(g):
                self.pred[s].discard(g)
                if s != keep:
                    self.pred[s].add(keep)
                    self.succ[keep].add(s)
            for p in self.pred.pop(g):
                self.succ[p].discard(g)
                if p != keep:
                    self.succ[p].add(keep)
                    self.pred[keep].add(p)
            self.first.pop(g)
        self.succ[keep].discard(keep)
        self.pred[keep].discard(keep)
        return keep

    def _add(self, name: str, gid: int, producers: list[str]) -> None:
        self.of[name] = gid
        self.members[gid].append(name)
        for p in producers:
            pg = self.of[p]
            if pg != gid:
                self.succ[pg].add(gid)
                self.pred[gid].add(pg)

    def order(self, nodes: list[Node]) -> list[Node]:
        """The nodes group by group: groups in a topological order of the group graph
        (earliest first node first), each group's nodes in their original order."""
        indeg = {g: len(self.pred[g]) for g in self.members}
        heap = [(self.first[g], g) for g, d in indeg.items() if d == 0]
        heapq.heapify(heap)
        by_name = {n.name: n for n in nodes}
        position = {n.name: i for i, n in enumerate(nodes)}
        out: list[Node] = []
        while heap:
            _, g = heapq.heappop(heap)
            out.extend(by_name[m] for m in sorted(self.members[g], key=position.__getitem__))
            for s in self.succ[g]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, (self.first[s], s))
        if len(out) != len(nodes):
            raise AssertionError("group graph has a cycle")
        return out
