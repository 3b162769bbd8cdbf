"""merge_concat: a concat of a concat (same axis, read nowhere else) becomes one concat."""

from __future__ import annotations

from ..graph import Graph
from .patterns import Readers, Rewrite


def merge_concat(graph: Graph) -> Graph:
    """Inline into each ``cat`` every input that is itself a ``cat`` along the same dim whose
    output nothing else reads (and is no graph output).

    Expects: ``cat`` nodes with a non-negative ``dim`` attr (the frontend normalises it).
    Guarantees: the same outputs; no ``cat`` reads, along its own dim, a ``cat`` output
    that only it reads; chains of any depth become one ``cat`` (the inner ones are gone).
    """
    readers = Readers(graph)
    rw = Rewrite(graph)
    parts_of: dict[str, tuple[str, ...]] = {}  # name of a cat -> its inputs after merging
    for n in graph.nodes():
        if n.op != "cat":
            continue
        parts: list[str] = []
        merged = False
        for v in n.inputs:
            p = graph.producer(v)
            if (
                p is not None
                and p.op == "cat"
                and p.attrs["dim"] == n.attrs["dim"]
                and readers.only_by(v, n)
            ):
                parts.extend(parts_of[p.name])
                rw.drop(p.name)  # also when it was itself merged: it is inlined here
                merged = True
            else:
                parts.append(v)
        parts_of[n.name] = tuple(parts)
        if merged:
            rw.replace(n.name, [(n.replace(inputs=tuple(parts)), [graph.values[n.outputs[0]]])])
    return rw.build()
