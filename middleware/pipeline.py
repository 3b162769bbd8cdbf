"""The pipeline: framework model -> graph -> passes -> batch slicing -> the device's backend
(lowering, units) -> plan (+ report).

Every device runs through the same steps: the registry (``backends.backend_for``) names the
backend of ``options.device``, and the backend answers the device-specific ones.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn as nn

from .backends import Backend, backend_for
from .frontends import trace
from .graph import Graph
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
    graph = run_passes(graph, options, hardware)
    graph = _fallbacks_on(graph, device)
    cut = batch_slice(graph, options, hardware, auto=backend.slices_batch)
    if cut is not None:
        pre, post = split_graph(graph, cut)
        plan = ChunkedPlan(
            graph,
            cut,
            _plan(backend, pre, options, hardware, device),
            _plan(backend, post, options, hardware, device, owned=cut.values),
            device,
        )
    else:
        plan = _plan(backend, graph, options, hardware, device)
    plan = backend.finish(plan, options, inputs)
    return Compiled(graph, plan, make_report(graph, plan, hardware))


def _plan(
    backend: Backend,
    graph: Graph,
    options: Options,
    hardware: Hardware,
    device: torch.device,
    owned: tuple[str, ...] = (),
) -> Plan:
    graph = backend.lower(graph, options)
    return build_plan(
        graph,
        device,
        backend.units(graph, options, hardware, device),
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
            if p is not None and p.device != device:
                graph = graph.copy() if graph is not None else graph
                graph.replace_node(n.name, n.replace(payload=copy.deepcopy(mod).to(device)))
    return graph
