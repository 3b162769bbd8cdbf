"""How a graph runs on a CUDA device: I/O-bound groups as generated kernels, everything else
(convolutions, matrix products: cuDNN/cuBLAS) through PyTorch's ATen operators on CUDA
tensors. Called by ``middleware.compiler._units`` when the device is CUDA.

Groups come from the passes (``Node.group`` of io nodes) when they ran; otherwise maximal
runs of consecutive io nodes that the CUDA renderer supports, split into connected parts.
A group that cannot be rendered or compiled runs node by node through the framework, with
the reason in the report (``strict=True`` raises instead).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import networkx as nx
import torch

from ...errors import CompileError, DeviceError, UnsupportedError
from ...graph import Graph, Node
from ...hardware import Hardware
from ...ops import Bound, get_op
from ...options import Options
from ..interface import Unit, node_step, to_tensor
from .build import build_many, cubin_request, emulation_request
from .elements import EMITTERS, why_unsupported
from .emulate import EmulatedLauncher, emulated_launcher
from .epilogue import Epilogue, conv_epilogue, make_conv, render_epilogue
from .group import KernelGroup, group_from_nodes
from .kernel import GeneratedKernel, memory_format_of
from .loader import LoadedKernel, get_loader
from .render import render_group
from .tiled import render_kernel, tile_plan


def _is_io(n: Node, graph: Graph | None = None) -> bool:
    """An io node this backend renders. A dense (non-depthwise) convolution is left to
    cuDNN even when the roofline calls it io: one thread per output element would recompute
    it for every element of every reader's window (squeezenet's stem fused this way ran
    70x slower than eager on an H200)."""
    bound = n.bound or str(get_op(n.op).bound)
    if bound != str(Bound.IO) or n.op not in EMITTERS:
        return False
    if graph is not None and reduction_extent(graph, n) > MAX_SERIAL_REDUCTION:
        return False
    if n.op == "conv2d" and graph is not None:
        cin = graph.values[n.inputs[0]].shape[1]
        return int(n.attrs.get("groups", 1)) == cin
    return True


# One thread sums a reduction's whole extent serially: mobilenet_v3_small's SE global
# pools (56x56 maps, 3136 elements per output, pulling a depthwise convolution through)
# took 4.7 ms of its 7.9 ms of kernel time on an H200 this way, ATen's parallel reduction
# 7 us each. Past this extent a reduction runs through the framework.
MAX_SERIAL_REDUCTION = 64


def reduction_extent(graph: Graph, n: Node) -> int:
    """How many input elements one output element of ``n`` sums or maxes (1: not a
    reduction)."""
    if n.op in ("adaptive_avg_pool2d", "adaptive_max_pool2d"):
        h, w = graph.values[n.inputs[0]].shape[2:]
        oh, ow = graph.values[n.outputs[0]].shape[2:]
        return -(-h // max(oh, 1)) * -(-w // max(ow, 1))
    if n.op == "mean":
        t = graph.values[n.inputs[0]]
        extent = 1
        for d in n.attrs["dims"]:
            extent *= t.shape[d % t.rank]
        return extent
    return 1


# A reduction over more than this many elements per output reads its input from memory
# instead of pulling the producers through: mobilenet_v3_small's 7x7 SE pools recomputed
# a 5x5 depthwise convolution 49 times per thread (64 us for one such group on an H200),
# while the convolution's output is written to memory for the SE multiply anyway.
MAX_PULLED_REDUCTION = 8


def _starts_group(graph: Graph, n: Node | None) -> bool:
    return n is not None and reduction_extent(graph, n) > MAX_PULLED_REDUCTION


def io_groups(graph: Graph) -> list[list[str]]:
    """The node names of each I/O-bound group to fuse, in execution order.

    Runs of consecutive nodes (in the graph's topological order) that are io, renderable
    and, when the passes grouped the graph, of one group; each run split into its
    connected parts. A part of consecutive nodes is convex (no path leaves it and comes
    back), so it can run as one kernel.
    """
    groups: list[list[str]] = []
    run: list[Node] = []
    for n in [*graph.nodes(), None]:
        joins = n is not None and (
            not run or (run[-1].group == n.group and not _starts_group(graph, n))
        )
        if joins and _is_io(n, graph):
            run.append(n)
            continue
        if run:
            groups.extend(_connected_parts(graph, run))
        run = [n] if n is not None and _is_io(n, graph) else []
    return groups


def _connected_parts(graph: Graph, run: list[Node]) -> list[list[str]]:
    """Weakly connected parts of a run of consecutive nodes (each part is convex: a path
    between two of its nodes only passes nodes of the run)."""
    names = {n.name for n in run}
    sub = nx.Graph()
    sub.add_nodes_from(names)
    for n in run:
        for v in n.inputs:
            p = graph.producer(v)
            if p is not None and p.name in names:
                sub.add_edge(p.name, n.name)
    order = {n.name: i for i, n in enumerate(run)}
    parts = [sorted(c, key=order.__getitem__) for c in nx.connected_components(sub)]
    return sorted(parts, key=lambda part: order[part[0]])


def _worth_a_kernel(group: KernelGroup) -> bool:
    """A group of views only (flatten, identity, ...) is free in the framework: no kernel."""
    return any(not get_op(n.op).view_like for n in group.nodes)


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
    try:  # cuDNN/cuBLAS calls with prepacked weights, where the vendor module offers them
        from ..x86.vendor import vendor_kernel
    except ImportError:
        vendor_kernel = None
    if emulate:
        index = -1
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
    in_group: dict[str, int] = {}
    kernels: dict[int, GeneratedKernel] = {}
    reasons: dict[int, str] = {}
    groups = []
    if options.fuse:
        for names in io_groups(graph):
            group = group_from_nodes(
                graph,
                names,
                name=f"g{len(groups)}_" + "_".join(dict.fromkeys(graph.node(n).op for n in names)),
            )
            if not _worth_a_kernel(group):
                continue
            gid = len(groups)
            groups.append(group)
            for name in names:
                in_group[name] = gid

    rendered, requests = {}, []
    flat: dict[int, tuple] = {}  # tiled groups on a GPU: the one-thread-per-output variant too
    for gid, group in enumerate(groups):
        reason = why_unsupported(group)
        if reason:
            reasons[gid] = reason
            continue
        try:
            r = render_kernel(group, hardware, emulate=emulate)
            if emulate:
                req = emulation_request(r.name, r.source, meta={"group": group.name})
            else:
                req = cubin_request(
                    r.name,
                    r.source,
                    hardware.arch or "sm_80",
                    (options.codegen_key(),),
                    meta={"group": group.name},
                )
        except (UnsupportedError, DeviceError) as exc:
            if options.strict:
                raise
            reasons[gid] = str(exc)
            continue
        rendered[gid] = r
        requests.append((gid, req))
        if not emulate and tile_plan(group, hardware) is not None:
            f = render_group(group, hardware, emulate=False)
            arch = hardware.arch or "sm_80"
            flat[gid] = (
                f,
                cubin_request(f.name + "_flat", f.source, arch, (options.codegen_key(),)),
            )

    epilogues = _epilogues(graph, in_group) if options.fuse else {}
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
    flat_ids = sorted(flat)
    results = build_many(
        [req for _, req in requests] + ep_requests + [flat[g][1] for g in flat_ids],
        options.cache_dir,
    )
    k0, k1 = len(requests), len(requests) + len(ep_requests)
    results, ep_results, flat_results = results[:k0], results[k0:k1], results[k1:]
    flat_bins = {
        g: res
        for g, res in zip(flat_ids, flat_results, strict=True)
        if not isinstance(res, Exception)
    }
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
    for (gid, _), result in zip(requests, results, strict=True):
        if isinstance(result, CompileError):
            if options.strict:
                raise result
            warnings.warn(
                f"CUDA kernel for group {groups[gid].name} failed to compile; it runs through "
                f"PyTorch. Source: {result.source_path}",
                RuntimeWarning,
                stacklevel=2,
            )
            reasons[gid] = str(result)
            continue
        r = rendered[gid]
        if emulate:
            launcher = emulated_launcher(r, options.cache_dir)
        else:
            launcher = LoadedKernel(result.read_bytes(), r.name, index, loader)
        kernels[gid] = GeneratedKernel(r, launcher)
        if gid in flat_bins:  # measured, not guessed: keep the faster of the two
            f = flat[gid][0]
            alt = GeneratedKernel(
                f, LoadedKernel(flat_bins[gid].read_bytes(), f.name, index, loader)
            )
            choice = {"shared-memory tiles": kernels[gid], "one thread per output": alt}
            best, reasons[gid] = fastest(choice, graph, groups[gid], device)
            kernels[gid] = choice[best]

    units: list[Unit] = []
    emitted: set[int] = set()
    for n in graph.nodes():
        gid = in_group.get(n.name)
        if gid is not None and gid in kernels:
            if gid in emitted:
                continue
            emitted.add(gid)
            k, g = kernels[gid], groups[gid]
            units.append(
                Unit(
                    g.name,
                    "generated",
                    k,
                    g.inputs,
                    g.outputs,
                    tuple(m.name for m in g.nodes),
                    reasons.get(gid, ""),
                    out_fn=k.out,
                )
            )
            continue
        runs_as, fn, reason = node_step(graph, n, device)
        ep = epilogues.get(n.name)
        if runs_as == "vendor" and ep is not None and ep.name() in ep_launchers:
            fn = make_conv(
                n, ep, ep_launchers[ep.name()], hardware, _conv_weight(graph, n, ep, device)
            )
            reason = "cuDNN convolution + generated epilogue (" + ep.name() + ")"
        elif runs_as == "vendor" and vendor_kernel is not None and not emulate:
            fn = vendor_kernel(graph, n, device, hardware) or fn
        if gid is not None and runs_as == "vendor":
            reason = f"not fused: {reasons.get(gid, '')}"
        units.append(Unit(n.name, runs_as, fn, n.inputs, n.outputs, (n.name,), reason))
    return order_units(units)


def fastest(
    kernels: dict[str, object], graph: Graph, group: KernelGroup, device: torch.device
) -> tuple[str, str]:
    """The name of the fastest of ``kernels`` (variants of ``group``'s kernel) on sample
    inputs of the group's shapes (the graph's own constants), timed with CUDA events over
    interleaved rounds; and a line that says what was measured."""
    args = []
    for v in group.inputs:
        t = group.types[v]
        if v in graph.params:
            args.append(to_tensor(graph.params[v], device, t.layout))
        else:
            x = torch.randn(t.shape, device=device)
            args.append(x.contiguous(memory_format=memory_format_of(t)))
    outs = [
        torch.empty(
            t.shape,
            device=device,
            memory_format=memory_format_of(t),
        )
        for t in (group.types[v] for v in group.outputs)
    ]
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for k in kernels.values():
        k.out(*args, *outs)  # warm-up
    for _ in range(5):
        for name, k in kernels.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(3):
                k.out(*args, *outs)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 3 * 1e3)
    med = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    best = min(med, key=med.__getitem__)
    line = "; ".join(
        f"{name} {us:.1f} us" for name, us in sorted(med.items(), key=lambda kv: kv[1])
    )
    return best, f"{best} (measured: {line})"


def _epilogues(graph: Graph, in_group: dict[str, int]) -> dict[str, Epilogue]:
    """The conv2d nodes that run through cuDNN (not inside a generated group) and have an
    epilogue to fuse, by node name."""
    out = {}
    for n in graph.nodes():
        if n.op != "conv2d" or n.name in in_group:
            continue
        ep = conv_epilogue(graph, n)
        if ep is not None:
            out[n.name] = ep
    return out


def _conv_weight(graph: Graph, n: Node, ep: Epilogue, device: torch.device) -> torch.Tensor | None:
    """A constant weight, once, in the output's memory format (else PyTorch would convert
    it at every call); None when the weight is not a graph parameter."""
    arr = graph.params.get(n.inputs[1])
    if arr is None or graph.values[n.inputs[1]].layout == ep.layout:
        return None  # the plan's own constant is already in the output's format
    w = to_tensor(arr, device)
    return w.contiguous(memory_format=torch.channels_last) if ep.layout == "nhwc" else w


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
