"""Measuring a model and its optimized form: peak memory and latency, side by side.

:func:`measure` (``middleware.profile`` and ``OptimizedModule.profile`` call it) runs both
and returns a :class:`ProfileResult`.
Peak memory is *measured*, never estimated:

- on CPU a :class:`LiveStorageTracker` (a ``TorchDispatchMode``) sees every tensor an
  operator returns and counts each storage once, by its ``nbytes``, from the call that
  allocated it until the storage is freed (a ``weakref.finalize`` on the storage). Storages
  that existed before the call and are read by it are parameter memory (weights, buffers,
  packed weights); the inputs, the buffer plan's arena and everything allocated during the
  call are I/O (activation) memory;
- on CUDA the framework's own allocator statistics (``torch.cuda.max_memory_allocated``).

The optimized model's measured peak is cross-checked against its buffer plan (arena size
plus the framework allocations the plan predicts); a disagreement of more than
``PLAN_TOLERANCE`` is reported in ``result.notes`` and warned about.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..enums import RunsAs

# measured vs planned optimized peak: relative disagreement that triggers a warning
PLAN_TOLERANCE = 0.10
MIB = 2**20


# ------------------------------------------------------------------ live storages
class LiveStorageTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages while active (CPU or any device).

    ``io`` storages: those allocated while the mode is active, plus the ones declared with
    :meth:`add_io` (inputs, arenas). ``param`` storages: pre-existing storages that an
    operator reads. ``peak_io`` is the most I/O bytes live at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[object, int] = {}  # storage key -> nbytes (I/O storages alive)
        self._known: set[object] = set()  # pre-existing storages already classified
        self._params: dict[object, int] = {}
        self.current = 0
        self.peak_io = 0

    @staticmethod
    def _storage(t: torch.Tensor) -> tuple[object, int, object]:
        """(key, nbytes, owner) of ``t``'s memory; the bytes are freed with ``owner``.

        An opaque oneDNN tensor (a prepacked weight) exposes no storage: it is keyed by the
        tensor itself and counted as ``numel * element_size`` (oneDNN's blocked format may
        pad a little beyond that)."""
        if t.is_mkldnn:
            return ("opaque", id(t)), t.numel() * t.element_size(), t
        s = t.untyped_storage()
        return s._cdata, s.nbytes(), s

    def add_io(self, tensors: Sequence[torch.Tensor]) -> None:
        """Count these existing tensors' storages as live I/O memory (until freed)."""
        for t in tensors:
            self._track(t)
        for t in tensors:
            self._known.add(self._storage(t)[0])

    def _track(self, t: torch.Tensor) -> None:
        key, nbytes, owner = self._storage(t)
        if key in self._live or key in self._known or nbytes == 0:
            return
        self._live[key] = nbytes
        self.current += nbytes
        self.peak_io = max(self.peak_io, self.current)
        weakref.finalize(owner, self._free, key)

    def _free(self, key: object) -> None:
        self.current -= self._live.pop(key, 0)

    @property
    def param_bytes(self) -> int:
        return sum(self._params.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                key, nbytes, _ = self._storage(t)
                if key not in self._live and key not in self._known:
                    self._known.add(key)
                    self._params[key] = nbytes
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


# ------------------------------------------------------------------ result records
@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """Parameter bytes, peak I/O (activation) bytes, their sum, and the median latency.

    ``param_bytes``: on CPU the storages that existed before the call and that it reads
    (weights, buffers, packed weights; for the optimized model its plan's constants, not
    the original model it keeps a reference to); on CUDA the unique storages of the
    model's parameters and buffers (the plan's constants for the optimized model).
    ``peak_io_bytes`` counts the inputs (``input_bytes``), the arena and every storage
    allocated during the call, at the moment their sum is largest. Allocations that do
    not pass through the dispatcher (oneDNN scratchpads inside a kernel) are not seen.
    """

    param_bytes: int
    peak_io_bytes: int
    latency_ms: float
    input_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return self.param_bytes + self.peak_io_bytes


@dataclasses.dataclass(frozen=True)
class GroupProfile:
    """One step of the optimized plan: a fused group, a vendor call or a fallback."""

    step: str
    runs_as: RunsAs
    nodes: tuple[str, ...]
    ops: tuple[str, ...]
    time_ms: float
    out_bytes: int
    placement: str  # where its output lives: arena, slice, inplace, vendor, fresh, view


@dataclasses.dataclass(frozen=True)
class ProfileResult:
    """``original`` and ``optimized`` side by side, and the optimized plan's ``groups``.

    ``planned_peak_io_bytes``: the buffer plan's prediction for the optimized peak
    (inputs + arena + framework allocations), None without a buffer plan.
    """

    original: ModelProfile
    optimized: ModelProfile
    groups: tuple[GroupProfile, ...]
    device: str
    method: str
    planned_peak_io_bytes: int | None = None
    arena_bytes: int = 0
    notes: tuple[str, ...] = ()

    @property
    def io_ratio(self) -> float:
        """Optimized over original peak I/O memory."""
        return self.optimized.peak_io_bytes / max(self.original.peak_io_bytes, 1)

    def __str__(self) -> str:
        o, p = self.original, self.optimized

        def row(label: str, a: float, b: float, unit: str) -> str:
            ratio = f"{b / a:8.2f}x" if a else f"{'-':>9}"
            return f"{label:<22} {a:>12.2f} {b:>12.2f} {ratio}  {unit}"

        lines = [
            f"profile on {self.device} ({self.method})",
            f"{'':<22} {'original':>12} {'optimized':>12} {'ratio':>9}",
            row("parameter memory", o.param_bytes / MIB, p.param_bytes / MIB, "MiB"),
            row("peak I/O memory", o.peak_io_bytes / MIB, p.peak_io_bytes / MIB, "MiB"),
            row("peak total memory", o.peak_bytes / MIB, p.peak_bytes / MIB, "MiB"),
            row("latency (median)", o.latency_ms, p.latency_ms, "ms"),
        ]
        if self.planned_peak_io_bytes is not None:
            lines.append(
                f"buffer plan: arena {self.arena_bytes / MIB:.2f} MiB, predicted peak I/O "
                f"{self.planned_peak_io_bytes / MIB:.2f} MiB (measured {p.peak_io_bytes / MIB:.2f})"
            )
        if self.groups:
            lines.append("")
            lines.append(
                f"{'step':<36} {'runs as':<9} {'ms':>8} {'out MiB':>8} {'lives in':<8}  ops"
            )
            for g in self.groups:
                lines.append(
                    f"{g.step[:36]:<36} {g.runs_as:<9} {g.time_ms:>8.3f} "
                    f"{g.out_bytes / MIB:>8.2f} {g.placement:<8}  {' > '.join(g.ops)[:60]}"
                )
        lines.extend(self.notes)
        return "\n".join(lines)

    def plot(self, path: str | Path, title: str | None = None) -> Path:
        """Save a stacked bar chart (parameter and I/O memory, original vs optimized) as a
        PNG at ``path``. Needs matplotlib (``pip install matplotlib``)."""
        return plot_results({title or "model": self}, path)


def plot_results(results: dict[str, ProfileResult], path: str | Path) -> Path:
    """One pair of stacked bars (original, optimized) per named result, in MiB, in the
    manner of the BrainSlug paper's memory figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "plotting a profile needs matplotlib, which is not installed: pip install matplotlib"
        ) from None
    names = list(results)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(names) + 2), 4.6), dpi=120)
    width = 0.38
    colors = {"param": ("#9ecae1", "#3182bd"), "io": ("#fdae6b", "#e6550d")}
    for i, name in enumerate(names):
        r = results[name]
        for j, (_label, m) in enumerate((("original", r.original), ("optimized", r.optimized))):
            x = i + (j - 0.5) * width
            pa, io = m.param_bytes / MIB, m.peak_io_bytes / MIB
            ax.bar(x, pa, width * 0.95, color=colors["param"][j], edgecolor="black", lw=0.5)
            ax.bar(x, io, width * 0.95, bottom=pa, color=colors["io"][j], edgecolor="black", lw=0.5)
            ax.text(x, pa + io, f"{pa + io:.3g}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=20 if len(names) > 4 else 0)
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(
        "peak memory: parameters + I/O\n(left bar: original, right bar: optimized)", fontsize=9
    )
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color=colors["param"][0], label="parameters, original"),
            Patch(color=colors["io"][0], label="I/O, original"),
            Patch(color=colors["param"][1], label="parameters, optimized"),
            Patch(color=colors["io"][1], label="I/O, optimized"),
        ],
        fontsize=7,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.14),
        ncol=2,
        frameon=False,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# ------------------------------------------------------------------ measuring
def _as_tuple(inputs: Any) -> tuple[torch.Tensor, ...]:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _latency_ms(
    fn: Any, inputs: Sequence[torch.Tensor], repeats: int, device: torch.device
) -> float:
    times = []
    with torch.no_grad():
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            fn(*inputs)
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_peak(
    fn: Any,
    inputs: Sequence[torch.Tensor],
    persistent_io: Sequence[torch.Tensor] = (),
    params: Sequence[torch.Tensor] = (),
    held: Sequence[torch.Tensor] = (),
) -> tuple[int, int]:
    """(parameter bytes, peak I/O bytes) of one call ``fn(*inputs)`` under ``no_grad``.

    The inputs and ``persistent_io`` (e.g. an arena) count as live I/O from the start.
    On CPU, parameter bytes are the pre-existing storages the call reads, plus ``held``
    (storages a step reads through raw pointers, unseen by the dispatcher); on CUDA they
    are the unique storages of ``params``.
    """
    device = inputs[0].device if inputs else torch.device("cpu")
    if device.type == "cuda":
        return _measure_peak_cuda(fn, inputs, persistent_io, params)
    tracker = LiveStorageTracker()
    with torch.no_grad():
        tracker.add_io(list(inputs) + list(persistent_io))
        with tracker:
            out = fn(*inputs)
        peak = tracker.peak_io
        del out
    for t in held:
        key, nbytes, _ = tracker._storage(t)
        if key not in tracker._live and key not in tracker._params:
            tracker._params[key] = nbytes
    return tracker.param_bytes, peak


def _unique_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def _measure_peak_cuda(fn, inputs, persistent_io, params) -> tuple[int, int]:  # noqa: ANN001
    device = inputs[0].device
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        out = fn(*inputs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
    resident = _unique_bytes(list(inputs) + list(persistent_io))
    return _unique_bytes(params), peak + resident


def measure(
    model: nn.Module,
    optimized: Any,
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    repeats: int = 5,
    warmup: int = 1,
) -> ProfileResult:
    """Measure ``model`` and ``optimized`` (its ``OptimizedModule``) on ``inputs``:
    parameter bytes, peak I/O bytes, peak total bytes, median latency over ``repeats``
    calls, and per-step time and bytes of the optimized plan.

    Both models run under ``torch.no_grad()``; the peaks are measured on a warm call (plans
    built).
    """
    inputs = _as_tuple(inputs)
    device = inputs[0].device if inputs else torch.device("cpu")
    with torch.no_grad():
        for _ in range(max(warmup, 1)):
            model(*inputs)
            optimized(*inputs)
    model_params = list(model.parameters()) + list(model.buffers())
    o_param, o_peak = measure_peak(model, inputs, params=model_params)
    plan = optimized.plan if optimized._fallback_reason is None else None
    arena = plan.arenas() if plan is not None else []
    plan_params = plan.param_tensors() if plan is not None else []
    p_param, p_peak = measure_peak(
        optimized,
        inputs,
        persistent_io=arena,
        params=plan_params or model_params,
        held=plan.held_tensors() if plan is not None else (),
    )
    o_lat = _latency_ms(model, inputs, repeats, device)
    p_lat = _latency_ms(optimized, inputs, repeats, device)
    input_bytes = _unique_bytes(inputs)
    groups: list[GroupProfile] = []
    notes: list[str] = []
    planned = None
    arena_bytes = 0
    if plan is not None:
        with torch.no_grad():
            times = plan.step_times(inputs, max(1, min(repeats, 3)))
        graph = plan.graph
        notes.extend(plan.notes)
        extra: dict[str, int] = {}
        for r in optimized.report().rows:
            if r.extra_bytes:
                extra[r.algorithm] = extra.get(r.algorithm, 0) + r.extra_bytes
        if extra:
            notes.append(
                "algorithms' extra parameter and workspace memory (in the optimized "
                f"parameter and peak I/O figures): {sum(extra.values()) / MIB:.2f} MiB ("
                + ", ".join(f"{a} {b / MIB:.2f}" for a, b in sorted(extra.items()))
                + ")"
            )
        rows = zip(plan.steps, times, plan.step_placements(), plan.step_out_bytes(), strict=True)
        for st, ms, place, nbytes in rows:
            groups.append(
                GroupProfile(
                    step=st.name,
                    runs_as=st.runs_as,
                    nodes=st.nodes,
                    ops=tuple(graph.node(n).op for n in st.nodes),
                    time_ms=ms,
                    out_bytes=nbytes,
                    placement=place,
                )
            )
        planned, arena_bytes = plan.predicted_peak_io(), plan.arena_bytes
        if planned is not None:
            gap = abs(p_peak - planned) / max(planned, 1)
            if gap > PLAN_TOLERANCE:
                msg = (
                    f"note: measured optimized peak I/O {p_peak / MIB:.2f} MiB differs from the "
                    f"buffer plan's prediction {planned / MIB:.2f} MiB by {gap:.0%} (tolerance "
                    f"{PLAN_TOLERANCE:.0%}): framework calls allocate memory the plan does not see"
                )
                notes.append(msg)
                warnings.warn(msg, stacklevel=2)
    else:
        notes.append("note: the optimized model runs as the original PyTorch model (fallback)")
    method = (
        "torch.cuda memory statistics"
        if device.type == "cuda"
        else "live-storage tracking (TorchDispatchMode)"
    )
    return ProfileResult(
        original=ModelProfile(o_param, o_peak, o_lat, input_bytes),
        optimized=ModelProfile(p_param, p_peak, p_lat, input_bytes),
        groups=tuple(groups),
        device=str(device),
        method=method,
        planned_peak_io_bytes=planned,
        arena_bytes=arena_bytes,
        notes=tuple(notes),
    )


# ------------------------------------------------------------------ training steps
def training_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """One training step of ``model`` as the profiler times it: forward, a mean-square loss
    over every floating output, backward, the optimizer's step, gradients dropped."""

    def step(*inputs: torch.Tensor) -> float:
        out = model(*inputs)
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        loss = sum(t.float().square().mean() for t in leaves if t.is_floating_point())
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def step_peak(step: Any, inputs: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(parameter bytes, peak I/O bytes) of one training step; gradients and activations
    kept for the backward pass are I/O, the weights and optimizer state parameters."""
    device = inputs[0].device if inputs else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(*inputs)
        torch.cuda.synchronize(device)
        return base, torch.cuda.max_memory_allocated(device) - base
    tracker = LiveStorageTracker()
    tracker.add_io(list(inputs))
    with tracker:
        step(*inputs)
    return tracker.param_bytes, tracker.peak_io


def _step_ms(step: Any, inputs: Sequence[torch.Tensor], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    step(*inputs)
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def measure_training(
    model: nn.Module,
    optimized: Any,
    inputs: Sequence[torch.Tensor] | torch.Tensor,
    repeats: int = 5,
    warmup: int = 1,
) -> ProfileResult:
    """Time and peak memory of one training step (forward, backward, SGD-with-momentum
    step) of ``model`` and of ``optimized`` (an ``OptimizedModule`` of it), side by side.

    Both run on copies in training mode (the caller's weights are not trained); the steps
    alternate, model then optimized, ``repeats`` times after ``warmup`` steps each (the
    optimizer's momentum buffers exist by then and count as parameter memory)."""
    inputs = _as_tuple(inputs)
    device = inputs[0].device if inputs else torch.device("cpu")
    eager = copy.deepcopy(model).train()
    mine = copy.deepcopy(optimized).train()
    steps = []
    for net in (eager, mine):
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        steps.append(training_step(net, opt))
    for _ in range(max(warmup, 1)):
        for step in steps:
            step(*inputs)
    peaks = [step_peak(step, inputs) for step in steps]
    times: list[list[float]] = [[], []]
    for _ in range(repeats):
        for k, step in enumerate(steps):
            times[k].append(_step_ms(step, inputs, device))
    input_bytes = _unique_bytes(inputs)
    plan = mine.plan
    notes = []
    if plan is None:
        notes.append("note: the optimized model trains as the original PyTorch model (fallback)")
    method = "one training step: forward, backward, SGD step; " + (
        "torch.cuda memory statistics" if device.type == "cuda" else "live-storage tracking"
    )
    return ProfileResult(
        original=ModelProfile(*peaks[0], statistics.median(times[0]), input_bytes),
        optimized=ModelProfile(*peaks[1], statistics.median(times[1]), input_bytes),
        groups=(),
        device=str(device),
        method=method,
        notes=tuple(notes),
    )
