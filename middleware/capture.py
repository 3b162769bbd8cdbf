"""Capture that does not give up: TorchDynamo splits what ``torch.fx`` cannot trace.

``Capture`` is a TorchDynamo backend. Dynamo runs the model's Python itself, cuts it at
each graph break (data-dependent control flow, ``.item()``, calls it cannot trace) and hands
the backend one ``fx.GraphModule`` per captured subgraph. Each ``Subgraph`` is compiled by
the middleware's own pipeline on its first real call (dynamo may hand fake example
inputs): ``frontends/dynamo.freeze`` turns the lifted parameters and buffers back into
constants, and an ``OptimizedModule`` over that module traces, lowers, passes and plans it
like any model (one plan per input signature, a fallback with its reason when it cannot).
A subgraph the middleware must not compile (an in-place write to an input, training mode,
gradients required) runs as dynamo gave it, with the reason.

Two doors lead here: ``optimize()`` when ``torch.fx`` fails (``compile_or_capture``: the
whole model becomes a ``DynamoPlan``), and ``torch.compile(model, backend="middleware")``
(``compile_backend.py``). Either way ``report()`` lists every captured subgraph and every
graph break with its reason (``CaptureReport``).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .enums import RunsAs
from .errors import TraceError
from .frontends.dynamo import (
    CONSTANT,
    SCALAR,
    TENSOR,
    GraphBreak,
    Placeholder,
    break_of,
    describe_break,
    freeze,
    mixed_results,
    placeholders,
    refusal,
    scalar_value,
)
from .options import Options
from .pipeline import compile_model
from .runtime.module import Compiled, OptimizedModule
from .runtime.report import GroupRow, Report, ReportRow

GRAD_REASON = (
    "gradients are required (grad mode is on and an input or parameter requires grad): "
    "the middleware compiles inference only, so this subgraph runs as captured; call the "
    "model under torch.no_grad() or torch.inference_mode() to optimize it"
)


@dataclasses.dataclass(frozen=True)
class SubgraphRow:
    """One captured subgraph in a report: its index, how many calls it holds, its input
    shapes, whether the middleware runs it (``optimized``) or it runs as captured (and
    why), the graph break that ended it, and its own report (one row per node)."""

    index: int
    calls: int
    inputs: tuple[str, ...]
    optimized: bool
    reason: str = ""
    ended_by: GraphBreak | None = None
    report: Report | None = None


@dataclasses.dataclass(frozen=True)
class CaptureReport(Report):
    """A report of a model captured through TorchDynamo: ``rows`` and ``groups`` are every
    subgraph's (node names prefixed ``g<index>.``, group ids made unique), plus one
    fallback row per graph break (the Python between subgraphs runs as the original);
    ``subgraphs`` and ``breaks`` list them."""

    subgraphs: tuple[SubgraphRow, ...] = ()
    breaks: tuple[GraphBreak, ...] = ()


class Subgraph:
    """The callable dynamo runs for one captured subgraph."""

    def __init__(
        self,
        capture: Capture,
        index: int,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
    ) -> None:
        self.index = index
        self.gm = gm
        self.options = capture.options
        self.inputs: tuple[Placeholder, ...] = placeholders(gm, example_inputs)
        self.ended_by = break_of(gm)
        self.calls = sum(1 for n in gm.graph.nodes if n.op.startswith("call_"))
        self.shapes = tuple(
            _shape(x) for p, x in zip(self.inputs, example_inputs, strict=False) if p.kind == TENSOR
        )
        self._scalars = tuple(i for i, p in enumerate(self.inputs) if p.kind == SCALAR)
        self._constants = tuple(i for i, p in enumerate(self.inputs) if p.kind == CONSTANT)
        self.mixed = mixed_results(gm)  # dynamo drops the example values after compiling
        self.reason = refusal(gm, self.inputs)
        if self.reason is None and self.calls == 0:
            self.reason = "no calls to compile (the subgraph only returns its inputs)"
        if self.reason is None and _needs_grad(example_inputs):
            self.reason = GRAD_REASON
        self._lock = threading.Lock()
        # per tuple of scalar inputs: (the constants it was frozen with, its module)
        self._modules: dict[tuple, tuple[tuple[Any, ...], tuple[int, ...], OptimizedModule]] = {}
        self._latest: OptimizedModule | None = None

    def __call__(self, *args: Any) -> Any:
        if self.reason is not None:
            return self.gm(*args)
        if torch.is_grad_enabled() and _needs_grad(args):  # dynamo guards grad mode; be sure
            return self.gm(*args)
        key = tuple(scalar_value(args[i]) for i in self._scalars)
        consts = tuple(args[i] for i in self._constants)
        entry = self._modules.get(key)
        if entry is None or not _same(entry[0], consts):
            entry = self._build(key, consts, args)
        _, positions, module = entry
        self._latest = module
        return module(*[args[i] for i in positions])

    def _build(self, key: tuple, consts: tuple[Any, ...], args: Sequence[Any]) -> tuple:
        """Freeze the subgraph on these constants (a parameter replaced by another object
        freezes it again) and wrap it in an ``OptimizedModule``."""
        with self._lock:
            entry = self._modules.get(key)
            if entry is not None and _same(entry[0], consts):
                return entry
            frozen, positions = freeze(
                self.gm, self.inputs, args, self.mixed, name=f"subgraph_g{self.index}"
            )
            module = OptimizedModule(frozen, self.options, compile_model)
            entry = (consts, positions, module)
            self._modules[key] = entry
            return entry

    def row(self) -> SubgraphRow:
        module = self._latest
        report = None if module is None else module.report()
        return SubgraphRow(
            index=self.index,
            calls=self.calls,
            inputs=self.shapes,
            optimized=self.reason is None,
            reason=self.reason or "",
            ended_by=self.ended_by,
            report=report,
        )


def _shape(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')}[{', '.join(map(str, x.shape))}]"
    return type(x).__name__


def _needs_grad(args: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class Capture:
    """A TorchDynamo backend that compiles every captured subgraph with the middleware
    (``torch.compile(model, backend=Capture(options))``); ``report()`` lists what it
    captured. Subgraphs are held weakly: dynamo's cache owns them."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self._subgraphs: list[weakref.ref[Subgraph]] = []
        self._breaks: list[GraphBreak] = []  # breaks seen outside any subgraph
        self._lock = threading.Lock()
        self.notes: list[str] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        with self._lock:
            sub = Subgraph(self, len(self._subgraphs), gm, example_inputs)
            self._subgraphs.append(weakref.ref(sub))
        return sub

    @property
    def subgraphs(self) -> list[Subgraph]:
        return [s for s in (r() for r in self._subgraphs) if s is not None]

    def add_breaks(self, breaks: Sequence[GraphBreak]) -> None:
        with self._lock:
            known = {b.detail or b.reason for b in self._breaks}
            known |= {s.ended_by.detail or s.ended_by.reason for s in self.subgraphs if s.ended_by}
            self._breaks.extend(b for b in breaks if (b.detail or b.reason) not in known)

    def report(self, notes: Sequence[str] = ()) -> CaptureReport:
        subs = [s.row() for s in self.subgraphs]
        breaks = [s.ended_by for s in subs if s.ended_by is not None] + list(self._breaks)
        rows: list[ReportRow] = []
        groups: list[GroupRow] = []
        offset = 0
        for s in subs:
            if s.report is None or not s.optimized:
                rows.append(
                    ReportRow(
                        node=f"g{s.index}",
                        op="subgraph",
                        bound="-",
                        group=None,
                        runs_as=RunsAs.FALLBACK,
                        reason=s.reason or "not called yet",
                    )
                )
                continue
            ids = {g.group for g in s.report.groups} | {
                r.group for r in s.report.rows if r.group is not None
            }
            remap = {g: offset + i for i, g in enumerate(sorted(ids))}
            offset += len(remap)
            for r in s.report.rows:
                rows.append(
                    dataclasses.replace(
                        r,
                        node=f"g{s.index}.{r.node}",
                        group=None if r.group is None else remap[r.group],
                    )
                )
            for g in s.report.groups:
                groups.append(
                    dataclasses.replace(
                        g,
                        group=remap[g.group],
                        nodes=tuple(f"g{s.index}.{n}" for n in g.nodes),
                    )
                )
        for i, b in enumerate(breaks):
            rows.append(
                ReportRow(
                    node=f"break{i}",
                    op="graph_break",
                    bound="-",
                    group=None,
                    runs_as=RunsAs.FALLBACK,
                    reason=f"graph break: {b.reason}",
                    source=b.where,
                )
            )
        lines = [
            *notes,
            *self.notes,
            f"captured through TorchDynamo: {len(subs)} subgraph(s), {len(breaks)} graph "
            "break(s); the Python between subgraphs runs as the original code",
        ]
        for s in subs:
            how = "optimized" if s.optimized else f"runs as captured: {s.reason}"
            if s.optimized and s.report is not None and s.report.fallbacks:
                how += f" ({len(s.report.fallbacks)} fallback node(s))"
            if s.optimized and s.report is None:
                how = "not called yet"
            end = f"; ended by graph break: {s.ended_by.reason}" if s.ended_by else ""
            lines.append(
                f"  subgraph g{s.index}: {s.calls} call(s) on {', '.join(s.inputs) or 'no tensors'}"
                f": {how}{end}"
            )
        for i, b in enumerate(breaks):
            lines.append(f"  break{i}{' at ' + b.where if b.where else ''}: {b.reason}")
        return CaptureReport(
            tuple(rows), tuple(groups), tuple(lines), subgraphs=tuple(subs), breaks=tuple(breaks)
        )


# --------------------------------------------------------------------- optimize()'s door
class DynamoPlan:
    """The plan of a model that ``torch.fx`` could not trace: the model run under
    ``torch.compile`` with a ``Capture`` backend (static shapes: one capture per input
    signature). ``entry`` is the ``Compiled`` record whose report it keeps current."""

    # what runtime/profile.py asks of a plan: the subgraphs' own plans are not broken out
    steps: tuple = ()
    graph = None
    arena_bytes = 0

    def arenas(self) -> list:
        return []

    def param_tensors(self) -> list:
        return []

    def held_tensors(self) -> list:
        return []

    def step_times(self, inputs: Sequence[torch.Tensor], repeats: int) -> list:
        return []

    def step_placements(self) -> list:
        return []

    def step_out_bytes(self) -> list:
        return []

    def predicted_peak_io(self) -> None:
        return None

    def __init__(self, capture: Capture, compiled: Callable[..., Any], why: str) -> None:
        self.capture = capture
        self.compiled = compiled
        self.why = why
        self.entry: Compiled | None = None
        self._seen = 0

    @property
    def notes(self) -> tuple[str, ...]:
        return (self._note(),)

    def _note(self) -> str:
        return f"torch.fx could not trace the model ({self.why})"

    def run(self, inputs: Sequence[torch.Tensor]) -> Any:
        before = _break_counts()
        out = self.compiled(*inputs)
        new = _break_counts() - before
        if new:
            self.capture.add_breaks([describe_break(text) for text in new])
        if self.entry is not None and len(self.capture._subgraphs) != self._seen:
            self.refresh()
        return out

    def refresh(self) -> None:
        """Rebuild the entry's report from the capture (new subgraphs since the last)."""
        self._seen = len(self.capture._subgraphs)
        if self.entry is not None:
            self.entry.report = self.capture.report((self._note(),))


def _break_counts() -> Counter:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - dynamo ships with torch >= 2.0
        return Counter()
    return Counter(counters["graph_break"])


# One capture per model and optimize() call (its Options object), shared by the plans of
# all its input signatures: dynamo caches per code object, and a new backend per signature
# would spend dynamo's recompile limit on backends instead of shapes. The compiled function
# is the model class's forward, called with the model as ``self``, so that nothing here
# keeps the model alive.
_CAPTURES: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[Capture, Any, bool]]] = (
    weakref.WeakKeyDictionary()
)
_CAPTURES_LOCK = threading.Lock()


def capture_model(
    model: nn.Module, inputs: Sequence[torch.Tensor], options: Options, why: str
) -> Compiled:
    """``model`` through TorchDynamo (see the module docstring), run once on ``inputs`` to
    capture its subgraphs; raises ``TraceError`` (both reasons) when dynamo fails too."""
    with _CAPTURES_LOCK:
        per_model = _CAPTURES.setdefault(model, {})
        found = per_model.get(id(options))  # the entry holds options: its id stays unique
        if found is None:
            capture = Capture(options)
            method = model.forward
            fn = (
                getattr(method, "__func__", None)
                if getattr(method, "__self__", None) is model
                else None
            )
            if fn is None:  # a forward set on the instance: compiled as it is
                forward = torch.compile(method, backend=capture, dynamic=False)
            else:
                forward = torch.compile(fn, backend=capture, dynamic=False)
            per_model[id(options)] = found = (capture, forward, fn is not None)
    capture, forward, unbound = found
    compiled = functools.partial(_call, forward, weakref.ref(model)) if unbound else forward
    plan = DynamoPlan(capture, compiled, why)
    try:
        with torch.no_grad():
            plan.run(inputs)
    except Exception as e:  # noqa: BLE001 - dynamo failed too: the model runs as the original
        raise TraceError(
            f"{why}; TorchDynamo could not capture it either: {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from e
    entry = Compiled(None, plan, capture.report((plan._note(),)))  # type: ignore[arg-type]
    plan.entry = entry
    plan._seen = len(capture._subgraphs)
    return entry


def _call(forward: Callable[..., Any], model: weakref.ref[nn.Module], *inputs: Any) -> Any:
    return forward(model(), *inputs)


def compile_or_capture(
    model: nn.Module, inputs: Sequence[torch.Tensor], options: Options
) -> Compiled:
    """``pipeline.compile_model``; where ``torch.fx`` cannot trace the model, the model
    through TorchDynamo instead (``capture_model``), unless ``options.strict`` (which asks
    for the whole model in one graph: the ``TraceError`` is raised)."""
    try:
        return compile_model(model, inputs, options)
    except TraceError as e:
        if options.strict:
            raise
        return capture_model(model, inputs, options, str(e))
