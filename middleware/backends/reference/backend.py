"""The reference backend: runs a :class:`~middleware.passes.schedule_ir.Schedule` directly
in Python/numpy, on small shapes, as the golden model of every other backend.

It follows the "How to run a stage" conventions of ``passes/schedule_ir.py`` literally:
for each tile (the ``Tiling`` origins, in order), for each stage whose ``guard`` holds,
the outer ``loops`` are scanned in Python and the SIMD ``inner`` loop is one numpy
vector over the inner variable; reductions start from ``init`` in an accumulator row of
``acc_elems`` floats, scan ``reduction.loops`` and apply ``op`` over ``reduction.inner``,
then divide by ``divisor``. Bounds, guards, origins, divisors and indices are index trees
evaluated with ``index_expr.evaluate``; buffers are flat float32 arrays addressed with
``Buffer.strides`` and origins as the C code does; scalar functions are spelled in
numpy (``functions.py``).

Where a compiled kernel would silently read garbage, this one stops with
:class:`ScheduleError`: an index outside a buffer's extent, a read of a scratch element
no earlier stage of the tile wrote (scratch is fresh in every tile), an accumulator index
outside ``acc_elems``, a store outside the stage's ``covers``, an output element no stage
wrote.

``run(..., per_point=True)`` reads the same schedule one output element at a time, as
one-thread-per-output backends (CUDA) do (``points.py``).

``ReferenceBackend().run(schedule, inputs)`` maps framework tensors (the schedule's input
order, each in its ``Buffer.layout``) to the output tensor (in its layout);
``ReferenceBackend().build(graph, names, options, hardware)`` returns a
:class:`ReferenceKernel` with the x86 ``GeneratedKernel``'s calling convention
(``fn(*inputs) -> output``, ``out_fn(*inputs, out)``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...enums import Bound, RunsAs
from ...graph import Graph
from ...hardware import Hardware
from ...index_expr import Ix, evaluate
from ...loops import DIMS, Acc, Call, Const, Expr, Load, NotFusable, ParamVec
from ...options import Options
from ...passes.schedule import schedule_group
from ...passes.schedule_ir import Buffer, Loop, Schedule, Stage, Tiling
from ..interface import Unit, node_unit
from .functions import apply
from .points import run_points

F32 = np.float32


class ScheduleError(RuntimeError):
    """The schedule is wrong: running it as written reads or writes where it must not."""


Env = Mapping[str, Any]


def _int(x: Ix, env: Env) -> int:
    return int(evaluate(x, env))


def scan(loops: Sequence[Loop], env: Env) -> Iterator[dict[str, Any]]:
    """Every binding of ``loops`` (outermost first, inclusive bounds evaluated in the
    bindings of the loops outside them), each as ``env`` extended."""
    if not loops:
        yield dict(env)
        return
    lp, rest = loops[0], loops[1:]
    for v in range(_int(lp.lo, env), _int(lp.hi, env) + 1):
        yield from scan(rest, {**env, lp.var: v})


def tiles(t: Tiling) -> Iterator[dict[str, int]]:
    """The tile origins: ``t_d = 0, sizes[d], ... < extents[d]`` on each tiled dim."""
    dims = [(p, range(0, e, z)) for p, e, z in zip(t.params, t.extents, t.sizes, strict=True) if p]
    for values in itertools.product(*(r for _, r in dims)):
        yield {p: v for (p, _), v in zip(dims, values, strict=True)}


def to_flat(x: torch.Tensor, b: Buffer) -> np.ndarray:
    """A framework tensor as the flat float32 array of ``b`` (its memory order)."""
    if tuple(x.shape) != tuple(b.torch_shape):
        raise ValueError(f"{b.value}: shape {tuple(x.shape)}, the schedule has {b.torch_shape}")
    x = x.detach().to("cpu", torch.float32)
    if b.layout == "nhwc" and x.dim() == 4:
        x = x.permute(0, 2, 3, 1)
    return x.contiguous().reshape(-1).numpy()


def from_flat(a: np.ndarray, b: Buffer) -> torch.Tensor:
    """The flat array of ``b`` as a framework tensor of its shape, in its layout."""
    if b.layout == "nhwc" and len(b.torch_shape) == 4:
        n, c, h, w = b.torch_shape
        return torch.from_numpy(a.reshape(n, h, w, c).copy()).permute(0, 3, 1, 2)
    return torch.from_numpy(a.reshape(b.torch_shape).copy())


class _Run:
    """One execution of a schedule over flat buffers."""

    def __init__(self, s: Schedule, inputs: Sequence[np.ndarray]) -> None:
        self.s = s
        self.by_value = {b.value: b for b in s.buffers}
        self.mem: dict[str, np.ndarray] = {}
        self.written: dict[str, np.ndarray] = {}
        self.origin: dict[str, tuple[int, ...]] = {}
        self.params = {p.name: p.array() for p in s.params}
        self.stage: Stage | None = None
        for name, a in zip(s.inputs, inputs, strict=True):
            b = s.buffer(name)
            if a.shape != (b.elements,):
                raise ValueError(f"{b.value}: {a.shape[0]} elements, the schedule has {b.elements}")
            self.mem[name] = a
            self.origin[name] = (0, 0, 0, 0)
        (out,) = s.outputs
        self._fresh(s.buffer(out), {})

    # ------------------------------------------------------------------ buffers
    def _fresh(self, b: Buffer, env: Env) -> None:
        """A new allocation of ``b`` (NaN, nothing written), its origins in ``env``."""
        self.mem[b.name] = np.full(b.elements, np.nan, dtype=F32)
        self.written[b.name] = np.zeros(b.elements, dtype=bool)
        self.origin[b.name] = tuple(_int(o, env) for o in b.origin)

    def _where(self) -> str:
        return f"stage {self.stage.name!r}" if self.stage is not None else "the schedule"

    def address(self, b: Buffer, index: Sequence[Any], what: str) -> Any:
        """Flat offsets of ``index`` (ints or arrays per logical dim) in ``b``, checked
        against its extent."""
        addr: Any = 0
        strides, origin = b.strides, self.origin[b.name]
        for d in range(4):
            if b.extent[d] == 1:  # index 0 whatever the index says (broadcast)
                continue
            rel = np.asarray(index[d]) - origin[d]
            if rel.size and (rel.min() < 0 or rel.max() >= b.extent[d]):
                raise ScheduleError(
                    f"{self._where()} {what} {b.role} buffer {b.name} ({b.value}) at "
                    f"{DIMS[d]} = {np.unique(np.asarray(index[d])).tolist()}, outside "
                    f"{origin[d]}..{origin[d] + b.extent[d] - 1}"
                )
            addr = addr + rel * strides[d]
        return addr

    def load(self, x: Load, env: Env) -> np.ndarray:
        b = self.by_value[x.value]
        addr = self.address(b, [evaluate(i, env) for i in x.index], "reads")
        if b.role != "input" and not self.written[b.name][addr].all():
            raise ScheduleError(
                f"{self._where()} reads {b.role} buffer {b.name} ({b.value}) where no "
                f"earlier stage of this tile wrote"
            )
        return self.mem[b.name][addr]

    def store(self, st: Stage, env: Env, value: np.ndarray, n: int) -> None:
        b = self.s.buffer(st.target)
        if st.covers is not None and not np.all(evaluate(st.covers, env)):
            raise ScheduleError(f"{self._where()} writes outside the elements it covers")
        addr = self.address(b, [env[d] for d in DIMS], "writes")
        if np.ndim(addr) == 0 and n > 1:
            raise ScheduleError(f"{self._where()} writes {n} values to one element of {b.name}")
        addr = np.broadcast_to(addr, (n,))
        self.mem[b.name][addr] = np.broadcast_to(np.asarray(value, dtype=F32), (n,))
        self.written[b.name][addr] = True

    # -------------------------------------------------------------- expressions
    def expr(self, e: Expr, env: Env, acc: np.ndarray | None = None) -> np.ndarray:
        if isinstance(e, Const):
            return F32(e.value)  # type: ignore[return-value]
        if isinstance(e, Load):
            return self.load(e, env)
        if isinstance(e, ParamVec):
            data = self.params[e.name]
            i = np.asarray(evaluate(e.index, env))  # type: ignore[arg-type]
            if i.size and (i.min() < 0 or i.max() >= data.size):
                raise ScheduleError(f"{self._where()} reads {e.name} outside its {data.size}")
            return data[i]
        if isinstance(e, Acc):
            if acc is None:
                raise ScheduleError(f"{self._where()} reads the accumulator without a reduction")
            return acc
        if isinstance(e, Call):
            return apply(e.fn, [self.expr(a, env, acc) for a in e.args])
        raise TypeError(f"not an expression: {e!r}")

    # ------------------------------------------------------------------- stages
    def run(self) -> np.ndarray:
        s = self.s
        scratch = [b for b in s.buffers if b.role == "scratch"]
        for tile in tiles(s.tiling):
            for b in scratch:  # per thread in C; fresh per tile here, so stale reads fail
                self._fresh(b, tile)
            for st in s.stages:
                self.stage = st
                if st.guard is None or evaluate(st.guard, tile):
                    self.run_stage(st, tile)
            self.stage = None
        (out,) = s.outputs
        missing = ~self.written[out]
        if missing.any():
            raise ScheduleError(
                f"no stage wrote {int(missing.sum())} of the {missing.size} elements of the "
                f"output {s.buffer(out).value}"
            )
        return self.mem[out]

    def run_stage(self, st: Stage, tile: Env) -> None:
        red = st.reduction
        for env in scan(st.loops, tile):
            lo, hi = _int(st.inner.lo, env), _int(st.inner.hi, env)
            if hi < lo:
                continue
            n = hi - lo + 1
            row = {**env, st.inner.var: np.arange(lo, hi + 1)}
            if red is None:
                self.store(st, row, self.expr(st.expr, row), n)
                continue
            if n > self.s.acc_elems:
                raise ScheduleError(f"{self._where()}: a row of {n} > acc_elems")
            acc = np.full(self.s.acc_elems, red.init, dtype=F32)
            for wenv in scan(red.loops, env):
                rlo, rhi = _int(red.inner.lo, wenv), _int(red.inner.hi, wenv)
                if rhi < rlo:
                    continue
                if rlo - lo < 0 or rhi - lo >= self.s.acc_elems:
                    raise ScheduleError(
                        f"{self._where()}: accumulator index {rlo - lo}..{rhi - lo} outside "
                        f"0..{self.s.acc_elems - 1}"
                    )
                at = np.arange(rlo - lo, rhi - lo + 1)
                body = self.expr(red.body, {**wenv, red.inner.var: np.arange(rlo, rhi + 1)})
                acc[at] = apply("max" if red.op == "max" else "add", [acc[at], body])
            value = acc[:n]
            if red.divisor is not None:
                div = np.asarray(evaluate(red.divisor, row), dtype=F32)
                value = apply("div", [value, div])
            self.store(st, row, self.expr(st.expr, row, value), n)


def run_schedule(
    schedule: Schedule, inputs: Sequence[torch.Tensor], per_point: bool = False
) -> torch.Tensor:
    """The output of ``schedule`` on ``inputs`` (framework tensors in the schedule's input
    order); raises :class:`ScheduleError` where the schedule is wrong. ``per_point``: the
    one-thread-per-output reading (``points.py``: point loops and covers, no tiles)
    instead of the tiled loop nest."""
    if len(inputs) != len(schedule.inputs):
        raise TypeError(f"{schedule.name} takes {len(schedule.inputs)} inputs, got {len(inputs)}")
    flat = [to_flat(x, schedule.buffer(n)) for x, n in zip(inputs, schedule.inputs, strict=True)]
    if per_point:
        out = run_points(schedule, flat, ScheduleError)
    else:
        out = _Run(schedule, flat).run()
    return from_flat(out, schedule.buffer(schedule.outputs[0]))


@dataclasses.dataclass(frozen=True)
class ReferenceKernel:
    """A group run by the reference backend, with the calling convention of the x86
    ``GeneratedKernel``: value names in argument order, ``fn(*inputs) -> output`` and
    ``out_fn(*inputs, out)``."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    fn: Callable[..., torch.Tensor]
    out_fn: Callable[..., None]
    schedule: Schedule


class ReferenceBackend:
    """Schedules interpreted in numpy on the CPU: slow, for small shapes and tests."""

    name = "reference"
    device_type = "cpu"
    slices_batch = False

    def check_runtime(self) -> None:
        """numpy is all it needs."""

    def schedule(self, graph: Graph, nodes: Sequence[str], hardware: Hardware) -> Schedule:
        return schedule_group(graph, nodes, hardware)

    def run(
        self, schedule: Schedule, inputs: Sequence[torch.Tensor], per_point: bool = False
    ) -> torch.Tensor:
        """The output tensor of ``schedule`` on ``inputs`` (see :func:`run_schedule`)."""
        return run_schedule(schedule, inputs, per_point)

    def kernel(self, schedule: Schedule, per_point: bool = False) -> ReferenceKernel:
        """``schedule`` as a callable kernel (``per_point``: see :func:`run_schedule`)."""

        def fn(*xs: torch.Tensor) -> torch.Tensor:
            out = run_schedule(schedule, xs, per_point)
            dev = xs[0].device if xs else torch.device("cpu")
            return out if dev.type == "cpu" else out.to(dev)

        def out_fn(*args: torch.Tensor) -> None:
            *xs, out = args
            out.copy_(run_schedule(schedule, xs, per_point))

        values = tuple(schedule.buffer(n).value for n in schedule.inputs)
        outs = tuple(schedule.buffer(n).value for n in schedule.outputs)
        return ReferenceKernel(schedule.name, values, outs, fn, out_fn, schedule)

    def build(
        self, graph: Graph, names: Sequence[str], options: Options, hardware: Hardware
    ) -> ReferenceKernel:
        """The group ``names`` of ``graph`` scheduled for ``hardware`` and run in numpy
        (``options`` is unused: nothing is compiled or cached)."""
        return self.kernel(self.schedule(graph, names, hardware))

    def can_run(
        self,
        graph: Graph,
        nodes: Sequence[str],
        hardware: Hardware,
        options: Options | None = None,
    ) -> tuple[bool, str]:
        """Whether the group ``nodes`` has a schedule, and if not, why."""
        try:
            self.schedule(graph, nodes, hardware)
        except NotFusable as e:
            return False, str(e)
        return True, ""

    # ------------------------------------------------- the pipeline's interface
    def passes_off(self, options: Options) -> tuple[str, ...]:
        return ()

    def lower(self, graph: Graph, options: Options) -> Graph:
        return graph

    def units(
        self, graph: Graph, options: Options, hardware: Hardware, device: torch.device
    ) -> list[Unit]:
        """One unit per io group of the passes (``Node.group``, every node bound io) that
        has a schedule, run in numpy; every other node through the framework. A group's
        unit sits where its last node was (the graph's order stays a valid order)."""
        groups: dict[int, list[str]] = {}
        for node in graph.nodes():
            if node.group is not None:
                groups.setdefault(node.group, []).append(node.name)
        at_last: dict[str, tuple[list[str], ReferenceKernel]] = {}
        for group in groups.values():
            if any(graph.node(n).bound != Bound.IO for n in group):
                continue
            for names in self._pieces(graph, group, hardware):
                try:
                    at_last[names[-1]] = (names, self.build(graph, names, options, hardware))
                except NotFusable:
                    continue
        inside = {n for names, _ in at_last.values() for n in names}
        units: list[Unit] = []
        for node in graph.nodes():
            if node.name in at_last:
                names, k = at_last[node.name]
                units.append(
                    Unit(k.name, RunsAs.GENERATED, k.fn, k.inputs, k.outputs, tuple(names),
                         out_fn=k.out_fn)
                )  # fmt: skip
            elif node.name not in inside:
                units.append(node_unit(graph, node, device))
        return units

    def _pieces(self, graph: Graph, group: list[str], hardware: Hardware) -> list[list[str]]:
        """``group`` itself when it has a schedule, else its runs of nodes that each have
        one (a node without loop semantics splits it)."""
        if self.can_run(graph, group, hardware)[0]:
            return [group]
        runs: list[list[str]] = [[]]
        for n in group:
            if self.can_run(graph, [n], hardware)[0]:
                runs[-1].append(n)
            elif runs[-1]:
                runs.append([])
        return [r for r in runs if r]

    def finish(self, plan: Any, options: Options, inputs: Sequence[torch.Tensor] | None) -> Any:
        return plan
