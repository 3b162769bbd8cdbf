"""The pipeline glue: framework model -> graph -> passes -> plan (+ report)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn as nn

from .backends.interface import Unit, node_step
from .backends.x86.vendor import vendor_kernel
from .frontends import trace
from .graph import Graph
from .hardware import Hardware, for_options
from .ops import get_op
from .options import Options
from .passes import run_passes
from .runtime.chunked import ChunkedPlan, Cut, choose_cut, split_graph
from .runtime.module import Compiled
from .runtime.plan import Plan, build_plan
from .runtime.report import Report, ReportRow, group_rows, hardware_note, node_cost


def compile_model(model: nn.Module, inputs: Sequence[torch.Tensor], options: Options) -> Compiled:
    """Trace ``model`` on ``inputs``, run the passes and build the plan for this signature."""
    graph = trace(model, inputs)
    return compile_graph(graph, options, inputs)


def compile_graph(
    graph: Graph, options: Options, inputs: Sequence[torch.Tensor] | None = None
) -> Compiled:
    """Passes, units and plan of ``graph``; on CUDA with ``inputs`` given, the plan is
    captured as a CUDA graph here, so that the report says whether it could be."""
    device = torch.device(options.device)
    hardware = for_options(options)
    graph = run_passes(graph, options, hardware)
    graph = _fallbacks_on(graph, device)
    cut = _cut(graph, options, hardware, device)
    if cut is not None:
        pre, post = split_graph(graph, cut)
        plan = ChunkedPlan(
            graph,
            cut,
            _plan(pre, options, hardware, device),
            _plan(post, options, hardware, device, owned=cut.values),
            device,
        )
    else:
        plan = _plan(graph, options, hardware, device)
    if device.type == "cuda" and options.cuda_graphs:
        from .backends.cuda.graphs import CudaGraphPlan

        plan = CudaGraphPlan(plan)
        if inputs is not None and all(x.device.type == "cuda" for x in inputs):
            with torch.no_grad():
                plan.capture(inputs)
    return Compiled(graph, plan, make_report(graph, plan, hardware))


def _plan(
    graph: Graph,
    options: Options,
    hardware: Hardware,
    device: torch.device,
    owned: tuple[str, ...] = (),
) -> Plan:
    if device.type == "cuda":  # io groups -> generated CUDA kernels; the rest -> cuDNN/cuBLAS
        from .backends.cuda.lower import affine_batch_norms, channels_last_weights
        from .backends.cuda.units import cuda_units

        graph = channels_last_weights(affine_batch_norms(graph))
        units = cuda_units(graph, options, hardware, device)
    else:
        units = _units(graph, options, hardware, device)
    return build_plan(
        graph,
        device,
        units,
        plan_memory=options.plan_memory,
        owned=owned,
        check_memory=options.check_memory,
    )


def _cut(graph: Graph, options: Options, hardware: Hardware, device: torch.device) -> Cut | None:
    """The prefix to run depth-first over the batch. "auto" chunks on CPU only: on CUDA the
    slices' kernels would be too small to fill the GPU (and it is not measured there)."""
    mode = options.batch_chunk
    if mode == "auto" and device.type != "cpu":
        return None
    # weights beyond half the cores' private caches are re-read from memory once per slice
    cache = hardware.l2_bytes * max(hardware.cores, 1)
    return choose_cut(graph, mode, cache, hardware.bandwidth_gbs)


def _units(graph: Graph, options: Options, hardware: Hardware, device: torch.device) -> list[Unit]:
    """Decide how each part of the graph runs, in execution order.

    I/O-bound groups run as generated depth-first kernels (``fusion_units``) when
    ``options.fuse`` is on; every other node runs on its own through the framework:
    conv2d/linear through the fast vendor call (weights prepacked once, post-ops fused)
    where ``vendor_kernel`` offers one, other nodes through their catalogue implementation;
    fallback nodes call the original callable.
    """
    fused: dict[str, Unit] = {}
    failed: dict[str, str] = {}
    left_out: dict[str, str] = {}  # io nodes the fusion left to the framework, and why
    winograd = options.winograd and device.type == "cpu"
    if winograd:  # their transforms compile while the fused groups do
        from .backends.x86.winograd import prebuild, winograd_kernel

        prebuilding = prebuild(graph, options, hardware)
    if options.fuse and device.type == "cpu":
        from .backends.x86.units import fusion_units

        fused, failed = fusion_units(graph, options, hardware, left_out)
    if winograd:
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
        if runs_as == "vendor":
            wino = winograd_kernel(graph, n, options, hardware) if winograd else None
            fn = wino or vendor_kernel(graph, n, device, hardware) or fn
            if wino is not None:
                reason = wino.algorithm
        if n.name in failed:
            runs_as, reason = "fallback", failed[n.name]
        elif runs_as == "vendor" and not reason:
            reason = left_out.get(n.name, "")
        units.append(Unit(n.name, runs_as, fn, n.inputs, n.outputs, (n.name,), reason))
    return units


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


def make_report(graph: Graph, plan, hardware: Hardware | None = None) -> Report:  # noqa: ANN001 - Plan, avoiding a cycle
    step_of = {}
    for st in plan.steps:
        for name in st.nodes:
            step_of[name] = st
    rows = []
    for n in graph.nodes():
        st = step_of.get(n.name)
        flops, nbytes = node_cost(graph, n.name)
        bound = n.bound or str(get_op(n.op).bound)
        rows.append(
            ReportRow(
                node=n.name,
                op=n.op,
                bound=bound,
                group=n.group,
                runs_as=st.runs_as if st else "vendor",
                reason=(st.reason if st else "") or str(n.attrs.get("reason", ""))
                if n.op == "fallback"
                else (st.reason if st else ""),
                source=n.source,
                flops=flops,
                bytes=nbytes,
            )
        )
    notes = tuple(getattr(plan, "notes", ()))
    if hardware is not None:  # which figures classified and tiled this plan, and whence
        notes = (hardware_note(hardware), *notes)
    wino = [r.node for r in rows if r.reason.startswith("winograd")]
    if wino:
        notes += (
            f"{len(wino)} convolution(s) run as Winograd F(4x4,3x3): generated transforms "
            f"around the framework's batched GEMM ({', '.join(wino[:3])}"
            f"{', ...' if len(wino) > 3 else ''}); Options(winograd=False) keeps oneDNN's "
            "direct algorithm",
        )
    return Report(tuple(rows), group_rows(graph, rows), notes)
