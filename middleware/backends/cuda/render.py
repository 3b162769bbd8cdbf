"""Render an I/O-bound group to one CUDA C kernel (jinja2 template ``kernel.cu.j2``).

The mapping onto the GPU: the group's outputs are laid end to end in one index space, each
output in its own memory order (the contiguous dimension fastest, so that a warp's 32
threads read and write 32 neighbouring elements: coalesced in both layouts). One thread
computes one output element depth-first through every layer (see ``elements.py``); a
grid-stride loop covers the space. Block size and grid size come from the ``Hardware``
description (warp size, streaming multiprocessor count). Kernels use no shared memory and
no ``__syncthreads``: threads never wait for each other, which is also what lets the CPU
emulation (``emulate.h``) run them thread after thread.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path
from typing import Any

import jinja2

from ...errors import UnsupportedError
from ...hardware import Hardware
from ...ops import get_op
from .elements import cident, element_functions, memory_order, why_unsupported
from .group import KernelGroup

TEMPLATES = Path(__file__).parent / "templates"

# Threads per block, in warps: 8 warps (256 threads) keeps 8 blocks resident per SM on
# every architecture from sm_80 on, enough to hide memory latency in a streaming kernel.
WARPS_PER_BLOCK = 8
# Grid-stride: at most this many blocks per SM (more gives nothing but launch overhead).
BLOCKS_PER_SM = 32


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    grid: int
    block: int
    total: int


@dataclasses.dataclass(frozen=True)
class RenderedKernel:
    """A kernel's source and everything needed to launch it.

    ``inputs`` and ``outputs`` name the group's values in kernel-argument order (inputs
    first); ``out_types`` are the outputs' types (the caller allocates them in that layout).
    """

    name: str
    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    in_types: tuple[Any, ...]
    out_types: tuple[Any, ...]
    launch: LaunchConfig
    group: KernelGroup


@cache
def environment() -> jinja2.Environment:
    """The CUDA templates' jinja2 environment (``StrictUndefined``), shared by every
    renderer of this backend."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def launch_config(total: int, hardware: Hardware) -> LaunchConfig:
    """Block and grid sizes for ``total`` independent elements on ``hardware``."""
    warp = max(1, hardware.warp_size or 32)
    block = warp * WARPS_PER_BLOCK
    sms = max(1, hardware.cores)
    grid = max(1, min(-(-total // block), sms * BLOCKS_PER_SM))
    return LaunchConfig(grid, block, total)


# Outputs per thread along the innermost memory dimension, where that dimension's size is
# a multiple of it: one index decomposition per 4 elements, 4 independent element
# computations in flight, a float4 store where the address is aligned. (On an H200 the
# BN -> ReLU kernel moved 51% of the copy bandwidth one element per thread, instruction-
# bound; 83% with 4 per thread and the batch-norm as a multiply-add.)
VECTOR = 4


def vector_width(group: KernelGroup) -> int:
    """``VECTOR`` when every node is elementwise and every output's innermost memory
    dimension is a multiple of it. A window over the innermost dimension would spread a
    warp's loads 4x wider (3x3/2 max-pooling on an H200: 24.4 -> 34.1 us), so groups with
    windows, concats or reshapes keep one element per thread."""
    if not all(get_op(n.op).elementwise for n in group.nodes):
        return 1
    for v in group.outputs:
        t = group.types[v]
        order = memory_order(t)
        if t.rank == 0 or t.shape[order[-1]] % VECTOR:
            return 1
    return VECTOR


def _decompose(shape: tuple[int, ...], order: tuple[int, ...]) -> list[dict[str, str]]:
    """C expressions for the logical coordinates of memory-order index ``r``."""
    out = []
    inner = 1
    for pos in range(len(order) - 1, -1, -1):
        d = order[pos]
        div = "r" if inner == 1 else f"r / {inner}"
        expr = div if pos == 0 else f"({div}) % {shape[d]}"
        out.append({"name": f"i{d}", "expr": "0" if shape[d] == 1 else expr})
        inner *= shape[d]
    return list(reversed(out))


def value_names(group: KernelGroup, taken: set[str]) -> dict[str, str]:
    """A unique C identifier for every value of ``group`` (inputs, then node outputs),
    none of them in ``taken`` (the kernel's own names), which they join."""
    names: dict[str, str] = {}
    for v in group.inputs:
        names[v] = cident(v, taken)
    for n in group.nodes:
        for v in n.outputs:
            names[v] = cident(v, taken)
    return names


def kernel_name(group: KernelGroup) -> str:
    base = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in group.name)
    return f"mw_{base}"[:120]


def render_group(group: KernelGroup, hardware: Hardware, emulate: bool = True) -> RenderedKernel:
    """The CUDA C source of ``group`` and its launch configuration.

    Raises ``UnsupportedError`` when an op of the group has no element function or a value
    is not float32. ``emulate`` adds the ``#ifdef MW_EMULATE`` CPU entry point (ignored by
    nvcc).
    """
    reason = why_unsupported(group)
    if reason:
        raise UnsupportedError(f"group {group.name}: {reason}")
    if not group.outputs:
        raise UnsupportedError(f"group {group.name} writes nothing")
    names = value_names(group, {"a", "idx", "r", "step"})
    functions = element_functions(group, names)
    vec = vector_width(group)
    total, outs = 0, []
    for v in group.outputs:
        t = group.types[v]
        order = memory_order(t)
        coords = [f"i{d}" for d in range(t.rank)]
        calls = []
        for k in range(vec):
            args = list(coords)
            if k:
                args[order[-1]] = f"({args[order[-1]]} + {k})"
            calls.append(", ".join(["a", *args]))
        outs.append(
            {
                "value": v,
                "cname": names[v],
                "type": str(t),
                "rank": t.rank,
                "numel": t.numel,
                "start": total,
                "order_text": ", ".join(f"i{d}" for d in order) or "scalar",
                "decompose": _decompose(t.shape, order),
                "calls": calls,
            }
        )
        total += t.numel
    ins = [{"value": v, "cname": names[v], "type": str(group.types[v])} for v in group.inputs]
    launch = launch_config(total // vec, hardware)
    big = total + launch.grid * launch.block >= 2**31 or any(
        group.types[v].numel >= 2**31 for v in group.types
    )
    name = kernel_name(group)
    source = (
        environment()
        .get_template("kernel.cu.j2")
        .render(
            kernel=name,
            description=group.describe(),
            inputs=ins,
            outputs=outs,
            functions=functions,
            total=total,
            vec=vec,
            index_t="long long" if big else "int",
            grid=launch.grid,
            block=launch.block,
            emulate=emulate,
        )
    )
    return RenderedKernel(
        name,
        source,
        group.inputs,
        group.outputs,
        tuple(group.types[v] for v in group.inputs),
        tuple(group.types[v] for v in group.outputs),
        launch,
        group,
    )


def render_cuda(schedule: Any, hardware: Hardware, graph: Any = None) -> str:
    """The CUDA C source of a fused group for ``hardware``.

    ``schedule``: a :class:`KernelGroup`, or the backend-neutral ``Schedule`` of
    ``passes/schedule.py`` (its ``layers`` name the group's nodes) together with the
    ``graph`` it was made from. The CUDA backend keeps the schedule's fusion decision (which
    nodes, which values are written) and maps it onto the GPU its own way: one thread per
    output element, the halo recomputed in registers instead of a per-tile scratch buffer
    (on a GPU that buffer would live in local memory or need a block barrier).
    """
    return render_group(as_group(schedule, graph), hardware).source


def as_group(schedule: Any, graph: Any = None) -> KernelGroup:
    """A :class:`KernelGroup` from a group record: a ``KernelGroup`` itself, or a record
    naming its nodes (``layers``, ``node_names`` or ``nodes``) in ``graph`` (or in its own
    ``graph`` attribute)."""
    from .group import group_from_nodes

    if isinstance(schedule, KernelGroup):
        return schedule
    graph = graph if graph is not None else getattr(schedule, "graph", None)
    nodes = (
        getattr(schedule, "layers", None)
        or getattr(schedule, "node_names", None)
        or getattr(schedule, "nodes", None)
    )
    if graph is None or nodes is None:
        raise UnsupportedError(
            f"cannot render a {type(schedule).__name__} without the graph and its node names"
        )
    names = [n if isinstance(n, str) else n.name for n in nodes]
    return group_from_nodes(graph, names, str(getattr(schedule, "name", "") or ""))
