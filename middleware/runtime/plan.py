"""The executable plan: ordered steps over numbered value slots, and the loop that runs them.

A :class:`Plan` is built once per input signature from a passed graph. Each step is a
vendor call (the framework's ATen operator, oneDNN on CPU), a generated kernel (a fused
I/O-bound group), or a fallback (the original framework callable). Values live in a flat
list of slots; a slot is cleared right after its last reader so that memory is released
as early as eager PyTorch releases it.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..backends.interface import Unit, held_inputs, node_unit, to_tensor, users_tensor
from ..enums import RunsAs
from ..graph import PARAM_SOURCES, Graph, map_tree
from . import shortcut
from .memory import plan_memory as make_memory_plan
from .native import NativeProgram, not_native, same_values
from .native import record as record_native

_num_threads = torch.get_num_threads

# The largest arena the native runner asks for (every intermediate value in it, none
# allocated during a call): a plan whose arena would be larger keeps the planner's
# framework allocations and runs its steps from Python (a large network's steps are long
# enough that the Python between them is a small share).
NATIVE_ARENA_MAX = 64 << 20


@dataclasses.dataclass(frozen=True)
class Step:
    """One call of the plan: ``fn(*slots[ins])`` writes ``slots[outs]``."""

    name: str
    runs_as: RunsAs
    fn: Callable[..., Any]
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    nodes: tuple[str, ...]
    frees: tuple[int, ...] = ()
    reason: str = ""
    algorithm: str = ""  # a vendor op's algorithm (Unit.algorithm)


class Plan:
    """Steps over slots; ``run`` takes the input tensors and returns the output structure."""

    def __init__(
        self,
        graph: Graph,
        steps: list[Step],
        slot_of: dict[str, int],
        constants: dict[int, torch.Tensor],
    ) -> None:
        self.graph = graph
        self.steps = steps
        self.slot_of = slot_of
        self.n_slots = len(slot_of)
        self.input_slots = tuple(slot_of[v] for v in graph.inputs)
        self.output_slots = [slot_of[v] for v in graph.output_values()]
        template: list[Any] = [None] * self.n_slots
        for s, t in constants.items():
            template[s] = t
        self._template = template
        self._out_tree = graph.output_tree
        self._single_out = (
            slot_of[graph.output_tree] if isinstance(graph.output_tree, str) else None
        )
        self._program = [(st.fn, st.ins, st.outs, len(st.outs) > 1, st.frees) for st in steps]
        # the buffer plan (runtime/memory.py), when planning is on: its arena and the steps
        # that write into it; a re-entrant call (another thread) runs the unplanned steps
        self.memory = None
        self.arena: torch.Tensor | None = None
        self._unplanned = self._program
        self.recycled: list[Any] = []  # planned_steps.Recycled of the graph outputs
        self._busy = threading.Lock()
        # the native runner (runtime/native.py): None (off), the cache folder of its C loop
        # while the next planned run is to record the program, then the NativeProgram
        self._native: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Plan:
        # A plan is immutable once built (loaded kernels, prepacked weights); copies of an
        # OptimizedModule share it, and its lock sends a concurrent caller down the unplanned
        # steps, so sharing the arena is safe.
        return self

    def use_memory_plan(self, planned: Any) -> None:  # planned: memory.PlannedUnits
        """Run the steps through the buffer plan's functions (same values, reused memory)."""
        self.memory, self.arena = planned.memory, planned.arena
        self.recycled = planned.recycled
        self._program = [
            (fn, ins, outs, multi, frees)
            for fn, (_, ins, outs, multi, frees) in zip(planned.fns, self._unplanned, strict=True)
        ]

    # -------------------------------------------------------- what the profiler asks
    notes: tuple[str, ...] = ()
    consumes_inputs = False
    # parameters derived by the passes (not the user's tensors) that every step reading
    # them holds its own copy of: no constant here (build_plan), so the weight lives once
    held_params: frozenset[str] = frozenset()

    def arenas(self) -> list[torch.Tensor]:
        """The buffer plan's arena(s), live for as long as the plan, and the output buffers
        it keeps between calls (``planned_steps.Recycled``): I/O memory the plan holds."""
        kept = [t for r in self.recycled for t in r.buffers()]
        return ([] if self.arena is None else [self.arena]) + kept

    @property
    def arena_bytes(self) -> int:
        return 0 if self.memory is None else self.memory.arena_bytes

    def held_tensors(self) -> list[torch.Tensor]:
        """Tensors the steps hold themselves (``fn.keep``: an algorithm's packed or
        transformed weights read through raw pointers, which the dispatcher never sees)."""
        return [
            t
            for st in self.steps
            for t in getattr(st.fn, "keep", ())
            if isinstance(t, torch.Tensor)
        ]

    def param_tensors(self) -> list[torch.Tensor]:
        """The plan's constants (weights, folded batch-norm parameters)."""
        return [t for t in self._template if isinstance(t, torch.Tensor)]

    def predicted_peak_io(self) -> int | None:
        """The buffer plan's predicted peak I/O bytes (None without a buffer plan)."""
        return None if self.memory is None else self.memory.predicted_peak_io()

    def step_placements(self) -> list[str]:
        """Where each step's first output lives under the buffer plan ("-" without one)."""
        names = {s: v for v, s in self.slot_of.items()}
        if self.memory is None:
            return ["-"] * len(self.steps)
        return [
            self.memory.placements[names[st.outs[0]]].kind if st.outs else "-" for st in self.steps
        ]

    def step_out_bytes(self) -> list[int]:
        """Bytes of each step's outputs (at the batch the plan runs at)."""
        names = {s: v for v, s in self.slot_of.items()}
        return [sum(self.graph.values[names[o]].nbytes for o in st.outs) for st in self.steps]

    def timed_run(self, inputs: Sequence[torch.Tensor]) -> tuple[list[float], Any]:
        """Run once step by step: (milliseconds of each step, the outputs)."""
        device = inputs[0].device if inputs else torch.device("cpu")
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda d: None)
        times: list[float] = [0.0] * len(self._program)

        def timed(k: int, fn: Callable[..., Any]) -> Callable[..., Any]:
            def step(*args: Any) -> Any:
                sync(device)
                t0 = time.perf_counter()
                r = fn(*args)
                sync(device)
                times[k] = (time.perf_counter() - t0) * 1e3
                return r

            return step

        program = [(timed(k, p[0]), *p[1:]) for k, p in enumerate(self._program)]
        # the planned steps share the arena and the kept output buffers: a call of the
        # same plan from another thread meanwhile waits (as run() sends it elsewhere)
        with self._busy:
            out = self._run(list(inputs) if self.consumes_inputs else inputs, program)
        return times, out

    def step_times(self, inputs: Sequence[torch.Tensor], repeats: int) -> list[float]:
        """Median milliseconds of each step over ``repeats`` step-by-step runs."""
        runs = [self.timed_run(inputs)[0] for _ in range(repeats)]
        return [statistics.median(t) for t in zip(*runs, strict=True)]

    def run(self, inputs: Sequence[torch.Tensor]) -> Any:
        if self.memory is None:
            return self._run(inputs, self._program)
        if self._native is not None:
            out = self.run_native(inputs)
            if out is not None:
                return out
            # one caller at a time (blocking), from the moment a recording may start: the
            # native program bypasses the per-step locks the unplanned steps take around
            # their primitives
            with self._busy:
                native = self._native  # (read again: another caller may have recorded)
                if native is None or isinstance(native, NativeProgram):
                    # refused meanwhile, or recorded at another thread count
                    return self._run(inputs, self._program)
                return self._record_native(inputs, native)
        busy = self._busy
        if not busy.acquire(False):  # (not blocking)
            return self._run(inputs, self._unplanned)
        try:
            return self._run(inputs, self._program)
        finally:
            busy.release()

    def run_native(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The recorded native program's output for ``inputs``, or None where this call
        must take the steps (not recorded yet, refused, or recorded at another thread
        count): ``run``'s native branch, and the shortcut of ``OptimizedModule.__call__``
        (35-60 us fewer a call on a cold cache). The program runs no framework operation
        but handing out its output, so it needs neither ``run``'s other checks nor the
        caller's gradient mode switched off."""
        with self._busy:
            native = self._native
            if native.__class__ is NativeProgram and native.threads == _num_threads():
                return native(inputs)
        return None

    def use_native(self, cache_dir: Any) -> None:
        """Record the planned steps as one C call at the next run (runtime/native.py), where
        they allow it; ``report()`` notes the outcome."""
        if self.memory is not None and self._single_out is not None and not self.consumes_inputs:
            self._native = cache_dir
        else:
            self._note_native("the plan has no buffer plan or more than one output")

    def use_native_call(self) -> None:
        """The outputs' pools in C++ from the start (runtime/shortcut.cpp's Recycler: the
        module's C++ call takes from them), where the extension is loaded; else its build
        starts, and the module's call hands the pools over later."""
        ext = shortcut.extension()
        if ext is not None and self._native is not None:
            for pool in self.recycled:
                pool.adopt(ext)

    @property
    def may_run_native(self) -> bool:
        """A native program runs this plan or may, once recorded (not refused)."""
        return self._native is not None

    @property
    def native(self) -> NativeProgram | None:
        """The native program this plan runs, once recorded."""
        return self._native if isinstance(self._native, NativeProgram) else None

    def _record_native(self, inputs: Sequence[torch.Tensor], cache_dir: Any) -> Any:
        """Under ``_busy``: the planned steps run once, recorded; the program is then
        checked against that run with every intermediate poisoned first (NaN in the arena
        and the workspaces: a step that the program skips or misplaces shows), and kept
        only if its output is the same bit for bit. Any refusal keeps the Python steps."""
        names = [st.name for st in self.steps]
        prog, out, why = record_native(
            self._program,
            self._run,
            self._template,
            self._single_out,
            names,
            inputs,
            self.arena,
            cache_dir,
        )
        self._native = None  # unless the check below passes
        if prog is None:
            self._note_native(why)
            return out
        try:
            for buf in [self.arena, *prog.buffers]:
                if buf is not None and buf.numel() % 4 == 0:
                    buf.view(torch.float32).fill_(float("nan"))
            # into memory of its own (not a second kept output buffer)
            again = prog(inputs, torch.full_like(out, float("nan")))
        except Exception as e:  # noqa: BLE001 - a failing check refuses the runner, no more
            self._note_native(f"its check failed ({type(e).__name__}: {e})")
            return out
        if not same_values(out, again):
            self._note_native("its output differed from the Python steps' (not used)")
            return out
        self._native = prog
        self.notes = (
            *self.notes,
            f"native runner: {prog.n} steps run as one C call (runtime/native.py)",
        )
        return out

    def _note_native(self, why: str) -> None:
        self.notes = (*self.notes, f"native runner: off ({why}); the steps run from Python")

    def _run(self, inputs: Sequence[torch.Tensor], program: list) -> Any:
        env = self._template[:]
        for s, x in zip(self.input_slots, inputs, strict=True):
            env[s] = x
        x = None  # noqa: F841 - the loop variable must not keep the last input alive
        if self.consumes_inputs:  # the caller handed its references over (a list)
            inputs.clear()
        for fn, ins, outs, multi, frees in program:
            r = fn(*[env[i] for i in ins])
            if multi:
                for o, v in zip(outs, r, strict=True):
                    env[o] = v
                v = None  # noqa: F841 - the loop variable must not keep a freed value alive
            else:
                env[outs[0]] = r
            r = None
            for f in frees:
                env[f] = None
        if self._single_out is not None:
            return env[self._single_out]
        slot_of = self.slot_of
        return map_tree(self._out_tree, lambda name: env[slot_of[name]])


def build_plan(
    graph: Graph,
    device: torch.device,
    units: Sequence[Unit] | None = None,
    plan_memory: bool = False,
    owned: Sequence[str] = (),
    check_memory: bool | None = None,
    huge_pages: bool = False,
    native: Any = None,
    native_call: bool = False,
) -> Plan:
    """Assemble a plan from ``units`` in execution order; without them every node runs on
    its own through the framework. ``plan_memory``: run it through the buffer planner
    (runtime/memory.py: one reused arena, in-place ops, concat slices). ``owned``: graph
    inputs the caller hands over (``run`` empties its input list): they are freed after
    their last read instead of living for the whole call. ``check_memory``: the planner's
    run-time overlap check (``Options.check_memory``; None: its environment default).
    ``huge_pages``: the planner's long-lived CPU buffers ask for 2 MiB pages
    (``Options.huge_pages``, runtime/pages.py). ``native``: the cache folder of the native
    runner's C loop, to run a CPU plan as one C call where it allows (runtime/native.py;
    ``Options.native_runner``), or None. ``native_call``: such a plan's outputs come from
    the C++ call's pools (runtime/shortcut.py; ``Options.native_call``) where it is built."""
    slot_of: dict[str, int] = {}

    def slot(v: str) -> int:
        if v not in slot_of:
            slot_of[v] = len(slot_of)
        return slot_of[v]

    for v in graph.inputs:
        slot(v)
    if units is None:
        units = [node_unit(graph, n, device) for n in graph.nodes()]
    constants: dict[int, torch.Tensor] = {}
    sources = graph.meta.get(PARAM_SOURCES, {})
    unread = unread_params(graph, units)
    stood_in = [p for p in graph.released() if p in graph.params and p not in unread]
    if stood_in:  # a vendor call released a weight that another step still reads
        raise RuntimeError(
            f"build_plan: a step reads parameter {stood_in[0]!r}, which was released while "
            f"the plan was built ({graph.released()[stood_in[0]]})"
        )
    held: set[str] = set()
    own_consts: set[int] = set()  # the slots of constants the plan made (not the user's)
    for p, arr in graph.params.items():
        layout = graph.values[p].layout
        own = users_tensor(arr, sources.get(p), device, layout)
        if own is not None:  # the user's tensor: free to keep, whoever reads it
            constants[slot(p)] = own
        elif p in unread:  # every step holds its own copy: no second one here
            slot(p)
            held.add(p)
        else:
            constants[slot(p)] = to_tensor(arr, device, layout)
            own_consts.add(slot_of[p])
    tell_constants(units, slot_of, constants, own_consts)
    # liveness: the last unit that reads each slot frees it (never inputs, params, outputs)
    keep = (set(graph.inputs) - set(owned)) | set(graph.params) | set(graph.output_values())
    last_use: dict[str, int] = {}
    for i, u in enumerate(units):
        for v in u.inputs:
            last_use[v] = i
    frees_at: dict[int, list[int]] = {}
    for v, i in last_use.items():
        if v not in keep:
            frees_at.setdefault(i, []).append(slot(v))
    steps = []
    for i, u in enumerate(units):
        in_slots = tuple(slot(v) for v in u.inputs)
        out_slots = tuple(slot(v) for v in u.outputs)
        dead = [s for s in out_slots if graph_value_unused(u.outputs, out_slots, s, last_use, keep)]
        steps.append(
            Step(
                u.name,
                u.runs_as,
                u.fn,
                in_slots,
                out_slots,
                tuple(u.nodes),
                tuple(frees_at.get(i, [])) + tuple(dead),
                u.reason,
                u.algorithm,
            )
        )
    for v in graph.output_values():
        slot(v)
    plan = Plan(graph, steps, slot_of, constants)
    plan.consumes_inputs = bool(owned)
    plan.held_params = frozenset(held)
    if plan_memory:
        try:
            native_cpu = native is not None and device.type == "cpu" and not owned
            why_not = ""
            if native_cpu:
                ops = [graph.node(u.nodes[0]).op if len(u.nodes) == 1 else None for u in units]
                why_not = not_native(units, ops)
                native_cpu = not why_not
            planned = make_memory_plan(
                graph,
                units,
                device,
                owned,
                check=check_memory,
                huge_pages=huge_pages,
                arena_max=NATIVE_ARENA_MAX if native_cpu else None,
            )
            plan.use_memory_plan(planned)
            if native_cpu:
                plan.use_native(native)
                if native_call:
                    plan.use_native_call()
            elif why_not:
                plan._note_native(why_not)
        except Exception as e:  # noqa: BLE001 - a planner bug must not break optimize()
            warnings.warn(
                f"middleware: the buffer planner failed ({type(e).__name__}: {e}); "
                "running without it",
                RuntimeWarning,
                stacklevel=2,
            )
    return plan


def tell_constants(
    units: Sequence[Unit],
    slot_of: dict[str, int],
    constants: dict[int, torch.Tensor],
    own: set[int],
) -> None:
    """Hand each unit whose function asks (``fn.constant_inputs``: a CUDA generated kernel)
    the plan's own constants among its inputs, by position: tensors that only the plan
    holds and passes at every call as they are, so their checks can be made once. The
    user's tensors serving as constants (``users_tensor``) are left out: their storage can
    be swapped under the plan (``p.data = ...``), so they are checked at every call."""
    for u in units:
        note = getattr(u.fn, "constant_inputs", None)
        if note is None:
            continue
        mine = {}
        for k, v in enumerate(u.inputs):
            s = slot_of.get(v)
            if s in own:
                mine[k] = constants[s]
        note(mine)


def unread_params(graph: Graph, units: Sequence[Unit]) -> set[str]:
    """The parameters no unit reads: each unit that takes one as an input holds its own
    copy (``interface.holds_inputs``: a prepacked or transformed weight)."""
    read = set(graph.output_values())
    for u in units:
        held = held_inputs(u.fn)
        read.update(v for i, v in enumerate(u.inputs) if i not in held)
    return {p for p in graph.params if p not in read}


def graph_value_unused(
    outs: Sequence[str], out_slots: Sequence[int], s: int, last_use: dict[str, int], keep: set[str]
) -> bool:
    """An output of a step that nothing reads (e.g. an unused chunk of a split)."""
    v = outs[list(out_slots).index(s)]
    return v not in last_use and v not in keep
