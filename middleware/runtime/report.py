"""What ran where and why: the rows of ``OptimizedModule.report()``.

One :class:`ReportRow` per node (its class, group, how it runs) and one :class:`GroupRow`
per group (FLOPs, bytes across the group's boundary, FLOP per byte). ``str(report)``
prints one line per group and a summary per class, so that it stays readable for a
200-layer network; ``report.verbose()`` prints one line per node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..backends.vendor import ALGORITHMS, primitives_note
from ..enums import Bound, RunsAs
from ..graph import Graph, Node
from ..hardware import Hardware
from ..ops import get_op
from ..passes.classify import MARGIN


@dataclasses.dataclass(frozen=True)
class ReportRow:
    node: str
    op: str
    bound: Bound | str  # "-" for a model that runs as the original
    group: int | None
    runs_as: RunsAs
    reason: str = ""
    source: str = ""
    flops: float = 0.0
    bytes: int = 0
    # a conv2d/linear node's algorithm (backends/vendor/algorithms.py): "vendor",
    # "winograd_f4x4", "im2col_gemm", a user's; "" for other nodes
    algorithm: str = ""
    # the algorithm's extra parameter and workspace bytes beyond the vendor call's
    extra_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class GroupRow:
    """One group: its nodes run as one step. ``bytes`` is what crosses the group's
    boundary (inputs read from outside, weights, outputs read outside or returned), not its
    intermediates."""

    group: int
    bound: str
    runs_as: str
    nodes: tuple[str, ...]
    ops: tuple[str, ...]
    flops: float
    bytes: int
    reason: str = ""

    @property
    def flops_per_byte(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


@dataclasses.dataclass(frozen=True)
class Report:
    """Rows per node and per group. ``str(report)`` prints one line per group;
    ``report.verbose()`` one line per node."""

    rows: tuple[ReportRow, ...]
    groups: tuple[GroupRow, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def fallbacks(self) -> list[ReportRow]:
        return [r for r in self.rows if r.runs_as == RunsAs.FALLBACK]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.runs_as] = out.get(r.runs_as, 0) + 1
        return out

    def __str__(self) -> str:
        lines = list(self.notes)
        c = self.counts()
        lines.append(
            f"{len(self.rows)} nodes: "
            + ", ".join(f"{v} {k}" for k, v in sorted(c.items()))
            + (f"; {len(self.groups)} groups" if self.groups else "")
        )
        if self.groups:
            lines.append(
                f"{'group':>5}  {'bound':<7} {'runs as':<9} {'nodes':>5} "
                f"{'MFLOP':>10} {'MB':>8} {'FLOP/B':>7}  ops"
            )
            for g in self.groups:
                lines.append(
                    f"{g.group:>5}  {g.bound:<7} {g.runs_as:<9} {len(g.nodes):>5} "
                    f"{g.flops / 1e6:>10.2f} {g.bytes / 1e6:>8.2f} {g.flops_per_byte:>7.2f}  "
                    f"{summarise_ops(g.ops)}{'  (' + g.reason + ')' if g.reason else ''}"
                )
            lines.extend(self._class_summary())
        else:
            lines.append(self._node_table())
        fb = self.fallbacks
        if fb:
            lines.append("fallbacks:")
            lines.extend(f"  {r.node} ({r.source}): {r.reason}" for r in fb)
        return "\n".join(lines)

    def _class_summary(self) -> list[str]:
        """One line per class: groups, nodes, FLOPs, bytes and their shares."""
        total_f = sum(g.flops for g in self.groups) or 1.0
        total_b = sum(g.bytes for g in self.groups) or 1
        lines = ["per class:"]
        for bound in ("compute", "param", "io"):
            gs = [g for g in self.groups if g.bound == bound]
            if not gs:
                continue
            f, b = sum(g.flops for g in gs), sum(g.bytes for g in gs)
            lines.append(
                f"  {bound:<7} {len(gs):>4} groups {sum(len(g.nodes) for g in gs):>5} nodes "
                f"{f / 1e6:>10.2f} MFLOP ({100 * f / total_f:4.1f}%) "
                f"{b / 1e6:>8.2f} MB ({100 * b / total_b:4.1f}%)"
            )
        return lines

    def verbose(self) -> str:
        """One line per node."""
        return "\n".join(list(self.notes) + [self._node_table()])

    def _node_table(self) -> str:
        lines = [
            f"{'node':<32} {'op':<20} {'bound':<7} {'group':>5} {'runs as':<9} "
            f"{'MFLOP':>9} {'MB':>7}  reason"
        ]
        for r in self.rows:
            g = "-" if r.group is None else str(r.group)
            lines.append(
                f"{r.node[:32]:<32} {r.op[:20]:<20} {r.bound:<7} {g:>5} {r.runs_as:<9} "
                f"{r.flops / 1e6:>9.2f} {r.bytes / 1e6:>7.2f}  "
                f"{_algorithm_tag(r)}{r.reason}"
            )
        return "\n".join(lines)


def _algorithm_tag(r: ReportRow) -> str:
    if not r.algorithm:
        return ""
    extra = f" +{r.extra_bytes / 2**20:.2f} MiB" if r.extra_bytes else ""
    return f"[{r.algorithm}{extra}] "


def extra_bytes_of(graph: Graph, node: Node, algorithm: str) -> int:
    """The extra bytes ``algorithm`` (backends/vendor/algorithms.py) holds for ``node``; 0
    for none, or one no longer registered."""
    record = ALGORITHMS.get(node.op, {}).get(algorithm) if algorithm else None
    return 0 if record is None else int(record.extra_bytes(graph, node))


def summarise_ops(ops: Sequence[str], width: int = 70) -> str:
    """``ops`` joined by " > ", runs of one op as "op x3", cut to ``width`` characters."""
    out: list[list] = []
    for o in ops:
        if out and out[-1][0] == o:
            out[-1][1] += 1
        else:
            out.append([o, 1])
    s = " > ".join(o if k == 1 else f"{o} x{k}" for o, k in out)
    return s if len(s) <= width else s[: width - 3] + "..."


def op_label(node: Node) -> str:
    """The op name with its fused post-ops, e.g. ``conv2d+add+relu``."""
    label = node.op
    if node.attrs.get("residual"):
        label += "+add"
    act = node.attrs.get("activation")
    if act and node.op != "maxpool_relu":
        label += f"+{act}"
    if node.op == "maxpool_relu":
        label = f"maxpool+{act}"
    if node.attrs.get("dw_activation"):  # conv2d_dw: the depthwise layer's
        label += f"+dw+{node.attrs['dw_activation']}"
    return label


def node_cost(graph: Graph, name: str) -> tuple[float, int]:
    """FLOPs and bytes moved (inputs, weights and outputs) of one node."""
    n = graph.node(name)
    ins = [graph.values[v] for v in n.inputs]
    outs = [graph.values[v] for v in n.outputs]
    flops = get_op(n.op).flops(n, ins, outs)
    nbytes = sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)
    return flops, nbytes


def group_rows(graph: Graph, rows: Sequence[ReportRow]) -> tuple[GroupRow, ...]:
    """One row per group of ``graph`` (nodes without a group are left out), in the order
    of their first node. A group's bytes are the distinct values it reads from outside
    (inputs, weights, other groups' outputs) plus the values it writes that are read
    outside it or returned; its FLOPs the sum of its nodes'."""
    row_of = {r.node: r for r in rows}
    members: dict[int, list[Node]] = {}
    for n in graph.nodes():
        if n.group is not None:
            members.setdefault(n.group, []).append(n)
    outputs = set(graph.output_values())
    readers: dict[str, set[int | None]] = {}
    for n in graph.nodes():
        for v in n.inputs:
            readers.setdefault(v, set()).add(n.group)
    out: list[GroupRow] = []
    for gid, nodes in members.items():
        inside = {v for n in nodes for v in n.outputs}
        read = {v for n in nodes for v in n.inputs if v not in inside}
        written = {v for v in inside if v in outputs or (readers.get(v, set()) - {gid})}
        nbytes = sum(graph.values[v].nbytes for v in read | written)
        node_rows = [row_of[n.name] for n in nodes if n.name in row_of]
        runs = list(dict.fromkeys(r.runs_as for r in node_rows)) or ["-"]
        reasons = list(dict.fromkeys(r.reason for r in node_rows if r.reason))
        bounds = list(dict.fromkeys(n.bound or get_op(n.op).bound for n in nodes))
        out.append(
            GroupRow(
                group=gid,
                bound="/".join(bounds),
                runs_as="+".join(runs),
                nodes=tuple(n.name for n in nodes),
                ops=tuple(op_label(n) for n in nodes),
                flops=sum(node_cost(graph, n.name)[0] for n in nodes),
                bytes=nbytes,
                reason="; ".join(reasons),
            )
        )
    return tuple(out)


def hardware_note(hw: Hardware) -> str:
    """The report's line on the hardware figures: what they are, where they came from
    (measured, pinned, the device's properties, documented defaults and why) and what they
    were used for, so that a run that classified or tiled differently says why."""
    return (
        f"hardware {hw.describe()}; used for: the io/param/compute classification "
        f"(balance, decided by op kind within x{MARGIN:g} of it), tile sizes "
        f"(L1 {hw.l1_bytes >> 10} KiB, L2 {hw.l2_bytes >> 10} KiB, {hw.cores} cores) and the "
        "batch-slicing cache budget (L2 x cores)"
    )


def make_report(graph: Graph, plan: Any, hardware: Hardware | None = None) -> Report:
    """The report of ``graph`` run by ``plan`` (a ``Plan``, ``ChunkedPlan`` or a backend's
    wrapper of one: anything with ``steps`` and ``notes``): one row per node, one per group,
    the plan's notes after the hardware figures that classified and tiled it."""
    step_of = {}
    for st in plan.steps:
        for name in st.nodes:
            step_of[name] = st
    rows = []
    for n in graph.nodes():
        st = step_of.get(n.name)
        flops, nbytes = node_cost(graph, n.name)
        bound = n.bound or get_op(n.op).bound
        rows.append(
            ReportRow(
                node=n.name,
                op=n.op,
                bound=bound,
                group=n.group,
                runs_as=st.runs_as if st else RunsAs.VENDOR,
                reason=(st.reason if st else "") or str(n.attrs.get("reason", ""))
                if n.op == "fallback"
                else (st.reason if st else ""),
                source=n.source,
                flops=flops,
                bytes=nbytes,
                algorithm=getattr(st, "algorithm", "") if st else "",
                extra_bytes=extra_bytes_of(graph, n, getattr(st, "algorithm", "") if st else ""),
            )
        )
    notes = tuple(getattr(plan, "notes", ()))
    if hardware is not None:  # which figures classified and tiled this plan, and whence
        notes = (hardware_note(hardware), *notes)
    wino = [r.node for r in rows if r.reason.startswith("winograd")]
    if wino:
        notes += (
            f"{len(wino)} convolution(s) run as Winograd F(4x4,3x3): generated transforms "
            f"around oneDNN's batched matmul ({', '.join(wino[:3])}"
            f"{', ...' if len(wino) > 3 else ''}); Options(winograd=False) keeps oneDNN's "
            "direct algorithm",
        )
    extra = sum(r.extra_bytes for r in rows)
    if extra:
        by: dict[str, int] = {}
        for r in rows:
            if r.extra_bytes:
                by[r.algorithm] = by.get(r.algorithm, 0) + r.extra_bytes
        notes += (
            f"algorithms' extra parameter and workspace memory: {extra / 2**20:.2f} MiB ("
            + ", ".join(f"{a} {b / 2**20:.2f}" for a, b in sorted(by.items()))
            + ")",
        )
    prims = primitives_note(plan.steps)
    if prims:
        notes += (prims,)
    asked = [r for r in rows if "algorithms= asked for" in r.reason]
    if asked:
        notes += (
            f"{len(asked)} layer(s) run the default algorithm instead of the one algorithms= "
            f"named, which does not apply there ({', '.join(r.node for r in asked[:3])}"
            f"{', ...' if len(asked) > 3 else ''}): see their rows",
        )
    return Report(tuple(rows), group_rows(graph, rows), notes)
