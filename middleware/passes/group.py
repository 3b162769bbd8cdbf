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
"""

from __future__ import annotations

import heapq

from ..graph import Graph, Node
from ..ops import get_op


def group(graph: Graph) -> Graph:
    """Set ``group`` (an int id) on every node and order the nodes group by group.

    Expects: ``bound`` set on every node by the classify pass (a node without one, when
    classify is switched off, gets its op's default class from the catalogue).
    Guarantees: every node has a group; the nodes of a group share one class, and form
    one contiguous run in the new graph's node order, which is still topological; the
    groups are numbered 0, 1, ... in that order; each group is convex; a fallback node is
    alone in its group. The values, params and outputs are unchanged.
    """
    nodes = [
        n if n.bound is not None else n.replace(bound=str(get_op(n.op).bound))
        for n in graph.nodes()
    ]
    by_name = {n.name: n for n in nodes}
    position = {n.name: i for i, n in enumerate(nodes)}
    state = _Groups()
    for n in nodes:
        producers = _producers(graph, n, by_name, position)
        candidates = [p.name for p in producers if _joins(n, p)]
        state.place(n.name, [p.name for p in producers], candidates)
    order = state.order(nodes)
    number = {g: i for i, g in enumerate(dict.fromkeys(state.of[n.name] for n in order))}
    records = [
        (n.replace(group=number[state.of[n.name]]), [graph.values[v] for v in n.outputs])
        for n in order
    ]
    return graph.rebuild(records)


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
