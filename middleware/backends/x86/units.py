"""The x86 half of the pipeline: the plan's units on a CPU.

:func:`cpu_units` decides how each part of a graph runs (``X86Backend.units`` calls it):
generated kernels for the I/O-bound groups (:func:`fusion_units`), conv2d/linear through
the vendor module (prepacked oneDNN weights with fused post-ops, or Winograd where the
measured rule picks it), every other node through its catalogue implementation.

``fusion_units(backend, graph, options, hardware)`` asks ``backend`` for a kernel per group whose
nodes are all bound "io" (``node.group``/``node.bound`` from the passes). A graph without
groups (the passes have not run) gets groups of consecutive io nodes that read each
other. A group the backend cannot run as a whole is tried as its maximal runs of nodes
that have loop semantics. A compile failure warns (naming the group and the source path)
and its nodes run through the framework with the compiler's message as the reason;
``options.strict`` raises the :class:`~middleware.errors.CompileError` instead.
"""

from __future__ import annotations

import concurrent.futures
import os
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ...enums import Bound, RunsAs
from ...errors import CompileError
from ...graph import Graph
from ...hardware import Hardware
from ...loops import NotFusable
from ...ops import get_op, has_loops, loops_of
from ...options import Options
from ..interface import Unit, node_step
from .vendor import ONEDNN_DTYPES, vendor_kernel
from .winograd import prebuild, winograd_kernel


class KernelGenerator(Protocol):
    """What :func:`fusion_units` asks of a code generator (``X86Backend``, ``IspcBackend``)."""

    def can_run(
        self, graph: Graph, nodes: Sequence[str], hardware: Hardware, options: Options | None
    ) -> tuple[bool, str]: ...

    def build(
        self, graph: Graph, nodes: Sequence[str], options: Options, hardware: Hardware
    ) -> Any: ...


def io_groups(graph: Graph) -> list[list[str]]:
    """Groups of io nodes in topological order: the passes' groups when they set any,
    else chains of consecutive io nodes each reading the previous one's output."""
    nodes = list(graph.nodes())
    if any(n.group is not None for n in nodes):
        groups: dict[int, list[str]] = {}
        bad: set[int] = set()
        for n in nodes:
            if n.group is None:
                continue
            groups.setdefault(n.group, []).append(n.name)
            if n.bound != Bound.IO:
                bad.add(n.group)
        return [names for gid, names in groups.items() if gid not in bad]
    out: list[list[str]] = []
    run: list[str] = []
    for n in nodes:
        io = get_op(n.op).bound == Bound.IO and has_loops(n.op) and len(n.outputs) == 1
        if io and run and graph.node(run[-1]).outputs[0] in n.inputs:
            run.append(n.name)
            continue
        if run:
            out.append(run)
        run = [n.name] if io else []
    if run:
        out.append(run)
    return out


def _has_loops(graph: Graph, name: str) -> bool:
    """The node has loop semantics for these attributes and shapes (a dense convolution
    classified io, say, has none: it splits its group)."""
    node = graph.node(name)
    if not has_loops(node.op):
        return False
    try:
        loops_of(graph, node)
    except NotFusable:
        return False
    return True


# Ops that oneDNN (through the framework, with its fused post-ops) runs faster than a
# generated depth-first kernel even where they are I/O-bound: such a node splits its group
# and runs as a vendor call. Measured at batch 16 on the 2-core AVX-512 host, the same plan
# with generated against oneDNN depthwise convolutions: mobilenet_v2 97 -> 71 ms,
# shufflenet_v2_x1_0 46 -> 43 ms, mobilenet_v3_small 19.8 -> 17.2 ms.
VENDOR_FASTER = frozenset({"conv2d"})


def _vendor_faster(graph: Graph, name: str) -> bool:
    node = graph.node(name)
    if node.op not in VENDOR_FASTER or not torch.backends.mkldnn.is_available():
        return False
    return graph.values[node.inputs[0]].dtype in ONEDNN_DTYPES


def _runs(graph: Graph, names: Sequence[str]) -> list[list[str]]:
    """Maximal runs of consecutive nodes that have loop semantics and that the vendor does
    not run faster."""
    runs, cur = [], []
    for n in names:
        if _has_loops(graph, n) and not _vendor_faster(graph, n):
            cur.append(n)
        else:
            if cur:
                runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def _left_out(graph: Graph, name: str, refused: str) -> str:
    """Why node ``name`` of a group the backend does not run whole may run outside a
    generated kernel (a piece of it that does run generated drops the reason later)."""
    if _vendor_faster(graph, name):
        return "oneDNN through the framework, measured faster than a generated kernel"
    node = graph.node(name)
    if not has_loops(node.op):
        return f"op {node.op} has no loop semantics"
    try:
        loops_of(graph, node)
    except NotFusable as e:
        return f"no loop semantics for these attributes: {e}"
    return f"its group was split: {refused}" if refused else "its group was split"


def _split_at_escapes(graph: Graph, group: Sequence[str], names: Sequence[str]) -> list[list[str]]:
    """``names`` cut after every node whose output is read outside ``group`` (so that a
    group with several outputs becomes pieces with one output each, where it can)."""
    inside = set(group)
    outs = set(graph.output_values())
    pieces, cur = [], []
    for n in names:
        cur.append(n)
        v = graph.node(n).outputs[0]
        if v in outs or any(c.name not in inside for c in graph.consumers(v)):
            pieces.append(cur)
            cur = []
    if cur:
        pieces.append(cur)
    return pieces


def _worth_it(graph: Graph, names: Sequence[str]) -> bool:
    """A group of views only is left to the framework (a view costs nothing there)."""
    return any(not get_op(graph.node(n).op).view_like for n in names)


def _build(
    backend: KernelGenerator,
    graph: Graph,
    names: Sequence[str],
    options: Options,
    hardware: Hardware,
) -> tuple[Any, BaseException | None]:
    try:
        return backend.build(graph, names, options, hardware), None
    except Exception as e:  # noqa: BLE001 - sorted out by the caller, in group order
        return None, e


def fusion_units(
    backend: KernelGenerator,
    graph: Graph,
    options: Options,
    hardware: Hardware,
    why_not: dict[str, str] | None = None,
) -> tuple[dict[str, Unit], dict[str, str]]:
    """(generated units keyed by the node whose position they take in the plan, fallback
    reasons keyed by node name for groups whose compile failed). ``why_not``, when given,
    receives the reason of every io node left to the framework (vendor faster, no loop
    semantics, the backend refused its group, views only, a generator failure), for the
    report.

    The groups build from a thread pool (one worker per core): while one group's C
    compiler runs, the next group is scheduled; failures are reported in group order."""
    units: dict[str, Unit] = {}
    failed: dict[str, str] = {}
    why = {} if why_not is None else why_not
    todo: list[list[str]] = []
    for group in io_groups(graph):
        candidates = [group]
        ok, refused = backend.can_run(graph, group, hardware, options)
        if not ok or any(_vendor_faster(graph, n) for n in group):
            candidates = []
            for run in _runs(graph, group):
                pieces = _split_at_escapes(graph, group, run)
                candidates += [p for p in pieces if p != group]
            for n in group:
                why[n] = _left_out(graph, n, "" if ok else refused)
        for names in candidates:
            if _worth_it(graph, names):
                todo.append(names)
            else:
                for n in names:
                    why[n] = "views only: free in the framework, no kernel needed"
    workers = max(1, min(len(todo), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_build, backend, graph, n, options, hardware) for n in todo]
        results = [f.result() for f in futures]
    for names, (kernel, err) in zip(todo, results, strict=True):
        if isinstance(err, NotFusable):
            for n in names:
                why[n] = f"not fusable: {err}"
            continue
        if isinstance(err, CompileError):
            if options.strict:
                raise err
            gid = graph.node(names[0]).group
            warnings.warn(
                f"group {gid} ({', '.join(names)}) runs through the framework: its "
                f"generated kernel failed to compile; source: {err.source_path}",
                RuntimeWarning,
                stacklevel=2,
            )
            msg = (err.stderr or str(err)).strip().splitlines()
            reason = "compile failed: " + " | ".join(msg[:3])
            for n in names:
                failed[n] = reason
            continue
        if err is not None:  # a generator bug must not break optimize()
            if options.strict:
                raise err
            warnings.warn(
                f"group ({', '.join(names)}) runs through the framework: generating it "
                f"failed with {type(err).__name__}: {err}",
                RuntimeWarning,
                stacklevel=2,
            )
            for n in names:
                why[n] = f"generating its kernel failed ({type(err).__name__}: {err})"
            continue
        assert kernel is not None
        for n in names:
            why.pop(n, None)
        producer = graph.producer(kernel.outputs[0])
        assert producer is not None
        units[producer.name] = Unit(
            kernel.name,
            RunsAs.GENERATED,
            kernel.fn,
            kernel.inputs,
            kernel.outputs,
            tuple(names),
            "",
            kernel.out_fn,
        )
    return units, failed


def cpu_units(
    backend: KernelGenerator,
    graph: Graph,
    options: Options,
    hardware: Hardware,
    device: torch.device,
) -> list[Unit]:
    """Decide how each part of the graph runs, in execution order.

    I/O-bound groups run as kernels generated by ``backend`` (``fusion_units``) when
    ``options.fuse`` is on; every other node runs on its own through the framework:
    conv2d/linear through the fast vendor call (weights prepacked once, post-ops fused, or
    Winograd where ``options.winograd`` and the measured rule pick it), other nodes through
    their catalogue implementation; fallback nodes call the original callable.
    """
    fused: dict[str, Unit] = {}
    failed: dict[str, str] = {}
    left_out: dict[str, str] = {}  # io nodes the fusion left to the framework, and why
    if options.winograd:  # their transforms compile while the fused groups do
        prebuilding = prebuild(graph, options, hardware)
    if options.fuse:
        fused, failed = fusion_units(backend, graph, options, hardware, left_out)
    if options.winograd:
        prebuilding.join()
    covered = {name for u in fused.values() for name in u.nodes}
    units: list[Unit] = []
    for n in graph.nodes():
        if n.name in fused:
            units.append(fused[n.name])
            continue
        if n.name in covered:
            continue
        runs_as, fn, reason = node_step(graph, n, device)
        if runs_as == RunsAs.VENDOR:
            wino = winograd_kernel(graph, n, options, hardware) if options.winograd else None
            fn = wino or vendor_kernel(graph, n, device, hardware) or fn
            if wino is not None:
                reason = wino.algorithm
        if n.name in failed:
            runs_as, reason = RunsAs.FALLBACK, failed[n.name]
        elif runs_as == RunsAs.VENDOR and not reason:
            reason = left_out.get(n.name, "")
        units.append(Unit(n.name, runs_as, fn, n.inputs, n.outputs, (n.name,), reason))
    return units
