"""How a graph runs on a CUDA device: I/O-bound groups as generated kernels, everything else
(convolutions, matrix products: cuDNN/cuBLAS; ops without loop semantics: ATen) through
PyTorch's operators on CUDA tensors.

Groups are the passes' (``passes/group.py``, which on a CUDA device already keeps apart
what one thread per output element cannot compute well); a graph the passes did not
group is grouped by that same pass here. Each io group's schedule
(``passes/schedule.schedule_group``) is rendered by ``render.py``. A group left to the
framework (views only, an op without loop semantics, a long serial reduction, a schedule
or compile failure) runs node by node with the reason in the report (``strict=True``
raises on a compile failure instead).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import networkx as nx
import torch

from ...enums import RunsAs
from ...errors import CompileError, DeviceError, UnsupportedError
from ...graph import Graph, Node
from ...hardware import Hardware
from ...loops import NotFusable
from ...ops import get_op, loops_of
from ...options import Options
from ...passes.group import (
    MAX_SERIAL_REDUCTION,
    bypassed,
    generated_groups,
    reduction_extent,
)
from ...passes.schedule import schedule_group
from ...passes.schedule_ir import Schedule
from ..interface import Unit, node_step, to_tensor
from ..vendor import vendor_kernel
from .build import build_many, cubin_request, emulation_request
from .emulate import EmulatedLauncher, emulated_launcher
from .epilogue import Epilogue, conv_epilogue, make_conv, render_epilogue
from .kernel import GeneratedKernel
from .loader import LoadedKernel, get_loader
from .render import RenderedKernel, render_schedule
from .trials import conv_problems, search_conv_algorithms

# The schedule's tiles play no part in a one-thread-per-output kernel (only its stages,
# point loops and covers do): a fixed tile height skips the scheduler's search for one.
TILE_ROWS = 1


def _node_reason(graph: Graph, n: Node) -> str:
    """Why io node ``n`` cannot be inside a generated kernel ("" when it can)."""
    try:
        loops_of(graph, n)
    except NotFusable as e:
        return f"no loop semantics ({e}): runs through the framework (cuDNN/ATen)"
    extent = reduction_extent(graph, n)
    if extent > MAX_SERIAL_REDUCTION:
        return (
            f"ATen's parallel reduction: one thread per output would reduce {extent} "
            f"elements serially (limit {MAX_SERIAL_REDUCTION})"
        )
    return ""


def why_unsupported(graph: Graph, names: Sequence[str], hardware: Hardware) -> str:
    """ "" when the group ``names`` renders to one CUDA kernel, else the reason it does not
    (views only, a node without loop semantics or with a long serial reduction, a group
    the scheduler refuses, a function without a CUDA spelling)."""
    if all(get_op(graph.node(n).op).view_like for n in names):
        return "views only: free in the framework, no kernel needed"
    through = bypassed(graph)
    for n in names:
        reason = "" if n in through else _node_reason(graph, graph.node(n))
        if reason:
            return f"{graph.node(n).op} {n}: {reason}"
    try:
        render_schedule(schedule_group(graph, names, hardware, tile_rows=TILE_ROWS), hardware)
    except (NotFusable, UnsupportedError) as e:
        return f"not fusable: {e}"
    return ""


def _left_out(graph: Graph, names: Sequence[str], through: set[str]) -> dict[str, str]:
    """The reason of every node of group ``names`` when the group is left to the
    framework before scheduling (empty when it is scheduled). ``through``: views that
    other nodes' loop semantics read through (``passes.group.bypassed``)."""
    if all(get_op(graph.node(n).op).view_like for n in names):
        return {n: "views only: free in the framework, no kernel needed" for n in names}
    reasons = {n: "" if n in through else _node_reason(graph, graph.node(n)) for n in names}
    bad = [n for n, r in reasons.items() if r]
    if not bad:
        return {}
    return {n: reasons[n] or f"its group holds {bad[0]}, which has no kernel" for n in names}


def cuda_units(
    graph: Graph,
    options: Options,
    hardware: Hardware,
    device: torch.device,
    emulate: bool = False,
) -> list[Unit]:
    """The plan's units for ``device`` (a CUDA device), in a valid execution order.

    ``emulate=True`` (tests without a GPU): the same kernels compiled for the CPU emulation
    and run on CPU tensors, so that grouping and plan integration are tested end to end.
    """
    if emulate:
        index = -1
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
    groups = generated_groups(graph, hardware) if options.fuse else []
    in_group = {name: gid for gid, names in enumerate(groups) for name in names}
    why: dict[str, str] = {}
    rendered: dict[int, RenderedKernel] = {}
    requests = []
    through = bypassed(graph) if groups else set()
    for gid, names in enumerate(groups):
        left = _left_out(graph, names, through)
        if left:
            why.update(left)
            continue
        try:
            schedule: Schedule = schedule_group(graph, names, hardware, tile_rows=TILE_ROWS)
            r = render_schedule(schedule, hardware, emulate=emulate)
            if emulate:
                req = emulation_request(r.name, r.source, meta={"group": schedule.name})
            else:
                req = cubin_request(
                    r.name,
                    r.source,
                    hardware.arch or "sm_80",
                    (options.codegen_key(),),
                    meta={"group": schedule.name},
                )
        except NotFusable as exc:
            why.update({n: f"not fusable: {exc}" for n in names})
            continue
        except (UnsupportedError, DeviceError) as exc:
            if options.strict:
                raise
            why.update({n: str(exc) for n in names})
            continue
        rendered[gid] = r
        requests.append((gid, req))

    scheduled = {name: gid for gid in rendered for name in groups[gid]}
    epilogues = _epilogues(graph, scheduled) if options.fuse else {}
    ep_names = sorted({ep.name() for ep in epilogues.values()})
    ep_of_name = {ep.name(): ep for ep in epilogues.values()}
    ep_requests = [
        emulation_request(nm, render_epilogue(ep_of_name[nm], hardware), meta={"epilogue": nm})
        if emulate
        else cubin_request(
            nm,
            render_epilogue(ep_of_name[nm], hardware),
            hardware.arch or "sm_80",
            (options.codegen_key(),),
            meta={"epilogue": nm},
        )
        for nm in ep_names
    ]
    results = build_many([req for _, req in requests] + ep_requests, options.cache_dir)
    results, ep_results = results[: len(requests)], results[len(requests) :]
    loader = get_loader() if (requests or ep_requests) and not emulate else None
    ep_launchers: dict[str, object] = {}
    for nm, result in zip(ep_names, ep_results, strict=True):
        if isinstance(result, CompileError):
            if options.strict:
                raise result
            continue  # the convolution runs with PyTorch's own bias add and activation
        if emulate:
            ep_launchers[nm] = EmulatedLauncher(result, nm)
        else:
            ep_launchers[nm] = LoadedKernel(result.read_bytes(), nm, index, loader)
    kernels: dict[int, GeneratedKernel] = {}
    for (gid, _), result in zip(requests, results, strict=True):
        r = rendered[gid]
        if isinstance(result, CompileError):
            if options.strict:
                raise result
            warnings.warn(
                f"CUDA kernel for group {r.schedule.name} failed to compile; it runs through "
                f"PyTorch. Source: {result.source_path}",
                RuntimeWarning,
                stacklevel=2,
            )
            why.update({n: result.reason() for n in groups[gid]})
            continue
        if emulate:
            launcher = emulated_launcher(r, options.cache_dir)
        else:
            launcher = LoadedKernel(result.read_bytes(), r.name, index, loader)
        kernels[gid] = GeneratedKernel(r, launcher)

    # cuDNN's benchmark-mode search now, before the plan allocates anything (trials.py)
    in_kernel = {name for gid in kernels for name in groups[gid]}
    weight_layouts = {}
    for n in graph.nodes():
        if n.op == "conv2d" and n.name not in in_kernel:
            ep = epilogues.get(n.name)
            used = ep if ep is not None and ep.name() in ep_launchers else None
            weight_layouts[n.name] = _step_weight_layout(graph, n, used, options, not emulate)
    search_conv_algorithms(conv_problems(graph, weight_layouts), device)

    units: list[Unit] = []
    emitted: set[int] = set()
    for n in graph.nodes():
        gid = in_group.get(n.name)
        if gid is not None and gid in kernels:
            if gid in emitted:
                continue
            emitted.add(gid)
            k = kernels[gid]
            units.append(
                Unit(
                    k.rendered.schedule.name,
                    RunsAs.GENERATED,
                    k,
                    k.rendered.inputs,
                    k.rendered.outputs,
                    tuple(groups[gid]),
                    "",
                    out_fn=k.out,
                )
            )
            continue
        runs_as, fn, reason = node_step(graph, n, device)
        if runs_as == RunsAs.VENDOR and n.name in why:
            reason = why[n.name]
        ep = epilogues.get(n.name)
        if runs_as == RunsAs.VENDOR and ep is not None and ep.name() in ep_launchers:
            # cuda_weights="share": the plan's constant (the model's own weight) serves
            weight = _conv_weight(graph, n, ep, options, device)
            fn = make_conv(n, ep, ep_launchers[ep.name()], hardware, weight)
            reason = "cuDNN convolution + generated epilogue (" + ep.name() + ")"
        elif runs_as == RunsAs.VENDOR and vendor_kernel is not None and not emulate:
            fn = vendor_kernel(graph, n, device, hardware) or fn
        units.append(Unit(n.name, runs_as, fn, n.inputs, n.outputs, (n.name,), reason))
    return order_units(units)


def _epilogues(graph: Graph, in_group: dict[str, int]) -> dict[str, Epilogue]:
    """The conv2d nodes that run through cuDNN (not inside a generated kernel: not in
    ``in_group``) and have an epilogue to fuse, by node name."""
    out = {}
    for n in graph.nodes():
        if n.op != "conv2d" or n.name in in_group:
            continue
        ep = conv_epilogue(graph, n)
        if ep is not None:
            out[n.name] = ep
    return out


def _step_weight_layout(
    graph: Graph, n: Node, ep: Epilogue | None, options: Options, vendor: bool
) -> str:
    """The layout of the weight that conv2d ``n``'s step hands cuDNN: a constant weight is
    converted once to the output's format by a step with an epilogue (unless the plan
    shares the model's weights) and by the vendor call of an "nhwc" output
    (``vendor_kernel``, ``vendor``); else the weight value's own layout."""
    w = graph.values[n.inputs[1]]
    if n.inputs[1] not in graph.params:
        return w.layout
    if ep is not None:
        return w.layout if options.cuda_weights == "share" else ep.layout
    if vendor and graph.values[n.outputs[0]].layout == "nhwc":
        return "nhwc"
    return w.layout


def _conv_weight(
    graph: Graph, n: Node, ep: Epilogue, options: Options, device: torch.device
) -> torch.Tensor | None:
    """A constant weight, once, in the layout ``_step_weight_layout`` gives it (the
    output's memory format, else PyTorch would convert it at every call); None where that
    is the weight value's own layout (the plan's constant, or the model's own weight with
    ``cuda_weights="share"``) or the weight is not a graph parameter."""
    layout = _step_weight_layout(graph, n, ep, options, vendor=False)
    if layout == graph.values[n.inputs[1]].layout:
        return None
    return to_tensor(graph.params[n.inputs[1]], device, layout)


def order_units(units: Sequence[Unit]) -> list[Unit]:
    """``units`` in an order where every value is produced before it is read, as close to
    the given order as possible (a group's unit may have to move after outside nodes that
    feed its later members)."""
    producer = {v: i for i, u in enumerate(units) for v in u.outputs}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(units)))
    for i, u in enumerate(units):
        for v in u.inputs:
            j = producer.get(v)
            if j is not None and j != i:
                dag.add_edge(j, i)
    try:
        order = list(nx.lexicographical_topological_sort(dag))
    except nx.NetworkXUnfeasible as exc:
        raise UnsupportedError("fused groups form a cycle; the grouping is not convex") from exc
    return [units[i] for i in order]
