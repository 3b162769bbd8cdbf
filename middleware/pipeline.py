"""The pipeline: framework model -> graph -> passes -> batch slicing -> the device's backend
(lowering, units) -> plan (+ report).

Every device runs through the same steps: the registry (``backends.backend_for``) names the
backend of ``options.device``, and the backend answers the device-specific ones.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch
import torch.nn as nn

from .backends import Backend, backend_for
from .backends.interface import same_device
from .frontends import trace
from .graph import RELEASE_AS_BUILT, Graph, return_freed_memory
from .hardware import Hardware, for_options
from .options import Options
from .passes import run_passes
from .passes.batch_slice import batch_slice, split_graph
from .runtime.chunked import ChunkedPlan
from .runtime.module import Compiled
from .runtime.plan import Plan, build_plan
from .runtime.report import make_report


def compile_model(model: nn.Module, inputs: Sequence[torch.Tensor], options: Options) -> Compiled:
    """Trace ``model`` on ``inputs``, run the passes and build the plan for this signature."""
    graph = trace(model, inputs)
    return compile_graph(graph, options, inputs)


def compile_graph(
    graph: Graph, options: Options, inputs: Sequence[torch.Tensor] | None = None
) -> Compiled:
    """Passes, batch-slicing cut, units and plan of ``graph`` on ``options.device``. With
    ``inputs`` given, the backend may finish the plan on them here (CUDA: capture it as a
    CUDA graph), so that the report says whether it could."""
    device = torch.device(options.device)
    backend = backend_for(device)
    hardware = for_options(options)
    # a backend registered before passes_off joined the interface turns nothing off
    passes_off = getattr(backend, "passes_off", None)
    off = passes_off(options) if passes_off is not None else ()
    pass_options = (
        dataclasses.replace(
            options, disable_passes=tuple(dict.fromkeys((*options.disable_passes, *off)))
        )
        if off
        else options
    )
    graph = run_passes(graph, pass_options, hardware)
    return_freed_memory()  # the passes' temporaries (folding works in float64)
    graph = _fallbacks_on(graph, device)
    cut = batch_slice(graph, options, hardware, auto=backend.slices_batch)
    if cut is not None:
        pre, post = split_graph(graph, cut)
        # while the two plans build, the halves alone hold the weights they read, so that
        # a weight released as its call is built (RELEASE_AS_BUILT) is freed at once
        order = _lend_params(graph, (pre, post))
        try:
            plans = [
                _plan(backend, pre, options, hardware, device),
                _plan(backend, post, options, hardware, device, owned=cut.values),
            ]
        finally:
            _take_back_params(graph, (pre, post), order)
        plan = ChunkedPlan(graph, cut, plans[0], plans[1], device)
        graphs = [graph, pre, post]
    else:
        plans = [_plan(backend, graph, options, hardware, device)]
        plan, graphs = plans[0], [graph]
    plan = backend.finish(plan, options, inputs)
    report = make_report(graph, plan, hardware)
    graphs += [p.graph for p in plans]
    release_held_params(graphs, plans)
    for g in graphs:  # stand-ins left where the other half reads the weight: no value
        g.release_params([v for v in g.released() if v in g.params], "released while built")
    return_freed_memory()
    return Compiled(graph, plan, report)


def _lend_params(graph: Graph, halves: Sequence[Graph]) -> list[str]:
    """Take out of ``graph`` the parameters ``halves`` hold too; returns the order of all
    of ``graph``'s parameters, for :func:`_take_back_params`."""
    order = list(graph.params)
    for v in order:
        if any(v in h.params for h in halves):
            del graph.params[v]
    return order


def _take_back_params(graph: Graph, halves: Sequence[Graph], order: Sequence[str]) -> None:
    """Put back into ``graph`` (in ``order``) each lent parameter's array from a half that
    still holds it; one that every half released comes back as a stand-in."""
    params, stood = {}, []
    for v in order:
        if v in graph.params:
            params[v] = graph.params[v]
            continue
        held = [h for h in halves if v in h.params]
        real = [h.params[v] for h in held if v not in h.released()]
        if real or held:
            params[v] = real[0] if real else held[0].params[v]
            if not real:
                stood.append(v)
    graph.params = params
    graph.stand_in_params(stood, "released while built")


def release_held_params(graphs: Sequence[Graph], plans: Sequence[Plan]) -> list[str]:
    """Drop from ``graphs`` the arrays of the parameters that no step of ``plans`` reads
    (every step that takes one holds its own copy: a prepacked or Winograd-transformed
    weight, ``Plan.held_params``), so that a weight the passes derived (batch-norm folded)
    is not held a second time beside that copy. Returns the names released.

    Safe for later builds: a new input signature, changed weights or a switch to training
    trace the user's model again (``runtime.module``), never this graph; ``Graph.evaluate``
    on it raises for a released parameter."""
    held = {v for p in plans for v in p.held_params}
    read = {v for p in plans for v in p.graph.params if v not in p.held_params}
    released = sorted(held - read)
    if released:
        why = "the plan holds its own copy: a prepacked or transformed weight"
        for g in {id(g): g for g in graphs}.values():
            g.release_params(released, why)
    return released


def _plan(
    backend: Backend,
    graph: Graph,
    options: Options,
    hardware: Hardware,
    device: torch.device,
    owned: tuple[str, ...] = (),
) -> Plan:
    graph = backend.lower(graph, options)
    graph.meta[RELEASE_AS_BUILT] = True  # see middleware.graph
    try:
        units = backend.units(graph, options, hardware, device)
    finally:
        graph.meta.pop(RELEASE_AS_BUILT, None)
    return build_plan(
        graph,
        device,
        units,
        plan_memory=options.plan_memory,
        owned=owned,
        check_memory=options.check_memory,
    )


def _fallbacks_on(graph: Graph, device: torch.device) -> Graph:
    """Fallback modules that live on another device than the plan run on a copy moved there
    (the user's model itself is never moved)."""
    for n in list(graph.nodes()):
        mod = n.payload
        if n.op == "fallback" and isinstance(mod, nn.Module):
            p = next(iter(mod.parameters()), None)
            if p is None:
                p = next(iter(mod.buffers()), None)
            if p is not None and not same_device(p.device, device):
                graph = graph.copy() if graph is not None else graph
                graph.replace_node(n.name, n.replace(payload=copy.deepcopy(mod).to(device)))
    return graph
