"""Render a backend-neutral :class:`~middleware.passes.schedule_ir.Schedule` to one CUDA C
kernel (jinja2 template ``kernel.cu.j2``).

The mapping onto the GPU: one thread per element of the schedule's output, walked in the
output's memory order (the contiguous dimension fastest, so that a warp's 32 threads read
and write 32 neighbouring elements: coalesced in both layouts); a grid-stride loop covers
the output. Every stage's target becomes a ``__device__`` element function of
``(n, c, h, w)`` computing the stage's expression (with its reduction: ``init``, ``op`` over
the body at the ``point_loops`` taps, the divisor); a stage that covers only part of its
target (a concat slice, ``Stage.covers``) is taken where its condition holds. A load of a
group input reads global memory at the buffer's layout strides; a load of another stage's
value calls that stage's element function at the load's index, which nvcc inlines: the
depth-first recompute. Expressions are printed with the backend's one function table
(``funcs.CUDA_FUNCS``). Kernels use no shared memory and no ``__syncthreads``: threads
never wait for each other, which is also what lets the CPU emulation (``emulate.h``) run
them thread after thread. Block and grid sizes come from the ``Hardware`` description.
"""

from __future__ import annotations

import dataclasses
import math
import re
from functools import cache
from pathlib import Path

import jinja2

from ...errors import UnsupportedError
from ...graph import TensorType
from ...hardware import Hardware
from ...index_expr import Int, to_c
from ...loops import DIMS, Acc, Load, ParamVec, leaves
from ...ops import get_op
from ...passes.schedule_ir import ORDER, Buffer, Schedule, Stage
from .funcs import HELPERS, cuda_expr, flt, index_c
from .taps import tap_range
from .tiles import TILE, TilePlan, tile_plan

TEMPLATES = Path(__file__).parent / "templates"

# Threads per block, in warps: 8 warps (256 threads) keeps 8 blocks resident per SM on
# every architecture from sm_80 on, enough to hide memory latency in a streaming kernel.
WARPS_PER_BLOCK = 8
# Grid-stride: at most this many blocks per SM (more gives nothing but launch overhead).
BLOCKS_PER_SM = 32
# Outputs per thread along the innermost memory dimension, where that dimension's size is
# a multiple of it: one index decomposition per 4 elements, 4 independent element
# computations in flight, a float4 store where the address is aligned. (On an H200 the
# BN -> ReLU kernel moved 51% of the copy bandwidth one element per thread, instruction-
# bound; 83% with 4 per thread and the batch-norm as a multiply-add.)
VECTOR = 4
# Elements per thread per grid-stride iteration where one thread computes one element
# (windows, concats, reshapes): ``ILP`` elements a grid stride apart, so that a warp's
# accesses stay as coalesced as with one, while each thread has the loads of ``ILP``
# independent elements in flight. Measured on an H100 (bench/gpu_diag.py, 2026-11-27): the
# BN -> ReLU -> 3x3/2 max-pool kernel and its parts with the pool moved 73-78% of the copy
# bandwidth with one element per iteration and 68-75% with two, in both layouts (BN -> ReLU
# alone: 84-86% either way): one it is (two stays selectable for the variants run).
ILP = 1
# Window schedules over a group input's pointwise prologue can render as shared-memory
# tiles (``tiles.py``). Off: measured on an H200 (bench/gpu_chain.py, 2026-11-27), the
# BN -> ReLU -> 3x3/2 max-pool kernel took 44.3 us tiled (NCHW; 49.6 channels_last)
# against 24.7 us flat (24.5). That tiled kernel loaded its box in a rolled loop, one load
# in flight per thread; the box loads now go to registers first in unrolled loops (all in
# flight), not yet measured: bench/gpu_chain.py's mw_kernel/mw_flat rows decide.
TILED = False


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    grid: int
    block: int
    total: int


@dataclasses.dataclass(frozen=True)
class RenderedKernel:
    """A kernel's source and everything needed to launch it.

    ``inputs`` and ``outputs`` name the graph values in kernel-argument order (inputs
    first); ``in_types``/``out_types`` their types (the caller allocates outputs in that
    layout); ``schedule`` is the schedule rendered.
    """

    name: str
    source: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    in_types: tuple[TensorType, ...]
    out_types: tuple[TensorType, ...]
    launch: LaunchConfig
    schedule: Schedule


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


# ----------------------------------------------------------------------- identifiers
# Identifiers from the user's graph get their own namespace: buffers ``v_<name>``, their
# element functions ``e_<name>``, constant vectors ``p_<name>``. The kernel's own names
# (n, c, h, w, k_h, k_w, a, q, r, o, v0.., acc, acc_v, step, the mw_* helpers) start with
# none of these prefixes.
_NOT_IDENT = re.compile(r"[^0-9A-Za-z_]")


def buffer_ident(name: str) -> str:
    return "v_" + _NOT_IDENT.sub("_", name)


def function_ident(name: str) -> str:
    return "e_" + _NOT_IDENT.sub("_", name)


def param_ident(name: str) -> str:
    return "p_" + _NOT_IDENT.sub("_", name)


def comment(text: str) -> str:
    """``text`` safe inside a ``//`` comment line."""
    return text.replace("\n", " ")


def kernel_name(schedule: Schedule, name: str | None = None) -> str:
    """The kernel's C name: ``mw_`` and the schedule's name (or ``name``)."""
    return ("mw_" + _NOT_IDENT.sub("_", name or schedule.name))[:120]


def tensor_type(b: Buffer) -> TensorType:
    """The framework type of a global buffer (its real shape, its memory layout)."""
    return TensorType(
        tuple(b.torch_shape), "float32", b.layout if len(b.torch_shape) == 4 else "nchw"
    )


# ----------------------------------------------------------------------- elements
class _Printer:
    """CUDA C text of a schedule's expressions: loads of group inputs read memory, loads
    of stage values call their element functions, constants come from the params."""

    def __init__(self, s: Schedule) -> None:
        self.s = s
        self.by_value = {b.value: b for b in s.buffers}

    def load(self, x: Load) -> str:
        b = self.by_value.get(x.value)
        if b is None:
            raise UnsupportedError(f"load of {x.value}, which the schedule does not hold")
        index = [index_c(i) for i in x.index]
        if b.role != "input":
            return f"{function_ident(b.name)}(a, {', '.join(index)})"
        wide = b.elements >= 2**31
        terms = []
        for d, stride in enumerate(b.strides):
            if b.extent[d] == 1:
                continue
            ix = f"(long long){index[d]}" if wide else index[d]
            terms.append(ix if stride == 1 else f"{ix} * {stride}")
        return f"a.{buffer_ident(b.name)}[{' + '.join(terms) or '0'}]"

    @staticmethod
    def param(p: ParamVec) -> str:
        return f"{param_ident(p.name)}[{index_c(p.index)}]"

    def expr(self, e: object, acc: str = "acc_v") -> str:
        return cuda_expr(e, self.load, self.param, acc)  # type: ignore[arg-type]

    def stage(self, st: Stage) -> list[str]:
        """Lines computing one element of ``st``'s target at (n, c, h, w), ending in a
        ``return``."""
        red = st.reduction
        if red is None:
            return [f"return {self.expr(st.expr)};"]
        if red.op not in ("max", "sum"):
            raise UnsupportedError(f"stage {st.name}: reduction {red.op!r}")
        lines = [f"float acc = {flt(red.init)};"]
        depth = 0
        ranges = {
            d: (0, size - 1) for d, size in zip(DIMS, self.s.buffer(st.target).shape, strict=True)
        }
        for lp in red.point_loops:
            pad = "  " * depth
            lo, hi = index_c(lp.lo), index_c(lp.hi)
            taps = tap_range(lp, ranges)
            if taps is None:
                lines.append(f"{pad}for (int {lp.var} = {lo}; {lp.var} <= {hi}; ++{lp.var}) {{")
            else:
                # a constant trip count nvcc unrolls; taps outside this point's window
                # (clipped at the input's border) are skipped
                first, last = taps
                ranges[lp.var] = taps
                lines.append(f"{pad}#pragma unroll")
                lines.append(
                    f"{pad}for (int {lp.var} = {first}; {lp.var} <= {last}; ++{lp.var}) {{"
                )
                skip = []
                if lp.lo != Int(first):
                    skip.append(f"{lp.var} < {lo}")
                if lp.hi != Int(last):
                    skip.append(f"{lp.var} > {hi}")
                if skip:
                    lines.append(f"{pad}  if ({' || '.join(skip)}) continue;")
            depth += 1
        body = self.expr(red.body)
        step = f"mw_max(acc, {body})" if red.op == "max" else f"acc + {body}"
        lines.append("  " * depth + f"acc = {step};")
        for d in reversed(range(depth)):
            lines.append("  " * d + "}")
        if red.divisor is not None:
            lines.append(f"const float acc_v = acc / (float){index_c(red.divisor)};")
        else:
            lines.append("const float acc_v = acc;")
        lines.append(f"return {self.expr(st.expr)};")
        return lines


def _uses_acc(st: Stage) -> bool:
    return any(isinstance(x, Acc) for x in leaves(st.expr))


def element_functions(s: Schedule) -> list[dict]:
    """One element function per buffer a stage computes, in stage order (a function is
    defined before the stages that call it)."""
    pr = _Printer(s)
    by_target: dict[str, list[Stage]] = {}
    for st in s.stages:
        if st.reduction is None and _uses_acc(st):
            raise UnsupportedError(f"stage {st.name} reads an accumulator it has not")
        by_target.setdefault(st.target, []).append(st)
    out = []
    for target, stages in by_target.items():
        b = s.buffer(target)
        body: list[str] = []
        covered = False
        for st in stages:
            cond = st.covers
            lines = pr.stage(st)
            body.append(f"// {comment(st.name)}")
            if cond is None:
                body += lines
                covered = True
                break
            body.append(f"if ({to_c(cond)}) {{")
            body += ["  " + line for line in lines]
            body.append("}")
        if not covered:
            body.append("return 0.0f;  // no stage covers this element (never reached)")
        out.append(
            {
                "fname": function_ident(b.name),
                "body": body,
                "comment": f"{b.value}: {b.role}, logical {'x'.join(map(str, b.shape))}",
            }
        )
    return out


# ------------------------------------------------------------------------- kernel
def _innermost(b: Buffer) -> int:
    """The logical dim that varies fastest in ``b``'s memory among those longer than 1
    (a (N, C) value's C, not its logical w of size 1)."""
    order = ORDER[b.layout]
    return next((d for d in reversed(order) if b.shape[d] > 1), order[-1])


def vector_width(s: Schedule) -> int:
    """``VECTOR`` when every op of the schedule is elementwise and the output's innermost
    memory dimension is a multiple of it. A window over the innermost dimension would
    spread a warp's loads 4x wider (3x3/2 max-pooling on an H200: 24.4 -> 34.1 us), so
    schedules with windows, concats or reshapes keep one element per thread."""
    if not all(get_op(op).elementwise for op in s.ops):
        return 1
    out = s.buffer(s.outputs[0])
    return VECTOR if out.shape[_innermost(out)] % VECTOR == 0 else 1


def _decompose(
    shape: tuple[int, ...], order: tuple[int, ...], var: str = "r"
) -> list[dict[str, str]]:
    """C expressions for the logical coordinates of memory-order index ``var``."""
    out = []
    inner = 1
    for pos in range(len(order) - 1, -1, -1):
        d = order[pos]
        div = var if inner == 1 else f"{var} / {inner}"
        expr = div if pos == 0 else f"({div}) % {shape[d]}"
        out.append({"name": DIMS[d], "expr": "0" if shape[d] == 1 else expr})
        inner *= shape[d]
    return list(reversed(out))


def _ilp_element(out: Buffer, order: tuple[int, ...], k: int) -> dict:
    """The ``k``-th of a thread's ``ILP`` elements in one grid-stride iteration: its index
    (``q + k * step``, clamped to ``q`` past the end), coordinates ``n<k>, c<k>, ...``."""
    r = f"r{k}"
    total = out.elements
    init = "q" if k == 0 else f"q + {k} * step < {total} ? q + {k} * step : q"
    dec = _decompose(out.shape, order, r)
    for d in dec:
        d["name"] = f"{d['name']}{k}"
    # the element function takes (n, c, h, w), whatever the memory order
    return {"r": r, "init": init, "decompose": dec, "args": ", ".join(f"{d}{k}" for d in DIMS)}


def _param_text(p: ParamVec, per_line: int = 6) -> str:
    vals = [flt(v) for v in p.data]
    rows = [", ".join(vals[i : i + per_line]) for i in range(0, len(vals), per_line)]
    return ",\n".join("  " + r for r in rows)


class _TilePrinter(_Printer):
    """The output stage of a tiled kernel: a load of ``tiles.TILE`` reads the shared box
    (its coordinates relative to the box's first element ``o_c, o_h, o_w``)."""

    def __init__(self, s: Schedule, plan: TilePlan) -> None:
        super().__init__(s)
        self.plan = plan

    def load(self, x: Load) -> str:
        if x.value != TILE:
            return super().load(x)
        p = self.plan
        local = {0: "0", 1: f"({index_c(x.index[1])} - o_c)"}
        local[2] = f"({index_c(x.index[2])} - o_h)"
        local[3] = f"({index_c(x.index[3])} - o_w)"
        flat = ""
        for d in p.order:
            if p.region[d] == 1:
                continue
            flat = local[d] if not flat else f"({flat}) * {p.region[d]} + {local[d]}"
        return f"s_tile[{flat or '0'}]"


def _tile_decompose(
    extents: tuple[int, ...],
    order: tuple[int, ...],
    var: str,
    names: dict[int, str],
    base: dict[int, str],
) -> list[dict[str, str]]:
    """C for each dim's coordinate ``base + local`` of flat index ``var`` over a box of
    ``extents`` laid out in ``order``."""
    out = []
    inner = 1
    for pos in range(len(order) - 1, -1, -1):
        d = order[pos]
        div = var if inner == 1 else f"{var} / {inner}"
        local = "0" if extents[d] == 1 else (div if pos == 0 else f"({div}) % {extents[d]}")
        b = base[d]
        out.append({"name": names[d], "expr": b if local == "0" else f"{b} + {local}"})
        inner *= extents[d]
    return list(reversed(out))


def _render(
    template: str,
    s: Schedule,
    name: str,
    launch: LaunchConfig,
    emulate: bool,
    out_extra: dict,
    **env: object,
) -> RenderedKernel:
    """Render ``template`` with what every CUDA kernel template takes (the schedule's
    description, helpers, constant vectors, input and output buffers, the launch) and
    ``env``; the kernel's record."""
    out = s.buffer(s.outputs[0])
    ins = [s.buffer(n) for n in s.inputs]
    source = (
        environment()
        .get_template(template)
        .render(
            kernel=name,
            description=s.description,
            helpers=HELPERS,
            params=[
                {"cname": param_ident(p.name), "size": len(p.data), "text": _param_text(p)}
                for p in s.params
            ],
            inputs=[
                {"cname": buffer_ident(b.name), "value": b.value, "type": str(tensor_type(b))}
                for b in ins
            ],
            out={
                "cname": buffer_ident(out.name),
                "fname": function_ident(out.name),
                "value": out.value,
                "type": str(tensor_type(out)),
                "order_text": ", ".join(DIMS[d] for d in ORDER[out.layout]),
                **out_extra,
            },
            grid=launch.grid,
            block=launch.block,
            emulate=emulate,
            **env,
        )
    )
    return RenderedKernel(
        name,
        source,
        tuple(b.value for b in ins),
        (out.value,),
        tuple(tensor_type(b) for b in ins),
        (tensor_type(out),),
        launch,
        s,
    )


def _render_tiled(
    s: Schedule, plan: TilePlan, hardware: Hardware, emulate: bool, name: str
) -> RenderedKernel:
    """The shared-memory tiled kernel of ``s`` (``tiles.py``)."""
    out = s.buffer(s.outputs[0])
    src = next(b for b in s.buffers if b.value == plan.source and b.role == "input")
    pr = _TilePrinter(s, plan)
    order = plan.order
    counts = [-(-out.shape[d] // plan.tile[d]) for d in range(4)]
    ntiles = math.prod(counts)
    # the tile's output origin: tile index decomposed over the tile counts, in memory order
    tile_dec = []
    inner = 1
    for pos in range(len(order) - 1, -1, -1):
        d = order[pos]
        div = "tile" if inner == 1 else f"tile / {inner}"
        idx = "0" if counts[d] == 1 else (div if pos == 0 else f"({div}) % {counts[d]}")
        expr = idx if plan.tile[d] == 1 else f"({idx}) * {plan.tile[d]}"
        tile_dec.append({"name": DIMS[d], "expr": "0" if idx == "0" else expr})
        inner *= counts[d]
    tile_dec.reverse()
    first = {}
    for d in (1, 2, 3):
        m = plan.maps[d]
        first[DIMS[d]] = f"t_{DIMS[d]}" if m is None else m.first(f"t_{DIMS[d]}")
    region_dec = _tile_decompose(
        plan.region,
        order,
        "e",
        dict(enumerate(DIMS)),
        {0: "t_n", 1: "o_c", 2: "o_h", 3: "o_w"},
    )
    out_dec = _tile_decompose(
        plan.tile,
        order,
        "e",
        dict(enumerate(DIMS)),
        {0: "t_n", 1: "t_c", 2: "t_h", 3: "t_w"},
    )
    region_guard = []
    for d in (1, 2, 3):
        v, size = DIMS[d], src.shape[d]
        if plan.maps[d] is not None:
            region_guard.append(f"{v} >= 0 && {v} < {size}")
        elif out.shape[d] % plan.tile[d]:
            region_guard.append(f"{v} < {size}")
    out_guard = [f"{DIMS[d]} < {out.shape[d]}" for d in (1, 2, 3) if out.shape[d] % plan.tile[d]]
    big = any(b.elements >= 2**31 for b in s.buffers)
    offset = (
        " + ".join(
            (f"(long long){DIMS[d]}" if big else DIMS[d])
            + ("" if out.strides[d] == 1 else f" * {out.strides[d]}")
            for d in range(4)
            if out.shape[d] > 1
        )
        or "0"
    )
    launch = LaunchConfig(
        max(1, min(ntiles, max(1, hardware.cores) * BLOCKS_PER_SM)),
        max(1, hardware.warp_size or 32) * WARPS_PER_BLOCK,
        out.elements,
    )
    return _render(
        "kernel_tiled.cu.j2",
        s,
        name,
        launch,
        emulate,
        {},
        source=plan.source,
        staged=pr.expr(plan.staged),
        body=pr.stage(plan.stage),
        tile_text="x".join(str(plan.tile[d]) for d in range(4)),
        region_text="x".join(str(plan.region[d]) for d in range(4)),
        smem=plan.smem_floats,
        tile_outputs=plan.tile_outputs,
        load_iters=-(-plan.smem_floats // launch.block),
        out_iters=-(-plan.tile_outputs // launch.block),
        ntiles=ntiles,
        tile_decompose=tile_dec,
        first=first,
        region_decompose=region_dec,
        region_guard=" && ".join(region_guard),
        out_decompose=out_dec,
        out_guard=" && ".join(out_guard),
        out_offset=offset,
    )


def render_schedule(
    s: Schedule, hardware: Hardware, emulate: bool = True, name: str | None = None
) -> RenderedKernel:
    """The CUDA C source of schedule ``s`` and its launch configuration; ``name`` names
    the kernel instead of the schedule's name (kernels sharing one library).

    Raises ``UnsupportedError`` when the schedule holds something this renderer cannot
    print (a function without a CUDA spelling, a reduction without its point loops).
    ``emulate`` adds the ``#ifdef MW_EMULATE`` CPU entry point (ignored by nvcc).
    """
    if len(s.outputs) != 1:
        raise UnsupportedError(f"schedule {s.name} has {len(s.outputs)} outputs; one needed")
    plan = tile_plan(s, hardware) if TILED else None
    if plan is not None:
        return _render_tiled(s, plan, hardware, emulate, kernel_name(s, name))
    functions = element_functions(s)
    out = s.buffer(s.outputs[0])
    vec = vector_width(s)
    order = ORDER[out.layout]
    inner = DIMS[_innermost(out)]
    calls = []
    for k in range(vec):
        calls.append(", ".join(f"{d} + {k}" if d == inner and k else d for d in DIMS))
    total = out.elements
    ilp = ILP if vec == 1 else 1
    launch = launch_config(-(-(total // vec) // ilp), hardware)  # threads: ilp elements each
    big = total + ilp * launch.grid * launch.block >= 2**31 or any(
        b.elements >= 2**31 for b in s.buffers
    )
    return _render(
        "kernel.cu.j2",
        s,
        kernel_name(s, name),
        launch,
        emulate,
        {
            "decompose": _decompose(out.shape, order),
            "ilp": [_ilp_element(out, order, k) for k in range(ilp)],
            "calls": calls,
        },
        functions=functions,
        total=total,
        vec=vec,
        ilp=ilp,
        index_t="long long" if big else "int",
    )


def render_cuda(schedule: Schedule, hardware: Hardware) -> str:
    """The CUDA C source of ``schedule`` for ``hardware`` (the backend's ``render``)."""
    return render_schedule(schedule, hardware, emulate=False).source
