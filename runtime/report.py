"""What ran where and why: the rows of ``OptimizedModule.report()``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..graph import Graph
from ..ops import get_op


@dataclasses.dataclass(frozen=True)
class ReportRow:
    node: str
    op: str
    bound: str
    group: int | None
    runs_as: str  # "generated" | "vendor" | "fallback"
    reason: str = ""
    source: str = ""
    flops: float = 0.0
    bytes: int = 0


@dataclasses.dataclass(frozen=True)
class GroupRow:
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
        return [r for r in self.rows if r.runs_as == "fallback"]

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
                f"{'MFLOP':>10} {'MB':>9} {'FLOP/B':>7}  ops"
            )
            for g in self.groups:
                ops = _summarise_ops(g.ops)
                lines.append(
                    f"{g.group:>5}  {g.bound:<7} {g.runs_as:<9} {len(g.nodes):>5} "
                    f"{g.flops / 1e6:>10.2f} {g.bytes / 1e6:>9.2f} {g.flops_per_byte:>7.2f}  "
                    f"{ops}{'  (' + g.reason + ')' if g.reason else ''}"
                )
        else:
            lines.append(self._node_table())
        fb = self.fallbacks
        if fb:
            lines.append("fallbacks:")
            lines.extend(f"  {r.node} ({r.source}): {r.reason}" for r in fb)
        return "\n".join(lines)

    def verbose(self) -> str:
        """One line per node."""
        return "\n".join(list(self.notes) + [self._node_table()])

    def _node_table(self) -> str:
        lines = [f"{'node':<32} {'op':<20} {'bound':<7} {'group':>5} {'runs as':<9} reason"]
        for r in self.rows:
            g = "-" if r.group is None else str(r.group)
            lines.append(
                f"{r.node[:32]:<32} {r.op:<20} {r.bound:<7} {g:>5} {r.runs_as:<9} {r.reason}"
            )
        return "\n".join(lines)


def _summarise_ops(ops: Sequence[str]) -> str:
    out: list[str] = []
    for o in ops:
        if out and out[-1].split("x")[0] == o:
            continue
        out.append(o)
    s = " > ".join(out)
    return s if len(s) <= 70 else s[:67] + "..."


def node_cost(graph: Graph, name: str) -> tuple[float, int]:
    """FLOPs and bytes moved (inputs, weights and outputs) of one node."""
    n = graph.node(name)
    ins = [graph.values[v] for v in n.inputs]
    outs = [graph.values[v] for v in n.outputs]
    flops = get_op(n.op).flops(n, ins, outs)
    nbytes = sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs)
    return flops, nbytes
