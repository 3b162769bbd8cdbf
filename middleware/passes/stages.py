"""Stage planning of a depth-first group: which values a schedule materialises.

Nodes of an io group are gathered into *stages* (``StageDraft``): a stage computes one
value into a buffer. Pointwise nodes with a single reader are inlined into their reader's
expression, also into a window's body when the window reads each element only a few times
and the expression is cheap (recompute instead of a scratch round trip); a window op read
at its own point by a pointwise node becomes that stage's reduction (its epilogue); a
concat whose inputs are computed straight into its slices is distributed. Everything
else is materialised. ``passes/schedule.py`` turns the drafts into regions, tiles and
bounds.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from ..graph import Graph, Node
from ..loops import (
    DIMS,
    EXPENSIVE_FUNCTIONS,
    Call,
    Expr,
    Load,
    OpLoops,
    ParamVec,
    Window,
    leaves,
    substitute,
)
from ..ops import loops_of

# A pointwise producer read through a window is recomputed at every read (inlined into the
# window's body) instead of materialised in scratch when each of its elements is read at
# most this many times and its expression has no transcendental function. Measured on
# batch-norm -> ReLU -> 3x3/2 max-pool (16x64x112x112, nhwc, 2 threads): the scratch
# version ran at 28-31 GB/s, recomputing (2.25 reads per element) at 43 GB/s, against 45
# GB/s for a kernel that only streams the same bytes (bench/chain.py measures it).
INLINE_MAX_READS_PER_ELEMENT = 4.0


def _subst_vars(text: str, mapping: dict[str, str]) -> str:
    if not mapping:
        return text
    pat = re.compile(r"\b(" + "|".join(re.escape(k) for k in mapping) + r")\b")
    return pat.sub(lambda m: f"({mapping[m.group(1)]})", text)


def compose(expr: Expr, index: Sequence[str]) -> Expr:
    """``expr`` (in its own coordinates n, c, h, w) evaluated at ``index``."""
    mapping = dict(zip(DIMS, index, strict=True))

    def leaf(x: Expr) -> Expr | None:
        if isinstance(x, Load):
            return Load(x.value, tuple(_subst_vars(i, mapping) for i in x.index))  # type: ignore[arg-type]
        if isinstance(x, ParamVec):
            return ParamVec(x.name, x.data, _subst_vars(x.index, mapping))
        return None

    return substitute(expr, leaf)


@dataclasses.dataclass
class StageDraft:
    value: str
    nodes: list[str]
    expr: Expr
    red: OpLoops | None = None
    channels: tuple[int, int] | None = None  # a cat slice: (first channel, count)
    # the value ``red``'s windows index (the reducing node's input): its shape bounds the
    # windows, whatever producers the body inlines (a broadcast operand's smaller shape
    # must not: an adaptive pool of ``scale[c] * x`` read only x's first column)
    window_value: str | None = None


def group_io(graph: Graph, names: Sequence[str]) -> tuple[list[str], list[str]]:
    inside = set(names)
    produced = {v for n in names for v in graph.node(n).outputs}
    ins: list[str] = []
    for n in names:
        for v in graph.node(n).inputs:
            if v not in produced and v not in ins:
                ins.append(v)
    outs_graph = set(graph.output_values())
    outs = []
    for n in names:
        for v in graph.node(n).outputs:
            if v in outs_graph or any(c.name not in inside for c in graph.consumers(v)):
                outs.append(v)
    return ins, outs


def _uses_inside(graph: Graph, names: set[str], value: str) -> int:
    return sum(c.inputs.count(value) for c in graph.consumers(value) if c.name in names)


def _window_dims_identity(index: Sequence[str], windows: Sequence[Window]) -> bool:
    """A load index that only shifts channels (n, h, w and every window dim unchanged)."""
    if _strip(index[0]) != "n":
        return False
    return all(_strip(index[d]) == DIMS[d] for d in (2, 3))


def _strip(text: str) -> str:
    t = text.strip()
    while t.startswith("(") and t.endswith(")"):
        t = t[1:-1].strip()
    return t


def _distributable_cat(graph, inside, out, producer, sem, lp) -> tuple[Load, OpLoops] | None:  # noqa: ANN001
    """The load of a concat (read once, at the stage's own point) in pointwise ``lp``."""
    if lp.kind != "pointwise":
        return None
    for x in leaves(lp.expr):
        if (
            isinstance(x, Load)
            and x.value in producer
            and x.value != out
            and tuple(_strip(i) for i in x.index) == DIMS
            and _uses_inside(graph, inside, x.value) == 1
            and sem(x.value).kind == "cat"
        ):
            return x, sem(x.value)
    return None


def _reads_per_element(windows: Sequence[Window]) -> float:
    r = 1.0
    for win in windows:
        r *= win.reads_per_input
    return r


def _cheap(expr: Expr) -> bool:
    """No function that costs more than a few cycles per element (worth a scratch buffer)."""
    if isinstance(expr, Call):
        return expr.fn not in EXPENSIVE_FUNCTIONS and all(_cheap(a) for a in expr.args)
    return True


def plan_stages(graph: Graph, names: Sequence[str], out: str) -> list[StageDraft]:
    """Decide which values are materialised and build each stage's expression."""
    inside = set(names)
    producer: dict[str, Node] = {}
    for n in names:
        node = graph.node(n)
        producer[node.outputs[0]] = node
    sem_cache: dict[str, OpLoops] = {}

    def sem(v: str) -> OpLoops:
        if v not in sem_cache:
            sem_cache[v] = loops_of(graph, producer[v])
        return sem_cache[v]

    drafts: list[StageDraft] = []
    done: set[str] = set()
    todo = [out]

    def recompute(slp: OpLoops, draft: StageDraft) -> bool:
        """Inline a pointwise producer into a window's body (recomputed per read)?"""
        assert draft.red is not None
        if isinstance(slp.expr, Load):
            # a copy (a layout conversion): a scratch round trip would only add a store
            # and a load per element (issue 18: inception's cat -> 3x3/1 max-pool in NCHW)
            return True
        return (
            _cheap(slp.expr)
            and _reads_per_element(draft.red.windows) <= INLINE_MAX_READS_PER_ELEMENT
        )

    def expand(expr: Expr, draft: StageDraft, window_read: bool) -> Expr:
        def leaf(x: Expr) -> Expr | None:
            if not isinstance(x, Load) or x.value not in producer:
                return None
            src = producer[x.value]
            slp = sem(x.value)
            single = _uses_inside(graph, inside, x.value) == 1 and x.value != out
            if single and slp.kind == "pointwise" and (not window_read or recompute(slp, draft)):
                draft.nodes.insert(0, src.name)
                return expand(compose(slp.expr, x.index), draft, window_read)
            if (
                single
                and slp.kind == "reduce"
                and not window_read
                and draft.red is None
                and _window_dims_identity(x.index, slp.windows)
            ):
                draft.nodes.insert(0, src.name)
                draft.red = dataclasses.replace(
                    slp,
                    body=compose(slp.body, x.index),  # type: ignore[arg-type]
                )
                draft.window_value = src.inputs[0]
                return expand(compose(slp.expr, x.index), draft, False)
            todo.append(x.value)
            return None

        return substitute(expr, leaf)

    def finish(draft: StageDraft) -> None:
        draft.expr = expand(draft.expr, draft, False)
        if draft.red is not None:
            body = expand(draft.red.body, draft, True)  # type: ignore[arg-type]
            draft.red = dataclasses.replace(draft.red, body=body)
        drafts.append(draft)

    while todo:
        v = todo.pop()
        if v in done:
            continue
        done.add(v)
        node = producer[v]
        lp = sem(v)
        if lp.kind == "cat":
            for src, first, count in lp.slices:
                index = ("n", f"c - {first}" if first else "c", "h", "w")
                finish(StageDraft(v, [node.name], Load(src, index), None, (first, count)))
            continue
        cat = _distributable_cat(graph, inside, out, producer, sem, lp)
        if cat is not None:
            # a pointwise op of a concat is computed per slice, straight from each input
            load, cat_lp = cat
            for src, first, count in cat_lp.slices:
                index = ("n", f"c - {first}" if first else "c", "h", "w")
                expr = substitute(
                    lp.expr,
                    lambda x, load=load, src=src, index=index: (
                        Load(src, index) if x == load else None
                    ),
                )
                draft = StageDraft(v, [producer[load.value].name, node.name], expr, None)
                draft.channels = (first, count)
                finish(draft)
            continue
        reduces = lp.kind == "reduce"
        finish(
            StageDraft(
                v,
                [node.name],
                lp.expr,
                lp if reduces else None,
                window_value=node.inputs[0] if reduces else None,
            )
        )
    order = {graph.node(n).outputs[0]: i for i, n in enumerate(names)}
    return sorted(drafts, key=lambda d: (order[d.value], d.channels or (0, 0)))


def stage_loads(d: StageDraft) -> list[tuple[Load, bool]]:
    """(load, read through the reduction window?) of a stage."""
    out = [(x, False) for x in leaves(d.expr) if isinstance(x, Load)]
    if d.red is not None and d.red.body is not None:
        out += [(x, True) for x in leaves(d.red.body) if isinstance(x, Load)]
    return out


def window_constraints(windows: Sequence[Window]) -> list[str]:
    cons = []
    for win in windows:
        o = DIMS[win.dim]
        c = re.sub(r"\bk\b", win.var, win.constraint)
        c = re.sub(r"\bo\b", o, c)
        cons.append(c)
    return cons


def valid_constraints(index: Sequence[str], shape: Sequence[int]) -> list[str]:
    return [f"0 <= {ix} < {s}" for ix, s in zip(index, shape, strict=True)]
