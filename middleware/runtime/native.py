"""A whole CPU plan as one C call: the native runner.

A planned step is a Python closure around one C call (a generated kernel, a oneDNN
primitive, a GEMV), with the plan loop, the closure, the form's checks and ctypes' argument
conversion around it: 3-5 us a step, a third of mobilenet_v3_small's time at batch 1
(46 oneDNN convolutions took 509 us through their Python steps, 339 us as bare calls).

Where every step of a plan offers its call (``native_step``, from the destination forms'
``interface.NativeCall``) and every intermediate value lives in the arena, the plan is
recorded once: a run of its Python steps that notes each step's C function and arguments.
An argument must be a constant (a primitive's handle, a held weight's address), the
scratchpad, or memory of the call's inputs, of its output or of the arena; anything else
(a framework allocation made during the call) refuses the native runner. The recording
is then checked: the native program runs once on the same inputs and must give the
recorded output bit for bit, else it is refused too. Later calls fill the slot table
(each input's and the output's address) and run ``mw_run`` (backends/x86/runner.py).

Each refusal has a reason (``Plan.notes`` and ``report()``); the Python steps then run as
before. A program is tied to the thread count it was recorded at (oneDNN sizes a
primitive's scratchpad and splits its work for it): another count runs the Python steps.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..backends.interface import SCRATCH, Workspace
from ..backends.x86.runner import MAX_ARGS, Step, function_address, load_runner
from ..enums import RunsAs
from ..ops import get_op
from .planned_steps import NATIVE_NOTHING


class NativeRefused(Exception):
    """Why a plan cannot run as one C call."""


@dataclasses.dataclass
class NativeProgram:
    """The recorded C calls of one plan and what a call needs to run them."""

    steps: Any  # ctypes array of Step
    n: int
    n_inputs: int
    output_source: Callable[[], torch.Tensor]
    run: Any  # mw_run
    threads: int
    buffers: list[torch.Tensor | None]  # the scratchpad and the workspaces it passes
    names: list[str]
    kept: list[Any]  # what the calls' constants point into (NativeCall.keep)
    slots: Any = None  # the slot table, made once (callers take turns: Plan.run's lock)

    def __post_init__(self) -> None:
        self.slots = (ctypes.c_ssize_t * (self.n_inputs + 1))()

    def __call__(
        self, inputs: Sequence[torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The output for ``inputs`` (written into ``out`` where given: a tensor like the
        recorded output). One caller at a time: the slot table is filled in place (a new
        table each call cost 12 us more on a cold cache)."""
        if out is None:
            out = self.output_source()
        slots = self.slots
        i = 0
        for x in inputs:
            slots[i] = x.data_ptr()
            i += 1
        slots[i] = out.data_ptr()
        rc = self.run(self.steps, self.n, slots)
        if rc:
            raise RuntimeError(f"native runner: step {self.names[rc - 1]} reported a failure")
        return out


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a dense tensor covers, from its data pointer (what a call's slot holds)."""
    p = t.data_ptr()
    return p, p + t.numel() * t.element_size()


def _region(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.data_ptr() + st.nbytes()


def record(
    program: list,
    run: Callable[[Sequence[torch.Tensor], list], Any],
    template: list,
    out_slot: int,
    names: Sequence[str],
    inputs: Sequence[torch.Tensor],
    arena: torch.Tensor | None,
    cache_dir: Path,
) -> tuple[NativeProgram | None, Any, str]:
    """Run ``program`` (the plan's planned steps) once on ``inputs`` through ``run`` (the
    plan's own loop, ``Plan._run``), noting each step's C calls: (the native program or
    None, the run's output, why not where None). Every step runs exactly once whatever is
    refused (a step may have effects: a fallback's)."""
    missing = [nm for nm, p in zip(names, program, strict=True) if not hasattr(p[0], "native_step")]
    refused = [f"step {missing[0]} is not one C call"] if missing else []
    calls: list[tuple[str, Any]] = []  # (name, NativeCall, a list of them, or NATIVE_NOTHING)
    sources: list[Any] = []

    def noting(fn: Any, name: str, multi: bool, writes_output: bool) -> Callable[..., Any]:
        def step(*args: Any) -> Any:
            r = fn(*args)
            if not refused:
                why, call = _noted(fn, name, args, r, multi, writes_output)
                if why:
                    refused.append(why)
                calls.append((name, call))
                if writes_output:
                    sources.append(getattr(fn, "output_source", None))
            return r

        return step

    noted = [
        (noting(fn, name, multi, out_slot in outs), ins, outs, multi, frees)
        for (fn, ins, outs, multi, frees), name in zip(program, names, strict=True)
    ]
    out = run(inputs, noted)
    if refused:
        return None, out, refused[0]
    source = sources[0] if sources else None
    if source is None or not isinstance(out, torch.Tensor):
        return None, out, "the output is not written by a step into memory it allocates"
    try:
        return _encode(calls, template, inputs, out, source, arena, cache_dir), out, ""
    except NativeRefused as e:
        return None, out, str(e)
    except Exception as e:  # noqa: BLE001 - the runner's compile or load: refused, no more
        return None, out, f"{type(e).__name__}: {e}"


def _noted(
    fn: Any, name: str, args: tuple[Any, ...], r: Any, multi: bool, writes_output: bool
) -> tuple[str, Any]:
    """(why not, or ""; the step's native call) of one step that ran on ``args``."""
    try:
        call = fn.native_step(args, r)
    except Exception as e:  # noqa: BLE001 - a form's description failing refuses, no more
        return f"step {name}: its native form failed ({type(e).__name__}: {e})", None
    if call is None:
        return f"step {name} cannot be one C call on its operands", None
    if multi and (call is not NATIVE_NOTHING or writes_output):
        return f"step {name} has several outputs", None
    return "", call


def _encode(
    calls: list[tuple[str, Any]],
    template: list,
    inputs: Sequence[torch.Tensor],
    out: torch.Tensor,
    source: Callable[[], torch.Tensor],
    arena: torch.Tensor | None,
    cache_dir: Path,
) -> NativeProgram:
    """The recorded calls as the runner's step array (raises :class:`NativeRefused`)."""
    dynamic = [_span(x) for x in inputs] + [_span(out)]
    spans = sorted(d for d in dynamic if d[1] > d[0])
    if any(b[0] < a[1] for a, b in zip(spans, spans[1:], strict=False)):
        # (an address inside both could not say which slot it follows on later calls)
        raise NativeRefused("the recorded call's inputs share memory")
    # memory that lives as long as the plan: the arena and the plan's constants
    fixed = [_region(t) for t in [arena, *template] if isinstance(t, torch.Tensor)]
    records = [
        (name, c)
        for name, call in calls
        if call is not NATIVE_NOTHING
        for c in (call if isinstance(call, list) else [call])
    ]
    uses_scratch = any(a is SCRATCH for _, c in records for a in c.args)
    scratch_bytes = max((c.scratch_bytes for _, c in records), default=0)
    # (a primitive that needs none still gets a valid address)
    scratch = torch.empty(max(scratch_bytes, 64), dtype=torch.uint8) if uses_scratch else None
    spaces: dict[Workspace, torch.Tensor] = {}
    steps = (Step * max(len(records), 1))()
    for k, (name, call) in enumerate(records):
        if len(call.args) > MAX_ARGS:
            raise NativeRefused(f"step {name} takes more than {MAX_ARGS} arguments")
        st = steps[k]
        fn = call.fn if isinstance(call.fn, int) else function_address(cache_dir, call.fn)
        st.fn, st.status, st.nargs = fn, int(call.status), len(call.args)
        for j, a in enumerate(call.args):
            if isinstance(a, Workspace):
                if a not in spaces:
                    spaces[a] = torch.empty(max(a.nbytes, 64), dtype=torch.uint8)
                a = spaces[a].data_ptr()
            st.slot[j], st.off[j] = _argument(name, a, dynamic, fixed, scratch)
    return NativeProgram(
        steps,
        len(records),
        len(inputs),
        source,
        load_runner(cache_dir),
        torch.get_num_threads(),
        [scratch, *spaces.values()],
        [name for name, _ in records],
        [k for _, c in records for k in c.keep],
    )


def _argument(
    name: str,
    a: Any,
    dynamic: list[tuple[int, int]],
    fixed: list[tuple[int, int]],
    scratch: torch.Tensor | None,
) -> tuple[int, int]:
    """(slot, offset) of one argument: slot -1 for a constant (the offset its value)."""
    if a is SCRATCH:
        if scratch is None:
            raise NativeRefused(f"step {name}: a scratchpad without its size")
        return -1, scratch.data_ptr()
    if isinstance(a, bool) or not isinstance(a, (int, torch.Tensor)):
        raise NativeRefused(f"step {name}: an argument of type {type(a).__name__}")
    if isinstance(a, int):
        return -1, a
    p = a.data_ptr()
    for slot, (lo, hi) in enumerate(dynamic):
        if lo <= p < hi:
            return slot, p - lo
    if any(lo <= p < hi for lo, hi in fixed):
        return -1, p
    raise NativeRefused(
        f"step {name} reads or writes memory allocated during the call (not the arena's)"
    )


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit the same values (NaN where the other has NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def not_native(units: Sequence[Any], single_ops: Sequence[str | None]) -> str:
    """Why not every unit may offer native calls ("" where each may: a generated kernel, a
    vendor call with a native destination form, a view-like op or a concat; never a
    fallback). Only then does the planner keep every intermediate in the arena for the
    native runner (and record it)."""
    for u, op in zip(units, single_ops, strict=True):
        if u.runs_as == RunsAs.FALLBACK:
            return f"step {u.name} runs the original code"
        if u.runs_as == RunsAs.GENERATED:
            continue
        if getattr(getattr(u, "out_fn", None), "native", None) is not None:
            continue
        if op is not None and (op == "cat" or get_op(op).view_like):
            continue
        return f"step {u.name} is not one C call"
    return ""
